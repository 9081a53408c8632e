//! [`RankActor`]: one rank's actor. It owns the rank's links and runs its
//! operations strictly in submission order, each with a sequence number.
//!
//! Rules:
//! - RA-1: collectives run one at a time, in the order they were submitted
//!   (an `AtomicResponse` holds the mailbox until the running one ends),
//!   each whether or not its submitter still waits for the result
//!   ([`Submit`]).
//! - RA-2: collectives are numbered per group; collective `n` uses channel
//!   `n % COLLECTIVE_CHANNELS`, so consecutive collectives never share a
//!   channel and frames of one are never read by another.
//! - RA-3: point-to-point operations do not take a turn in that order: each
//!   runs as soon as it is submitted, beside the collectives, on channels of
//!   their own numbered per peer, direction and tag (rules PP-1..PP-4 in
//!   [`crate::p2p`]), so ranks that do not take part in them keep the same
//!   collective numbering, and a receive posted before its send cannot
//!   deadlock. Only RA-1's collectives hold the mailbox.
//! - RA-4: after a failure that may have left frames in flight (timeout,
//!   desync, a broken link), the group is broken: later operations fail at
//!   once until it is re-formed. Errors every rank detects alike (a bad root,
//!   an operator the dtype lacks) leave it usable.
//! - RA-5: every operation is recorded in the rank's flight recorder when it
//!   starts and when it ends; when one breaks the group (RA-4) and a trace
//!   directory is set (`CHORUS_TRACE_DIR`), the rank dumps the recorder there
//!   for `chorus trace`.
//! - RA-6: the actor runs under its rank's [`Supervision`]: an operation that
//!   breaks the group aborts it (SV-2), an abort ends the running operation
//!   and fails queued ones at once (SV-1, SV-4), and the recorder is dumped
//!   once per group, whichever path broke it. An operation that failed on a
//!   link once the group is aborted returns the abort, which names the
//!   failed ranks (SV-14); other errors (a timeout, a desync) are returned
//!   as they are.
//!
//! Channels: collectives use `0..COLLECTIVE_CHANNELS` (RA-2), point-to-point
//! the [`P2P_TAGS`](crate::p2p::P2P_TAGS) above them (RA-3), heartbeats
//! [`HEARTBEAT_CHANNEL`](crate::heartbeat::HEARTBEAT_CHANNEL)
//! (`u32::MAX - 1`); the rest are free for users of raw links.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use actix::{
    Actor, ActorFutureExt, AsyncContext, AtomicResponse, Context, Handler, Message, ResponseActFuture, WrapFuture,
};
use bytes::Bytes;
use chorus_runtime::collective::Region;
use chorus_runtime::collective::{
    Action, Algorithm, CollectiveKind, DType, Overrides, Plan, PlanCache, PlanError, ReduceError, ReduceOp, Signature,
    Spec, choose_algorithm,
};
use chorus_runtime::flight::{EntryId, FlightRecorder, write_dump};
use chorus_transports::link::{ChannelId, Link};

use crate::buffer::Buffer;
use tracing::Instrument;

use crate::driver::{self, CollectiveError, FramePool, Job, SIGNATURE_TAG};
use crate::lend::LentOutput;
use crate::metrics::{GroupMetrics, transport_index};
use crate::p2p::{Lane, Lanes, Turn, Way, check_sender, first_sender, p2p_channel};
use crate::supervision::{AbortReason, ErrorHandling, Supervision};

/// Channels collectives rotate through (RA-2).
pub const COLLECTIVE_CHANNELS: u32 = 64;
/// Worlds up to this size check every rank's signature on every
/// collective, so each rank of a desync names it. Larger ones check along
/// the plan's own edges and a ring of neighbours (rank r announces to
/// r + 1 before anything else): some rank still finds any desync and
/// aborts the group, no data is used before its sender's signature is
/// checked, and a collective costs what its algorithm does instead of n^2
/// frames. Along the plan's edges a small payload carries the signature
/// (`Job::sign_data`), so a small collective sends one frame per edge.
pub const FULL_SIGNATURE_CHECK: usize = 16;

