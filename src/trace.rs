//! The analysis behind `chorus trace DIR`: compares the flight-recorder
//! dumps ranks wrote on a timeout or abort (`CHORUS_TRACE_DIR`, format in
//! [`chorus_runtime::flight`]) and names the rank(s) that never entered the
//! operation the others are waiting in, with the last operation each rank
//! completed.
//!
//! [`load_dir`] does the IO; [`analyze`] is pure, over parsed dumps; a
//! [`Report`] prints as text (`Display`) or JSON (`Serialize`);
//! the command that prints it is in `chorus-cli`.
//!
//! How the analysis reads the dumps:
//! - Only the newest generation is compared: older dumps describe a group
//!   that was already restarted.
//! - A rank of the world without a dump is a suspect in its own right: a
//!   SIGKILLed or SIGSTOPped process writes nothing.
//! - Collectives are numbered per group, so a rank "never entered" `#n` when
//!   the highest collective it entered is below `n`. Sends and receives are
//!   numbered per peer and direction, so each is matched with the peer's
//!   counterpart instead.
//! - Ranks that ran different operations under one number are desynchronized;
//!   that explains any hang that follows, so it comes first.
//! - A rank that never entered `#n+1` because it is stuck in `#n` is a
//!   consequence, not a culprit, when `#n` has a culprit of its own (a rank
//!   without a dump): a SIGSTOPped rank may have fed some ranks their part of
//!   `#n` and not others; those left in `#n` wait for it, the others wait in
//!   `#n+1` for them.
//! - A rank that dumped between operations no longer after its last one
//!   than the others had waited in `#n` was on its way to `#n` when a rank
//!   without a dump ended the wait: it is named as not there yet, not as a
//!   culprit.
//! - When every rank entered `#n`, the ranks that timed out there name the
//!   peers whose frames never came (`waiting_for` in their entries): those
//!   peers are named, unless they completed `#n` or timed out waiting for a
//!   rank that had not completed it themselves; so is a rank that timed out
//!   waiting for frames from a rank that completed `#n` (they were sent: a
//!   rank frozen inside a collective still dumps once its peers' exits
//!   abort it). Such a finding is a cause, so it comes before `#n+1`,
//!   which the ranks stuck in `#n` never entered.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use chorus_runtime::flight::{self, DumpError, EntryState, FlightEntry, FlightOp, RankDump};
use serde::ser::{Serialize, SerializeMap, SerializeStruct, Serializer};
use thiserror::Error;

/// Largest file read as a dump. A full ring of the default 1000 entries is
/// about 300 KiB; this leaves room for large configured rings while refusing
/// to slurp an unrelated huge file that happens to carry a dump's name.
pub const MAX_DUMP_BYTES: u64 = 256 << 20;

/// A file in the directory that looked like a dump but could not be used,
/// or the directory itself could not be read.
#[derive(Debug, Error)]
pub enum TraceError {
    /// Reading failed.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Too large to be a dump.
    #[error("{} is {len} bytes, more than a dump can be ({MAX_DUMP_BYTES} at most)", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        len: u64,
    },
    /// Not a readable dump.
    #[error("{}: {source}", path.display())]
    Dump {
        /// The file.
        path: PathBuf,
        /// Why.
        source: DumpError,
    },
}

impl TraceError {
    /// The file or directory it is about.
    pub fn path(&self) -> &Path {
        match self {
            TraceError::Io { path, .. } | TraceError::TooLarge { path, .. } | TraceError::Dump { path, .. } => path,
        }
    }
}

/// What [`load_dir`] found.
#[derive(Debug)]
pub struct Loaded {
    /// Readable dumps with their paths, in file-name order.
    pub dumps: Vec<(PathBuf, RankDump)>,
    /// Files named like dumps that could not be used.
    pub unreadable: Vec<TraceError>,
}

/// Reads every dump (`chorus-trace-g<G>-r<R>.json`) in `dir`, skipping
/// other files; fails only when `dir` itself cannot be listed.
pub fn load_dir(dir: &Path) -> Result<Loaded, TraceError> {
    let io_error = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TraceError::Io { path, source }
    };
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_error(dir))? {
        let entry = entry.map_err(io_error(dir))?;
        let name = entry.file_name();
        if name.to_str().and_then(flight::parse_dump_file_name).is_some() {
            paths.push(entry.path());
        }
    }
    paths.sort();
    let mut loaded = Loaded {
        dumps: Vec::new(),
        unreadable: Vec::new(),
    };
    for path in paths {
        match read_dump(&path) {
            Ok(dump) => loaded.dumps.push((path, dump)),
            Err(error) => loaded.unreadable.push(error),
        }
    }
    Ok(loaded)
}

fn read_dump(path: &Path) -> Result<RankDump, TraceError> {
    let io_error = |source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    };
    let len = std::fs::metadata(path).map_err(io_error)?.len();
    if len > MAX_DUMP_BYTES {
        return Err(TraceError::TooLarge {
            path: path.to_path_buf(),
            len,
        });
    }
    let bytes = std::fs::read(path).map_err(io_error)?;
    RankDump::parse(&bytes).map_err(|source| TraceError::Dump {
        path: path.to_path_buf(),
        source,
    })
}

/// What the dumps say, most telling finding first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The generation compared (the newest present).
    pub generation: u64,
    /// Its world size.
    pub world: usize,
    /// Never empty; the first is the verdict.
    pub findings: Vec<Finding>,
    /// One row per rank of the world.
    pub ranks: Vec<RankRow>,
    /// What the analysis set aside (older generations, duplicate dumps, ...).
    pub notes: Vec<String>,
}

/// One conclusion drawn from the dumps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// Ranks ran different collectives under one sequence number (the
    /// lowest such number).
    Desync {
        /// The sequence number.
        seq: u64,
        /// Each operation and the ranks that ran it, fewest ranks first.
        variants: Vec<(FlightOp, Vec<usize>)>,
    },
    /// Ranks are inside a collective that has not completed.
    Stuck(Stuck),
    /// A rank is inside a send or receive that has not completed.
    P2p {
        /// The waiting rank.
        waiter: usize,
        /// The operation's number (per peer and direction).
        seq: u64,
        /// The operation.
        op: FlightOp,
        /// Whether the waiter's entry failed (it timed out or was aborted).
        failed: bool,
        /// What the peer's dump says about the counterpart.
        peer: PeerView,
    },
    /// Ranks left no dump, and no rank that dumped is inside an operation.
    NoDump {
        /// The ranks without a dump.
        ranks: Vec<usize>,
    },
    /// Every rank dumped and none is inside an operation.
    NothingStuck,
}

/// Ranks waiting in one collective, and where every other rank is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stuck {
    /// The collective's sequence number.
    pub seq: u64,
    /// The collective, as the first waiting rank recorded it.
    pub op: FlightOp,
    /// Ranks that entered it and did not complete it.
    pub waiting: Vec<usize>,
    /// Whether some waiting rank's entry failed (timed out or aborted)
    /// rather than still running at the dump.
    pub failed: bool,
    /// Ranks that dumped and never entered it: the culprits.
    pub never_entered: Vec<usize>,
    /// Ranks that dumped between operations moments after their last one
    /// completed, when a rank without a dump had already ended the wait:
    /// the abort reached them before they reached this collective, so they
    /// are not culprits.
    pub arriving: Vec<usize>,
    /// Ranks that completed it.
    pub completed: Vec<usize>,
    /// Ranks of the world that left no dump.
    pub no_dump: Vec<usize>,
    /// The ranks the waiting ranks timed out waiting for (their entries'
    /// `waiting_for`), excluding those that named someone else: when every
    /// rank entered the collective, the one the others wait for.
    pub waited_for: Vec<usize>,
}

/// What a peer's dump says about the counterpart of a waiting send or
/// receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerView {
    /// The peer never entered it.
    NeverEntered,
    /// The peer left no dump.
    NoDump,
    /// The peer is inside it too.
    Inside,
    /// The peer completed it.
    Completed,
}

