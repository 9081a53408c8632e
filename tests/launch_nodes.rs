//! `chorus launch --nnodes MIN:MAX` with real processes: several launchers
//! on this machine form one job, and nodes leave it (a launcher SIGKILLed)
//! and join it (a launcher started late) while it runs.
//!
//! Workers run `worker.sh` below: in a round of `$FINAL_NODES` nodes
//! `chorus elastic-probe` (a fixed number of all-reduces, then exit 0),
//! otherwise `chorus fault-probe` (all-reduces until a peer is lost, then
//! exit 3), after printing their torchrun variables and writing their pid.
//!
//! Every child runs under a deadline: past it, the test kills every
//! launcher and fails with what each printed. The tests take turns (one
//! lock): each starts several launchers and workers on a small machine.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::{Duration, Instant};

mod common;
use common::launchers::{Job, alive, lock};

const WORKER: &str = r#"#!/bin/sh
echo "node=$NODE_TAG GROUP_RANK=$GROUP_RANK RANK=$RANK WORLD_SIZE=$WORLD_SIZE GROUP_WORLD_SIZE=$GROUP_WORLD_SIZE RESTART=$TORCHELASTIC_RESTART_COUNT MAX_RESTARTS=$TORCHELASTIC_MAX_RESTARTS"
if [ "$GROUP_WORLD_SIZE" = "$FINAL_NODES" ]; then exec "$CHORUS" elastic-probe --iterations 50; fi
echo "$$" > "$OUT/$NODE_TAG.$LOCAL_RANK.pid.tmp" && mv "$OUT/$NODE_TAG.$LOCAL_RANK.pid.tmp" "$OUT/$NODE_TAG.$LOCAL_RANK.pid"
exec "$CHORUS" fault-probe --seconds 600
"#;

/// This file's part of the shared harness (`common::launchers`).
impl Job {
    fn new() -> Job {
        Job::named("nodes", "launch-nodes-test", WORKER)
    }

    /// Starts launcher `tag`: `chorus launch` with `flags`, this job's store
    /// endpoint and run id, running `program` (worker.sh when empty).
    fn start(&mut self, tag: &str, flags: &[&str], program: &[&str], final_nodes: usize) {
        let mut command = self.command(tag, flags);
        if program.is_empty() {
            command.arg(self.worker());
        } else {
            command.args(program);
        }
        command
            .env("OUT", self.out())
            .env("NODE_TAG", tag)
            .env("FINAL_NODES", final_nodes.to_string());
        self.spawn(tag, command);
    }

