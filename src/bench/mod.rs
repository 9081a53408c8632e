//! `chorus bench`: measurements printed the way people in this field read
//! them, next to the peer they must beat, measured in the same run.
//!
//! # Layout
//! - [`transport`]: throughput and round trip per transport path, against raw TCP.

pub mod transport;
