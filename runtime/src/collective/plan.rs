//! The schedule representation: one rank's part of a collective, as a
//! dependency graph of sends, receives and local copies.
//!
//! # Buffers
//!
//! A plan touches two buffers of the rank's elements: `input`, which it only
//! reads, and `output`, which it receives into, reduces into and sends from.
//! Ranges are in elements; multiply by the dtype's size for bytes. What each
//! buffer holds before and after is stated per collective in
//! [`CollectiveKind`](super::CollectiveKind).
//!
//! # Execution rules (for drivers)
//!
//! 1. A step may take effect once every step in its [`deps`](Plan::deps) has;
//!    steps with no path between them may run concurrently, in any order.
//!    [`Plan::steps`] lists them in a valid order, which is also a good
//!    priority order (earlier rounds first).
//! 2. A [`Send`](Action::Send) takes effect when its region has been read
//!    (copied into a frame, or handed to a transport that holds it).
//! 3. A [`Recv`](Action::Recv) takes effect when its payload has been written
//!    ([`Combine::Copy`]) or reduced ([`Combine::Reduce`]) into its region.
//!    The payload may arrive, and be buffered in a scratch buffer, earlier.
//!    A `Copy` payload may be received straight into place once its deps are
//!    done.
//! 4. A message is matched by (sender, receiver, [`Tag`]); within one
//!    collective each such triple occurs once, so frames need not arrive in
//!    order. The receiver knows each message's length (its region's).
//! 5. Dependencies cover every data hazard on `output` (read after write,
//!    write after read, write after write), so following rule 1 gives the
//!    result exactly; no other ordering is implied.

use std::ops::Range;

/// Index of a step within its [`Plan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StepId(pub u32);

impl StepId {
    /// The index into [`Plan::steps`].
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Identifies a message between two ranks within one collective; drivers put
/// it in the frame header next to the collective's sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tag {
    /// The algorithm's round (ring step, tree level, doubling distance, ...).
    pub round: u32,
    /// The segment of the round's chunk (0 when unsegmented).
    pub segment: u32,
}

impl Tag {
    pub(crate) fn new(round: usize, segment: usize) -> Self {
        // `plan` bounds world size and segment counts well below u32::MAX.
        Tag {
            round: round as u32,
            segment: segment as u32,
        }
    }
}

/// Which buffer a [`Send`](Action::Send) reads.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Region {
    /// Elements of the read-only input buffer.
    Input(Range<usize>),
    /// Elements of the output buffer.
    Output(Range<usize>),
}

/// What to do with a received payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Combine {
    /// Overwrite the region (may be received directly into place).
    Copy,
    /// Reduce into the region with the collective's operator: receive into
    /// scratch, then `reduce_into(op, dtype, region, scratch)`.
    Reduce,
    /// As [`Reduce`](Self::Reduce), after which the region holds the
    /// reduction over every rank: an average divides it here (while it is
    /// in cache), and a plan with such steps is never divided as a whole
    /// ([`Plan::averages_in_steps`]).
    ReduceComplete,
    /// As [`Reduce`](Self::Reduce), this rank's values taken from `input`'s
    /// same range instead of the region: `region = input op payload`. An
    /// out-of-place plan's first write of a region.
    ReduceInput,
    /// As [`ReduceComplete`](Self::ReduceComplete), this rank's values taken
    /// from `input` as in [`ReduceInput`](Self::ReduceInput).
    ReduceCompleteInput,
}

impl Combine {
    /// The same combination with this rank's values taken from `input`.
    fn with_input(self) -> Self {
        match self {
            Combine::Reduce => Combine::ReduceInput,
            Combine::ReduceComplete => Combine::ReduceCompleteInput,
            other => other,
        }
    }
}

/// One step's action.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Action {
    /// Send a region to another rank.
    Send {
        /// Destination rank.
        to: usize,
        /// The message's tag.
        tag: Tag,
        /// What to send.
        src: Region,
    },
    /// Receive a message from another rank into a range of `output`.
    Recv {
        /// Source rank.
        from: usize,
        /// The message's tag.
        tag: Tag,
        /// Elements of `output` the payload lands in (its length is the
        /// expected message length).
        dst: Range<usize>,
        /// Overwrite or reduce.
        then: Combine,
    },
    /// Copy a range of `input` into a range of `output` of equal length.
    Copy {
        /// Elements of `input`.
        src: Range<usize>,
        /// Elements of `output`.
        dst: Range<usize>,
    },
}

impl Action {
    /// The range of `output` this action writes, if any.
    pub fn writes(&self) -> Option<&Range<usize>> {
        match self {
            Action::Recv { dst, .. } | Action::Copy { dst, .. } => Some(dst),
            Action::Send { .. } => None,
        }
    }

    /// The range of `output` this action reads, if any.
    pub fn reads(&self) -> Option<&Range<usize>> {
        match self {
            Action::Send {
                src: Region::Output(r), ..
            } => Some(r),
            _ => None,
        }
    }
}

/// One step of a [`Plan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// What the step does.
    pub action: Action,
    /// Where its dependencies lie in the plan's flat dependency list.
    deps: Range<u32>,
}

