//! Fault injection: a [`Link`] wrapper that drops, delays, corrupts,
//! partitions, closes, kills or freezes, deterministically under a seed.
//!
//! Driven by an API ([`FaultPlan::parse`], [`wrap_links`]; the `chorus`
//! library's `InitOptions::faults`) or by the `CHORUS_FAULTS` environment
//! variable (which that library reads), same grammar: rules separated by
//! `;`, each `kind(arguments)`, plus an optional `seed=N`.
//!
//! ```text
//! seed=7; drop(0->1, p=0.25); delay(*->2, ms=40, jitter_ms=10);
//! partition(0,1|2,3, after=500ms); close(1<->2, after_frames=100);
//! kill(rank=3, after=2s); freeze(rank=1, after_frames=20);
//! corrupt(1->0, p=1, after_frames=30, times=1); corrupt(rank=2, step=40, what=grads)
//! ```
//!
//! - Links: `A->B` (frames A sends to B), `A<->B` (both ways), `*` for any rank.
//! - `drop(link, p=P)`: loses a frame with probability P (default 1). Links
//!   are reliable streams that never re-send, so a lost frame breaks the
//!   link, as on a real connection: it closes as lost
//!   ([`TransportError::Closed`] on both sides) and supervision acts at once.
//! - `delay(link, ms=D[, jitter_ms=J])`: holds each frame D..D+J ms.
//! - `corrupt(link, p=P[, times=K])`: flips one bit of a data frame's payload
//!   with probability P (default 1), at most K times on each link (default:
//!   no limit). Heartbeats, empty frames and frames tagged `u64::MAX` (the
//!   collectives' signatures, also the first 32 bytes of a data frame whose
//!   tag has its top bit set) pass untouched, so the protocol's framing
//!   holds and only tensor bytes change: what a checksum must catch.
//! - `corrupt(rank=R, step=S[, what=params|grads][, bit=B])`: silent data
//!   corruption, which the links never see: rank R flips one bit of its own
//!   state at committed step S, in its parameters (default) or in its
//!   local gradient before it is summed. The links carry the rule; the
//!   training loop (`chorus::train`) reads it ([`FaultPlan::state_corruptions`])
//!   and carries it out. Bit B of the element (default: the top bit of the
//!   mantissa for parameters, silent; the top bit of the exponent for
//!   gradients, a far outlier).
//! - `partition(ranks|ranks)`: frames between the two sides are lost,
//!   heartbeats too, so each side takes the other for failed within the
//!   heartbeat window (the links stay open, as across a real partition).
//! - `close(link)`: cuts the connection (both sides see a lost link).
//! - `kill(rank=R)`: rank R dies: every link of it closes, and when it is a
//!   process of its own (a non-local link), the process gets SIGKILL.
//! - `freeze(rank=R)`: rank R stops: its sends and receives never complete,
//!   and it closes no link (as under SIGSTOP, but also for ranks that share
//!   a process, whose own deadlines still run).
//! - Triggers, on any rule: `after=T` (`ms` or `s`, since the wrapper was made)
//!   and `after_frames=N` (frames this rank sent on the matching link, or on
//!   all its links for `kill`/`freeze`); a rule acts once both hold.
//!   `kill` and `freeze` may instead strike a rank as it receives:
//!   `after_received=N` acts on the first frame it receives (heartbeats
//!   aside, on any link) once it has received N, which it never gets: a
//!   rank that only receives for a while (a joiner taking in the state)
//!   can die or stop in the middle of it.
//!
//! The decision ([`FaultPlan::decide`]) is a pure function of the rule, the
//! link, the frame count, the elapsed time and a per-link random stream.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use thiserror::Error;
use tokio::time::Instant;

use crate::link::{ChannelId, CloseNotice, Frame, HEARTBEAT_CHANNEL, Link, SendError, TransportError, TransportKind};

/// A fault specification that could not be parsed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("bad fault rule {rule:?}{}: {reason}", where_in(rule, *at))]
pub struct FaultSpecError {
    /// The rule as written.
    pub rule: String,
    /// The byte offset in `rule` where it stops making sense, when one
    /// place is to blame.
    pub at: Option<usize>,
    /// What is wrong with it.
    pub reason: String,
}

impl FaultSpecError {
    fn at(rule: &str, at: usize, reason: String) -> Self {
        Self {
            rule: rule.to_string(),
            at: Some(at),
            reason,
        }
    }
}

/// ` at character N ("the rest")`: where in `rule` an error is, as a
/// person counts (from 1), with the text from there on.
fn where_in(rule: &str, at: Option<usize>) -> String {
    let Some(at) = at.filter(|&at| rule.is_char_boundary(at)) else {
        return String::new();
    };
    let column = rule[..at].chars().count() + 1;
    match &rule[at..] {
        "" => format!(" at its end (character {column})"),
        rest => format!(" at character {column} ({rest:?})"),
    }
}

/// Which frames a rule applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkMatch {
    /// Frames from a rank (`None`: any) to a rank (`None`: any).
    Directed(Option<usize>, Option<usize>),
    /// Frames either way between two ranks.
    Both(usize, usize),
    /// Frames from one side of a partition to the other.
    Partition(Vec<usize>, Vec<usize>),
    /// Every frame a rank sends (for `kill` and `freeze`).
    Rank(usize),
}

impl LinkMatch {
    fn matches(&self, from: usize, to: usize) -> bool {
        match self {
            LinkMatch::Directed(a, b) => a.is_none_or(|a| a == from) && b.is_none_or(|b| b == to),
            LinkMatch::Both(a, b) => (from, to) == (*a, *b) || (from, to) == (*b, *a),
            LinkMatch::Partition(left, right) => {
                (left.contains(&from) && right.contains(&to)) || (right.contains(&from) && left.contains(&to))
            }
            LinkMatch::Rank(rank) => *rank == from,
        }
    }
}

/// What a rule does.
#[derive(Debug, Clone, PartialEq)]
pub enum FaultKind {
    /// Lose frames with this probability.
    Drop(f64),
    /// Hold frames for a base time plus up to a jitter.
    Delay(Duration, Duration),
    /// Flip one payload bit of data frames with this probability, at most
    /// this many times per link.
    Corrupt(f64, u64),
    /// Lose every frame (a partition).
    Partition,
    /// Close the connection.
    Close,
    /// The rank dies.
    Kill,
    /// The rank stops.
    Freeze,
    /// A bit of the rank's own training state flipped at a step (its
    /// [`FaultRule::link`] is [`LinkMatch::Rank`]); frames pass untouched.
    CorruptState {
        /// The committed step.
        step: u64,
        /// Which state.
        target: StateTarget,
        /// Which bit of the element; `None`: the target's default.
        bit: Option<u32>,
    },
}

/// The state a [`FaultKind::CorruptState`] rule flips a bit of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StateTarget {
    /// The parameters.
    Params,
    /// The rank's local gradient, before it is summed with the others'.
    Grads,
}

impl StateTarget {
    /// Its name in rules (`what=`).
    pub fn name(self) -> &'static str {
        match self {
            StateTarget::Params => "params",
            StateTarget::Grads => "grads",
        }
    }
}

