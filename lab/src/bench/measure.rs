//! One rank's side of a measurement, shared by every kind of side
//! ([`super::side`]) and the sweep that drives them
//! ([`super::collective`]): the collective measured ([`BenchOp`]), what a
//! run asks (`Spec`), the timed calls (`measure`), the check of the
//! outputs against exact expected values, and a rank's answer (`Raw`)
//! as the JSON line a worker prints.

use anyhow::{Result, bail};
use bytes::Bytes;
use chorus_runtime::collective::{DType, ReduceOp};
use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::time::Instant;

use chorus::group::ProcessGroup;
use chorus::tensor::Tensor;

/// The collective measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum BenchOp {
    /// `all_reduce`.
    AllReduce,
    /// `broadcast` from `--root`.
    Broadcast,
    /// `reduce` to `--root`.
    Reduce,
    /// `all_gather`.
    AllGather,
    /// `reduce_scatter`.
    ReduceScatter,
    /// `all_to_all`.
    AllToAll,
    /// Every rank sends to the next and receives from the previous one.
    SendRecv,
}

impl BenchOp {
    /// The name used on the command line and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all_reduce",
            BenchOp::Broadcast => "broadcast",
            BenchOp::Reduce => "reduce",
            BenchOp::AllGather => "all_gather",
            BenchOp::ReduceScatter => "reduce_scatter",
            BenchOp::AllToAll => "all_to_all",
            BenchOp::SendRecv => "send_recv",
        }
    }

    /// Whether the size counts every rank's block (S = count x typesize x
    /// nranks), as nccl-tests does for all-gather, reduce-scatter and all-to-all.
    pub fn size_counts_ranks(self) -> bool {
        matches!(self, BenchOp::AllGather | BenchOp::ReduceScatter | BenchOp::AllToAll)
    }

    /// Bytes S of one call with `count` elements (nccl-tests' `count`).
    pub fn bytes(self, count: usize, dtype: DType, world: usize) -> usize {
        count * dtype.size() * if self.size_counts_ranks() { world } else { 1 }
    }

    /// nccl-tests' `count` for a requested size in bytes (rounded down).
    pub fn count_for(self, bytes: usize, dtype: DType, world: usize) -> usize {
        bytes / (dtype.size() * if self.size_counts_ranks() { world } else { 1 })
    }

    /// busbw / algbw (docs/conventions.md, "nccl-tests output").
    pub fn bus_factor(self, world: usize) -> f64 {
        let n = world as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::ReduceScatter | BenchOp::AllGather | BenchOp::AllToAll => (n - 1.0) / n,
            BenchOp::Broadcast | BenchOp::Reduce | BenchOp::SendRecv => 1.0,
        }
    }

    /// Whether the op takes a reduction operator.
    pub fn reduces(self) -> bool {
        matches!(self, BenchOp::AllReduce | BenchOp::Reduce | BenchOp::ReduceScatter)
    }

    /// Whether the op has a root.
    pub fn rooted(self) -> bool {
        matches!(self, BenchOp::Broadcast | BenchOp::Reduce)
    }

    /// Elements of a rank's input for nccl-tests' `count`.
    fn input_len(self, count: usize, world: usize) -> usize {
        match self {
            BenchOp::ReduceScatter | BenchOp::AllToAll => count * world,
            _ => count,
        }
    }
}

// ------------------------------------------------------------ check values

/// Rank `rank`'s input element `i`: small integers, exact in every dtype.
pub(super) fn input_value(rank: usize, i: usize) -> f64 {
    (1 + (i + 3 * rank) % 3) as f64
}

/// `x` as stored in `dtype` (integers wrap, floats round).
pub(super) fn quantize(dtype: DType, x: f64) -> f64 {
    let i = x as i64;
    match dtype {
        DType::Int8 => i as i8 as f64,
        DType::UInt8 => i as u8 as f64,
        DType::Int32 => i as i32 as f64,
        DType::UInt32 => i as u32 as f64,
        DType::Int64 => i as f64,
        DType::UInt64 => i as u64 as f64,
        DType::Float16 => f16::from_f64(x).to_f64(),
        DType::BFloat16 => bf16::from_f64(x).to_f64(),
        DType::Float32 => x as f32 as f64,
        DType::Float64 => x,
    }
}

