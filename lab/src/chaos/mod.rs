//! `chorus chaos`: runs a training job across N nodes of this host (one
//! `chorus launch --restart-policy worker` each, so a whole launcher can be
//! killed), injects faults from a seeded schedule, and checks what the
//! members committed against a fault-free run of the same steps.
//!
//! The job is `examples/train.rs` (built beside the `chorus` binary) or the
//! user's program; either trains through [`chorus::train::train`], whose
//! commit records (`CHORUS_TRAIN_RECORD`) are the evidence. A run:
//! 1. for the example, a short fault-free calibration (200 steps) measures
//!    the step rate, and the job gets the steps that fill `--duration`;
//!    the user's program trains its own steps;
//! 2. the fault-free reference of those steps;
//! 3. the chaos run: the same job, faults at the schedule's times until
//!    the job ends (the schedule spans [`ChaosOptions::horizon`]) (killed launchers started again, stopped workers
//!    killed for their launcher to relaunch), then what it left behind:
//!    processes still alive (carrying the run's marker variable) and ring
//!    files of its processes in `/dev/shm`, both removed and reported;
//! 4. the [`verdict`].
//!
//! The store is served by this process, so every launcher may die.
//!
//! With [`ChaosOptions::hosts`] (`--hosts N`, root only) each node runs on
//! a simulated host of its own ([`hosts`]: network namespaces, a `/dev/shm`
//! and a host name each), the store on a switch no fault touches, and the
//! schedule also draws network faults: partitions, lossy and slow links.
//! A partitioned host's launcher loses the store and exits (its workers
//! stopped) after its keep-alive window, the others re-form without it;
//! it is started again once the partition heals and its node rejoins.
//! The hosts are removed at the end, on error and on Ctrl-C too.
//!
//! # Layout
//! - [`schedule`]: the seeded fault schedule, sans IO.
//! - [`verdict`]: the checks over the records, sans IO.
//! - [`hosts`]: the simulated hosts (namespaces, links, impairers).
//! - this file: the driver (processes, signals, files).

pub mod hosts;
pub mod schedule;
pub mod verdict;

use std::collections::{BTreeSet, HashMap};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chorus::auth::JobSecret;
use chorus::store::{TcpStore, TcpStoreOptions, TcpStoreServer, TcpStoreServerOptions};
use chorus::train::{CommitRecord, RECORD_ENV, live};
use serde::Serialize;
use thiserror::Error;

use chorus::process::{self, Signal};
use chorus::train::observe::StoreSource;
use chorus::train::record::unix_us;
pub use hosts::{Hosts, HostsError};
pub use schedule::{FaultKind, PlannedFault, ScheduleSpec};
pub use verdict::{Bounds, Check, Evidence, Verdict};

/// The variable every process of a run inherits, so that any left
/// behind can be found.
const MARKER_ENV: &str = "CHORUS_CHAOS_RUN";

/// Steps of the example's calibration run.
const CALIBRATION_STEPS: u64 = 200;

/// How long a slow rank stands still: well inside the heartbeat window.
const SLOW: Duration = Duration::from_millis(400);

/// A killed launcher is started again after this.
const LAUNCHER_BACK: Duration = Duration::from_secs(1);

/// The job chaos runs.
#[derive(Debug, Clone, PartialEq)]
pub enum Program {
    /// `examples/train.rs` at this path: chaos gives it its steps.
    Example(PathBuf),
    /// A program and its arguments, training through `chorus::train`.
    Command(Vec<String>),
}

/// What `chorus chaos` does.
#[derive(Debug, Clone)]
pub struct ChaosOptions {
    /// The job.
    pub program: Program,
    /// The `chorus` binary whose `launch` starts each node.
    pub chorus: PathBuf,
    /// Nodes (launchers).
    pub nodes: usize,
    /// Whether each node runs on a simulated host of its own (root only),
    /// which the network faults need.
    pub hosts: bool,
    /// Workers per node.
    pub nproc_per_node: usize,
    /// How long the job trains: the example's steps fill it (faults go on
    /// until the job ends).
    pub duration: Duration,
    /// Steps for the example instead of filling `duration`.
    pub steps: Option<u64>,
    /// Gaps between faults, drawn from this range.
    pub every: (Duration, Duration),
    /// The kinds of fault.
    pub faults: Vec<FaultKind>,
    /// The schedule's seed (also the example's data seed).
    pub seed: u64,
    /// The example's heartbeat window; a stopped worker is killed twice it
    /// after it stopped.
    pub heartbeat: Duration,
    /// The checks' bounds.
    pub bounds: Bounds,
    /// Where the runs' files go (kept); `None`: a temporary directory,
    /// removed after a passing run.
    pub dir: Option<PathBuf>,
}

impl ChaosOptions {
    /// How long a run may take before it is stopped, and so the
    /// schedule's length: faults go on until the job ends, however long its
    /// steps take on a loaded machine (a calibration is a guess).
    pub fn horizon(&self) -> Duration {
        Duration::from_secs(60) + self.duration * 4
    }
}