/// One `corrupt(rank=R, step=S, ...)` rule, for the training loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StateCorruption {
    /// The rank (in the generation that runs the step).
    pub rank: usize,
    /// The committed step.
    pub step: u64,
    /// Which state.
    pub target: StateTarget,
    /// Which bit of the element; `None`: the target's default.
    pub bit: Option<u32>,
}

/// One rule: what, where, and when it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultRule {
    /// What it does.
    pub kind: FaultKind,
    /// Which frames it applies to.
    pub link: LinkMatch,
    /// It acts only this long after the wrapper was made.
    pub after: Duration,
    /// It acts only once this many frames were sent on the matching link.
    pub after_frames: u64,
    /// `kill` and `freeze` only: it acts on a frame the rank receives, once
    /// the rank received this many (heartbeats aside); 0: on a send, as
    /// the other rules.
    pub after_received: u64,
    /// The rule as written, for errors.
    pub text: String,
}

/// What to do with one frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Deliver it.
    Deliver,
    /// Lose it silently (the sender sees success): a partition.
    Drop,
    /// Lose it, which breaks the link (a reliable stream that lost a frame
    /// is a lost connection).
    Break,
    /// Deliver it after this long.
    Delay(Duration),
    /// Deliver it with one payload bit flipped, unless the link already
    /// corrupted this many frames.
    Corrupt(u64),
    /// Close the link instead.
    Close,
    /// The sending rank dies.
    Kill,
    /// The sending rank stops.
    Freeze,
}

/// A parsed set of rules and the seed of their randomness.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FaultPlan {
    /// The rules, in the order written; the first that acts wins.
    pub rules: Vec<FaultRule>,
    /// Seed of the per-link random streams.
    pub seed: u64,
}

/// A rank, or `*` for any (`None`); `Err` says what the text is instead.
fn parse_rank(text: &str) -> Result<Option<usize>, String> {
    let text = text.trim();
    if text == "*" {
        return Ok(None);
    }
    text.parse()
        .map(Some)
        .map_err(|_| format!("{text:?} is not a rank or *"))
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration like 250ms or 2s");
    let text = text.trim();
    if let Some(ms) = text.strip_suffix("ms") {
        return ms.trim().parse::<u64>().map(Duration::from_millis).map_err(|_| bad());
    }
    if let Some(s) = text.strip_suffix('s') {
        return s
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| *s >= 0.0 && s.is_finite())
            .map(Duration::from_secs_f64)
            .ok_or_else(bad);
    }
    Err(bad())
}

/// A piece of a rule as written and the byte offset where it starts.
#[derive(Debug, Clone, Copy)]
struct Piece<'a> {
    text: &'a str,
    at: usize,
}

/// A rule split into its kind and arguments, before their meaning is read:
/// `kind(positional, ..., name=value, ...)`.
struct RuleSyntax<'a> {
    kind: Piece<'a>,
    positional: Vec<Piece<'a>>,
    /// Name, value.
    named: Vec<(Piece<'a>, Piece<'a>)>,
    /// Where the closing parenthesis is: a missing argument is missed there.
    close: usize,
}

impl<'a> RuleSyntax<'a> {
    /// Splits `rule`, failing at the first character that does not fit the
    /// grammar: a rule whose arguments run together (`delay(0->1 ms=5)`)
    /// is blamed where they meet, not for the argument that then seems
    /// missing.
    fn split(rule: &'a str) -> Result<Self, FaultSpecError> {
        let mut cursor = Cursor { rule, i: 0 };
        let kind = cursor.kind()?;
        let (mut positional, mut named) = (Vec::new(), Vec::<(Piece, Piece)>::new());
        loop {
            cursor.skip_ws();
            let Some(c) = cursor.peek() else {
                return Err(cursor.bad(cursor.i, "missing closing parenthesis".into()));
            };
            if c == b')' && positional.is_empty() && named.is_empty() {
                break;
            }
            let start = cursor.i;
            if c.is_ascii_alphabetic() || c == b'_' {
                let (key, value) = cursor.named()?;
                if let Some((earlier, _)) = named.iter().find(|(k, _)| k.text == key.text) {
                    return Err(cursor.bad(key.at, format!("{} is given twice", earlier.text)));
                }
                named.push((key, value));
            } else {
                positional.push(cursor.positional()?);
            }
            let last = &rule[start..cursor.i];
            cursor.skip_ws();
            match cursor.peek() {
                Some(b',') => cursor.i += 1,
                Some(b')') => break,
                None => return Err(cursor.bad(cursor.i, "missing closing parenthesis".into())),
                Some(_) => return Err(cursor.bad(cursor.i, format!("expected , or ) after {last}"))),
            }
        }
        let close = cursor.i;
        cursor.i = close + 1;
        cursor.skip_ws();
        if cursor.i < rule.len() {
            return Err(cursor.bad(cursor.i, "unexpected text after the closing parenthesis".into()));
        }
        Ok(Self {
            kind,
            positional,
            named,
            close,
        })
    }
}

/// Where [`RuleSyntax::split`] is in a rule: `i` is a byte offset.
struct Cursor<'a> {
    rule: &'a str,
    i: usize,
}

/// A byte of a kind or an argument's name.
fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

impl<'a> Cursor<'a> {
    fn bad(&self, at: usize, reason: String) -> FaultSpecError {
        FaultSpecError::at(self.rule, at, reason)
    }

    fn peek(&self) -> Option<u8> {
        self.rule.as_bytes().get(self.i).copied()
    }

    fn skip_ws(&mut self) {
        self.i = self.run(self.i, |b| b.is_ascii_whitespace());
    }

    /// Where the bytes from `i` on that `fits` stop.
    fn run(&self, mut i: usize, fits: impl Fn(u8) -> bool) -> usize {
        let bytes = self.rule.as_bytes();
        while i < bytes.len() && fits(bytes[i]) {
            i += 1;
        }
        i
    }

    /// The piece of the rule from `start` to the cursor.
    fn piece_from(&self, start: usize) -> Piece<'a> {
        Piece {
            text: &self.rule[start..self.i],
            at: start,
        }
    }

    /// The kind, at the start, and the opening parenthesis after it.
    fn kind(&mut self) -> Result<Piece<'a>, FaultSpecError> {
        self.i = self.run(0, is_word);
        if self.i == 0 {
            return Err(self.bad(0, "expected kind(arguments), like drop(0->1)".into()));
        }
        let kind = self.piece_from(0);
        self.skip_ws();
        if self.peek() != Some(b'(') {
            return Err(self.bad(self.i, format!("expected ( after {}: kind(arguments)", kind.text)));
        }
        self.i += 1;
        Ok(kind)
    }

    /// A `name=value` argument: its name and value.
    fn named(&mut self) -> Result<(Piece<'a>, Piece<'a>), FaultSpecError> {
        let start = self.i;
        self.i = self.run(start, is_word);
        let key = self.piece_from(start);
        self.skip_ws();
        if self.peek() != Some(b'=') {
            return Err(self.bad(self.i, format!("expected = after {}", key.text)));
        }
        self.i += 1;
        self.skip_ws();
        let start = self.i;
        self.i = self.run(start, |b| !b.is_ascii_whitespace() && b != b',' && b != b')');
        if self.i == start {
            return Err(self.bad(start, format!("expected a value for {}=", key.text)));
        }
        Ok((key, self.piece_from(start)))
    }

    /// Ranks (or `*`) joined by `->`, `<->` or `|`, spaces allowed around
    /// the joins: a link, or a piece of a partition's sides (`0,1|2,3` is
    /// three of them).
    fn positional(&mut self) -> Result<Piece<'a>, FaultSpecError> {
        let item = |i: usize| self.run(i, |b| b.is_ascii_digit() || b == b'*');
        let start = self.i;
        let mut end = item(start);
        if end == start {
            return Err(self.bad(
                start,
                "expected an argument: a link like 0->1, ranks like 0,1|2,3, or name=value".into(),
            ));
        }
        loop {
            let j = self.run(end, |b| b.is_ascii_whitespace());
            let join = ["<->", "->", "|"].into_iter().find(|j2| self.rule[j..].starts_with(j2));
            let Some(join) = join else {
                if matches!(self.rule.as_bytes().get(j), Some(b'-' | b'<' | b'>' | b'=')) {
                    return Err(self.bad(j, "expected -> or <-> between two ranks".into()));
                }
                break;
            };
            let k = self.run(j + join.len(), |b| b.is_ascii_whitespace());
            end = item(k);
            if end == k {
                return Err(self.bad(k, format!("expected a rank or * after {join}")));
            }
        }
        self.i = end;
        Ok(self.piece_from(start))
    }
}

