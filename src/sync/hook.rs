//! Communication hooks: how one bucket of gradients becomes the average
//! over the ranks (PyTorch's `register_comm_hook`). [`Average`] is the
//! default; [`Compress`] sends half precision (PyTorch's
//! `fp16_compress_hook` / `bf16_compress_hook`). Write your own by
//! implementing [`CommHook`].

use std::future::Future;
use std::pin::Pin;

use chorus_actors::driver::CollectiveError;
use chorus_runtime::collective::{DType, ReduceOp};
use half::{bf16, f16};

use crate::group::ProcessGroup;
use crate::tensor::Tensor;

/// A bucket's reduction in flight: resolves to the averaged bucket, of the
/// same dtype and length as the one handed in.
pub type HookFuture = Pin<Box<dyn Future<Output = Result<Tensor, CollectiveError>> + Send>>;

/// Which bucket a hook is reducing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketInfo {
    /// Its index in launch order.
    pub index: usize,
    /// How many buckets the step has.
    pub count: usize,
    /// The step (counting synced steps from 0).
    pub step: u64,
}

/// Turns one bucket into the average of every rank's bucket.
///
/// `reduce` is called on the rank's thread the moment the bucket is
/// complete: submit the collectives there (a [`ProcessGroup`] call returns
/// its `Work` at once and the rank's actor starts it), and return the
/// post-processing as the future. Every rank calls it for the same buckets
/// in the same order.
pub trait CommHook: Send + Sync {
    /// Reduces `data` (the bucket's storage, moved in without a copy).
    fn reduce(&mut self, group: &ProcessGroup, bucket: BucketInfo, data: Tensor) -> HookFuture;
}

/// The default hook: one all-reduce with [`ReduceOp::Avg`], in place.
#[derive(Debug, Clone, Copy, Default)]
pub struct Average;

impl CommHook for Average {
    fn reduce(&mut self, group: &ProcessGroup, _bucket: BucketInfo, data: Tensor) -> HookFuture {
        Box::pin(group.all_reduce(data, ReduceOp::Avg))
    }
}

/// Sends `f32`/`f64` buckets as `f16` or `bf16`: each rank divides by the
/// world size, rounds to half precision, the halves are summed, and the sum
/// is widened back into the bucket. Halves the traffic of `f32`; results
/// are exact to the half type's precision (f16: 11 significant bits and a
/// range up to 65504, bf16: 8 bits and `f32`'s range). Buckets of other
/// dtypes are averaged as they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compress {
    to: DType,
}

impl Compress {
    /// PyTorch's `fp16_compress_hook`.
    pub fn fp16() -> Self {
        Self { to: DType::Float16 }
    }

    /// PyTorch's `bf16_compress_hook`.
    pub fn bf16() -> Self {
        Self { to: DType::BFloat16 }
    }
}

/// Float types a bucket can hold and be compressed from.
trait Wide: bytemuck::Pod {
    fn to_f16(self) -> f16;
    fn to_bf16(self) -> bf16;
    fn from_f16(h: f16) -> Self;
    fn from_bf16(h: bf16) -> Self;
    fn scaled(self, by: f64) -> Self;
}

impl Wide for f32 {
    fn to_f16(self) -> f16 {
        f16::from_f32(self)
    }
    fn to_bf16(self) -> bf16 {
        bf16::from_f32(self)
    }
    fn from_f16(h: f16) -> Self {
        h.to_f32()
    }
    fn from_bf16(h: bf16) -> Self {
        h.to_f32()
    }
    fn scaled(self, by: f64) -> Self {
        self * by as f32
    }
}

impl Wide for f64 {
    fn to_f16(self) -> f16 {
        f16::from_f64(self)
    }
    fn to_bf16(self) -> bf16 {
        bf16::from_f64(self)
    }
    fn from_f16(h: f16) -> Self {
        h.to_f64()
    }
    fn from_bf16(h: bf16) -> Self {
        h.to_f64()
    }
    fn scaled(self, by: f64) -> Self {
        self * by
    }
}

/// `bytes` as `T`s, borrowed when aligned, copied when not.
fn elements<T: bytemuck::Pod>(bytes: &[u8]) -> std::borrow::Cow<'_, [T]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(slice) => std::borrow::Cow::Borrowed(slice),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}

fn compress<T: Wide>(data: &Tensor, to: DType, scale: f64) -> Tensor {
    let wide = elements::<T>(data.as_bytes());
    match to {
        DType::BFloat16 => Tensor::from_slice(&wide.iter().map(|x| x.scaled(scale).to_bf16()).collect::<Vec<_>>()),
        _ => Tensor::from_slice(&wide.iter().map(|x| x.scaled(scale).to_f16()).collect::<Vec<_>>()),
    }
}

/// Widens the summed halves in `sum` back into `data`'s buffer.
fn decompress<T: Wide>(data: Tensor, sum: &Tensor) -> Tensor {
    let dtype = data.dtype();
    let mut bytes = data.into_bytes();
    let out: Vec<T> = match sum.dtype() {
        DType::BFloat16 => elements::<bf16>(sum.as_bytes()).iter().map(|&h| T::from_bf16(h)).collect(),
        _ => elements::<f16>(sum.as_bytes()).iter().map(|&h| T::from_f16(h)).collect(),
    };
    bytes.copy_from_slice(bytemuck::cast_slice(&out));
    Tensor::from_bytes(dtype, bytes)
}

impl CommHook for Compress {
    fn reduce(&mut self, group: &ProcessGroup, bucket: BucketInfo, data: Tensor) -> HookFuture {
        // Dividing before rounding keeps the sum of halves in range.
        let scale = 1.0 / group.world_size() as f64;
        let wide = data.dtype();
        let halves = match wide {
            DType::Float32 => compress::<f32>(&data, self.to, scale),
            DType::Float64 => compress::<f64>(&data, self.to, scale),
            _ => return Average.reduce(group, bucket, data),
        };
        let work = group.all_reduce(halves, ReduceOp::Sum);
        Box::pin(async move {
            let sum = work.await?;
            Ok(match wide {
                DType::Float64 => decompress::<f64>(data, &sum),
                _ => decompress::<f32>(data, &sum),
            })
        })
    }
}
