//! The fault schedule, sans IO: from a seed, when each fault strikes, what
//! it is and which node and worker it aims at. The same seed, duration,
//! interval, kinds and shape give the same schedule; which process a
//! target names is resolved only when the fault is injected (a relaunched
//! worker has a new pid). The network kinds ([`FaultKind::network`]) are
//! drawn only across simulated hosts ([`ScheduleSpec::hosts`]).

use std::time::Duration;

use serde::Serialize;

use crate::bench::recovery::Schedule;

/// A kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    /// SIGKILL of a worker; its launcher relaunches it and it rejoins.
    Kill,
    /// SIGSTOP of a worker: the others find it silent by heartbeat and go
    /// on without it; it is SIGKILLed later (twice the heartbeat window
    /// after it stopped), for its launcher to relaunch it.
    Stop,
    /// SIGKILL of a whole launcher (its workers die with it); it is
    /// started again a second later and its node rejoins.
    KillLauncher,
    /// A slow rank: a worker stopped for a moment shorter than the
    /// heartbeat window, then continued; the group waits for it.
    Slow,
    /// Simulated hosts only: the node's host taken off the network (from
    /// the other hosts and the store) for 4 s ([`PARTITION`]), then back. Its
    /// launcher loses the store and exits, the others re-form without it;
    /// it is started again after the heal and its node rejoins.
    Partition,
    /// Simulated hosts only: the host's link drops 2% ([`LOSS`]) of its
    /// frames, each direction, for 3 s ([`IMPAIRED`]); the group goes on.
    LossyLink,
    /// Simulated hosts only: the host's link delays every frame by
    /// 5 ms ([`DELAY`]), each direction, for 3 s ([`IMPAIRED`]); the group
    /// goes on.
    SlowLink,
    /// Silent data corruption: one bit of a worker's parameters (the 1st,
    /// 3rd, ... of a run) or of its local gradient (the 2nd, 4th, ...)
    /// flipped at its next step, asked for through the job's live records
    /// with the job secret (as a dashboard asks); the members' checks must
    /// find it and heal the worker in place.
    Corrupt,
}

/// How long a partition lasts: past the launchers' keep-alive window, so
/// the group re-forms without the host.
pub const PARTITION: Duration = Duration::from_secs(4);

/// How long a lossy or slow link lasts.
pub const IMPAIRED: Duration = Duration::from_secs(3);

/// The frames a lossy link drops, as `chorus netem --loss` takes it.
pub const LOSS: &str = "2%";

/// The delay of a slow link, each direction.
pub const DELAY: Duration = Duration::from_millis(5);

impl FaultKind {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Stop => "stop",
            FaultKind::KillLauncher => "kill-launcher",
            FaultKind::Slow => "slow",
            FaultKind::Partition => "partition",
            FaultKind::LossyLink => "lossy-link",
            FaultKind::SlowLink => "slow-link",
            FaultKind::Corrupt => "corrupt",
        }
    }

    /// Whether it acts on the network between simulated hosts (so needs
    /// them).
    pub fn network(self) -> bool {
        matches!(self, FaultKind::Partition | FaultKind::LossyLink | FaultKind::SlowLink)
    }

    /// How long it lasts before it is undone (zero: an instant fault).
    pub fn lasts(self) -> Duration {
        match self {
            FaultKind::Partition => PARTITION,
            FaultKind::LossyLink | FaultKind::SlowLink => IMPAIRED,
            FaultKind::Kill | FaultKind::Stop | FaultKind::KillLauncher | FaultKind::Slow | FaultKind::Corrupt => {
                Duration::ZERO
            }
        }
    }

    /// Whether the fault makes the group re-form (a member leaves), so
    /// that its recovery time is measured.
    pub fn reforms(self) -> bool {
        !matches!(
            self,
            FaultKind::Slow | FaultKind::LossyLink | FaultKind::SlowLink | FaultKind::Corrupt
        )
    }
}

/// One fault of the schedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PlannedFault {
    /// From the start of the run.
    #[serde(serialize_with = "seconds")]
    pub at: Duration,
    /// What.
    pub kind: FaultKind,
    /// The node (launcher, and its host) it strikes.
    pub node: usize,
    /// The worker of that node, by local rank (not used by `kill-launcher`).
    pub local_rank: usize,
}

fn seconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// What a schedule is drawn over.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleSpec {
    /// The seed.
    pub seed: u64,
    /// Faults start before this.
    pub duration: Duration,
    /// Each gap between faults (and before the first) is drawn uniformly
    /// from this range, millisecond resolution.
    pub every: (Duration, Duration),
    /// The kinds, drawn uniformly (at least one).
    pub kinds: Vec<FaultKind>,
    /// Nodes, and workers per node.
    pub nodes: usize,
    /// Workers per node.
    pub nproc_per_node: usize,
    /// Whether each node is a simulated host of its own; without, the
    /// network kinds are left out of the draw.
    pub hosts: bool,
}

/// The faults of `spec`, in time order.
pub fn schedule(spec: &ScheduleSpec) -> Vec<PlannedFault> {
    let mut rng = Schedule::new(spec.seed);
    let (low, high) = (spec.every.0.as_millis() as u64, spec.every.1.as_millis() as u64);
    let mut faults = Vec::new();
    let mut at = Duration::ZERO;
    let kinds: Vec<FaultKind> = spec
        .kinds
        .iter()
        .copied()
        .filter(|k| spec.hosts || !k.network())
        .collect();
    if kinds.is_empty() {
        return faults;
    }
    loop {
        at += Duration::from_millis(low.min(high) + rng.below(high.abs_diff(low) + 1));
        if at >= spec.duration || high == 0 {
            return faults;
        }
        let kind = kinds[rng.below(kinds.len() as u64) as usize];
        let node = rng.below(spec.nodes as u64) as usize;
        let local_rank = rng.below(spec.nproc_per_node as u64) as usize;
        faults.push(PlannedFault {
            at,
            kind,
            node,
            local_rank,
        });
    }
}

