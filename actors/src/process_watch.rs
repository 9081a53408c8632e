//! Watching the processes of peers on this host (SV-15): a SIGKILLed peer
//! sends nothing, so over QUIC only the heartbeat window (seconds) would
//! notice it; a peer process on this host can be watched directly, and its
//! exit wakes the watchdog at once whatever the transport. On a
//! multi-GPU node this also speeds up remote ranks: the dead rank's local
//! neighbours abort at once and close their links to everyone (SV-14).
//!
//! A process is watched through a pidfd (`pidfd_open`, Linux 5.3+), which
//! names that process and no later one with a reused pid, and turns readable
//! when it exits, reaped or not: [`ProcessWatch::next_exit`] waits for that
//! on the runtime's reactor, so the watchdog hears of an exit at once;
//! where pidfds are unavailable, `kill(pid, 0)` on each poll stands in (a
//! zombie then counts as alive until its parent reaps it).
//! Pids mean something only within one pid namespace: the caller watches
//! only peers whose kernel and pid namespace are this process's.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::task::Poll;

use tokio::io::unix::AsyncFd;

#[derive(Debug)]
enum Handle {
    /// A pidfd not yet registered with a reactor.
    Pidfd(OwnedFd),
    /// A pidfd registered with the reactor of the runtime that waits on it.
    Registered(AsyncFd<OwnedFd>),
    /// No pidfd could be opened: `kill(pid, 0)` stands in.
    Signal,
}

#[derive(Debug)]
struct Watched {
    rank: usize,
    pid: u32,
    handle: Handle,
}

impl Watched {
    fn exited(&self) -> bool {
        match &self.handle {
            Handle::Pidfd(fd) => readable(fd),
            Handle::Registered(fd) => readable(fd.get_ref()),
            Handle::Signal => !chorus_transports::process::exists(self.pid),
        }
    }
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
                handle: open_pidfd(pid).map_or(Handle::Signal, Handle::Pidfd),
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
            let exited = w.exited();
            if exited {
                gone.push((w.rank, w.pid));
            }
            !exited
        });
        gone
    }

    /// Waits until watched processes exit and returns them, as
    /// [`exited`](Self::exited) does; pends forever when none can be waited
    /// for (no pidfds: [`exited`](Self::exited) on each poll finds them).
    /// Must run inside a Tokio runtime with IO enabled, whose reactor then
    /// watches the pidfds.
    pub async fn next_exit(&mut self) -> Vec<(usize, u32)> {
        for watched in &mut self.watched {
            watched.handle = match std::mem::replace(&mut watched.handle, Handle::Signal) {
                Handle::Pidfd(fd) => {
                    // SAFETY: the `OwnedFd` moves into the `AsyncFd`, which
                    // keeps it open and unchanged until it is dropped.
                    match unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) } {
                        Ok(registered) => Handle::Registered(registered),
                        // The reactor refused it: keep polling the pidfd.
                        Err(refused) => Handle::Pidfd(refused.into_parts().0),
                    }
                }
                other => other,
            };
        }
        std::future::poll_fn(|cx| {
            let mut gone = Vec::new();
            self.watched.retain(|w| {
                let exited = match &w.handle {
                    Handle::Registered(fd) => fd.poll_read_ready(cx).is_ready(),
                    Handle::Pidfd(_) | Handle::Signal => false,
                };
                if exited {
                    gone.push((w.rank, w.pid));
                }
                !exited
            });
            if gone.is_empty() {
                Poll::Pending
            } else {
                Poll::Ready(gone)
            }
        })
        .await
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

    #[tokio::test]
    async fn sv15_an_exit_wakes_a_waiting_watchdog() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let mut watch = ProcessWatch::new([(2, child.id()), (0, std::process::id())]);
        let waiting = tokio::spawn(async move { (watch.next_exit().await, watch) });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "nothing exited yet");
        child.kill().unwrap();
        let (gone, mut watch) = tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("the exit woke the waiter")
            .unwrap();
        assert_eq!(gone, vec![(2, child.id())]);
        assert!(watch.exited().is_empty(), "this process still runs");
        child.wait().unwrap();
    }

    #[test]
    fn sv15_a_live_process_is_not_reported() {
        let mut watch = ProcessWatch::new([(0, std::process::id())]);
        assert!(watch.exited().is_empty());
    }
}
