//! `chorus launch`: starts a node's workers the way torchrun does, so
//! unmodified PyTorch scripts and chorus programs run under it.
//!
//! The launcher of a job serves the job's store at `MASTER_ADDR:MASTER_PORT`
//! and tells the workers so (`TORCHELASTIC_USE_AGENT_STORE=True`): rank 0
//! connects to it instead of serving its own, and the store outlives any
//! worker. With `--rdzv-backend etcd` the store is in etcd instead: no
//! launcher serves it, and the workers get its URL (`CHORUS_STORE`), so
//! losing any launcher's host leaves it to the others. With several nodes
//! the launchers meet on that store in rounds,
//! agree on each round's nodes, dense node ranks and `--nproc-per-node`, and
//! restart together: a failure anywhere, a hung launcher, or a launcher
//! waiting to join (`--nnodes MIN:MAX`) advances the store's round counter,
//! which every launcher watches (see `nodes` for the rules and keys).
//!
//! # Layout
//! - `config`: sans-IO; flags and `PET_*` variables into a [`LaunchConfig`],
//!   and where the store is served ([`config::StorePlan`]).
//! - `env`: sans-IO; the environment of each worker ([`env::JobEnv`]).
//! - `plan`: sans-IO; restart policy, when a round's group is formed and how
//!   its nodes rank, when to admit a waiting node, keep-alives, exit codes.
//! - `nodes`: serving or reaching the store; the launchers' rounds, their
//!   key layout and shared secret on it.
//! - `records`: sans-IO; the rounds' records as the store holds them
//!   (`joiners` lines, the `closed` group, the `end`), parsed totally.
//! - `workers`: the worker processes of one attempt and their output.
//! - `fork_server`: the pre-started Python process replacement workers are
//!   forked from (its command parsing and protocol sans IO;
//!   `fork_server.py` is the server).
//!
//! - this file: the driver tying them together ([`main`]).
//!
//! # Restart policies
//! `--restart-policy all` (the default) is torchrun's: a failed worker stops
//! every worker and the group restarts as attempt n+1. `worker` reports the
//! failure the same way but relaunches only that worker, in its local rank
//! slot with `TORCHELASTIC_RESTART_COUNT` advanced (its files under
//! `attempt_<n>/`), while the others keep running; an `ElasticGroup`
//! program takes it into its next generation, where its rank may differ from
//! `RANK`. `--max-restarts` counts restarts per job under `all` and per node
//! under `worker` (on one node the same thing; with several, each launcher
//! relaunches and counts its own workers, as torchrun's agents count theirs).
//!
//! With several nodes, `worker` leaves node churn to the workers too: a node
//! that leaves (its keep-alive stands still) or joins changes the launchers'
//! record of who the nodes are (the next round), but no launcher restarts
//! its workers for it; the workers re-form without the lost ranks (within
//! `CHORUS_MIN_WORLD`) and take a new node's workers into their next
//! generation (SV-13). Every worker gets the bounds of its group's size,
//! `CHORUS_MIN_WORLD` / `CHORUS_MAX_WORLD` = `--nnodes` MIN / MAX times
//! `--nproc-per-node`. A node whose worker fails past its `--max-restarts`
//! ends the job for every node; the job succeeds once every node of the
//! current round has seen all its workers succeed. The rules and keys are in
//! [`nodes`] (rules 6-10); `run_elastic_round` drives them.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use thiserror::Error;
use tokio::signal::unix::{Signal, SignalKind, signal};

pub mod config;
pub mod env;
pub mod fork_server;
pub mod nodes;
pub mod plan;
pub mod records;
pub mod workers;

pub use config::{ConfigError, LaunchConfig, Parsed, RestartPolicy};

use chorus::binding::{self, BindingError, Topology};
use chorus_runtime::rendezvous::{HostId, elastic};
use chorus_runtime::store::{Store, StoreError};
use config::{HostFacts, Streams};
use nodes::{JobStore, Joining, Keys};
use plan::AfterFailure;
use records::RoundEnd;
use workers::{WorkerSpec, Workers};

/// Why a launch failed before or between its workers' runs.
#[derive(Debug, Error)]
pub enum LaunchError {
    /// The command line is wrong.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The program is not there.
    #[error(
        "program {0} not found (not a file, or not on PATH, or not executable); check the path, or name a .py script"
    )]
    ProgramNotFound(String),
    /// The store cannot be served.
    #[error(
        "cannot serve the store on {addr}: {source}; pick another --master-port (or --rdzv-endpoint port), or use --standalone"
    )]
    Bind {
        /// Address tried.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// This launcher must serve the store but the address is elsewhere.
    #[error(
        "{0} is not an address of this machine, but this launcher must serve the store there (single node, or --node-rank 0); fix --master-addr / --rdzv-endpoint"
    )]
    NotLocal(String),
    /// The store's host name does not resolve.
    #[error("{0} does not resolve; fix --master-addr / --rdzv-endpoint")]
    Unresolvable(String),
    /// A worker could not be started.
    #[error("cannot start rank {rank} ({program}): {source}")]
    Spawn {
        /// Program.
        program: String,
        /// Rank.
        rank: usize,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// `--numa-binding` cannot be met on this host.
    #[error(transparent)]
    Binding(#[from] BindingError),
    /// `--dashboard` cannot be served.
    #[error(transparent)]
    Dashboard(#[from] crate::dashboard::DashboardError),
    /// Not enough nodes arrived in time.
    #[error(
        "only {joined} of {expected} nodes joined within {waited:?}; start `chorus launch` with the same --nnodes, --rdzv-id and store address on every node, or raise --rdzv-conf join_timeout"
    )]
    NodesMissing {
        /// Nodes that arrived.
        joined: usize,
        /// Nodes needed.
        expected: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// The job runs at its most nodes and this launcher waited in vain.
    #[error(
        "the job runs with its maximum of {max} nodes (--nnodes); this launcher waited {waited:?} for a place and gives up; start it once a node has left, raise the upper bound of --nnodes, or raise --rdzv-conf join_timeout"
    )]
    JobFull {
        /// The upper bound of `--nnodes`.
        max: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// The running group did not restart to take this launcher in.
    #[error(
        "the running job ({running} nodes) did not restart to admit this launcher within {waited:?} (a node of it may have finished already); start it with the same --rdzv-id, or raise --rdzv-conf join_timeout"
    )]
    NotAdmitted {
        /// Nodes in the running group.
        running: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// The job ended while this launcher waited to join it.
    #[error("the job ended before this launcher could join it: {why}")]
    JobEnded {
        /// How it ended.
        why: String,
    },
    /// The launcher serving the store is gone.
    #[error(
        "lost the job's store at {addr} ({source}): {}; start the job again",
        who_is_gone(addr)
    )]
    StoreLost {
        /// Where the store was (`etcd://...` when it is in etcd).
        addr: String,
        /// What failed.
        #[source]
        source: StoreError,
    },
    /// The store did not answer within the keep-alive window after this
    /// node's workers failed.
    #[error(
        "could not reach the job's store at {addr} within {waited:?} (the keep-alive window) after this node's workers failed; is this node cut off from the network?"
    )]
    StoreUnreachable {
        /// Where the store is.
        addr: String,
        /// How long it was given.
        waited: Duration,
    },
    /// Two launchers claim one node rank.
    #[error("node rank {node_rank} is already taken by launcher {other}; give each node its own --node-rank, or none")]
    DuplicateNodeRank {
        /// The rank.
        node_rank: usize,
        /// The launcher that holds it.
        other: String,
    },
    /// Nodes disagree on `--nproc-per-node`.
    #[error(
        "this node runs --nproc-per-node {mine} but node {other_node} (launcher {other_id}) runs {other}; give every node the same --nproc-per-node"
    )]
    NprocMismatch {
        /// This node's count.
        mine: usize,
        /// The other node.
        other_node: usize,
        /// Its launcher.
        other_id: String,
        /// Its count.
        other: String,
    },
    /// Launchers of one job run different restart policies.
    #[error(
        "this launcher runs --restart-policy {mine} but the job's other launchers run {theirs}; give every node the same --restart-policy"
    )]
    PolicyMismatch {
        /// This launcher's policy.
        mine: String,
        /// The job's.
        theirs: String,
    },
    /// A multi-node launcher found no secret to share.
    #[error(
        "no job secret arrived from the launcher serving the store; set CHORUS_JOB_SECRET or --job-secret-file on every node"
    )]
    NoSecret,
    /// The secret file cannot be read.
    #[error("cannot read the job secret from {path}: {reason}; give a readable, non-empty file")]
    SecretFile {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Setting up the launcher (signals, directories) failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl LaunchError {
    /// The launcher's exit code: 2 for input to fix (as with a bad command
    /// line), 1 for failures while running.
    pub fn exit_code(&self) -> u8 {
        match self {
            LaunchError::Config(_)
            | LaunchError::ProgramNotFound(_)
            | LaunchError::Bind { .. }
            | LaunchError::NotLocal(_)
            | LaunchError::Unresolvable(_)
            | LaunchError::SecretFile { .. }
            | LaunchError::Binding(_)
            | LaunchError::PolicyMismatch { .. } => 2,
            _ => 1,
        }
    }
}

/// Runs `chorus launch` with `args` (everything after `launch`) and returns
/// the launcher's exit code.
pub fn main(args: &[String]) -> ExitCode {
    let lookup = |name: &str| std::env::var(name).ok();
    let host = HostFacts {
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        gpus: count_gpus(),
    };
    let config = match config::parse(args, &lookup, host) {
        Ok(Parsed::Help) => {
            print!("{}", config::USAGE);
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Launch(config)) => *config,
        Err(error) => return fail(&error.into()),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(source) => {
            return fail(&LaunchError::Io {
                what: "starting the async runtime".into(),
                source,
            });
        }
    };
    let outcome = runtime.block_on(launch(config));
    // Workers killed while forming leave their rings behind (shm rule 3):
    // the launcher removes every dead rank's once its own are gone.
    chorus_transports::shm::remove_dead_rings(&chorus_transports::shm::ShmOptions::default().dir);
    match outcome {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(error) => fail(&error),
    }
}

fn fail(error: &LaunchError) -> ExitCode {
    print_line(&format!("chorus launch: error: {error}"));
    ExitCode::from(error.exit_code())
}

fn say(message: impl std::fmt::Display) {
    print_line(&format!("chorus launch: {message}"));
}

/// Prints one of the launcher's own lines.
type PrintLine = Box<dyn Fn(&str) + Send + Sync>;

/// Where the launcher's own lines go, when not to stderr.
static LINES: std::sync::OnceLock<PrintLine> = std::sync::OnceLock::new();

/// Has the launcher's own lines (its notes and failure reports, not the
/// workers' output) go to `print` instead of stderr, for the rest of the
/// process: a program that launches through this library and draws a
/// progress bar prints them above it (the training example). Returns
/// whether it took (only the first call does).
pub fn print_lines_with(print: impl Fn(&str) + Send + Sync + 'static) -> bool {
    LINES.set(Box::new(print)).is_ok()
}

fn print_line(line: &str) {
    match LINES.get() {
        Some(print) => print(line),
        None => eprintln!("{line}"),
    }
}

/// GPUs visible as `/dev/nvidia<N>`.
fn count_gpus() -> usize {
    std::fs::read_dir("/dev").map_or(0, |dir| {
        dir.filter_map(Result::ok)
            .filter(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.strip_prefix("nvidia")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
            .count()
    })
}

/// Whether `program` names an executable file, directly or on `PATH`.
fn program_exists(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let executable =
        |path: &Path| std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    if program.contains('/') {
        return executable(Path::new(program));
    }
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| executable(&dir.join(program))))
}

