//! The flight recorder: each rank keeps its group's last N operations
//! (sequence number, op, sizes, state, timestamps) in a bounded ring, and
//! dumps it to a file on a timeout or abort, so `chorus trace` can compare
//! every rank's view and name the rank the others are waiting for.
//!
//! The recorder has no IO and no clock: every method takes `now`, so tests
//! drive time by hand. [`write_dump`] is the only function that touches the
//! file system. Groups read [`BUFFER_SIZE_ENV`] and [`TRACE_DIR_ENV`]
//! through [`capacity_from_env`] and [`trace_dir_from_env`].
//!
//! # Dump format (version 1)
//! One JSON document, UTF-8, with one entry per line so it also reads well in
//! a terminal and greps by line:
//!
//! ```text
//! {"format":"chorus-flight-recorder","version":1,"rank":2,"world":4,"generation":1,"reason":"timeout","dumped_at_ns":1700000030000000000,"capacity":1000,"dropped":0,"entries":[
//! {"id":0,"seq":0,"op":"all_reduce","dtype":"float32","count":1048576,"root":null,"peer":null,"reduce_op":"sum","state":"completed","error":null,"enqueued_ns":...,"started_ns":...,"completed_ns":...},
//! ...
//! ]}
//! ```
//!
//! - `id` numbers every entry the recorder made, in order; `dropped` entries
//!   fell out of the ring before the dump.
//! - `seq` is the group's collective number; for `send` and `recv` (which
//!   name their `peer`) it counts operations per peer and direction.
//! - `state` is `scheduled`, `started`, `completed` or `failed` (with
//!   `error`); times are unix nanoseconds of the dumping rank's clock, `null`
//!   when the entry never got there.
//! - Readers ignore members they do not know, so version 1 can grow fields;
//!   a change that old readers would misread bumps `version`.

use std::fmt;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::Value;
use thiserror::Error;

use crate::collective::{CollectiveKind, DType, ReduceOp, Signature};

/// Entries a recorder keeps unless configured otherwise.
pub const DEFAULT_CAPACITY: usize = 1000;
/// The environment variable that sets the ring's capacity (0 disables
/// recording).
pub const BUFFER_SIZE_ENV: &str = "CHORUS_TRACE_BUFFER_SIZE";
/// The environment variable naming the directory ranks dump into.
pub const TRACE_DIR_ENV: &str = "CHORUS_TRACE_DIR";
/// The `format` member every dump starts with.
pub const FORMAT: &str = "chorus-flight-recorder";
/// The dump format version this build writes and reads.
pub const VERSION: u64 = 1;

/// Identifies an entry within one recorder: the number of entries recorded
/// before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EntryId(pub u64);

/// What an operation was, as the rank that ran it described it. Strings
/// rather than enums, so a dump from a newer build with new kinds or dtypes
/// still reads.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FlightOp {
    /// PyTorch's name of the operation (`all_reduce`, `send`, ...).
    pub kind: String,
    /// The element type (`float32`, ...).
    pub dtype: String,
    /// Elements per rank.
    pub count: u64,
    /// The root of a rooted collective.
    pub root: Option<usize>,
    /// The other rank of a `send` or `recv`.
    pub peer: Option<usize>,
    /// The reduction operator of a reducing collective.
    pub reduce_op: Option<String>,
}

impl FlightOp {
    /// Whether this is a point-to-point operation, numbered per peer rather
    /// than per group.
    pub fn is_p2p(&self) -> bool {
        self.peer.is_some()
    }
}

impl FlightOp {
    /// The record of an operation; `root` is the peer of a `send` or
    /// `recv`, which the recorder keeps apart because p2p operations are
    /// numbered differently.
    pub fn new(
        kind: CollectiveKind,
        dtype: DType,
        count: usize,
        root: Option<usize>,
        reduce_op: Option<ReduceOp>,
    ) -> Self {
        let p2p = matches!(kind, CollectiveKind::Send | CollectiveKind::Recv);
        FlightOp {
            kind: kind.name().to_string(),
            dtype: dtype.name().to_string(),
            count: count as u64,
            root: root.filter(|_| !p2p),
            peer: root.filter(|_| p2p),
            reduce_op: reduce_op.map(|op| op.name().to_string()),
        }
    }
}

impl From<&Signature> for FlightOp {
    fn from(signature: &Signature) -> Self {
        FlightOp::new(
            signature.kind,
            signature.dtype,
            signature.count,
            signature.root,
            signature.reduce_op,
        )
    }
}

/// The ring capacity [`BUFFER_SIZE_ENV`] asks for, else
/// [`DEFAULT_CAPACITY`].
pub fn capacity_from_env() -> usize {
    std::env::var(BUFFER_SIZE_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_CAPACITY)
}

/// The directory [`TRACE_DIR_ENV`] names, when set and not blank.
pub fn trace_dir_from_env() -> Option<PathBuf> {
    std::env::var(TRACE_DIR_ENV)
        .ok()
        .filter(|d| !d.trim().is_empty())
        .map(PathBuf::from)
}

