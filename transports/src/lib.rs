//! chorus-transports: how ranks reach each other.
//!
//! # Layout
//! - [`netif`]: choosing the addresses a rank publishes at rendezvous (most
//!   preferred first, never only loopback when the host has a real
//!   interface) and the one a peer connects to. The choice is a pure function
//!   of the interface list, an optional `CHORUS_SOCKET_IFNAME` /
//!   `GLOO_SOCKET_IFNAME` spec and the route to the master; listing the
//!   interfaces and asking the kernel for that route are thin wrappers.
//!
//! The transports that move tagged frames between ranks come later in this
//! crate.

pub mod netif;
