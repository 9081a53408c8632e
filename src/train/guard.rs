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
use super::trainer::{TrainError, TrainOptions};
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
            let index = integrity::element(step, bytes.len() / size.max(1));
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

/// See the module docs.
pub(super) struct Guard {
    options: IntegrityOptions,
    /// Whether the members' states and gradients must agree (DDP).
    checking: bool,
    pending: Vec<StateCorruption>,
    grads: Arc<GradWatch>,
    /// The step of the next state check; `None`: never.
    next_check: Option<u64>,
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
    /// `corrupt(rank=R, step=S)` rules of `CHORUS_FAULTS` join the
    /// options' corruptions.
    pub(super) fn new(options: &TrainOptions, checking: bool) -> Self {
        let mut pending = options.corruptions.clone();
        if let Ok(spec) = std::env::var("CHORUS_FAULTS") {
            // A plan that does not parse was refused when the group formed.
            if let Ok(plan) = FaultPlan::parse(&spec) {
                pending.extend(plan.state_corruptions());
            }
        }
        let cadence = options.integrity.cadence;
        Self {
            options: options.integrity.clone(),
            checking,
            pending,
            grads: Arc::default(),
            next_check: (checking && cadence != Cadence::Off).then_some(0),
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

    /// At a due step, compares every member's state checksums (collective:
    /// every member calls it at the same steps).
    pub(super) async fn check(
        &mut self,
        pg: &ProcessGroup,
        state: &mut dyn TrainState,
        step: u64,
        max_in_a_row: u32,
    ) -> Result<Check, TrainError> {
        if self.next_check.is_none_or(|at| step < at) {
            return Ok(Check::NotDue);
        }
        let started = Instant::now();
        let step_ns = match self.steps_since {
            0 => 0,
            n => (self.since.elapsed().as_nanos() / u128::from(n)) as u64,
        };
        let mut row = entry_sums(state);
        let width = row.len();
        row.extend([self.last_cost_ns, step_ns]);
        let Some(all) = pg
            .all_gather(Tensor::from_slice(&row))
            .await
            .ok()
            .and_then(|t| t.to_vec::<u64>().ok())
        else {
            return Ok(Check::GroupFailed);
        };
        let rows: Vec<Vec<u64>> = all.chunks(width + 2).map(<[u64]>::to_vec).collect();
        let sums: Vec<Vec<u64>> = rows.iter().map(|r| r[..width.min(r.len())].to_vec()).collect();
        let word = |i: usize| {
            rows.iter()
                .map(|r| r.get(width + i).copied().unwrap_or(0))
                .collect::<Vec<_>>()
        };
        self.next_check = integrity::next_interval(self.options.cadence, &word(0), &word(1)).map(|k| step + k);
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
                .map_or_else(|| "extras".to_owned(), |e| e.name.clone())
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
