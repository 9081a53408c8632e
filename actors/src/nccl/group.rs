//! [`NcclGroup`]: one rank of an NCCL process group, supervised. Its
//! [`NcclRankActor`] runs operations in submission order on the
//! communicator's stream (NC-5); a watchdog thread polls the communicator
//! and the operation in flight and aborts the group on an asynchronous
//! error or a timeout (NC-6..NC-8), as PyTorch's ProcessGroupNCCL watchdog
//! does under `TORCH_NCCL_ASYNC_ERROR_HANDLING`; in blocking-wait mode the
//! waiting caller gets the error itself (NC-9).

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use actix::{Actor, ActorFutureExt, Addr, AtomicResponse, Context, Handler, Message, WrapFuture};
use actix_rt::Arbiter;
use thiserror::Error;
use tokio::sync::watch;

use chorus_runtime::collective::{CollectiveKind, DType, ReduceOp};
use chorus_runtime::flight::{self, FlightOp, FlightRecorder, write_dump};

use super::comm::{Communicator, DeviceBuffer};
use super::types::{CommStatus, NcclError, NcclOp};
use crate::supervision::{AbortReason, ErrorHandling, GroupAborted, Supervision};
use crate::system::{SystemError, new_arbiter};

/// PyTorch's default timeout of NCCL operations.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// How long a waiting operation polls by yielding before it sleeps between
/// looks: short collectives complete in microseconds, a timer tick is 1 ms.
const SPIN: Duration = Duration::from_micros(200);
/// How long it sleeps between looks after that.
const POLL: Duration = Duration::from_millis(1);

/// How a group is supervised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclGroupConfig {
    /// The generation it belongs to (published with an abort).
    pub generation: u64,
    /// Operations' timeout unless one gives its own (PyTorch's: 10 min).
    pub timeout: Duration,
    /// What a failure does (SV-7's modes; see NC-6, NC-9, NC-10).
    pub mode: ErrorHandling,
    /// How often the watchdog polls (PyTorch's: 100 ms).
    pub watchdog_poll: Duration,
    /// In blocking-wait and off modes the caller enforces the timeout; the
    /// watchdog steps in only this much later.
    pub overdue_grace: Duration,
    /// Operations the flight recorder keeps (0: none); `None` reads
    /// `CHORUS_TRACE_BUFFER_SIZE`, as the CPU backend does.
    pub flight_capacity: Option<usize>,
    /// Where every rank dumps its flight recorder when the group aborts or
    /// breaks (into `<dir>/nccl`, apart from the CPU group's dumps); `None`
    /// reads `CHORUS_TRACE_DIR`.
    pub trace_dir: Option<PathBuf>,
}

impl Default for NcclGroupConfig {
    fn default() -> Self {
        Self {
            generation: 0,
            timeout: DEFAULT_TIMEOUT,
            mode: ErrorHandling::Abort,
            watchdog_poll: Duration::from_millis(100),
            overdue_grace: Duration::from_secs(5),
            flight_capacity: None,
            trace_dir: None,
        }
    }
}

impl NcclGroupConfig {
    fn recorder(&self) -> FlightRecorder {
        FlightRecorder::new(self.flight_capacity.unwrap_or_else(flight::capacity_from_env))
    }

    fn trace_dir(&self) -> Option<PathBuf> {
        let dir = self.trace_dir.clone().or_else(flight::trace_dir_from_env);
        dir.map(|d| d.join("nccl"))
    }
}

/// One operation for the actor: buffers are moved in, the output handed back.
#[derive(Debug)]
pub struct NcclCollective<B> {
    /// The operation.
    pub op: NcclOp,
    /// Its input, or `None` to run in place in `output`.
    pub input: Option<B>,
    /// Its output.
    pub output: B,
    /// Overrides the group's timeout for this operation.
    pub timeout: Option<Duration>,
}

impl<B: 'static> Message for NcclCollective<B> {
    type Result = Result<Buffers<B>, NcclOpError>;
}

