//! The training loop's guard against silent data corruption, the IO side
//! of [`integrity`](super::integrity): it carries out the `corrupt` faults
//! asked for (`CHORUS_FAULTS` or [`TrainOptions::corruptions`]), compares
//! the members' state at its cadence, and measures each member's local
//! gradient on its way into the sum (the DDP hook).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use chorus_runtime::collective::ReduceOp;
use chorus_transports::fault::FaultPlan;

use super::integrity::{self, Cadence, IntegrityOptions, StateCorruption, StateTarget, StateVerdict};
use super::state::{TrainState, entries};
use super::trainer::TrainError;
use super::transfer::entry_sums;
use crate::group::ProcessGroup;
use crate::sync::{BucketInfo, CommHook, HookFuture, Parameters};
use crate::tensor::Tensor;

/// What a state check found.
pub(super) enum Check {
    /// Not due at this step.
    NotDue,
    /// Every member holds the same state.
    Agree,
    /// These ranks hold a state the majority does not: they must receive it.
    Outvoted(Vec<usize>),
    /// The exchange failed (the group did).
    GroupFailed,
}

/// The local gradient on its way into the sum: its squared norm, and a bit
/// to flip in it (a `corrupt(..., what=grads)` fault).
#[derive(Debug, Default)]
struct GradWatch {
    sum_of_squares: Mutex<f64>,
    /// The bit (`None`: the dtype's default) and the step, for the next bucket.
    flip: Mutex<Option<(Option<u32>, u64)>>,
}

/// Sums the buckets (the members' shares of one global batch) instead of
/// averaging them, measuring each local bucket first.
struct Sum(Arc<GradWatch>);

impl CommHook for Sum {
    fn reduce(&mut self, group: &ProcessGroup, _bucket: BucketInfo, data: Tensor) -> HookFuture {
        let dtype = data.dtype();
        let mut bytes = data.into_buffer();
        if let Some((bit, step)) = self.0.flip.lock().expect("not poisoned").take() {
            let size = dtype.size();
            let bit = bit.or_else(|| integrity::default_bit(StateTarget::Grads, dtype));
            let from = integrity::element(step, bytes.len() / size.max(1));
            let index = integrity::nonzero_element(&bytes, size, from);
            if let Some(bit) = bit.filter(|&b| integrity::flip_bit(&mut bytes, size, index, b)) {
                tracing::warn!(
                    step,
                    bit,
                    index,
                    "injected fault: flipped a bit of this rank's local gradient"
                );
            }
        }
        *self.0.sum_of_squares.lock().expect("not poisoned") += integrity::sum_of_squares(dtype, &bytes);
        Box::pin(group.all_reduce(Tensor::from_buffer(dtype, bytes), ReduceOp::Sum))
    }
}

/// Every member's `row`, rank after rank; `None`: the group failed.
async fn gather_u64s(pg: &ProcessGroup, row: &[u64]) -> Option<Vec<u64>> {
    let all = pg.all_gather(Tensor::from_slice(row)).await.ok()?;
    all.to_vec::<u64>().ok()
}

/// A checksum of each tensor entry of `state`: the extras are left out,
/// since a job may keep per-rank state there (RNG, data position) that
/// differs between healthy members.
fn tensor_sums(state: &mut dyn TrainState) -> Vec<u64> {
    entry_sums(state, None)
}

/// See the module docs.
#[derive(Debug)]
pub(super) struct Guard {
    options: IntegrityOptions,
    /// Whether the members' states and gradients must agree (DDP).
    checking: bool,
    pending: Vec<StateCorruption>,
    grads: Arc<GradWatch>,
    /// The step of the next state check; `None`: never.
    next_check: Option<u64>,
    /// Steps between two checks, as last agreed.
    pub(super) interval: Option<u64>,
    /// What the last check took here (checksums and exchange).
    last_cost_ns: u64,
    /// Since the last check, and the steps committed since.
    since: Instant,
    steps_since: u64,
    /// State checks that disagreed in a row (healing did not hold).
    disagreed_in_a_row: u32,
    /// Corruptions injected here.
    pub(super) injected: u64,
    /// Corruptions found (state or gradient), each counted once on every member.
    pub(super) detected: u64,
}

