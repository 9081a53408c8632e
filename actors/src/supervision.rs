//! Failure detection and group abort: the per-rank [`Supervision`] state, the
//! watchdog that polls it, and the monitor that watches the watchdog.
//!
//! Rules (each has a test named after it, in this module or in
//! `tests/supervision.rs`):
//! - SV-1: a dead or frozen peer (its link closed, or no heartbeat for the
//!   window, see [`heartbeat`](crate::heartbeat)) aborts the group: every
//!   pending and queued operation on this rank completes at once with
//!   [`GroupAborted`] naming the failed ranks.
//! - SV-2: an operation that fails in a way that breaks the group (RA-4: a
//!   timeout, a desync, a broken link) aborts it too; the watchdog also
//!   aborts when an operation outlives its deadline by a heartbeat window
//!   (a driver stuck outside its own deadline).
//! - SV-3: in the default mode an abort closes this generation's links, so
//!   every peer fails within moments, not a heartbeat window later.
//! - SV-4: after an abort, operations fail at once; nothing waits.
//! - SV-5: an abort happens once per group and is published on
//!   [`Supervision::subscribe`] (`ProcessGroup::failures`), the hook a
//!   group supervisor restarts from; the flight recorder is dumped (RA-5).
//! - SV-6: the watchdog is watched: when it makes no progress for the
//!   watchdog timeout (default 480 s), the process says so and exits.
//! - SV-7: one error-handling mode per process ([`ErrorHandling::from_env`]);
//!   blocking wait and async error handling set together is an error that
//!   names both variables.
//! - SV-8: a group that leaves cleanly (`ProcessGroup::destroy`) says
//!   goodbye on the heartbeat channel and stops its heartbeats before its
//!   last barrier, so a rank that leaves first is never taken for failed.
//! - SV-14: a peer that closed its links on purpose is not taken for failed;
//!   the rank that died is. An abort closes the links with a
//!   [`CloseNotice`] naming what this rank saw and the ranks it blames; a
//!   peer that gets it (`TransportError::PeerClosed`, a
//!   [`Left`](crate::heartbeat::PeerFailureCause::Left) peer) still aborts,
//!   but blames the ranks the notice names, not its sender, and its abort
//!   message leads with the failures it saw itself. The same holds for a
//!   peer on another host whose launcher published that its process exited
//!   after its group aborted, naming whom it blamed (its error file): an
//!   exit that outran its close notice does not make it the culprit.
//!
//! Restarting a group (a new generation) is a supervisor's job on top of
//! SV-5: everything here belongs to one generation and ends with it.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chorus_runtime::collective::Signature;
use chorus_transports::link::{CloseNotice, Link};
use thiserror::Error;
use tokio::sync::watch;

use crate::heartbeat::{PeerFailure, PeerFailureCause, SharedMonitor};
use crate::metrics::GroupMetrics;
use crate::process_watch::ProcessWatch;

/// The environment variables of blocking-wait mode, most specific first.
pub const BLOCKING_WAIT_ENV: [&str; 3] = ["CHORUS_BLOCKING_WAIT", "TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"];
/// The environment variables of async error handling, most specific first.
pub const ASYNC_ERROR_HANDLING_ENV: [&str; 3] = [
    "CHORUS_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_ASYNC_ERROR_HANDLING",
];
/// Seconds without a heartbeat before a peer is taken for failed.
pub const HEARTBEAT_TIMEOUT_ENV: &str = "CHORUS_HEARTBEAT_TIMEOUT";
/// Seconds without watchdog progress before the process exits.
pub const WATCHDOG_TIMEOUT_ENV: &str = "CHORUS_WATCHDOG_TIMEOUT";

/// What a rank does when a peer fails or an operation times out
/// (PyTorch's `TORCH_NCCL_BLOCKING_WAIT` / `TORCH_NCCL_ASYNC_ERROR_HANDLING`,
/// made recoverable: chorus never has to tear the process down).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorHandling {
    /// Async error handling 0 without blocking wait: the watchdog only logs;
    /// failures reach each operation through its own deadline and links.
    Off,
    /// Blocking wait: the operations waiting get a typed error (the timeout or
    /// the failed peer) and the group is broken, later operations fail at
    /// once; the links stay open and the process runs on.
    BlockingWait,
    /// Async error handling 1, the default: abort the group (SV-1..SV-5):
    /// pending operations fail, this generation's links close, the failure is
    /// published for a supervisor.
    Abort,
    /// Async error handling 2 ("clean up only"): as [`Abort`](Self::Abort)
    /// but the links stay open; peers learn from their own heartbeats.
    CleanUpOnly,
    /// Async error handling 3 ("tear down"): abort, dump the flight recorder,
    /// then exit the process (code 1) so a launcher can restart it.
    TearDown,
}

impl ErrorHandling {
    /// Whether a failure found by the watchdog aborts the group.
    pub fn aborts(self) -> bool {
        self != ErrorHandling::Off
    }

    /// Whether an abort closes this generation's links (SV-3).
    pub fn closes_links(self) -> bool {
        matches!(self, ErrorHandling::Abort | ErrorHandling::TearDown)
    }