/// One rank's schedule for one collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    rank: usize,
    world: usize,
    input_len: usize,
    output_len: usize,
    steps: Vec<Step>,
    deps: Vec<StepId>,
    lendable: bool,
}

impl Plan {
    /// The rank this plan is for.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Elements of the input buffer the plan reads (0 when it has none).
    pub fn input_len(&self) -> usize {
        self.input_len
    }

    /// Elements of the output buffer.
    pub fn output_len(&self) -> usize {
        self.output_len
    }

    /// The steps, in a valid execution order.
    pub fn steps(&self) -> &[Step] {
        &self.steps
    }

    /// Whether [`ReduceOp::Avg`](super::ReduceOp::Avg) divides at its
    /// [`Combine::ReduceComplete`] receives (every element of the result
    /// passes through one, or is copied from a rank where it did) instead
    /// of over the whole result at the end (`finalize_avg`).
    pub fn averages_in_steps(&self) -> bool {
        self.steps.iter().any(|s| {
            matches!(
                s.action,
                Action::Recv {
                    then: Combine::ReduceComplete | Combine::ReduceCompleteInput,
                    ..
                }
            )
        })
    }

    /// Whether a peer in this process may read this rank's output sends in
    /// place (a view of the region instead of a copy, the send counting as
    /// done once handed over): every region this rank sends is overwritten
    /// only by data that its receiver produced after reading it, when all
    /// ranks run the same algorithm (a ring: what overwrites a sent segment
    /// comes round the ring after its receiver reduced or forwarded it). A
    /// driver that lends must still not write a region whose view is out,
    /// nor hand the output back before every view is released.
    pub fn lendable(&self) -> bool {
        self.lendable
    }

    /// The steps `id` waits for; each is earlier in [`steps`](Self::steps).
    pub fn deps(&self, id: StepId) -> &[StepId] {
        let r = &self.steps[id.index()].deps;
        &self.deps[r.start as usize..r.end as usize]
    }
}

/// Builds a [`Plan`], deriving each step's dependencies from the `output`
/// ranges it reads and writes, so algorithms state only what moves where.
///
/// Out of place ([`Builder::out_of_place`]), an algorithm written for data
/// in `output` runs on data in `input` (laid out the same), which stays
/// untouched, without first copying it over: as each step comes, a region
/// of `output` not yet written is read from `input` instead (a send of it
/// sends `input`'s range; a reduction into it reduces `input`'s range with
/// the payload, [`Combine::ReduceInput`]). A step touching a region only
/// partly written first copies the unwritten part over, and whatever no
/// step wrote is copied at the end, so the result is the in-place plan's.
pub(crate) struct Builder {
    plan: Plan,
    /// Disjoint intervals covering `output`, each with its last writer and
    /// the readers since; split on demand at step boundaries.
    intervals: Vec<Interval>,
    /// Whether this rank's data is in `input` rather than `output`.
    out_of_place: bool,
}

#[derive(Clone)]
struct Interval {
    start: usize,
    writer: Option<StepId>,
    readers: Vec<StepId>,
}

impl Builder {
    pub(crate) fn new(rank: usize, world: usize, input_len: usize, output_len: usize) -> Self {
        Builder {
            plan: Plan {
                rank,
                world,
                input_len,
                output_len,
                steps: Vec::new(),
                deps: Vec::new(),
                lendable: false,
            },
            intervals: vec![Interval {
                start: 0,
                writer: None,
                readers: Vec::new(),
            }],
            out_of_place: false,
        }
    }

    /// A builder whose algorithm, written for data in `output`, finds it in
    /// an `input` of `output_len` elements instead (see [`Builder`]).
    pub(crate) fn out_of_place(rank: usize, world: usize, output_len: usize) -> Self {
        let mut builder = Self::new(rank, world, output_len, output_len);
        builder.out_of_place = true;
        builder
    }

    /// Sends `src` to `to`; skipped (`None`) when empty.
    pub(crate) fn send(&mut self, to: usize, tag: Tag, src: Region) -> Option<StepId> {
        let (Region::Input(r) | Region::Output(r)) = &src;
        (!r.is_empty()).then(|| self.push(Action::Send { to, tag, src }, &[]))
    }

    /// Receives into `dst` from `from`; skipped (`None`) when empty.
    pub(crate) fn recv(&mut self, from: usize, tag: Tag, dst: Range<usize>, then: Combine) -> Option<StepId> {
        (!dst.is_empty()).then(|| self.push(Action::Recv { from, tag, dst, then }, &[]))
    }

    /// Copies `input[src]` to `output[dst]`; skipped (`None`) when empty.
    pub(crate) fn copy(&mut self, src: Range<usize>, dst: Range<usize>) -> Option<StepId> {
        debug_assert_eq!(src.len(), dst.len());
        (!dst.is_empty()).then(|| self.push(Action::Copy { src, dst }, &[]))
    }