impl Guard {
    /// The guard of a run with `options`; `checking` in DDP. The
    /// `corrupt(rank=R, step=S)` rules of `CHORUS_FAULTS` join
    /// `corruptions`.
    pub(super) fn new(options: &IntegrityOptions, corruptions: &[StateCorruption], checking: bool) -> Self {
        let mut pending = corruptions.to_vec();
        if let Ok(spec) = std::env::var("CHORUS_FAULTS") {
            // A plan that does not parse was refused when the group formed.
            if let Ok(plan) = FaultPlan::parse(&spec) {
                pending.extend(plan.state_corruptions());
            }
        }
        let cadence = options.cadence;
        Self {
            options: options.clone(),
            checking,
            pending,
            grads: Arc::default(),
            next_check: (checking && cadence != Cadence::Off).then_some(0),
            interval: None,
            last_cost_ns: 0,
            since: Instant::now(),
            steps_since: 0,
            disagreed_in_a_row: 0,
            injected: 0,
            detected: 0,
        }
    }

    /// The gradient hook of this run's sync.
    pub(super) fn hook(&self) -> Box<dyn CommHook> {
        Box::new(Sum(self.grads.clone()))
    }

    /// Check the state before the step `step` runs (after a transfer, or a
    /// step voted down): every member calls it at the same points.
    pub(super) fn check_at(&mut self, step: u64) {
        if self.next_check.is_some() {
            self.next_check = Some(step);
        }
    }

    /// A step committed.
    pub(super) fn committed(&mut self) {
        self.steps_since += 1;
    }

    /// Adds a corruption asked for while training (a dashboard, `chorus
    /// chaos`); refused, with a warning, where the state is not checked, as
    /// nothing would find it.
    pub(super) fn ask(&mut self, corruption: StateCorruption) {
        match self.next_check {
            Some(_) => self.pending.push(corruption),
            None => tracing::warn!(
                target = corruption.target.name(),
                "a corruption was asked for, but this job does not check its state: not carried out"
            ),
        }
    }

    /// Whether a state check, or a corruption of the parameters, is due
    /// before step `step` of rank `rank` (the state is then needed).
    pub(super) fn wants_state(&self, rank: usize, step: u64) -> bool {
        self.next_check.is_some_and(|at| step >= at)
            || self
                .pending
                .iter()
                .any(|c| c.rank == rank && c.step == step && c.target == StateTarget::Params)
    }

    /// Carries out the corruptions asked of rank `rank` at `step`.
    pub(super) fn inject(&mut self, rank: usize, step: u64, params: &mut dyn Parameters) {
        let mut due = Vec::new();
        self.pending.retain(|c| {
            let now = c.rank == rank && c.step == step;
            if now {
                due.push(*c);
            }
            !now
        });
        for corruption in due {
            match corruption.target {
                StateTarget::Params => match integrity::corrupt_parameters(params, step, corruption.bit) {
                    Some(what) => {
                        tracing::warn!(rank, step, "injected fault: flipped {what}");
                        self.injected += 1;
                    }
                    None => tracing::warn!(rank, step, "injected fault: no floating-point parameter to corrupt"),
                },
                StateTarget::Grads => {
                    *self.grads.flip.lock().expect("not poisoned") = Some((corruption.bit, step));
                    self.injected += 1;
                }
            }
        }
    }

    /// Starts a step's gradient measurement.
    pub(super) fn start_step(&self) {
        *self.grads.sum_of_squares.lock().expect("not poisoned") = 0.0;
    }

    /// The norm of this step's local gradient, when the members compare them.
    pub(super) fn grad_norm(&self) -> Option<f64> {
        let checking = self.checking && self.options.grad_outlier > 0.0;
        checking.then(|| self.grads.sum_of_squares.lock().expect("not poisoned").sqrt())
    }

