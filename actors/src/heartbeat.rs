//! Heartbeats between ranks: every rank sends a tiny frame to every peer
//! each `interval` on [`HEARTBEAT_CHANNEL`], and a peer from which nothing
//! arrived for `window` is taken for dead or frozen. This catches what a
//! collective's own deadline (minutes) catches too late: a SIGKILLed peer
//! (its link closes, or it falls silent when the transport cannot tell), a
//! SIGSTOPped one and a partition (silence).
//!
//! The timing is sans IO: [`HeartbeatMonitor`] is fed arrivals and closed
//! links with the time they happened and polled with `now`; [`spawn`] is
//! the thin IO part (one sender and one reader task per peer).
//!
//! Ranks in one process (`chorus::spawn`) have no heartbeats: a rank cannot
//! fall silent apart from its process, and n^2 tasks would swamp a large
//! world. Their monitor watches closed links only
//! ([`HeartbeatMonitor::closures_only`]), fed by [`spawn_local`] from the
//! in-process mesh's watcher.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chorus_transports::link::{Link, TransportError};
use chorus_transports::local::LocalWatch;
use tokio::sync::{Notify, watch};

/// The channel heartbeats travel on (`u32::MAX - 1`), apart from
/// collectives (RA-2) and point-to-point operations (RA-3), so a heartbeat is
/// never read by an operation and an operation never waits behind one.
pub use chorus_transports::link::HEARTBEAT_CHANNEL;

/// The tag of the frame a rank sends when it leaves cleanly (SV-8).
const GOODBYE: u64 = u64::MAX;

/// How often heartbeats go out and how long a silence is tolerated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeartbeatConfig {
    /// Time between two heartbeats to a peer.
    pub interval: Duration,
    /// Silence after which a peer is taken for dead or frozen.
    pub window: Duration,
}

impl Default for HeartbeatConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(1),
            window: Duration::from_secs(5),
        }
    }
}

impl HeartbeatConfig {
    /// A window of `window`, with heartbeats often enough that one late
    /// frame alone never looks like a silence (at least three per window).
    pub fn with_window(window: Duration) -> Self {
        Self {
            interval: Duration::from_secs(1).min(window / 3),
            window,
        }
    }
}

/// Why a peer is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerFailureCause {
    /// Nothing arrived from it for this long: failed.
    Silent(Duration),
    /// Its link was lost (it died, the connection broke, a fault cut it):
    /// failed.
    Closed(String),
    /// It closed its link on purpose, e.g. aborting after a failure it saw
    /// (SV-14): gone, but not failed itself.
    Left {
        /// Its reason.
        reason: String,
        /// The ranks it took for failed.
        failed: Vec<usize>,
    },
}

impl PeerFailureCause {
    /// The cause a link error shows: a peer's close on purpose is
    /// [`Left`](Self::Left), anything else a lost link.
    pub fn of(error: &TransportError) -> Self {
        match error {
            TransportError::PeerClosed { reason, failed, .. } => PeerFailureCause::Left {
                reason: reason.clone(),
                failed: failed.clone(),
            },
            other => PeerFailureCause::Closed(other.to_string()),
        }
    }
}

/// A peer the monitor gave up on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerFailure {
    /// The peer.
    pub rank: usize,
    /// Why.
    pub cause: PeerFailureCause,
}

impl PeerFailure {
    /// Whether the peer itself failed (it did not leave on purpose).
    pub fn failed(&self) -> bool {
        !matches!(self.cause, PeerFailureCause::Left { .. })
    }
}

impl fmt::Display for PeerFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.cause {
            PeerFailureCause::Silent(d) => write!(
                f,
                "rank {} sent no heartbeat for {:.1}s (dead, frozen or partitioned)",
                self.rank,
                d.as_secs_f64()
            ),
            PeerFailureCause::Closed(reason) => write!(f, "rank {} is gone: {reason}", self.rank),
            PeerFailureCause::Left { reason, .. } => write!(f, "rank {} closed its links ({reason})", self.rank),
        }
    }
}

