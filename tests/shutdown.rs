//! Leaving a group from a service's shutdown path: `ProcessGroup::shutdown`
//! and `ElasticGroup::shutdown` fail pending work with a typed error and let
//! peers go on at once; dropping a group without `destroy` neither hangs
//! nor panics.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chorus::store::{HashStore, Store};
use chorus::{AbortReason, CollectiveError, DType, ElasticGroup, InitOptions, ReduceOp, Tensor};

mod common;
use common::{elastic_options, within};

/// A heartbeat window long enough that anything under it was not waited out.
const WINDOW: Duration = Duration::from_secs(5);

fn options() -> InitOptions {
    InitOptions::default()
        .heartbeat_timeout(WINDOW)
        .collective_timeout(Duration::from_secs(20))
        .error_handling(chorus::ErrorHandling::Abort)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_shuts_down_fails_its_pending_work_and_its_peers_go_on_at_once() {
    let left_at = Arc::new(Mutex::new(None::<Instant>));
    // Rank 1 leaves only once every rank has its first result (its links
    // close at once, frames still in flight with them).
    let first_done = Arc::new(tokio::sync::Barrier::new(3));
    let results = within(
        30,
        "three ranks, one shutting down",
        chorus::spawn_with(3, options(), move |pg| {
            let (left_at, first_done) = (left_at.clone(), first_done.clone());
            async move {
                pg.all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::Sum)
                    .await
                    .unwrap();
                first_done.wait().await;
                if pg.rank() == 1 {
                    // A receive nobody sends to would wait forever, and the
                    // collective the others are in queues behind it.
                    let pending = pg.recv(DType::UInt8, 8, 0);
                    let queued = pg.all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::Sum);
                    *left_at.lock().unwrap() = Some(Instant::now());
                    pg.shutdown("service stopping").await;
                    for result in [pending.await.map(drop), queued.await.map(drop)] {
                        match result {
                            Err(CollectiveError::GroupAborted(aborted)) => {
                                assert_eq!(aborted.reason, AbortReason::Shutdown("service stopping".into()));
                            }
                            other => panic!("pending work must fail with the shutdown, got {other:?}"),
                        }
                    }
                    return None;
                }
                // The others are in a collective with rank 1 when it leaves.
                let failed = pg.all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::Sum).await;
                let noticed = left_at.lock().unwrap().expect("rank 1 left").elapsed();
                match failed {
                    Err(CollectiveError::GroupAborted(aborted)) => assert_eq!(aborted.failed_ranks, vec![1]),
                    other => panic!("rank {}: {other:?}", pg.rank()),
                }
                Some(noticed)
            }
        }),
    )
    .await
    .unwrap();
    for noticed in results.into_iter().flatten() {
        assert!(
            noticed < WINDOW / 3,
            "peers noticed the shutdown after {noticed:?}, not at once (heartbeat window {WINDOW:?})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_group_with_pending_work_neither_hangs_nor_panics() {
    // Ranks of one process have no heartbeats: rank 1's pending all-reduce
    // keeps its links (and so its peers) until a timeout fails it, then
    // its links go and rank 0's receive fails; the collective timeout is
    // what bounds it here, and a rank process's heartbeat window there.
    let options = options()
        .heartbeat_timeout(Duration::from_secs(1))
        .collective_timeout(Duration::from_secs(3));
    let results = within(
        20,
        "two ranks, one dropping its group",
        chorus::spawn_with(2, options, |pg| async move {
            pg.barrier().await.unwrap();
            if pg.rank() == 1 {
                let pending = pg.all_reduce(Tensor::from_slice(&[1.0f32; 4]), ReduceOp::Sum);
                drop(pg);
                return pending.await.map(drop);
            }
            // A receive rank 1 never sends to: only its departure ends it.
            let started = Instant::now();
            let result = pg.recv(DType::UInt8, 8, 1).await.map(drop);
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "the peer waited {:?}",
                started.elapsed()
            );
            result
        }),
    )
    .await
    .unwrap();
    for (rank, result) in results.iter().enumerate() {
        assert!(
            result.is_err(),
            "rank {rank}: work on a dropped group cannot succeed: {result:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_of_an_elastic_shutdown_re_form_well_under_the_heartbeat_window() {
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let left_at = Arc::new(Mutex::new(None::<Instant>));
    // Rank 3 leaves only once every rank has its first result.
    let first_done = Arc::new(tokio::sync::Barrier::new(4));
    let mut ranks = Vec::new();
    for rank in 0..4 {
        // Neither the heartbeat window nor the last call is waited out.
        let options = elastic_options(&store, rank, 4)
            .elastic_world(2, 4)
            .heartbeat_timeout(WINDOW)
            .last_call(WINDOW);
        let (left_at, first_done) = (left_at.clone(), first_done.clone());
        ranks.push(tokio::spawn(async move {
            let group = ElasticGroup::init_with(options, |e| panic!("gave up: {e}"))
                .await
                .unwrap();
            let pg = group.current();
            pg.all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::Sum)
                .await
                .unwrap();
            first_done.wait().await;
            if rank == 3 {
                drop(pg);
                *left_at.lock().unwrap() = Some(Instant::now());
                group.shutdown("scaling down").await;
                return None;
            }
            assert!(
                pg.all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::Sum)
                    .await
                    .is_err()
            );
            let next = group.next_generation(pg.generation()).await.unwrap();
            let took = left_at.lock().unwrap().expect("rank 3 left").elapsed();
            let sum = next
                .all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::Sum)
                .await
                .unwrap();
            let result = (
                next.generation(),
                next.world_size(),
                sum.to_vec::<f32>().unwrap()[0],
                took,
            );
            drop(next);
            group.destroy().await.unwrap();
            Some(result)
        }));
    }
    for task in ranks {
        if let Some((generation, world, sum, took)) = within(30, "the elastic group", task).await.unwrap() {
            assert_eq!((generation, world, sum), (1, 3, 3.0));
            assert!(
                took < WINDOW / 3,
                "survivors re-formed {took:?} after the shutdown (heartbeat window and last call {WINDOW:?})"
            );
            eprintln!("re-formed {took:?} after the shutdown");
        }
    }
}
