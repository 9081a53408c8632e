//! [`ElasticGroup`]: a process group that restarts itself after a failure,
//! one-for-all, into a new generation with the survivors and any joiners,
//! behind the same handle.
//!
//! A [`GroupSupervisor`] task waits on the current group's `failures()`
//! (the abort of SV-5), tears the generation down, runs the elastic
//! rendezvous (`rendezvous::elastic`) for the next one, forms it through the
//! same path as [`init_process_group`](crate::init_process_group) (new
//! records, links, actor, heartbeats, watchdog), swaps it in and emits a
//! [`MembershipChange`] on [`ElasticGroup::events`].
//!
//! The application's side: an operation that fails with
//! `CollectiveError::GroupAborted` ran on a generation that is gone. Wait
//! for the next one ([`ElasticGroup::next_generation`]), agree on where to
//! resume (e.g. an all-reduce of the step counters with `Min`: a collective
//! may have completed on some survivors and not on others) and re-run the
//! step, as torchelastic's users re-run theirs.
//!
//! The store must outlive any rank: a launcher's store
//! (`TORCHELASTIC_USE_AGENT_STORE`), `chorus store serve`, a file store, or
//! an in-process store. Where this process serves the store itself (rank 0
//! of `tcp://`), the group keeps serving it across generations, but a
//! failure of this process ends the job.
//!
//! Rules (each with a test named after it, here, in
//! `chorus_runtime::rendezvous::elastic` or in `tests/elastic.rs`):
//! - SV-9: a failure of generation g (any abort, SV-1/SV-2) restarts the
//!   group one-for-all: its links close, the survivors and joiners form
//!   generation g+1 and the same handle runs on it; operations submitted
//!   between the failure and the swap fail with the abort error.
//! - SV-10: ranks of a new generation are dense and stable: survivors keep
//!   their relative order by old rank, joiners follow in arrival order.
//! - SV-11: a generation closes when `max_world` joined, or when at least
//!   `min_world` joined and every rank of the previous generation joined or
//!   was seen to fail by one who did, or when at least `min_world` joined
//!   and the last-call window passed; fewer than `min_world` within the
//!   timeout is an error naming who came; an arrival after the close waits
//!   for the next generation.
//! - SV-12: at most `max_restarts` restarts per window; the failure past the
//!   budget ends the process with a message naming every failure seen
//!   (generation, rank, reason, failed ranks). A generation that closed but
//!   could not form (a member died before publishing or connecting) is such
//!   a failure: the survivors try the next generation.
//! - SV-13: a process waiting to join generation g+1 restarts a healthy
//!   group that has fewer than `max_world` ranks, so it is admitted; that
//!   restart is a membership change and does not count against SV-12's
//!   budget (as torchrun's agents do not count one). Under
//!   [`Admission::AtStepBoundary`] the running generation is not stopped
//!   for it: a member that saw the joiner says so in the step's commit
//!   vote; once a vote committed with it every member asks for the
//!   admission ([`ElasticGroup::admit_at_boundary`]) and the supervisors
//!   form generation g+1 (rendezvous, records, links) beside g, which
//!   keeps training; each member's vote then says whether it holds g+1,
//!   and after the first vote in which every member does, they pass one
//!   barrier on g and swap to g+1 together
//!   ([`ElasticGroup::swap_at_boundary`]), so no step under way is lost and
//!   at the boundary only the state moves. If g fails while g+1 forms or
//!   waits, the members swap to g+1 at once (it fails in turn if it lost
//!   a member); if g+1 fails before the swap, both end and the members
//!   restart from g+1 (a member that leaves the job before the swap
//!   closes g+1 with a notice, so it is seen to leave, not to crash). If
//!   no boundary comes within the bound (a loop that stopped stepping),
//!   the group restarts as under [`Admission::Immediate`], or swaps
//!   without the barrier once g+1 is formed. A joiner that comes while
//!   the members re-form after a failure waits for the generation after
//!   theirs, so the survivors finish the step they were in (its gradients
//!   synced again among them) before it is admitted.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_actors::supervision::{self, AbortReason, GroupAborted};
use chorus_runtime::rendezvous::elastic::{self as elastic_rdzv, ElasticConfig, Joiner};
use chorus_runtime::rendezvous::{self, OpenedStore, RendezvousConfig, RendezvousError};
use chorus_runtime::store::{Store, StoreError, TcpStoreServer};
use thiserror::Error;
use tokio::sync::{broadcast, watch};

use crate::collectives::Work;
use crate::group::{Deadline, InitError, InitOptions, LinkSource, Master, ProcessGroup, form};
use crate::tensor::Tensor;
use chorus_runtime::collective::ReduceOp;

/// Restarts allowed per window, when neither the options nor the environment say.
pub const DEFAULT_MAX_RESTARTS: u32 = 3;
/// The budget's window, when neither the options nor the environment say.
pub const DEFAULT_RESTART_WINDOW: Duration = Duration::from_secs(600);
/// Restarts allowed per window.
pub const MAX_RESTARTS_ENV: &str = "CHORUS_MAX_RESTARTS";
/// The budget's window, in seconds.
pub const RESTART_WINDOW_ENV: &str = "CHORUS_RESTART_WINDOW";
/// Fewest ranks a generation may have, when the options do not say
/// (`chorus launch --restart-policy worker` sets it from `--nnodes MIN:MAX`).
pub const MIN_WORLD_ENV: &str = "CHORUS_MIN_WORLD";
/// Most ranks a generation may have, when the options do not say.
pub const MAX_WORLD_ENV: &str = "CHORUS_MAX_WORLD";
/// Scopes this process's elastic group within its run (`chorus launch
/// --restart-policy all` sets it per attempt after the first).
pub const SCOPE_ENV: &str = "CHORUS_ELASTIC_SCOPE";
/// Set (to 1) for a process that joins a running group: `chorus launch
/// --restart-policy worker` sets it for relaunched workers and late nodes.
pub const JOIN_ENV: &str = "CHORUS_ELASTIC_JOIN";
/// Set by `chorus launch --standby N` for a warm standby worker: the store
/// key its promotion will be written to. Such a process starts and builds
/// what it needs like any worker, then waits in [`ElasticGroup::init`]
/// until the launcher promotes it into a failed worker's slot (writing the
/// slot's local rank there), and joins the running group as a relaunched
/// worker would, without paying its start-up.
pub const STANDBY_ENV: &str = "CHORUS_STANDBY";
/// How long one wait of a standby worker on its key lasts before it waits again.
const STANDBY_WAIT: Duration = Duration::from_secs(60);
/// How often rank 0 of a healthy group looks for processes waiting to join
/// (SV-13): a joiner waits for this look, so it is short, and one rank's
/// reads are cheap for the store.
const JOINER_POLL: Duration = Duration::from_millis(50);
/// How often the other ranks look, so that admission does not hang on
/// rank 0 alone.
const JOINER_POLL_BACKUP: Duration = Duration::from_millis(500);
/// How often an elastic rendezvous reads the store while waiting.
const RENDEZVOUS_POLL: Duration = Duration::from_millis(20);
/// How long a joiner waits for a step boundary under
/// [`Admission::at_step_boundary`] before the group restarts anyway.
pub const DEFAULT_BOUNDARY_WAIT: Duration = Duration::from_secs(10);

