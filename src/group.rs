//! [`init_process_group`]: from an init method to a formed group.
//!
//! The steps, each in its own layer: resolve the configuration
//! (`rendezvous::resolve`, reading the launcher's environment), open the
//! store (rank 0 serves `tcp://`), choose the addresses to publish
//! (`netif::local_addresses`: the route to the master first, loopback last),
//! prepare this rank's endpoint (`mesh`), exchange records
//! (`rendezvous::rendezvous`), then connect to every peer. Then, on the
//! rank's arbiter, the actor, the heartbeats and the watchdog start
//! (`chorus_actors::supervision`, rules SV-1..SV-8).

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use actix::{Actor, Addr};
use chorus_actors::driver::FramePool;
use chorus_actors::heartbeat::{self, HeartbeatConfig, HeartbeatMonitor, SharedMonitor};
use chorus_actors::metrics::GroupMetrics;
use chorus_actors::process_watch::ProcessWatch;
use chorus_actors::rank::{Aborted, Drain, RankActor};
use chorus_actors::supervision::{
    self, ErrorHandling, GroupAborted, HEARTBEAT_TIMEOUT_ENV, Supervision, SupervisionConfigError,
    WATCHDOG_TIMEOUT_ENV, WatchdogConfig,
};
use chorus_actors::system::{self, SystemError};
use chorus_runtime::collective::{Overrides, Thresholds};
use chorus_runtime::flight::{self, FlightRecorder};
use chorus_runtime::rendezvous::{
    self, HostId, InitMethod, Membership, PeerRecord, RendezvousConfig, RendezvousError, StoreSpec, elastic,
};
use chorus_runtime::store::{DEFAULT_TIMEOUT, Store, StoreError, TcpStoreServer};
use chorus_runtime::store::{HashStore, PrefixStore};
use chorus_transports::auth::JobSecret;
use chorus_transports::fault::{FaultPlan, wrap_links};
use chorus_transports::link::Link;
use chorus_transports::local::LocalMesh;
use chorus_transports::netif::{self, NetifError};
use chorus_transports::quic::QuicEndpoint;
use chorus_transports::scoped::ScopedLink;
use thiserror::Error;
use tokio::sync::{oneshot, watch};

use crate::elastic::Admission;
use crate::mesh::{LinkOptions, MeshError, MeshPlan, SHM_BUDGET, TransportChoice, checked_faults, parse_shm_budget};

/// Why a group could not be formed.
#[derive(Error)]
pub enum InitError {
    /// Configuration, store or exchange failed.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// No address could be chosen to publish.
    #[error(transparent)]
    Netif(#[from] NetifError),
    /// The store failed after rendezvous (e.g. in a barrier).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The links to the peers could not be made.
    #[error(transparent)]
    Mesh(#[from] MeshError),
    /// The rank's actor could not be started.
    #[error(transparent)]
    System(#[from] SystemError),
    /// `CHORUS_ALGO` or `CHORUS_ALGO_THRESHOLDS` does not parse (the
    /// message names which).
    #[error("{0}")]
    Algorithm(String),
    /// `new_group` was called with bad or disagreeing ranks.
    #[error("{0}")]
    Subgroup(String),
    /// The supervision settings (error-handling mode, timeouts) are wrong.
    #[error(transparent)]
    Supervision(#[from] SupervisionConfigError),
    /// A stage of initialisation ran out of what was left of the one
    /// `timeout` every stage shares; `cause` is the stage's own error
    /// (`None` when it had none to give, e.g. a host lookup that hung).
    #[error(
        "initialisation ran out of its {timeout:?} timeout while {stage}{}",
        cause.as_ref().map(|cause| format!(": {cause}")).unwrap_or_default()
    )]
    TimedOut {
        /// The stage that was running.
        stage: InitStage,
        /// The whole timeout ([`InitOptions::timeout`]).
        timeout: Duration,
        /// What the stage reported when its time ran out.
        cause: Option<Box<InitError>>,
    },
}

impl InitError {
    /// The error behind a [`InitError::TimedOut`] (the stage's own), else
    /// this one.
    pub fn cause(&self) -> &InitError {
        match self {
            InitError::TimedOut { cause: Some(cause), .. } => cause.cause(),
            other => other,
        }
    }

    /// The error behind a [`InitError::TimedOut`] (the stage's own), else
    /// this one: for matching on what went wrong whichever stage ran out.
    pub fn into_cause(self) -> InitError {
        match self {
            InitError::TimedOut { cause: Some(cause), .. } => cause.into_cause(),
            other => other,
        }
    }
}

/// The stages of forming a group, in order; a timeout names the one that
/// ran out ([`InitError::TimedOut`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitStage {
    /// Opening the store (serving it on rank 0 of `tcp://`, connecting).
    StoreConnect,
    /// Looking up the master's (the store's) host.
    MasterLookup,
    /// Publishing this rank's record and waiting for every peer's.
    Rendezvous,
    /// Connecting the links to every peer.
    MeshConnect,
}

impl std::fmt::Display for InitStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            InitStage::StoreConnect => "connecting to the store",
            InitStage::MasterLookup => "looking up the master host",
            InitStage::Rendezvous => "waiting for every rank's record (rendezvous)",
            InitStage::MeshConnect => "connecting to the peers",
        })
    }
}

/// The one deadline of forming a group: each stage gets what is left of
/// the timeout, so the whole ends within it (not a timeout per stage).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    at: tokio::time::Instant,
    timeout: Duration,
}

impl Deadline {
    /// A deadline `timeout` from now.
    pub(crate) fn after(timeout: Duration) -> Self {
        Self {
            at: tokio::time::Instant::now() + timeout,
            timeout,
        }
    }

    /// The time left, at least 1 ms: a store may read a limit of 0 as none.
    fn left(&self) -> Duration {
        self.at
            .saturating_duration_since(tokio::time::Instant::now())
            .max(Duration::from_millis(1))
    }

    /// Runs `stage` with the time left; an error it returns once the
    /// deadline passed is its running out, named as such.
    async fn stage<T, E, F>(&self, stage: InitStage, run: impl FnOnce(Duration) -> F) -> Result<T, InitError>
    where
        E: Into<InitError>,
        F: std::future::Future<Output = Result<T, E>>,
    {
        run(self.left()).await.map_err(|error| {
            let error = error.into();
            match tokio::time::Instant::now() >= self.at {
                true => self.ran_out(stage, Some(error)),
                false => error,
            }
        })
    }

    fn ran_out(&self, stage: InitStage, cause: Option<InitError>) -> InitError {
        InitError::TimedOut {
            stage,
            timeout: self.timeout,
            cause: cause.map(Box::new),
        }
    }
}

/// The master's (the store's) host, looked up once per process: whether
/// the whole job is on this host, and the address whose route chooses the
/// addresses to publish.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Master {
    /// Its first address, when it has a host that resolved.
    pub(crate) ip: Option<IpAddr>,
    /// Whether the whole job is on this host: the store is on loopback, or
    /// is an in-process store.
    pub(crate) single_host: bool,
}

impl Master {
    /// Looks the host up within `deadline`; a lookup that fails leaves
    /// the address unknown (and the job taken to span hosts), one that
    /// outlasts the deadline is an error.
    pub(crate) async fn resolve(
        config: &RendezvousConfig,
        store_host: Option<&str>,
        deadline: &Deadline,
    ) -> Result<Self, InitError> {
        let host = config.master_host().or(store_host);
        let ip = match host {
            Some(host) => tokio::time::timeout_at(deadline.at, tokio::net::lookup_host((host, 0)))
                .await
                .map_err(|_| deadline.ran_out(InitStage::MasterLookup, None))?
                .ok()
                .and_then(|mut addrs| addrs.next())
                .map(|a| a.ip()),
            None => None,
        };
        let single_host = match (&config.store, host) {
            (StoreSpec::Given(_), None) => true,
            (_, Some(_)) => ip.is_some_and(|ip| ip.is_loopback()),
            _ => false,
        };
        Ok(Self { ip, single_host })
    }
}

chorus_runtime::debug_as_report!(InitError);

