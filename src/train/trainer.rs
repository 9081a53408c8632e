//! The elastic training loop: steps that count only when every member's
//! sync succeeded (per-step commit), recovery by state transfer from the
//! most advanced survivors, and three ways to keep replicas together
//! ([`Mode`]).
//!
//! One step of [`train`]:
//! 1. the [`Job`] computes the gradients of its share of the step's global
//!    batch into the [`DistributedSync`]'s views and marks them ready (in
//!    [`Mode::Ddp`] the buckets are summed over the members while it
//!    computes; in the local modes nothing moves);
//! 2. `finish()`, then the commit vote: one all-reduce of
//!    `[succeeded, failed for good, loss]` over the members;
//! 3. only when every member succeeded does [`Job::apply`] run (the
//!    optimizer) and the committed step advance.
//!
//! On a collective error (the group aborted: a member died, froze or was
//! cut off) nothing is applied: the loop waits for the next generation,
//! calls [`sync_state`] with its committed progress so that joiners and any
//! member behind (a vote that completed on some members and not on others)
//! take the state of the most advanced survivors (never rolled back), and
//! re-runs the step. Each recovery is logged with its phases and returned
//! in the [`TrainReport`].
//!
//! The global batch stays fixed when the world size changes: in DDP each
//! member writes the sum of its samples' gradients times
//! [`Step::grad_scale`] (`1 / global batch`) and the buckets are summed, so
//! the update does not depend on how many members shared the batch.
//!
//! In the local modes every local step commits the same way, and an outer
//! sync (every `every` steps) is a unit of progress of its own: the
//! progress handed to [`sync_state`] is `committed steps + outer syncs`, so
//! a member that applied an outer sync its peers did not is ahead of them
//! and is the one they copy. The outer state (anchor parameters, outer
//! momentum) is part of the transferred state.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use chorus_runtime::collective::{DType, ReduceOp};
use thiserror::Error;

use super::guard::{Check, Guard};
use super::integrity::{IntegrityOptions, StateCorruption};
use super::live::Live;
use super::outer::OuterRule;
use super::record::{self, CommitRecord, Recorder};
use super::state::{InPlace, TrainState};
use super::transfer::{TransferError, TransferOptions, sync_state};
use crate::elastic::{ElasticGroup, RestartError};
use crate::group::ProcessGroup;
use crate::sync::{DistributedSync, ParamBuffer, Parameters, SyncError, SyncOptions};
use crate::tensor::Tensor;

/// How replicas are kept together.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// Gradients summed over the members every step (DDP).
    Ddp,
    /// Local optimizer steps; the parameters are averaged every `every` steps.
    LocalSgd {
        /// Steps between averages.
        every: u64,
    },
    /// DiLoCo: local (inner) optimizer steps; every `every` steps the
    /// average drift from the last outer sync takes an outer SGD step with
    /// Nesterov momentum.
    DiLoCo {
        /// Steps between outer syncs.
        every: u64,
        /// Outer learning rate (published default 0.7).
        outer_lr: f32,
        /// Outer momentum (published default 0.9).
        outer_momentum: f32,
        /// Streaming DiLoCo: the parameters in this many fragments, each
        /// synced every `every` steps at staggered steps (fragment `f`
        /// `f * every / fragments` steps after the first), so one outer
        /// sync moves a fraction of the model. 1: all at once.
        fragments: u32,
    },
}

impl Mode {
    /// DiLoCo with the published outer defaults (lr 0.7, momentum 0.9).
    pub fn diloco(every: u64) -> Self {
        Mode::DiLoCo {
            every,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            fragments: 1,
        }
    }

    /// Steps between a fragment's syncs, its rule, and the fragments.
    fn outer(&self) -> Option<(u64, OuterRule, u32)> {
        match *self {
            Mode::Ddp => None,
            Mode::LocalSgd { every } => Some((every.max(1), OuterRule::Average, 1)),
            Mode::DiLoCo {
                every,
                outer_lr,
                outer_momentum,
                fragments,
            } => Some((
                every.max(1),
                OuterRule::Nesterov {
                    lr: outer_lr,
                    momentum: outer_momentum,
                },
                fragments.max(1),
            )),
        }
    }
}

/// What [`train`] runs.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// How replicas are kept together.
    pub mode: Mode,
    /// Steps to commit.
    pub steps: u64,
    /// Samples per step over all members (fixed when the world size changes).
    pub global_batch: usize,
    /// How state moves to joiners.
    pub transfer: TransferOptions,
    /// Gradient buckets' cap in MiB (DDP's 25).
    pub bucket_cap_mb: f64,
    /// Times a step may be voted down by a member's local failure (not a
    /// group failure), or a member's state found corrupt, in a row before
    /// training stops.
    pub max_rejections: u32,
    /// The checks against silent data corruption (DDP).
    pub integrity: IntegrityOptions,
    /// Corruptions to inject (fault injection), besides the
    /// `corrupt(rank=R, step=S, ...)` rules of `CHORUS_FAULTS`.
    pub corruptions: Vec<StateCorruption>,
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            mode: Mode::Ddp,
            steps: 100,
            global_batch: 256,
            transfer: TransferOptions::default(),
            bucket_cap_mb: 25.0,
            max_rejections: 3,
            integrity: IntegrityOptions::default(),
            corruptions: Vec::new(),
        }
    }
}