/// One rank's line in the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankRow {
    /// The rank.
    pub rank: usize,
    /// What its dump says; `None` when it left none.
    pub dump: Option<RankState>,
}

/// Where a rank was when it dumped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankState {
    /// Why it dumped.
    pub reason: String,
    /// The last operation it completed.
    pub last_completed: Option<FlightEntry>,
    /// The operation it was in (entered and not completed), or else the
    /// oldest one queued and never started.
    pub current: Option<FlightEntry>,
    /// How long `current` had run (until the dump, or until it failed), or
    /// waited in the queue.
    pub current_for: Option<Duration>,
}

/// Compares the dumps of one group; `None` when there are none.
pub fn analyze(dumps: &[RankDump]) -> Option<Report> {
    let generation = dumps.iter().map(|d| d.generation).max()?;
    let mut notes = Vec::new();
    let mut older: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for dump in dumps.iter().filter(|d| d.generation != generation) {
        older.entry(dump.generation).or_default().push(dump.rank);
    }
    for (older_generation, mut ranks) in older {
        ranks.sort_unstable();
        notes.push(format!(
            "ignored the dumps of {} of generation {older_generation}: only the newest, {generation}, is compared",
            rank_list(&ranks)
        ));
    }
    let current: Vec<&RankDump> = dumps.iter().filter(|d| d.generation == generation).collect();
    let mut worlds: Vec<usize> = current.iter().map(|d| d.world).collect();
    worlds.sort_unstable();
    worlds.dedup();
    let world = *worlds.last()?;
    if worlds.len() > 1 {
        notes.push(format!(
            "the dumps disagree on the world size ({worlds:?}); using {world}"
        ));
    }
    // Two dumps of one rank and generation come from copied files or a
    // rank that dumped twice under different names; the newer one is the
    // rank's last word.
    let mut by_rank: BTreeMap<usize, &RankDump> = BTreeMap::new();
    let mut duplicated = Vec::new();
    for &dump in &current {
        let kept = by_rank.entry(dump.rank).or_insert(dump);
        if !std::ptr::eq(*kept, dump) {
            duplicated.push(dump.rank);
            if dump.dumped_at > kept.dumped_at {
                *kept = dump;
            }
        }
    }
    duplicated.sort_unstable();
    duplicated.dedup();
    if !duplicated.is_empty() {
        notes.push(format!(
            "{} dumped more than once; using each one's newest dump",
            rank_list(&duplicated)
        ));
    }
    let missing: Vec<usize> = (0..world).filter(|r| !by_rank.contains_key(r)).collect();

    let mut findings = Vec::new();
    findings.extend(desync(&by_rank, &mut notes));
    let stuck = stuck_collectives(&by_rank, &missing);
    let any_stuck = !stuck.is_empty();
    findings.extend(stuck.into_iter().map(Finding::Stuck));
    findings.extend(stuck_p2p(&by_rank, world));
    if !any_stuck && !missing.is_empty() {
        findings.push(Finding::NoDump { ranks: missing });
    }
    if findings.is_empty() {
        findings.push(Finding::NothingStuck);
    }
    let ranks = (0..world)
        .map(|rank| RankRow {
            rank,
            dump: by_rank.get(&rank).map(|dump| rank_state(dump)),
        })
        .collect();
    Some(Report {
        generation,
        world,
        findings,
        ranks,
        notes,
    })
}

/// The lowest sequence number at which ranks recorded different
/// collectives; later disagreements are consequences, so only counted.
fn desync(by_rank: &BTreeMap<usize, &RankDump>, notes: &mut Vec<String>) -> Option<Finding> {
    let mut by_seq: BTreeMap<u64, Vec<(usize, &FlightOp)>> = BTreeMap::new();
    for (&rank, dump) in by_rank {
        for entry in dump.entries.iter().filter(|e| !e.op.is_p2p()) {
            by_seq.entry(entry.seq).or_default().push((rank, &entry.op));
        }
    }
    let mut desyncs = by_seq.into_iter().filter_map(|(seq, ops)| {
        let mut variants: Vec<(FlightOp, Vec<usize>)> = Vec::new();
        for (rank, op) in ops {
            match variants.iter_mut().find(|(known, _)| known == op) {
                Some((_, ranks)) => ranks.push(rank),
                None => variants.push((op.clone(), vec![rank])),
            }
        }
        // The minority first: usually the rank that went astray.
        variants.sort_by_key(|(_, ranks)| (ranks.len(), ranks[0]));
        (variants.len() > 1).then_some(Finding::Desync { seq, variants })
    });
    let first = desyncs.next()?;
    let later = desyncs.count();
    if later > 0 {
        notes.push(format!(
            "{later} later sequence number(s) disagree too, after the desync"
        ));
    }
    Some(first)
}

/// One finding per collective some rank is inside: culprits first (ranks
/// that never entered it or left no dump), causes before consequences (a
/// collective whose never-entered ranks all wait in an earlier one), then
/// the one most ranks wait in.
fn stuck_collectives(by_rank: &BTreeMap<usize, &RankDump>, missing: &[usize]) -> Vec<Stuck> {
    let mut waiting: BTreeMap<u64, Vec<(usize, &FlightEntry)>> = BTreeMap::new();
    let mut highest_entered: BTreeMap<usize, u64> = BTreeMap::new();
    for (&rank, dump) in by_rank {
        let entries: Vec<&FlightEntry> = dump.entries.iter().filter(|e| !e.op.is_p2p()).collect();
        // Operations run one at a time, so the highest unfinished one is
        // where the rank is (a failure breaks the group, and later ones
        // fail without starting).
        if let Some(entry) = entries.iter().filter(|e| e.unfinished()).max_by_key(|e| e.seq) {
            waiting.entry(entry.seq).or_default().push((rank, entry));
        }
        if let Some(seq) = entries.iter().filter(|e| e.entered()).map(|e| e.seq).max() {
            highest_entered.insert(rank, seq);
        }
    }
    let waits_in: BTreeMap<usize, u64> = waiting
        .iter()
        .flat_map(|(&seq, waiters)| waiters.iter().map(move |(rank, _)| (*rank, seq)))
        .collect();
    let mut stuck: Vec<Stuck> = waiting
        .into_iter()
        .map(|(seq, waiters)| {
            let waiting: Vec<usize> = waiters.iter().map(|(rank, _)| *rank).collect();
            let longest_wait = waiters
                .iter()
                .filter_map(|(rank, entry)| {
                    let ended = entry.completed_at.unwrap_or(by_rank[rank].dumped_at);
                    ended.duration_since(entry.started_at?).ok()
                })
                .max()
                .unwrap_or_default();
            let (mut never_entered, mut arriving, mut completed) = (Vec::new(), Vec::new(), Vec::new());
            for (&rank, dump) in by_rank.iter().filter(|(r, _)| !waiting.contains(r)) {
                match highest_entered.get(&rank) {
                    Some(&highest) if highest >= seq => completed.push(rank),
                    _ if !missing.is_empty() && caught_between_operations(dump, longest_wait) => arriving.push(rank),
                    _ => never_entered.push(rank),
                }
            }
            // Whom the timed-out ranks waited for, less the ranks that
            // completed it (they sent their part) and any rank that itself
            // timed out waiting for a rank still short of completing it (a
            // consequence, not the cause). A rank that waited for frames
            // from a rank that completed it is named too: those frames were
            // sent, so its own links stalled (a rank frozen inside it).
            let named: Vec<usize> = waiters
                .iter()
                .flat_map(|(_, e)| e.waiting_for.iter().copied())
                .collect();
            let blocked_on_others = |r: &usize| {
                waiters
                    .iter()
                    .any(|(w, e)| w == r && e.waiting_for.iter().any(|p| !completed.contains(p)))
            };
            let stalled = waiters
                .iter()
                .filter(|(_, e)| e.waiting_for.iter().any(|p| completed.contains(p)))
                .map(|(w, _)| *w);
            let mut waited_for: Vec<usize> = named
                .into_iter()
                .filter(|r| !completed.contains(r) && !blocked_on_others(r))
                .chain(stalled)
                .collect();
            waited_for.sort_unstable();
            waited_for.dedup();
            Stuck {
                seq,
                op: waiters[0].1.op.clone(),
                failed: waiters.iter().any(|(_, e)| matches!(e.state, EntryState::Failed(_))),
                waiting,
                never_entered,
                arriving,
                completed,
                no_dump: missing.to_vec(),
                waited_for,
            }
        })
        .collect();
    stuck.sort_by_key(|s| {
        let stuck_earlier = |rank: &usize| waits_in.get(rank).is_some_and(|&seq| seq < s.seq);
        (
            s.never_entered.is_empty() && s.no_dump.is_empty() && s.waited_for.is_empty(),
            !s.never_entered.is_empty() && s.never_entered.iter().all(stuck_earlier),
            std::cmp::Reverse(s.waiting.len()),
            s.seq,
        )
    });
    stuck
}

