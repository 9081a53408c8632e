//! The worker processes of one attempt on this node: spawned each in its
//! own process group (so stopping one takes its children too, and a
//! terminal's Ctrl-C reaches only the launcher, which forwards it), their
//! output prefixed with the rank, teed to log files and kept in a short
//! ring buffer for failure reports. One worker can be relaunched in its
//! slot while the others run (`--restart-policy worker`), or a warm
//! standby worker promoted into it (`--standby`); relaunches and new
//! standbys are forked from the node's fork server when it can run them.

use std::collections::VecDeque;
use std::future::Future;
use std::io::Write;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::LaunchError;
use super::config::Streams;
use super::fork_server::{ForkServer, PythonCommand, Request};
use super::plan::WorkerExit;
use chorus::binding;
use chorus::process::{self, Signal};

/// Lines kept per worker for the failure report.
pub const TAIL_LINES: usize = 20;

/// How one worker is started and where its output goes.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    /// Global rank (the output prefix).
    pub rank: usize,
    /// Rank on this node.
    pub local_rank: usize,
    /// Program and arguments.
    pub argv: Vec<String>,
    /// Variables added to the launcher's environment.
    pub env: Vec<(String, String)>,
    /// Whether its lines are shown on the console (`--local-ranks-filter`).
    pub console: bool,
    /// The streams shown on the console (all but `--redirects`).
    pub shown: Streams,
    /// Directory for `stdout.log` / `stderr.log`, with the streams written there.
    pub log: Option<(PathBuf, Streams)>,
    /// The CPUs it is bound to (`--numa-binding`); empty when unbound.
    pub cpus: Vec<usize>,
    /// For a standby worker, its number on this node (its output is labelled
    /// `s<n>` until it is promoted into a slot).
    pub standby: Option<usize>,
}

impl WorkerSpec {
    fn label(&self) -> String {
        match self.standby {
            Some(n) => format!("s{n}"),
            None => self.rank.to_string(),
        }
    }
}

struct Worker {
    rank: usize,
    local_rank: usize,
    standby: Option<usize>,
    /// The prefix of its output lines; a promoted standby's changes.
    label: Arc<Mutex<String>>,
    pid: i32,
    tail: Arc<Mutex<VecDeque<String>>>,
    readers: Vec<JoinHandle<()>>,
    running: bool,
    /// When it was started: the standby started first is the warmest.
    started: std::time::Instant,
}

/// The workers of one attempt.
pub struct Workers {
    workers: Vec<Worker>,
    exits: mpsc::UnboundedReceiver<(usize, WorkerExit)>,
    /// Cloned into each worker's waiter, relaunched ones too.
    exits_tx: mpsc::UnboundedSender<(usize, WorkerExit)>,
    /// Where replacements are forked from, when the node has one.
    fork_server: Option<ForkServer>,
}

/// How [`Workers::relaunch`] started a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Started {
    /// Forked from the fork server.
    Forked,
    /// As a new process.
    New,
    /// As a new process, because the fork server could not run it (why).
    NewInstead(String),
}

/// A started worker process, before the launcher watches it.
struct Process {
    pid: i32,
    stdout: Box<dyn AsyncRead + Send + Unpin>,
    stderr: Box<dyn AsyncRead + Send + Unpin>,
    exit: Pin<Box<dyn Future<Output = WorkerExit> + Send>>,
}

/// A worker that ended, as reported by [`Workers::next_exit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ended {
    /// Global rank.
    pub rank: usize,
    /// Rank on this node.
    pub local_rank: usize,
    /// Process id.
    pub pid: i32,
    /// How it ended.
    pub exit: WorkerExit,
    /// Its standby number, when it ended before it was promoted.
    pub standby: Option<usize>,
}

impl Workers {
    /// Starts every worker; on a spawn failure, stops the ones started.
    pub async fn spawn(specs: Vec<WorkerSpec>, grace: Duration) -> Result<Self, LaunchError> {
        let (tx, exits) = mpsc::unbounded_channel();
        let mut group = Workers {
            workers: Vec::new(),
            exits,
            exits_tx: tx,
            fork_server: None,
        };
        for spec in specs {
            match spawn_one(group.workers.len(), spec, group.exits_tx.clone()) {
                Ok(worker) => group.workers.push(worker),
                Err(error) => {
                    group.stop(libc::SIGTERM, grace).await;
                    return Err(error);
                }
            }
        }
        Ok(group)
    }