/// When an elastic group admits a process waiting to join (SV-13).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// The running generation restarts as soon as a joiner is seen; a
    /// step under way fails and is run again.
    Immediate,
    /// The members admit it at a step boundary: after a commit vote that
    /// said a joiner waits, the next generation forms beside the running
    /// one, and the members swap to it between two steps (`chorus::train`
    /// does this). After `longest` without a boundary, at once.
    AtStepBoundary {
        /// The longest a joiner waits for a boundary.
        longest: Duration,
    },
}

impl Admission {
    /// [`Admission::AtStepBoundary`] with [`DEFAULT_BOUNDARY_WAIT`].
    pub fn at_step_boundary() -> Self {
        Admission::AtStepBoundary {
            longest: DEFAULT_BOUNDARY_WAIT,
        }
    }
}

/// Why an elastic group could not form, or stopped restarting.
#[derive(Error)]
pub enum RestartError {
    /// Forming a generation (peer exchange, links, actor) failed.
    #[error(transparent)]
    Init(#[from] InitError),
    /// The elastic rendezvous failed.
    #[error(transparent)]
    Rendezvous(#[from] elastic_rdzv::ElasticError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A setting does not parse.
    #[error("{name}={value:?}: {expected}")]
    BadSetting {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What it should be.
        expected: &'static str,
    },
    /// This process was started to join a running group (`CHORUS_ELASTIC_JOIN`)
    /// and none formed in time.
    #[error("{JOIN_ENV}=1 but no generation of run {run_id:?} formed within {waited:?}: nothing to join")]
    NothingToJoin {
        /// The run.
        run_id: String,
        /// How long it waited.
        waited: Duration,
    },
    /// The restart budget is spent (SV-12).
    #[error("restart budget spent: {} failure(s) in {window:?} with at most {max_restarts} restart(s) allowed; failures: {}", failures.len(), describe(failures))]
    BudgetSpent {
        /// Restarts allowed per window.
        max_restarts: u32,
        /// The window.
        window: Duration,
        /// Every failure seen, oldest first.
        failures: Vec<GroupAborted>,
    },
    /// The store went out of reach while the group re-formed: the next
    /// generation cannot meet without it.
    #[error(
        "lost the job's store {location} while re-forming the group after generation {generation} ({source}): {}; failures so far: {}",
        lost_store_hint(location),
        describe(failures)
    )]
    StoreLost {
        /// Where the store was (`tcp://host:port`, `etcd://...`).
        location: String,
        /// The generation that failed.
        generation: u64,
        /// What the store did (boxed: it would make every `RestartError` large).
        #[source]
        source: Box<StoreError>,
        /// Every failure seen, oldest first.
        failures: Vec<GroupAborted>,
    },
    /// A restart could not form its generation.
    #[error(
        "restart after generation {generation} failed: {source}; failures so far: {}",
        describe(failures)
    )]
    RestartFailed {
        /// The generation that failed.
        generation: u64,
        /// Why the next could not form.
        #[source]
        source: Box<RestartError>,
        /// Every failure seen, oldest first.
        failures: Vec<GroupAborted>,
    },
}

chorus_runtime::debug_as_report!(RestartError);

/// What losing the store at `location` means and what avoids it: a
/// store served by one process (`tcp://`, the launcher's c10d store) dies
/// with its host; etcd is lost only when no member answers.
fn lost_store_hint(location: &str) -> &'static str {
    if location.starts_with("etcd://") {
        "etcd answers at none of its endpoints, and the group cannot re-form without it"
    } else if location.starts_with("tcp://") {
        "the process serving it (with `chorus launch`, node 0's launcher) is gone with its host, and the group cannot re-form without it: that store is a single point of failure; `chorus launch --rdzv-backend etcd` with a 3-member etcd cluster avoids it"
    } else {
        "the group cannot re-form without it"
    }
}

/// `error`'s store error when the store itself is out of reach (its
/// connection broke, or it stopped answering), as opposed to a late key or
/// a refused request; otherwise `error` back.
fn into_lost_store(error: RestartError) -> Result<StoreError, RestartError> {
    let lost = |e: &StoreError| {
        matches!(
            e,
            StoreError::Unreachable { .. }
                | StoreError::NoReply { .. }
                | StoreError::Io { .. }
                | StoreError::ConnectionClosed { .. }
        )
    };
    let lost_in_init = |e: &InitError| match e.cause() {
        InitError::Store(e) | InitError::Rendezvous(RendezvousError::Store(e)) => lost(e),
        _ => false,
    };
    match error {
        RestartError::Store(e) | RestartError::Rendezvous(elastic_rdzv::ElasticError::Store(e)) if lost(&e) => Ok(e),
        // Whichever stage ran out of time when the store went.
        RestartError::Init(e) if lost_in_init(&e) => match e.into_cause() {
            InitError::Store(e) | InitError::Rendezvous(RendezvousError::Store(e)) => Ok(e),
            other => Err(RestartError::Init(other)),
        },
        error => Err(error),
    }
}

fn describe(failures: &[GroupAborted]) -> String {
    let each: Vec<String> = failures
        .iter()
        .map(|f| format!("[{f}; failed ranks {:?}]", f.failed_ranks))
        .collect();
    each.join(" ")
}

