//! chorus-lab: the tools that measure and shake chorus, behind the `chorus`
//! binary's `bench`, `chaos`, `netem` and `selftest` commands (the binary
//! is `chorus-cli`, which ships the launcher and builds on this crate).
//!
//! # Layout
//! - [`bench`](mod@bench): `chorus bench` measurements, each against the
//!   peer it must beat in the same run (Gloo, PyTorch's DDP, torchft).
//! - [`chaos`]: `chorus chaos`, a training job under random faults from a
//!   seed (across simulated hosts with network faults too, `--hosts`),
//!   checked against its fault-free run (also for tests: [`chaos::run`]).
//! - [`netem`]: `chorus netem`, a userspace link impairer (loss, delay,
//!   jitter, rate) between two interfaces, for tests across namespaces.
//! - [`selftest`]: every collective against a naive reference, run by every
//!   rank (`chorus selftest`).
//!
//! What this crate shares with the launcher (NUMA binding, random job
//! secrets, signals, reading a job from its store) lives in the `chorus`
//! library below both, so no arrow points back up to `chorus-cli`.

pub mod bench;
pub mod chaos;
pub mod netem;
pub mod selftest;
