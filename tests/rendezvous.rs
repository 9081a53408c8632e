//! Rendezvous between real processes (the `chorus` binary), over each init
//! method, and the errors a user gets for each way of getting it wrong.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

mod common;
use common::{Stop, chorus_bin, free_port, joined, spawn_piped};

/// Runs `command` to completion, killing it and failing the test after `secs`.
fn run(mut command: Command, secs: u64) -> Output {
    common::run(&mut command, secs, "chorus", Stop::Kill)
}

fn hello(world: usize, init: &str) {
    let mut command = Command::new(chorus_bin());
    // Info events go to a pipe here: they must come without colour codes.
    command.env("CHORUS_LOG", "info").env_remove("CHORUS_JOB_SECRET").args([
        "hello",
        "--world",
        &world.to_string(),
        "--init",
        init,
        "--timeout",
        "60",
    ]);
    let output = run(command, 90);
    let all = joined(&output);
    assert!(
        output.status.success(),
        "hello --world {world} --init {init} failed:\n{all}"
    );
    assert!(!all.contains('\x1b'), "colour codes in a pipe:\n{all}");
    assert!(
        !all.contains("CHORUS_JOB_SECRET is not set"),
        "hello hands its ranks a job secret:\n{all}"
    );
    for rank in 0..world {
        let found: Vec<&str> = all
            .lines()
            .filter(|l| l.starts_with(&format!("[{rank}]:   rank ")))
            .collect();
        assert_eq!(found.len(), world, "rank {rank} should list {world} peers:\n{all}");
        assert!(
            found.iter().all(|l| l.contains("via 127.0.0.1")),
            "peers on this host are reached over loopback:\n{all}"
        );
        for peer in (0..world).filter(|&p| p != rank) {
            let greeting = format!("said \"hello from rank {peer}\"");
            assert!(
                found.iter().any(|l| l.contains(&greeting)),
                "rank {rank} never heard rank {peer}:\n{all}"
            );
        }
    }
    assert!(all.contains(&format!("all {world} ranks found each other")), "{all}");
}

#[test]
fn processes_meet_over_tcp() {
    for world in [1, 2, 5] {
        hello(world, "tcp");
    }
}

#[test]
fn processes_meet_over_a_file() {
    for world in [1, 2, 5] {
        hello(world, "file");
    }
}

#[test]
fn processes_meet_over_env() {
    for world in [1, 2, 5] {
        hello(world, "env");
    }
}

/// One rank process, with a clean environment plus `env`.
fn worker(url: &str, timeout_secs: u64, env: &[(&str, String)]) -> Command {
    let mut command = Command::new(chorus_bin());
    command
        .args(["hello", "--timeout", &timeout_secs.to_string(), "--worker", url])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default());
    for (k, v) in env {
        command.env(k, v);
    }
    command
}

#[test]
fn a_rank_outside_the_world_is_refused() {
    let url = format!("tcp://127.0.0.1:{}?rank=3&world_size=2", free_port());
    let output = run(worker(&url, 5, &[]), 30);
    assert!(!output.status.success());
    assert!(
        joined(&output).contains("rank 3 is out of range for world size 2"),
        "{}",
        joined(&output)
    );
}

#[test]
fn env_init_names_the_missing_variable() {
    let output = run(worker("env://", 5, &[]), 30);
    assert!(!output.status.success());
    assert!(joined(&output).contains("MASTER_ADDR"), "{}", joined(&output));
    let env = [
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", free_port().to_string()),
        ("WORLD_SIZE", "2".to_string()),
    ];
    let output = run(worker("env://", 5, &env), 30);
    assert!(!output.status.success());
    assert!(joined(&output).contains("RANK"), "{}", joined(&output));
}

#[test]
fn an_unreachable_store_is_reported_with_address_and_time() {
    let port = free_port();
    let url = format!("tcp://127.0.0.1:{port}?rank=1&world_size=2");
    let started = Instant::now();
    let output = run(worker(&url, 2, &[]), 30);
    assert!(!output.status.success());
    let all = joined(&output);
    assert!(
        all.contains(&format!("could not connect to store at 127.0.0.1:{port}")),
        "{all}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "gave up late: {:?}",
        started.elapsed()
    );
}

