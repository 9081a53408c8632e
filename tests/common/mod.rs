//! Scaffolding shared by the integration tests (`mod common;` in each):
//! deadlines for futures and child processes, rank processes whose output
//! lines are gathered with their rank, and small parsers.
//!
//! A test that hangs fails at its deadline with what the processes printed.

// Each test binary compiles this module on its own and uses a subset of it.
#![allow(dead_code)]

use chorus::process::{self, Signal};
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub(crate) mod cluster;
pub(crate) mod etcd;
pub(crate) mod launchers;
pub(crate) mod netem;

/// The `chorus` binary under test. Cargo names it to the tests of
/// chorus-cli, which builds it; the lab's tests (chorus-lab) find it in
/// their own target folder, where a workspace `cargo test` builds it too
/// before any test runs, and fail saying so where it is missing.
pub(crate) fn chorus_bin() -> &'static str {
    static BESIDE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if let Some(built) = option_env!("CARGO_BIN_EXE_chorus") {
        return built;
    }
    BESIDE.get_or_init(|| {
        // A test runs as <target>/<profile>/deps/<test>-<hash>.
        let exe = std::env::current_exe().expect("the test's own path");
        let chorus = exe.parent().and_then(std::path::Path::parent).map(|profile| profile.join("chorus"));
        match chorus {
            Some(chorus) if chorus.exists() => chorus.display().to_string(),
            _ => panic!(
                "the `chorus` binary is not built beside {}: `cargo test --workspace` builds it; before a single lab test, `cargo build -p chorus-cli --bins --examples` with the same profile",
                exe.display()
            ),
        }
    })
}

/// The example `name` (`examples/<name>.rs`), which `cargo test` builds
/// beside the `chorus` binary; a single `--test` may not, and the failure
/// says how to build it.
pub(crate) fn example(name: &str) -> std::path::PathBuf {
    let exe = std::path::PathBuf::from(chorus_bin())
        .with_file_name("examples")
        .join(name);
    assert!(
        exe.exists(),
        "{} missing: `cargo test` builds the examples, a single `--test` may not (cargo build --release --example {name})",
        exe.display()
    );
    exe
}

/// Options for rank `rank` of an in-process elastic group meeting on
/// `store`: a 1 s heartbeat window, aborts on failure, a 200 ms last call.
pub(crate) fn elastic_options(
    store: &std::sync::Arc<dyn chorus::store::Store>,
    rank: usize,
    world: usize,
) -> chorus::InitOptions {
    chorus::InitOptions {
        init_method: chorus::rendezvous::InitMethod::Store(store.clone()),
        ..chorus::InitOptions::default()
    }
    .rank(rank)
    .world_size(world)
    .timeout(Duration::from_secs(10))
    .heartbeat_timeout(Duration::from_secs(1))
    .error_handling(chorus::ErrorHandling::Abort)
    .last_call(Duration::from_millis(200))
}

/// Fails a test that hangs, with a message, instead of hanging CI.
pub(crate) async fn within<T>(secs: u64, what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), future)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within {secs}s"))
}

/// The interpreter `python3` runs (its `sys.executable`, past any shim
/// that would change the environment on the way) when it can import every
/// module of `modules`; `None` otherwise (tests needing it then skip).
pub(crate) fn python_importing(modules: &[&str]) -> Option<String> {
    let imports: String = modules.iter().map(|m| format!("import {m}; ")).collect();
    let output = Command::new("python3")
        .args(["-c", &format!("{imports}import sys; print(sys.executable)")])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_string())
}

/// A free TCP port on 127.0.0.1 (free when asked; nothing holds it).
pub(crate) fn free_port() -> u16 {
    free_ports(1)[0]
}

/// `n` distinct free loopback ports: every listener is held until all are
/// picked, since the kernel may hand a just-released port out again.
pub(crate) fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    listeners.iter().map(|l| l.local_addr().unwrap().port()).collect()
}

