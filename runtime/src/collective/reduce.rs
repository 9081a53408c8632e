//! Reduction kernels over raw byte buffers: `dst = op(dst, src)`, element by
//! element.
//!
//! Buffers arrive as bytes (frames off the wire, pooled scratch), so they may
//! be misaligned for their dtype. Aligned buffers are reinterpreted in place
//! (`bytemuck::try_cast_slice`) and combined by a plain zip loop, which the
//! compiler vectorizes; misaligned ones are combined in chunks copied through
//! an aligned stack buffer. Neither path uses `unsafe` or panics.
//!
//! # Precision of float16 and bfloat16
//!
//! Each combine converts both operands to `f32`, combines there and rounds
//! back once. Keeping an `f32` accumulator across the steps of a collective
//! would round only once in total, but would double the bytes on the wire and
//! in scratch, and the ring's partial sums travel between ranks; like NCCL,
//! chorus rounds once per combine, so a sum over `P` ranks carries up to
//! `P - 1` roundings (about `P * 2^-11` relative error for float16,
//! `P * 2^-8` for bfloat16). [`finalize_avg`] divides in `f32` and rounds once.

use std::convert::Infallible;

use bytemuck::Pod;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use thiserror::Error;

use super::dtype::{DType, ReduceOp};

/// Elements per chunk on the misaligned and half-precision paths: 4 KiB of
/// `f64`, small enough for the stack, large enough to vectorize.
const CHUNK: usize = 512;

/// Errors from the reduction kernels.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ReduceError {
    /// A bitwise operator on a floating-point dtype.
    #[error("reduce op {op} needs an integer dtype, not {dtype}")]
    Unsupported {
        /// The operator.
        op: ReduceOp,
        /// The dtype.
        dtype: DType,
    },
    /// The two buffers differ in length.
    #[error("cannot reduce {src} bytes into {dst} bytes; the buffers must have the same length")]
    LengthMismatch {
        /// Length of the destination, in bytes.
        dst: usize,
        /// Length of the source, in bytes.
        src: usize,
    },
    /// A buffer's length is not a whole number of elements.
    #[error("a buffer of {len} bytes is not a whole number of {dtype} elements ({size} bytes each)")]
    Ragged {
        /// Length of the buffer, in bytes.
        len: usize,
        /// The dtype.
        dtype: DType,
        /// Size of one element, in bytes.
        size: usize,
    },
    /// [`finalize_avg`] with a world size of zero.
    #[error("cannot average over a world of 0 ranks")]
    EmptyWorld,
}

