//! chorus: keeps the parameters of a distributed training job in sync, the
//! way `torch.distributed` does for PyTorch.
//!
//! # Layout
//! - [`group`]: [`init_process_group`] and the [`ProcessGroup`] handle it
//!   returns (rendezvous, store, membership; collectives land here next).
//! - [`store`], [`rendezvous`]: re-exported from `chorus-runtime`.
//! - [`netif`]: re-exported from `chorus-transports` (which address a rank
//!   publishes, which one a peer connects to).
//! - `src/main.rs`: the `chorus` command line (`hello`, `store ...`).

pub mod group;

pub use chorus_runtime::{rendezvous, store};
pub use chorus_transports::netif;
pub use group::{InitError, InitOptions, ProcessGroup, init_process_group};
