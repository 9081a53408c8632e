//! The sides of a bench run: what measures one size when the parent asks,
//! rank processes talking JSON lines over their stdin and stdout
//! (`ProcessSide`: chorus's `bench --worker` ranks or a Python peer's)
//! or ranks as actors in this process (`InProcessSide`). The size sweeps
//! ([`super::collective`], [`super::tune`]) alternate their sides per size.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

use super::common::{free_port, torchrun_env};
use super::measure::{Raw, Spec, measure};
use chorus::binding;

/// Something that measures one size when asked: a set of rank processes or in-process ranks.
pub(crate) trait Side {
    /// `chorus (quic)`, `gloo`, ...
    fn label(&self) -> String;
    /// Measures `count`; one [`Raw`] per rank.
    fn step(&mut self, count: usize, timeout: Duration) -> Result<Vec<Raw>>;
    /// Stops the ranks.
    fn finish(&mut self);
}

/// How long the other ranks may take to answer once one answered with an error.
const ERROR_GRACE: Duration = Duration::from_secs(2);

/// Rank processes talking JSON lines over their stdin/stdout.
pub(crate) struct ProcessSide {
    label: String,
    children: Vec<Child>,
    stdins: Vec<ChildStdin>,
    lines: mpsc::Receiver<(usize, String)>,
    stderr: Arc<Mutex<Vec<VecDeque<String>>>>,
    /// What the ranks said when ready (torch's version for Gloo).
    ready: Vec<Value>,
}

