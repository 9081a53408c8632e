//! `chorus trace DIR` end to end: dumps written through the library API, the
//! command run as a process, its verdict, table, JSON and exit codes checked.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chorus_runtime::flight::{self, FlightOp, FlightRecorder};
use serde_json::Value;

mod common;
use common::{Stop, chorus_bin};

fn at(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_700_000_000) + Duration::from_millis(ms)
}

fn all_reduce() -> FlightOp {
    FlightOp {
        kind: "all_reduce".into(),
        dtype: "float32".into(),
        count: 1 << 20,
        root: None,
        peer: None,
        reduce_op: Some("sum".into()),
    }
}

/// Writes rank `rank`'s dump: collectives `0..completed` done, and when
/// `waiting`, collective `completed` entered 30 s before the dump.
fn write_rank(dir: &Path, rank: usize, world: usize, generation: u64, completed: u64, waiting: bool) {
    let mut recorder = FlightRecorder::new(flight::DEFAULT_CAPACITY);
    for seq in 0..completed {
        let id = recorder.record_scheduled(seq, all_reduce(), at(seq * 10));
        recorder.record_started(id, at(seq * 10 + 1));
        recorder.record_completed(id, at(seq * 10 + 2));
    }
    if waiting {
        let id = recorder.record_scheduled(completed, all_reduce(), at(10_000));
        recorder.record_started(id, at(10_000));
    }
    let dump = recorder.dump(rank, world, generation, "timeout", at(40_000));
    flight::write_dump(dir, &dump).expect("write the dump");
}

fn trace(dir: &Path, json: bool) -> Output {
    let mut command = Command::new(chorus_bin());
    command.arg("trace").arg(dir).stdin(Stdio::null());
    if json {
        command.arg("--json");
    }
    common::run(&mut command, 30, "chorus trace", Stop::Kill)
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn trace_names_the_frozen_rank_and_the_last_completed_operations() {
    let dir = tempfile::tempdir().unwrap();
    for rank in [0, 1, 3] {
        write_rank(dir.path(), rank, 4, 2, 41, true);
    }
    write_rank(dir.path(), 2, 4, 2, 41, false);
    // An older generation, a stray file and a corrupt dump: set aside, said.
    write_rank(dir.path(), 0, 4, 1, 5, true);
    std::fs::write(dir.path().join("README.txt"), "not a dump").unwrap();
    std::fs::write(
        dir.path().join("chorus-trace-g2-r9.json"),
        "{\"format\":\"chorus-flight-rec",
    )
    .unwrap();

    let output = trace(dir.path(), false);
    let text = stdout(&output);
    assert!(
        output.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut lines = text.lines();
    assert_eq!(
        lines.next(),
        Some("rank 2 never entered #41 all_reduce(1048576 x float32, sum) that ranks 0, 1, 3 are waiting in")
    );
    assert!(
        text.contains("generation 2, world size 4: 4 of 4 ranks dumped"),
        "{text}"
    );
    let row = |rank: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(rank))
            .unwrap_or_default()
            .to_string()
    };
    assert!(row("2 ").contains("#40 all_reduce"), "{text}");
    assert!(
        row("0 ").contains("#41 all_reduce(1048576 x float32, sum) running for 30.0 s"),
        "{text}"
    );
    // The table fits a terminal, and the reason all four share is said once.
    for line in text.lines().skip(1).filter(|l| !l.starts_with("unreadable: ")) {
        assert!(line.chars().count() <= 100, "too wide: {line:?}\n{text}");
    }
    assert_eq!(
        text.lines().filter(|l| l.starts_with("[1] timeout")).count(),
        1,
        "{text}"
    );
    assert!(!text.contains("[2]"), "one reason, one footnote:\n{text}");
    assert!(text.contains("ignored the dumps of rank 0 of generation 1"), "{text}");
    assert!(
        text.contains("unreadable: ") && text.contains("chorus-trace-g2-r9.json: not valid JSON"),
        "{text}"
    );
    assert!(!text.contains("README"), "{text}");

    let output = trace(dir.path(), true);
    assert!(output.status.success());
    let report = serde_json::from_slice::<Value>(&output.stdout).expect("--json prints one JSON document");
    assert_eq!(
        report.get("verdict").and_then(Value::as_str),
        Some("rank 2 never entered #41 all_reduce(1048576 x float32, sum) that ranks 0, 1, 3 are waiting in")
    );
    let unreadable = report.get("unreadable").and_then(Value::as_array).unwrap();
    assert_eq!(unreadable.len(), 1);
}

#[test]
fn trace_names_a_rank_that_left_no_dump() {
    let dir = tempfile::tempdir().unwrap();
    for rank in [0, 2, 3] {
        write_rank(dir.path(), rank, 4, 0, 7, true);
    }
    let output = trace(dir.path(), false);
    assert!(output.status.success());
    assert_eq!(
        stdout(&output).lines().next(),
        Some(
            "ranks 0, 2, 3 are waiting in #7 all_reduce(1048576 x float32, sum); rank 1 left no dump (killed or frozen?)"
        )
    );
}

#[test]
fn trace_says_when_nothing_is_stuck() {
    let dir = tempfile::tempdir().unwrap();
    for rank in 0..2 {
        write_rank(dir.path(), rank, 2, 0, 3, false);
    }
    let output = trace(dir.path(), false);
    assert!(output.status.success());
    assert_eq!(
        stdout(&output).lines().next(),
        Some("nothing is stuck: no rank is inside an operation")
    );
}

#[test]
fn unusable_dumps_exit_1_and_say_why() {
    let dir = tempfile::tempdir().unwrap();
    let output = trace(dir.path(), false);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("no readable flight-recorder dumps"));

    std::fs::write(dir.path().join("chorus-trace-g0-r0.json"), b"\x00\x01garbage").unwrap();
    let output = trace(dir.path(), true);
    assert_eq!(output.status.code(), Some(1));
    let report = serde_json::from_slice::<Value>(&output.stdout).unwrap();
    assert!(report.get("error").is_some());
    assert_eq!(
        report.get("unreadable").and_then(Value::as_array).map(Vec::len),
        Some(1)
    );

    let output = trace(&dir.path().join("missing"), false);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("cannot read"));
}
