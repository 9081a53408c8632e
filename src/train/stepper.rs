//! Per-step commit for a loop the caller runs: the machinery of
//! [`train`](super::train) without the loop, for a training loop that
//! stays its user's own (a torch script's `zero_grad`, `backward`, `step`).
//!
//! Each step is [`Stepper::begin`] (join the current generation: when it
//! changed, the state moves from the most advanced members to the others
//! and is checked equal on every member), the caller's gradient sync on
//! [`Begun::group`], then [`Stepper::commit`] (the vote: the step counts
//! only when every member's sync succeeded). A step that is not committed
//! is discarded by every member; none rolls back. At the very first
//! formation every member takes rank 0's state, as DDP's construction
//! broadcasts it, so replicas start equal however they were built.
//!
//! With `CHORUS_TRAIN_RECORD` set, each committed step leaves a commit
//! record once the caller applied its update ([`Stepper::record`]), as
//! [`train`](super::train) leaves one, so `chorus chaos` can judge the job.

use std::sync::Arc;
use std::time::Instant;

use super::guard::{Check, Guard};
use super::integrity::{FIRST_INTERVAL, IntegrityOptions, StateCorruption, StateTarget};
use super::live::Live;
use super::record::{self, CommitRecord, Recorder};
use super::state::TrainState;
use super::trainer::{
    Boundary, Committed, Full, Outcome, Outer, Pending, Progress, TrainError, TrainReport, decide, vote, wait_next,
};
use super::transfer::{TransferError, TransferOptions, TransferReport, sync_state, sync_verified};
use crate::elastic::ElasticGroup;
use crate::group::ProcessGroup;

/// What a [`Stepper`] does at each join.
#[derive(Debug, Clone)]
pub struct StepperOptions {
    /// How state moves to joiners.
    pub transfer: TransferOptions,
    /// Times a step may be voted down by a member's local failure (not a
    /// group failure), or a member's state found corrupt, in a row before
    /// training stops.
    pub max_rejections: u32,
    /// The state checks against silent data corruption (the gradients are
    /// the caller's: their check is not run here).
    pub integrity: IntegrityOptions,
}

impl Default for StepperOptions {
    fn default() -> Self {
        Self {
            transfer: TransferOptions::default(),
            max_rejections: 3,
            integrity: IntegrityOptions::default(),
        }
    }
}

/// What [`Stepper::begin`] found.
#[derive(Debug)]
pub enum Begin {
    /// The step may run.
    Ready(Begun),
    /// Call again with the state: the generation changed (the state
    /// moves), or the members' state check is due.
    NeedState,
}

/// A step under way.
#[derive(Debug, Clone)]
pub struct Begun {
    /// The generation the step runs in: sync the gradients here.
    pub group: Arc<ProcessGroup>,
    /// The committed step it becomes.
    pub step: u64,
    /// The state transfer this join ran, if the generation changed or a
    /// state check healed a member.
    pub transfer: Option<TransferReport>,
}

/// What a due state check found.
enum Checked {
    /// Every member agrees: the step may run.
    Agreed,
    /// Begin again: a member was healed (the transfer, for the step's
    /// report) or the generation failed under the check.
    Again(Option<TransferReport>),
}

/// One member's side of per-step commit (see the module docs).
#[derive(Debug)]
pub struct Stepper {
    options: StepperOptions,
    progress: Progress,
    /// Whether this member's state may be a source (false for a joiner
    /// until it received one, and after a transfer into it broke).
    has_state: bool,
    /// The generation the state was last synced into.
    current: Option<Arc<ProcessGroup>>,
    /// A generation that failed under this member: wait for the next.
    failed: Option<u64>,
    /// Whether a step was begun on `current` (a second `begin` before
    /// the vote continues it, as a second `zero_grad` would).
    in_step: bool,
    pending: Option<Pending>,
    report: TrainReport,
    rejections: u32,
    /// This process's progress in the job's store, for a dashboard.
    live: Option<Live>,
    /// Where commit records go (`CHORUS_TRAIN_RECORD`), if anywhere.
    recorder: Option<Recorder>,
    /// The last committed step's record, until its update is applied.
    unrecorded: Option<CommitRecord>,
    /// The state checks, and the corruptions asked for.
    guard: Guard,
    /// When the caller was asked for the state for a check.
    asked_at: Option<Instant>,
}

