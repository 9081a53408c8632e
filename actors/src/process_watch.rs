//! Watching the processes of peers on this host (SV-15): a SIGKILLed peer
//! sends nothing, so over QUIC only the heartbeat window (seconds) would
//! notice it; a peer process on this host can be watched directly, and its
//! exit is seen at the watchdog's next poll whatever the transport. On a
//! multi-GPU node this also speeds up remote ranks: the dead rank's local
//! neighbours abort at once and close their links to everyone (SV-14).
//!
//! A process is watched through a pidfd (`pidfd_open`, Linux 5.3+), which
//! names that process and no later one with a reused pid, and turns readable
//! when it exits, reaped or not; where pidfds are unavailable, `kill(pid, 0)`
//! stands in (a zombie then counts as alive until its parent reaps it).
//! Pids mean something only within one pid namespace: the caller watches
//! only peers whose host and pid namespace are this process's
//! ([`pid_namespace`]).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// This process's pid namespace (the inode of `/proc/self/ns/pid`), if it can be read.
pub fn pid_namespace() -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino())
}

#[derive(Debug)]
struct Watched {
    rank: usize,
    pid: u32,
    /// `None`: no pidfd could be opened, `kill(pid, 0)` stands in.
    pidfd: Option<OwnedFd>,
}

/// The peer processes on this host being watched.
#[derive(Debug, Default)]
pub struct ProcessWatch {
    watched: Vec<Watched>,
}

impl ProcessWatch {
    /// Watches each `(rank, pid)`. A pid that is already gone is reported by
    /// the first [`exited`](Self::exited).
    pub fn new(peers: impl IntoIterator<Item = (usize, u32)>) -> Self {
        let watched = peers
            .into_iter()
            .map(|(rank, pid)| Watched {
                rank,
                pid,
                pidfd: open_pidfd(pid),
            })
            .collect();
        Self { watched }
    }

    /// How many processes are watched.
    pub fn len(&self) -> usize {
        self.watched.len()
    }

    /// Whether nothing is watched.
    pub fn is_empty(&self) -> bool {
        self.watched.is_empty()
    }

    /// The watched processes that exited since the last call, as `(rank,
    /// pid)`; each is reported once. Never blocks.
    pub fn exited(&mut self) -> Vec<(usize, u32)> {
        let mut gone = Vec::new();
        self.watched.retain(|w| {
            let alive = match &w.pidfd {
                Some(fd) => !readable(fd),
                None => process_exists(w.pid),
            };
            if !alive {
                gone.push((w.rank, w.pid));
            }
            alive
        });
        gone
    }
}

fn open_pidfd(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the syscall returned a fresh fd that nothing else owns.
    Some(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Whether a pidfd is readable: its process exited.
fn readable(fd: &OwnedFd) -> bool {
    let mut poll = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, timeout 0: returns at once.
    let ready = unsafe { libc::poll(&mut poll, 1, 0) };
    ready > 0 && poll.revents & libc::POLLIN != 0
}

fn process_exists(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let sent = unsafe { libc::kill(pid as libc::pid_t, 0) };
    sent == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::{Duration, Instant};

    #[test]
    fn sv15_an_exited_peer_process_is_reported_once_reaped_or_not() {
        let mut first = Command::new("sleep").arg("30").spawn().unwrap();
        let mut second = Command::new("sleep").arg("30").spawn().unwrap();
        let mut watch = ProcessWatch::new([(1, first.id()), (3, second.id())]);
        assert_eq!(watch.len(), 2);
        assert!(watch.exited().is_empty());
        // Killed but not reaped: a zombie has exited all the same.
        first.kill().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let gone = loop {
            let gone = watch.exited();
            if !gone.is_empty() || Instant::now() > deadline {
                break gone;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(gone, vec![(1, first.id())]);
        assert!(watch.exited().is_empty(), "reported once");
        assert_eq!(watch.len(), 1);
        first.wait().unwrap();
        second.kill().unwrap();
        second.wait().unwrap();
        assert_eq!(watch.exited(), vec![(3, second.id())]);
        assert!(watch.is_empty());
    }

    #[test]
    fn sv15_a_live_process_is_not_reported_and_the_namespace_is_known() {
        let mut watch = ProcessWatch::new([(0, std::process::id())]);
        assert!(watch.exited().is_empty());
        assert!(pid_namespace().is_some());
    }
}
