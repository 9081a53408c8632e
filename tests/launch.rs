//! `chorus launch` with real processes: the environment torchrun gives,
//! failures reported and restarted, signals, two launchers forming one job,
//! bad input, and PyTorch and chorus programs running under it.
//!
//! Every child runs under a deadline: past it, the test kills it and fails
//! with what it printed.

use chorus::process::{self, Signal};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

mod common;
use common::{LAUNCHER, chorus_bin, finish, free_port, text};

const PYTHON_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../lab/python");

/// `chorus launch ARGS`, with stdout and stderr captured.
fn launch(args: &[&str]) -> Command {
    let mut command = Command::new(chorus_bin());
    command
        .arg("launch")
        .args(args)
        .env_remove("CHORUS_JOB_SECRET")
        .env_remove("OMP_NUM_THREADS")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Runs `command` to its end; past `secs` stops it (SIGTERM first) and fails.
fn run(mut command: Command, secs: u64) -> Output {
    common::run(&mut command, secs, "chorus launch", LAUNCHER)
}

/// The python that has torch, or `None` (tests needing it then skip).
fn torch_python() -> Option<&'static str> {
    static PYTHON: OnceLock<Option<String>> = OnceLock::new();
    PYTHON.get_or_init(|| common::python_importing(&["torch"])).as_deref()
}

