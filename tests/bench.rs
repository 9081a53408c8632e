//! `chorus bench` (the collective form) end to end: real rank processes,
//! tiny sweeps, hard deadlines. The Gloo comparison runs when python3 can
//! import torch and skips, saying so, otherwise.

use std::process::{Command, Stdio};

use chorus::process::{self, Signal};
use serde_json::Value;

mod common;
use common::{Stop, chorus_bin};

const HEADER: &str = "#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong";
const UNITS: &str =
    "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)";

struct Output {
    ok: bool,
    stdout: String,
    stderr: String,
}

/// Runs `chorus bench ARGS`, killing it after `secs`.
fn bench(args: &[&str], secs: u64) -> Output {
    let mut command = Command::new(chorus_bin());
    command
        .arg("bench")
        .args(args)
        .env("CHORUS_LOG", "warn")
        .stdin(Stdio::null());
    let output = common::run(&mut command, secs, &format!("chorus bench {args:?}"), Stop::Kill);
    Output {
        ok: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

fn data_rows(table: &str) -> Vec<Vec<&str>> {
    table
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().collect())
        .collect()
}

#[test]
fn all_reduce_table_matches_nccl_tests_and_checks_every_element() {
    let out = bench(
        &[
            "--op",
            "all_reduce",
            "-b",
            "8",
            "-e",
            "32K",
            "-f",
            "8",
            "--world",
            "2",
            "-n",
            "3",
            "-w",
            "1",
            "--check",
            "--transport",
            "quic",
        ],
        60,
    );
    assert!(out.ok, "stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert!(lines.contains(&HEADER), "{}", out.stdout);
    assert!(lines.iter().any(|l| l.starts_with(UNITS)), "{}", out.stdout);
    let rows = data_rows(&out.stdout);
    let sizes: Vec<&str> = rows.iter().map(|r| r[0]).collect();
    assert_eq!(sizes, ["8", "64", "512", "4096", "32768"], "{}", out.stdout);
    for row in &rows {
        assert_eq!(row.len(), 13, "{row:?}");
        assert_eq!(row[1].parse::<usize>().unwrap() * 4, row[0].parse::<usize>().unwrap());
        assert_eq!(&row[2..5], ["float", "sum", "-1"]);
        assert_eq!((row[8], row[12]), ("0", "0"), "#wrong: {row:?}");
        for col in [5, 6, 7, 9, 10, 11] {
            assert!(row[col].parse::<f64>().unwrap() >= 0.0, "{row:?}");
        }
        // all-reduce of 2 ranks: busbw = algbw x 2(n-1)/n = algbw.
        assert_eq!(row[6], row[7]);
    }
    assert!(
        lines.iter().any(|l| l.starts_with("# Avg bus bandwidth : ")),
        "{}",
        out.stdout
    );
    assert!(
        lines.iter().any(|l| l.starts_with("# Out of bounds values : 0 OK")),
        "{}",
        out.stdout
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("# Single-thread memcpy bandwidth : ")),
        "{}",
        out.stdout
    );
    // Progress goes to stderr (and is hidden off a terminal), never into the table.
    assert!(!out.stdout.contains('['), "{}", out.stdout);
    // Piped, the bench still says it runs: a line per finished size.
    let done: Vec<&str> = out.stderr.lines().filter(|l| l.contains(" B done (")).collect();
    assert_eq!(done.len(), 5, "{}", out.stderr);
    assert!(
        done[0].starts_with("chorus bench: all_reduce 8 B done (1 of 5 sizes): median ") && done[0].ends_with(" us"),
        "{}",
        out.stderr
    );
}

#[test]
fn json_rows_parse_and_the_plot_is_a_png() {
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("busbw.png");
    let out = bench(
        &[
            "--op",
            "all_gather",
            "-b",
            "64",
            "-e",
            "4K",
            "-f",
            "8",
            "--world",
            "2",
            "-n",
            "2",
            "-w",
            "1",
            "--check",
            "--json",
            "--plot",
            png.to_str().unwrap(),
        ],
        60,
    );
    assert!(out.ok, "stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
    let rows: Vec<Value> = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(rows.len(), 3, "{}", out.stdout);
    for (row, size) in rows.iter().zip([64.0, 512.0, 4096.0]) {
        assert_eq!(row.get("library").and_then(Value::as_str), Some("chorus"));
        assert_eq!(row.get("op").and_then(Value::as_str), Some("all_gather"));
        assert_eq!(row.get("size").and_then(Value::as_f64), Some(size));
        // all_gather: size = count x 4 B x 2 ranks.
        assert_eq!(row.get("count").and_then(Value::as_f64), Some(size / 8.0));
        for half in ["oop", "ip"] {
            let h = row.get(half).unwrap();
            assert!(h.get("median_us").and_then(Value::as_f64).unwrap() > 0.0);
            assert!(h.get("busbw").and_then(Value::as_f64).unwrap() >= 0.0);
            assert_eq!(h.get("wrong").and_then(Value::as_f64), Some(0.0));
        }
    }
    let bytes = std::fs::read(&png).expect("the plot was written");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(bytes.len() > 2000, "a suspiciously small PNG: {} bytes", bytes.len());
}

#[test]
fn every_op_checks_in_process() {
    for op in [
        "broadcast",
        "reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "send_recv",
    ] {
        let out = bench(
            &[
                "--op",
                op,
                "--in-process",
                "-b",
                "96",
                "-e",
                "96K",
                "-f",
                "1024",
                "--world",
                "3",
                "-n",
                "2",
                "-w",
                "1",
                "--check",
                "--root",
                "1",
            ],
            30,
        );
        assert!(out.ok, "{op}: stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
        let rows = data_rows(&out.stdout);
        assert_eq!(rows.len(), 2, "{op}: {}", out.stdout);
        for row in &rows {
            assert_eq!((row[8], row[12]), ("0", "0"), "{op}: #wrong: {row:?}");
            let rooted = matches!(op, "broadcast" | "reduce");
            assert_eq!(row[4], if rooted { "1" } else { "-1" }, "{op}: root column");
            assert_eq!(
                row[3],
                if matches!(op, "reduce" | "reduce_scatter") {
                    "sum"
                } else {
                    "none"
                }
            );
        }
    }
}

#[test]
fn a_transport_the_mesh_rejects_is_reported() {
    let out = bench(
        &[
            "--transport",
            "carrier-pigeon",
            "-b",
            "8",
            "-e",
            "8",
            "-n",
            "1",
            "-w",
            "0",
        ],
        30,
    );
    assert!(!out.ok);
    assert!(out.stderr.contains("CHORUS_TRANSPORT"), "{}", out.stderr);
    assert!(out.stderr.contains("carrier-pigeon"), "{}", out.stderr);
}

#[test]
#[ignore = "needs PyTorch (python3 -c 'import torch'); run: cargo test --workspace --release -- --ignored torch_"]
fn torch_compare_gloo_adds_the_ratio_columns() {
    common::require_torch();
    let out = bench(
        &[
            "--op",
            "all_reduce",
            "-b",
            "8",
            "-e",
            "8K",
            "-f",
            "32",
            "--world",
            "2",
            "-n",
            "2",
            "-w",
            "1",
            "--compare",
            "gloo",
        ],
        90,
    );
    assert!(out.ok, "stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
    assert!(out.stdout.contains("chorus/gloo busbw"), "{}", out.stdout);
    assert!(
        out.stdout.contains("gloo (python3 lab/python/bench_gloo.py"),
        "{}",
        out.stdout
    );
    let rows = data_rows(&out.stdout);
    // Three chorus rows with two ratios each, then three Gloo rows.
    assert_eq!(rows.len(), 6, "{}", out.stdout);
    for row in &rows[..3] {
        assert_eq!(row.len(), 15, "{row:?}");
        for ratio in &row[13..] {
            assert!(ratio.trim_end_matches('x').parse::<f64>().unwrap() > 0.0, "{row:?}");
        }
    }
    for row in &rows[3..] {
        assert_eq!(row.len(), 13, "{row:?}");
    }
}

#[test]
fn compare_gloo_without_torch_says_so_and_still_measures_chorus() {
    let out = bench(
        &[
            "-b",
            "8",
            "-e",
            "8",
            "--world",
            "2",
            "-n",
            "1",
            "-w",
            "0",
            "--compare",
            "gloo",
            "--python",
            "/nonexistent/python3",
        ],
        30,
    );
    assert!(out.ok, "stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
    assert!(out.stderr.contains("no comparison"), "{}", out.stderr);
    assert_eq!(data_rows(&out.stdout).len(), 1, "{}", out.stdout);
}

/// The pids of `parent`'s children, started by any of its threads (Linux).
fn children(parent: u32) -> Vec<i32> {
    let tasks = std::fs::read_dir(format!("/proc/{parent}/task"))
        .into_iter()
        .flatten()
        .flatten();
    let mut pids: Vec<i32> = tasks
        .flat_map(|task| {
            std::fs::read_to_string(task.path().join("children"))
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<_>>()
        })
        .collect();
    pids.sort();
    pids
}

#[test]
fn a_rank_stopped_mid_run_ends_the_bench_naming_it() {
    use std::time::{Duration, Instant};
    let mut command = Command::new(chorus_bin());
    command
        .args([
            "bench",
            "--world",
            "3",
            "-b",
            "8",
            "-e",
            "8",
            "-n",
            "10000000",
            "-w",
            "0",
            "--timeout",
            "300",
        ])
        .env("CHORUS_LOG", "warn")
        .env("CHORUS_HEARTBEAT_TIMEOUT", "2")
        .stdin(Stdio::null());
    let child = common::spawn_piped(&mut command, "chorus bench");
    let started = Instant::now();
    let ranks = loop {
        let ranks = children(child.id());
        if ranks.len() == 3 {
            break ranks;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the bench did not start 3 ranks"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    // Let them form the group and start measuring.
    std::thread::sleep(Duration::from_secs(3));
    let rank_of = |pid: i32| {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        environ
            .split(|&b| b == 0)
            .find_map(|var| var.strip_prefix(b"RANK="))
            .map(|r| String::from_utf8_lossy(r).into_owned())
            .expect("a rank process has RANK")
    };
    let frozen = ranks[1];
    let frozen_rank = rank_of(frozen);
    process::signal(frozen, Signal::SIGSTOP);
    let stopped = Instant::now();
    let output = common::finish(child, 60, "chorus bench with a stopped rank", Stop::Kill);
    let took = stopped.elapsed();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    // The heartbeat window (2 s), then the bench's grace for the frozen rank.
    assert!(
        took < Duration::from_secs(10),
        "the bench ended {took:?} after the stop: {stderr}"
    );
    assert!(stderr.contains(&format!("rank {frozen_rank}: no answer")), "{stderr}");
    let alive = process::exists(frozen);
    assert!(!alive, "the stopped rank {frozen} was left behind");
}