/// A completed operation's buffers, handed back for reuse.
#[derive(Debug)]
pub struct Buffers<B> {
    /// The input (`None` when it ran in place).
    pub input: Option<B>,
    /// The output, holding the result.
    pub output: B,
}

/// Why an operation of an NCCL group failed.
#[derive(Debug, Clone, Error)]
pub enum NcclOpError {
    /// The group was aborted (by the watchdog, a failed operation, or the
    /// application): every pending and later operation gets this (NC-7).
    #[error(transparent)]
    GroupAborted(#[from] GroupAborted),
    /// The operation did not complete in time (blocking-wait and off modes:
    /// the caller's own error, NC-9).
    #[error("rank {rank}: {operation} did not complete within {timeout:?}; the group is broken: form a new one")]
    Timeout {
        /// The rank.
        rank: usize,
        /// The operation.
        operation: String,
        /// Its timeout.
        timeout: Duration,
    },
    /// An NCCL or CUDA call failed (blocking-wait and off modes; abort
    /// modes report it as the abort's reason).
    #[error("rank {rank}: {operation} failed: {source}; the group is broken: form a new one")]
    Failed {
        /// The rank.
        rank: usize,
        /// The operation.
        operation: String,
        /// What failed.
        #[source]
        source: NcclError,
    },
    /// The operation was refused before launch; the group is still usable.
    #[error("rank {rank}: {source}")]
    Invalid {
        /// The rank.
        rank: usize,
        /// Why.
        #[source]
        source: NcclError,
    },
    /// An earlier operation broke the group (off mode, where nothing aborts).
    #[error("rank {rank}: the NCCL group is broken ({reason}); form a new one")]
    Broken {
        /// The rank.
        rank: usize,
        /// What broke it.
        reason: String,
    },
    /// The rank's actor is gone.
    #[error("the NCCL rank actor has stopped")]
    Stopped,
}

/// The operation in flight, as the watchdog sees it.
#[derive(Debug, Clone)]
struct InFlight {
    what: String,
    started: Instant,
    deadline: Instant,
}

/// What the actor and the watchdog share.
struct Shared<C> {
    comm: C,
    supervision: Arc<Supervision>,
    in_flight: Mutex<Option<InFlight>>,
    mode: ErrorHandling,
    flight: Mutex<FlightRecorder>,
    trace_dir: Option<PathBuf>,
    dumped: AtomicBool,
    generation: u64,
}

impl<C: Communicator> Shared<C> {
    /// Aborts the group once (NC-8): publishes the abort (which fails the
    /// operation in flight and the queued ones, NC-7), then aborts the
    /// communicator, the only way to end a hung kernel. Tear-down mode
    /// exits instead of aborting, as PyTorch's does: `ncclCommAbort` can
    /// itself hang.
    fn abort(&self, reason: AbortReason) -> bool {
        let first = self.supervision.abort(reason, Vec::new());
        if first {
            let aborted = self.supervision.aborted().map(|a| a.to_string()).unwrap_or_default();
            self.dump(&aborted);
            if self.mode == ErrorHandling::TearDown {
                eprintln!(
                    "chorus: rank {}: NCCL group aborted: {}; exiting (async error handling 3: tear down)",
                    self.comm.rank(),
                    self.supervision.aborted().map(|a| a.to_string()).unwrap_or_default()
                );
                std::process::exit(1);
            }
            if let Err(e) = self.comm.abort() {
                tracing::error!(rank = self.comm.rank(), error = %e, "ncclCommAbort failed");
            }
        }
        first
    }

