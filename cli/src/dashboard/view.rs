//! The page's data, sans IO: what was read from the store ([`Observed`])
//! becomes the members, the generation timeline with each re-form's cause
//! and recovery phases, the committed steps and the findings ([`JobView`]).

use std::collections::{BTreeMap, HashMap};

use chorus::train::live::{FaultKind, FaultLogEntry, LiveAbort, LiveRecord};
pub use chorus::train::observe::{Generation, Observed, Process};
use serde::Serialize;

/// A record not rewritten for this long belongs to a process that stopped
/// (its heartbeat is [`chorus::train::live::HEARTBEAT_EVERY`]).
pub const SILENT_AFTER_US: i64 = 5_000_000;

/// Steps over which the step rate is measured.
const RATE_WINDOW: usize = 20;

/// What a member is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberState {
    /// A member of the newest generation, committing steps.
    Training,
    /// Between a failure it saw and its next committed step.
    Recovering,
    /// Alive but in no formed generation yet (waiting to join).
    Standby,
    /// No longer part of the job.
    Gone,
}

/// Why a member left or a generation re-formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// Killed (a fault asked for, or its exit published by its launcher).
    Killed,
    /// Stopped (SIGSTOP): silent.
    Frozen,
    /// Its links cut.
    CutOff,
    /// A new process came in.
    Joined,
    /// An operation broke the group (a damaged or mismatched frame).
    Corrupted,
    /// It stopped answering, for no recorded reason.
    Silent,
    /// The job finished.
    Finished,
}

impl Cause {
    /// Its words on the page.
    pub fn text(self) -> &'static str {
        match self {
            Cause::Killed => "killed",
            Cause::Frozen => "frozen",
            Cause::CutOff => "cut off",
            Cause::Joined => "joined",
            Cause::Corrupted => "corrupted",
            Cause::Silent => "silent",
            Cause::Finished => "finished",
        }
    }
}

/// One member of the job.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemberView {
    /// Its rank in the newest generation it belongs to.
    pub rank: Option<usize>,
    /// That generation.
    pub generation: Option<u64>,
    /// Its node's rank, if known.
    pub node: Option<usize>,
    /// Its host and process.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// What it does.
    pub state: MemberState,
    /// Why it is gone.
    pub cause: Option<Cause>,
    /// Since its record was last written, milliseconds; `None` without a record.
    pub heartbeat_age_ms: Option<f64>,
    /// Its newest committed step.
    pub last_step: Option<u64>,
}

/// What happened to one rank of the previous generation, or who joined.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Change {
    /// The cause.
    pub cause: Cause,
    /// Its rank in the previous generation (`None` for a joiner).
    pub rank: Option<usize>,
    /// The process.
    pub process: Process,
}

/// One recovery's phases, milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Phases {
    /// From the fault asked for to the failure seen (`None` when no fault
    /// was asked for from a dashboard: nothing to measure from).
    pub detect_ms: Option<f64>,
    /// From the failure seen to the new generation formed.
    pub reform_ms: f64,
    /// The state transfer.
    pub transfer_ms: f64,
    /// From the transfer to the first committed step.
    pub first_step_ms: f64,
}

impl Phases {
    /// Every phase together.
    pub fn total_ms(&self) -> f64 {
        self.detect_ms.unwrap_or(0.0) + self.reform_ms + self.transfer_ms + self.first_step_ms
    }
}

/// One generation on the timeline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GenerationView {
    /// Its number.
    pub generation: u64,
    /// Its members.
    pub world_size: usize,
    /// Why it formed: who left (or was hit by a fault and came back) and
    /// who joined since the previous one (empty for the first, and for a
    /// re-form with the same members for no recorded reason).
    pub changes: Vec<Change>,
    /// The recovery into it (the slowest member's), when one was recorded.
    pub recovery: Option<Phases>,
    /// When it started training, microseconds since the Unix epoch.
    pub started_us: Option<i64>,
}

/// One committed step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepPoint {
    /// The step.
    pub step: u64,
    /// Its loss, when the loop reported one.
    pub loss: Option<f64>,
    /// Its generation.
    pub generation: u64,
    /// When it committed.
    pub at_us: i64,
}

