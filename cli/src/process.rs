//! Signals to processes: the one place the command line, its example and
//! its tests call `kill(2)`. A pid that names more than one process (0 is
//! the caller's process group, -1 every process it may signal, another
//! negative one a group) is refused, so a pid that was never set cannot
//! take the launcher's own group down.

/// Sends `signal` to the process `pid` (signal 0 only checks that it
/// exists). Returns whether it was sent: false when the process is gone or
/// not ours to signal, or `pid` is not one process's (0 or less).
pub fn signal(pid: impl TryInto<libc::pid_t>, signal: libc::c_int) -> bool {
    let Some(pid) = pid.try_into().ok().filter(|&pid| pid > 0) else {
        return false;
    };
    // SAFETY: kill(2) reads and writes none of this process's memory, and
    // `pid` names one process.
    unsafe { libc::kill(pid, signal) == 0 }
}

/// Sends `signal` to every process of the group `leader` leads (a worker
/// spawned with `process_group(0)`, its children included); false as
/// [`signal`] says.
pub fn signal_group(leader: impl TryInto<libc::pid_t>, signal: libc::c_int) -> bool {
    let Some(leader) = leader.try_into().ok().filter(|&pid| pid > 0) else {
        return false;
    };
    // SAFETY: as in `signal`; `-leader` names the one group it leads.
    unsafe { libc::kill(-leader, signal) == 0 }
}

/// Whether the process `pid` exists (a zombie not yet reaped does).
pub fn exists(pid: impl TryInto<libc::pid_t>) -> bool {
    signal(pid, 0)
}

/// Sends `signal` to this process itself (fault injection: SIGKILL,
/// SIGSTOP).
pub fn signal_self(signal: libc::c_int) {
    self::signal(std::process::id(), signal);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pids_that_name_more_than_one_process_are_refused() {
        for pid in [0, -1, -2] {
            assert!(!signal(pid, 0), "{pid}");
            assert!(!signal_group(pid, 0), "{pid}");
        }
        assert!(!signal(u32::MAX, 0), "a u32 beyond pid_t");
    }

    #[test]
    fn a_child_is_signalled_until_it_is_reaped() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        assert!(exists(child.id()));
        assert!(signal(child.id(), libc::SIGKILL));
        child.wait().unwrap();
        assert!(!exists(child.id()), "reaped: gone");
    }
}