/// How much later than the longest wait a rank may have dumped and still
/// count as caught on its way to the collective: the time a loaded machine
/// takes to deliver the abort and write the dump, far below any collective
/// timeout, so a rank idle for a whole timeout stays a culprit.
const ARRIVAL_SLACK: Duration = Duration::from_millis(250);

/// Whether `dump` shows a rank outside every operation that had finished
/// its last one no longer before the dump than the others waited (plus
/// [`ARRIVAL_SLACK`]): it was running its own code between two operations,
/// not holding the others up.
fn caught_between_operations(dump: &RankDump, longest_wait: Duration) -> bool {
    if dump.entries.iter().any(FlightEntry::unfinished) {
        return false;
    }
    let Some(last_finished) = dump.entries.iter().filter_map(|e| e.completed_at).max() else {
        return false;
    };
    dump.dumped_at
        .duration_since(last_finished)
        .is_ok_and(|idle| idle <= longest_wait + ARRIVAL_SLACK)
}

/// One finding per send or receive a rank is inside, matched with the
/// peer's counterpart (same number, opposite direction).
fn stuck_p2p(by_rank: &BTreeMap<usize, &RankDump>, world: usize) -> Vec<Finding> {
    let mut findings = Vec::new();
    for (&rank, dump) in by_rank {
        for entry in dump.entries.iter().filter(|e| e.unfinished()) {
            let (Some(peer), Some(counterpart)) = (entry.op.peer, counterpart(&entry.op.kind)) else {
                continue;
            };
            if peer >= world {
                continue;
            }
            let view = match by_rank.get(&peer) {
                None => PeerView::NoDump,
                Some(peer_dump) => {
                    let mut matching = peer_dump
                        .entries
                        .iter()
                        .filter(|c| c.op.kind == counterpart && c.op.peer == Some(rank));
                    match matching.clone().find(|c| c.seq == entry.seq) {
                        Some(c) if c.state == EntryState::Completed => PeerView::Completed,
                        Some(c) if c.entered() => PeerView::Inside,
                        Some(_) => PeerView::NeverEntered,
                        // Gone from the peer's ring while later ones are
                        // there: it completed long ago.
                        None if matching.any(|c| c.seq > entry.seq) => PeerView::Completed,
                        None => PeerView::NeverEntered,
                    }
                }
            };
            // Both sides inside one pair: the lower rank reports it.
            if view == PeerView::Inside && peer < rank {
                continue;
            }
            findings.push(Finding::P2p {
                waiter: rank,
                seq: entry.seq,
                op: entry.op.clone(),
                failed: matches!(entry.state, EntryState::Failed(_)),
                peer: view,
            });
        }
    }
    findings
}

fn counterpart(kind: &str) -> Option<&'static str> {
    match kind {
        "send" => Some("recv"),
        "recv" => Some("send"),
        _ => None,
    }
}

fn rank_state(dump: &RankDump) -> RankState {
    let last_completed = dump
        .entries
        .iter()
        .filter(|e| e.state == EntryState::Completed)
        .max_by_key(|e| e.id)
        .cloned();
    let inside = dump.entries.iter().filter(|e| e.unfinished()).max_by_key(|e| e.id);
    let queued = || {
        dump.entries
            .iter()
            .filter(|e| e.state == EntryState::Scheduled)
            .min_by_key(|e| e.id)
    };
    let current = inside.or_else(queued).cloned();
    let since = |from: SystemTime, to: SystemTime| to.duration_since(from).ok();
    let current_for = current.as_ref().and_then(|e| match (e.started_at, e.completed_at) {
        (Some(started), Some(ended)) => since(started, ended),
        (Some(started), None) => since(started, dump.dumped_at),
        (None, _) => since(e.enqueued_at, dump.dumped_at),
    });
    RankState {
        reason: dump.reason.clone(),
        last_completed,
        current,
        current_for,
    }
}

/// `rank 2`, `ranks 0, 1, 3`, `ranks 0-7, 9` (runs of three or more
/// collapse, so a thousand ranks stay one line).
fn rank_list(ranks: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        if j >= i + 2 {
            parts.push(format!("{}-{}", ranks[i], ranks[j]));
        } else {
            parts.extend(ranks[i..=j].iter().map(usize::to_string));
        }
        i = j + 1;
    }
    let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{noun} {}", parts.join(", "))
}

/// `is`/`are` (or `was`/`were` when the wait already failed) for `ranks`.
fn waiting_in(ranks: &[usize], failed: bool) -> &'static str {
    match (ranks.len() == 1, failed) {
        (true, false) => "is waiting in",
        (false, false) => "are waiting in",
        (true, true) => "was waiting in",
        (false, true) => "were waiting in",
    }
}

const NO_DUMP: &str = "left no dump (killed or frozen?)";

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finding::Desync { seq, variants } => {
                write!(f, "desync at #{seq}: ")?;
                for (i, (op, ranks)) in variants.iter().enumerate() {
                    let separator = if i == 0 { "" } else { "; " };
                    write!(f, "{separator}{} ran {op}", rank_list(ranks))?;
                }
                Ok(())
            }
            Finding::Stuck(s) => {
                let what = format!("#{} {}", s.seq, s.op);
                let waiting = rank_list(&s.waiting);
                let verb = waiting_in(&s.waiting, s.failed);
                if !s.never_entered.is_empty() {
                    write!(
                        f,
                        "{} never entered {what} that {waiting} {verb}",
                        rank_list(&s.never_entered)
                    )?;
                } else if !s.no_dump.is_empty() || (s.waited_for.is_empty() && !s.completed.is_empty()) {
                    write!(f, "{waiting} {verb} {what}")?;
                } else if !s.waited_for.is_empty() {
                    let timed_out: Vec<usize> = s
                        .waiting
                        .iter()
                        .copied()
                        .filter(|r| !s.waited_for.contains(r))
                        .collect();
                    write!(
                        f,
                        "{} entered {what} and never sent what {} timed out waiting for (stalled inside it?)",
                        rank_list(&s.waited_for),
                        rank_list(&timed_out)
                    )?;
                } else {
                    return write!(
                        f,
                        "all {} ranks entered {what} and none completed it (a broken link, or a rank stalled inside it?)",
                        s.waiting.len()
                    );
                }
                if !s.no_dump.is_empty() {
                    write!(f, "; {} {NO_DUMP}", rank_list(&s.no_dump))?;
                }
                if !s.arriving.is_empty() {
                    write!(
                        f,
                        "; {} had not reached it yet when the abort came",
                        rank_list(&s.arriving)
                    )?;
                }
                if !s.completed.is_empty() {
                    write!(f, "; {} completed it", rank_list(&s.completed))?;
                }
                Ok(())
            }
            Finding::P2p {
                waiter,
                seq,
                op,
                failed,
                peer,
            } => {
                let verb = waiting_in(&[*waiter], *failed);
                let other = op.peer.map_or_else(String::new, |p| p.to_string());
                let counterpart = counterpart(&op.kind).unwrap_or("counterpart");
                match peer {
                    PeerView::NeverEntered => write!(
                        f,
                        "rank {other} never entered the {counterpart} matching #{seq} {op} that rank {waiter} {verb}"
                    ),
                    PeerView::NoDump => write!(f, "rank {waiter} {verb} #{seq} {op}; rank {other} {NO_DUMP}"),
                    PeerView::Inside => write!(
                        f,
                        "ranks {waiter} and {other} are both inside #{seq} {op} and its {counterpart} (a broken link?)"
                    ),
                    PeerView::Completed => {
                        write!(f, "rank {waiter} {verb} #{seq} {op}, which rank {other} completed")
                    }
                }
            }
            Finding::NoDump { ranks } => write!(
                f,
                "{} {NO_DUMP}; no rank that dumped is inside an operation",
                rank_list(ranks)
            ),
            Finding::NothingStuck => f.write_str("nothing is stuck: no rank is inside an operation"),
        }
    }
}

