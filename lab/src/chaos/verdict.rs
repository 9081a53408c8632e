//! The verdict of a chaos run, sans IO: from the members' commit records
//! ([`CommitRecord`], one per committed step and member), the fault-free
//! reference's, the faults' times and what was left behind, each check
//! with its value, its bound and whether it passed.
//!
//! The checks:
//! - `completed`: every step `0..steps` committed (by some member).
//! - `one history` (no split brain): each step committed in one
//!   generation, generations never going back as steps advance, and in each
//!   generation one world size, each rank held by one process and no more
//!   processes than the world size.
//! - `parameters equal`: at each step every member that committed it holds
//!   the same parameters (checksums of the bytes; DDP), but for a member
//!   between a bit flip of its own and the check that found it.
//! - `exactly once`: each member's steps strictly increase, and at each
//!   its applied plus adopted steps equal the step + 1 (none applied twice,
//!   none skipped).
//! - `final loss`: the mean loss of the last steps (a tenth of them, 1 to
//!   20) within a relative tolerance of the reference's over the same steps.
//! - `goodput`: committed steps per second, first to last commit, against
//!   the reference's.
//! - `recovery`: per fault that made the group re-form before the next
//!   fault, from the fault to the first step committed in a later
//!   generation (median, p99, max; the max bounded).
//! - `corruptions`: every bit flip a member carried out (its records
//!   count them) found by the members' checks within the check interval
//!   they had agreed (a detection at a step from the flip's to that many
//!   after), unless the flipped process ended before then.
//! - `orphans`, `shared memory`: no process of the run left, no ring file
//!   of its processes left in `/dev/shm`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use chorus::train::CommitRecord;
use serde::Serialize;

/// The bounds the checks apply.
#[derive(Debug, Clone, PartialEq)]
pub struct Bounds {
    /// The final loss's largest relative difference from the reference's.
    pub loss_tolerance: f64,
    /// The lowest goodput.
    pub min_goodput: f64,
    /// The longest recovery.
    pub max_recovery: Duration,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            loss_tolerance: 0.02,
            min_goodput: 0.9,
            max_recovery: Duration::from_secs(10),
        }
    }
}

/// What a run left to judge.
#[derive(Debug, Clone, Default)]
pub struct Evidence {
    /// Steps the job commits.
    pub steps: u64,
    /// The chaos run's records, each member's in the order it wrote them.
    pub records: Vec<CommitRecord>,
    /// The fault-free reference's records.
    pub reference: Vec<CommitRecord>,
    /// When each fault that acted struck (unix microseconds), and whether
    /// it makes the group re-form.
    pub faults: Vec<(i64, bool)>,
    /// Processes of the run still alive once it ended.
    pub orphans: Vec<u32>,
    /// Ring files of the run's processes left in `/dev/shm`.
    pub leaked_shm: Vec<String>,
    /// Corruptions asked of the workers (`corrupt` faults that acted).
    pub corruptions_asked: usize,
}

/// One check.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    /// Its name.
    pub name: &'static str,
    /// What was measured.
    pub value: String,
    /// What it must be.
    pub bound: String,
    /// Whether it passed.
    pub pass: bool,
    /// The first violations, when it failed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
}

/// Recovery times in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RecoveryStats {
    /// How many were measured.
    pub count: usize,
    /// Median (nearest rank).
    pub median_ms: f64,
    /// 99th percentile (nearest rank).
    pub p99_ms: f64,
    /// Longest.
    pub max_ms: f64,
}

/// How many of the last steps the `final loss` check averages: a tenth of
/// the steps, at least 1 and at most 20.
pub fn loss_window(steps: u64) -> u64 {
    (steps / 10).clamp(1, 20)
}

/// Every check, and the figures behind them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Verdict {
    /// The checks, in a fixed order.
    pub checks: Vec<Check>,
    /// Committed steps per second, chaos run.
    pub steps_per_second: Option<f64>,
    /// The same, fault-free reference.
    pub reference_steps_per_second: Option<f64>,
    /// The ratio of the two.
    pub goodput: Option<f64>,
    /// The mean loss of the last [`loss_window`] steps, chaos run.
    pub final_loss: Option<f64>,
    /// The reference's.
    pub reference_loss: Option<f64>,
    /// The recoveries.
    pub recovery: Option<RecoveryStats>,
    /// Each recovery, in fault order, milliseconds.
    pub recovery_ms: Vec<f64>,
    /// Generations the chaos run went through.
    pub generations: usize,
    /// Distinct processes that committed steps.
    pub members: usize,
}