/// A failure to mark on the step chart: the first step committed after it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FailureMark {
    /// The step.
    pub step: u64,
    /// What (a fault asked for, or a generation's cause).
    pub what: String,
}

/// The page's data.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobView {
    /// The run.
    pub run_id: String,
    /// When it was read.
    pub now_us: i64,
    /// Whether the job finished.
    pub finished: bool,
    /// Members of the newest generation by rank, then the others.
    pub members: Vec<MemberView>,
    /// The generations, ascending.
    pub generations: Vec<GenerationView>,
    /// Committed steps, ascending.
    pub steps: Vec<StepPoint>,
    /// Steps per second over the newest steps.
    pub step_rate: Option<f64>,
    /// Failures on the step chart.
    pub failures: Vec<FailureMark>,
    /// Each generation's first abort report (the one closest to the
    /// cause: later ones follow it), newest generation first.
    pub findings: Vec<LiveAbort>,
    /// Faults asked for, oldest first.
    pub faults: Vec<FaultLogEntry>,
}

impl JobView {
    /// The newest generation's members, by rank.
    pub fn ranks(&self) -> impl Iterator<Item = &MemberView> {
        let newest = self.generations.last().map(|g| g.generation);
        self.members
            .iter()
            .filter(move |m| m.generation.is_some() && m.generation == newest && m.state != MemberState::Gone)
    }
}

fn process_of(record: &LiveRecord) -> Process {
    Process {
        host: record.host.clone(),
        pid: record.pid,
    }
}

/// Builds the page's data from what was read.
pub fn build(observed: &Observed) -> JobView {
    let lookup = Lookup::new(observed);
    let generations = lookup.timeline();
    let members = lookup.members();
    let steps = committed_steps(&observed.records);
    let step_rate = rate(&steps);
    let failures = lookup.failures(&steps, &generations);
    JobView {
        run_id: observed.run_id.clone(),
        now_us: observed.now_us,
        finished: observed.finished,
        members,
        generations,
        steps,
        step_rate,
        failures,
        findings: first_aborts(&observed.records),
        faults: observed.faults.clone(),
    }
}

/// What the page's parts are read from: the observation, with each
/// process's record and the fault asked for against it at hand.
struct Lookup<'a> {
    observed: &'a Observed,
    records: HashMap<Process, &'a LiveRecord>,
    faulted: HashMap<Process, &'a FaultLogEntry>,
}

impl<'a> Lookup<'a> {
    fn new(observed: &'a Observed) -> Self {
        let records = observed.records.iter().map(|r| (process_of(r), r)).collect();
        let faulted = observed
            .faults
            .iter()
            .map(|f| {
                let process = Process {
                    host: f.host.clone(),
                    pid: f.pid,
                };
                (process, f)
            })
            .collect();
        Self {
            observed,
            records,
            faulted,
        }
    }

    /// Whether `p` wrote no record lately (or none at all).
    fn silent(&self, p: &Process) -> bool {
        self.records
            .get(p)
            .is_none_or(|r| self.observed.now_us - r.updated_us > SILENT_AFTER_US)
    }

    /// Why `p` is gone, when it is.
    fn gone_cause(&self, p: &Process) -> Option<Cause> {
        let exited = self.observed.exited.contains(p);
        if !exited && !self.silent(p) {
            return None;
        }
        Some(match self.faulted.get(p).map(|f| f.kind) {
            Some(FaultKind::Kill) => Cause::Killed,
            Some(FaultKind::Freeze) => Cause::Frozen,
            Some(FaultKind::CutOff) => Cause::CutOff,
            _ if self.observed.finished => Cause::Finished,
            _ if exited => Cause::Killed,
            _ => Cause::Silent,
        })
    }

    /// Every process once: the generations' members, newest generation
    /// first, then those with a record in none (standing by, or gone);
    /// sorted with the newest generation's by rank first and the gone last.
    fn members(&self) -> Vec<MemberView> {
        let observed = self.observed;
        let mut members = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for g in observed.generations.iter().rev() {
            for (rank, p) in g.members.iter().enumerate() {
                if seen.insert(p.clone()) {
                    let record = self.records.get(p).copied();
                    members.push(self.member(p, Some((rank, g.generation)), record));
                }
            }
        }
        for record in &observed.records {
            let p = process_of(record);
            if seen.insert(p.clone()) {
                members.push(self.member(&p, None, Some(record)));
            }
        }
        members.sort_by_key(|m| {
            (
                m.state == MemberState::Gone,
                std::cmp::Reverse(m.generation),
                m.rank,
                m.pid,
            )
        });
        members
    }

