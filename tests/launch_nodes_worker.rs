//! `chorus launch --restart-policy worker` with several nodes, real
//! processes: several launchers on this machine form one job whose workers
//! are elastic (`chorus elastic-probe`, an `ElasticGroup`). A failed worker
//! is relaunched alone, a node that leaves (its launcher SIGKILLed) and a
//! node that joins change the group without restarting anyone else's
//! workers.
//!
//! Workers run `worker.sh` below: `chorus elastic-probe` with the elastic
//! bounds the launcher gives (`CHORUS_MIN_WORLD`, `CHORUS_MAX_WORLD`), so a
//! launcher that does not give them fails the test.
//!
//! Every child runs under a deadline: past it, the test kills every
//! launcher and fails with what each printed. The tests take turns (one
//! lock): each starts several launchers and workers on a small machine.

use std::process::ExitStatus;
use std::time::{Duration, Instant};

mod common;
use common::field;
use common::launchers::{Job, alive, lock};

const WORKER: &str = r#"#!/bin/sh
exec "$CHORUS" elastic-probe --min-world "$CHORUS_MIN_WORLD" --max-world "$CHORUS_MAX_WORLD" "$@"
"#;

/// This file's part of the shared harness (`common::launchers`).
impl Job {
    fn new() -> Job {
        Job::named("workers", "launch-nodes-worker-test", WORKER)
    }

    /// Starts launcher `tag`: `chorus launch --restart-policy worker` with
    /// `flags`, this job's store endpoint and run id, running worker.sh
    /// with `probe` (elastic-probe's flags).
    fn start(&mut self, tag: &str, flags: &[&str], probe: &[&str]) {
        let flags = [&["--restart-policy", "worker"][..], flags].concat();
        let mut command = self.command(tag, &flags);
        command
            .arg(self.worker())
            .args(probe)
            .env_remove("CHORUS_MIN_WORLD")
            .env_remove("CHORUS_MAX_WORLD");
        self.spawn(tag, command);
    }

    /// Waits until launcher `tag` relayed `count` lines containing `text`.
    fn wait_for_lines(&self, tag: &str, text: &str, count: usize) {
        self.wait_until(30, &format!("launcher {tag} never relayed {count} x {text:?}"), |job| {
            job.stdout(tag).matches(text).count() >= count
        });
    }
}

/// Whether a launcher said it restarts its workers (the workers' own
/// lines, prefixed with their rank, may speak of their group restarting).
fn launcher_restarted(stderr: &str) -> bool {
    stderr
        .lines()
        .any(|l| l.starts_with("chorus launch:") && l.contains("restarting"))
}

/// The probe lines in `stdout` (a launcher's relayed output) with `event`.
fn events<'a>(stdout: &'a str, event: &str) -> Vec<&'a str> {
    let event = format!("event={event}");
    stdout
        .lines()
        .filter(|l| l.contains("]: probe ") && l.split_whitespace().any(|w| w == event))
        .collect()
}

/// The probe lines relayed for the worker slot of global `rank`.
fn lines_of(stdout: &str, rank: usize) -> Vec<&str> {
    let prefix = format!("[{rank}]: probe ");
    stdout.lines().filter(|l| l.starts_with(&prefix)).collect()
}

/// Checks that the single worker process behind `lines` ran from start to
/// end (one `ready`, and the `done` line from the same pid) and returns its
/// `done` line.
fn one_process<'a>(lines: &[&'a str], who: &str, all: &str) -> &'a str {
    let ready: Vec<&&str> = lines.iter().filter(|l| l.contains("event=ready")).collect();
    assert_eq!(ready.len(), 1, "{who} started more than once (or never)\n{all}");
    let done = lines
        .iter()
        .find(|l| l.contains("event=done"))
        .unwrap_or_else(|| panic!("{who} did not finish\n{all}"));
    assert_eq!(field(ready[0], "pid"), field(done, "pid"), "{who}'s pid changed\n{all}");
    done
}