impl Verdict {
    /// Whether every check passed.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.pass)
    }

    /// The checks as a table, one row each, and each failure's first problems.
    pub fn table(&self) -> String {
        let mut rows = vec![["check".to_string(), "value".into(), "bound".into(), "result".into()]];
        for c in &self.checks {
            let result = if c.pass { "PASS" } else { "FAIL" };
            rows.push([c.name.to_string(), c.value.clone(), c.bound.clone(), result.into()]);
        }
        let width = |i: usize| rows.iter().map(|r| r[i].len()).max().unwrap_or(0);
        let widths = [width(0), width(1), width(2)];
        let mut out = String::new();
        for r in &rows {
            out.push_str(&format!(
                "{:w0$}  {:w1$}  {:w2$}  {}\n",
                r[0],
                r[1],
                r[2],
                r[3],
                w0 = widths[0],
                w1 = widths[1],
                w2 = widths[2]
            ));
        }
        for c in self.checks.iter().filter(|c| !c.pass) {
            for p in &c.problems {
                out.push_str(&format!("{}: {p}\n", c.name));
            }
        }
        out
    }
}

/// At most this many problems are kept per check.
const PROBLEMS: usize = 5;

fn check(name: &'static str, value: String, bound: String, problems: Vec<String>) -> Check {
    Check {
        name,
        value,
        bound,
        pass: problems.is_empty(),
        problems: problems.into_iter().take(PROBLEMS).collect(),
    }
}

/// Judges `evidence` under `bounds`.
pub fn judge(evidence: &Evidence, bounds: &Bounds) -> Verdict {
    let records = &evidence.records;
    let corruptions = corruptions(records);
    let mismatched = parameters_differ(records, &corruptions.silent);
    let repeated = not_exactly_once(records);
    let loss = LossCheck::judge(evidence, bounds);
    let goodput = GoodputCheck::judge(evidence, bounds);
    let recovery_ms = recoveries(records, &evidence.faults);
    let recovery = stats(&recovery_ms);
    let checks = vec![
        completed(evidence),
        one_history(records),
        check(
            "parameters equal",
            format!("{} steps differ", mismatched.len()),
            "0".into(),
            mismatched,
        ),
        check(
            "exactly once",
            format!("{} violations", repeated.len()),
            "0".into(),
            repeated,
        ),
        loss.check,
        goodput.check,
        recovery_check(&recovery_ms, recovery.as_ref(), bounds),
        corruptions_check(evidence.corruptions_asked, corruptions),
        check(
            "orphans",
            format!("{} processes", evidence.orphans.len()),
            "0".into(),
            evidence
                .orphans
                .iter()
                .map(|pid| format!("process {pid} outlived the run (killed)"))
                .collect(),
        ),
        check(
            "shared memory",
            format!("{} files left", evidence.leaked_shm.len()),
            "0".into(),
            evidence
                .leaked_shm
                .iter()
                .map(|f| format!("{f} left in /dev/shm (removed)"))
                .collect(),
        ),
    ];
    Verdict {
        checks,
        steps_per_second: goodput.rate,
        reference_steps_per_second: goodput.reference_rate,
        goodput: goodput.goodput,
        final_loss: loss.final_loss,
        reference_loss: loss.reference_loss,
        recovery,
        recovery_ms,
        generations: records.iter().map(|r| r.generation).collect::<BTreeSet<_>>().len(),
        members: records.iter().map(|r| r.pid).collect::<BTreeSet<_>>().len(),
    }
}

/// The `completed` check.
fn completed(evidence: &Evidence) -> Check {
    let committed: BTreeSet<u64> = evidence.records.iter().map(|r| r.step).collect();
    let missing: Vec<u64> = (0..evidence.steps).filter(|s| !committed.contains(s)).collect();
    let mut problems: Vec<String> = missing
        .iter()
        .take(PROBLEMS)
        .map(|s| format!("step {s} committed by no member"))
        .collect();
    if evidence.steps == 0 {
        problems.push("no steps to commit".into());
    }
    check(
        "completed",
        format!("{} of {} steps", evidence.steps - missing.len() as u64, evidence.steps),
        format!("{} of {}", evidence.steps, evidence.steps),
        problems,
    )
}