/// Why a chaos run could not be judged.
#[derive(Debug, Error)]
pub enum ChaosError {
    /// Bad options.
    #[error("{0}")]
    Options(String),
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// The simulated hosts could not be made or changed.
    #[error(transparent)]
    Hosts(#[from] HostsError),
    /// SIGINT, SIGTERM or SIGHUP came; the run was stopped and cleaned up.
    #[error("interrupted; the run's processes and hosts were removed")]
    Interrupted,
    /// A fault-free run failed, so there is nothing to compare against.
    #[error("the {phase} run failed: {why}; its logs are in {}", dir.display())]
    Phase {
        /// Which run.
        phase: &'static str,
        /// What went wrong.
        why: String,
        /// Its directory.
        dir: PathBuf,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ChaosError {
    let what = what.into();
    move |source| ChaosError::Io { what, source }
}

/// A fault as it was injected.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Injected {
    /// The fault planned.
    #[serde(flatten)]
    pub planned: PlannedFault,
    /// What it hit (`pid 1234`), or why it hit nothing.
    pub outcome: String,
    /// Whether it acted.
    pub acted: bool,
}

/// What a chaos run found.
#[derive(Debug, Clone, Serialize)]
pub struct ChaosReport {
    /// The checks.
    pub verdict: Verdict,
    /// Steps the job committed.
    pub steps: u64,
    /// Nodes and workers per node.
    pub nodes: usize,
    /// Whether each node ran on a simulated host of its own.
    pub hosts: bool,
    /// Workers per node.
    pub nproc_per_node: usize,
    /// The seed.
    pub seed: u64,
    /// Every fault of the schedule until the job ended, and what it did.
    pub faults: Vec<Injected>,
    /// Seconds the chaos run took, start to end.
    pub chaos_seconds: f64,
    /// Seconds the reference took.
    pub reference_seconds: f64,
    /// The runs' files, if kept.
    pub dir: Option<PathBuf>,
}

/// Runs the reference and the chaos run and judges them; `say` gets a
/// line per event (faults, phases).
pub fn run(options: &ChaosOptions, say: &mut dyn FnMut(&str)) -> Result<ChaosReport, ChaosError> {
    check_options(options)?;
    let (dir, keep) = match &options.dir {
        Some(dir) => (dir.clone(), true),
        None => (
            std::env::temp_dir().join(format!("chorus-chaos-{}", std::process::id())),
            false,
        ),
    };
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(io("starting the store's runtime"))?;
    let secret = chorus::auth::random_hex(16).map_err(|e| ChaosError::Options(e.to_string()))?;
    let _signals = Interrupts::catch();
    let mut hosts = simulated_hosts(options, say)?;
    let mut driver = Driver {
        options,
        runtime: &runtime,
        secret,
        corruptions: 0,
        hosts: hosts.as_mut(),
    };

    let steps = driver.steps(&dir, say)?;
    say("chaos: the fault-free reference");
    let reference = driver.phase("reference", &dir.join("reference"), steps, &[], say)?;
    let steps = reference_steps(&reference, steps, &dir)?;
    let planned = schedule::schedule(&ScheduleSpec {
        seed: options.seed,
        duration: options.horizon(),
        every: options.every,
        kinds: options.faults.clone(),
        nodes: options.nodes,
        nproc_per_node: options.nproc_per_node,
        hosts: options.hosts,
    });
    say(&format!(
        "chaos: the chaos run, faults every {:.0}-{:.0} s until the job ends",
        options.every.0.as_secs_f64(),
        options.every.1.as_secs_f64()
    ));
    let chaos = driver.phase("chaos", &dir.join("chaos"), Some(steps), &planned, say)?;
    let evidence = Evidence {
        steps,
        records: chaos.records,
        reference: reference.records,
        faults: chaos
            .injected
            .iter()
            .filter(|f| f.0.acted)
            .map(|(f, at)| (*at, f.planned.kind.reforms()))
            .collect(),
        orphans: chaos.orphans,
        leaked_shm: chaos.leaked_shm,
        corruptions_asked: chaos
            .injected
            .iter()
            .filter(|(f, _)| f.acted && f.planned.kind == FaultKind::Corrupt)
            .count(),
    };
    let verdict = verdict::judge(&evidence, &options.bounds);
    let keep = keep || !verdict.passed();
    // The hosts' tmpfs mounts go before the directory may.
    drop(driver);
    drop(hosts);
    if !keep {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(ChaosReport {
        verdict,
        steps,
        nodes: options.nodes,
        hosts: options.hosts,
        nproc_per_node: options.nproc_per_node,
        seed: options.seed,
        faults: chaos.injected.into_iter().map(|(f, _)| f).collect(),
        chaos_seconds: chaos.seconds,
        reference_seconds: reference.seconds,
        dir: keep.then_some(dir),
    })
}

/// The options a run cannot go with, and why.
fn check_options(options: &ChaosOptions) -> Result<(), ChaosError> {
    if options.nodes == 0 || options.nproc_per_node == 0 {
        return Err(ChaosError::Options("--nodes and --nproc-per-node: at least 1".into()));
    }
    if options.nodes * options.nproc_per_node < 2 {
        return Err(ChaosError::Options(
            "at least 2 workers in all: one to fail and one to go on".into(),
        ));
    }
    if options.every.0 > options.every.1 || options.every.0.is_zero() {
        return Err(ChaosError::Options(format!(
            "--fault-every {:?}..{:?}: a positive range, low to high",
            options.every.0, options.every.1
        )));
    }
    if !options.hosts
        && let Some(kind) = options.faults.iter().find(|k| k.network())
    {
        return Err(ChaosError::Options(format!(
            "the {} fault acts between simulated hosts: give --hosts N",
            kind.name()
        )));
    }
    // SAFETY: geteuid has no preconditions.
    if options.hosts && unsafe { libc::geteuid() } != 0 {
        return Err(HostsError::NotRoot.into());
    }
    if let Program::Example(path) = &options.program
        && !path.exists()
    {
        return Err(ChaosError::Options(format!(
            "{} missing: build it (cargo build --release --example train) or give a program after --",
            path.display()
        )));
    }
    Ok(())
}

/// With `--hosts`, a simulated host per node.
fn simulated_hosts(options: &ChaosOptions, say: &mut dyn FnMut(&str)) -> Result<Option<Hosts>, ChaosError> {
    Ok(match options.hosts {
        true => {
            say(&format!("chaos: making {} simulated hosts", options.nodes));
            let root = std::env::temp_dir().join(format!("chorus-chaos-hosts-{}", std::process::id()));
            Some(Hosts::up(&std::process::id().to_string(), options.nodes, &root)?)
        }
        false => None,
    })
}

/// The job's steps, `steps` or for a command those the reference
/// committed; an error unless the reference committed them all.
fn reference_steps(reference: &PhaseOutcome, steps: Option<u64>, dir: &Path) -> Result<u64, ChaosError> {
    let steps = match steps {
        Some(steps) => steps,
        None => reference.records.iter().map(|r| r.step + 1).max().unwrap_or(0),
    };
    if reference.records.iter().map(|r| r.step + 1).max() != Some(steps) {
        return Err(ChaosError::Phase {
            phase: "reference",
            why: format!("it did not commit its {steps} steps"),
            dir: dir.join("reference"),
        });
    }
    Ok(steps)
}

/// What one run (calibration, reference or chaos) left.
struct PhaseOutcome {
    records: Vec<CommitRecord>,
    /// Each fault and when it acted (unix microseconds).
    injected: Vec<(Injected, i64)>,
    orphans: Vec<u32>,
    leaked_shm: Vec<String>,
    seconds: f64,
}

impl PhaseOutcome {
    /// Steps per second past the first fifth of the steps (start-up).
    fn rate(&self) -> Option<f64> {
        let last = self.records.iter().map(|r| r.step).max()?;
        let from = last / 5;
        let at = |step: u64| self.records.iter().filter(|r| r.step == step).map(|r| r.at_us).min();
        let (start, end) = (at(from)?, at(last)?);
        (end > start).then(|| (last - from) as f64 / ((end - start) as f64 / 1e6))
    }
}

/// One node: its launcher, while it runs.
struct Node {
    child: Option<Child>,
    /// When a killed launcher is due back.
    back_at: Option<Instant>,
    /// Its exit status once it ended by itself.
    ended: Option<std::process::ExitStatus>,
    /// Until when its host is partitioned, once it was while this launcher
    /// ran: a launcher that then exits failing lost the store, and is
    /// started again after the heal.
    cut_until: Option<Instant>,
}

/// A signal due later.
struct Due {
    at: Instant,
    pid: i32,
    signal: Signal,
}

/// A network fault to undo later.
struct Undo {
    at: Instant,
    /// The node, from 0 (its host is `node + 1`).
    node: usize,
    kind: FaultKind,
}

/// Set by [`Interrupts`]' handler.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn interrupted(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// SIGINT, SIGTERM and SIGHUP noted (the run stops at its next turn and
/// cleans up) instead of ending the process, while this lives; the
/// previous handlers come back when it drops.
struct Interrupts {
    previous: Vec<(libc::c_int, libc::sighandler_t)>,
}

impl Interrupts {
    fn catch() -> Self {
        INTERRUPTED.store(false, Ordering::SeqCst);
        let previous = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP]
            .into_iter()
            .map(|signo| {
                // SAFETY: the handler only stores to an atomic.
                let old =
                    unsafe { libc::signal(signo, interrupted as extern "C" fn(libc::c_int) as libc::sighandler_t) };
                (signo, old)
            })
            .collect();
        Self { previous }
    }
}

impl Drop for Interrupts {
    fn drop(&mut self) {
        for &(signo, old) in &self.previous {
            // SAFETY: puts back the handler that was there.
            unsafe { libc::signal(signo, old) };
        }
    }
}

struct Driver<'a> {
    options: &'a ChaosOptions,
    runtime: &'a tokio::runtime::Runtime,
    secret: String,
    hosts: Option<&'a mut Hosts>,
    /// Corruptions asked for so far (they alternate parameters, gradients).
    corruptions: usize,
}

impl Driver<'_> {
    /// Asks worker `pid` of the job of `(store, run id)` for `kind` through
    /// its live record, signed with the job secret, as a dashboard does.
    fn request_live_fault(&self, (store, run_id): (&str, &str), pid: u32, kind: live::FaultKind) -> Result<(), String> {
        self.runtime.block_on(async {
            let options = TcpStoreOptions {
                timeout: Duration::from_secs(5),
                connect_timeout: Duration::from_secs(5),
                ..TcpStoreOptions::default()
            };
            let client = TcpStore::connect(store.to_string(), options)
                .await
                .map_err(|e| e.to_string())?;
            let source = StoreSource::new(std::sync::Arc::new(client), Some(run_id.to_string()));
            let observed = source.observe().await.map_err(|e| e.to_string())?;
            let record = observed
                .records
                .iter()
                .filter(|r| r.pid == pid)
                .max_by_key(|r| r.slot)
                .ok_or("it has published no live record yet")?;
            let secret = JobSecret::new(self.secret.as_bytes());
            source
                .request_fault(&secret, record, record.rank, record.generation, kind, "chorus chaos")
                .await
                .map_err(|e| e.to_string())
        })
    }