/// The reduction of `values` by `op` as the library computes it in `dtype`.
pub(super) fn reduce_values(dtype: DType, op: ReduceOp, values: impl Iterator<Item = f64>) -> f64 {
    let values: Vec<f64> = values.collect();
    let n = values.len() as f64;
    let ints = || values.iter().map(|&v| v as i64);
    let r = match op {
        ReduceOp::Sum => values.iter().sum(),
        ReduceOp::Avg => {
            let sum = quantize(dtype, values.iter().sum());
            if dtype.is_integer() { (sum / n).trunc() } else { sum / n }
        }
        ReduceOp::Prod => values.iter().product(),
        ReduceOp::Min => values.iter().copied().fold(f64::INFINITY, f64::min),
        ReduceOp::Max => values.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::BAnd => ints().fold(-1, |a, b| a & b) as f64,
        ReduceOp::BOr => ints().fold(0, |a, b| a | b) as f64,
        ReduceOp::BXor => ints().fold(0, |a, b| a ^ b) as f64,
    };
    quantize(dtype, r)
}

/// The measurement's fixed parameters, shared by every rank.
#[derive(Debug, Clone)]
pub(crate) struct Spec {
    pub(super) op: BenchOp,
    pub(super) dtype: DType,
    pub(super) redop: ReduceOp,
    pub(super) root: usize,
    pub(super) iters: usize,
    pub(super) warmup: usize,
    pub(super) check: bool,
    pub(super) memory: bool,
}

impl Spec {
    /// The expected output element `i` on `rank`, or `None` where the output is unspecified.
    pub(super) fn expected(&self, rank: usize, world: usize, count: usize, i: usize) -> Option<f64> {
        let all = |at: usize| reduce_values(self.dtype, self.redop, (0..world).map(move |r| input_value(r, at)));
        match self.op {
            BenchOp::AllReduce => Some(all(i)),
            BenchOp::Reduce => (rank == self.root).then(|| all(i)),
            BenchOp::Broadcast => Some(input_value(self.root, i)),
            BenchOp::AllGather => Some(input_value(i / count, i % count)),
            BenchOp::ReduceScatter => Some(all(rank * count + i)),
            BenchOp::AllToAll => Some(input_value(i / count, rank * count + i % count)),
            BenchOp::SendRecv => Some(input_value((rank + world - 1) % world, i)),
        }
    }
}

/// A tensor of `len` elements of `dtype` with values `value(i)`.
pub(super) fn make_tensor(dtype: DType, len: usize, value: impl Fn(usize) -> f64) -> Tensor {
    macro_rules! build {
        ($t:ty, $conv:expr) => {{
            let v: Vec<$t> = (0..len).map(|i| $conv(value(i))).collect();
            Tensor::from_slice(&v)
        }};
    }
    match dtype {
        DType::Int8 => build!(i8, |x: f64| x as i8),
        DType::UInt8 => build!(u8, |x: f64| x as u8),
        DType::Int32 => build!(i32, |x: f64| x as i32),
        DType::UInt32 => build!(u32, |x: f64| x as u32),
        DType::Int64 => build!(i64, |x: f64| x as i64),
        DType::UInt64 => build!(u64, |x: f64| x as u64),
        DType::Float16 => build!(f16, f16::from_f64),
        DType::BFloat16 => build!(bf16, bf16::from_f64),
        DType::Float32 => build!(f32, |x: f64| x as f32),
        DType::Float64 => build!(f64, |x: f64| x),
    }
}

/// Element `i` of `bytes` (native-endian `dtype`) as f64.
pub(super) fn element(dtype: DType, bytes: &[u8], i: usize) -> f64 {
    let s = dtype.size();
    let b = &bytes[i * s..(i + 1) * s];
    match dtype {
        DType::Int8 => b[0] as i8 as f64,
        DType::UInt8 => b[0] as f64,
        DType::Int32 => i32::from_ne_bytes(b.try_into().expect("4 bytes")) as f64,
        DType::UInt32 => u32::from_ne_bytes(b.try_into().expect("4 bytes")) as f64,
        DType::Int64 => i64::from_ne_bytes(b.try_into().expect("8 bytes")) as f64,
        DType::UInt64 => u64::from_ne_bytes(b.try_into().expect("8 bytes")) as f64,
        DType::Float16 => f16::from_ne_bytes(b.try_into().expect("2 bytes")).to_f64(),
        DType::BFloat16 => bf16::from_ne_bytes(b.try_into().expect("2 bytes")).to_f64(),
        DType::Float32 => f32::from_ne_bytes(b.try_into().expect("4 bytes")) as f64,
        DType::Float64 => f64::from_ne_bytes(b.try_into().expect("8 bytes")),
    }
}

