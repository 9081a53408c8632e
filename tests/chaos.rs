//! `chorus chaos` in CI: `examples/train.rs` across 3 nodes of this host
//! (one `chorus launch` each) for a minute of faults from a fixed seed
//! (worker SIGKILL and SIGSTOP, a whole launcher SIGKILLed, a slow rank),
//! checked against its fault-free run; every check of the verdict must pass.
//! A shorter run mixes `corrupt` faults with kills.
//! `netns_` (root, ignored unless asked for): the same across 3 simulated
//! hosts (`chorus chaos --hosts 3`), with a partition and a slow link.

use std::path::PathBuf;
use std::sync::{Mutex, mpsc};
use std::time::Duration;

use chorus_lab::chaos::{self, Bounds, ChaosOptions, FaultKind, Program};

mod common;
use common::{chorus_bin, example};

/// Runs `options` on a thread, failing the test past `secs`; the report
/// and what the run said.
fn run_within(options: ChaosOptions, secs: u64) -> (chaos::ChaosReport, String) {
    // One run at a time: each compares its rates with a fault-free run's,
    // which another run beside it would skew.
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (tx, rx) = mpsc::channel();
    let (lines_tx, lines) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        let report = chaos::run(&options, &mut |line| {
            let _ = lines_tx.send(line.to_string());
        });
        let _ = tx.send(report);
    });
    let report = rx.recv_timeout(Duration::from_secs(secs));
    let said: Vec<String> = lines.try_iter().collect();
    let said = said.join("\n");
    match report {
        Ok(Ok(report)) => (report, said),
        Ok(Err(e)) => panic!("the chaos run could not be judged: {e}\n{said}"),
        Err(_) => panic!("the chaos run did not end within {secs} s\n{said}"),
    }
}

#[test]
#[ignore = "needs root: network namespaces (CI runs it as root: --ignored netns_)"]
fn netns_a_minute_of_faults_across_three_simulated_hosts_passes_every_check() {
    let kinds = vec![
        FaultKind::Kill,
        FaultKind::Stop,
        FaultKind::KillLauncher,
        FaultKind::Slow,
        FaultKind::Partition,
        FaultKind::LossyLink,
        FaultKind::SlowLink,
    ];
    let options = ChaosOptions {
        program: Program::Example(example("train")),
        chorus: PathBuf::from(chorus_bin()),
        nodes: 3,
        hosts: true,
        nproc_per_node: 1,
        duration: Duration::from_secs(60),
        steps: None,
        every: (Duration::from_secs(10), Duration::from_secs(20)),
        faults: kinds.clone(),
        // Its schedule: a partition at 12.6 s, a slow link at 22.8 s, a
        // worker killed at 41.7 s.
        seed: 97,
        heartbeat: Duration::from_secs(2),
        // The slow links slow the job by design, and on CI's 2 shared cores
        // the fault-free rate itself moves by a fifth from run to run
        // (measured: 0.77 with every other check passing); the 0.9 of the
        // 10-minute target is measured, not asserted, here.
        bounds: Bounds {
            min_goodput: 0.6,
            ..Bounds::default()
        },
        dir: None,
    };
    let horizon = options.horizon();
    // Calibration, the reference and the chaos run, a minute each at most
    // but the calibration, with room for a loaded machine.
    let (report, said) = run_within(options, 420);
    let table = report.verdict.table();
    assert!(report.hosts, "not run across simulated hosts");
    assert!(report.verdict.passed(), "{table}\n{said}");
    for kind in [FaultKind::Partition, FaultKind::SlowLink, FaultKind::Kill] {
        assert!(
            report.faults.iter().any(|f| f.acted && f.planned.kind == kind),
            "no {} fault acted\n{table}\n{said}",
            kind.name()
        );
    }
    assert!(
        said.contains("partition of node 0 undone") && said.contains("starting node 0's launcher again"),
        "the partitioned host's launcher did not come back after the heal\n{said}"
    );
    assert!(
        report.verdict.recovery.as_ref().is_some_and(|r| r.count >= 2),
        "too few recoveries measured\n{table}\n{said}"
    );
    let again = chaos::schedule::schedule(&chaos::ScheduleSpec {
        seed: 97,
        duration: horizon,
        every: (Duration::from_secs(10), Duration::from_secs(20)),
        kinds,
        nodes: 3,
        nproc_per_node: 1,
        hosts: true,
    });
    let planned: Vec<_> = report.faults.iter().map(|f| f.planned.clone()).collect();
    assert_eq!(planned, again[..planned.len()]);
    // Nothing of the hosts is left.
    let netns = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    let left = String::from_utf8_lossy(&netns.stdout).into_owned();
    let ours = format!("chaos{}-", std::process::id());
    assert!(!left.contains(&ours), "namespaces left: {left}");
}

/// How far apart the minute's faults come: three within 42 s, as the
/// calibration can overestimate a step (its 200 steps include the
/// start-up) and the run then ends well before its minute.
const EVERY: (Duration, Duration) = (Duration::from_secs(8), Duration::from_secs(14));

#[test]
fn a_minute_of_faults_on_three_nodes_passes_every_check() {
    let options = ChaosOptions {
        program: Program::Example(example("train")),
        chorus: PathBuf::from(chorus_bin()),
        nodes: 3,
        hosts: false,
        nproc_per_node: 1,
        duration: Duration::from_secs(60),
        steps: None,
        every: EVERY,
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
    // Calibration, the reference (about a minute) and the chaos run (a
    // minute and its recoveries), with room for a loaded machine.
    let (report, said) = run_within(options, 420);
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
        every: EVERY,
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

/// `corrupt` faults (a bit of a worker's parameters, then of its local
/// gradient, asked for through the job's live records) among kills: every
/// flip a worker carried out is found within the check interval and healed
/// in place, and the run passes every check against its fault-free one.
#[test]
fn corruptions_among_kills_are_found_and_healed_in_place() {
    let options = ChaosOptions {
        program: Program::Example(example("train")),
        chorus: PathBuf::from(chorus_bin()),
        nodes: 3,
        hosts: false,
        nproc_per_node: 1,
        duration: Duration::from_secs(30),
        steps: None,
        every: (Duration::from_secs(4), Duration::from_secs(6)),
        faults: vec![FaultKind::Corrupt, FaultKind::Kill],
        seed: 2,
        heartbeat: Duration::from_secs(2),
        // The checks of corruption are this run's point; on CI's 2 shared
        // cores a 30 s run's rate against its reference moves by a tenth
        // (measured: 0.88 with every other check passing). The minute run
        // above holds 0.9.
        bounds: Bounds {
            min_goodput: 0.8,
            ..Bounds::default()
        },
        dir: None,
    };
    let (report, said) = run_within(options, 300);
    let table = report.verdict.table();
    assert!(report.verdict.passed(), "{table}\n{said}");
    let check = report
        .verdict
        .checks
        .iter()
        .find(|c| c.name == "corruptions")
        .expect("a corruptions check");
    // "N asked, M carried out, K found in time[, ...]"
    let numbers: Vec<usize> = check.value.split([' ', ',']).filter_map(|w| w.parse().ok()).collect();
    assert!(
        numbers.len() >= 3 && numbers[2] >= 2,
        "too few corruptions found: {}\n{table}\n{said}",
        check.value
    );
    assert!(
        said.contains("corrupt_params asked for") && said.contains("corrupt_grads asked for"),
        "{said}"
    );
}