    /// The program's command line after `chorus launch ... --`.
    fn program(&self, run_dir: &Path, steps: Option<u64>) -> Vec<String> {
        match &self.options.program {
            Program::Command(argv) => argv.clone(),
            Program::Example(path) => {
                let mut argv = vec![path.display().to_string()];
                let world = self.options.nodes * self.options.nproc_per_node;
                for (flag, value) in [
                    ("--run-dir", run_dir.display().to_string()),
                    ("--fault", "none".into()),
                    ("--steps", steps.unwrap_or(CALIBRATION_STEPS).to_string()),
                    ("--world", world.to_string()),
                    ("--seed", self.options.seed.to_string()),
                    ("--heartbeat-ms", self.options.heartbeat.as_millis().to_string()),
                ] {
                    argv.push(flag.into());
                    argv.push(value);
                }
                argv
            }
        }
    }

    /// Starts node `node`'s launcher (on its host, with hosts).
    fn launch(
        &self,
        dir: &Path,
        store: &str,
        marker: &str,
        node: usize,
        program: &[String],
    ) -> Result<Child, ChaosError> {
        let log = |stream: &str| {
            let path = dir.join(format!("node{node}.{stream}"));
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(io(format!("opening {}", path.display())))
        };
        let mut command = Command::new(&self.options.chorus);
        command
            .arg("launch")
            .args(["--nnodes", &format!("1:{}", self.options.nodes)])
            .args(["--nproc-per-node", &self.options.nproc_per_node.to_string()])
            .args(["--rdzv-backend", "c10d", "--rdzv-endpoint", store])
            .args(["--rdzv-id", marker])
            .args(["--restart-policy", "worker", "--max-restarts", "100000"])
            .args(["--monitor-interval", "0.1"])
            .args([
                "--rdzv-conf",
                "join_timeout=120,last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=4",
            ])
            .arg("--")
            .args(program)
            .env(MARKER_ENV, marker)
            .env(RECORD_ENV, dir.join("records"))
            .env("CHORUS_JOB_SECRET", &self.secret)
            .env("OMP_NUM_THREADS", "1")
            .env_remove("CHORUS_FAULTS")
            .stdin(Stdio::null())
            .stdout(log("stdout")?)
            .stderr(log("stderr")?);
        // Entered in the child (after the hooks below), so kept open until spawned.
        let _host = match &self.hosts {
            Some(hosts) => Some(hosts.enter(node + 1, &mut command)?),
            None => None,
        };
        // SAFETY: prctl is async-signal-safe; a launcher must not outlive
        // this process (a chaos run killed midway).
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut command, || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        command
            .spawn()
            .map_err(io(format!("starting {}", self.options.chorus.display())))
    }

