//! [`Tensor`]: a flat buffer of one dtype, the unit collectives take and
//! hand back (by ownership: no copy of the caller's buffer beyond what the
//! algorithm needs). Its bytes are its own, or memory a binding lends
//! ([`Tensor::from_raw_parts`]), reduced where it lies.

use std::any::Any;

use bytes::Bytes;
use chorus_actors::buffer::Buffer;
use chorus_runtime::collective::DType;
use half::{bf16, f16};
use thiserror::Error;

/// A Rust element type with a collective dtype.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// Its dtype.
    const DTYPE: DType;
}

macro_rules! elements {
    ($($t:ty => $d:ident),* $(,)?) => {
        $(impl Element for $t { const DTYPE: DType = DType::$d; })*
    };
}

elements!(i8 => Int8, u8 => UInt8, i32 => Int32, u32 => UInt32, i64 => Int64, u64 => UInt64,
    f16 => Float16, bf16 => BFloat16, f32 => Float32, f64 => Float64);

/// A tensor was used as the wrong type.
#[derive(Error, Clone, PartialEq, Eq)]
#[error("tensor holds {held}, not {asked}")]
pub struct DTypeMismatch {
    /// The tensor's dtype.
    pub held: DType,
    /// The dtype asked for.
    pub asked: DType,
}

chorus_runtime::debug_as_report!(DTypeMismatch);

/// A flat buffer of elements of one dtype.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    dtype: DType,
    bytes: Buffer,
}

impl Tensor {
    /// A tensor holding a copy of `values`.
    pub fn from_slice<T: Element>(values: &[T]) -> Self {
        Self {
            dtype: T::DTYPE,
            bytes: bytemuck::cast_slice(values).to_vec().into(),
        }
    }

    /// `count` zero elements of `dtype`.
    pub fn zeros(dtype: DType, count: usize) -> Self {
        Self {
            dtype,
            bytes: vec![0; count * dtype.size()].into(),
        }
    }

    /// A tensor over raw native-endian bytes of `dtype` (the length is
    /// rounded down to whole elements).
    pub fn from_bytes(dtype: DType, mut bytes: Vec<u8>) -> Self {
        bytes.truncate(bytes.len() / dtype.size() * dtype.size());
        Self {
            dtype,
            bytes: bytes.into(),
        }
    }

    /// A tensor over `len` bytes at `ptr` that stay where they are: a
    /// collective reads and writes them in place, and `owner` (which keeps
    /// them alive, e.g. a reference to a PyTorch tensor) is dropped with the
    /// last buffer made from them. `len` must be a whole number of elements.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, aligned for
    /// `dtype` (or `len` must be 0), until `owner` is dropped, and nothing
    /// else may read or write them meanwhile.
    pub unsafe fn from_raw_parts(dtype: DType, ptr: *mut u8, len: usize, owner: Box<dyn Any + Send>) -> Self {
        debug_assert_eq!(len % dtype.size(), 0, "a whole number of {dtype} elements");
        Self {
            dtype,
            // SAFETY: the caller's contract is the buffer's.
            bytes: unsafe { Buffer::from_raw_parts(ptr, len, owner) },
        }
    }

    /// A tensor over a collective's output buffer.
    pub fn from_buffer(dtype: DType, bytes: Buffer) -> Self {
        Self { dtype, bytes }
    }

    /// Its buffer, as a collective's output ([`Collective::output`]).
    ///
    /// [`Collective::output`]: crate::Collective::output
    pub fn into_buffer(self) -> Buffer {
        self.bytes
    }

    /// Its bytes as a collective's read-only input ([`Collective::input`]),
    /// without a copy.
    ///
    /// [`Collective::input`]: crate::Collective::input
    pub fn into_shared(self) -> Bytes {
        self.bytes.into_shared()
    }

    /// Its dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Its number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Its raw bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Its raw bytes, by value (a copy when they were lent through
    /// [`Tensor::from_raw_parts`]).
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes.into_vec()
    }

    /// A copy of its elements as `T`.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, DTypeMismatch> {
        if T::DTYPE != self.dtype {
            return Err(DTypeMismatch {
                held: self.dtype,
                asked: T::DTYPE,
            });
        }
        Ok(bytemuck::pod_collect_to_vec(&self.bytes[..]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_roundtrip_and_types_are_checked() {
        let t = Tensor::from_slice(&[1.5f64, -2.0]);
        assert_eq!((t.dtype(), t.len()), (DType::Float64, 2));
        assert_eq!(t.to_vec::<f64>().unwrap(), vec![1.5, -2.0]);
        assert!(t.to_vec::<f32>().is_err());
        let h = Tensor::from_slice(&[bf16::from_f32(3.0)]);
        assert_eq!(h.as_bytes().len(), 2);
        assert_eq!(Tensor::from_bytes(DType::Int32, vec![0; 7]).len(), 1);
    }
}
