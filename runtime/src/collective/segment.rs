//! How the algorithms cut buffers: nearly equal parts, and segments of at
//! most [`MAX_SEGMENT_BYTES`]. Shared by every algorithm module and using
//! none of them.

use std::ops::Range;

/// Largest segment a ring or tree sends as one message (Gloo's 1 MiB).
pub const MAX_SEGMENT_BYTES: usize = 1 << 20;

/// Fewest segments per ring chunk, so a ring of `P` ranks has at least `2P`
/// segments and sending one overlaps reducing the next (Gloo's rule).
pub const MIN_SEGMENTS_PER_CHUNK: usize = 2;

/// Start of part `i` when `n` is cut into `parts` nearly equal parts (the
/// first `n % parts` one element longer); `bound(n, parts, parts) == n`.
pub(crate) fn bound(n: usize, parts: usize, i: usize) -> usize {
    i * (n / parts) + i.min(n % parts)
}

/// Part `i` of `range` cut into `parts` nearly equal parts.
pub(crate) fn part(range: &Range<usize>, parts: usize, i: usize) -> Range<usize> {
    let n = range.len();
    range.start + bound(n, parts, i)..range.start + bound(n, parts, i + 1)
}

/// Segments per chunk: at most [`MAX_SEGMENT_BYTES`] each, at least
/// [`MIN_SEGMENTS_PER_CHUNK`] (so a ring has at least `2P` in flight), at
/// most one per element.
pub(crate) fn segments(chunk_len: usize, elem_size: usize, min: usize) -> usize {
    (chunk_len * elem_size)
        .div_ceil(MAX_SEGMENT_BYTES)
        .max(min)
        .min(chunk_len.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_range_in_order() {
        for n in [0, 1, 7, 64] {
            for parts in 1..=9 {
                let r = 3..3 + n;
                let ps: Vec<_> = (0..parts).map(|i| part(&r, parts, i)).collect();
                assert_eq!(ps[0].start, 3);
                assert_eq!(ps[parts - 1].end, 3 + n);
                assert!(
                    ps.windows(2)
                        .all(|w| w[0].end == w[1].start && w[0].len() >= w[1].len())
                );
            }
        }
    }

    #[test]
    fn segments_follow_gloos_rule() {
        // At least two per chunk, at most 1 MiB each, never empty.
        assert_eq!(segments(1000, 4, 2), 2);
        assert_eq!(segments(1, 4, 2), 1);
        assert_eq!(segments(0, 4, 2), 1);
        assert_eq!(segments(3 << 20, 1, 2), 3);
        assert_eq!(segments((3 << 20) + 1, 1, 2), 4);
    }
}