#[derive(Debug)]
struct PeerState {
    last: Instant,
    closed: Option<PeerFailureCause>,
    reported: bool,
}

/// The heartbeat's timing, without IO: when each peer was last heard from.
#[derive(Debug)]
pub struct HeartbeatMonitor {
    window: Duration,
    peers: BTreeMap<usize, PeerState>,
    /// Without heartbeats: every rank below the world size but this one is
    /// watched, without a state until its link fails; those that left.
    implicit: Option<Implicit>,
}

#[derive(Debug)]
struct Implicit {
    world: usize,
    me: usize,
    left: BTreeSet<usize>,
}

impl HeartbeatMonitor {
    /// Watches `peers`, each heard from at `now` (the group just formed).
    pub fn new(peers: impl IntoIterator<Item = usize>, window: Duration, now: Instant) -> Self {
        let peers = peers
            .into_iter()
            .map(|p| {
                (
                    p,
                    PeerState {
                        last: now,
                        closed: None,
                        reported: false,
                    },
                )
            })
            .collect();
        Self {
            window,
            peers,
            implicit: None,
        }
    }

    /// Watches every other rank of `world` for closed links only, never
    /// for silence: for ranks without heartbeats (in one process). Keeps
    /// state only for peers whose link failed.
    pub fn closures_only(world: usize, me: usize) -> Self {
        Self {
            window: Duration::MAX,
            peers: BTreeMap::new(),
            implicit: Some(Implicit {
                world,
                me,
                left: BTreeSet::new(),
            }),
        }
    }

    /// The state of `peer`, made for a watched peer without one.
    fn state(&mut self, peer: usize) -> Option<&mut PeerState> {
        if let Some(implicit) = &self.implicit
            && peer < implicit.world
            && peer != implicit.me
            && !implicit.left.contains(&peer)
        {
            return Some(self.peers.entry(peer).or_insert(PeerState {
                last: Instant::now(),
                closed: None,
                reported: false,
            }));
        }
        self.peers.get_mut(&peer)
    }

    /// A heartbeat from `peer` arrived at `now`.
    pub fn arrived(&mut self, peer: usize, now: Instant) {
        if let Some(state) = self.peers.get_mut(&peer) {
            state.last = state.last.max(now);
        }
    }

    /// The link to `peer` failed with `error`: it is gone at once, without
    /// waiting out the window (failed, or left when it closed on purpose).
    pub fn link_failed(&mut self, peer: usize, error: &TransportError) {
        if let Some(state) = self.state(peer) {
            state.closed.get_or_insert_with(|| PeerFailureCause::of(error));
        }
    }

    /// `peer`'s process exited (seen on this host, SV-15, or published by
    /// its launcher in the store): it failed, without waiting out the window.
    pub fn process_exited(&mut self, peer: usize, pid: u32) {
        if let Some(state) = self.state(peer) {
            state
                .closed
                .get_or_insert_with(|| PeerFailureCause::Closed(format!("its process (pid {pid}) exited")));
        }
    }

    /// `peer`'s process exited after its own group aborted, blaming
    /// `failed` (its launcher published whom, from its error file): it
    /// left because of them, as a close notice would say (SV-14), so it is
    /// not blamed itself.
    pub fn exited_after_abort(&mut self, peer: usize, pid: u32, failed: Vec<usize>) {
        if let Some(state) = self.state(peer) {
            state.closed.get_or_insert_with(|| PeerFailureCause::Left {
                reason: format!("its process (pid {pid}) exited after its group aborted"),
                failed,
            });
        }
    }

    /// `peer` left cleanly: it is no longer watched (SV-8).
    pub fn left(&mut self, peer: usize) {
        self.peers.remove(&peer);
        if let Some(implicit) = &mut self.implicit {
            implicit.left.insert(peer);
        }
    }

    /// Peers failed by `now` and not reported before: each failure is
    /// reported once.
    pub fn poll(&mut self, now: Instant) -> Vec<PeerFailure> {
        let mut failed = Vec::new();
        for (&rank, state) in &mut self.peers {
            if state.reported {
                continue;
            }
            let silent = now.saturating_duration_since(state.last);
            let cause = match &state.closed {
                Some(cause) => cause.clone(),
                None if silent >= self.window => PeerFailureCause::Silent(silent),
                None => continue,
            };
            state.reported = true;
            failed.push(PeerFailure { rank, cause });
        }
        failed
    }
}

