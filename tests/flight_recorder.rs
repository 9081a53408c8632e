//! The flight recorder end to end: a rank frozen by fault injection makes the
//! others time out; they dump their recorders, and `chorus trace` names the
//! frozen rank.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHORUS: &str = env!("CARGO_BIN_EXE_chorus");

fn run(command: &mut Command, secs: u64) -> (bool, String) {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chorus");
    let deadline = Instant::now() + Duration::from_secs(secs);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chorus did not finish within {secs}s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let output = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[test]
fn chorus_trace_names_the_frozen_rank() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, job) = run(
        Command::new(CHORUS)
            .args([
                "launch",
                "--nproc-per-node",
                "3",
                "--",
                CHORUS,
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
    let dumps: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        dumps.len(),
        2,
        "ranks 0 and 1 dump, the frozen rank cannot: {dumps:?}\n{job}"
    );
    let (ok, report) = run(Command::new(CHORUS).arg("trace").arg(dir.path()), 30);
    assert!(ok, "{report}");
    let verdict = report.lines().next().unwrap_or_default();
    assert!(verdict.contains("rank 2"), "the verdict must name rank 2:\n{report}");
}