/// What [`init_process_group`] needs; PyTorch's arguments by other names.
#[derive(Debug, Clone)]
pub struct InitOptions {
    /// How ranks meet (`env://` by default, as in PyTorch).
    pub init_method: InitMethod,
    /// This rank, when not in the URL or the environment.
    pub rank: Option<usize>,
    /// The world size, when not in the URL or the environment.
    pub world_size: Option<usize>,
    /// Limit on forming the group, all stages together (connecting to the
    /// store, looking up its host, the rendezvous, connecting to the peers:
    /// each gets what the ones before it left), and on each store operation
    /// (default 300 s, PyTorch's store default). A conflict (another world
    /// size, a rank claimed twice) fails every rank at once instead.
    pub timeout: Duration,
    /// Default limit on each collective (PyTorch's default for Gloo: 30 min).
    pub collective_timeout: Duration,
    /// Silence after which a peer is taken for dead or frozen; `None`:
    /// `CHORUS_HEARTBEAT_TIMEOUT` seconds, else 5 s
    /// ([`InitOptions::with_env_defaults`]).
    pub heartbeat_timeout: Option<Duration>,
    /// How long the watchdog may make no progress before the process exits;
    /// `None`: `CHORUS_WATCHDOG_TIMEOUT` seconds, else 480 s.
    pub watchdog_timeout: Option<Duration>,
    /// What a failure does; `None`: from the environment
    /// ([`ErrorHandling::from_env`]: `CHORUS_BLOCKING_WAIT`,
    /// `CHORUS_ASYNC_ERROR_HANDLING` and the torch / NCCL names), else abort.
    pub error_handling: Option<ErrorHandling>,
    /// Algorithms forced per collective; `None`: `CHORUS_ALGO`, else each
    /// chosen by size.
    pub algorithms: Option<Overrides>,
    /// The all-reduce switch points (`chorus bench tune` measures them),
    /// over those of [`InitOptions::algorithms`]; `None`:
    /// `CHORUS_ALGO_THRESHOLDS`, else the defaults.
    pub algorithm_thresholds: Option<Thresholds>,
    /// Fewest ranks an [`ElasticGroup`](crate::ElasticGroup) restarts with;
    /// `None`: the initial world size (no shrinking).
    pub min_world: Option<usize>,
    /// Most ranks an elastic group admits; `None`: the initial world size.
    pub max_world: Option<usize>,
    /// How long an elastic rendezvous waits for more ranks once `min_world`
    /// came (torchelastic's last call).
    pub last_call: Duration,
    /// When an elastic group admits a process waiting to join (SV-13):
    /// at once (the default), or at the members' next step boundary.
    pub admission: Admission,
    /// Scopes an elastic group within its run, under the launcher's own
    /// scope (`CHORUS_ELASTIC_SCOPE`): several elastic groups of one run,
    /// each of its own members (the replica groups of a sharded job, one
    /// per shard), keep their keys apart. `None`: the run's group.
    pub elastic_scope: Option<String>,
    /// Restarts an elastic group may make per `restart_window`; `None`:
    /// `CHORUS_MAX_RESTARTS`, else 3.
    pub max_restarts: Option<u32>,
    /// The window of the restart budget; `None`: `CHORUS_RESTART_WINDOW`
    /// seconds, else 600 s.
    pub restart_window: Option<Duration>,
    /// The host a given store ([`InitMethod::Store`]) lives on, e.g. the
    /// `TCPStore` a PyTorch job already made: it tells whether the job spans
    /// hosts and which interface reaches them. `None`: the store is in
    /// this process, so every rank is on this host.
    pub store_host: Option<String>,
    /// Which transport links between rank processes use; `None`:
    /// `CHORUS_TRANSPORT`, else auto ([`InitOptions::with_env_defaults`]).
    pub transport: Option<TransportChoice>,
    /// Faults to inject into the links (`docs/faults.md`); `None`:
    /// `CHORUS_FAULTS`, else none.
    pub faults: Option<FaultPlan>,
    /// The secret every rank signs its record with (all ranks must have
    /// the same); `None`: `CHORUS_JOB_SECRET`, else records go unsigned.
    pub job_secret: Option<JobSecret>,
    /// Bytes of shared-memory ring all ranks on a host may use together
    /// (`docs/transports.md`); `None`: `CHORUS_SHM_BUDGET`, else 576 MiB.
    pub shm_budget: Option<u64>,
}

/// The variables [`InitOptions::with_env_defaults`] reads.
const TRANSPORT_ENV: &str = "CHORUS_TRANSPORT";
const FAULTS_ENV: &str = "CHORUS_FAULTS";
const JOB_SECRET_ENV: &str = "CHORUS_JOB_SECRET";
const SHM_BUDGET_ENV: &str = "CHORUS_SHM_BUDGET";
const ALGO_ENV: &str = "CHORUS_ALGO";
const ALGO_THRESHOLDS_ENV: &str = "CHORUS_ALGO_THRESHOLDS";

impl Default for InitOptions {
    fn default() -> Self {
        Self {
            init_method: InitMethod::Env,
            rank: None,
            world_size: None,
            timeout: DEFAULT_TIMEOUT,
            collective_timeout: Duration::from_secs(30 * 60),
            heartbeat_timeout: None,
            watchdog_timeout: None,
            error_handling: None,
            algorithms: None,
            algorithm_thresholds: None,
            min_world: None,
            max_world: None,
            last_call: Duration::from_secs(1),
            admission: Admission::Immediate,
            elastic_scope: None,
            max_restarts: None,
            restart_window: None,
            store_host: None,
            transport: None,
            faults: None,
            job_secret: None,
            shm_budget: None,
        }
    }
}

impl InitOptions {
    /// Options for an init URL (`tcp://host:port`, `file:///path`, `env://`).
    pub fn from_url(url: &str) -> Result<Self, InitError> {
        Ok(Self {
            init_method: InitMethod::parse(url)?,
            ..Self::default()
        })
    }

    /// Sets the rank.
    pub fn rank(mut self, rank: usize) -> Self {
        self.rank = Some(rank);
        self
    }

    /// Sets the world size.
    pub fn world_size(mut self, world_size: usize) -> Self {
        self.world_size = Some(world_size);
        self
    }

    /// Sets the timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the default timeout of each collective.
    pub fn collective_timeout(mut self, timeout: Duration) -> Self {
        self.collective_timeout = timeout;
        self
    }

    /// Sets the heartbeat window (silence that fails a peer).
    pub fn heartbeat_timeout(mut self, timeout: Duration) -> Self {
        self.heartbeat_timeout = Some(timeout);
        self
    }

    /// Sets how long the watchdog may stall before the process exits.
    pub fn watchdog_timeout(mut self, timeout: Duration) -> Self {
        self.watchdog_timeout = Some(timeout);
        self
    }

    /// Sets the error-handling mode, over the environment's.
    pub fn error_handling(mut self, mode: ErrorHandling) -> Self {
        self.error_handling = Some(mode);
        self
    }

    /// Sets the bounds on an elastic group's world size.
    pub fn elastic_world(mut self, min_world: usize, max_world: usize) -> Self {
        self.min_world = Some(min_world);
        self.max_world = Some(max_world);
        self
    }

    /// Sets how long an elastic rendezvous waits for more once `min_world` came.
    pub fn last_call(mut self, window: Duration) -> Self {
        self.last_call = window;
        self
    }

    /// Sets when an elastic group admits a process waiting to join.
    pub fn admission(mut self, admission: Admission) -> Self {
        self.admission = admission;
        self
    }

    /// Sets the restart budget: at most `max_restarts` per `window`.
    pub fn restart_budget(mut self, max_restarts: u32, window: Duration) -> Self {
        self.max_restarts = Some(max_restarts);
        self.restart_window = Some(window);
        self
    }

    /// Sets the transport between rank processes, over `CHORUS_TRANSPORT`.
    pub fn transport(mut self, transport: TransportChoice) -> Self {
        self.transport = Some(transport);
        self
    }

    /// Sets the faults to inject, over `CHORUS_FAULTS`.
    pub fn faults(mut self, plan: FaultPlan) -> Self {
        self.faults = Some(plan);
        self
    }

    /// Sets the job secret, over `CHORUS_JOB_SECRET`.
    pub fn job_secret(mut self, secret: JobSecret) -> Self {
        self.job_secret = Some(secret);
        self
    }

    /// Sets the shared-memory budget of a host's ranks, in bytes, over
    /// `CHORUS_SHM_BUDGET`.
    pub fn shm_budget(mut self, bytes: u64) -> Self {
        self.shm_budget = Some(bytes);
        self
    }

    /// Sets the algorithms forced per collective, over `CHORUS_ALGO`.
    pub fn algorithms(mut self, overrides: Overrides) -> Self {
        self.algorithms = Some(overrides);
        self
    }

    /// Sets the all-reduce switch points, over `CHORUS_ALGO_THRESHOLDS`.
    pub fn algorithm_thresholds(mut self, thresholds: Thresholds) -> Self {
        self.algorithm_thresholds = Some(thresholds);
        self
    }