impl ProcessSide {
    /// Starts `world` processes of `program args` with the env:// variables,
    /// rank r bound to `cpus[r]` when that is given and not empty.
    pub(crate) fn start(
        label: String,
        program: &str,
        args: &[String],
        world: usize,
        extra_env: &[(String, String)],
        cpus: &[Vec<usize>],
    ) -> Result<Self> {
        let port = free_port().context("finding a free port")?;
        let (tx, lines) = mpsc::channel();
        let stderr = Arc::new(Mutex::new(vec![VecDeque::new(); world]));
        let mut side = Self {
            label,
            children: Vec::new(),
            stdins: Vec::new(),
            lines,
            stderr: stderr.clone(),
            ready: Vec::new(),
        };
        for rank in 0..world {
            let mut command = Command::new(program);
            torchrun_env(&mut command, rank, world, port);
            command
                .args(args)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in extra_env {
                command.env(k, v);
            }
            if let Some(cpus) = cpus.get(rank).filter(|c| !c.is_empty()) {
                let set = binding::cpu_set(cpus);
                // SAFETY: the closure runs between fork and exec and only
                // calls sched_setaffinity.
                unsafe {
                    std::os::unix::process::CommandExt::pre_exec(&mut command, move || {
                        binding::bind_current_process(&set)
                    });
                }
            }
            let mut child = command
                .spawn()
                .with_context(|| format!("starting rank {rank} of {}: {program}", side.label))?;
            side.stdins.push(child.stdin.take().expect("piped"));
            let (out, err) = (child.stdout.take().expect("piped"), child.stderr.take().expect("piped"));
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(Result::ok) {
                    if tx.send((rank, line)).is_err() {
                        break;
                    }
                }
            });
            let stderr = stderr.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(err).lines().map_while(Result::ok) {
                    let mut tails = stderr.lock().expect("stderr tails");
                    let tail = &mut tails[rank];
                    if tail.len() == 20 {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            });
            side.children.push(child);
        }
        Ok(side)
    }

    /// Why the ranks failed: exit statuses and the end of their stderr.
    fn failure(&mut self, what: &str) -> anyhow::Error {
        std::thread::sleep(Duration::from_millis(200));
        let mut s = format!("{} {what}", self.label);
        let tails = self.stderr.lock().expect("stderr tails").clone();
        for (rank, child) in self.children.iter_mut().enumerate() {
            let status = match child.try_wait() {
                Ok(Some(status)) => format!("exited with {status}"),
                _ => "still running".to_string(),
            };
            let _ = write!(s, "\n  rank {rank} {status}");
            for line in &tails[rank] {
                let _ = write!(s, "\n    {line}");
            }
        }
        anyhow!(s)
    }

    /// Reads one JSON line from every rank. Once a rank answers with an
    /// error, the others get [`ERROR_GRACE`] to answer (a frozen one never
    /// will), then the step fails naming every rank's error.
    fn collect(&mut self, timeout: Duration, what: &str) -> Result<Vec<Value>> {
        let deadline = Instant::now() + timeout;
        let mut got: Vec<Option<Value>> = vec![None; self.children.len()];
        let mut first_error: Option<Instant> = None;
        while got.iter().any(Option::is_none) {
            let limit = first_error.map_or(deadline, |at| (at + ERROR_GRACE).min(deadline));
            let left = limit.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.min(Duration::from_millis(500))) {
                Ok((rank, line)) => match serde_json::from_str::<Value>(&line) {
                    Ok(value) => {
                        if value.get("error").is_some() {
                            first_error.get_or_insert_with(Instant::now);
                        }
                        got[rank] = Some(value);
                    }
                    Err(_) => tracing::debug!(rank, line, "ignoring a non-JSON line"),
                },
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if first_error.is_some() && Instant::now() >= limit {
                        return Err(anyhow!(self.errors(&got, what)));
                    }
                    let exited = self.children.iter_mut().any(|c| matches!(c.try_wait(), Ok(Some(_))));
                    if exited {
                        return Err(self.failure(&format!("stopped while {what}")));
                    }
                    if Instant::now() >= deadline {
                        return Err(self.failure(&format!("did not finish {what} within {timeout:?}")));
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(self.failure(&format!("stopped while {what}"))),
            }
        }
        if first_error.is_some() {
            return Err(anyhow!(self.errors(&got, what)));
        }
        Ok(got.into_iter().map(|v| v.expect("all collected")).collect())
    }

    /// Each rank's error, and the ranks that did not answer.
    fn errors(&self, got: &[Option<Value>], what: &str) -> String {
        let mut s = format!("{} failed while {what}:", self.label);
        for (rank, value) in got.iter().enumerate() {
            match value.as_ref().map(|v| v.get("error").and_then(Value::as_str)) {
                Some(Some(error)) => {
                    let _ = write!(s, "\n  rank {rank}: {error}");
                }
                Some(None) => {}
                None => {
                    let _ = write!(
                        s,
                        "\n  rank {rank}: no answer within {ERROR_GRACE:?} of the first error (frozen or stuck; killed)"
                    );
                }
            }
        }
        s
    }

    /// Starts `world` ranks of this binary (`bench --worker` in `flags`) on
    /// `transport`, with a job secret of their own and `extra_env` (named in
    /// an error), bound to `cpus` as [`ProcessSide::start`], and waits until
    /// their group formed.
    pub(crate) fn start_chorus(
        label: String,
        transport: &str,
        flags: &[String],
        world: usize,
        extra_env: &[(String, String)],
        cpus: &[Vec<usize>],
        timeout: Duration,
    ) -> Result<Self> {
        let exe = std::env::current_exe().context("locating the chorus binary")?;
        let mut env = vec![("CHORUS_TRANSPORT".to_string(), transport.to_string())];
        env.extend_from_slice(extra_env);
        let settings = env
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ");
        env.push(("CHORUS_JOB_SECRET".to_string(), chorus::auth::random_hex(16)?));
        let mut side = Self::start(label, &exe.to_string_lossy(), flags, world, &env, cpus)?;
        side.wait_ready(timeout).context(settings)?;
        Ok(side)
    }

    pub(crate) fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        self.ready = self.collect(timeout, "forming the group")?;
        if let Some(e) = self.ready.iter().find_map(|v| v.get("error").and_then(Value::as_str)) {
            bail!("{}: {e}", self.label);
        }
        Ok(())
    }
}

