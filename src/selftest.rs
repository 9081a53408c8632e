//! `chorus selftest`: every collective against a naive reference, run by
//! every rank of a real group (the `--check` of nccl-tests, for the whole
//! API). Inputs are small integers derived from the rank, exact in every
//! dtype and in any summation order, so each rank computes the expected
//! result on its own.

use chorus_runtime::collective::{DType, ReduceOp};
use half::{bf16, f16};
use thiserror::Error;

use crate::group::ProcessGroup;
use crate::tensor::Tensor;

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
        got: Result<Tensor, crate::CollectiveError>,
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