/// The value of `key=` in a `key=value ...` probe line.
pub(crate) fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// Fails the test unless python3 can import `torch.distributed`: a test
/// that needs it runs only when asked to (`--ignored`), and then must check.
pub(crate) fn require_torch() {
    let ok = Command::new("python3")
        .args(["-c", "import torch.distributed"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "this test needs torch, which python3 cannot import: `pip install torch==2.15.0`"
    );
}

/// A process's stdout and stderr, labelled.
pub(crate) fn text(output: &Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A process's stdout then its stderr, as one text.
pub(crate) fn joined(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// How a child past its deadline is stopped.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Stop {
    /// SIGKILL at once.
    Kill,
    /// SIGTERM, then SIGKILL if it still runs after the grace period: lets
    /// a launcher stop its workers.
    Term(Duration),
}

/// `chorus launch` past its deadline: SIGTERM, 2 s to stop its workers, SIGKILL.
pub(crate) const LAUNCHER: Stop = Stop::Term(Duration::from_secs(2));

/// Starts `command` with stdout and stderr piped.
pub(crate) fn spawn_piped(command: &mut Command, what: &str) -> Child {
    command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start {what}: {e}"))
}

/// Runs `command` (stdout and stderr piped) to its end under [`finish`].
pub(crate) fn run(command: &mut Command, secs: u64, what: &str, stop: Stop) -> Output {
    finish(spawn_piped(command, what), secs, what, stop)
}

/// Waits for `child` up to `secs`, reading its piped output meanwhile; past
/// that stops it as `stop` says and fails with what it printed.
pub(crate) fn finish(mut child: Child, secs: u64, what: &str, stop: Stop) -> Output {
    let stdout = read_to_end(child.stdout.take());
    let stderr = read_to_end(child.stderr.take());
    let deadline = Instant::now() + Duration::from_secs(secs);
    let status = loop {
        if let Some(status) = child.try_wait().expect("poll child") {
            break status;
        }
        if Instant::now() > deadline {
            stop_child(&mut child, stop);
            let output = Output {
                status: child.wait().expect("wait for child"),
                stdout: stdout.join().unwrap(),
                stderr: stderr.join().unwrap(),
            };
            panic!("{what} did not finish within {secs}s\n{}", text(&output));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

fn stop_child(child: &mut Child, stop: Stop) {
    if let Stop::Term(grace) = stop {
        process::signal(child.id(), Signal::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let _ = child.kill();
}

/// Reads `stream` to its end on a thread (so a full pipe never blocks the child).
fn read_to_end(stream: Option<impl Read + Send + 'static>) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut stream) = stream {
            let _ = stream.read_to_end(&mut bytes);
        }
        bytes
    })
}

/// Rank processes, started in rank order, whose stdout and stderr lines
/// threads forward into one channel tagged with the rank. The lines read so
/// far are in `log` as `[rank] line`. Dropping it kills every process (after
/// SIGCONT, so a stopped one dies too), so none outlives a failed assertion.
pub(crate) struct Ranks {
    children: Vec<Child>,
    tx: mpsc::Sender<(usize, String)>,
    lines: mpsc::Receiver<(usize, String)>,
    /// The lines read so far, `[rank] line`.
    pub(crate) log: Vec<String>,
}

impl Ranks {
    pub(crate) fn new() -> Self {
        let (tx, lines) = mpsc::channel();
        Self {
            children: Vec::new(),
            tx,
            lines,
            log: Vec::new(),
        }
    }

    /// Starts `command` as the next rank (stdout and stderr piped and
    /// forwarded) and returns that rank.
    pub(crate) fn spawn(&mut self, command: &mut Command, what: &str) -> usize {
        let rank = self.children.len();
        let mut child = spawn_piped(command, what);
        let streams: [Box<dyn Read + Send>; 2] = [
            Box::new(child.stdout.take().unwrap()),
            Box::new(child.stderr.take().unwrap()),
        ];
        for stream in streams {
            let tx = self.tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    let _ = tx.send((rank, line));
                }
            });
        }
        self.children.push(child);
        rank
    }

    /// How many ranks were started.
    pub(crate) fn len(&self) -> usize {
        self.children.len()
    }

    pub(crate) fn pid(&self, rank: usize) -> i32 {
        self.children[rank].id() as i32
    }

    /// The next line of any rank, logged, or a panic with the output at
    /// `deadline`: "timed out waiting for `what`".
    pub(crate) fn next_line(&mut self, what: &str, deadline: Instant) -> (usize, String) {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.lines.recv_timeout(left.max(Duration::from_millis(1))) {
            Ok((rank, line)) => {
                self.log.push(format!("[{rank}] {line}"));
                (rank, line)
            }
            Err(_) => panic!("timed out waiting for {what}; output:\n{}", self.output()),
        }
    }

    /// Reads lines until `done` holds for the log, or panics with the output
    /// at `deadline`.
    pub(crate) fn until(&mut self, what: &str, deadline: Instant, done: impl Fn(&[String]) -> bool) {
        while !done(&self.log) {
            self.next_line(what, deadline);
        }
    }

    /// Logs the lines already forwarded, without waiting for more.
    pub(crate) fn drain(&mut self) {
        while let Ok((rank, line)) = self.lines.try_recv() {
            self.log.push(format!("[{rank}] {line}"));
        }
    }

    /// Waits until `rank` exits, or panics with the output at `deadline`.
    pub(crate) fn wait(&mut self, rank: usize, deadline: Instant) -> ExitStatus {
        loop {
            if let Some(status) = self.children[rank].try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "rank {rank} did not exit; output:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs `rank` and reaps it.
    pub(crate) fn kill(&mut self, rank: usize) {
        self.children[rank].kill().unwrap();
        self.children[rank].wait().unwrap();
    }

    /// Kills and reaps every rank still running (stopped ones too).
    pub(crate) fn kill_all(&mut self) {
        for child in &mut self.children {
            if matches!(child.try_wait(), Ok(None)) {
                // SIGCONT lets a stopped one run to its death.
                process::signal(child.id(), Signal::SIGCONT);
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }

    /// The log, one line each.
    pub(crate) fn output(&self) -> String {
        self.log.join("\n")
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.kill_all();
    }
}