/// Wrong elements of `out` on `rank` (a missing element counts as wrong).
pub(super) fn count_wrong(spec: &Spec, rank: usize, world: usize, count: usize, out: &Tensor) -> u64 {
    let expected_len = match spec.op {
        BenchOp::AllGather => count * world,
        BenchOp::AllToAll => count * world,
        _ => count,
    };
    let tolerance = match spec.dtype {
        DType::Float16 | DType::BFloat16 => 1e-2,
        DType::Float32 => 1e-6,
        _ => 0.0,
    };
    let bytes = out.as_bytes();
    let have = out.len().min(expected_len);
    let mut wrong = (expected_len - have) as u64;
    for i in 0..have {
        if let Some(want) = spec.expected(rank, world, count, i) {
            let got = element(spec.dtype, bytes, i);
            if (got - want).abs() > tolerance * want.abs().max(1.0) || got.is_nan() {
                wrong += 1;
            }
        }
    }
    wrong
}

// ------------------------------------------------------------- one rank

/// One rank's answer to `run COUNT` (the members of its JSON line besides
/// `rank` and `count`; the `wrong_*` members may be absent, as Gloo's are).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct Raw {
    pub(super) oop: Vec<f64>,
    pub(super) ip: Vec<f64>,
    pub(super) wrong_oop: Option<u64>,
    pub(super) wrong_ip: Option<u64>,
    /// The process's peak resident bytes over the measurement (`--memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) peak_rss: Option<u64>,
}

impl Raw {
    /// The answers of several rounds as one: each rank's iterations pooled,
    /// the largest peak.
    pub(super) fn pool(rounds: &[Vec<Raw>]) -> Vec<Raw> {
        let world = rounds.iter().map(Vec::len).min().unwrap_or(0);
        (0..world)
            .map(|rank| {
                let mut out = Raw::default();
                for raws in rounds {
                    let r = &raws[rank];
                    out.oop.extend(&r.oop);
                    out.ip.extend(&r.ip);
                    out.wrong_oop = sum_options(out.wrong_oop, r.wrong_oop);
                    out.wrong_ip = sum_options(out.wrong_ip, r.wrong_ip);
                    out.peak_rss = out.peak_rss.max(r.peak_rss);
                }
                out
            })
            .collect()
    }
}

pub(super) fn sum_options(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
    }
}

/// Resets this process's peak resident memory (VmHWM) to its current
/// resident size (Linux: `5` to clear_refs); elsewhere a no-op, and the
/// peak then covers the process's whole life.
pub(super) fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// This process's peak resident bytes (VmHWM), where /proc tells it.
pub(super) fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// A worker's line: who answered which count, then the answer.
#[derive(Serialize)]
pub(super) struct WorkerLine<T> {
    pub(super) rank: usize,
    pub(super) count: usize,
    #[serde(flatten)]
    pub(super) answer: T,
}

/// A worker's answer when it could not measure.
#[derive(Serialize)]
pub(super) struct WorkerError {
    pub(super) error: String,
}

impl Raw {
    pub(super) fn to_json(&self, rank: usize, count: usize) -> String {
        // Times to the nanosecond, as the workers always wrote them.
        let ns = |v: &[f64]| v.iter().map(|&t| round(t, 1e3)).collect();
        let answer = Raw {
            oop: ns(&self.oop),
            ip: ns(&self.ip),
            ..*self
        };
        to_line(&WorkerLine { rank, count, answer })
    }

    pub(super) fn from_json(v: Value) -> Result<Self, String> {
        if let Some(e) = v.get("error").and_then(Value::as_str) {
            return Err(e.to_string());
        }
        serde_json::from_value(v).map_err(|e| format!("a result line: {e}"))
    }
}

/// `x` rounded to `1 / scale` (`scale` a power of ten).
pub(super) fn round(x: f64, scale: f64) -> f64 {
    (x * scale).round() / scale
}

/// Compact one-line JSON of a line or row, which always serializes
/// (string keys; a non-finite float becomes `null`).
pub(super) fn to_line(value: &impl Serialize) -> String {
    serde_json::to_string(value).expect("bench lines have string keys")
}

