//! [`Buffer`]: the bytes a collective writes, owned by the rank or lent by
//! its caller (a PyTorch tensor's storage), so a binding's tensors are
//! reduced where they lie instead of copied in and out.

use std::any::Any;
use std::fmt;
use std::ops::{Deref, DerefMut};

use bytes::Bytes;

/// A collective's output: a `Vec` of its own, or memory the caller keeps
/// alive through an owner held until the buffer is dropped.
pub struct Buffer(Storage);

enum Storage {
    Owned(Vec<u8>),
    External {
        ptr: *mut u8,
        len: usize,
        /// Keeps the memory alive; dropped with the buffer, never read.
        _owner: Box<dyn Any + Send>,
    },
}

// SAFETY: an external buffer is exclusively this value's for its lifetime
// (`from_raw_parts`' contract) and its owner is `Send`; the bytes are plain
// memory that any thread may read and write.
unsafe impl Send for Buffer {}
// SAFETY: shared access only reads, through `&[u8]`.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// A buffer over `len` bytes at `ptr` that belong to someone else:
    /// `owner` keeps them alive and is dropped with the buffer.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes (or `len`
    /// must be 0) until `owner` is dropped, and nothing else may read or
    /// write those bytes while the buffer lives.
    pub unsafe fn from_raw_parts(ptr: *mut u8, len: usize, owner: Box<dyn Any + Send>) -> Self {
        Self(Storage::External {
            ptr,
            len,
            _owner: owner,
        })
    }

    /// Whether the bytes belong to the caller (not copied into a `Vec`).
    pub fn is_external(&self) -> bool {
        matches!(self.0, Storage::External { .. })
    }

    /// The bytes as a read-only [`Bytes`], without a copy either way.
    pub fn into_shared(self) -> Bytes {
        match self.0 {
            Storage::Owned(bytes) => Bytes::from(bytes),
            Storage::External { .. } => Bytes::from_owner(self),
        }
    }

    /// The bytes as a `Vec`: the same allocation when owned, a copy when
    /// external (whose memory then goes back to its owner).
    pub fn into_vec(self) -> Vec<u8> {
        match self.0 {
            Storage::Owned(bytes) => bytes,
            Storage::External { .. } => self.to_vec(),
        }
    }
}

impl Default for Buffer {
    fn default() -> Self {
        Self(Storage::Owned(Vec::new()))
    }
}

impl From<Vec<u8>> for Buffer {
    fn from(bytes: Vec<u8>) -> Self {
        Self(Storage::Owned(bytes))
    }
}

impl Deref for Buffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match &self.0 {
            Storage::Owned(bytes) => bytes,
            Storage::External { len: 0, .. } => &[],
            // SAFETY: valid for `len` bytes and ours alone (`from_raw_parts`).
            Storage::External { ptr, len, .. } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

impl DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        match &mut self.0 {
            Storage::Owned(bytes) => bytes,
            Storage::External { len: 0, .. } => &mut [],
            // SAFETY: as in `deref`, and `&mut self` makes this the only view.
            Storage::External { ptr, len, .. } => unsafe { std::slice::from_raw_parts_mut(*ptr, *len) },
        }
    }
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

/// A copy is always owned.
impl Clone for Buffer {
    fn clone(&self) -> Self {
        Self::from(self.to_vec())
    }
}

impl PartialEq for Buffer {
    fn eq(&self, other: &Self) -> bool {
        self[..] == other[..]
    }
}

impl Eq for Buffer {}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.is_external() { "external" } else { "owned" };
        write!(f, "Buffer({} bytes, {kind})", self.len())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn external_bytes_are_written_in_place_and_released_with_the_buffer() {
        let mut memory = vec![1u8, 2, 3, 4];
        let dropped = Arc::new(AtomicBool::new(false));
        // SAFETY: `memory` outlives the buffer and is not touched meanwhile.
        let mut buffer =
            unsafe { Buffer::from_raw_parts(memory.as_mut_ptr(), memory.len(), Box::new(Flag(dropped.clone()))) };
        assert!(buffer.is_external());
        buffer[1..3].copy_from_slice(&[9, 9]);
        let copy = buffer.clone();
        assert!(!copy.is_external());
        assert_eq!(copy, buffer);
        drop(buffer);
        assert!(dropped.load(Ordering::SeqCst));
        assert_eq!(memory, [1, 9, 9, 4]);
        assert_eq!(copy.into_vec(), [1, 9, 9, 4]);
    }

    #[test]
    fn shared_external_bytes_are_not_copied() {
        let mut memory = vec![5u8; 64];
        let ptr = memory.as_mut_ptr();
        // SAFETY: `memory` outlives the bytes and is not touched meanwhile.
        let shared = unsafe { Buffer::from_raw_parts(ptr, memory.len(), Box::new(())) }.into_shared();
        assert_eq!(shared.as_ptr(), ptr.cast_const());
        assert_eq!(shared.len(), 64);
    }

    #[test]
    fn an_empty_external_buffer_needs_no_valid_pointer() {
        // SAFETY: zero bytes are never read.
        let buffer = unsafe { Buffer::from_raw_parts(std::ptr::null_mut(), 0, Box::new(())) };
        assert!(buffer.is_empty());
        assert_eq!(format!("{buffer:?}"), "Buffer(0 bytes, external)");
    }
}
