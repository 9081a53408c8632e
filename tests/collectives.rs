//! Every collective, for ranks in one process (`chorus::spawn`), against a
//! naive reference, for world sizes 1 to 8; plus desync detection.

use std::time::Duration;

use chorus::{CollectiveError, DType, ReduceOp, Tensor, spawn};

/// Fails the test with a message instead of hanging.
async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within 60s"))
}

/// Rank `rank`'s input: small integers, exact in every dtype and any order.
fn input(rank: usize, count: usize) -> Vec<i64> {
    (0..count).map(|i| ((rank * 7 + i * 3) % 5) as i64 + 1).collect()
}

fn tensor(dtype: DType, values: &[i64]) -> Tensor {
    let bytes: Vec<u8> = match dtype {
        DType::Int32 => values.iter().flat_map(|&v| (v as i32).to_ne_bytes()).collect(),
        DType::Int64 => values.iter().flat_map(|&v| v.to_ne_bytes()).collect(),
        DType::Float32 => values.iter().flat_map(|&v| (v as f32).to_ne_bytes()).collect(),
        DType::Float64 => values.iter().flat_map(|&v| (v as f64).to_ne_bytes()).collect(),
        DType::BFloat16 => values.iter().flat_map(|&v| half::bf16::from_f32(v as f32).to_ne_bytes()).collect(),
        DType::UInt8 => values.iter().map(|&v| v as u8).collect(),
        other => panic!("no test encoding for {other}"),
    };
    Tensor::from_bytes(dtype, bytes)
}

fn values(t: &Tensor) -> Vec<i64> {
    match t.dtype() {
        DType::Int32 => t.to_vec::<i32>().unwrap().into_iter().map(i64::from).collect(),
        DType::Int64 => t.to_vec::<i64>().unwrap(),
        DType::Float32 => t.to_vec::<f32>().unwrap().into_iter().map(|v| v as i64).collect(),
        DType::Float64 => t.to_vec::<f64>().unwrap().into_iter().map(|v| v as i64).collect(),
        DType::BFloat16 => t.to_vec::<half::bf16>().unwrap().into_iter().map(|v| v.to_f32() as i64).collect(),
        DType::UInt8 => t.to_vec::<u8>().unwrap().into_iter().map(i64::from).collect(),
        other => panic!("no test decoding for {other}"),
    }
}

fn reduce(op: ReduceOp, columns: impl Iterator<Item = Vec<i64>>, world: usize) -> Vec<i64> {
    let columns: Vec<Vec<i64>> = columns.collect();
    let count = columns[0].len();
    (0..count)
        .map(|i| {
            let mut it = columns.iter().map(|c| c[i]);
            let first = it.next().unwrap();
            let folded = it.fold(first, |a, b| match op {
                ReduceOp::Sum | ReduceOp::Avg => a + b,
                ReduceOp::Prod => a * b,
                ReduceOp::Min => a.min(b),
                ReduceOp::Max => a.max(b),
                ReduceOp::BAnd => a & b,
                ReduceOp::BOr => a | b,
                ReduceOp::BXor => a ^ b,
            });
            if op == ReduceOp::Avg { folded / world as i64 } else { folded }
        })
        .collect()
}

