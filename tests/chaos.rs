//! `chorus chaos` in CI: `examples/train.rs` across 3 nodes of this host
//! (one `chorus launch` each) for a minute of faults from a fixed seed
//! (worker SIGKILL and SIGSTOP, a whole launcher SIGKILLed, a slow rank),
//! checked against its fault-free run; every check of the verdict must pass.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use chorus_cli::chaos::{self, Bounds, ChaosOptions, FaultKind, Program};

mod common;
use common::CHORUS;

/// `examples/train.rs`, built beside the `chorus` binary by `cargo test`.
fn example() -> PathBuf {
    let exe = PathBuf::from(CHORUS).with_file_name("examples").join("train");
    assert!(
        exe.exists(),
        "{} missing: `cargo test` builds the examples, `cargo test --test chaos` does not (cargo build --release --example train)",
        exe.display()
    );
    exe
}

#[test]
fn a_minute_of_faults_on_three_nodes_passes_every_check() {
    let options = ChaosOptions {
        program: Program::Example(example()),
        chorus: PathBuf::from(CHORUS),
        nodes: 3,
        hosts: false,
        nproc_per_node: 1,
        duration: Duration::from_secs(60),
        steps: None,
        every: (Duration::from_secs(10), Duration::from_secs(20)),
        faults: vec![
            FaultKind::Kill,
            FaultKind::Stop,
            FaultKind::KillLauncher,
            FaultKind::Slow,
        ],
        seed: 3,
        heartbeat: Duration::from_secs(2),
        bounds: Bounds::default(),
        dir: None,
    };
    let horizon = options.horizon();
    let (tx, rx) = mpsc::channel();
    let (lines_tx, lines) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        let report = chaos::run(&options, &mut |line| {
            let _ = lines_tx.send(line.to_string());
        });
        let _ = tx.send(report);
    });
    // Calibration, the reference (about a minute) and the chaos run (a
    // minute and its recoveries), with room for a loaded machine.
    let report = rx.recv_timeout(Duration::from_secs(420));
    let said: Vec<String> = lines.try_iter().collect();
    let said = said.join("\n");
    let report = match report {
        Ok(Ok(report)) => report,
        Ok(Err(e)) => panic!("the chaos run could not be judged: {e}\n{said}"),
        Err(_) => panic!("the chaos run did not end within 420 s\n{said}"),
    };
    let table = report.verdict.table();
    assert!(report.verdict.passed(), "{table}\n{said}");
    let acted = report.faults.iter().filter(|f| f.acted).count();
    assert!(acted >= 3, "only {acted} faults acted\n{table}\n{said}");
    assert!(
        report.verdict.recovery.as_ref().is_some_and(|r| r.count >= 2),
        "too few recoveries measured\n{table}\n{said}"
    );
    // The seed's schedule: the same faults again, up to where the job ended.
    let again = chaos::schedule::schedule(&chaos::ScheduleSpec {
        seed: 3,
        duration: horizon,
        every: (Duration::from_secs(10), Duration::from_secs(20)),
        kinds: vec![
            FaultKind::Kill,
            FaultKind::Stop,
            FaultKind::KillLauncher,
            FaultKind::Slow,
        ],
        nodes: 3,
        nproc_per_node: 1,
        hosts: false,
    });
    let planned: Vec<_> = report.faults.iter().map(|f| f.planned.clone()).collect();
    assert_eq!(planned, again[..planned.len()]);
}