/// This launcher's own executable when `program` is `chorus` and the
/// launcher is the `chorus` command: `chorus launch -- chorus selftest`
/// then runs the same build, whether or not (and whichever) `chorus` is on
/// PATH. Not when another program launches through this library (the
/// examples): its executable is not `chorus`.
fn own_executable(program: &str) -> Option<String> {
    let own = std::env::current_exe().ok()?;
    (program == "chorus" && own.file_name()? == "chorus").then(|| own.display().to_string())
}

/// `bytes` random bytes in hex (a job secret, a run id), failing as the
/// launcher does.
fn random_hex(bytes: usize) -> Result<String, LaunchError> {
    chorus::auth::random_hex(bytes).map_err(|source| LaunchError::Io {
        what: "drawing random bytes".into(),
        source,
    })
}

/// The signals the launcher forwards to its workers (torchrun's
/// `--signals-to-handle` default).
struct Signals(Vec<(i32, Signal)>);

impl Signals {
    fn new() -> Result<Self, LaunchError> {
        [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT]
            .into_iter()
            .map(|n| {
                signal(SignalKind::from_raw(n))
                    .map(|s| (n, s))
                    .map_err(|source| LaunchError::Io {
                        what: "installing signal handlers".into(),
                        source,
                    })
            })
            .collect::<Result<_, _>>()
            .map(Signals)
    }

    /// The next signal received.
    async fn recv(&mut self) -> i32 {
        let waits = self.0.iter_mut().map(|(n, s)| {
            let n = *n;
            Box::pin(async move {
                s.recv().await;
                n
            })
        });
        futures_select_all(waits).await
    }
}

/// The first of several futures to finish.
async fn futures_select_all<F: std::future::Future<Output = i32> + Unpin>(futures: impl Iterator<Item = F>) -> i32 {
    let mut futures: Vec<F> = futures.collect();
    std::future::poll_fn(|cx| {
        for future in &mut futures {
            if let std::task::Poll::Ready(n) = std::pin::Pin::new(future).poll(cx) {
                return std::task::Poll::Ready(n);
            }
        }
        std::task::Poll::Pending
    })
    .await
}

/// How one round on this node ended.
enum Outcome {
    /// Every local worker succeeded.
    Succeeded,
    /// A local worker failed.
    Failed(workers::Ended),
    /// Another node ended the round.
    Moved,
    /// This launcher waits to join, and the group has room for it.
    Waiting(String),
    /// This member's keep-alive stood still: it is taken for hung.
    Stalled(String),
    /// This node's workers stop and the launcher ends, under either
    /// restart policy.
    Leave(Leave),
}

/// The ends of a round after which this launcher stops its workers and
/// exits, whatever its restart policy.
enum Leave {
    /// The launcher got this signal.
    Signaled(i32),
    /// The store is out of reach.
    StoreLost(StoreError),
    /// The store did not answer within the keep-alive window.
    StoreUnreachable(Duration),
    /// Another node ended the job for good (`--restart-policy worker`).
    Over(String),
}

impl Leave {
    /// Stops this node's workers (with the signal the launcher got, else
    /// SIGTERM) and says how the launcher ends.
    async fn stop_workers(self, workers: &mut Workers, job: &Job) -> Result<AfterRound, LaunchError> {
        let signo = match &self {
            Leave::Signaled(signo) => {
                say(format!("got {}; stopping the workers", plan::signal_name(*signo)));
                *signo
            }
            _ => libc::SIGTERM,
        };
        workers.stop(signo, job.config.shutdown_timeout).await;
        match self {
            Leave::Signaled(signo) => Ok(AfterRound::Exit(128 + signo)),
            Leave::StoreLost(source) => Err(LaunchError::Store(source)),
            Leave::StoreUnreachable(waited) => Err(LaunchError::StoreUnreachable {
                addr: job.store.addr(),
                waited,
            }),
            Leave::Over(why) => {
                say(format!("the job ended: {why}; stopped this node's workers"));
                Ok(AfterRound::Exit(1))
            }
        }
    }
}