/// One membership change, emitted after a restart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembershipChange {
    /// The new generation.
    pub generation: u64,
    /// This process's rank in the previous generation (`None` if it had none).
    pub old_rank: Option<usize>,
    /// Its rank now.
    pub new_rank: usize,
    /// The new world size.
    pub world_size: usize,
}

/// The restart budget (SV-12), sans IO: failures go in with their time.
#[derive(Debug)]
pub(crate) struct RestartBudget {
    max_restarts: u32,
    window: Duration,
    restarts: VecDeque<Instant>,
    failures: Vec<GroupAborted>,
}

impl RestartBudget {
    pub(crate) fn new(max_restarts: u32, window: Duration) -> Self {
        Self {
            max_restarts,
            window,
            restarts: VecDeque::new(),
            failures: Vec::new(),
        }
    }

    /// Records `failure` at `now`; `Ok` when a restart is within budget.
    pub(crate) fn admit(&mut self, failure: GroupAborted, now: Instant) -> Result<(), RestartError> {
        self.failures.push(failure);
        while self
            .restarts
            .front()
            .is_some_and(|&t| now.duration_since(t) >= self.window)
        {
            self.restarts.pop_front();
        }
        if self.restarts.len() >= self.max_restarts as usize {
            return Err(RestartError::BudgetSpent {
                max_restarts: self.max_restarts,
                window: self.window,
                failures: self.failures.clone(),
            });
        }
        self.restarts.push_back(now);
        Ok(())
    }

    pub(crate) fn failures(&self) -> &[GroupAborted] {
        &self.failures
    }
}

/// What forming any generation of this process needs.
#[derive(Clone)]
struct Base {
    config: RendezvousConfig,
    store: Arc<dyn Store>,
    /// Looked up once, for every generation.
    master: Master,
    options: InitOptions,
    min_world: usize,
    max_world: usize,
    me: Joiner,
}

impl Base {
    /// The elastic rendezvous of `generation`.
    fn rendezvous(&self, generation: u64) -> ElasticConfig {
        ElasticConfig {
            run_id: self.config.run_id.clone(),
            generation,
            min_world: self.min_world,
            max_world: self.max_world,
            last_call: self.options.last_call,
            timeout: self.options.timeout,
            poll: RENDEZVOUS_POLL,
        }
    }

    /// Joins generation `generation` (or a later one, when late), then forms it.
    /// A survivor brings its place in the generation it leaves.
    /// Once admitted, `survivor` becomes this process's place in the new
    /// generation, so that a generation which then fails to form is the one
    /// the next must hold a quorum of (SV-16).
    async fn form(&self, mut generation: u64, survivor: &mut Option<Survivor>) -> Result<ProcessGroup, RestartError> {
        let old_rank = survivor.as_ref().map(|s| s.old_rank);
        let me = Joiner {
            old_rank: old_rank.map(|r| r as u32),
            previous_generation: survivor.as_ref().and_then(|s| s.generation),
            previous_world: survivor.as_ref().map(|s| s.world_size as u32),
            failed: survivor
                .as_ref()
                .map_or_else(Vec::new, |s| s.failed.iter().map(|&r| r as u32).collect()),
            ..self.me.clone()
        };
        loop {
            let started = Instant::now();
            let elastic = self.rendezvous(generation);
            let admission = match elastic_rdzv::join(self.store.clone(), &elastic, me.clone()).await {
                Ok(admission) => admission,
                Err(elastic_rdzv::ElasticError::Late { .. }) => {
                    generation += 1;
                    continue;
                }
                Err(other) => return Err(other.into()),
            };
            let admitted = started.elapsed();
            let initial = generation == self.config.generation && Some(admission.rank) == old_rank;
            *survivor = Some(Survivor {
                old_rank: admission.rank,
                world_size: admission.world_size(),
                generation: Some(generation),
                failed: Vec::new(),
            });
            let config = RendezvousConfig {
                rank: admission.rank,
                world_size: admission.world_size(),
                generation,
                serve_store: false,
                // The launcher's local numbering holds only for the launch layout.
                local_rank: self
                    .config
                    .local_rank
                    .filter(|_| initial && admission.world_size() == self.config.world_size),
                local_world_size: self
                    .config
                    .local_world_size
                    .filter(|_| initial && admission.world_size() == self.config.world_size),
                ..self.config.clone()
            };
            let opened = OpenedStore {
                store: self.store.clone(),
                server: None,
            };
            let group = form(
                config,
                opened,
                LinkSource::Mesh { world: self.max_world },
                self.master,
                &self.options,
                Deadline::after(self.options.timeout),
            )
            .await?;
            elastic_rdzv::publish_latest(&self.store, &self.config.run_id, generation).await?;
            tracing::info!(
                generation,
                rank = admission.rank,
                world_size = admission.world_size(),
                rendezvous_ms = admitted.as_secs_f64() * 1e3,
                connect_ms = (started.elapsed() - admitted).as_secs_f64() * 1e3,
                "generation formed"
            );
            return Ok(group);
        }
    }
}

/// A survivor's place in the generation it leaves, for the elastic
/// rendezvous of the next one.
#[derive(Debug, Clone)]
struct Survivor {
    old_rank: usize,
    world_size: usize,
    /// The generation `old_rank` is in (`None` before the first one).
    generation: Option<u64>,
    /// Ranks it saw fail, so the survivors need not wait for them.
    failed: Vec<usize>,
}

/// What the handle and its supervisor share.
struct Shared {
    current: watch::Sender<Arc<ProcessGroup>>,
    events: broadcast::Sender<MembershipChange>,
    gave_up: watch::Sender<Option<Arc<RestartError>>>,
    admission: Admission,
    /// The generation in which this process saw joiners waiting for a
    /// step boundary.
    joiners_seen: watch::Sender<Option<u64>>,
    /// The generation whose members agreed to admit at this boundary.
    admit_requested: watch::Sender<Option<u64>>,
    /// The generation whose successor this process has formed beside it.
    next_ready: watch::Sender<Option<u64>>,
    /// The generation whose members agreed to swap to its successor.
    swap_requested: watch::Sender<Option<u64>>,
}

/// A process group that survives failures of its members: see the module docs.
pub struct ElasticGroup {
    shared: Arc<Shared>,
    supervisor: GroupSupervisor,
    /// The store server, when this process hosts it (kept across generations).
    server: Option<TcpStoreServer>,
    /// The job's store and run id, to record that it finished.
    job: (Arc<dyn Store>, String),
}

