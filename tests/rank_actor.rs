//! A rank's actor (rules RA-1..RA-4 of `chorus_actors::rank`), seen from
//! ranks in one process: operations submitted without waiting run in
//! submission order, keep their numbering past the channel count and
//! around point-to-point operations, and a failure breaks the group only
//! when frames may be left in flight. (RA-5 and RA-6: tests/flight_recorder.rs
//! and tests/supervision.rs.)

use chorus::{CollectiveError, DType, ReduceOp, Tensor, spawn};

mod common;
use common::within;

fn floats(t: Tensor) -> Vec<f32> {
    t.to_vec::<f32>().expect("float32")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ra1_operations_submitted_without_waiting_run_in_submission_order() {
    const OPS: usize = 40;
    const WORLD: usize = 3;
    within(60, "the group", async {
        spawn(WORLD, |pg| async move {
            let rank = pg.rank() as f32;
            // Kinds alternate, so an operation run out of order meets a
            // peer's different one (a desync) or another's values.
            let works: Vec<_> = (0..OPS)
                .map(|i| match i % 3 {
                    0 => pg.all_reduce(Tensor::from_slice(&[i as f32 * (rank + 1.0); 5]), ReduceOp::Sum),
                    1 => pg.broadcast(Tensor::from_slice(&[i as f32 + rank * 100.0; 3]), i % WORLD),
                    _ => pg.all_gather(Tensor::from_slice(&[i as f32 + rank])),
                })
                .collect();
            // Waited for last first: the order is the submission's, not the waits'.
            let mut results: Vec<_> = Vec::new();
            for work in works.into_iter().rev() {
                results.push(work.await);
            }
            results.reverse();
            for (i, result) in results.into_iter().enumerate() {
                let got = floats(result.unwrap_or_else(|e| panic!("rank {rank}: operation {i}: {e}")));
                let want: Vec<f32> = match i % 3 {
                    0 => vec![i as f32 * 6.0; 5],
                    1 => vec![i as f32 + (i % WORLD) as f32 * 100.0; 3],
                    _ => (0..WORLD).map(|r| i as f32 + r as f32).collect(),
                };
                assert_eq!(got, want, "rank {rank}: operation {i}");
            }
        })
        .await
        .unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ra2_more_collectives_in_flight_than_channels_keep_their_numbering() {
    // Three times the 64 collective channels, all submitted before any is
    // waited for: collective n and n + 64 share a channel, never a frame.
    const OPS: usize = 3 * 64 + 5;
    within(60, "the group", async {
        spawn(2, |pg| async move {
            let rank = pg.rank() as f32;
            let works: Vec<_> = (0..OPS)
                .map(|i| pg.all_reduce(Tensor::from_slice(&vec![i as f32 + rank; i % 7 + 1]), ReduceOp::Sum))
                .collect();
            for (i, work) in works.into_iter().enumerate() {
                let got = floats(
                    work.await
                        .unwrap_or_else(|e| panic!("rank {rank}: collective {i}: {e}")),
                );
                assert_eq!(
                    got,
                    vec![2.0 * i as f32 + 1.0; i % 7 + 1],
                    "rank {rank}: collective {i}"
                );
            }
        })
        .await
        .unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ra3_point_to_point_between_two_ranks_leaves_the_collective_numbering_alone() {
    within(60, "the group", async {
        spawn(3, |pg| async move {
            let rank = pg.rank();
            for round in 0..10u32 {
                // Ranks 0 and 1 exchange a message between collectives;
                // rank 2 takes no part and must stay in step with them.
                match rank {
                    0 => {
                        pg.send(Tensor::from_slice(&[round as f32]), 1).await.expect("send");
                        let back = pg.recv(DType::Float32, 1, 1).await.expect("recv");
                        assert_eq!(floats(back), vec![round as f32 + 0.5]);
                    }
                    1 => {
                        let got = pg.recv(DType::Float32, 1, 0).await.expect("recv");
                        assert_eq!(floats(got), vec![round as f32]);
                        pg.send(Tensor::from_slice(&[round as f32 + 0.5]), 0)
                            .await
                            .expect("send");
                    }
                    _ => {}
                }
                let sum = pg
                    .all_reduce(Tensor::from_slice(&[(rank as u32 + round) as f32]), ReduceOp::Sum)
                    .await
                    .unwrap_or_else(|e| panic!("rank {rank}: round {round}: {e}"));
                assert_eq!(floats(sum), vec![(3 + 3 * round) as f32], "rank {rank}: round {round}");
            }
        })
        .await
        .unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ra4_errors_every_rank_detects_alike_leave_the_group_usable() {
    within(60, "the group", async {
        spawn(3, |pg| async move {
            let rank = pg.rank();
            // A root outside the group: refused on every rank, nothing sent.
            let bad_root = pg.broadcast(Tensor::from_slice(&[1.0f32]), 7).await;
            assert!(bad_root.is_err(), "rank {rank}: a broadcast from rank 7 of 3 succeeded");
            // An operator the dtype lacks: refused alike.
            let bad_op = pg.all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::BAnd).await;
            assert!(bad_op.is_err(), "rank {rank}: a bitwise and of floats succeeded");
            let sum = pg
                .all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::Sum)
                .await
                .unwrap_or_else(|e| panic!("rank {rank}: the group broke after a refused operation: {e}"));
            assert_eq!(floats(sum), vec![3.0]);
        })
        .await
        .unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ra4_a_desync_breaks_the_group_and_later_operations_fail_at_once() {
    within(60, "the group", async {
        spawn(2, |pg| async move {
            let t = Tensor::from_slice(&[1.0f32; 4]);
            let first = if pg.rank() == 0 {
                pg.all_gather(t).await.map(drop)
            } else {
                pg.all_reduce(t, ReduceOp::Max).await.map(drop)
            };
            assert!(first.is_err(), "rank {}: a desync succeeded", pg.rank());
            let started = std::time::Instant::now();
            let later = pg.all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::Sum).await;
            assert!(
                matches!(
                    later,
                    Err(CollectiveError::Broken(_) | CollectiveError::GroupAborted(_))
                ),
                "rank {}: after a desync: {later:?}",
                pg.rank()
            );
            assert!(
                started.elapsed().as_secs() < 5,
                "rank {}: the failure waited",
                pg.rank()
            );
        })
        .await
        .unwrap();
    })
    .await;
}
