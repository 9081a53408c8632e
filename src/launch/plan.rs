//! Sans-IO decisions: when the node group is formed, whether to restart,
//! how a worker's end reads and what the launcher exits with.

use std::fmt;
use std::time::Duration;

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerExit {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

impl WorkerExit {
    /// From the process status.
    pub fn from_status(status: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(code), _) => WorkerExit::Code(code),
            (None, Some(signal)) => WorkerExit::Signal(signal),
            // Neither a code nor a signal cannot happen for an exited child.
            (None, None) => WorkerExit::Code(1),
        }
    }

    /// Whether it succeeded.
    pub fn success(self) -> bool {
        self == WorkerExit::Code(0)
    }

    /// The launcher's exit code when this failure ends the job: the worker's
    /// own code, or 1 when a signal killed it (torchrun exits 1 then too).
    pub fn launcher_code(self) -> i32 {
        match self {
            WorkerExit::Code(code) if code != 0 => code,
            _ => 1,
        }
    }
}

impl fmt::Display for WorkerExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            WorkerExit::Code(code) => write!(f, "exited with code {code}"),
            WorkerExit::Signal(signal) => write!(f, "was killed by signal {} ({signal})", signal_name(signal)),
        }
    }
}

/// The usual name of a signal number.
pub fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        _ => "signal",
    }
}

/// What to do after attempt `attempt` failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterFailure {
    /// Start attempt `next` (`TORCHELASTIC_RESTART_COUNT`).
    Restart {
        /// The next attempt.
        next: u64,
    },
    /// Restarts are used up.
    GiveUp,
}

/// torchrun's policy: restart the whole group while restarts remain.
pub fn after_failure(attempt: u64, max_restarts: u64) -> AfterFailure {
    if attempt < max_restarts {
        AfterFailure::Restart { next: attempt + 1 }
    } else {
        AfterFailure::GiveUp
    }
}

/// Whether the node group of an attempt is formed, and with how many nodes:
/// at once with `max` nodes; with `min` or more once `last_call` has passed
/// since the `min`-th arrived (torchrun's last call for late nodes).
pub fn nodes_formed(
    joined: usize,
    min: usize,
    max: usize,
    since_min: Option<Duration>,
    last_call: Duration,
) -> Option<usize> {
    if joined >= max {
        return Some(max);
    }
    match since_min {
        Some(waited) if joined >= min && waited >= last_call => Some(joined),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_until_the_limit() {
        assert_eq!(after_failure(0, 2), AfterFailure::Restart { next: 1 });
        assert_eq!(after_failure(1, 2), AfterFailure::Restart { next: 2 });
        assert_eq!(after_failure(2, 2), AfterFailure::GiveUp);
        assert_eq!(after_failure(0, 0), AfterFailure::GiveUp);
    }

    #[test]
    fn exit_codes_and_descriptions() {
        assert_eq!(WorkerExit::Code(7).launcher_code(), 7);
        assert_eq!(WorkerExit::Signal(9).launcher_code(), 1);
        assert_eq!(WorkerExit::Signal(9).to_string(), "was killed by signal SIGKILL (9)");
        assert_eq!(WorkerExit::Code(3).to_string(), "exited with code 3");
        assert!(WorkerExit::Code(0).success());
    }

    #[test]
    fn group_forms_at_max_or_after_last_call() {
        let call = Duration::from_secs(30);
        assert_eq!(nodes_formed(2, 2, 2, Some(Duration::ZERO), call), Some(2));
        assert_eq!(nodes_formed(1, 2, 2, None, call), None);
        assert_eq!(nodes_formed(2, 1, 4, Some(Duration::from_secs(1)), call), None);
        assert_eq!(nodes_formed(2, 1, 4, Some(call), call), Some(2));
    }
}