    /// Fills what is not set in code from the environment (the launcher's
    /// way in): the transport, the fault plan and the job secret
    /// (`CHORUS_TRANSPORT`, `CHORUS_FAULTS`, `CHORUS_JOB_SECRET`), the
    /// shared-memory budget (`CHORUS_SHM_BUDGET`), the algorithms and
    /// switch points (`CHORUS_ALGO`, `CHORUS_ALGO_THRESHOLDS`), and the
    /// supervision settings (`CHORUS_HEARTBEAT_TIMEOUT`,
    /// `CHORUS_WATCHDOG_TIMEOUT`, the error-handling mode's variables). The
    /// one place the library reads them; [`init_process_group`],
    /// [`spawn_with`] and [`ElasticGroup::init`](crate::ElasticGroup::init)
    /// call it, so what is set in code wins. A value that does not parse
    /// is an error naming its variable.
    pub fn with_env_defaults(self) -> Result<Self, InitError> {
        self.defaults_from(&|name| std::env::var(name).ok())
    }

    /// The error-handling mode: the one set in code, else the
    /// environment's (what an NCCL group, which takes no other of these
    /// settings, reads; [`Self::with_env_defaults`] fills it the same way).
    pub(crate) fn error_handling_or_env(&self) -> Result<ErrorHandling, SupervisionConfigError> {
        error_handling_from(self.error_handling, &|name| std::env::var(name).ok())
    }

    fn defaults_from(mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<Self, InitError> {
        if self.transport.is_none() {
            self.transport = Some(match env(TRANSPORT_ENV) {
                Some(text) => TransportChoice::parse(&text)?,
                None => TransportChoice::Auto,
            });
        }
        if self.faults.is_none() {
            self.faults = env(FAULTS_ENV)
                .map(|spec| FaultPlan::parse(&spec))
                .transpose()
                .map_err(MeshError::Faults)?;
        }
        if self.job_secret.is_none() {
            self.job_secret = env(JOB_SECRET_ENV)
                .filter(|s| !s.trim().is_empty())
                .map(|s| JobSecret::new(s.trim().as_bytes()));
        }
        if self.shm_budget.is_none() {
            self.shm_budget = parse_shm_budget(env(SHM_BUDGET_ENV).as_deref())?;
        }
        if self.algorithms.is_none() {
            self.algorithms = Some(match env(ALGO_ENV).filter(|v| !v.trim().is_empty()) {
                Some(value) => {
                    Overrides::parse(&value).map_err(|e| InitError::Algorithm(format!("{ALGO_ENV}: {e}")))?
                }
                None => Overrides::default(),
            });
        }
        if self.algorithm_thresholds.is_none() {
            self.algorithm_thresholds = env(ALGO_THRESHOLDS_ENV)
                .map(|value| Thresholds::parse(&value))
                .transpose()
                .map_err(|e| InitError::Algorithm(format!("{ALGO_THRESHOLDS_ENV}: {e}")))?;
        }
        self.error_handling = Some(error_handling_from(self.error_handling, env)?);
        if self.heartbeat_timeout.is_none() {
            self.heartbeat_timeout = supervision::seconds_from_env(env, HEARTBEAT_TIMEOUT_ENV)?;
        }
        if self.watchdog_timeout.is_none() {
            self.watchdog_timeout = supervision::seconds_from_env(env, WATCHDOG_TIMEOUT_ENV)?;
        }
        Ok(self)
    }

    /// The algorithm choice the ranks plan with (after
    /// [`Self::with_env_defaults`]): the forced algorithms, with the switch
    /// points when given.
    fn overrides(&self) -> Overrides {
        let overrides = self.algorithms.clone().unwrap_or_default();
        match self.algorithm_thresholds {
            Some(thresholds) => overrides.with_thresholds(thresholds),
            None => overrides,
        }
    }

    /// What the links are made with (after [`Self::with_env_defaults`]).
    fn link_options(&self) -> LinkOptions {
        LinkOptions {
            transport: self.transport.unwrap_or(TransportChoice::Auto),
            faults: self.faults.clone(),
            secret: self.job_secret.clone(),
            shm_budget: self.shm_budget.unwrap_or(SHM_BUDGET),
        }
    }
}

/// `set`, else the mode the environment asks for.
fn error_handling_from(
    set: Option<ErrorHandling>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<ErrorHandling, SupervisionConfigError> {
    match set {
        Some(mode) => Ok(mode),
        None => ErrorHandling::from_env(env),
    }
}

/// A formed group: this rank's place, every peer's record, and the store.
///
/// Call [`ProcessGroup::destroy`] when done (PyTorch's
/// `destroy_process_group`): it waits until every rank is done with the
/// store, which rank 0 serves for `tcp://`.
pub struct ProcessGroup {
    config: RendezvousConfig,
    membership: Membership,
    store: Arc<dyn Store>,
    timeout: Duration,
    server: Option<TcpStoreServer>,
    links: Vec<Option<Arc<dyn Link>>>,
    pub(crate) actor: Addr<RankActor>,
    arbiter: RankThread,
    /// The in-process mesh of a rank made by [`spawn`] (not of its subgroups).
    local: Option<Arc<LocalMesh>>,
    supervision: Arc<Supervision>,
    /// Turning it true stops the heartbeats, the watchdog and its monitor.
    stop_supervision: watch::Sender<bool>,
    /// What the group was formed with, for its subgroups.
    options: InitOptions,
    /// Subgroups made so far ([`ProcessGroup::new_group`]).
    subgroups: AtomicU32,
    /// Kept alive for the links' connections (none for in-process groups).
    _endpoint: Option<QuicEndpoint>,
    /// Has the group dump its recorder on SIGTERM (with a trace directory).
    _on_sigterm: Option<crate::terminate::Registration>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("generation", &self.generation())
            .field("store", &self.store.location())
            .finish()
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.stop_supervision.send_replace(true);
        // A shared arbiter runs on: this rank's tasks end with the stop
        // above, and its actor once its last address (this one) is gone.
        if let RankThread::Own(arbiter) = &self.arbiter {
            arbiter.stop();
        }
    }
}

/// The thread a rank's actor, links and supervision run on.
enum RankThread {
    /// An arbiter of its own (a rank process), stopped with its group.
    Own(actix_rt::Arbiter),
    /// One shared by ranks in one process ([`system::shared_arbiter`]).
    Shared(actix_rt::ArbiterHandle),
}

impl RankThread {
    fn handle(&self) -> actix_rt::ArbiterHandle {
        match self {
            RankThread::Own(arbiter) => arbiter.handle(),
            RankThread::Shared(handle) => handle.clone(),
        }
    }
}

/// Runs `future` on `arbiter` and returns its output: a rank's endpoint and
/// connections are made on the thread that will drive them.
async fn on_arbiter<T: Send + 'static>(
    arbiter: &RankThread,
    future: impl std::future::Future<Output = T> + Send + 'static,
) -> Result<T, SystemError> {
    let (tx, rx) = oneshot::channel();
    arbiter.handle().spawn(async move {
        let _ = tx.send(future.await);
    });
    rx.await.map_err(|_| system_error("the rank's arbiter stopped"))
}

fn system_error(what: &str) -> SystemError {
    SystemError::new(what)
}

/// Where a group's links come from.
pub(crate) enum LinkSource {
    /// The QUIC mesh, set up on the rank's arbiter; `world` bounds the
    /// ranks of every generation (the fault plan is checked against it).
    Mesh { world: usize },
    /// In-process links made by [`spawn`], and their mesh; its watcher
    /// stands in for heartbeats unless `heartbeats` (injected faults can
    /// silence a rank, which only heartbeats notice).
    Local {
        mesh: Arc<LocalMesh>,
        links: Vec<Option<Arc<dyn Link>>>,
        heartbeats: bool,
    },
}

/// Forms the group: resolves the configuration, opens the store, publishes
/// this rank's addresses and waits for every peer's, all within
/// [`InitOptions::timeout`] (an error names the stage that ran out).
///
/// # Cancel safety
///
/// Not cancel safe. Dropped after its rendezvous claimed this rank, the
/// rank stays claimed in this generation: a second call fails as a rank
/// claimed twice, and so do the peers' rendezvous then (at once, with the
/// conflict). Without a second call, the peers fail for want of this rank:
/// their rendezvous by its deadline, or, once this rank's record is
/// published, connecting to it, or their first operation if it had
/// connected. Bound it with [`InitOptions::timeout`].
pub async fn init_process_group(options: InitOptions) -> Result<ProcessGroup, InitError> {
    let deadline = Deadline::after(options.timeout);
    let options = options.with_env_defaults()?;
    let env = |name: &str| std::env::var(name).ok();
    let config = rendezvous::resolve(options.init_method.clone(), options.rank, options.world_size, &env)?;
    let opened = deadline
        .stage(InitStage::StoreConnect, |left| rendezvous::open_store(&config, left))
        .await?;
    let master = Master::resolve(&config, options.store_host.as_deref(), &deadline).await?;
    let world = config.world_size;
    form(config, opened, LinkSource::Mesh { world }, master, &options, deadline).await
}