/// `all_reduce(1048576 x float32, sum)`, `broadcast(4 x int64, root 0)`,
/// `send(16 x float32) to rank 1`, `barrier`.
impl fmt::Display for FlightOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.kind)?;
        if self.kind == CollectiveKind::Barrier.name() {
            return Ok(());
        }
        write!(f, "({} x {}", self.count, self.dtype)?;
        if let Some(op) = &self.reduce_op {
            write!(f, ", {op}")?;
        }
        if let Some(root) = self.root {
            write!(f, ", root {root}")?;
        }
        f.write_str(")")?;
        match (self.peer, self.kind.as_str()) {
            (Some(peer), "recv") => write!(f, " from rank {peer}"),
            (Some(peer), _) => write!(f, " to rank {peer}"),
            (None, _) => Ok(()),
        }
    }
}

/// Where an operation got to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryState {
    /// Submitted, not yet running.
    Scheduled,
    /// Running.
    Started,
    /// Finished successfully.
    Completed,
    /// Finished with this error (a timeout, a dead peer, a group abort).
    Failed(String),
}

impl EntryState {
    /// The state's name in dumps.
    pub fn name(&self) -> &'static str {
        match self {
            EntryState::Scheduled => "scheduled",
            EntryState::Started => "started",
            EntryState::Completed => "completed",
            EntryState::Failed(_) => "failed",
        }
    }
}

/// One recorded operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlightEntry {
    /// Its place in the recorder's order.
    pub id: EntryId,
    /// The group's collective number, or for p2p the number per peer and
    /// direction.
    pub seq: u64,
    /// What it was.
    pub op: FlightOp,
    /// Where it got to.
    pub state: EntryState,
    /// When it was submitted.
    pub enqueued_at: SystemTime,
    /// When it started running.
    pub started_at: Option<SystemTime>,
    /// When it completed or failed.
    pub completed_at: Option<SystemTime>,
    /// The peers it still waited for when it timed out (empty otherwise):
    /// whom a stuck collective waits for when every rank entered it.
    pub waiting_for: Vec<usize>,
}

impl FlightEntry {
    /// Whether the rank entered the operation (it started running).
    pub fn entered(&self) -> bool {
        self.started_at.is_some()
    }

    /// Whether the rank entered the operation and did not complete it: it
    /// is still inside, or it failed there.
    pub fn unfinished(&self) -> bool {
        self.entered() && self.state != EntryState::Completed
    }
}

/// What an entry in the ring says an operation was: a collective's
/// signature as it is (turned into a [`FlightOp`] only for a snapshot),
/// or an op given as one. A thousand ranks in one process keep a thousand
/// rings, so an entry holds no text of its own.
#[derive(Debug, Clone)]
enum KeptOp {
    Signature(Signature),
    Op(Box<FlightOp>),
}

/// An entry as the ring keeps it ([`FlightEntry`] with a [`KeptOp`]).
#[derive(Debug, Clone)]
struct Kept {
    id: EntryId,
    seq: u64,
    op: KeptOp,
    state: EntryState,
    enqueued_at: SystemTime,
    started_at: Option<SystemTime>,
    completed_at: Option<SystemTime>,
    waiting_for: Vec<usize>,
}

impl From<&Kept> for FlightEntry {
    fn from(kept: &Kept) -> Self {
        FlightEntry {
            id: kept.id,
            seq: kept.seq,
            op: match &kept.op {
                KeptOp::Signature(signature) => signature.into(),
                KeptOp::Op(op) => (**op).clone(),
            },
            state: kept.state.clone(),
            enqueued_at: kept.enqueued_at,
            started_at: kept.started_at,
            completed_at: kept.completed_at,
            waiting_for: kept.waiting_for.clone(),
        }
    }
}

/// A bounded ring of one rank's operations in one group: the newest
/// `capacity` entries, the oldest dropped first.
#[derive(Debug, Clone)]
pub struct FlightRecorder {
    capacity: usize,
    /// A ring: entry `id` lives in slot `id % capacity`, so a new entry
    /// overwrites the one it drops in place (one set of cache lines touched,
    /// where a queue's pop and push touch two).
    entries: Vec<Kept>,
    next_id: u64,
}

