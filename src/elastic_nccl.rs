//! [`ElasticNccl`]: NCCL communicators that follow an [`ElasticGroup`]
//! through its generations, so a failed or hung NCCL group is aborted and
//! restarted like the CPU group it rides on.
//!
//! The elastic group is the control plane: its rendezvous decides who forms
//! each generation, its heartbeats and process watch notice dead and frozen
//! peers (SV-1, SV-15), and its supervisor restarts it (SV-9). For every
//! generation this attachment forms one NCCL communicator over the same
//! members (the unique id under the generation's own key, NC-3) and runs it
//! in an [`NcclGroup`]. Rules (tests named after them in
//! `tests/elastic_nccl.rs`, run with the fake communicator):
//! - EN-1: an abort of the NCCL group (an asynchronous NCCL error, a hung or
//!   failed collective: NC-6, NC-7) aborts the generation's CPU group, so the
//!   whole job restarts one-for-all into the next generation.
//! - EN-2: an abort of the CPU group (a dead, frozen or partitioned peer)
//!   aborts the NCCL group at once (`ncclCommAbort`, which ends a kernel
//!   waiting on the dead peer), without waiting for the NCCL timeout.
//! - EN-3: once the next generation forms, a new communicator of its members
//!   is formed and [`ElasticNccl::current`] returns it; until then it
//!   returns the aborted group, whose operations fail at once (NC-7).

use std::sync::Arc;
use std::time::Duration;

use chorus_actors::nccl::{Backend, BootstrapError, CommKey, NcclGroup, NcclGroupConfig, init_communicator};
use chorus_actors::system::SystemError;
use thiserror::Error;
use tokio::sync::watch;

use crate::elastic::{ElasticGroup, RestartError};
use crate::group::ProcessGroup;

/// Why an NCCL generation could not be formed.
#[derive(Error)]
pub enum ElasticNcclError {
    /// The unique id exchange or the communicator's init failed.
    #[error(transparent)]
    Bootstrap(#[from] BootstrapError),
    /// The NCCL group's actor could not start.
    #[error(transparent)]
    System(#[from] SystemError),
    /// The elastic group gave up restarting (SV-12).
    #[error("the elastic group gave up: {0}")]
    GaveUp(Arc<RestartError>),
}

chorus_runtime::debug_as_report!(ElasticNcclError);

/// NCCL communicators following an [`ElasticGroup`]: see the module docs.
pub struct ElasticNccl<B: Backend> {
    current: watch::Receiver<Arc<NcclGroup<B::Comm>>>,
    /// Set when a generation's communicator could not be formed.
    failed: watch::Receiver<Option<Arc<ElasticNcclError>>>,
    task: tokio::task::JoinHandle<()>,
}

impl<B: Backend> Drop for ElasticNccl<B> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl<B: Backend> std::fmt::Debug for ElasticNccl<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ElasticNccl")
            .field("generation", &self.current.borrow().generation())
            .finish()
    }
}

/// Forms the communicator of `group`'s generation and starts its NCCL group.
async fn form<B: Backend>(
    backend: &B,
    group: &ProcessGroup,
    config: NcclGroupConfig,
    timeout: Duration,
) -> Result<NcclGroup<B::Comm>, ElasticNcclError> {
    let key = CommKey::world(group.run_id(), group.generation());
    let comm = init_communicator(
        backend,
        group.store().as_ref(),
        &key,
        group.rank(),
        group.world_size(),
        timeout,
    )
    .await?;
    Ok(NcclGroup::start(
        comm,
        NcclGroupConfig {
            generation: group.generation(),
            ..config
        },
    )?)
}