/// Dispatches an integer operator to `$run` (applied over the buffers)
/// with a closure the compiler can inline into the loop.
macro_rules! int_op {
    ($t:ty, $op:expr, $run:ident, $($buf:expr),+) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => $run::<$t>($($buf),+, |a, b| a.wrapping_add(b)),
            ReduceOp::Prod => $run::<$t>($($buf),+, |a, b| a.wrapping_mul(b)),
            ReduceOp::Min => $run::<$t>($($buf),+, |a, b| a.min(b)),
            ReduceOp::Max => $run::<$t>($($buf),+, |a, b| a.max(b)),
            ReduceOp::BAnd => $run::<$t>($($buf),+, |a, b| a & b),
            ReduceOp::BOr => $run::<$t>($($buf),+, |a, b| a | b),
            ReduceOp::BXor => $run::<$t>($($buf),+, |a, b| a ^ b),
        }
    };
}
/// Dispatches a float operator (computed in `$acc`) to `$run`, which applies
/// it over the buffers. Bitwise operators were rejected before.
macro_rules! float_op {
    ($acc:ty, $op:expr, $run:path, $($buf:expr),+) => {{
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => $run($($buf),+, |a: $acc, b: $acc| a + b),
            ReduceOp::Prod => $run($($buf),+, |a: $acc, b: $acc| a * b),
            // NaN-propagating (torch.minimum); written as selects so it vectorizes.
            ReduceOp::Min => $run($($buf),+, |a: $acc, b: $acc| if b.is_nan() || b < a { b } else { a }),
            ReduceOp::Max => $run($($buf),+, |a: $acc, b: $acc| if b.is_nan() || b > a { b } else { a }),
            ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => {}
        }
    }};
}
/// Combines `src` into `dst` element by element: `dst[i] = op(dst[i], src[i])`.
///
/// Both are raw bytes of `dtype` elements in native byte order, of equal
/// length, with any alignment. [`ReduceOp::Avg`] combines as a sum; divide
/// the final result with [`finalize_avg`].
pub fn reduce_into(op: ReduceOp, dtype: DType, dst: &mut [u8], src: &[u8]) -> Result<(), ReduceError> {
    if !op.supports(dtype) {
        return Err(ReduceError::Unsupported { op, dtype });
    }
    if dst.len() != src.len() {
        return Err(ReduceError::LengthMismatch {
            dst: dst.len(),
            src: src.len(),
        });
    }
    check_whole(dtype, dst.len())?;
    match dtype {
        DType::Int8 => int_op!(i8, op, combine, dst, src),
        DType::UInt8 => int_op!(u8, op, combine, dst, src),
        DType::Int32 => int_op!(i32, op, combine, dst, src),
        DType::UInt32 => int_op!(u32, op, combine, dst, src),
        DType::Int64 => int_op!(i64, op, combine, dst, src),
        DType::UInt64 => int_op!(u64, op, combine, dst, src),
        DType::Float32 => float_op!(f32, op, combine::<f32>, dst, src),
        DType::Float64 => float_op!(f64, op, combine::<f64>, dst, src),
        DType::Float16 => float_op!(f32, op, combine_half::<f16>, dst, src),
        DType::BFloat16 => float_op!(f32, op, combine_half::<bf16>, dst, src),
    }
    Ok(())
}

/// [`reduce_into`] with `op`, then, for [`ReduceOp::Avg`], [`finalize_avg`]
/// over `dst`: the combine that completes a region of an average. For
/// `f32` and `f64` both happen in one pass (the same sum and division,
/// so the same result).
pub fn reduce_complete_into(
    op: ReduceOp,
    dtype: DType,
    dst: &mut [u8],
    src: &[u8],
    world: usize,
) -> Result<(), ReduceError> {
    if op != ReduceOp::Avg {
        return reduce_into(op, dtype, dst, src);
    }
    if world == 0 {
        return Err(ReduceError::EmptyWorld);
    }
    if dst.len() == src.len() {
        match dtype {
            DType::Float32 => {
                if let (Ok(d), Ok(s)) = (bytemuck::try_cast_slice_mut(dst), bytemuck::try_cast_slice(src)) {
                    let w = world as f32;
                    zip_with(d, s, |a: f32, b| (a + b) / w);
                    return Ok(());
                }
            }
            DType::Float64 => {
                if let (Ok(d), Ok(s)) = (bytemuck::try_cast_slice_mut(dst), bytemuck::try_cast_slice(src)) {
                    let w = world as f64;
                    zip_with(d, s, |a: f64, b| (a + b) / w);
                    return Ok(());
                }
            }
            _ => {}
        }
    }
    reduce_into(op, dtype, dst, src)?;
    finalize_avg(dtype, dst, world)
}

/// Bytes per piece of [`reduce_from`]: a piece copied in is still in the
/// L1 cache when it is reduced, so the copy costs no pass over memory.
const FROM_PIECE: usize = 16 << 10;

/// `dst = op(own, src)` element by element: [`reduce_into`] with this
/// rank's values in `own` rather than in `dst` (an out-of-place plan's
/// first write of a region). One pass over the three buffers where they
/// are aligned for `dtype` and it is not a half-precision type, else
/// `own` is copied into `dst` a piece at a time and `src` combined in.
pub fn reduce_from(op: ReduceOp, dtype: DType, dst: &mut [u8], own: &[u8], src: &[u8]) -> Result<(), ReduceError> {
    check_from(op, dtype, dst, own, src)?;
    match dtype {
        DType::Int8 => int_op!(i8, op, combine_from, dst, own, src),
        DType::UInt8 => int_op!(u8, op, combine_from, dst, own, src),
        DType::Int32 => int_op!(i32, op, combine_from, dst, own, src),
        DType::UInt32 => int_op!(u32, op, combine_from, dst, own, src),
        DType::Int64 => int_op!(i64, op, combine_from, dst, own, src),
        DType::UInt64 => int_op!(u64, op, combine_from, dst, own, src),
        DType::Float32 => float_op!(f32, op, combine_from::<f32>, dst, own, src),
        DType::Float64 => float_op!(f64, op, combine_from::<f64>, dst, own, src),
        DType::Float16 | DType::BFloat16 => in_pieces(dst, own, src, |d, s| reduce_into(op, dtype, d, s))?,
    }
    Ok(())
}

