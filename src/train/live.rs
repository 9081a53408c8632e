//! Live progress for a dashboard (`chorus launch --dashboard`, `chorus
//! dashboard`): every process training through [`train`](super::train)
//! keeps a small record of its progress in the job's store, and carries out
//! the faults a holder of the job secret asks for there.
//!
//! Keys, under `chorus/<run id>/live/`:
//! - `count`: `add(1)` by each process; the result less one is its *slot*;
//! - `p/<slot>`: its [`LiveRecord`] (JSON: [`STEP_RING`] committed steps,
//!   one per [`STEP_SPACING_US`] and the newest, the last [`RECOVERY_RING`] recoveries with their phases, the
//!   last abort it saw), set at most every [`PUBLISH_EVERY`] when it
//!   changed and every [`HEARTBEAT_EVERY`] regardless, so its age is a
//!   heartbeat;
//! - `fault/<slot>`: a [`FaultRequest`], signed with the job secret, which
//!   the process carries out once (a request with a higher `seq`);
//! - `faults/count`, `faults/<i>`: the log of requested faults
//!   ([`FaultLogEntry`]), kept by the dashboard that asked.
//!
//! `chorus/live/run` holds the run id of the newest process to publish, for
//! a dashboard not told which run to show.
//!
//! Publishing never touches the training loop's path: the loop updates an
//! in-memory record (a `watch` channel), and a task of its own writes it.
//! A store that fails is logged once and retried; training goes on.
//! `CHORUS_LIVE=0` turns it off.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_runtime::store::Store;
use chorus_transports::auth::JobSecret;
use chorus_transports::process;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::integrity::StateTarget;
use super::record::unix_us;
use super::trainer::{Committed, Recovery};
use crate::group::ProcessGroup;

/// Committed steps a record keeps (the newest, sampled).
pub const STEP_RING: usize = 120;
/// The least time between two kept steps but the newest: a fast job's
/// record still spans [`STEP_RING`] times this (30 s).
pub const STEP_SPACING_US: i64 = 250_000;
/// Recoveries a record keeps (the newest).
pub const RECOVERY_RING: usize = 16;
/// Shortest interval between two writes of a changed record.
pub const PUBLISH_EVERY: Duration = Duration::from_millis(500);
/// Longest interval between two writes: the record's heartbeat.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
/// How long a frozen process ([`FaultKind::Freeze`]) stays stopped.
pub const FREEZE_FOR: Duration = Duration::from_secs(4);
/// How long a slow rank ([`FaultKind::Slow`]) stays slow.
pub const SLOW_FOR: Duration = Duration::from_secs(3);
/// The pause before each of a slow rank's steps.
pub const SLOW_STEP: Duration = Duration::from_millis(250);
/// The variable that turns publishing off (`0`).
pub const LIVE_ENV: &str = "CHORUS_LIVE";
/// The key naming the newest run that published.
pub const RUN_KEY: &str = "chorus/live/run";

/// The prefix of `run_id`'s live keys.
pub fn prefix(run_id: &str) -> String {
    format!("chorus/{run_id}/live")
}

/// The key of the counter that hands out slots.
pub fn count_key(run_id: &str) -> String {
    format!("{}/count", prefix(run_id))
}

/// The key of slot `slot`'s record.
pub fn record_key(run_id: &str, slot: u64) -> String {
    format!("{}/p/{slot}", prefix(run_id))
}

/// The key of slot `slot`'s fault request.
pub fn fault_key(run_id: &str, slot: u64) -> String {
    format!("{}/fault/{slot}", prefix(run_id))
}

/// The key of the fault log's counter.
pub fn fault_log_count_key(run_id: &str) -> String {
    format!("{}/faults/count", prefix(run_id))
}

/// The key of the fault log's entry `index`.
pub fn fault_log_key(run_id: &str, index: u64) -> String {
    format!("{}/faults/{index}", prefix(run_id))
}

/// What a process published about itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LiveRecord {
    /// Its slot (see the module docs).
    pub slot: u64,
    /// Its process id.
    pub pid: u32,
    /// Its host name.
    pub host: String,
    /// Its node's rank (`GROUP_RANK` from its launcher), if known.
    pub node: Option<usize>,
    /// The generation it is a member of (its last, while it recovers).
    pub generation: u64,
    /// Its rank there.
    pub rank: usize,
    /// Members of that generation.
    pub world_size: usize,
    /// Between a failure it saw and its first committed step after it.
    pub recovering: bool,
    /// The newest committed steps, oldest first.
    pub steps: VecDeque<LiveStep>,
    /// The newest recoveries, oldest first.
    pub recoveries: VecDeque<LiveRecovery>,
    /// The last abort of its group it saw.
    pub abort: Option<LiveAbort>,
    /// When it started publishing, microseconds since the Unix epoch.
    pub started_us: i64,
    /// When this record was written.
    pub updated_us: i64,
    /// [`secret_tag`] of its job secret, so a dashboard can tell that it
    /// holds the same one; `None` without a secret.
    pub secret_tag: Option<String>,
}

