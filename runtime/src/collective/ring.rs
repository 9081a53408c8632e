//! Segmented, pipelined rings: reduce-scatter, all-gather, and all-reduce as
//! the one followed by the other (Gloo's and NCCL's large-message path).
//!
//! The buffer is cut into `P` chunks; each ring step moves one chunk to the
//! right neighbour, segment by segment. A segment's send depends only on the
//! same segment's previous receive, so sending segment `k` overlaps receiving
//! and reducing segment `k + 1`.

use std::ops::Range;

use super::plan::{Builder, Combine, Region, Tag};
use super::segment::{MIN_SEGMENTS_PER_CHUNK, part, segments};

/// A ring over `chunks` (the `P` chunk ranges of `output`), for `rank`.
struct Ring<'a> {
    rank: usize,
    world: usize,
    chunks: &'a [Range<usize>],
    segments: usize,
}

impl Ring<'_> {
    fn right(&self) -> usize {
        (self.rank + 1) % self.world
    }

    fn left(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// Chunk index `rank - back` modulo the world.
    fn chunk(&self, back: usize) -> &Range<usize> {
        &self.chunks[(self.rank + 2 * self.world - back) % self.world]
    }

    /// `P - 1` steps, tagged from round `round0`, after which this rank holds
    /// chunk `rank` reduced over all ranks; with `mark_complete` its last
    /// round says so ([`Combine::ReduceComplete`]).
    fn reduce_scatter(&self, b: &mut Builder, round0: usize, mark_complete: bool) {
        for t in 0..self.world - 1 {
            let then = if mark_complete && t + 2 == self.world {
                Combine::ReduceComplete
            } else {
                Combine::Reduce
            };
            for s in 0..self.segments {
                let tag = Tag::new(round0 + t, s);
                b.send(
                    self.right(),
                    tag,
                    Region::Output(part(self.chunk(t + 1), self.segments, s)),
                );
                b.recv(self.left(), tag, part(self.chunk(t + 2), self.segments, s), then);
            }
        }
    }

    /// `P - 1` steps, tagged from round `round0`, that spread every rank's
    /// chunk `rank` to all ranks.
    fn all_gather(&self, b: &mut Builder, round0: usize) {
        for t in 0..self.world - 1 {
            for s in 0..self.segments {
                let tag = Tag::new(round0 + t, s);
                b.send(self.right(), tag, Region::Output(part(self.chunk(t), self.segments, s)));
                b.recv(
                    self.left(),
                    tag,
                    part(self.chunk(t + 1), self.segments, s),
                    Combine::Copy,
                );
            }
        }
    }
}

/// Ring all-reduce of `output[0..count]` in place.
pub(crate) fn all_reduce(b: &mut Builder, rank: usize, world: usize, count: usize, elem_size: usize) {
    let whole = 0..count;
    let chunks: Vec<Range<usize>> = (0..world).map(|c| part(&whole, world, c)).collect();
    let ring = Ring {
        rank,
        world,
        segments: segments(count.div_ceil(world), elem_size, MIN_SEGMENTS_PER_CHUNK),
        chunks: &chunks,
    };
    // Chunk `rank` is complete after the reduce-scatter, and the all-gather
    // only copies complete chunks: an average divides each chunk once, on
    // its owner, and ships it divided.
    ring.reduce_scatter(b, 0, true);
    ring.all_gather(b, world - 1);
    b.lendable();
}

/// `P` blocks of `count` elements.
fn blocks(world: usize, count: usize) -> Vec<Range<usize>> {
    (0..world).map(|c| c * count..(c + 1) * count).collect()
}

/// Ring reduce-scatter of `output[0..count * world]` in place; block `rank`
/// holds the result.
pub(crate) fn reduce_scatter(b: &mut Builder, rank: usize, world: usize, count: usize, elem_size: usize) {
    let chunks = blocks(world, count);
    let segments = segments(count, elem_size, MIN_SEGMENTS_PER_CHUNK);
    Ring {
        rank,
        world,
        chunks: &chunks,
        segments,
    }
    .reduce_scatter(b, 0, false);
    b.lendable();
}

/// Ring all-gather of every rank's `input[0..count]` into block `i` of
/// `output[0..count * world]`.
pub(crate) fn all_gather(b: &mut Builder, rank: usize, world: usize, count: usize, elem_size: usize) {
    let chunks = blocks(world, count);
    b.copy(0..count, chunks[rank].clone());
    let segments = segments(count, elem_size, MIN_SEGMENTS_PER_CHUNK);
    Ring {
        rank,
        world,
        chunks: &chunks,
        segments,
    }
    .all_gather(b, 0);
    b.lendable();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::collective::plan::Action;

    #[test]
    fn only_the_all_reduces_last_reduce_round_completes_its_chunk() {
        for world in [2, 3, 5] {
            for rank in 0..world {
                let mut b = Builder::new(rank, world, 0, 1000);
                all_reduce(&mut b, rank, world, 1000, 4);
                let plan = b.finish();
                assert!(plan.averages_in_steps());
                let completing: Vec<Range<usize>> = plan
                    .steps()
                    .iter()
                    .filter_map(|s| match &s.action {
                        Action::Recv {
                            dst,
                            then: Combine::ReduceComplete,
                            ..
                        } => Some(dst.clone()),
                        _ => None,
                    })
                    .collect();
                // Exactly this rank's chunk, in its segments.
                let chunk = part(&(0..1000), world, rank);
                assert_eq!(completing.first().map(|r| r.start), Some(chunk.start));
                assert_eq!(completing.last().map(|r| r.end), Some(chunk.end));
                assert!(completing.windows(2).all(|w| w[0].end == w[1].start));
            }
        }
        let mut b = Builder::new(0, 3, 0, 3000);
        reduce_scatter(&mut b, 0, 3, 1000, 4);
        assert!(!b.finish().averages_in_steps());
    }
}
