//! chorus-cli: the `chorus` command line, and the library behind the
//! commands a user ships with (`launch`, `dashboard`, `store`, `trace`),
//! built on the [`chorus`] library (which an embedding service uses alone).
//! The lab's commands (`bench`, `chaos`, `netem`, `selftest`) are the
//! `chorus-lab` crate's; this crate's binary dispatches to them.
//!
//! # Layout
//! - [`launch`]: `chorus launch`, a torchrun-compatible launcher.
//! - [`dashboard`]: the live page of a running job (`chorus launch
//!   --dashboard`, `chorus dashboard`), read from the job's store, with
//!   fault injection for a holder of the job secret.
//! - [`logging`]: the command's and the examples' log output.
//! - [`trace`]: `chorus trace DIR`, printing the report of
//!   [`chorus::trace`] (which reads and compares the ranks' flight-recorder
//!   dumps).
//! - `src/main.rs`: the `chorus` command line (`hello`, `launch`, `store ...`,
//!   the lab's commands, and the hidden probes the tests run).

pub mod dashboard;
pub mod launch;
pub mod logging;
pub mod trace;