/// [`reduce_complete_into`] with this rank's values in `own`, as
/// [`reduce_from`].
pub fn reduce_complete_from(
    op: ReduceOp,
    dtype: DType,
    dst: &mut [u8],
    own: &[u8],
    src: &[u8],
    world: usize,
) -> Result<(), ReduceError> {
    if op != ReduceOp::Avg {
        return reduce_from(op, dtype, dst, own, src);
    }
    if world == 0 {
        return Err(ReduceError::EmptyWorld);
    }
    check_from(op, dtype, dst, own, src)?;
    // One pass for `f32` and `f64`, as in `reduce_complete_into`.
    match dtype {
        DType::Float32 => {
            let w = world as f32;
            combine_from::<f32>(dst, own, src, move |a, b| (a + b) / w);
        }
        DType::Float64 => {
            let w = world as f64;
            combine_from::<f64>(dst, own, src, move |a, b| (a + b) / w);
        }
        _ => in_pieces(dst, own, src, |d, s| reduce_complete_into(op, dtype, d, s, world))?,
    }
    Ok(())
}

/// What [`reduce_from`] and [`reduce_complete_from`] need of their
/// arguments: an operator `dtype` supports and three buffers of one length
/// in whole elements.
fn check_from(op: ReduceOp, dtype: DType, dst: &[u8], own: &[u8], src: &[u8]) -> Result<(), ReduceError> {
    if !op.supports(dtype) {
        return Err(ReduceError::Unsupported { op, dtype });
    }
    for other in [own, src] {
        if other.len() != dst.len() {
            return Err(ReduceError::LengthMismatch {
                dst: dst.len(),
                src: other.len(),
            });
        }
    }
    check_whole(dtype, dst.len())
}

/// Copies `own` into `dst` (the caller checked they and `src` are of one
/// length) and combines `src` into it with `combine`, one
/// [`FROM_PIECE`] at a time.
fn in_pieces<E>(
    dst: &mut [u8],
    own: &[u8],
    src: &[u8],
    mut combine: impl FnMut(&mut [u8], &[u8]) -> Result<(), E>,
) -> Result<(), E> {
    let pieces = dst
        .chunks_mut(FROM_PIECE)
        .zip(own.chunks(FROM_PIECE))
        .zip(src.chunks(FROM_PIECE));
    for ((dst, own), src) in pieces {
        dst.copy_from_slice(own);
        combine(dst, src)?;
    }
    Ok(())
}

/// Divides every element of `buf` by `world`: the last step of
/// [`ReduceOp::Avg`], on the fully summed result.
///
/// Integers truncate toward zero (NCCL's integer `ncclAvg`); floats divide in
/// `f32`/`f64` (float16 and bfloat16 through `f32`) and round once.
pub fn finalize_avg(dtype: DType, buf: &mut [u8], world: usize) -> Result<(), ReduceError> {
    if world == 0 {
        return Err(ReduceError::EmptyWorld);
    }
    check_whole(dtype, buf.len())?;
    // Dividing in a wider type keeps `world` exact: it may not fit `i8`.
    match dtype {
        DType::Int8 => map::<i8>(buf, |x| (i64::from(x) / wide_i(world)) as i8),
        DType::UInt8 => map::<u8>(buf, |x| (u64::from(x) / wide_u(world)) as u8),
        DType::Int32 => map::<i32>(buf, |x| (i64::from(x) / wide_i(world)) as i32),
        DType::UInt32 => map::<u32>(buf, |x| (u64::from(x) / wide_u(world)) as u32),
        DType::Int64 => map::<i64>(buf, |x| (i128::from(x) / i128::from(wide_i(world))) as i64),
        DType::UInt64 => map::<u64>(buf, |x| x / wide_u(world)),
        DType::Float32 => map::<f32>(buf, |x| x / world as f32),
        DType::Float64 => map::<f64>(buf, |x| x / world as f64),
        DType::Float16 => map::<f16>(buf, |x| f16::from_f32(x.to_f32() / world as f32)),
        DType::BFloat16 => map::<bf16>(buf, |x| bf16::from_f32(x.to_f32() / world as f32)),
    }
    Ok(())
}