/// Rendezvous, links and actor: the part of forming a group shared by
/// separate processes and [`spawn`]; its stages share `deadline`.
pub(crate) async fn form(
    config: RendezvousConfig,
    opened: rendezvous::OpenedStore,
    source: LinkSource,
    master: Master,
    options: &InitOptions,
    deadline: Deadline,
) -> Result<ProcessGroup, InitError> {
    let env = |name: &str| std::env::var(name).ok();
    let arbiter = match &source {
        LinkSource::Mesh { .. } => RankThread::Own(system::new_arbiter()?),
        LinkSource::Local { .. } => RankThread::Shared(system::shared_arbiter(config.rank, config.world_size)?),
    };
    let mut record = PeerRecord {
        rank: config.rank as u32,
        host: HostId::local(),
        pid: std::process::id(),
        addrs: netif::local_addresses(master.ip, &env)?,
        extras: Vec::new(),
    };
    let (membership, endpoint, links, local) = match source {
        LinkSource::Mesh { world } => {
            let (rank, single_host, left, links) =
                (config.rank, master.single_host, deadline.left(), options.link_options());
            let plan = on_arbiter(&arbiter, async move {
                MeshPlan::prepare(rank, world, single_host, left, links)
            })
            .await??;
            plan.publish(&mut record, &config.run_id, config.generation);
            let store = opened.store.clone();
            let membership = deadline
                .stage(InitStage::Rendezvous, |left| {
                    rendezvous::rendezvous(store, &config, record, left)
                })
                .await?;
            let (known, run_id, arbiter) = (membership.clone(), config.run_id.clone(), &arbiter);
            let (endpoint, links) = deadline
                .stage(InitStage::MeshConnect, |left| async move {
                    on_arbiter(arbiter, async move { plan.connect(&known, &run_id, left).await })
                        .await
                        .map_err(InitError::from)?
                        .map_err(InitError::from)
                })
                .await?;
            (membership, Some(endpoint), links, None)
        }
        LinkSource::Local {
            mesh,
            links,
            heartbeats,
        } => {
            let store = opened.store.clone();
            let membership = deadline
                .stage(InitStage::Rendezvous, |left| {
                    rendezvous::rendezvous(store, &config, record, left)
                })
                .await?;
            (membership, None, links, (!heartbeats).then_some(mesh))
        }
    };
    let rank = FormedRank {
        config,
        membership,
        opened,
        links,
        endpoint,
        local,
        arbiter,
    };
    start_rank(rank, options).await
}

/// The peers of this rank whose processes it can watch (SV-15): other
/// processes on this host, in this pid namespace.
fn local_processes(membership: &Membership) -> ProcessWatch {
    let me = membership.me();
    ProcessWatch::new(
        membership
            .peers
            .iter()
            .filter(|peer| peer.host.same_pids(&me.host) && peer.pid != me.pid)
            .map(|peer| (peer.rank as usize, peer.pid)),
    )
}

/// How often a rank with peers on other hosts looks for their exits.
const REMOTE_EXIT_POLL: Duration = Duration::from_millis(250);

/// Fails peers on other hosts as soon as their launcher publishes their
/// exit (`elastic::publish_exit`): a SIGKILLed rank elsewhere is noticed
/// within a poll instead of at the heartbeat window, which remains for
/// partitions and frozen ranks. A peer that exited after its own group
/// aborted, blaming others (its launcher publishes whom), left because of
/// them and is not blamed itself (SV-14). Reads one counter per poll, and
/// the peers' exit keys only when it moved; a store error is not a peer's
/// failure. `members`: every rank's (rank, host name, pid); `remote`: the
/// ranks to watch.
async fn watch_remote_exits(
    store: Arc<dyn Store>,
    run_id: String,
    (members, remote): (Vec<(usize, String, u32)>, Vec<usize>),
    monitor: Arc<SharedMonitor>,
    mut stop: watch::Receiver<bool>,
) {
    let mut seen = None;
    loop {
        if let Ok(count) = elastic::exit_count(store.as_ref(), &run_id).await
            && seen != Some(count)
        {
            seen = Some(count);
            for (rank, host, pid) in members.iter().filter(|(rank, ..)| remote.contains(rank)) {
                if let Ok(Some(exit)) = elastic::exit_of(store.as_ref(), &run_id, host, *pid).await {
                    match blamed_ranks(&exit, &members) {
                        blamed if blamed.is_empty() => monitor.process_exited(*rank, *pid),
                        blamed => monitor.exited_after_abort(*rank, *pid, blamed),
                    }
                }
            }
        }
        tokio::select! {
            () = tokio::time::sleep(REMOTE_EXIT_POLL) => {}
            _ = stop.wait_for(|stopped| *stopped) => return,
        }
    }
}

/// The ranks among `members` (rank, host name, pid) of the processes an
/// exit blamed; processes of no member (another generation's) are left out.
fn blamed_ranks(exit: &elastic::Exit, members: &[(usize, String, u32)]) -> Vec<usize> {
    members
        .iter()
        .filter(|(_, host, pid)| exit.blamed.iter().any(|(h, p)| h == host && p == pid))
        .map(|(rank, ..)| *rank)
        .collect()
}

/// A formed rank, before it starts: its group's configuration and
/// membership, the store it met on, its links and the thread it runs on.
struct FormedRank {
    config: RendezvousConfig,
    membership: Membership,
    opened: rendezvous::OpenedStore,
    links: Vec<Option<Arc<dyn Link>>>,
    /// The endpoint its QUIC links live on (none in-process).
    endpoint: Option<QuicEndpoint>,
    /// The in-process mesh whose watcher stands in for its heartbeats.
    local: Option<Arc<LocalMesh>>,
    arbiter: RankThread,
}

/// How a rank handles failures and how soon it detects them, from its
/// options.
struct Detection {
    mode: ErrorHandling,
    /// The heartbeat window.
    window: Duration,
    watchdog: WatchdogConfig,
}

impl Detection {
    fn from_options(options: &InitOptions) -> Self {
        // The options went through `with_env_defaults`: what is unset here
        // was unset in the environment too.
        let window = options.heartbeat_timeout.unwrap_or(HeartbeatConfig::default().window);
        Self {
            mode: options.error_handling.unwrap_or(ErrorHandling::Abort),
            window,
            watchdog: WatchdogConfig {
                stall_timeout: options
                    .watchdog_timeout
                    .unwrap_or(WatchdogConfig::default().stall_timeout),
                overdue_grace: window,
                ..WatchdogConfig::default()
            },
        }
    }
}

/// Starts a formed rank: its actor, heartbeats and watchdog on its
/// arbiter. Shared by whole groups and subgroups. A rank of an in-process
/// `local` mesh has no heartbeats: its watchdog learns of closed links
/// from the mesh.
async fn start_rank(rank: FormedRank, options: &InitOptions) -> Result<ProcessGroup, InitError> {
    let detection = Detection::from_options(options);
    let metrics = Arc::new(GroupMetrics::new(&rank.config.run_id));
    metrics.formed(rank.membership.generation, rank.membership.world_size());
    let supervision = rank.supervision(detection.mode, &metrics);
    let (actor, on_sigterm) = rank.start_actor(options, &supervision, &metrics)?;
    let (stop_supervision, stop) = watch::channel(false);
    let monitor = rank
        .detect_failures(&detection, &supervision, &actor, &metrics, stop.clone())
        .await?;
    rank.watch_remote_exits(monitor, stop.clone());
    supervision::spawn_stall_monitor(
        supervision.clone(),
        detection.watchdog.stall_timeout,
        stop,
        supervision::exit_on_stall,
    )
    .map_err(|e| system_error(&format!("could not start the watchdog monitor: {e}")))?;
    let FormedRank {
        config,
        membership,
        opened,
        links,
        endpoint,
        local,
        arbiter,
    } = rank;
    tracing::info!(
        rank = membership.rank,
        world_size = membership.world_size(),
        generation = membership.generation,
        store = %opened.store.location(),
        "process group formed"
    );
    Ok(ProcessGroup {
        config,
        membership,
        store: opened.store,
        timeout: options.timeout,
        server: opened.server,
        links,
        actor,
        arbiter,
        local,
        supervision,
        stop_supervision,
        options: options.clone(),
        subgroups: AtomicU32::new(0),
        _endpoint: endpoint,
        _on_sigterm: on_sigterm,
    })
}