impl FlightRecorder {
    /// A recorder that keeps the last `capacity` operations; 0 records
    /// nothing (as `TORCH_NCCL_TRACE_BUFFER_SIZE=0` does).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            // Grows to `capacity` as entries arrive: a group that runs few
            // operations should not pay for a large configured ring.
            entries: Vec::new(),
            next_id: 0,
        }
    }

    /// How many entries it keeps.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Entries recorded and since dropped from the ring.
    pub fn dropped(&self) -> u64 {
        self.next_id - self.entries.len() as u64
    }

    /// Records a submitted operation; the id updates it later.
    pub fn record_scheduled(&mut self, seq: u64, op: FlightOp, now: SystemTime) -> EntryId {
        self.record(seq, KeptOp::Op(Box::new(op)), now)
    }

    /// Records a submitted collective by its signature (what
    /// [`FlightOp::from`] makes of it), with no text made until a dump.
    pub fn record_signature(&mut self, seq: u64, signature: &Signature, now: SystemTime) -> EntryId {
        self.record(seq, KeptOp::Signature(*signature), now)
    }

    fn record(&mut self, seq: u64, op: KeptOp, now: SystemTime) -> EntryId {
        let id = EntryId(self.next_id);
        self.next_id += 1;
        if self.capacity == 0 {
            return id;
        }
        let kept = Kept {
            id,
            seq,
            op,
            state: EntryState::Scheduled,
            enqueued_at: now,
            started_at: None,
            completed_at: None,
            waiting_for: Vec::new(),
        };
        if self.entries.len() < self.capacity {
            self.entries.push(kept);
        } else {
            let slot = self.slot(id);
            self.entries[slot] = kept;
        }
        id
    }

    /// Marks a scheduled operation as running.
    ///
    /// Updates of entries that already left the ring, and updates out of
    /// order (a start after the end), change nothing: the recorder must never
    /// fail the operation it watches.
    pub fn record_started(&mut self, id: EntryId, now: SystemTime) {
        if let Some(entry) = self.entry_mut(id)
            && entry.state == EntryState::Scheduled
        {
            entry.state = EntryState::Started;
            entry.started_at = Some(now);
        }
    }

    /// Marks an operation as completed (one that completed without a
    /// recorded start, say on a single-rank group, is taken to have started
    /// then). Ignored once the entry has ended or left the ring.
    pub fn record_completed(&mut self, id: EntryId, now: SystemTime) {
        if let Some(entry) = self.entry_mut(id)
            && matches!(entry.state, EntryState::Scheduled | EntryState::Started)
        {
            entry.started_at.get_or_insert(now);
            entry.state = EntryState::Completed;
            entry.completed_at = Some(now);
        }
    }

    /// Marks an operation as failed. One that fails before it starts (an
    /// abort while it was queued) keeps no start time: it was never entered.
    /// Ignored once the entry has ended or left the ring.
    pub fn record_failed(&mut self, id: EntryId, now: SystemTime, reason: impl Into<String>) {
        self.record_timed_out(id, now, reason, Vec::new());
    }

    /// Marks an operation as failed while it still waited for `waiting_for`
    /// (a timeout naming the peers whose frames never came).
    pub fn record_timed_out(
        &mut self,
        id: EntryId,
        now: SystemTime,
        reason: impl Into<String>,
        waiting_for: Vec<usize>,
    ) {
        if let Some(entry) = self.entry_mut(id)
            && matches!(entry.state, EntryState::Scheduled | EntryState::Started)
        {
            entry.state = EntryState::Failed(reason.into());
            entry.completed_at = Some(now);
            entry.waiting_for = waiting_for;
        }
    }

    /// The entries in the ring, oldest first.
    pub fn snapshot(&self) -> Vec<FlightEntry> {
        // Once the ring is full the oldest entry is the one the next overwrites.
        let full = !self.entries.is_empty() && self.entries.len() == self.capacity;
        let oldest = if full { self.slot(EntryId(self.next_id)) } else { 0 };
        let (newer, older) = self.entries.split_at(oldest);
        older.iter().chain(newer).map(FlightEntry::from).collect()
    }

    /// This rank's dump: the ring with who dumped it, when and why.
    pub fn dump(&self, rank: usize, world: usize, generation: u64, reason: &str, now: SystemTime) -> RankDump {
        RankDump {
            rank,
            world,
            generation,
            reason: reason.to_string(),
            dumped_at: now,
            capacity: self.capacity as u64,
            dropped: self.dropped(),
            entries: self.snapshot(),
        }
    }

    fn entry_mut(&mut self, id: EntryId) -> Option<&mut Kept> {
        // The ring holds the ids just below `next_id`: the slot is
        // arithmetic, no other entry is read (each would be a cache miss per
        // update with a thousand ranks' rings in one process).
        let first = self.next_id - self.entries.len() as u64;
        if id.0 < first || id.0 >= self.next_id {
            return None;
        }
        let slot = self.slot(id);
        self.entries.get_mut(slot)
    }

    fn slot(&self, id: EntryId) -> usize {
        (id.0 % self.capacity as u64) as usize
    }
}

impl Default for FlightRecorder {
    fn default() -> Self {
        Self::new(DEFAULT_CAPACITY)
    }
}

/// One rank's dump, as written by [`RankDump::encode`] and read back by
/// [`RankDump::parse`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankDump {
    /// The dumping rank.
    pub rank: usize,
    /// The group's world size.
    pub world: usize,
    /// The group's rendezvous generation.
    pub generation: u64,
    /// Why it dumped (`timeout`, `abort: ...`).
    pub reason: String,
    /// When, by the rank's clock (the reference for how long entries ran).
    pub dumped_at: SystemTime,
    /// The ring's capacity.
    pub capacity: u64,
    /// Entries that had left the ring before the dump.
    pub dropped: u64,
    /// The ring, oldest first.
    pub entries: Vec<FlightEntry>,
}