/// Everything fixed for the whole run.
struct Job {
    config: LaunchConfig,
    store: JobStore,
    keys: Keys,
    run_id: String,
    secret: String,
    launcher_id: String,
    /// `<log dir>/<run id>` or a temporary directory, holding `attempt_<n>/<rank>/`.
    run_dir: PathBuf,
    /// Whether `run_dir` is ours to remove at the end.
    temporary: bool,
    /// Each local rank's CPUs (`--numa-binding`); empty when unbound.
    cpus: Vec<Vec<usize>>,
}

async fn launch(mut config: LaunchConfig) -> Result<i32, LaunchError> {
    if let Some(own) = own_executable(&config.command[0]) {
        config.command[0] = own;
    }
    if !program_exists(&config.command[0]) {
        return Err(LaunchError::ProgramNotFound(config.command[0].clone()));
    }
    let cpus = match config.numa_binding {
        Some(mode) => {
            let cpus = Topology::read()?.plan(mode, config.nproc_per_node)?;
            let each: Vec<String> = cpus.iter().map(|c| binding::format_cpu_list(c)).collect();
            say(format!(
                "--numa-binding {mode}: local ranks on CPUs {}",
                each.join(" | ")
            ));
            cpus
        }
        None => Vec::new(),
    };
    let mut signals = Signals::new()?;
    if config.nproc_per_node > 1 && std::env::var_os("OMP_NUM_THREADS").is_none() {
        say(
            "setting OMP_NUM_THREADS=1 for each worker (as torchrun does) to avoid overloading the machine; \
             set it yourself to tune it",
        );
    }
    let plan = config.store_plan();
    let store = tokio::select! {
        store = nodes::open(&plan, config.join_timeout) => store?,
        signo = signals.recv() => return Ok(128 + signo),
    };
    let keys_run_id = config.run_id(|| random_hex(16).unwrap_or_else(|_| std::process::id().to_string()));
    let keys = Keys::new(&keys_run_id);
    let secret = tokio::select! {
        secret = job_secret(&config, &store, &keys) => secret?,
        signo = signals.recv() => return Ok(128 + signo),
    };
    // Its own task: the dashboard failing later never stops the job.
    let dashboard = match &config.dashboard {
        Some(addr) => {
            let options = crate::dashboard::DashboardOptions {
                addr: addr.clone(),
                faults: config.dashboard_faults,
                secret: secret.clone(),
                run_id: Some(keys_run_id.clone()),
            };
            let dashboard = crate::dashboard::start(store.store.clone(), &options).await?;
            if let Some(warning) = dashboard.exposure_warning() {
                say(warning);
            }
            let faults = match config.dashboard_faults {
                true => "faults on, with the job secret",
                false => "faults off",
            };
            say(format!("dashboard at {} ({faults})", dashboard.url()));
            Some(dashboard)
        }
        None => None,
    };
    let (run_dir, temporary) = match &config.log_dir {
        Some(dir) => (dir.join(&keys_run_id), false),
        None => (
            std::env::temp_dir().join(format!("chorus-launch-{}-{}", std::process::id(), random_hex(4)?)),
            true,
        ),
    };
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let mut job = Job {
        launcher_id: format!("{}:{}", hostname.trim(), std::process::id()),
        config,
        store,
        keys,
        run_id: keys_run_id,
        secret,
        run_dir,
        temporary,
        cpus,
    };
    let result = run(&job, &mut signals).await;
    if job.temporary {
        let _ = std::fs::remove_dir_all(&job.run_dir);
    }
    let server = job.store.server.take();
    // Our own connections must not hold the server's shutdown open.
    drop(dashboard);
    drop(job);
    if let Some(server) = server {
        // Lets the other nodes' launchers read the final state before the store goes.
        server.shutdown().await;
    }
    result
}

/// Who took the job's store along, by its address.
fn who_is_gone(addr: &str) -> &'static str {
    if addr.starts_with("etcd://") {
        "etcd does not answer at any endpoint, and the job cannot go on without it"
    } else {
        "the launcher serving it has left, and the job cannot go on without it (as with torchrun's c10d store host): the store on one launcher's host is a single point of failure; `--rdzv-backend etcd` with a 3-member etcd cluster avoids it"
    }
}

