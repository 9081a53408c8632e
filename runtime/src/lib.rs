//! chorus-runtime: the protocols and algorithms of chorus, with as little IO
//! as each allows.
//!
//! # Layout
//! - [`store`]: the [`Store`](store::Store) trait and its backends.
//!   `store::protocol` is the sans-IO codec of PyTorch's TCPStore wire
//!   protocol; `store::state` the key/value state machine every backend
//!   shares; `store::tcp` the server and client (thin tokio drivers);
//!   `store::file` the file store; `store::prefix` namespaces.
//! - [`rendezvous`]: from an init method (`tcp://`, `file://`, `env://`, or a
//!   store) and a launcher's environment (torchrun, Slurm, Open MPI, Kubeflow)
//!   to a validated membership: every rank's published [`PeerRecord`](rendezvous::PeerRecord),
//!   keyed by generation so elastic restarts re-run it.
//! - [`collective`]: collectives sans IO: dtypes, reduction kernels, each
//!   algorithm as a per-rank schedule of tagged sends and receives, and the
//!   signatures ranks compare to detect desync.
//! - [`codec`]: the one place that uses bincode (small control records only;
//!   tensor payloads are never serialized).
//! - [`flight`]: the flight recorder (each rank's last N operations in a
//!   bounded ring, sans IO) and its versioned dump format, read by
//!   `chorus trace`.
//! - [`wait`]: long waits (rendezvous, connecting to the store) note who
//!   they wait for and how long is left.
//! - [`error`]: [`error::report`] and the `Debug` of the public errors,
//!   which prints it.

pub mod codec;
pub mod collective;
pub mod error;
pub mod flight;
pub mod rendezvous;
pub mod store;
pub mod wait;