/// Why bytes are not a readable dump.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DumpError {
    /// Not JSON (garbage, a file cut short, or nesting deeper than
    /// `serde_json`'s recursion limit): the parser's message, with the line
    /// and column.
    #[error("not valid JSON: {0}")]
    Json(String),
    /// JSON, but not a flight-recorder dump.
    #[error("not a chorus flight-recorder dump (no \"format\": \"{FORMAT}\")")]
    NotADump,
    /// A dump of a format version this build does not read.
    #[error("dump format version {0}; this build reads version {VERSION} (was it written by another chorus?)")]
    Version(u64),
    /// A member is missing or has the wrong type.
    #[error("{at}: member \"{member}\" is missing or not {expected}")]
    Member {
        /// `header` or `entry N`.
        at: String,
        /// The member.
        member: &'static str,
        /// The type it should have.
        expected: &'static str,
    },
    /// Members that contradict each other.
    #[error("{at}: {problem}")]
    Invalid {
        /// `header` or `entry N`.
        at: String,
        /// What is wrong.
        problem: String,
    },
}

impl From<serde_json::Error> for DumpError {
    fn from(error: serde_json::Error) -> Self {
        DumpError::Json(error.to_string())
    }
}

/// The header line of a version-1 dump, members in the order written.
#[derive(Serialize)]
struct HeaderLine<'a> {
    format: &'a str,
    version: u64,
    rank: usize,
    world: usize,
    generation: u64,
    reason: &'a str,
    dumped_at_ns: u64,
    capacity: u64,
    dropped: u64,
}

/// One entry line of a version-1 dump, members in the order written.
#[derive(Serialize)]
struct EntryLine<'a> {
    id: u64,
    seq: u64,
    op: &'a str,
    dtype: &'a str,
    count: u64,
    root: Option<usize>,
    peer: Option<usize>,
    reduce_op: Option<&'a str>,
    state: &'a str,
    error: Option<&'a str>,
    enqueued_ns: u64,
    started_ns: Option<u64>,
    completed_ns: Option<u64>,
    #[serde(skip_serializing_if = "<[usize]>::is_empty")]
    waiting_for: &'a [usize],
}

impl<'a> From<&'a FlightEntry> for EntryLine<'a> {
    fn from(entry: &'a FlightEntry) -> Self {
        let error = match &entry.state {
            EntryState::Failed(reason) => Some(reason.as_str()),
            _ => None,
        };
        EntryLine {
            id: entry.id.0,
            seq: entry.seq,
            op: &entry.op.kind,
            dtype: &entry.op.dtype,
            count: entry.op.count,
            root: entry.op.root,
            peer: entry.op.peer,
            reduce_op: entry.op.reduce_op.as_deref(),
            state: entry.state.name(),
            error,
            enqueued_ns: unix_nanos(entry.enqueued_at),
            started_ns: entry.started_at.map(unix_nanos),
            completed_ns: entry.completed_at.map(unix_nanos),
            waiting_for: &entry.waiting_for,
        }
    }
}

/// Compact one-line JSON of a line struct, which always serializes.
fn to_line(line: &impl Serialize) -> String {
    serde_json::to_string(line).expect("dump lines have string keys and no floats")
}

impl RankDump {
    /// The file name of this dump, `chorus-trace-g<generation>-r<rank>.json`.
    pub fn file_name(&self) -> String {
        dump_file_name(self.generation, self.rank)
    }

    /// The dump in the version-1 format (see the module docs).
    pub fn encode(&self) -> Vec<u8> {
        let header = to_line(&HeaderLine {
            format: FORMAT,
            version: VERSION,
            rank: self.rank,
            world: self.world,
            generation: self.generation,
            reason: &self.reason,
            dumped_at_ns: unix_nanos(self.dumped_at),
            capacity: self.capacity,
            dropped: self.dropped,
        });
        // The header object without its closing brace, then the entries one
        // per line: still one JSON document.
        let mut out = format!("{},\"entries\":[\n", &header[..header.len() - 1]);
        for (i, entry) in self.entries.iter().enumerate() {
            let separator = if i + 1 < self.entries.len() { ",\n" } else { "\n" };
            out.push_str(&to_line(&EntryLine::from(entry)));
            out.push_str(separator);
        }
        out.push_str("]}\n");
        out.into_bytes()
    }

