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
    let world = plans.len();
    let size = dtype.size();
    for (r, (plan, buf)) in plans.iter().zip(bufs.iter()).enumerate() {
        if plan.rank() != r || plan.world() != world {
            return Err(format!("plan {r} is for rank {} of {}", plan.rank(), plan.world()));
        }
        if buf.input.len() != plan.input_len() * size || buf.output.len() != plan.output_len() * size {
            return Err(format!("rank {r}: buffers do not match the plan's lengths"));
        }
        check_hazards(plan)?;
    }
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
    let mut knows: Vec<Vec<u64>> = plans.iter().map(|p| vec![0; p.steps().len()]).collect();
    let mut flight: HashMap<(usize, usize, Tag), Message> = HashMap::new();
    let mut sent: HashSet<(usize, usize, Tag)> = HashSet::new();
    let mut rng = Rng(seed | 1);
    let mut left: usize = plans.iter().map(|p| p.steps().len()).sum();
    while left > 0 {
        let runnable: Vec<usize> = (0..ready.len())
            .filter(|&k| {
                let (r, i) = ready[k];
                match &plans[r].steps()[i].action {
                    Action::Recv { from, tag, .. } => flight.contains_key(&(*from, r, *tag)),
                    _ => true,
                }
            })
            .collect();
        if runnable.is_empty() {
            let waiting: Vec<String> = ready
                .iter()
                .map(|&(r, i)| format!("rank {r} step {i}: {:?}", plans[r].steps()[i].action))
                .collect();
            return Err(format!("deadlock with {left} steps left; waiting: {waiting:?}"));
        }
        let (r, i) = ready.swap_remove(runnable[rng.below(runnable.len())]);
        let plan = &plans[r];
        let mut know = 1u64 << r;
        for d in plan.deps(StepId(i as u32)) {
            know |= knows[r][d.index()];
        }
        let buf = &mut bufs[r];
        match &plan.steps()[i].action {
            Action::Send { to, tag, src } => {
                if *to >= world || *to == r || !sent.insert((r, *to, *tag)) {
                    return Err(format!("rank {r} step {i}: bad or repeated send to {to} {tag:?}"));
                }
                let bytes = match src {
                    Region::Input(range) => slice(&buf.input, range, size, r)?,
                    Region::Output(range) => slice(&buf.output, range, size, r)?,
                };
                flight.insert((r, *to, *tag), (bytes.to_vec(), know));
            }
            Action::Recv { from, tag, dst, then } => {
                let (payload, theirs) = flight.remove(&(*from, r, *tag)).ok_or("checked above")?;
                know |= theirs;
                let dst_bytes = slice_mut(&mut buf.output, dst, size, r)?;
                if payload.len() != dst_bytes.len() {
                    return Err(format!(
                        "rank {r} step {i}: size mismatch: {} bytes from {from} {tag:?}, expected {}",
                        payload.len(),
                        dst_bytes.len()
                    ));
                }
                let done = match then {
                    Combine::Copy => {
                        dst_bytes.copy_from_slice(&payload);
                        Ok(())
                    }
                    Combine::Reduce => reduce_into(op, dtype, dst_bytes, &payload),
                    Combine::ReduceComplete => reduce_complete_into(op, dtype, dst_bytes, &payload, world),
                    Combine::ReduceInput => {
                        reduce_from(op, dtype, dst_bytes, slice(&buf.input, dst, size, r)?, &payload)
                    }
                    Combine::ReduceCompleteInput => {
                        let own = slice(&buf.input, dst, size, r)?;
                        reduce_complete_from(op, dtype, dst_bytes, own, &payload, world)
                    }
                };
                done.map_err(|e| e.to_string())?;
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
        knows[r][i] = know;
        left -= 1;
        for &j in &dependents[r][i] {
            pending[r][j] -= 1;
            if pending[r][j] == 0 {
                ready.push((r, j));
            }
        }
    }
    if !flight.is_empty() {
        let keys: Vec<_> = flight.keys().collect();
        return Err(format!("messages sent but never received (from, to, tag): {keys:?}"));
    }
    Ok(knows
        .iter()
        .enumerate()
        .map(|(r, k)| k.iter().fold(1u64 << r, |a, b| a | b))
        .collect())
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
