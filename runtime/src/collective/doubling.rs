//! Recursive doubling (small all-reduce) and halving-doubling, Rabenseifner's
//! reduce-scatter + all-gather (medium all-reduce), for any world size.
//!
//! Both run on a power-of-two group. With `P = 2^m + rem`, the first `2 rem`
//! ranks pair up first (MPICH's scheme): each even one sends its whole buffer
//! to the odd one above it, which reduces it and joins the group; at the end
//! the odd one sends the result back.

use std::ops::Range;

use super::plan::{Builder, Combine, Region, Tag};
use super::segment::bound;

/// A rank's place in the power-of-two group.
enum Role {
    /// Folded into `rank + 1`: sends first, receives the result last.
    Extra,
    /// In the group, with this rank in the group; `absorbs` is the folded
    /// rank it reduces first and answers last.
    Member { group_rank: usize, absorbs: Option<usize> },
}

/// The power-of-two group of a world.
struct Group {
    /// `2^m`, the largest power of two not above the world size.
    size: usize,
    /// `m`.
    log: usize,
    /// World size minus `size`: how many ranks fold.
    rem: usize,
}

impl Group {
    fn new(world: usize) -> Self {
        let log = world.ilog2() as usize;
        let size = 1 << log;
        Group {
            size,
            log,
            rem: world - size,
        }
    }

    fn role(&self, rank: usize) -> Role {
        if rank >= 2 * self.rem {
            Role::Member {
                group_rank: rank - self.rem,
                absorbs: None,
            }
        } else if rank.is_multiple_of(2) {
            Role::Extra
        } else {
            Role::Member {
                group_rank: rank / 2,
                absorbs: Some(rank - 1),
            }
        }
    }

    /// The world rank of group rank `g`.
    fn world_rank(&self, g: usize) -> usize {
        if g < self.rem { 2 * g + 1 } else { g + self.rem }
    }
}

/// Runs `body` for a member of the group, wrapped in the fold and unfold of
/// the extra ranks; `body` returns the number of rounds it tagged (from 1;
/// the fold is round 0, the unfold the round after `body`'s).
fn folded(
    b: &mut Builder,
    rank: usize,
    world: usize,
    count: usize,
    rounds: usize,
    body: impl FnOnce(&mut Builder, &Group, usize),
) {
    let group = Group::new(world);
    let all = 0..count;
    let last = Tag::new(rounds + 1, 0);
    match group.role(rank) {
        Role::Extra => {
            b.send(rank + 1, Tag::new(0, 0), Region::Output(all.clone()));
            b.recv(rank + 1, last, all, Combine::Copy);
        }
        Role::Member { group_rank, absorbs } => {
            if let Some(extra) = absorbs {
                b.recv(extra, Tag::new(0, 0), all.clone(), Combine::Reduce);
            }
            body(b, &group, group_rank);
            if let Some(extra) = absorbs {
                b.send(extra, last, Region::Output(all));
            }
        }
    }
}

/// Recursive doubling all-reduce of `output[0..count]` in place: `m` rounds,
/// each exchanging the whole buffer with the partner at distance `2^k`.
pub(crate) fn recursive_doubling(b: &mut Builder, rank: usize, world: usize, count: usize) {
    let log = Group::new(world).log;
    folded(b, rank, world, count, log, |b, group, g| {
        for k in 0..group.log {
            let partner = group.world_rank(g ^ (1 << k));
            let tag = Tag::new(1 + k, 0);
            b.send(partner, tag, Region::Output(0..count));
            b.recv(partner, tag, 0..count, Combine::Reduce);
        }
    });
}

/// Halving-doubling all-reduce of `output[0..count]` in place: recursive
/// halving reduce-scatter (`m` rounds, halving the exchanged part each time,
/// so group rank `g` ends owning block `g`), then recursive doubling
/// all-gather (`m` rounds, doubling it back).
pub(crate) fn halving_doubling(b: &mut Builder, rank: usize, world: usize, count: usize) {
    let log = Group::new(world).log;
    folded(b, rank, world, count, 2 * log, |b, group, g| {
        // Elements of blocks `lo..hi` when `count` is cut into `size` blocks.
        let blocks =
            |lo: usize, hi: usize| -> Range<usize> { bound(count, group.size, lo)..bound(count, group.size, hi) };
        let (mut lo, mut hi) = (0, group.size);
        for k in 0..group.log {
            let mask = group.size >> (k + 1);
            let partner = group.world_rank(g ^ mask);
            let mid = lo + mask;
            let (keep, give) = if g & mask == 0 {
                ((lo, mid), (mid, hi))
            } else {
                ((mid, hi), (lo, mid))
            };
            let tag = Tag::new(1 + k, 0);
            b.send(partner, tag, Region::Output(blocks(give.0, give.1)));
            b.recv(partner, tag, blocks(keep.0, keep.1), Combine::Reduce);
            (lo, hi) = keep;
        }
        for k in 0..group.log {
            let mask = 1 << k;
            let partner = g ^ mask;
            let mine = g & !(mask - 1);
            let theirs = partner & !(mask - 1);
            let tag = Tag::new(1 + group.log + k, 0);
            let partner = group.world_rank(partner);
            b.send(partner, tag, Region::Output(blocks(mine, mine + mask)));
            b.recv(partner, tag, blocks(theirs, theirs + mask), Combine::Copy);
        }
    });
}