    /// Starts this node's fork server for workers run like `template`
    /// (relaunches and new standbys are forked from it from then on);
    /// `false` when its command is not a Python script the server can run.
    pub fn start_fork_server(&mut self, template: &WorkerSpec) -> Result<bool, LaunchError> {
        let Some(command) = PythonCommand::parse(&template.argv) else {
            return Ok(false);
        };
        let server = ForkServer::start(&command, &template.env).map_err(|source| LaunchError::Io {
            what: format!("starting the fork server ({})", command.interpreter),
            source,
        })?;
        self.fork_server = Some(server);
        Ok(true)
    }

    /// The next worker (standby ones too) to end, or `None` when no worker
    /// but standby ones is running: those wait for a failure that can no
    /// longer come.
    pub async fn next_exit(&mut self) -> Option<Ended> {
        if !self.workers.iter().any(|w| w.running && w.standby.is_none()) {
            return None;
        }
        self.any_exit().await
    }

    async fn any_exit(&mut self) -> Option<Ended> {
        if !self.workers.iter().any(|w| w.running) {
            return None;
        }
        let (index, exit) = self.exits.recv().await?;
        let worker = &mut self.workers[index];
        worker.running = false;
        Some(Ended {
            rank: worker.rank,
            local_rank: worker.local_rank,
            pid: worker.pid,
            exit,
            standby: worker.standby,
        })
    }

    /// Promotes the running standby worker started first (the one furthest
    /// through its start-up: a standby started behind a promoted one moments
    /// ago is still importing) into the slot of `local_rank` (global
    /// `rank`), whose worker has ended; the
    /// ended one's entry becomes that standby's, for
    /// [`Workers::relaunch`] to start a new standby in. Returns the
    /// standby's number and pid, or `None` when none is running.
    pub fn promote(&mut self, local_rank: usize, rank: usize) -> Option<(usize, i32)> {
        let spare = self
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.running)
            .filter_map(|(i, w)| Some((w.started, w.standby?, i)))
            .min()?;
        let (_, number, index) = spare;
        let ended = self
            .workers
            .iter()
            .position(|w| !w.running && w.standby.is_none() && w.local_rank == local_rank)?;
        let spare_local_rank = self.workers[index].local_rank;
        let promoted = &mut self.workers[index];
        promoted.standby = None;
        promoted.local_rank = local_rank;
        promoted.rank = rank;
        *lock(&promoted.label) = rank.to_string();
        let pid = promoted.pid;
        let vacated = &mut self.workers[ended];
        vacated.standby = Some(number);
        vacated.local_rank = spare_local_rank;
        Some((number, pid))
    }

    /// The global and local rank of this attempt's worker with process id
    /// `pid`, running or not.
    pub fn by_pid(&self, pid: u32) -> Option<(usize, usize)> {
        self.workers
            .iter()
            .find(|w| w.pid as u32 == pid)
            .map(|w| (w.rank, w.local_rank))
    }

    /// The last lines the worker of `rank` printed, once its output is read
    /// to the end (or after a second, if something it started keeps the pipe open).
    pub async fn tail(&mut self, rank: usize) -> Vec<String> {
        let Some(worker) = self.workers.iter_mut().find(|w| w.rank == rank) else {
            return Vec::new();
        };
        drain(&mut worker.readers).await;
        lock(&worker.tail).iter().cloned().collect()
    }

    /// Starts `spec` again in the slot of its local rank, whose worker has
    /// ended (its output is read, see [`Workers::tail`]); what is left of
    /// the old worker's process group is killed first. A standby worker
    /// with no ended entry of its local rank gets a new one. Returns the new
    /// pid and how it was started: forked from the fork server where the
    /// node has one that can run it, else as a new process.
    pub async fn relaunch(&mut self, spec: WorkerSpec) -> Result<(i32, Started), LaunchError> {
        let index = match self
            .workers
            .iter()
            .position(|w| !w.running && w.local_rank == spec.local_rank)
        {
            Some(index) => {
                // Children the old worker started in its group must not linger.
                process::signal_group(self.workers[index].pid, Signal::SIGKILL);
                index
            }
            None if spec.standby.is_some() => self.workers.len(),
            None => {
                return Err(LaunchError::Io {
                    what: format!("relaunching local rank {}", spec.local_rank),
                    source: std::io::Error::other("no such worker slot"),
                });
            }
        };
        let (process, started) = self.start(&spec).await?;
        let worker = watch(index, spec, process, self.exits_tx.clone());
        let pid = worker.pid;
        if index == self.workers.len() {
            self.workers.push(worker);
        } else {
            self.workers[index] = worker;
        }
        Ok((pid, started))
    }

    /// Forks `spec` from the fork server, or starts it as a new process.
    async fn start(&mut self, spec: &WorkerSpec) -> Result<(Process, Started), LaunchError> {
        let Some(server) = &mut self.fork_server else {
            return Ok((start_process(spec)?, Started::New));
        };
        let why = match PythonCommand::parse(&spec.argv) {
            None => "the command is not a Python script".to_string(),
            Some(command) => {
                let request = Request {
                    command: &command,
                    env: &spec.env,
                    cpus: &spec.cpus,
                };
                match server.fork(request).await {
                    Ok(forked) => {
                        let exit = forked.exit;
                        let process = Process {
                            pid: forked.pid,
                            stdout: Box::new(forked.stdout),
                            stderr: Box::new(forked.stderr),
                            // A server gone before reporting takes its children with it.
                            exit: Box::pin(async move { exit.await.unwrap_or(WorkerExit::Signal(libc::SIGKILL)) }),
                        };
                        return Ok((process, Started::Forked));
                    }
                    Err(why) => why,
                }
            }
        };
        Ok((start_process(spec)?, Started::NewInstead(why)))
    }

    /// Sends `signal` to every running worker's process group, waits up to
    /// `grace` for them to end, then kills what is left of every group.
    pub async fn stop(&mut self, signal: i32, grace: Duration) {
        // Only the signals a launcher handles come here, each a valid one.
        let signal = Signal::try_from(signal).unwrap_or(Signal::SIGTERM);
        for worker in self.workers.iter().filter(|w| w.running) {
            process::signal_group(worker.pid, signal);
            // A stopped (SIGSTOPped) worker would keep the signal pending
            // until the grace ran out: resume it so it acts on it now.
            process::signal_group(worker.pid, Signal::SIGCONT);
        }
        let _ = tokio::time::timeout(grace, async { while self.any_exit().await.is_some() {} }).await;
        // Children a worker started in its group may outlive it: no orphans.
        for worker in &self.workers {
            process::signal_group(worker.pid, Signal::SIGKILL);
        }
        while self.any_exit().await.is_some() {}
        for worker in &mut self.workers {
            drain(&mut worker.readers).await;
        }
        self.fork_server = None;
    }
}