impl<B> ElasticNccl<B>
where
    B: Backend + Send + Sync + 'static,
    B::Comm: Send + Sync + 'static,
{
    /// Forms the NCCL group of `group`'s current generation on `backend`
    /// (its device) and keeps one for every later generation (EN-1..EN-3).
    /// `timeout` bounds each generation's unique id exchange and init.
    pub async fn attach(
        group: &ElasticGroup,
        backend: B,
        config: NcclGroupConfig,
        timeout: Duration,
    ) -> Result<Self, ElasticNcclError> {
        let first = Arc::new(form(&backend, &group.current(), config.clone(), timeout).await?);
        let (current_tx, current) = watch::channel(first);
        let (failed_tx, failed) = watch::channel(None);
        let generations = group.generations();
        let task = tokio::spawn(async move {
            let result = follow(generations, backend, config, timeout, &current_tx).await;
            if let Err(error) = result {
                tracing::error!("NCCL group not re-formed: {error}");
                failed_tx.send_replace(Some(Arc::new(error)));
            }
        });
        Ok(Self { current, failed, task })
    }

    /// The NCCL group of the newest formed generation.
    pub fn current(&self) -> Arc<NcclGroup<B::Comm>> {
        self.current.borrow().clone()
    }

    /// Waits until the NCCL group of a generation after `generation` is
    /// formed and returns it, or returns why none will be.
    pub async fn next_generation(&self, generation: u64) -> Result<Arc<NcclGroup<B::Comm>>, Arc<ElasticNcclError>> {
        let mut current = self.current.clone();
        let mut failed = self.failed.clone();
        tokio::select! {
            Ok(group) = current.wait_for(|g| g.generation() > generation) => Ok(group.clone()),
            Ok(error) = failed.wait_for(Option::is_some) => Err(error.clone().expect("waited for Some")),
        }
    }
}

/// The attachment's loop: ties each generation's NCCL and CPU groups
/// together (EN-1, EN-2), then forms the next one (EN-3).
async fn follow<B>(
    mut generations: watch::Receiver<Arc<ProcessGroup>>,
    backend: B,
    config: NcclGroupConfig,
    timeout: Duration,
    current: &watch::Sender<Arc<NcclGroup<B::Comm>>>,
) -> Result<(), ElasticNcclError>
where
    B: Backend + Send + Sync + 'static,
    B::Comm: Send + Sync + 'static,
{
    // The newest generation a communicator was formed for or tried.
    let mut attempted = current.borrow().generation();
    loop {
        let cpu = generations.borrow_and_update().clone();
        let nccl = current.borrow().clone();
        let mut nccl_failures = nccl.failures();
        let mut cpu_failures = cpu.failures();
        if cpu.generation() != nccl.generation() {
            // The group restarted again while this communicator formed.
            nccl.abort("the group moved to a new generation");
        } else {
            tokio::select! {
                seen = nccl_failures.wait_for(Option::is_some) => {
                    let why = seen.ok().and_then(|s| s.clone()).map_or_else(|| "the NCCL group stopped".to_string(), |a| a.to_string());
                    cpu.abort(format!("NCCL: {why}"));
                }
                seen = cpu_failures.wait_for(Option::is_some) => {
                    let why = seen.ok().and_then(|s| s.clone()).map_or_else(|| "the group stopped".to_string(), |a| a.to_string());
                    nccl.abort(&why);
                }
                changed = generations.changed() => {
                    // A generation change without an abort seen here (it was
                    // seen first by the elastic supervisor): end this one too.
                    if changed.is_err() {
                        return Ok(());
                    }
                    nccl.abort("the group moved to a new generation");
                }
            }
        }
        drop((nccl, cpu));
        // Wait for the CPU group's next generation, then form its communicator.
        let next = loop {
            let candidate = generations.borrow_and_update().clone();
            if candidate.generation() > attempted {
                break candidate;
            }
            if generations.changed().await.is_err() {
                return Ok(());
            }
        };
        attempted = next.generation();
        match form(&backend, &next, config.clone(), timeout).await {
            Ok(group) => {
                current.send_replace(Arc::new(group));
            }
            // Peers may have failed while forming: the CPU group notices
            // and restarts again; try with the generation after.
            Err(ElasticNcclError::Bootstrap(error)) => {
                tracing::warn!(generation = next.generation(), "NCCL communicator not formed: {error}");
                next.abort(format!("NCCL communicator not formed: {error}"));
            }
            Err(other) => return Err(other),
        }
    }
}
