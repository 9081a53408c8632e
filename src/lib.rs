//! chorus: keeps the parameters of a distributed training job in sync, the
//! way `torch.distributed` does for PyTorch.
//!
//! ```
//! use chorus::{ReduceOp, Tensor};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! // Four ranks in this process; across processes, `init_process_group`.
//! let averages = chorus::spawn(4, |pg| async move {
//!     let model = Tensor::from_slice(&[pg.rank() as f32; 3]);
//!     let average = pg.all_reduce(model, ReduceOp::Avg).await;
//!     pg.destroy().await?;
//!     Ok::<_, Box<dyn std::error::Error + Send + Sync>>(average?)
//! })
//! .await?;
//! for average in averages {
//!     assert_eq!(average?.to_vec::<f32>()?, [1.5; 3]); // (0 + 1 + 2 + 3) / 4
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//! - [`group`]: [`init_process_group`] and the [`ProcessGroup`] handle it
//!   returns (rendezvous, store, membership, links to every peer), its
//!   stages under one deadline ([`InitStage`]).
//! - [`collectives`]: every `torch.distributed` collective on a
//!   [`ProcessGroup`], each returning a [`Work`]; [`tensor`]: the owned
//!   buffers they take and hand back.
//! - [`elastic`]: [`ElasticGroup`], a group that restarts itself into a
//!   new generation after a failure (rules SV-9..SV-13); [`elastic_nccl`]:
//!   NCCL communicators that follow it through its generations (EN-1..EN-3).
//! - [`binding`]: torchrun's `--numa-binding` modes: each local rank's CPUs
//!   from the host's topology (a sans-IO plan over [`binding::Topology`]).
//! - [`error_file`]: what a rank process whose group aborts writes for its
//!   launcher (`TORCHELASTIC_ERROR_FILE`), naming the peers it blames.
//! - [`metrics`]: what a running group reports through the `metrics`
//!   facade (a table of names), and the `tracing` span of each collective.
//! - [`nccl_group`]: [`init_nccl_group`], `init_process_group(backend="nccl")`:
//!   a supervised NCCL group on the local rank's GPU, formed through the
//!   same rendezvous.
//! - [`sync`](mod@sync): [`DistributedSync`], PyTorch's `DistributedDataParallel`
//!   for a Rust model: checked registration, start-up broadcast, gradient
//!   buckets reduced while the backward pass runs, communication hooks.
//! - [`train`]: elastic training on top of it: [`TrainState`] (what
//!   survivors hand to joiners) and [`train::sync_state`], live state
//!   transfer to them (chunked, striped, checksummed).
//! - [`mesh`]: building those links: transport choice, published endpoints,
//!   job-secret signatures, fault injection.
//! - [`store`], [`rendezvous`]: re-exported from `chorus-runtime`.
//! - [`netif`], [`auth`], [`fault`], [`link`], [`process`]: re-exported from
//!   `chorus-transports` (which address a rank publishes, which one a peer
//!   connects to; the job secret; fault plans; the link trait; signals to
//!   processes).
//! - `terminate`: with `CHORUS_TRACE_DIR` set, SIGTERM dumps every live
//!   group's flight recorder before the process exits.
//! - [`trace`]: the analysis behind `chorus trace DIR`: reads the ranks'
//!   flight-recorder dumps and names the rank(s) a stuck collective waits for.
//! - [`nccl`]: the NCCL backend of `chorus-actors` ([`NcclOp`], `CudaBackend`,
//!   `NcclGroup`), re-exported for [`init_nccl_group`]'s users.
//!
//! # Cancel safety
//!
//! A future of this crate dropped half-way (a `select!`, a timeout) is
//! cancel safe only where its docs say so. A collective is the ranks' joint
//! act: once called it runs in its turn whether or not its [`Work`] is
//! kept, so dropping a `Work` loses only the result. An `async fn` that
//! runs several collectives ([`DistributedSync`]'s, [`train`]'s) and is
//! dropped between them leaves this rank short of the ones it had not
//! called yet, which puts the ranks out of step, as does a dropped
//! [`ProcessGroup::new_group`] (it numbers subgroups in call order): those
//! are not cancel safe; bound them with the group's timeouts, not by
//! dropping them. The [`store::Store`] trait documents
//! its own.
//!
//! The `chorus` command line (`chorus launch`, `bench`, `selftest`, `netem`,
//! `trace`, `store`) is the `chorus-cli` crate, built on this one.

/// The README's code blocks, compiled and run as doc-tests so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The user guide's code blocks (`docs/`), compiled and run as the README's
/// are; `tests/docs.rs` checks that every page with Rust code is here.
#[cfg(doctest)]
#[doc = include_str!("../docs/embedding.md")]
pub struct EmbeddingDoctests;

/// See [`EmbeddingDoctests`].
#[cfg(doctest)]
#[doc = include_str!("../docs/gpu.md")]
pub struct GpuDoctests;

/// See [`EmbeddingDoctests`].
#[cfg(doctest)]
#[doc = include_str!("../docs/supervision.md")]
pub struct SupervisionDoctests;

/// See [`EmbeddingDoctests`].
#[cfg(doctest)]
#[doc = include_str!("../docs/training.md")]
pub struct TrainingDoctests;

pub mod binding;
pub mod collectives;
pub mod elastic;
pub mod elastic_nccl;
pub mod error_file;
pub mod group;
pub mod mesh;
pub mod nccl_group;
pub mod sync;
pub mod tensor;
mod terminate;
pub mod trace;
pub mod train;

pub use chorus_actors::buffer::Buffer;
pub use chorus_actors::driver::CollectiveError;
pub use chorus_actors::metrics;
pub use chorus_actors::nccl;
pub use chorus_actors::nccl::NcclOp;
pub use chorus_actors::rank::Collective;
pub use chorus_actors::supervision::{AbortReason, ErrorHandling, GroupAborted};
pub use chorus_runtime::collective::{CollectiveKind, DType, Overrides, ReduceOp, Thresholds};
pub use chorus_runtime::{rendezvous, store, wait};
pub use chorus_transports::{auth, fault, link, netif, process};
pub use collectives::Work;
pub use elastic::{Admission, ElasticGroup, GroupSupervisor, MembershipChange, RestartError};
pub use group::{InitError, InitOptions, InitStage, ProcessGroup, init_process_group, spawn, spawn_with};
pub use nccl_group::{NcclInitError, NcclProcessGroup, init_nccl_group, init_nccl_group_with};
pub use sync::{DistributedSync, ParamBuffer, Parameters, SyncError, SyncOptions};
pub use tensor::{Element, Tensor};
pub use train::{NamedState, TrainState};

pub use chorus_runtime::error::report as error_report;

#[cfg(test)]
mod tests {
    use chorus_runtime::rendezvous::RendezvousError;
    use chorus_runtime::rendezvous::env::{EnvError, Launcher};

    /// A `main` that returns `Result<(), Box<dyn Error>>` prints its error
    /// with `Debug`: the user reads the message, not the error's structure.
    #[test]
    fn an_error_returned_from_main_prints_its_message() {
        let missing = EnvError::Missing {
            var: "MASTER_ADDR",
            launcher: Launcher::Env,
        };
        let error = crate::InitError::from(RendezvousError::from(missing.clone()));
        let boxed: Box<dyn std::error::Error> = Box::new(error);
        let printed = format!("{boxed:?}");
        assert_eq!(printed, missing.to_string());
        assert!(
            printed.starts_with("MASTER_ADDR is not set: ") && printed.contains("chorus launch"),
            "{printed}"
        );
        assert!(!printed.contains("Missing {"), "{printed}");
    }
}