/// The `one history` check.
fn one_history(records: &[CommitRecord]) -> Check {
    let mut history = check(
        "one history",
        String::new(),
        "no split brain".into(),
        split_brain(records),
    );
    history.value = match history.pass {
        true => "one sequence of generations".into(),
        false => format!("{} violations", history.problems.len()),
    };
    history
}

/// The `final loss` check, and the losses it compared.
struct LossCheck {
    check: Check,
    final_loss: Option<f64>,
    reference_loss: Option<f64>,
}

impl LossCheck {
    fn judge(evidence: &Evidence, bounds: &Bounds) -> Self {
        // One step's loss is one batch's: where the global batch follows the
        // membership (a Python job's sampler), it moves by several percent
        // from step to step, so the last steps' mean is compared.
        let window = loss_window(evidence.steps);
        let loss_at = |records: &[CommitRecord]| {
            let first = evidence.steps.checked_sub(window)?;
            let losses = (first..evidence.steps)
                .map(|step| records.iter().filter(|r| r.step == step).find_map(|r| r.loss))
                .collect::<Option<Vec<f64>>>()?;
            Some(losses.iter().sum::<f64>() / losses.len() as f64)
        };
        let (final_loss, reference_loss) = (loss_at(&evidence.records), loss_at(&evidence.reference));
        let (value, problems) = match (final_loss, reference_loss) {
            (Some(loss), Some(reference)) => {
                let off = loss / reference - 1.0;
                let problems = match off.abs() <= bounds.loss_tolerance {
                    true => Vec::new(),
                    false => vec![format!("{loss:.5} against the reference's {reference:.5}")],
                };
                (format!("{loss:.4} vs {reference:.4} ({:+.2}%)", off * 100.0), problems)
            }
            (loss, _) => (
                "-".into(),
                vec![format!(
                    "a loss of the last {window} steps is missing from the {}",
                    if loss.is_none() { "chaos run" } else { "reference" }
                )],
            ),
        };
        let check = check(
            "final loss",
            value,
            format!("within {:.1}% of the reference", bounds.loss_tolerance * 100.0),
            problems,
        );
        LossCheck {
            check,
            final_loss,
            reference_loss,
        }
    }
}

/// The `goodput` check, and the rates it compared.
struct GoodputCheck {
    check: Check,
    rate: Option<f64>,
    reference_rate: Option<f64>,
    goodput: Option<f64>,
}

impl GoodputCheck {
    fn judge(evidence: &Evidence, bounds: &Bounds) -> Self {
        let (rate, reference_rate) = (
            steps_per_second(&evidence.records),
            steps_per_second(&evidence.reference),
        );
        let goodput = rate.zip(reference_rate).map(|(r, f)| r / f);
        let problems = match goodput {
            Some(g) if g >= bounds.min_goodput => Vec::new(),
            Some(g) => vec![format!(
                "{:.1} steps/s against the reference's {:.1}: {g:.3}",
                rate.unwrap_or_default(),
                reference_rate.unwrap_or_default()
            )],
            None => vec!["too few steps to measure a rate".into()],
        };
        let check = check(
            "goodput",
            goodput.map_or("-".into(), |g| {
                format!(
                    "{g:.3} ({:.1} / {:.1} steps/s)",
                    rate.unwrap_or_default(),
                    reference_rate.unwrap_or_default()
                )
            }),
            format!(">= {}", bounds.min_goodput),
            problems,
        );
        GoodputCheck {
            check,
            rate,
            reference_rate,
            goodput,
        }
    }
}

/// The `recovery` check of the recoveries measured.
fn recovery_check(recovery_ms: &[f64], recovery: Option<&RecoveryStats>, bounds: &Bounds) -> Check {
    let limit_ms = bounds.max_recovery.as_secs_f64() * 1e3;
    check(
        "recovery",
        recovery.map_or("none measured".into(), |s| {
            format!(
                "median {:.0} ms, p99 {:.0} ms, max {:.0} ms ({})",
                s.median_ms, s.p99_ms, s.max_ms, s.count
            )
        }),
        format!("max <= {limit_ms:.0} ms"),
        recovery_ms
            .iter()
            .filter(|&&ms| ms > limit_ms)
            .map(|ms| format!("a recovery took {ms:.0} ms"))
            .collect(),
    )
}