    /// The pids of `tag`'s workers in their first (long) round, once all
    /// `nproc` of them wrote one.
    fn worker_pids(&self, tag: &str, nproc: usize) -> Vec<i32> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let files: Vec<PathBuf> = (0..nproc).map(|r| self.out().join(format!("{tag}.{r}.pid"))).collect();
        loop {
            let pids: Vec<i32> = files
                .iter()
                .filter_map(|f| std::fs::read_to_string(f).ok()?.trim().parse().ok())
                .collect();
            if pids.len() == nproc {
                return pids;
            }
            self.check(deadline, &format!("the workers of launcher {tag} did not start"));
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until launcher `tag` printed (either stream) `count` lines containing `text`.
    fn wait_for_lines(&self, tag: &str, text: &str, count: usize) {
        self.wait_until(20, &format!("launcher {tag} never printed {count} x {text:?}"), |job| {
            job.output(tag).matches(text).count() >= count
        });
    }
}

/// The worker.sh lines a launcher relayed, as `KEY=value` maps.
fn env_lines(output: &str) -> Vec<BTreeMap<String, String>> {
    output
        .lines()
        .filter_map(|l| l.split_once("]: node="))
        .map(|(_, rest)| {
            format!("node={rest}")
                .split(' ')
                .filter_map(|f| f.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .collect()
}

/// Three nodes; one that does not serve the store is SIGKILLed (its workers
/// die with it). The two others' workers fail, and the launchers restart
/// them as a group of two with dense node ranks in their old order.
#[test]
fn a_node_that_leaves_is_dropped_and_the_others_go_on_with_dense_ranks() {
    let _turn = lock();
    let mut job = Job::new();
    let flags = [
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "2",
        "--rdzv-conf",
        "join_timeout=20,last_call_timeout=2",
    ];
    job.start("a", &flags, &[], 2);
    job.wait_for_store();
    job.start("b", &flags, &[], 2);
    job.start("c", &flags, &[], 2);
    let leaving = job.worker_pids("c", 1);
    // Past the workers' own rendezvous: a node lost there would leave the
    // others waiting for it until their init timeout.
    for tag in ["a", "b", "c"] {
        job.wait_for_lines(tag, "event=running", 1);
    }

    job.child("c").kill().unwrap();
    job.child("c").wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while leaving.iter().any(|&p| alive(p)) {
        job.check(deadline, "the SIGKILLed launcher's workers outlived it");
        std::thread::sleep(Duration::from_millis(20));
    }

    let (a, b) = (job.finish("a", 40), job.finish("b", 20));
    let all = job.all_output();
    assert!(a.success() && b.success(), "{all}");
    let first_rank = |tag: &str| -> usize {
        let lines = env_lines(&job.stdout(tag));
        lines
            .iter()
            .find(|l| l["GROUP_WORLD_SIZE"] == "3")
            .unwrap_or_else(|| panic!("{all}"))["GROUP_RANK"]
            .parse()
            .unwrap()
    };
    let mut last = Vec::new();
    for tag in ["a", "b"] {
        let lines = env_lines(&job.stdout(tag));
        let line = lines.last().unwrap_or_else(|| panic!("{all}")).clone();
        assert_eq!(line["GROUP_WORLD_SIZE"], "2", "{all}");
        assert_eq!(line["WORLD_SIZE"], "2", "{all}");
        assert_eq!(line["RESTART"], "1", "the failure counts as a restart\n{all}");
        assert_eq!(line["GROUP_RANK"], line["RANK"], "{all}");
        assert!(job.output(tag).contains("world=2 event=done iterations=50"), "{all}");
        last.push(line["GROUP_RANK"].parse::<usize>().unwrap());
    }
    let mut ranks = last.clone();
    ranks.sort();
    assert_eq!(ranks, [0, 1], "dense node ranks\n{all}");
    assert_eq!(
        last[0] < last[1],
        first_rank("a") < first_rank("b"),
        "the survivors keep their order\n{all}"
    );
}

/// Two nodes run; a third launcher starts: the running ones restart their
/// workers to admit it, and the job finishes with three nodes. The
/// membership restart uses none of `--max-restarts 0`.
#[test]
fn a_late_node_is_admitted_by_restarting_the_workers_for_free() {
    let _turn = lock();
    let mut job = Job::new();
    let flags = [
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        "--rdzv-conf",
        "join_timeout=20,last_call_timeout=1",
    ];
    job.start("a", &flags, &[], 3);
    job.wait_for_store();
    job.start("b", &flags, &[], 3);
    job.worker_pids("a", 2);
    job.worker_pids("b", 2);
    job.start("c", &flags, &[], 3);

    let statuses = [job.finish("c", 40), job.finish("a", 20), job.finish("b", 20)];
    let all = job.all_output();
    assert!(statuses.iter().all(ExitStatus::success), "{statuses:?}\n{all}");
    assert!(
        all.contains("waits to join; restarting the workers to admit it"),
        "{all}"
    );
    let mut ranks = Vec::new();
    let mut nodes = Vec::new();
    for tag in ["a", "b", "c"] {
        let lines = env_lines(&job.stdout(tag));
        let last: Vec<_> = lines.iter().filter(|l| l["GROUP_WORLD_SIZE"] == "3").collect();
        assert_eq!(last.len(), 2, "launcher {tag}: two workers in the 3-node round\n{all}");
        for line in last {
            assert_eq!(line["WORLD_SIZE"], "6", "{all}");
            // The workers were restarted once (a new round), though not for a failure.
            assert_eq!(line["RESTART"], "1", "{all}");
            ranks.push(line["RANK"].parse::<usize>().unwrap());
            nodes.push((tag, line["GROUP_RANK"].clone()));
        }
        assert_eq!(
            job.output(tag).matches("world=6 event=done iterations=50").count(),
            2,
            "{all}"
        );
    }
    ranks.sort();
    assert_eq!(ranks, (0..6).collect::<Vec<_>>(), "{all}");
    assert!(
        nodes.contains(&("c", "2".to_string())),
        "the newcomer ranks last\n{all}"
    );
}

/// A launcher arriving while the job runs with its most nodes waits for a
/// place, then gives up after its join timeout with a clear error; the
/// running nodes are left alone.
#[test]
fn a_node_past_max_waits_then_gives_up_with_a_clear_error() {
    let _turn = lock();
    let mut job = Job::new();
    let sleeper = [
        "sh",
        "-c",
        r#"echo "node=$NODE_TAG GROUP_WORLD_SIZE=$GROUP_WORLD_SIZE"; echo $$ > "$OUT/$NODE_TAG.0.pid"; exec sleep 600"#,
    ];
    let flags = ["--nnodes", "1:2", "--rdzv-conf", "join_timeout=20,last_call_timeout=5"];
    job.start("a", &flags, &sleeper, 0);
    job.wait_for_store();
    job.start("b", &flags, &sleeper, 0);
    job.worker_pids("a", 1);
    job.worker_pids("b", 1);
    job.start("c", &["--nnodes", "1:2", "--rdzv-conf", "join_timeout=2"], &sleeper, 0);

    let c = job.finish("c", 20);
    let all = job.all_output();
    assert_eq!(c.code(), Some(1), "{all}");
    assert!(
        job.output("c")
            .contains("the job runs with its maximum of 2 nodes (--nnodes); this launcher waited 2s for a place"),
        "{all}"
    );
    assert!(!all.contains("waits to join"), "the full job did not restart\n{all}");
    // Both at once: a launcher that outlives the one serving the store
    // would fail, having lost it.
    for tag in ["b", "a"] {
        job.signal(tag, chorus::process::Signal::SIGTERM);
    }
    let codes = [job.finish("a", 15).code(), job.finish("b", 15).code()];
    let all = job.all_output();
    assert_eq!(codes, [Some(128 + libc::SIGTERM); 2], "{all}");
    for tag in ["a", "b"] {
        assert_eq!(env_lines(&job.stdout(tag)).len(), 1, "one round only\n{all}");
    }
}

/// The launcher serving the store cannot leave: the others end with an
/// error that says so (as torchrun's agents do when the c10d store's host
/// is gone).
#[test]
fn losing_the_store_host_ends_the_job_with_a_clear_error() {
    let _turn = lock();
    let mut job = Job::new();
    let flags = [
        "--nnodes",
        "1:2",
        "--max-restarts",
        "1",
        "--rdzv-conf",
        "join_timeout=20,last_call_timeout=5",
    ];
    job.start("a", &flags, &[], 1);
    job.wait_for_store();
    job.start("b", &flags, &[], 1);
    for tag in ["a", "b"] {
        job.wait_for_lines(tag, "event=running", 1);
    }
    job.child("a").kill().unwrap();
    job.child("a").wait().unwrap();
    let b = job.finish("b", 20);
    let all = job.all_output();
    assert_eq!(b.code(), Some(1), "{all}");
    assert!(
        job.output("b")
            .contains("the launcher serving it has left, and the job cannot go on without it"),
        "{all}"
    );
}

/// A launcher that hangs (SIGSTOP: alive, and its workers not failing) is
/// noticed by its keep-alive standing still; the others end the round
/// naming it and go on without it.
#[test]
fn a_hung_launcher_is_noticed_by_its_keep_alive() {
    let _turn = lock();
    let mut job = Job::new();
    let flags = [
        "--nnodes",
        "2:3",
        "--max-restarts",
        "1",
        "--rdzv-conf",
        "join_timeout=20,last_call_timeout=2,keep_alive_interval=0.5,keep_alive_max_attempt=2",
    ];
    job.start("a", &flags, &[], 2);
    job.wait_for_store();
    job.start("b", &flags, &[], 2);
    job.start("c", &flags, &[], 2);
    for tag in ["a", "b", "c"] {
        job.wait_for_lines(tag, "event=running", 1);
    }
    job.signal("c", chorus::process::Signal::SIGSTOP);
    let b = job.finish("b", 30);
    // The hung launcher still holds a connection the store's host would wait for.
    job.signal("c", chorus::process::Signal::SIGKILL);
    let a = job.finish("a", 15);
    let all = job.all_output();
    assert!(a.success() && b.success(), "{all}");
    assert!(all.contains("sent no keep-alive for 1s; taking it for hung"), "{all}");
    for tag in ["a", "b"] {
        let lines = env_lines(&job.stdout(tag));
        let last = lines.last().unwrap_or_else(|| panic!("{all}"));
        assert_eq!(last["GROUP_WORLD_SIZE"], "2", "{all}");
        assert!(job.stdout(tag).contains("world=2 event=done iterations=50"), "{all}");
    }
}
