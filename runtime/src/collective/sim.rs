//! Reference executor for tests: runs every rank's [`Plan`] in memory by
//! message passing, in a random order that respects dependencies, and
//! reports what a real driver would hang or corrupt on: deadlock (a receive
//! nobody will satisfy), a message of the wrong size, a tag sent twice, a
//! message never received, and data hazards the dependencies leave open.

use std::collections::{HashMap, HashSet};
use std::ops::Range;

use half::{bf16, f16};

use super::dtype::{DType, ReduceOp};
use super::plan::{Action, Combine, Plan, Region, StepId, Tag};
use super::reduce::{reduce_complete_from, reduce_complete_into, reduce_from, reduce_into};

/// The small integer `v` as one element of `dtype` (wrapping for integers).
pub(crate) fn encode(dtype: DType, v: i64) -> Vec<u8> {
    match dtype {
        DType::Int8 => (v as i8).to_ne_bytes().to_vec(),
        DType::UInt8 => (v as u8).to_ne_bytes().to_vec(),
        DType::Int32 => (v as i32).to_ne_bytes().to_vec(),
        DType::UInt32 => (v as u32).to_ne_bytes().to_vec(),
        DType::Int64 => v.to_ne_bytes().to_vec(),
        DType::UInt64 => (v as u64).to_ne_bytes().to_vec(),
        DType::Float16 => f16::from_f64(v as f64).to_ne_bytes().to_vec(),
        DType::BFloat16 => bf16::from_f64(v as f64).to_ne_bytes().to_vec(),
        DType::Float32 => (v as f32).to_ne_bytes().to_vec(),
        DType::Float64 => (v as f64).to_ne_bytes().to_vec(),
    }
}

/// One rank's buffers, in bytes.
#[derive(Debug, Clone)]
pub(crate) struct Buffers {
    pub(crate) input: Vec<u8>,
    pub(crate) output: Vec<u8>,
}

/// A message in flight: payload and the set of ranks it has heard from.
type Message = (Vec<u8>, u64);

/// Small deterministic generator for the execution order.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
    }
}

/// Runs `plans` (one per rank, in rank order) over `bufs`; returns, per
/// rank, the set of ranks (bit `i` for rank `i`, worlds up to 64) whose
/// messages reached it through some chain of dependencies.
pub(crate) fn run(
    plans: &[Plan],
    dtype: DType,
    op: ReduceOp,
    bufs: &mut [Buffers],
    seed: u64,
) -> Result<Vec<u64>, String> {
    check_plans(plans, bufs, dtype.size())?;
    let mut sim = Sim::new(plans, dtype, op, seed);
    while sim.left > 0 {
        let (r, i) = sim.pick()?;
        let know = sim.execute(r, i, &mut bufs[r])?;
        sim.complete(r, i, know);
    }
    sim.finish()
}

/// Checks that `plans` are for their ranks of one world, that `bufs` have
/// their lengths, and that they leave no data hazards open.
fn check_plans(plans: &[Plan], bufs: &[Buffers], size: usize) -> Result<(), String> {
    let world = plans.len();
    for (r, (plan, buf)) in plans.iter().zip(bufs.iter()).enumerate() {
        if plan.rank() != r || plan.world() != world {
            return Err(format!("plan {r} is for rank {} of {}", plan.rank(), plan.world()));
        }
        if buf.input.len() != plan.input_len() * size || buf.output.len() != plan.output_len() * size {
            return Err(format!("rank {r}: buffers do not match the plan's lengths"));
        }
        check_hazards(plan)?;
    }
    Ok(())
}

/// The state of a run: which steps are ready, what each step knows, the
/// messages in flight. Steps are `(rank, index)`.
struct Sim<'a> {
    plans: &'a [Plan],
    dtype: DType,
    op: ReduceOp,
    /// Per rank and step, the dependencies not yet done.
    pending: Vec<Vec<usize>>,
    /// Per rank and step, the steps that depend on it.
    dependents: Vec<Vec<Vec<usize>>>,
    ready: Vec<(usize, usize)>,
    /// Per rank and step, the ranks it heard from (when done).
    knows: Vec<Vec<u64>>,
    flight: HashMap<(usize, usize, Tag), Message>,
    sent: HashSet<(usize, usize, Tag)>,
    rng: Rng,
    /// Steps not yet done.
    left: usize,
}