    /// The store, on the switch with hosts, and its address for the launchers.
    fn serve_store(&self) -> Result<(TcpStoreServer, String), ChaosError> {
        let server = match &self.hosts {
            Some(hosts) => {
                let listener = hosts.listen_on_switch(0)?;
                listener.set_nonblocking(true).map_err(io("serving the job's store"))?;
                let _entered = self.runtime.enter();
                let listener = tokio::net::TcpListener::from_std(listener).map_err(io("serving the job's store"))?;
                TcpStoreServer::serve(listener, TcpStoreServerOptions::default())
            }
            None => self
                .runtime
                .block_on(TcpStoreServer::bind(
                    "127.0.0.1:0".parse().expect("an address"),
                    TcpStoreServerOptions::default(),
                ))
                .map_err(io("serving the job's store"))?,
        };
        let addr = server.local_addr().to_string();
        Ok((server, addr))
    }

    /// The directories whose ring files are checked: `/dev/shm` and each
    /// host's.
    fn shm_dirs(&self) -> Vec<PathBuf> {
        let mut dirs = vec![PathBuf::from("/dev/shm")];
        if let Some(hosts) = &self.hosts {
            dirs.extend((1..=hosts.count()).map(|i| hosts.shm(i)));
        }
        dirs
    }

    /// The example's steps: `--steps`, or as many as fill the duration at
    /// the rate of a fault-free calibration run; `None` for a command,
    /// whose steps are its own.
    fn steps(&mut self, dir: &Path, say: &mut dyn FnMut(&str)) -> Result<Option<u64>, ChaosError> {
        let options = self.options;
        match (&options.program, options.steps) {
            (Program::Example(_), Some(steps)) => Ok(Some(steps)),
            (Program::Command(_), _) => Ok(None),
            (Program::Example(_), None) => {
                say(&format!("chaos: calibrating: {CALIBRATION_STEPS} fault-free steps"));
                let calibration = self.phase(
                    "calibration",
                    &dir.join("calibration"),
                    Some(CALIBRATION_STEPS),
                    &[],
                    say,
                )?;
                let rate = calibration.rate().ok_or_else(|| ChaosError::Phase {
                    phase: "calibration",
                    why: match calibration.records.len() {
                        // The job ran but wrote nothing: a trainer built before
                        // the records existed (an old build of the example).
                        0 => "no commit records were written: is the program built from this tree?".into(),
                        _ => "too few steps committed to measure a rate".into(),
                    },
                    dir: dir.join("calibration"),
                })?;
                let steps = (rate * options.duration.as_secs_f64()).round().max(20.0) as u64;
                say(&format!(
                    "chaos: {rate:.1} steps/s fault-free: {steps} steps fill {:.0} s",
                    options.duration.as_secs_f64()
                ));
                Ok(Some(steps))
            }
        }
    }

