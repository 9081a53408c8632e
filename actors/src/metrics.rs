//! What a running group reports through the [`metrics`](https://docs.rs/metrics) facade. The library
//! installs no recorder: a service installs one (a Prometheus exporter, say;
//! `examples/service.rs`) before it forms groups, since each group registers
//! its handles when it forms (so the hot path only adds to them: no
//! allocation, no lookup per operation). Without a recorder every handle
//! is a no-op.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `chorus_collectives_started_total` | counter | `group`, `op` | operations the rank's actor took (each ends as completed or failed) |
//! | `chorus_collectives_completed_total` | counter | `group`, `op` | operations that ended well |
//! | `chorus_collectives_failed_total` | counter | `group`, `op` | operations that ended with an error (refused ones included) |
//! | `chorus_collective_duration_seconds` | histogram | `group`, `op` | time from start to end of each operation that completed |
//! | `chorus_bytes_sent_total` | counter | `group`, `transport` | payload bytes completed operations sent (`local`, `shm`, `quic`) |
//! | `chorus_bytes_received_total` | counter | `group`, `transport` | payload bytes completed operations received |
//! | `chorus_heartbeats_missed_total` | counter | `group` | heartbeat intervals a peer let pass without one (late or silent peers) |
//! | `chorus_aborts_total` | counter | `group`, `reason` | group aborts: `peer_failed`, `peer_left`, `operation_failed`, `overdue`, `shutdown` |
//! | `chorus_restarts_total` | counter | `group` | generations an elastic group re-formed after the first |
//! | `chorus_generation` | gauge | `group` | the generation this process's group is in |
//! | `chorus_world_size` | gauge | `group` | the ranks of that generation |
//!
//! `group` is the job's run id (`run_id/subN` for a subgroup); ranks of one
//! process in the same group share its series, so their counts add up. Each
//! operation also runs in a `tracing` span `collective` (level info) with
//! `rank`, `group`, `seq`, `op`, `bytes` and `algorithm`.

use chorus_runtime::collective::CollectiveKind;
use chorus_transports::link::TransportKind;
use metrics::{Counter, Histogram, SharedString, counter, gauge, histogram};

/// The counters and histogram of one operation kind in one group.
#[derive(Debug, Clone)]
pub struct OpMetrics {
    /// `chorus_collectives_started_total`.
    pub started: Counter,
    /// `chorus_collectives_completed_total`.
    pub completed: Counter,
    /// `chorus_collectives_failed_total`.
    pub failed: Counter,
    /// `chorus_collective_duration_seconds`.
    pub duration: Histogram,
}

/// The handles of one group, registered once when it forms.
#[derive(Debug, Clone)]
pub struct GroupMetrics {
    group: SharedString,
    ops: Vec<OpMetrics>,
    /// Sent and received, indexed by [`transport_index`].
    bytes: [(Counter, Counter); 3],
    heartbeats_missed: Counter,
}

/// The index of `kind` in per-transport arrays.
pub fn transport_index(kind: TransportKind) -> usize {
    match kind {
        TransportKind::Local => 0,
        TransportKind::Shm => 1,
        TransportKind::Quic => 2,
    }
}

const TRANSPORTS: [TransportKind; 3] = [TransportKind::Local, TransportKind::Shm, TransportKind::Quic];

impl GroupMetrics {
    /// Registers the handles of the group labelled `group`.
    pub fn new(group: &str) -> Self {
        let group = SharedString::from_owned(group.to_owned());
        let ops = CollectiveKind::ALL
            .iter()
            .map(|kind| {
                let labels = [("group", group.clone()), ("op", SharedString::const_str(kind.name()))];
                OpMetrics {
                    started: counter!("chorus_collectives_started_total", &labels),
                    completed: counter!("chorus_collectives_completed_total", &labels),
                    failed: counter!("chorus_collectives_failed_total", &labels),
                    duration: histogram!("chorus_collective_duration_seconds", &labels),
                }
            })
            .collect();
        let bytes = TRANSPORTS.map(|kind| {
            let labels = [
                ("group", group.clone()),
                ("transport", SharedString::const_str(transport_name(kind))),
            ];
            (
                counter!("chorus_bytes_sent_total", &labels),
                counter!("chorus_bytes_received_total", &labels),
            )
        });
        let heartbeats_missed = counter!("chorus_heartbeats_missed_total", "group" => group.clone());
        Self {
            group,
            ops,
            bytes,
            heartbeats_missed,
        }
    }

    /// The group label.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The handles of operations of `kind`.
    pub fn op(&self, kind: CollectiveKind) -> &OpMetrics {
        let index = CollectiveKind::ALL.iter().position(|&k| k == kind).unwrap_or(0);
        &self.ops[index]
    }

    /// Bytes sent and received, per transport ([`transport_index`]).
    pub fn all_bytes(&self) -> &[(Counter, Counter); 3] {
        &self.bytes
    }

    /// `chorus_heartbeats_missed_total`.
    pub fn heartbeats_missed(&self) -> &Counter {
        &self.heartbeats_missed
    }

    /// Counts an abort of this group (rare: registered on the spot).
    pub fn aborted(&self, reason: &'static str) {
        counter!("chorus_aborts_total", "group" => self.group.clone(), "reason" => reason).increment(1);
    }

    /// Sets the generation and world-size gauges.
    pub fn formed(&self, generation: u64, world_size: usize) {
        gauge!("chorus_generation", "group" => self.group.clone()).set(generation as f64);
        gauge!("chorus_world_size", "group" => self.group.clone()).set(world_size as f64);
    }
}

/// Counts a restart of the group labelled `group` (an elastic group re-formed).
pub fn count_restart(group: &str) {
    counter!("chorus_restarts_total", "group" => group.to_owned()).increment(1);
}

fn transport_name(kind: TransportKind) -> &'static str {
    match kind {
        TransportKind::Local => "local",
        TransportKind::Shm => "shm",
        TransportKind::Quic => "quic",
    }
}