/// The `corruptions` check, of `asked` corruptions.
fn corruptions_check(asked: usize, corruptions: Corruptions) -> Check {
    check(
        "corruptions",
        format!(
            "{} asked, {} carried out, {} found in time{}",
            asked,
            corruptions.carried_out,
            corruptions.found,
            match corruptions.ended_first {
                0 => String::new(),
                n => format!(", {n} before a check could run"),
            }
        ),
        "each found within the check interval".into(),
        corruptions.problems,
    )
}

/// The split-brain violations (see the module docs).
fn split_brain(records: &[CommitRecord]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut by_step: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
    for r in records {
        by_step.entry(r.step).or_default().insert(r.generation);
    }
    let mut highest: Option<(u64, u64)> = None;
    for (step, generations) in &by_step {
        if generations.len() > 1 {
            problems.push(format!("step {step} committed in generations {generations:?}"));
        }
        let first = *generations.first().expect("a step has a record");
        if let Some((at, generation)) = highest
            && first < generation
        {
            problems.push(format!(
                "step {step} committed in generation {first} after step {at} in generation {generation}"
            ));
        }
        let last = *generations.last().expect("a step has a record");
        highest = Some(highest.map_or((*step, last), |(at, g)| if last > g { (*step, last) } else { (at, g) }));
    }
    let mut worlds: BTreeMap<u64, BTreeSet<usize>> = BTreeMap::new();
    let mut holders: BTreeMap<(u64, usize), BTreeSet<u32>> = BTreeMap::new();
    let mut members: BTreeMap<u64, BTreeSet<u32>> = BTreeMap::new();
    for r in records {
        worlds.entry(r.generation).or_default().insert(r.world_size);
        holders.entry((r.generation, r.rank)).or_default().insert(r.pid);
        members.entry(r.generation).or_default().insert(r.pid);
    }
    for (generation, sizes) in &worlds {
        if sizes.len() > 1 {
            problems.push(format!("generation {generation} has world sizes {sizes:?}"));
        }
        let pids = &members[generation];
        if let Some(&size) = sizes.last()
            && pids.len() > size
        {
            problems.push(format!(
                "generation {generation} of {size} members committed in {} processes {pids:?}",
                pids.len()
            ));
        }
    }
    for ((generation, rank), pids) in &holders {
        if pids.len() > 1 {
            problems.push(format!(
                "rank {rank} of generation {generation} held by processes {pids:?}"
            ));
        }
    }
    problems
}

/// The steps at which members' parameters differ, but for the records of
/// a process within one of its `silent` windows.
fn parameters_differ(records: &[CommitRecord], silent: &[(u32, std::ops::Range<u64>)]) -> Vec<String> {
    let mut by_step: BTreeMap<u64, BTreeMap<u64, Vec<u32>>> = BTreeMap::new();
    let explained = |r: &CommitRecord| {
        silent
            .iter()
            .any(|(pid, steps)| *pid == r.pid && steps.contains(&r.step))
    };
    for r in records.iter().filter(|r| !explained(r)) {
        if let Some(sum) = r.checksum {
            by_step.entry(r.step).or_default().entry(sum).or_default().push(r.pid);
        }
    }
    by_step
        .iter()
        .filter(|(_, sums)| sums.len() > 1)
        .map(|(step, sums)| {
            let groups: Vec<String> = sums
                .iter()
                .map(|(sum, pids)| format!("{sum:016x} on {pids:?}"))
                .collect();
            format!("step {step}: {}", groups.join(", "))
        })
        .collect()
}

/// Each member's repeated, out-of-order or miscounted steps.
fn not_exactly_once(records: &[CommitRecord]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut last: BTreeMap<u32, u64> = BTreeMap::new();
    for r in records {
        if let Some(&before) = last.get(&r.pid)
            && r.step <= before
        {
            problems.push(format!(
                "process {} committed step {} after step {before}",
                r.pid, r.step
            ));
        }
        last.insert(r.pid, r.step);
        if r.applied + r.adopted != r.step + 1 {
            problems.push(format!(
                "process {} at step {}: {} applied + {} adopted",
                r.pid, r.step, r.applied, r.adopted
            ));
        }
    }
    problems
}