impl std::fmt::Debug for ElasticGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ElasticGroup")
            .field("current", &*self.shared.current.borrow())
            .finish()
    }
}

/// The task that restarts an [`ElasticGroup`] (SV-9, SV-12, SV-13); it
/// stops when the group is dropped or destroyed.
#[derive(Debug)]
pub struct GroupSupervisor {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for GroupSupervisor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the supervisor does when it gives up: print and exit, so a
/// launcher sees the failure. A job whose members finished it as this
/// process came has nothing for it to do: that exit is a success.
pub fn exit_on_give_up(error: &RestartError) {
    if error.job_finished() {
        eprintln!("chorus: the job ended as this process joined it ({error}); it exits");
        std::process::exit(0);
    }
    eprintln!("chorus: elastic group gives up: {error}");
    std::process::exit(1);
}

/// The newest formed generation of `run_id`, waiting up to `timeout` for
/// the first one.
async fn wait_for_latest(store: &Arc<dyn Store>, run_id: &str, timeout: Duration) -> Result<u64, RestartError> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(latest) = elastic_rdzv::latest(store, run_id).await? {
            return Ok(latest);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(RestartError::NothingToJoin {
                run_id: run_id.to_string(),
                waited: timeout,
            });
        }
        tokio::time::sleep(RENDEZVOUS_POLL).await;
    }
}

/// Waits, as long as it takes, until the launcher writes `key` (a standby
/// worker's promotion) and returns what it wrote; fails only when the store does.
async fn wait_for_promotion(store: &Arc<dyn Store>, key: &str) -> Result<String, RestartError> {
    loop {
        match store.wait_timeout(&[key], STANDBY_WAIT).await {
            Ok(()) => return Ok(String::from_utf8_lossy(&store.get(key).await?).into_owned()),
            Err(error) if error.is_timeout() => continue,
            Err(error) => return Err(error.into()),
        }
    }
}

/// A world-size bound from the environment, if set.
fn world_from_env(name: &'static str) -> Result<Option<usize>, RestartError> {
    match std::env::var(name).ok().filter(|v| !v.trim().is_empty()) {
        Some(value) => match value.trim().parse() {
            Ok(n @ 1..) => Ok(Some(n)),
            _ => Err(RestartError::BadSetting {
                name,
                value,
                expected: "a number of ranks, 1 or more",
            }),
        },
        None => Ok(None),
    }
}

fn budget_from(options: &InitOptions) -> Result<RestartBudget, RestartError> {
    let env = |name: &str| std::env::var(name).ok();
    let max_restarts = match options.max_restarts {
        Some(n) => n,
        None => match env(MAX_RESTARTS_ENV).filter(|v| !v.trim().is_empty()) {
            Some(value) => value.trim().parse().map_err(|_| RestartError::BadSetting {
                name: MAX_RESTARTS_ENV,
                value,
                expected: "a number of restarts, 0 or more",
            })?,
            None => DEFAULT_MAX_RESTARTS,
        },
    };
    let window = match options.restart_window {
        Some(window) => window,
        None => supervision::seconds_from_env(&env, RESTART_WINDOW_ENV)
            .map_err(InitError::Supervision)?
            .unwrap_or(DEFAULT_RESTART_WINDOW),
    };
    Ok(RestartBudget::new(max_restarts, window))
}

impl RestartError {
    /// Whether the job finished before this process could join it.
    pub fn job_finished(&self) -> bool {
        matches!(
            self,
            RestartError::Rendezvous(elastic_rdzv::ElasticError::Finished { .. })
        )
    }
}

impl ElasticGroup {
    /// Forms the group (as [`init_process_group`](crate::init_process_group)
    /// does, through an elastic rendezvous) and starts its supervisor, which
    /// exits the process when it gives up (SV-12).
    ///
    /// A process that finds the job already running (a relaunched worker, a
    /// new node) joins its next generation as a new member.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, as [`init_process_group`](crate::init_process_group):
    /// dropped after its elastic rendezvous admitted this process, the
    /// generation waits for it and fails to form, and the others retry
    /// without it.
    pub async fn init(options: InitOptions) -> Result<Self, RestartError> {
        Self::init_with(options, exit_on_give_up).await
    }

