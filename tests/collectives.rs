//! Every collective x every dtype against a naive reference
//! (`chorus::selftest`), for ranks in one process (`chorus::spawn`, world
//! sizes 1 to 8) and in separate processes (`chorus launch ... chorus
//! selftest`, over shared memory and QUIC); plus desync detection.

use std::process::Command;

use chorus::{CollectiveError, DType, ReduceOp, Tensor, spawn};
use chorus_lab::selftest::{ALL_DTYPES, check_collectives, check_subgroups};

mod common;
use common::{Stop, chorus_bin, joined, run, within};

async fn check_world(world: usize, dtypes: &'static [DType], counts: &'static [usize]) {
    let results = spawn(world, move |pg| async move {
        let mut checks = 0;
        for &dtype in dtypes {
            for &count in counts {
                checks += check_collectives(&pg, dtype, count)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        }
        checks += check_subgroups(&pg).await.unwrap_or_else(|e| panic!("{e}"));
        // Leave together: a rank that dropped its group as soon as its own
        // part was done would break a peer still reading its last frames.
        pg.destroy().await.unwrap_or_else(|e| panic!("destroy: {e}"));
        checks
    })
    .await
    .unwrap();
    assert_eq!(results.len(), world);
    assert!(results.iter().all(|&checks| checks > 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_collective_for_worlds_one_to_eight() {
    within(60, "collectives", async {
        for world in 1..=8 {
            check_world(world, &ALL_DTYPES, &[0, 1, 13]).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_mib_all_reduce_in_process() {
    within(60, "large all_reduce", async {
        for world in [2, 3, 5] {
            check_world(world, &[DType::Float32], &[(3 << 20) / 4 + 3]).await;
        }
    })
    .await;
}

/// Every collective on float32 just past the size from which the driver
/// copies with non-temporal stores (half the last-level cache), or past 32
/// MiB where the cache is larger (checking more would cost gigabytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collectives_larger_than_the_cache_in_process() {
    let bytes = chorus_runtime::collective::streaming_threshold().min(32 << 20);
    let counts: &'static [usize] = Vec::leak(vec![bytes / 4 + 5]);
    within(90, "collectives past the streaming threshold", async {
        check_world(2, &[DType::Float32], counts).await;
    })
    .await;
}

/// An out-of-place all-reduce whose input does not match its output is
/// refused before anything is sent; the group goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_out_of_place_all_reduce_with_a_short_input_is_refused() {
    within(30, "all_reduce_into", async {
        let results = spawn(2, |pg| async move {
            let output = Tensor::from_slice(&[0f32; 4]);
            let short = bytes::Bytes::from(Tensor::from_slice(&[1f32; 3]).into_bytes());
            let refused = pg.all_reduce_into(short, output.clone(), ReduceOp::Sum).await;
            let full = bytes::Bytes::from(Tensor::from_slice(&[1f32; 4]).into_bytes());
            let summed = pg.all_reduce_into(full, output, ReduceOp::Sum).await;
            pg.destroy().await.unwrap();
            let values = |t: Tensor| t.to_vec::<f32>().unwrap();
            (refused.map(values), summed.map(values))
        })
        .await
        .unwrap();
        for (refused, summed) in results {
            let error = refused.unwrap_err().to_string();
            assert!(
                error.contains("all_reduce_into: the input has 12 bytes, the output 16"),
                "{error}"
            );
            assert_eq!(summed.unwrap(), [2.0; 4]);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_that_call_different_collectives_all_get_a_desync_error() {
    within(60, "desync", async {
        let errors = spawn(3, |pg| async move {
            let t = Tensor::from_slice(&[1.0f32; 4]);
            let result = if pg.rank() == 1 {
                pg.broadcast(t, 0).await
            } else {
                pg.all_reduce(t, ReduceOp::Sum).await
            };
            let err = result.expect_err("a desync must fail");
            // The group is broken afterwards: later operations fail at once.
            let later = pg.barrier().await.expect_err("broken group");
            (err, later)
        })
        .await
        .unwrap();
        for (rank, (err, later)) in errors.iter().enumerate() {
            let text = err.to_string();
            // A rank may see the abort of a peer that found the desync
            // first (failed links wake the watchdog at once); the abort
            // carries that peer's desync, both signatures included.
            let desync = matches!(err, CollectiveError::Desync { .. })
                || (matches!(err, CollectiveError::GroupAborted(_)) && text.contains("collective desync"));
            assert!(desync, "rank {rank}: {text}");
            assert!(
                text.contains("all_reduce") && text.contains("broadcast"),
                "rank {rank}: {text}"
            );
            assert!(
                matches!(later, CollectiveError::Broken(_) | CollectiveError::GroupAborted(_)),
                "rank {rank}: {later}"
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_world_checks_signatures_along_its_plan() {
    within(120, "large world", async {
        // Above 16 ranks a small payload carries its sender's signature
        // (13 floats); 2000 floats are too large to, so a frame of its own
        // goes first.
        check_world(20, &[DType::Float32, DType::Int64], &[1, 13, 2000]).await;
        let errors = spawn(20, |pg| async move {
            let t = Tensor::from_slice(&[1.0f32; 4]);
            let result = if pg.rank() == 7 {
                pg.broadcast(t, 0).await
            } else {
                pg.all_reduce(t, ReduceOp::Sum).await
            };
            result.expect_err("a desync must fail").to_string()
        })
        .await
        .unwrap();
        // The ranks next to rank 7 and its partners find the desync; the
        // others see the abort it causes, which names it.
        let naming = errors.iter().filter(|e| e.contains("collective desync")).count();
        assert!(naming > 0, "no rank names the desync: {errors:?}");
        assert!(
            errors
                .iter()
                .filter(|e| e.contains("collective desync"))
                .all(|e| e.contains("all_reduce") && e.contains("broadcast")),
            "{errors:?}"
        );
    })
    .await;
}

/// `chorus launch --nproc-per-node world -- chorus selftest` with `transport`,
/// more environment and `more` selftest arguments.
fn selftest_processes(world: usize, transport: &str, env: &[(&str, &str)], more: &[&str]) {
    let mut command = Command::new(chorus_bin());
    command
        .args([
            "launch",
            "--nproc-per-node",
            &world.to_string(),
            "--",
            chorus_bin(),
            "selftest",
            "--timeout",
            "60",
        ])
        .args(more)
        .envs(env.iter().copied())
        .env("CHORUS_TRANSPORT", transport);
    let what = format!("selftest of {world} processes over {transport}");
    let output = run(&mut command, 150, &what, Stop::Kill);
    let all = joined(&output);
    assert!(
        output.status.success(),
        "selftest of {world} processes over {transport} failed:\n{all}"
    );
    assert_eq!(
        all.matches("checks passed").count(),
        world,
        "every rank reports:\n{all}"
    );
}

#[test]
fn every_collective_in_separate_processes_over_shared_memory() {
    for world in [2, 3, 5] {
        selftest_processes(world, "auto", &[], &["--counts", "0,1,13,2000"]);
    }
}

/// Each rank writes its peer's ring and its output with non-temporal
/// stores past the threshold (set to 4 MiB, whatever the cache): every
/// result still exact.
#[test]
fn collectives_larger_than_the_cache_over_shared_memory() {
    let count = ((4 << 20) / 4 + 5).to_string();
    selftest_processes(
        2,
        "auto",
        &[(chorus_runtime::collective::STREAMING_THRESHOLD_ENV, "4M")],
        &["--counts", &count, "--dtypes", "float32"],
    );
}

#[test]
fn every_collective_in_separate_processes_over_quic() {
    for world in [2, 4] {
        selftest_processes(world, "quic", &[], &["--counts", "0,1,13,2000"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_that_disagree_on_a_subgroup_are_told_so() {
    within(60, "subgroup mismatch", async {
        let outcomes = spawn(3, |pg| async move {
            let ranks: &[usize] = if pg.rank() == 2 { &[0, 2] } else { &[0, 1] };
            pg.new_group(ranks)
                .await
                .map(|g| g.is_some())
                .map_err(|e| e.to_string())
        })
        .await
        .unwrap();
        let refused: Vec<&String> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
        assert!(!refused.is_empty(), "a disagreement must be refused: {outcomes:?}");
        assert!(
            refused.iter().all(|e| e.contains("[0,1]") && e.contains("[0,2]")),
            "{refused:?}"
        );
    })
    .await;
}

#[test]
fn handles_cross_threads_and_runtimes() {
    fn shareable<T: Send + Sync + 'static>() {}
    fn sendable<T: Send + 'static>() {}
    // Share a group between tasks with Arc<ProcessGroup>; Work moves to any runtime.
    shareable::<chorus::ProcessGroup>();
    sendable::<chorus::Work<Tensor>>();
}