impl Stepper {
    /// A member of `group`'s job: a process that joined a running job
    /// (its generation is past 0) has no state until it receives one.
    /// Call it inside a tokio runtime (it starts the publishing of this
    /// process's progress, `train::live`).
    pub fn new(group: &ElasticGroup, options: StepperOptions) -> Self {
        Self {
            progress: Progress::default(),
            has_state: group.generation() == 0 && group.rank() == 0,
            current: None,
            failed: None,
            in_step: false,
            pending: None,
            report: TrainReport::default(),
            rejections: 0,
            live: Live::start(group),
            recorder: Recorder::from_env(),
            unrecorded: None,
            guard: Guard::new(&options.integrity, &[], true),
            asked_at: None,
            options,
        }
    }

    /// Whether committed steps are recorded (`CHORUS_TRAIN_RECORD` is set):
    /// the caller then passes [`record`](Self::record) a checksum.
    pub fn recording(&self) -> bool {
        self.recorder.is_some()
    }

    /// Writes the record of the step committed last, once the caller
    /// applied its update: `checksum` is [`checksum`](super::checksum) of
    /// the parameters after it (`None` where members' parameters may
    /// differ). Does nothing when not recording or already recorded.
    pub fn record(&mut self, checksum: Option<u64>) {
        if let (Some(recorder), Some(mut record)) = (self.recorder.as_mut(), self.unrecorded.take()) {
            record.checksum = checksum;
            record.at_us = record::unix_us();
            recorder.write(&record);
        }
    }

    /// Committed steps so far.
    pub fn step(&self) -> u64 {
        self.progress.step
    }

    /// What happened so far: steps, commits applied here, steps adopted by
    /// receiving state, recoveries with their phases.
    pub fn report(&self) -> TrainReport {
        TrainReport {
            steps: self.progress.step,
            corruptions_injected: self.guard.injected,
            corruptions_detected: self.guard.detected,
            ..self.report.clone()
        }
    }

    /// Starts a step on the current generation. When the generation
    /// changed since the last step (a member failed or a joiner was
    /// admitted) and `state` is `None`, returns [`Begin::NeedState`];
    /// given the state, it runs the transfer, then checks that every
    /// member holds the same state (an error naming the first entry that
    /// differs). A generation that fails during the join is waited out.
    ///
    /// It also asks for the state when the members' periodic state check
    /// is due (see [`train`](super::train)'s silent data corruption
    /// checks): a member a majority outvotes receives their state here,
    /// and the step's [`Begun::transfer`] says so.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: the join runs collectives with the peers.
    pub async fn begin(
        &mut self,
        group: &ElasticGroup,
        mut state: Option<&mut dyn TrainState>,
    ) -> Result<Begin, TrainError> {
        // A transfer that healed this member or another, for the step's report.
        let mut healed = None;
        loop {
            if let Some(generation) = self.failed.take() {
                wait_next(group, generation).await?;
            }
            let pg = group.current();
            if self.current.as_ref().is_some_and(|c| c.generation() == pg.generation()) {
                if !self.in_step {
                    self.take_asked_corruption(&pg);
                    if self.guard.wants_state(pg.rank(), self.progress.step) {
                        let Some(state) = state.as_deref_mut() else {
                            self.asked_at.get_or_insert_with(Instant::now);
                            return Ok(Begin::NeedState);
                        };
                        match self.check_state(&pg, state).await? {
                            Checked::Agreed => {}
                            Checked::Again(transfer) => {
                                healed = transfer.or(healed);
                                continue;
                            }
                        }
                    }
                }
                // A slow rank asked for from a dashboard.
                if let Some(pause) = self.live.as_ref().and_then(Live::slowdown) {
                    tokio::time::sleep(pause).await;
                }
                self.in_step = true;
                return Ok(Begin::Ready(Begun {
                    group: pg,
                    step: self.progress.step,
                    transfer: healed,
                }));
            }
            let Some(state) = state.as_deref_mut() else {
                return Ok(Begin::NeedState);
            };
            if let Some(begun) = self.join(pg, state).await? {
                return Ok(Begin::Ready(begun));
            }
        }
    }

    /// A corruption asked for from a dashboard or `chorus chaos` (`live`),
    /// for this member's state at the step about to begin.
    fn take_asked_corruption(&mut self, pg: &ProcessGroup) {
        match self.live.as_ref().and_then(Live::take_corruption) {
            Some(StateTarget::Params) => self.guard.ask(StateCorruption {
                rank: pg.rank(),
                step: self.progress.step,
                target: StateTarget::Params,
                bit: None,
            }),
            Some(StateTarget::Grads) => tracing::warn!(
                "a corruption of the local gradient was asked for: this loop syncs its own gradients, so it is not carried out"
            ),
            None => {}
        }
    }

