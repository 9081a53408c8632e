//! `chorus selftest`: every collective against a naive reference, run by
//! every rank of a real group (the `--check` of nccl-tests, for the whole
//! API). Inputs are small integers derived from the rank, exact in every
//! dtype and in any summation order, so each rank computes the expected
//! result on its own.

use bytes::Bytes;
use chorus_runtime::collective::{DType, ReduceOp};
use half::{bf16, f16};
use thiserror::Error;

use chorus::group::ProcessGroup;
use chorus::tensor::Tensor;

/// A collective returned a wrong result or failed.
#[derive(Debug, Error)]
#[error("selftest: {what} ({dtype}, {count} elements per rank, world {world}) on rank {rank}: {detail}")]
pub struct SelfTestError {
    /// The collective checked.
    pub what: String,
    /// Its dtype.
    pub dtype: DType,
    /// Elements per rank.
    pub count: usize,
    /// The world size.
    pub world: usize,
    /// The rank that saw it.
    pub rank: usize,
    /// What went wrong.
    pub detail: String,
}

/// Every dtype the collectives support.
pub const ALL_DTYPES: [DType; 10] = DType::ALL;

/// Rank `rank`'s values: 1 to 5, so sums over 8 ranks fit even in `i8`.
fn input(rank: usize, count: usize) -> Vec<i64> {
    (0..count).map(|i| ((rank * 7 + i * 3) % 5) as i64 + 1).collect()
}

fn encode(dtype: DType, values: &[i64]) -> Tensor {
    let bytes: Vec<u8> = match dtype {
        DType::Int8 => values.iter().map(|&v| v as i8 as u8).collect(),
        DType::UInt8 => values.iter().map(|&v| v as u8).collect(),
        DType::Int32 => values.iter().flat_map(|&v| (v as i32).to_ne_bytes()).collect(),
        DType::UInt32 => values.iter().flat_map(|&v| (v as u32).to_ne_bytes()).collect(),
        DType::Int64 => values.iter().flat_map(|&v| v.to_ne_bytes()).collect(),
        DType::UInt64 => values.iter().flat_map(|&v| (v as u64).to_ne_bytes()).collect(),
        DType::Float16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v as f32).to_ne_bytes())
            .collect(),
        DType::BFloat16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v as f32).to_ne_bytes())
            .collect(),
        DType::Float32 => values.iter().flat_map(|&v| (v as f32).to_ne_bytes()).collect(),
        DType::Float64 => values.iter().flat_map(|&v| (v as f64).to_ne_bytes()).collect(),
    };
    Tensor::from_bytes(dtype, bytes)
}

fn decode(t: &Tensor) -> Vec<i64> {
    let b = t.as_bytes();
    let chunks = |n: usize| b.chunks_exact(n);
    match t.dtype() {
        DType::Int8 => b.iter().map(|&v| i64::from(v as i8)).collect(),
        DType::UInt8 => b.iter().map(|&v| i64::from(v)).collect(),
        DType::Int32 => chunks(4)
            .map(|c| i64::from(i32::from_ne_bytes(c.try_into().expect("4"))))
            .collect(),
        DType::UInt32 => chunks(4)
            .map(|c| i64::from(u32::from_ne_bytes(c.try_into().expect("4"))))
            .collect(),
        DType::Int64 => chunks(8)
            .map(|c| i64::from_ne_bytes(c.try_into().expect("8")))
            .collect(),
        DType::UInt64 => chunks(8)
            .map(|c| u64::from_ne_bytes(c.try_into().expect("8")) as i64)
            .collect(),
        DType::Float16 => chunks(2)
            .map(|c| f16::from_ne_bytes(c.try_into().expect("2")).to_f32() as i64)
            .collect(),
        DType::BFloat16 => chunks(2)
            .map(|c| bf16::from_ne_bytes(c.try_into().expect("2")).to_f32() as i64)
            .collect(),
        DType::Float32 => chunks(4)
            .map(|c| f32::from_ne_bytes(c.try_into().expect("4")) as i64)
            .collect(),
        DType::Float64 => chunks(8)
            .map(|c| f64::from_ne_bytes(c.try_into().expect("8")) as i64)
            .collect(),
    }
}

fn reduce(op: ReduceOp, columns: &[Vec<i64>]) -> Vec<i64> {
    let count = columns.first().map_or(0, Vec::len);
    (0..count)
        .map(|i| {
            let mut values = columns.iter().map(|c| c[i]);
            let first = values.next().expect("at least one rank");
            values.fold(first, |a, b| match op {
                ReduceOp::Min => a.min(b),
                ReduceOp::Max => a.max(b),
                ReduceOp::BXor => a ^ b,
                _ => a + b,
            })
        })
        .collect()
}

