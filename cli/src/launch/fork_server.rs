//! The fork server: a Python process started beside a node's workers that
//! imports torch (and what a first optimizer step imports) and then runs
//! nothing else. A replacement worker, relaunched or a new standby, is
//! forked from it instead of started afresh, so it skips the interpreter's
//! start-up and those imports: seconds, where the rest of a recovery takes
//! tens of milliseconds. The child is made into what `python -u script.py`
//! would have been: its own process group, the worker's environment,
//! directory, CPUs, argv, stdin from /dev/null and stdout/stderr into the
//! launcher's pipes (passed over the socket); see `fork_server.py`.
//!
//! Safety of the fork: the server checks, after its imports, that it is
//! still one thread (a thread pool started by an import would be missing in
//! the child, and its locks could be held forever); otherwise it says
//! `unsafe` and every worker starts as a new process. Commands that are not
//! `python [-u] script.py ...` or `python [-u] -m module ...` start as new
//! processes too, as do all workers under `--no-fork-server`.

use std::collections::HashMap;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};

use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::UnixStream;
use tokio::net::unix::pipe;
use tokio::sync::oneshot;

use super::plan::WorkerExit;

/// The descriptor the server finds its socket on.
const SERVER_FD: i32 = 3;

/// How long a fork may wait for the server's answer, its imports included
/// (seconds on a loaded machine); past it the server is stopped and the
/// worker starts afresh.
const FORK_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// A worker command the fork server can run: `python [-u] script.py ARGS`
/// or `python [-u] -m module ARGS`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PythonCommand {
    /// The interpreter, as the command names it.
    pub interpreter: String,
    /// `-u`: unbuffered standard streams.
    pub unbuffered: bool,
    /// `-m`: `argv[0]` is a module, not a script.
    pub module: bool,
    /// The script (or module) and its arguments.
    pub argv: Vec<String>,
}

impl PythonCommand {
    /// The command, when it is one the fork server can run; `None` for
    /// anything else (another program, interpreter options other than
    /// `-u`, `-c`, a script read from stdin).
    pub fn parse(command: &[String]) -> Option<Self> {
        let (interpreter, rest) = command.split_first()?;
        let name = interpreter.rsplit('/').next().unwrap_or(interpreter);
        let version = name.strip_prefix("python")?;
        if !version.chars().all(|c| c.is_ascii_digit() || c == '.') {
            return None;
        }
        let mut unbuffered = false;
        let mut rest = rest;
        while let Some((first, more)) = rest.split_first() {
            match first.as_str() {
                "-u" => unbuffered = true,
                "-m" => {
                    let (module, args) = more.split_first()?;
                    return Some(PythonCommand {
                        interpreter: interpreter.clone(),
                        unbuffered,
                        module: true,
                        argv: std::iter::once(module).chain(args).cloned().collect(),
                    });
                }
                flag if flag.starts_with('-') => return None,
                _ => break,
            }
            rest = more;
        }
        rest.first()?;
        Some(PythonCommand {
            interpreter: interpreter.clone(),
            unbuffered,
            module: false,
            argv: rest.to_vec(),
        })
    }
}

/// One line from the server.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Reply {
    Ready,
    Unsafe { threads: usize },
    Forked { id: u64, pid: i32 },
    Failed { id: u64, why: String },
    Exited { pid: i32, status: i32 },
}

impl Reply {
    fn parse(line: &str) -> Option<Reply> {
        let mut words = line.trim_end().splitn(3, ' ');
        let kind = words.next()?;
        let first = words.next();
        let rest = words.next();
        Some(match (kind, first, rest) {
            ("ready", None, None) => Reply::Ready,
            ("unsafe", Some(threads), None) => Reply::Unsafe {
                threads: threads.parse().ok()?,
            },
            ("forked", Some(id), Some(pid)) => Reply::Forked {
                id: id.parse().ok()?,
                pid: pid.parse().ok()?,
            },
            ("failed", Some(id), why) => Reply::Failed {
                id: id.parse().ok()?,
                why: why.unwrap_or("no reason given").to_string(),
            },
            ("exited", Some(pid), Some(status)) => Reply::Exited {
                pid: pid.parse().ok()?,
                status: status.parse().ok()?,
            },
            _ => return None,
        })
    }
}

/// A worker forked from the server.
pub struct Forked {
    /// Its process id (it leads its own process group).
    pub pid: i32,
    /// Its standard output and error.
    pub stdout: pipe::Receiver,
    /// Its standard error.
    pub stderr: pipe::Receiver,
    /// How it ended, once it has.
    pub exit: oneshot::Receiver<WorkerExit>,
}

/// What the fork of one worker needs besides the command.
pub struct Request<'a> {
    /// The worker's command.
    pub command: &'a PythonCommand,
    /// Variables added to the launcher's environment.
    pub env: &'a [(String, String)],
    /// The CPUs it is bound to; empty when unbound.
    pub cpus: &'a [usize],
}

