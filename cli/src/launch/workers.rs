//! The worker processes of one attempt on this node: spawned each in its
//! own process group (so stopping one takes its children too, and a
//! terminal's Ctrl-C reaches only the launcher, which forwards it), their
//! output prefixed with the rank, teed to log files and kept in a short
//! ring buffer for failure reports. One worker can be relaunched in its
//! slot while the others run (`--restart-policy worker`), or a warm
//! standby worker promoted into it (`--standby`).

use std::collections::VecDeque;
use std::io::Write;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::LaunchError;
use super::binding;
use super::config::Streams;
use super::plan::WorkerExit;

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
}

/// The workers of one attempt.
pub struct Workers {
    workers: Vec<Worker>,
    exits: mpsc::UnboundedReceiver<(usize, WorkerExit)>,
    /// Cloned into each worker's waiter, relaunched ones too.
    exits_tx: mpsc::UnboundedSender<(usize, WorkerExit)>,
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

    /// Promotes the running standby worker with the lowest number into the
    /// slot of `local_rank` (global `rank`), whose worker has ended; the
    /// ended one's entry becomes that standby's, for
    /// [`Workers::relaunch`] to start a new standby in. Returns the
    /// standby's number and pid, or `None` when none is running.
    pub fn promote(&mut self, local_rank: usize, rank: usize) -> Option<(usize, i32)> {
        let spare = self
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.running)
            .filter_map(|(i, w)| Some((w.standby?, i)))
            .min()?;
        let (number, index) = spare;
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
    /// with no ended entry of its local rank gets a new one. Returns the new pid.
    pub fn relaunch(&mut self, spec: WorkerSpec) -> Result<i32, LaunchError> {
        let Some(index) = self
            .workers
            .iter()
            .position(|w| !w.running && w.local_rank == spec.local_rank)
        else {
            if spec.standby.is_some() {
                let worker = spawn_one(self.workers.len(), spec, self.exits_tx.clone())?;
                let pid = worker.pid;
                self.workers.push(worker);
                return Ok(pid);
            }
            return Err(LaunchError::Io {
                what: format!("relaunching local rank {}", spec.local_rank),
                source: std::io::Error::other("no such worker slot"),
            });
        };
        let old = &self.workers[index];
        // Children the old worker started in its group must not linger.
        signal_group(old.pid, libc::SIGKILL);
        let worker = spawn_one(index, spec, self.exits_tx.clone())?;
        let pid = worker.pid;
        self.workers[index] = worker;
        Ok(pid)
    }

    /// Sends `signal` to every running worker's process group, waits up to
    /// `grace` for them to end, then kills what is left of every group.
    pub async fn stop(&mut self, signal: i32, grace: Duration) {
        for worker in self.workers.iter().filter(|w| w.running) {
            signal_group(worker.pid, signal);
            // A stopped (SIGSTOPped) worker would keep the signal pending
            // until the grace ran out: resume it so it acts on it now.
            signal_group(worker.pid, libc::SIGCONT);
        }
        let _ = tokio::time::timeout(grace, async { while self.any_exit().await.is_some() {} }).await;
        // Children a worker started in its group may outlive it: no orphans.
        for worker in &self.workers {
            signal_group(worker.pid, libc::SIGKILL);
        }
        while self.any_exit().await.is_some() {}
        for worker in &mut self.workers {
            drain(&mut worker.readers).await;
        }
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

fn signal_group(pid: i32, signal: i32) {
    // SAFETY: kill only sends a signal; a negative pid names the process
    // group the worker leads (spawned with process_group(0)).
    unsafe {
        libc::kill(-pid, signal);
    }
}

fn spawn_one(
    index: usize,
    spec: WorkerSpec,
    exits: mpsc::UnboundedSender<(usize, WorkerExit)>,
) -> Result<Worker, LaunchError> {
    let mut command = tokio::process::Command::new(&spec.argv[0]);
    command
        .args(&spec.argv[1..])
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // A launcher that is SIGKILLed cannot stop its workers: have the kernel
    // kill each worker when the launcher dies (the worker's own children
    // are the worker's to handle, as PyTorch's data loaders do).
    let launcher = std::process::id() as libc::pid_t;
    let cpus = (!spec.cpus.is_empty()).then(|| binding::cpu_set(&spec.cpus));
    // SAFETY: the closure runs in the child between fork and exec and calls
    // only async-signal-safe functions (prctl, getppid, _exit, sched_setaffinity).
    unsafe {
        command.pre_exec(move || {
            if let Some(cpus) = &cpus {
                binding::bind_current_process(cpus)?;
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher may have died before prctl took effect.
            if libc::getppid() != launcher {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(|source| LaunchError::Spawn {
        program: spec.argv[0].clone(),
        rank: spec.rank,
        source,
    })?;
    let pid = child.id().map_or(0, |id| id as i32);
    let tail = Arc::new(Mutex::new(VecDeque::with_capacity(TAIL_LINES)));
    let label = Arc::new(Mutex::new(spec.label()));
    let mut readers = Vec::new();
    if let Some(stdout) = child.stdout.take() {
        readers.push(tokio::spawn(relay(
            stdout,
            true,
            spec.clone(),
            label.clone(),
            tail.clone(),
        )));
    }
    if let Some(stderr) = child.stderr.take() {
        readers.push(tokio::spawn(relay(
            stderr,
            false,
            spec.clone(),
            label.clone(),
            tail.clone(),
        )));
    }
    tokio::spawn(async move {
        let exit = match child.wait().await {
            Ok(status) => WorkerExit::from_status(status),
            Err(_) => WorkerExit::Code(1),
        };
        let _ = exits.send((index, exit));
    });
    Ok(Worker {
        rank: spec.rank,
        local_rank: spec.local_rank,
        standby: spec.standby,
        label,
        pid,
        tail,
        readers,
        running: true,
    })
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