/// `world` as `i64`, saturating (a world cannot reach `i64::MAX` ranks).
fn wide_i(world: usize) -> i64 {
    i64::try_from(world).unwrap_or(i64::MAX)
}

/// `world` as `u64`, saturating.
fn wide_u(world: usize) -> u64 {
    u64::try_from(world).unwrap_or(u64::MAX)
}

fn check_whole(dtype: DType, len: usize) -> Result<(), ReduceError> {
    let size = dtype.size();
    if len.is_multiple_of(size) {
        Ok(())
    } else {
        Err(ReduceError::Ragged { len, dtype, size })
    }
}

/// `dst[i] = f(dst[i], src[i])` over equal-length byte buffers of `T`.
#[inline(always)]
fn combine<T: Pod>(dst: &mut [u8], src: &[u8], f: impl Fn(T, T) -> T + Copy) {
    if let (Ok(d), Ok(s)) = (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        bytemuck::try_cast_slice::<u8, T>(src),
    ) {
        zip_with(d, s, f);
        return;
    }
    let size = size_of::<T>();
    let mut a = [T::zeroed(); CHUNK];
    let mut b = [T::zeroed(); CHUNK];
    for (dc, sc) in dst.chunks_mut(CHUNK * size).zip(src.chunks(CHUNK * size)) {
        let n = dc.len() / size;
        let (a, b) = (&mut a[..n], &mut b[..n]);
        bytemuck::cast_slice_mut::<T, u8>(a).copy_from_slice(dc);
        bytemuck::cast_slice_mut::<T, u8>(b).copy_from_slice(sc);
        zip_with(a, b, f);
        dc.copy_from_slice(bytemuck::cast_slice::<T, u8>(a));
    }
}

/// `dst[i] = f(own[i], src[i])` in one pass when all three are aligned for
/// `T`; otherwise `own` is copied into `dst` a piece at a time and `src`
/// combined into it ([`combine`]).
fn combine_from<T: Pod>(dst: &mut [u8], own: &[u8], src: &[u8], f: impl Fn(T, T) -> T + Copy) {
    if let (Ok(d), Ok(a), Ok(b)) = (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        bytemuck::try_cast_slice::<u8, T>(own),
        bytemuck::try_cast_slice::<u8, T>(src),
    ) {
        for ((d, a), b) in d.iter_mut().zip(a).zip(b) {
            *d = f(*a, *b);
        }
        return;
    }
    let Ok(()) = in_pieces::<Infallible>(dst, own, src, |d, s| {
        combine::<T>(d, s, f);
        Ok(())
    });
}

/// The loop every path ends in: simple enough for the auto-vectorizer.
#[inline(always)]
fn zip_with<T: Copy>(dst: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f(*d, *s);
    }
}

/// Half-precision elements that convert to and from `f32` in bulk (F16C on
/// x86 where available).
trait Half: Pod {
    fn to_f32s(src: &[Self], dst: &mut [f32]);
    fn from_f32s(src: &[f32], dst: &mut [Self]);
}