/// The step a [`Job`] computes.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The committed step it becomes (picks the data and the learning rate).
    pub step: u64,
    /// This member's rank.
    pub rank: usize,
    /// Members now.
    pub world_size: usize,
    /// The group's generation.
    pub generation: u64,
    /// Samples of the step over all members.
    pub global_batch: usize,
    /// Multiply the sum of your samples' gradients by this before writing
    /// it: `1 / global batch` in DDP (the members' sums are added), `1 /
    /// your share` in the local modes (your gradient is the update).
    pub grad_scale: f32,
}

impl Step {
    /// This member's samples: positions within the step's global batch
    /// (contiguous, sizes differing by at most one).
    pub fn shard(&self) -> std::ops::Range<usize> {
        shard(self.global_batch, self.world_size, self.rank)
    }
}

fn shard(global_batch: usize, world_size: usize, rank: usize) -> std::ops::Range<usize> {
    let w = world_size.max(1);
    global_batch * rank / w..global_batch * (rank + 1) / w
}

/// A training program: its state plus how a step is computed and applied.
pub trait Job: TrainState {
    /// Writes the gradients of this member's [`Step::shard`], scaled by
    /// [`Step::grad_scale`], into `grads` (`grad_mut`, then `mark_ready`
    /// for each parameter) and returns the sum of its samples' losses.
    fn backward(&mut self, step: &Step, grads: &mut DistributedSync<'static>) -> Result<f64, String>;
    /// Runs the optimizer with the gradients in `grads` (summed over the
    /// members in DDP). Called once per committed step, never for a step
    /// that was not committed.
    fn apply(&mut self, step: &Step, grads: &DistributedSync<'static>) -> Result<(), String>;
}

/// One committed step, as [`train`] reports it to its observer.
#[derive(Debug, Clone, PartialEq)]
pub struct Committed {
    /// The step (from 0).
    pub step: u64,
    /// Mean loss over the step's global batch (all members).
    pub loss: f64,
    /// Members that computed it.
    pub world_size: usize,
    /// The generation it ran in.
    pub generation: u64,
}

/// One recovery: from the failure seen here to the first committed step
/// of the new generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    /// The generation recovered into.
    pub generation: u64,
    /// Its members.
    pub world_size: usize,
    /// The committed step training resumed from.
    pub resumed_step: u64,
    /// Members that received the state.
    pub receivers: Vec<usize>,
    /// Bytes each received.
    pub bytes: u64,
    /// From the failure seen here to the new generation formed.
    pub rendezvous: Duration,
    /// The state transfer (and setting up the new generation's sync).
    pub transfer: Duration,
    /// From the transfer's end to the first committed step.
    pub first_step: Duration,
    /// When that first step committed (wall clock, to compare with a death
    /// time written by another process).
    pub first_step_at: SystemTime,
}

impl Recovery {
    /// From the failure seen here to the first committed step.
    pub fn total(&self) -> Duration {
        self.rendezvous + self.transfer + self.first_step
    }
}

/// What [`train`] did on this member.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TrainReport {
    /// Committed steps (the same on every member).
    pub steps: u64,
    /// Optimizer updates this process applied ([`Job::apply`] calls).
    pub applied: u64,
    /// Steps this process took over by receiving state instead of applying
    /// them (a joiner's whole past; a member behind a vote). `applied +
    /// adopted == steps` on every member: no step is applied twice.
    pub adopted: u64,
    /// Outer syncs done (local modes).
    pub outer_syncs: u64,
    /// Every recovery this process went through as a survivor.
    pub recoveries: Vec<Recovery>,
    /// Steps voted down by a member's local failure.
    pub rejected: u64,
    /// Corruptions injected into this process (fault injection).
    pub corruptions_injected: u64,
    /// Corruptions found: a member's state outvoted, or its local gradient
    /// an outlier (the same count on every member that saw them).
    pub corruptions_detected: u64,
}

/// Why training stopped.
#[derive(Error)]
pub enum TrainError {
    /// The group's supervisor gave up restarting.
    #[error("the elastic group gave up: {0}")]
    GaveUp(Arc<RestartError>),
    /// The state could not be moved (other than a group failure).
    #[error(transparent)]
    Transfer(TransferError),
    /// The gradient sync failed (other than a group failure).
    #[error(transparent)]
    Sync(SyncError),
    /// The job's `backward` or `apply` failed here.
    #[error("the job failed at step {step}: {reason}")]
    Job {
        /// The step.
        step: u64,
        /// What it said.
        reason: String,
    },
    /// Another member's job failed (it stops with the reason).
    #[error("another member's job failed at step {0}; see its log")]
    PeerFailed(u64),
    /// A step was voted down too often.
    #[error("step {step} was voted down {times} times by a member's local failure; check the members' logs")]
    Rejected {
        /// The step.
        step: u64,
        /// How many times.
        times: u32,
    },
    /// The members' states differ and no majority tells which copy is
    /// right (two members, or a tie): silent data corruption.
    #[error(
        "silent data corruption found before step {step}: the members' states differ ({}), first at '{entry}', and no majority tells which copy is right; training stops",
        fingerprints.iter().map(|(rank, f)| format!("rank {rank}: {f:016x}")).collect::<Vec<_>>().join(", ")
    )]
    Corrupted {
        /// The step about to run.
        step: u64,
        /// The first entry that differs.
        entry: String,
        /// Each rank's state fingerprint.
        fingerprints: Vec<(usize, u64)>,
    },
    /// Members kept disagreeing with the others after being healed.
    #[error(
        "before step {step}, rank(s) {ranks:?} disagreed with the others {times} times in a row, healed each time: a fault that persists (check that host's memory)"
    )]
    Unhealed {
        /// The step.
        step: u64,
        /// The ranks.
        ranks: Vec<usize>,
        /// How many times.
        times: u32,
    },
    /// The local modes average `f32` parameters only.
    #[error("parameter '{0}' is not f32; the local modes average f32 parameters")]
    NotF32(String),
}