/// Writes an executable shell script.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// `KEY=value` lines (output of `env`) into a map.
fn parse_env(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn json_env(path: &Path) -> BTreeMap<String, String> {
    // A flat {"key": "value"} object from json.dump(dict(os.environ)); read
    // through python to stay free of a JSON dependency.
    let python = torch_python().unwrap();
    let output = Command::new(python)
        .args([
            "-c",
            "import json,sys\nfor k,v in json.load(open(sys.argv[1])).items(): print(k+'='+v.replace('\\n',' '))",
        ])
        .arg(path)
        .output()
        .unwrap();
    parse_env(&String::from_utf8_lossy(&output.stdout))
}

/// torchrun and chorus launch, same flags, same script (each worker dumps
/// its environment): every variable must be equal except
/// - `TORCHELASTIC_ERROR_FILE`: a path under each launcher's own directory
///   (both end in `attempt_0/<rank>/error.json`, checked);
/// - `CHORUS_JOB_SECRET`: chorus only (random);
/// - `_`: set by some shells to the last command (the launcher's path).
///
/// Compared, among all inherited ones: RANK, LOCAL_RANK, WORLD_SIZE,
/// LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_NAME,
/// ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (fixed with --master-port, so
/// equal), TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
/// TORCHELASTIC_RUN_ID (fixed with --rdzv-id), TORCHELASTIC_USE_AGENT_STORE,
/// TORCHELASTIC_SIGNALS_TO_HANDLE, TORCH_NCCL_ASYNC_ERROR_HANDLING,
/// OMP_NUM_THREADS.
#[test]
fn environment_equals_torchruns() {
    let Some(python) = torch_python() else {
        eprintln!("skipped: python3 cannot import torch (pip install torch==2.15.0 to run it)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (theirs, ours) = (dir.path().join("torchrun"), dir.path().join("chorus"));
    std::fs::create_dir_all(&theirs).unwrap();
    std::fs::create_dir_all(&ours).unwrap();
    let env_script = format!("{PYTHON_DIR}/launch_env.py");
    let port = free_port().to_string();
    let flags = [
        "--nproc-per-node",
        "2",
        "--master-port",
        &port,
        "--rdzv-id",
        "compare",
        "--max-restarts",
        "1",
        "--role",
        "trainer",
    ];
    let mut torchrun = Command::new(python);
    torchrun
        .args(["-m", "torch.distributed.run"])
        .args(flags)
        .arg(&env_script)
        .arg(&theirs)
        .env("PYTHON_EXEC", python)
        .env_remove("OMP_NUM_THREADS")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let output = run(torchrun, 60);
    assert!(output.status.success(), "torchrun failed:\n{}", text(&output));
    let mut chorus = launch(&flags);
    chorus.arg(&env_script).arg(&ours).env("PYTHON_EXEC", python);
    let output = run(chorus, 30);
    assert!(output.status.success(), "chorus launch failed:\n{}", text(&output));
    for rank in 0..2 {
        let mut a = json_env(&theirs.join(format!("{rank}.json")));
        let mut b = json_env(&ours.join(format!("{rank}.json")));
        for env in [&a, &b] {
            let error_file = &env["TORCHELASTIC_ERROR_FILE"];
            assert!(
                error_file.ends_with(&format!("attempt_0/{rank}/error.json")),
                "{error_file}"
            );
        }
        assert_eq!(b.remove("CHORUS_JOB_SECRET").map(|s| s.len()), Some(64));
        for env in [&mut a, &mut b] {
            env.remove("TORCHELASTIC_ERROR_FILE");
            env.remove("_");
        }
        assert_eq!(a.get("RANK"), Some(&rank.to_string()));
        assert_eq!(
            a, b,
            "rank {rank}: torchrun's environment (left) differs from chorus launch's (right)"
        );
    }
}

/// Three workers: each gets its ranks, the launcher's store, one shared
/// secret, `--local-rank=N` when asked, and its output in --log-dir.
#[test]
fn three_workers_get_torchruns_variables_and_logs() {
    let dir = tempfile::tempdir().unwrap();
    let worker = script(
        dir.path(),
        "worker.sh",
        r#"env > "$OUT/$RANK.env"; echo "args: $*"; echo "to stderr" >&2"#,
    );
    let logs = dir.path().join("logs");
    let mut command = launch(&[
        "--nproc_per_node=3",
        "--rdzv-id",
        "envtest",
        "--log-dir",
        logs.to_str().unwrap(),
        "--pass-local-rank-arg",
    ]);
    command.arg(&worker).arg("--lr").arg("0.1").env("OUT", dir.path());
    let output = run(command, 20);
    let all = text(&output);
    assert!(output.status.success(), "{all}");
    let envs: Vec<BTreeMap<String, String>> = (0..3)
        .map(|r| parse_env(&std::fs::read_to_string(dir.path().join(format!("{r}.env"))).unwrap()))
        .collect();
    for (rank, env) in envs.iter().enumerate() {
        let rank = rank.to_string();
        for (key, value) in [
            ("RANK", rank.as_str()),
            ("LOCAL_RANK", &rank),
            ("ROLE_RANK", &rank),
            ("WORLD_SIZE", "3"),
            ("LOCAL_WORLD_SIZE", "3"),
            ("ROLE_WORLD_SIZE", "3"),
            ("GROUP_RANK", "0"),
            ("GROUP_WORLD_SIZE", "1"),
            ("ROLE_NAME", "default"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("TORCHELASTIC_RESTART_COUNT", "0"),
            ("TORCHELASTIC_MAX_RESTARTS", "0"),
            ("TORCHELASTIC_RUN_ID", "envtest"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            ("OMP_NUM_THREADS", "1"),
        ] {
            assert_eq!(env.get(key).map(String::as_str), Some(value), "rank {rank} {key}");
        }
        assert_ne!(env["MASTER_PORT"], "0");
        assert_eq!(env["MASTER_PORT"], envs[0]["MASTER_PORT"]);
        assert_eq!(env["CHORUS_JOB_SECRET"], envs[0]["CHORUS_JOB_SECRET"]);
        assert!(
            all.contains(&format!("[{rank}]: args: --local-rank={rank} --lr 0.1")),
            "{all}"
        );
        assert!(all.contains(&format!("[{rank}]: to stderr")), "{all}");
        let rank_dir = logs.join("envtest").join("attempt_0").join(&rank);
        let stdout = std::fs::read_to_string(rank_dir.join("stdout.log")).unwrap();
        assert_eq!(stdout, format!("args: --local-rank={rank} --lr 0.1\n"));
        assert_eq!(
            std::fs::read_to_string(rank_dir.join("stderr.log")).unwrap(),
            "to stderr\n"
        );
    }
    let secret = &envs[0]["CHORUS_JOB_SECRET"];
    assert!(
        secret.len() == 64 && secret.bytes().all(|b| b.is_ascii_hexdigit()),
        "{secret}"
    );
}

/// Rank 1 kills itself with SIGKILL on the first attempt only: reported with
/// its rank, pid, signal and last line; the group restarts and succeeds.
#[test]
fn a_killed_worker_is_reported_and_the_group_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let worker = script(
        dir.path(),
        "worker.sh",
        r#"echo "attempt $TORCHELASTIC_RESTART_COUNT"
if [ "$RANK" = 1 ] && [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then echo "about to die"; kill -9 $$; fi
sleep 0.2"#,
    );
    let mut command = launch(&["--nproc-per-node", "2", "--max-restarts", "1"]);
    command.arg(&worker);
    let output = run(command, 20);
    let all = text(&output);
    assert!(output.status.success(), "{all}");
    assert!(all.contains("rank 1 (local rank 1 on node 0, pid "), "{all}");
    assert!(all.contains("was killed by signal SIGKILL (9) in attempt 0"), "{all}");
    assert!(
        all.contains("  [1]: about to die"),
        "the last lines are reported:\n{all}"
    );
    assert!(all.contains("restarting the group (restart 1 of 1)"), "{all}");
    assert!(
        all.contains("[0]: attempt 1") && all.contains("[1]: attempt 1"),
        "{all}"
    );
}

/// A worker that always fails: after --max-restarts the launcher exits with
/// its code and names it.
#[test]
fn used_up_restarts_exit_with_the_workers_code() {
    let dir = tempfile::tempdir().unwrap();
    let worker = script(
        dir.path(),
        "worker.sh",
        r#"if [ "$RANK" = 1 ]; then echo "bad input"; exit 7; fi; sleep 30"#,
    );
    let mut command = launch(&[
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--shutdown-timeout",
        "5",
    ]);
    command.arg(&worker);
    let output = run(command, 20);
    let all = text(&output);
    assert_eq!(output.status.code(), Some(7), "{all}");
    assert!(all.contains("exited with code 7 in attempt 0"), "{all}");
    assert!(all.contains("exited with code 7 in attempt 1"), "{all}");
    assert!(all.contains("rank 1 failed and --max-restarts 1 is used up"), "{all}");
}

fn alive(pid: i32) -> bool {
    // A zombie has exited; only its entry waits for a reaper.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

/// Waits until each of `ranks` workers wrote its pids (whitespace-separated,
/// newline-terminated) to `DIR/<rank>.pids`, and returns them all.
fn worker_pids(dir: &Path, ranks: usize) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let pid_files: Vec<PathBuf> = (0..ranks).map(|r| dir.join(format!("{r}.pids"))).collect();
    while !pid_files
        .iter()
        .all(|f| std::fs::read_to_string(f).is_ok_and(|s| s.ends_with('\n')))
    {
        assert!(Instant::now() < deadline, "workers did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let pids: Vec<i32> = pid_files
        .iter()
        .flat_map(|f| {
            std::fs::read_to_string(f)
                .unwrap()
                .split_whitespace()
                .map(|p| p.parse().unwrap())
                .collect::<Vec<i32>>()
        })
        .collect();
    assert!(pids.iter().all(|&p| alive(p)));
    pids
}

/// Fails, after killing them, if any of `pids` is still alive `within` from now.
fn assert_all_gone(pids: &[i32], within: Duration, what: &str) {
    let deadline = Instant::now() + within;
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left: Vec<i32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    for &pid in &left {
        // Clean up before failing.
        process::signal(pid, Signal::SIGKILL);
    }
    assert!(left.is_empty(), "{what}: {left:?}");
}

/// SIGTERM to the launcher reaches every worker and the children they
/// started; the launcher exits 128+15 only when they are gone.
#[test]
fn sigterm_leaves_no_process_behind() {
    let dir = tempfile::tempdir().unwrap();
    let worker = script(
        dir.path(),
        "worker.sh",
        r#"sleep 1000 &
echo "$! $$" > "$OUT/$RANK.pids"
wait"#,
    );
    let mut command = launch(&["--nproc-per-node", "2"]);
    command.arg(&worker).env("OUT", dir.path());
    let child = command.spawn().unwrap();
    let pids = worker_pids(dir.path(), 2);
    process::signal(child.id(), Signal::SIGTERM);
    let output = finish(child, 15, "the launcher after SIGTERM", LAUNCHER);
    assert_eq!(output.status.code(), Some(128 + 15), "{}", text(&output));
    assert_all_gone(&pids, Duration::from_secs(2), "processes left behind");
}

#[test]
fn a_sigkilled_launcher_takes_its_workers_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let worker = script(
        dir.path(),
        "worker.sh",
        r#"echo "$$" > "$OUT/$RANK.pids"
exec sleep 1000"#,
    );
    let mut command = launch(&["--nproc-per-node", "2"]);
    // Its run directory, which a SIGKILLed launcher cannot remove.
    command.arg(&worker).env("OUT", dir.path()).env("TMPDIR", dir.path());
    let mut child = command.spawn().unwrap();
    let pids = worker_pids(dir.path(), 2);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_all_gone(&pids, Duration::from_secs(3), "workers outlived a SIGKILLed launcher");
}

/// Two launchers with --nnodes 2 and no --node-rank on this machine: one
/// serves the store, node ranks are handed out there, and the workers form
/// one job of 2 x 2 ranks.
#[test]
fn two_launchers_form_one_job() {
    let port = free_port().to_string();
    let flags = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--master-port",
        &port,
        "--rdzv-conf",
        "join_timeout=20",
    ];
    let program = [
        "sh",
        "-c",
        "echo RANK=$RANK WORLD_SIZE=$WORLD_SIZE SECRET=$CHORUS_JOB_SECRET",
    ];
    let spawn = || {
        let mut command = launch(&flags);
        command.args(program);
        command.spawn().unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let outputs = [
        finish(a, 30, "launcher a", LAUNCHER),
        finish(b, 30, "launcher b", LAUNCHER),
    ];
    let mut ranks = BTreeSet::new();
    let mut secrets = BTreeSet::new();
    for output in &outputs {
        assert!(output.status.success(), "{}", text(output));
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            let fields: BTreeMap<&str, &str> = line
                .split_once(": ")
                .unwrap()
                .1
                .split(' ')
                .filter_map(|f| f.split_once('='))
                .collect();
            assert_eq!(fields["WORLD_SIZE"], "4", "{line}");
            assert!(
                ranks.insert(fields["RANK"].parse::<usize>().unwrap()),
                "rank twice: {line}"
            );
            secrets.insert(fields["SECRET"].to_string());
        }
    }
    assert_eq!(ranks, (0..4).collect(), "{}\n{}", text(&outputs[0]), text(&outputs[1]));
    assert_eq!(secrets.len(), 1, "one job secret for both nodes");
    let warned = outputs
        .iter()
        .filter(|o| text(o).contains("publishing a generated job secret"))
        .count();
    assert_eq!(warned, 1, "the store's host warns that it published the secret");
}

/// A node that waits for another that never comes gives up with a count.
#[test]
fn missing_nodes_time_out_with_a_clear_error() {
    let port = free_port().to_string();
    let mut command = launch(&[
        "--nnodes",
        "2",
        "--master-port",
        &port,
        "--rdzv-conf",
        "join_timeout=1",
        "true",
    ]);
    command.env("CHORUS_JOB_SECRET", "s");
    let output = run(command, 15);
    let all = text(&output);
    assert_eq!(output.status.code(), Some(1), "{all}");
    assert!(all.contains("only 1 of 2 nodes joined within 1s"), "{all}");
}

/// Bad input: one line that says what to change, exit code 2.
#[test]
fn bad_input_exits_2_with_what_to_change() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_port = busy.local_addr().unwrap().port().to_string();
    for (args, expected) in [
        (vec!["--frobnicate", "true"], "unknown flag --frobnicate"),
        (vec!["--nnodes", "3:2", "true"], "--nnodes 3:2: give N or MIN:MAX"),
        (vec!["--", "/no/such/program"], "program /no/such/program not found"),
        (vec!["--master-port", &busy_port, "true"], "pick another --master-port"),
        (vec!["--nproc-per-node", "0", "true"], "give a positive number"),
        (vec!["--nproc-per-node", "2"], "no program to launch"),
        (
            vec!["--numa-binding", "cores", "true"],
            "give node, socket, exclusive or core-complex",
        ),
    ] {
        let output = run(launch(&args), 15);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {}", text(&output));
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
}

/// `--numa-binding exclusive`: each worker runs on CPUs of its own, and
/// more workers than CPUs is refused before any starts.
#[test]
fn numa_binding_exclusive_gives_each_worker_its_own_cpus() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let too_many = (cpus + 1).to_string();
    let output = run(
        launch(&["--nproc-per-node", &too_many, "--numa-binding", "exclusive", "true"]),
        15,
    );
    let all = text(&output);
    assert_eq!(output.status.code(), Some(2), "{all}");
    assert!(all.contains(&format!("physical cores for {too_many} workers")), "{all}");
    if cpus < 2 {
        eprintln!("skipped the two-worker half: this host has one CPU");
        return;
    }
    let show = "grep Cpus_allowed_list /proc/self/status";
    let output = run(
        launch(&["--nproc-per-node", "2", "--numa-binding", "exclusive", "sh", "-c", show]),
        30,
    );
    let all = text(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if output.status.code() == Some(2) && stderr.contains("physical cores for 2 workers") {
        eprintln!("skipped the two-worker half: {} CPUs but one physical core", cpus);
        return;
    }
    assert!(output.status.success(), "{all}");
    assert!(all.contains("--numa-binding exclusive: local ranks on CPUs"), "{all}");
    let allowed = |rank: usize| -> BTreeSet<usize> {
        let prefix = format!("[{rank}]: Cpus_allowed_list:");
        let line = all
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("{all}"));
        line.trim()
            .split(',')
            .flat_map(|part| match part.split_once('-') {
                Some((a, b)) => a.parse().unwrap()..=b.parse().unwrap(),
                None => part.parse().unwrap()..=part.parse().unwrap(),
            })
            .collect()
    };
    let (first, second) = (allowed(0), allowed(1));
    assert!(!first.is_empty() && !second.is_empty(), "{all}");
    assert!(first.is_disjoint(&second), "{all}");
}

/// A PyTorch script written for torchrun (Gloo all-reduce) runs unmodified.
#[test]
fn pytorch_gloo_allreduce_runs_unmodified() {
    let Some(python) = torch_python() else {
        eprintln!("skipped: python3 cannot import torch (pip install torch==2.15.0 to run it)");
        return;
    };
    let mut command = launch(&["--nproc-per-node", "2", &format!("{PYTHON_DIR}/gloo_allreduce.py")]);
    command.env("PYTHON_EXEC", python);
    let output = run(command, 60);
    let all = text(&output);
    assert!(output.status.success(), "{all}");
    assert!(all.contains("[0]: OK rank 0/2 sum 3"), "{all}");
    assert!(all.contains("[1]: OK rank 1/2 sum 3"), "{all}");
}

/// A chorus program (`chorus hello --worker env://`) under the launcher:
/// rank 0 uses the launcher's store, and all three ranks find each other.
#[test]
fn chorus_ranks_meet_on_the_launchers_store() {
    let output = run(
        launch(&[
            "--nproc-per-node",
            "3",
            "--",
            chorus_bin(),
            "hello",
            "--worker",
            "env://",
        ]),
        30,
    );
    let all = text(&output);
    assert!(output.status.success(), "{all}");
    for rank in 0..3 {
        assert!(all.contains(&format!("[{rank}]: rank {rank}/3")), "{all}");
        let peers = all
            .lines()
            .filter(|l| l.starts_with(&format!("[{rank}]:   rank ")))
            .count();
        assert_eq!(peers, 3, "rank {rank} lists every peer:\n{all}");
    }
}

/// A worker failing on one node restarts the workers of both nodes, with
/// the same restart count everywhere.
#[test]
fn a_failure_on_one_node_restarts_both() {
    let port = free_port().to_string();
    let flags = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--master-port",
        &port,
    ];
    let body = r#"echo "RANK=$RANK RESTART=$TORCHELASTIC_RESTART_COUNT"
if [ "$RANK" = 3 ] && [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then exit 5; fi; sleep 0.3"#;
    let spawn = || {
        let mut command = launch(&flags);
        command.args(["sh", "-c", body]).env("CHORUS_JOB_SECRET", "shared");
        command.spawn().unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let outputs = [
        finish(a, 30, "launcher a", LAUNCHER),
        finish(b, 30, "launcher b", LAUNCHER),
    ];
    let all = format!("{}\n{}", text(&outputs[0]), text(&outputs[1]));
    assert!(outputs.iter().all(|o| o.status.success()), "{all}");
    for rank in 0..4 {
        assert!(all.contains(&format!("[{rank}]: RANK={rank} RESTART=1")), "{all}");
    }
    assert!(
        all.contains("exited with code 5 in attempt 0; restarting this node's workers"),
        "{all}"
    );
}

#[test]
fn prefixed_lines_stay_whole_when_stdout_and_stderr_share_a_pipe() {
    let dir = tempfile::tempdir().unwrap();
    let worker = script(
        dir.path(),
        "chatty.sh",
        "i=0; while [ $i -lt 400 ]; do echo out-$i-aaaaaaaaaaaaaaaa; echo err-$i-bbbbbbbbbbbbbbbb >&2; i=$((i+1)); done",
    );
    // One pipe for both streams, as `2>&1` gives.
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg(format!(
            "exec {} launch --nproc-per-node 4 {} 2>&1",
            chorus_bin(),
            worker.display()
        ))
        .env_remove("CHORUS_JOB_SECRET")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let output = run(command, 60);
    assert!(output.status.success(), "{}", text(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let whole = |line: &str| {
        let Some((prefix, rest)) = line.split_once("]: ") else {
            return false;
        };
        prefix.strip_prefix('[').is_some_and(|r| r.parse::<usize>().is_ok())
            && (rest.starts_with("out-") && rest.ends_with("-aaaaaaaaaaaaaaaa")
                || rest.starts_with("err-") && rest.ends_with("-bbbbbbbbbbbbbbbb"))
            && !rest[4..].contains(['[', 'o', 'e'])
    };
    let prefixed: Vec<&str> = stdout.lines().filter(|l| l.starts_with('[')).collect();
    assert_eq!(prefixed.len(), 4 * 800, "{stdout}");
    let broken: Vec<&&str> = prefixed.iter().filter(|l| !whole(l)).take(5).collect();
    assert!(broken.is_empty(), "garbled lines: {broken:?}");
}

#[test]
fn a_stopped_worker_does_not_hold_up_the_end_of_a_failed_job() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 1 stops itself (SIGSTOP); rank 0 then fails.
    let worker = script(
        dir.path(),
        "stop_and_fail.sh",
        "if [ \"$RANK\" = 1 ]; then kill -STOP $$; sleep 600; fi; sleep 1; exit 3",
    );
    let started = Instant::now();
    let output = run(
        launch(&[
            "--nproc-per-node",
            "2",
            "--shutdown-timeout",
            "60",
            worker.to_str().unwrap(),
        ]),
        90,
    );
    let took = started.elapsed();
    assert!(!output.status.success(), "{}", text(&output));
    assert!(
        took < Duration::from_secs(15),
        "the launcher waited {took:?} for a stopped worker: {}",
        text(&output)
    );
}

/// `chorus launch -- chorus ...` runs the launcher's own build, with no
/// `chorus` on PATH; and `chorus selftest` started alone points at
/// `chorus launch`.
#[test]
fn chorus_launches_chorus_without_it_on_path() {
    let mut command = launch(&[
        "--nproc-per-node",
        "2",
        "--",
        "chorus",
        "selftest",
        "--counts",
        "13",
        "--dtypes",
        "float32",
        "--timeout",
        "20",
    ]);
    command.env("PATH", "/usr/bin:/bin");
    let output = run(command, 60);
    let all = text(&output);
    assert!(output.status.success(), "{all}");
    assert!(all.contains("[1]: selftest: rank 1 of 2"), "{all}");

    let mut alone = Command::new(chorus_bin());
    alone
        .args(["selftest", "--timeout", "5"])
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("LOCAL_RANK")
        .env_remove("GROUP_RANK")
        .env_remove("CHORUS_STORE");
    let output = common::run(&mut alone, 20, "chorus selftest", common::Stop::Kill);
    let all = text(&output);
    assert!(!output.status.success(), "{all}");
    assert!(
        all.contains("MASTER_ADDR is not set") && all.contains("chorus launch --nproc-per-node"),
        "{all}"
    );
}

/// A rank frozen by fault injection is found by the others, which exit on
/// the abort: the launcher's summary blames the frozen rank, not the first
/// process to exit.
#[test]
fn the_summary_blames_the_frozen_rank_not_the_first_to_exit() {
    let traces = tempfile::tempdir().unwrap();
    let mut command = launch(&[
        "--nproc-per-node",
        "3",
        "--",
        chorus_bin(),
        "fault-probe",
        "--seconds",
        "60",
    ]);
    command
        .env("CHORUS_TRACE_DIR", traces.path())
        .env("CHORUS_FAULTS", "freeze(rank=2, after=2s)")
        .env("CHORUS_HEARTBEAT_TIMEOUT", "2")
        .env_remove("CHORUS_TRANSPORT");
    let output = run(command, 60);
    let all = text(&output);
    assert!(!output.status.success(), "{all}");
    let summary = all
        .lines()
        .find(|l| l.starts_with("chorus launch: rank ") && l.contains("the other workers took it for failed"))
        .unwrap_or_else(|| panic!("no summary line:\n{all}"));
    assert!(
        summary.starts_with("chorus launch: rank 2 (local rank 2 on node 0, pid "),
        "{summary}\n{all}"
    );
    assert!(
        all.contains("chorus launch: rank 2 failed and --max-restarts 0 is used up"),
        "{all}"
    );
    // The healthy ranks exited on the abort, each leaving its flight-recorder dump.
    for rank in [0, 1] {
        let dump = traces.path().join(format!("chorus-trace-g0-r{rank}.json"));
        assert!(dump.exists(), "rank {rank} left no dump:\n{all}");
    }
}