impl FormedRank {
    /// Its supervision, handling failures as `mode` says.
    fn supervision(&self, mode: ErrorHandling, metrics: &GroupMetrics) -> Arc<Supervision> {
        let (rank, generation) = (self.config.rank, self.membership.generation);
        let mut supervision =
            Supervision::new(rank, generation, mode, self.links.clone()).with_metrics(metrics.clone());
        // A rank process tells its launcher whom it blames; ranks sharing a
        // process (one error file) leave it to the process.
        if let (RankThread::Own(_), Some(hook)) = (&self.arbiter, crate::error_file::hook(&self.membership)) {
            supervision = supervision.with_failure_hook(hook);
        }
        Arc::new(supervision)
    }

    /// Starts its actor on its arbiter, and with a trace directory has
    /// SIGTERM (a launcher stopping the job) dump the recorder before the
    /// process exits (crate::terminate).
    fn start_actor(
        &self,
        options: &InitOptions,
        supervision: &Arc<Supervision>,
        metrics: &Arc<GroupMetrics>,
    ) -> Result<(Addr<RankActor>, Option<crate::terminate::Registration>), InitError> {
        let (overrides, pool) = match self.arbiter {
            RankThread::Shared(_) => (options.overrides().sharing_threads(), system::shared_frame_pool()),
            RankThread::Own(_) => (options.overrides(), FramePool::default()),
        };
        let (rank, collective_timeout) = (self.config.rank, options.collective_timeout);
        let (links, generation) = (self.links.clone(), self.membership.generation);
        let flight = FlightRecorder::new(flight::capacity_from_env());
        let trace_dir = flight::trace_dir_from_env();
        let (actor_supervision, actor_metrics) = (supervision.clone(), metrics.clone());
        let (dump_notice, dumped) = watch::channel(false);
        let dumps = trace_dir.is_some();
        let actor = RankActor::start_in_arbiter(&self.arbiter.handle(), move |_| {
            let actor = RankActor::new(rank, links, collective_timeout, overrides, actor_supervision)
                .with_frame_pool(pool)
                .with_flight_recorder(flight, trace_dir, generation)
                .with_metrics(actor_metrics);
            if dumps {
                actor.with_dump_notice(dump_notice)
            } else {
                actor
            }
        });
        let on_sigterm = match dumps {
            true => Some(crate::terminate::register(supervision.clone(), actor.clone(), dumped)?),
            false => None,
        };
        Ok((actor, on_sigterm))
    }

    /// Spawns its heartbeats (or, in-process, the mesh's watcher) and its
    /// watchdog on its arbiter, until `stop`; returns the monitor they
    /// share, where the watchdog learns of failed peers.
    async fn detect_failures(
        &self,
        detection: &Detection,
        supervision: &Arc<Supervision>,
        actor: &Addr<RankActor>,
        metrics: &GroupMetrics,
        stop: watch::Receiver<bool>,
    ) -> Result<Arc<SharedMonitor>, InitError> {
        let (rank, links) = (self.config.rank, &self.links);
        let peers = (0..links.len()).filter(|&r| r != rank);
        let monitor = SharedMonitor::new(match &self.local {
            Some(_) => HeartbeatMonitor::closures_only(links.len(), rank),
            None => HeartbeatMonitor::new(peers, detection.window, std::time::Instant::now()),
        });
        let watch = self.local.as_ref().map(|mesh| mesh.watch(rank));
        let processes = local_processes(&self.membership);
        let (heartbeat_links, watched, notify, window) =
            (links.clone(), supervision.clone(), actor.clone(), detection.window);
        let (watchdog, watchdog_monitor) = (detection.watchdog, monitor.clone());
        let missed = metrics.heartbeats_missed().clone();
        on_arbiter(&self.arbiter, async move {
            match watch {
                Some(watch) => heartbeat::spawn_local(watch, watchdog_monitor.clone(), stop.clone()),
                None => heartbeat::spawn(
                    &heartbeat_links,
                    HeartbeatConfig::with_window(window),
                    watchdog_monitor.clone(),
                    stop.clone(),
                    missed,
                ),
            }
            supervision::spawn_watchdog(
                watched,
                watchdog_monitor,
                processes,
                watchdog,
                move || notify.do_send(Aborted),
                stop,
            );
        })
        .await?;
        Ok(monitor)
    }

    /// Has `monitor` learn of the exits of peers on other hosts, as their
    /// launchers publish them, until `stop`.
    fn watch_remote_exits(&self, monitor: Arc<SharedMonitor>, stop: watch::Receiver<bool>) {
        let me = self.membership.me();
        let remote: Vec<usize> = self
            .membership
            .peers
            .iter()
            .filter(|peer| !peer.host.same_pids(&me.host))
            .map(|peer| peer.rank as usize)
            .collect();
        if remote.is_empty() {
            return;
        }
        let members = self
            .membership
            .peers
            .iter()
            .map(|peer| (peer.rank as usize, peer.host.hostname.clone(), peer.pid))
            .collect();
        let (store, run_id) = (self.opened.store.clone(), self.config.run_id.clone());
        self.arbiter
            .handle()
            .spawn(watch_remote_exits(store, run_id, (members, remote), monitor, stop));
    }
}

/// Starts `world` ranks inside this process (PyTorch's
/// `torch.multiprocessing.spawn`, without processes: no GIL here, so one
/// process drives many ranks in parallel). Each rank is an actor; the ranks
/// share one thread per core, meet on an in-process store and talk over
/// in-process links made when first used, so a world of a thousand ranks
/// fits a laptop. Failure detection is by closed links, without heartbeats
/// unless faults are injected (a frozen or partitioned rank is silent).
/// Each rank's `body` runs on its rank's thread, beside its actor, so it
/// should not block that thread: blocking work belongs in
/// `tokio::task::spawn_blocking`. Returns every rank's result, in rank
/// order; a body that panics is an error naming the panic.
///
/// # Cancel safety
///
/// Dropping it does not stop the ranks: each body runs on as a task of its
/// rank's thread until it ends; only the results are lost.
pub async fn spawn<T, F, Fut>(world: usize, body: F) -> Result<Vec<T>, InitError>
where
    T: Send + 'static,
    F: Fn(ProcessGroup) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    spawn_with(world, InitOptions::default(), body).await
}

/// [`spawn`] with `options` for every rank (timeouts, heartbeat window,
/// error handling); their init method, rank and world size are ignored.
///
/// The options' fault plan (by default `CHORUS_FAULTS`,
/// [`InitOptions::with_env_defaults`]) is injected into the in-process
/// links (`kill` closes every link of the rank), and a bad `CHORUS_FAULTS`
/// or `CHORUS_TRANSPORT` is an error. The ranks talk over in-process links
/// whatever transport the options name.
pub async fn spawn_with<T, F, Fut>(world: usize, options: InitOptions, body: F) -> Result<Vec<T>, InitError>
where
    T: Send + 'static,
    F: Fn(ProcessGroup) -> Fut,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    let options = options.with_env_defaults()?;
    if options.transport != Some(TransportChoice::Auto) {
        tracing::debug!("the transport choice applies to rank processes; chorus::spawn's ranks use in-process links");
    }
    let faults = checked_faults(options.faults.clone(), world)?;
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let mesh = LocalMesh::new(world);
    let mut groups = Vec::with_capacity(world);
    let mut forming = Vec::with_capacity(world);
    for rank in 0..world {
        let links = match &faults {
            Some(plan) => wrap_links(rank, mesh.links(rank), plan.clone()),
            None => mesh.links(rank),
        };
        let (mesh, faulty) = (mesh.clone(), faults.is_some());
        let options = InitOptions {
            init_method: InitMethod::Store(store.clone()),
            rank: Some(rank),
            world_size: Some(world),
            ..options.clone()
        };
        forming.push(tokio::spawn(async move {
            let deadline = Deadline::after(options.timeout);
            let config = rendezvous::resolve(options.init_method.clone(), options.rank, options.world_size, &|_| None)?;
            let opened = rendezvous::open_store(&config, options.timeout).await?;
            let master = Master::resolve(&config, options.store_host.as_deref(), &deadline).await?;
            let heartbeats = faulty;
            form(
                config,
                opened,
                LinkSource::Local {
                    mesh,
                    links,
                    heartbeats,
                },
                master,
                &options,
                deadline,
            )
            .await
        }));
    }
    for task in forming {
        groups.push(
            task.await
                .map_err(|e| system_error(&format!("a rank failed to start: {e}")))??,
        );
    }
    // Each body runs on its rank's arbiter, beside its actor: submitting an
    // operation and waking on its result stay on one thread, where a body on
    // another runtime pays a cross-thread wake-up for each (bench/HISTORY.md
    // §17a: a 1024-rank all-reduce 1.15x faster at the median, up to 1.7x).
    // A body that blocks its thread holds up the ranks that share it, as it
    // would hold up a tokio worker.
    let running: Vec<_> = groups
        .into_iter()
        .map(|group| {
            let (tx, rx) = oneshot::channel();
            let arbiter = group.arbiter.handle();
            let body = body(group);
            arbiter.spawn(async move {
                // A task of its own, so a panicking body is reported, not lost.
                let _ = tx.send(tokio::task::spawn_local(body).await);
            });
            rx
        })
        .collect();
    let mut results = Vec::with_capacity(world);
    for task in running {
        let outcome = task.await.map_err(|_| system_error("a rank's arbiter stopped"))?;
        results.push(outcome.map_err(|e| system_error(&format!("a rank panicked: {e}")))?);
    }
    Ok(results)
}

