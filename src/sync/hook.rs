//! Communication hooks: how one bucket of gradients becomes the average
//! over the ranks (PyTorch's `register_comm_hook`). [`Average`] is the
//! default; [`Compress`] sends half precision (PyTorch's
//! `fp16_compress_hook` / `bf16_compress_hook`). Write your own by
//! implementing [`CommHook`].

use std::future::Future;
use std::pin::Pin;

use chorus_actors::driver::CollectiveError;
use chorus_runtime::collective::{DType, ReduceOp};
use half::slice::HalfFloatSliceExt;
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
/// in the same order, so collectives submitted inside `reduce` line up
/// across ranks; a collective submitted later, from the future, could
/// interleave with other buckets' differently on each rank (a desync), so
/// a two-round scheme such as PowerSGD needs its second round ordered by
/// bucket, e.g. on a subgroup of its own awaited in bucket order.
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

/// Float types a bucket can hold and be compressed from (vectorized slice
/// conversions of `half`, hardware F16C where the CPU has it).
trait Wide: bytemuck::Pod {
    fn to_f16(src: &[Self], dst: &mut [f16]);
    fn to_bf16(src: &[Self], dst: &mut [bf16]);
    fn from_f16(src: &[f16], dst: &mut [Self]);
    fn from_bf16(src: &[bf16], dst: &mut [Self]);
    fn scale(values: &mut [Self], by: f64);
}

impl Wide for f32 {
    fn to_f16(src: &[Self], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src)
    }
    fn to_bf16(src: &[Self], dst: &mut [bf16]) {
        dst.convert_from_f32_slice(src)
    }
    fn from_f16(src: &[f16], dst: &mut [Self]) {
        src.convert_to_f32_slice(dst)
    }
    fn from_bf16(src: &[bf16], dst: &mut [Self]) {
        src.convert_to_f32_slice(dst)
    }
    fn scale(values: &mut [Self], by: f64) {
        values.iter_mut().for_each(|v| *v *= by as f32)
    }
}

impl Wide for f64 {
    fn to_f16(src: &[Self], dst: &mut [f16]) {
        dst.convert_from_f64_slice(src)
    }
    fn to_bf16(src: &[Self], dst: &mut [bf16]) {
        dst.convert_from_f64_slice(src)
    }
    fn from_f16(src: &[f16], dst: &mut [Self]) {
        src.convert_to_f64_slice(dst)
    }
    fn from_bf16(src: &[bf16], dst: &mut [Self]) {
        src.convert_to_f64_slice(dst)
    }
    fn scale(values: &mut [Self], by: f64) {
        values.iter_mut().for_each(|v| *v *= by)
    }
}

/// Runs `f` on `bytes` as `T`s: in place when aligned, through a copy when not.
fn with_elements<T: bytemuck::Pod, R>(bytes: &mut [u8], f: impl FnOnce(&mut [T]) -> R) -> R {
    match bytemuck::try_cast_slice_mut(bytes) {
        Ok(slice) => f(slice),
        Err(_) => {
            let mut copy: Vec<T> = bytemuck::pod_collect_to_vec(bytes);
            let out = f(&mut copy);
            bytes.copy_from_slice(bytemuck::cast_slice(&copy));
            out
        }
    }
}

/// Scales the bucket in place (it is overwritten by the result anyway) and
/// rounds it into a new half-precision tensor.
fn compress<T: Wide>(bytes: &mut [u8], to: DType, scale: f64) -> Tensor {
    with_elements::<T, _>(bytes, |wide| {
        T::scale(wide, scale);
        match to {
            DType::BFloat16 => {
                let mut halves = vec![bf16::ZERO; wide.len()];
                T::to_bf16(wide, &mut halves);
                Tensor::from_slice(&halves)
            }
            _ => {
                let mut halves = vec![f16::ZERO; wide.len()];
                T::to_f16(wide, &mut halves);
                Tensor::from_slice(&halves)
            }
        }
    })
}

/// Widens the summed halves in `sum` back into the bucket's bytes.
fn decompress<T: Wide>(bytes: &mut [u8], sum: &Tensor) {
    with_elements::<T, _>(bytes, |wide| match sum.dtype() {
        DType::BFloat16 => T::from_bf16(&elements(sum.as_bytes()), wide),
        _ => T::from_f16(&elements(sum.as_bytes()), wide),
    })
}

/// `bytes` as `T`s, borrowed when aligned, copied when not.
fn elements<T: bytemuck::Pod>(bytes: &[u8]) -> std::borrow::Cow<'_, [T]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(slice) => std::borrow::Cow::Borrowed(slice),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}

impl CommHook for Compress {
    fn reduce(&mut self, group: &ProcessGroup, bucket: BucketInfo, data: Tensor) -> HookFuture {
        // Dividing before rounding keeps the sum of halves in range.
        let scale = 1.0 / group.world_size() as f64;
        let wide = data.dtype();
        if !matches!(wide, DType::Float32 | DType::Float64) {
            return Average.reduce(group, bucket, data);
        }
        let mut bytes = data.into_bytes();
        let halves = match wide {
            DType::Float64 => compress::<f64>(&mut bytes, self.to, scale),
            _ => compress::<f32>(&mut bytes, self.to, scale),
        };
        let work = group.all_reduce(halves, ReduceOp::Sum);
        Box::pin(async move {
            let sum = work.await?;
            if sum.len() * wide.size() != bytes.len() {
                return Err(CollectiveError::Protocol {
                    peer: usize::MAX,
                    reason: format!(
                        "compressed all_reduce returned {} elements for {}",
                        sum.len(),
                        bytes.len() / wide.size()
                    ),
                });
            }
            match wide {
                DType::Float64 => decompress::<f64>(&mut bytes, &sum),
                _ => decompress::<f32>(&mut bytes, &sum),
            }
            Ok(Tensor::from_bytes(wide, bytes))
        })
    }
}
