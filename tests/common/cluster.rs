//! Simulated hosts for multi-host tests: `scripts/sim-cluster.sh` makes
//! network namespaces with their own host names, `/dev/shm`, `eth0` on a
//! switch and a decoy `docker0`; this wraps it for tests. Every host of a
//! [`Cluster`] is removed when it drops, with whatever still runs on it.

use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/sim-cluster.sh");

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Serializes the cluster tests of one binary: each runs several launchers
/// and ranks on a small machine.
pub(crate) fn lock() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Hosts `1..=hosts` of one simulated cluster.
pub(crate) struct Cluster {
    prefix: String,
}

fn script(args: &[&str]) -> Output {
    Command::new("bash")
        .arg(SCRIPT)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run scripts/sim-cluster.sh")
}

/// `program` on host `host` of the cluster named `prefix` ([`Cluster::command`]).
pub(crate) fn on_host(prefix: &str, host: usize, program: &str) -> Command {
    let mut command = Command::new("bash");
    command
        .arg(SCRIPT)
        .args(["exec", prefix, &host.to_string(), "--", program])
        .stdin(Stdio::null());
    command
}

impl Cluster {
    /// Makes `hosts` hosts (`options` as `sim-cluster.sh up` takes them),
    /// or fails the test saying why they cannot be made: the tests that
    /// call this are ignored unless asked for (they need root).
    pub(crate) fn up(tag: &str, hosts: usize, options: &[&str]) -> Cluster {
        assert!(tag.len() <= 3, "cluster tags are at most 3 characters");
        assert!(
            // SAFETY: geteuid has no preconditions.
            unsafe { libc::geteuid() } == 0,
            "the simulated-host tests need root (network namespaces)"
        );
        let prefix = format!("{tag}{}", std::process::id() % 1000);
        // A cluster left by a killed run of the same pid would be in the way.
        script(&["down", &prefix]);
        let hosts = hosts.to_string();
        let mut args = vec!["up", prefix.as_str(), hosts.as_str()];
        args.extend_from_slice(options);
        let made = script(&args);
        if !made.status.success() {
            script(&["down", &prefix]);
            panic!(
                "cannot make simulated hosts here: {}",
                String::from_utf8_lossy(&made.stderr).trim()
            );
        }
        Cluster { prefix }
    }

    /// `program` on host `host` (from 1). The child is `program` itself
    /// (the script execs into it), so killing the child kills it.
    pub(crate) fn command(&self, host: usize, program: &str) -> Command {
        on_host(&self.prefix, host, program)
    }

    /// SIGKILLs every process on host `host`, as when the host dies.
    pub(crate) fn kill(&self, host: usize) {
        let done = script(&["kill", &self.prefix, &host.to_string()]);
        assert!(done.status.success(), "kill host {host}: {done:?}");
    }

    /// The processes still running on host `host`, one `ps` line each.
    pub(crate) fn processes(&self, host: usize) -> Vec<String> {
        let net = format!("{}-h{host}", self.prefix);
        let pids = Command::new("ip")
            .args(["netns", "pids", &net])
            .output()
            .expect("ip netns pids");
        String::from_utf8_lossy(&pids.stdout)
            .split_whitespace()
            .filter_map(|pid| {
                let args = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                let args = String::from_utf8_lossy(&args).replace('\0', " ");
                // A zombie has exited; only its entry waits for a reaper.
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
                let zombie = stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z'));
                (!zombie).then(|| format!("{pid} {}", args.trim()))
            })
            .collect()
    }

    /// The cluster's name in `sim-cluster.sh`'s commands.
    pub(crate) fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Host `host`'s `eth0` address.
    pub(crate) fn addr(&self, host: usize) -> String {
        format!("10.77.0.{host}")
    }

    /// Takes host `host` off the network (both directions), as a partition.
    pub(crate) fn cut(&self, host: usize) {
        let done = script(&["cut", &self.prefix, &host.to_string()]);
        assert!(done.status.success(), "cut host {host}: {done:?}");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        script(&["down", &self.prefix]);
    }
}