/// Plans an actor keeps for repeated calls ([`PlanCache`]).
const CACHED_PLANS: usize = 32;
/// Plans of more steps are not kept: building them costs little next to
/// the data they move, and a large world's 1 MiB ring plan is hundreds of
/// KiB per rank.
const CACHED_PLAN_STEPS: usize = 256;

/// A plan and what the actor derives from it, kept between calls.
struct Prepared {
    plan: Plan,
    /// Payload bytes sent and received per transport ([`plan_bytes`]).
    bytes: ([u64; 3], [u64; 3]),
}

/// One operation, as submitted: buffers are moved in and the output is
/// handed back.
#[derive(Debug)]
pub struct Collective {
    /// Which collective.
    pub kind: CollectiveKind,
    /// The element type.
    pub dtype: DType,
    /// Elements per rank (see `CollectiveKind` for each buffer's length).
    pub count: usize,
    /// The root, or the peer of a send or receive.
    pub root: Option<usize>,
    /// The operator, for reducing collectives.
    pub op: Option<ReduceOp>,
    /// The read-only input (empty for in-place collectives).
    pub input: Bytes,
    /// The output buffer, returned with the result.
    pub output: Buffer,
    /// Overrides the group's timeout for this operation.
    pub timeout: Option<Duration>,
    /// A send's or receive's tag: a receive takes the messages its peer
    /// sent with the same tag (RA-3).
    pub tag: u64,
}

/// Sequence number, channel, ranks to announce to, ranks to check.
type Placement = (u64, ChannelId, Vec<usize>, Vec<usize>);

/// A collective the actor admitted: numbered, placed and planned.
struct Admitted {
    placement: Placement,
    signature: Signature,
    /// The bytes its spec moves, for its span.
    bytes: usize,
    algorithm: Algorithm,
    prepared: Arc<Prepared>,
}

/// One rank's actor.
pub struct RankActor {
    rank: usize,
    world: usize,
    links: Arc<Vec<Option<Arc<dyn Link>>>>,
    timeout: Duration,
    overrides: Overrides,
    seq: u64,
    lanes: Lanes,
    broken: Option<String>,
    pool: FramePool,
    /// Shared with the point-to-point operations running beside the actor.
    flight: Arc<Mutex<FlightRecorder>>,
    trace_dir: Option<PathBuf>,
    generation: u64,
    supervision: Arc<Supervision>,
    dumped: bool,
    /// Turned true once the group broke and the recorder was dumped.
    dump_notice: Option<tokio::sync::watch::Sender<bool>>,
    /// Registered once, so an operation only adds to its handles.
    metrics: Option<Arc<GroupMetrics>>,
    plans: PlanCache<Prepared>,
}

/// Tells the actor its group was aborted from outside an operation (by the
/// watchdog), so it dumps its recorder (RA-6).
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Aborted;

impl RankActor {
    /// An actor for `rank` of `links.len()` ranks, under `supervision`.
    pub fn new(
        rank: usize,
        links: Vec<Option<Arc<dyn Link>>>,
        timeout: Duration,
        overrides: Overrides,
        supervision: Arc<Supervision>,
    ) -> Self {
        Self {
            rank,
            world: links.len(),
            links: Arc::new(links),
            timeout,
            overrides,
            seq: 0,
            lanes: Lanes::default(),
            broken: None,
            pool: FramePool::default(),
            flight: Arc::new(Mutex::new(FlightRecorder::new(0))),
            trace_dir: None,
            generation: 0,
            supervision,
            dumped: false,
            dump_notice: None,
            metrics: None,
            plans: PlanCache::new(CACHED_PLANS),
        }
    }

    /// Takes frame buffers from `pool`, which other ranks may share (ranks
    /// sharing a process's threads share one, so its bound holds per
    /// process, not per rank).
    pub fn with_frame_pool(mut self, pool: FramePool) -> Self {
        self.pool = pool;
        self
    }

