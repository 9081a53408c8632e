//! chorus-actors: where concurrency and failure live.
//!
//! # Layout
//! This crate receives the rank actors, the CPU and NCCL backends, the
//! watchdog and the group supervisor as the collectives land; today the
//! process-group handle is rendezvous-only and lives in the root crate.