    /// [`ElasticGroup::init`] with another give-up action (it runs on the
    /// supervisor's task; [`ElasticGroup::gave_up`] reports the error too).
    pub async fn init_with(
        options: InitOptions,
        on_give_up: impl Fn(&RestartError) + Send + Sync + 'static,
    ) -> Result<Self, RestartError> {
        let options = options.with_env_defaults()?;
        let env = |name: &str| std::env::var(name).ok();
        let mut config = rendezvous::resolve(options.init_method.clone(), options.rank, options.world_size, &env)
            .map_err(InitError::from)?;
        // A launcher that restarts every worker (`--restart-policy all`) makes
        // each attempt a job of its own, and one run may hold several elastic
        // groups (a replica group's shards): keys under `<run id>/<scope>...`.
        for scope in [env(SCOPE_ENV), options.elastic_scope.clone()].into_iter().flatten() {
            if !scope.trim().is_empty() {
                config.run_id = format!("{}/{}", config.run_id, scope.trim());
            }
        }
        let budget = budget_from(&options)?;
        let opened = rendezvous::open_store(&config, options.timeout)
            .await
            .map_err(InitError::from)?;
        let min_world = match options.min_world {
            Some(n) => n,
            None => world_from_env(MIN_WORLD_ENV)?.unwrap_or(config.world_size),
        };
        let max_world = match options.max_world {
            Some(n) => n,
            None => world_from_env(MAX_WORLD_ENV)?.unwrap_or(config.world_size.max(min_world)),
        };
        let base = Base {
            master: Master::resolve(
                &config,
                options.store_host.as_deref(),
                &Deadline::after(options.timeout),
            )
            .await?,
            store: opened.store.clone(),
            me: Joiner {
                old_rank: None,
                previous_generation: None,
                previous_world: None,
                failed: Vec::new(),
                hostname: rendezvous::HostId::local().hostname,
                pid: std::process::id(),
                nonce: next_nonce(),
            },
            config,
            options,
            min_world,
            max_world,
        };
        if let Some(key) = env(STANDBY_ENV).filter(|k| !k.trim().is_empty()) {
            let slot = wait_for_promotion(&base.store, key.trim()).await?;
            tracing::info!(target: "chorus::elastic", slot = %slot, "standby worker promoted; joining the running group");
        }
        let latest = match std::env::var(JOIN_ENV).is_ok_and(|v| v.trim() == "1") {
            // Started to join a running group (a relaunched worker, a late
            // node): wait for its first generation rather than form one.
            true => Some(wait_for_latest(&base.store, &base.config.run_id, base.options.timeout).await?),
            false => elastic_rdzv::latest(&base.store, &base.config.run_id).await?,
        };
        let group = match latest {
            // The job runs: join its next generation as a new member; or,
            // when its members are re-forming it after a failure right now
            // and admit joiners at a step boundary, the one after, so that
            // the step they are in the middle of is not given up for it.
            // Not when fewer than the minimum world re-form it so far: they
            // may need this joiner to form at all (and, waiting for them in
            // the generation after, it would wait out the formation timeout).
            Some(latest) => {
                let after_failure = matches!(base.options.admission, Admission::AtStepBoundary { .. })
                    && elastic_rdzv::forming(base.store.clone(), &base.rendezvous(latest + 1)).await? >= base.min_world;
                base.form(latest + 1 + u64::from(after_failure), &mut None).await?
            }
            None => {
                let mut first = Some(Survivor {
                    old_rank: base.config.rank,
                    world_size: base.config.world_size,
                    generation: None,
                    failed: Vec::new(),
                });
                base.form(base.config.generation, &mut first).await?
            }
        };
        let shared = Arc::new(Shared {
            current: watch::Sender::new(Arc::new(group)),
            events: broadcast::channel(64).0,
            gave_up: watch::Sender::new(None),
            admission: base.options.admission,
            joiners_seen: watch::Sender::new(None),
            admit_requested: watch::Sender::new(None),
            next_ready: watch::Sender::new(None),
            swap_requested: watch::Sender::new(None),
        });
        let job = (base.store.clone(), base.config.run_id.clone());
        let task = tokio::spawn(supervise(shared.clone(), base, budget, Box::new(on_give_up)));
        Ok(Self {
            shared,
            supervisor: GroupSupervisor { task },
            server: opened.server,
            job,
        })
    }

    /// The current generation's group: every `ProcessGroup` method works on
    /// it. After a failure it stays the aborted one (its operations fail at
    /// once) until the next generation is swapped in.
    pub fn current(&self) -> Arc<ProcessGroup> {
        self.shared.current.borrow().clone()
    }

    /// This rank in the current generation.
    pub fn rank(&self) -> usize {
        self.current().rank()
    }

    /// The current world size.
    pub fn world_size(&self) -> usize {
        self.current().world_size()
    }

    /// The current generation.
    pub fn generation(&self) -> u64 {
        self.current().generation()
    }

    /// The current generation's group, as it changes (for what follows the
    /// group through its generations, e.g. `ElasticNccl`).
    pub(crate) fn generations(&self) -> watch::Receiver<Arc<ProcessGroup>> {
        self.shared.current.subscribe()
    }

    /// The job's store and run id (for what a process publishes there:
    /// `train::live`).
    pub(crate) fn job_store(&self) -> (&Arc<dyn Store>, &str) {
        (&self.job.0, &self.job.1)
    }

    /// Membership changes from now on, one per restart.
    pub fn events(&self) -> broadcast::Receiver<MembershipChange> {
        self.shared.events.subscribe()
    }

    /// Why the supervisor gave up, once it did (SV-12).
    pub fn gave_up(&self) -> Option<Arc<RestartError>> {
        self.shared.gave_up.borrow().clone()
    }

    /// Waits until a generation after `generation` runs and returns it, or
    /// returns why the supervisor gave up.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only watches; the supervisor re-forms the group
    /// whether or not anyone waits.
    pub async fn next_generation(&self, generation: u64) -> Result<Arc<ProcessGroup>, Arc<RestartError>> {
        let mut current = self.shared.current.subscribe();
        let mut gave_up = self.shared.gave_up.subscribe();
        tokio::select! {
            Ok(group) = current.wait_for(|g| g.generation() > generation) => Ok(group.clone()),
            Ok(error) = gave_up.wait_for(Option::is_some) => Err(error.clone().expect("waited for Some")),
        }
    }

    /// Whether this process saw processes waiting to join `generation`'s
    /// group at its next step boundary (under [`Admission::AtStepBoundary`]).
    pub fn joiners_waiting(&self, generation: u64) -> bool {
        *self.shared.joiners_seen.borrow() == Some(generation)
    }

    /// Admits the processes waiting to join `group`'s generation, once
    /// every member agreed at a step boundary (their commit vote said some
    /// wait): the supervisor forms the next generation with them beside
    /// this one, which keeps running (SV-13). The membership change
    /// charges no restart. Swap to it with
    /// [`swap_at_boundary`](Self::swap_at_boundary).
    pub fn admit_at_boundary(&self, group: &ProcessGroup) {
        self.shared.admit_requested.send_replace(Some(group.generation()));
    }

    /// Whether this process holds the generation after `generation`,
    /// formed beside it and waiting for the members' swap (a step's vote
    /// says so).
    pub fn next_ready(&self, generation: u64) -> bool {
        *self.shared.next_ready.borrow() == Some(generation)
    }

    /// Swaps `group`'s generation for the next one formed beside it, at a
    /// step boundary where every member holds it (their vote said so), or
    /// once this process holds it when called before: the members pass a
    /// barrier on `group` (so ending it cuts no vote short), then the next
    /// generation becomes current. Returns once it is, or once `group`
    /// failed or the supervisor gave up (then wait for the next generation
    /// as after a failure).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a drop before the swap is asked leaves it unasked, and
    /// the supervisor swaps once the bound passed.
    pub async fn swap_at_boundary(&self, group: &ProcessGroup) {
        let generation = group.generation();
        let mut ready = self.shared.next_ready.subscribe();
        let mut failures = group.failures();
        let mut gave_up = self.shared.gave_up.subscribe();
        tokio::select! {
            _ = ready.wait_for(|g| *g == Some(generation)) => {}
            _ = failures.wait_for(Option::is_some) => return,
            _ = gave_up.wait_for(Option::is_some) => return,
        }
        let _ = group.barrier().await;
        self.shared.swap_requested.send_replace(Some(generation));
        let _ = self.next_generation(generation).await;
    }