struct Checker<'a> {
    pg: &'a ProcessGroup,
    dtype: DType,
    count: usize,
    checks: usize,
}

impl Checker<'_> {
    fn fail(&self, what: &str, detail: String) -> SelfTestError {
        SelfTestError {
            what: what.to_string(),
            dtype: self.dtype,
            count: self.count,
            world: self.pg.world_size(),
            rank: self.pg.rank(),
            detail,
        }
    }

    fn expect(
        &mut self,
        what: &str,
        got: Result<Tensor, chorus::CollectiveError>,
        want: &[i64],
    ) -> Result<(), SelfTestError> {
        let got = got.map_err(|e| self.fail(what, e.to_string()))?;
        let got = decode(&got);
        if got != want {
            let wrong = got.iter().zip(want).filter(|(a, b)| a != b).count() + got.len().abs_diff(want.len());
            return Err(self.fail(
                what,
                format!(
                    "{wrong} wrong elements (first values {:?}, expected {:?})",
                    &got[..got.len().min(6)],
                    &want[..want.len().min(6)]
                ),
            ));
        }
        self.checks += 1;
        Ok(())
    }
}

/// Runs every collective with `dtype` and `count` elements per rank on this
/// rank, checking each result; returns how many checks passed.
pub async fn check_collectives(pg: &ProcessGroup, dtype: DType, count: usize) -> Result<usize, SelfTestError> {
    let (rank, world) = (pg.rank(), pg.world_size());
    let mut c = Checker {
        pg,
        dtype,
        count,
        checks: 0,
    };
    let everyone: Vec<Vec<i64>> = (0..world).map(|r| input(r, count)).collect();
    let mine = &everyone[rank];
    let integer = !matches!(
        dtype,
        DType::Float16 | DType::BFloat16 | DType::Float32 | DType::Float64
    );
    let ops: &[ReduceOp] = if integer {
        &[ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::BXor]
    } else {
        &[ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max]
    };
    for &op in ops {
        let got = pg.all_reduce(encode(dtype, mine), op).await;
        c.expect(&format!("all_reduce {op}"), got, &reduce(op, &everyone))?;
    }
    // Out of place into an output holding something else, on every rank,
    // then on odd ranks only (the forms mix within one operation).
    let kept = Bytes::from(encode(dtype, mine).into_bytes());
    for (label, apart) in [
        ("all_reduce_into", true),
        ("all_reduce_into on odd ranks", rank % 2 == 1),
    ] {
        let stale = encode(dtype, &vec![5; count]);
        let got = match apart {
            true => pg.all_reduce_into(kept.clone(), stale, ReduceOp::Sum).await,
            false => pg.all_reduce(encode(dtype, mine), ReduceOp::Sum).await,
        };
        c.expect(label, got, &reduce(ReduceOp::Sum, &everyone))?;
    }
    let root = world - 1;
    let got = pg.reduce(encode(dtype, mine), root, ReduceOp::Sum).await;
    if rank == root {
        c.expect("reduce", got, &reduce(ReduceOp::Sum, &everyone))?;
    } else {
        got.map_err(|e| c.fail("reduce", e.to_string()))?;
    }
    c.expect(
        "broadcast",
        pg.broadcast(encode(dtype, mine), root).await,
        &everyone[root],
    )?;
    c.expect(
        "all_gather",
        pg.all_gather(encode(dtype, mine)).await,
        &everyone.concat(),
    )?;
    let gathered = if rank == 0 { everyone.concat() } else { Vec::new() };
    c.expect("gather", pg.gather(encode(dtype, mine), 0).await, &gathered)?;
    let chunks = (rank == 0).then(|| encode(dtype, &everyone.concat()));
    c.expect("scatter", pg.scatter(chunks, dtype, count, 0).await, mine)?;
    let blocks: Vec<Vec<i64>> = (0..world).map(|r| input(r + 1, count * world)).collect();
    let summed = reduce(ReduceOp::Sum, &blocks);
    let got = pg.reduce_scatter(encode(dtype, &blocks[rank]), ReduceOp::Sum).await;
    c.expect("reduce_scatter", got, &summed[rank * count..(rank + 1) * count])?;
    let exchanged: Vec<i64> = (0..world)
        .flat_map(|r| blocks[r][rank * count..(rank + 1) * count].to_vec())
        .collect();
    c.expect(
        "all_to_all",
        pg.all_to_all(encode(dtype, &blocks[rank])).await,
        &exchanged,
    )?;
    pg.barrier().await.map_err(|e| c.fail("barrier", e.to_string()))?;
    if world > 1 {
        let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
        let sending = pg.send(encode(dtype, mine), next);
        let receiving = pg.recv(dtype, count, prev);
        sending.await.map_err(|e| c.fail("send", e.to_string()))?;
        c.expect("send/recv", receiving.await, &everyone[prev])?;
    }
    Ok(c.checks)
}