    fn in_flight(&self) -> std::sync::MutexGuard<'_, Option<InFlight>> {
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn flight(&self) -> std::sync::MutexGuard<'_, FlightRecorder> {
        self.flight.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Dumps the flight recorder once, when the group aborts or breaks: the
    /// operation in flight shows as started, where this rank was stuck.
    fn dump(&self, reason: &str) {
        let Some(dir) = &self.trace_dir else {
            return;
        };
        if self.dumped.swap(true, Ordering::Relaxed) {
            return;
        }
        let rank = self.comm.rank();
        let dump = self
            .flight()
            .dump(rank, self.comm.world(), self.generation, reason, SystemTime::now());
        match write_dump(dir, &dump) {
            Ok(path) => {
                tracing::error!(rank, path = %path.display(), "NCCL flight recorder dumped; run `chorus trace {}`", dir.display())
            }
            Err(e) => {
                tracing::error!(rank, dir = %dir.display(), error = %e, "could not dump the NCCL flight recorder")
            }
        }
    }
}

/// How one operation ended badly, before the actor decides what the caller gets.
enum Failure {
    Aborted(GroupAborted),
    TimedOut,
    Nccl(NcclError),
}

/// One rank's NCCL actor.
pub struct NcclRankActor<C: Communicator> {
    shared: Arc<Shared<C>>,
    timeout: Duration,
    seq: u64,
    /// Collectives so far: the recorder's numbering, which every rank shares.
    collectives: u64,
    /// Sends and receives so far, per direction and peer.
    transfers: HashMap<(CollectiveKind, usize), u64>,
    broken: Option<String>,
}

impl<C: Communicator> Actor for NcclRankActor<C> {
    type Context = Context<Self>;
}

impl<C: Communicator> NcclRankActor<C> {
    /// Whether the caller enforces its own deadline: in blocking-wait mode
    /// (the caller gets the timeout, NC-9) and off mode (nothing else will);
    /// in the abort modes the watchdog does (NC-6).
    fn caller_deadline(&self) -> bool {
        matches!(self.shared.mode, ErrorHandling::BlockingWait | ErrorHandling::Off)
    }

    /// What the caller gets for `failure`, and what it does to the group.
    fn fail(&mut self, failure: Failure, operation: String, timeout: Duration, ran: Duration) -> NcclOpError {
        let rank = self.shared.comm.rank();
        let error = match failure {
            Failure::Aborted(aborted) => return aborted.into(),
            // An error after an abort is the abort's doing.
            Failure::Nccl(_) if self.shared.supervision.aborted().is_some() => {
                return self
                    .shared
                    .supervision
                    .aborted()
                    .map_or(NcclOpError::Stopped, Into::into);
            }
            Failure::TimedOut => NcclOpError::Timeout {
                rank,
                operation: operation.clone(),
                timeout,
            },
            Failure::Nccl(source) => NcclOpError::Failed {
                rank,
                operation: operation.clone(),
                source,
            },
        };
        tracing::error!(rank, error = %error, "NCCL operation failed");
        self.broken = Some(error.to_string());
        if !self.shared.mode.aborts() {
            self.shared.dump(&error.to_string());
            return error;
        }
        let reason = match &error {
            NcclOpError::Timeout { .. } => AbortReason::Overdue { operation, ran },
            other => AbortReason::OperationFailed(other.to_string()),
        };
        self.shared.abort(reason);
        match (self.shared.mode, self.shared.supervision.aborted()) {
            (ErrorHandling::BlockingWait, _) | (_, None) => error,
            (_, Some(aborted)) => aborted.into(),
        }
    }
}

impl<C: Communicator> Handler<NcclCollective<C::Buffer>> for NcclRankActor<C> {
    type Result = AtomicResponse<Self, Result<Buffers<C::Buffer>, NcclOpError>>;