chorus_runtime::debug_as_report!(TrainError);

/// Committed progress, carried in the transferred extras.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Progress {
    pub(super) step: u64,
    pub(super) outer_syncs: u64,
}

impl Progress {
    pub(super) fn units(&self) -> u64 {
        self.step + self.outer_syncs
    }
}

/// The local modes' outer state, flat over the parameters.
#[derive(Debug, Default)]
pub(super) struct Outer {
    anchor: Vec<f32>,
    momentum: Vec<f32>,
}

/// The job's state plus the trainer's: what a joiner receives.
pub(super) struct Full<'a, J: ?Sized> {
    pub(super) job: &'a mut J,
    pub(super) outer: &'a mut Outer,
    pub(super) progress: &'a mut Progress,
    /// Set once a transfer wrote into any entry: if the transfer then
    /// breaks, this member's state is a mix and must never be a source.
    pub(super) written: bool,
}

impl<'a, J: ?Sized> Full<'a, J> {
    pub(super) fn new(job: &'a mut J, outer: &'a mut Outer, progress: &'a mut Progress) -> Self {
        Self {
            job,
            outer,
            progress,
            written: false,
        }
    }
}

/// A buffer that reports writes into it (see [`Full::written`]).
struct Tracked<'b> {
    inner: &'b mut dyn ParamBuffer,
    written: &'b mut bool,
}

impl ParamBuffer for Tracked<'_> {
    fn dtype(&self) -> DType {
        self.inner.dtype()
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
    fn read_bytes(&self, offset: usize, out: &mut [u8]) {
        self.inner.read_bytes(offset, out)
    }
    fn write_bytes(&mut self, offset: usize, data: &[u8]) {
        *self.written = true;
        self.inner.write_bytes(offset, data)
    }
    fn as_bytes(&self) -> Option<&[u8]> {
        self.inner.as_bytes()
    }
    fn as_bytes_mut(&mut self) -> Option<&mut [u8]> {
        // Another process may write through it (the state transfer).
        *self.written = true;
        self.inner.as_bytes_mut()
    }
}

/// `visit` with every buffer wrapped in [`Tracked`].
fn tracking<'v>(
    written: &'v mut bool,
    visit: &'v mut dyn FnMut(&str, &mut dyn ParamBuffer),
) -> impl FnMut(&str, &mut dyn ParamBuffer) + 'v {
    move |name, inner| {
        visit(
            name,
            &mut Tracked {
                inner,
                written: &mut *written,
            },
        )
    }
}

impl<J: TrainState + ?Sized> Parameters for Full<'_, J> {
    fn visit_parameters(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        self.job.visit_parameters(&mut tracking(&mut self.written, visit))
    }
    fn visit_buffers(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        self.job.visit_buffers(&mut tracking(&mut self.written, visit))
    }
}

impl<J: TrainState + ?Sized> TrainState for Full<'_, J> {
    /// The job's promise: the outer optimizer's buffers are `Vec`s of
    /// this state, which the transfer holds borrowed.
    fn buffers_in_place(&self) -> Option<InPlace> {
        self.job.buffers_in_place()
    }
    fn visit_optimizer(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        let mut visit = tracking(&mut self.written, visit);
        self.job.visit_optimizer(&mut visit);
        if !self.outer.anchor.is_empty() {
            visit("chorus.outer.anchor", &mut self.outer.anchor);
        }
        if !self.outer.momentum.is_empty() {
            visit("chorus.outer.momentum", &mut self.outer.momentum);
        }
    }
    fn save_extra(&self) -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&self.progress.step.to_le_bytes());
        bytes.extend_from_slice(&self.progress.outer_syncs.to_le_bytes());
        bytes.extend_from_slice(&self.job.save_extra());
        bytes
    }
    fn load_extra(&mut self, bytes: &[u8]) -> Result<(), String> {
        if bytes.len() < 16 {
            return Err(format!("{} bytes of extras, fewer than the trainer's 16", bytes.len()));
        }
        let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        *self.progress = Progress {
            step: word(0),
            outer_syncs: word(1),
        };
        self.job.load_extra(&bytes[16..])
    }
}

/// The parameters as one flat `f32` vector.
fn read_params(job: &mut dyn Parameters) -> Result<Vec<f32>, TrainError> {
    let mut flat = Vec::new();
    let mut wrong = None;
    job.visit_parameters(&mut |name, buffer| {
        if buffer.dtype() != DType::Float32 {
            wrong.get_or_insert_with(|| name.to_owned());
            return;
        }
        let at = flat.len();
        flat.resize(at + buffer.len(), 0.0f32);
        buffer.read_bytes(0, bytemuck::cast_slice_mut(&mut flat[at..]));
    });
    match wrong {
        Some(name) => Err(TrainError::NotF32(name)),
        None => Ok(flat),
    }
}