    /// The mode the environment asks for. Each mode is read from its most
    /// specific variable that is set (`CHORUS_*`, then `TORCH_NCCL_*`, then
    /// `NCCL_*`). When both are on, the one set by a more specific name wins
    /// (so `CHORUS_BLOCKING_WAIT=1` works under a launcher that sets
    /// `TORCH_NCCL_ASYNC_ERROR_HANDLING=1`); at the same level it is an error.
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> Result<Self, SupervisionConfigError> {
        let read =
            |names: &[&'static str; 3], max: u8| -> Result<Option<(usize, &'static str, u8)>, SupervisionConfigError> {
                for (level, name) in names.iter().enumerate() {
                    let Some(value) = env(name).filter(|v| !v.trim().is_empty()) else {
                        continue;
                    };
                    return match value.trim().parse::<u8>() {
                        Ok(n) if n <= max => Ok(Some((level, name, n))),
                        _ => Err(SupervisionConfigError::BadValue {
                            name,
                            value,
                            expected: if max == 1 { "0 or 1" } else { "0, 1, 2 or 3" },
                        }),
                    };
                }
                Ok(None)
            };
        let blocking = read(&BLOCKING_WAIT_ENV, 1)?.filter(|&(_, _, v)| v == 1);
        let asynchronous = read(&ASYNC_ERROR_HANDLING_ENV, 3)?;
        let async_mode = |value| match value {
            0 => ErrorHandling::Off,
            2 => ErrorHandling::CleanUpOnly,
            3 => ErrorHandling::TearDown,
            _ => ErrorHandling::Abort,
        };
        Ok(match (blocking, asynchronous) {
            (None, None) => ErrorHandling::Abort,
            (None, Some((_, _, value))) => async_mode(value),
            (Some(_), None) | (Some(_), Some((_, _, 0))) => ErrorHandling::BlockingWait,
            (Some((b, _, _)), Some((a, _, _))) if b < a => ErrorHandling::BlockingWait,
            (Some((b, _, _)), Some((a, _, value))) if a < b => async_mode(value),
            (Some((_, blocking, _)), Some((_, asynchronous, value))) => {
                return Err(SupervisionConfigError::BothModes {
                    blocking,
                    asynchronous,
                    value,
                });
            }
        })
    }
}

/// The supervision settings in the environment are wrong.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SupervisionConfigError {
    /// Blocking wait and async error handling are both on.
    #[error(
        "{blocking}=1 and {asynchronous}={value} are both set: choose blocking wait or async error handling, not both \
         (unset one, set {asynchronous}=0, or set CHORUS_BLOCKING_WAIT=1 / CHORUS_ASYNC_ERROR_HANDLING to override)"
    )]
    BothModes {
        /// The blocking-wait variable.
        blocking: &'static str,
        /// The async-error-handling variable.
        asynchronous: &'static str,
        /// Its value.
        value: u8,
    },
    /// A variable holds something else than it takes.
    #[error("{name}={value:?}: expected {expected}")]
    BadValue {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What it takes.
        expected: &'static str,
    },
}

/// Reads a duration in seconds (`5`, `0.5`) from `name`: `None` when unset.
pub fn seconds_from_env(
    env: &dyn Fn(&str) -> Option<String>,
    name: &'static str,
) -> Result<Option<Duration>, SupervisionConfigError> {
    let Some(value) = env(name).filter(|v| !v.trim().is_empty()) else {
        return Ok(None);
    };
    match value.trim().parse::<f64>() {
        Ok(s) if s > 0.0 && s.is_finite() => Ok(Some(Duration::from_secs_f64(s))),
        _ => Err(SupervisionConfigError::BadValue {
            name,
            value,
            expected: "a positive number of seconds",
        }),
    }
}

/// Why a group was aborted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AbortReason {
    /// Peers failed (SV-1).
    PeersFailed(Vec<PeerFailure>),
    /// An operation broke the group (SV-2).
    OperationFailed(String),
    /// An operation outlived its deadline and its driver did not end it.
    Overdue {
        /// What was running.
        operation: String,
        /// How long it ran.
        ran: Duration,
    },
    /// This rank left the group on purpose (`ProcessGroup::shutdown`).
    Shutdown(String),
}

impl AbortReason {
    /// A short label for metrics (`chorus_aborts_total{reason}`).
    pub fn label(&self) -> &'static str {
        match self {
            AbortReason::PeersFailed(failures) if failures.iter().any(PeerFailure::failed) => "peer_failed",
            AbortReason::PeersFailed(_) => "peer_left",
            AbortReason::OperationFailed(_) => "operation_failed",
            AbortReason::Overdue { .. } => "overdue",
            AbortReason::Shutdown(_) => "shutdown",
        }
    }

    /// Whether the only peers gone shut down on purpose: each notice names
    /// its sender alone (`ProcessGroup::shutdown`), so nothing failed.
    pub fn peers_shut_down(&self) -> bool {
        matches!(self, AbortReason::PeersFailed(gone) if gone.iter().all(|p| matches!(
            &p.cause,
            PeerFailureCause::Left { failed, .. } if failed[..] == [p.rank]
        )))
    }
}