    /// Counts operations, their time and bytes in `metrics` (see
    /// [`crate::metrics`]).
    pub fn with_metrics(mut self, metrics: Arc<GroupMetrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Records operations in `flight` (RA-5) and, when `trace_dir` is set,
    /// dumps it there once the group breaks.
    pub fn with_flight_recorder(mut self, flight: FlightRecorder, trace_dir: Option<PathBuf>, generation: u64) -> Self {
        self.flight = Arc::new(Mutex::new(flight));
        self.trace_dir = trace_dir;
        self.generation = generation;
        self
    }

    /// Turns `notice` true once the group broke and the recorder was dumped,
    /// for a process that must not exit before (a SIGTERM that aborts it).
    pub fn with_dump_notice(mut self, notice: tokio::sync::watch::Sender<bool>) -> Self {
        self.dump_notice = Some(notice);
        self
    }

    /// The group broke (RA-4, RA-6): dump the recorder once, and in
    /// tear-down mode leave the process.
    fn broke(&mut self, reason: &str) {
        if !std::mem::replace(&mut self.dumped, true) {
            self.dump_flight_recorder(reason);
        }
        if let Some(notice) = &self.dump_notice {
            notice.send_replace(true);
        }
        if self.supervision.mode() == ErrorHandling::TearDown {
            eprintln!(
                "chorus: rank {}: {reason}; exiting (async error handling 3: tear down)",
                self.rank
            );
            std::process::exit(1);
        }
    }

    fn dump_flight_recorder(&self, reason: &str) {
        let Some(dir) = &self.trace_dir else {
            return;
        };
        let dump = lock(&self.flight).dump(self.rank, self.world, self.generation, reason, SystemTime::now());
        match write_dump(dir, &dump) {
            Ok(path) => {
                tracing::error!(rank = self.rank, path = %path.display(), "flight recorder dumped; run `chorus trace {}`", dir.display())
            }
            Err(e) => {
                tracing::error!(rank = self.rank, dir = %dir.display(), error = %e, "could not dump the flight recorder")
            }
        }
    }

    /// Numbers the operation and picks its channel, the ranks it announces
    /// its signature to and the ranks whose signatures it checks.
    fn place(&mut self) -> Placement {
        self.seq += 1;
        let seq = self.seq - 1;
        let channel = (seq % u64::from(COLLECTIVE_CHANNELS)) as ChannelId;
        if self.world > FULL_SIGNATURE_CHECK {
            // A ring of neighbours; the driver adds the plan's
            // edges (`Job::sign_data`).
            let (next, previous) = ((self.rank + 1) % self.world, (self.rank + self.world - 1) % self.world);
            return (seq, channel, vec![next], vec![previous]);
        }
        let others: Vec<usize> = (0..self.world).filter(|&r| r != self.rank).collect();
        (seq, channel, others.clone(), others)
    }
}

impl Actor for RankActor {
    type Context = Context<Self>;
}

/// Submits a collective whose result goes to `reply`. Sent with `do_send`,
/// so it runs when its turn comes even if the caller dropped its receiver
/// (RA-1): a collective is the ranks' joint act, and one rank skipping it
/// would put every later one out of step. (An actix request whose
/// receiver is gone is skipped, which is why collectives do not go as
/// requests.)
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Submit {
    /// The operation.
    pub op: Collective,
    /// Where its result goes; nobody listening is fine.
    pub reply: tokio::sync::oneshot::Sender<Result<Completed, CollectiveError>>,
}

/// What a finished operation hands back.
#[derive(Debug)]
pub struct Completed {
    /// The output buffer.
    pub output: Buffer,
    /// The rank a receive took its message from (known only once it ran,
    /// for a receive from any source); `None` for other operations.
    pub peer: Option<usize>,
}

impl Handler<Submit> for RankActor {
    type Result = AtomicResponse<Self, ()>;