fn write_params(job: &mut dyn Parameters, flat: &[f32]) {
    let mut at = 0;
    job.visit_parameters(&mut |_, buffer| {
        let n = buffer.len();
        buffer.write_bytes(0, bytemuck::cast_slice(&flat[at..at + n]));
        at += n;
    });
}

/// What ended an attempt at a unit of progress.
pub(super) enum Outcome {
    /// `admit`: a member saw processes waiting to join at this boundary;
    /// `swap`: every member holds the next generation, formed beside this
    /// one (swap to it now).
    Committed { admit: bool, swap: bool },
    /// The group failed: wait for the next generation.
    GroupFailed,
    /// A member's local failure voted it down: re-run in this generation.
    Rejected,
}

/// A recovery under way.
#[derive(Debug)]
pub(super) struct Pending {
    pub(super) failed_at: Instant,
    pub(super) formed: Option<Duration>,
    pub(super) transferred: Option<(Instant, Duration)>,
    pub(super) generation: u64,
    pub(super) world_size: usize,
    pub(super) resumed_step: u64,
    pub(super) receivers: Vec<usize>,
    pub(super) bytes: u64,
}

impl Pending {
    pub(super) fn new(failed_at: Instant) -> Self {
        Self {
            failed_at,
            formed: None,
            transferred: None,
            generation: 0,
            world_size: 0,
            resumed_step: 0,
            receivers: Vec::new(),
            bytes: 0,
        }
    }

    /// A failure: starts a recovery, or extends the one under way.
    pub(super) fn extend(pending: &mut Option<Pending>) {
        let p = pending.get_or_insert_with(|| Pending::new(Instant::now()));
        p.formed = None;
        p.transferred = None;
    }

    /// The recovery, ended by a committed step now (logged); `None` when
    /// no transfer ended it (the initial formation).
    pub(super) fn finish(self) -> Option<Recovery> {
        let (transferred_at, transfer) = self.transferred?;
        let recovery = Recovery {
            generation: self.generation,
            world_size: self.world_size,
            resumed_step: self.resumed_step,
            receivers: self.receivers,
            bytes: self.bytes,
            rendezvous: self.formed.unwrap_or_default(),
            transfer,
            first_step: transferred_at.elapsed(),
            first_step_at: SystemTime::now(),
        };
        tracing::info!(
            generation = recovery.generation,
            world_size = recovery.world_size,
            resumed_step = recovery.resumed_step,
            receivers = ?recovery.receivers,
            bytes = recovery.bytes,
            rendezvous_ms = recovery.rendezvous.as_secs_f64() * 1e3,
            transfer_ms = recovery.transfer.as_secs_f64() * 1e3,
            first_step_ms = recovery.first_step.as_secs_f64() * 1e3,
            total_ms = recovery.total().as_secs_f64() * 1e3,
            "recovered"
        );
        Some(recovery)
    }
}

/// Trains `job` for `options.steps` committed steps on `group`, through
/// failures and joiners (see the module docs); `observe` sees each
/// committed step. Every member calls it; a process that joined a running
/// job (its group's generation is past 0) starts without state and
/// receives it.
///
/// # Cancel safety
///
/// Not cancel safe: it runs collectives with the peers (see
/// [`Work`](crate::Work)), so dropping it half-way leaves them waiting on
/// this rank until their timeouts, and `job`'s state may be half-way
/// through a step.
pub async fn train<J: Job>(
    group: &ElasticGroup,
    job: &mut J,
    options: &TrainOptions,
    observe: impl FnMut(&Committed),
) -> Result<TrainReport, TrainError> {
    let mut run = Run::new(group, job, options, observe)?;
    loop {
        let outer_due = run.outer_due();
        if run.progress.step >= options.steps && outer_due.is_none() {
            break;
        }
        let pg = group.current();
        if run.heal_outvoted(&pg).await? == Next::Again {
            continue;
        }
        let joined = run.synced.as_ref().is_some_and(|(g, _)| *g == pg.generation());
        if !joined && run.join(&pg).await? == Next::Again {
            continue;
        }
        let boundary = Boundary::of(group, pg.generation());
        let outcome = match outer_due {
            Some((rule, fragment, fragments)) => {
                let (job, at) = (&mut *run.job, run.progress.step);
                outer_sync(&pg, job, &mut run.outer, rule, (fragment, fragments), at, boundary).await?
            }
            None => match run.step(&pg, boundary).await? {
                Some(outcome) => outcome,
                None => continue,
            },
        };
        run.conclude(&pg, outcome, outer_due.is_some()).await?;
    }
    Ok(run.finish())
}

/// After a step of [`Run`]: go on in this generation, or look at the
/// group again (a generation failed and the next is formed, or a member
/// must be healed first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Next {
    Go,
    Again,
}

/// [`train`]'s loop state, between units of progress.
struct Run<'a, J: Job, F> {
    group: &'a ElasticGroup,
    job: &'a mut J,
    options: &'a TrainOptions,
    observe: F,
    outer: Outer,
    progress: Progress,
    /// Whether this member's state is a committed step's (a fresh joiner's
    /// is none, nor is one a broken transfer half wrote).
    has_state: bool,
    report: TrainReport,
    /// The gradient sync of the generation this member joined.
    synced: Option<(u64, DistributedSync<'static>)>,
    pending: Option<Pending>,
    /// Votes down in a row at this step.
    rejections: u32,
    recorder: Option<Recorder>,
    live: Option<Live>,
    guard: Guard,
    /// Members whose state a check outvoted, in a generation.
    outvoted: Option<(u64, Vec<usize>)>,
}