    /// All-reduce on the current generation.
    pub fn all_reduce(&self, tensor: Tensor, op: ReduceOp) -> Work<Tensor> {
        self.current().all_reduce(tensor, op)
    }

    /// Broadcast from `root` on the current generation.
    pub fn broadcast(&self, tensor: Tensor, root: usize) -> Work<Tensor> {
        self.current().broadcast(tensor, root)
    }

    /// All-gather on the current generation.
    pub fn all_gather(&self, tensor: Tensor) -> Work<Tensor> {
        self.current().all_gather(tensor)
    }

    /// Barrier on the current generation.
    pub fn barrier(&self) -> Work<()> {
        self.current().barrier()
    }

    /// Stops the supervisor, so ranks leaving are not restarted; the rest,
    /// for the caller to leave.
    fn stop_supervisor(self) -> (Arc<Shared>, Option<TcpStoreServer>) {
        let Self {
            shared,
            supervisor,
            server,
            job: _,
        } = self;
        drop(supervisor);
        (shared, server)
    }

    /// Leaves the job now, from this process alone (a service's shutdown
    /// path), where [`destroy`](Self::destroy) waits for every rank: the
    /// supervisor stops, pending operations fail with
    /// [`GroupAborted`] (reason `Shutdown`), and the
    /// links close with a notice naming this rank gone, so the others
    /// re-form without it at once (their elastic rendezvous accounts for
    /// it as for a rank seen to fail, and their restart budget is not
    /// charged) instead of waiting out a heartbeat window. A store server
    /// this process holds stops too: leave the serving process last.
    pub async fn shutdown(self, why: &str) {
        let (shared, server) = self.stop_supervisor();
        shared.current.borrow().leave_now(why);
        drop(shared);
        if let Some(server) = server {
            server.shutdown().await;
        }
    }

    /// Whether the job's members left it on purpose (it ended): a member
    /// that came as they finished has nothing left to do.
    pub async fn job_finished(&self) -> Result<bool, StoreError> {
        let (store, run_id) = &self.job;
        elastic_rdzv::is_finished(store.as_ref(), run_id).await
    }

    /// Leaves once every rank of the current generation leaves: stops the
    /// supervisor first, so ranks leaving are not restarted.
    pub async fn destroy(self) -> Result<(), InitError> {
        let (store, run_id) = self.job.clone();
        let (shared, server) = self.stop_supervisor();
        let group = shared.current.borrow().clone();
        // The members leave: a late joiner has nothing to wait for, and one
        // admitted as they took their last step learns it before their
        // last barrier, which it then joins (the store may already be gone
        // with it, which changes nothing).
        let _ = elastic_rdzv::publish_finished(store.as_ref(), &run_id).await;
        group.leave().await?;
        drop(group);
        drop(shared);
        if let Some(server) = server {
            server.shutdown().await;
        }
        Ok(())
    }
}

/// Tells apart the participants of this process (ranks in one process
/// share its pid).
fn next_nonce() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Returns how many processes wait to join the next generation, once some
/// do and there is room for them (SV-13).
async fn watch_joiners(group: &ProcessGroup, base: &Base) -> usize {
    let next = base.rendezvous(group.generation() + 1);
    let poll = if group.rank() == 0 {
        JOINER_POLL
    } else {
        JOINER_POLL_BACKUP
    };
    loop {
        tokio::time::sleep(poll).await;
        if group.world_size() >= base.max_world {
            continue;
        }
        if let Ok(waiting @ 1..) = elastic_rdzv::newcomers(base.store.clone(), &next).await {
            return waiting;
        }
    }
}

/// How the running generation makes way for processes waiting to join.
enum Admit {
    /// Restart now: joiners seen under [`Admission::Immediate`], or no
    /// step boundary came within the bound.
    Restart(String),
    /// The members agreed at a step boundary: form the next generation
    /// beside this one.
    Beside,
}

/// Returns how the group admits processes waiting to join: once some do,
/// at once or (under [`Admission::AtStepBoundary`]) when the members ask
/// at a step boundary, whichever process saw them first.
async fn admission(group: &ProcessGroup, base: &Base, shared: &Shared) -> Admit {
    let generation = group.generation();
    let mut requested = shared.admit_requested.subscribe();
    let seen = async {
        let waiting = watch_joiners(group, base).await;
        let why = format!("{waiting} process(es) wait to join generation {}", generation + 1);
        let Admission::AtStepBoundary { longest } = shared.admission else {
            return why;
        };
        shared.joiners_seen.send_replace(Some(generation));
        tokio::time::sleep(longest).await;
        format!("{why}; no step boundary came within {longest:?}")
    };
    tokio::select! {
        why = seen => Admit::Restart(why),
        Ok(_) = requested.wait_for(|g| *g == Some(generation)) => Admit::Beside,
    }
}

/// How a generation formed beside the running one ended.
enum Beside {
    /// It is current now.
    Swapped,
    /// It failed before the swap; the running one ended with it.
    Failed(GroupAborted),
}