/// The job secret: CHORUS_JOB_SECRET, else `--job-secret-file`, else a fresh
/// one (single node), else one the store's host publishes (multi-node).
async fn job_secret(config: &LaunchConfig, store: &JobStore, keys: &Keys) -> Result<String, LaunchError> {
    if let Some(secret) = std::env::var("CHORUS_JOB_SECRET").ok().filter(|s| !s.is_empty()) {
        return Ok(secret);
    }
    if let Some(path) = &config.job_secret_file {
        let secret = std::fs::read_to_string(path).map_err(|e| LaunchError::SecretFile {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        let secret = secret.trim();
        if secret.is_empty() {
            return Err(LaunchError::SecretFile {
                path: path.clone(),
                reason: "it is empty".into(),
            });
        }
        return Ok(secret.to_string());
    }
    let fresh = random_hex(32)?;
    if config.max_nodes == 1 {
        return Ok(fresh);
    }
    let hosting = store.server.is_some() || store.replicated();
    if hosting {
        say(
            "warning: no CHORUS_JOB_SECRET or --job-secret-file; publishing a generated job secret in the store, where anyone who can reach it can read it",
        );
    }
    nodes::shared_secret(store.store.as_ref(), keys, hosting, || fresh, config.join_timeout).await
}

/// A store call made after a failure, given up on after the keep-alive
/// window: a launcher cut off from the store then reports and exits
/// instead of waiting out `join_timeout` (what it has to say is printed
/// before).
async fn bounded<T>(
    job: &Job,
    call: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, LaunchError> {
    let waited = job.config.keep_alive_timeout;
    match tokio::time::timeout(waited, call).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(LaunchError::StoreUnreachable {
            addr: job.store.addr(),
            waited,
        }),
    }
}

/// Publishes that worker `pid` exited (`elastic::publish_exit`), under
/// the run ids its groups may use, so ranks on other hosts fail it at once
/// and an elastic rendezvous need not wait for it; with the peers its
/// error file blames, when it exited after its group aborted, so that
/// they are blamed and not it.
async fn publish_exit(job: &Job, job_env: &env::JobEnv, pid: i32, error_file: &Path) -> Result<(), LaunchError> {
    let store = job.store.store.as_ref();
    let host = HostId::local().hostname;
    let exit = elastic::Exit {
        blamed: chorus::error_file::ErrorReport::read(error_file)
            .map(|report| report.failed.into_iter().map(|peer| (peer.host, peer.pid)).collect())
            .unwrap_or_default(),
    };
    for run_id in job_env.group_run_ids() {
        bounded(job, elastic::publish_exit(store, &run_id, &host, pid as u32, &exit)).await?;
    }
    Ok(())
}

/// Runs rounds until the job succeeds, fails for good or is signalled.
async fn run(job: &Job, signals: &mut Signals) -> Result<i32, LaunchError> {
    // After the store was reached, a store error means its host is gone.
    run_rounds(job, signals).await.map_err(|error| match error {
        LaunchError::Store(source) => LaunchError::StoreLost {
            addr: job.store.addr(),
            source,
        },
        error => error,
    })
}

/// The launcher's rounds: it joins one, runs its workers there until the
/// round ends for it ([`GroupRound`] or [`ElasticRound`]), then joins the
/// next or exits.
async fn run_rounds(job: &Job, signals: &mut Signals) -> Result<i32, LaunchError> {
    let config = &job.config;
    let store = job.store.store.as_ref();
    let mut round = nodes::current_attempt(store, &job.keys).await?;
    if config.max_nodes > 1 {
        let policy = match config.restart_policy {
            RestartPolicy::All => "all",
            RestartPolicy::Worker => "worker",
        };
        nodes::agree_policy(store, &job.keys, policy).await?;
    }
    loop {
        let formed = match join_round(job, signals, &mut round).await? {
            Joined::Formed(formed) => formed,
            Joined::Signaled(signo) => return Ok(128 + signo),
        };
        let job_env = round_env(job, &formed, round);
        let mut workers = Workers::spawn(specs(job, &job_env)?, config.shutdown_timeout).await?;
        let after = if config.restart_policy == RestartPolicy::Worker {
            run_elastic_round(job, signals, formed, job_env, &mut workers).await?
        } else {
            let group = GroupRound {
                job,
                round,
                formed,
                job_env,
                workers: &mut workers,
            };
            group.run(signals).await?
        };
        match after {
            AfterRound::Exit(code) => return Ok(code),
            AfterRound::Rejoin(next) => round = next,
        }
    }
}

/// How joining a round ended.
enum Joined {
    /// This node's place in the round.
    Formed(nodes::Formed),
    /// The launcher got this signal first (and withdrew).
    Signaled(i32),
}

/// Joins `round`, or the later one the launchers form (`round` is moved on
/// to it).
async fn join_round(job: &Job, signals: &mut Signals, round: &mut u64) -> Result<Joined, LaunchError> {
    let config = &job.config;
    let store = job.store.store.as_ref();
    let joining = Joining {
        node_rank: config.node_rank,
        nproc_per_node: config.nproc_per_node,
        min_nodes: config.min_nodes,
        max_nodes: config.max_nodes,
        join_timeout: config.join_timeout,
        last_call_timeout: config.last_call_timeout,
        poll: config.monitor_interval.max(Duration::from_millis(10)),
        launcher_id: &job.launcher_id,
    };
    let joined = tokio::select! {
        formed = nodes::join(store, &job.keys, round, &joining) => Ok(formed),
        signo = signals.recv() => Err(signo),
    };
    let formed = match joined {
        Ok(formed) => formed?,
        Err(signo) => {
            // Best effort: the launcher is leaving either way.
            let _ = nodes::withdraw(store, &job.keys, *round, &job.launcher_id).await;
            return Ok(Joined::Signaled(signo));
        }
    };
    if config.max_nodes > 1 {
        say(format!(
            "round {round}: this launcher ({}) is node {} of {}",
            job.launcher_id, formed.node_rank, formed.nnodes
        ));
    }
    Ok(Joined::Formed(formed))
}

/// The environment of this node's workers in `round`.
fn round_env(job: &Job, formed: &nodes::Formed, round: u64) -> env::JobEnv {
    let config = &job.config;
    env::JobEnv {
        role: config.role.clone(),
        nproc_per_node: config.nproc_per_node,
        node_rank: formed.node_rank,
        nnodes: formed.nnodes,
        master_addr: job.store.host.clone(),
        master_port: job.store.port,
        store_url: job.store.url.clone(),
        // Every round restarts the workers, so each gets its own count:
        // chorus workers take it as their rendezvous generation.
        restart_count: round,
        max_restarts: config.max_restarts,
        run_id: job.run_id.clone(),
        secret: job.secret.clone(),
        attempt_dir: env::attempt_dir(&job.run_dir, round),
        elastic_world: (config.restart_policy == RestartPolicy::Worker).then_some((
            config.min_nodes * config.nproc_per_node,
            config.max_nodes * config.nproc_per_node,
        )),
        // Under the worker policy only the first round starts the group;
        // workers started in a later one join it.
        join_running: config.restart_policy == RestartPolicy::Worker && round > 0,
    }
}

/// What a node does once its workers' run in a round is over.
enum AfterRound {
    /// The launcher exits with this code.
    Exit(i32),
    /// It joins round `.0`: the next one after a group restart, or, for a
    /// node left out of a round (its workers stopped), the one it waits to
    /// join again as a newcomer.
    Rejoin(u64),
}

/// One round under `--restart-policy all` (torchrun's): this node's workers
/// run until the round ends anywhere, then every node's group restarts in
/// the next round or the job is over.
struct GroupRound<'a> {
    job: &'a Job,
    round: u64,
    formed: nodes::Formed,
    job_env: env::JobEnv,
    workers: &'a mut Workers,
}

impl GroupRound<'_> {
    async fn run(mut self, signals: &mut Signals) -> Result<AfterRound, LaunchError> {
        let (job, round) = (self.job, self.round);
        let store = job.store.store.as_ref();
        let outcome = supervise(
            self.workers,
            job,
            &self.formed,
            &mut plan::KeepAlives::default(),
            signals,
        )
        .await;
        let end = match outcome {
            Outcome::Succeeded => return self.succeeded(signals).await,
            Outcome::Failed(ended) => return self.failed(ended).await,
            Outcome::Moved => {
                self.stop(libc::SIGTERM).await;
                ended_elsewhere(store, &job.keys, round).await?
            }
            Outcome::Waiting(id) => {
                // Tell the other nodes first, so every group stops at once.
                let why = RoundEnd::Membership(format!("node {id} waits to join"));
                let won = nodes::end_round(store, &job.keys, round, &why).await?;
                self.stop(libc::SIGTERM).await;
                won
            }
            Outcome::Stalled(id) => {
                let rank = self.formed.members.iter().position(|m| *m == id).unwrap_or(0);
                let why = RoundEnd::Failure(format!(
                    "node {rank} (launcher {id}) sent no keep-alive for {:?}; taking it for hung",
                    job.config.keep_alive_timeout
                ));
                let won = nodes::end_round(store, &job.keys, round, &why).await?;
                self.stop(libc::SIGTERM).await;
                won
            }
            Outcome::Leave(leave) => return leave.stop_workers(self.workers, job).await,
        };
        self.restart_after(&end).await
    }

    async fn stop(&mut self, signo: i32) {
        self.workers.stop(signo, self.job.config.shutdown_timeout).await;
    }

    /// Every local worker succeeded: the job is over once every node's have.
    async fn succeeded(mut self, signals: &mut Signals) -> Result<AfterRound, LaunchError> {
        let store = self.job.store.store.as_ref();
        // Every worker exited: their last lines reach the console and
        // the logs before this launcher may exit (and nothing they
        // left running in their process groups outlives them).
        self.stop(libc::SIGTERM).await;
        match wait_for_nodes(self.job, &self.formed, signals).await? {
            AllDone::Yes => {
                nodes::end_job(store, &self.job.keys, self.round, "the job finished").await?;
                Ok(AfterRound::Exit(0))
            }
            AllDone::Signaled(signo) => Ok(AfterRound::Exit(128 + signo)),
            AllDone::Moved => {
                let end = ended_elsewhere(store, &self.job.keys, self.round).await?;
                self.restart_after(&end).await
            }
        }
    }

    /// A local worker failed: reports it, and ends the round for every node.
    async fn failed(mut self, ended: workers::Ended) -> Result<AfterRound, LaunchError> {
        let (job, round, job_env) = (self.job, self.round, &self.job_env);
        let (config, store) = (&job.config, job.store.store.as_ref());
        let tail = self.workers.tail(ended.rank).await;
        let reports: Vec<PathBuf> = (0..config.nproc_per_node)
            .map(|local_rank| job_env.error_file(job_env.rank(local_rank)))
            .collect();
        await_reports(&job_env.error_file(ended.rank), &reports).await;
        let (culprit, what) = failure(self.workers, &ended, self.formed.node_rank, round, &reports);
        report(&what, ended.rank, &tail, &job_env.error_file(ended.rank));
        // End the round before stopping: the others stop at once, and
        // none takes this node for hung while its workers wind down.
        // A node cut off from the store gives up within the keep-alive window.
        let ours = RoundEnd::Failure(what.clone());
        let told = async {
            publish_exit(job, job_env, ended.pid, &job_env.error_file(ended.rank)).await?;
            bounded(job, nodes::end_round(store, &job.keys, round, &ours)).await
        }
        .await;
        self.stop(libc::SIGTERM).await;
        let won = told?;
        if won != ours {
            return self.restart_after(&won).await;
        }
        match plan::after_failure(self.formed.restarts, config.max_restarts) {
            AfterFailure::Restart { next } => {
                say(format!(
                    "restarting the group (restart {next} of {})",
                    config.max_restarts
                ));
                Ok(AfterRound::Rejoin(round + 1))
            }
            AfterFailure::GiveUp => {
                say(format!(
                    "{culprit} failed and --max-restarts {} is used up; exiting",
                    config.max_restarts
                ));
                bounded(job, nodes::end_job(store, &job.keys, round, ours.what())).await?;
                Ok(AfterRound::Exit(ended.exit.launcher_code()))
            }
        }
    }

    /// After the round ended for `end` (its workers stopped): the next
    /// round, unless a failure used up `--max-restarts`.
    async fn restart_after(&self, end: &RoundEnd) -> Result<AfterRound, LaunchError> {
        let (job, config) = (self.job, &self.job.config);
        match end {
            RoundEnd::Membership(why) => say(format!(
                "{why}; restarting the workers to admit it (a membership change: --max-restarts is not used)"
            )),
            RoundEnd::Failure(what) => match plan::after_failure(self.formed.restarts, config.max_restarts) {
                AfterFailure::Restart { next } => say(format!(
                    "{what}; restarting this node's workers (restart {next} of {})",
                    config.max_restarts
                )),
                AfterFailure::GiveUp => {
                    say(format!(
                        "{what}; --max-restarts {} is used up; exiting",
                        config.max_restarts
                    ));
                    nodes::end_job(job.store.store.as_ref(), &job.keys, self.round, what).await?;
                    return Ok(AfterRound::Exit(1));
                }
            },
        }
        Ok(AfterRound::Rejoin(self.round + 1))
    }
}