/// Splits the group into even and odd ranks with `new_group` (every rank
/// calls it twice, as PyTorch requires), all-reduces inside each subgroup and,
/// at the same time, in the whole group; checks all three results.
pub async fn check_subgroups(pg: &ProcessGroup) -> Result<usize, SelfTestError> {
    let (rank, world) = (pg.rank(), pg.world_size());
    let fail = |what: &str, detail: String| SelfTestError {
        what: what.to_string(),
        dtype: DType::Int64,
        count: 1,
        world,
        rank,
        detail,
    };
    let evens: Vec<usize> = (0..world).step_by(2).collect();
    let odds: Vec<usize> = (1..world).step_by(2).collect();
    let even_group = pg
        .new_group(&evens)
        .await
        .map_err(|e| fail("new_group(evens)", e.to_string()))?;
    let odd_group = if odds.is_empty() {
        None
    } else {
        pg.new_group(&odds)
            .await
            .map_err(|e| fail("new_group(odds)", e.to_string()))?
    };
    let (mine, members) = match (&even_group, &odd_group) {
        (Some(group), _) => (group, &evens),
        (None, Some(group)) => (group, &odds),
        (None, None) => return Err(fail("new_group", "this rank is in neither subgroup".into())),
    };
    if mine.world_size() != members.len() || members[mine.rank()] != rank {
        return Err(fail(
            "new_group",
            format!(
                "subgroup rank {} of {} for members {members:?}",
                mine.rank(),
                mine.world_size()
            ),
        ));
    }
    let value = Tensor::from_slice(&[rank as i64 + 1]);
    let sub = mine.all_reduce(value.clone(), ReduceOp::Sum);
    let whole = pg.all_reduce(value, ReduceOp::Sum);
    let sub = sub.await.map_err(|e| fail("subgroup all_reduce", e.to_string()))?;
    let whole = whole
        .await
        .map_err(|e| fail("all_reduce beside a subgroup's", e.to_string()))?;
    let want_sub: i64 = members.iter().map(|&r| r as i64 + 1).sum();
    let want_whole = (world * (world + 1) / 2) as i64;
    if decode(&sub) != [want_sub] || decode(&whole) != [want_whole] {
        return Err(fail(
            "subgroups",
            format!(
                "got {:?} and {:?}, expected {want_sub} and {want_whole}",
                decode(&sub),
                decode(&whole)
            ),
        ));
    }
    Ok(2)
}

/// Which backend `chorus selftest` checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SelfTestBackend {
    /// The CPU backend: every collective and dtype, over the mesh.
    #[default]
    Cpu,
    /// The NCCL backend, one GPU per process (see `nccl::run`).
    Nccl,
}

/// `chorus selftest --backend nccl`: one rank per GPU (as torchrun starts
/// them) forms an NCCL communicator through the job's store and checks
/// all-reduce, broadcast, all-gather and reduce-scatter on the device
/// against a reference computed on the host, for a few sizes and dtypes.
///
/// Inputs are small integers (rank `r` holds `r + 1 + i % 5` at index `i`),
/// exact in every dtype checked and in any summation order, so each rank
/// knows every expected element on its own and one wrong element is an
/// error naming the operation, its size, the index, the expected value and
/// the value found.
pub mod nccl {
    use std::fmt;
    use std::time::{Duration, Instant};

    use chorus_actors::nccl::{
        Backend, Communicator, CudaBackend, NcclError, NcclGroup, NcclOp, NcclOpError, NcclVersion, ProbeError, probe,
    };
    use chorus_runtime::collective::{DType, ReduceOp};
    use chorus_runtime::rendezvous::InitMethod;
    use half::{bf16, f16};
    use thiserror::Error;

    use super::encode;
    use chorus::InitOptions;
    use chorus::nccl_group::{NcclInitError, init_nccl_group};

    /// Elements per rank checked by default: one element, an odd size that
    /// no NCCL chunking divides, and 1 Mi elements, enough for every
    /// channel and protocol switch of a single node.
    pub const DEFAULT_COUNTS: [usize; 3] = [1, 4099, 1 << 20];

    /// The dtypes checked: the training ones and an integer one.
    pub const DTYPES: [DType; 4] = [DType::Float32, DType::BFloat16, DType::Float16, DType::Int32];

    /// How many distinct values an input cycles through (`i % PERIOD`).
    const PERIOD: usize = 5;