    /// One run of the job: `faults` injected at their times until every
    /// launcher ended, then the leftovers.
    fn phase(
        &mut self,
        phase: &'static str,
        dir: &Path,
        steps: Option<u64>,
        faults: &[PlannedFault],
        say: &mut dyn FnMut(&str),
    ) -> Result<PhaseOutcome, ChaosError> {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir.join("run")).map_err(io(format!("creating {}", dir.display())))?;
        let (server, store) = self.serve_store()?;
        let marker = format!("chaos-{}-{phase}-{store}", std::process::id());
        let program = self.program(&dir.join("run"), steps);
        let shm_before: BTreeSet<PathBuf> = self.shm_dirs().iter().flat_map(|d| ring_files(d)).collect();
        let mut run = PhaseRun {
            driver: self,
            say,
            phase,
            dir,
            faults,
            store,
            marker,
            program,
            started: Instant::now(),
            nodes: Vec::new(),
            stopped: None,
            known: BTreeSet::new(),
            injected: Vec::new(),
            due: Vec::new(),
            undo: Vec::new(),
            next: 0,
            last_scan: Instant::now(),
        };
        run.start_launchers();
        let timed_out = run.stopped.is_none() && run.until_ended();
        let seconds = run.started.elapsed().as_secs_f64();
        run.wind_down();
        drop(server);
        run.leftovers(&shm_before, seconds, timed_out)
    }

    /// Undoes network fault `u`.
    fn undo(&mut self, u: &Undo) -> Result<(), ChaosError> {
        let Some(hosts) = self.hosts.as_mut() else {
            return Ok(());
        };
        match u.kind {
            FaultKind::Partition => hosts.partition(u.node + 1, false)?,
            _ => hosts.clear(u.node + 1)?,
        }
        Ok(())
    }

    /// Injects a network fault on `fault.node`'s host.
    fn inject_network(
        &mut self,
        fault: &PlannedFault,
        dir: &Path,
        node: &mut Node,
        undo: &mut Vec<Undo>,
    ) -> Result<(String, bool), ChaosError> {
        let chorus = self.options.chorus.clone();
        let Some(hosts) = self.hosts.as_mut() else {
            return Ok(("no simulated hosts".into(), false));
        };
        let host = fault.node + 1;
        if undo.iter().any(|u| u.node == fault.node) {
            return Ok(("the host's network is faulty already".into(), false));
        }
        let until = Instant::now() + fault.kind.lasts();
        let lasts = fault.kind.lasts().as_secs_f64();
        let outcome = match fault.kind {
            FaultKind::Partition => {
                hosts.partition(host, true)?;
                node.cut_until = Some(until);
                format!("host {host} cut off for {lasts:.0} s")
            }
            kind => {
                let flags = match kind {
                    FaultKind::LossyLink => vec!["--loss".to_string(), schedule::LOSS.to_string()],
                    _ => vec!["--delay-ms".to_string(), schedule::DELAY.as_millis().to_string()],
                };
                let path = dir.join(format!("netem{host}.log"));
                let log = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .map_err(io(format!("opening {}", path.display())))?;
                let pid = hosts.impair(host, &chorus, &flags, log)?;
                format!(
                    "host {host}'s link through chorus netem {} (pid {pid}) for {lasts:.0} s",
                    flags.join(" ")
                )
            }
        };
        undo.push(Undo {
            at: until,
            node: fault.node,
            kind: fault.kind,
        });
        Ok((outcome, true))
    }

    /// Injects `fault` into the job of `(store, run id)`; what it hit and
    /// whether it acted.
    fn inject(
        &mut self,
        fault: &PlannedFault,
        dir: &Path,
        job: (&str, &str),
        nodes: &mut [Node],
        due: &mut Vec<Due>,
        undo: &mut Vec<Undo>,
    ) -> (String, bool) {
        let node = &mut nodes[fault.node];
        let (signal, then, outcome) = match fault.kind {
            FaultKind::Corrupt => {
                let pid = match worker_pid(node, fault.local_rank) {
                    Ok(pid) => pid,
                    Err(why) => return (why, false),
                };
                let kind = match self.corruptions % 2 {
                    0 => live::FaultKind::CorruptParams,
                    _ => live::FaultKind::CorruptGrads,
                };
                self.corruptions += 1;
                return match self.request_live_fault(job, pid, kind) {
                    Ok(()) => (format!("worker pid {pid}: {} asked for", kind.name()), true),
                    Err(why) => (format!("worker pid {pid}: {} not asked for: {why}", kind.name()), false),
                };
            }
            FaultKind::Kill => (Signal::SIGKILL, None, "SIGKILL"),
            FaultKind::Stop => (
                Signal::SIGSTOP,
                Some((self.options.heartbeat * 2, Signal::SIGKILL)),
                "SIGSTOP, SIGKILL twice the heartbeat window later",
            ),
            FaultKind::Slow => (
                Signal::SIGSTOP,
                Some((SLOW, Signal::SIGCONT)),
                "SIGSTOP, SIGCONT 400 ms later",
            ),
            FaultKind::KillLauncher => {
                let Some(mut child) = node.child.take() else {
                    return ("the launcher is down already".into(), false);
                };
                let pid = child.id();
                let _ = child.kill();
                let _ = child.wait();
                node.back_at = Some(node.cut_until.unwrap_or(Instant::now()).max(Instant::now()) + LAUNCHER_BACK);
                return (format!("killed launcher pid {pid}; back in {LAUNCHER_BACK:?}"), true);
            }
            FaultKind::Partition | FaultKind::LossyLink | FaultKind::SlowLink => {
                return self
                    .inject_network(fault, dir, node, undo)
                    .unwrap_or_else(|e| (format!("failed: {e}"), false));
            }
        };
        let pid = match worker_pid(node, fault.local_rank) {
            Ok(pid) => pid,
            Err(why) => return (why, false),
        };
        if due.iter().any(|d| d.pid == pid as i32) {
            return (format!("worker pid {pid} is stopped already"), false);
        }
        let pid = pid as i32;
        process::signal(pid, signal);
        if let Some((after, signal)) = then {
            due.push(Due {
                at: Instant::now() + after,
                pid,
                signal,
            });
        }
        (format!("worker pid {pid}: {outcome}"), true)
    }
}