    /// Reads a dump, checking every member it relies on; members it does
    /// not know are ignored.
    ///
    /// It reads a [`Value`] and then the members one by one, rather than
    /// deserializing the line structs, so that each problem names its entry
    /// and member ([`DumpError::Member`], [`DumpError::Invalid`]).
    pub fn parse(bytes: &[u8]) -> Result<Self, DumpError> {
        let doc: Value = serde_json::from_slice(bytes)?;
        if doc.get("format").and_then(Value::as_str) != Some(FORMAT) {
            return Err(DumpError::NotADump);
        }
        let at = "header";
        let version = uint(&doc, at, "version")?;
        if version != VERSION {
            return Err(DumpError::Version(version));
        }
        let rank = index(&doc, at, "rank")?;
        let world = index(&doc, at, "world")?;
        if rank >= world {
            return Err(invalid(
                at,
                format!("rank {rank} is out of range for world size {world}"),
            ));
        }
        let entries = doc
            .get("entries")
            .and_then(Value::as_array)
            .ok_or_else(|| member(at, "entries", "an array"))?
            .iter()
            .enumerate()
            .map(|(i, entry)| parse_entry(entry, &format!("entry {i}")))
            .collect::<Result<_, _>>()?;
        Ok(RankDump {
            rank,
            world,
            generation: uint(&doc, at, "generation")?,
            reason: string(&doc, at, "reason")?,
            dumped_at: time(uint(&doc, at, "dumped_at_ns")?),
            capacity: uint(&doc, at, "capacity")?,
            dropped: uint(&doc, at, "dropped")?,
            entries,
        })
    }
}

/// `chorus-trace-g<generation>-r<rank>.json`.
pub fn dump_file_name(generation: u64, rank: usize) -> String {
    format!("chorus-trace-g{generation}-r{rank}.json")
}

/// The generation and rank a dump's file name carries, or `None` for a file
/// that is not a dump.
pub fn parse_dump_file_name(name: &str) -> Option<(u64, usize)> {
    let rest = name.strip_prefix("chorus-trace-g")?.strip_suffix(".json")?;
    let (generation, rank) = rest.split_once("-r")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(generation) || !digits(rank) {
        return None;
    }
    Some((generation.parse().ok()?, rank.parse().ok()?))
}

/// Writes `dump` to `dir/<dump.file_name()>`, creating `dir` if needed.
///
/// It writes a hidden temporary file, syncs it and renames it into place,
/// so a reader never sees half a dump, even if this process dies meanwhile.
pub fn write_dump(dir: &Path, dump: &RankDump) -> io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let name = dump.file_name();
    let path = dir.join(&name);
    // The pid keeps two processes that claim one rank (a misconfigured
    // job) from writing one temporary file.
    let temporary = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = std::fs::File::create(&temporary).and_then(|mut file| {
        file.write_all(&dump.encode())?;
        file.sync_all()
    });
    match written.and_then(|()| std::fs::rename(&temporary, &path)) {
        Ok(()) => Ok(path),
        Err(error) => {
            // Best effort: the error that matters is the one above.
            let _ = std::fs::remove_file(&temporary);
            Err(error)
        }
    }
}

fn parse_entry(value: &Value, at: &str) -> Result<FlightEntry, DumpError> {
    let started_at = optional(value, at, "started_ns", Value::as_u64, "an integer or null")?.map(time);
    let completed_at = optional(value, at, "completed_ns", Value::as_u64, "an integer or null")?.map(time);
    let error = optional(value, at, "error", Value::as_str, "a string or null")?;
    let state = match string(value, at, "state")?.as_str() {
        "scheduled" => EntryState::Scheduled,
        "started" => EntryState::Started,
        "completed" => EntryState::Completed,
        "failed" => EntryState::Failed(
            error
                .ok_or_else(|| member(at, "error", "a string (the state is failed)"))?
                .to_string(),
        ),
        other => return Err(invalid(at, format!("unknown state {other:?}"))),
    };
    // The analysis relies on these: a started entry has a start time, an
    // ended one an end time.
    let needs_start = matches!(state, EntryState::Started | EntryState::Completed);
    if needs_start && started_at.is_none() {
        return Err(invalid(at, format!("state {} without started_ns", state.name())));
    }
    let ended = matches!(state, EntryState::Completed | EntryState::Failed(_));
    if ended && completed_at.is_none() {
        return Err(invalid(at, format!("state {} without completed_ns", state.name())));
    }
    let index_or_null = |name| -> Result<Option<usize>, DumpError> {
        optional(value, at, name, Value::as_u64, "a rank or null")?
            .map(|n| usize::try_from(n).map_err(|_| member(at, name, "a rank or null")))
            .transpose()
    };
    Ok(FlightEntry {
        id: EntryId(uint(value, at, "id")?),
        seq: uint(value, at, "seq")?,
        op: FlightOp {
            kind: string(value, at, "op")?,
            dtype: string(value, at, "dtype")?,
            count: uint(value, at, "count")?,
            root: index_or_null("root")?,
            peer: index_or_null("peer")?,
            reduce_op: optional(value, at, "reduce_op", Value::as_str, "a string or null")?.map(str::to_string),
        },
        state,
        enqueued_at: time(uint(value, at, "enqueued_ns")?),
        started_at,
        completed_at,
        // Absent when the entry waited for nobody.
        waiting_for: match value.get("waiting_for") {
            None => Vec::new(),
            Some(list) => list
                .as_array()
                .and_then(|ranks| {
                    ranks
                        .iter()
                        .map(|r| r.as_u64().and_then(|r| usize::try_from(r).ok()))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| member(at, "waiting_for", "a list of ranks"))?,
        },
    })
}

fn member(at: &str, member: &'static str, expected: &'static str) -> DumpError {
    DumpError::Member {
        at: at.to_string(),
        member,
        expected,
    }
}

fn invalid(at: &str, problem: String) -> DumpError {
    DumpError::Invalid {
        at: at.to_string(),
        problem,
    }
}

fn uint(value: &Value, at: &str, name: &'static str) -> Result<u64, DumpError> {
    value
        .get(name)
        .and_then(Value::as_u64)
        .ok_or_else(|| member(at, name, "an unsigned integer"))
}

fn index(value: &Value, at: &str, name: &'static str) -> Result<usize, DumpError> {
    usize::try_from(uint(value, at, name)?).map_err(|_| member(at, name, "a rank"))
}

fn string(value: &Value, at: &str, name: &'static str) -> Result<String, DumpError> {
    value
        .get(name)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| member(at, name, "a string"))
}