/// One committed step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LiveStep {
    /// The step (from 0).
    pub step: u64,
    /// Its mean loss; `None` when the loop did not report one (a torch
    /// script's loss is its own: `chorus.torch.Manager` does not see it).
    pub loss: Option<f64>,
    /// The generation it committed in.
    pub generation: u64,
    /// Members then.
    pub world_size: usize,
    /// When it committed, microseconds since the Unix epoch.
    pub at_us: i64,
}

/// One recovery and its phases, as [`Recovery`] measured it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LiveRecovery {
    /// The generation recovered into.
    pub generation: u64,
    /// Its members.
    pub world_size: usize,
    /// The step training resumed from.
    pub resumed_step: u64,
    /// When this process saw the failure, microseconds since the Unix epoch.
    pub failed_at_us: i64,
    /// From the failure seen to the new generation formed.
    pub reform_ms: f64,
    /// The state transfer.
    pub transfer_ms: f64,
    /// From the transfer to the first committed step.
    pub first_step_ms: f64,
}

/// An abort of the group, as the supervision of this rank found it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LiveAbort {
    /// The generation that aborted.
    pub generation: u64,
    /// This process's rank in it.
    pub rank: usize,
    /// Why (the abort reason: who failed, which operation ran over).
    pub reason: String,
    /// Its label (`peer_failed`, `peer_left`, `operation_failed`,
    /// `overdue`, `shutdown`).
    pub label: String,
    /// The ranks taken for failed.
    pub failed_ranks: Vec<usize>,
    /// When it was seen, microseconds since the Unix epoch.
    pub at_us: i64,
}

/// A fault a dashboard can inject into one process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL.
    Kill,
    /// SIGSTOP for [`FREEZE_FOR`], then SIGCONT: the others find it silent
    /// by heartbeat and go on (or wait for it); it rejoins when it wakes.
    Freeze,
    /// Every link of its group cut while it keeps running.
    CutOff,
    /// A pause of [`SLOW_STEP`] before each step for [`SLOW_FOR`]: a straggler.
    Slow,
    /// One bit of its parameters flipped at its next step: silent data
    /// corruption, for the members' state check to find.
    CorruptParams,
    /// One bit of its local gradient flipped at its next step, for the
    /// gradient check at the vote to find.
    CorruptGrads,
}

impl FaultKind {
    /// Every kind, in the order a page shows them.
    pub const ALL: [FaultKind; 6] = [
        FaultKind::Kill,
        FaultKind::Freeze,
        FaultKind::CutOff,
        FaultKind::Slow,
        FaultKind::CorruptParams,
        FaultKind::CorruptGrads,
    ];

    /// Its name in requests and logs.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Freeze => "freeze",
            FaultKind::CutOff => "cut_off",
            FaultKind::Slow => "slow",
            FaultKind::CorruptParams => "corrupt_params",
            FaultKind::CorruptGrads => "corrupt_grads",
        }
    }

    /// The kind named `name` ([`FaultKind::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// A request to a process to inject a fault into itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultRequest {
    /// Higher than any earlier request to the same slot.
    pub seq: u64,
    /// The process it is for (a slot's process never changes; this guards
    /// against a record read before a relaunch).
    pub pid: u32,
    /// What to do.
    pub kind: FaultKind,
    /// Who asked, for the log.
    pub who: String,
    /// HMAC-SHA256 of [`FaultRequest::message`] with the job secret, hex.
    pub tag: String,
}

impl FaultRequest {
    /// A request signed with `secret`.
    pub fn signed(
        secret: &JobSecret,
        run_id: &str,
        slot: u64,
        seq: u64,
        pid: u32,
        kind: FaultKind,
        who: String,
    ) -> Self {
        let tag = hex(&secret.sign(Self::message(run_id, slot, seq, pid, kind).as_bytes()));
        Self {
            seq,
            pid,
            kind,
            who,
            tag,
        }
    }

