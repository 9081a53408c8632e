//! A rank's actor (rules RA-1..RA-4 of `chorus_actors::rank`), seen from
//! ranks in one process: operations submitted without waiting run in
//! submission order, keep their numbering past the channel count and
//! around point-to-point operations, and a failure breaks the group only
//! when frames may be left in flight; sends and receives run beside the
//! collectives (RA-3, rules PP-1..PP-4 of `chorus_actors::p2p`). (RA-5
//! and RA-6: tests/flight_recorder.rs and tests/supervision.rs.)

use std::time::Duration;

use chorus::{Buffer, Collective, CollectiveError, CollectiveKind, DType, ReduceOp, Tensor, spawn};

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ra3_receives_posted_before_their_sends_on_both_sides_do_not_deadlock() {
    // 32 MiB each way: far past what a link queues, so run one at a time
    // (the receive first) both ranks would wait for each other forever.
    const N: usize = 8 << 20;
    within(60, "the exchange", async {
        spawn(2, |pg| async move {
            let (rank, peer) = (pg.rank(), 1 - pg.rank());
            let receive = pg.recv(DType::Float32, N, peer);
            let send = pg.send(Tensor::from_slice(&vec![rank as f32; N]), peer);
            let got = floats(receive.await.unwrap_or_else(|e| panic!("rank {rank}: recv: {e}")));
            send.await.unwrap_or_else(|e| panic!("rank {rank}: send: {e}"));
            assert!(got.iter().all(|&v| v == peer as f32), "rank {rank} got another's data");
        })
        .await
        .unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ra3_a_receive_pending_across_a_collective_holds_up_neither() {
    within(60, "the group", async {
        spawn(3, |pg| async move {
            let rank = pg.rank();
            // Rank 1 posts a receive that rank 0 answers only after an
            // all-reduce every rank must reach first.
            let pending = (rank == 1).then(|| pg.recv(DType::Float32, 4, 0));
            let sum = pg.all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::Sum).await;
            assert_eq!(floats(sum.expect("all_reduce")), vec![3.0]);
            if rank == 0 {
                pg.send(Tensor::from_slice(&[9.0f32; 4]), 1).await.expect("send");
            }
            if let Some(pending) = pending {
                assert_eq!(floats(pending.await.expect("recv")), vec![9.0; 4]);
            }
        })
        .await
        .unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pp2_a_receive_takes_only_its_tags_messages() {
    within(60, "the group", async {
        spawn(2, |pg| async move {
            if pg.rank() == 0 {
                pg.send_tagged(Tensor::from_slice(&[7.0f32]), 1, 7)
                    .await
                    .expect("send tag 7");
                pg.send_tagged(Tensor::from_slice(&[3.0f32]), 1, 3)
                    .await
                    .expect("send tag 3");
            } else {
                // The other order: each receive waits for its own tag.
                let three = pg.recv_tagged(DType::Float32, 1, 0, 3).await.expect("recv tag 3");
                let seven = pg.recv_tagged(DType::Float32, 1, 0, 7).await.expect("recv tag 7");
                assert_eq!((floats(three), floats(seven)), (vec![3.0], vec![7.0]));
            }
        })
        .await
        .unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pp3_a_receive_from_any_source_names_each_sender() {
    within(60, "the group", async {
        spawn(4, |pg| async move {
            let rank = pg.rank();
            if rank == 0 {
                let mut senders = Vec::new();
                for _ in 1..4 {
                    let (tensor, from) = pg.recv_any(DType::Float32, 2, 5).await.expect("recv_any");
                    assert_eq!(floats(tensor), vec![from as f32 * 10.0; 2], "the data is its sender's");
                    senders.push(from);
                }
                senders.sort_unstable();
                assert_eq!(senders, [1, 2, 3]);
            } else {
                pg.send_tagged(Tensor::from_slice(&[rank as f32 * 10.0; 2]), 0, 5)
                    .await
                    .expect("send");
            }
            pg.barrier().await.expect("barrier");
            // Named receives after it take the next message of each sender.
            if rank == 0 {
                for from in (1..4).rev() {
                    let next = pg.recv_tagged(DType::Float32, 2, from, 5).await.expect("recv");
                    assert_eq!(floats(next), vec![from as f32 * 10.0 + 1.0; 2]);
                }
            } else {
                pg.send_tagged(Tensor::from_slice(&[rank as f32 * 10.0 + 1.0; 2]), 0, 5)
                    .await
                    .expect("send");
            }
        })
        .await
        .unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pp3_a_receive_from_any_source_nobody_answers_times_out_naming_every_peer() {
    within(60, "the group", async {
        spawn(3, |pg| async move {
            if pg.rank() == 0 {
                let began = std::time::Instant::now();
                let result = pg
                    .submit_recv(Collective {
                        kind: CollectiveKind::Recv,
                        dtype: DType::UInt8,
                        count: 4,
                        root: None,
                        op: None,
                        input: Default::default(),
                        output: Buffer::from(vec![0u8; 4]),
                        timeout: Some(Duration::from_millis(300)),
                        tag: 1,
                    })
                    .await;
                match result {
                    Err(CollectiveError::Timeout { waiting_for, .. }) => assert_eq!(waiting_for, [1, 2]),
                    other => panic!("expected a timeout naming ranks 1 and 2, got {other:?}"),
                }
                assert!(began.elapsed() < Duration::from_secs(10), "took {:?}", began.elapsed());
            }
        })
        .await
        .unwrap();
    })
    .await;
}