impl ProcessGroup {
    /// The goodbye and last barrier of [`ProcessGroup::destroy`], for a
    /// handle shared by an elastic group (which keeps the store server).
    pub(crate) async fn leave(&self) -> Result<(), InitError> {
        match &self.local {
            // Its peers' watchers take its links closing for a departure.
            Some(mesh) => mesh.leave(self.rank()),
            None => {
                let links = self.links.clone();
                on_arbiter(&self.arbiter, async move { heartbeat::say_goodbye(&links).await }).await?;
            }
        }
        self.stop_supervision.send_replace(true);
        self.store_barrier("destroy").await
    }

    /// Ends this generation after an abort: its heartbeats and watchdog stop
    /// and its links close (in every error-handling mode, so no frame of it
    /// reaches the next generation's peers).
    pub(crate) fn tear_down(&self, why: &str) {
        self.stop_supervision.send_replace(true);
        for link in self.links.iter().flatten() {
            link.close(why);
        }
    }

    /// Leaves the group now, from this rank alone (a service's shutdown
    /// path), where [`destroy`](Self::destroy) waits for every rank:
    /// pending and queued operations fail at once with
    /// [`GroupAborted`] (reason `Shutdown`), the
    /// heartbeats and watchdog stop, and the links close with a notice
    /// that tells peers this rank is gone (they abort at once instead of
    /// waiting out a heartbeat window). A store this rank serves stops
    /// with it, so in a job that lives on, leave the serving rank last.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in effect: the leaving (operations failed, links closed
    /// with the notice) is done before its first await; what a drop skips
    /// is waiting for the queue to drain and for a served store to stop,
    /// which dropping the group then does.
    pub async fn shutdown(mut self, why: &str) {
        self.leave_now(why);
        // Behind the queued operations: once it is handled they have all
        // failed with the abort, so none sees the actor stop instead.
        let _ = tokio::time::timeout(Duration::from_secs(1), self.actor.send(Drain)).await;
        self.store = Arc::new(HashStore::default());
        if let Some(server) = self.server.take() {
            server.shutdown().await;
        }
    }

    /// The part of [`shutdown`](Self::shutdown) that a shared handle can
    /// do (an elastic group's current generation).
    pub(crate) fn leave_now(&self, why: &str) {
        self.supervision.shut_down(why);
        self.stop_supervision.send_replace(true);
    }

    /// Aborts the group from outside (a membership change), as a failure
    /// would (SV-5): pending operations fail and `failures()` publishes it.
    pub(crate) fn abort(&self, why: String) -> bool {
        self.supervision
            .abort(supervision::AbortReason::OperationFailed(why), Vec::new())
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.membership.rank
    }

    /// How many ranks.
    pub fn world_size(&self) -> usize {
        self.membership.world_size()
    }

    /// The rank among those on this host: the launcher's `LOCAL_RANK` when
    /// one said, else counted from the peers' host identities.
    pub fn local_rank(&self) -> usize {
        self.config.local_rank.unwrap_or_else(|| {
            self.membership
                .local_ranks()
                .iter()
                .position(|&r| r == self.rank())
                .expect("a rank is always local to itself")
        })
    }

    /// The generation of this group (0 unless restarted).
    pub fn generation(&self) -> u64 {
        self.membership.generation
    }

    /// The job's run id (`TORCHELASTIC_RUN_ID`), which scopes its keys in the store.
    pub fn run_id(&self) -> &str {
        &self.config.run_id
    }

    /// Every rank's published record, indexed by rank.
    pub fn peers(&self) -> &[PeerRecord] {
        &self.membership.peers
    }

    /// The address to reach `rank` at from here: loopback when it shares this
    /// host, its first routable address otherwise; `None` when it published
    /// only loopback from another host.
    pub fn peer_address(&self, rank: usize) -> Option<IpAddr> {
        let peer = self.membership.peers.get(rank)?;
        netif::peer_address(&peer.addrs, peer.host.same_network(&self.membership.me().host))
    }

