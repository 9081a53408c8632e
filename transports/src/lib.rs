//! chorus-transports: how ranks reach each other.
//!
//! # Layout
//! - [`link`]: the one abstraction, a [`Link`](link::Link) to a peer that
//!   carries tagged, ordered frames on independent channels with
//!   back-pressure; the frame header codec.
//! - [`congestion`]: QUIC's controller between hosts, Cubic until the link
//!   shows loss, then BBR.
//! - [`auth`]: signing published records with the job secret (HMAC-SHA256).
//! - [`fault`]: a link wrapper injecting drops, delays, partitions, closes,
//!   kills and freezes, deterministic under a seed (`CHORUS_FAULTS`).
//! - [`local`]: links between ranks of one process (payloads move without a
//!   copy).
//! - [`quic`]: the QUIC mesh (quinn), mutual TLS with pinned per-rank
//!   certificates, tuned for throughput.
//! - [`shm`]: links between processes of one host over shared-memory rings
//!   in `/dev/shm` (one copy per byte; received payloads point into the ring).
//!   A folder: the endpoint in `shm/mod.rs`, the records sans IO in
//!   [`shm::ring`] (a cursor the tests and the `shm_ring` fuzz target drive
//!   over a byte slice), the mapping and futex waits in `shm/mapped.rs`, the
//!   link in `shm/link.rs`, the tests in `shm/tests.rs` and `shm/tests/`.
//! - [`scoped`]: a subgroup's view of a link (channels shifted past the
//!   parent group's, peers renamed to subgroup ranks).
//! - [`netif`]: choosing the addresses a rank publishes at rendezvous (most
//!   preferred first, never only loopback when the host has a real
//!   interface) and the one a peer connects to. The choice is a pure function
//!   of the interface list, an optional `CHORUS_SOCKET_IFNAME` /
//!   `GLOO_SOCKET_IFNAME` spec and the route to the master; listing the
//!   interfaces and asking the kernel for that route are thin wrappers.
//! - [`process`]: signals to processes (fault injection's kills and
//!   freezes, a peer's liveness), without `unsafe` at any caller.
//!
//! This crate knows nothing of stores or collectives: it is handed peers
//! (rank, address, fingerprint) and moves frames.

pub mod auth;
pub mod congestion;
pub mod fault;
pub mod link;
pub mod local;
pub mod netif;
pub mod process;
pub mod quic;
pub mod scoped;
#[cfg(target_os = "linux")]
pub mod shm;