impl<'a, J: Job, F: FnMut(&Committed)> Run<'a, J, F> {
    fn new(group: &'a ElasticGroup, job: &'a mut J, options: &'a TrainOptions, observe: F) -> Result<Self, TrainError> {
        let mut outer = Outer::default();
        if let Some((_, rule, _)) = options.mode.outer() {
            outer.anchor = read_params(job)?;
            if matches!(rule, OuterRule::Nesterov { .. }) {
                outer.momentum = vec![0.0; outer.anchor.len()];
            }
        }
        Ok(Self {
            group,
            job,
            options,
            observe,
            outer,
            progress: Progress::default(),
            has_state: group.generation() == 0,
            report: TrainReport::default(),
            synced: None,
            pending: None,
            rejections: 0,
            recorder: Recorder::from_env(),
            live: Live::start(group),
            guard: Guard::new(&options.integrity, &options.corruptions, options.mode == Mode::Ddp),
            outvoted: None,
        })
    }

    /// The next outer sync (or fragment sync), once its step is committed.
    fn outer_due(&self) -> Option<(OuterRule, u32, u32)> {
        self.options.mode.outer().and_then(|(every, rule, fragments)| {
            let (at, fragment) = sync_point(self.progress.outer_syncs, every, fragments);
            (at <= self.progress.step).then_some((rule, fragment, fragments))
        })
    }

    /// The generation failed: wait for the next one.
    async fn failed(&mut self, generation: u64) -> Result<Next, TrainError> {
        Pending::extend(&mut self.pending);
        wait_next(self.group, generation).await?;
        Ok(Next::Again)
    }

    /// Silent corruption found on these members: they take the majority's
    /// state in this generation; nobody else moves. (In a new generation
    /// the join's transfer and the check after it do.)
    async fn heal_outvoted(&mut self, pg: &ProcessGroup) -> Result<Next, TrainError> {
        let generation = pg.generation();
        let Some((_, ranks)) = self.outvoted.take().filter(|(g, _)| *g == generation) else {
            return Ok(Next::Go);
        };
        self.has_state &= !ranks.contains(&pg.rank());
        let mine = self.has_state.then(|| self.progress.units());
        let options = self.options;
        let mut full = Full::new(&mut *self.job, &mut self.outer, &mut self.progress);
        match sync_state(pg, &mut full, mine, &options.transfer).await {
            Ok(_) => {
                self.has_state = true;
                Ok(Next::Go)
            }
            Err(TransferError::Collective(_) | TransferError::Protocol { .. } | TransferError::Timeout { .. }) => {
                self.failed(generation).await
            }
            Err(other) => Err(TrainError::Transfer(other)),
        }
    }

    /// Joins generation `pg`, new to this member: the state moves from the
    /// most advanced members (after they compared theirs) to those behind,
    /// and the gradient sync is set up on the new group.
    async fn join(&mut self, pg: &Arc<ProcessGroup>) -> Result<Next, TrainError> {
        let generation = pg.generation();
        // A generation swapped in between two operations is a recovery
        // too (a joiner admitted into a healthy group).
        if self.synced.take().is_some() && self.pending.is_none() {
            self.pending = Some(Pending::new(Instant::now()));
        }
        if let Some(p) = self.pending.as_mut() {
            p.formed.get_or_insert_with(|| p.failed_at.elapsed());
        }
        let started = Instant::now();
        let units = self.has_state.then(|| self.progress.units());
        let mut full = Full::new(&mut *self.job, &mut self.outer, &mut self.progress);
        match self.guard.vet_sources(pg, &mut full, units).await? {
            Check::NotDue | Check::Agree => {}
            Check::Outvoted(ranks) => self.has_state &= !ranks.contains(&pg.rank()),
            Check::GroupFailed => {
                wait_next(self.group, generation).await?;
                return Ok(Next::Again);
            }
        }
        let mine = self.has_state.then(|| self.progress.units());
        let before = self.progress.step;
        let mut full = Full::new(&mut *self.job, &mut self.outer, &mut self.progress);
        let transfer = match sync_state(pg, &mut full, mine, &self.options.transfer).await {
            Ok(transfer) => transfer,
            Err(TransferError::Collective(_) | TransferError::Protocol { .. } | TransferError::Timeout { .. }) => {
                // A receiver cut off mid-transfer holds a mix of two
                // states: it must receive again, even if every member
                // ahead of it died and its old step became the newest.
                if full.written {
                    self.has_state = false;
                }
                wait_next(self.group, generation).await?;
                return Ok(Next::Again);
            }
            Err(other) => return Err(TrainError::Transfer(other)),
        };
        if transfer.receivers.contains(&pg.rank()) {
            // The extras (and so `progress`) load only once every chunk
            // arrived: `before` is what this member had applied itself.
            self.report.adopted += self.progress.step - before;
        }
        self.has_state = true;
        let sync_options = SyncOptions {
            bucket_cap_mb: self.options.bucket_cap_mb,
            init_sync: false,
            ..SyncOptions::default()
        };
        let mut sync = match DistributedSync::new(pg.clone(), &mut *self.job, sync_options).await {
            Ok(sync) => sync,
            Err(SyncError::Collective(_) | SyncError::Aborted { .. }) => {
                wait_next(self.group, generation).await?;
                return Ok(Next::Again);
            }
            Err(other) => return Err(TrainError::Sync(other)),
        };
        sync.register_comm_hook(self.guard.hook());
        self.synced = Some((generation, sync));
        // The state just moved: checked before the first step.
        self.guard.check_at(self.progress.step);
        if let Some(p) = self.pending.as_mut() {
            p.generation = generation;
            p.world_size = pg.world_size();
            p.resumed_step = self.progress.step;
            p.receivers = transfer.receivers;
            p.bytes = transfer.bytes;
            p.transferred = Some((Instant::now(), started.elapsed()));
        }
        Ok(Next::Go)
    }