/// A [`HeartbeatMonitor`] shared by the heartbeat readers and the
/// watchdog. A failed link wakes the watchdog at once: a peer's close
/// notice (its abort) is acted on in microseconds, not at the next poll.
#[derive(Debug)]
pub struct SharedMonitor {
    monitor: Mutex<HeartbeatMonitor>,
    link_failed: Notify,
}

impl SharedMonitor {
    /// Shares `monitor`.
    pub fn new(monitor: HeartbeatMonitor) -> Arc<Self> {
        Arc::new(Self {
            monitor: Mutex::new(monitor),
            link_failed: Notify::new(),
        })
    }

    /// The monitor.
    pub fn lock(&self) -> MutexGuard<'_, HeartbeatMonitor> {
        self.monitor.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that the link to `peer` failed and wakes the watchdog.
    pub fn link_failed(&self, peer: usize, error: &TransportError) {
        self.lock().link_failed(peer, error);
        self.link_failed.notify_one();
    }

    /// Records that `peer`'s process exited (seen by this host, SV-15, or
    /// published by its launcher) and wakes the watchdog.
    pub fn process_exited(&self, peer: usize, pid: u32) {
        self.lock().process_exited(peer, pid);
        self.link_failed.notify_one();
    }

    /// Records that `peer`'s process exited after blaming `failed`
    /// ([`HeartbeatMonitor::exited_after_abort`]) and wakes the watchdog.
    pub fn exited_after_abort(&self, peer: usize, pid: u32, failed: Vec<usize>) {
        self.lock().exited_after_abort(peer, pid, failed);
        self.link_failed.notify_one();
    }

    /// Returns once a link failed since the last call returned.
    pub async fn next_link_failure(&self) {
        self.link_failed.notified().await;
    }
}

/// Starts this rank's heartbeats on the current runtime (the rank's
/// arbiter): per peer, one task sends a frame every `config.interval` and
/// one reads the peer's frames into `monitor`. A task per direction and
/// peer, so a send that waits on a frozen peer's full queue delays nobody
/// else's heartbeat. Everything stops when `stop` turns true. A heartbeat
/// that comes two or more intervals after the previous one adds the
/// intervals it skipped to `missed`.
pub fn spawn(
    links: &[Option<Arc<dyn Link>>],
    config: HeartbeatConfig,
    monitor: Arc<SharedMonitor>,
    stop: watch::Receiver<bool>,
    missed: metrics::Counter,
) {
    for link in links.iter().flatten() {
        let (sender, mut stop_sending) = (link.clone(), stop.clone());
        tokio::spawn(async move {
            let mut beat = 0u64;
            loop {
                // A failed send is the reader's to report: it sees the closed link.
                let sent = sender.send(HEARTBEAT_CHANNEL, beat, Bytes::copy_from_slice(&beat.to_le_bytes()));
                tokio::select! {
                    _ = stop_sending.wait_for(|s| *s) => return,
                    _ = sent => {}
                }
                beat += 1;
                tokio::select! {
                    _ = stop_sending.wait_for(|s| *s) => return,
                    () = tokio::time::sleep(config.interval) => {}
                }
            }
        });
        let (reader, monitor, mut stop_reading, missed) = (link.clone(), monitor.clone(), stop.clone(), missed.clone());
        tokio::spawn(async move {
            let peer = reader.peer();
            let mut last = Instant::now();
            loop {
                tokio::select! {
                    _ = stop_reading.wait_for(|s| *s) => return,
                    frame = reader.recv(HEARTBEAT_CHANNEL) => match frame {
                        Ok(frame) if frame.tag == GOODBYE => {
                            monitor.lock().left(peer);
                            return;
                        }
                        Ok(_) => {
                            let now = Instant::now();
                            let intervals = now.duration_since(last).as_nanos() / config.interval.as_nanos().max(1);
                            if intervals >= 2 {
                                missed.increment(intervals as u64 - 1);
                            }
                            last = now;
                            monitor.lock().arrived(peer, now);
                        }
                        Err(e) => {
                            monitor.link_failed(peer, &e);
                            return;
                        }
                    },
                }
            }
        });
    }
}