impl Half for f16 {
    fn to_f32s(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn from_f32s(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

// By hand rather than through `half`, whose bfloat16 slice conversions go
// element by element through a function call (about 1 GB/s); these are plain
// integer loops that vectorize.
impl Half for bf16 {
    #[inline(always)]
    fn to_f32s(src: &[Self], dst: &mut [f32]) {
        // bfloat16 is the top half of an f32.
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }
    #[inline(always)]
    fn from_f32s(src: &[f32], dst: &mut [Self]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = bf16::from_bits(round_to_bf16(*s));
        }
    }
}

/// `x` rounded to nearest bfloat16, ties to even; NaN stays NaN (quieted),
/// as `bf16::from_f32` does.
#[inline(always)]
fn round_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        ((bits >> 16) | 0x0040) as u16
    } else {
        // Cannot overflow: the largest non-NaN pattern is 0xff80_0000.
        ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
    }
}

/// `dst[i] = round(f(f32(dst[i]), f32(src[i])))` for half-precision `H`, in
/// chunks through aligned stack buffers (the conversion needs a copy anyway).
#[inline(always)]
fn combine_half<H: Half>(dst: &mut [u8], src: &[u8], f: impl Fn(f32, f32) -> f32 + Copy) {
    let mut h = [H::zeroed(); CHUNK];
    let mut a = [0f32; CHUNK];
    let mut b = [0f32; CHUNK];
    for (dc, sc) in dst.chunks_mut(CHUNK * 2).zip(src.chunks(CHUNK * 2)) {
        let n = dc.len() / 2;
        let (h, a, b) = (&mut h[..n], &mut a[..n], &mut b[..n]);
        bytemuck::cast_slice_mut::<H, u8>(h).copy_from_slice(dc);
        H::to_f32s(h, a);
        bytemuck::cast_slice_mut::<H, u8>(h).copy_from_slice(sc);
        H::to_f32s(h, b);
        zip_with(a, b, f);
        H::from_f32s(a, h);
        dc.copy_from_slice(bytemuck::cast_slice::<H, u8>(h));
    }
}

