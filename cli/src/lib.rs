//! chorus-cli: the `chorus` command line, and the library behind it, built
//! on the [`chorus`] library (which an embedding service uses alone).
//!
//! # Layout
//! - [`launch`]: `chorus launch`, a torchrun-compatible launcher.
//! - [`chaos`]: `chorus chaos`, a training job under random faults from a
//!   seed (across simulated hosts with network faults too, `--hosts`),
//!   checked against its fault-free run (also for tests: [`chaos::run`]).
//! - [`dashboard`]: the live page of a running job (`chorus launch
//!   --dashboard`, `chorus dashboard`), read from the job's store, with
//!   fault injection for a holder of the job secret.
//! - [`bench`](mod@bench): `chorus bench` measurements.
//! - [`selftest`]: every collective against a naive reference, run by every
//!   rank (`chorus selftest`).
//! - [`logging`]: the command's and the examples' log output.
//! - [`netem`]: `chorus netem`, a userspace link impairer (loss, delay,
//!   jitter, rate) between two interfaces, for tests across namespaces.
//! - [`trace`]: `chorus trace DIR`, printing the report of
//!   [`chorus::trace`] (which reads and compares the ranks' flight-recorder
//!   dumps).
//! - `src/main.rs`: the `chorus` command line (`hello`, `launch`, `store ...`,
//!   and the hidden probes the tests run).

pub mod bench;
pub mod chaos;
pub mod dashboard;
pub mod launch;
pub mod logging;
pub mod netem;
pub mod selftest;
pub mod trace;