/// A duration as people read it: `250 ms`, `30.0 s`.
fn human(duration: Duration) -> String {
    if duration < Duration::from_secs(1) {
        format!("{} ms", duration.as_millis())
    } else {
        format!("{:.1} s", duration.as_secs_f64())
    }
}

/// The "in flight" cell: `#41 all_reduce(...) failed after 30.0 s`; the
/// error itself goes to the table's list of reasons.
fn current_cell(state: &RankState) -> String {
    let Some(entry) = &state.current else {
        return "-".to_string();
    };
    let took = state.current_for.map(human).unwrap_or_else(|| "?".to_string());
    let what = format!("#{} {}", entry.seq, entry.op);
    match &entry.state {
        EntryState::Failed(_) => format!("{what} failed after {took}"),
        EntryState::Scheduled => format!("{what} queued for {took}, not started"),
        _ => format!("{what} running for {took}"),
    }
}

/// The widest line the text report prints (besides the verdict, which
/// stays one line for scripts): it fits a terminal.
pub const REPORT_WIDTH: usize = 100;

/// `text` in lines of at most `width` characters, broken at spaces (a word
/// longer than a line stands alone).
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    lines.push(line);
    lines
}

impl Report {
    /// The verdict: the first finding, one line.
    pub fn verdict(&self) -> String {
        self.findings.first().map(Finding::to_string).unwrap_or_default()
    }
}

/// The JSON form (`chorus trace --json`, with `serde_json`): `verdict`,
/// `generation`, `world`, `findings` (each its `text`, its `kind` and the
/// kind's members), `ranks` and `notes`, in that order. Written here
/// rather than derived because it adds what the text says (the verdict,
/// each finding's and operation's text) to the fields.
impl Serialize for Report {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut report = serializer.serialize_struct("Report", 6)?;
        report.serialize_field("verdict", &self.verdict())?;
        report.serialize_field("generation", &self.generation)?;
        report.serialize_field("world", &self.world)?;
        report.serialize_field("findings", &self.findings)?;
        report.serialize_field("ranks", &self.ranks)?;
        report.serialize_field("notes", &self.notes)?;
        report.end()
    }
}

/// An operation in the JSON form: its number, its fields and its text.
struct OpJson<'a>(u64, &'a FlightOp);

impl Serialize for OpJson<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let OpJson(seq, op) = *self;
        let mut map = serializer.serialize_struct("Op", 8)?;
        map.serialize_field("seq", &seq)?;
        map.serialize_field("op", &op.kind)?;
        map.serialize_field("dtype", &op.dtype)?;
        map.serialize_field("count", &op.count)?;
        map.serialize_field("root", &op.root)?;
        map.serialize_field("peer", &op.peer)?;
        map.serialize_field("reduce_op", &op.reduce_op)?;
        map.serialize_field("text", &op.to_string())?;
        map.end()
    }
}

/// `{"op": .., "ranks": [..]}`: one operation of a desync and who ran it.
struct VariantJson<'a>(u64, &'a FlightOp, &'a [usize]);

impl Serialize for VariantJson<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_struct("Variant", 2)?;
        map.serialize_field("op", &OpJson(self.0, self.1))?;
        map.serialize_field("ranks", self.2)?;
        map.end()
    }
}

/// `text`, `kind` (snake case) and the kind's members.
impl Serialize for Finding {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("text", &self.to_string())?;
        match self {
            Finding::Desync { seq, variants } => {
                map.serialize_entry("kind", "desync")?;
                let variants: Vec<_> = variants
                    .iter()
                    .map(|(op, ranks)| VariantJson(*seq, op, ranks))
                    .collect();
                map.serialize_entry("variants", &variants)?;
            }
            Finding::Stuck(s) => {
                map.serialize_entry("kind", "stuck")?;
                map.serialize_entry("op", &OpJson(s.seq, &s.op))?;
                map.serialize_entry("waiting", &s.waiting)?;
                map.serialize_entry("failed", &s.failed)?;
                map.serialize_entry("never_entered", &s.never_entered)?;
                map.serialize_entry("arriving", &s.arriving)?;
                map.serialize_entry("completed", &s.completed)?;
                map.serialize_entry("no_dump", &s.no_dump)?;
                map.serialize_entry("waited_for", &s.waited_for)?;
            }
            Finding::P2p {
                waiter,
                seq,
                op,
                failed,
                peer,
            } => {
                map.serialize_entry("kind", "p2p")?;
                map.serialize_entry("waiter", waiter)?;
                map.serialize_entry("op", &OpJson(*seq, op))?;
                map.serialize_entry("failed", failed)?;
                map.serialize_entry(
                    "peer_state",
                    match peer {
                        PeerView::NeverEntered => "never_entered",
                        PeerView::NoDump => "no_dump",
                        PeerView::Inside => "inside",
                        PeerView::Completed => "completed",
                    },
                )?;
            }
            Finding::NoDump { ranks } => {
                map.serialize_entry("kind", "no_dump")?;
                map.serialize_entry("ranks", ranks)?;
            }
            Finding::NothingStuck => map.serialize_entry("kind", "nothing_stuck")?,
        }
        map.end()
    }
}

/// `rank`, `dumped`, and for a rank that dumped, `reason`,
/// `last_completed` and `current` (`entry`, `state`, `for_ms`, and a
/// failed entry's `error`).
impl Serialize for RankRow {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("rank", &self.rank)?;
        map.serialize_entry("dumped", &self.dump.is_some())?;
        if let Some(state) = &self.dump {
            map.serialize_entry("reason", &state.reason)?;
            map.serialize_entry(
                "last_completed",
                &state.last_completed.as_ref().map(|e| OpJson(e.seq, &e.op)),
            )?;
            let current = state.current.as_ref().map(|entry| CurrentJson {
                entry,
                for_ms: state
                    .current_for
                    .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            });
            map.serialize_entry("current", &current)?;
        }
        map.end()
    }
}

/// The operation a rank was in when it dumped, and for how long.
struct CurrentJson<'a> {
    entry: &'a FlightEntry,
    for_ms: Option<u64>,
}

impl Serialize for CurrentJson<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("entry", &OpJson(self.entry.seq, &self.entry.op))?;
        map.serialize_entry("state", self.entry.state.name())?;
        map.serialize_entry("for_ms", &self.for_ms)?;
        if let EntryState::Failed(error) = &self.entry.state {
            map.serialize_entry("error", error)?;
        }
        map.end()
    }
}