/// A split rule while the meaning of its arguments is read: each named
/// argument is taken once, so those left at the end are unknown.
struct RuleArgs<'a> {
    rule: &'a str,
    syntax: RuleSyntax<'a>,
}

impl<'a> RuleArgs<'a> {
    fn bad(&self, at: usize, reason: &str) -> FaultSpecError {
        FaultSpecError::at(self.rule, at, reason.to_string())
    }

    /// Takes the named argument `key`, if given.
    fn take(&mut self, key: &str) -> Option<Piece<'a>> {
        let found = self.syntax.named.iter().position(|(k, _)| k.text == key)?;
        Some(self.syntax.named.remove(found).1)
    }

    /// A number given as `value`, or `default` when it is not given;
    /// `reason` says what is wrong with one that does not parse.
    fn parse_number<T: std::str::FromStr>(
        &self,
        value: Option<Piece>,
        default: T,
        reason: &str,
    ) -> Result<T, FaultSpecError> {
        value.map_or(Ok(default), |v| v.text.parse().map_err(|_| self.bad(v.at, reason)))
    }

    /// The named number `key`, or `default` when it is not given.
    fn number<T: std::str::FromStr>(&mut self, key: &str, default: T, reason: &str) -> Result<T, FaultSpecError> {
        let value = self.take(key);
        self.parse_number(value, default, reason)
    }

    /// The named number `key`, which must be given (`missing` says so).
    fn required_number(&mut self, key: &str, missing: &str, reason: &str) -> Result<u64, FaultSpecError> {
        let value = self.take(key).ok_or_else(|| self.bad(self.syntax.close, missing))?;
        self.parse_number(Some(value), 0, reason)
    }

    /// `p=P`, a probability (default 1).
    fn probability(&mut self) -> Result<f64, FaultSpecError> {
        match self.take("p") {
            Some(p) => p
                .text
                .parse::<f64>()
                .ok()
                .filter(|v| (0.0..=1.0).contains(v))
                .ok_or_else(|| self.bad(p.at, "p must be between 0 and 1")),
            None => Ok(1.0),
        }
    }

    /// `rank=R`, which must be given and be a number, not `*`.
    fn rank(&mut self) -> Result<usize, FaultSpecError> {
        let rank = self
            .take("rank")
            .ok_or_else(|| self.bad(self.syntax.close, "needs rank=R"))?;
        let number = parse_rank(rank.text).map_err(|reason| self.bad(rank.at, &reason))?;
        number.ok_or_else(|| self.bad(rank.at, "rank must be a number"))
    }

    /// What the rule does, and the frames it applies to where its kind
    /// decides them (`None`: the link its positional argument names).
    fn kind_and_link(&mut self) -> Result<(FaultKind, Option<LinkMatch>), FaultSpecError> {
        let kind = match self.syntax.kind.text {
            "drop" => FaultKind::Drop(self.probability()?),
            "corrupt" if self.syntax.named.iter().any(|(k, _)| k.text == "rank") => {
                return self.state_corruption();
            }
            "corrupt" => {
                let p = self.probability()?;
                FaultKind::Corrupt(p, self.number("times", u64::MAX, "times must be an integer")?)
            }
            "delay" => {
                let ms = self.required_number("ms", "delay needs ms=D", "ms must be an integer")?;
                let jitter = self.number("jitter_ms", 0, "jitter_ms must be an integer")?;
                FaultKind::Delay(Duration::from_millis(ms), Duration::from_millis(jitter))
            }
            "partition" => return Ok((FaultKind::Partition, Some(self.partition()?))),
            "close" => FaultKind::Close,
            "kill" => return Ok((FaultKind::Kill, Some(LinkMatch::Rank(self.rank()?)))),
            "freeze" => return Ok((FaultKind::Freeze, Some(LinkMatch::Rank(self.rank()?)))),
            other => {
                return Err(self.bad(
                    self.syntax.kind.at,
                    &format!("unknown kind {other:?}; use drop, delay, corrupt, partition, close, kill or freeze"),
                ));
            }
        };
        Ok((kind, None))
    }

    /// `corrupt(rank=R, step=S[, what=params|grads][, bit=B])`: a flip in
    /// the rank's own state, which no link sees.
    fn state_corruption(&mut self) -> Result<(FaultKind, Option<LinkMatch>), FaultSpecError> {
        let rank = self.rank()?;
        let step = self.required_number("step", "corrupt(rank=R) needs step=S", "step must be an integer")?;
        let target = match self.take("what") {
            None => StateTarget::Params,
            Some(w) if w.text == "params" => StateTarget::Params,
            Some(w) if w.text == "grads" => StateTarget::Grads,
            Some(w) => return Err(self.bad(w.at, "what must be params or grads")),
        };
        let bit = match self.take("bit") {
            None => None,
            Some(b) => Some(
                b.text
                    .parse::<u32>()
                    .ok()
                    .filter(|b| *b < 64)
                    .ok_or_else(|| self.bad(b.at, "bit must be an integer from 0 to 63"))?,
            ),
        };
        if let Some(link_only) = self.take("p").or_else(|| self.take("times")) {
            return Err(self.bad(
                link_only.at,
                "p and times apply to a link's corruption, not a rank's state",
            ));
        }
        let kind = FaultKind::CorruptState { step, target, bit };
        Ok((kind, Some(LinkMatch::Rank(rank))))
    }

    /// `partition(0,1|2,3)`: its two sides, from the positional arguments.
    fn partition(&self) -> Result<LinkMatch, FaultSpecError> {
        let mut sides = [Vec::new(), Vec::new()];
        let mut side = 0;
        for piece in &self.syntax.positional {
            for (n, ranks) in piece.text.split('|').enumerate() {
                side += usize::from(n > 0);
                let rank = ranks
                    .trim()
                    .parse()
                    .map_err(|_| self.bad(piece.at, "sides list ranks"))?;
                match sides.get_mut(side) {
                    Some(list) => list.push(rank),
                    None => return Err(self.bad(piece.at, "write partition(0,1|2,3)")),
                }
            }
        }
        let at = self.syntax.positional.first().map_or(self.syntax.close, |p| p.at);
        if side != 1 || sides.iter().any(Vec::is_empty) {
            return Err(self.bad(at, "write partition(0,1|2,3)"));
        }
        let [left, right] = sides;
        Ok(LinkMatch::Partition(left, right))
    }

    /// The one link the positional argument names: `A->B`, `A<->B`.
    fn link(&self) -> Result<LinkMatch, FaultSpecError> {
        let spec = match self.syntax.positional.as_slice() {
            [spec] => spec,
            [_, extra, ..] => return Err(self.bad(extra.at, "name one link, like 0->1, 0<->1 or *->2")),
            [] => return Err(self.bad(self.syntax.close, "name one link, like 0->1, 0<->1 or *->2")),
        };
        let rank = |text: &str| parse_rank(text).map_err(|reason| self.bad(spec.at, &reason));
        if let Some((a, b)) = spec.text.split_once("<->") {
            match (rank(a)?, rank(b)?) {
                (Some(a), Some(b)) => Ok(LinkMatch::Both(a, b)),
                _ => Err(self.bad(spec.at, "<-> needs two ranks; use -> with * instead")),
            }
        } else if let Some((a, b)) = spec.text.split_once("->") {
            Ok(LinkMatch::Directed(rank(a)?, rank(b)?))
        } else {
            Err(self.bad(spec.at, "name one link, like 0->1, 0<->1 or *->2"))
        }
    }
}