/// Two nodes of two workers; the worker of rank 3 kills itself. Only its
/// launcher relaunches it, alone; the three others keep their processes,
/// the group re-forms with the relaunched one and everybody finishes.
#[test]
fn a_failed_worker_on_one_node_is_relaunched_alone() {
    let _turn = lock();
    let mut job = Job::new();
    let flags = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--rdzv-conf",
        "join_timeout=20",
    ];
    let probe = ["--iterations", "300", "--kill-rank", "3", "--kill-after", "30"];
    job.start("a", &flags, &probe);
    job.wait_for_store();
    job.start("b", &flags, &probe);
    let statuses = [job.finish("a", 60), job.finish("b", 20)];
    let all = job.all_output();
    assert!(statuses.iter().all(ExitStatus::success), "{statuses:?}\n{all}");

    let stdout = job.stdout("a") + &job.stdout("b");
    let stderr = job.stderr("a") + &job.stderr("b");
    assert_eq!(stderr.matches("relaunching rank").count(), 1, "{all}");
    assert!(stderr.contains("relaunching rank 3 alone"), "{all}");
    assert!(
        stderr.contains("was killed by signal SIGKILL (9) in attempt 0"),
        "{all}"
    );
    assert!(!launcher_restarted(&stderr), "no launcher restarted its workers\n{all}");
    for rank in 0..3 {
        let done = one_process(&lines_of(&stdout, rank), &format!("rank {rank}"), &all);
        assert!(done.contains("world=4 event=done iterations=300"), "{all}");
    }
    let lines = lines_of(&stdout, 3);
    let ready: Vec<&&str> = lines.iter().filter(|l| l.contains("event=ready")).collect();
    assert_eq!(ready.len(), 2, "rank 3 started twice\n{all}");
    assert!(ready[0].contains("gen=0 world=4"), "{all}");
    assert!(ready[1].contains("gen=1 world=4"), "joined the next generation\n{all}");
    assert_ne!(field(ready[0], "pid"), field(ready[1], "pid"), "{all}");
    let done = lines
        .iter()
        .find(|l| l.contains("event=done"))
        .unwrap_or_else(|| panic!("the relaunched worker did not finish\n{all}"));
    assert_eq!(field(ready[1], "pid"), field(done, "pid"), "{all}");
    assert!(done.contains("world=4 event=done iterations=300"), "{all}");
}

/// Three nodes of `--nnodes 2:3`; one that does not serve the store is
/// SIGKILLed (its worker dies with it). The other launchers keep their
/// workers, which re-form without it and finish in a world of two; the
/// launchers take the node for gone without restarting anyone.
#[test]
fn a_node_that_leaves_leaves_the_others_workers_running() {
    let _turn = lock();
    let mut job = Job::new();
    let flags = [
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "--rdzv-conf",
        "join_timeout=20,last_call_timeout=2,keep_alive_interval=0.5,keep_alive_max_attempt=2",
    ];
    let probe = ["--iterations", "600"];
    job.start("a", &flags, &probe);
    job.wait_for_store();
    job.start("b", &flags, &probe);
    job.start("c", &flags, &probe);
    // Past the workers' own rendezvous: every worker runs in a world of three.
    for tag in ["a", "b", "c"] {
        job.wait_for_lines(tag, "event=running", 1);
    }
    let ready = job.stdout("c");
    let leaving: i32 = events(&ready, "ready")
        .first()
        .and_then(|l| field(l, "pid")?.parse().ok())
        .unwrap_or_else(|| panic!("no pid from c's worker\n{}", job.all_output()));

    job.child("c").kill().unwrap();
    job.child("c").wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while alive(leaving) {
        job.check(deadline, "the SIGKILLed launcher's worker outlived it");
        std::thread::sleep(Duration::from_millis(20));
    }

    let statuses = [job.finish("a", 60), job.finish("b", 20)];
    let all = job.all_output();
    assert!(statuses.iter().all(ExitStatus::success), "{statuses:?}\n{all}");
    for tag in ["a", "b"] {
        let stdout = job.stdout(tag);
        let lines: Vec<&str> = stdout.lines().filter(|l| l.contains("]: probe ")).collect();
        let done = one_process(&lines, &format!("the worker of {tag}"), &all);
        assert!(
            events(&stdout, "ready").iter().all(|l| l.contains("gen=0 world=3")),
            "{all}"
        );
        assert!(done.contains("world=2 event=done iterations=600"), "{all}");
        assert!(
            events(&stdout, "restarted").iter().any(|l| l.contains("world=2")),
            "the worker re-formed without the lost node\n{all}"
        );
        let stderr = job.stderr(tag);
        assert!(!stderr.contains("relaunching"), "{all}");
        assert!(!launcher_restarted(&stderr), "{all}");
    }
    let stderr = job.stderr("a") + &job.stderr("b");
    assert!(stderr.contains("taking it for gone"), "{all}");
    assert!(stderr.contains("is node 1 of 2; its workers keep running"), "{all}");
}