/// What the records say of the corruptions carried out.
struct Corruptions {
    carried_out: usize,
    found: usize,
    /// Each found flip's process and the steps from the flip to the
    /// finding: its parameters may differ there.
    silent: Vec<(u32, std::ops::Range<u64>)>,
    /// Flips whose process ended before a check could find them.
    ended_first: usize,
    problems: Vec<String>,
}

/// Each flip (a step at which a process's count of injected corruptions
/// rose) against the detections (steps at which any process's count of
/// found ones rose): one must follow within the longest check interval
/// recorded.
fn corruptions(records: &[CommitRecord]) -> Corruptions {
    let mut flips = Vec::new();
    let mut found_at = BTreeSet::new();
    let mut last_step: BTreeMap<u32, u64> = BTreeMap::new();
    let mut counts: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for r in records {
        let (injected, detected) = counts.entry(r.pid).or_default();
        if r.corruptions_injected > *injected {
            flips.extend(std::iter::repeat_n(
                (r.pid, r.step),
                (r.corruptions_injected - *injected) as usize,
            ));
        }
        if r.corruptions_detected > *detected {
            found_at.insert(r.step);
        }
        (*injected, *detected) = (r.corruptions_injected, r.corruptions_detected);
        last_step.insert(r.pid, r.step);
    }
    let window = records.iter().filter_map(|r| r.check_interval).max().unwrap_or(1);
    let mut out = Corruptions {
        carried_out: flips.len(),
        found: 0,
        silent: Vec::new(),
        ended_first: 0,
        problems: Vec::new(),
    };
    for (pid, step) in flips {
        if let Some(&found) = found_at.range(step..=step + window).next() {
            out.found += 1;
            out.silent.push((pid, step..found));
        } else if last_step[&pid] < step + window {
            out.ended_first += 1;
        } else {
            out.problems.push(format!(
                "process {pid}'s corruption at step {step} not found by step {}",
                step + window
            ));
        }
    }
    out
}

/// Steps per second from the first step's commit to the last's (each the
/// earliest member's), `None` with fewer than two steps.
fn steps_per_second(records: &[CommitRecord]) -> Option<f64> {
    let mut first_at: BTreeMap<u64, i64> = BTreeMap::new();
    for r in records {
        let at = first_at.entry(r.step).or_insert(r.at_us);
        *at = (*at).min(r.at_us);
    }
    let (&first, &start) = first_at.first_key_value()?;
    let (&last, &end) = first_at.last_key_value()?;
    (last > first && end > start).then(|| (last - first) as f64 / ((end - start) as f64 / 1e6))
}

/// Per re-forming fault followed by a step of a later generation before
/// the next fault: milliseconds from the fault to that step.
fn recoveries(records: &[CommitRecord], faults: &[(i64, bool)]) -> Vec<f64> {
    let mut by_time: Vec<&CommitRecord> = records.iter().collect();
    by_time.sort_by_key(|r| r.at_us);
    let mut out = Vec::new();
    for (i, &(at, reforms)) in faults.iter().enumerate() {
        if !reforms {
            continue;
        }
        let next = faults.get(i + 1).map_or(i64::MAX, |f| f.0);
        let before = by_time.iter().take_while(|r| r.at_us <= at).map(|r| r.generation).max();
        let Some(before) = before else { continue };
        if let Some(r) = by_time.iter().find(|r| r.at_us > at && r.generation > before)
            && r.at_us < next
        {
            out.push((r.at_us - at) as f64 / 1e3);
        }
    }
    out
}