impl FaultPlan {
    /// Parses the `CHORUS_FAULTS` grammar (see the module docs).
    pub fn parse(spec: &str) -> Result<Self, FaultSpecError> {
        let mut plan = FaultPlan::default();
        for rule in spec.split(';').map(str::trim).filter(|r| !r.is_empty()) {
            if let Some(seed) = rule.strip_prefix("seed=") {
                plan.seed = seed.trim().parse().map_err(|_| FaultSpecError {
                    rule: rule.to_string(),
                    at: Some("seed=".len()),
                    reason: "the seed must be an unsigned integer".into(),
                })?;
                continue;
            }
            plan.rules.push(Self::parse_rule(rule)?);
        }
        Ok(plan)
    }

    fn parse_rule(rule: &str) -> Result<FaultRule, FaultSpecError> {
        let mut args = RuleArgs {
            rule,
            syntax: RuleSyntax::split(rule)?,
        };
        let (kind, link) = args.kind_and_link()?;
        let link = match link {
            Some(link) => link,
            None => args.link()?,
        };
        let after = match args.take("after") {
            Some(t) => parse_duration(t.text).map_err(|reason| args.bad(t.at, &reason))?,
            None => Duration::ZERO,
        };
        let after_frames = args.number("after_frames", 0, "after_frames must be an integer")?;
        let after_received = args.take("after_received");
        let after_received_at = after_received.map_or(args.syntax.close, |p| p.at);
        let after_received = args.parse_number(after_received, 0, "after_received must be an integer")?;
        if after_received > 0 && !matches!(kind, FaultKind::Kill | FaultKind::Freeze) {
            return Err(args.bad(after_received_at, "after_received applies to kill and freeze only"));
        }
        if let Some((unknown, _)) = args.syntax.named.first() {
            return Err(args.bad(unknown.at, &format!("unknown argument {:?}", unknown.text)));
        }
        Ok(FaultRule {
            kind,
            link,
            after,
            after_frames,
            after_received,
            text: rule.to_string(),
        })
    }

    /// Checks that every rule names ranks of a world of `world` ranks: a
    /// rule for a rank that does not exist would never act.
    pub fn check_world(&self, world: usize) -> Result<(), FaultSpecError> {
        for rule in &self.rules {
            let ranks: Vec<usize> = match &rule.link {
                LinkMatch::Directed(a, b) => a.iter().chain(b).copied().collect(),
                LinkMatch::Both(a, b) => vec![*a, *b],
                LinkMatch::Partition(left, right) => left.iter().chain(right).copied().collect(),
                LinkMatch::Rank(rank) => vec![*rank],
            };
            if let Some(rank) = ranks.into_iter().find(|&r| r >= world) {
                return Err(FaultSpecError {
                    rule: rule.text.clone(),
                    at: None,
                    reason: format!("rank {rank} is out of range for world size {world}"),
                });
            }
        }
        Ok(())
    }

    /// What happens to the `frames_sent`-th frame (0-based) `from` sends to
    /// `to`, `elapsed` after the wrapper was made; `random` is the link's next
    /// uniform draw in `[0, 1)`.
    pub fn decide(&self, from: usize, to: usize, frames_sent: u64, elapsed: Duration, random: f64) -> Action {
        for rule in &self.rules {
            if !rule.link.matches(from, to)
                || elapsed < rule.after
                || frames_sent < rule.after_frames
                || rule.after_received > 0
            {
                continue;
            }
            return match rule.kind {
                FaultKind::Drop(p) if random < p => Action::Break,
                FaultKind::Drop(_) => continue,
                FaultKind::Delay(base, jitter) => Action::Delay(base + jitter.mul_f64(random)),
                FaultKind::Corrupt(p, times) if random < p => Action::Corrupt(times),
                FaultKind::Corrupt(..) => continue,
                FaultKind::Partition => Action::Drop,
                FaultKind::Close => Action::Close,
                FaultKind::Kill => Action::Kill,
                FaultKind::Freeze => Action::Freeze,
                FaultKind::CorruptState { .. } => continue,
            };
        }
        Action::Deliver
    }

    /// The `corrupt(rank=R, step=S, ...)` rules, which the training loop
    /// carries out (the links pass them by).
    pub fn state_corruptions(&self) -> Vec<StateCorruption> {
        self.rules
            .iter()
            .filter_map(|rule| match (&rule.kind, &rule.link) {
                (&FaultKind::CorruptState { step, target, bit }, &LinkMatch::Rank(rank)) => Some(StateCorruption {
                    rank,
                    step,
                    target,
                    bit,
                }),
                _ => None,
            })
            .collect()
    }

    /// What happens to rank `me` as it receives a frame after `received`
    /// others (heartbeats aside), `elapsed` after the wrapper was made:
    /// [`Action::Kill`] or [`Action::Freeze`] from an `after_received`
    /// rule, otherwise [`Action::Deliver`].
    pub fn decide_on_receive(&self, me: usize, received: u64, elapsed: Duration) -> Action {
        let acts = |rule: &&FaultRule| {
            rule.after_received > 0
                && received >= rule.after_received
                && elapsed >= rule.after
                && rule.link == LinkMatch::Rank(me)
        };
        match self.rules.iter().find(acts).map(|rule| &rule.kind) {
            Some(FaultKind::Kill) => Action::Kill,
            Some(FaultKind::Freeze) => Action::Freeze,
            _ => Action::Deliver,
        }
    }
}

/// splitmix64: a small, well-mixed generator; one stream per directed link.
#[derive(Debug, Clone)]
struct SplitMix(u64);