    /// What the tag signs: the run, slot, sequence number, process and kind.
    pub fn message(run_id: &str, slot: u64, seq: u64, pid: u32, kind: FaultKind) -> String {
        format!("chorus live fault|{run_id}|{slot}|{seq}|{pid}|{}", kind.name())
    }

    /// Whether `secret` signed this request for `slot` of `run_id`.
    pub fn verify(&self, secret: &JobSecret, run_id: &str, slot: u64) -> bool {
        unhex(&self.tag).is_some_and(|tag| {
            secret.verify(
                Self::message(run_id, slot, self.seq, self.pid, self.kind).as_bytes(),
                &tag,
            )
        })
    }
}

/// One requested fault, as the dashboard that asked logged it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultLogEntry {
    /// When it was asked for, microseconds since the Unix epoch.
    pub at_us: i64,
    /// What.
    pub kind: FaultKind,
    /// The rank it was for, in `generation`.
    pub rank: usize,
    /// The generation the rank was named in.
    pub generation: u64,
    /// The process.
    pub pid: u32,
    /// Its host.
    pub host: String,
    /// Who asked (the client's address and the name it gave).
    pub who: String,
}

/// The tag of a job secret that a record carries: HMAC of a fixed message
/// under `run_id`, hex. Equal tags mean equal secrets; the tag tells nothing
/// else about the secret.
pub fn secret_tag(secret: &JobSecret, run_id: &str) -> String {
    hex(&secret.sign(format!("chorus live secret|{run_id}").as_bytes()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Adds `step` to `steps`: it replaces the newest unless that one is kept
/// (spaced from its predecessor by [`STEP_SPACING_US`], or of another
/// generation); the oldest goes past [`STEP_RING`].
fn keep_step(steps: &mut VecDeque<LiveStep>, step: LiveStep) {
    let n = steps.len();
    let replace = n >= 2 && {
        let (before, last) = (&steps[n - 2], &steps[n - 1]);
        last.at_us - before.at_us < STEP_SPACING_US && last.generation == step.generation
    };
    if replace {
        steps[n - 1] = step;
    } else {
        if n == STEP_RING {
            steps.pop_front();
        }
        steps.push_back(step);
    }
}

/// This process's publisher: the record the loop updates and the task
/// that writes it (stopped when dropped).
pub(crate) struct Live {
    record: watch::Sender<LiveRecord>,
    /// Until when (Unix microseconds) steps are slowed; 0 when not.
    slow_until: Arc<AtomicI64>,
    /// A corruption asked for and not yet carried out.
    corrupt: Arc<Mutex<Option<StateTarget>>>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live")
            .field("record", &*self.record.borrow())
            .finish_non_exhaustive()
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Live {
    /// Starts publishing for the process training on `group`, unless
    /// `CHORUS_LIVE=0`.
    pub(crate) fn start(group: &crate::elastic::ElasticGroup) -> Option<Self> {
        if std::env::var(LIVE_ENV).is_ok_and(|v| v.trim() == "0") {
            return None;
        }
        let (store, run_id) = group.job_store();
        let secret = std::env::var("CHORUS_JOB_SECRET")
            .ok()
            .filter(|s| !s.is_empty())
            .map(|s| JobSecret::new(s.as_bytes()));
        let pg = group.current();
        let now = unix_us();
        let (record, watched) = watch::channel(LiveRecord {
            slot: 0,
            pid: std::process::id(),
            host: chorus_runtime::rendezvous::HostId::local().hostname,
            node: std::env::var("GROUP_RANK").ok().and_then(|v| v.trim().parse().ok()),
            generation: pg.generation(),
            rank: pg.rank(),
            world_size: pg.world_size(),
            recovering: false,
            steps: VecDeque::new(),
            recoveries: VecDeque::new(),
            abort: None,
            started_us: now,
            updated_us: now,
            secret_tag: secret.as_ref().map(|s| secret_tag(s, run_id)),
        });
        let slow_until = Arc::new(AtomicI64::new(0));
        let corrupt = Arc::new(Mutex::new(None));
        let publisher = Publisher {
            store: store.clone(),
            run_id: run_id.to_string(),
            secret,
            record: watched,
            groups: group.generations(),
            slow_until: slow_until.clone(),
            corrupt: corrupt.clone(),
            warned: false,
            seen_seq: 0,
        };
        Some(Self {
            record,
            slow_until,
            corrupt,
            task: tokio::spawn(publisher.run()),
        })
    }

    /// A step committed here, as rank `rank`.
    pub(crate) fn committed(&self, committed: &Committed, rank: usize) {
        self.record.send_modify(|r| {
            r.generation = committed.generation;
            r.rank = rank;
            r.world_size = committed.world_size;
            r.recovering = false;
            let step = LiveStep {
                step: committed.step,
                loss: committed.loss.is_finite().then_some(committed.loss),
                generation: committed.generation,
                world_size: committed.world_size,
                at_us: unix_us(),
            };
            keep_step(&mut r.steps, step);
        });
    }

    /// The group `pg` failed under this process's step.
    pub(crate) fn failed(&self, pg: &ProcessGroup) {
        let abort = pg.failures().borrow().clone().map(|a| LiveAbort {
            generation: a.generation,
            rank: a.rank,
            reason: a.reason.to_string(),
            label: a.reason.label().to_string(),
            failed_ranks: a.failed_ranks,
            at_us: unix_us(),
        });
        self.record.send_modify(|r| {
            r.recovering = true;
            if abort.is_some() {
                r.abort = abort;
            }
        });
    }

    /// A recovery ended with a committed step.
    pub(crate) fn recovered(&self, recovery: &Recovery) {
        let at_us = recovery
            .first_step_at
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        self.record.send_modify(|r| {
            if r.recoveries.len() == RECOVERY_RING {
                r.recoveries.pop_front();
            }
            r.recoveries.push_back(LiveRecovery {
                generation: recovery.generation,
                world_size: recovery.world_size,
                resumed_step: recovery.resumed_step,
                failed_at_us: at_us - recovery.total().as_micros() as i64,
                reform_ms: ms(recovery.rendezvous),
                transfer_ms: ms(recovery.transfer),
                first_step_ms: ms(recovery.first_step),
            });
        });
    }

    /// The pause before the next step: [`SLOW_STEP`] while a slow fault
    /// lasts.
    pub(crate) fn slowdown(&self) -> Option<Duration> {
        (self.slow_until.load(Ordering::Relaxed) > unix_us()).then_some(SLOW_STEP)
    }

    /// A corruption asked for, to carry out at this step (once).
    pub(crate) fn take_corruption(&self) -> Option<StateTarget> {
        self.corrupt.lock().expect("not poisoned").take()
    }
}

/// The task writing a process's record and reading its fault requests.
struct Publisher {
    store: Arc<dyn Store>,
    run_id: String,
    secret: Option<JobSecret>,
    record: watch::Receiver<LiveRecord>,
    groups: watch::Receiver<Arc<ProcessGroup>>,
    slow_until: Arc<AtomicI64>,
    corrupt: Arc<Mutex<Option<StateTarget>>>,
    /// Whether a store failure was logged already (once is enough).
    warned: bool,
    /// The newest fault request carried out.
    seen_seq: u64,
}

impl Publisher {
    async fn run(mut self) {
        let slot = loop {
            match self.store.add(&count_key(&self.run_id), 1).await {
                Ok(n) => break (n - 1).max(0) as u64,
                Err(e) => self.store_failed(&e),
            }
            tokio::time::sleep(HEARTBEAT_EVERY).await;
        };
        if let Err(e) = self.store.set(RUN_KEY, self.run_id.as_bytes()).await {
            self.store_failed(&e);
        }
        let mut last_write: Option<tokio::time::Instant> = None;
        let mut tick = tokio::time::interval(PUBLISH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let changed = self.record.has_changed().unwrap_or(false);
            if changed || last_write.is_none_or(|t| t.elapsed() >= HEARTBEAT_EVERY) {
                let mut record = self.record.borrow_and_update().clone();
                record.slot = slot;
                record.updated_us = unix_us();
                let bytes = serde_json::to_vec(&record).expect("a record serializes");
                match self.store.set(&record_key(&self.run_id, slot), &bytes).await {
                    Ok(()) => last_write = Some(tokio::time::Instant::now()),
                    Err(e) => self.store_failed(&e),
                }
            }
            self.poll_fault(slot).await;
        }
    }

    fn store_failed(&mut self, error: &chorus_runtime::store::StoreError) {
        if !std::mem::replace(&mut self.warned, true) {
            tracing::warn!(target: "chorus::train::live", error = %error, "cannot publish live progress to the store; training goes on");
        }
    }

    /// Carries out a new, correctly signed fault request for `slot`.
    async fn poll_fault(&mut self, slot: u64) {
        let key = fault_key(&self.run_id, slot);
        let bytes = match self.store.check(&[&key]).await {
            Ok(true) => match self.store.get(&key).await {
                Ok(bytes) => bytes,
                Err(e) => return self.store_failed(&e),
            },
            Ok(false) => return,
            Err(e) => return self.store_failed(&e),
        };
        let Ok(request) = serde_json::from_slice::<FaultRequest>(&bytes) else {
            return;
        };
        if request.seq <= self.seen_seq {
            return;
        }
        self.seen_seq = request.seq;
        let signed = self
            .secret
            .as_ref()
            .is_some_and(|s| request.verify(s, &self.run_id, slot));
        if !signed || request.pid != std::process::id() {
            tracing::warn!(target: "chorus::train::live", seq = request.seq, who = %request.who, "ignoring a fault request not signed with this job's secret");
            return;
        }
        tracing::warn!(target: "chorus::train::live", kind = request.kind.name(), who = %request.who, "injecting a fault asked for from a dashboard");
        match request.kind {
            FaultKind::Kill => process::signal_self(process::Signal::SIGKILL),
            FaultKind::Freeze => freeze(),
            FaultKind::CutOff => self.groups.borrow().cut_links("cut off from a dashboard"),
            FaultKind::Slow => {
                self.slow_until
                    .store(unix_us() + SLOW_FOR.as_micros() as i64, Ordering::Relaxed);
            }
            FaultKind::CorruptParams => *self.corrupt.lock().expect("not poisoned") = Some(StateTarget::Params),
            FaultKind::CorruptGrads => *self.corrupt.lock().expect("not poisoned") = Some(StateTarget::Grads),
        }
    }
}

/// Stops this process for [`FREEZE_FOR`]: a helper process, started
/// first, continues it (a stopped process cannot).
fn freeze() {
    let pid = std::process::id();
    let helper = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("sleep {}; kill -CONT {pid}", FREEZE_FOR.as_secs()))
        .spawn();
    match helper {
        Ok(mut helper) => {
            // Reaped once it ends (after this process continues).
            std::thread::spawn(move || helper.wait());
            process::signal_self(process::Signal::SIGSTOP);
        }
        Err(e) => {
            tracing::warn!(target: "chorus::train::live", error = %e, "cannot start the helper that would continue this process; not freezing it");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_request_verifies_only_under_its_secret_run_slot_and_fields() {
        let secret = JobSecret::new(b"s3cret");
        let request = FaultRequest::signed(&secret, "run", 2, 5, 42, FaultKind::Kill, "me".into());
        assert!(request.verify(&secret, "run", 2));
        assert!(!request.verify(&JobSecret::new(b"other"), "run", 2));
        assert!(!request.verify(&secret, "run", 3));
        assert!(!request.verify(&secret, "other", 2));
        let mut changed = request.clone();
        changed.kind = FaultKind::Freeze;
        assert!(!changed.verify(&secret, "run", 2));
        changed = request.clone();
        changed.tag = "zz".into();
        assert!(!changed.verify(&secret, "run", 2));
    }

    #[test]
    fn kept_steps_are_spaced_bounded_and_end_with_the_newest() {
        let mut steps = VecDeque::new();
        // A step every millisecond for 60 s.
        for i in 0..60_000u64 {
            let step = LiveStep {
                step: i,
                loss: Some(0.0),
                generation: u64::from(i >= 30_000),
                world_size: 2,
                at_us: i as i64 * 1000,
            };
            keep_step(&mut steps, step);
        }
        assert_eq!(steps.len(), STEP_RING);
        assert_eq!(steps.back().unwrap().step, 59_999);
        let spaced = steps
            .iter()
            .zip(steps.iter().skip(1))
            .take(STEP_RING - 2)
            .all(|(a, b)| b.at_us - a.at_us >= STEP_SPACING_US);
        assert!(spaced);
        assert!(steps.front().unwrap().at_us <= 60_000_000 - (STEP_RING as i64 - 2) * STEP_SPACING_US);
    }

    #[test]
    fn fault_kinds_round_trip_by_name() {
        for kind in FaultKind::ALL {
            assert_eq!(FaultKind::from_name(kind.name()), Some(kind));
        }
        assert_eq!(FaultKind::from_name("explode"), None);
    }

    #[test]
    fn secret_tags_tell_secrets_apart() {
        let a = secret_tag(&JobSecret::new(b"a"), "run");
        assert_eq!(a, secret_tag(&JobSecret::new(b"a"), "run"));
        assert_ne!(a, secret_tag(&JobSecret::new(b"b"), "run"));
    }
}