/// Waits for a worker's output relays, each up to a second.
async fn drain(readers: &mut Vec<JoinHandle<()>>) {
    for reader in readers.drain(..) {
        let _ = tokio::time::timeout(Duration::from_secs(1), reader).await;
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn spawn_one(
    index: usize,
    spec: WorkerSpec,
    exits: mpsc::UnboundedSender<(usize, WorkerExit)>,
) -> Result<Worker, LaunchError> {
    let process = start_process(&spec)?;
    Ok(watch(index, spec, process, exits))
}

/// Makes the calling process (a child between fork and exec) die when the
/// launcher `launcher` does: a launcher that is SIGKILLed cannot stop its
/// workers itself. Async-signal-safe: for `pre_exec`.
pub(super) fn die_with(launcher: libc::pid_t) -> std::io::Result<()> {
    // SAFETY: prctl, getppid and _exit are async-signal-safe and touch no memory of ours.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // The launcher may have died before prctl took effect.
        if libc::getppid() != launcher {
            libc::_exit(1);
        }
    }
    Ok(())
}

/// Starts `spec` as a new process.
fn start_process(spec: &WorkerSpec) -> Result<Process, LaunchError> {
    let mut command = tokio::process::Command::new(&spec.argv[0]);
    command
        .args(&spec.argv[1..])
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // The worker's own children are the worker's to handle, as PyTorch's
    // data loaders do.
    let launcher = std::process::id() as libc::pid_t;
    let cpus = (!spec.cpus.is_empty()).then(|| binding::cpu_set(&spec.cpus));
    // SAFETY: the closure runs in the child between fork and exec and calls
    // only async-signal-safe functions (sched_setaffinity, prctl, getppid, _exit).
    unsafe {
        command.pre_exec(move || {
            if let Some(cpus) = &cpus {
                binding::bind_current_process(cpus)?;
            }
            die_with(launcher)
        });
    }
    let mut child = command.spawn().map_err(|source| LaunchError::Spawn {
        program: spec.argv[0].clone(),
        rank: spec.rank,
        source,
    })?;
    let pid = child.id().map_or(0, |id| id as i32);
    let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(LaunchError::Spawn {
            program: spec.argv[0].clone(),
            rank: spec.rank,
            source: std::io::Error::other("its output pipes were not made"),
        });
    };
    Ok(Process {
        pid,
        stdout: Box::new(stdout),
        stderr: Box::new(stderr),
        exit: Box::pin(async move {
            match child.wait().await {
                Ok(status) => WorkerExit::from_status(status),
                Err(_) => WorkerExit::Code(1),
            }
        }),
    })
}

