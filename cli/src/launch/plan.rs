//! Sans-IO decisions: when a round's node group is formed and in which
//! order its nodes rank, when a running group restarts to admit a waiting
//! node, whether to restart after a failure, how a worker's end reads and
//! what the launcher exits with.

use std::fmt;
use std::time::{Duration, Instant};

use chorus_runtime::rendezvous::membership::{self, Claim};

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

/// A launcher that joined a round, as its record in the store says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    /// The launcher (`host:pid`).
    pub id: String,
    /// Its `--nproc-per-node`.
    pub nproc: usize,
    /// Its `--node-rank`, when given (static `--nnodes N` only).
    pub node_rank: Option<usize>,
}

/// The members of a round that forms with `n` nodes, in node rank order:
/// an explicit `--node-rank` keeps its place; the other places go first to
/// the previous round's members, in their previous order (so survivors
/// keep their relative order), then to newcomers in arrival order. Ranks
/// are dense: a node that left leaves no hole ([`membership::places`]).
pub fn members(arrivals: &[Arrival], previous: &[String], n: usize) -> Vec<Arrival> {
    let claims: Vec<Claim> = arrivals
        .iter()
        .map(|a| Claim {
            fixed: a.node_rank,
            previous: previous.iter().position(|id| *id == a.id),
        })
        .collect();
    membership::places(&claims, n)
        .into_iter()
        .map(|i| arrivals[i].clone())
        .collect()
}

/// Whether every member of the previous round (when there was one) is
/// among `arrivals`.
pub fn previous_back(arrivals: &[Arrival], previous: &[String]) -> bool {
    !previous.is_empty() && previous.iter().all(|id| arrivals.iter().any(|a| a.id == *id))
}

/// Whether a running round of `nnodes` nodes restarts to admit a launcher
/// waiting for the next one: only while it has room for it, and only while
/// no node has finished (a finished node would not come back to the
/// restarted group).
pub fn admit_waiting(nnodes: usize, max: usize, nodes_done: usize, waiting: bool) -> bool {
    waiting && nnodes < max && nodes_done == 0
}

/// The keep-alive counters of the other launchers of a round, as last
/// seen, and when each last moved: a launcher whose counter stands still
/// for the keep-alive timeout is taken for hung.
#[derive(Debug, Default)]
pub struct KeepAlives {
    seen: Vec<(String, i64, Instant)>,
}

impl KeepAlives {
    /// Records that `id`'s counter reads `count` at `now`.
    pub fn observe(&mut self, id: &str, count: i64, now: Instant) {
        match self.seen.iter_mut().find(|(seen, _, _)| seen == id) {
            Some((_, last, moved)) if *last != count => (*last, *moved) = (count, now),
            Some(_) => {}
            None => self.seen.push((id.to_string(), count, now)),
        }
    }

    /// The first launcher whose counter has not moved for `timeout` at `now`.
    pub fn stalled(&self, now: Instant, timeout: Duration) -> Option<&str> {
        self.seen
            .iter()
            .find(|(_, _, moved)| now.saturating_duration_since(*moved) >= timeout)
            .map(|(id, _, _)| id.as_str())
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

    fn arrival(id: &str, node_rank: Option<usize>) -> Arrival {
        Arrival {
            id: id.to_string(),
            nproc: 1,
            node_rank,
        }
    }

    fn ids(members: &[Arrival]) -> Vec<&str> {
        members.iter().map(|a| a.id.as_str()).collect()
    }

    #[test]
    fn ranks_are_dense_survivors_keep_their_order_and_newcomers_follow() {
        // Round 0 had a, b, c; b left; d arrived first, then c, then a.
        let previous = ["a".to_string(), "b".into(), "c".into()];
        let arrivals = [arrival("d", None), arrival("c", None), arrival("a", None)];
        assert_eq!(ids(&members(&arrivals, &previous, 3)), ["a", "c", "d"]);
        // No room for everyone: survivors before newcomers.
        assert_eq!(ids(&members(&arrivals, &previous, 2)), ["a", "c"]);
        // The first round: arrival order.
        assert_eq!(ids(&members(&arrivals, &[], 3)), ["d", "c", "a"]);
        assert!(previous_back(
            &[arrival("c", None), arrival("a", None), arrival("b", None)],
            &previous
        ));
        assert!(!previous_back(&arrivals, &previous));
        assert!(!previous_back(&arrivals, &[]));
    }

    #[test]
    fn explicit_node_ranks_keep_their_places() {
        let arrivals = [arrival("x", None), arrival("y", Some(2)), arrival("z", Some(0))];
        assert_eq!(ids(&members(&arrivals, &[], 3)), ["z", "x", "y"]);
        let previous = ["x".to_string()];
        let arrivals = [arrival("n", None), arrival("x", None), arrival("y", Some(1))];
        assert_eq!(ids(&members(&arrivals, &previous, 3)), ["x", "y", "n"]);
    }

    #[test]
    fn a_launcher_whose_keep_alive_stands_still_is_taken_for_hung() {
        let start = Instant::now();
        let timeout = Duration::from_secs(15);
        let at = |s: u64| start + Duration::from_secs(s);
        let mut alive = KeepAlives::default();
        alive.observe("a", 0, at(0));
        alive.observe("b", 7, at(0));
        alive.observe("a", 1, at(10));
        assert_eq!(alive.stalled(at(14), timeout), None);
        assert_eq!(alive.stalled(at(15), timeout), Some("b"));
        alive.observe("b", 8, at(16));
        alive.observe("b", 8, at(20));
        assert_eq!(alive.stalled(at(24), timeout), None, "b moved at 16");
        assert_eq!(alive.stalled(at(25), timeout), Some("a"));
    }

    #[test]
    fn a_waiting_node_is_admitted_only_with_room_and_nobody_finished() {
        assert!(admit_waiting(2, 3, 0, true));
        assert!(!admit_waiting(3, 3, 0, true), "at max the newcomer waits");
        assert!(!admit_waiting(2, 3, 1, true), "a finished node would not come back");
        assert!(!admit_waiting(2, 3, 0, false));
    }
}