/// A duration as given on the command line: `90`, `90s`, `1500ms`,
/// `10m`, `1h` (a number, seconds without a unit).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale = match unit {
        "" | "s" => 1.0,
        "ms" => 1e-3,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return Err(format!("'{text}': a unit of ms, s, m or h")),
    };
    number
        .parse::<f64>()
        .ok()
        .filter(|n| n.is_finite() && *n >= 0.0)
        .map(|n| Duration::from_secs_f64(n * scale))
        .ok_or_else(|| format!("'{text}': a number and a unit, e.g. 60s or 10m"))
}

/// A range of durations: `10..20` (seconds, or with units as
/// [`parse_duration`]), or one duration for a fixed interval.
pub fn parse_range(text: &str) -> Result<(Duration, Duration), String> {
    let (low, high) = match text.split_once("..") {
        Some((low, high)) => (parse_duration(low)?, parse_duration(high)?),
        None => {
            let d = parse_duration(text)?;
            (d, d)
        }
    };
    if low > high || low.is_zero() {
        return Err(format!("'{text}': a positive range, low..high"));
    }
    Ok((low, high))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_ranges_parse_with_units() {
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("ten").is_err() && parse_duration("5d").is_err() && parse_duration("-1s").is_err());
        assert_eq!(
            parse_range("10..20"),
            Ok((Duration::from_secs(10), Duration::from_secs(20)))
        );
        assert_eq!(
            parse_range("15s"),
            Ok((Duration::from_secs(15), Duration::from_secs(15)))
        );
        assert!(parse_range("20..10").is_err() && parse_range("0..5").is_err());
    }

    fn spec(seed: u64) -> ScheduleSpec {
        ScheduleSpec {
            seed,
            duration: Duration::from_secs(600),
            every: (Duration::from_secs(10), Duration::from_secs(20)),
            kinds: vec![
                FaultKind::Kill,
                FaultKind::Stop,
                FaultKind::KillLauncher,
                FaultKind::Slow,
            ],
            nodes: 3,
            nproc_per_node: 2,
            hosts: false,
        }
    }

    fn with_hosts(seed: u64) -> ScheduleSpec {
        let mut spec = spec(seed);
        spec.kinds
            .extend([FaultKind::Partition, FaultKind::LossyLink, FaultKind::SlowLink]);
        spec.hosts = true;
        spec
    }

    #[test]
    fn network_faults_come_only_across_simulated_hosts() {
        let mut without = with_hosts(1);
        without.hosts = false;
        let faults = schedule(&without);
        assert!(!faults.is_empty());
        assert!(faults.iter().all(|f| !f.kind.network()), "{faults:?}");
        // Without hosts the network kinds are not drawn at all: the
        // schedule is the one of the other kinds alone.
        assert_eq!(faults, schedule(&spec(1)));
        let faults = schedule(&with_hosts(1));
        assert_eq!(faults, schedule(&with_hosts(1)));
        for kind in with_hosts(1).kinds {
            assert!(faults.iter().any(|f| f.kind == kind), "{kind:?} never drawn");
        }
        // Only network kinds, and no hosts: nothing.
        let mut only = with_hosts(1);
        only.kinds = vec![FaultKind::Partition, FaultKind::SlowLink];
        only.hosts = false;
        assert!(schedule(&only).is_empty());
    }

    #[test]
    fn a_network_fault_is_undone_before_the_next_fault_at_the_default_interval() {
        // Faults do not pile up on one host at --fault-every 10..20.
        for kind in [FaultKind::Partition, FaultKind::LossyLink, FaultKind::SlowLink] {
            assert!(kind.lasts() > Duration::ZERO && kind.lasts() < Duration::from_secs(10));
        }
        assert!(!FaultKind::LossyLink.reforms() && !FaultKind::SlowLink.reforms());
        assert!(FaultKind::Partition.reforms());
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        assert_eq!(schedule(&spec(7)), schedule(&spec(7)));
        assert_ne!(schedule(&spec(7)), schedule(&spec(8)));
    }

    #[test]
    fn gaps_stay_in_the_range_and_every_kind_and_target_comes_up() {
        let faults = schedule(&spec(1));
        // 600 s at one fault per 10-20 s.
        assert!((30..=60).contains(&faults.len()), "{}", faults.len());
        let mut last = Duration::ZERO;
        for f in &faults {
            let gap = f.at - last;
            assert!(
                gap >= Duration::from_secs(10) && gap <= Duration::from_secs(20),
                "{gap:?}"
            );
            assert!(f.at < Duration::from_secs(600));
            assert!(f.node < 3 && f.local_rank < 2);
            last = f.at;
        }
        for kind in spec(1).kinds {
            assert!(faults.iter().any(|f| f.kind == kind), "{kind:?} never drawn");
        }
        for node in 0..3 {
            assert!(faults.iter().any(|f| f.node == node));
        }
    }

    #[test]
    fn a_fixed_interval_and_no_kinds_are_honoured() {
        let mut fixed = spec(3);
        fixed.every = (Duration::from_secs(15), Duration::from_secs(15));
        fixed.duration = Duration::from_secs(61);
        let at: Vec<u64> = schedule(&fixed).iter().map(|f| f.at.as_secs()).collect();
        assert_eq!(at, [15, 30, 45, 60]);
        fixed.kinds.clear();
        assert!(schedule(&fixed).is_empty());
    }
}
