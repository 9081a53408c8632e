//! The NCCL backend (rules NC-1..NC-10 in `chorus_actors::nccl`).
//!
//! The multi-rank supervision tests run everywhere, on the in-process fake
//! communicator. The `gpu_*` tests use real CUDA and NCCL: they are ignored
//! by default (`cargo test` lists them as ignored, with the reason), and
//! `-- --ignored gpu_` (`scripts/gpu-check.sh`) runs them, failing where
//! either is missing. The `nc1` and `..._without_cuda_...` tests check the
//! missing-library path, so they check nothing where CUDA and NCCL are present.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus_actors::nccl::fake::{FakeBackend, FakeBuffer, FakeComm, Fault};
use chorus_actors::nccl::{
    Availability, Backend, BootstrapError, CommKey, Communicator, CudaBackend, NcclCode, NcclCollective, NcclError,
    NcclGroup, NcclGroupConfig, NcclOp, NcclOpError, ProbeError, init_communicator, probe,
};
use chorus_actors::supervision::{AbortReason, ErrorHandling};
use chorus_runtime::collective::{DType, ReduceOp};
use chorus_runtime::store::{HashStore, Store};

mod common;
use common::within;

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_ne_bytes()).collect()
}

fn f32_values(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

fn f32s(values: &[f32]) -> FakeBuffer {
    FakeBuffer::from_host(f32_bytes(values))
}

fn config(mode: ErrorHandling, timeout: Duration) -> NcclGroupConfig {
    NcclGroupConfig {
        mode,
        timeout,
        ..NcclGroupConfig::default()
    }
}

/// `world` fake ranks formed through one store, each with its group and a
/// handle on its communicator; `faults` go in before the groups start.
async fn fake_group(
    world: usize,
    config: NcclGroupConfig,
    faults: &[(usize, Fault)],
) -> Vec<(FakeComm, NcclGroup<FakeComm>)> {
    let store = Arc::new(HashStore::new(Duration::from_secs(10)));
    let backend = FakeBackend::new();
    let key = CommKey::world("nccl-test", config.generation);
    let tasks: Vec<_> = (0..world)
        .map(|rank| {
            let (store, backend, key) = (store.clone(), backend.clone(), key.clone());
            tokio::spawn(async move {
                init_communicator(&backend, &*store, &key, rank, world, Duration::from_secs(10)).await
            })
        })
        .collect();
    let mut ranks = Vec::new();
    for task in tasks {
        let comm = within(20, "init", task).await.unwrap().unwrap();
        for (rank, fault) in faults {
            if *rank == comm.rank() {
                comm.inject(*fault);
            }
        }
        let group = NcclGroup::start(comm.clone(), config.clone()).unwrap();
        ranks.push((comm, group));
    }
    ranks
}

/// Whether `comm` is aborted within 5 s: the abort is published first (failing the operations), then
/// `ncclCommAbort` runs, which may take a while on a real device.
async fn aborted_soon(comm: &FakeComm) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !comm.is_aborted() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    comm.is_aborted()
}

fn all_reduce(values: &[f32]) -> NcclCollective<FakeBuffer> {
    NcclCollective {
        op: NcclOp::all_reduce(DType::Float32, values.len(), ReduceOp::Sum),
        input: None,
        output: f32s(values),
        timeout: None,
    }
}