/// One run of the job while it goes: its launchers, the faults injected
/// and those still to act or to undo.
struct PhaseRun<'p, 'a> {
    driver: &'p mut Driver<'a>,
    say: &'p mut dyn FnMut(&str),
    phase: &'static str,
    dir: &'p Path,
    /// The schedule, injected from `next` on.
    faults: &'p [PlannedFault],
    /// The job's store address and run id (the marker).
    store: String,
    marker: String,
    program: Vec<String>,
    started: Instant,
    nodes: Vec<Node>,
    /// Why the run stopped early.
    stopped: Option<ChaosError>,
    /// Every worker pid seen, whose ring files are the run's.
    known: BTreeSet<u32>,
    injected: Vec<(Injected, i64)>,
    due: Vec<Due>,
    undo: Vec<Undo>,
    next: usize,
    last_scan: Instant,
}

impl PhaseRun<'_, '_> {
    /// Starts every node's launcher, until one fails to start.
    fn start_launchers(&mut self) {
        for node in 0..self.driver.options.nodes {
            match self
                .driver
                .launch(self.dir, &self.store, &self.marker, node, &self.program)
            {
                Ok(child) => self.nodes.push(Node {
                    child: Some(child),
                    back_at: None,
                    ended: None,
                    cut_until: None,
                }),
                Err(e) => {
                    self.stopped = Some(e);
                    break;
                }
            }
        }
    }

