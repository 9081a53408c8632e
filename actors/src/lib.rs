//! chorus-actors: where concurrency and failure live.
//!
//! # Layout
//! - [`system`]: the process-wide actix system and one arbiter (thread,
//!   current-thread runtime) per rank.
//! - [`rank`]: [`RankActor`](rank::RankActor), which owns a rank's links and
//!   runs its operations in submission order, numbered, under the rules
//!   RA-1..RA-5 in its docs.
//! - [`p2p`]: point-to-point operations run beside the rank's collectives,
//!   in lanes per peer, direction and tag, with receives from any source;
//!   rules PP-1..PP-4 in its docs.
//! - [`heartbeat`]: heartbeats between ranks on a channel of their own, and
//!   the sans-IO [`HeartbeatMonitor`](heartbeat::HeartbeatMonitor) that
//!   tells a dead or frozen peer from a slow one.
//! - [`supervision`]: error-handling modes, the watchdog that aborts a group
//!   when a peer fails or an operation overruns, the monitor that exits a
//!   process whose watchdog is stuck; rules SV-1..SV-8 in its docs.
//! - [`process_watch`]: watching peer processes on this host through
//!   pidfds, so their exit is noticed at once whatever the transport (SV-15).
//! - [`driver`]: the CPU backend: runs one rank's collective plan (from
//!   `chorus_runtime::collective`) over its links, with signature exchange
//!   for desync detection and a deadline.
//! - [`buffer`]: [`Buffer`](buffer::Buffer), a collective's output: owned, or
//!   memory its caller lends (a binding's tensor), written in place.
//! - [`lend`]: regions of a collective's output lent to ranks of this
//!   process, which read them in place instead of from a copy.
//! - [`nccl`]: the GPU backend: NCCL through cudarc (loaded at run time,
//!   probed before use), the unique id exchange through the store, and a
//!   supervised group (actor, watchdog, abort); rules NC-1..NC-10 in its docs.

pub mod buffer;
pub mod driver;
pub mod heartbeat;
pub mod lend;
pub mod metrics;
pub mod nccl;
pub mod p2p;
pub mod process_watch;
pub mod rank;
pub mod supervision;
pub mod system;