/// One call of the collective on `tensor` (moved in); returns the output.
pub(super) async fn call(group: &ProcessGroup, spec: &Spec, count: usize, tensor: Tensor) -> Result<Tensor> {
    let (rank, world) = (group.rank(), group.world_size());
    Ok(match spec.op {
        BenchOp::AllReduce => group.all_reduce(tensor, spec.redop).await?,
        BenchOp::Broadcast => group.broadcast(tensor, spec.root).await?,
        BenchOp::Reduce => group.reduce(tensor, spec.root, spec.redop).await?,
        BenchOp::AllGather => group.all_gather(tensor).await?,
        BenchOp::ReduceScatter => group.reduce_scatter(tensor, spec.redop).await?,
        BenchOp::AllToAll => group.all_to_all(tensor).await?,
        BenchOp::SendRecv => {
            if world < 2 {
                bail!("send_recv needs at least 2 ranks");
            }
            let (to, from) = ((rank + 1) % world, (rank + world - 1) % world);
            // A rank's operations run one at a time (RA-1), so a ring where
            // every rank sends first could wait on itself: even ranks send
            // first, odd ranks receive first.
            if rank % 2 == 0 {
                group.send(tensor, to).await?;
                group.recv(spec.dtype, count, from).await?
            } else {
                let got = group.recv(spec.dtype, count, from).await?;
                group.send(tensor, to).await?;
                got
            }
        }
    })
}

/// Turns an output back into an input of the right length (outside the
/// timed region): all_gather's output is cut to its first block,
/// reduce_scatter's block grows back to `count * world`.
pub(super) fn reshape(out: Tensor, input_len: usize) -> Tensor {
    let dtype = out.dtype();
    let mut bytes = out.into_bytes();
    bytes.resize(input_len * dtype.size(), 0);
    Tensor::from_bytes(dtype, bytes)
}

/// Measures one size on this rank: warm-up, timed out-of-place calls, timed
/// in-place calls, then (with `--check`) one checked call of each.
pub(super) async fn measure(group: &ProcessGroup, spec: &Spec, count: usize) -> Result<Raw> {
    let (rank, world) = (group.rank(), group.world_size());
    let len = spec.op.input_len(count, world);
    let input = make_tensor(spec.dtype, len, |i| input_value(rank, i));
    let mut raw = Raw::default();
    // Out of place: the input survives. An all-reduce reads it in place
    // (`all_reduce_into`, nccl-tests' sendbuff != recvbuff) into the buffer
    // the previous call handed back; the other collectives first copy it
    // there (no allocation), as a caller keeping its input would.
    let mut buffer = input.clone();
    let kept = Bytes::from(input.as_bytes().to_vec());
    for i in 0..spec.warmup + spec.iters {
        let started = Instant::now();
        let out = if spec.op == BenchOp::AllReduce {
            group.all_reduce_into(kept.clone(), buffer, spec.redop).await?
        } else {
            let mut bytes = buffer.into_bytes();
            bytes.copy_from_slice(input.as_bytes());
            call(group, spec, count, Tensor::from_bytes(spec.dtype, bytes)).await?
        };
        let took = started.elapsed().as_secs_f64() * 1e6;
        buffer = reshape(out, len);
        if i >= spec.warmup {
            raw.oop.push(took);
        }
    }
    // --memory: the peak of the in-place half, where the caller holds one
    // tensor and everything above it is chorus's (the input kept for the
    // out-of-place half, in both its forms, goes first unless --check
    // needs it).
    drop(kept);
    let input = (spec.check || !spec.memory).then_some(input);
    if spec.memory {
        reset_peak_rss();
    }
    // In place: the buffer handed back is the next input.
    for i in 0..spec.warmup + spec.iters {
        let started = Instant::now();
        let out = call(group, spec, count, buffer).await?;
        let took = started.elapsed().as_secs_f64() * 1e6;
        buffer = reshape(out, len);
        if i >= spec.warmup {
            raw.ip.push(took);
        }
    }
    if spec.memory {
        raw.peak_rss = peak_rss();
    }
    drop(buffer);
    if let Some(input) = input.filter(|_| spec.check) {
        let out = call(group, spec, count, input.clone()).await?;
        raw.wrong_oop = Some(count_wrong(spec, rank, world, count, &out));
        drop(out);
        let out = call(group, spec, count, input).await?;
        raw.wrong_ip = Some(count_wrong(spec, rank, world, count, &out));
    }
    Ok(raw)
}