/// Two nodes of `--nnodes 2:3` run; a third launcher starts: it is
/// admitted without a restart of the others' workers, its worker joins the
/// running group's next generation, and everybody finishes in a world of
/// three.
#[test]
fn a_late_node_joins_without_restarting_the_others() {
    let _turn = lock();
    let mut job = Job::new();
    let flags = [
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "--rdzv-conf",
        "join_timeout=20,last_call_timeout=1",
    ];
    let probe = ["--iterations", "1200"];
    job.start("a", &flags, &probe);
    job.wait_for_store();
    job.start("b", &flags, &probe);
    for tag in ["a", "b"] {
        job.wait_for_lines(tag, "event=running", 1);
    }
    job.start("c", &flags, &probe);

    let statuses = [job.finish("c", 60), job.finish("a", 20), job.finish("b", 20)];
    let all = job.all_output();
    assert!(statuses.iter().all(ExitStatus::success), "{statuses:?}\n{all}");
    for tag in ["a", "b"] {
        let stdout = job.stdout(tag);
        let lines: Vec<&str> = stdout.lines().filter(|l| l.contains("]: probe ")).collect();
        let done = one_process(&lines, &format!("the worker of {tag}"), &all);
        assert!(
            events(&stdout, "ready").iter().all(|l| l.contains("gen=0 world=2")),
            "{all}"
        );
        assert!(done.contains("world=3 event=done iterations=1200"), "{all}");
        assert!(!launcher_restarted(&job.stderr(tag)), "{all}");
    }
    let stdout = job.stdout("c");
    let lines: Vec<&str> = stdout.lines().filter(|l| l.contains("]: probe ")).collect();
    let done = one_process(&lines, "the worker of c", &all);
    assert!(done.contains("world=3 event=done iterations=1200"), "{all}");
    assert!(
        events(&stdout, "joined").iter().any(|l| l.contains("world=3")),
        "the new node's worker joined the running group\n{all}"
    );
    assert!(
        job.stdout("c").starts_with("[2]: "),
        "the newcomer is node 2, its worker rank 2\n{all}"
    );
    let stderr = job.stderr("a") + &job.stderr("b");
    assert!(stderr.contains("waits to join"), "{all}");
    assert!(stderr.contains("its workers keep running"), "{all}");
}

/// A worker failing past its node's `--max-restarts` ends the job on every
/// node, as under `--restart-policy all`: its launcher exits with the
/// worker's code (1 for a signal), the other stops its workers and exits 1
/// naming the failure.
#[test]
fn a_failure_past_max_restarts_ends_the_job_on_every_node() {
    let _turn = lock();
    let mut job = Job::new();
    let flags = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "--rdzv-conf",
        "join_timeout=20",
    ];
    let probe = ["--iterations", "1000000", "--kill-rank", "1", "--kill-after", "20"];
    job.start("a", &flags, &probe);
    job.wait_for_store();
    job.start("b", &flags, &probe);
    let statuses = [job.finish("a", 60), job.finish("b", 20)];
    let all = job.all_output();
    assert_eq!(statuses.map(|s| s.code()), [Some(1); 2], "{all}");
    let gave_up: Vec<&str> = ["a", "b"]
        .into_iter()
        .filter(|tag| {
            job.stderr(tag)
                .contains("rank 1 failed and --max-restarts 0 is used up; stopped the other workers; exiting")
        })
        .collect();
    assert_eq!(gave_up.len(), 1, "{all}");
    let other = if gave_up[0] == "a" { "b" } else { "a" };
    assert!(
        job.stderr(other).contains(
            "the job ended: rank 1 failed and --max-restarts 0 is used up on node 1; stopped this node's workers"
        ),
        "{all}"
    );
    assert!(!all.contains("relaunching"), "{all}");
}