impl Side for ProcessSide {
    fn label(&self) -> String {
        self.label.clone()
    }

    fn step(&mut self, count: usize, timeout: Duration) -> Result<Vec<Raw>> {
        for stdin in &mut self.stdins {
            writeln!(stdin, "run {count}")
                .and_then(|()| stdin.flush())
                .map_err(|e| anyhow!("{}: a rank's stdin: {e}", self.label))?;
        }
        let values = self.collect(timeout, &format!("measuring count {count}"))?;
        values
            .into_iter()
            .map(|v| Raw::from_json(v).map_err(|e| anyhow!(e)))
            .collect()
    }

    fn finish(&mut self) {
        for stdin in &mut self.stdins {
            let _ = writeln!(stdin, "quit").and_then(|()| stdin.flush());
        }
        self.stdins.clear();
        let deadline = Instant::now() + Duration::from_secs(10);
        for child in &mut self.children {
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
            }
            let _ = child.wait();
        }
    }
}

impl Drop for ProcessSide {
    fn drop(&mut self) {
        for child in &mut self.children {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

type Command_ = tokio::sync::mpsc::UnboundedSender<Option<usize>>;

/// Ranks as actors in this process ([`chorus::spawn`]), on a runtime of their own.
pub(crate) struct InProcessSide {
    commands: Vec<Command_>,
    results: mpsc::Receiver<(usize, Result<Raw, String>)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl InProcessSide {
    pub(crate) fn start(spec: Spec, world: usize) -> Result<Self> {
        let (mut commands, mut receivers) = (Vec::new(), Vec::new());
        for _ in 0..world {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            commands.push(tx);
            receivers.push(Some(rx));
        }
        let receivers = Arc::new(Mutex::new(receivers));
        let (tx, results) = mpsc::channel();
        let threads = std::thread::available_parallelism()
            .map_or(2, |n| n.get())
            .min(world.max(1));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
            .context("starting the in-process ranks' runtime")?;
        let thread = std::thread::spawn(move || {
            let failed = tx.clone();
            let outcome = runtime.block_on(chorus::spawn(world, move |group| {
                let rank = group.rank();
                let mut rx = receivers.lock().expect("receivers")[rank]
                    .take()
                    .expect("one body per rank");
                let (spec, tx) = (spec.clone(), tx.clone());
                async move {
                    while let Some(Some(count)) = rx.recv().await {
                        let result = measure(&group, &spec, count).await.map_err(|e| format!("{e:#}"));
                        if tx.send((rank, result)).is_err() {
                            break;
                        }
                    }
                }
            }));
            if let Err(e) = outcome {
                let _ = failed.send((usize::MAX, Err(format!("in-process ranks: {e}"))));
            }
        });
        Ok(Self {
            commands,
            results,
            thread: Some(thread),
        })
    }
}

impl Side for InProcessSide {
    fn label(&self) -> String {
        "chorus (in-process)".into()
    }

    fn step(&mut self, count: usize, timeout: Duration) -> Result<Vec<Raw>> {
        for c in &self.commands {
            c.send(Some(count))
                .map_err(|_| anyhow!("the in-process ranks stopped"))?;
        }
        let mut got: Vec<Option<Raw>> = vec![None; self.commands.len()];
        let deadline = Instant::now() + timeout;
        while got.iter().any(Option::is_none) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.results.recv_timeout(left) {
                Ok((rank, Ok(raw))) if rank < got.len() => got[rank] = Some(raw),
                Ok((rank, Err(e))) => bail!("chorus (in-process) rank {rank}: {e}"),
                Ok(_) => {}
                Err(_) => bail!("chorus (in-process) did not finish count {count} within {timeout:?}"),
            }
        }
        Ok(got.into_iter().map(|r| r.expect("all collected")).collect())
    }

    fn finish(&mut self) {
        for c in &self.commands {
            let _ = c.send(None);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