impl fmt::Display for AbortReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AbortReason::PeersFailed(failures) => {
                // The real failures lead; peers that closed on purpose are a
                // consequence, named in full only when nothing else is known.
                let (failed, left): (Vec<&PeerFailure>, Vec<&PeerFailure>) = failures.iter().partition(|f| f.failed());
                let full = if failed.is_empty() { &left } else { &failed };
                let text: Vec<String> = full.iter().map(ToString::to_string).collect();
                f.write_str(&text.join("; "))?;
                match left.as_slice() {
                    _ if failed.is_empty() => Ok(()),
                    [] => Ok(()),
                    [one] => write!(f, "; rank {} closed its links too", one.rank),
                    many => {
                        let ranks: Vec<usize> = many.iter().map(|p| p.rank).collect();
                        write!(f, "; ranks {ranks:?} closed their links too")
                    }
                }
            }
            AbortReason::OperationFailed(e) => f.write_str(e),
            AbortReason::Overdue { operation, ran } => {
                write!(f, "{operation} still running after {ran:?}, past its deadline")
            }
            AbortReason::Shutdown(why) => write!(f, "this rank shut the group down ({why})"),
        }
    }
}

/// The group was aborted: what every pending and later operation of this
/// rank gets, and what [`Supervision::subscribe`] publishes.
#[derive(Clone, PartialEq, Eq, Error)]
#[error("process group (generation {generation}) aborted on rank {rank}: {reason}")]
pub struct GroupAborted {
    /// The rank that aborted.
    pub rank: usize,
    /// The group's generation.
    pub generation: u64,
    /// Why.
    pub reason: AbortReason,
    /// The ranks taken for failed, ascending, never this rank (empty when
    /// none is known, e.g. a desync). Peers that closed their links on
    /// purpose are not among them (SV-14).
    pub failed_ranks: Vec<usize>,
}

chorus_runtime::debug_as_report!(GroupAborted);

/// The operation a rank is running, as the watchdog sees it.
#[derive(Debug, Clone, Copy)]
struct InFlight {
    /// Formatted only if the watchdog reports it: an operation's start
    /// formats nothing.
    what: Signature,
    started: Instant,
    deadline: Instant,
}

/// One rank's supervision state for one generation, shared by its actor, its
/// watchdog and its process group handle.
#[derive(Debug)]
pub struct Supervision {
    rank: usize,
    generation: u64,
    mode: ErrorHandling,
    links: Vec<Option<Arc<dyn Link>>>,
    aborted: watch::Sender<Option<GroupAborted>>,
    in_flight: Mutex<Option<InFlight>>,
    progress: AtomicU64,
    metrics: Option<GroupMetrics>,
    on_failure: Option<FailureHook>,
}

/// Told of the group's abort for a failure ([`Supervision::abort`]) before
/// any operation is: what it records is there before the program can
/// exit on the error (a launcher reads it once the process ended).
pub struct FailureHook(Box<dyn Fn(&GroupAborted) + Send + Sync>);

impl FailureHook {
    /// A hook calling `hook`.
    pub fn new(hook: impl Fn(&GroupAborted) + Send + Sync + 'static) -> Self {
        Self(Box::new(hook))
    }
}

impl fmt::Debug for FailureHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FailureHook")
    }
}

impl Supervision {
    /// The state of `rank` in `generation`, over `links`.
    pub fn new(rank: usize, generation: u64, mode: ErrorHandling, links: Vec<Option<Arc<dyn Link>>>) -> Self {
        Self {
            rank,
            generation,
            mode,
            links,
            aborted: watch::Sender::new(None),
            in_flight: Mutex::new(None),
            progress: AtomicU64::new(0),
            metrics: None,
            on_failure: None,
        }
    }

    /// Calls `hook` with the abort when a failure aborts the group.
    pub fn with_failure_hook(mut self, hook: FailureHook) -> Self {
        self.on_failure = Some(hook);
        self
    }

