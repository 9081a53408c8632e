//! `chorus launch --restart-policy worker` with real processes: a failed
//! worker is relaunched alone and joins the elastic group's next generation
//! while the other workers keep running (`chorus elastic-probe` ranks).
//!
//! Every child runs under a deadline: past it, the test kills it and fails
//! with what it printed.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;
use common::{LAUNCHER, chorus_bin, field, text};

/// `chorus launch ARGS -- chorus elastic-probe PROBE`, run to the end.
fn launch_probe(args: &[&str], probe: &[&str], secs: u64) -> Output {
    let mut command = Command::new(chorus_bin());
    command
        .arg("launch")
        .args(args)
        .args(["--", chorus_bin(), "elastic-probe"])
        .args(probe)
        .env_remove("CHORUS_JOB_SECRET")
        .env_remove("CHORUS_FAULTS")
        .env("CHORUS_HEARTBEAT_TIMEOUT", "2");
    common::run(&mut command, secs, "chorus launch", LAUNCHER)
}

/// The probe lines the launcher relayed for the worker slot of `rank`.
fn lines_of(stdout: &str, rank: usize) -> Vec<&str> {
    let prefix = format!("[{rank}]: probe ");
    stdout.lines().filter(|l| l.starts_with(&prefix)).collect()
}

#[test]
fn a_failed_worker_is_relaunched_alone_and_joins_the_next_generation() {
    let output = launch_probe(
        &[
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "1",
            "--restart-policy",
            "worker",
        ],
        &["--iterations", "200", "--kill-rank", "2", "--kill-after", "30"],
        30,
    );
    let all = text(&output);
    assert_eq!(output.status.code(), Some(0), "{all}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("was killed by signal SIGKILL (9) in attempt 0"),
        "{all}"
    );
    assert!(stderr.contains("relaunching rank 2 alone"), "{all}");
    assert!(!stderr.contains("chorus launch: restarting the group"), "{all}");

    // The survivors were never restarted: one process each from start to end.
    for rank in [0, 1] {
        let lines = lines_of(&stdout, rank);
        let ready: Vec<&&str> = lines.iter().filter(|l| l.contains("event=ready")).collect();
        assert_eq!(ready.len(), 1, "rank {rank} started more than once\n{all}");
        assert!(ready[0].contains("gen=0 world=3"), "{all}");
        let done = lines
            .iter()
            .find(|l| l.contains("event=done"))
            .unwrap_or_else(|| panic!("rank {rank} did not finish\n{all}"));
        assert!(
            done.contains(&format!("probe rank={rank} gen=1 world=3 event=done iterations=200")),
            "{all}"
        );
        assert_eq!(
            field(ready[0], "pid"),
            field(done, "pid"),
            "rank {rank}'s pid changed\n{all}"
        );
        assert!(
            lines.iter().any(|l| l.contains("gen=1 world=3 event=restarted")),
            "{all}"
        );
    }

    // The killed worker: started twice, the second time in generation 1.
    let lines = lines_of(&stdout, 2);
    let ready: Vec<&&str> = lines.iter().filter(|l| l.contains("event=ready")).collect();
    assert_eq!(ready.len(), 2, "{all}");
    assert!(ready[0].contains("gen=0 world=3"), "{all}");
    assert!(lines.iter().any(|l| l.contains("event=killing-self")), "{all}");
    assert!(ready[1].contains("rank=2 gen=1 world=3"), "{all}");
    assert_ne!(field(ready[0], "pid"), field(ready[1], "pid"), "{all}");
    let done = lines
        .iter()
        .find(|l| l.contains("event=done"))
        .unwrap_or_else(|| panic!("rank 2 did not finish\n{all}"));
    assert!(
        done.contains("probe rank=2 gen=1 world=3 event=done iterations=200"),
        "{all}"
    );
    assert_eq!(field(ready[1], "pid"), field(done, "pid"), "{all}");
}

