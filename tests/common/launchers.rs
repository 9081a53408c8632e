//! Several `chorus launch` processes on this machine forming one job (the
//! multi-node launcher tests): each launcher's stdout and stderr go to
//! files in the job's directory, read back per launcher tag.
//!
//! Every wait runs under a deadline: past it, [`Job::check`] kills every
//! launcher and fails with what each printed. The tests take turns
//! ([`lock`]): each starts several launchers and workers on a small machine.

use chorus::process::{self, Signal};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{chorus_bin, free_port};

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Serializes the tests of one binary (a failed one does not block the rest).
pub(crate) fn lock() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Whether process `pid` runs (a zombie does not).
pub(crate) fn alive(pid: i32) -> bool {
    // A zombie has exited; only its entry waits for a reaper.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

/// The launchers of one job; whatever is still running when it drops is
/// SIGKILLed (its workers die with it).
pub(crate) struct Job {
    dir: tempfile::TempDir,
    port: u16,
    run_id: &'static str,
    secret: &'static str,
    /// The store's `etcd://` URL, when the launchers meet in etcd.
    etcd: Option<String>,
    launchers: Vec<(String, Child)>,
}

impl Job {
    /// A job with run id `run_id` and job secret `secret`, its store on a
    /// free port, and `worker` written to `worker.sh` in its directory.
    pub(crate) fn named(run_id: &'static str, secret: &'static str, worker: &str) -> Job {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("worker.sh");
        std::fs::write(&script, worker).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        Job {
            dir,
            port: free_port(),
            run_id,
            secret,
            etcd: None,
            launchers: Vec::new(),
        }
    }

    /// The same job meeting in etcd (`--rdzv-backend etcd`) at `url`.
    pub(crate) fn in_etcd(mut self, url: &str) -> Job {
        self.etcd = Some(url.to_string());
        self
    }

    /// The job's directory: worker.sh and each launcher's `{tag}.stdout`
    /// and `{tag}.stderr`.
    pub(crate) fn out(&self) -> &Path {
        self.dir.path()
    }

    /// The worker script given to [`Job::named`].
    pub(crate) fn worker(&self) -> PathBuf {
        self.out().join("worker.sh")
    }

    /// Launcher `tag`'s command up to its program: `chorus launch` with
    /// this job's store endpoint and run id, then `flags` and `--`; its
    /// stdout and stderr go to `{tag}.stdout` and `{tag}.stderr`. The
    /// caller adds the program (and any environment) and [`Job::spawn`]s it.
    pub(crate) fn command(&self, tag: &str, flags: &[&str]) -> Command {
        let (backend, endpoint) = match &self.etcd {
            Some(url) => ("etcd", url.trim_start_matches("etcd://").to_string()),
            None => ("c10d", format!("127.0.0.1:{}", self.port)),
        };
        let log = |stream: &str| std::fs::File::create(self.out().join(format!("{tag}.{stream}"))).unwrap();
        let mut command = Command::new(chorus_bin());
        command
            .arg("launch")
            .args([
                "--rdzv-backend",
                backend,
                "--rdzv-endpoint",
                &endpoint,
                "--rdzv-id",
                self.run_id,
            ])
            .args(["--monitor-interval", "0.05", "--shutdown-timeout", "5"])
            .args(flags)
            .arg("--")
            .env("CHORUS_JOB_SECRET", self.secret)
            .env("CHORUS_HEARTBEAT_TIMEOUT", "3")
            // Nodes on several machines would talk over QUIC: so do these.
            .env("CHORUS_TRANSPORT", "quic")
            .env_remove("CHORUS_FAULTS")
            .env_remove("OMP_NUM_THREADS")
            .env("CHORUS", chorus_bin())
            // A launcher SIGKILLed here leaves its run directory behind.
            .env("TMPDIR", self.out())
            .stdin(Stdio::null())
            .stdout(log("stdout"))
            .stderr(log("stderr"));
        command
    }

    /// Starts `command` (from [`Job::command`]) as launcher `tag`.
    pub(crate) fn spawn(&mut self, tag: &str, mut command: Command) {
        let child = command.spawn().expect("start chorus launch");
        self.launchers.push((tag.to_string(), child));
    }

    /// Waits until the store's port accepts connections (the first launcher serves it).
    pub(crate) fn wait_for_store(&self) {
        self.wait_until(10, "the first launcher never served the store", |job| {
            std::net::TcpStream::connect(("127.0.0.1", job.port)).is_ok()
        });
    }

    fn read(&self, tag: &str, stream: &str) -> String {
        std::fs::read_to_string(self.out().join(format!("{tag}.{stream}"))).unwrap_or_default()
    }

    /// What launcher `tag`'s workers printed to stdout so far.
    pub(crate) fn stdout(&self, tag: &str) -> String {
        self.read(tag, "stdout")
    }

    /// What launcher `tag` printed itself so far.
    pub(crate) fn stderr(&self, tag: &str) -> String {
        self.read(tag, "stderr")
    }

    /// What launcher `tag` printed so far, both streams, labelled.
    pub(crate) fn output(&self, tag: &str) -> String {
        format!(
            "--- {tag} stdout:\n{}--- {tag} stderr:\n{}",
            self.stdout(tag),
            self.stderr(tag)
        )
    }

    /// What every launcher printed so far.
    pub(crate) fn all_output(&self) -> String {
        self.launchers
            .iter()
            .map(|(tag, _)| self.output(tag))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Past `deadline`, kills everything and fails with `what` and the output.
    pub(crate) fn check(&self, deadline: Instant, what: &str) {
        if Instant::now() > deadline {
            self.stop_all();
            panic!("{what}\n{}", self.all_output());
        }
    }

    /// Polls `done` every 20 ms for up to `secs`; past that, [`Job::check`]
    /// fails with `what`.
    pub(crate) fn wait_until(&self, secs: u64, what: &str, done: impl Fn(&Job) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while !done(self) {
            self.check(deadline, what);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs every launcher.
    pub(crate) fn stop_all(&self) {
        for (_, child) in &self.launchers {
            // SIGKILL takes the workers too (their parent-death signal).
            process::signal(child.id(), Signal::SIGKILL);
        }
    }

    pub(crate) fn child(&mut self, tag: &str) -> &mut Child {
        &mut self.launchers.iter_mut().find(|(t, _)| t == tag).unwrap().1
    }

    /// Waits for launcher `tag` to exit, up to `secs` from now.
    pub(crate) fn finish(&mut self, tag: &str, secs: u64) -> ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Some(status) = self.child(tag).try_wait().expect("poll child") {
                return status;
            }
            self.check(deadline, &format!("launcher {tag} did not finish within {secs}s"));
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub(crate) fn signal(&mut self, tag: &str, signal: Signal) {
        process::signal(self.child(tag).id(), signal);
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        self.stop_all();
        for (_, child) in &mut self.launchers {
            let _ = child.wait();
        }
    }
}