/// The verdict, other findings, then a table of ranks and the notes.
impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.verdict())?;
        for finding in self.findings.iter().skip(1) {
            writeln!(f, "also: {finding}")?;
        }
        let dumped = self.ranks.iter().filter(|r| r.dump.is_some()).count();
        writeln!(
            f,
            "\ngeneration {}, world size {}: {dumped} of {} ranks dumped",
            self.generation, self.world, self.world
        )?;
        // Each distinct reason (why a rank dumped, why its operation
        // failed) is printed once under the table; rows refer to it by number.
        let mut reasons: Vec<String> = Vec::new();
        let mut refer = |text: &str| {
            let index = match reasons.iter().position(|r| r == text) {
                Some(index) => index,
                None => {
                    reasons.push(text.to_string());
                    reasons.len() - 1
                }
            };
            format!("[{}]", index + 1)
        };
        let rows: Vec<[String; 4]> = self
            .ranks
            .iter()
            .map(|row| match &row.dump {
                None => [
                    row.rank.to_string(),
                    String::new(),
                    String::new(),
                    "no dump (killed or frozen?)".into(),
                ],
                Some(state) => {
                    // "aborted on rank 3: rank 2 is gone" is one reason for
                    // every rank: the row already says which rank.
                    let own = format!(" on rank {}:", row.rank);
                    let shared = |text: &str| text.replacen(&own, ":", 1);
                    let mut why = vec![refer(&shared(&state.reason))];
                    if let Some(EntryState::Failed(error)) = state.current.as_ref().map(|e| &e.state) {
                        let error = refer(&shared(error));
                        if !why.contains(&error) {
                            why.push(error);
                        }
                    }
                    [
                        row.rank.to_string(),
                        why.join(" "),
                        state
                            .last_completed
                            .as_ref()
                            .map_or_else(|| "-".to_string(), |e| format!("#{} {}", e.seq, e.op.kind)),
                        current_cell(state),
                    ]
                }
            })
            .collect();
        let header = ["rank", "why", "last completed", "in flight"].map(String::from);
        let mut widths = [0; 3];
        for row in std::iter::once(&header).chain(&rows) {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        // The last column takes what is left of the line and wraps in it.
        let indent = widths.iter().sum::<usize>() + 2 * widths.len();
        let last = REPORT_WIDTH.saturating_sub(indent).max(20);
        for row in std::iter::once(&header).chain(&rows) {
            let first = format!(
                "{:>w0$}  {:<w1$}  {:<w2$}  ",
                row[0],
                row[1],
                row[2],
                w0 = widths[0],
                w1 = widths[1],
                w2 = widths[2]
            );
            let mut cell = wrap(&row[3], last).into_iter();
            let head = cell.next().unwrap_or_default();
            writeln!(f, "{}", format!("{first}{head}").trim_end())?;
            for more in cell {
                writeln!(f, "{:indent$}{more}", "")?;
            }
        }
        if !reasons.is_empty() {
            writeln!(f)?;
        }
        for (i, reason) in reasons.iter().enumerate() {
            let label = format!("[{}] ", i + 1);
            for (j, line) in wrap(reason, REPORT_WIDTH - label.len()).iter().enumerate() {
                let lead = if j == 0 { label.as_str() } else { "" };
                writeln!(f, "{lead:w$}{line}", w = label.len())?;
            }
        }
        for note in &self.notes {
            writeln!(f, "note: {note}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_runtime::flight::FlightRecorder;
    use serde_json::Value;
    use std::time::UNIX_EPOCH;

    fn at(ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_700_000_000) + Duration::from_millis(ms)
    }

    fn op(kind: &str, count: u64) -> FlightOp {
        FlightOp {
            kind: kind.into(),
            dtype: "float32".into(),
            count,
            root: None,
            peer: None,
            reduce_op: (kind == "all_reduce").then(|| "sum".into()),
        }
    }

    /// A rank that completed collectives `0..completed` (all-reduces of
    /// 1 Mi elements), then what `then` records.
    fn rank(rank: usize, world: usize, completed: u64, then: impl FnOnce(&mut FlightRecorder)) -> RankDump {
        let mut recorder = FlightRecorder::new(16);
        for seq in 0..completed {
            let id = recorder.record_scheduled(seq, op("all_reduce", 1 << 20), at(seq * 10));
            recorder.record_started(id, at(seq * 10 + 1));
            recorder.record_completed(id, at(seq * 10 + 5));
        }
        then(&mut recorder);
        recorder.dump(rank, world, 1, "timeout", at(40_000))
    }

    fn enters(seq: u64, op: FlightOp) -> impl FnOnce(&mut FlightRecorder) {
        move |r| {
            let id = r.record_scheduled(seq, op, at(9_000));
            r.record_started(id, at(10_000));
        }
    }

    fn idle(_: &mut FlightRecorder) {}

    fn stuck(report: &Report) -> &Stuck {
        match &report.findings[0] {
            Finding::Stuck(s) => s,
            other => panic!("expected a stuck collective first, got {other:?}"),
        }
    }

    #[test]
    fn a_frozen_rank_is_named_as_the_one_that_never_entered() {
        let dumps = [
            rank(0, 4, 41, enters(41, op("all_reduce", 1 << 20))),
            rank(1, 4, 41, enters(41, op("all_reduce", 1 << 20))),
            rank(2, 4, 41, idle),
            rank(3, 4, 41, enters(41, op("all_reduce", 1 << 20))),
        ];
        let report = analyze(&dumps).unwrap();
        assert_eq!(
            report.verdict(),
            "rank 2 never entered #41 all_reduce(1048576 x float32, sum) that ranks 0, 1, 3 are waiting in"
        );
        let s = stuck(&report);
        assert_eq!(
            (s.never_entered.as_slice(), s.completed.as_slice()),
            (&[2][..], &[][..])
        );
        assert_eq!(report.findings.len(), 1);
        let row = report.ranks[2].dump.as_ref().unwrap();
        assert_eq!(row.last_completed.as_ref().map(|e| e.seq), Some(40));
        assert_eq!(row.current, None);
        let row = report.ranks[0].dump.as_ref().unwrap();
        assert_eq!(row.current_for, Some(Duration::from_secs(30)));
        let text = report.to_string();
        assert!(
            text.contains("#41 all_reduce(1048576 x float32, sum) running for 30.0 s"),
            "{text}"
        );
    }

    #[test]
    fn a_rank_without_a_dump_is_a_suspect() {
        let dumps = [
            rank(0, 4, 7, enters(7, op("all_reduce", 1 << 20))),
            rank(1, 4, 7, enters(7, op("all_reduce", 1 << 20))),
            rank(2, 4, 7, enters(7, op("all_reduce", 1 << 20))),
        ];
        let report = analyze(&dumps).unwrap();
        assert_eq!(
            report.verdict(),
            "ranks 0-2 are waiting in #7 all_reduce(1048576 x float32, sum); rank 3 left no dump (killed or frozen?)"
        );
        assert_eq!(report.ranks[3].dump, None);
        assert!(report.to_string().contains("no dump (killed or frozen?)"));

        // A rank that never entered, and one that left nothing.
        let dumps = [
            rank(0, 4, 7, enters(7, op("all_reduce", 1 << 20))),
            rank(1, 4, 7, idle),
            rank(3, 4, 7, enters(7, op("all_reduce", 1 << 20))),
        ];
        let report = analyze(&dumps).unwrap();
        assert_eq!(
            report.verdict(),
            "rank 1 never entered #7 all_reduce(1048576 x float32, sum) that ranks 0, 3 are waiting in; rank 2 left no dump (killed or frozen?)"
        );

        // Nobody inside anything, one rank missing.
        let report = analyze(&[rank(0, 2, 3, idle)]).unwrap();
        assert_eq!(report.findings, [Finding::NoDump { ranks: vec![1] }]);
    }

    #[test]
    fn a_rank_the_abort_caught_between_operations_is_not_a_culprit() {
        // Rank 2 was SIGKILLed inside #3: ranks 1 and 3 had entered #3 and
        // failed 2 ms later; rank 0 had completed #2 3 ms before it dumped
        // and was on its way to #3 (what `chorus launch` runs produce).
        let survivor = |rank: usize, enters_third: bool, dumped_ms: u64| {
            let mut recorder = FlightRecorder::new(16);
            for seq in 0..3 {
                let id = recorder.record_scheduled(seq, op("all_reduce", 1024), at(seq * 10));
                recorder.record_started(id, at(seq * 10 + 1));
                recorder.record_completed(id, at(seq * 10 + 5));
            }
            if enters_third {
                let id = recorder.record_scheduled(3, op("all_reduce", 1024), at(26));
                recorder.record_started(id, at(26));
                recorder.record_failed(id, at(28), "aborted: rank 2 is gone");
            }
            recorder.dump(rank, 4, 0, "abort: rank 2 is gone", at(dumped_ms))
        };
        let dumps = [survivor(0, false, 28), survivor(1, true, 28), survivor(3, true, 29)];
        let report = analyze(&dumps).unwrap();
        assert_eq!(
            report.verdict(),
            "ranks 1, 3 were waiting in #3 all_reduce(1024 x float32, sum); rank 2 left no dump (killed or frozen?); rank 0 had not reached it yet when the abort came"
        );
        let s = stuck(&report);
        assert_eq!((s.never_entered.as_slice(), s.arriving.as_slice()), (&[][..], &[0][..]));

        // Idle for far longer than the others waited: rank 0 held them up.
        let dumps = [survivor(0, false, 5_000), survivor(1, true, 28), survivor(3, true, 29)];
        let s = stuck(&analyze(&dumps).unwrap()).clone();
        assert_eq!((s.never_entered.as_slice(), s.arriving.as_slice()), (&[0][..], &[][..]));

        // Every rank dumped: nobody else ended the wait, so rank 0 is named.
        let dumps = [
            survivor(0, false, 28),
            survivor(1, true, 28),
            survivor(2, true, 28),
            survivor(3, true, 29),
        ];
        let s = stuck(&analyze(&dumps).unwrap()).clone();
        assert_eq!(s.never_entered, [0]);
    }

    #[test]
    fn a_rank_held_back_by_a_missing_one_is_not_the_culprit() {
        // What a SIGSTOP leaves: rank 2 fed ranks 1 and 3 their part of #7
        // and stopped before rank 0's; rank 0 waits in #7 for rank 2, and
        // ranks 1 and 3 wait in #8 for ranks 0 and 2.
        let aborted = |seq: u64| {
            move |r: &mut FlightRecorder| {
                let id = r.record_scheduled(seq, op("all_reduce", 1 << 20), at(9_000));
                r.record_started(id, at(9_000));
                r.record_failed(id, at(11_000), "aborted: rank 2 sent no heartbeat for 2.0s");
            }
        };
        let dumps = [
            rank(0, 4, 7, aborted(7)),
            rank(1, 4, 8, aborted(8)),
            rank(3, 4, 8, aborted(8)),
        ];
        let report = analyze(&dumps).unwrap();
        assert_eq!(
            report.verdict(),
            "rank 0 was waiting in #7 all_reduce(1048576 x float32, sum); rank 2 left no dump (killed or frozen?); ranks 1, 3 completed it"
        );
        let s = stuck(&report);
        assert_eq!((s.never_entered.as_slice(), s.no_dump.as_slice()), (&[][..], &[2][..]));
        assert_eq!(
            report.findings[1].to_string(),
            "rank 0 never entered #8 all_reduce(1048576 x float32, sum) that ranks 1, 3 were waiting in; rank 2 left no dump (killed or frozen?)"
        );

        // Every rank dumped: #7 has no culprit of its own, so the rank that
        // never entered #8 is the one to look at.
        let dumps = [
            rank(0, 4, 7, aborted(7)),
            rank(1, 4, 8, aborted(8)),
            rank(2, 4, 8, aborted(8)),
            rank(3, 4, 8, aborted(8)),
        ];
        assert_eq!(
            analyze(&dumps).unwrap().verdict(),
            "rank 0 never entered #8 all_reduce(1048576 x float32, sum) that ranks 1-3 were waiting in"
        );
    }

    #[test]
    fn different_ops_at_one_sequence_number_are_a_desync_naming_both() {
        let broadcast = FlightOp {
            root: Some(0),
            ..op("broadcast", 4)
        };
        let dumps = [
            rank(0, 4, 3, enters(3, op("all_reduce", 4))),
            rank(1, 4, 3, enters(3, op("all_reduce", 4))),
            rank(2, 4, 3, enters(3, broadcast)),
            rank(3, 4, 3, enters(3, op("all_reduce", 4))),
        ];
        let report = analyze(&dumps).unwrap();
        assert_eq!(
            report.verdict(),
            "desync at #3: rank 2 ran broadcast(4 x float32, root 0); ranks 0, 1, 3 ran all_reduce(4 x float32, sum)"
        );
        assert!(matches!(report.findings[1], Finding::Stuck(_)));
    }

    #[test]
    fn everyone_completed_means_nothing_is_stuck() {
        let dumps: Vec<RankDump> = (0..3).map(|r| rank(r, 3, 12, idle)).collect();
        let report = analyze(&dumps).unwrap();
        assert_eq!(report.findings, [Finding::NothingStuck]);
        assert_eq!(report.verdict(), "nothing is stuck: no rank is inside an operation");
        assert!(
            report
                .ranks
                .iter()
                .all(|r| { r.dump.as_ref().unwrap().last_completed.as_ref().unwrap().seq == 11 })
        );
    }

    #[test]
    fn only_the_newest_generation_is_compared() {
        let mut old: Vec<RankDump> = (0..4).map(|r| rank(r, 4, 5, enters(5, op("all_reduce", 8)))).collect();
        for dump in &mut old {
            dump.generation = 0;
        }
        // Generation 1 has three ranks: one was lost and the group shrank.
        let mut dumps = vec![
            rank(0, 3, 2, enters(2, op("all_reduce", 8))),
            rank(1, 3, 2, idle),
            rank(2, 3, 2, enters(2, op("all_reduce", 8))),
        ];
        dumps.extend(old);
        let report = analyze(&dumps).unwrap();
        assert_eq!((report.generation, report.world, report.ranks.len()), (1, 3, 3));
        assert_eq!(
            report.verdict(),
            "rank 1 never entered #2 all_reduce(8 x float32, sum) that ranks 0, 2 are waiting in"
        );
        assert_eq!(
            report.notes,
            ["ignored the dumps of ranks 0-3 of generation 0: only the newest, 1, is compared"]
        );

        // A second, newer dump of rank 1 (it entered #2 after all) wins.
        let mut again = rank(1, 3, 2, enters(2, op("all_reduce", 8)));
        again.dumped_at += Duration::from_secs(1);
        dumps.push(again);
        let report = analyze(&dumps).unwrap();
        assert_eq!(
            report.verdict(),
            "all 3 ranks entered #2 all_reduce(8 x float32, sum) and none completed it (a broken link, or a rank stalled inside it?)"
        );
        assert_eq!(
            report.notes[1],
            "rank 1 dumped more than once; using each one's newest dump"
        );
    }

    #[test]
    fn when_everyone_entered_the_rank_the_others_timed_out_waiting_for_is_named() {
        // Ranks 0 and 1 timed out waiting for rank 2's frames; rank 2 entered
        // too (its links froze) and was aborted later, naming nobody.
        let times_out = |r: &mut FlightRecorder| {
            let id = r.record_scheduled(20, op("all_reduce", 8), at(1_000));
            r.record_started(id, at(1_000));
            r.record_timed_out(id, at(5_000), "timed out after 4s", vec![2]);
        };
        let aborted = |r: &mut FlightRecorder| {
            let id = r.record_scheduled(20, op("all_reduce", 8), at(1_000));
            r.record_started(id, at(1_000));
            r.record_failed(id, at(5_010), "group aborted");
        };
        let dumps = [
            rank(0, 3, 20, times_out),
            rank(1, 3, 20, times_out),
            rank(2, 3, 20, aborted),
        ];
        let report = analyze(&dumps).unwrap();
        assert_eq!(
            report.verdict(),
            "rank 2 entered #20 all_reduce(8 x float32, sum) and never sent what ranks 0, 1 timed out waiting for (stalled inside it?)"
        );
        assert_eq!(stuck(&report).waited_for, vec![2]);
        // The dump keeps whom an entry waited for.
        let text = dumps[0].encode();
        let parsed = RankDump::parse(&text).unwrap();
        assert_eq!(parsed.entries.last().unwrap().waiting_for, vec![2]);
    }

    #[test]
    fn a_rank_frozen_mid_collective_is_named_past_the_one_that_completed_it() {
        // Rank 2's links froze inside #22: rank 0 timed out waiting for it;
        // rank 2 timed out waiting for frames rank 1 had sent; rank 1
        // completed #22 and timed out in #23, which ranks 0 and 2 never
        // entered because they were stuck in #22.
        let waits_in_22_for = |peer: usize| {
            move |r: &mut FlightRecorder| {
                let id = r.record_scheduled(22, op("all_gather", 13), at(1_000));
                r.record_started(id, at(1_000));
                r.record_timed_out(id, at(5_000), "timed out after 4s", vec![peer]);
            }
        };
        let waits_in_23 = |r: &mut FlightRecorder| {
            let id = r.record_scheduled(22, op("all_gather", 13), at(1_000));
            r.record_started(id, at(1_000));
            r.record_completed(id, at(1_001));
            let id = r.record_scheduled(23, op("gather", 13), at(1_002));
            r.record_started(id, at(1_002));
            r.record_timed_out(id, at(5_002), "timed out after 4s", vec![0, 2]);
        };
        let dumps = [
            rank(0, 3, 22, waits_in_22_for(2)),
            rank(1, 3, 22, waits_in_23),
            rank(2, 3, 22, waits_in_22_for(1)),
        ];
        let report = analyze(&dumps).unwrap();
        assert_eq!(
            report.verdict(),
            "rank 2 entered #22 all_gather(13 x float32) and never sent what rank 0 timed out waiting for (stalled inside it?); rank 1 completed it"
        );
        assert_eq!(stuck(&report).waited_for, vec![2]);
        // Rank 2 also waiting for rank 0, which waits for it: still rank 2,
        // the one that waited for frames a rank that completed had sent.
        let dumps = [
            rank(0, 3, 22, waits_in_22_for(2)),
            rank(1, 3, 22, waits_in_23),
            rank(2, 3, 22, |r: &mut FlightRecorder| {
                let id = r.record_scheduled(22, op("all_gather", 13), at(1_000));
                r.record_started(id, at(1_000));
                r.record_timed_out(id, at(5_000), "timed out after 4s", vec![0, 1]);
            }),
        ];
        assert_eq!(stuck(&analyze(&dumps).unwrap()).waited_for, vec![2]);
    }

    #[test]
    fn everyone_inside_and_failed_waits_read_as_such() {
        let fails = |r: &mut FlightRecorder| {
            let id = r.record_scheduled(9, op("all_gather", 2), at(1_000));
            r.record_started(id, at(1_000));
            r.record_failed(id, at(31_000), "timed out after 30s");
        };
        let dumps = [rank(0, 2, 9, fails), rank(1, 2, 9, enters(9, op("all_gather", 2)))];
        let report = analyze(&dumps).unwrap();
        assert_eq!(
            report.verdict(),
            "all 2 ranks entered #9 all_gather(2 x float32) and none completed it (a broken link, or a rank stalled inside it?)"
        );
        assert!(stuck(&report).failed);
        let text = report.to_string();
        assert!(
            text.contains("#9 all_gather(2 x float32) failed after 30.0 s"),
            "{text}"
        );
        assert_eq!(text.matches("timed out after 30s").count(), 1, "{text}");
        // Completed by one side only.
        let completes = |r: &mut FlightRecorder| {
            let id = r.record_scheduled(9, op("all_gather", 2), at(1_000));
            r.record_completed(id, at(1_001));
        };
        let dumps = [rank(0, 2, 9, fails), rank(1, 2, 9, completes)];
        assert_eq!(
            analyze(&dumps).unwrap().verdict(),
            "rank 0 was waiting in #9 all_gather(2 x float32); rank 1 completed it"
        );
    }

    #[test]
    fn a_send_is_matched_with_the_peers_receive() {
        let send = FlightOp {
            peer: Some(1),
            ..op("send", 16)
        };
        let recv = FlightOp {
            peer: Some(0),
            ..op("recv", 16)
        };
        let report = analyze(&[rank(0, 2, 3, enters(0, send.clone())), rank(1, 2, 3, idle)]).unwrap();
        assert_eq!(
            report.verdict(),
            "rank 1 never entered the recv matching #0 send(16 x float32) to rank 1 that rank 0 is waiting in"
        );
        let report = analyze(&[rank(0, 2, 3, enters(0, send.clone())), rank(1, 2, 3, enters(0, recv))]).unwrap();
        assert_eq!(report.findings.len(), 1, "{:?}", report.findings);
        assert_eq!(
            report.verdict(),
            "ranks 0 and 1 are both inside #0 send(16 x float32) to rank 1 and its recv (a broken link?)"
        );
        let report = analyze(&[rank(0, 2, 3, enters(0, send))]).unwrap();
        assert_eq!(
            report.verdict(),
            "rank 0 is waiting in #0 send(16 x float32) to rank 1; rank 1 left no dump (killed or frozen?)"
        );
    }

    #[test]
    fn the_report_has_a_json_form() {
        let dumps = [rank(0, 2, 4, enters(4, op("all_reduce", 1))), rank(1, 2, 4, idle)];
        let text = serde_json::to_string(&analyze(&dumps).unwrap()).unwrap();
        assert!(
            text.starts_with(r#"{"verdict":"rank 1 never entered"#),
            "members in order: {text}"
        );
        let json: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            json.get("verdict").and_then(Value::as_str),
            Some("rank 1 never entered #4 all_reduce(1 x float32, sum) that rank 0 is waiting in")
        );
        let finding = &json.get("findings").and_then(Value::as_array).unwrap()[0];
        assert_eq!(finding.get("never_entered"), Some(&serde_json::json!([1])));
        let rank0 = &json.get("ranks").and_then(Value::as_array).unwrap()[0];
        assert_eq!(
            rank0
                .get("current")
                .and_then(|c| c.get("for_ms"))
                .and_then(Value::as_u64),
            Some(30_000)
        );
    }

    /// Every kind of finding, a rank without a dump, a failed entry with
    /// its error, a root and a peer: the JSON `chorus trace --json` printed
    /// before the report became one type, byte for byte.
    #[test]
    fn the_json_form_is_what_it_was() {
        let broadcast = FlightOp {
            root: Some(0),
            ..op("broadcast", 4)
        };
        let send = FlightOp {
            peer: Some(1),
            ..op("send", 16)
        };
        let fails = |r: &mut FlightRecorder| {
            let id = r.record_scheduled(9, op("all_gather", 2), at(1_000));
            r.record_started(id, at(1_000));
            r.record_failed(id, at(31_000), "timed out after 30s");
        };
        let reports = [
            analyze(&[
                rank(0, 3, 3, enters(3, op("all_reduce", 4))),
                rank(1, 3, 3, enters(3, broadcast)),
            ]),
            analyze(&[rank(0, 2, 1, enters(0, send)), rank(1, 2, 1, idle)]),
            analyze(&[rank(0, 2, 9, fails), rank(1, 2, 9, enters(9, op("all_gather", 2)))]),
            analyze(&[rank(0, 2, 2, idle)]),
            analyze(&[rank(0, 1, 1, idle)]),
        ];
        let json: Vec<String> = reports
            .iter()
            .map(|report| serde_json::to_string(report.as_ref().unwrap()).unwrap())
            .collect();
        assert_eq!(json.join("\n"), GOLDEN_JSON);
    }

    #[test]
    fn the_table_fits_a_terminal_and_says_each_reason_once() {
        let reason = |r: usize| {
            format!(
                "process group (generation 0) aborted on rank {r}: rank 5 (pid 4242 on \
                 a-rather-long-host-name.example.com) died: its process exited, seen through its pidfd"
            )
        };
        let waits = |recorder: &mut FlightRecorder, r: usize| {
            let id = recorder.record_scheduled(41, op("reduce_scatter", 123_456_789), at(1_000));
            recorder.record_started(id, at(1_000));
            recorder.record_failed(id, at(31_000), reason(r));
        };
        let dumps: Vec<RankDump> = (0..8)
            .filter(|&r| r != 5)
            .map(|r| {
                let mut recorder = FlightRecorder::new(flight::DEFAULT_CAPACITY);
                for seq in 0..41 {
                    let id = recorder.record_scheduled(seq, op("reduce_scatter", 123_456_789), at(seq * 10));
                    recorder.record_completed(id, at(seq * 10 + 1));
                }
                waits(&mut recorder, r);
                recorder.dump(r, 8, 0, &reason(r), at(40_000))
            })
            .collect();
        let text = analyze(&dumps).unwrap().to_string();
        for line in text.lines().skip(1) {
            assert!(
                line.chars().count() <= REPORT_WIDTH,
                "{} columns: {line:?}\n{text}",
                line.chars().count()
            );
        }
        assert_eq!(text.matches("pidfd").count(), 1, "each reason once:\n{text}");
        assert!(
            text.contains("[1] process group (generation 0) aborted: rank 5"),
            "the ranks' reasons differ only in the rank, which the rows say:\n{text}"
        );
        let row = text.lines().find(|l| l.trim_start().starts_with("7 ")).unwrap();
        assert!(
            row.contains("[1]") && row.contains("#40 reduce_scatter"),
            "{row}\n{text}"
        );
        let missing = text.lines().find(|l| l.trim_start().starts_with("5 ")).unwrap();
        assert!(missing.ends_with("no dump (killed or frozen?)"), "{missing}\n{text}");
    }

    #[test]
    fn rank_lists_collapse_runs() {
        assert_eq!(rank_list(&[2]), "rank 2");
        assert_eq!(rank_list(&[0, 1, 3]), "ranks 0, 1, 3");
        assert_eq!(rank_list(&[0, 1, 2, 3, 5, 7, 8, 9]), "ranks 0-3, 5, 7-9");
    }

    /// What `ReportJson` (the JSON mirror this replaced) printed for the reports of `the_json_form_is_what_it_was`.
    const GOLDEN_JSON: &str = r##"{"verdict":"desync at #3: rank 0 ran all_reduce(4 x float32, sum); rank 1 ran broadcast(4 x float32, root 0)","generation":1,"world":3,"findings":[{"text":"desync at #3: rank 0 ran all_reduce(4 x float32, sum); rank 1 ran broadcast(4 x float32, root 0)","kind":"desync","variants":[{"op":{"seq":3,"op":"all_reduce","dtype":"float32","count":4,"root":null,"peer":null,"reduce_op":"sum","text":"all_reduce(4 x float32, sum)"},"ranks":[0]},{"op":{"seq":3,"op":"broadcast","dtype":"float32","count":4,"root":0,"peer":null,"reduce_op":null,"text":"broadcast(4 x float32, root 0)"},"ranks":[1]}]},{"text":"ranks 0, 1 are waiting in #3 all_reduce(4 x float32, sum); rank 2 left no dump (killed or frozen?)","kind":"stuck","op":{"seq":3,"op":"all_reduce","dtype":"float32","count":4,"root":null,"peer":null,"reduce_op":"sum","text":"all_reduce(4 x float32, sum)"},"waiting":[0,1],"failed":false,"never_entered":[],"arriving":[],"completed":[],"no_dump":[2],"waited_for":[]}],"ranks":[{"rank":0,"dumped":true,"reason":"timeout","last_completed":{"seq":2,"op":"all_reduce","dtype":"float32","count":1048576,"root":null,"peer":null,"reduce_op":"sum","text":"all_reduce(1048576 x float32, sum)"},"current":{"entry":{"seq":3,"op":"all_reduce","dtype":"float32","count":4,"root":null,"peer":null,"reduce_op":"sum","text":"all_reduce(4 x float32, sum)"},"state":"started","for_ms":30000}},{"rank":1,"dumped":true,"reason":"timeout","last_completed":{"seq":2,"op":"all_reduce","dtype":"float32","count":1048576,"root":null,"peer":null,"reduce_op":"sum","text":"all_reduce(1048576 x float32, sum)"},"current":{"entry":{"seq":3,"op":"broadcast","dtype":"float32","count":4,"root":0,"peer":null,"reduce_op":null,"text":"broadcast(4 x float32, root 0)"},"state":"started","for_ms":30000}},{"rank":2,"dumped":false}],"notes":[]}
{"verdict":"rank 1 never entered the recv matching #0 send(16 x float32) to rank 1 that rank 0 is waiting in","generation":1,"world":2,"findings":[{"text":"rank 1 never entered the recv matching #0 send(16 x float32) to rank 1 that rank 0 is waiting in","kind":"p2p","waiter":0,"op":{"seq":0,"op":"send","dtype":"float32","count":16,"root":null,"peer":1,"reduce_op":null,"text":"send(16 x float32) to rank 1"},"failed":false,"peer_state":"never_entered"}],"ranks":[{"rank":0,"dumped":true,"reason":"timeout","last_completed":{"seq":0,"op":"all_reduce","dtype":"float32","count":1048576,"root":null,"peer":null,"reduce_op":"sum","text":"all_reduce(1048576 x float32, sum)"},"current":{"entry":{"seq":0,"op":"send","dtype":"float32","count":16,"root":null,"peer":1,"reduce_op":null,"text":"send(16 x float32) to rank 1"},"state":"started","for_ms":30000}},{"rank":1,"dumped":true,"reason":"timeout","last_completed":{"seq":0,"op":"all_reduce","dtype":"float32","count":1048576,"root":null,"peer":null,"reduce_op":"sum","text":"all_reduce(1048576 x float32, sum)"},"current":null}],"notes":[]}
{"verdict":"all 2 ranks entered #9 all_gather(2 x float32) and none completed it (a broken link, or a rank stalled inside it?)","generation":1,"world":2,"findings":[{"text":"all 2 ranks entered #9 all_gather(2 x float32) and none completed it (a broken link, or a rank stalled inside it?)","kind":"stuck","op":{"seq":9,"op":"all_gather","dtype":"float32","count":2,"root":null,"peer":null,"reduce_op":null,"text":"all_gather(2 x float32)"},"waiting":[0,1],"failed":true,"never_entered":[],"arriving":[],"completed":[],"no_dump":[],"waited_for":[]}],"ranks":[{"rank":0,"dumped":true,"reason":"timeout","last_completed":{"seq":8,"op":"all_reduce","dtype":"float32","count":1048576,"root":null,"peer":null,"reduce_op":"sum","text":"all_reduce(1048576 x float32, sum)"},"current":{"entry":{"seq":9,"op":"all_gather","dtype":"float32","count":2,"root":null,"peer":null,"reduce_op":null,"text":"all_gather(2 x float32)"},"state":"failed","for_ms":30000,"error":"timed out after 30s"}},{"rank":1,"dumped":true,"reason":"timeout","last_completed":{"seq":8,"op":"all_reduce","dtype":"float32","count":1048576,"root":null,"peer":null,"reduce_op":"sum","text":"all_reduce(1048576 x float32, sum)"},"current":{"entry":{"seq":9,"op":"all_gather","dtype":"float32","count":2,"root":null,"peer":null,"reduce_op":null,"text":"all_gather(2 x float32)"},"state":"started","for_ms":30000}}],"notes":[]}
{"verdict":"rank 1 left no dump (killed or frozen?); no rank that dumped is inside an operation","generation":1,"world":2,"findings":[{"text":"rank 1 left no dump (killed or frozen?); no rank that dumped is inside an operation","kind":"no_dump","ranks":[1]}],"ranks":[{"rank":0,"dumped":true,"reason":"timeout","last_completed":{"seq":1,"op":"all_reduce","dtype":"float32","count":1048576,"root":null,"peer":null,"reduce_op":"sum","text":"all_reduce(1048576 x float32, sum)"},"current":null},{"rank":1,"dumped":false}],"notes":[]}
{"verdict":"nothing is stuck: no rank is inside an operation","generation":1,"world":1,"findings":[{"text":"nothing is stuck: no rank is inside an operation","kind":"nothing_stuck"}],"ranks":[{"rank":0,"dumped":true,"reason":"timeout","last_completed":{"seq":0,"op":"all_reduce","dtype":"float32","count":1048576,"root":null,"peer":null,"reduce_op":"sum","text":"all_reduce(1048576 x float32, sum)"},"current":null}],"notes":[]}"##;

    #[test]
    fn no_dumps_no_report() {
        assert_eq!(analyze(&[]), None);
    }
}