    /// Counts aborts and silent peers in `metrics`.
    pub fn with_metrics(mut self, metrics: GroupMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The error-handling mode.
    pub fn mode(&self) -> ErrorHandling {
        self.mode
    }

    /// Aborts the group unless it already was (SV-5): publishes the abort
    /// (which ends the running operation and fails the queued ones) and, in
    /// modes that do, closes the links (SV-3) with a notice of why and whom
    /// this rank blames (SV-14). Returns whether this call aborted.
    pub fn abort(&self, reason: AbortReason, mut failed_ranks: Vec<usize>) -> bool {
        failed_ranks.sort_unstable();
        failed_ranks.dedup();
        failed_ranks.retain(|&r| r != self.rank);
        let Some(abort) = self.publish(reason, failed_ranks, self.on_failure.as_ref()) else {
            return false;
        };
        tracing::error!(rank = self.rank, generation = self.generation, mode = ?self.mode, "{abort}");
        if self.mode.closes_links() {
            let notice = CloseNotice {
                reason: format!("rank {} aborted: {}", self.rank, abort.reason),
                failed: abort.failed_ranks.clone(),
            };
            for link in self.links.iter().flatten() {
                link.close_with(&notice);
            }
        }
        true
    }

    /// This rank leaves the group on purpose (a service shutting down):
    /// the abort ([`AbortReason::Shutdown`]) is published, so pending and
    /// later operations fail at once, and the links close in every mode
    /// with a notice naming this rank itself, so peers count it gone at
    /// once (an elastic rendezvous does not wait for it) rather than
    /// waiting out a heartbeat window. Returns whether this call aborted.
    pub fn shut_down(&self, why: &str) -> bool {
        let first = self.abort_quietly(AbortReason::Shutdown(why.to_owned()));
        let notice = CloseNotice {
            reason: format!("rank {} shut down: {why}", self.rank),
            failed: vec![self.rank],
        };
        for link in self.links.iter().flatten() {
            link.close_with(&notice);
        }
        first
    }

    /// Publishes `reason` as the abort unless there was one, without
    /// closing links; returns whether it did.
    fn abort_quietly(&self, reason: AbortReason) -> bool {
        let Some(abort) = self.publish(reason, Vec::new(), None) else {
            return false;
        };
        tracing::info!(rank = self.rank, generation = self.generation, "{abort}");
        true
    }

    /// Publishes the abort and counts it, unless there was one already:
    /// the first abort is the group's. `hook` hears of it first.
    fn publish(
        &self,
        reason: AbortReason,
        failed_ranks: Vec<usize>,
        hook: Option<&FailureHook>,
    ) -> Option<GroupAborted> {
        let abort = GroupAborted {
            rank: self.rank,
            generation: self.generation,
            reason,
            failed_ranks,
        };
        let first = self.aborted.send_if_modified(|current| {
            if current.is_some() {
                return false;
            }
            if let Some(hook) = hook {
                (hook.0)(&abort);
            }
            *current = Some(abort.clone());
            true
        });
        if !first {
            return None;
        }
        if let Some(metrics) = &self.metrics {
            metrics.aborted(abort.reason.label());
        }
        Some(abort)
    }

    /// The abort, once there was one.
    pub fn aborted(&self) -> Option<GroupAborted> {
        self.aborted.borrow().clone()
    }

    /// A receiver that sees the abort when it happens (SV-5).
    pub fn subscribe(&self) -> watch::Receiver<Option<GroupAborted>> {
        self.aborted.subscribe()
    }

    /// The actor started `what`, due by `deadline`.
    pub fn started(&self, what: Signature, deadline: Instant) {
        *self.in_flight.lock().unwrap_or_else(|p| p.into_inner()) = Some(InFlight {
            what,
            started: Instant::now(),
            deadline,
        });
    }

    /// The actor's operation ended.
    pub fn finished(&self) {
        *self.in_flight.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// How many times the watchdog has polled (what SV-6 watches).
    pub fn progress(&self) -> u64 {
        self.progress.load(Ordering::Relaxed)
    }
}

/// The watchdog's timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchdogConfig {
    /// How often it polls (PyTorch's: 100 ms).
    pub poll: Duration,
    /// How long it may make no progress before the process exits (SV-6;
    /// PyTorch's heartbeat monitor: 480 s).
    pub stall_timeout: Duration,
    /// How far past its deadline an operation may run before the watchdog
    /// aborts (the driver's own deadline normally ends it first).
    pub overdue_grace: Duration,
}

impl Default for WatchdogConfig {
    fn default() -> Self {
        Self {
            poll: Duration::from_millis(100),
            stall_timeout: Duration::from_secs(480),
            overdue_grace: Duration::from_secs(5),
        }
    }
}

/// What one poll of the watchdog decides, as a pure function of the gone
/// peers and the operation in flight: the reason to abort and the ranks to
/// name, or nothing. Named are the peers that failed and the ranks that
/// peers which closed on purpose blamed, never those peers (SV-14).
fn verdict(
    failures: Vec<PeerFailure>,
    in_flight: Option<&InFlight>,
    grace: Duration,
    now: Instant,
) -> Option<(AbortReason, Vec<usize>)> {
    if !failures.is_empty() {
        let mut ranks = Vec::new();
        let mut left = Vec::new();
        for failure in &failures {
            match &failure.cause {
                PeerFailureCause::Left { failed, .. } => {
                    // A peer that names itself left for good (a shutdown):
                    // it is gone as a failed one is, so nobody waits for it.
                    if !failed.contains(&failure.rank) {
                        left.push(failure.rank);
                    }
                    ranks.extend(failed);
                }
                _ => ranks.push(failure.rank),
            }
        }
        // What this rank saw itself beats what a peer reported.
        ranks.retain(|r| !left.contains(r));
        return Some((AbortReason::PeersFailed(failures), ranks));
    }
    let op = in_flight?;
    (now >= op.deadline + grace).then(|| {
        (
            AbortReason::Overdue {
                operation: op.what.to_string(),
                ran: now.saturating_duration_since(op.started),
            },
            Vec::new(),
        )
    })
}

/// Runs the watchdog on the current runtime (the rank's arbiter) until
/// `stop` turns true: every `config.poll`, and at once when a link fails or
/// a watched peer process exits, it counts a step of progress, tells the
/// heartbeat monitor which watched peer processes exited (SV-15),
/// polls the monitor and the operation in flight, and aborts the group on a
/// verdict (in modes that abort; [`ErrorHandling::Off`] logs). `on_abort`
/// runs once after the abort (the actor dumps its recorder).
pub fn spawn_watchdog(
    supervision: Arc<Supervision>,
    monitor: Arc<SharedMonitor>,
    mut processes: ProcessWatch,
    config: WatchdogConfig,
    on_abort: impl FnOnce() + Send + 'static,
    mut stop: watch::Receiver<bool>,
) {
    tokio::spawn(async move {
        let mut on_abort = Some(on_abort);
        loop {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                () = tokio::time::sleep(config.poll) => {}
                // A closed link (a peer's abort, a lost connection) and a
                // local peer's exit (SV-15) are acted on at once, not at the
                // next poll.
                () = monitor.next_link_failure() => {}
                gone = processes.next_exit() => {
                    let mut monitor = monitor.lock();
                    for (rank, pid) in gone {
                        monitor.process_exited(rank, pid);
                    }
                }
            }
            supervision.progress.fetch_add(1, Ordering::Relaxed);
            if supervision.aborted().is_some() {
                continue;
            }
            let now = Instant::now();
            let failures = {
                let mut monitor = monitor.lock();
                for (rank, pid) in processes.exited() {
                    monitor.process_exited(rank, pid);
                }
                monitor.poll(now)
            };
            if let Some(metrics) = &supervision.metrics {
                let silent = failures
                    .iter()
                    .filter(|f| matches!(f.cause, PeerFailureCause::Silent(_)));
                metrics.heartbeats_missed().increment(silent.count() as u64);
            }
            let in_flight = *supervision.in_flight.lock().unwrap_or_else(|p| p.into_inner());
            let Some((reason, ranks)) = verdict(failures, in_flight.as_ref(), config.overdue_grace, now) else {
                continue;
            };
            if !supervision.mode.aborts() {
                tracing::error!(
                    rank = supervision.rank,
                    "{reason} (async error handling is off: not aborting)"
                );
                continue;
            }
            if supervision.abort(reason, ranks)
                && let Some(notify) = on_abort.take()
            {
                notify();
            }
        }
    });
}

