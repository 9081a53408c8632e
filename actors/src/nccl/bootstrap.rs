//! Forming a communicator through the store, as PyTorch's ProcessGroupNCCL
//! does (NC-3, NC-4): rank 0 makes the `ncclUniqueId` and sets it under a
//! key scoped by run, generation and group; the others get it; every rank
//! then starts its non-blocking init and polls it until ready, aborting it
//! when it does not become ready in time.

use std::time::{Duration, Instant};

use chorus_runtime::store::{Store, StoreError};
use thiserror::Error;

use super::comm::{Backend, Communicator};
use super::types::{CommStatus, NcclError, UNIQUE_ID_BYTES, UniqueId};

/// How long init polls wait between two looks.
const INIT_POLL: Duration = Duration::from_millis(5);

/// Which communicator: the store key is derived from these, so each
/// generation (and each group in it) gets a unique id of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommKey {
    /// The job's run id.
    pub run_id: String,
    /// The group's generation (an elastic restart forms the next one).
    pub generation: u64,
    /// The group's name within the generation (`world` for the default group).
    pub group: String,
}

impl CommKey {
    /// The default group of `generation` in run `run_id`.
    pub fn world(run_id: impl Into<String>, generation: u64) -> Self {
        Self {
            run_id: run_id.into(),
            generation,
            group: "world".into(),
        }
    }

    /// The store key of the unique id: beside the rendezvous's records
    /// (`chorus/<run id>/g<generation>/`).
    pub fn store_key(&self) -> String {
        format!(
            "chorus/{}/g{}/nccl/{}/unique_id",
            self.run_id, self.generation, self.group
        )
    }
}

/// Forming a communicator failed.
#[derive(Debug, Error)]
pub enum BootstrapError {
    /// Rank 0 did not publish the unique id in time.
    #[error(
        "rank {rank} waited {waited:?} for the NCCL unique id under {key:?} in store {location}: rank 0 did not \
         publish it; check that rank 0 runs, on the same store, run id and generation"
    )]
    MissingId {
        /// The waiting rank.
        rank: usize,
        /// The key.
        key: String,
        /// The store.
        location: String,
        /// How long it waited.
        waited: Duration,
    },
    /// The value under the key is not a unique id.
    #[error(
        "the value under {key:?} is {len} bytes, not a {UNIQUE_ID_BYTES}-byte NCCL unique id; another program uses the key"
    )]
    WrongSize {
        /// The key.
        key: String,
        /// Its length.
        len: usize,
    },
    /// The store failed.
    #[error("store error on {key:?}: {source}")]
    Store {
        /// The key.
        key: String,
        /// What failed.
        #[source]
        source: StoreError,
    },
    /// An NCCL call failed (making the id, starting or polling init).
    #[error("rank {rank}: {source}")]
    Nccl {
        /// The rank.
        rank: usize,
        /// What failed.
        #[source]
        source: NcclError,
    },
    /// Init did not complete in time: some rank never joined. The
    /// communicator was aborted.
    #[error(
        "rank {rank}: the NCCL communicator of {world} ranks was not ready after {waited:?} (a rank did not join); \
         it was aborted"
    )]
    InitTimeout {
        /// The rank.
        rank: usize,
        /// The world size.
        world: usize,
        /// How long it waited.
        waited: Duration,
    },
}

/// Hands the unique id of `key` around (NC-3): rank 0 makes it with
/// `make` and sets it; the others wait up to `timeout` for it.
pub async fn exchange_unique_id(
    store: &dyn Store,
    key: &CommKey,
    rank: usize,
    timeout: Duration,
    make: impl FnOnce() -> Result<UniqueId, NcclError>,
) -> Result<UniqueId, BootstrapError> {
    let store_key = key.store_key();
    if rank == 0 {
        let id = make().map_err(|source| BootstrapError::Nccl { rank, source })?;
        store
            .set(&store_key, id.as_bytes())
            .await
            .map_err(|source| BootstrapError::Store { key: store_key, source })?;
        return Ok(id);
    }
    let bytes = match store.get_timeout(&store_key, timeout).await {
        Ok(bytes) => bytes,
        Err(StoreError::Timeout { waited, location, .. }) => {
            return Err(BootstrapError::MissingId {
                rank,
                key: store_key,
                location,
                waited,
            });
        }
        Err(source) => {
            return Err(BootstrapError::Store { key: store_key, source });
        }
    };
    UniqueId::from_bytes(&bytes).ok_or(BootstrapError::WrongSize {
        key: store_key,
        len: bytes.len(),
    })
}

