//! `chorus bench`: measurements printed the way people in this field read
//! them, next to the peer they must beat, measured in the same run.
//!
//! # Layout
//! - [`collective`]: `chorus bench --op ...`, the nccl-tests table for one
//!   collective over a sweep of sizes, with `--compare gloo` (PyTorch's Gloo
//!   in the same invocation, alternating per size and `--rounds`), `--json`,
//!   `--memory` (peak resident memory) and `--plot`.
//! - [`common`]: what the benches share: [`common::median`] and
//!   [`common::Spread`], the torchrun environment of rank processes and
//!   their job secret, a Python peer's start-up (torch's version, its
//!   embedded script written out for the run).
//! - [`ddp`]: `chorus bench ddp`, gradient sync step time with and without
//!   sync on a 25M-parameter model, with `--compare torch` (PyTorch DDP, Gloo).
//! - [`measure`]: one rank's side of a measurement, which the sides and the
//!   sweep share: the collective, the timed calls, the check of the
//!   outputs, a rank's answer as a JSON line.
//! - [`memory`]: `chorus bench memory -- COMMAND`, a job's peak `/dev/shm`
//!   segments and its processes' summed peak resident memory.
//! - [`plot`]: the set-up every PNG the tools draw shares, and the `--plot`
//!   PNG (busbw against size).
//! - [`recovery`]: `chorus bench recovery`, the time an elastic group takes
//!   from the SIGKILL of a rank to its next successful collective.
//! - [`side`]: the sides a sweep alternates per size: rank processes
//!   answering JSON lines (`side::ProcessSide`, chorus's or a Python
//!   peer's) or in-process ranks (`side::InProcessSide`).
//! - [`scale`]: `chorus bench scale`, in-process ranks and the TCP store's
//!   rendezvous against the world size (time, peak memory).
//! - [`transfer`]: `chorus bench transfer`, live state transfer
//!   (`train::sync_state`) from S sources to a joiner, against the link's
//!   own throughput in the same group.
//! - [`transport`]: throughput and round trip per transport path, against raw TCP.
//! - [`tune`]: `chorus bench tune`, the all-reduce algorithms per transport
//!   across sizes and the measured switch points (`CHORUS_ALGO_THRESHOLDS`).

pub mod collective;
pub mod common;
pub mod ddp;
pub mod measure;
pub mod memory;
pub mod plot;
pub mod recovery;
pub mod scale;
pub mod side;
pub mod transfer;
pub mod transport;
pub mod tune;
