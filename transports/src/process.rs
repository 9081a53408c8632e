//! Signals to processes: the one place the crates, the command line, its
//! example and its tests send one (`kill(2)` through `nix`, so no caller
//! writes `unsafe`). A pid that names more than one process (0 is the
//! caller's process group, -1 every process it may signal, another
//! negative one a group) is refused, so a pid that was never set cannot
//! take the caller's own group down.

use nix::errno::Errno;
use nix::sys::signal;
use nix::unistd::Pid;

pub use nix::sys::signal::Signal;

/// One process's pid, or `None` where `pid` names none or several.
fn one(pid: impl TryInto<i32>) -> Option<Pid> {
    pid.try_into().ok().filter(|&pid| pid > 0).map(Pid::from_raw)
}

/// Sends `signal` to the process `pid`. Returns whether it was sent: false
/// when the process is gone or not ours to signal, or `pid` is not one
/// process's (0 or less).
pub fn signal(pid: impl TryInto<i32>, signal: Signal) -> bool {
    one(pid).is_some_and(|pid| signal::kill(pid, signal).is_ok())
}

/// Sends `signal` to every process of the group `leader` leads (a worker
/// spawned with `process_group(0)`, its children included); false as
/// [`signal()`] says.
pub fn signal_group(leader: impl TryInto<i32>, signal: Signal) -> bool {
    one(leader).is_some_and(|leader| signal::killpg(leader, signal).is_ok())
}

/// Whether the process `pid` exists (a zombie not yet reaped does; so does
/// one that is not ours to signal).
pub fn exists(pid: impl TryInto<i32>) -> bool {
    one(pid).is_some_and(|pid| signal::kill(pid, None) != Err(Errno::ESRCH))
}

/// Sends `signal` to this process itself (fault injection: SIGKILL,
/// SIGSTOP).
pub fn signal_self(signal: Signal) {
    self::signal(std::process::id(), signal);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pids_that_name_more_than_one_process_are_refused() {
        for pid in [0, -1, -2] {
            assert!(!signal(pid, Signal::SIGCONT), "{pid}");
            assert!(!signal_group(pid, Signal::SIGCONT), "{pid}");
            assert!(!exists(pid), "{pid}");
        }
        assert!(!exists(u32::MAX), "a u32 beyond pid_t");
    }

    #[test]
    fn a_child_is_signalled_until_it_is_reaped() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        assert!(exists(child.id()));
        assert!(signal(child.id(), Signal::SIGKILL));
        child.wait().unwrap();
        assert!(!exists(child.id()), "reaped: gone");
    }

    #[test]
    fn a_process_not_ours_to_signal_still_exists() {
        // pid 1 runs on every Linux host; an unprivileged caller gets EPERM.
        assert!(exists(1));
    }
}