impl SplitMix {
    fn new(seed: u64, from: usize, to: usize) -> Self {
        Self(seed ^ ((from as u64) << 32) ^ (to as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// State one rank's wrapped links share: whether it is dead or frozen.
#[derive(Debug)]
struct RankState {
    plan: FaultPlan,
    started: Instant,
    killed: AtomicBool,
    frozen: AtomicBool,
    /// Frames received on all its links, heartbeats aside.
    received: AtomicU64,
    links: Mutex<Vec<Arc<dyn Link>>>,
}

/// A link with faults injected on what this rank sends.
#[derive(Debug)]
pub struct FaultyLink {
    me: usize,
    inner: Arc<dyn Link>,
    rank: Arc<RankState>,
    frames: AtomicU64,
    /// Frames corrupted so far (for `corrupt`'s `times`).
    corrupted: AtomicU64,
    random: Mutex<SplitMix>,
}

impl FaultyLink {
    async fn frozen_forever(&self) -> ! {
        loop {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
    }

    fn kill(&self) {
        if self.rank.killed.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::warn!(rank = self.me, "fault injection: killing this rank");
        if self.inner.kind() != TransportKind::Local {
            // A rank with a process of its own dies as under SIGKILL.
            crate::process::signal_self(crate::process::Signal::SIGKILL);
        }
        for link in self.rank.links.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            link.cut("rank killed by fault injection");
        }
    }

    /// `payload` with one bit flipped at a seeded position, or as it is
    /// when it is no data frame or the link used up its `times`.
    fn corrupt(&self, channel: ChannelId, tag: u64, payload: Bytes, times: u64) -> Bytes {
        // u64::MAX tags the collectives' signatures: their framing, not data.
        // A data tag with the top bit set carries one in its first 32 bytes
        // (the CPU driver's signed frames): only the data after it.
        let skip = if tag & (1 << 63) != 0 { 32.min(payload.len()) } else { 0 };
        if channel == HEARTBEAT_CHANNEL || tag == u64::MAX || payload.len() == skip {
            return payload;
        }
        let done = self
            .corrupted
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < times).then_some(n + 1));
        if done.is_err() {
            return payload;
        }
        let (at, bit) = {
            let mut random = self.random.lock().unwrap_or_else(|p| p.into_inner());
            let data = payload.len() - skip;
            let at = skip + ((random.next_f64() * data as f64) as usize).min(data - 1);
            (at, (random.next_f64() * 8.0) as u32 % 8)
        };
        tracing::warn!(
            rank = self.me,
            peer = self.peer(),
            at,
            bit,
            "fault injection: corrupting a frame"
        );
        let mut bytes = payload.to_vec();
        bytes[at] ^= 1 << bit;
        Bytes::from(bytes)
    }

    /// A borrowed send ([`Link::poll_send_copy`], [`Link::poll_send_with`],
    /// [`Link::try_send_copy`]) goes to the inner link only when this
    /// frame's decision is to deliver it; any other fault refuses it
    /// (`Ok(false)`), so the owned `send` the caller makes instead applies
    /// the fault. The decision is made on a
    /// copy of the random stream and committed (the frame counted, the
    /// stream advanced) only once the inner link took the frame, so a
    /// refused or pending frame is decided again, the same way, later.
    fn copy_through(
        &self,
        channel: ChannelId,
        inner: impl FnOnce(&dyn Link) -> Poll<Result<bool, TransportError>>,
    ) -> Poll<Result<bool, TransportError>> {
        if self.rank.frozen.load(Ordering::SeqCst) {
            // Never completes, as a frozen rank's sends.
            return Poll::Pending;
        }
        if self.rank.killed.load(Ordering::SeqCst) {
            return Poll::Ready(Err(self.dead()));
        }
        let mut random = self.random.lock().unwrap_or_else(|p| p.into_inner());
        let mut next = random.clone();
        let count = self.frames.load(Ordering::SeqCst);
        let action = self.rank.plan.decide(
            self.me,
            self.peer(),
            count,
            self.rank.started.elapsed(),
            next.next_f64(),
        );
        if action != Action::Deliver {
            return Poll::Ready(Ok(false));
        }
        let polled = inner(self.inner.as_ref());
        if let Poll::Ready(Ok(true)) = polled {
            *random = next;
            if channel != HEARTBEAT_CHANNEL {
                self.frames.fetch_add(1, Ordering::SeqCst);
            }
        }
        polled
    }

    fn dead(&self) -> TransportError {
        TransportError::Closed {
            peer: self.inner.peer(),
            reason: "this rank was killed by fault injection".into(),
        }
    }
}

/// Wraps one rank's links (indexed by peer rank) with `plan`.
pub fn wrap_links(me: usize, links: Vec<Option<Arc<dyn Link>>>, plan: FaultPlan) -> Vec<Option<Arc<dyn Link>>> {
    let rank = Arc::new(RankState {
        started: Instant::now(),
        killed: AtomicBool::new(false),
        frozen: AtomicBool::new(false),
        received: AtomicU64::new(0),
        links: Mutex::new(links.iter().flatten().cloned().collect()),
        plan,
    });
    links
        .into_iter()
        .map(|link| {
            link.map(|inner| {
                let random = SplitMix::new(rank.plan.seed, me, inner.peer());
                Arc::new(FaultyLink {
                    me,
                    inner,
                    rank: rank.clone(),
                    frames: AtomicU64::new(0),
                    corrupted: AtomicU64::new(0),
                    random: Mutex::new(random),
                }) as Arc<dyn Link>
            })
        })
        .collect()
}

#[async_trait]
impl Link for FaultyLink {
    fn peer(&self) -> usize {
        self.inner.peer()
    }

    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    async fn send(&self, channel: ChannelId, tag: u64, payload: Bytes) -> Result<(), SendError> {
        if self.rank.frozen.load(Ordering::SeqCst) {
            self.frozen_forever().await;
        }
        if self.rank.killed.load(Ordering::SeqCst) {
            return Err(SendError {
                error: self.dead(),
                payload,
            });
        }
        let count = if channel == HEARTBEAT_CHANNEL {
            self.frames.load(Ordering::SeqCst)
        } else {
            self.frames.fetch_add(1, Ordering::SeqCst)
        };
        let random = self.random.lock().unwrap_or_else(|p| p.into_inner()).next_f64();
        let action = self
            .rank
            .plan
            .decide(self.me, self.peer(), count, self.rank.started.elapsed(), random);
        match action {
            Action::Deliver => self.inner.send(channel, tag, payload).await,
            Action::Drop => Ok(()),
            Action::Break => {
                let reason = "a frame was lost (drop by fault injection), which breaks a reliable link";
                self.inner.cut(reason);
                Err(SendError {
                    error: TransportError::Closed {
                        peer: self.peer(),
                        reason: reason.into(),
                    },
                    payload,
                })
            }
            Action::Delay(d) => {
                tokio::time::sleep(d).await;
                self.inner.send(channel, tag, payload).await
            }
            Action::Corrupt(times) => {
                let payload = self.corrupt(channel, tag, payload, times);
                self.inner.send(channel, tag, payload).await
            }
            Action::Close => {
                self.inner.cut("closed by fault injection");
                self.inner.send(channel, tag, payload).await
            }
            Action::Kill => {
                self.kill();
                Err(SendError {
                    error: self.dead(),
                    payload,
                })
            }
            Action::Freeze => {
                tracing::warn!(rank = self.me, "fault injection: freezing this rank");
                self.rank.frozen.store(true, Ordering::SeqCst);
                self.frozen_forever().await
            }
        }
    }

    fn try_send_copy(&self, channel: ChannelId, tag: u64, payload: &[u8]) -> Result<bool, TransportError> {
        match self.copy_through(channel, |inner| Poll::Ready(inner.try_send_copy(channel, tag, payload))) {
            Poll::Ready(sent) => sent,
            Poll::Pending => Ok(false),
        }
    }

    fn poll_send_with(
        &self,
        cx: &mut Context<'_>,
        channel: ChannelId,
        tag: u64,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Poll<Result<bool, TransportError>> {
        self.copy_through(channel, |inner| inner.poll_send_with(cx, channel, tag, len, fill))
    }

    fn injects_faults(&self) -> bool {
        self.rank.plan.rules.iter().any(|rule| {
            !matches!(
                rule.kind,
                FaultKind::Kill | FaultKind::Freeze | FaultKind::CorruptState { .. }
            ) && rule.link.matches(self.me, self.peer())
        })
    }

    async fn recv(&self, channel: ChannelId) -> Result<Frame, TransportError> {
        if self.rank.killed.load(Ordering::SeqCst) {
            return Err(self.dead());
        }
        let frame = self.inner.recv(channel).await;
        if frame.is_ok() && channel != HEARTBEAT_CHANNEL {
            let received = self.rank.received.fetch_add(1, Ordering::SeqCst);
            match self
                .rank
                .plan
                .decide_on_receive(self.me, received, self.rank.started.elapsed())
            {
                Action::Freeze if !self.rank.frozen.swap(true, Ordering::SeqCst) => {
                    tracing::warn!(rank = self.me, "fault injection: freezing this rank as it receives");
                }
                Action::Kill => {
                    self.kill();
                    return Err(self.dead());
                }
                _ => {}
            }
        }
        if self.rank.frozen.load(Ordering::SeqCst) {
            self.frozen_forever().await;
        }
        frame
    }

    fn close_with(&self, notice: &CloseNotice) {
        // A stopped rank closes nothing (as under SIGSTOP): its peers must
        // find it silent by their own deadlines, not by its abort.
        if !self.rank.frozen.load(Ordering::SeqCst) {
            self.inner.close_with(notice);
        }
    }

    fn cut(&self, reason: &str) {
        if !self.rank.frozen.load(Ordering::SeqCst) {
            self.inner.cut(reason);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::local_mesh;

    #[test]
    fn the_grammar_parses_every_kind() {
        let plan = FaultPlan::parse(
            "seed=7; drop(0->1, p=0.25); delay(*->2, ms=40, jitter_ms=10); partition(0,1|2,3, after=500ms); \
             close(1<->2, after_frames=100); kill(rank=3, after=2s); freeze(rank=1, after_frames=20); \
             corrupt(1->0, p=0.5, after_frames=30, times=2); corrupt(*->1)",
        )
        .unwrap();
        assert_eq!(plan.seed, 7);
        assert_eq!(plan.rules.len(), 8);
        assert_eq!(plan.rules[6].kind, FaultKind::Corrupt(0.5, 2));
        assert_eq!(plan.rules[6].after_frames, 30);
        assert_eq!(plan.rules[7].kind, FaultKind::Corrupt(1.0, u64::MAX));
        assert_eq!(plan.rules[0].kind, FaultKind::Drop(0.25));
        assert_eq!(plan.rules[1].link, LinkMatch::Directed(None, Some(2)));
        assert_eq!(plan.rules[2].link, LinkMatch::Partition(vec![0, 1], vec![2, 3]));
        assert_eq!(plan.rules[2].after, Duration::from_millis(500));
        assert_eq!(plan.rules[3].after_frames, 100);
        assert_eq!(plan.rules[4].kind, FaultKind::Kill);
        assert_eq!(plan.rules[5].link, LinkMatch::Rank(1));
    }

    #[test]
    fn a_state_corruption_is_a_rule_for_the_training_loop_that_frames_pass_by() {
        let plan = FaultPlan::parse("corrupt(rank=2, step=40, what=grads, bit=30); corrupt(rank=1, step=7)").unwrap();
        assert_eq!(
            plan.state_corruptions(),
            [
                StateCorruption {
                    rank: 2,
                    step: 40,
                    target: StateTarget::Grads,
                    bit: Some(30)
                },
                StateCorruption {
                    rank: 1,
                    step: 7,
                    target: StateTarget::Params,
                    bit: None
                }
            ]
        );
        assert_eq!(plan.decide(2, 0, 1000, Duration::from_secs(60), 0.0), Action::Deliver);
        plan.check_world(3).unwrap();
        assert!(plan.check_world(2).is_err());
    }

    #[test]
    fn bad_rules_say_what_is_wrong() {
        for (spec, needle) in [
            ("drop(0->1, p=2)", "between 0 and 1"),
            ("corrupt(0->1, p=-1)", "between 0 and 1"),
            ("corrupt(0->1, times=once)", "times must be an integer"),
            ("explode(0->1)", "unknown kind"),
            ("drop(0-1)", "expected -> or <->"),
            ("drop(0)", "name one link"),
            ("delay(0->1)", "needs ms"),
            ("kill(3)", "rank=R"),
            ("drop(0->1, after=soon)", "duration"),
            ("drop(0->1, colour=red)", "unknown argument"),
            ("drop(0->1", "parenthesis"),
            ("seed=x", "unsigned"),
            ("corrupt(rank=1)", "needs step=S"),
            ("corrupt(rank=1, step=2, what=optimizer)", "params or grads"),
            ("corrupt(rank=1, step=2, bit=64)", "from 0 to 63"),
            ("corrupt(rank=1, step=2, p=0.5)", "not a rank's state"),
            ("corrupt(rank=*, step=2)", "rank must be a number"),
        ] {
            let err = FaultPlan::parse(spec).unwrap_err();
            assert!(err.to_string().contains(needle), "{spec}: {err}");
        }
    }

    #[test]
    fn a_parse_error_points_where_the_rule_stops_making_sense() {
        for (spec, at, needle) in [
            // A missing comma is blamed where the arguments meet, not for
            // the `ms` that then seems missing.
            ("delay(0->1 ms=5)", "ms=5)", "expected , or ) after 0->1"),
            (
                "delay(0->1, ms=5 jitter_ms=2)",
                "jitter_ms=2)",
                "expected , or ) after ms=5",
            ),
            ("delay(0->1, ms 5)", "5)", "expected = after ms"),
            ("delay(0->1, ms=five)", "five)", "ms must be an integer"),
            ("delay(0->1)", ")", "delay needs ms=D"),
            ("drop(0->, p=1)", ", p=1)", "expected a rank or * after ->"),
            ("drop(0->1, p=1, p=0)", "p=0)", "p is given twice"),
            ("drop(0->1, colour=red)", "colour=red)", "unknown argument"),
            ("drop(0->1, 2->3)", "2->3)", "name one link"),
            ("drop(0->1) extra", "extra", "after the closing parenthesis"),
            ("kill(rank=x)", "x)", "not a rank"),
            ("partition(0,1 2,3)", "2,3)", "expected , or ) after 1"),
        ] {
            let err = FaultPlan::parse(spec).unwrap_err();
            let offset = err.at.unwrap_or_else(|| panic!("{spec}: {err} has no place"));
            assert_eq!(&spec[offset..], at, "{spec}: {err}");
            let text = err.to_string();
            assert!(text.contains(needle), "{spec}: {text}");
            let column = offset + 1;
            assert!(text.contains(&format!("character {column}")), "{spec}: {text}");
        }
        let err = FaultPlan::parse("drop(0->1").unwrap_err();
        assert!(err.to_string().contains("at its end"), "{err}");
        // Spaces around the joins are still welcome.
        let plan = FaultPlan::parse("drop(0 -> 1); partition(0, 1 | 2, 3)").unwrap();
        assert_eq!(plan.rules[0].link, LinkMatch::Directed(Some(0), Some(1)));
        assert_eq!(plan.rules[1].link, LinkMatch::Partition(vec![0, 1], vec![2, 3]));
    }

    #[test]
    fn decisions_follow_triggers_and_are_deterministic() {
        let plan = FaultPlan::parse("partition(0|1, after=1s); close(0->2, after_frames=3)").unwrap();
        assert_eq!(plan.decide(0, 1, 0, Duration::from_millis(999), 0.5), Action::Deliver);
        assert_eq!(plan.decide(1, 0, 0, Duration::from_secs(1), 0.5), Action::Drop);
        assert_eq!(plan.decide(0, 2, 2, Duration::ZERO, 0.5), Action::Deliver);
        assert_eq!(plan.decide(0, 2, 3, Duration::ZERO, 0.5), Action::Close);
        let draws = |seed| {
            let mut r = SplitMix::new(seed, 0, 1);
            (0..5).map(|_| r.next_f64()).collect::<Vec<_>>()
        };
        assert_eq!(draws(1), draws(1));
        assert_ne!(draws(1), draws(2));
        assert!(draws(3).iter().all(|x| (0.0..1.0).contains(x)));
    }

    async fn within<T>(fut: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(10), fut)
            .await
            .expect("fault test hung")
    }

    fn wrapped(world: usize, spec: &str) -> Vec<Vec<Option<Arc<dyn Link>>>> {
        let plan = FaultPlan::parse(spec).unwrap();
        local_mesh(world)
            .into_iter()
            .enumerate()
            .map(|(r, row)| wrap_links(r, row, plan.clone()))
            .collect()
    }

    #[tokio::test]
    async fn a_dropped_frame_breaks_the_link_at_a_seeded_frame() {
        within(async {
            // Frames before the drop arrive; the drop closes the link as lost
            // on both sides, so nothing waits for a frame that never comes.
            let broken_at = |seed: u64| async move {
                let mesh = wrapped(2, &format!("seed={seed}; drop(0->1, p=0.3)"));
                let link = mesh[0][1].as_ref().unwrap();
                let mut sent = 0u64;
                while link.send(0, sent, Bytes::new()).await.is_ok() {
                    sent += 1;
                    assert!(sent < 1000, "p=0.3 drops a frame long before 1000");
                }
                for tag in 0..sent {
                    assert_eq!(mesh[1][0].as_ref().unwrap().recv(0).await.unwrap().tag, tag);
                }
                let lost = mesh[1][0].as_ref().unwrap().recv(0).await;
                assert!(matches!(lost, Err(TransportError::Closed { peer: 0, .. })), "{lost:?}");
                assert!(link.send(0, 0, Bytes::new()).await.is_err(), "the link stays broken");
                sent
            };
            let first = broken_at(11).await;
            assert_eq!(first, broken_at(11).await, "the same seed drops the same frame");
        })
        .await;
    }

    #[tokio::test]
    async fn borrowed_sends_count_toward_triggers_and_faults_go_the_owned_way() {
        within(async {
            let mesh = wrapped(2, "close(0->1, after_frames=2)");
            let (tx, rx) = (mesh[0][1].as_ref().unwrap(), mesh[1][0].as_ref().unwrap());
            let borrowed = |tag: u64| std::future::poll_fn(move |cx| tx.poll_send_copy(cx, 0, tag, b"borrowed"));
            // Two frames go straight through and count; the third is the
            // close's, refused here so that the owned send applies it.
            assert_eq!(borrowed(0).await, Ok(true));
            assert_eq!(tx.try_send_copy(0, 1, b"borrowed"), Ok(true));
            assert_eq!(borrowed(2).await, Ok(false));
            assert_eq!(
                tx.try_send_copy(0, 2, b"borrowed"),
                Ok(false),
                "refused again, not counted"
            );
            assert!(tx.send(0, 2, Bytes::from_static(b"owned")).await.is_err());
            for tag in 0..2 {
                assert_eq!(rx.recv(0).await.unwrap().tag, tag);
            }
            assert!(matches!(rx.recv(0).await, Err(TransportError::Closed { .. })));
        })
        .await;
    }

    #[test]
    fn links_tell_whether_a_rule_acts_on_what_they_send() {
        let mesh = wrapped(3, "corrupt(1->2, p=1); freeze(rank=0, after_frames=4)");
        let injects = |from: usize, to: usize| mesh[from][to].as_ref().unwrap().injects_faults();
        assert!(injects(1, 2), "the corrupt rule's direction");
        assert!(!injects(2, 1), "not the other way");
        assert!(
            !injects(0, 1) && !injects(0, 2),
            "a freeze stops the rank, it changes no frame"
        );
        let mesh = wrapped(2, "partition(0|1)");
        assert!(mesh[0][1].as_ref().unwrap().injects_faults() && mesh[1][0].as_ref().unwrap().injects_faults());
        assert!(
            !local_mesh(2)[0][1].as_ref().unwrap().injects_faults(),
            "no wrapper, no faults"
        );
    }

    #[tokio::test]
    async fn corrupt_flips_one_bit_of_data_frames_only() {
        within(async {
            let mesh = wrapped(2, "seed=3; corrupt(0->1, after_frames=2, times=1)");
            let (tx, rx) = (mesh[0][1].as_ref().unwrap(), mesh[1][0].as_ref().unwrap());
            let data = Bytes::from(vec![0u8; 4096]);
            // Before the trigger, then a signature and a heartbeat: untouched.
            for (channel, tag) in [(0, 0), (0, 1), (0, u64::MAX), (HEARTBEAT_CHANNEL, 5), (0, 2), (0, 3)] {
                tx.send(channel, tag, data.clone()).await.unwrap();
            }
            let mut flipped = Vec::new();
            for channel in [0, 0, 0, HEARTBEAT_CHANNEL, 0, 0] {
                let frame = rx.recv(channel).await.unwrap();
                let ones: u32 = frame.payload.iter().map(|b| b.count_ones()).sum();
                flipped.push((frame.tag, ones));
            }
            // Only the first data frame after the trigger, and only once (times=1).
            assert_eq!(flipped, [(0, 0), (1, 0), (u64::MAX, 0), (5, 0), (2, 1), (3, 0)]);
        })
        .await;
    }

    #[tokio::test]
    async fn corrupt_spares_the_signature_a_data_frame_carries() {
        within(async {
            let mesh = wrapped(2, "seed=5; corrupt(0->1)");
            let (tx, rx) = (mesh[0][1].as_ref().unwrap(), mesh[1][0].as_ref().unwrap());
            let signed = 1 << 63;
            // A signature alone, then a signature and one byte of data.
            tx.send(0, signed, Bytes::from(vec![0u8; 32])).await.unwrap();
            tx.send(0, signed | 1, Bytes::from(vec![0u8; 33])).await.unwrap();
            assert!(rx.recv(0).await.unwrap().payload.iter().all(|&b| b == 0));
            let frame = rx.recv(0).await.unwrap();
            assert!(frame.payload[..32].iter().all(|&b| b == 0), "the signature changed");
            assert_eq!(frame.payload[32].count_ones(), 1, "the data byte is corrupted");
        })
        .await;
    }

    #[test]
    fn rules_must_name_ranks_of_the_world() {
        let ok = FaultPlan::parse("drop(0->1); delay(*->3, ms=1); partition(0|1,2,3); close(2<->3); freeze(rank=3)")
            .unwrap();
        assert_eq!(ok.check_world(4), Ok(()));
        for (spec, rank) in [
            ("kill(rank=9)", 9),
            ("drop(0->2)", 2),
            ("close(1<->5)", 5),
            ("partition(0|1,7)", 7),
            ("delay(4->*, ms=1)", 4),
        ] {
            let err = FaultPlan::parse(spec).unwrap().check_world(2).unwrap_err();
            assert_eq!(err.rule, spec, "{err}");
            assert!(
                err.reason
                    .contains(&format!("rank {rank} is out of range for world size 2")),
                "{spec}: {err}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn delays_hold_frames_and_partitions_cut_between_sides() {
        within(async {
            let mesh = wrapped(4, "delay(0->1, ms=200); partition(0,1|2,3, after=1s)");
            let started = Instant::now();
            mesh[0][1].as_ref().unwrap().send(0, 1, Bytes::new()).await.unwrap();
            assert!(started.elapsed() >= Duration::from_millis(200), "the frame is held");
            assert_eq!(mesh[1][0].as_ref().unwrap().recv(0).await.unwrap().tag, 1);
            // Before the partition starts, frames cross it.
            mesh[2][1].as_ref().unwrap().send(0, 2, Bytes::new()).await.unwrap();
            assert_eq!(mesh[1][2].as_ref().unwrap().recv(0).await.unwrap().tag, 2);
            tokio::time::sleep(Duration::from_secs(1)).await;
            mesh[2][1].as_ref().unwrap().send(0, 3, Bytes::new()).await.unwrap();
            mesh[3][2].as_ref().unwrap().send(0, 4, Bytes::new()).await.unwrap();
            let crossing = tokio::time::timeout(Duration::from_secs(5), mesh[1][2].as_ref().unwrap().recv(0)).await;
            assert!(crossing.is_err(), "frames across the partition are lost");
            assert_eq!(
                mesh[2][3].as_ref().unwrap().recv(0).await.unwrap().tag,
                4,
                "frames within a side pass"
            );
        })
        .await;
    }

    #[tokio::test]
    async fn close_kill_and_freeze_act_on_their_links() {
        within(async {
            let mesh = wrapped(3, "close(0->1, after_frames=1); kill(rank=2)");
            mesh[0][1].as_ref().unwrap().send(0, 0, Bytes::new()).await.unwrap();
            assert!(mesh[0][1].as_ref().unwrap().send(0, 1, Bytes::new()).await.is_err());
            assert_eq!(mesh[1][0].as_ref().unwrap().recv(0).await.unwrap().tag, 0);
            // Injected closes and kills are lost links, never a peer leaving on purpose.
            let cut = mesh[1][0].as_ref().unwrap().recv(0).await;
            assert!(
                matches!(cut, Err(TransportError::Closed { peer: 0, .. })),
                "closed after the first frame: {cut:?}"
            );
            // Rank 2 dies on its first send: its peers see closed links.
            assert!(mesh[2][0].as_ref().unwrap().send(0, 0, Bytes::new()).await.is_err());
            let killed = mesh[1][2].as_ref().unwrap().recv(0).await;
            assert!(
                matches!(killed, Err(TransportError::Closed { peer: 2, .. })),
                "{killed:?}"
            );

            let mesh = wrapped(2, "freeze(rank=0, after_frames=1)");
            mesh[0][1].as_ref().unwrap().send(0, 0, Bytes::new()).await.unwrap();
            let frozen = tokio::time::timeout(
                Duration::from_millis(100),
                mesh[0][1].as_ref().unwrap().send(0, 1, Bytes::new()),
            )
            .await;
            assert!(frozen.is_err(), "a frozen rank's send never completes");
            assert_eq!(mesh[1][0].as_ref().unwrap().recv(0).await.unwrap().tag, 0);
        })
        .await;
    }

    #[test]
    fn after_received_strikes_on_a_receive_and_only_kill_or_freeze() {
        let plan =
            FaultPlan::parse("freeze(rank=1, after_received=3, after=1s); kill(rank=2, after_received=1)").unwrap();
        assert_eq!(plan.rules[0].after_received, 3);
        let second = Duration::from_secs(1);
        assert_eq!(
            plan.decide_on_receive(1, 2, second),
            Action::Deliver,
            "2 received: not yet"
        );
        assert_eq!(
            plan.decide_on_receive(1, 3, Duration::ZERO),
            Action::Deliver,
            "too early"
        );
        assert_eq!(plan.decide_on_receive(1, 3, second), Action::Freeze);
        assert_eq!(plan.decide_on_receive(0, 9, second), Action::Deliver, "another rank");
        assert_eq!(plan.decide_on_receive(2, 1, Duration::ZERO), Action::Kill);
        // It never acts on a send.
        assert_eq!(plan.decide(1, 0, 100, second, 0.0), Action::Deliver);
        let err = FaultPlan::parse("drop(0->1, after_received=2)").unwrap_err();
        assert_eq!(err.reason, "after_received applies to kill and freeze only");
        assert!(FaultPlan::parse("freeze(rank=0, after_received=x)").is_err());
    }

    #[tokio::test]
    async fn a_rank_freezes_or_dies_as_it_receives() {
        within(async {
            // Rank 1 takes two frames, then freezes on the third: it never
            // gets it, and its sends stop too.
            let mesh = wrapped(2, "freeze(rank=1, after_received=2)");
            let (to_one, one) = (mesh[0][1].as_ref().unwrap(), mesh[1][0].as_ref().unwrap());
            for tag in 0..3 {
                to_one.send(0, tag, Bytes::from_static(b"x")).await.unwrap();
            }
            assert_eq!(one.recv(0).await.unwrap().tag, 0);
            assert_eq!(one.recv(0).await.unwrap().tag, 1);
            let third = tokio::time::timeout(Duration::from_millis(100), one.recv(0)).await;
            assert!(third.is_err(), "the frozen rank never gets the third frame");
            let send = tokio::time::timeout(Duration::from_millis(100), one.send(0, 0, Bytes::new())).await;
            assert!(send.is_err(), "nor sends");

            // Rank 1 dies on its second frame: its receive fails and its
            // peer sees the link closed.
            let mesh = wrapped(2, "kill(rank=1, after_received=1)");
            let (to_one, one) = (mesh[0][1].as_ref().unwrap(), mesh[1][0].as_ref().unwrap());
            for tag in 0..2 {
                to_one.send(0, tag, Bytes::from_static(b"x")).await.unwrap();
            }
            assert_eq!(one.recv(0).await.unwrap().tag, 0);
            assert!(one.recv(0).await.is_err(), "killed as it receives the second");
            let closed = to_one.recv(0).await;
            assert!(
                matches!(closed, Err(TransportError::Closed { peer: 1, .. })),
                "{closed:?}"
            );
        })
        .await;
    }
}