/// Runs this node's workers under `--restart-policy worker` from the round
/// `formed` until the job ends (see `nodes`, rules 6-10): relaunches a
/// failed worker alone; follows the rounds other launchers close for nodes
/// that left or join, keeping its workers; closes such a round itself when
/// it sees a node gone or waiting.
async fn run_elastic_round(
    job: &Job,
    signals: &mut Signals,
    formed: nodes::Formed,
    job_env: env::JobEnv,
    workers: &mut Workers,
) -> Result<AfterRound, LaunchError> {
    ElasticRound::start(job, formed, job_env, workers)
        .await?
        .run(signals)
        .await
}

/// This node under `--restart-policy worker`: its workers, each slot's
/// latest, its standbys, and the round it is in, which moves on while the
/// workers keep running.
struct ElasticRound<'a> {
    job: &'a Job,
    workers: &'a mut Workers,
    formed: nodes::Formed,
    job_env: env::JobEnv,
    /// This node's relaunches so far, which `--max-restarts` bounds.
    restarts: u64,
    /// `restarts` when this node's run began.
    first_restarts: u64,
    /// The workers' restart count when this node's run began.
    first_count: u64,
    slots: Vec<Slot>,
    standbys: Standbys,
    alive: plan::KeepAlives,
}

impl<'a> ElasticRound<'a> {
    /// Takes over the workers started in `formed`, and starts the fork
    /// server and the standby workers beside them.
    async fn start(
        job: &'a Job,
        formed: nodes::Formed,
        job_env: env::JobEnv,
        workers: &'a mut Workers,
    ) -> Result<Self, LaunchError> {
        let config = &job.config;
        let first_count = job_env.restart_count;
        let slots: Vec<Slot> = (0..config.nproc_per_node)
            .map(|local_rank| Slot {
                count: first_count,
                error_file: job_env.error_file(job_env.rank(local_rank)),
            })
            .collect();
        if config.fork_server
            && (config.max_restarts > 0 || config.standby > 0)
            && workers.start_fork_server(&spec(job, &job_env, 0)?)?
        {
            say(
                "fork server started: replacement workers will be forked from it (--no-fork-server to start them afresh)",
            );
        }
        let mut node = ElasticRound {
            job,
            workers,
            restarts: formed.restarts,
            first_restarts: formed.restarts,
            first_count,
            formed,
            job_env,
            slots,
            standbys: Standbys::new(config.standby),
            alive: plan::KeepAlives::default(),
        };
        // Standby workers start as the next relaunch would.
        for number in 0..config.standby {
            node.start_standby(number).await?;
        }
        Ok(node)
    }

    /// The restart count of the worker started by this node's relaunch
    /// `restart`: it goes on from the round this node started in, so it
    /// stays above that of the workers it replaces.
    fn count_of(&self, restart: u64) -> u64 {
        self.first_count + (restart - self.first_restarts)
    }

    /// Starts standby `number` as the next relaunch would start a worker
    /// (on failure, with every worker stopped).
    async fn start_standby(&mut self, number: usize) -> Result<(), LaunchError> {
        let count = self.count_of(self.restarts + 1);
        self.standbys
            .start(self.job, &self.job_env, self.workers, number, count)
            .await
    }

    async fn stop(&mut self, signo: i32) {
        self.workers.stop(signo, self.job.config.shutdown_timeout).await;
    }

    fn multi(&self) -> bool {
        self.job.config.max_nodes > 1
    }