    /// `p`'s row: at `place` (its rank in a generation), or in none
    /// (standing by, or gone); `record`: its live record, if any.
    fn member(&self, p: &Process, place: Option<(usize, u64)>, record: Option<&LiveRecord>) -> MemberView {
        let cause = self.gone_cause(p);
        let newest = self.observed.generations.last().map(|g| g.generation);
        let state = match (cause, place, record) {
            (Some(_), ..) => MemberState::Gone,
            (None, None, _) => MemberState::Standby,
            (None, Some((_, generation)), _) if Some(generation) != newest => MemberState::Recovering,
            (None, _, Some(r)) if r.recovering => MemberState::Recovering,
            (None, ..) => MemberState::Training,
        };
        MemberView {
            rank: place.map(|(rank, _)| rank),
            generation: place.map(|(_, generation)| generation),
            node: record.and_then(|r| r.node),
            host: p.host.clone(),
            pid: p.pid,
            state,
            cause,
            heartbeat_age_ms: record.map(|r| (self.observed.now_us - r.updated_us).max(0) as f64 / 1e3),
            last_step: record.and_then(|r| r.steps.back()).map(|s| s.step),
        }
    }

    /// The step chart's marks: each fault asked for, then each re-form
    /// for another reason, at the first step committed after it.
    fn failures(&self, steps: &[StepPoint], generations: &[GenerationView]) -> Vec<FailureMark> {
        let mut failures: Vec<FailureMark> = self
            .observed
            .faults
            .iter()
            .filter_map(|f| {
                let step = steps.iter().find(|s| s.at_us >= f.at_us)?.step;
                Some(FailureMark {
                    step,
                    what: format!("{} rank {}", f.kind.name(), f.rank),
                })
            })
            .collect();
        for g in generations {
            let left: Vec<&Change> = g.changes.iter().filter(|c| c.cause != Cause::Joined).collect();
            // A fault asked for is marked already, where it was asked for.
            if left.is_empty() || left.iter().any(|c| self.faulted.contains_key(&c.process)) {
                continue;
            }
            if let Some(first) = steps.iter().find(|s| s.generation == g.generation) {
                failures.push(FailureMark {
                    step: first.step,
                    what: format!(
                        "g{}: rank {} {}",
                        g.generation,
                        left[0].rank.unwrap_or(0),
                        left[0].cause.text()
                    ),
                });
            }
        }
        failures.sort_by_key(|f| f.step);
        failures
    }

    /// The generations with their causes and recoveries.
    fn timeline(&self) -> Vec<GenerationView> {
        let generations = &self.observed.generations;
        let mut out: Vec<GenerationView> = Vec::new();
        for (i, g) in generations.iter().enumerate() {
            // Only a generation that follows its predecessor directly is compared with it.
            let previous = i
                .checked_sub(1)
                .map(|j| &generations[j])
                .filter(|p| p.generation + 1 == g.generation);
            let changes = previous.map_or_else(Vec::new, |previous| self.changes(previous, g));
            let recovery = self.recovery(g, &changes);
            let started_us = self
                .observed
                .records
                .iter()
                .flat_map(|r| r.steps.iter())
                .filter(|s| s.generation == g.generation)
                .map(|s| s.at_us)
                .min();
            out.push(GenerationView {
                generation: g.generation,
                world_size: g.members.len(),
                changes,
                recovery,
                started_us,
            });
        }
        out
    }