    /// Appends `action`, after `extra` and after every earlier step it
    /// conflicts with on `output`. Zero-length messages (barrier) carry no
    /// data, so their ordering comes from `extra` alone.
    pub(crate) fn push(&mut self, action: Action, extra: &[StepId]) -> StepId {
        let action = if self.out_of_place {
            self.reading_input(action)
        } else {
            action
        };
        let id = StepId(self.plan.steps.len() as u32);
        let mut deps: Vec<StepId> = extra.to_vec();
        let (range, write) = match (action.writes(), action.reads()) {
            (Some(w), _) => (Some(w.clone()), true),
            (None, Some(r)) => (Some(r.clone()), false),
            (None, None) => (None, false),
        };
        if let Some(range) = range.filter(|r| !r.is_empty()) {
            let (first, last) = (self.split(range.start), self.split(range.end));
            for iv in &mut self.intervals[first..last] {
                deps.extend(iv.writer);
                if write {
                    deps.append(&mut iv.readers);
                    iv.writer = Some(id);
                } else {
                    iv.readers.push(id);
                }
            }
        }
        deps.sort_unstable();
        deps.dedup();
        let start = self.plan.deps.len() as u32;
        self.plan.deps.extend(deps);
        let end = self.plan.deps.len() as u32;
        self.plan.steps.push(Step {
            action,
            deps: start..end,
        });
        id
    }

    /// Makes an interval start at `at` (unless `at` is past the end) and
    /// returns its index.
    fn split(&mut self, at: usize) -> usize {
        let i = self.intervals.partition_point(|iv| iv.start <= at);
        // `intervals[0].start == 0`, so `i >= 1`.
        let containing = &self.intervals[i - 1];
        if containing.start == at {
            return i - 1;
        }
        let mut tail = containing.clone();
        tail.start = at;
        self.intervals.insert(i, tail);
        i
    }

    /// Out of place: `action` reading `input` where its region of `output`
    /// was never written (see [`Builder`]).
    fn reading_input(&mut self, action: Action) -> Action {
        let region = match &action {
            Action::Send {
                src: Region::Output(r), ..
            } => r.clone(),
            Action::Recv {
                dst,
                then: Combine::Reduce | Combine::ReduceComplete,
                ..
            } => dst.clone(),
            _ => return action,
        };
        let unwritten = self.unwritten(region.clone());
        if unwritten.first() != Some(&region) {
            // Written, or partly: the rest of it comes over first.
            for part in unwritten {
                self.push(
                    Action::Copy {
                        src: part.clone(),
                        dst: part,
                    },
                    &[],
                );
            }
            return action;
        }
        match action {
            Action::Send { to, tag, src } => Action::Send {
                to,
                tag,
                src: match src {
                    Region::Output(r) => Region::Input(r),
                    input => input,
                },
            },
            Action::Recv { from, tag, dst, then } => Action::Recv {
                from,
                tag,
                dst,
                then: then.with_input(),
            },
            copy => copy,
        }
    }

    /// The parts of `range` of `output` no step has written yet, merged, in order.
    fn unwritten(&mut self, range: Range<usize>) -> Vec<Range<usize>> {
        let end = range.end.min(self.plan.output_len);
        if range.start >= end {
            return Vec::new();
        }
        let (first, last) = (self.split(range.start), self.split(end));
        let mut parts: Vec<Range<usize>> = Vec::new();
        for i in first..last {
            if self.intervals[i].writer.is_some() {
                continue;
            }
            let start = self.intervals[i].start;
            let stop = self.intervals.get(i + 1).map_or(end, |next| next.start.min(end));
            match parts.last_mut() {
                Some(last) if last.end == start => last.end = stop,
                _ => parts.push(start..stop),
            }
        }
        parts
    }

    /// Marks the plan [`Plan::lendable`]; the algorithm vouches for it.
    pub(crate) fn lendable(&mut self) {
        self.plan.lendable = true;
    }

    pub(crate) fn finish(mut self) -> Plan {
        if self.out_of_place {
            for part in self.unwritten(0..self.plan.output_len) {
                self.push(
                    Action::Copy {
                        src: part.clone(),
                        dst: part,
                    },
                    &[],
                );
            }
        }
        self.plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builder_orders_conflicting_steps_only() {
        let mut b = Builder::new(0, 2, 4, 8);
        let c = b.copy(0..4, 0..4).unwrap();
        let s1 = b.send(1, Tag::new(0, 0), Region::Output(0..2)).unwrap();
        let s2 = b.send(1, Tag::new(0, 1), Region::Input(0..4)).unwrap();
        let r = b.recv(1, Tag::new(0, 0), 1..6, Combine::Reduce).unwrap();
        let s3 = b.send(1, Tag::new(1, 0), Region::Output(4..8)).unwrap();
        assert_eq!(b.recv(1, Tag::new(2, 0), 3..3, Combine::Copy), None);
        let p = b.finish();
        assert_eq!(p.deps(c), &[]);
        assert_eq!(p.deps(s1), &[c]);
        assert_eq!(p.deps(s2), &[]);
        // Write after write (copy) and write after read (s1).
        assert_eq!(p.deps(r), &[c, s1]);
        assert_eq!(p.deps(s3), &[r]);
        assert_eq!(p.steps().len(), 5);
    }
}