impl<'a> Sim<'a> {
    fn new(plans: &'a [Plan], dtype: DType, op: ReduceOp, seed: u64) -> Self {
        let mut pending: Vec<Vec<usize>> = Vec::new();
        let mut dependents: Vec<Vec<Vec<usize>>> = Vec::new();
        let mut ready: Vec<(usize, usize)> = Vec::new();
        for (r, plan) in plans.iter().enumerate() {
            let n = plan.steps().len();
            let mut deps_left = vec![0; n];
            let mut after = vec![Vec::new(); n];
            for (i, left) in deps_left.iter_mut().enumerate() {
                for d in plan.deps(StepId(i as u32)) {
                    *left += 1;
                    after[d.index()].push(i);
                }
                if *left == 0 {
                    ready.push((r, i));
                }
            }
            pending.push(deps_left);
            dependents.push(after);
        }
        Self {
            plans,
            dtype,
            op,
            pending,
            dependents,
            ready,
            knows: plans.iter().map(|p| vec![0; p.steps().len()]).collect(),
            flight: HashMap::new(),
            sent: HashSet::new(),
            rng: Rng(seed | 1),
            left: plans.iter().map(|p| p.steps().len()).sum(),
        }
    }

    /// Takes a ready step that can run now (a receive only once its message
    /// is in flight), chosen at random; none is a deadlock.
    fn pick(&mut self) -> Result<(usize, usize), String> {
        let plans = self.plans;
        let runnable: Vec<usize> = (0..self.ready.len())
            .filter(|&k| {
                let (r, i) = self.ready[k];
                match &plans[r].steps()[i].action {
                    Action::Recv { from, tag, .. } => self.flight.contains_key(&(*from, r, *tag)),
                    _ => true,
                }
            })
            .collect();
        if runnable.is_empty() {
            let waiting: Vec<String> = self
                .ready
                .iter()
                .map(|&(r, i)| format!("rank {r} step {i}: {:?}", plans[r].steps()[i].action))
                .collect();
            return Err(format!("deadlock with {} steps left; waiting: {waiting:?}", self.left));
        }
        Ok(self.ready.swap_remove(runnable[self.rng.below(runnable.len())]))
    }

    /// Runs step `i` of rank `r` over its buffers `buf`; returns the ranks
    /// it heard from.
    fn execute(&mut self, r: usize, i: usize, buf: &mut Buffers) -> Result<u64, String> {
        let (plan, world, size) = (&self.plans[r], self.plans.len(), self.dtype.size());
        let mut know = 1u64 << r;
        for d in plan.deps(StepId(i as u32)) {
            know |= self.knows[r][d.index()];
        }
        match &plan.steps()[i].action {
            Action::Send { to, tag, src } => {
                if *to >= world || *to == r || !self.sent.insert((r, *to, *tag)) {
                    return Err(format!("rank {r} step {i}: bad or repeated send to {to} {tag:?}"));
                }
                let bytes = match src {
                    Region::Input(range) => slice(&buf.input, range, size, r)?,
                    Region::Output(range) => slice(&buf.output, range, size, r)?,
                };
                self.flight.insert((r, *to, *tag), (bytes.to_vec(), know));
            }
            Action::Recv { from, tag, dst, then } => {
                let (payload, theirs) = self.flight.remove(&(*from, r, *tag)).ok_or("checked above")?;
                know |= theirs;
                let dst_bytes = slice_mut(&mut buf.output, dst, size, r)?;
                if payload.len() != dst_bytes.len() {
                    return Err(format!(
                        "rank {r} step {i}: size mismatch: {} bytes from {from} {tag:?}, expected {}",
                        payload.len(),
                        dst_bytes.len()
                    ));
                }
                let own = || slice(&buf.input, dst, size, r);
                self.combine(*then, dst_bytes, &payload, own)?;
            }
            Action::Copy { src, dst } => {
                let src_bytes = slice(&buf.input, src, size, r)?.to_vec();
                let dst_bytes = slice_mut(&mut buf.output, dst, size, r)?;
                if src_bytes.len() != dst_bytes.len() {
                    return Err(format!("rank {r} step {i}: copy of unequal ranges"));
                }
                dst_bytes.copy_from_slice(&src_bytes);
            }
        }
        Ok(know)
    }