/// A member that may be `null` or absent.
fn optional<'v, T>(
    value: &'v Value,
    at: &str,
    name: &'static str,
    read: impl Fn(&'v Value) -> Option<T>,
    expected: &'static str,
) -> Result<Option<T>, DumpError> {
    match value.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => read(v).map(Some).ok_or_else(|| member(at, name, expected)),
    }
}

fn unix_nanos(t: SystemTime) -> u64 {
    // A clock before 1970 is broken; 0 still orders it first.
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn time(nanos: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(nanos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::{DType, ReduceOp};

    fn at(ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_700_000_000) + Duration::from_millis(ms)
    }

    fn all_reduce(count: u64) -> FlightOp {
        FlightOp {
            kind: "all_reduce".into(),
            dtype: "float32".into(),
            count,
            root: None,
            peer: None,
            reduce_op: Some("sum".into()),
        }
    }

    #[test]
    fn a_collective_recorded_by_its_signature_reads_as_its_op() {
        let signature = Signature {
            seq: 3,
            kind: CollectiveKind::AllReduce,
            dtype: DType::Float32,
            count: 2,
            root: None,
            reduce_op: Some(ReduceOp::Sum),
        };
        let (mut by_signature, mut by_op) = (FlightRecorder::new(4), FlightRecorder::new(4));
        for recorder in [&mut by_signature, &mut by_op] {
            recorder.record_scheduled(0, all_reduce(8), at(0));
        }
        let id = by_signature.record_signature(3, &signature, at(1));
        assert_eq!(id, by_op.record_scheduled(3, FlightOp::from(&signature), at(1)));
        for recorder in [&mut by_signature, &mut by_op] {
            recorder.record_started(id, at(2));
            recorder.record_failed(id, at(3), "timeout");
        }
        assert_eq!(by_signature.snapshot(), by_op.snapshot());
        assert_eq!(by_signature.snapshot()[1].op, all_reduce(2));
    }

    #[test]
    fn the_ring_keeps_the_newest_entries_and_counts_the_dropped() {
        let mut recorder = FlightRecorder::new(3);
        let ids: Vec<EntryId> = (0..5)
            .map(|seq| recorder.record_scheduled(seq, all_reduce(1), at(seq)))
            .collect();
        assert_eq!(ids, (0..5).map(EntryId).collect::<Vec<_>>());
        let seqs: Vec<u64> = recorder.snapshot().iter().map(|e| e.seq).collect();
        assert_eq!(seqs, [2, 3, 4]);
        assert_eq!(recorder.dropped(), 2);
        // An update of an entry that left the ring is a no-op, not a panic
        // or an update of another entry.
        recorder.record_completed(ids[0], at(10));
        assert!(recorder.snapshot().iter().all(|e| e.state == EntryState::Scheduled));
        recorder.record_completed(ids[3], at(10));
        assert_eq!(recorder.snapshot()[1].state, EntryState::Completed);
        recorder.record_started(EntryId(99), at(10));
        assert_eq!(recorder.snapshot().iter().filter(|e| e.entered()).count(), 1);
        // Oldest first after any number of wraps, each update on its own entry.
        for seq in 5..11 {
            let id = recorder.record_scheduled(seq, all_reduce(1), at(seq));
            recorder.record_completed(id, at(seq));
            let kept: Vec<(u64, bool)> = recorder
                .snapshot()
                .iter()
                .map(|e| (e.seq, e.state == EntryState::Completed))
                .collect();
            let want: Vec<(u64, bool)> = (seq - 2..=seq).map(|s| (s, s != 4)).collect();
            assert_eq!(kept, want, "after seq {seq}");
        }
    }

    #[test]
    fn capacity_zero_records_nothing() {
        let mut recorder = FlightRecorder::new(0);
        let id = recorder.record_scheduled(0, all_reduce(1), at(0));
        recorder.record_started(id, at(1));
        assert!(recorder.snapshot().is_empty());
        assert_eq!(recorder.dropped(), 1);
        assert_eq!(FlightRecorder::default().capacity(), DEFAULT_CAPACITY);
    }

    #[test]
    fn states_move_forward_only() {
        let mut recorder = FlightRecorder::new(8);
        let a = recorder.record_scheduled(0, all_reduce(1), at(0));
        assert!(!recorder.snapshot()[0].entered());
        recorder.record_started(a, at(1));
        assert!(recorder.snapshot()[0].unfinished());
        recorder.record_completed(a, at(3));
        // Late or repeated updates do not rewrite history.
        recorder.record_failed(a, at(4), "late");
        recorder.record_started(a, at(5));
        let entry = &recorder.snapshot()[0];
        assert_eq!(entry.state, EntryState::Completed);
        assert_eq!(
            (entry.enqueued_at, entry.started_at, entry.completed_at),
            (at(0), Some(at(1)), Some(at(3)))
        );
        assert!(!entry.unfinished());

        let b = recorder.record_scheduled(1, all_reduce(1), at(6));
        recorder.record_started(b, at(7));
        recorder.record_failed(b, at(9), "timed out after 2ms");
        recorder.record_completed(b, at(10));
        let entry = &recorder.snapshot()[1];
        assert_eq!(entry.state, EntryState::Failed("timed out after 2ms".into()));
        assert_eq!(entry.completed_at, Some(at(9)));
        assert!(entry.unfinished(), "failed inside it");

        // Aborted while queued: never entered.
        let c = recorder.record_scheduled(2, all_reduce(1), at(11));
        recorder.record_failed(c, at(12), "group aborted");
        assert!(!recorder.snapshot()[2].entered());

        // Completed without a recorded start: it ran, so it was entered.
        let d = recorder.record_scheduled(3, all_reduce(1), at(13));
        recorder.record_completed(d, at(14));
        assert_eq!(recorder.snapshot()[3].started_at, Some(at(14)));
    }

    #[test]
    fn ops_come_from_signatures_with_p2p_peers_apart() {
        let signature = Signature {
            seq: 7,
            kind: CollectiveKind::AllReduce,
            dtype: DType::Float32,
            count: 1 << 20,
            root: None,
            reduce_op: Some(ReduceOp::Sum),
        };
        let op = FlightOp::from(&signature);
        assert_eq!(op, all_reduce(1 << 20));
        assert_eq!(op.to_string(), "all_reduce(1048576 x float32, sum)");
        let broadcast = FlightOp::from(&Signature {
            kind: CollectiveKind::Broadcast,
            root: Some(2),
            reduce_op: None,
            dtype: DType::Int64,
            count: 4,
            ..signature
        });
        assert_eq!((broadcast.root, broadcast.peer), (Some(2), None));
        assert_eq!(broadcast.to_string(), "broadcast(4 x int64, root 2)");
        let send = FlightOp::from(&Signature {
            kind: CollectiveKind::Send,
            root: Some(1),
            reduce_op: None,
            ..signature
        });
        assert!(send.is_p2p());
        assert_eq!(send.to_string(), "send(1048576 x float32) to rank 1");
        let recv = FlightOp {
            kind: "recv".into(),
            ..send
        };
        assert_eq!(recv.to_string(), "recv(1048576 x float32) from rank 1");
        let barrier = FlightOp::from(&Signature {
            kind: CollectiveKind::Barrier,
            reduce_op: None,
            count: 0,
            ..signature
        });
        assert_eq!(barrier.to_string(), "barrier");
    }

    fn sample_dump() -> RankDump {
        let mut recorder = FlightRecorder::new(4);
        for seq in 0..5 {
            let id = recorder.record_scheduled(seq, all_reduce(1024), at(seq * 10));
            recorder.record_started(id, at(seq * 10 + 1));
            recorder.record_completed(id, at(seq * 10 + 2));
        }
        let stuck = recorder.record_scheduled(5, all_reduce(1024), at(60));
        recorder.record_started(stuck, at(61));
        recorder.record_failed(stuck, at(30_061), "timed out after 30s; \"rank 2\"\n\tdid not answer");
        let send = FlightOp {
            kind: "send".into(),
            dtype: "bfloat16".into(),
            count: 3,
            root: None,
            peer: Some(0),
            reduce_op: None,
        };
        recorder.record_scheduled(0, send, at(30_062));
        recorder.dump(1, 4, 2, "timeout: é", at(30_100))
    }

    #[test]
    fn dumps_round_trip() {
        let dump = sample_dump();
        assert_eq!(dump.dropped, 3);
        let bytes = dump.encode();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.starts_with("{\"format\":\"chorus-flight-recorder\",\"version\":1,\"rank\":1,"));
        assert_eq!(
            text.lines().count(),
            2 + dump.entries.len(),
            "one line per entry:\n{text}"
        );
        assert_eq!(RankDump::parse(&bytes), Ok(dump.clone()));
        // Any JSON reader reads it too: the whole file is one document.
        assert!(serde_json::from_slice::<Value>(&bytes).is_ok());
        let empty = FlightRecorder::new(4).dump(0, 1, 0, "abort", at(0));
        assert_eq!(RankDump::parse(&empty.encode()), Ok(empty));
        // Nanosecond times keep all 64 bits (a double would round them).
        let late = RankDump {
            dumped_at: time(u64::MAX - 1),
            ..sample_dump()
        };
        let text = String::from_utf8(late.encode()).unwrap();
        assert!(text.contains("\"dumped_at_ns\":18446744073709551614,"), "{text}");
        assert_eq!(RankDump::parse(text.as_bytes()), Ok(late));
    }

    #[test]
    fn unknown_members_are_ignored() {
        let text = String::from_utf8(sample_dump().encode()).unwrap();
        let extended = text
            .replacen("\"version\":1,", "\"version\":1,\"host\":\"node7\",", 1)
            .replace("\"id\":", "\"future\":[1,{}],\"id\":");
        assert_eq!(RankDump::parse(extended.as_bytes()), Ok(sample_dump()));
    }

    #[test]
    fn garbage_and_truncated_dumps_are_typed_errors() {
        let bytes = sample_dump().encode();
        for end in 0..bytes.len() - 1 {
            let error = RankDump::parse(&bytes[..end]).expect_err("a truncated dump parsed");
            assert!(matches!(error, DumpError::Json(_)), "{end}: {error}");
        }
        assert!(matches!(RankDump::parse(b"\x00\xffgarbage"), Err(DumpError::Json(_))));
        // Nesting past the parser's recursion limit is an error, not a
        // stack overflow.
        let deep = [vec![b'['; 100_000], vec![b']'; 100_000]].concat();
        assert!(matches!(RankDump::parse(&deep), Err(DumpError::Json(_))));
        let mut nested = text_with_deep_member(&bytes, 100_000);
        assert!(matches!(RankDump::parse(nested.as_bytes()), Err(DumpError::Json(_))));
        // Shallow unknown nesting, as a newer writer might add, still reads.
        nested = text_with_deep_member(&bytes, 8);
        assert!(RankDump::parse(nested.as_bytes()).is_ok());
        assert_eq!(RankDump::parse(b"{\"entries\":[]}"), Err(DumpError::NotADump));
        assert_eq!(RankDump::parse(b"[1,2]"), Err(DumpError::NotADump));
        let text = String::from_utf8(bytes).unwrap();
        let edit = |from: &str, to: &str| RankDump::parse(text.replacen(from, to, 1).as_bytes()).unwrap_err();
        assert_eq!(edit("\"version\":1", "\"version\":2"), DumpError::Version(2));
        assert_eq!(
            edit("\"rank\":1", "\"rank\":4"),
            invalid("header", "rank 4 is out of range for world size 4".into())
        );
        assert_eq!(
            edit("\"world\":4", "\"world\":\"4\""),
            member("header", "world", "an unsigned integer")
        );
        assert_eq!(
            edit(",\"entries\":[", ",\"entries\":{}, \"x\":["),
            member("header", "entries", "an array")
        );
        assert_eq!(
            edit("\"state\":\"completed\"", "\"state\":\"done\""),
            invalid("entry 0", "unknown state \"done\"".into())
        );
        assert_eq!(
            edit("\"root\":null", "\"root\":\"x\""),
            member("entry 0", "root", "a rank or null")
        );
        assert_eq!(
            edit("\"started_ns\":1700000000031000000", "\"started_ns\":null"),
            invalid("entry 0", "state completed without started_ns".into())
        );
        let failed = text.replace("\"error\":\"timed out", "\"error\":null,\"x\":\"");
        assert_eq!(
            RankDump::parse(failed.as_bytes()),
            Err(member("entry 2", "error", "a string (the state is failed)"))
        );
    }

    /// The dump with an unknown header member nested `depth` arrays deep.
    fn text_with_deep_member(bytes: &[u8], depth: usize) -> String {
        let text = std::str::from_utf8(bytes).unwrap();
        let member = format!("\"deep\":{}{},", "[".repeat(depth), "]".repeat(depth));
        text.replacen("\"version\":1,", &format!("\"version\":1,{member}"), 1)
    }

    #[test]
    fn file_names_carry_generation_and_rank() {
        assert_eq!(dump_file_name(3, 12), "chorus-trace-g3-r12.json");
        assert_eq!(parse_dump_file_name("chorus-trace-g3-r12.json"), Some((3, 12)));
        for other in [
            "chorus-trace-g3-r12.json.tmp",
            ".chorus-trace-g3-r12.json.1.tmp",
            "chorus-trace-g-r1.json",
            "chorus-trace-g1-r+1.json",
            "chorus-trace-g1-r1-r2.json",
            "notes.txt",
            "chorus-trace-g99999999999999999999-r1.json",
        ] {
            assert_eq!(parse_dump_file_name(other), None, "{other}");
        }
    }

    #[test]
    fn write_dump_is_atomic_and_readable() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("nested/traces");
        let dump = sample_dump();
        let path = write_dump(&target, &dump).unwrap();
        assert_eq!(path, target.join("chorus-trace-g2-r1.json"));
        assert_eq!(RankDump::parse(&std::fs::read(&path).unwrap()), Ok(dump.clone()));
        // Rewriting replaces it and leaves no temporary file behind.
        write_dump(&target, &dump).unwrap();
        let names: Vec<_> = std::fs::read_dir(&target)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["chorus-trace-g2-r1.json"]);
    }
}
