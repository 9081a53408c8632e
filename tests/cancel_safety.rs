//! The `# Cancel safety` sections of the root crate, each claim dropped on
//! purpose on real ranks: `init_process_group` dropped after claiming its
//! rank, `ProcessGroup::new_group` and `store_barrier` dropped after their
//! first poll, `DistributedSync::finish` dropped mid-step, and `train`
//! dropped between steps. Each test has a hard deadline.
//!
//! Run: `cargo test --release -p chorus-cli --test cancel_safety`.

use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use chorus::rendezvous::InitMethod;
use chorus::store::{HashStore, Store};
use chorus::sync::{DistributedSync, ParamBuffer, Parameters};
use chorus::train::{self, Job, Mode, NamedState, Step, TrainOptions, TrainState};
use chorus::{ElasticGroup, InitOptions, SyncError, SyncOptions, init_process_group, spawn};
use tokio::sync::Notify;

mod common;
use common::{elastic_options, within};

/// Rank `rank` of a world of 2 meeting on `store`.
fn options(store: &Arc<dyn Store>, rank: usize) -> InitOptions {
    InitOptions {
        init_method: InitMethod::Store(store.clone()),
        ..InitOptions::default()
    }
    .rank(rank)
    .world_size(2)
    .timeout(Duration::from_secs(20))
}

/// Polls `future` once and drops it: whether it was still pending then.
async fn dropped_after_one_poll<F: Future>(future: F) -> bool {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx).is_pending())).await
}