/// Polls `comm` until it is ready (NC-4); past `timeout` it is aborted.
pub async fn wait_ready<C: Communicator>(comm: &C, timeout: Duration) -> Result<(), BootstrapError> {
    let started = Instant::now();
    let rank = comm.rank();
    loop {
        match comm.status() {
            Ok(CommStatus::Ready) => return Ok(()),
            Ok(CommStatus::InProgress) => {}
            Err(source) => {
                // A failed init may hold resources (threads, sockets) until aborted.
                let _ = comm.abort();
                return Err(BootstrapError::Nccl { rank, source });
            }
        }
        if started.elapsed() >= timeout {
            if let Err(e) = comm.abort() {
                tracing::warn!(rank, error = %e, "aborting a communicator whose init timed out failed");
            }
            return Err(BootstrapError::InitTimeout {
                rank,
                world: comm.world(),
                waited: started.elapsed(),
            });
        }
        tokio::time::sleep(INIT_POLL).await;
    }
}

/// Forms `rank`'s communicator of `world` ranks through `store` (NC-3,
/// NC-4): the unique id exchange (waiting up to `timeout` for rank 0), the
/// non-blocking init, and the wait until it is ready (up to `timeout` again).
pub async fn init_communicator<B: Backend>(
    backend: &B,
    store: &dyn Store,
    key: &CommKey,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> Result<B::Comm, BootstrapError> {
    let id = exchange_unique_id(store, key, rank, timeout, || backend.unique_id()).await?;
    let comm = backend
        .init(&id, rank, world)
        .map_err(|source| BootstrapError::Nccl { rank, source })?;
    wait_ready(&comm, timeout).await?;
    Ok(comm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nccl::fake::FakeBackend;
    use chorus_runtime::store::HashStore;
    use std::sync::Arc;

    async fn within<T>(secs: u64, future: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(secs), future)
            .await
            .unwrap_or_else(|_| panic!("did not finish within {secs}s"))
    }

    #[test]
    fn nc3_keys_are_scoped_by_run_generation_and_group() {
        let key = CommKey::world("job", 3);
        assert_eq!(key.store_key(), "chorus/job/g3/nccl/world/unique_id");
        let next = CommKey::world("job", 4);
        assert_ne!(key.store_key(), next.store_key());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn nc3_every_rank_gets_rank_0s_id_and_forms_one_communicator() {
        let store = Arc::new(HashStore::new(Duration::from_secs(5)));
        let backend = FakeBackend::new();
        let key = CommKey::world("t", 0);
        let tasks: Vec<_> = (0..4)
            .map(|rank| {
                let (store, backend, key) = (store.clone(), backend.clone(), key.clone());
                tokio::spawn(async move {
                    init_communicator(&backend, &*store, &key, rank, 4, Duration::from_secs(5)).await
                })
            })
            .collect();
        for (rank, task) in tasks.into_iter().enumerate() {
            let comm = within(10, task).await.unwrap().unwrap();
            assert_eq!((comm.rank(), comm.world()), (rank, 4));
            assert_eq!(comm.status(), Ok(CommStatus::Ready));
        }
        let stored = store.get(&key.store_key()).await.unwrap();
        assert_eq!(stored.len(), UNIQUE_ID_BYTES);
    }

    #[tokio::test]
    async fn nc3_a_value_of_the_wrong_size_is_a_typed_error() {
        let store = HashStore::new(Duration::from_secs(5));
        let key = CommKey::world("t", 1);
        store.set(&key.store_key(), &[1, 2, 3]).await.unwrap();
        let err = within(
            5,
            exchange_unique_id(&store, &key, 1, Duration::from_secs(1), || unreachable!()),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, BootstrapError::WrongSize { len: 3, .. }), "{err}");
    }

    #[tokio::test]
    async fn nc3_a_missing_rank_0_times_out_naming_the_key() {
        let store = HashStore::new(Duration::from_secs(60));
        let key = CommKey::world("t", 2);
        let started = Instant::now();
        let err = within(
            5,
            exchange_unique_id(&store, &key, 2, Duration::from_millis(200), || unreachable!()),
        )
        .await
        .unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "the timeout given wins over the store's"
        );
        let text = err.to_string();
        assert!(
            matches!(err, BootstrapError::MissingId { rank: 2, .. })
                && text.contains("chorus/t/g2/nccl/world/unique_id"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn nc4_an_init_that_never_completes_is_aborted_at_its_timeout() {
        let store = HashStore::new(Duration::from_secs(5));
        let backend = FakeBackend::new();
        // Rank 1 of 2 never joins.
        let key = CommKey::world("t", 0);
        let err = within(
            5,
            init_communicator(&backend, &store, &key, 0, 2, Duration::from_millis(200)),
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, BootstrapError::InitTimeout { rank: 0, world: 2, .. }),
            "{err}"
        );
        // The id was published and rank 1 can still read it, but rank 0's communicator is gone.
        let id = exchange_unique_id(&store, &key, 1, Duration::from_secs(1), || unreachable!())
            .await
            .unwrap();
        let late = backend.init(&id, 1, 2).unwrap();
        assert!(
            late.status().is_err(),
            "rank 0 aborted: the late rank sees a remote error"
        );
    }
}
