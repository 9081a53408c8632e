//! `chorus launch`'s fork server with real processes: a replacement worker
//! of a Python script is forked from a pre-started interpreter and is the
//! worker a fresh start would have been (environment, directory, argv,
//! process group, stdio, exit status); other commands and
//! `--no-fork-server` start afresh; a SIGKILLed launcher leaves no forked
//! worker behind.
//!
//! Every child runs under a deadline: past it, the test kills it and fails
//! with what it printed. Without python3 the tests skip and say so.

use chorus::process;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

mod common;
use common::{LAUNCHER, chorus_bin, text};

/// The interpreter python3 runs (not a shim that would change the
/// environment on its way), or `None`: the tests then skip.
fn python() -> Option<&'static str> {
    static PYTHON: OnceLock<Option<String>> = OnceLock::new();
    PYTHON.get_or_init(|| common::python_importing(&[])).as_deref()
}

fn skip_without_python() -> Option<&'static str> {
    let python = python();
    if python.is_none() {
        eprintln!("skipped: no python3 on PATH (the fork server runs Python scripts)");
    }
    python
}

/// A worker that writes what a worker can see of itself to
/// `$OUT/r<rank>_<restart>.json`, prints a line to each stream, and then
/// exits with `$FAIL_CODE` when its restart count is in `$FAIL_AT` (and its
/// rank is `$FAIL_RANK`, if set), or sleeps when it is in `$SLEEP_AT`.
const PROBE: &str = r#"
import json, os, sys
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
draw = sys.modules["numpy"].random.randint(1 << 30) if "numpy" in sys.modules else None
facts = {
    "pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "cwd": os.getcwd(),
    "parent": open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\0")[0].decode(),
    "argv": sys.argv, "name": __name__, "path0": sys.path[0], "env": dict(os.environ),
    "stdin": os.readlink("/proc/self/fd/0"), "threads": len(os.listdir("/proc/self/task")),
    "affinity": sorted(os.sched_getaffinity(0)), "write_through": sys.stdout.write_through,
    "numpy_draw": draw,
}
with open(f"{os.environ['OUT']}/r{rank}_{restart}.json", "w") as f:
    json.dump(facts, f)
print(f"hello from rank {rank} restart {restart}")
print(f"error line of rank {rank} restart {restart}", file=sys.stderr)
sys.stdout.flush()
if str(restart) in os.environ.get("SLEEP_AT", "").split(","):
    import time
    time.sleep(60)
if str(restart) in os.environ.get("FAIL_AT", "").split(",") and os.environ.get("FAIL_RANK", str(rank)) == str(rank):
    sys.exit(int(os.environ["FAIL_CODE"]))
"#;

struct Job {
    dir: tempfile::TempDir,
}

