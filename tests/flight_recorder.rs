//! The flight recorder end to end: a rank frozen by fault injection, or
//! stopped by SIGSTOP, makes the others time out or abort; they dump their
//! recorders, and `chorus trace` names the frozen rank.

use std::path::Path;
use std::process::Command;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use chorus::process::{self, Signal};
use serde_json::{Value, json};

mod common;
use common::{Ranks, Stop, chorus_bin, field, free_port, joined};

/// Each test runs several ranks; one at a time on a 2-core machine, so one
/// test's ranks do not starve the other's past its timeouts (the frozen
/// test's 4 s `--timeout` also bounds connecting).
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `command` under a deadline: whether it succeeded, and its output.
fn run(command: &mut Command, secs: u64) -> (bool, String) {
    let output = common::run(command, secs, "chorus", Stop::Kill);
    (output.status.success(), joined(&output))
}

#[test]
fn chorus_trace_names_the_frozen_rank() {
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let (ok, job) = run(
        Command::new(chorus_bin())
            .args([
                "launch",
                "--nproc-per-node",
                "3",
                "--",
                chorus_bin(),
                "selftest",
                "--timeout",
                "4",
                "--counts",
                "13",
            ])
            .env("CHORUS_FAULTS", "freeze(rank=2, after_frames=40)")
            // A rank frozen by fault injection still runs its own watchdog (a
            // SIGSTOPped one would not): keep its heartbeat window past the test.
            .env("CHORUS_HEARTBEAT_TIMEOUT", "60")
            .env("CHORUS_TRACE_DIR", dir.path()),
        90,
    );
    assert!(!ok, "the job must fail when a rank freezes:\n{job}");
    let dumps: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| !name.starts_with('.'))
        .collect();
    // The frozen rank's links are frozen, not its process: it may notice its
    // peers' processes exit (SV-15) and dump too, or be stopped by the
    // launcher first (a half-written dump is a hidden temporary file).
    for rank in [0, 1] {
        assert!(
            dumps.contains(&format!("chorus-trace-g0-r{rank}.json")),
            "rank {rank} must dump: {dumps:?}\n{job}"
        );
    }
    let (ok, report) = run(Command::new(chorus_bin()).arg("trace").arg(dir.path()), 30);
    assert!(ok, "{report}");
    let verdict = report.lines().next().unwrap_or_default();
    assert!(verdict.contains("rank 2"), "the verdict must name rank 2:\n{report}");
}

/// A rank killed under `chorus launch`: the launcher SIGTERMs the survivors,
/// maybe before they noticed the death; each must dump anyway (a SIGTERM
/// dumps first), so `chorus trace` blames only the rank that died. Several
/// runs, as the race between the abort and the signal goes either way.
#[test]
fn ra5_every_survivor_dumps_under_chorus_launch() {
    let _serial = one_at_a_time();
    for run_number in 0..3 {
        let dir = tempfile::tempdir().unwrap();
        let (ok, job) = run(
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
                .env("CHORUS_FAULTS", "kill(rank=2, after_frames=50)")
                .env_remove("CHORUS_TRANSPORT")
                .env("CHORUS_TRACE_DIR", dir.path()),
            60,
        );
        assert!(!ok, "run {run_number}: the job must fail when a rank dies:\n{job}");
        for rank in [0, 1, 3] {
            let dump = dir.path().join(format!("chorus-trace-g0-r{rank}.json"));
            assert!(dump.exists(), "run {run_number}: survivor {rank} must dump:\n{job}");
        }
        let (ok, report) = run(Command::new(chorus_bin()).arg("trace").arg(dir.path()), 30);
        assert!(ok, "{report}");
        let verdict = report.lines().next().unwrap_or_default();
        assert!(
            verdict.contains("rank 2 left no dump") && !verdict.contains("never entered"),
            "run {run_number}: only rank 2 is to blame:\n{report}\n{job}"
        );
    }
}

/// Real rank processes (`chorus fault-probe`: all-reduces in a loop, rank 0
/// serving the store) dumping to `trace_dir`, and their merged output.
/// Dropping them continues and kills every one, so a stopped rank is not
/// left behind when an assertion fails.
fn start_probes(world: usize, trace_dir: &Path) -> Ranks {
    let port = free_port();
    let mut probes = Ranks::new();
    for rank in 0..world {
        let mut command = Command::new(chorus_bin());
        command
            .args(["fault-probe", "--seconds", "120", "--init"])
            .arg(format!("tcp://127.0.0.1:{port}"))
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            // A stopped rank is noticed within seconds, long before any collective timeout.
            .env("CHORUS_HEARTBEAT_TIMEOUT", "3")
            .env("CHORUS_TRACE_DIR", trace_dir);
        probes.spawn(&mut command, "chorus fault-probe");
    }
    probes
}

/// Reads output until each of `ranks` printed a probe line with
/// `event=NAME`, or panics with the output at `deadline`.
fn until_event(probes: &mut Ranks, name: &str, ranks: &[usize], deadline: Instant) {
    probes.until(&format!("event={name} from ranks {ranks:?}"), deadline, |log| {
        ranks.iter().all(|&rank| event(log, rank, name).is_some())
    });
}

