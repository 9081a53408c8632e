//! chorus-actors: where concurrency and failure live.
//!
//! # Layout
//! - [`system`]: the process-wide actix system and one arbiter (thread,
//!   current-thread runtime) per rank.
//! - [`rank`]: [`RankActor`](rank::RankActor), which owns a rank's links and
//!   runs its operations in submission order, numbered, under the rules
//!   RA-1..RA-4 in its docs.
//! - [`driver`]: the CPU backend: runs one rank's collective plan (from
//!   `chorus_runtime::collective`) over its links, with signature exchange
//!   for desync detection and a deadline.

pub mod driver;
pub mod rank;
pub mod system;
