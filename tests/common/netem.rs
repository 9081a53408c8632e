//! Two simulated hosts joined by an impaired link (`scripts/netem-pair.sh`):
//! host a is 10.99.0.1 in namespace `<name>-a`, host b is 10.99.0.2 in
//! `<name>-b`, and `chorus netem` forwards every frame between them.
//! Dropping the pair stops the impairer and removes the namespaces.

use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Stop, chorus_bin, run, text};

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/netem-pair.sh");

/// Host a's address.
pub(crate) const HOST_A: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 99, 0, 1));
/// Host b's address.
pub(crate) const HOST_B: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 99, 0, 2));

/// A pair of namespaces and the impairer between them.
pub(crate) struct NetemPair {
    name: String,
}

impl NetemPair {
    /// Starts a pair whose link does what `flags` (of `chorus netem`) say,
    /// or fails the test saying why it cannot: the tests that call this are
    /// ignored unless asked for (they need root and `ip netns`).
    pub(crate) fn up(flags: &[&str]) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!("chn{}x{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        let mut command = Command::new("bash");
        command
            .arg(SCRIPT)
            .args(["up", &name])
            .args(flags)
            .env("CHORUS", chorus_bin());
        let output = run(&mut command, 30, "netem-pair.sh up", Stop::Kill);
        assert!(
            output.status.success(),
            "netem-pair.sh up {name} failed (needs root and `ip netns`)\n{}",
            text(&output)
        );
        Self { name }
    }

    /// Runs `f` on a thread that lives in host `host`'s (`'a'` or `'b'`)
    /// network namespace: sockets it makes stay there when handed out.
    pub(crate) fn in_host<T: Send>(&self, host: char, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/run/netns/{}-{host}", self.name);
        std::thread::scope(|scope| {
            scope
                .spawn(|| {
                    let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
                    // SAFETY: setns on this (fresh, unshared) thread only moves
                    // it into the namespace named by an open file.
                    let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
                    assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
                    f()
                })
                .join()
                .expect("thread in the namespace panicked")
        })
    }

    /// The namespace of host `host` (`'a'` or `'b'`), for `ip netns exec`.
    pub(crate) fn namespace(&self, host: char) -> String {
        format!("{}-{host}", self.name)
    }
}

impl Drop for NetemPair {
    fn drop(&mut self) {
        let mut command = Command::new("bash");
        command.arg(SCRIPT).args(["down", &self.name]);
        let output = run(&mut command, 30, "netem-pair.sh down", Stop::Kill);
        // What the impairer counted: shown with a failing test's output.
        eprint!("{}", String::from_utf8_lossy(&output.stderr));
    }
}