/// Feeds `monitor` from an in-process rank's watcher until `stop` turns
/// true: a closed link fails its peer, unless the peer left cleanly (SV-8).
pub fn spawn_local(watch: LocalWatch, monitor: Arc<SharedMonitor>, mut stop: watch::Receiver<bool>) {
    tokio::spawn(async move {
        loop {
            let closed = tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                closed = watch.next() => closed,
            };
            for (peer, error) in closed {
                if watch.has_left(peer) {
                    monitor.lock().left(peer);
                } else {
                    monitor.link_failed(peer, &error);
                }
            }
        }
    });
}

/// Tells every peer this rank is leaving cleanly, so that its silence from
/// now on is not a failure (SV-8). Best effort: a peer that cannot take the
/// frame within a second is failing anyway.
pub async fn say_goodbye(links: &[Option<Arc<dyn Link>>]) {
    let sends = links.iter().flatten().map(|link| {
        tokio::time::timeout(
            Duration::from_secs(1),
            link.send(HEARTBEAT_CHANNEL, GOODBYE, Bytes::new()),
        )
    });
    for sent in sends {
        let _ = sent.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: Duration = Duration::from_secs(5);

    #[test]
    fn a_peer_heard_from_within_the_window_is_alive() {
        let t0 = Instant::now();
        let mut monitor = HeartbeatMonitor::new([1, 2], WINDOW, t0);
        for s in 1..20 {
            monitor.arrived(1, t0 + Duration::from_secs(s));
            monitor.arrived(2, t0 + Duration::from_secs(s));
            assert!(
                monitor
                    .poll(t0 + Duration::from_secs(s) + Duration::from_millis(900))
                    .is_empty()
            );
        }
    }

    #[test]
    fn a_silent_peer_fails_once_the_window_passes_and_is_reported_once() {
        let t0 = Instant::now();
        let mut monitor = HeartbeatMonitor::new([1, 2], WINDOW, t0);
        monitor.arrived(1, t0 + Duration::from_secs(3));
        assert!(monitor.poll(t0 + Duration::from_millis(4999)).is_empty());
        let failed = monitor.poll(t0 + WINDOW);
        assert_eq!(
            failed,
            vec![PeerFailure {
                rank: 2,
                cause: PeerFailureCause::Silent(WINDOW)
            }]
        );
        assert!(
            monitor.poll(t0 + Duration::from_secs(7)).is_empty(),
            "rank 2 is reported once"
        );
        assert_eq!(monitor.poll(t0 + Duration::from_secs(8))[0].rank, 1);
    }

    #[test]
    fn a_closed_link_fails_its_peer_at_once() {
        let t0 = Instant::now();
        let mut monitor = HeartbeatMonitor::new([0, 3], WINDOW, t0);
        monitor.link_failed(
            3,
            &TransportError::Closed {
                peer: 3,
                reason: "rank 3 (pid 9) died".into(),
            },
        );
        let failed = monitor.poll(t0);
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].rank, 3);
        assert!(failed[0].failed());
        assert!(failed[0].to_string().contains("pid 9) died"), "{}", failed[0]);
    }

    #[test]
    fn sv14_a_peer_that_closed_on_purpose_left_and_did_not_fail() {
        let t0 = Instant::now();
        let mut monitor = HeartbeatMonitor::new([1, 2], WINDOW, t0);
        let closed = TransportError::PeerClosed {
            peer: 1,
            reason: "rank 1 aborted: rank 2 (pid 9) died".into(),
            failed: vec![2],
        };
        monitor.link_failed(1, &closed);
        // A later error of the same link does not change what happened first.
        monitor.link_failed(
            1,
            &TransportError::Closed {
                peer: 1,
                reason: "closed by rank 0".into(),
            },
        );
        let gone = monitor.poll(t0);
        assert_eq!(
            gone,
            vec![PeerFailure {
                rank: 1,
                cause: PeerFailureCause::Left {
                    reason: "rank 1 aborted: rank 2 (pid 9) died".into(),
                    failed: vec![2]
                }
            }]
        );
        assert!(!gone[0].failed());
        assert_eq!(
            gone[0].to_string(),
            "rank 1 closed its links (rank 1 aborted: rank 2 (pid 9) died)"
        );
    }

    #[test]
    fn sv14_a_peer_that_exited_after_its_own_abort_left_and_names_whom_it_blamed() {
        let t0 = Instant::now();
        let mut monitor = HeartbeatMonitor::new([1, 2, 3], WINDOW, t0);
        monitor.exited_after_abort(1, 41, vec![2, 3]);
        // Its process gone too (seen later): what it said first stands.
        monitor.process_exited(1, 41);
        monitor.process_exited(2, 42);
        let gone = monitor.poll(t0);
        assert_eq!(
            gone,
            vec![
                PeerFailure {
                    rank: 1,
                    cause: PeerFailureCause::Left {
                        reason: "its process (pid 41) exited after its group aborted".into(),
                        failed: vec![2, 3]
                    }
                },
                PeerFailure {
                    rank: 2,
                    cause: PeerFailureCause::Closed("its process (pid 42) exited".into())
                }
            ]
        );
        assert!(!gone[0].failed() && gone[1].failed());
    }

    #[tokio::test]
    async fn a_failed_link_wakes_the_watchdog_even_when_it_was_not_waiting_yet() {
        let shared = SharedMonitor::new(HeartbeatMonitor::new([1], WINDOW, Instant::now()));
        let closed = TransportError::Closed {
            peer: 1,
            reason: "reset".into(),
        };
        shared.link_failed(1, &closed);
        tokio::time::timeout(Duration::from_secs(10), shared.next_link_failure())
            .await
            .expect("the failure before the wait was kept");
        assert_eq!(shared.lock().poll(Instant::now())[0].rank, 1);
        let waiting = tokio::time::timeout(Duration::from_millis(50), shared.next_link_failure()).await;
        assert!(waiting.is_err(), "one failure wakes once");
    }

    #[test]
    fn without_heartbeats_only_closed_links_fail_peers() {
        let t0 = Instant::now();
        let mut monitor = HeartbeatMonitor::closures_only(1024, 5);
        assert!(monitor.poll(t0 + WINDOW * 100).is_empty(), "silence is no failure");
        let lost = TransportError::Closed {
            peer: 700,
            reason: "dropped".into(),
        };
        monitor.link_failed(700, &lost);
        monitor.link_failed(5, &lost);
        monitor.link_failed(1024, &lost);
        monitor.left(9);
        monitor.link_failed(9, &lost);
        let failed = monitor.poll(t0);
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert_eq!(failed[0].rank, 700);
        assert!(monitor.poll(t0).is_empty(), "reported once");
    }

    #[test]
    fn a_peer_that_left_is_no_longer_watched() {
        let t0 = Instant::now();
        let mut monitor = HeartbeatMonitor::new([1], WINDOW, t0);
        monitor.left(1);
        assert!(monitor.poll(t0 + WINDOW * 10).is_empty());
    }

    #[test]
    fn late_arrivals_never_move_the_clock_back() {
        let t0 = Instant::now();
        let mut monitor = HeartbeatMonitor::new([1], WINDOW, t0 + Duration::from_secs(2));
        monitor.arrived(1, t0);
        assert!(monitor.poll(t0 + Duration::from_secs(6)).is_empty());
    }

    #[test]
    fn small_windows_get_frequent_heartbeats() {
        assert_eq!(
            HeartbeatConfig::with_window(Duration::from_secs(5)).interval,
            Duration::from_secs(1)
        );
        assert_eq!(
            HeartbeatConfig::with_window(Duration::from_millis(600)).interval,
            Duration::from_millis(200)
        );
    }
}