    /// How a relaunch message names where the others keep running.
    fn on_this_node(&self) -> &'static str {
        if self.multi() { " on this node" } else { "" }
    }

    async fn run(mut self, signals: &mut Signals) -> Result<AfterRound, LaunchError> {
        let (job, config) = (self.job, &self.job.config);
        let store = job.store.store.as_ref();
        loop {
            let outcome = supervise(self.workers, job, &self.formed, &mut self.alive, signals).await;
            match outcome {
                Outcome::Failed(
                    ended @ workers::Ended {
                        standby: Some(number), ..
                    },
                ) => self.standby_exited(ended, number).await?,
                Outcome::Failed(ended) => {
                    if let Some(after) = self.worker_failed(ended).await? {
                        return Ok(after);
                    }
                }
                Outcome::Succeeded => return self.succeeded(signals).await,
                Outcome::Moved => {
                    if let Some(end) = follow(job, &mut self.formed, &mut self.alive).await? {
                        self.stop(libc::SIGTERM).await;
                        return Ok(end);
                    }
                    // Later relaunches take this node's place in the new round.
                    self.job_env.node_rank = self.formed.node_rank;
                    self.job_env.nnodes = self.formed.nnodes;
                }
                Outcome::Waiting(id) => {
                    let why = format!("node {id} waits to join");
                    nodes::reform(store, &job.keys, &self.formed, &[], config.max_nodes, &why).await?;
                }
                Outcome::Stalled(id) => {
                    let why = gone_message(job, &self.formed, &id);
                    nodes::reform(store, &job.keys, &self.formed, &[id.as_str()], config.max_nodes, &why).await?;
                }
                Outcome::Leave(leave) => return leave.stop_workers(self.workers, job).await,
            }
        }
    }

    /// Every worker succeeded.
    async fn succeeded(mut self, signals: &mut Signals) -> Result<AfterRound, LaunchError> {
        // Only standby workers are left: there is nothing for them to replace.
        self.stop(libc::SIGTERM).await;
        if !self.multi() {
            return Ok(AfterRound::Exit(0));
        }
        wait_for_members(self.job, self.formed, &mut self.alive, signals).await
    }

    /// Standby `number` exited before it was needed: another takes its
    /// place, within `--max-restarts`, unless it left of its own accord.
    async fn standby_exited(&mut self, ended: workers::Ended, number: usize) -> Result<(), LaunchError> {
        let max_restarts = self.job.config.max_restarts;
        self.standbys.vacate(number);
        let tail = self.workers.tail(ended.rank).await;
        say(format!(
            "standby worker s{number} (pid {}) {} before it was needed",
            ended.pid, ended.exit
        ));
        if ended.exit.success() {
            // It chose to leave (e.g. it saw the job ending): not a failure.
            return Ok(());
        }
        for line in &tail {
            print_line(&format!("  [s{number}]: {line}"));
        }
        match plan::after_failure(self.restarts, max_restarts) {
            AfterFailure::Restart { next } => {
                self.restarts = next;
                self.start_standby(number).await?;
            }
            AfterFailure::GiveUp => say(format!(
                "--max-restarts {max_restarts} is used up: going on without standby worker s{number}"
            )),
        }
        Ok(())
    }

    /// A worker failed: reports it, then replaces it alone, or ends the
    /// job once `--max-restarts` is used up.
    async fn worker_failed(&mut self, ended: workers::Ended) -> Result<Option<AfterRound>, LaunchError> {
        let job = self.job;
        let slot = &self.slots[ended.local_rank];
        let slot_env = self.job_env.for_attempt(slot.count, &job.run_dir);
        let error_file = slot.error_file.clone();
        let tail = self.workers.tail(ended.rank).await;
        let reports: Vec<PathBuf> = self.slots.iter().map(|slot| slot.error_file.clone()).collect();
        await_reports(&error_file, &reports).await;
        let (_, what) = failure(
            self.workers,
            &ended,
            self.formed.node_rank,
            slot_env.restart_count,
            &reports,
        );
        report(&what, ended.rank, &tail, &error_file);
        if let Err(error) = publish_exit(job, &slot_env, ended.pid, &error_file).await {
            self.stop(libc::SIGTERM).await;
            return Err(error);
        }
        match plan::after_failure(self.restarts, job.config.max_restarts) {
            AfterFailure::Restart { next } => {
                if !self.promote_standby(&ended, next).await? {
                    self.relaunch(&ended, next).await?;
                }
                Ok(None)
            }
            AfterFailure::GiveUp => self.give_up(&ended).await.map(Some),
        }
    }

    /// Moves a waiting standby into the failed worker's slot as relaunch
    /// `next`, and starts another standby in its place; `false` when none
    /// waits.
    async fn promote_standby(&mut self, ended: &workers::Ended, next: u64) -> Result<bool, LaunchError> {
        let rank = self.job_env.rank(ended.local_rank);
        let promoted = self
            .standbys
            .promote(self.job, self.workers, ended.local_rank, rank)
            .await;
        let (number, pid, slot) = match promoted {
            Ok(Some(promoted)) => promoted,
            Ok(None) => return Ok(false),
            Err(error) => {
                self.stop(libc::SIGTERM).await;
                return Err(error);
            }
        };
        say(format!(
            "promoted standby worker s{number} (pid {pid}) into rank {rank}'s slot (restart {next} of {}{}); the other workers keep running",
            self.job.config.max_restarts,
            self.on_this_node()
        ));
        self.slots[ended.local_rank] = slot;
        self.restarts = next;
        self.start_standby(number).await?;
        Ok(true)
    }

    /// Starts a new worker in the failed worker's slot as relaunch `next`.
    async fn relaunch(&mut self, ended: &workers::Ended, next: u64) -> Result<(), LaunchError> {
        let job = self.job;
        let count = self.count_of(next);
        let new_env = env::JobEnv {
            join_running: true,
            ..self.job_env.for_attempt(count, &job.run_dir)
        };
        let spec = spec(job, &new_env, ended.local_rank)?;
        match self.workers.relaunch(spec).await {
            Ok((pid, how)) => say(format!(
                "relaunching rank {} alone as pid {pid}{} (restart {next} of {}{}); the other workers keep running",
                new_env.rank(ended.local_rank),
                match how {
                    workers::Started::Forked => ", forked from the fork server".to_string(),
                    workers::Started::New => String::new(),
                    workers::Started::NewInstead(why) => format!(", a new process ({why})"),
                },
                job.config.max_restarts,
                self.on_this_node()
            )),
            Err(error) => {
                self.stop(libc::SIGTERM).await;
                return Err(error);
            }
        }
        self.restarts = next;
        self.slots[ended.local_rank] = Slot {
            count,
            error_file: new_env.error_file(new_env.rank(ended.local_rank)),
        };
        Ok(())
    }

    /// A worker failed past `--max-restarts`: the job ends, for every node.
    async fn give_up(&mut self, ended: &workers::Ended) -> Result<AfterRound, LaunchError> {
        let job = self.job;
        let store = job.store.store.as_ref();
        let why = format!(
            "rank {} failed and --max-restarts {} is used up",
            ended.rank, job.config.max_restarts
        );
        if self.multi() {
            // Tell the other nodes first, so every node stops at once.
            let over = format!("{why} on node {}", self.formed.node_rank);
            let told = async {
                bounded(job, nodes::end_for_good(store, &job.keys, &over)).await?;
                bounded(job, nodes::end_job(store, &job.keys, self.formed.round, &why)).await
            }
            .await;
            if let Err(error) = told {
                self.stop(libc::SIGTERM).await;
                return Err(error);
            }
        }
        self.stop(libc::SIGTERM).await;
        say(format!("{why}; stopped the other workers; exiting"));
        Ok(AfterRound::Exit(ended.exit.launcher_code()))
    }
}

/// This node's standby workers: a slot per `--standby`, each holding the
/// promotion key of the process started in it.
struct Standbys {
    slots: Vec<Option<Standby>>,
    /// Names each started standby's key and directory; never reused.
    serial: u64,
}

impl Standbys {
    fn new(count: usize) -> Self {
        Self {
            slots: vec![None; count],
            serial: 0,
        }
    }

    /// Starts standby `number` as restart `count` would start a worker.
    /// On failure every worker is stopped and the error returned, for the
    /// launcher to end with.
    async fn start(
        &mut self,
        job: &Job,
        job_env: &env::JobEnv,
        workers: &mut Workers,
        number: usize,
        count: u64,
    ) -> Result<(), LaunchError> {
        let serial = self.serial;
        self.serial += 1;
        let standby_env = env::JobEnv {
            join_running: true,
            ..job_env.for_attempt(count, &job.run_dir)
        };
        let started = match standby_spec(job, &standby_env, number, serial) {
            Ok((spec, standby)) => workers.relaunch(spec).await.map(|(_, how)| (standby, how)),
            Err(error) => Err(error),
        };
        match started {
            Ok((standby, how)) => {
                if let workers::Started::NewInstead(why) = how {
                    say(format!("standby worker s{number} started as a new process: {why}"));
                }
                self.slots[number] = Some(standby);
                Ok(())
            }
            Err(error) => {
                workers.stop(libc::SIGTERM, job.config.shutdown_timeout).await;
                Err(error)
            }
        }
    }

    /// Forgets standby `number`, which exited before it was needed.
    fn vacate(&mut self, number: usize) {
        self.slots[number] = None;
    }

    /// Moves a waiting standby into `local_rank`'s slot (as `rank`) and
    /// writes its promotion key: `(number, pid, slot)`, or `None` when no
    /// standby waits.
    async fn promote(
        &mut self,
        job: &Job,
        workers: &mut Workers,
        local_rank: usize,
        rank: usize,
    ) -> Result<Option<(usize, i32, Slot)>, LaunchError> {
        let Some((number, pid)) = workers.promote(local_rank, rank) else {
            return Ok(None);
        };
        let standby = self.slots[number].take().ok_or_else(|| LaunchError::Io {
            what: format!("promoting standby worker s{number}"),
            source: std::io::Error::other("it has no promotion key"),
        })?;
        let store = job.store.store.as_ref();
        bounded(job, store.set(&standby.key, local_rank.to_string().as_bytes())).await?;
        Ok(Some((number, pid, standby.slot)))
    }
}

/// What the launchers say of a member whose keep-alive stood still.
fn gone_message(job: &Job, formed: &nodes::Formed, id: &str) -> String {
    let rank = formed.members.iter().position(|m| m == id).unwrap_or(0);
    format!(
        "node {rank} (launcher {id}) sent no keep-alive for {:?}; taking it for gone (its workers' places are left to the elastic group; no worker restarts for it)",
        job.config.keep_alive_timeout
    )
}