    fn handle(&mut self, msg: Submit, ctx: &mut Context<Self>) -> Self::Result {
        if matches!(msg.op.kind, CollectiveKind::Send | CollectiveKind::Recv) {
            // RA-3: it runs beside the actor; the mailbox goes on at once.
            self.start_p2p(msg.op, msg.reply, ctx);
            return AtomicResponse::new(Box::pin(actix::fut::ready(())));
        }
        let reply = msg.reply;
        AtomicResponse::new(Box::pin(self.start(msg.op).map(move |result, _, _| {
            // A dropped Work: the operation ran all the same; its result goes nowhere.
            let _ = reply.send(result.map(|output| Completed { output, peer: None }));
        })))
    }
}

impl RankActor {
    /// Runs `msg` next: the future ends when the collective does.
    fn start(&mut self, msg: Collective) -> ResponseActFuture<Self, Result<Buffer, CollectiveError>> {
        if let Some(metrics) = &self.metrics {
            metrics.op(msg.kind).started.increment(1);
        }
        match self.admit(&msg) {
            Ok(admitted) => self.launch(msg, admitted),
            Err(error) => {
                if let Some(metrics) = &self.metrics {
                    metrics.op(msg.kind).failed.increment(1);
                }
                Box::pin(actix::fut::ready(Err(error)))
            }
        }
    }

    /// Refuses `msg` when the group is broken or aborted or its operator
    /// does not apply to its type; otherwise numbers, places and plans it.
    fn admit(&mut self, msg: &Collective) -> Result<Admitted, CollectiveError> {
        if let Some(reason) = &self.broken {
            return Err(CollectiveError::Broken(reason.clone()));
        }
        if let Some(aborted) = self.supervision.aborted() {
            return Err(aborted.into());
        }
        if let (true, Some(op)) = (msg.kind.reduces(), msg.op)
            && !op.supports(msg.dtype)
        {
            return Err(ReduceError::Unsupported { op, dtype: msg.dtype }.into());
        }
        let placement = self.place();
        let signature = Signature {
            seq: placement.0,
            kind: msg.kind,
            dtype: msg.dtype,
            count: msg.count,
            root: msg.root,
            reduce_op: if msg.kind.reduces() {
                msg.op.or(Some(ReduceOp::Sum))
            } else {
                None
            },
        };
        let spec = Spec {
            kind: msg.kind,
            dtype: msg.dtype,
            count: msg.count,
            root: msg.root,
            world: self.world,
        };
        let algorithm = choose_algorithm(msg.kind, spec.bytes(), self.world, &self.overrides);
        // A reducing collective given an input runs out of place on it.
        let out_of_place = msg.kind.reduces() && !msg.input.is_empty();
        let prepared = self.prepared(spec, algorithm, out_of_place)?;
        Ok(Admitted {
            placement,
            signature,
            bytes: spec.bytes(),
            algorithm,
            prepared,
        })
    }

    /// The plan of `spec` by `algorithm`, from the cache or made (and
    /// cached unless large).
    fn prepared(&mut self, spec: Spec, algorithm: Algorithm, out_of_place: bool) -> Result<Arc<Prepared>, PlanError> {
        let key = (spec, self.rank, algorithm, out_of_place);
        if let Some(prepared) = self.plans.get(&key) {
            return Ok(prepared);
        }
        let plan = match out_of_place {
            true => spec.plan_out_of_place(self.rank, algorithm),
            false => spec.plan(self.rank, algorithm),
        }?;
        let bytes = plan_bytes(&plan, &self.links, spec.dtype.size());
        let prepared = Prepared { plan, bytes };
        Ok(match prepared.plan.steps().len() <= CACHED_PLAN_STEPS {
            true => self.plans.insert(key, prepared),
            false => Arc::new(prepared),
        })
    }