    /// The members' periodic state check, due now: an outvoted member
    /// receives the majority's state here (`Again` with the transfer),
    /// and the check runs again; a generation that failed under it is
    /// waited out (`Again` without one).
    async fn check_state(&mut self, pg: &ProcessGroup, state: &mut dyn TrainState) -> Result<Checked, TrainError> {
        let (rank, step) = (pg.rank(), self.progress.step);
        self.guard.inject(rank, step, &mut *state);
        let mut outer = Outer::default();
        let mut full = Full::new(state, &mut outer, &mut self.progress);
        let asked_at = self.asked_at.take();
        match self
            .guard
            .check(pg, &mut full, step, self.options.max_rejections, asked_at)
            .await?
        {
            Check::NotDue | Check::Agree => Ok(Checked::Agreed),
            Check::GroupFailed => {
                self.failed = Some(pg.generation());
                Ok(Checked::Again(None))
            }
            Check::Outvoted(ranks) => {
                // Healed in place from the majority, then checked again.
                self.has_state &= !ranks.contains(&rank);
                let mine = self.has_state.then(|| full.progress.units());
                match sync_state(pg, &mut full, mine, &self.options.transfer).await {
                    Ok(transfer) => {
                        self.has_state = true;
                        Ok(Checked::Again(Some(transfer)))
                    }
                    Err(
                        TransferError::Collective(_) | TransferError::Protocol { .. } | TransferError::Timeout { .. },
                    ) => {
                        self.failed = Some(pg.generation());
                        Ok(Checked::Again(None))
                    }
                    Err(other) => Err(TrainError::Transfer(other)),
                }
            }
        }
    }

    /// Joins generation `pg`, new to this member: the state moves from the
    /// most advanced members to the others (after the senders compared
    /// theirs), then every member's is checked equal. `None` when the
    /// generation failed meanwhile (wait for the next).
    async fn join(&mut self, pg: Arc<ProcessGroup>, state: &mut dyn TrainState) -> Result<Option<Begun>, TrainError> {
        // A generation swapped in between two steps is a recovery too
        // (a joiner admitted into a healthy group).
        if self.current.take().is_some() && self.pending.is_none() {
            self.pending = Some(Pending::new(Instant::now()));
        }
        if let Some(p) = self.pending.as_mut() {
            p.formed.get_or_insert_with(|| p.failed_at.elapsed());
        }
        let started = Instant::now();
        let before = self.progress.step;
        let mut outer = Outer::default();
        let mut full = Full::new(state, &mut outer, &mut self.progress);
        let units = self.has_state.then(|| full.progress.units());
        match self.guard.vet_sources(&pg, &mut full, units).await? {
            Check::NotDue | Check::Agree => {}
            Check::Outvoted(ranks) => self.has_state &= !ranks.contains(&pg.rank()),
            Check::GroupFailed => {
                self.failed = Some(pg.generation());
                return Ok(None);
            }
        }
        let mine = self.has_state.then(|| full.progress.units());
        let joined = sync_verified(&pg, &mut full, mine, &self.options.transfer).await;
        let written = full.written;
        let transfer = match joined {
            Ok(transfer) => transfer,
            Err(TransferError::Collective(_) | TransferError::Protocol { .. } | TransferError::Timeout { .. }) => {
                // A receiver cut off mid-transfer holds a mix of two
                // states: it must receive again.
                if written {
                    self.has_state = false;
                }
                self.failed = Some(pg.generation());
                return Ok(None);
            }
            Err(other) => return Err(TrainError::Transfer(other)),
        };
        if transfer.receivers.contains(&pg.rank()) {
            self.report.adopted += self.progress.step - before;
        }
        self.has_state = true;
        // Every member of the new generation passes here: the next
        // state check is set from the step alone, so a joiner agrees.
        self.guard.check_at(self.progress.step + FIRST_INTERVAL);
        if let Some(p) = self.pending.as_mut() {
            p.generation = pg.generation();
            p.world_size = pg.world_size();
            p.resumed_step = self.progress.step;
            p.receivers = transfer.receivers.clone();
            p.bytes = transfer.bytes;
            p.transferred = Some((Instant::now(), started.elapsed()));
        }
        self.current = Some(pg.clone());
        self.in_step = true;
        Ok(Some(Begun {
            group: pg,
            step: self.progress.step,
            transfer: Some(transfer),
        }))
    }

    /// The step's vote: `ok` when this member's gradient sync succeeded
    /// and its loss is finite, `fatal` when it stops for good (its peers
    /// then stop too). Returns whether the step is committed: apply the
    /// update only then. Not committed because the group failed, the next
    /// [`begin`](Self::begin) waits for the next generation; voted down
    /// by a member's local failure, the step runs again (at most
    /// [`StepperOptions::max_rejections`] times in a row). The second
    /// value is the sum of the members' `loss`es. Under
    /// [`Admission::AtStepBoundary`](crate::elastic::Admission), a
    /// committed vote that says processes wait to join has the next
    /// generation formed with them beside this one, while the steps go on;
    /// the first committed vote in which every member holds it swaps to
    /// it, between two steps.
    pub async fn commit(
        &mut self,
        group: &ElasticGroup,
        ok: bool,
        fatal: bool,
        loss: f64,
    ) -> Result<(bool, f64), TrainError> {
        self.commit_with(group, ok, fatal, loss, None).await
    }