/// Follows the round another launcher closed (rule 8): `None` when this
/// node is still in it (its place updated, its workers untouched), else how
/// this node's run ends (its workers are then to be stopped).
async fn follow(
    job: &Job,
    formed: &mut nodes::Formed,
    alive: &mut plan::KeepAlives,
) -> Result<Option<AfterRound>, LaunchError> {
    let store = job.store.store.as_ref();
    match nodes::adopt(store, &job.keys, &job.launcher_id).await? {
        nodes::Adopted::Member(next) => {
            let why = nodes::round_end(store, &job.keys, formed.round)
                .await?
                .map_or_else(String::new, |end| format!("{}; ", end.what()));
            say(format!(
                "round {}: {why}this launcher ({}) is node {} of {}; its workers keep running",
                next.round, job.launcher_id, next.node_rank, next.nnodes
            ));
            *formed = next;
            // The members changed: their keep-alives are watched afresh.
            *alive = plan::KeepAlives::default();
            Ok(None)
        }
        nodes::Adopted::Pending => Ok(None),
        nodes::Adopted::Dropped(round) => {
            say(format!(
                "round {round} formed without this launcher (taken for gone); stopping its workers and waiting to join again"
            ));
            Ok(Some(AfterRound::Rejoin(round)))
        }
        nodes::Adopted::Ended(why) => {
            say(format!("the job ended: {why}; stopped this node's workers"));
            Ok(Some(AfterRound::Exit(1)))
        }
    }
}

/// After this node's workers all succeeded (`--restart-policy worker`, several
/// nodes): waits until every member of the current round's have, following
/// the rounds and dropping members that leave meanwhile, so the store stays
/// up while others still use it.
async fn wait_for_members(
    job: &Job,
    mut formed: nodes::Formed,
    alive: &mut plan::KeepAlives,
    signals: &mut Signals,
) -> Result<AfterRound, LaunchError> {
    let config = &job.config;
    let store = job.store.store.as_ref();
    nodes::mark_finished(store, &job.keys, &job.launcher_id).await?;
    let mut poll = tokio::time::interval(config.monitor_interval.max(Duration::from_millis(10)));
    loop {
        if nodes::finished_among(store, &job.keys, &formed.members).await? == formed.nnodes {
            nodes::end_job(store, &job.keys, formed.round, "the job finished").await?;
            return Ok(AfterRound::Exit(0));
        }
        tokio::select! {
            _ = poll.tick() => {}
            signo = signals.recv() => return Ok(AfterRound::Exit(128 + signo)),
        }
        match watch_round(job, &formed, alive).await? {
            None | Some(Outcome::Waiting(_)) => {}
            Some(Outcome::Moved) => {
                if let Some(end) = follow(job, &mut formed, alive).await? {
                    // Left out after its work was done: the others finish without it.
                    return Ok(match end {
                        AfterRound::Rejoin(_) => AfterRound::Exit(0),
                        end => end,
                    });
                }
            }
            Some(Outcome::Stalled(id)) => {
                let why = gone_message(job, &formed, &id);
                nodes::reform(store, &job.keys, &formed, &[id.as_str()], config.max_nodes, &why).await?;
            }
            Some(Outcome::Leave(Leave::Over(why))) => {
                say(format!("the job ended: {why}"));
                return Ok(AfterRound::Exit(1));
            }
            Some(_) => {}
        }
    }
}

/// Why another node ended `round`.
async fn ended_elsewhere(store: &dyn Store, keys: &Keys, round: u64) -> Result<RoundEnd, LaunchError> {
    // The reason is written before the round advances; its absence is a bug elsewhere.
    Ok(nodes::round_end(store, keys, round)
        .await?
        .unwrap_or_else(|| RoundEnd::Failure("another node ended the round".to_string())))
}

/// The worker specs of one attempt on this node.
fn specs(job: &Job, job_env: &env::JobEnv) -> Result<Vec<WorkerSpec>, LaunchError> {
    (0..job.config.nproc_per_node)
        .map(|local_rank| spec(job, job_env, local_rank))
        .collect()
}

/// The spec of the worker in `local_rank`'s slot in `job_env`'s attempt.
fn spec(job: &Job, job_env: &env::JobEnv, local_rank: usize) -> Result<WorkerSpec, LaunchError> {
    let dir = env::rank_dir(&job_env.attempt_dir, job_env.rank(local_rank));
    spec_in(job, job_env, local_rank, dir)
}

/// A standby worker's spec: the program as a relaunch in `job_env`'s
/// attempt would run it in slot `number` mod `--nproc-per-node` (its
/// `RANK` and `LOCAL_RANK` are that slot's until the group ranks it on
/// joining), kept by the launcher past this node's slots, with its files
/// under `standby_<serial>/` and the store key of its promotion.
fn standby_spec(
    job: &Job,
    job_env: &env::JobEnv,
    number: usize,
    serial: u64,
) -> Result<(WorkerSpec, Standby), LaunchError> {
    let dir = job_env.attempt_dir.join(format!("standby_{serial}"));
    let nproc = job.config.nproc_per_node;
    let mut spec = spec_in(job, job_env, number % nproc, dir.clone())?;
    spec.local_rank = nproc + number;
    let error_file = dir.join("error.json");
    for (name, value) in &mut spec.env {
        if name == "TORCHELASTIC_ERROR_FILE" {
            *value = error_file.display().to_string();
        }
    }
    let key = job.keys.standby(&job.launcher_id, serial);
    spec.env.push((chorus::elastic::STANDBY_ENV.to_string(), key.clone()));
    spec.standby = Some(number);
    spec.console = job.config.local_ranks_filter.is_none();
    let standby = Standby {
        slot: Slot {
            count: job_env.restart_count,
            error_file,
        },
        key,
    };
    Ok((spec, standby))
}

/// What the launcher keeps of the worker in a slot.
#[derive(Debug, Clone)]
struct Slot {
    /// Its restart count (`TORCHELASTIC_RESTART_COUNT`).
    count: u64,
    /// Where it writes its error report.
    error_file: PathBuf,
}

/// What the launcher keeps of a standby worker.
#[derive(Debug, Clone)]
struct Standby {
    /// The slot it takes when promoted.
    slot: Slot,
    /// The store key its promotion is written to.
    key: String,
}

fn spec_in(job: &Job, job_env: &env::JobEnv, local_rank: usize, dir: PathBuf) -> Result<WorkerSpec, LaunchError> {
    let config = &job.config;
    let parent = |name: &str| std::env::var(name).ok();
    let rank = job_env.rank(local_rank);
    // The error file's directory must exist for the worker to write it.
    std::fs::create_dir_all(&dir).map_err(|source| LaunchError::Io {
        what: format!("creating {}", dir.display()),
        source,
    })?;
    let mut argv = config.command.clone();
    if config.pass_local_rank_arg {
        argv.push(format!("--local-rank={local_rank}"));
    }
    argv.extend(config.args.iter().cloned());
    let logged = Streams {
        stdout: config.tee.stdout || config.redirects.stdout,
        stderr: config.tee.stderr || config.redirects.stderr,
    };
    Ok(WorkerSpec {
        rank,
        local_rank,
        argv,
        env: job_env.for_worker(local_rank, &parent),
        console: config
            .local_ranks_filter
            .as_ref()
            .is_none_or(|f| f.contains(&local_rank)),
        shown: Streams {
            stdout: !config.redirects.stdout,
            stderr: !config.redirects.stderr,
        },
        log: config.log_dir.as_ref().map(|_| (dir, logged)),
        cpus: job.cpus.get(local_rank).cloned().unwrap_or_default(),
        standby: None,
    })
}