    /// Records `msg` as started and runs its plan on its links; the future
    /// settles the result on the actor (metrics, recorder, breakage).
    fn launch(
        &mut self,
        msg: Collective,
        admitted: Admitted,
    ) -> ResponseActFuture<Self, Result<Buffer, CollectiveError>> {
        let Admitted {
            placement: (seq, channel, announce_to, check_from),
            signature,
            bytes: spec_bytes,
            algorithm,
            prepared,
        } = admitted;
        let sign_data = self.world > FULL_SIGNATURE_CHECK;
        let entry = {
            let mut flight = lock(&self.flight);
            let entry = flight.record_signature(seq, &signature, SystemTime::now());
            flight.record_started(entry, SystemTime::now());
            entry
        };
        let (rank, links, timeout) = (self.rank, self.links.clone(), msg.timeout.unwrap_or(self.timeout));
        // Peers in this process may read its regions in place (`lend`).
        let mut output = LentOutput::new(msg.output);
        let lender = output.lender();
        let input = msg.input;
        let pool = self.pool.clone();
        let abort = self.supervision.subscribe();
        let span = tracing::info_span!(
            "collective",
            rank,
            group = self.metrics.as_deref().map_or("", GroupMetrics::group),
            seq,
            op = msg.kind.name(),
            bytes = spec_bytes,
            algorithm = ?algorithm,
        );
        let bytes = self.metrics.as_ref().map(|_| prepared.bytes);
        let (kind, began) = (msg.kind, std::time::Instant::now());
        self.supervision.started(signature, began + timeout);
        let run = async move {
            driver::run(Job {
                rank,
                links: &links,
                channel,
                signature,
                plan: &prepared.plan,
                announce_to,
                check_from,
                sign_data,
                input,
                output: output.as_mut_slice().expect("nothing is lent before the driver runs"),
                timeout,
                pool: &pool,
                lender: Some(lender),
                abort,
            })
            .await?;
            // The driver returns only once every lent view is released.
            output
                .into_inner()
                .ok_or_else(|| CollectiveError::Broken("a peer still reads the output".into()))
        }
        .instrument(span);
        Box::pin(run.into_actor(self).map(move |result, actor, _| {
            actor.supervision.finished();
            record_metrics(actor.metrics.as_deref(), kind, began, bytes, result.is_ok());
            record_end(&actor.flight, entry, &result);
            result.map_err(|e| {
                let (e, breakage) = settle_failure(&actor.supervision, actor.rank, e);
                actor.apply(breakage);
                e
            })
        }))
    }

    /// What an operation's failure did to the group, on the actor's side:
    /// the recorder dumped (RA-5), later operations refused (RA-4).
    fn apply(&mut self, breakage: Breakage) {
        match breakage {
            Breakage::None => {}
            Breakage::Aborted(reason) => self.broke(&reason),
            Breakage::Broken(reason) => {
                self.broken = Some(reason.clone());
                self.broke(&reason);
            }
        }
    }

    /// Starts a send or receive beside the actor (RA-3): it waits for its
    /// lane's turn (PP-1, PP-3), then runs the plan on its own task and
    /// replies from there, so neither a running collective nor a receive
    /// still waiting holds it up.
    fn start_p2p(
        &mut self,
        msg: Collective,
        reply: tokio::sync::oneshot::Sender<Result<Completed, CollectiveError>>,
        ctx: &mut Context<Self>,
    ) {
        let metrics = self.metrics.clone();
        if let Some(metrics) = &metrics {
            metrics.op(msg.kind).started.increment(1);
        }
        let (peers, channel, way, turn) = match self.queue_p2p(&msg) {
            Ok(queued) => queued,
            Err(error) => {
                record_metrics(metrics.as_deref(), msg.kind, std::time::Instant::now(), None, false);
                let _ = reply.send(Err(error));
                return;
            }
        };
        let context = P2pContext {
            rank: self.rank,
            world: self.world,
            links: self.links.clone(),
            timeout: msg.timeout.unwrap_or(self.timeout),
            pool: self.pool.clone(),
            supervision: self.supervision.clone(),
            flight: self.flight.clone(),
            metrics,
            actor: ctx.address(),
        };
        actix::spawn(context.run(msg, peers, channel, way, turn, reply));
    }