/// The first probe line of `rank` with `event=NAME`.
fn event<'a>(log: &'a [String], rank: usize, name: &str) -> Option<&'a str> {
    let prefix = format!("[{rank}] probe ");
    let event = format!(" event={name} ");
    log.iter()
        .find(|line| line.starts_with(&prefix) && format!("{line} ").contains(&event))
        .map(String::as_str)
}

/// Waits until each of `ranks` exited and returns whether each succeeded.
fn exited(probes: &mut Ranks, ranks: &[usize], deadline: Instant) -> Vec<bool> {
    ranks
        .iter()
        .map(|&rank| probes.wait(rank, deadline).success())
        .collect()
}

#[test]
fn chorus_trace_names_a_sigstopped_rank() {
    let _serial = one_at_a_time();
    // Rank 0 serves the store; stopping it would test the store, not the trace.
    const STOPPED: usize = 2;
    const SURVIVORS: [usize; 3] = [0, 1, 3];
    let dir = tempfile::tempdir().unwrap();
    let mut probes = start_probes(4, dir.path());
    until_event(
        &mut probes,
        "running",
        &[0, 1, 2, 3],
        Instant::now() + Duration::from_secs(60),
    );
    // Stopping at a different point of the loop each run: a rank stopped
    // between its sends of one all-reduce leaves some survivors in it and
    // others in the next, which `chorus trace` must still pin on the stopped rank.
    let pause = Duration::from_millis(u64::from(
        SystemTime::now().duration_since(UNIX_EPOCH).unwrap().subsec_nanos() % 300,
    ));
    std::thread::sleep(pause);
    // Drop continues and kills it.
    assert!(
        process::signal(probes.pid(STOPPED), Signal::SIGSTOP),
        "SIGSTOP rank {STOPPED}"
    );
    // A survivor prints its error, then whether the next call failed too, then exits.
    let deadline = Instant::now() + Duration::from_secs(60);
    until_event(&mut probes, "next", &SURVIVORS, deadline);
    let succeeded = exited(&mut probes, &SURVIVORS, deadline);
    assert_eq!(succeeded, [false; 3], "the survivors must fail:\n{}", probes.output());
    let mut dumps: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    dumps.sort();
    assert_eq!(
        dumps,
        [
            "chorus-trace-g0-r0.json",
            "chorus-trace-g0-r1.json",
            "chorus-trace-g0-r3.json"
        ],
        "the survivors dump, the stopped rank cannot:\n{}",
        probes.output()
    );
    // What each survivor completed, by its own account: the probe counts
    // the all-reduces of its loop, the flight recorder numbers them from 0.
    let last_completed: Vec<u64> = SURVIVORS
        .iter()
        .map(|&rank| {
            let error = event(&probes.log, rank, "error").unwrap();
            let iterations: u64 = field(error, "iteration").unwrap().parse().unwrap();
            assert!(iterations >= 20, "rank {rank} stopped before running: {error}");
            iterations - 1
        })
        .collect();
    let context = |report: &str| {
        format!(
            "{report}\nrank {STOPPED} stopped {pause:?} after all ran; probes:\n{}",
            probes.output()
        )
    };

    let (ok, report) = run(Command::new(chorus_bin()).arg("trace").arg(dir.path()), 30);
    assert!(ok, "{}", context(&report));
    let verdict = report.lines().next().unwrap_or_default();
    assert!(
        verdict.contains(&format!("rank {STOPPED} left no dump (killed or frozen?)"))
            && !verdict.contains("never entered"),
        "the verdict must blame the stopped rank {STOPPED}, not a survivor:\n{}",
        context(&report)
    );
    let row = |rank: usize| {
        report
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{rank} ")))
            .unwrap_or_default()
    };
    assert!(row(STOPPED).contains("no dump"), "{}", context(&report));
    for (&rank, last) in SURVIVORS.iter().zip(&last_completed) {
        assert!(
            row(rank).contains(&format!("#{last} all_reduce ")),
            "rank {rank} last completed #{last}:\n{}",
            context(&report)
        );
    }

    let (ok, json) = run(
        Command::new(chorus_bin()).arg("trace").arg(dir.path()).arg("--json"),
        30,
    );
    assert!(ok, "{}", context(&json));
    let json: Value = serde_json::from_str(&json).unwrap_or_else(|e| panic!("{e}: {}", context(&json)));
    assert_eq!(
        json["verdict"].as_str(),
        Some(verdict),
        "{}",
        context(&json.to_string())
    );
    let finding = &json["findings"][0];
    assert_eq!(
        (&finding["kind"], &finding["never_entered"], &finding["no_dump"]),
        (&json!("stuck"), &json!([]), &json!([STOPPED])),
        "{}",
        context(&json.to_string())
    );
    // The collective they wait in is the one after the lowest any survivor completed.
    assert_eq!(
        finding["op"]["seq"].as_u64(),
        last_completed.iter().min().map(|seq| seq + 1),
        "{}",
        context(&json.to_string())
    );
    for (&rank, &last) in SURVIVORS.iter().zip(&last_completed) {
        let row = &json["ranks"][rank];
        assert_eq!(
            (row["last_completed"]["seq"].as_u64(), row["current"]["state"].as_str()),
            (Some(last), Some("failed")),
            "rank {rank}: {}",
            context(&json.to_string())
        );
    }
    assert_eq!(json["ranks"][STOPPED]["dumped"], json!(false));
}