/// SV-6's check, without IO: the last progress count seen and when it
/// last changed.
#[derive(Debug, Clone, Copy)]
pub struct StallCheck {
    timeout: Duration,
    seen: u64,
    since: Instant,
}

impl StallCheck {
    /// A check that allows `timeout` without progress, starting at `now`.
    pub fn new(timeout: Duration, now: Instant) -> Self {
        Self {
            timeout,
            seen: 0,
            since: now,
        }
    }

    /// Feeds the progress count at `now`; returns how long it has not
    /// moved once that reaches the timeout.
    pub fn observe(&mut self, progress: u64, now: Instant) -> Option<Duration> {
        if progress != self.seen {
            self.seen = progress;
            self.since = now;
            return None;
        }
        let stalled = now.saturating_duration_since(self.since);
        (stalled >= self.timeout).then_some(stalled)
    }
}

/// One watchdog the stall monitor watches.
struct Watched {
    supervision: Arc<Supervision>,
    timeout: Duration,
    step: Duration,
    next: Instant,
    check: StallCheck,
    stop: watch::Receiver<bool>,
    on_stall: Box<dyn FnOnce(String) + Send>,
}

/// The watchdogs of this process, watched by one thread: a thread per rank
/// would be a thousand threads for a thousand ranks in one process.
static WATCHED: Mutex<Vec<Watched>> = Mutex::new(Vec::new());
static STALL_THREAD: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();

/// How often the stall monitor thread looks at its watchdogs at most.
const STALL_TICK: Duration = Duration::from_millis(10);

fn watch_stalls() {
    loop {
        std::thread::sleep(STALL_TICK);
        let now = Instant::now();
        let mut fired = Vec::new();
        {
            let mut watched = WATCHED.lock().unwrap_or_else(|p| p.into_inner());
            let mut i = 0;
            while i < watched.len() {
                let w = &mut watched[i];
                // Only watchdogs due are looked at: a thousand ranks'
                // stop flags every tick cost more than the watching.
                if now < w.next {
                    i += 1;
                    continue;
                }
                // A stop sent, or its sender gone with its group.
                if *w.stop.borrow() || w.stop.has_changed().is_err() {
                    watched.swap_remove(i);
                    continue;
                }
                w.next = now + w.step;
                if let Some(stalled) = w.check.observe(w.supervision.progress(), now) {
                    fired.push((watched.swap_remove(i), stalled));
                    continue;
                }
                i += 1;
            }
        }
        // Outside the lock: `on_stall` may exit the process or register more.
        for (w, stalled) in fired {
            (w.on_stall)(format!(
                "chorus: the watchdog of rank {} (generation {}) made no progress for {:.1}s \
                 (CHORUS_WATCHDOG_TIMEOUT={}): the rank's thread is stuck; exiting",
                w.supervision.rank,
                w.supervision.generation,
                stalled.as_secs_f64(),
                w.timeout.as_secs_f64()
            ));
        }
    }
}