    /// Checks a send or receive and queues it on its lanes: its peers (all
    /// others for a receive from any source), channel, direction and turn.
    fn queue_p2p(&mut self, msg: &Collective) -> Result<(Vec<usize>, ChannelId, Way, Turn), CollectiveError> {
        if let Some(reason) = &self.broken {
            return Err(CollectiveError::Broken(reason.clone()));
        }
        if let Some(aborted) = self.supervision.aborted() {
            return Err(aborted.into());
        }
        let (rank, world, kind) = (self.rank, self.world, msg.kind);
        let peers: Vec<usize> = match (kind, msg.root) {
            (_, Some(peer)) => {
                // A bad peer is refused here, as every rank would refuse it.
                let spec = Spec {
                    kind,
                    dtype: msg.dtype,
                    count: msg.count,
                    root: Some(peer),
                    world,
                };
                spec.plan(rank, Algorithm::Direct)?;
                vec![peer]
            }
            // A receive from any source (PP-3).
            (CollectiveKind::Recv, None) => (0..world).filter(|&r| r != rank).collect(),
            (_, None) => {
                return Err(PlanError::Root {
                    kind,
                    root: None,
                    world,
                }
                .into());
            }
        };
        let channel = p2p_channel(msg.tag);
        let way = if kind == CollectiveKind::Send {
            Way::Out
        } else {
            Way::In
        };
        let lanes: Vec<Lane> = peers.iter().map(|&peer| (way, peer, channel)).collect();
        Ok((peers, channel, way, self.lanes.enqueue(&lanes)))
    }
}

/// What a point-to-point task needs of its rank.
struct P2pContext {
    rank: usize,
    world: usize,
    links: Arc<Vec<Option<Arc<dyn Link>>>>,
    timeout: Duration,
    pool: FramePool,
    supervision: Arc<Supervision>,
    flight: Arc<Mutex<FlightRecorder>>,
    metrics: Option<Arc<GroupMetrics>>,
    actor: actix::Addr<RankActor>,
}

impl P2pContext {
    /// Runs one send or receive once its turn comes, and replies.
    async fn run(
        self,
        msg: Collective,
        peers: Vec<usize>,
        channel: ChannelId,
        way: Way,
        mut turn: Turn,
        reply: tokio::sync::oneshot::Sender<Result<Completed, CollectiveError>>,
    ) {
        turn.wait().await;
        let (kind, began) = (msg.kind, std::time::Instant::now());
        let deadline = tokio::time::Instant::now() + self.timeout;
        let result = self.transfer(msg, &peers, channel, way, &turn, deadline).await;
        let result = match result {
            Ok((completed, bytes)) => {
                record_metrics(self.metrics.as_deref(), kind, began, Some(bytes), true);
                Ok(completed)
            }
            Err(e) => {
                record_metrics(self.metrics.as_deref(), kind, began, None, false);
                let (e, breakage) = settle_failure(&self.supervision, self.rank, e);
                self.actor.do_send(Broke(breakage));
                Err(e)
            }
        };
        // The turn ends (dropped) after the reply: a later operation of the
        // lane cannot overtake this one's result.
        let _ = reply.send(result);
        drop(turn);
    }