async fn check_world(world: usize, dtype: DType, count: usize) {
    let results = spawn(world, move |pg| async move {
        let rank = pg.rank();
        let mine = input(rank, count);
        let everyone: Vec<Vec<i64>> = (0..world).map(|r| input(r, count)).collect();
        let ops: &[ReduceOp] = if matches!(dtype, DType::Int32 | DType::Int64 | DType::UInt8) {
            &[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::BXor]
        } else {
            &[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min]
        };
        for &op in ops {
            let got = pg.all_reduce(tensor(dtype, &mine), op).await.unwrap();
            assert_eq!(values(&got), reduce(op, everyone.iter().cloned(), world), "all_reduce {op} {dtype} world {world} count {count}");
        }
        let root = world - 1;
        let got = pg.reduce(tensor(dtype, &mine), root, ReduceOp::Sum).await.unwrap();
        if rank == root {
            assert_eq!(values(&got), reduce(ReduceOp::Sum, everyone.iter().cloned(), world), "reduce");
        }
        let got = pg.broadcast(tensor(dtype, &mine), root).await.unwrap();
        assert_eq!(values(&got), everyone[root], "broadcast");
        let got = pg.all_gather(tensor(dtype, &mine)).await.unwrap();
        assert_eq!(values(&got), everyone.concat(), "all_gather");
        let got = pg.gather(tensor(dtype, &mine), 0).await.unwrap();
        assert_eq!(values(&got), if rank == 0 { everyone.concat() } else { vec![] }, "gather");
        let chunks = (rank == 0).then(|| tensor(dtype, &everyone.concat()));
        let got = pg.scatter(chunks, dtype, count, 0).await.unwrap();
        assert_eq!(values(&got), everyone[rank], "scatter");
        // reduce_scatter / all_to_all: every rank contributes world blocks.
        let blocks: Vec<Vec<i64>> = (0..world).map(|r| input(r + rank, count * world)).collect();
        let got = pg.reduce_scatter(tensor(dtype, &blocks[0]), ReduceOp::Sum).await.unwrap();
        let expected_block: Vec<i64> = reduce(ReduceOp::Sum, (0..world).map(|r| input(r, count * world)), world)
            [rank * count..(rank + 1) * count]
            .to_vec();
        assert_eq!(values(&got), expected_block, "reduce_scatter");
        let got = pg.all_to_all(tensor(dtype, &input(rank, count * world))).await.unwrap();
        let expected: Vec<i64> = (0..world).flat_map(|r| input(r, count * world)[rank * count..(rank + 1) * count].to_vec()).collect();
        assert_eq!(values(&got), expected, "all_to_all");
        pg.barrier().await.unwrap();
        if world > 1 {
            let next = (rank + 1) % world;
            let prev = (rank + world - 1) % world;
            let sending = pg.send(tensor(dtype, &mine), next);
            let got = pg.recv(dtype, count, prev);
            sending.await.unwrap_or_else(|e| panic!("send {rank}->{next} world {world} {dtype} count {count}: {e}"));
            let got = got.await.unwrap_or_else(|e| panic!("recv {prev}->{rank} world {world} {dtype} count {count}: {e}"));
            assert_eq!(values(&got), everyone[prev], "send/recv");
        }
    })
    .await
    .unwrap();
    assert_eq!(results.len(), world);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_for_worlds_one_to_eight() {
    within("collectives", async {
        for world in 1..=8 {
            for (dtype, count) in [(DType::Float32, 0), (DType::Float32, 1), (DType::Int64, 13), (DType::BFloat16, 5), (DType::UInt8, 3)] {
                check_world(world, dtype, count).await;
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_mib_all_reduce_in_process() {
    within("large all_reduce", async {
        for world in [2, 3, 5] {
            check_world(world, DType::Float32, (3 << 20) / 4 + 3).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_that_call_different_collectives_all_get_a_desync_error() {
    within("desync", async {
        let errors = spawn(3, |pg| async move {
            let t = Tensor::from_slice(&[1.0f32; 4]);
            let result = if pg.rank() == 1 { pg.broadcast(t, 0).await } else { pg.all_reduce(t, ReduceOp::Sum).await };
            let err = result.expect_err("a desync must fail");
            // The group is broken afterwards: later operations fail at once.
            let later = pg.barrier().await.expect_err("broken group");
            (err, later)
        })
        .await
        .unwrap();
        for (rank, (err, later)) in errors.iter().enumerate() {
            let text = err.to_string();
            assert!(matches!(err, CollectiveError::Desync { .. }), "rank {rank}: {text}");
            assert!(text.contains("all_reduce") && text.contains("broadcast"), "rank {rank}: {text}");
            assert!(matches!(later, CollectiveError::Broken(_)), "rank {rank}: {later}");
        }
    })
    .await;
}