#[test]
fn hello_with_a_bad_setting_fails_fast_naming_the_rank_and_why() {
    let mut command = Command::new(chorus_bin());
    command
        .args(["hello", "--world", "4", "--timeout", "60"])
        .env("CHORUS_TRANSPORT", "bogus");
    let started = Instant::now();
    let output = run(command, 90);
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(took < Duration::from_secs(10), "hello took {took:?}: {stderr}");
    let summary = stderr.lines().last().unwrap_or_default();
    assert!(
        summary.starts_with("chorus: error: rank ") && summary.contains("CHORUS_TRANSPORT=\"bogus\""),
        "{stderr}"
    );
}

#[test]
fn a_store_that_never_answers_fails_init_within_its_timeout() {
    // Accepts (the kernel does) and never answers, as a stopped rank 0 would.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let url = format!("tcp://127.0.0.1:{port}?rank=1&world_size=2");
    let started = Instant::now();
    let output = run(worker(&url, 2, &[]), 30);
    let took = started.elapsed();
    let all = joined(&output);
    assert!(!output.status.success(), "{all}");
    assert!(took < Duration::from_secs(4), "init gave up after {took:?}: {all}");
    assert!(
        all.contains(&format!("store tcp://127.0.0.1:{port} did not answer")),
        "{all}"
    );
}

#[test]
fn a_duplicate_rank_fails_every_rank_at_once_naming_both_processes() {
    let port = free_port();
    let url = |rank: usize| format!("tcp://127.0.0.1:{port}?rank={rank}&world_size=3");
    // A rendezvous timeout far beyond the test's bound: the conflict, not the timeout, must end them.
    let spawn = |rank: usize| spawn_piped(&mut worker(&url(rank), 300, &[]), "chorus");
    let rank0 = spawn(0);
    std::thread::sleep(Duration::from_millis(300));
    let first = spawn(1);
    let first_pid = first.id();
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    let second = run(worker(&url(1), 300, &[]), 30);
    let all = joined(&second);
    assert!(!second.status.success());
    assert!(all.contains("rank 1 is claimed twice"), "{all}");
    assert!(
        all.contains(&format!("pid {first_pid}")),
        "the first claimant's pid must be named: {all}"
    );
    let message = all
        .lines()
        .find_map(|l| l.strip_prefix("chorus: error: "))
        .expect("an error line")
        .to_string();
    for (who, child) in [("rank 0", rank0), ("the first rank 1", first)] {
        let output = wait_with_deadline(child, 30);
        let all = joined(&output);
        assert!(!output.status.success(), "{who} should fail: {all}");
        assert!(
            all.contains(&message),
            "{who} must fail with the same message:\n{message}\n{all}"
        );
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "the ranks failed {took:?} after the conflict"
    );
}

fn wait_with_deadline(child: std::process::Child, secs: u64) -> Output {
    let what = format!("process {}", child.id());
    common::finish(child, secs, &what, Stop::Kill)
}

/// A rank at `tcp://127.0.0.1:PORT?{first}`, then 300 ms later one at
/// `?{second}` (both with a `timeout` in seconds): both outputs, each within
/// 10 s of the second's start.
fn after_a_first_rank(first: &str, second: &str, timeout: u64) -> (Output, Output) {
    let port = free_port();
    let url = |query: &str| format!("tcp://127.0.0.1:{port}?{query}");
    let rank0 = spawn_piped(&mut worker(&url(first), timeout, &[]), "chorus");
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let output = run(worker(&url(second), timeout, &[]), 30);
    let first = wait_with_deadline(rank0, 30);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(10),
        "the ranks ended {took:?} after the second started"
    );
    (first, output)
}

#[test]
fn ranks_that_disagree_on_the_world_size_all_fail_at_once_and_are_told_so() {
    let (first, second) = after_a_first_rank("rank=0&world_size=2", "rank=1&world_size=3", 300);
    let all = joined(&second);
    assert!(!second.status.success());
    assert!(all.contains("world size mismatch"), "{all}");
    assert!(all.contains("world size 3") && all.contains("world size 2"), "{all}");
    let message = all
        .lines()
        .find_map(|l| l.strip_prefix("chorus: error: "))
        .expect("an error line");
    let all0 = joined(&first);
    assert!(!first.status.success(), "{all0}");
    assert!(
        all0.contains(message),
        "rank 0 must fail with the same message:\n{message}\n{all0}"
    );
}