/// Median, p99 and max (nearest rank), `None` for no values.
fn stats(values: &[f64]) -> Option<RecoveryStats> {
    if values.is_empty() {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let nearest = |q: f64| sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
    Some(RecoveryStats {
        count: sorted.len(),
        median_ms: nearest(0.5),
        p99_ms: nearest(0.99),
        max_ms: sorted[sorted.len() - 1],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record of `pid` as `rank` of `world` in `generation` at `step`,
    /// committed at `step` * 10 ms.
    fn rec(pid: u32, generation: u64, rank: usize, world: usize, step: u64) -> CommitRecord {
        CommitRecord {
            pid,
            generation,
            rank,
            world_size: world,
            step,
            loss: Some(2.0 - step as f64 / 100.0),
            checksum: Some(step * 1000 + 1),
            applied: step + 1,
            adopted: 0,
            at_us: step as i64 * 10_000,
            corruptions_injected: 0,
            corruptions_detected: 0,
            check_interval: Some(5),
        }
    }

    /// Three members for steps 0..10 in generation 0; process 3 dies after
    /// step 4 (fault at 45 ms), the other two go on in generation 1 of 2;
    /// process 4 joins at step 8 in generation 2 having adopted steps 0..8.
    fn healthy() -> Vec<CommitRecord> {
        let mut records = Vec::new();
        for step in 0..10 {
            let (generation, world) = match step {
                0..5 => (0, 3),
                5..8 => (1, 2),
                _ => (2, 3),
            };
            records.push(rec(1, generation, 0, world, step));
            records.push(rec(2, generation, 1, world, step));
            if step < 5 {
                records.push(rec(3, generation, 2, world, step));
            }
            if step >= 8 {
                let mut joiner = rec(4, generation, 2, world, step);
                joiner.applied = step - 7;
                joiner.adopted = 8;
                records.push(joiner);
            }
        }
        records
    }

    fn evidence(records: Vec<CommitRecord>) -> Evidence {
        let mut reference: Vec<CommitRecord> = (0..10).map(|s| rec(1, 0, 0, 3, s)).collect();
        for r in &mut reference {
            // Fault-free: twice as fast as the chaos run's 100 steps/s.
            r.at_us /= 2;
        }
        Evidence {
            steps: 10,
            records,
            reference,
            faults: vec![(45_000, true)],
            orphans: Vec::new(),
            leaked_shm: Vec::new(),
            corruptions_asked: 0,
        }
    }

    fn failed(verdict: &Verdict) -> Vec<&'static str> {
        verdict.checks.iter().filter(|c| !c.pass).map(|c| c.name).collect()
    }

    fn lenient() -> Bounds {
        Bounds {
            min_goodput: 0.4,
            ..Bounds::default()
        }
    }

    #[test]
    fn a_healthy_run_passes_every_check() {
        let verdict = judge(&evidence(healthy()), &lenient());
        assert!(verdict.passed(), "{}", verdict.table());
        assert_eq!(verdict.goodput, Some(0.5));
        assert_eq!(verdict.recovery_ms, [5.0]);
        assert_eq!((verdict.generations, verdict.members), (3, 4));
        assert!(verdict.table().contains("goodput"));
        let strict = judge(&evidence(healthy()), &Bounds::default());
        assert_eq!(failed(&strict), ["goodput"]);
    }

    /// Marks a corruption carried out by `pid` at `step` and one found by
    /// every member at `found` (check interval 5).
    fn corrupted(records: &mut [CommitRecord], pid: u32, step: u64, found: Option<u64>) {
        for r in records.iter_mut() {
            if r.pid == pid && r.step >= step {
                r.corruptions_injected += 1;
            }
            if found.is_some_and(|f| r.step >= f) {
                r.corruptions_detected += 1;
            }
        }
    }

    #[test]
    fn a_corruption_must_be_found_within_the_check_interval() {
        // Process 1 flips at step 1, found at step 4 (interval 5): passes.
        let mut records = healthy();
        corrupted(&mut records, 1, 1, Some(4));
        // Its parameters differ until it is healed: explained.
        for r in records.iter_mut().filter(|r| r.pid == 1 && (1..4).contains(&r.step)) {
            r.checksum = Some(7);
        }
        let verdict = judge(&evidence(records.clone()), &lenient());
        assert!(verdict.passed(), "{}", verdict.table());
        assert!(verdict.table().contains("1 carried out, 1 found in time"));
        // Past the finding they must agree again.
        records
            .iter_mut()
            .filter(|r| r.pid == 1 && r.step == 4)
            .for_each(|r| r.checksum = Some(7));
        assert_eq!(failed(&judge(&evidence(records), &lenient())), ["parameters equal"]);
        // Never found: fails, naming it.
        let mut records = healthy();
        corrupted(&mut records, 2, 2, None);
        let verdict = judge(&evidence(records), &lenient());
        assert_eq!(failed(&verdict), ["corruptions"]);
        assert!(
            verdict
                .table()
                .contains("process 2's corruption at step 2 not found by step 7")
        );
        // Found too late (step 8, past 1 + 5): fails.
        let mut records = healthy();
        corrupted(&mut records, 1, 1, Some(8));
        assert_eq!(failed(&judge(&evidence(records), &lenient())), ["corruptions"]);
        // Its process died (after step 4) before a check: not a miss.
        let mut records = healthy();
        corrupted(&mut records, 3, 3, None);
        let verdict = judge(&evidence(records), &lenient());
        assert!(verdict.passed(), "{}", verdict.table());
        assert!(verdict.table().contains("1 before a check could run"));
    }

    #[test]
    fn two_groups_committing_one_step_is_a_split_brain() {
        let mut records = healthy();
        // Process 3 carries on alone in a generation of its own.
        let mut alone = rec(3, 1, 0, 1, 5);
        alone.checksum = Some(9);
        records.push(alone);
        let verdict = judge(&evidence(records), &lenient());
        let history = &verdict.checks[1];
        assert!(!history.pass);
        assert!(
            history.problems.iter().any(|p| p.contains("rank 0 of generation 1")),
            "{history:?}"
        );
        assert!(
            history.problems.iter().any(|p| p.contains("world sizes")),
            "{history:?}"
        );
        assert!(failed(&verdict).contains(&"parameters equal"));
    }

    #[test]
    fn a_step_in_two_generations_or_going_back_is_a_split_brain() {
        let mut records = healthy();
        records.push(rec(5, 3, 0, 3, 6));
        records.push(rec(6, 0, 0, 3, 9));
        let problems = split_brain(&records);
        assert!(
            problems
                .iter()
                .any(|p| p.contains("step 6 committed in generations {1, 3}")),
            "{problems:?}"
        );
        assert!(
            problems
                .iter()
                .any(|p| p.contains("step 9 committed in generation 0 after")),
            "{problems:?}"
        );
    }

    #[test]
    fn a_checksum_mismatch_fails_the_parameters_check() {
        let mut records = healthy();
        records[4].checksum = Some(7);
        let verdict = judge(&evidence(records), &lenient());
        assert_eq!(failed(&verdict), ["parameters equal"]);
        assert!(
            verdict.checks[2].problems[0].starts_with("step 1:"),
            "{:?}",
            verdict.checks[2]
        );
    }

    #[test]
    fn a_step_applied_twice_or_skipped_fails_exactly_once() {
        let mut records = healthy();
        let mut again = rec(1, 1, 0, 2, 5);
        again.applied = 7;
        again.at_us = 99_000;
        records.push(again);
        let verdict = judge(&evidence(records), &lenient());
        assert!(failed(&verdict).contains(&"exactly once"), "{}", verdict.table());
        let problems = &verdict.checks[3].problems;
        assert!(
            problems.iter().any(|p| p.contains("committed step 5 after step 9")),
            "{problems:?}"
        );

        let mut records = healthy();
        // The joiner applied step 8 without having adopted step 7.
        records.iter_mut().filter(|r| r.pid == 4).for_each(|r| r.adopted = 7);
        assert_eq!(failed(&judge(&evidence(records), &lenient())), ["exactly once"]);
    }

    #[test]
    fn a_missing_step_a_loss_off_and_leftovers_fail() {
        let mut records = healthy();
        records.retain(|r| r.step != 9);
        let verdict = judge(&evidence(records), &lenient());
        assert_eq!(failed(&verdict), ["completed", "final loss"]);

        let mut records = healthy();
        records
            .iter_mut()
            .filter(|r| r.step == 9)
            .for_each(|r| r.loss = r.loss.map(|l| l * 1.03));
        let mut e = evidence(records);
        e.orphans = vec![42];
        e.leaked_shm = vec!["chorus-00-to-1".into()];
        let verdict = judge(&e, &lenient());
        assert_eq!(failed(&verdict), ["final loss", "orphans", "shared memory"]);
    }

    #[test]
    fn recoveries_count_reformations_before_the_next_fault_only() {
        let records = healthy();
        // A slow rank (no re-formation) and a fault followed by none.
        let faults = [(45_000, true), (60_000, false), (85_000, true)];
        assert_eq!(recoveries(&records, &faults), [5.0]);
        let s = stats(&[5.0, 1.0, 3.0, 100.0]).unwrap();
        assert_eq!((s.median_ms, s.p99_ms, s.max_ms, s.count), (3.0, 100.0, 100.0, 4));
        let mut tight = lenient();
        tight.max_recovery = Duration::from_millis(4);
        assert_eq!(failed(&judge(&evidence(healthy()), &tight)), ["recovery"]);
    }
}