/// Forms the generation after `group`'s beside it while it keeps running
/// (SV-13), then swaps it in once the members ask at a step boundary, or
/// at once when `group` fails, or after the bound. A formation that fails
/// ends `group` too, and its error is returned.
async fn form_beside(
    shared: &Shared,
    base: &Base,
    group: &ProcessGroup,
    survivor: &mut Option<Survivor>,
) -> Result<Beside, RestartError> {
    let generation = group.generation();
    let end = |why: &str| {
        group.abort(why.to_string());
        group.tear_down(why);
    };
    let started = Instant::now();
    let next = match base.form(generation + 1, survivor).await {
        Ok(next) => next,
        Err(error) => {
            end(&format!(
                "generation {} did not form beside it: {error}",
                generation + 1
            ));
            return Err(error);
        }
    };
    tracing::info!(
        generation = next.generation(),
        rank = next.rank(),
        formed_ms = started.elapsed().as_secs_f64() * 1e3,
        "next generation formed beside the running one"
    );
    if next.generation() != generation + 1 {
        // Late for the generation beside it: the others formed it without
        // this process, which is in a later one; the running one is over.
        end(&format!("generation {} formed without this process", generation + 1));
        install(shared, next, group.rank());
        return Ok(Beside::Swapped);
    }
    let next = HeldBeside(Some(next));
    let bound = match shared.admission {
        Admission::AtStepBoundary { longest } => longest,
        Admission::Immediate => Duration::ZERO,
    };
    let mut failures = group.failures();
    let mut next_failures = next.failures();
    let mut swap = shared.swap_requested.subscribe();
    shared.next_ready.send_replace(Some(generation));
    let why = tokio::select! {
        Ok(_) = swap.wait_for(|g| *g == Some(generation)) => {
            format!("the members swapped to generation {} at a step boundary", next.generation())
        }
        Ok(_) = failures.wait_for(Option::is_some) => {
            format!("generation {generation} failed with generation {} formed beside it", next.generation())
        }
        Ok(aborted) = next_failures.wait_for(Option::is_some) => {
            let aborted = aborted.clone().expect("waited for Some");
            shared.next_ready.send_replace(None);
            end(&format!("generation {} failed before the swap: {aborted}", next.generation()));
            next.take().tear_down(&aborted.to_string());
            return Ok(Beside::Failed(aborted));
        }
        () = tokio::time::sleep(bound) => {
            format!("no step boundary came within {bound:?} to swap to generation {}", next.generation())
        }
    };
    shared.next_ready.send_replace(None);
    end(&why);
    tracing::info!(generation, rank = group.rank(), "{why}");
    install(shared, next.take(), group.rank());
    Ok(Beside::Swapped)
}

/// A generation formed beside the running one, until it is swapped in or
/// ends. Dropped with it (the supervisor stopped: this process leaves the
/// job), it closes with a notice, so that its other members see this
/// process leave rather than crash.
struct HeldBeside(Option<ProcessGroup>);

impl HeldBeside {
    fn take(mut self) -> ProcessGroup {
        self.0.take().expect("held until taken")
    }
}

impl std::ops::Deref for HeldBeside {
    type Target = ProcessGroup;

    fn deref(&self) -> &ProcessGroup {
        self.0.as_ref().expect("held until taken")
    }
}

impl Drop for HeldBeside {
    fn drop(&mut self) {
        if let Some(next) = self.0.take() {
            next.leave_now("this process left the job before the members swapped to the next generation");
        }
    }
}

/// Makes `next` the current generation and says so.
fn install(shared: &Shared, next: ProcessGroup, old_rank: usize) {
    let change = MembershipChange {
        generation: next.generation(),
        old_rank: Some(old_rank),
        new_rank: next.rank(),
        world_size: next.world_size(),
    };
    tracing::info!(?change, "group restarted");
    chorus_actors::metrics::count_restart(next.run_id());
    shared.current.send_replace(Arc::new(next));
    let _ = shared.events.send(change);
}

/// Where a restart begins: the generation to form, this process's place
/// in the one it leaves, and a formation already tried beside it.
struct Restart {
    generation: u64,
    survivor: Survivor,
    tried: Option<Result<ProcessGroup, RestartError>>,
}

/// The supervisor's loop: wait for an abort or a joiner, then restart or
/// swap (SV-9, SV-12, SV-13).
async fn supervise(
    shared: Arc<Shared>,
    base: Base,
    mut budget: RestartBudget,
    on_give_up: Box<dyn Fn(&RestartError) + Send + Sync>,
) {
    let give_up = |error: RestartError| {
        on_give_up(&error);
        shared.gave_up.send_replace(Some(Arc::new(error)));
    };
    loop {
        let group = shared.current.borrow().clone();
        let mut failures = group.failures();
        let admit = tokio::select! {
            seen = failures.wait_for(Option::is_some) => match seen {
                Ok(aborted) => Err(aborted.clone().expect("waited for Some")),
                // The group's supervision is gone: nothing left to restart.
                Err(_) => return,
            },
            admit = admission(&group, &base, &shared) => Ok(admit),
        };
        let restart = match admit {
            Ok(Admit::Restart(why)) => {
                group.abort(why.clone());
                group.tear_down(&why);
                tracing::info!(
                    generation = group.generation(),
                    rank = group.rank(),
                    "{why}; restarting to admit them"
                );
                Ok(Some(Restart::after(&group, Vec::new())))
            }
            Ok(Admit::Beside) => admit_beside(&shared, &base, &group, &mut budget).await,
            Err(aborted) => after_abort(&shared, &base, &group, aborted, &mut budget)
                .await
                .map(Some),
        };
        let (old_rank, old_generation) = (group.rank(), group.generation());
        drop(group);
        match restart {
            Ok(None) => {}
            Ok(Some(restart)) => match reform(&base, &mut budget, old_generation, restart).await {
                Ok(next) => install(&shared, next, old_rank),
                Err(error) => return give_up(error),
            },
            Err(error) => return give_up(error),
        }
    }
}

impl Restart {
    /// Into the generation after `group`'s, which failed with `failed`.
    fn after(group: &ProcessGroup, failed: Vec<usize>) -> Self {
        Self {
            generation: group.generation() + 1,
            survivor: Survivor {
                old_rank: group.rank(),
                world_size: group.world_size(),
                generation: Some(group.generation()),
                failed,
            },
            tried: None,
        }
    }
}

/// The members agreed to admit joiners: forms their generation beside
/// `group` ([`form_beside`]). `None` once it is swapped in; otherwise the
/// restart to run, charged to the budget when the new generation failed
/// before the swap (its members are known: it restarts from there).
async fn admit_beside(
    shared: &Shared,
    base: &Base,
    group: &ProcessGroup,
    budget: &mut RestartBudget,
) -> Result<Option<Restart>, RestartError> {
    let mut restart = Restart::after(group, Vec::new());
    let mut place = Some(restart.survivor.clone());
    match form_beside(shared, base, group, &mut place).await {
        Ok(Beside::Swapped) => return Ok(None),
        Ok(Beside::Failed(aborted)) => {
            restart.generation = aborted.generation + 1;
            restart.survivor = place.expect("a formed generation leaves a place");
            restart.survivor.failed = aborted.failed_ranks.clone();
            if !aborted.reason.peers_shut_down() {
                budget.admit(aborted, Instant::now())?;
            }
        }
        Err(error) => {
            restart.survivor = place.unwrap_or(restart.survivor);
            restart.tried = Some(Err(error));
        }
    }
    Ok(Some(restart))
}