/// An all-reduce with a 60 s timeout: one that fails within a second failed fast, not by timing out.
fn patient(values: &[f32]) -> NcclCollective<FakeBuffer> {
    NcclCollective {
        timeout: Some(Duration::from_secs(60)),
        ..all_reduce(values)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nc5_operations_run_in_submission_order_with_correct_results() {
    let ranks = fake_group(3, NcclGroupConfig::default(), &[]).await;
    let mut pending = Vec::new();
    for (rank, (_, group)) in ranks.iter().enumerate() {
        let r = rank as f32;
        // Three queued at once: any reordering would mismatch collectives across ranks.
        let ops = vec![
            group.submit(all_reduce(&[r, 10.0 * r])),
            group.submit(NcclCollective {
                op: NcclOp::all_gather(DType::Float32, 1),
                input: Some(f32s(&[r])),
                output: f32s(&[0.0; 3]),
                timeout: None,
            }),
            group.submit(NcclCollective {
                op: NcclOp::reduce_scatter(DType::Float32, 1, ReduceOp::Max),
                input: Some(f32s(&[r, 2.0 * r, 3.0 * r])),
                output: f32s(&[0.0]),
                timeout: None,
            }),
        ];
        pending.push(ops);
    }
    for (rank, ops) in pending.into_iter().enumerate() {
        let mut results = Vec::new();
        for op in ops {
            results.push(f32_values(
                &within(10, "an operation", op).await.unwrap().output.to_host(),
            ));
        }
        assert_eq!(results[0], vec![3.0, 30.0], "rank {rank}: all-reduce");
        assert_eq!(results[1], vec![0.0, 1.0, 2.0], "rank {rank}: all-gather");
        assert_eq!(
            results[2],
            vec![2.0 * (rank as f32 + 1.0)],
            "rank {rank}: reduce-scatter"
        );
    }
    for (comm, _) in &ranks {
        assert_eq!(comm.launched(), 3);
        assert!(!comm.is_aborted());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nc2_a_refused_operation_leaves_the_group_usable() {
    let ranks = fake_group(2, NcclGroupConfig::default(), &[]).await;
    for (comm, group) in &ranks {
        let refused = group
            .run(
                NcclOp::all_reduce(DType::Int32, 1, ReduceOp::BXor),
                None,
                FakeBuffer::zeros(4),
            )
            .await
            .unwrap_err();
        assert!(
            matches!(
                refused,
                NcclOpError::Invalid {
                    source: NcclError::UnsupportedOp { op: ReduceOp::BXor },
                    ..
                }
            ),
            "{refused}"
        );
        let short = group
            .run(NcclOp::all_reduce(DType::Float32, 4, ReduceOp::Sum), None, f32s(&[1.0]))
            .await
            .unwrap_err();
        assert!(short.to_string().contains("needs 16 bytes"), "{short}");
        assert_eq!(comm.launched(), 0, "nothing refused reaches the communicator");
    }
    let works: Vec<_> = ranks.iter().map(|(_, g)| g.submit(all_reduce(&[1.0]))).collect();
    for work in works {
        assert_eq!(
            f32_values(&within(10, "all-reduce", work).await.unwrap().output.to_host()),
            vec![2.0]
        );
    }
}

/// `op` on every rank of `ranks` at once, rank `r` with `input(r)` and an
/// output of `output_len(r)` floats; the outputs, by rank.
async fn on_every_rank(
    ranks: &[(FakeComm, NcclGroup<FakeComm>)],
    op: NcclOp,
    input: impl Fn(usize) -> Option<Vec<f32>>,
    output_len: impl Fn(usize) -> usize,
) -> Vec<Vec<f32>> {
    let works: Vec<_> = ranks
        .iter()
        .enumerate()
        .map(|(rank, (_, group))| {
            group.submit(NcclCollective {
                op,
                input: input(rank).map(|v| f32s(&v)),
                output: f32s(&vec![0.0; output_len(rank)]),
                timeout: None,
            })
        })
        .collect();
    let mut outputs = Vec::new();
    for work in works {
        let done = within(10, &op.to_string(), work).await.unwrap();
        outputs.push(f32_values(&done.output.to_host()));
    }
    outputs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gather_scatter_all_to_all_and_barrier_run_as_pytorch_runs_them() {
    let ranks = fake_group(3, NcclGroupConfig::default(), &[]).await;
    let r = |rank: usize| rank as f32;
    let gathered = on_every_rank(
        &ranks,
        NcclOp::gather(DType::Float32, 2, 1),
        |rank| Some(vec![r(rank), -r(rank)]),
        |rank| if rank == 1 { 6 } else { 0 },
    )
    .await;
    assert_eq!(gathered, [vec![], vec![0.0, -0.0, 1.0, -1.0, 2.0, -2.0], vec![]]);
    let scattered = on_every_rank(
        &ranks,
        NcclOp::scatter(DType::Float32, 1, 2),
        |rank| (rank == 2).then(|| vec![10.0, 11.0, 12.0]),
        |_| 1,
    )
    .await;
    assert_eq!(scattered, [vec![10.0], vec![11.0], vec![12.0]]);
    // Rank r sends 10r + j to rank j: rank i ends with 10r + i from each r.
    let exchanged = on_every_rank(
        &ranks,
        NcclOp::all_to_all(DType::Float32, 1),
        |rank| Some((0..3).map(|j| 10.0 * r(rank) + j as f32).collect()),
        |_| 3,
    )
    .await;
    for (i, got) in exchanged.iter().enumerate() {
        let want: Vec<f32> = (0..3).map(|from| 10.0 * from as f32 + i as f32).collect();
        assert_eq!(got, &want, "rank {i}");
    }
    let barriers: Vec<_> = ranks.iter().map(|(_, g)| g.barrier()).collect();
    for barrier in barriers {
        within(10, "barrier", barrier).await.unwrap();
    }
    // A barrier waits for every rank: with one rank absent it does not return.
    let early = tokio::time::timeout(Duration::from_millis(300), ranks[0].1.barrier()).await;
    assert!(early.is_err(), "a barrier returned before every rank entered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_and_receives_match_per_pair_in_order_between_collectives() {
    let ranks = fake_group(3, NcclGroupConfig::default(), &[]).await;
    let (g0, g2) = (&ranks[0].1, &ranks[2].1);
    // Rank 0 sends two messages to rank 2; rank 1 takes no part, and the
    // all-reduce after them still matches on every rank.
    let first = g0.run(NcclOp::send(DType::Float32, 2, 2), None, f32s(&[1.0, 2.0]));
    let second = g0.run(NcclOp::send(DType::Float32, 1, 2), None, f32s(&[3.0]));
    let a = g2.run(NcclOp::recv(DType::Float32, 2, 0), None, f32s(&[0.0; 2]));
    let b = g2.run(NcclOp::recv(DType::Float32, 1, 0), None, f32s(&[0.0]));
    let (first, second, a, b) = within(10, "sends and receives", async { tokio::join!(first, second, a, b) }).await;
    assert_eq!(
        f32_values(&first.unwrap().to_host()),
        [1.0, 2.0],
        "a send hands its buffer back"
    );
    second.unwrap();
    assert_eq!(f32_values(&a.unwrap().to_host()), [1.0, 2.0]);
    assert_eq!(f32_values(&b.unwrap().to_host()), [3.0]);
    let sums = on_every_rank(
        &ranks,
        NcclOp::all_reduce(DType::Float32, 1, ReduceOp::Sum),
        |rank| Some(vec![rank as f32]),
        |_| 1,
    )
    .await;
    assert_eq!(sums, vec![vec![3.0]; 3]);
    // Sending to oneself is refused before launch; the group stays usable.
    let to_self = g0
        .run(NcclOp::send(DType::Float32, 1, 0), None, f32s(&[1.0]))
        .await
        .unwrap_err();
    assert!(
        matches!(
            to_self,
            NcclOpError::Invalid {
                source: NcclError::PeerIsSelf { rank: 0, .. },
                ..
            }
        ),
        "{to_self}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_that_does_not_match_its_send_fails_and_aborts_both_ranks() {
    let ranks = fake_group(2, NcclGroupConfig::default(), &[]).await;
    let send = ranks[0]
        .1
        .run(NcclOp::send(DType::Float32, 2, 1), None, f32s(&[1.0, 2.0]));
    let recv = ranks[1].1.run(NcclOp::recv(DType::Float32, 1, 0), None, f32s(&[0.0]));
    let (send, recv) = within(10, "a mismatched pair", async { tokio::join!(send, recv) }).await;
    // The rank that sees the mismatch aborts; its peer may see that abort first.
    let errors = [send.unwrap_err().to_string(), recv.unwrap_err().to_string()];
    assert!(
        errors.iter().any(|e| e.contains(
            "mismatched send and receive: send(float32 x 2, peer 1) sent 8 bytes to recv(float32 x 1, peer 0)"
        )),
        "{errors:#?}"
    );
    for (comm, _) in &ranks {
        assert!(aborted_soon(comm).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nc11_every_rank_dumps_its_flight_recorder_and_chorus_trace_names_the_rank_that_never_entered() {
    let dir = tempfile::tempdir().unwrap();
    let config = NcclGroupConfig {
        trace_dir: Some(dir.path().to_path_buf()),
        flight_capacity: Some(16),
        ..config(ErrorHandling::Abort, Duration::from_millis(500))
    };
    let ranks = fake_group(3, config, &[]).await;
    // Two all-reduces everywhere, then a third that rank 1 never calls
    // (stuck in its own code, as a data loader can be).
    for round in 0..3 {
        let works: Vec<_> = ranks
            .iter()
            .enumerate()
            .filter(|(rank, _)| round < 2 || *rank != 1)
            .map(|(_, (_, group))| group.submit(all_reduce(&[1.0])))
            .collect();
        for work in works {
            let result = within(10, "an all-reduce", work).await;
            assert_eq!(result.is_ok(), round < 2, "round {round}: {result:?}");
        }
    }
    // Ranks 0 and 2 abort at their timeout; rank 1 follows their abort.
    for (comm, _) in &ranks {
        assert!(aborted_soon(comm).await);
    }
    let nccl_dir = dir.path().join("nccl");
    let deadline = Instant::now() + Duration::from_secs(10);
    let loaded = loop {
        let loaded = chorus::trace::load_dir(&nccl_dir);
        if loaded.as_ref().is_ok_and(|l| l.dumps.len() == 3) || Instant::now() > deadline {
            break loaded.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(loaded.dumps.len(), 3, "every rank dumps: {:?}", loaded.unreadable);
    let dumps: Vec<_> = loaded.dumps.into_iter().map(|(_, dump)| dump).collect();
    let stuck = dumps.iter().find(|d| d.rank == 0).unwrap();
    assert_eq!(stuck.entries.len(), 3);
    assert_eq!(stuck.entries[2].op.to_string(), "all_reduce(1 x float32, sum)");
    let report = chorus::trace::analyze(&dumps).expect("a report");
    let verdict = report.verdict();
    assert!(verdict.contains("rank 1"), "{verdict}");
    assert!(!verdict.contains("rank 0") && !verdict.contains("rank 2"), "{verdict}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nc6_a_hung_collective_is_aborted_within_its_timeout() {
    let timeout = Duration::from_millis(300);
    let ranks = fake_group(2, config(ErrorHandling::Abort, timeout), &[(1, Fault::HangAt(0))]).await;
    let started = Instant::now();
    let works: Vec<_> = ranks.iter().map(|(_, g)| g.submit(all_reduce(&[1.0]))).collect();
    for (rank, work) in works.into_iter().enumerate() {
        let err = within(10, "the hung collective", work).await.unwrap_err();
        let NcclOpError::GroupAborted(aborted) = err else {
            panic!("rank {rank}: {err}");
        };
        assert_eq!(aborted.rank, rank);
        assert!(
            matches!(aborted.reason, AbortReason::Overdue { .. }) || aborted.to_string().contains("ncclRemoteError"),
            "rank {rank}: {aborted}"
        );
    }
    let elapsed = started.elapsed();
    assert!(elapsed >= timeout, "aborted before the timeout: {elapsed:?}");
    assert!(elapsed < timeout + Duration::from_secs(2), "aborted late: {elapsed:?}");
    for (comm, group) in &ranks {
        assert!(aborted_soon(comm).await, "ncclCommAbort ends the hung kernel");
        assert!(group.failures().borrow().is_some(), "the abort is published");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nc6_an_async_error_aborts_the_group() {
    let fault = Fault::AsyncErrorAt {
        seq: 1,
        code: NcclCode::RemoteError,
    };
    let ranks = fake_group(2, config(ErrorHandling::Abort, Duration::from_secs(60)), &[(1, fault)]).await;
    let first: Vec<_> = ranks.iter().map(|(_, g)| g.submit(all_reduce(&[1.0]))).collect();
    for work in first {
        within(10, "the first all-reduce", work).await.unwrap();
    }
    let started = Instant::now();
    let second: Vec<_> = ranks.iter().map(|(_, g)| g.submit(all_reduce(&[1.0]))).collect();
    for (rank, work) in second.into_iter().enumerate() {
        let err = within(10, "the failing all-reduce", work).await.unwrap_err();
        assert!(
            matches!(&err, NcclOpError::GroupAborted(a) if a.to_string().contains("ncclRemoteError")),
            "rank {rank}: {err}"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the error, not the 60 s timeout, ended it: {:?}",
        started.elapsed()
    );
    for (comm, _) in &ranks {
        assert!(aborted_soon(comm).await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nc7_queued_operations_fail_with_the_abort_and_later_ones_fail_fast() {
    let ranks = fake_group(
        2,
        config(ErrorHandling::Abort, Duration::from_millis(300)),
        &[(1, Fault::HangAt(0))],
    )
    .await;
    let (comm, group) = &ranks[0];
    let queued: Vec<_> = (0..3).map(|i| group.submit(all_reduce(&[i as f32]))).collect();
    for work in queued {
        let err = within(10, "a queued operation", work).await.unwrap_err();
        assert!(matches!(err, NcclOpError::GroupAborted(_)), "{err}");
    }
    assert_eq!(comm.launched(), 1, "queued operations never reached the communicator");
    let started = Instant::now();
    let later = within(10, "a later operation", group.submit(patient(&[1.0])))
        .await
        .unwrap_err();
    assert!(matches!(later, NcclOpError::GroupAborted(_)), "{later}");
    assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
    assert_eq!(comm.launched(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nc8_abort_is_idempotent_and_peers_follow() {
    let ranks = fake_group(2, config(ErrorHandling::Abort, Duration::from_secs(60)), &[]).await;
    let (comm, group) = &ranks[0];
    assert!(group.abort("the application gave up"));
    assert!(!group.abort("again"));
    assert_eq!(comm.abort_calls(), 1, "ncclCommAbort is called once");
    let published = group.failures().borrow().clone().unwrap();
    assert!(published.to_string().contains("the application gave up"), "{published}");
    // The peer's watchdog sees ncclRemoteError from its communicator and aborts too.
    let (peer_comm, peer) = &ranks[1];
    let mut failures = peer.failures();
    within(5, "the peer's abort", failures.wait_for(|a| a.is_some()))
        .await
        .unwrap();
    assert!(aborted_soon(peer_comm).await);
    assert_eq!(peer_comm.abort_calls(), 1);
    assert!(matches!(
        peer.submit(all_reduce(&[1.0])).await,
        Err(NcclOpError::GroupAborted(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nc9_blocking_wait_returns_the_error_to_the_caller() {
    let timeout = Duration::from_millis(300);
    let ranks = fake_group(
        2,
        config(ErrorHandling::BlockingWait, timeout),
        &[(1, Fault::HangAt(0))],
    )
    .await;
    let (comm, group) = &ranks[0];
    let started = Instant::now();
    let err = within(10, "the hung collective", group.submit(all_reduce(&[1.0])))
        .await
        .unwrap_err();
    let NcclOpError::Timeout {
        rank: 0,
        timeout: waited,
        ..
    } = &err
    else {
        panic!("{err}");
    };
    assert_eq!(*waited, timeout);
    assert!(
        started.elapsed() < timeout + Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert!(err.to_string().contains("all_reduce(float32 x 1, sum) #0"), "{err}");
    assert!(aborted_soon(comm).await, "the hung kernel is ended all the same");
    assert!(group.failures().borrow().is_some());
    let started = Instant::now();
    assert!(
        within(10, "a later operation", group.submit(patient(&[1.0])))
            .await
            .is_err()
    );
    assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
    assert_eq!(comm.launched(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nc10_with_async_error_handling_off_the_watchdog_only_logs() {
    let ranks = fake_group(
        2,
        config(ErrorHandling::Off, Duration::from_millis(300)),
        &[(1, Fault::HangAt(0))],
    )
    .await;
    let (comm, group) = &ranks[0];
    let err = within(10, "the hung collective", group.submit(all_reduce(&[1.0])))
        .await
        .unwrap_err();
    assert!(matches!(err, NcclOpError::Timeout { .. }), "{err}");
    // Past the watchdog's grace too: it logs, and aborts nothing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(comm.abort_calls(), 0);
    assert!(group.failures().borrow().is_none());
    let later = group.submit(all_reduce(&[1.0])).await.unwrap_err();
    assert!(matches!(later, NcclOpError::Broken { .. }), "{later}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nc3_a_new_generation_gets_a_new_unique_id() {
    let store = HashStore::new(Duration::from_secs(5));
    let backend = FakeBackend::new();
    let mut ids = Vec::new();
    for generation in 0..2 {
        let key = CommKey::world("job", generation);
        within(
            5,
            "init",
            init_communicator(&backend, &store, &key, 0, 1, Duration::from_secs(5)),
        )
        .await
        .unwrap();
        ids.push(store.get(&key.store_key()).await.unwrap());
    }
    assert_ne!(ids[0], ids[1]);
}

/// The machine's CUDA and NCCL; fails the test without them (a `gpu_` test
/// runs only when asked to, and then must check).
fn device(test: &str) -> Availability {
    probe().unwrap_or_else(|e| panic!("{test} needs CUDA and NCCL: {e}"))
}

#[test]
fn nc1_without_cuda_or_nccl_every_entry_point_is_a_typed_error() {
    let Err(missing) = probe() else {
        println!("nc1: skipping the missing-library path: CUDA and NCCL are present");
        return;
    };
    let text = missing.to_string();
    if let ProbeError::MissingLibrary { library, .. } = &missing {
        assert!(text.contains(library) && text.contains("LD_LIBRARY_PATH"), "{text}");
    }
    match CudaBackend::new(0) {
        Err(NcclError::Unavailable(e)) => assert_eq!(e, missing),
        other => panic!("expected the probe's error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU with CUDA and NCCL; run: scripts/gpu-check.sh, or cargo test --release --test nccl -- --ignored gpu_"]
async fn gpu_collectives_on_every_visible_device() {
    let found = device("gpu_collectives_on_every_visible_device");
    // NCCL takes one rank per device: as many ranks as devices, one thread each.
    let world = found.devices;
    let store = Arc::new(HashStore::new(Duration::from_secs(60)));
    let key = CommKey::world("gpu-test", 0);
    let tasks: Vec<_> = (0..world)
        .map(|rank| {
            let (store, key) = (store.clone(), key.clone());
            tokio::spawn(async move {
                let backend = CudaBackend::new(rank).unwrap();
                let comm = init_communicator(&backend, &*store, &key, rank, world, Duration::from_secs(60))
                    .await
                    .unwrap();
                let group = NcclGroup::start(comm, NcclGroupConfig::default()).unwrap();
                let n = 1 << 20;
                let values: Vec<f32> = (0..n).map(|i| (i % 7) as f32 + rank as f32).collect();
                let output = group
                    .run(
                        NcclOp::all_reduce(DType::Float32, n, ReduceOp::Sum),
                        None,
                        backend.upload(&f32_bytes(&values)).unwrap(),
                    )
                    .await
                    .unwrap();
                let sum: f32 = (0..world).map(|r| r as f32).sum();
                let got = f32_values(&backend.download(&output).unwrap());
                for (i, v) in got.iter().enumerate() {
                    assert_eq!(*v, world as f32 * (i % 7) as f32 + sum, "rank {rank}, element {i}");
                }
                let gathered = group
                    .run(
                        NcclOp::all_gather(DType::Float32, 2),
                        Some(backend.upload(&f32_bytes(&[rank as f32, -(rank as f32)])).unwrap()),
                        backend.zeros(8 * world).unwrap(),
                    )
                    .await
                    .unwrap();
                let want: Vec<f32> = (0..world).flat_map(|r| [r as f32, -(r as f32)]).collect();
                assert_eq!(f32_values(&backend.download(&gathered).unwrap()), want);
                let scattered = group
                    .run(
                        NcclOp::reduce_scatter(DType::Float32, 1, ReduceOp::Max),
                        Some(backend.upload(&f32_bytes(&vec![rank as f32; world])).unwrap()),
                        backend.zeros(4).unwrap(),
                    )
                    .await
                    .unwrap();
                assert_eq!(
                    f32_values(&backend.download(&scattered).unwrap()),
                    vec![(world - 1) as f32]
                );
                let broadcast = group
                    .run(
                        NcclOp::broadcast(DType::Float32, 1, 0),
                        None,
                        backend.upload(&f32_bytes(&[rank as f32 + 5.0])).unwrap(),
                    )
                    .await
                    .unwrap();
                assert_eq!(f32_values(&backend.download(&broadcast).unwrap()), vec![5.0]);
                // Grouped sends and receives (with one device, each rank's own).
                let root = world - 1;
                let gathered = group
                    .run(
                        NcclOp::gather(DType::Float32, 1, root),
                        Some(backend.upload(&f32_bytes(&[rank as f32])).unwrap()),
                        backend.zeros(if rank == root { 4 * world } else { 0 }).unwrap(),
                    )
                    .await
                    .unwrap();
                if rank == root {
                    let want: Vec<f32> = (0..world).map(|r| r as f32).collect();
                    assert_eq!(f32_values(&backend.download(&gathered).unwrap()), want);
                }
                let blocks: Vec<f32> = (0..world).map(|j| (10 * rank + j) as f32).collect();
                let exchanged = group
                    .run(
                        NcclOp::all_to_all(DType::Float32, 1),
                        Some(backend.upload(&f32_bytes(&blocks)).unwrap()),
                        backend.zeros(4 * world).unwrap(),
                    )
                    .await
                    .unwrap();
                let want: Vec<f32> = (0..world).map(|from| (10 * from + rank) as f32).collect();
                assert_eq!(f32_values(&backend.download(&exchanged).unwrap()), want);
                let scattered = group
                    .run(
                        NcclOp::scatter(DType::Float32, 1, 0),
                        (rank == 0).then(|| backend.upload(&f32_bytes(&blocks)).unwrap()),
                        backend.zeros(4).unwrap(),
                    )
                    .await
                    .unwrap();
                assert_eq!(f32_values(&backend.download(&scattered).unwrap()), vec![rank as f32]);
                group.barrier().await.unwrap();
                // An application abort on a live communicator: later operations fail at once.
                assert!(group.abort("test over"));
                let err = group
                    .run(
                        NcclOp::all_reduce(DType::Float32, 1, ReduceOp::Sum),
                        None,
                        backend.zeros(4).unwrap(),
                    )
                    .await
                    .unwrap_err();
                assert!(matches!(err, NcclOpError::GroupAborted(_)), "{err}");
            })
        })
        .collect();
    for task in tasks {
        within(120, "the GPU collectives", task).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU with CUDA and NCCL; run: scripts/gpu-check.sh, or cargo test --release --test nccl -- --ignored gpu_"]
async fn gpu_nc4_an_init_missing_a_rank_is_aborted_at_its_timeout() {
    device("gpu_nc4_an_init_missing_a_rank_is_aborted_at_its_timeout");
    let backend = CudaBackend::new(0).unwrap();
    let store = HashStore::new(Duration::from_secs(10));
    // Rank 1 of 2 never comes: the real non-blocking init stays in progress until aborted.
    let started = Instant::now();
    let err = within(
        60,
        "the abandoned init",
        init_communicator(
            &backend,
            &store,
            &CommKey::world("gpu-test", 1),
            0,
            2,
            Duration::from_secs(3),
        ),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, BootstrapError::InitTimeout { .. }), "{err}");
    println!("abandoned init aborted after {:?}", started.elapsed());
    // The device is still usable afterwards.
    let comm = init_communicator(
        &backend,
        &store,
        &CommKey::world("gpu-test", 2),
        0,
        1,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert_eq!(comm.world(), 1);
    assert!(comm.abort().unwrap());
}

#[test]
#[ignore = "needs a GPU with CUDA and NCCL; run: scripts/gpu-check.sh, or cargo test --release --test nccl -- --ignored gpu_"]
fn gpu_unique_ids_are_128_random_bytes() {
    device("gpu_unique_ids_are_128_random_bytes");
    let backend = CudaBackend::new(0).unwrap();
    let (a, b) = (backend.unique_id().unwrap(), backend.unique_id().unwrap());
    assert_ne!(a, b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_nccl_group_forms_a_group_through_the_rendezvous_as_init_process_group_does() {
    let url = format!("tcp://127.0.0.1:{}", common::free_port());
    let backend = FakeBackend::new();
    let tasks: Vec<_> = (0..3)
        .map(|rank| {
            let (url, backend) = (url.clone(), backend.clone());
            tokio::spawn(async move {
                let options = chorus::InitOptions {
                    rank: Some(rank),
                    world_size: Some(3),
                    ..chorus::InitOptions::from_url(&url).unwrap()
                };
                let formed = chorus::init_nccl_group_with(options, |r, local_rank| {
                    assert_eq!(
                        (r, local_rank),
                        (rank, rank),
                        "no LOCAL_RANK: the rank picks the device"
                    );
                    Ok(backend)
                })
                .await
                .unwrap();
                assert_eq!((formed.rank(), formed.world_size()), (rank, 3));
                let sum = formed
                    .group()
                    .run(
                        NcclOp::all_reduce(DType::Float32, 1, ReduceOp::Sum),
                        None,
                        f32s(&[rank as f32 + 1.0]),
                    )
                    .await
                    .unwrap();
                formed.destroy().await.unwrap();
                f32_values(&sum.to_host())
            })
        })
        .collect();
    for task in tasks {
        assert_eq!(within(30, "init_nccl_group", task).await.unwrap(), vec![6.0]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_nccl_group_without_cuda_is_the_probes_typed_error() {
    if probe().is_ok() {
        eprintln!("skipped: CUDA and NCCL are present here");
        return;
    }
    let options = chorus::InitOptions {
        rank: Some(0),
        world_size: Some(1),
        ..chorus::InitOptions::from_url(&format!("tcp://127.0.0.1:{}", common::free_port())).unwrap()
    };
    let error = chorus::init_nccl_group(options).await.err().expect("no GPU here");
    assert!(matches!(error, chorus::NcclInitError::Unavailable(_)), "{error}");
}