    /// The send or receive itself: the sender found (a receive from any
    /// source), its plan, the driver. Returns the output and the bytes moved.
    async fn transfer(
        &self,
        msg: Collective,
        peers: &[usize],
        channel: ChannelId,
        way: Way,
        turn: &Turn,
        deadline: tokio::time::Instant,
    ) -> Result<(Completed, ([u64; 3], [u64; 3])), CollectiveError> {
        let mut signature = Signature {
            seq: 0,
            kind: msg.kind,
            dtype: msg.dtype,
            count: msg.count,
            root: msg.root,
            reduce_op: None,
        };
        let abort = self.supervision.subscribe();
        let (peer, checked) = match msg.root {
            Some(peer) => (peer, false),
            None => {
                let waited = deadline.saturating_duration_since(tokio::time::Instant::now());
                let found = first_sender(
                    &self.links,
                    peers,
                    channel,
                    (signature, self.rank, waited),
                    abort.clone(),
                );
                let (peer, frame) = found.await?;
                signature.seq = turn.number((way, peer, channel));
                signature.root = Some(peer);
                if frame.tag != SIGNATURE_TAG {
                    return Err(CollectiveError::Protocol {
                        peer,
                        reason: "a message arrived without its sender's signature".into(),
                    });
                }
                check_sender(&signature, self.rank, peer, &frame.payload)?;
                (peer, true)
            }
        };
        if !checked {
            signature.seq = turn.number((way, peer, channel));
        }
        let spec = Spec {
            kind: msg.kind,
            dtype: msg.dtype,
            count: msg.count,
            root: Some(peer),
            world: self.world,
        };
        let plan = spec.plan(self.rank, Algorithm::Direct)?;
        let bytes = plan_bytes(&plan, &self.links, msg.dtype.size());
        let entry = {
            let mut flight = lock(&self.flight);
            let entry = flight.record_signature(signature.seq, &signature, SystemTime::now());
            flight.record_started(entry, SystemTime::now());
            entry
        };
        let mut output = LentOutput::new(msg.output);
        let lender = output.lender();
        let (announce_to, check_from) = match (way, checked) {
            (Way::Out, _) => (vec![peer], vec![]),
            (Way::In, false) => (vec![], vec![peer]),
            (Way::In, true) => (vec![], vec![]),
        };
        let ran = driver::run(Job {
            rank: self.rank,
            links: &self.links,
            channel,
            signature,
            plan: &plan,
            announce_to,
            check_from,
            sign_data: false,
            input: msg.input,
            output: output.as_mut_slice().expect("nothing is lent before the driver runs"),
            timeout: deadline.saturating_duration_since(tokio::time::Instant::now()),
            pool: &self.pool,
            lender: Some(lender),
            abort,
        })
        .await;
        let result = ran.and_then(|()| {
            output
                .into_inner()
                .ok_or_else(|| CollectiveError::Broken("a peer still reads the output".into()))
        });
        record_end(&self.flight, entry, &result);
        result.map(|output| {
            let peer = Some(peer);
            (Completed { output, peer }, bytes)
        })
    }
}

/// A point-to-point operation's failure, for the actor to apply (RA-4).
#[derive(Debug, Message)]
#[rtype(result = "()")]
struct Broke(Breakage);

impl Handler<Broke> for RankActor {
    type Result = ();

    fn handle(&mut self, msg: Broke, _ctx: &mut Context<Self>) {
        self.apply(msg.0);
    }
}

/// What a failed operation did to the group.
#[derive(Debug)]
enum Breakage {
    /// Nothing: every rank refuses such a call alike (a buffer of the
    /// wrong size).
    None,
    /// The group was aborted (later operations see the abort, SV-4).
    Aborted(String),
    /// The group is broken until re-formed (RA-4).
    Broken(String),
}

/// Settles a failed operation with the group's supervision: aborts the
/// group where the mode says so (RA-6). Returns the error its caller
/// sees (a link error becomes the abort, which names who failed) and what
/// the actor must apply.
fn settle_failure(supervision: &Supervision, rank: usize, e: CollectiveError) -> (CollectiveError, Breakage) {
    match e {
        CollectiveError::BufferSize { .. } => (e, Breakage::None),
        CollectiveError::GroupAborted(ref aborted) => {
            let reason = aborted.to_string();
            (e, Breakage::Aborted(reason))
        }
        e => {
            tracing::error!(rank, error = %e, "operation failed; the group is broken until re-formed");
            let reason = e.to_string();
            if supervision.mode().aborts() {
                supervision.abort(AbortReason::OperationFailed(reason.clone()), failed_ranks(&e));
            }
            let e = match (&e, supervision.aborted()) {
                (CollectiveError::Transport(_), Some(aborted)) => aborted.into(),
                _ => e,
            };
            (e, Breakage::Broken(reason))
        }
    }
}

/// Counts an ended operation in `metrics`: its time and bytes when it
/// succeeded.
fn record_metrics(
    metrics: Option<&GroupMetrics>,
    kind: CollectiveKind,
    began: std::time::Instant,
    bytes: Option<([u64; 3], [u64; 3])>,
    ok: bool,
) {
    let Some(metrics) = metrics else {
        return;
    };
    let op = metrics.op(kind);
    if !ok {
        op.failed.increment(1);
        return;
    }
    op.completed.increment(1);
    op.duration.record(began.elapsed().as_secs_f64());
    if let Some((sent, received)) = bytes {
        for (i, (to, from)) in metrics.all_bytes().iter().enumerate() {
            to.increment(sent[i]);
            from.increment(received[i]);
        }
    }
}

/// Records an operation's end in the flight recorder (RA-5).
fn record_end<T>(flight: &Mutex<FlightRecorder>, entry: EntryId, result: &Result<T, CollectiveError>) {
    let mut flight = lock(flight);
    match result {
        Ok(_) => flight.record_completed(entry, SystemTime::now()),
        Err(e) => {
            let waiting_for = match e {
                CollectiveError::Timeout { waiting_for, .. } => waiting_for.clone(),
                _ => Vec::new(),
            };
            flight.record_timed_out(entry, SystemTime::now(), e.to_string(), waiting_for);
        }
    }
}

/// The recorder, whoever panicked holding it (it holds plain records).
fn lock(flight: &Mutex<FlightRecorder>) -> std::sync::MutexGuard<'_, FlightRecorder> {
    flight.lock().unwrap_or_else(|p| p.into_inner())
}