/// `--standby 1`: a warm standby worker waits in its group's init; the
/// killed worker's slot is given to it at once (no process started then),
/// a new standby takes its place, and the standbys left at the end are
/// stopped, so the job ends.
#[test]
fn a_warm_standby_takes_the_failed_workers_slot() {
    let output = launch_probe(
        &[
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "1",
            "--restart-policy",
            "worker",
            "--standby",
            "1",
        ],
        &["--iterations", "300", "--kill-rank", "2", "--kill-after", "30"],
        30,
    );
    let all = text(&output);
    assert_eq!(output.status.code(), Some(0), "{all}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("promoted standby worker s0 (pid"), "{all}");
    assert!(stderr.contains("into rank 2's slot (restart 1 of 1)"), "{all}");
    assert!(!stderr.contains("relaunching rank 2 alone"), "{all}");
    // Nothing a standby printed came before its promotion: it waited in init.
    assert!(!stdout.lines().any(|l| l.starts_with("[s0]: probe")), "{all}");

    let lines = lines_of(&stdout, 2);
    let ready: Vec<&&str> = lines.iter().filter(|l| l.contains("event=ready")).collect();
    assert_eq!(ready.len(), 2, "{all}");
    assert!(ready[0].contains("gen=0 world=3"), "{all}");
    assert!(ready[1].contains("world=3"), "the standby joined\n{all}");
    let promoted_pid = field(ready[1], "pid").unwrap_or_else(|| panic!("no pid\n{all}"));
    assert!(
        stderr.contains(&format!("promoted standby worker s0 (pid {promoted_pid})")),
        "the process that joined is the standby that was promoted\n{all}"
    );
    let done = lines
        .iter()
        .find(|l| l.contains("event=done"))
        .unwrap_or_else(|| panic!("the promoted standby did not finish\n{all}"));
    assert!(done.contains("event=done iterations=300"), "{all}");
    assert_eq!(field(done, "pid"), Some(promoted_pid), "{all}");
    for rank in [0, 1] {
        let lines = lines_of(&stdout, rank);
        assert_eq!(lines.iter().filter(|l| l.contains("event=ready")).count(), 1, "{all}");
        assert!(lines.iter().any(|l| l.contains("event=done iterations=300")), "{all}");
    }
}

#[test]
fn a_worker_failing_past_max_restarts_stops_the_others() {
    // --max-restarts 0: the first failure ends the job as with torchrun.
    let started = Instant::now();
    let output = launch_probe(
        &[
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "0",
            "--restart-policy",
            "worker",
            "--shutdown-timeout",
            "5",
        ],
        &["--iterations", "1000000", "--kill-rank", "1", "--kill-after", "20"],
        30,
    );
    let all = text(&output);
    assert_eq!(output.status.code(), Some(1), "{all}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("rank 1 failed and --max-restarts 0 is used up"),
        "{all}"
    );
    assert!(!stderr.contains("relaunching"), "{all}");
    assert!(started.elapsed() < Duration::from_secs(25), "{all}");
}

#[test]
fn with_restart_policy_all_every_worker_restarts_as_with_torchrun() {
    let output = launch_probe(
        &[
            "--nproc-per-node",
            "3",
            "--max-restarts",
            "1",
            "--restart-policy",
            "all",
            "--shutdown-timeout",
            "5",
        ],
        &["--iterations", "100", "--kill-rank", "2", "--kill-after", "30"],
        30,
    );
    let all = text(&output);
    assert_eq!(output.status.code(), Some(0), "{all}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("chorus launch: restarting the group (restart 1 of 1)"),
        "{all}"
    );
    assert!(!stderr.contains("relaunching"), "{all}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    for rank in 0..3 {
        let lines = lines_of(&stdout, rank);
        let ready: Vec<&&str> = lines.iter().filter(|l| l.contains("event=ready")).collect();
        assert_eq!(ready.len(), 2, "rank {rank} should have started twice\n{all}");
        assert_ne!(field(ready[0], "pid"), field(ready[1], "pid"), "{all}");
        assert!(
            lines.iter().any(|l| l.contains("world=3 event=done iterations=100")),
            "{all}"
        );
    }
}