    /// Whether this process holds the next generation, formed beside the
    /// step's own (what its vote would say toward the swap).
    pub fn next_ready(&self, group: &ElasticGroup) -> bool {
        self.current
            .as_ref()
            .is_some_and(|pg| Boundary::of(group, pg.generation()).ready)
    }

    /// [`commit`](Self::commit) with this member's word on the swap given:
    /// several elastic groups whose members must swap at the same step
    /// (the shards of one replica group) each vote their shared
    /// [`next_ready`](Self::next_ready), agreed among themselves first.
    pub async fn commit_with(
        &mut self,
        group: &ElasticGroup,
        ok: bool,
        fatal: bool,
        loss: f64,
        ready: Option<bool>,
    ) -> Result<(bool, f64), TrainError> {
        let Some(pg) = self.current.clone().filter(|_| self.in_step) else {
            return Err(TrainError::Job {
                step: self.progress.step,
                reason: "commit without a step begun (begin first)".into(),
            });
        };
        self.in_step = false;
        let mut boundary = Boundary::of(group, pg.generation());
        if let Some(ready) = ready {
            boundary.ready = ready;
        }
        let votes = vote(&pg, ok, fatal, loss, boundary, None).await;
        let summed = votes.as_ref().map_or(0.0, |v| v.sums[2]);
        match decide(&pg, self.progress.step, votes.as_ref())? {
            Outcome::Committed { admit, swap } => {
                let mean_loss = summed / pg.world_size() as f64;
                if let Some(live) = &self.live {
                    let committed = Committed {
                        step: self.progress.step,
                        loss: mean_loss,
                        world_size: pg.world_size(),
                        generation: pg.generation(),
                    };
                    live.committed(&committed, pg.rank());
                }
                self.rejections = 0;
                self.report.applied += 1;
                self.guard.committed();
                if self.recorder.is_some() {
                    self.unrecorded = Some(CommitRecord {
                        pid: std::process::id(),
                        generation: pg.generation(),
                        rank: pg.rank(),
                        world_size: pg.world_size(),
                        step: self.progress.step,
                        loss: mean_loss.is_finite().then_some(mean_loss),
                        checksum: None,
                        applied: self.report.applied,
                        adopted: self.report.adopted,
                        at_us: 0,
                        corruptions_injected: self.guard.injected,
                        corruptions_detected: self.guard.detected,
                        check_interval: self.guard.interval,
                    });
                }
                self.progress.step += 1;
                if let Some(recovery) = self.pending.take().and_then(Pending::finish) {
                    if let Some(live) = &self.live {
                        live.recovered(&recovery);
                    }
                    self.report.recoveries.push(recovery);
                }
                if swap {
                    self.pending = Some(Pending::new(Instant::now()));
                    group.swap_at_boundary(&pg).await;
                    self.failed = Some(pg.generation());
                } else if admit {
                    group.admit_at_boundary(&pg);
                }
                Ok((true, summed))
            }
            Outcome::GroupFailed => {
                if let Some(live) = &self.live {
                    live.failed(&pg);
                }
                self.fail();
                Ok((false, summed))
            }
            Outcome::Rejected => {
                self.report.rejected += 1;
                self.rejections += 1;
                // A member may hold a corrupt state (a loss gone non-finite):
                // compare before running the step again.
                self.guard.check_at(self.progress.step);
                if self.rejections > self.options.max_rejections {
                    return Err(TrainError::Rejected {
                        step: self.progress.step,
                        times: self.rejections,
                    });
                }
                Ok((false, summed))
            }
        }
    }

    /// Waits for the next generation when the last step's failed (after a
    /// [`commit`](Self::commit) that was not committed because the group
    /// failed) and returns the group now current, without joining it: a
    /// caller may look at its members before [`begin`](Self::begin) moves
    /// any state.
    pub async fn next_generation(&mut self, group: &ElasticGroup) -> Result<Arc<ProcessGroup>, TrainError> {
        if let Some(generation) = self.failed.take() {
            wait_next(group, generation).await?;
        }
        Ok(group.current())
    }

    fn fail(&mut self) {
        Pending::extend(&mut self.pending);
        if let Some(pg) = self.current.take() {
            self.failed = Some(pg.generation());
        }
    }
}