/// `group` aborted: ends it and charges the restart budget (SV-12), unless
/// the abort admits a newcomer (SV-13) or the peers gone left on purpose.
async fn after_abort(
    shared: &Shared,
    base: &Base,
    group: &ProcessGroup,
    aborted: GroupAborted,
    budget: &mut RestartBudget,
) -> Result<Restart, RestartError> {
    let (generation, rank) = (group.generation(), group.rank());
    group.tear_down(&aborted.to_string());
    let restart = Restart::after(group, aborted.failed_ranks.clone());
    // Another rank may have aborted to admit a newcomer (SV-13): this rank
    // then sees that rank's links close.
    let admitting = *shared.admit_requested.borrow() == Some(generation)
        || group.world_size() < base.max_world
            && matches!(
                elastic_rdzv::newcomers(base.store.clone(), &base.rendezvous(generation + 1)).await,
                Ok(1..)
            );
    if admitting || aborted.reason.peers_shut_down() {
        tracing::info!(
            generation,
            rank,
            "{aborted}; processes wait to join: restarting to admit them"
        );
    } else {
        budget.admit(aborted, Instant::now())?;
        tracing::warn!(generation, rank, "restarting the group into the next generation");
    }
    Ok(restart)
}

/// Forms the generation after `old_generation`, which this process left
/// as `restart` says: a generation that closes but cannot form is a
/// failure of its own, retried under the budget (SV-12); a lost store or
/// any other error ends the restarts, with the error to give up with.
async fn reform(
    base: &Base,
    budget: &mut RestartBudget,
    old_generation: u64,
    restart: Restart,
) -> Result<ProcessGroup, RestartError> {
    let Restart {
        mut generation,
        survivor,
        mut tried,
    } = restart;
    let old_rank = survivor.old_rank;
    let mut survivor = Some(survivor);
    loop {
        let formed = match tried.take() {
            Some(formed) => formed,
            None => base.form(generation, &mut survivor).await,
        }
        .map_err(into_lost_store);
        match formed {
            Ok(next) => return Ok(next),
            // Retrying cannot help: end at once, saying which store is gone.
            Err(Ok(source)) => {
                return Err(RestartError::StoreLost {
                    location: base.store.location(),
                    generation: old_generation,
                    source: Box::new(source),
                    failures: budget.failures().to_vec(),
                });
            }
            // A member admitted to the generation died before it formed
            // (its records or links never came): a failure of that
            // generation, retried in the next one under the budget (SV-12).
            Err(Err(RestartError::Init(error))) => {
                let failed_ranks = match error.cause() {
                    InitError::Rendezvous(RendezvousError::Incomplete { missing, .. }) => missing.clone(),
                    _ => Vec::new(),
                };
                if let Some(survivor) = &mut survivor {
                    survivor.failed = failed_ranks.clone();
                }
                let failure = GroupAborted {
                    rank: old_rank,
                    generation,
                    reason: AbortReason::OperationFailed(format!("generation {generation} did not form: {error}")),
                    failed_ranks,
                };
                tracing::warn!(generation, "{}; trying the next generation", failure.reason);
                budget.admit(failure, Instant::now())?;
                generation = survivor.as_ref().and_then(|s| s.generation).unwrap_or(generation) + 1;
            }
            Err(Err(source)) => {
                return Err(RestartError::RestartFailed {
                    generation: old_generation,
                    source: Box::new(source),
                    failures: budget.failures().to_vec(),
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_actors::supervision::AbortReason;

    fn failure(generation: u64) -> GroupAborted {
        GroupAborted {
            rank: 1,
            generation,
            reason: AbortReason::OperationFailed("peer 2 closed".into()),
            failed_ranks: vec![2],
        }
    }

    #[test]
    fn a_lost_store_is_named_and_only_a_served_one_points_to_etcd() {
        let closed = |location: &str| StoreError::ConnectionClosed {
            location: location.into(),
            operation: "check",
        };
        let lost = |location: &str| {
            let source = into_lost_store(RestartError::Rendezvous(elastic_rdzv::ElasticError::Store(closed(
                location,
            ))))
            .expect("a closed connection is a lost store");
            RestartError::StoreLost {
                location: location.into(),
                generation: 2,
                source: Box::new(source),
                failures: vec![failure(2)],
            }
            .to_string()
        };
        let served = lost("tcp://10.0.0.1:29400");
        assert!(
            served.contains("lost the job's store tcp://10.0.0.1:29400")
                && served.contains("after generation 2")
                && served.contains("single point of failure")
                && served.contains("--rdzv-backend etcd"),
            "{served}"
        );
        let in_etcd = lost("etcd://e1:2379,e2:2379/chorus");
        assert!(
            in_etcd.contains("etcd answers at none of its endpoints") && !in_etcd.contains("--rdzv-backend"),
            "{in_etcd}"
        );
        // A late key is the store working: not a lost store.
        let late = StoreError::Timeout {
            keys: vec!["k".into()],
            location: "tcp://10.0.0.1:29400".into(),
            waited: Duration::from_secs(1),
        };
        assert!(into_lost_store(RestartError::Store(late)).is_err());
    }

    #[test]
    fn sv12_the_restart_budget_counts_restarts_per_window() {
        let start = Instant::now();
        let mut budget = RestartBudget::new(2, Duration::from_secs(10));
        budget.admit(failure(0), start).unwrap();
        budget.admit(failure(1), start + Duration::from_secs(1)).unwrap();
        let spent = budget.admit(failure(2), start + Duration::from_secs(2)).unwrap_err();
        let text = spent.to_string();
        for generation in 0..3 {
            assert!(text.contains(&format!("generation {generation}")), "{text}");
        }
        assert!(
            text.contains("failed ranks [2]") && text.contains("peer 2 closed"),
            "{text}"
        );
        // Past the window, the oldest restart no longer counts.
        let mut budget = RestartBudget::new(1, Duration::from_secs(10));
        budget.admit(failure(0), start).unwrap();
        budget.admit(failure(1), start + Duration::from_secs(11)).unwrap();
        assert!(
            RestartBudget::new(0, Duration::from_secs(1))
                .admit(failure(0), start)
                .is_err()
        );
    }
}