/// Watches the watchdog from a thread other than its own (the arbiter it
/// runs on may be the thing that is stuck; one thread watches every
/// watchdog of the process): once it makes no progress for `timeout`,
/// calls `on_stall` with a message and stops. Ends when `stop` turns true.
pub fn spawn_stall_monitor(
    supervision: Arc<Supervision>,
    timeout: Duration,
    stop: watch::Receiver<bool>,
    on_stall: impl FnOnce(String) + Send + 'static,
) -> std::io::Result<()> {
    STALL_THREAD
        .get_or_init(|| {
            std::thread::Builder::new()
                .name("chorus-watchdog-monitor".into())
                .spawn(watch_stalls)
                .map(drop)
                .map_err(|e| e.to_string())
        })
        .clone()
        .map_err(std::io::Error::other)?;
    let now = Instant::now();
    let step = (timeout / 4).clamp(STALL_TICK, Duration::from_secs(1));
    WATCHED.lock().unwrap_or_else(|p| p.into_inner()).push(Watched {
        supervision,
        timeout,
        step,
        next: now + step,
        check: StallCheck::new(timeout, now),
        stop,
        on_stall: Box::new(on_stall),
    });
    Ok(())
}

/// What a stalled watchdog does in a real process (SV-6): say so and exit.
pub fn exit_on_stall(message: String) {
    eprintln!("{message}");
    std::process::exit(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |name| vars.get(name).cloned()
    }

    #[test]
    fn only_peers_that_name_themselves_alone_shut_down_on_purpose() {
        let left = |rank, failed: Vec<usize>| PeerFailure {
            rank,
            cause: PeerFailureCause::Left {
                reason: format!("rank {rank} left"),
                failed,
            },
        };
        let shut_down = AbortReason::PeersFailed(vec![left(1, vec![1]), left(3, vec![3])]);
        assert!(shut_down.peers_shut_down());
        // A peer that aborted because another died reports a failure.
        assert!(!AbortReason::PeersFailed(vec![left(1, vec![2])]).peers_shut_down());
        let died = PeerFailure {
            rank: 2,
            cause: PeerFailureCause::Closed("link to rank 2 is closed".into()),
        };
        assert!(!AbortReason::PeersFailed(vec![left(1, vec![1]), died]).peers_shut_down());
        assert!(!AbortReason::Shutdown("this rank left".into()).peers_shut_down());
    }

    #[test]
    fn sv7_one_error_handling_mode_per_process() {
        let mode = |vars: &[(&str, &str)]| ErrorHandling::from_env(&env(vars));
        assert_eq!(mode(&[]), Ok(ErrorHandling::Abort));
        assert_eq!(
            mode(&[("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")]),
            Ok(ErrorHandling::Abort)
        );
        assert_eq!(
            mode(&[("NCCL_ASYNC_ERROR_HANDLING", "2")]),
            Ok(ErrorHandling::CleanUpOnly)
        );
        assert_eq!(
            mode(&[("CHORUS_ASYNC_ERROR_HANDLING", "3")]),
            Ok(ErrorHandling::TearDown)
        );
        assert_eq!(mode(&[("CHORUS_ASYNC_ERROR_HANDLING", "0")]), Ok(ErrorHandling::Off));
        assert_eq!(mode(&[("NCCL_BLOCKING_WAIT", "1")]), Ok(ErrorHandling::BlockingWait));
        assert_eq!(mode(&[("TORCH_NCCL_BLOCKING_WAIT", "0")]), Ok(ErrorHandling::Abort));
        // The more specific name wins: a launcher's TORCH_NCCL_ASYNC_ERROR_HANDLING=1 does not block CHORUS_BLOCKING_WAIT.
        assert_eq!(
            mode(&[("CHORUS_BLOCKING_WAIT", "1"), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")]),
            Ok(ErrorHandling::BlockingWait)
        );
        assert_eq!(
            mode(&[("NCCL_BLOCKING_WAIT", "1"), ("CHORUS_ASYNC_ERROR_HANDLING", "2")]),
            Ok(ErrorHandling::CleanUpOnly)
        );
        assert_eq!(
            mode(&[
                ("TORCH_NCCL_BLOCKING_WAIT", "1"),
                ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
            ]),
            Ok(ErrorHandling::BlockingWait)
        );
        let both = mode(&[
            ("TORCH_NCCL_BLOCKING_WAIT", "1"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        ])
        .unwrap_err();
        assert!(matches!(both, SupervisionConfigError::BothModes { .. }));
        let text = both.to_string();
        assert!(
            text.contains("TORCH_NCCL_BLOCKING_WAIT=1") && text.contains("TORCH_NCCL_ASYNC_ERROR_HANDLING=1"),
            "{text}"
        );
        assert!(
            mode(&[("CHORUS_ASYNC_ERROR_HANDLING", "4")])
                .unwrap_err()
                .to_string()
                .contains("0, 1, 2 or 3")
        );
        assert!(
            mode(&[("CHORUS_BLOCKING_WAIT", "yes")])
                .unwrap_err()
                .to_string()
                .contains("0 or 1")
        );
    }

    #[test]
    fn modes_say_what_an_abort_does() {
        assert!(!ErrorHandling::Off.aborts());
        assert!(ErrorHandling::BlockingWait.aborts() && !ErrorHandling::BlockingWait.closes_links());
        assert!(ErrorHandling::Abort.closes_links());
        assert!(!ErrorHandling::CleanUpOnly.closes_links());
    }

    #[test]
    fn durations_come_in_seconds() {
        let read = |v: &str| seconds_from_env(&env(&[(HEARTBEAT_TIMEOUT_ENV, v)]), HEARTBEAT_TIMEOUT_ENV);
        assert_eq!(read("2.5"), Ok(Some(Duration::from_millis(2500))));
        assert_eq!(seconds_from_env(&env(&[]), "X"), Ok(None));
        assert!(read("-1").is_err());
        assert!(
            read("soon")
                .unwrap_err()
                .to_string()
                .contains("CHORUS_HEARTBEAT_TIMEOUT")
        );
    }

    #[test]
    fn sv1_a_failed_peer_is_a_verdict_naming_it() {
        let now = Instant::now();
        let failure = PeerFailure {
            rank: 3,
            cause: PeerFailureCause::Silent(Duration::from_secs(5)),
        };
        let (reason, ranks) = verdict(vec![failure.clone()], None, Duration::ZERO, now).unwrap();
        assert_eq!(ranks, vec![3]);
        assert_eq!(reason, AbortReason::PeersFailed(vec![failure]));
        assert!(verdict(Vec::new(), None, Duration::ZERO, now).is_none());
    }

    #[test]
    fn sv2_an_operation_past_its_deadline_and_grace_is_a_verdict() {
        let t0 = Instant::now();
        let op = InFlight {
            what: Signature {
                seq: 4,
                kind: chorus_runtime::collective::CollectiveKind::AllReduce,
                dtype: chorus_runtime::collective::DType::Float32,
                count: 2,
                root: None,
                reduce_op: Some(chorus_runtime::collective::ReduceOp::Sum),
            },
            started: t0,
            deadline: t0 + Duration::from_secs(10),
        };
        let grace = Duration::from_secs(5);
        assert!(verdict(Vec::new(), Some(&op), grace, t0 + Duration::from_secs(14)).is_none());
        let (reason, ranks) = verdict(Vec::new(), Some(&op), grace, t0 + Duration::from_secs(15)).unwrap();
        assert!(ranks.is_empty());
        assert!(
            reason
                .to_string()
                .contains("#4 all_reduce(2 x float32, sum) still running"),
            "{reason}"
        );
    }

    #[tokio::test]
    async fn a_rank_that_shuts_down_fails_its_operations_and_its_peers_count_it_gone_at_once() {
        use chorus_transports::link::TransportError;
        use chorus_transports::local::local_mesh;
        let mut mesh = local_mesh(3);
        // Clean-up-only mode keeps links open on an abort: a shutdown closes them anyway.
        let supervision = Supervision::new(1, 4, ErrorHandling::CleanUpOnly, std::mem::take(&mut mesh[1]));
        assert!(supervision.shut_down("service stopping"));
        assert!(!supervision.shut_down("again"), "a shutdown aborts once");
        let aborted = supervision
            .aborted()
            .expect("pending and later operations see the abort");
        assert_eq!(aborted.reason, AbortReason::Shutdown("service stopping".into()));
        assert_eq!(aborted.reason.label(), "shutdown");
        let heard = tokio::time::timeout(Duration::from_secs(5), mesh[0][1].as_ref().unwrap().recv(0))
            .await
            .expect("the close wakes the peer");
        let Err(error @ TransportError::PeerClosed { .. }) = heard else {
            panic!("{heard:?}")
        };
        let gone = PeerFailure {
            rank: 1,
            cause: PeerFailureCause::of(&error),
        };
        // The peer names the rank that left among the gone ones, so an
        // elastic rendezvous accounts for it without waiting.
        let (reason, ranks) = verdict(vec![gone], None, Duration::ZERO, Instant::now()).unwrap();
        assert_eq!(ranks, vec![1]);
        assert_eq!(reason.label(), "peer_left");
    }

    #[tokio::test]
    async fn sv14_a_peer_that_closed_its_links_on_purpose_is_not_taken_for_failed_the_rank_that_died_is() {
        use chorus_transports::link::TransportError;
        use chorus_transports::local::local_mesh;
        let now = Instant::now();
        let left = |rank, failed: Vec<usize>| PeerFailure {
            rank,
            cause: PeerFailureCause::Left {
                reason: format!("rank {rank} aborted: rank 2 (pid 9) died"),
                failed,
            },
        };
        let died = PeerFailure {
            rank: 2,
            cause: PeerFailureCause::Closed("link to rank 2 is closed: rank 2 (pid 9) died".into()),
        };
        // Rank 0 of 4 (the report of today's bug): ranks 1 and 3 aborted and
        // closed their links, rank 2 died. Only rank 2 is blamed, and first.
        let mut mesh = local_mesh(4);
        let supervision = Supervision::new(0, 0, ErrorHandling::Abort, std::mem::take(&mut mesh[0]));
        let failures = vec![left(1, vec![2]), died.clone(), left(3, vec![2, 0, 1])];
        let (reason, ranks) = verdict(failures, None, Duration::ZERO, now).unwrap();
        assert!(supervision.abort(reason, ranks));
        let aborted = supervision.aborted().unwrap();
        assert_eq!(aborted.failed_ranks, vec![2], "{aborted}");
        let text = aborted.to_string();
        assert!(
            text.contains("rank 0: rank 2 is gone") && text.ends_with("; ranks [1, 3] closed their links too"),
            "{text}"
        );
        // Its own close tells every peer why, and that it blames rank 2.
        let heard = tokio::time::timeout(Duration::from_secs(5), mesh[3][0].as_ref().unwrap().recv(0))
            .await
            .expect("the close wakes the peer");
        match heard {
            Err(TransportError::PeerClosed {
                peer: 0,
                reason,
                failed,
            }) => {
                assert_eq!(failed, vec![2]);
                assert!(reason.starts_with("rank 0 aborted: rank 2 is gone"), "{reason}");
            }
            other => panic!("{other:?}"),
        }

        // Before its own detection, a rank learns of the failure from a notice alone.
        let (reason, ranks) = verdict(vec![left(1, vec![2])], None, Duration::ZERO, now).unwrap();
        assert_eq!(ranks, vec![2]);
        assert_eq!(
            reason.to_string(),
            "rank 1 closed its links (rank 1 aborted: rank 2 (pid 9) died)"
        );
        // A notice blaming nobody (a membership change, an overdue operation) blames nobody.
        assert_eq!(
            verdict(vec![left(1, vec![])], None, Duration::ZERO, now).unwrap().1,
            Vec::<usize>::new()
        );
        // What this rank saw itself wins: rank 3 left on purpose, whatever rank 1 says.
        let (_, ranks) = verdict(vec![left(1, vec![3]), left(3, vec![])], None, Duration::ZERO, now).unwrap();
        assert!(ranks.is_empty(), "{ranks:?}");
    }

    #[test]
    fn sv5_an_abort_happens_once_and_is_published() {
        let supervision = Supervision::new(1, 0, ErrorHandling::Abort, Vec::new());
        let events = supervision.subscribe();
        assert!(supervision.abort(AbortReason::OperationFailed("first".into()), vec![2]));
        assert!(!supervision.abort(AbortReason::OperationFailed("second".into()), vec![3]));
        let seen = events.borrow().clone().unwrap();
        assert_eq!(seen.failed_ranks, vec![2]);
        assert_eq!(seen.reason, AbortReason::OperationFailed("first".into()));
    }

    #[test]
    fn sv6_a_stalled_watchdog_is_noticed_with_injected_time() {
        let t0 = Instant::now();
        let mut check = StallCheck::new(Duration::from_secs(480), t0);
        for step in 1..100u64 {
            assert!(check.observe(step, t0 + Duration::from_secs(step * 4)).is_none());
        }
        let last = t0 + Duration::from_secs(99 * 4);
        assert!(check.observe(99, last + Duration::from_secs(479)).is_none());
        assert_eq!(
            check.observe(99, last + Duration::from_secs(480)),
            Some(Duration::from_secs(480))
        );
    }

    #[test]
    fn sv6_the_stall_monitor_thread_fires_when_the_watchdog_stops() {
        // No watchdog runs here, so progress never moves.
        let supervision = Arc::new(Supervision::new(0, 0, ErrorHandling::Abort, Vec::new()));
        let (_stop, stop_rx) = watch::channel(false);
        let (tx, rx) = std::sync::mpsc::channel();
        spawn_stall_monitor(supervision, Duration::from_millis(200), stop_rx, move |message| {
            let _ = tx.send(message);
        })
        .unwrap();
        let message = rx.recv_timeout(Duration::from_secs(5)).expect("the monitor must fire");
        assert!(
            message.contains("made no progress") && message.contains("CHORUS_WATCHDOG_TIMEOUT"),
            "{message}"
        );
    }

    #[test]
    fn sv6_a_moving_watchdog_keeps_the_monitor_quiet() {
        let supervision = Arc::new(Supervision::new(0, 0, ErrorHandling::Abort, Vec::new()));
        let (stop, stop_rx) = watch::channel(false);
        let (tx, rx) = std::sync::mpsc::channel();
        spawn_stall_monitor(
            supervision.clone(),
            Duration::from_millis(300),
            stop_rx,
            move |message| {
                let _ = tx.send(message);
            },
        )
        .unwrap();
        for _ in 0..20 {
            supervision.progress.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(30));
        }
        stop.send_replace(true);
        assert!(
            rx.recv_timeout(Duration::from_millis(500)).is_err(),
            "no stall while progress moves"
        );
    }
}
