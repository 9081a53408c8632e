//! Schedules with one message per pair (in segments, below): gather and
//! scatter (direct to and from the root), all-to-all (pairwise exchange),
//! point-to-point send and receive, and the dissemination barrier.
//!
//! Gather and scatter go direct rather than through a tree: a tree would
//! forward every block `log2 P` times and need scratch on inner ranks, and
//! the root's link carries `(P - 1) * count` either way.
//!
//! Every message of gather, scatter and all-to-all goes in segments of at
//! most [`MAX_SEGMENT_BYTES`](super::MAX_SEGMENT_BYTES), as the
//! ring's do: a large one then streams through a transport's buffers (a
//! shared-memory ring smaller than the message, a QUIC stream's window)
//! and the receiver copies one segment out while the next comes in.

use std::ops::Range;

use super::plan::{Action, Builder, Combine, Region, StepId, Tag};
use super::segment::{part, segments};

/// Block `i` of `count` elements.
fn block(i: usize, count: usize) -> Range<usize> {
    i * count..(i + 1) * count
}

/// `range` cut into segments of at most `MAX_SEGMENT_BYTES` (one for an
/// empty range), each with its tag in `round`. Two ranges of one length cut
/// alike, so a sender's and a receiver's segments match.
fn segmented(range: Range<usize>, elem_size: usize, round: usize) -> impl Iterator<Item = (Tag, Range<usize>)> {
    let parts = segments(range.len(), elem_size, 1);
    (0..parts).map(move |s| (Tag::new(round, s), part(&range, parts, s)))
}

/// Sends `range` of `input` to `to` in segments.
fn send_input(b: &mut Builder, to: usize, range: Range<usize>, elem_size: usize, round: usize) {
    for (tag, segment) in segmented(range, elem_size, round) {
        b.send(to, tag, Region::Input(segment));
    }
}

/// Receives `range` of `output` from `from` in segments.
fn recv_output(b: &mut Builder, from: usize, range: Range<usize>, elem_size: usize, round: usize) {
    for (tag, segment) in segmented(range, elem_size, round) {
        b.recv(from, tag, segment, Combine::Copy);
    }
}

/// Gathers every rank's `input[0..count]` into block `i` of the root's
/// `output`.
pub(crate) fn gather(b: &mut Builder, rank: usize, world: usize, root: usize, count: usize, elem_size: usize) {
    if rank != root {
        send_input(b, root, 0..count, elem_size, 0);
        return;
    }
    b.copy(0..count, block(root, count));
    for i in (0..world).filter(|&i| i != root) {
        recv_output(b, i, block(i, count), elem_size, 0);
    }
}

/// Scatters block `i` of the root's `input` into rank `i`'s
/// `output[0..count]`.
pub(crate) fn scatter(b: &mut Builder, rank: usize, world: usize, root: usize, count: usize, elem_size: usize) {
    if rank != root {
        recv_output(b, root, 0..count, elem_size, 0);
        return;
    }
    for i in (0..world).filter(|&i| i != root) {
        send_input(b, i, block(i, count), elem_size, 0);
    }
    b.copy(block(root, count), 0..count);
}

/// All-to-all by pairwise exchange: in round `k` rank `r` sends block
/// `r + k` of its input to rank `r + k` and receives block `r - k` of its
/// output from rank `r - k`, so every round is a permutation and no link
/// carries two messages at once.
pub(crate) fn all_to_all(b: &mut Builder, rank: usize, world: usize, count: usize, elem_size: usize) {
    b.copy(block(rank, count), block(rank, count));
    for k in 1..world {
        let to = (rank + k) % world;
        let from = (rank + world - k) % world;
        send_input(b, to, block(to, count), elem_size, k);
        recv_output(b, from, block(from, count), elem_size, k);
    }
}

/// Point-to-point send of `input[0..count]` to `peer`, in one message: a
/// rank runs its operations in order, so a send must complete before the
/// peer's receive starts (both ranks may send first), and the transports
/// buffer one message whole but hold only a few per channel.
pub(crate) fn send(b: &mut Builder, peer: usize, count: usize) {
    b.send(peer, Tag::new(0, 0), Region::Input(0..count));
}

/// Point-to-point receive of `output[0..count]` from `peer`.
pub(crate) fn recv(b: &mut Builder, peer: usize, count: usize) {
    b.recv(peer, Tag::new(0, 0), 0..count, Combine::Copy);
}

/// Dissemination barrier: in round `k` rank `r` sends an empty message to
/// `r + 2^k` and waits for one from `r - 2^k`, each send after the previous
/// round's receive (and each receive after the one before); after `ceil(log2 P)` rounds every rank has heard,
/// transitively, from every other.
pub(crate) fn barrier(b: &mut Builder, rank: usize, world: usize) {
    let mut heard: Option<StepId> = None;
    let mut k = 0;
    while (1 << k) < world {
        let d = 1 << k;
        let tag = Tag::new(k, 0);
        let send = Action::Send {
            to: (rank + d) % world,
            tag,
            src: Region::Output(0..0),
        };
        b.push(send, heard.as_slice());
        let recv = Action::Recv {
            from: (rank + world - d) % world,
            tag,
            dst: 0..0,
            then: Combine::Copy,
        };
        // Chained, so each send carries everything heard in earlier rounds.
        heard = Some(b.push(recv, heard.as_slice()));
        k += 1;
    }
}