/// `buf[i] = f(buf[i])` over a byte buffer of `T`, with any alignment.
fn map<T: Pod>(buf: &mut [u8], f: impl Fn(T) -> T) {
    if let Ok(xs) = bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        xs.iter_mut().for_each(|x| *x = f(*x));
        return;
    }
    for chunk in buf.chunks_exact_mut(size_of::<T>()) {
        let x: T = bytemuck::pod_read_unaligned(chunk);
        chunk.copy_from_slice(bytemuck::bytes_of(&f(x)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::sim::encode;

    fn buffer(dtype: DType, values: &[i64]) -> Vec<u8> {
        values.iter().flat_map(|&v| encode(dtype, v)).collect()
    }

    #[test]
    fn reducing_from_an_input_equals_copying_it_then_reducing_across_pieces() {
        for dtype in DType::ALL {
            // Two pieces and a bit, so a piece boundary and a short tail occur.
            let n = FROM_PIECE / dtype.size() * 2 + 3;
            let len = n * dtype.size();
            // Each buffer at offset 0 (the one-pass path, for every dtype
            // but the half types) and at offset 1 (misaligned: in pieces).
            for at in [0, 1] {
                let padded = |values: Vec<u8>| [vec![0x77; at], values].concat();
                let own = padded(buffer(dtype, &(0..n).map(|i| (i % 7) as i64 - 3).collect::<Vec<_>>()));
                let src = padded(buffer(dtype, &(0..n).map(|i| (i % 5) as i64 - 2).collect::<Vec<_>>()));
                let (own, src) = (&own[at..], &src[at..]);
                for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(dtype)) {
                    let mut want = own.to_vec();
                    reduce_into(op, dtype, &mut want, src).unwrap();
                    let mut got = vec![0x5a; at + len];
                    reduce_from(op, dtype, &mut got[at..], own, src).unwrap();
                    assert_eq!(&got[at..], want, "{dtype} {op} at {at}");
                    let mut want = own.to_vec();
                    reduce_complete_into(op, dtype, &mut want, src, 3).unwrap();
                    let mut got = vec![0x5a; at + len];
                    reduce_complete_from(op, dtype, &mut got[at..], own, src, 3).unwrap();
                    assert_eq!(&got[at..], want, "{dtype} {op} completing at {at}");
                }
            }
        }
        let mut dst = [0u8; 8];
        assert_eq!(
            reduce_from(ReduceOp::Sum, DType::Float32, &mut dst, &[0; 4], &[0; 8]),
            Err(ReduceError::LengthMismatch { dst: 8, src: 4 })
        );
        assert_eq!(
            reduce_from(ReduceOp::BXor, DType::Float32, &mut dst, &[0; 8], &[0; 8]),
            Err(ReduceError::Unsupported {
                op: ReduceOp::BXor,
                dtype: DType::Float32
            })
        );
    }

    /// The scalar definition of each operator, in `i64` (exact for the small
    /// values used here, wrapping for the integer types via `encode`).
    fn scalar(op: ReduceOp, a: i64, b: i64) -> i64 {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => a + b,
            ReduceOp::Prod => a * b,
            ReduceOp::Min => a.min(b),
            ReduceOp::Max => a.max(b),
            ReduceOp::BAnd => a & b,
            ReduceOp::BOr => a | b,
            ReduceOp::BXor => a ^ b,
        }
    }

    #[test]
    fn every_dtype_and_op_matches_the_scalar_definition_aligned_or_not() {
        // Lengths cross the chunk boundary; values stay exact in bfloat16.
        let n = CHUNK + 37;
        // No zeros: a float product with zero may be -0, which encodes differently.
        let nonzero = |v: i64| if v == 0 { 1 } else { v };
        let a: Vec<i64> = (0..n as i64).map(|i| nonzero((i * 7) % 11 - 5)).collect();
        let b: Vec<i64> = (0..n as i64).map(|i| nonzero((i * 5) % 9 - 4)).collect();
        for dtype in DType::ALL {
            let signed = |v: i64| {
                if dtype.name().starts_with('u') { v + 5 } else { v }
            };
            let (a, b): (Vec<i64>, Vec<i64>) = (
                a.iter().map(|&v| signed(v)).collect(),
                b.iter().map(|&v| signed(v)).collect(),
            );
            for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(dtype)) {
                let want = buffer(
                    dtype,
                    &a.iter().zip(&b).map(|(&x, &y)| scalar(op, x, y)).collect::<Vec<_>>(),
                );
                for offset in [0, 1, 3] {
                    // Misalign dst and src differently.
                    let mut dst = vec![0u8; offset];
                    dst.extend(buffer(dtype, &a));
                    let mut src = vec![0u8; (offset + 1) % 4];
                    src.extend(buffer(dtype, &b));
                    let src_off = (offset + 1) % 4;
                    reduce_into(op, dtype, &mut dst[offset..], &src[src_off..]).unwrap();
                    assert!(dst[offset..] == want[..], "{dtype} {op} offset {offset}");
                }
            }
        }
    }

    #[test]
    fn a_completing_combine_equals_reduce_then_finalize_for_every_dtype() {
        let n = CHUNK + 37;
        let a: Vec<i64> = (0..n as i64).map(|i| (i * 7) % 11 + 1).collect();
        let b: Vec<i64> = (0..n as i64).map(|i| (i * 5) % 9 + 3).collect();
        for dtype in DType::ALL {
            for op in [ReduceOp::Avg, ReduceOp::Sum, ReduceOp::Max] {
                for offset in [0, 1] {
                    let mut want = buffer(dtype, &a);
                    reduce_into(op, dtype, &mut want, &buffer(dtype, &b)).unwrap();
                    if op == ReduceOp::Avg {
                        finalize_avg(dtype, &mut want, 3).unwrap();
                    }
                    let mut dst = vec![0u8; offset];
                    dst.extend(buffer(dtype, &a));
                    reduce_complete_into(op, dtype, &mut dst[offset..], &buffer(dtype, &b), 3).unwrap();
                    assert!(dst[offset..] == want[..], "{dtype} {op} offset {offset}");
                }
            }
        }
        let mut one = 1.0f32.to_ne_bytes().to_vec();
        assert_eq!(
            reduce_complete_into(ReduceOp::Avg, DType::Float32, &mut one, &[0; 4], 0),
            Err(ReduceError::EmptyWorld)
        );
    }

    #[test]
    fn integers_wrap_and_floats_propagate_nan() {
        let mut d = buffer(DType::Int8, &[127, -128]);
        reduce_into(ReduceOp::Sum, DType::Int8, &mut d, &buffer(DType::Int8, &[1, -1])).unwrap();
        assert_eq!(d, buffer(DType::Int8, &[-128, 127]));

        for op in [ReduceOp::Min, ReduceOp::Max] {
            for (x, y) in [(f32::NAN, 1.0), (1.0, f32::NAN)] {
                let mut d = x.to_ne_bytes().to_vec();
                reduce_into(op, DType::Float32, &mut d, &y.to_ne_bytes()).unwrap();
                assert!(f32::from_ne_bytes(d.try_into().unwrap()).is_nan(), "{op} {x} {y}");
            }
        }
    }

    #[test]
    fn half_precision_rounds_once_per_combine() {
        // 2048 + 1 is not representable in float16: rounds to even (2048).
        let mut d = f16::from_f32(2048.0).to_ne_bytes().to_vec();
        reduce_into(ReduceOp::Sum, DType::Float16, &mut d, &f16::from_f32(1.0).to_ne_bytes()).unwrap();
        assert_eq!(f16::from_ne_bytes([d[0], d[1]]).to_f32(), 2048.0);
        // 1.5 * 1.5 = 2.25 is exact in bfloat16.
        let mut d = bf16::from_f32(1.5).to_ne_bytes().to_vec();
        reduce_into(
            ReduceOp::Prod,
            DType::BFloat16,
            &mut d,
            &bf16::from_f32(1.5).to_ne_bytes(),
        )
        .unwrap();
        assert_eq!(bf16::from_ne_bytes([d[0], d[1]]).to_f32(), 2.25);
    }

    #[test]
    fn bfloat16_rounding_matches_half() {
        let specials = [
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            f32::MIN_POSITIVE,
        ];
        let sweep = (0..u32::MAX).step_by(65_521).map(f32::from_bits);
        for x in specials.into_iter().chain(sweep) {
            assert_eq!(
                round_to_bf16(x),
                bf16::from_f32(x).to_bits(),
                "{x} ({:#x})",
                x.to_bits()
            );
        }
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let mut d = vec![0u8; 8];
        assert_eq!(
            reduce_into(ReduceOp::BXor, DType::Float32, &mut d, &[0; 8]),
            Err(ReduceError::Unsupported {
                op: ReduceOp::BXor,
                dtype: DType::Float32
            })
        );
        assert_eq!(
            reduce_into(ReduceOp::Sum, DType::Float32, &mut d, &[0; 4]),
            Err(ReduceError::LengthMismatch { dst: 8, src: 4 })
        );
        assert!(matches!(
            reduce_into(ReduceOp::Sum, DType::Float64, &mut d[..6], &[0; 6]),
            Err(ReduceError::Ragged { len: 6, .. })
        ));
        assert_eq!(finalize_avg(DType::Int32, &mut d, 0), Err(ReduceError::EmptyWorld));
    }

    #[test]
    fn avg_truncates_integers_and_rounds_floats_once() {
        let mut d = buffer(DType::Int8, &[-7, 7, 127]);
        finalize_avg(DType::Int8, &mut d, 2).unwrap();
        assert_eq!(d, buffer(DType::Int8, &[-3, 3, 63]));
        let mut d = buffer(DType::UInt8, &[255, 200]);
        finalize_avg(DType::UInt8, &mut d, 300).unwrap();
        assert_eq!(d, buffer(DType::UInt8, &[0, 0]));
        let mut d = vec![0u8];
        d.extend(buffer(DType::Float64, &[7, -3]));
        finalize_avg(DType::Float64, &mut d[1..], 2).unwrap();
        assert_eq!(d[1..], [3.5f64.to_ne_bytes(), (-1.5f64).to_ne_bytes()].concat());
        let mut d = buffer(DType::BFloat16, &[3]);
        finalize_avg(DType::BFloat16, &mut d, 4).unwrap();
        assert_eq!(d, bf16::from_f32(0.75).to_ne_bytes());
    }
}