    fn handle(&mut self, msg: NcclCollective<C::Buffer>, _ctx: &mut Context<Self>) -> Self::Result {
        let immediate = |result| AtomicResponse::new(Box::pin(actix::fut::ready(result)));
        let rank = self.shared.comm.rank();
        // NC-7: after an abort nothing touches the communicator.
        if let Some(aborted) = self.shared.supervision.aborted() {
            return immediate(Err(aborted.into()));
        }
        if let Some(reason) = &self.broken {
            return immediate(Err(NcclOpError::Broken {
                rank,
                reason: reason.clone(),
            }));
        }
        let world = self.shared.comm.world();
        if let Err(source) = msg
            .op
            .check(world, rank, msg.input.as_ref().map(DeviceBuffer::len), msg.output.len())
        {
            return immediate(Err(NcclOpError::Invalid { rank, source }));
        }
        let operation = format!("{} #{}", msg.op, self.seq);
        self.seq += 1;
        let numbered = match (msg.op.is_p2p(), msg.op.root) {
            (true, Some(peer)) => self.transfers.entry((msg.op.kind, peer)).or_default(),
            _ => &mut self.collectives,
        };
        let entry = {
            let mut flight = self.shared.flight();
            let op = &msg.op;
            let recorded = FlightOp::new(op.kind, op.dtype, op.count, op.root, op.reduce_op());
            let entry = flight.record_scheduled(*numbered, recorded, SystemTime::now());
            flight.record_started(entry, SystemTime::now());
            entry
        };
        *numbered += 1;
        let timeout = msg.timeout.unwrap_or(self.timeout);
        let started = Instant::now();
        let deadline = started + timeout;
        *self.shared.in_flight() = Some(InFlight {
            what: operation.clone(),
            started,
            deadline,
        });
        let shared = self.shared.clone();
        let caller_deadline = self.caller_deadline().then_some(deadline);
        let run = async move { execute(&shared, msg, caller_deadline).await };
        AtomicResponse::new(Box::pin(run.into_actor(self).map(move |result, actor, _| {
            *actor.shared.in_flight() = None;
            let result = result.map_err(|failure| actor.fail(failure, operation, timeout, started.elapsed()));
            let mut flight = actor.shared.flight();
            match &result {
                Ok(_) => flight.record_completed(entry, SystemTime::now()),
                Err(error) => flight.record_failed(entry, SystemTime::now(), error.to_string()),
            }
            result
        })))
    }
}

/// Runs one operation (NC-5): launch, wait until the communicator has taken
/// it in (a non-blocking launch may still be enqueuing), record an event,
/// and wait for it, watching for an abort, an asynchronous error and, where
/// the caller enforces it, the deadline.
async fn execute<C: Communicator>(
    shared: &Shared<C>,
    msg: NcclCollective<C::Buffer>,
    deadline: Option<Instant>,
) -> Result<Buffers<C::Buffer>, Failure> {
    let comm = &shared.comm;
    let mut abort = shared.supervision.subscribe();
    let NcclCollective {
        op, input, mut output, ..
    } = msg;
    comm.launch(&op, input.as_ref(), &mut output).map_err(Failure::Nccl)?;
    wait(&mut abort, deadline, || Ok(comm.status()? == CommStatus::Ready)).await?;
    let event = comm.record().map_err(Failure::Nccl)?;
    // The status too: after an asynchronous error (a peer died) the event never completes.
    wait(&mut abort, deadline, || {
        comm.status()?;
        comm.query(&event)
    })
    .await?;
    // Both buffers stay here until the work that uses them has completed.
    Ok(Buffers { input, output })
}

async fn wait(
    abort: &mut watch::Receiver<Option<GroupAborted>>,
    deadline: Option<Instant>,
    mut done: impl FnMut() -> Result<bool, NcclError>,
) -> Result<(), Failure> {
    let started = Instant::now();
    loop {
        if let Some(aborted) = abort.borrow_and_update().clone() {
            return Err(Failure::Aborted(aborted));
        }
        if done().map_err(Failure::Nccl)? {
            return Ok(());
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(Failure::TimedOut);
        }
        if started.elapsed() < SPIN {
            tokio::task::yield_now().await;
        } else {
            tokio::select! {
                () = tokio::time::sleep(POLL) => {}
                // The sender lives in the supervision this future's owner holds.
                _ = abort.changed() => {}
            }
        }
    }
}

/// What one poll of the watchdog decides (NC-6), as a pure function: an
/// asynchronous error, or an operation past its deadline (plus `grace`).
fn verdict(
    status: Result<CommStatus, NcclError>,
    in_flight: Option<&InFlight>,
    grace: Duration,
    now: Instant,
) -> Option<AbortReason> {
    if let Err(e) = status {
        return Some(AbortReason::OperationFailed(format!("ncclCommGetAsyncError: {e}")));
    }
    let op = in_flight?;
    (now >= op.deadline + grace).then(|| AbortReason::Overdue {
        operation: op.what.clone(),
        ran: now.saturating_duration_since(op.started),
    })
}

/// The watchdog: a thread of its own, so a rank thread stuck in a driver
/// call does not stop it. Ends at the abort, or when `stop` is set.
fn spawn_watchdog<C: Communicator>(
    shared: Arc<Shared<C>>,
    config: NcclGroupConfig,
    stop: Arc<AtomicBool>,
) -> std::io::Result<()> {
    let rank = shared.comm.rank();
    let grace = match config.mode {
        ErrorHandling::BlockingWait | ErrorHandling::Off => config.overdue_grace,
        _ => Duration::ZERO,
    };
    std::thread::Builder::new()
        .name(format!("chorus-nccl-watchdog-{rank}"))
        .spawn(move || {
            let mut logged: Option<String> = None;
            while !stop.load(Ordering::Relaxed) && shared.supervision.aborted().is_none() {
                std::thread::sleep(config.watchdog_poll);
                let in_flight = shared.in_flight().clone();
                let Some(reason) = verdict(shared.comm.status(), in_flight.as_ref(), grace, Instant::now()) else {
                    continue;
                };
                if shared.mode.aborts() {
                    shared.abort(reason);
                } else if logged.as_deref() != Some(&reason.to_string()) {
                    // NC-10: off mode only says so, once per reason.
                    tracing::error!(rank, "{reason} (async error handling is off: not aborting)");
                    logged = Some(reason.to_string());
                }
            }
        })
        .map(drop)
}

/// One rank of a supervised NCCL group: its actor, on an arbiter of its
/// own, and its watchdog. Dropping it stops both; the communicator is
/// aborted (freed) once neither holds it.
pub struct NcclGroup<C: Communicator> {
    addr: Addr<NcclRankActor<C>>,
    shared: Arc<Shared<C>>,
    stop: Arc<AtomicBool>,
    arbiter: Arbiter,
}

impl<C: Communicator> NcclGroup<C> {
    /// Starts the actor and the watchdog of a ready communicator (see
    /// [`init_communicator`](super::init_communicator)).
    pub fn start(comm: C, config: NcclGroupConfig) -> Result<Self, SystemError> {
        let supervision = Arc::new(Supervision::new(
            comm.rank(),
            config.generation,
            config.mode,
            Vec::new(),
        ));
        let shared = Arc::new(Shared {
            comm,
            supervision,
            in_flight: Mutex::new(None),
            mode: config.mode,
            flight: Mutex::new(config.recorder()),
            trace_dir: config.trace_dir(),
            dumped: AtomicBool::new(false),
            generation: config.generation,
        });
        let arbiter = new_arbiter()?;
        let actor = NcclRankActor {
            shared: shared.clone(),
            timeout: config.timeout,
            seq: 0,
            collectives: 0,
            transfers: HashMap::new(),
            broken: None,
        };
        let addr = NcclRankActor::start_in_arbiter(&arbiter.handle(), move |_| actor);
        let stop = Arc::new(AtomicBool::new(false));
        if let Err(e) = spawn_watchdog(shared.clone(), config, stop.clone()) {
            arbiter.stop();
            return Err(SystemError::new(format!("could not start the NCCL watchdog: {e}")));
        }
        Ok(Self {
            addr,
            shared,
            stop,
            arbiter,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.shared.comm.rank()
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.shared.comm.world()
    }

    /// The generation it was formed for.
    pub fn generation(&self) -> u64 {
        self.shared.generation
    }

    /// Queues `collective` now (operations run in the order submitted,
    /// NC-5) and returns its buffers, the result in the output, when awaited.
    pub fn submit(
        &self,
        collective: NcclCollective<C::Buffer>,
    ) -> impl Future<Output = Result<Buffers<C::Buffer>, NcclOpError>> + 'static {
        let request = self.addr.send(collective);
        async move { request.await.unwrap_or(Err(NcclOpError::Stopped)) }
    }

    /// Runs `op` under the group's timeout (`input` `None`: in place) and
    /// returns the output.
    pub async fn run(&self, op: NcclOp, input: Option<C::Buffer>, output: C::Buffer) -> Result<C::Buffer, NcclOpError> {
        let done = self
            .submit(NcclCollective {
                op,
                input,
                output,
                timeout: None,
            })
            .await?;
        Ok(done.output)
    }

    /// Queues a barrier now, like [`submit`](Self::submit): it completes
    /// once every rank has entered. A one-element all-reduce on scratch
    /// memory, as PyTorch's ProcessGroupNCCL runs `barrier`.
    pub fn barrier(&self) -> impl Future<Output = Result<(), NcclOpError>> + 'static {
        let rank = self.rank();
        let op = NcclOp::all_reduce(DType::Float32, 1, ReduceOp::Sum);
        let submitted = self
            .shared
            .comm
            .zeros(op.output_bytes(self.world(), rank))
            .map(|scratch| {
                self.submit(NcclCollective {
                    op,
                    input: None,
                    output: scratch,
                    timeout: None,
                })
            });
        async move {
            match submitted {
                Ok(work) => work.await.map(drop),
                Err(source) => Err(NcclOpError::Failed {
                    rank,
                    operation: "barrier".into(),
                    source,
                }),
            }
        }
    }

