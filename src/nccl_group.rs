//! `init_process_group(backend="nccl")` for chorus: one call that forms a
//! supervised NCCL group the way PyTorch forms one. Rank, world size and
//! store come from [`InitOptions`] and the launcher's environment (`env://`,
//! `tcp://`, `file://`), as for the CPU backend; the process of local rank
//! `k` uses GPU `k` (torchrun's convention); rank 0's `ncclUniqueId` goes
//! through the store; the group runs under the error handling the
//! environment asks for (`TORCH_NCCL_ASYNC_ERROR_HANDLING`,
//! `TORCH_NCCL_BLOCKING_WAIT` and their `CHORUS_` / `NCCL_` names).
//!
//! [`init_nccl_group`] takes the real GPU (probing CUDA and NCCL first, so
//! a machine without them gets a typed error, never a panic);
//! [`init_nccl_group_with`] takes any [`Backend`], e.g. the in-process fake.

use std::time::Duration;

use chorus_actors::nccl::{
    Backend, BootstrapError, CommKey, CudaBackend, NcclError, NcclGroup, NcclGroupConfig, ProbeError,
    init_communicator, probe,
};
use chorus_actors::supervision::SupervisionConfigError;
use chorus_actors::system::SystemError;
use chorus_runtime::rendezvous::{self, OpenedStore, RendezvousError};
use chorus_runtime::store::{Store, StoreError};
use thiserror::Error;

use crate::InitOptions;

/// Why an NCCL group could not be formed or left.
#[derive(Error)]
pub enum NcclInitError {
    /// CUDA or NCCL cannot be used here: the probe's message.
    #[error("{0}")]
    Unavailable(#[from] ProbeError),
    /// More processes on this node than GPUs.
    #[error(
        "local rank {local_rank} has no GPU of its own: {devices} visible (CUDA_VISIBLE_DEVICES={visible:?}); \
         start at most {devices} processes per node (--nproc-per-node)"
    )]
    TooFewDevices {
        /// This process's local rank.
        local_rank: usize,
        /// The devices visible.
        devices: usize,
        /// CUDA_VISIBLE_DEVICES, when set.
        visible: Option<String>,
    },
    /// Rank, world and store could not be resolved or opened.
    #[error(transparent)]
    Rendezvous(Box<RendezvousError>),
    /// The error-handling variables are wrong.
    #[error(transparent)]
    Supervision(#[from] SupervisionConfigError),
    /// The device could not be set up.
    #[error("rank {rank}: CUDA device {local_rank}: {source}")]
    Device {
        /// The rank.
        rank: usize,
        /// The device (its local rank).
        local_rank: usize,
        /// What failed.
        #[source]
        source: NcclError,
    },
    /// The communicator could not be formed.
    #[error(transparent)]
    Bootstrap(Box<BootstrapError>),
    /// The group's actor could not be started.
    #[error(transparent)]
    System(#[from] SystemError),
    /// Leaving together failed: a rank did not arrive at the final barrier.
    #[error("rank {rank}: leaving the NCCL group: {source}")]
    Leave {
        /// The rank.
        rank: usize,
        /// What failed.
        #[source]
        source: StoreError,
    },
}

chorus_runtime::debug_as_report!(NcclInitError);

// The two largest causes go boxed, so that every `Result` of this error
// stays small: those of the `device` closure a caller of
// `init_nccl_group_with` writes too (clippy's `result_large_err`).
impl From<RendezvousError> for NcclInitError {
    fn from(error: RendezvousError) -> Self {
        NcclInitError::Rendezvous(Box::new(error))
    }
}

impl From<BootstrapError> for NcclInitError {
    fn from(error: BootstrapError) -> Self {
        NcclInitError::Bootstrap(Box::new(error))
    }
}

/// One rank of an NCCL group formed by [`init_nccl_group`]: the supervised
/// [`NcclGroup`] (run operations on [`group`](Self::group)), the backend
/// that makes its device buffers, and the store it was formed through
/// (rank 0 may be serving it, so it lives as long as the group).
pub struct NcclProcessGroup<B: Backend> {
    group: NcclGroup<B::Comm>,
    backend: B,
    opened: OpenedStore,
    key: CommKey,
    local_rank: usize,
    timeout: Duration,
}

/// Forms this rank's NCCL group on the GPU of its local rank.
pub async fn init_nccl_group(options: InitOptions) -> Result<NcclProcessGroup<CudaBackend>, NcclInitError> {
    let found = probe()?;
    init_nccl_group_with(options, |rank, local_rank| {
        if local_rank >= found.devices {
            return Err(NcclInitError::TooFewDevices {
                local_rank,
                devices: found.devices,
                visible: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
            });
        }
        CudaBackend::new(local_rank).map_err(|source| NcclInitError::Device {
            rank,
            local_rank,
            source,
        })
    })
    .await
}

/// Forms this rank's NCCL group on the backend `device(rank, local_rank)`
/// returns (the local rank is the rank when the launcher sets none).
pub async fn init_nccl_group_with<B: Backend>(
    options: InitOptions,
    device: impl FnOnce(usize, usize) -> Result<B, NcclInitError>,
) -> Result<NcclProcessGroup<B>, NcclInitError> {
    let env = |name: &str| std::env::var(name).ok();
    let config = rendezvous::resolve(options.init_method.clone(), options.rank, options.world_size, &env)?;
    let (rank, world) = (config.rank, config.world_size);
    let local_rank = config.local_rank.unwrap_or(rank);
    let mode = options.error_handling_or_env()?;
    let backend = device(rank, local_rank)?;
    let opened = rendezvous::open_store(&config, options.timeout).await?;
    let key = CommKey::world(config.run_id.clone(), config.generation);
    let comm = init_communicator(&backend, &*opened.store, &key, rank, world, options.timeout).await?;
    let group = NcclGroup::start(
        comm,
        NcclGroupConfig {
            generation: config.generation,
            timeout: options.collective_timeout,
            mode,
            ..NcclGroupConfig::default()
        },
    )?;
    Ok(NcclProcessGroup {
        group,
        backend,
        opened,
        key,
        local_rank,
        timeout: options.timeout,
    })
}

impl<B: Backend> NcclProcessGroup<B> {
    /// The supervised group: run operations on it.
    pub fn group(&self) -> &NcclGroup<B::Comm> {
        &self.group
    }

    /// The backend of this rank's device (its buffers, its copies).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.group.world()
    }

    /// This process's rank on its node, which picked its device.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The store the group was formed through.
    pub fn store(&self) -> &dyn Store {
        &*self.opened.store
    }

    /// Leaves with the others (`destroy_process_group`): waits until every
    /// rank has arrived (so rank 0 does not stop serving the store under a
    /// peer still using it), then frees the communicator.
    pub async fn destroy(self) -> Result<(), NcclInitError> {
        let rank = self.rank();
        let prefix = format!("chorus/{}/g{}/nccl/leave", self.key.run_id, self.key.generation);
        let (count, done) = (format!("{prefix}/count"), format!("{prefix}/done"));
        let store = &*self.opened.store;
        let left = async {
            if store.add(&count, 1).await? as usize == self.group.world() {
                store.set(&done, b"1").await?;
            }
            store.wait_timeout(&[&done], self.timeout).await
        };
        left.await.map_err(|source| NcclInitError::Leave { rank, source })?;
        drop(self.group);
        // Our own connection must not hold the server's shutdown open.
        let OpenedStore { store, server } = self.opened;
        drop(store);
        if let Some(server) = server {
            server.shutdown().await;
        }
        Ok(())
    }
}