    /// Turns until the job ended or the run stopped; whether it ran past
    /// the horizon instead.
    fn until_ended(&mut self) -> bool {
        loop {
            if let Some(timed_out) = self.turn() {
                return timed_out;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One look at the run: launchers that ended, signals and undos due,
    /// launchers due back, faults due; `Some(timed out)` once it is over.
    fn turn(&mut self) -> Option<bool> {
        let now = Instant::now();
        if INTERRUPTED.load(Ordering::SeqCst) {
            self.stopped = Some(ChaosError::Interrupted);
            return Some(false);
        }
        let finishing = self.reap(now);
        if now.duration_since(self.last_scan) > Duration::from_millis(250) {
            self.known.extend(workers_of(&self.nodes).into_values().flatten());
            self.last_scan = now;
        }
        for d in self.due.iter().filter(|d| d.at <= now) {
            process::signal(d.pid, d.signal);
        }
        self.due.retain(|d| d.at > now);
        for u in self.undo.iter().filter(|u| u.at <= now) {
            (self.say)(&format!("chaos: {} of node {} undone", u.kind.name(), u.node));
            if let Err(e) = self.driver.undo(u) {
                self.stopped = Some(e);
            }
        }
        self.undo.retain(|u| u.at > now);
        self.bring_back(now, finishing);
        if !finishing {
            self.inject_due(now);
        }
        if self.stopped.is_some() {
            return Some(false);
        }
        let running = self
            .nodes
            .iter()
            .any(|n| n.child.is_some() || (n.back_at.is_some() && !finishing));
        if !running && self.due.is_empty() {
            return Some(false);
        }
        if now.duration_since(self.started) > self.driver.options.horizon() {
            return Some(true);
        }
        None
    }

    /// Notes the launchers that exited; whether any ended for good (the
    /// job is finishing).
    fn reap(&mut self, now: Instant) -> bool {
        let mut finishing = false;
        for node in self.nodes.iter_mut() {
            if let Some(child) = node.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                node.child = None;
                match node.cut_until {
                    // Cut off from the store: back after the heal.
                    Some(until) if !status.success() => {
                        node.back_at = Some(until.max(now) + LAUNCHER_BACK);
                    }
                    _ => node.ended = Some(status),
                }
            }
            finishing |= node.ended.is_some();
        }
        finishing
    }

    /// Starts again the launchers due back, unless the job is finishing.
    fn bring_back(&mut self, now: Instant, finishing: bool) {
        for (i, node) in self.nodes.iter_mut().enumerate() {
            if node.back_at.is_some_and(|at| at <= now) {
                node.back_at = None;
                if !finishing && self.stopped.is_none() {
                    (self.say)(&format!("chaos: starting node {i}'s launcher again"));
                    match self
                        .driver
                        .launch(self.dir, &self.store, &self.marker, i, &self.program)
                    {
                        Ok(child) => node.child = Some(child),
                        Err(e) => self.stopped = Some(e),
                    }
                    node.cut_until = None;
                }
            }
        }
    }

    /// Injects the faults whose time came.
    fn inject_due(&mut self, now: Instant) {
        while self.stopped.is_none()
            && self.next < self.faults.len()
            && self.faults[self.next].at <= now.duration_since(self.started)
        {
            let fault = self.faults[self.next].clone();
            self.next += 1;
            let job = (self.store.as_str(), self.marker.as_str());
            let (outcome, acted) =
                self.driver
                    .inject(&fault, self.dir, job, &mut self.nodes, &mut self.due, &mut self.undo);
            (self.say)(&format!(
                "chaos: {:>6.1} s {} node {} worker {}: {outcome}",
                fault.at.as_secs_f64(),
                fault.kind.name(),
                fault.node,
                fault.local_rank
            ));
            self.injected.push((
                Injected {
                    planned: fault,
                    outcome,
                    acted,
                },
                unix_us(),
            ));
        }
    }

    /// Kills the launchers still running, wakes the workers a due signal
    /// would have, and puts the network back as it was.
    fn wind_down(&mut self) {
        for node in self.nodes.iter_mut() {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        // SIGCONT any worker a due signal would have woken.
        for d in &self.due {
            process::signal(d.pid, Signal::SIGCONT);
        }
        // The network as it was, for the next run (an error here is reported
        // after the leftovers are cleared).
        for u in &self.undo {
            if let Err(e) = self.driver.undo(u) {
                self.stopped.get_or_insert(e);
            }
        }
    }

    /// What the run left: its records, the processes and ring files left
    /// behind; an error when it stopped early, or when a fault-free run
    /// failed or ran past the horizon.
    fn leftovers(
        mut self,
        shm_before: &BTreeSet<PathBuf>,
        seconds: f64,
        timed_out: bool,
    ) -> Result<PhaseOutcome, ChaosError> {
        let (phase, dir) = (self.phase, self.dir);
        let records = read_records(&dir.join("records"))?;
        self.known.extend(records.iter().map(|r| r.pid));
        let net_inodes = self.driver.hosts.as_ref().map(|h| h.net_inodes()).unwrap_or_default();
        let orphans = orphans(&self.marker, &net_inodes);
        let leaked_shm: Vec<String> = self
            .driver
            .shm_dirs()
            .iter()
            .flat_map(|d| leaked_rings(d, shm_before, &self.known))
            .collect();
        if let Some(e) = self.stopped {
            return Err(e);
        }
        let failed = self
            .nodes
            .iter()
            .filter_map(|n| n.ended)
            .filter(|s| !s.success())
            .count();
        (self.say)(&format!(
            "chaos: the {phase} run ended after {seconds:.1} s: {} records{}",
            records.len(),
            match failed {
                0 => String::new(),
                n => format!(", {n} launchers failed"),
            }
        ));
        if phase != "chaos" && (timed_out || failed > 0) {
            return Err(ChaosError::Phase {
                phase,
                why: match timed_out {
                    true => format!("it ran past {:.0} s", self.driver.options.horizon().as_secs_f64()),
                    false => format!("{failed} launchers exited with an error"),
                },
                dir: dir.to_path_buf(),
            });
        }
        Ok(PhaseOutcome {
            records,
            injected: self.injected,
            orphans,
            leaked_shm,
            seconds,
        })
    }
}

/// The worker of `node` at `local_rank` (by pid order), or why there is none.
fn worker_pid(node: &Node, local_rank: usize) -> Result<u32, String> {
    let Some(launcher) = node.child.as_ref().map(|c| c.id()) else {
        return Err("the node's launcher is down".into());
    };
    let mut workers = workers_of_launcher(launcher);
    workers.sort_unstable();
    workers
        .get(local_rank % workers.len().max(1))
        .copied()
        .ok_or_else(|| "no worker running (being relaunched)".into())
}

/// Every process's parent, from `/proc`.
fn parents() -> HashMap<u32, u32> {
    let mut out = HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // After the command's closing parenthesis: state, then the parent.
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        if fields.next() == Some("Z") {
            continue;
        }
        if let Some(ppid) = fields.next().and_then(|s| s.parse().ok()) {
            out.insert(pid, ppid);
        }
    }
    out
}

/// The live children of process `launcher`.
fn workers_of_launcher(launcher: u32) -> Vec<u32> {
    parents()
        .into_iter()
        .filter(|&(_, ppid)| ppid == launcher)
        .map(|(pid, _)| pid)
        .collect()
}

/// The workers of each running launcher.
fn workers_of(nodes: &[Node]) -> HashMap<u32, Vec<u32>> {
    let launchers: BTreeSet<u32> = nodes.iter().filter_map(|n| n.child.as_ref().map(Child::id)).collect();
    let mut out: HashMap<u32, Vec<u32>> = HashMap::new();
    for (pid, ppid) in parents() {
        if launchers.contains(&ppid) {
            out.entry(ppid).or_default().push(pid);
        }
    }
    out
}

/// Every member's records, each member's in the order written. A line cut
/// short by a kill is skipped.
fn read_records(dir: &Path) -> Result<Vec<CommitRecord>, ChaosError> {
    let mut records = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(records);
    };
    let mut files: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    files.sort();
    for path in files {
        let file = std::fs::File::open(&path).map_err(io(format!("reading {}", path.display())))?;
        for line in std::io::BufReader::new(file).lines().map_while(Result::ok) {
            if let Ok(record) = serde_json::from_str(&line) {
                records.push(record);
            }
        }
    }
    Ok(records)
}

/// Processes still carrying the run's marker or in one of the network
/// namespaces `net_inodes` (the simulated hosts'), after a grace period for
/// the last to exit; each is SIGKILLed.
fn orphans(marker: &str, net_inodes: &[u64]) -> Vec<u32> {
    use std::os::unix::fs::MetadataExt;
    let needle = format!("{MARKER_ENV}={marker}");
    let find = || -> Vec<u32> {
        parents()
            .into_keys()
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|env| env.split(|&b| b == 0).any(|kv| kv == needle.as_bytes()))
                    || std::fs::metadata(format!("/proc/{pid}/ns/net")).is_ok_and(|m| net_inodes.contains(&m.ino()))
            })
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut left = find();
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        left = find();
    }
    for &pid in &left {
        process::signal(pid as i32, Signal::SIGKILL);
    }
    left
}

/// The shared-memory ring files in `dir` (a `/dev/shm`).
fn ring_files(dir: &Path) -> BTreeSet<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("chorus-") && n.contains("-to-"))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Ring files in `dir` that appeared since `before`, written by one of
/// `pids` (the writer's pid is in the ring's header: magic `chorusR1` at 0,
/// the pid at 12); each is removed.
fn leaked_rings(dir: &Path, before: &BTreeSet<PathBuf>, pids: &BTreeSet<u32>) -> Vec<String> {
    let mut leaked = Vec::new();
    for path in ring_files(dir).difference(before) {
        let mut head = [0u8; 16];
        let read = std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head));
        if read.is_err() || &head[..8] != b"chorusR1" {
            continue;
        }
        let writer = u32::from_le_bytes([head[12], head[13], head[14], head[15]]);
        if pids.contains(&writer) {
            let _ = std::fs::remove_file(path);
            leaked.push(path.display().to_string());
        }
    }
    leaked
}