    /// One step in generation `pg`: the due state check, the job's step
    /// and its vote. `None`: look at the group again first.
    async fn step(&mut self, pg: &ProcessGroup, boundary: Boundary) -> Result<Option<Outcome>, TrainError> {
        let (at, generation) = (self.progress.step, pg.generation());
        // A corruption asked for from a dashboard or `chorus chaos` (`live`).
        if let Some(target) = self.live.as_ref().and_then(Live::take_corruption) {
            self.guard.ask(StateCorruption {
                rank: pg.rank(),
                step: at,
                target,
                bit: None,
            });
        }
        self.guard.inject(pg.rank(), at, &mut *self.job);
        let max_rejections = self.options.max_rejections;
        let mut full = Full::new(&mut *self.job, &mut self.outer, &mut self.progress);
        match self.guard.check(pg, &mut full, at, max_rejections, None).await? {
            Check::NotDue | Check::Agree => {}
            Check::Outvoted(ranks) => {
                self.outvoted = Some((generation, ranks));
                return Ok(None);
            }
            Check::GroupFailed => {
                self.failed(generation).await?;
                return Ok(None);
            }
        }
        let options = self.options;
        let step = Step {
            step: at,
            rank: pg.rank(),
            world_size: pg.world_size(),
            generation,
            global_batch: options.global_batch,
            grad_scale: match options.mode {
                Mode::Ddp => 1.0 / options.global_batch.max(1) as f32,
                _ => 1.0 / shard(options.global_batch, pg.world_size(), pg.rank()).len().max(1) as f32,
            },
        };
        // A slow rank asked for from a dashboard (`live`).
        if let Some(pause) = self.live.as_ref().and_then(Live::slowdown) {
            tokio::time::sleep(pause).await;
        }
        let ddp = options.mode == Mode::Ddp;
        let (_, sync) = self.synced.as_mut().expect("joined before a step");
        let (outcome, loss, outliers) =
            run_step(pg, &mut *self.job, sync, &step, (ddp, boundary), &mut self.guard).await?;
        if !outliers.is_empty() && self.rejections >= options.max_rejections {
            return Err(TrainError::Unhealed {
                step: step.step,
                ranks: outliers,
                times: self.rejections + 1,
            });
        }
        if let Outcome::Committed { .. } = outcome {
            self.committed(&step, loss);
        }
        Ok(Some(outcome))
    }

    /// A committed step: counted, recorded, shown and observed.
    fn committed(&mut self, step: &Step, loss: f64) {
        self.report.applied += 1;
        self.guard.committed();
        let committed = Committed {
            step: step.step,
            loss: loss / self.options.global_batch.max(1) as f64,
            world_size: step.world_size,
            generation: step.generation,
        };
        let ddp = self.options.mode == Mode::Ddp;
        if let Some(recorder) = self.recorder.as_mut() {
            recorder.write(&CommitRecord {
                pid: std::process::id(),
                generation: step.generation,
                rank: step.rank,
                world_size: step.world_size,
                step: step.step,
                loss: Some(committed.loss),
                checksum: ddp.then(|| record::checksum(&mut *self.job)),
                applied: self.report.applied,
                adopted: self.report.adopted,
                at_us: record::unix_us(),
                corruptions_injected: self.guard.injected,
                corruptions_detected: self.guard.detected,
                check_interval: self.guard.interval,
            });
        }
        if let Some(live) = &self.live {
            live.committed(&committed, step.rank);
        }
        (self.observe)(&committed);
    }

    /// What a unit's outcome leads to: the next unit, a recovery ended or
    /// begun, a swap to the generation formed beside, or a step run again.
    async fn conclude(&mut self, pg: &ProcessGroup, outcome: Outcome, outer: bool) -> Result<(), TrainError> {
        match outcome {
            Outcome::Committed { admit, swap } => {
                self.rejections = 0;
                match outer {
                    true => self.progress.outer_syncs += 1,
                    false => self.progress.step += 1,
                }
                // A recovery ends at the first committed unit, but the
                // initial formation (no failure before it) is none.
                if let Some(recovery) = self.pending.take().and_then(Pending::finish) {
                    if let Some(live) = &self.live {
                        live.recovered(&recovery);
                    }
                    self.report.recoveries.push(recovery);
                }
                if swap {
                    self.pending = Some(Pending::new(Instant::now()));
                    self.group.swap_at_boundary(pg).await;
                    wait_next(self.group, pg.generation()).await?;
                } else if admit {
                    self.group.admit_at_boundary(pg);
                }
            }
            Outcome::GroupFailed => {
                if let Some(live) = &self.live {
                    live.failed(pg);
                }
                self.failed(pg.generation()).await?;
            }
            Outcome::Rejected => {
                self.report.rejected += 1;
                self.rejections += 1;
                // A member may hold a corrupt state (a loss gone non-finite,
                // an outlier gradient): compare before running it again.
                self.guard.check_at(self.progress.step);
                if self.rejections > self.options.max_rejections {
                    return Err(TrainError::Rejected {
                        step: self.progress.step,
                        times: self.rejections,
                    });
                }
            }
        }
        Ok(())
    }

