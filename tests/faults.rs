//! Fault injection as a user meets it: the `CHORUS_FAULTS` example of docs/faults.md
//! under real rank processes, and `chorus::spawn` (ranks in one process)
//! honouring and checking `CHORUS_FAULTS` and `CHORUS_TRANSPORT` as rank
//! processes do, also at 20 ranks (the tree all-reduce) with a rank killed
//! or frozen.

use std::process::Command;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use chorus::mesh::MeshError;
use chorus::{CollectiveError, InitError, InitOptions, ReduceOp, Tensor};

mod common;
use common::{LAUNCHER, chorus_bin, free_port, joined, within};

/// The in-process tests set environment variables the library reads, and
/// the process tests' ranks are several processes on a 2-core machine: one
/// test at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `body` with the variables set (`None`: removed), restoring them after.
fn with_env<T>(vars: &[(&str, Option<&str>)], body: impl FnOnce() -> T) -> T {
    let saved: Vec<(String, Option<String>)> = vars
        .iter()
        .map(|(name, _)| (name.to_string(), std::env::var(name).ok()))
        .collect();
    let set = |name: &str, value: Option<&str>| {
        // SAFETY: the tests of this binary that read these variables hold
        // ONE_AT_A_TIME, and the others start no thread that reads them.
        unsafe {
            match value {
                Some(value) => std::env::set_var(name, value),
                None => std::env::remove_var(name),
            }
        }
    };
    for (name, value) in vars {
        set(name, *value);
    }
    let result = body();
    for (name, value) in &saved {
        set(name, value.as_deref());
    }
    result
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The error of forming a 2-rank group in process under `vars`.
fn spawn_error(vars: &[(&str, Option<&str>)]) -> InitError {
    with_env(vars, || {
        runtime().block_on(within(30, "chorus::spawn", async {
            chorus::spawn(2, |pg| async move { pg.rank() }).await
        }))
    })
    .expect_err("the settings must be refused")
}

/// The error and every cause under it, as `{:#}` prints them.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

#[test]
fn spawn_refuses_bad_fault_and_transport_settings_once() {
    let _serial = one_at_a_time();
    let error = spawn_error(&[("CHORUS_FAULTS", Some("garbage")), ("CHORUS_TRANSPORT", None)]);
    assert!(matches!(error, InitError::Mesh(MeshError::Faults(_))), "{error:?}");
    let printed = with_causes(&error);
    assert_eq!(printed.matches("bad fault rule").count(), 1, "said once: {printed}");

    let error = spawn_error(&[("CHORUS_FAULTS", Some("kill(rank=9)")), ("CHORUS_TRANSPORT", None)]);
    assert!(matches!(error, InitError::Mesh(MeshError::Faults(_))), "{error:?}");
    assert!(
        error.to_string().contains("rank 9 is out of range for world size 2"),
        "{error}"
    );

    let error = spawn_error(&[("CHORUS_FAULTS", None), ("CHORUS_TRANSPORT", Some("bogus"))]);
    assert!(
        matches!(&error, InitError::Mesh(MeshError::UnknownTransport(t)) if t == "bogus"),
        "{error:?}"
    );
}

#[test]
fn a_killed_in_process_rank_fails_its_peers() {
    let _serial = one_at_a_time();
    let started = Instant::now();
    let results = with_env(
        &[
            ("CHORUS_FAULTS", Some("kill(rank=2, after_frames=20)")),
            ("CHORUS_TRANSPORT", None),
        ],
        || {
            let options = InitOptions::default().heartbeat_timeout(Duration::from_secs(2));
            runtime().block_on(within(30, "3 in-process ranks, one killed", async {
                chorus::spawn_with(3, options, |pg| async move {
                    for _ in 0..1000 {
                        pg.all_reduce(Tensor::from_slice(&[1.0f32; 64]), ReduceOp::Sum).await?;
                    }
                    Ok::<_, CollectiveError>(())
                })
                .await
            }))
        },
    )
    .expect("the group forms");
    assert!(
        results[2].is_err(),
        "rank 2 is killed before 1000 all-reduces: {results:?}"
    );
    for rank in [0, 1] {
        match &results[rank] {
            Err(CollectiveError::GroupAborted(aborted)) => {
                assert!(
                    aborted.failed_ranks.contains(&2),
                    "rank {rank} blames rank 2: {aborted}"
                )
            }
            other => panic!("rank {rank} must see the group aborted: {other:?}"),
        }
    }
    // Closed links are noticed at once, not at the heartbeat window.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn a_rank_process_refuses_a_fault_rule_for_a_rank_outside_the_world() {
    let _serial = one_at_a_time();
    let output = common::run(
        Command::new(chorus_bin())
            .args(["fault-probe", "--seconds", "5", "--init"])
            .arg(format!("tcp://127.0.0.1:{}", free_port()))
            .env("RANK", "0")
            .env("WORLD_SIZE", "1")
            .env("CHORUS_FAULTS", "kill(rank=9)")
            .env_remove("CHORUS_TRANSPORT"),
        30,
        "chorus fault-probe",
        common::Stop::Kill,
    );
    let text = joined(&output);
    assert!(!output.status.success(), "{text}");
    assert!(text.contains("rank 9 is out of range for world size 1"), "{text}");
    assert_eq!(text.matches("bad fault rule").count(), 1, "said once: {text}");
}

/// docs/faults.md's example: a link that loses a frame breaks (the streams are
/// reliable), and a rank dies; either way the job ends in a failure every
/// rank detects, within seconds, not at the 30-minute collective timeout.
#[test]
fn the_readme_fault_example_ends_in_a_detected_failure() {
    let _serial = one_at_a_time();
    let started = Instant::now();
    let output = common::run(
        Command::new(chorus_bin())
            .args([
                "launch",
                "--nproc-per-node",
                "4",
                "--",
                chorus_bin(),
                "fault-probe",
                "--seconds",
                "120",
            ])
            .env(
                "CHORUS_FAULTS",
                "seed=7; drop(0->1, p=0.1); kill(rank=2, after_frames=50)",
            )
            .env_remove("CHORUS_TRANSPORT")
            .env_remove("CHORUS_HEARTBEAT_TIMEOUT"),
        60,
        "chorus launch with docs/faults.md's faults",
        LAUNCHER,
    );
    let took = started.elapsed();
    let text = joined(&output);
    assert!(!output.status.success(), "the job must fail:\n{text}");
    assert!(
        text.contains("event=error") && text.contains("kind=aborted"),
        "a rank must see the group aborted:\n{text}"
    );
    assert!(
        took < Duration::from_secs(15),
        "the failure must be detected within the heartbeat window (5 s) plus start-up, took {took:?}:\n{text}"
    );
}

/// 20 in-process ranks (small all-reduces on the tree of ranks that share
/// threads) under `faults`; each rank's result and the time it took.
fn twenty_ranks_under(faults: &str) -> (Vec<Result<(), CollectiveError>>, Duration) {
    let _serial = one_at_a_time();
    let started = Instant::now();
    let results = with_env(&[("CHORUS_FAULTS", Some(faults)), ("CHORUS_TRANSPORT", None)], || {
        let options = InitOptions::default()
            .heartbeat_timeout(Duration::from_secs(2))
            .collective_timeout(Duration::from_secs(2));
        runtime().block_on(within(60, "20 in-process ranks under a fault", async {
            chorus::spawn_with(20, options, |pg| async move {
                for _ in 0..1000 {
                    pg.all_reduce(Tensor::from_slice(&[1.0f32; 2]), ReduceOp::Sum).await?;
                }
                Ok::<_, CollectiveError>(())
            })
            .await
        }))
    })
    .expect("the group forms");
    (results, started.elapsed())
}

#[test]
fn a_rank_killed_or_frozen_in_a_tree_all_reduce_fails_every_rank() {
    // Killed: its links close, the tree's neighbours see it at once and
    // the abort reaches every rank.
    let (results, took) = twenty_ranks_under("kill(rank=13, after_frames=30)");
    assert!(results[13].is_err(), "{results:?}");
    let mut named = false;
    for (rank, result) in results.iter().enumerate().filter(|(r, _)| *r != 13) {
        match result {
            Err(CollectiveError::GroupAborted(aborted)) => named |= aborted.failed_ranks.contains(&13),
            other => panic!("rank {rank} must see the group aborted: {other:?}"),
        }
    }
    assert!(named, "some rank blames rank 13: {results:?}");
    assert!(took < Duration::from_secs(15), "took {took:?}");

    // Frozen: it closes nothing and answers nothing; the collective
    // timeout (2 s) ends every rank's wait.
    let (results, took) = twenty_ranks_under("freeze(rank=13, after_frames=30)");
    assert!(results.iter().all(Result::is_err), "{results:?}");
    assert!(took < Duration::from_secs(20), "took {took:?}");
}