/// Watches one round until a worker fails, all succeed, another node
/// ends the round, a launcher waits to join, or a signal arrives.
async fn supervise(
    workers: &mut Workers,
    job: &Job,
    formed: &nodes::Formed,
    alive: &mut plan::KeepAlives,
    signals: &mut Signals,
) -> Outcome {
    // Only other launchers end a round from outside; one node has nothing to watch.
    let watch = job.config.max_nodes > 1;
    let mut poll = tokio::time::interval(job.config.monitor_interval.max(Duration::from_millis(10)));
    // A look at the store runs beside the workers, never in their way: a
    // worker's exit is acted on at once even while the store does not
    // answer, and a store silent for the keep-alive window ends the wait.
    let window = job.config.keep_alive_timeout;
    let mut looking = std::pin::pin!(None);
    loop {
        tokio::select! {
            ended = workers.next_exit() => match ended {
                None => return Outcome::Succeeded,
                // A standby worker that ends, even well, is one fewer to promote.
                Some(ended) if !ended.exit.success() || ended.standby.is_some() => return Outcome::Failed(ended),
                Some(_) => {}
            },
            signo = signals.recv() => return Outcome::Leave(Leave::Signaled(signo)),
            _ = poll.tick(), if watch && looking.is_none() => {
                // The look owns the keep-alive record while it runs.
                let mut record = std::mem::take(alive);
                looking.set(Some(tokio::time::timeout(window, async move {
                    let seen = watch_round(job, formed, &mut record).await;
                    (record, seen)
                })));
            }
            seen = async { looking.as_mut().as_pin_mut().expect("guarded by is_some").await }, if looking.is_some() => {
                looking.set(None);
                let seen = match seen {
                    Ok((record, seen)) => {
                        *alive = record;
                        seen
                    }
                    Err(_) => return Outcome::Leave(Leave::StoreUnreachable(window)),
                };
                match seen {
                    Ok(Some(outcome)) => return outcome,
                    Ok(None) => {}
                    Err(error) => return Outcome::Leave(Leave::StoreLost(error)),
                }
            }
        }
    }
}

/// One look at the store while this node's workers run.
async fn watch_round(
    job: &Job,
    formed: &nodes::Formed,
    alive: &mut plan::KeepAlives,
) -> Result<Option<Outcome>, StoreError> {
    let store = job.store.store.as_ref();
    let elastic = job.config.restart_policy == RestartPolicy::Worker;
    nodes::keep_alive(store, &job.keys, &job.launcher_id).await?;
    if elastic && let Some(why) = nodes::over(store, &job.keys).await? {
        return Ok(Some(Outcome::Leave(Leave::Over(why))));
    }
    if nodes::current_attempt(store, &job.keys).await? > formed.round {
        return Ok(Some(Outcome::Moved));
    }
    for id in formed.members.iter().filter(|m| **m != job.launcher_id) {
        let count = nodes::keep_alive_count(store, &job.keys, id).await?;
        alive.observe(id, count, std::time::Instant::now());
    }
    if let Some(id) = alive.stalled(std::time::Instant::now(), job.config.keep_alive_timeout) {
        return Ok(Some(Outcome::Stalled(id.to_string())));
    }
    if formed.nnodes >= job.config.max_nodes {
        return Ok(None);
    }
    let Some(id) = nodes::waiting(store, &job.keys, formed.round).await? else {
        return Ok(None);
    };
    let done = if elastic {
        nodes::finished_among(store, &job.keys, &formed.members).await?
    } else {
        nodes::done_count(store, &job.keys, formed.round).await?
    };
    Ok(plan::admit_waiting(formed.nnodes, job.config.max_nodes, done, true).then_some(Outcome::Waiting(id)))
}

/// How waiting for the other nodes' workers ended.
enum AllDone {
    /// Every node's workers succeeded.
    Yes,
    /// Another node ended the round.
    Moved,
    /// The launcher got this signal.
    Signaled(i32),
}

/// After this node's workers succeeded: waits until every node's have, so
/// the store stays up while others still use it.
async fn wait_for_nodes(job: &Job, formed: &nodes::Formed, signals: &mut Signals) -> Result<AllDone, LaunchError> {
    let store = job.store.store.as_ref();
    let mut done = nodes::mark_done(store, &job.keys, formed.round).await?;
    let mut poll = tokio::time::interval(job.config.monitor_interval.max(Duration::from_millis(10)));
    while done < formed.nnodes {
        tokio::select! {
            _ = poll.tick() => {}
            signo = signals.recv() => return Ok(AllDone::Signaled(signo)),
        }
        // Nodes still running must not take this one for hung.
        nodes::keep_alive(store, &job.keys, &job.launcher_id).await?;
        if nodes::current_attempt(store, &job.keys).await? > formed.round {
            return Ok(AllDone::Moved);
        }
        done = nodes::done_count(store, &job.keys, formed.round).await?;
    }
    Ok(AllDone::Yes)
}

/// Once a worker exited on its group's abort (its error file names whom
/// it blames), the others found the failure at about the same time: waits
/// until their error files are there too, for half a second at most (a
/// frozen or dead worker writes none).
async fn await_reports(exited: &Path, reports: &[PathBuf]) {
    if !exited.exists() {
        return;
    }
    let until = tokio::time::Instant::now() + Duration::from_millis(500);
    while tokio::time::Instant::now() < until && !reports.iter().all(|r| r.exists()) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whom a worker's failure is to be blamed on ("rank 2") and the line
/// that says what happened. A worker whose group aborts on a peer's
/// failure names that peer in its error file (`chorus::error_file`), and
/// the first process to exit is often a healthy rank that found a peer
/// frozen: the peer is blamed instead. `reports` are the error files of
/// this node's workers (of their current attempts); the rank they name
/// most is blamed, each report counting `1 / the ranks it names`: a rank
/// that lost every peer at once is likelier the one cut off (a rank frozen
/// by fault injection, its links frozen but its watchdog running, names
/// all the others in turn). A blamed peer is named as this node's worker
/// with its process id where it is one.
fn failure(
    workers: &Workers,
    ended: &workers::Ended,
    node: usize,
    attempt: u64,
    reports: &[PathBuf],
) -> (String, String) {
    let exited = format!(
        "rank {} (local rank {} on node {node}, pid {})",
        ended.rank, ended.local_rank, ended.pid
    );
    let mut votes: Vec<(chorus::error_file::FailedPeer, f64)> = Vec::new();
    for report in reports
        .iter()
        .filter_map(|path| chorus::error_file::ErrorReport::read(path))
    {
        let weight = 1.0 / report.failed.len().max(1) as f64;
        for peer in report.failed {
            match votes
                .iter_mut()
                .find(|(p, _)| (p.pid, &p.host) == (peer.pid, &peer.host))
            {
                Some((_, n)) => *n += weight,
                None => votes.push((peer, weight)),
            }
        }
    }
    let most = votes.iter().map(|(_, n)| *n).fold(0.0, f64::max);
    let host = HostId::local().hostname;
    let blamed: Vec<(String, String, bool)> = votes
        .into_iter()
        .filter(|(_, n)| most - *n < 1e-9)
        .map(
            |(peer, _)| match workers.by_pid(peer.pid).filter(|_| peer.host == host) {
                Some((rank, local_rank)) => (
                    format!("rank {rank}"),
                    format!("rank {rank} (local rank {local_rank} on node {node}, pid {})", peer.pid),
                    rank == ended.rank,
                ),
                None => (
                    format!("group rank {}", peer.rank),
                    format!("group rank {} (pid {} on {})", peer.rank, peer.pid, peer.host),
                    false,
                ),
            },
        )
        .collect();
    let plain = format!("{exited} {} in attempt {attempt}", ended.exit);
    match blamed.as_slice() {
        [] => (format!("rank {}", ended.rank), plain),
        [(culprit, _, true)] => (
            culprit.clone(),
            format!("{plain}; the other workers took it for failed"),
        ),
        _ => {
            let culprits: Vec<&str> = blamed.iter().map(|(c, _, _)| c.as_str()).collect();
            let described: Vec<&str> = blamed.iter().map(|(_, d, _)| d.as_str()).collect();
            (
                culprits.join(", "),
                format!(
                    "{} failed in attempt {attempt}: the other workers took it for failed, and {exited} {} on it",
                    described.join(", "),
                    ended.exit
                ),
            )
        }
    }
}

/// Tells which worker failed, how, and what it printed last.
fn report(what: &str, rank: usize, tail: &[String], error_file: &Path) {
    say(what);
    if tail.is_empty() {
        say(format!("rank {rank} printed nothing"));
    } else {
        say(format!("last {} lines of rank {rank}:", tail.len()));
        for line in tail {
            print_line(&format!("  [{rank}]: {line}"));
        }
    }
    if error_file.exists() {
        say(format!("rank {rank} wrote an error report: {}", error_file.display()));
    }
}