/// Waits until `key` of generation 0's rendezvous (the keys the
/// rendezvous module documents) is in `store`.
async fn stored(store: &Arc<dyn Store>, key: &str) {
    let key = format!("chorus/default/g0/{key}");
    while !store.check(&[&key]).await.unwrap() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_init_dropped_after_claiming_its_rank_leaves_it_claimed_and_fails_the_peer() {
    within(60, "the dropped init", async {
        let store: Arc<dyn Store> = Arc::new(HashStore::default());
        tokio::select! {
            formed = init_process_group(options(&store, 0)) => panic!("rank 0 formed a group of 2 alone: {formed:?}"),
            () = stored(&store, "rank/0") => {}
        }
        // The same rank again, as a retry would: the old claim stands.
        let again = init_process_group(options(&store, 0)).await.unwrap_err();
        assert!(again.to_string().contains("claimed twice"), "{again}");
        // The peer fails its rendezvous with the conflict, long before its
        // timeout.
        let started = Instant::now();
        let peer = init_process_group(options(&store, 1)).await.unwrap_err();
        assert!(peer.to_string().contains("claimed twice"), "{peer}");
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_init_dropped_after_claiming_its_rank_fails_a_peer_that_finds_its_record() {
    within(60, "the peer of a dropped init", async {
        let store: Arc<dyn Store> = Arc::new(HashStore::default());
        tokio::select! {
            formed = init_process_group(options(&store, 0)) => panic!("rank 0 formed a group of 2 alone: {formed:?}"),
            () = stored(&store, "peer/0") => {}
        }
        // Rank 0's record is there, its side of the links is gone: the peer's
        // rendezvous completes and forming the links fails, by its deadline.
        let peer = init_process_group(options(&store, 1).timeout(Duration::from_secs(4)))
            .await
            .unwrap_err();
        let message = chorus::error_report(&peer);
        assert!(message.contains("while connecting to the peers"), "{message}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_group_dropped_after_its_first_poll_puts_its_rank_a_subgroup_behind() {
    // A TCP store, so that agreeing on the subgroup waits for an answer.
    let url = format!("tcp://127.0.0.1:{}", common::free_port());
    let options = |rank| {
        InitOptions::from_url(&url)
            .unwrap()
            .rank(rank)
            .world_size(2)
            .timeout(Duration::from_secs(20))
    };
    within(60, "new_group", async {
        let (g0, g1) = tokio::join!(init_process_group(options(0)), init_process_group(options(1)));
        let (g0, g1) = (g0.unwrap(), g1.unwrap());
        // Rank 1's subgroup #0 of [0, 1], dropped once it has taken its
        // number (rank 1's store is a client of rank 0's server).
        assert!(
            dropped_after_one_poll(g1.new_group(&[0, 1])).await,
            "new_group finished in its first poll: the test shows nothing"
        );
        // Rank 0 makes #0 of [0, 1], then #1 of [0] alone.
        assert!(g0.new_group(&[0, 1]).await.unwrap().is_some());
        assert!(g0.new_group(&[0]).await.unwrap().is_some());
        // Rank 1's retry of [0, 1] is its #1, where the peer made [0].
        let error = g1
            .new_group(&[0, 1])
            .await
            .expect_err("the retry paired with the peer's next subgroup");
        let error = error.to_string();
        assert!(
            error.contains("subgroup #1") && error.contains("[0,1]") && error.contains("[0]"),
            "{error}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_barrier_dropped_after_counting_in_counts_twice_when_called_again_and_a_new_name_does_not() {
    let dropped = Arc::new(Notify::new());
    let passed = Arc::new(tokio::sync::Semaphore::new(0));
    // (rank, barrier, "came" or "passed", when).
    let seen = Arc::new(Mutex::new(Vec::new()));
    within(60, "the barriers", async {
        spawn(3, |pg| {
            let (dropped, passed, seen) = (dropped.clone(), passed.clone(), seen.clone());
            async move {
                let rank = pg.rank();
                let note = |barrier: &'static str, what: &'static str| {
                    seen.lock().unwrap().push((rank, barrier, what, Instant::now()))
                };
                let short = Duration::from_millis(300);
                match rank {
                    0 => {
                        // Counted in, then dropped while it waits for the others.
                        let cut = tokio::time::timeout(short, pg.store_barrier("same")).await;
                        assert!(cut.is_err(), "the barrier opened with one rank of three");
                        dropped.notify_one();
                        // Called again with the same name: counted twice.
                        pg.store_barrier("same").await.unwrap();
                        note("same", "passed");
                        passed.add_permits(1);
                        // Dropped again, then retried under a new name.
                        let cut = tokio::time::timeout(short, pg.store_barrier("try")).await;
                        assert!(cut.is_err(), "the barrier opened with one rank of three");
                        pg.store_barrier("retry").await.unwrap();
                        note("retry", "passed");
                    }
                    1 => {
                        dropped.notified().await;
                        pg.store_barrier("same").await.unwrap();
                        note("same", "passed");
                        passed.add_permits(1);
                        pg.store_barrier("retry").await.unwrap();
                        note("retry", "passed");
                    }
                    _ => {
                        // Only once ranks 0 and 1 passed "same" without it.
                        drop(passed.acquire_many(2).await.unwrap());
                        note("same", "came");
                        pg.store_barrier("same").await.unwrap();
                        tokio::time::sleep(short).await;
                        note("retry", "came");
                        pg.store_barrier("retry").await.unwrap();
                    }
                }
            }
        })
        .await
        .unwrap();
    })
    .await;
    let seen = seen.lock().unwrap();
    let when = |rank: usize, barrier: &str, what: &str| {
        seen.iter()
            .find(|s| (s.0, s.1, s.2) == (rank, barrier, what))
            .unwrap_or_else(|| panic!("rank {rank} {what} {barrier}: {seen:?}"))
            .3
    };
    for rank in [0, 1] {
        assert!(
            when(rank, "same", "passed") < when(2, "same", "came"),
            "rank {rank} waited for rank 2 at \"same\""
        );
        assert!(
            when(rank, "retry", "passed") > when(2, "retry", "came"),
            "rank {rank} passed \"retry\" before rank 2 came"
        );
    }
}

fn named(sizes: &[usize]) -> Vec<(String, Vec<f32>)> {
    sizes
        .iter()
        .enumerate()
        .map(|(p, &n)| (format!("p{p}"), vec![0.0; n]))
        .collect()
}

/// Writes `value` into every gradient and marks each ready.
fn backward(ddp: &mut DistributedSync<'_>, count: usize, value: f32) {
    for p in 0..count {
        ddp.grad_mut::<f32>(p).unwrap().fill(value);
        ddp.mark_ready(p).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finish_dropped_mid_step_completes_the_peers_step_and_rebind_recovers_the_instance() {
    let dropped = Arc::new(Notify::new());
    within(60, "the dropped finish", async {
        spawn(2, |pg| {
            let dropped = dropped.clone();
            async move {
                let rank = pg.rank();
                let sizes = [16; 6];
                let mut model = named(&sizes);
                // Small buckets: 64 B, then 128 B, so several are in flight.
                let options = SyncOptions {
                    first_bucket_bytes: 64,
                    bucket_cap_mb: 128.0 / (1 << 20) as f64,
                    ..SyncOptions::default()
                };
                let mut ddp = DistributedSync::new(&pg, &mut model, options).await.unwrap();
                // Step 0, whole (its end rebuilds the buckets, with the peers).
                backward(&mut ddp, sizes.len(), 1.0);
                ddp.finish().await.unwrap();
                // Step 1: rank 0's buckets are launched, then its finish is
                // dropped before the peer has even begun the step.
                let value = rank as f32 + 1.0;
                if rank == 0 {
                    backward(&mut ddp, sizes.len(), value);
                    assert!(
                        dropped_after_one_poll(ddp.finish()).await,
                        "a step finished before the peer took part"
                    );
                    dropped.notify_one();
                    // Left mid-step: a bucket's gradients are gone for good.
                    assert_eq!(ddp.step(), 1);
                    assert!(matches!(ddp.zero_grad(), Err(SyncError::InFlight(_))));
                } else {
                    dropped.notified().await;
                    backward(&mut ddp, sizes.len(), value);
                    // The peer's step completes, with rank 0's gradients in it.
                    ddp.finish().await.unwrap();
                    for p in 0..sizes.len() {
                        assert!(ddp.grad::<f32>(p).unwrap().iter().all(|&g| g == 1.5), "p{p}");
                    }
                }
                // Every rank rebinds to the same group: the next step is whole.
                ddp.rebind(&pg).await.unwrap();
                backward(&mut ddp, sizes.len(), value * 2.0);
                ddp.finish().await.unwrap();
                for p in 0..sizes.len() {
                    assert!(
                        ddp.grad::<f32>(p).unwrap().iter().all(|&g| g == 3.0),
                        "rank {rank} p{p}"
                    );
                }
            }
        })
        .await
        .unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finish_dropped_in_the_first_step_leaves_the_peers_bucket_rebuild_waiting_until_its_timeout() {
    const TIMEOUT: Duration = Duration::from_secs(2);
    let dropped = Arc::new(Notify::new());
    let options = InitOptions::default().collective_timeout(TIMEOUT);
    let peer = within(60, "the first step", async {
        chorus::spawn_with(2, options, |pg| {
            let dropped = dropped.clone();
            async move {
                let sizes = [16; 4];
                let mut model = named(&sizes);
                let mut ddp = DistributedSync::new(&pg, &mut model, SyncOptions::default())
                    .await
                    .unwrap();
                if pg.rank() == 0 {
                    backward(&mut ddp, sizes.len(), 1.0);
                    assert!(
                        dropped_after_one_poll(ddp.finish()).await,
                        "a step finished before the peer took part"
                    );
                    dropped.notify_one();
                    // Kept until the peer is done: its links must not close under it.
                    tokio::time::sleep(TIMEOUT * 3).await;
                    None
                } else {
                    dropped.notified().await;
                    backward(&mut ddp, sizes.len(), 1.0);
                    let started = Instant::now();
                    // The buckets are reduced; the broadcast of rank 0's
                    // ready order that ends the first step never comes.
                    let error = ddp.finish().await.unwrap_err();
                    Some((error.to_string(), started.elapsed()))
                }
            }
        })
        .await
        .unwrap()
    })
    .await;
    let (error, waited) = peer[1].clone().unwrap();
    assert!(
        waited >= TIMEOUT - Duration::from_millis(100),
        "failed after {waited:?}: {error}"
    );
    assert!(error.to_lowercase().contains("broadcast"), "{error}");
}

/// Every committed step subtracts 1 from a parameter (the members'
/// gradient shares sum to 1).
struct Counter(NamedState);

impl Parameters for Counter {
    fn visit_parameters(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        self.0.visit_parameters(visit)
    }
}

impl TrainState for Counter {
    fn visit_optimizer(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        self.0.visit_optimizer(visit)
    }
}

impl Job for Counter {
    fn backward(&mut self, step: &Step, grads: &mut DistributedSync<'static>) -> Result<f64, String> {
        std::thread::sleep(Duration::from_millis(2));
        let share = step.shard().len() as f32 * step.grad_scale;
        grads.grad_mut::<f32>(0).map_err(|e| e.to_string())?.fill(share);
        grads.mark_ready(0).map_err(|e| e.to_string())?;
        Ok(step.shard().len() as f64)
    }

    fn apply(&mut self, _step: &Step, grads: &DistributedSync<'static>) -> Result<(), String> {
        let g = grads.grad::<f32>(0).map_err(|e| e.to_string())?;
        self.0.params[0].1.iter_mut().zip(g).for_each(|(x, g)| *x -= g);
        Ok(())
    }
}

fn counter() -> Counter {
    Counter(NamedState {
        params: vec![("x".into(), vec![0.0; 256])],
        buffers: Vec::new(),
        optimizer: Vec::new(),
        extra: Vec::new(),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_train_dropped_between_steps_leaves_the_peer_waiting_until_its_collective_timeout() {
    const TIMEOUT: Duration = Duration::from_secs(2);
    let store: Arc<dyn Store> = Arc::new(HashStore::default());
    let options = |rank| elastic_options(&store, rank, 2).collective_timeout(TIMEOUT);
    let train_options = TrainOptions {
        mode: Mode::Ddp,
        steps: 1_000_000,
        global_batch: 8,
        ..TrainOptions::default()
    };
    let (g0, g1) = within(30, "forming the group", async {
        tokio::join!(ElasticGroup::init(options(0)), ElasticGroup::init(options(1)))
    })
    .await;
    let (g0, g1) = (Arc::new(g0.unwrap()), Arc::new(g1.unwrap()));
    let mut failures = g0.current().failures();
    // Rank 0 trains on; the time of each step it commits is kept.
    let commits = Arc::new(Mutex::new(Vec::new()));
    let rank0 = tokio::spawn({
        let (g0, commits, train_options) = (g0.clone(), commits.clone(), train_options.clone());
        async move {
            let mut job = counter();
            train::train(&g0, &mut job, &train_options, |c| {
                commits.lock().unwrap().push((c.step, Instant::now()))
            })
            .await
        }
    });
    // Rank 1 trains until it committed step 5, and its training is dropped
    // at its next await; its group lives on.
    let at_five = Notify::new();
    let mut job = counter();
    let dropped_at = within(30, "rank 1's first steps", async {
        tokio::select! {
            done = train::train(&g1, &mut job, &train_options, |c| if c.step == 5 { at_five.notify_one() }) => {
                panic!("rank 1 finished training: {done:?}")
            }
            () = at_five.notified() => Instant::now(),
        }
    })
    .await;
    // Rank 0 waits on it until its collective times out, and the group aborts.
    within(30, "rank 0's abort", failures.wait_for(Option::is_some))
        .await
        .unwrap();
    // The operation it waits on may have started a little before the drop.
    let waited = dropped_at.elapsed();
    assert!(
        waited >= TIMEOUT - Duration::from_millis(500),
        "aborted after {waited:?}"
    );
    let last = commits.lock().unwrap().last().copied().expect("rank 0 committed steps");
    assert!(last.0 <= 6, "rank 0 committed step {} without rank 1", last.0);
    rank0.abort();
    let _ = rank0.await;
}