#[test]
fn two_rank_zeros_cannot_both_serve() {
    // The second cannot serve, so it never reaches the store to tell the
    // first, which waits out its (short) timeout.
    let (_, output) = after_a_first_rank("rank=0&world_size=2", "rank=0&world_size=2", 4);
    let all = joined(&output);
    assert!(!output.status.success());
    assert!(all.contains("port is in use") || all.contains("claimed twice"), "{all}");
}

#[test]
fn a_rank_without_the_job_secret_is_refused() {
    let port = free_port();
    let url = |rank: usize| format!("tcp://127.0.0.1:{port}?rank={rank}&world_size=2");
    let rank0 = spawn_piped(
        &mut worker(&url(0), 5, &[("CHORUS_JOB_SECRET", "the-real-secret".to_string())]),
        "chorus",
    );
    let intruder = run(worker(&url(1), 5, &[("CHORUS_JOB_SECRET", "a-guess".to_string())]), 30);
    let rank0 = wait_with_deadline(rank0, 30);
    assert!(!rank0.status.success() && !intruder.status.success());
    let all = joined(&rank0);
    assert!(
        all.contains("rank 1 (pid") && all.contains("not signed with this job's secret"),
        "{all}"
    );
}

#[test]
fn faults_from_the_environment_kill_the_named_rank() {
    let mut command = Command::new(chorus_bin());
    command
        .args(["hello", "--world", "3", "--timeout", "5"])
        .env("CHORUS_FAULTS", "kill(rank=1)");
    let output = run(command, 60);
    let all = joined(&output);
    assert!(!output.status.success(), "{all}");
    assert!(
        all.contains("rank 1 exited with signal: 9"),
        "rank 1 must die by SIGKILL:\n{all}"
    );
}

#[test]
fn the_transport_follows_chorus_transport() {
    for (choice, expected) in [("auto", "shm said"), ("quic", "quic said"), ("shm", "shm said")] {
        let mut command = Command::new(chorus_bin());
        command
            .args(["hello", "--world", "3", "--timeout", "30"])
            .env("CHORUS_TRANSPORT", choice);
        let output = run(command, 60);
        let all = joined(&output);
        assert!(output.status.success(), "CHORUS_TRANSPORT={choice}:\n{all}");
        assert_eq!(
            all.matches(expected).count(),
            6,
            "CHORUS_TRANSPORT={choice} must give 6 {expected:?} lines:\n{all}"
        );
        assert_eq!(
            all.matches("correct;").count(),
            3,
            "every rank checks its all_reduce:\n{all}"
        );
    }
    let mut command = Command::new(chorus_bin());
    command
        .args(["hello", "--world", "2", "--timeout", "10"])
        .env("CHORUS_TRANSPORT", "carrier-pigeon");
    let output = run(command, 60);
    assert!(!output.status.success());
    assert!(
        joined(&output).contains("CHORUS_TRANSPORT=\"carrier-pigeon\" is not a transport"),
        "{}",
        joined(&output)
    );
}

/// A rank whose peers have not come says, while it waits, whom it waits
/// for and how long is left; and one whose store is not up yet says so.
#[test]
fn a_long_wait_says_whom_it_waits_for() {
    let port = free_port();
    let url = format!("tcp://127.0.0.1:{port}?rank=0&world_size=3");
    let output = run(worker(&url, 7, &[]), 30);
    assert!(!output.status.success());
    let all = joined(&output);
    assert!(
        all.contains(&format!(
            "rank 0: waiting for ranks 1, 2 of 3 (generation 0) at tcp://127.0.0.1:{port}; 5 s of 7 s"
        )),
        "{all}"
    );

    let port = free_port();
    let url = format!("tcp://127.0.0.1:{port}?rank=1&world_size=2");
    let output = run(worker(&url, 7, &[]), 30);
    assert!(!output.status.success());
    let all = joined(&output);
    assert!(
        all.contains(&format!("waiting for the store at tcp://127.0.0.1:{port} (")) && all.contains("s of 7 s"),
        "{all}"
    );
}