/// Relays a started worker's output and reports its exit as worker `index`.
fn watch(
    index: usize,
    spec: WorkerSpec,
    process: Process,
    exits: mpsc::UnboundedSender<(usize, WorkerExit)>,
) -> Worker {
    let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
    let label = Arc::new(Mutex::new(spec.label()));
    let readers = vec![
        tokio::spawn(relay(process.stdout, true, spec.clone(), label.clone(), tail.clone())),
        tokio::spawn(relay(process.stderr, false, spec.clone(), label.clone(), tail.clone())),
    ];
    let exit = process.exit;
    tokio::spawn(async move {
        let _ = exits.send((index, exit.await));
    });
    Worker {
        rank: spec.rank,
        local_rank: spec.local_rank,
        standby: spec.standby,
        label,
        pid: process.pid,
        tail,
        readers,
        running: true,
        started: std::time::Instant::now(),
    }
}

/// Copies one stream line by line: prefixed to the console, to the log file,
/// into the ring buffer.
async fn relay(
    stream: impl AsyncRead + Unpin,
    stdout: bool,
    spec: WorkerSpec,
    label: Arc<Mutex<String>>,
    tail: Arc<Mutex<VecDeque<String>>>,
) {
    let mut file = spec
        .log
        .as_ref()
        .filter(|(_, streams)| streams.has(stdout))
        .and_then(|(dir, _)| {
            let path = dir.join(if stdout { "stdout.log" } else { "stderr.log" });
            std::fs::File::create(&path)
                .inspect_err(|e| tracing::warn!(path = %path.display(), error = %e, "cannot write the worker's log"))
                .ok()
        });
    let show = spec.console && spec.shown.has(stdout);
    let mut reader = BufReader::new(stream);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if let Some(file) = &mut file {
            let _ = file.write_all(&buf);
        }
        let line = String::from_utf8_lossy(&buf);
        let line = line.trim_end_matches(['\n', '\r']);
        if show {
            // One write per line: stderr is unbuffered, and a line written
            // in pieces interleaves with the other stream under `2>&1`. A
            // closed console must not stop the job; the files still get the lines.
            let prefixed = format!("[{}]: {line}\n", lock(&label));
            let _ = if stdout {
                let mut out = std::io::stdout().lock();
                out.write_all(prefixed.as_bytes()).and_then(|()| out.flush())
            } else {
                std::io::stderr().lock().write_all(prefixed.as_bytes())
            };
        }
        let mut tail = lock(&tail);
        if tail.len() == TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sleeper(local_rank: usize, standby: Option<usize>) -> WorkerSpec {
        WorkerSpec {
            rank: local_rank,
            local_rank,
            argv: vec!["sleep".into(), "30".into()],
            env: Vec::new(),
            console: false,
            shown: Streams::BOTH,
            log: None,
            cpus: Vec::new(),
            standby,
        }
    }

    async fn end(workers: &mut Workers, pid: i32) -> Ended {
        assert!(process::signal(pid, Signal::SIGKILL), "the worker is ours to stop");
        tokio::time::timeout(Duration::from_secs(10), workers.next_exit())
            .await
            .expect("a killed worker's exit is seen within 10 s")
            .expect("a worker ended")
    }

    /// Two workers fail one after the other (a replica group's ranks): the
    /// second gets the standby that has waited longest, not the one started
    /// behind the first promotion a moment ago, which is still starting up.
    #[tokio::test]
    async fn the_standby_started_first_is_promoted_first() {
        let specs = vec![
            sleeper(0, None),
            sleeper(1, None),
            sleeper(2, Some(0)),
            sleeper(3, Some(1)),
        ];
        let mut workers = Workers::spawn(specs, Duration::from_secs(1))
            .await
            .expect("sleep starts");
        let pids: Vec<i32> = workers.workers.iter().map(|w| w.pid).collect();

        let ended = end(&mut workers, pids[0]).await;
        assert_eq!((ended.rank, ended.standby), (0, None));
        assert_eq!(workers.promote(0, 0), Some((0, pids[2])));
        // A new standby takes the number of the one promoted.
        let (fresh, _) = workers.relaunch(sleeper(2, Some(0))).await.expect("sleep starts");

        let ended = end(&mut workers, pids[1]).await;
        assert_eq!((ended.rank, ended.standby), (1, None));
        assert_eq!(
            workers.promote(1, 1),
            Some((1, pids[3])),
            "the fresh standby is pid {fresh}"
        );
        workers.stop(libc::SIGKILL, Duration::from_secs(1)).await;
    }
}