/// The server's answer to a fork: the child's pid and its exit to come, or why not.
type ForkAnswer = Result<(i32, oneshot::Receiver<WorkerExit>), String>;

#[derive(Default)]
struct Shared {
    /// Why the server cannot fork any more (or never could).
    gone: Option<String>,
    pending: HashMap<u64, oneshot::Sender<ForkAnswer>>,
    exits: HashMap<i32, oneshot::Sender<WorkerExit>>,
}

/// A running fork server; dropping it kills it (and with it, through their
/// parent-death signal, the workers forked from it that still run).
pub struct ForkServer {
    interpreter: String,
    socket: Arc<UnixStream>,
    shared: Arc<Mutex<Shared>>,
    next_id: u64,
    /// How long a fork waits for the server's answer ([`FORK_WAIT`]).
    answer_wait: std::time::Duration,
    process: tokio::process::Child,
}

impl ForkServer {
    /// Starts the server for `command`'s interpreter with the launcher's
    /// environment plus `env` (a worker's: what the imports see is what a
    /// fresh worker's would). It imports in the background; a fork asked
    /// for before it is ready waits for it.
    pub fn start(command: &PythonCommand, env: &[(String, String)]) -> std::io::Result<ForkServer> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()?;
        let theirs = OwnedFd::from(theirs);
        let mut process = tokio::process::Command::new(&command.interpreter);
        // The program comes on stdin (`-`), so `ps` shows a name, not it.
        process
            .args(["-", "chorus-fork-server"])
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("CHORUS_FORK_SERVER_FD", SERVER_FD.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let raw = theirs.as_raw_fd();
        let launcher = std::process::id() as libc::pid_t;
        // SAFETY: runs between fork and exec, calling only async-signal-safe
        // functions (dup2, fcntl, prctl, getppid, _exit).
        unsafe {
            process.pre_exec(move || {
                // dup2 onto itself would keep close-on-exec set.
                let moved = if raw == SERVER_FD {
                    libc::fcntl(raw, libc::F_SETFD, 0)
                } else {
                    libc::dup2(raw, SERVER_FD)
                };
                if moved < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                super::workers::die_with(launcher)
            });
        }
        let mut child = process.spawn()?;
        drop(theirs);
        if let Some(mut stdin) = child.stdin.take() {
            // A few kilobytes into an empty pipe: written at once.
            tokio::spawn(async move {
                let _ = stdin.write_all(include_bytes!("fork_server.py")).await;
            });
        }
        if let Some(stderr) = child.stderr.take() {
            tokio::spawn(async move {
                let mut lines = BufReader::new(stderr).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    tracing::debug!(target: "chorus::launch::fork_server", "{line}");
                }
            });
        }
        ours.set_nonblocking(true)?;
        let socket = Arc::new(UnixStream::from_std(ours)?);
        let shared = Arc::new(Mutex::new(Shared::default()));
        tokio::spawn(read_replies(socket.clone(), shared.clone()));
        Ok(ForkServer {
            interpreter: command.interpreter.clone(),
            socket,
            shared,
            next_id: 0,
            answer_wait: FORK_WAIT,
            process: child,
        })
    }

    /// Waits `wait` for each fork's answer instead of the default 60 s.
    pub fn answer_wait(mut self, wait: std::time::Duration) -> Self {
        self.answer_wait = wait;
        self
    }

    /// Forks the worker `request` describes. An error says why the server
    /// could not (it said `unsafe`, it died, the fork failed, the command
    /// names another interpreter): start the worker as a new process then.
    pub async fn fork(&mut self, request: Request<'_>) -> Result<Forked, String> {
        if request.command.interpreter != self.interpreter {
            return Err(format!(
                "the command runs {}, the server {}",
                request.command.interpreter, self.interpreter
            ));
        }
        let (stdout_read, stdout_write) = std::io::pipe().map_err(|e| format!("cannot make a pipe: {e}"))?;
        let (stderr_read, stderr_write) = std::io::pipe().map_err(|e| format!("cannot make a pipe: {e}"))?;
        let stdout = pipe::Receiver::from_owned_fd(stdout_read.into()).map_err(|e| e.to_string())?;
        let stderr = pipe::Receiver::from_owned_fd(stderr_read.into()).map_err(|e| e.to_string())?;
        self.next_id += 1;
        let id = self.next_id;
        // The request is JSON: a variable that is not UTF-8 cannot travel in
        // it (a new process inherits it as it is).
        let mut env = std::env::vars_os()
            .map(|(key, value)| Some((key.into_string().ok()?, value.into_string().ok()?)))
            .collect::<Option<HashMap<String, String>>>()
            .ok_or("the launcher's environment holds a variable that is not UTF-8")?;
        env.extend(request.env.iter().cloned());
        let cwd = std::env::current_dir().map_err(|e| format!("no working directory: {e}"))?;
        let mut line = serde_json::to_vec(&serde_json::json!({
            "id": id,
            "argv": request.command.argv,
            "module": request.command.module,
            "unbuffered": request.command.unbuffered,
            "env": env,
            "cwd": cwd,
            "cpus": request.cpus,
        }))
        .map_err(|e| e.to_string())?;
        line.push(b'\n');
        let (reply_tx, reply) = oneshot::channel();
        {
            let mut shared = lock(&self.shared);
            if let Some(why) = &shared.gone {
                return Err(why.clone());
            }
            shared.pending.insert(id, reply_tx);
        }
        let fds = [stdout_write.as_raw_fd(), stderr_write.as_raw_fd()];
        if let Err(e) = self.send(&line, &fds).await {
            lock(&self.shared).pending.remove(&id);
            return Err(format!("cannot write to the fork server: {e}"));
        }
        // The server holds its own copies now; the child gets them.
        drop((stdout_write, stderr_write));
        let (pid, exit) = match tokio::time::timeout(self.answer_wait, reply).await {
            Ok(answer) => answer.map_err(|_| "the fork server stopped".to_string())??,
            Err(_) => {
                // A late answer would start a worker nobody watches: stop it
                // (a child it forked dies with it).
                let why = format!("the fork server did not answer within {:?}", self.answer_wait);
                lock(&self.shared).gone = Some(why.clone());
                let _ = self.process.start_kill();
                return Err(why);
            }
        };
        Ok(Forked {
            pid,
            stdout,
            stderr,
            exit,
        })
    }

    /// Writes `bytes`, the descriptors riding with the first of them.
    async fn send(&self, bytes: &[u8], fds: &[i32]) -> std::io::Result<()> {
        let mut sent = 0;
        while sent < bytes.len() {
            self.socket.writable().await?;
            let rights = [ControlMessage::ScmRights(fds)];
            let cmsgs: &[ControlMessage] = if sent == 0 { &rights } else { &[] };
            let result = self.socket.try_io(Interest::WRITABLE, || {
                sendmsg::<()>(
                    self.socket.as_raw_fd(),
                    &[IoSlice::new(&bytes[sent..])],
                    cmsgs,
                    MsgFlags::MSG_NOSIGNAL,
                    None,
                )
                .map_err(std::io::Error::from)
            });
            match result {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Reads the server's lines until it ends, answering forks and reporting exits.
async fn read_replies(socket: Arc<UnixStream>, shared: Arc<Mutex<Shared>>) {
    let mut buffer = Vec::new();
    let why = 'read: loop {
        if let Err(e) = socket.readable().await {
            break format!("its socket failed: {e}");
        }
        let mut chunk = [0u8; 4096];
        match socket.try_read(&mut chunk) {
            Ok(0) => break "it exited".to_string(),
            Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => break format!("its socket failed: {e}"),
        }
        while let Some(end) = buffer.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buffer.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            match Reply::parse(&line) {
                Some(reply) => {
                    if let Some(why) = handle(reply, &shared) {
                        break 'read why;
                    }
                }
                None => break 'read format!("it sent a line that is not of its protocol: {line:?}"),
            }
        }
    };
    tracing::debug!(target: "chorus::launch::fork_server", "fork server gone: {why}");
    let mut shared = lock(&shared);
    for (_, pending) in shared.pending.drain() {
        let _ = pending.send(Err(format!("the fork server is gone: {why}")));
    }
    // Its children die with it (their parent-death signal is SIGKILL).
    for (_, exit) in shared.exits.drain() {
        let _ = exit.send(WorkerExit::Signal(libc::SIGKILL));
    }
    // A reason given first (a fork that gave up on it) is the cause.
    shared.gone.get_or_insert(format!("the fork server is gone: {why}"));
}

/// Acts on one reply; `Some(why)` when the server can no longer be used.
fn handle(reply: Reply, shared: &Mutex<Shared>) -> Option<String> {
    let mut shared = lock(shared);
    match reply {
        Reply::Ready => tracing::debug!(target: "chorus::launch::fork_server", "fork server ready"),
        Reply::Unsafe { threads } => {
            return Some(format!(
                "it runs {threads} threads after importing torch, so forking it is not safe (a thread pool started at import: set OMP_NUM_THREADS=1, or pass --no-fork-server)"
            ));
        }
        Reply::Forked { id, pid } => {
            let (exit_tx, exit) = oneshot::channel();
            shared.exits.insert(pid, exit_tx);
            if let Some(pending) = shared.pending.remove(&id) {
                let _ = pending.send(Ok((pid, exit)));
            }
        }
        Reply::Failed { id, why } => {
            if let Some(pending) = shared.pending.remove(&id) {
                let _ = pending.send(Err(format!("the fork failed: {why}")));
            }
        }
        Reply::Exited { pid, status } => {
            if let Some(exit) = shared.exits.remove(&pid) {
                let _ = exit.send(WorkerExit::from_status(ExitStatus::from_raw(status)));
            }
        }
    }
    None
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(line: &str) -> Vec<String> {
        line.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn python_scripts_and_modules_can_be_forked() {
        let script = PythonCommand::parse(&words("python3 -u train.py --lr 1")).unwrap();
        assert_eq!(script.interpreter, "python3");
        assert!(script.unbuffered && !script.module);
        assert_eq!(script.argv, words("train.py --lr 1"));
        let module = PythonCommand::parse(&words("/usr/bin/python3.11 -u -m pkg.train --x")).unwrap();
        assert!(module.module && module.unbuffered);
        assert_eq!(module.argv, words("pkg.train --x"));
        assert!(!PythonCommand::parse(&words("python a.py")).unwrap().unbuffered);
    }

    #[test]
    fn other_commands_start_as_new_processes() {
        for line in [
            "./train",
            "bash -c true",
            "pythonista a.py",
            "python3 -X importtime a.py",
            "python3 -c pass",
            "python3 -u",
            "python3 -m",
            "py -u a.py",
        ] {
            assert_eq!(PythonCommand::parse(&words(line)), None, "{line}");
        }
        assert_eq!(PythonCommand::parse(&[]), None);
    }

    #[test]
    fn the_servers_lines_parse_and_anything_else_does_not() {
        assert_eq!(Reply::parse("ready\n"), Some(Reply::Ready));
        assert_eq!(Reply::parse("unsafe 3\n"), Some(Reply::Unsafe { threads: 3 }));
        assert_eq!(
            Reply::parse("forked 7 4242\n"),
            Some(Reply::Forked { id: 7, pid: 4242 })
        );
        assert_eq!(
            Reply::parse("failed 7 [Errno 11] Resource temporarily unavailable\n"),
            Some(Reply::Failed {
                id: 7,
                why: "[Errno 11] Resource temporarily unavailable".into()
            })
        );
        assert_eq!(
            Reply::parse("exited 4242 2304\n"),
            Some(Reply::Exited {
                pid: 4242,
                status: 2304
            })
        );
        for line in [
            "",
            "ready now",
            "forked 7",
            "forked x 1",
            "exited 1",
            "unsafe many",
            "hello",
        ] {
            assert_eq!(Reply::parse(line), None, "{line:?}");
        }
    }

    /// A server that reads nothing and answers nothing (it holds its socket
    /// and sleeps): the fork gives up at its wait, stops the server, and
    /// later forks fail at once.
    #[tokio::test]
    async fn a_server_that_answers_nothing_is_given_up_at_the_wait() {
        let dir = tempfile::tempdir().unwrap();
        let interpreter = dir.path().join("python3");
        std::fs::write(&interpreter, "#!/bin/sh\nexec sleep 30\n").unwrap();
        std::fs::set_permissions(&interpreter, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let command = PythonCommand::parse(&[interpreter.display().to_string(), "a.py".into()]).unwrap();
        let mut server = ForkServer::start(&command, &[])
            .unwrap()
            .answer_wait(std::time::Duration::from_millis(300));
        let request = || Request {
            command: &command,
            env: &[],
            cpus: &[],
        };
        let started = std::time::Instant::now();
        let why = server.fork(request()).await.err().expect("nothing answered");
        assert!(why.contains("did not answer within 300ms"), "{why}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        let status = tokio::time::timeout(std::time::Duration::from_secs(5), server.process.wait())
            .await
            .expect("the silent server was stopped")
            .unwrap();
        assert!(!status.success());
        let again = server.fork(request()).await.err().expect("the server is gone");
        assert!(again.contains("did not answer"), "{again}");
    }

    #[test]
    fn an_exit_status_from_the_server_reads_as_a_launched_workers() {
        let shared = Mutex::new(Shared::default());
        let (tx, mut rx) = oneshot::channel();
        lock(&shared).exits.insert(10, tx);
        assert_eq!(
            handle(
                Reply::Exited {
                    pid: 10,
                    status: 3 << 8
                },
                &shared
            ),
            None
        );
        assert_eq!(rx.try_recv().unwrap(), WorkerExit::Code(3));
        let (tx, mut rx) = oneshot::channel();
        lock(&shared).exits.insert(11, tx);
        handle(
            Reply::Exited {
                pid: 11,
                status: libc::SIGKILL,
            },
            &shared,
        );
        assert_eq!(rx.try_recv().unwrap(), WorkerExit::Signal(libc::SIGKILL));
        assert!(handle(Reply::Unsafe { threads: 2 }, &shared).is_some());
    }
}