    fn finish(self) -> TrainReport {
        TrainReport {
            steps: self.progress.step,
            outer_syncs: self.progress.outer_syncs,
            corruptions_injected: self.guard.injected,
            corruptions_detected: self.guard.detected,
            ..self.report
        }
    }
}

pub(super) async fn wait_next(group: &ElasticGroup, generation: u64) -> Result<(), TrainError> {
    group
        .next_generation(generation)
        .await
        .map(drop)
        .map_err(TrainError::GaveUp)
}

/// What a member's vote says about the membership at this boundary.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Boundary {
    /// It saw processes waiting to join.
    pub(super) joiner: bool,
    /// It holds the next generation, formed beside this one.
    pub(super) ready: bool,
}

impl Boundary {
    /// This process's view of `generation` in `group`.
    pub(super) fn of(group: &ElasticGroup, generation: u64) -> Self {
        Self {
            joiner: group.joiners_waiting(generation),
            ready: group.next_ready(generation),
        }
    }
}

/// The commit vote, summed over the members.
pub(super) struct Votes {
    /// `[succeeded, failed for good, loss, saw a joiner waiting, holds the
    /// next generation]`.
    pub(super) sums: [f64; 5],
    /// Each member's local gradient norm, by rank (0 where not measured).
    pub(super) norms: Vec<f64>,
}

/// The commit vote: every member's `[succeeded, failed for good, loss,
/// saw a joiner waiting, holds the next generation]` summed, and each
/// one's local gradient norm in its own slot. `None` when the vote itself
/// failed (the group did).
pub(super) async fn vote(
    pg: &ProcessGroup,
    ok: bool,
    fatal: bool,
    loss: f64,
    boundary: Boundary,
    grad_norm: Option<f64>,
) -> Option<Votes> {
    const SLOTS: usize = 5;
    let mut mine = vec![0.0; SLOTS + pg.world_size()];
    mine[..SLOTS].copy_from_slice(&[
        f64::from(u8::from(ok)),
        f64::from(u8::from(fatal)),
        loss,
        f64::from(u8::from(boundary.joiner)),
        f64::from(u8::from(boundary.ready)),
    ]);
    if let Some(norm) = grad_norm {
        mine[SLOTS + pg.rank()] = norm;
    }
    let sum = pg.all_reduce(Tensor::from_slice(&mine), ReduceOp::Sum).await.ok()?;
    let sum = sum.to_vec::<f64>().ok().filter(|s| s.len() == mine.len())?;
    Some(Votes {
        sums: [sum[0], sum[1], sum[2], sum[3], sum[4]],
        norms: sum[SLOTS..].to_vec(),
    })
}

/// Decides a unit from the vote; the error when this or another member
/// failed for good.
pub(super) fn decide(pg: &ProcessGroup, step: u64, votes: Option<&Votes>) -> Result<Outcome, TrainError> {
    let Some(&Votes {
        sums: [ok, fatal, _, joiners, ready],
        ..
    }) = votes
    else {
        return Ok(Outcome::GroupFailed);
    };
    if fatal > 0.0 {
        return Err(TrainError::PeerFailed(step));
    }
    Ok(if ok as usize == pg.world_size() {
        Outcome::Committed {
            admit: joiners > 0.0,
            swap: ready as usize == pg.world_size(),
        }
    } else {
        Outcome::Rejected
    })
}

/// One step: gradients, sync, vote, and the update only if committed
/// (and no member's local gradient is an outlier: then it is voted down).
/// Returns the summed loss of the step's global batch, and the outliers.
async fn run_step<J: Job>(
    pg: &ProcessGroup,
    job: &mut J,
    sync: &mut DistributedSync<'static>,
    step: &Step,
    (ddp, boundary): (bool, Boundary),
    guard: &mut Guard,
) -> Result<(Outcome, f64, Vec<usize>), TrainError> {
    let mut failure: Option<TrainError> = None;
    let mut loss = 0.0;
    let mut ok = false;
    guard.start_step();
    if let Err(e) = sync.zero_grad() {
        failure = Some(TrainError::Sync(e));
    }
    if failure.is_none() {
        let (computed, finished) = if ddp {
            let computed = job.backward(step, sync);
            // finish() also when backward failed: the buckets it started
            // must end before the vote, or the members' collectives interleave.
            (computed, sync.finish().await)
        } else {
            // Local modes: the gradients stay here, nothing to finish.
            (job.backward(step, &mut sync.no_sync()), Ok(()))
        };
        match (computed, finished) {
            (_, Err(SyncError::Collective(_) | SyncError::Aborted { .. })) => {}
            (Err(reason), _) => {
                failure = Some(TrainError::Job {
                    step: step.step,
                    reason,
                })
            }
            (Ok(_), Err(e)) => failure = Some(TrainError::Sync(e)),
            (Ok(l), Ok(())) if l.is_finite() => (ok, loss) = (true, l),
            (Ok(l), Ok(())) => {
                tracing::warn!(step = step.step, loss = l, "non-finite loss: voting the step down");
            }
        }
    }
    let votes = vote(pg, ok, failure.is_some(), loss, boundary, guard.grad_norm()).await;
    if let Some(error) = failure {
        return Err(error);
    }
    let mut outcome = decide(pg, step.step, votes.as_ref())?;
    let mut outliers = Vec::new();
    if let (Outcome::Committed { .. }, Some(votes)) = (&outcome, &votes) {
        outliers = guard.judge_grads(step.step, &votes.norms);
        if !outliers.is_empty() {
            outcome = Outcome::Rejected;
        }
    }
    if let Outcome::Committed { .. } = outcome {
        job.apply(step, sync).map_err(|reason| TrainError::Job {
            step: step.step,
            reason,
        })?;
    }
    Ok((outcome, votes.map_or(0.0, |v| v.sums[2]), outliers))
}