    /// Who left `previous` (and why), who was hit by a fault there and came
    /// back into `g`, and who joined `g`.
    fn changes(&self, previous: &Generation, g: &Generation) -> Vec<Change> {
        let observed = self.observed;
        let mut changes = Vec::new();
        // An operation failure reported by a survivor marks the ranks it blamed corrupted.
        let corrupted = observed
            .records
            .iter()
            .filter_map(|r| r.abort.as_ref())
            .any(|a| a.generation == previous.generation && a.label == "operation_failed");
        for (rank, p) in previous.members.iter().enumerate() {
            if g.members.contains(p) {
                continue;
            }
            let cause = match self.faulted.get(p).map(|f| f.kind) {
                Some(FaultKind::Kill) => Cause::Killed,
                Some(FaultKind::Freeze) => Cause::Frozen,
                Some(FaultKind::CutOff) => Cause::CutOff,
                _ if corrupted => Cause::Corrupted,
                _ => self.gone_cause(p).unwrap_or(Cause::Silent),
            };
            changes.push(Change {
                cause,
                rank: Some(rank),
                process: p.clone(),
            });
        }
        // A member frozen or cut off that came back into g: the fault asked for is the cause.
        for f in observed.faults.iter().filter(|f| f.generation == previous.generation) {
            let p = Process {
                host: f.host.clone(),
                pid: f.pid,
            };
            let cause = match f.kind {
                FaultKind::Kill => Cause::Killed,
                FaultKind::Freeze => Cause::Frozen,
                FaultKind::CutOff => Cause::CutOff,
                // The member stays: healed in place, no generation changes.
                FaultKind::Slow | FaultKind::CorruptParams | FaultKind::CorruptGrads => continue,
            };
            if previous.members.contains(&p) && !changes.iter().any(|c| c.process == p) {
                changes.push(Change {
                    cause,
                    rank: Some(f.rank),
                    process: p,
                });
            }
        }
        for p in g.members.iter().filter(|p| !previous.members.contains(p)) {
            changes.push(Change {
                cause: Cause::Joined,
                rank: None,
                process: p.clone(),
            });
        }
        changes
    }

    /// The slowest member's recovery into `g` is the group's; its detection
    /// counts from the latest fault asked for against a changed member.
    fn recovery(&self, g: &Generation, changes: &[Change]) -> Option<Phases> {
        let recovery = g
            .members
            .iter()
            .filter_map(|p| self.records.get(p))
            .filter_map(|r| r.recoveries.iter().find(|rc| rc.generation == g.generation))
            .max_by(|a, b| {
                let end = |r: &chorus::train::live::LiveRecovery| r.reform_ms + r.transfer_ms + r.first_step_ms;
                end(a).total_cmp(&end(b))
            });
        recovery.map(|r| {
            let fault = changes
                .iter()
                .filter_map(|c| self.faulted.get(&c.process))
                .map(|f| f.at_us)
                .filter(|&at| at <= r.failed_at_us)
                .max();
            Phases {
                detect_ms: fault.map(|at| (r.failed_at_us - at) as f64 / 1e3),
                reform_ms: r.reform_ms,
                transfer_ms: r.transfer_ms,
                first_step_ms: r.first_step_ms,
            }
        })
    }
}

/// Each generation's first abort report (the one closest to the cause),
/// newest generation first.
fn first_aborts(records: &[LiveRecord]) -> Vec<LiveAbort> {
    let mut first_abort: BTreeMap<u64, LiveAbort> = BTreeMap::new();
    for abort in records.iter().filter_map(|r| r.abort.as_ref()) {
        first_abort
            .entry(abort.generation)
            .and_modify(|f| {
                if abort.at_us < f.at_us {
                    *f = abort.clone();
                }
            })
            .or_insert_with(|| abort.clone());
    }
    first_abort.into_values().rev().collect()
}

/// Every committed step any record holds, once each (members agree on a
/// step's loss), ascending.
fn committed_steps(records: &[LiveRecord]) -> Vec<StepPoint> {
    let mut steps: BTreeMap<u64, StepPoint> = BTreeMap::new();
    for s in records.iter().flat_map(|r| r.steps.iter()) {
        let point = StepPoint {
            step: s.step,
            loss: s.loss,
            generation: s.generation,
            at_us: s.at_us,
        };
        steps
            .entry(s.step)
            .and_modify(|p| {
                // The first member to commit it dates it.
                if point.at_us < p.at_us {
                    *p = point.clone();
                }
            })
            .or_insert(point);
    }
    steps.into_values().collect()
}