    /// A receiver that sees the abort when it happens: the hook an elastic
    /// supervisor re-forms the group from (with a new unique id, NC-3).
    pub fn failures(&self) -> watch::Receiver<Option<GroupAborted>> {
        self.shared.supervision.subscribe()
    }

    /// Aborts the group from the application; whether this call did.
    pub fn abort(&self, reason: &str) -> bool {
        self.shared.abort(AbortReason::OperationFailed(reason.to_owned()))
    }
}

impl<C: Communicator> Drop for NcclGroup<C> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.arbiter.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nccl::code::NcclCode;

    fn op(what: &str, deadline_in: u64, t0: Instant) -> InFlight {
        InFlight {
            what: what.into(),
            started: t0,
            deadline: t0 + Duration::from_secs(deadline_in),
        }
    }

    #[test]
    fn nc6_the_verdict_names_an_async_error_or_an_overdue_operation() {
        let t0 = Instant::now();
        let error = NcclError::Call {
            call: "ncclCommGetAsyncError",
            code: NcclCode::RemoteError,
            detail: String::new(),
        };
        let reason = verdict(Err(error), None, Duration::ZERO, t0).unwrap();
        assert!(reason.to_string().contains("ncclRemoteError"), "{reason}");
        let running = op("all_reduce(float32 x 4, sum) #2", 10, t0);
        let at = |s| t0 + Duration::from_secs(s);
        assert!(verdict(Ok(CommStatus::Ready), Some(&running), Duration::ZERO, at(9)).is_none());
        let overdue = verdict(Ok(CommStatus::Ready), Some(&running), Duration::ZERO, at(10)).unwrap();
        assert!(overdue.to_string().contains("#2 still running"), "{overdue}");
        // Blocking wait: the caller times out first; the watchdog only after the grace.
        assert!(verdict(Ok(CommStatus::Ready), Some(&running), Duration::from_secs(5), at(14)).is_none());
        assert!(verdict(Ok(CommStatus::InProgress), None, Duration::ZERO, at(100)).is_none());
    }
}
