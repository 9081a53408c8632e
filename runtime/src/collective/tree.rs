//! Binomial trees rooted at any rank: broadcast and reduce in `ceil(log2 P)`
//! rounds, segmented so a large buffer pipelines down (or up) the levels,
//! and all-reduce as a reduce to rank 0 followed by a broadcast from it.
//!
//! Ranks are renumbered relative to the root (`v = rank - root mod P`). The
//! parent of `v` is `v` without its lowest set bit; the edge to a child
//! `v + 2^k` is round `k`.

use std::ops::Range;

use super::plan::{Builder, Combine, Region, Tag};
use super::segment::{part, segments};

/// Ranks relative to a root.
struct Tree {
    root: usize,
    world: usize,
    /// This rank, relative to the root.
    v: usize,
}

impl Tree {
    fn new(rank: usize, world: usize, root: usize) -> Self {
        Tree {
            root,
            world,
            v: (rank + world - root) % world,
        }
    }

    fn world_rank(&self, v: usize) -> usize {
        (v + self.root) % self.world
    }

    /// The parent's world rank and the edge's round, unless this is the root.
    fn parent(&self) -> Option<(usize, usize)> {
        (self.v != 0).then(|| {
            let k = self.v.trailing_zeros() as usize;
            (self.world_rank(self.v - (1 << k)), k)
        })
    }

    /// The children's world ranks and rounds, smallest subtree first.
    fn children(&self) -> impl DoubleEndedIterator<Item = (usize, usize)> + '_ {
        // The root's children span every bit; others' the bits below their lowest.
        let below = if self.v == 0 {
            usize::BITS
        } else {
            self.v.trailing_zeros()
        };
        let fan = (0..below as usize)
            .take_while(|&k| self.v + (1 << k) < self.world)
            .count();
        (0..fan).map(|k| (self.world_rank(self.v + (1 << k)), k))
    }
}

/// Segments of `output[0..count]` that travel separately down or up a tree.
fn pieces(count: usize, elem_size: usize) -> impl Iterator<Item = (usize, Range<usize>)> {
    let n = segments(count, elem_size, 1);
    (0..n).map(move |s| (s, part(&(0..count), n, s)))
}

/// Binomial-tree broadcast of the root's `output[0..count]`.
pub(crate) fn broadcast(b: &mut Builder, rank: usize, world: usize, root: usize, count: usize, elem_size: usize) {
    broadcast_from_round(b, rank, world, root, count, elem_size, 0);
}

/// [`broadcast`] with its rounds tagged from `first_round`.
fn broadcast_from_round(
    b: &mut Builder,
    rank: usize,
    world: usize,
    root: usize,
    count: usize,
    elem_size: usize,
    first_round: usize,
) {
    let tree = Tree::new(rank, world, root);
    for (s, seg) in pieces(count, elem_size) {
        if let Some((parent, k)) = tree.parent() {
            b.recv(parent, Tag::new(first_round + k, s), seg.clone(), Combine::Copy);
        }
        // Largest subtree first: it has the most levels left to go.
        for (child, k) in tree.children().rev() {
            b.send(child, Tag::new(first_round + k, s), Region::Output(seg.clone()));
        }
    }
}

/// Binomial-tree reduce of every rank's `output[0..count]` into the root's;
/// other ranks' outputs end up holding partial results.
pub(crate) fn reduce(b: &mut Builder, rank: usize, world: usize, root: usize, count: usize, elem_size: usize) {
    let tree = Tree::new(rank, world, root);
    for (s, seg) in pieces(count, elem_size) {
        for (child, k) in tree.children() {
            b.recv(child, Tag::new(k, s), seg.clone(), Combine::Reduce);
        }
        if let Some((parent, k)) = tree.parent() {
            b.send(parent, Tag::new(k, s), Region::Output(seg));
        }
    }
}

/// All-reduce of `output[0..count]` in place: a binomial-tree reduce to rank
/// 0, then a binomial-tree broadcast of the result. `2 (P - 1)` messages in
/// all, against recursive doubling's `P log2 P`, in twice the rounds: the
/// cheaper of the two where many ranks share few threads (one process), so
/// the messages' total cost, not the rounds' latency, sets the time.
pub(crate) fn all_reduce(b: &mut Builder, rank: usize, world: usize, count: usize, elem_size: usize) {
    reduce(b, rank, world, 0, count, elem_size);
    // Rounds past the reduce's: the tags of the two halves never meet.
    let reduce_rounds = world.next_power_of_two().trailing_zeros() as usize;
    broadcast_from_round(b, rank, world, 0, count, elem_size, reduce_rounds);
}