/// The `k`-th outer sync (from 0): the committed step after which it
/// runs and the fragment it syncs. Fragment `f` of `fragments` syncs every
/// `every` steps, `f * every / fragments` steps after fragment 0.
fn sync_point(k: u64, every: u64, fragments: u32) -> (u64, u32) {
    let fragments = u64::from(fragments.max(1));
    let (round, fragment) = (k / fragments + 1, k % fragments);
    (round * every + fragment * every / fragments, fragment as u32)
}

/// One outer sync of the local modes: contributions summed, vote, and the
/// outer step only if committed.
async fn outer_sync<J: Job>(
    pg: &ProcessGroup,
    job: &mut J,
    outer: &mut Outer,
    rule: OuterRule,
    (fragment, fragments): (u32, u32),
    step: u64,
    boundary: Boundary,
) -> Result<Outcome, TrainError> {
    let mut params = read_params(job)?;
    let n = params.len();
    let range = n * fragment as usize / fragments as usize..n * (fragment as usize + 1) / fragments as usize;
    let mut contribution = vec![0.0f32; range.len()];
    rule.contribution(&params[range.clone()], &outer.anchor[range.clone()], &mut contribution);
    let sum = pg
        .all_reduce(Tensor::from_slice(&contribution), ReduceOp::Sum)
        .await
        .ok()
        .and_then(|sum| sum.to_vec::<f32>().ok());
    let votes = vote(pg, sum.is_some(), false, 0.0, boundary, None).await;
    let outcome = decide(pg, step, votes.as_ref())?;
    if let (Outcome::Committed { .. }, Some(sum)) = (&outcome, sum) {
        // Local SGD keeps no momentum.
        let momentum = match outer.momentum.is_empty() {
            true => &mut [][..],
            false => &mut outer.momentum[range.clone()],
        };
        rule.apply(
            &sum,
            pg.world_size(),
            &mut params[range.clone()],
            &mut outer.anchor[range],
            momentum,
        );
        write_params(job, &params);
    }
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outer_syncs_come_every_h_steps_and_fragments_are_staggered() {
        let points = |every, fragments| (0..6).map(|k| sync_point(k, every, fragments)).collect::<Vec<_>>();
        assert_eq!(points(8, 1), [(8, 0), (16, 0), (24, 0), (32, 0), (40, 0), (48, 0)]);
        assert_eq!(points(8, 2), [(8, 0), (12, 1), (16, 0), (20, 1), (24, 0), (28, 1)]);
        assert_eq!(points(9, 3), [(9, 0), (12, 1), (15, 2), (18, 0), (21, 1), (24, 2)]);
    }

    #[test]
    fn shards_cover_the_global_batch_once_for_any_world_size() {
        for world in 1..=7 {
            let mut next = 0;
            for rank in 0..world {
                let s = shard(100, world, rank);
                assert_eq!(s.start, next);
                assert!(s.len() == 100 / world || s.len() == 100 / world + 1);
                next = s.end;
            }
            assert_eq!(next, 100);
        }
    }

    #[test]
    fn progress_travels_in_the_extras_before_the_jobs() {
        struct Plain(crate::train::NamedState);
        impl Parameters for Plain {
            fn visit_parameters(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
                self.0.visit_parameters(visit)
            }
        }
        impl TrainState for Plain {
            fn save_extra(&self) -> Vec<u8> {
                self.0.save_extra()
            }
            fn load_extra(&mut self, bytes: &[u8]) -> Result<(), String> {
                self.0.load_extra(bytes)
            }
        }
        impl Job for Plain {
            fn backward(&mut self, _: &Step, _: &mut DistributedSync<'static>) -> Result<f64, String> {
                Ok(0.0)
            }
            fn apply(&mut self, _: &Step, _: &DistributedSync<'static>) -> Result<(), String> {
                Ok(())
            }
        }
        let mut source = Plain(crate::train::NamedState {
            extra: vec![9, 9],
            ..Default::default()
        });
        let (mut outer, mut progress) = (
            Outer::default(),
            Progress {
                step: 7,
                outer_syncs: 2,
            },
        );
        let bytes = Full::new(&mut source, &mut outer, &mut progress).save_extra();
        let mut joiner = Plain(crate::train::NamedState::default());
        let mut got = Progress::default();
        let mut full = Full::new(&mut joiner, &mut outer, &mut got);
        full.load_extra(&bytes).unwrap();
        assert!(full.load_extra(&bytes[..3]).is_err());
        assert_eq!(
            (got, got.units()),
            (
                Progress {
                    step: 7,
                    outer_syncs: 2
                },
                9
            )
        );
        assert_eq!(joiner.0.extra, [9, 9]);
    }
}