    /// PyTorch's `new_group(ranks)`: a group of some of this group's ranks,
    /// with its own actor and numbering, over the same connections (on
    /// channels of its own, so the two groups' collectives never mix).
    ///
    /// Every rank of this group must call it, in the same order, with the
    /// same ranks (a mismatch is an error naming both lists); members get
    /// the subgroup, where they have rank = their position in the sorted
    /// `ranks`, others `None`.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: its first poll takes the subgroup's number (agreeing
    /// on the members in the store comes after), so dropped at any await,
    /// this rank skips a number the others use, and its next `new_group`
    /// pairs with their next one, the ranks out of step (a mismatch error
    /// when those name other ranks).
    pub async fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>, InitError> {
        let index = self.subgroups.fetch_add(1, Ordering::SeqCst);
        let mut members = ranks.to_vec();
        members.sort_unstable();
        members.dedup();
        let world = self.world_size();
        if members.is_empty() || members.len() != ranks.len() || members.iter().any(|&r| r >= world) || index >= 0xfffe
        {
            return Err(InitError::Subgroup(format!(
                "new_group({ranks:?}): ranks must be distinct, in 0..{world}, and not empty"
            )));
        }
        let scope = format!("chorus/{}/g{}/subgroup/{index}", self.config.run_id, self.generation());
        let listed = members.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
        let agreed = self.store.compare_set(&scope, b"", listed.as_bytes()).await?;
        if agreed != listed.as_bytes() {
            return Err(InitError::Subgroup(format!(
                "subgroup #{index}: this rank asked for ranks [{listed}], another asked for [{}]; every rank must call new_group in the same order with the same ranks",
                String::from_utf8_lossy(&agreed)
            )));
        }
        let Some(sub_rank) = members.iter().position(|&r| r == self.rank()) else {
            return Ok(None);
        };
        let base = (index + 1) << 16;
        let links = members
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                self.links[r]
                    .as_ref()
                    .map(|link| Arc::new(ScopedLink::new(link.clone(), base, i)) as Arc<dyn Link>)
            })
            .collect();
        let peers = members
            .iter()
            .enumerate()
            .map(|(i, &r)| PeerRecord {
                rank: i as u32,
                ..self.membership.peers[r].clone()
            })
            .collect();
        let membership = Membership {
            generation: self.generation(),
            rank: sub_rank,
            peers,
        };
        let store: Arc<dyn Store> = Arc::new(PrefixStore::new(scope, self.store.clone()));
        let config = RendezvousConfig {
            store: StoreSpec::Given(store.clone()),
            rank: sub_rank,
            world_size: members.len(),
            local_rank: None,
            local_world_size: None,
            run_id: format!("{}/sub{index}", self.config.run_id),
            ..self.config.clone()
        };
        let opened = rendezvous::OpenedStore { store, server: None };
        let arbiter = match &self.arbiter {
            RankThread::Shared(_) => RankThread::Shared(system::shared_arbiter(self.rank(), self.world_size())?),
            RankThread::Own(_) => RankThread::Own(system::new_arbiter()?),
        };
        let rank = FormedRank {
            config,
            membership,
            opened,
            links,
            endpoint: None,
            local: None,
            arbiter,
        };
        Ok(Some(start_rank(rank, &self.options).await?))
    }

    /// This rank's link to `rank` (`None` for itself or out of range).
    pub fn link(&self, rank: usize) -> Option<&Arc<dyn Link>> {
        self.links.get(rank)?.as_ref()
    }

    /// Fault injection: cuts this rank's links to every peer while it keeps
    /// running, as a network partition would; each peer's next collective
    /// with it fails, telling `reason`.
    pub fn cut_links(&self, reason: &str) {
        for link in self.links.iter().flatten() {
            link.cut(reason);
        }
    }

    /// The store the group met on.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Waits until every rank has reached the barrier named `name`.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: dropped after this rank counted itself in, calling
    /// it again with the same name counts it twice (the barrier may open
    /// before every rank came). Use a new name to retry.
    pub async fn store_barrier(&self, name: &str) -> Result<(), InitError> {
        let prefix = format!("chorus/{}/g{}/barrier/{name}", self.config.run_id, self.generation());
        let arrived = self.store.add(&format!("{prefix}/count"), 1).await?;
        if arrived as usize == self.world_size() {
            self.store.set(&format!("{prefix}/done"), b"1").await?;
        }
        self.store
            .wait_timeout(&[&format!("{prefix}/done")], self.timeout)
            .await?;
        Ok(())
    }

    /// The group's failures (SV-5): `None` while it is healthy, then the
    /// abort, once. A supervisor waits on it (`changed()`) to restart.
    pub fn failures(&self) -> watch::Receiver<Option<GroupAborted>> {
        self.supervision.subscribe()
    }

    /// The default timeout of each collective, which the state transfer
    /// (`train::transfer`) also applies to each frame it waits for.
    pub(crate) fn collective_timeout(&self) -> Duration {
        self.options.collective_timeout
    }

    /// The error-handling mode this group runs under.
    pub fn error_handling(&self) -> ErrorHandling {
        self.supervision.mode()
    }

    /// Leaves the group once every rank is leaving, so rank 0 stops serving
    /// the store only when nobody needs it. Heartbeats stop first (SV-8): a
    /// peer that passed the barrier and exited is not a failure.
    ///
    /// # Cancel safety
    ///
    /// Dropping it half-way drops the group: this rank said goodbye and
    /// may be counted in the last barrier, so the others may pass it while
    /// a store this rank serves stops at once under them.
    pub async fn destroy(mut self) -> Result<(), InitError> {
        self.leave().await?;
        // Our own connection must not hold the server's shutdown open.
        self.store = Arc::new(HashStore::default());
        if let Some(server) = self.server.take() {
            server.shutdown().await;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CollectiveError, ReduceOp, Tensor};
    use chorus_runtime::store::TcpStoreServerOptions;
    use std::collections::HashMap;
    use std::time::Instant;

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port()
    }

    /// SV-14 across hosts: a peer whose launcher published that it exited
    /// after blaming rank 2 left because of rank 2; one that blamed no one
    /// (or only processes outside the group) failed itself.
    #[tokio::test]
    async fn sv14_a_remote_peer_that_exited_blaming_others_left_and_only_they_are_blamed() {
        use chorus_actors::heartbeat::{HeartbeatMonitor, PeerFailure, PeerFailureCause};
        let store: Arc<dyn Store> = Arc::new(chorus_runtime::store::HashStore::default());
        let members: Vec<(usize, String, u32)> = (0..4).map(|r| (r, format!("h{r}"), 100 + r as u32)).collect();
        let exit = |blamed: &[(&str, u32)]| elastic::Exit {
            blamed: blamed.iter().map(|&(h, p)| (h.to_string(), p)).collect(),
        };
        elastic::publish_exit(store.as_ref(), "run", "h1", 101, &exit(&[("h2", 102)]))
            .await
            .unwrap();
        elastic::publish_exit(store.as_ref(), "run", "h3", 103, &exit(&[("elsewhere", 1)]))
            .await
            .unwrap();
        let monitor = SharedMonitor::new(HeartbeatMonitor::new(
            [1, 2, 3],
            Duration::from_secs(60),
            Instant::now(),
        ));
        let (stop, stopped) = watch::channel(false);
        let watcher = tokio::spawn(watch_remote_exits(
            store,
            "run".into(),
            (members, vec![1, 2, 3]),
            monitor.clone(),
            stopped,
        ));
        let gone = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let gone = monitor.lock().poll(Instant::now());
                if !gone.is_empty() {
                    return gone;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the published exits were not seen within 5 s");
        stop.send_replace(true);
        watcher.await.unwrap();
        assert_eq!(
            gone,
            vec![
                PeerFailure {
                    rank: 1,
                    cause: PeerFailureCause::Left {
                        reason: "its process (pid 101) exited after its group aborted".into(),
                        failed: vec![2],
                    },
                },
                PeerFailure {
                    rank: 3,
                    cause: PeerFailureCause::Closed("its process (pid 103) exited".into()),
                },
            ]
        );
    }

    #[test]
    fn options_set_in_code_win_over_the_environment_and_the_others_come_from_it() {
        let vars: HashMap<&str, &str> = [
            (TRANSPORT_ENV, "shm"),
            (FAULTS_ENV, "not a plan"),
            (JOB_SECRET_ENV, " from-the-env "),
        ]
        .into();
        let env = |name: &str| vars.get(name).map(|v| v.to_string());
        let plan = FaultPlan::parse("kill(rank=1)").unwrap();
        let set = InitOptions::default()
            .transport(TransportChoice::Quic)
            .faults(plan.clone())
            .job_secret(JobSecret::new(b"from-code"))
            .defaults_from(&env)
            .expect("a bad CHORUS_FAULTS is not read when the plan is set in code");
        assert_eq!(set.transport, Some(TransportChoice::Quic));
        assert_eq!(set.faults, Some(plan));
        let signed = |options: &InitOptions| options.job_secret.as_ref().map(|s| s.sign(b"record"));
        assert_eq!(signed(&set), Some(JobSecret::new(b"from-code").sign(b"record")));

        let unset = InitOptions::default().defaults_from(&|name| match name {
            FAULTS_ENV => None,
            name => env(name),
        });
        let unset = unset.expect("the environment's values parse");
        assert_eq!(unset.transport, Some(TransportChoice::Shm));
        assert_eq!(unset.faults, None);
        assert_eq!(signed(&unset), Some(JobSecret::new(b"from-the-env").sign(b"record")));
        let error = InitOptions::default().defaults_from(&env).unwrap_err();
        assert!(matches!(error, InitError::Mesh(MeshError::Faults(_))), "{error}");
        let none = InitOptions::default().defaults_from(&|_| None).unwrap();
        assert_eq!(
            (none.transport, none.faults, none.job_secret.is_none()),
            (Some(TransportChoice::Auto), None, true)
        );
    }

    /// `options` completed from an environment of `vars` only.
    fn with_vars(options: InitOptions, vars: &[(&str, &str)]) -> Result<InitOptions, InitError> {
        let vars: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        options.defaults_from(&|name| vars.get(name).cloned())
    }

    /// Whether `error` is a supervision setting's bad value in `name`.
    fn bad_supervision_value(error: &InitError, name: &str) -> bool {
        matches!(error, InitError::Supervision(SupervisionConfigError::BadValue { name: n, .. }) if *n == name)
    }

    #[test]
    fn a_shm_budget_set_in_code_wins_over_chorus_shm_budget() {
        let set = with_vars(InitOptions::default().shm_budget(1 << 30), &[(SHM_BUDGET_ENV, "lots")])
            .expect("the environment's budget is not read when one is set in code");
        assert_eq!(set.shm_budget, Some(1 << 30));
        assert_eq!(set.link_options().shm_budget, 1 << 30);
        let from_env = with_vars(InitOptions::default(), &[(SHM_BUDGET_ENV, "2G")]).unwrap();
        assert_eq!(from_env.shm_budget, Some(2 << 30));
        let default = with_vars(InitOptions::default(), &[]).unwrap();
        assert_eq!(default.link_options().shm_budget, SHM_BUDGET);
        let error = with_vars(InitOptions::default(), &[(SHM_BUDGET_ENV, "lots")]).unwrap_err();
        assert!(matches!(error, InitError::Mesh(MeshError::BadShmBudget(_))), "{error}");
        assert!(error.to_string().contains(SHM_BUDGET_ENV), "{error}");
    }

    #[test]
    fn algorithms_set_in_code_win_over_chorus_algo() {
        let ring = Overrides::parse("ring").unwrap();
        let set = with_vars(InitOptions::default().algorithms(ring.clone()), &[(ALGO_ENV, "bogus")])
            .expect("the environment's algorithms are not read when set in code");
        assert_eq!(set.algorithms, Some(ring));
        let tree = "broadcast=binomial_tree";
        let from_env = with_vars(InitOptions::default(), &[(ALGO_ENV, tree)]).unwrap();
        assert_eq!(from_env.algorithms, Some(Overrides::parse(tree).unwrap()));
        let blank = with_vars(InitOptions::default(), &[(ALGO_ENV, " ")]).unwrap();
        assert_eq!(blank.algorithms, Some(Overrides::default()));
        let error = with_vars(InitOptions::default(), &[(ALGO_ENV, "bogus")]).unwrap_err();
        assert!(
            matches!(&error, InitError::Algorithm(message) if message.starts_with("CHORUS_ALGO:")),
            "{error}"
        );
    }

    #[test]
    fn algorithm_thresholds_set_in_code_win_over_chorus_algo_thresholds() {
        let code = Thresholds::parse("recursive_doubling=1K").unwrap();
        let set = with_vars(
            InitOptions::default().algorithm_thresholds(code),
            &[(ALGO_THRESHOLDS_ENV, "bogus")],
        )
        .expect("the environment's thresholds are not read when set in code");
        assert_eq!(set.algorithm_thresholds, Some(code));
        assert_eq!(set.overrides().thresholds(), code);
        let text = "recursive_doubling=256K,halving_doubling=4M";
        let from_env = with_vars(InitOptions::default(), &[(ALGO_THRESHOLDS_ENV, text)]).unwrap();
        assert_eq!(from_env.overrides().thresholds(), Thresholds::parse(text).unwrap());
        // Unset, the thresholds in the options' algorithms stand.
        let within = Overrides::default().with_thresholds(code);
        let kept = with_vars(InitOptions::default().algorithms(within), &[]).unwrap();
        assert_eq!((kept.algorithm_thresholds, kept.overrides().thresholds()), (None, code));
        let error = with_vars(InitOptions::default(), &[(ALGO_THRESHOLDS_ENV, "bogus")]).unwrap_err();
        assert!(
            matches!(&error, InitError::Algorithm(message) if message.starts_with("CHORUS_ALGO_THRESHOLDS:")),
            "{error}"
        );
    }

    #[test]
    fn a_heartbeat_timeout_set_in_code_wins_over_chorus_heartbeat_timeout() {
        let set = with_vars(
            InitOptions::default().heartbeat_timeout(Duration::from_secs(2)),
            &[(HEARTBEAT_TIMEOUT_ENV, "soon")],
        )
        .expect("the environment's window is not read when set in code");
        assert_eq!(set.heartbeat_timeout, Some(Duration::from_secs(2)));
        let from_env = with_vars(InitOptions::default(), &[(HEARTBEAT_TIMEOUT_ENV, "0.5")]).unwrap();
        assert_eq!(from_env.heartbeat_timeout, Some(Duration::from_millis(500)));
        assert_eq!(with_vars(InitOptions::default(), &[]).unwrap().heartbeat_timeout, None);
        let error = with_vars(InitOptions::default(), &[(HEARTBEAT_TIMEOUT_ENV, "soon")]).unwrap_err();
        assert!(bad_supervision_value(&error, HEARTBEAT_TIMEOUT_ENV), "{error}");
    }

    #[test]
    fn a_watchdog_timeout_set_in_code_wins_over_chorus_watchdog_timeout() {
        let set = with_vars(
            InitOptions::default().watchdog_timeout(Duration::from_secs(60)),
            &[(WATCHDOG_TIMEOUT_ENV, "-1")],
        )
        .expect("the environment's timeout is not read when set in code");
        assert_eq!(set.watchdog_timeout, Some(Duration::from_secs(60)));
        let from_env = with_vars(InitOptions::default(), &[(WATCHDOG_TIMEOUT_ENV, "30")]).unwrap();
        assert_eq!(from_env.watchdog_timeout, Some(Duration::from_secs(30)));
        assert_eq!(with_vars(InitOptions::default(), &[]).unwrap().watchdog_timeout, None);
        let error = with_vars(InitOptions::default(), &[(WATCHDOG_TIMEOUT_ENV, "-1")]).unwrap_err();
        assert!(bad_supervision_value(&error, WATCHDOG_TIMEOUT_ENV), "{error}");
    }

    #[test]
    fn an_error_handling_mode_set_in_code_wins_over_the_environment() {
        let both = [("CHORUS_BLOCKING_WAIT", "1"), ("CHORUS_ASYNC_ERROR_HANDLING", "9")];
        let set = with_vars(InitOptions::default().error_handling(ErrorHandling::CleanUpOnly), &both)
            .expect("the environment's mode is not read when set in code");
        assert_eq!(set.error_handling, Some(ErrorHandling::CleanUpOnly));
        assert_eq!(
            set.error_handling_or_env().unwrap(),
            ErrorHandling::CleanUpOnly,
            "what an NCCL group takes"
        );
        let from_env = with_vars(InitOptions::default(), &[("CHORUS_ASYNC_ERROR_HANDLING", "3")]).unwrap();
        assert_eq!(from_env.error_handling, Some(ErrorHandling::TearDown));
        let default = with_vars(InitOptions::default(), &[]).unwrap();
        assert_eq!(default.error_handling, Some(ErrorHandling::Abort));
        let error = with_vars(InitOptions::default(), &both).unwrap_err();
        assert!(bad_supervision_value(&error, "CHORUS_ASYNC_ERROR_HANDLING"), "{error}");
    }

    /// A plan in the options kills rank 2 of a `spawn`ed group, with no
    /// `CHORUS_FAULTS` (this binary sets none).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fault_plan_given_in_code_acts() {
        let options = InitOptions::default()
            .heartbeat_timeout(Duration::from_secs(2))
            .faults(FaultPlan::parse("kill(rank=2, after_frames=20)").unwrap());
        let run = spawn_with(3, options, |pg| async move {
            for _ in 0..1000 {
                pg.all_reduce(Tensor::from_slice(&[1.0f32; 64]), ReduceOp::Sum).await?;
            }
            Ok::<_, CollectiveError>(())
        });
        let results = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .expect("3 in-process ranks, one killed, did not end within 60 s")
            .expect("the group forms");
        for (rank, result) in results.iter().enumerate() {
            assert!(result.is_err(), "rank {rank} must fail: rank 2 is killed: {results:?}");
        }
    }

    /// Two rank processes' worth of `init_process_group` in this one: the
    /// secrets set in code sign and check the records.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_secret_given_in_code_signs_and_checks_the_records() {
        let pair = |secrets: [&'static [u8]; 2]| async move {
            // A store no rank serves: a rank that fails does not take it
            // from the other in the middle of its rendezvous.
            let store: Arc<dyn Store> = Arc::new(HashStore::default());
            let ranks = (0..2).map(|rank| {
                let options = InitOptions {
                    init_method: InitMethod::Store(store.clone()),
                    ..InitOptions::default()
                }
                .rank(rank)
                .world_size(2)
                .timeout(Duration::from_secs(20))
                .job_secret(JobSecret::new(secrets[rank]));
                tokio::spawn(init_process_group(options))
            });
            let mut formed = Vec::new();
            for rank in ranks.collect::<Vec<_>>() {
                let outcome = tokio::time::timeout(Duration::from_secs(60), rank)
                    .await
                    .expect("init_process_group did not end within 60 s of its 20 s timeout");
                formed.push(outcome.expect("the rank's task"));
            }
            formed
        };
        let formed = pair([b"one secret", b"one secret"]).await;
        let mut groups = Vec::new();
        for group in formed {
            groups.push(group.expect("ranks with one secret form"));
        }
        let leaving = groups.into_iter().map(|group| tokio::spawn(group.destroy()));
        for left in leaving.collect::<Vec<_>>() {
            left.await.expect("the rank's task").expect("destroy");
        }
        for (rank, outcome) in pair([b"one secret", b"another"]).await.into_iter().enumerate() {
            let error = outcome.expect_err("ranks with different secrets must not form");
            assert!(
                matches!(error, InitError::Mesh(MeshError::Unauthenticated { rank: peer, .. }) if peer == 1 - rank),
                "rank {rank}: {error}"
            );
        }
    }

    /// The store comes up only after 1 s and rank 0 never comes: the
    /// rendezvous gets what the store's connection left of the 2 s, so the
    /// whole init fails at 2 s (not 1 s + 2 s), naming the rendezvous.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_stage_shares_one_deadline_and_the_error_names_the_one_that_ran_out() {
        let port = free_port();
        let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let late_store = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            TcpStoreServer::bind(addr, TcpStoreServerOptions::default()).await
        });
        let timeout = Duration::from_secs(2);
        let options = InitOptions::from_url(&format!("tcp://127.0.0.1:{port}"))
            .expect("a tcp:// URL")
            .rank(1)
            .world_size(2)
            .timeout(timeout);
        let started = Instant::now();
        let outcome = tokio::time::timeout(Duration::from_secs(20), init_process_group(options))
            .await
            .expect("init_process_group did not end within 20 s of its 2 s timeout");
        let took = started.elapsed();
        let _server = late_store.await.expect("the store task").expect("the store binds");
        let error = outcome.expect_err("rank 0 never came, so the group cannot form");
        assert!(
            matches!(&error, InitError::TimedOut { stage: InitStage::Rendezvous, timeout: t, cause: Some(_) } if *t == timeout),
            "{error}"
        );
        assert!(
            matches!(error.cause(), InitError::Rendezvous(RendezvousError::Incomplete { missing, .. }) if missing == &[0]),
            "{error}"
        );
        let message = error.to_string();
        assert!(
            message.starts_with("initialisation ran out of its 2s timeout while waiting for every rank's record (rendezvous): rendezvous of generation 0 timed out"),
            "{message}"
        );
        assert!(
            took >= Duration::from_millis(1900) && took < timeout + Duration::from_millis(700),
            "init took {took:?}, its timeout was {timeout:?}"
        );
    }
}