fn rate(steps: &[StepPoint]) -> Option<f64> {
    let window = &steps[steps.len().saturating_sub(RATE_WINDOW)..];
    let (first, last) = (window.first()?, window.last()?);
    let seconds = (last.at_us - first.at_us) as f64 / 1e6;
    (seconds > 0.0).then(|| (last.step - first.step) as f64 / seconds)
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use chorus::train::live::{LiveAbort, LiveRecovery, LiveStep};

    use super::*;

    fn p(pid: u32) -> Process {
        Process { host: "h".into(), pid }
    }

    fn record(pid: u32, generation: u64, rank: usize, steps: &[(u64, i64)], updated_us: i64) -> LiveRecord {
        LiveRecord {
            slot: u64::from(pid),
            pid,
            host: "h".into(),
            node: Some(0),
            generation,
            rank,
            world_size: 3,
            recovering: false,
            steps: steps
                .iter()
                .map(|&(step, at_us)| LiveStep {
                    step,
                    loss: Some(1.0 / (step + 1) as f64),
                    generation: if step < 10 { 0 } else { 1 },
                    world_size: 3,
                    at_us,
                })
                .collect::<VecDeque<_>>(),
            recoveries: VecDeque::new(),
            abort: None,
            started_us: 0,
            updated_us,
            secret_tag: None,
        }
    }

    /// Three ranks; pid 12 (rank 2) killed from a dashboard at 9.5 s; a
    /// relaunched pid 13 joins generation 1; one step a second.
    fn killed_and_replaced() -> Observed {
        let now = 20_000_000;
        let steps: Vec<(u64, i64)> = (0..15).map(|s| (s, s as i64 * 1_000_000)).collect();
        let mut r0 = record(10, 1, 0, &steps, now - 100_000);
        r0.recoveries.push_back(LiveRecovery {
            generation: 1,
            world_size: 3,
            resumed_step: 10,
            failed_at_us: 9_700_000,
            reform_ms: 300.0,
            transfer_ms: 50.0,
            first_step_ms: 20.0,
        });
        r0.abort = Some(LiveAbort {
            generation: 0,
            rank: 0,
            reason: "rank 2 failed: connection lost".into(),
            label: "peer_failed".into(),
            failed_ranks: vec![2],
            at_us: 9_700_000,
        });
        let mut r1 = record(11, 1, 1, &steps, now - 200_000);
        r1.recoveries = r0.recoveries.clone();
        r1.recoveries[0].reform_ms = 400.0;
        let r2 = record(12, 0, 2, &steps[..10], 9_400_000);
        let r3 = record(13, 1, 2, &steps[10..], now - 300_000);
        Observed {
            now_us: now,
            run_id: "run".into(),
            generations: vec![
                Generation {
                    generation: 0,
                    members: vec![p(10), p(11), p(12)],
                },
                Generation {
                    generation: 1,
                    members: vec![p(10), p(11), p(13)],
                },
            ],
            records: vec![r0, r1, r2, r3],
            exited: vec![p(12)],
            faults: vec![FaultLogEntry {
                at_us: 9_500_000,
                kind: FaultKind::Kill,
                rank: 2,
                generation: 0,
                pid: 12,
                host: "h".into(),
                who: "127.0.0.1:5 (test)".into(),
            }],
            finished: false,
        }
    }

    #[test]
    fn a_kill_from_the_page_shows_as_a_re_form_with_its_cause_and_phases() {
        let view = build(&killed_and_replaced());
        assert_eq!(view.generations.len(), 2);
        assert!(view.generations[0].changes.is_empty());
        let g1 = &view.generations[1];
        assert_eq!(
            g1.changes,
            vec![
                Change {
                    cause: Cause::Killed,
                    rank: Some(2),
                    process: p(12)
                },
                Change {
                    cause: Cause::Joined,
                    rank: None,
                    process: p(13)
                },
            ]
        );
        // The slowest member's recovery, detection measured from the fault asked for.
        let phases = g1.recovery.as_ref().expect("a recovery");
        assert_eq!(phases.reform_ms, 400.0);
        assert_eq!(phases.detect_ms, Some(200.0));
        assert_eq!(phases.total_ms(), 200.0 + 400.0 + 50.0 + 20.0);
        assert_eq!(g1.started_us, Some(10_000_000));
        // Marked once, at the first step after the fault was asked for.
        assert_eq!(view.failures.len(), 1);
        assert_eq!(view.failures[0].step, 10);
        assert_eq!(view.findings[0].failed_ranks, vec![2]);
    }

    #[test]
    fn members_are_the_newest_generation_by_rank_then_the_gone_with_their_cause() {
        let view = build(&killed_and_replaced());
        let summary: Vec<(Option<usize>, u32, MemberState, Option<Cause>)> =
            view.members.iter().map(|m| (m.rank, m.pid, m.state, m.cause)).collect();
        assert_eq!(
            summary,
            vec![
                (Some(0), 10, MemberState::Training, None),
                (Some(1), 11, MemberState::Training, None),
                (Some(2), 13, MemberState::Training, None),
                (Some(2), 12, MemberState::Gone, Some(Cause::Killed)),
            ]
        );
        assert_eq!(view.members[0].heartbeat_age_ms, Some(100.0));
        assert_eq!(view.ranks().count(), 3);
    }

    #[test]
    fn steps_are_merged_once_each_and_the_rate_is_measured() {
        let view = build(&killed_and_replaced());
        let steps: Vec<u64> = view.steps.iter().map(|s| s.step).collect();
        assert_eq!(steps, (0..15).collect::<Vec<_>>());
        assert_eq!(view.step_rate, Some(1.0));
    }

    #[test]
    fn a_silent_member_without_a_fault_is_silent_a_frozen_one_frozen_and_recovery_shows() {
        let mut observed = killed_and_replaced();
        observed.faults.clear();
        observed.exited.clear();
        let view = build(&observed);
        assert_eq!(view.generations[1].changes[0].cause, Cause::Silent);
        assert_eq!(view.generations[1].recovery.as_ref().unwrap().detect_ms, None);
        // Without a fault asked for, the generation's first step marks the failure.
        assert_eq!(view.failures.len(), 1);
        assert_eq!(
            (view.failures[0].step, view.failures[0].what.as_str()),
            (10, "g1: rank 2 silent")
        );
        observed.faults = killed_and_replaced().faults;
        observed.faults[0].kind = FaultKind::Freeze;
        assert_eq!(build(&observed).generations[1].changes[0].cause, Cause::Frozen);
        observed.records[0].recovering = true;
        assert_eq!(build(&observed).members[0].state, MemberState::Recovering);
    }

    #[test]
    fn a_frozen_member_that_came_back_is_the_cause_of_the_re_form() {
        let mut observed = killed_and_replaced();
        observed.generations[1].members[2] = p(12);
        observed.faults[0].kind = FaultKind::Freeze;
        let g1 = &build(&observed).generations[1];
        assert_eq!(
            g1.changes,
            vec![Change {
                cause: Cause::Frozen,
                rank: Some(2),
                process: p(12)
            }]
        );
        observed.faults[0].kind = FaultKind::Slow;
        assert!(build(&observed).generations[1].changes.is_empty());
    }

    #[test]
    fn an_operation_failure_marks_the_lost_rank_corrupted() {
        let mut observed = killed_and_replaced();
        observed.faults.clear();
        observed.records[0].abort.as_mut().unwrap().label = "operation_failed".into();
        assert_eq!(build(&observed).generations[1].changes[0].cause, Cause::Corrupted);
    }

    #[test]
    fn a_live_process_in_no_generation_is_standby_and_a_finished_job_says_so() {
        let mut observed = killed_and_replaced();
        observed.records.push(record(20, 0, 0, &[], observed.now_us));
        let view = build(&observed);
        let standby = view.members.iter().find(|m| m.pid == 20).unwrap();
        assert_eq!((standby.state, standby.rank), (MemberState::Standby, None));
        observed.finished = true;
        observed.faults.clear();
        observed.exited.clear();
        observed.now_us += 60_000_000;
        let view = build(&observed);
        assert!(view.members.iter().all(|m| m.cause == Some(Cause::Finished)));
    }
}
