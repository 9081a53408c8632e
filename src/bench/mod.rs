//! `chorus bench`: measurements printed the way people in this field read
//! them, next to the peer they must beat, measured in the same run.
//!
//! # Layout
//! - [`collective`]: `chorus bench --op ...`, the nccl-tests table for one
//!   collective over a sweep of sizes, with `--compare gloo` (PyTorch's Gloo
//!   in the same invocation, alternating per size), `--json` and `--plot`.
//! - [`plot`]: the `--plot` PNG (busbw against size).
//! - [`transport`]: throughput and round trip per transport path, against raw TCP.

pub mod collective;
pub mod plot;
pub mod transport;