impl Job {
    fn new() -> Job {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("probe.py"), PROBE).unwrap();
        Job { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `chorus launch --restart-policy worker FLAGS probe.py a b`, in the job's directory.
    fn command(&self, python: &str, flags: &[&str], env: &[(&str, &str)]) -> Command {
        let mut command = Command::new(chorus_bin());
        command
            .current_dir(self.path())
            .args(["launch", "--restart-policy", "worker"])
            .args(flags)
            .args(["probe.py", "a", "b"])
            .env_remove("CHORUS_JOB_SECRET")
            .env_remove("OMP_NUM_THREADS")
            .env("PYTHON_EXEC", python)
            .env("OUT", self.path())
            .envs(env.iter().copied());
        command
    }

    fn run(&self, python: &str, flags: &[&str], env: &[(&str, &str)]) -> Output {
        common::run(&mut self.command(python, flags, env), 60, "chorus launch", LAUNCHER)
    }

    /// The facts of `rank`'s replacement: its restart count is the node's
    /// relaunches so far, so any above 0.
    fn replacement(&self, rank: usize) -> serde_json::Value {
        let restart = (1..10)
            .find(|n| self.path().join(format!("r{rank}_{n}.json")).exists())
            .unwrap_or_else(|| panic!("rank {rank} was not relaunched"));
        self.facts(rank, restart)
    }

    fn facts(&self, rank: usize, restart: usize) -> serde_json::Value {
        let path: PathBuf = self.path().join(format!("r{rank}_{restart}.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).unwrap()
    }
}

fn env_of(facts: &serde_json::Value) -> BTreeMap<String, String> {
    serde_json::from_value(facts["env"].clone()).unwrap()
}

#[test]
fn a_relaunched_python_worker_is_forked_and_is_the_worker_a_fresh_start_would_be() {
    let Some(python) = skip_without_python() else { return };
    let job = Job::new();
    let output = job.run(
        python,
        &["--nproc-per-node", "2", "--max-restarts", "2"],
        &[("FAIL_AT", "0"), ("FAIL_CODE", "3")],
    );
    let all = text(&output);
    assert_eq!(output.status.code(), Some(0), "{all}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("fork server started"), "{all}");
    for rank in [0, 1] {
        assert!(
            stderr.contains(&format!("relaunching rank {rank} alone as pid"))
                && stderr.contains(", forked from the fork server"),
            "{all}"
        );
        let fresh = job.facts(rank, 0);
        let forked = job.replacement(rank);
        let python_name = Path::new(python).file_name().unwrap().to_str().unwrap();
        assert!(
            fresh["parent"].as_str().unwrap().ends_with("chorus"),
            "a first worker's parent is the launcher: {fresh}"
        );
        assert!(
            forked["parent"].as_str().unwrap().ends_with(python_name),
            "a replacement's parent is the fork server: {forked}"
        );
        // Its own process group, in the launcher's session, as a fresh worker.
        assert_eq!(forked["pgid"], forked["pid"], "{forked}");
        for same in [
            "sid",
            "cwd",
            "argv",
            "name",
            "path0",
            "stdin",
            "threads",
            "affinity",
            "write_through",
        ] {
            assert_eq!(
                fresh[same], forked[same],
                "{same} differs: fresh {fresh}\nforked {forked}"
            );
        }
        assert_eq!(forked["argv"], serde_json::json!(["probe.py", "a", "b"]));
        // The environment is the worker's, exactly: what differs is what a
        // relaunch changes.
        let (mut fresh_env, mut forked_env) = (env_of(&fresh), env_of(&forked));
        let restart = forked_env.remove("TORCHELASTIC_RESTART_COUNT").unwrap();
        assert_ne!(restart, "0");
        assert_eq!(forked_env.remove("CHORUS_ELASTIC_JOIN").as_deref(), Some("1"));
        fresh_env.remove("TORCHELASTIC_RESTART_COUNT");
        let (fresh_error, forked_error) = (
            fresh_env.remove("TORCHELASTIC_ERROR_FILE").unwrap(),
            forked_env.remove("TORCHELASTIC_ERROR_FILE").unwrap(),
        );
        assert!(forked_error.contains(&format!("attempt_{restart}")) && fresh_error.contains("attempt_0"));
        assert_eq!(fresh_env, forked_env);
        // Its lines reach the console under its rank, on the right stream.
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            stdout.contains(&format!("[{rank}]: hello from rank {rank} restart {restart}")),
            "{all}"
        );
        assert!(
            stderr.contains(&format!("[{rank}]: error line of rank {rank} restart {restart}")),
            "{all}"
        );
    }
    // Two children of one server do not share numpy's random stream.
    let draws = [
        job.replacement(0)["numpy_draw"].clone(),
        job.replacement(1)["numpy_draw"].clone(),
    ];
    if draws[0].is_null() {
        eprintln!("skipped the numpy half: the fork server could not import numpy");
    } else {
        assert_ne!(draws[0], draws[1], "forked workers drew the same numbers");
    }
}

#[test]
fn a_forked_worker_that_fails_is_reported_with_its_exit_code() {
    let Some(python) = skip_without_python() else { return };
    let job = Job::new();
    let output = job.run(
        python,
        &["--nproc-per-node", "2", "--max-restarts", "1"],
        &[("FAIL_AT", "0,1"), ("FAIL_CODE", "7"), ("FAIL_RANK", "1")],
    );
    let all = text(&output);
    assert_eq!(output.status.code(), Some(7), "{all}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("forked from the fork server"), "{all}");
    assert!(stderr.contains("exited with code 7 in attempt 1"), "{all}");
    assert!(
        stderr.contains("error line of rank") && stderr.contains("restart 1"),
        "{all}"
    );
}

#[test]
fn without_the_fork_server_or_a_python_script_replacements_start_afresh() {
    let Some(python) = skip_without_python() else { return };
    let job = Job::new();
    let output = job.run(
        python,
        &["--nproc-per-node", "1", "--max-restarts", "1", "--no-fork-server"],
        &[("FAIL_AT", "0"), ("FAIL_CODE", "3")],
    );
    let all = text(&output);
    assert_eq!(output.status.code(), Some(0), "{all}");
    assert!(!all.contains("fork server"), "{all}");
    assert!(job.replacement(0)["parent"].as_str().unwrap().ends_with("chorus"));

    // A program that is not a Python script (a shell script, `--no-python`).
    let worker = job.path().join("worker.sh");
    std::fs::write(
        &worker,
        "#!/bin/sh\n[ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ] && exit 3\necho \"parent $(cat /proc/$PPID/comm)\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&worker, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let mut command = Command::new(chorus_bin());
    command
        .current_dir(job.path())
        .args([
            "launch",
            "--restart-policy",
            "worker",
            "--max-restarts",
            "1",
            "--no-python",
        ])
        .arg(&worker)
        .env_remove("CHORUS_JOB_SECRET");
    let output = common::run(&mut command, 60, "chorus launch", LAUNCHER);
    let all = text(&output);
    assert_eq!(output.status.code(), Some(0), "{all}");
    assert!(!all.contains("fork server"), "{all}");
    assert!(all.contains("[0]: parent chorus"), "{all}");
}

#[test]
fn a_sigkilled_launcher_takes_its_forked_workers_with_it() {
    let Some(python) = skip_without_python() else { return };
    let job = Job::new();
    let mut launcher = job
        .command(
            python,
            &["--nproc-per-node", "1", "--max-restarts", "1"],
            &[("FAIL_AT", "0"), ("FAIL_CODE", "3"), ("SLEEP_AT", "1")],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let pid = loop {
        if let Ok(text) = std::fs::read_to_string(job.path().join("r0_1.json"))
            && let Ok(facts) = serde_json::from_str::<serde_json::Value>(&text)
        {
            break facts["pid"].as_i64().unwrap() as i32;
        }
        if Instant::now() > deadline {
            let _ = launcher.kill();
            panic!("the relaunched worker did not start within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while process::exists(pid) {
        assert!(
            Instant::now() < deadline,
            "forked worker {pid} outlived its launcher by 10 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