    /// One collective the selftest checks.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Check {
        /// Sum of every rank's input, out of place.
        AllReduce,
        /// The last rank's input, in place (a non-zero root catches a root
        /// mixed up with rank 0).
        Broadcast,
        /// Every rank's input, in rank order.
        AllGather,
        /// This rank's block of the sum of every rank's `world` blocks.
        ReduceScatter,
    }

    /// Every check, in the order run.
    pub const CHECKS: [Check; 4] = [
        Check::AllReduce,
        Check::Broadcast,
        Check::AllGather,
        Check::ReduceScatter,
    ];

    /// Rank `rank`'s input value at `index`.
    pub fn value(rank: usize, index: usize) -> i64 {
        (rank + 1 + index % PERIOD) as i64
    }

    impl Check {
        /// The operation for `count` elements per rank in a world of `world`.
        pub fn op(self, dtype: DType, count: usize, world: usize) -> NcclOp {
            match self {
                Check::AllReduce => NcclOp::all_reduce(dtype, count, ReduceOp::Sum),
                Check::Broadcast => NcclOp::broadcast(dtype, count, world - 1),
                Check::AllGather => NcclOp::all_gather(dtype, count),
                Check::ReduceScatter => NcclOp::reduce_scatter(dtype, count, ReduceOp::Sum),
            }
        }

        /// Whether it runs in place (the input is the output buffer).
        pub fn in_place(self) -> bool {
            self == Check::Broadcast
        }

        /// Rank `rank`'s input: `count` elements, `count * world` for
        /// reduce-scatter.
        pub fn input(self, rank: usize, world: usize, count: usize) -> Vec<i64> {
            let len = if self == Check::ReduceScatter {
                count * world
            } else {
                count
            };
            (0..len).map(|i| value(rank, i)).collect()
        }

        /// What rank `rank` must hold afterwards, computed naively from
        /// every rank's input.
        pub fn expected(self, rank: usize, world: usize, count: usize) -> Vec<i64> {
            let inputs: Vec<Vec<i64>> = (0..world).map(|r| self.input(r, world, count)).collect();
            let sum = |range: std::ops::Range<usize>| -> Vec<i64> {
                range.map(|i| inputs.iter().map(|input| input[i]).sum()).collect()
            };
            match self {
                Check::AllReduce => sum(0..count),
                Check::Broadcast => inputs[world - 1].clone(),
                Check::AllGather => inputs.concat(),
                Check::ReduceScatter => sum(rank * count..(rank + 1) * count),
            }
        }
    }

    /// The largest value any check of a world of `world` produces (an
    /// all-reduced or reduce-scattered element at `i % PERIOD == PERIOD - 1`).
    pub fn largest_value(world: usize) -> i64 {
        (world * (world + 1) / 2 + world * (PERIOD - 1)) as i64
    }

    /// The largest integer below which `dtype` holds every integer exactly.
    pub fn exact_limit(dtype: DType) -> i64 {
        match dtype {
            DType::BFloat16 => 1 << 8,
            DType::Float16 => 1 << 11,
            DType::Float32 => 1 << 24,
            DType::Float64 => 1 << 53,
            DType::Int8 => i64::from(i8::MAX),
            DType::UInt8 => i64::from(u8::MAX),
            DType::Int32 => i64::from(i32::MAX),
            DType::UInt32 => i64::from(u32::MAX),
            DType::Int64 | DType::UInt64 => i64::MAX,
        }
    }

    /// Whether every value of a world of `world` is exact in `dtype`
    /// (bfloat16 stops being exact past 18 ranks: the check is skipped
    /// there rather than reporting rounding as a fault).
    pub fn exact(dtype: DType, world: usize) -> bool {
        largest_value(world) <= exact_limit(dtype)
    }

    /// Element values of `bytes` as `f64`, which holds every value of the
    /// checked dtypes exactly, so a wrong one is shown as it is (3.5, NaN).
    pub fn to_f64(dtype: DType, bytes: &[u8]) -> Vec<f64> {
        let chunks = |n: usize| bytes.chunks_exact(n);
        match dtype {
            DType::Float32 => chunks(4)
                .map(|c| f64::from(f32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
            DType::BFloat16 => chunks(2).map(|c| bf16::from_ne_bytes([c[0], c[1]]).to_f64()).collect(),
            DType::Float16 => chunks(2).map(|c| f16::from_ne_bytes([c[0], c[1]]).to_f64()).collect(),
            DType::Int32 => chunks(4)
                .map(|c| f64::from(i32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
                .collect(),
            other => super::decode(&chorus::tensor::Tensor::from_bytes(other, bytes.to_vec()))
                .into_iter()
                .map(|v| v as f64)
                .collect(),
        }
    }

    /// The first element of `got` that differs from `want`.
    #[derive(Debug, Clone, Copy, PartialEq)]
    pub struct Mismatch {
        /// Its index (the length of the shorter one when only the lengths differ).
        pub index: usize,
        /// The value found (`None` past the end of `got`).
        pub got: Option<f64>,
        /// The value expected (`None` past the end of `want`).
        pub expected: Option<i64>,
        /// How many elements are wrong in all.
        pub wrong: usize,
    }

    /// Compares a result with its expected values.
    pub fn first_mismatch(got: &[f64], want: &[i64]) -> Option<Mismatch> {
        let differs = |(g, w): (&f64, &i64)| *g != *w as f64;
        let wrong = got.iter().zip(want).filter(|&pair| differs(pair)).count() + got.len().abs_diff(want.len());
        if wrong == 0 {
            return None;
        }
        let index = got
            .iter()
            .zip(want)
            .position(differs)
            .unwrap_or(got.len().min(want.len()));
        Some(Mismatch {
            index,
            got: got.get(index).copied(),
            expected: want.get(index).copied(),
            wrong,
        })
    }

    fn shown<T: fmt::Display>(value: Option<T>) -> String {
        value.map_or_else(|| "nothing (past the end)".to_string(), |v| v.to_string())
    }

    /// `chorus selftest --backend nccl` failed on this rank.
    #[derive(Debug, Error)]
    pub enum NcclSelfTestError {
        /// CUDA or NCCL cannot be used here: the probe's message.
        #[error("{0}")]
        Unavailable(#[from] ProbeError),
        /// A count NCCL cannot be checked with.
        #[error("--counts must list element counts of at least 1 for the nccl backend, got {counts:?}")]
        BadCounts {
            /// The counts given.
            counts: Vec<usize>,
        },
        /// Rank, world and store could not be resolved, or the group could
        /// not be formed.
        #[error(transparent)]
        Init(#[from] NcclInitError),
        /// Copying to or from the device failed.
        #[error("rank {rank}: {operation}: copying between host and device: {source}")]
        Transfer {
            /// The rank.
            rank: usize,
            /// The operation checked.
            operation: String,
            /// What failed.
            #[source]
            source: NcclError,
        },
        /// The operation itself failed.
        #[error("rank {rank}: {operation}: {source}")]
        Operation {
            /// The rank.
            rank: usize,
            /// The operation checked.
            operation: String,
            /// What failed.
            #[source]
            source: NcclOpError,
        },
        /// The operation completed with a wrong result.
        #[error(
            "rank {rank}: {operation} of world {world}: element {index} is {got}, expected {expected} ({wrong} of {len} \
             elements wrong)",
            index = mismatch.index,
            got = shown(mismatch.got),
            expected = shown(mismatch.expected),
            wrong = mismatch.wrong
        )]
        Wrong {
            /// The rank.
            rank: usize,
            /// The world size.
            world: usize,
            /// The operation (kind, dtype, elements per rank).
            operation: String,
            /// Elements expected.
            len: usize,
            /// The first wrong element.
            mismatch: Mismatch,
        },
    }

    impl NcclSelfTestError {
        /// The process's exit code: 2 where nothing ran because CUDA or NCCL
        /// is missing or the input must change (the launcher reports it as
        /// the worker's code), 1 for failures while running.
        pub fn exit_code(&self) -> u8 {
            match self {
                Self::Unavailable(_)
                | Self::BadCounts { .. }
                | Self::Init(NcclInitError::Unavailable(_) | NcclInitError::TooFewDevices { .. }) => 2,
                _ => 1,
            }
        }
    }

    /// Host-device copies, for the backends a selftest runs on.
    pub trait Device: Backend {
        /// A device buffer holding `bytes`.
        fn upload(&self, bytes: &[u8]) -> Result<<Self::Comm as Communicator>::Buffer, NcclError>;
        /// A device buffer of `len` zero bytes.
        fn zeros(&self, len: usize) -> Result<<Self::Comm as Communicator>::Buffer, NcclError>;
        /// The contents of `buffer` once the work before it is done.
        fn download(&self, buffer: &<Self::Comm as Communicator>::Buffer) -> Result<Vec<u8>, NcclError>;
    }

    impl Device for CudaBackend {
        fn upload(&self, bytes: &[u8]) -> Result<chorus_actors::nccl::CudaBuffer, NcclError> {
            CudaBackend::upload(self, bytes)
        }
        fn zeros(&self, len: usize) -> Result<chorus_actors::nccl::CudaBuffer, NcclError> {
            CudaBackend::zeros(self, len)
        }
        fn download(&self, buffer: &chorus_actors::nccl::CudaBuffer) -> Result<Vec<u8>, NcclError> {
            CudaBackend::download(self, buffer)
        }
    }

    /// Runs every check for every dtype in [`DTYPES`] and count in
    /// `counts` on this rank of `group`, calling `report` with one line per
    /// check as it passes; returns how many passed.
    pub async fn check_group<D: Device>(
        group: &NcclGroup<D::Comm>,
        device: &D,
        counts: &[usize],
        report: &mut (dyn FnMut(&str) + Send),
    ) -> Result<usize, NcclSelfTestError> {
        let (rank, world) = (group.rank(), group.world());
        let mut passed = 0;
        for dtype in DTYPES {
            if !exact(dtype, world) {
                report(&format!(
                    "selftest nccl rank={rank}: {dtype} skipped: sums up to {} are not exact in it",
                    largest_value(world)
                ));
                continue;
            }
            for &count in counts {
                for check in CHECKS {
                    let op = check.op(dtype, count, world);
                    let operation = op.to_string();
                    let transfer = |source| NcclSelfTestError::Transfer {
                        rank,
                        operation: operation.clone(),
                        source,
                    };
                    let input = device
                        .upload(encode(dtype, &check.input(rank, world, count)).as_bytes())
                        .map_err(transfer)?;
                    let (input, output) = if check.in_place() {
                        (None, input)
                    } else {
                        (
                            Some(input),
                            device.zeros(op.output_bytes(world, rank)).map_err(transfer)?,
                        )
                    };
                    let started = Instant::now();
                    let output = group
                        .run(op, input, output)
                        .await
                        .map_err(|source| NcclSelfTestError::Operation {
                            rank,
                            operation: operation.clone(),
                            source,
                        })?;
                    let took = started.elapsed();
                    let got = to_f64(dtype, &device.download(&output).map_err(transfer)?);
                    let want = check.expected(rank, world, count);
                    if let Some(mismatch) = first_mismatch(&got, &want) {
                        return Err(NcclSelfTestError::Wrong {
                            rank,
                            world,
                            operation,
                            len: want.len(),
                            mismatch,
                        });
                    }
                    passed += 1;
                    report(&format!(
                        "selftest nccl rank={rank}: {operation} ok ({:.3} ms)",
                        took.as_secs_f64() * 1e3
                    ));
                }
            }
        }
        Ok(passed)
    }

    /// What a rank that passed reports.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Summary {
        /// The rank.
        pub rank: usize,
        /// The world size.
        pub world: usize,
        /// Its device's name.
        pub device: String,
        /// The NCCL version.
        pub nccl: NcclVersion,
        /// Checks passed.
        pub checks: usize,
    }

    impl fmt::Display for Summary {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(
                f,
                "selftest nccl ok rank={} world={} device={} nccl={}",
                self.rank, self.world, self.device, self.nccl
            )
        }
    }

    /// One rank of `chorus selftest --backend nccl`: probes CUDA and NCCL
    /// (first: where they are missing nothing else runs), resolves rank,
    /// world and store from `init` and the launcher's environment as the CPU
    /// selftest does, uses the GPU of its local rank, forms the communicator
    /// through the store (waiting up to `timeout`), runs [`check_group`]
    /// with operations timing out after `timeout`, and leaves with the
    /// others.
    pub async fn run(
        init: &str,
        timeout: Duration,
        counts: &[usize],
        report: &mut (dyn FnMut(&str) + Send),
    ) -> Result<Summary, NcclSelfTestError> {
        if counts.is_empty() || counts.contains(&0) {
            return Err(NcclSelfTestError::BadCounts {
                counts: counts.to_vec(),
            });
        }
        // Probed first: where CUDA or NCCL is missing nothing else runs.
        probe()?;
        let options = InitOptions {
            init_method: InitMethod::parse(init).map_err(NcclInitError::from)?,
            timeout,
            collective_timeout: timeout,
            ..InitOptions::default()
        };
        let formed = init_nccl_group(options).await?;
        let (rank, world) = (formed.rank(), formed.world_size());
        let backend = formed.backend().clone();
        let device = backend.device_name().map_err(|source| NcclInitError::Device {
            rank,
            local_rank: formed.local_rank(),
            source,
        })?;
        let checks = check_group(formed.group(), &backend, counts, report).await?;
        formed.destroy().await?;
        Ok(Summary {
            rank,
            world,
            device,
            nccl: backend.nccl_version(),
            checks,
        })
    }

    #[cfg(test)]
    mod tests {
        use std::sync::Arc;

        use chorus_actors::nccl::fake::{FakeBackend, FakeBuffer, FakeComm};
        use chorus_actors::nccl::{CommKey, NcclGroupConfig, UniqueId, init_communicator};
        use chorus_runtime::store::HashStore;

        use super::*;

        #[test]
        fn expected_values_per_op_by_hand() {
            // World 2, 3 elements: rank 0 holds 1 2 3, rank 1 holds 2 3 4.
            assert_eq!(Check::AllReduce.input(0, 2, 3), [1, 2, 3]);
            assert_eq!(Check::AllReduce.input(1, 2, 3), [2, 3, 4]);
            for rank in 0..2 {
                assert_eq!(Check::AllReduce.expected(rank, 2, 3), [3, 5, 7]);
                assert_eq!(
                    Check::Broadcast.expected(rank, 2, 3),
                    [2, 3, 4],
                    "the root is the last rank"
                );
                assert_eq!(Check::AllGather.expected(rank, 2, 3), [1, 2, 3, 2, 3, 4]);
            }
            // Reduce-scatter of 2 per rank: inputs 1 2 3 4 and 2 3 4 5 sum to 3 5 7 9.
            assert_eq!(Check::ReduceScatter.input(1, 2, 2), [2, 3, 4, 5]);
            assert_eq!(Check::ReduceScatter.expected(0, 2, 2), [3, 5]);
            assert_eq!(Check::ReduceScatter.expected(1, 2, 2), [7, 9]);
            let op = Check::Broadcast.op(DType::Float32, 3, 4);
            assert_eq!(op.to_string(), "broadcast(float32 x 3, root 3)");
            assert!(Check::Broadcast.in_place() && !Check::AllGather.in_place());
        }

        #[test]
        fn all_reduce_sums_rank_plus_one_per_element() {
            for world in 1..=8 {
                let got = Check::AllReduce.expected(0, world, 12);
                for (i, v) in got.iter().enumerate() {
                    let ranks: i64 = (1..=world as i64).sum();
                    assert_eq!(*v, ranks + (world * (i % PERIOD)) as i64, "world {world} index {i}");
                }
                let largest = [
                    Check::AllReduce,
                    Check::ReduceScatter,
                    Check::AllGather,
                    Check::Broadcast,
                ]
                .iter()
                .flat_map(|c| (0..world).flat_map(move |r| c.expected(r, world, 7)))
                .max()
                .unwrap();
                assert_eq!(largest, largest_value(world), "world {world}");
            }
        }

        #[test]
        fn half_dtypes_are_checked_only_where_exact() {
            assert!(exact(DType::BFloat16, 8) && exact(DType::Float16, 8) && exact(DType::Int32, 8));
            // 18 ranks: sums up to 243; 19: 266, past bfloat16's 256.
            assert!(exact(DType::BFloat16, 18) && !exact(DType::BFloat16, 19));
            assert!(exact(DType::Float16, 19) && exact(DType::Float32, 1024));
            for dtype in DTYPES {
                let values: Vec<i64> = (0..=largest_value(18)).collect();
                let back = to_f64(dtype, encode(dtype, &values).as_bytes());
                assert_eq!(first_mismatch(&back, &values), None, "{dtype}");
            }
            // Past the limit bfloat16 rounds: 257 is not representable.
            assert_eq!(
                to_f64(DType::BFloat16, encode(DType::BFloat16, &[257]).as_bytes()),
                [256.0]
            );
        }

        #[test]
        fn a_mismatch_names_the_first_wrong_element() {
            assert_eq!(first_mismatch(&[1.0, 2.0], &[1, 2]), None);
            let m = first_mismatch(&[1.0, 2.5, 9.0, 4.0], &[1, 2, 3, 4]).unwrap();
            assert_eq!((m.index, m.got, m.expected, m.wrong), (1, Some(2.5), Some(2), 2));
            let short = first_mismatch(&[1.0], &[1, 2, 3]).unwrap();
            assert_eq!(
                (short.index, short.got, short.expected, short.wrong),
                (1, None, Some(2), 2)
            );
            let nan = first_mismatch(&[f64::NAN], &[1]).unwrap();
            let error = NcclSelfTestError::Wrong {
                rank: 1,
                world: 2,
                operation: "all_reduce(float32 x 1, sum)".into(),
                len: 1,
                mismatch: nan,
            };
            assert_eq!(
                error.to_string(),
                "rank 1: all_reduce(float32 x 1, sum) of world 2: element 0 is NaN, expected 1 (1 of 1 elements wrong)"
            );
            assert_eq!(error.exit_code(), 1);
            assert_eq!(NcclSelfTestError::BadCounts { counts: vec![0] }.exit_code(), 2);
        }

        /// The fake communicator, with a download that can corrupt one element.
        #[derive(Clone, Default)]
        struct Fake {
            inner: FakeBackend,
            corrupt: Option<usize>,
        }

        impl Backend for Fake {
            type Comm = FakeComm;
            fn unique_id(&self) -> Result<UniqueId, NcclError> {
                self.inner.unique_id()
            }
            fn init(&self, id: &UniqueId, rank: usize, world: usize) -> Result<FakeComm, NcclError> {
                self.inner.init(id, rank, world)
            }
        }

        impl Device for Fake {
            fn upload(&self, bytes: &[u8]) -> Result<FakeBuffer, NcclError> {
                Ok(FakeBuffer::from_host(bytes.to_vec()))
            }
            fn zeros(&self, len: usize) -> Result<FakeBuffer, NcclError> {
                Ok(FakeBuffer::zeros(len))
            }
            fn download(&self, buffer: &FakeBuffer) -> Result<Vec<u8>, NcclError> {
                let mut bytes = buffer.to_host();
                if let Some(byte) = self.corrupt.filter(|&b| b < bytes.len()) {
                    bytes[byte] ^= 0x40;
                }
                Ok(bytes)
            }
        }

        async fn within<T>(secs: u64, future: impl std::future::Future<Output = T>) -> T {
            tokio::time::timeout(Duration::from_secs(secs), future)
                .await
                .unwrap_or_else(|_| panic!("did not finish within {secs}s"))
        }

        /// Every rank of an in-process group runs `check_group` on `backend`
        /// (its corruption on rank 0 only);
        /// returns each rank's result and the lines it reported.
        async fn run_fake(world: usize, backend: Fake, counts: &[usize]) -> Vec<(Result<usize, String>, Vec<String>)> {
            let store = Arc::new(HashStore::new(Duration::from_secs(10)));
            let tasks: Vec<_> = (0..world)
                .map(|rank| {
                    // Only rank 0's downloads are corrupted: a peer that saw a
                    // wrong element first would abort the group under rank 0,
                    // which would then report the abort instead.
                    let backend = match rank {
                        0 => backend.clone(),
                        _ => Fake {
                            corrupt: None,
                            ..backend.clone()
                        },
                    };
                    let (store, counts) = (store.clone(), counts.to_vec());
                    tokio::spawn(async move {
                        let key = CommKey::world("selftest", 0);
                        let comm = init_communicator(&backend, &*store, &key, rank, world, Duration::from_secs(10))
                            .await
                            .unwrap();
                        let config = NcclGroupConfig {
                            timeout: Duration::from_secs(10),
                            ..NcclGroupConfig::default()
                        };
                        let group = NcclGroup::start(comm, config).unwrap();
                        let mut lines = Vec::new();
                        let result = check_group(&group, &backend, &counts, &mut |l| lines.push(l.to_string())).await;
                        if result.is_err() {
                            // A rank that stops checking leaves its peers waiting in a collective.
                            group.abort("a peer's check failed");
                        }
                        (result.map_err(|e| e.to_string()), lines)
                    })
                })
                .collect();
            let mut results = Vec::new();
            for task in tasks {
                results.push(within(60, task).await.unwrap());
            }
            results
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn every_check_passes_on_the_fake_communicator() {
            let counts = [1, 7, 300];
            for world in [1, 3] {
                let results = run_fake(world, Fake::default(), &counts).await;
                for (rank, (result, lines)) in results.into_iter().enumerate() {
                    let want = DTYPES.len() * counts.len() * CHECKS.len();
                    assert_eq!(result, Ok(want), "world {world} rank {rank}: {lines:#?}");
                    assert_eq!(lines.len(), want);
                    assert!(
                        lines.iter().any(|l| l.starts_with(&format!(
                            "selftest nccl rank={rank}: reduce_scatter(bfloat16 x 300, sum) ok"
                        ))),
                        "{lines:#?}"
                    );
                }
            }
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn a_wrong_element_names_the_op_size_index_expected_and_got() {
            // Byte 9 is in float32 element 2 (7.0): a mantissa bit flips.
            let backend = Fake {
                corrupt: Some(9),
                ..Fake::default()
            };
            let results = run_fake(2, backend, &[4]).await;
            let (result, lines) = &results[0];
            assert!(lines.is_empty(), "{lines:#?}");
            let error = result.as_ref().unwrap_err();
            assert!(
                error.starts_with("rank 0: all_reduce(float32 x 4, sum) of world 2: element 2 is ")
                    && error.ends_with(", expected 7 (1 of 4 elements wrong)"),
                "{error}"
            );
        }
    }
}
