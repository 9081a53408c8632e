//! Many ranks in one process (`chorus::spawn`): a large world forms and
//! all-reduces correctly, on a few shared threads rather than one per rank.
//!
//! The world is 256 here, which fits CI's two cores and its memory (each
//! rank holds its own 1 MiB tensor); `chorus bench scale` measures up to
//! 1024 (BENCHMARKS.md, "Memory and scale").

use chorus::{ReduceOp, Tensor, spawn};

mod common;
use common::within;

const WORLD: usize = 256;

fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .expect("Threads: in /proc/self/status")
}

/// Rank r contributes r + 1 in every element: each sums to w(w+1)/2.
async fn check_all_reduce(pg: &chorus::ProcessGroup, count: usize) -> Result<(), String> {
    let want = (WORLD * (WORLD + 1) / 2) as f32;
    let tensor = Tensor::from_slice(&vec![(pg.rank() + 1) as f32; count]);
    let out = pg
        .all_reduce(tensor, ReduceOp::Sum)
        .await
        .map_err(|e| format!("rank {}: {e}", pg.rank()))?;
    let values = out.to_vec::<f32>().map_err(|e| e.to_string())?;
    match values.iter().position(|&v| v != want) {
        Some(i) => Err(format!(
            "rank {}: {count}-element all-reduce: element {i} is {}, not {want}",
            pg.rank(),
            values[i]
        )),
        None if values.len() != count => Err(format!("rank {}: {} elements back", pg.rank(), values.len())),
        None => Ok(()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_world_of_256_ranks_in_one_process_all_reduces_8_bytes_and_1_mib() {
    let results = within(
        90,
        "256 in-process ranks",
        spawn(WORLD, |pg| async move {
            let threads = threads();
            for _ in 0..3 {
                check_all_reduce(&pg, 2).await?;
            }
            check_all_reduce(&pg, (1 << 20) / 4).await?;
            check_all_reduce(&pg, 2).await?;
            pg.destroy().await.map_err(|e| e.to_string())?;
            Ok::<_, String>(threads)
        }),
    )
    .await
    .expect("the group forms");
    assert_eq!(results.len(), WORLD);
    for result in results {
        let threads = result.unwrap_or_else(|e| panic!("{e}"));
        // A thread per rank would be 256 more; ranks share one per core.
        assert!(
            threads < WORLD / 2,
            "{threads} threads for {WORLD} ranks: ranks must share threads"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_panics_is_an_error_naming_the_panic() {
    let outcome = within(
        30,
        "a panicking body",
        spawn(4, |pg| async move {
            if pg.rank() == 2 {
                panic!("rank two gives up");
            }
            pg.rank()
        }),
    )
    .await;
    let err = outcome.expect_err("a panicked rank is an error").to_string();
    assert!(
        err.contains("panicked") && err.contains("rank two gives up"),
        "the error names the panic: {err}"
    );
}