    /// The members whose gradient norm (from the vote) is an outlier; a
    /// detection when any is.
    pub(super) fn judge_grads(&mut self, step: u64, norms: &[f64]) -> Vec<usize> {
        if self.grad_norm().is_none() {
            return Vec::new();
        }
        let outliers = integrity::grad_outliers(norms, self.options.grad_outlier);
        if !outliers.is_empty() {
            self.detected += 1;
            tracing::warn!(
                step,
                ranks = ?outliers,
                norms = ?norms,
                "silent data corruption: a local gradient far outside the others'; the step is computed again"
            );
        }
        outliers
    }

    /// Before a transfer (collective: every member of the new generation
    /// calls it): the members about to be its sources, those holding the
    /// most advanced state (`units`), compare their states, so that a
    /// silently corrupt copy is not handed on. Returns the sources a
    /// majority of them outvoted (they must receive too).
    pub(super) async fn vet_sources(
        &mut self,
        pg: &ProcessGroup,
        state: &mut dyn TrainState,
        units: Option<u64>,
    ) -> Result<Check, TrainError> {
        if self.next_check.is_none() {
            return Ok(Check::NotDue);
        }
        let sums = units.map(|_| tensor_sums(state)).unwrap_or_default();
        let mine = [
            u64::from(units.is_some()),
            units.unwrap_or(0),
            integrity::fingerprint(&sums),
        ];
        let Some(all) = gather_u64s(pg, &mine).await else {
            return Ok(Check::GroupFailed);
        };
        let rows: Vec<&[u64]> = all.chunks(mine.len()).collect();
        let newest = rows.iter().filter(|r| r[0] == 1).map(|r| r[1]).max();
        let sources: Vec<usize> = (0..rows.len())
            .filter(|&rank| rows[rank][0] == 1 && Some(rows[rank][1]) == newest)
            .collect();
        let fingerprints: Vec<Vec<u64>> = sources.iter().map(|&rank| vec![rows[rank][2]]).collect();
        match integrity::judge_state(&fingerprints) {
            StateVerdict::Agree => Ok(Check::Agree),
            StateVerdict::Outvoted(outvoted) => {
                self.detected += 1;
                let ranks: Vec<usize> = outvoted.iter().map(|&(i, _)| sources[i]).collect();
                tracing::warn!(
                    ranks = ?ranks,
                    "silent data corruption: these members' state differs from the other sources'; they receive it instead of sending it"
                );
                Ok(Check::Outvoted(ranks))
            }
            StateVerdict::NoMajority { .. } => Err(TrainError::Corrupted {
                step: newest.unwrap_or(0),
                entry: "(a transfer's sources disagree; run verify_state to name it)".into(),
                fingerprints: sources.iter().map(|&rank| (rank, rows[rank][2])).collect(),
            }),
        }
    }