/// Does nothing: answered once every operation queued before it has
/// ended (RA-1), so a rank leaving can wait for its queue to drain.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Drain;

impl Handler<Drain> for RankActor {
    type Result = ();

    fn handle(&mut self, _: Drain, _ctx: &mut Context<Self>) {}
}

impl Handler<Aborted> for RankActor {
    type Result = ();

    fn handle(&mut self, _: Aborted, _ctx: &mut Context<Self>) {
        if let Some(aborted) = self.supervision.aborted() {
            self.broke(&aborted.to_string());
        }
    }
}

/// Payload bytes `plan` sends and receives, per transport
/// ([`transport_index`]): a walk over its steps, no allocation.
fn plan_bytes(plan: &Plan, links: &[Option<Arc<dyn Link>>], element: usize) -> ([u64; 3], [u64; 3]) {
    let (mut sent, mut received) = ([0u64; 3], [0u64; 3]);
    let transport = |peer: usize| {
        links
            .get(peer)
            .and_then(Option::as_ref)
            .map(|l| transport_index(l.kind()))
    };
    for step in plan.steps() {
        match &step.action {
            Action::Send { to, src, .. } => {
                if let Some(t) = transport(*to) {
                    let (Region::Input(r) | Region::Output(r)) = src;
                    sent[t] += (r.len() * element) as u64;
                }
            }
            Action::Recv { from, dst, .. } => {
                if let Some(t) = transport(*from) {
                    received[t] += (dst.len() * element) as u64;
                }
            }
            Action::Copy { .. } => {}
        }
    }
    (sent, received)
}

/// The ranks an operation's error blames, for the abort it causes: a peer
/// that closed its link on purpose is not one of them, the ranks it blamed
/// are (SV-14).
fn failed_ranks(error: &CollectiveError) -> Vec<usize> {
    match error {
        CollectiveError::Timeout { waiting_for, .. } => waiting_for.clone(),
        CollectiveError::Transport(e) => match e {
            chorus_transports::link::TransportError::PeerClosed { failed, .. } => failed.clone(),
            chorus_transports::link::TransportError::Closed { peer, .. }
            | chorus_transports::link::TransportError::FrameTooLarge { peer, .. }
            | chorus_transports::link::TransportError::Protocol { peer, .. }
            | chorus_transports::link::TransportError::Connect { peer, .. } => vec![*peer],
        },
        CollectiveError::Protocol { peer, .. } if *peer != usize::MAX => vec![*peer],
        _ => Vec::new(),
    }
}
