//! `chorus launch --nproc-per-node 2 -- chorus selftest --backend nccl`, as a
//! torchrun user checks NCCL: one process per GPU. Without CUDA or NCCL the
//! workers exit 2 with the probe's message naming the missing library and
//! the launcher reports it; with CUDA and NCCL every rank passes (two ranks
//! where two GPUs are visible, one on a single GPU).
//! A hard deadline kills the job and fails the test rather than hang.

use std::process::{Command, Output};
use std::time::Duration;

use chorus_actors::nccl::{ProbeError, probe};

mod common;
use common::{Stop, chorus_bin, text};

/// `chorus launch --nproc-per-node N -- chorus selftest --backend nccl ARGS`;
/// past `secs` SIGTERM, 3 s for the launcher to stop its workers, SIGKILL,
/// and the test fails.
fn launch_selftest(nproc: usize, args: &[&str], secs: u64) -> Output {
    let mut command = Command::new(chorus_bin());
    command
        .args(["launch", "--nproc-per-node", &nproc.to_string(), "--", chorus_bin()])
        .args(["selftest", "--backend", "nccl"])
        .args(args)
        .env_remove("CHORUS_JOB_SECRET");
    common::run(&mut command, secs, "chorus launch", Stop::Term(Duration::from_secs(3)))
}

#[test]
fn nccl_selftest_under_launch_fails_cleanly_without_cuda_or_passes_on_the_gpus() {
    match probe() {
        Err(missing) => {
            let output = launch_selftest(2, &["--timeout", "20"], 60);
            let all = text(&output);
            assert_eq!(output.status.code(), Some(2), "{all}");
            // The launcher's report: which worker failed, how, and its last lines.
            assert!(all.contains("exited with code 2 in attempt 0"), "{all}");
            assert!(all.contains("--max-restarts 0 is used up"), "{all}");
            // The probe's own message, naming the missing library where one is missing.
            assert!(all.contains(&missing.to_string()), "{all}");
            if let ProbeError::MissingLibrary { library, .. } = &missing {
                assert!(all.contains(library) && all.contains("LD_LIBRARY_PATH"), "{all}");
            }
            assert!(!all.contains("panicked"), "{all}");
            assert!(!all.contains("selftest nccl ok"), "{all}");
        }
        Ok(found) => {
            // Two ranks where two GPUs are visible; one GPU still checks the
            // whole path (probe, store, communicator, every op) at world 1.
            let world = found.devices.min(2);
            let output = launch_selftest(world, &["--timeout", "120"], 300);
            let all = text(&output);
            assert!(output.status.success(), "{all}");
            for rank in 0..world {
                let ok = format!("selftest nccl ok rank={rank} world={world} device=");
                assert!(all.contains(&ok), "rank {rank} did not pass:\n{all}");
                assert!(
                    all.contains(&format!("selftest nccl rank={rank}: all_reduce(float32 x 1, sum) ok")),
                    "{all}"
                );
            }
            assert!(all.contains(&format!("nccl={}", found.nccl)), "{all}");
        }
    }
}

/// A count of 0 is refused before the probe runs: input to fix, exit 2.
#[test]
fn nccl_selftest_refuses_zero_counts() {
    let output = launch_selftest(1, &["--counts", "0,5"], 60);
    let all = text(&output);
    assert_eq!(output.status.code(), Some(2), "{all}");
    assert!(all.contains("--counts must list element counts of at least 1"), "{all}");
}

/// `--dtypes` chooses the cpu backend's dtypes; the nccl backend has its
/// own set, so the flag there is refused, not ignored.
#[test]
fn nccl_selftest_refuses_dtypes() {
    let output = launch_selftest(1, &["--dtypes", "float32"], 60);
    let all = text(&output);
    assert_eq!(output.status.code(), Some(2), "{all}");
    assert!(all.contains("--dtypes is for --backend cpu"), "{all}");
}
