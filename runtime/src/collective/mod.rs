//! Collectives, sans IO: dtypes and reduction kernels, and each algorithm as
//! a pure per-rank schedule that any transport can drive.
//!
//! A driver turns one call (say an all-reduce of 1 MiB of float32 with sum)
//! into a [`Signature`] (sent with the first frame, compared by the
//! receiver), picks an [`Algorithm`] with [`choose_algorithm`], asks
//! [`Spec::plan`] for this rank's [`Plan`], and executes its steps by the
//! rules in [`plan`]: sends and receives of tagged frames, with
//! [`reduce_into`] for each received segment that reduces, and
//! [`finalize_avg`] at the end of an average.
//!
//! # Layout
//! - `dtype`: [`DType`] and [`ReduceOp`], with PyTorch's and nccl-tests'
//!   names.
//! - `reduce`: [`reduce_into`] and [`finalize_avg`], vectorizable kernels
//!   over byte buffers of any alignment.
//! - `copy`: [`copy_streaming`], a copy with non-temporal stores for
//!   collectives larger than the last-level cache ([`streaming_threshold`]).
//! - [`plan`]: the schedule representation ([`Plan`], [`Step`], [`Action`])
//!   and the builder that derives every step's dependencies from the ranges
//!   it touches.
//! - `schedule`: [`CollectiveKind`], [`Algorithm`], [`choose_algorithm`] with
//!   its [`Thresholds`] (`CHORUS_ALGO_THRESHOLDS`) and `CHORUS_ALGO` [`Overrides`], and [`Spec::plan`].
//! - `ring`, `doubling`, `tree`, `direct`: the algorithms (segmented
//!   pipelined rings; recursive doubling and halving-doubling with folding
//!   for non-powers of two; binomial trees; direct and pairwise exchanges and
//!   the dissemination barrier). `schedule` uses them; they use none of it
//!   nor each other.
//! - `segment`: how the algorithms cut buffers ([`MAX_SEGMENT_BYTES`],
//!   [`MIN_SEGMENTS_PER_CHUNK`], nearly equal parts); it uses no algorithm.
//! - `cache`: [`PlanCache`], a rank's plans kept for repeated calls.
//! - `signature`: [`Signature`], its 32-byte encoding, and mismatch reports
//!   for desync detection.
//! - `sim` (tests only): a reference executor running every rank's plan in
//!   memory, detecting deadlocks, unmatched messages and size mismatches.

mod cache;
mod copy;
mod direct;
mod doubling;
mod dtype;
pub mod plan;
mod reduce;
mod ring;
mod schedule;
mod segment;
mod signature;
mod tree;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod tests;

pub use cache::{PlanCache, PlanKey};
pub use copy::{STREAMING_MIN_COPY, STREAMING_THRESHOLD_ENV, copy_streaming, parse_cache_size, streaming_threshold};
pub use dtype::{DType, ParseError, ReduceOp};
pub use plan::{Action, Combine, Plan, Region, Step, StepId, Tag};
pub use reduce::{ReduceError, finalize_avg, reduce_complete_from, reduce_complete_into, reduce_from, reduce_into};
pub use schedule::{
    Algorithm, CollectiveKind, HALVING_DOUBLING_MAX_BYTES, MAX_BYTES, MAX_WORLD, Overrides, PlanError,
    RECURSIVE_DOUBLING_MAX_BYTES, SHARED_THREADS_TREE_MIN_WORLD, Spec, Thresholds, choose_algorithm,
};
pub use segment::{MAX_SEGMENT_BYTES, MIN_SEGMENTS_PER_CHUNK};
pub use signature::{ENCODED_LEN, Signature, SignatureError};