    /// Lands a received `payload` in `dst` as `then` says; `own` reads this
    /// rank's input where it lands, for the combines that take it in.
    fn combine<'b>(
        &self,
        then: Combine,
        dst: &mut [u8],
        payload: &[u8],
        own: impl FnOnce() -> Result<&'b [u8], String>,
    ) -> Result<(), String> {
        let (op, dtype, world) = (self.op, self.dtype, self.plans.len());
        let done = match then {
            Combine::Copy => {
                dst.copy_from_slice(payload);
                Ok(())
            }
            Combine::Reduce => reduce_into(op, dtype, dst, payload),
            Combine::ReduceComplete => reduce_complete_into(op, dtype, dst, payload, world),
            Combine::ReduceInput => reduce_from(op, dtype, dst, own()?, payload),
            Combine::ReduceCompleteInput => reduce_complete_from(op, dtype, dst, own()?, payload, world),
        };
        done.map_err(|e| e.to_string())
    }

    /// Marks step `i` of rank `r` done, knowing `know`, and readies the
    /// steps that waited only for it.
    fn complete(&mut self, r: usize, i: usize, know: u64) {
        self.knows[r][i] = know;
        self.left -= 1;
        for &j in &self.dependents[r][i] {
            self.pending[r][j] -= 1;
            if self.pending[r][j] == 0 {
                self.ready.push((r, j));
            }
        }
    }

    /// Every message must have been received; returns per rank the ranks
    /// it heard from.
    fn finish(self) -> Result<Vec<u64>, String> {
        if !self.flight.is_empty() {
            let keys: Vec<_> = self.flight.keys().collect();
            return Err(format!("messages sent but never received (from, to, tag): {keys:?}"));
        }
        Ok(self
            .knows
            .iter()
            .enumerate()
            .map(|(r, k)| k.iter().fold(1u64 << r, |a, b| a | b))
            .collect())
    }
}

fn bytes_of(range: &Range<usize>, size: usize) -> Range<usize> {
    range.start * size..range.end * size
}

fn slice<'a>(buf: &'a [u8], range: &Range<usize>, size: usize, r: usize) -> Result<&'a [u8], String> {
    buf.get(bytes_of(range, size))
        .ok_or_else(|| format!("rank {r}: range {range:?} out of bounds"))
}

fn slice_mut<'a>(buf: &'a mut [u8], range: &Range<usize>, size: usize, r: usize) -> Result<&'a mut [u8], String> {
    buf.get_mut(bytes_of(range, size))
        .ok_or_else(|| format!("rank {r}: range {range:?} out of bounds"))
}

/// Checks, independently of the builder, that every dependency points to an
/// earlier step and that any two steps touching overlapping `output`
/// elements, one of them writing, are ordered by a chain of dependencies.
pub(crate) fn check_hazards(plan: &Plan) -> Result<(), String> {
    let n = plan.steps().len();
    let words = n.div_ceil(64);
    let mut before: Vec<Vec<u64>> = Vec::with_capacity(n);
    for i in 0..n {
        let mut set = vec![0u64; words];
        for d in plan.deps(StepId(i as u32)) {
            let d = d.index();
            if d >= i {
                return Err(format!("rank {}: step {i} depends on later step {d}", plan.rank()));
            }
            for (w, x) in set.iter_mut().zip(&before[d]) {
                *w |= x;
            }
            set[d / 64] |= 1 << (d % 64);
        }
        before.push(set);
    }
    let overlap = |a: Option<&Range<usize>>, b: Option<&Range<usize>>| match (a, b) {
        (Some(a), Some(b)) => a.start < b.end && b.start < a.end,
        _ => false,
    };
    let steps = plan.steps();
    for i in 0..n {
        let (wi, ri) = (steps[i].action.writes(), steps[i].action.reads());
        for j in 0..i {
            let (wj, rj) = (steps[j].action.writes(), steps[j].action.reads());
            let conflict = overlap(wi, wj) || overlap(wi, rj) || overlap(ri, wj);
            if conflict && before[i][j / 64] & (1 << (j % 64)) == 0 {
                return Err(format!(
                    "rank {}: steps {j} ({:?}) and {i} ({:?}) conflict but are unordered",
                    plan.rank(),
                    steps[j].action,
                    steps[i].action
                ));
            }
        }
    }
    Ok(())
}