    /// At a due step, compares every member's state checksums (collective:
    /// every member calls it at the same steps). `asked_at`: when the
    /// caller was asked for the state, which the check's cost includes.
    pub(super) async fn check(
        &mut self,
        pg: &ProcessGroup,
        state: &mut dyn TrainState,
        step: u64,
        max_in_a_row: u32,
        asked_at: Option<Instant>,
    ) -> Result<Check, TrainError> {
        if self.next_check.is_none_or(|at| step < at) {
            return Ok(Check::NotDue);
        }
        let started = asked_at.unwrap_or_else(Instant::now);
        let step_ns = match self.steps_since {
            0 => 0,
            n => (self.since.elapsed().as_nanos() / u128::from(n)) as u64,
        };
        let mut row = tensor_sums(state);
        let width = row.len();
        row.extend([self.last_cost_ns, step_ns]);
        let Some(all) = gather_u64s(pg, &row).await else {
            return Ok(Check::GroupFailed);
        };
        let rows: Vec<Vec<u64>> = all.chunks(width + 2).map(<[u64]>::to_vec).collect();
        let sums: Vec<Vec<u64>> = rows.iter().map(|r| r[..width.min(r.len())].to_vec()).collect();
        let word = |i: usize| {
            rows.iter()
                .map(|r| r.get(width + i).copied().unwrap_or(0))
                .collect::<Vec<_>>()
        };
        self.interval = integrity::next_interval(self.options.cadence, &word(0), &word(1));
        self.next_check = self.interval.map(|k| step + k);
        self.last_cost_ns = started.elapsed().as_nanos() as u64;
        tracing::debug!(
            step,
            cost_us = self.last_cost_ns / 1000,
            step_us = step_ns / 1000,
            next = ?self.next_check,
            "state check"
        );
        (self.since, self.steps_since) = (Instant::now(), 0);
        let name = |state: &mut dyn TrainState, entry: usize| {
            entries(state)
                .get(entry)
                .map_or_else(|| format!("entry {entry}"), |e| e.name.clone())
        };
        match integrity::judge_state(&sums) {
            StateVerdict::Agree => {
                self.disagreed_in_a_row = 0;
                Ok(Check::Agree)
            }
            StateVerdict::NoMajority { entry } => Err(TrainError::Corrupted {
                step,
                entry: name(state, entry),
                fingerprints: sums.iter().map(|r| integrity::fingerprint(r)).enumerate().collect(),
            }),
            StateVerdict::Outvoted(outvoted) => {
                self.detected += 1;
                self.disagreed_in_a_row += 1;
                let ranks: Vec<usize> = outvoted.iter().map(|&(rank, _)| rank).collect();
                for &(rank, entry) in &outvoted {
                    tracing::warn!(
                        step,
                        rank,
                        entry = %name(state, entry),
                        "silent data corruption: this rank's state differs from the majority's; it receives theirs"
                    );
                }
                if self.disagreed_in_a_row > max_in_a_row {
                    return Err(TrainError::Unhealed {
                        step,
                        ranks,
                        times: self.disagreed_in_a_row,
                    });
                }
                // Confirm the healing before the step runs.
                self.next_check = Some(step);
                Ok(Check::Outvoted(ranks))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::NamedState;

    /// Four members, rank 3 a joiner with no state; rank `corrupt`'s copy
    /// differs; `behind` holds an older step. What each one's vetting says.
    async fn vet(corrupt: usize, behind: Option<usize>) -> Vec<Result<Vec<usize>, String>> {
        crate::group::spawn(4, move |pg| async move {
            let rank = pg.rank();
            let value = if rank == corrupt { 2.0 } else { 1.0 };
            let mut state = NamedState {
                params: vec![("w".into(), vec![value; 64])],
                ..NamedState::default()
            };
            let units = match rank {
                3 => None,
                r if Some(r) == behind => Some(6),
                _ => Some(7),
            };
            let mut guard = Guard::new(&IntegrityOptions::default(), &[], true);
            match guard.vet_sources(&pg, &mut state, units).await {
                Ok(Check::Outvoted(ranks)) => Ok(ranks),
                Ok(Check::Agree) => Ok(Vec::new()),
                Ok(_) => Err("no vetting".to_owned()),
                Err(e) => Err(e.to_string()),
            }
        })
        .await
        .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_source_outvoted_by_the_others_receives_instead_of_sending() {
        for outcome in vet(1, None).await {
            assert_eq!(outcome, Ok(vec![1]));
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_member_behind_is_no_source_and_two_sources_that_differ_stop_training() {
        // Rank 2 is behind (it receives anyway): its older state is no corruption.
        for outcome in vet(2, Some(2)).await {
            assert_eq!(outcome, Ok(vec![]));
        }
        // Ranks 0 and 1 are the sources and differ: nobody can tell which is right.
        for outcome in vet(1, Some(2)).await {
            let error = outcome.unwrap_err();
            assert!(
                error.contains("no majority") && error.contains("rank 0: ") && error.contains("rank 1: "),
                "{error}"
            );
        }
    }
}
