//! The shared-memory ring's records (`chorus_transports::shm::ring`): the
//! writer's placement (`place`, skip records), the reader's cursor
//! (`ReadCursor`, every check on what a peer published) and `tail`'s
//! bookkeeping (`Released`), through `shm::sim::SliceRing`, the simulator
//! the unit tests use: a writer and a reader over a byte vector instead of
//! the mapping (positions wrap by copying modulo the capacity, where the
//! mapping's second view makes a record one slice). Needs the transports'
//! `fuzzing` feature.
//!
//! Input: byte 0 picks the mode, the ring's capacity and the reader's
//! limit; the rest drives it.
//! - Mode "exchange": 4-byte operations (send a frame of some length on a
//!   channel, read what is published, release a held frame); frames larger
//!   than the ring go in pieces; the writer, finding no room, has the
//!   reader read and release everything first.
//! - Mode "forged": the rest is the ring's content, then `u16` steps the
//!   writer's `head` takes (any value: a lying peer).
//!
//! Checks, besides "no panic" and the simulator's own (the writer's room
//! and restarts; the cursor asks for a record header only where one is
//! published, hands out only records inside what was published, each at
//! the cursor, no longer than the ring, frames within the limit and pieces
//! within their frame; after an error it has not moved):
//! - exchange: every frame arrives whole, in order, with its channel and
//!   tag; the cursor never passes `head`; once everything is released,
//!   `tail` is `head`; a ring left empty past `RESTART_AFTER` restarts.
//! - forged: reading stops at the first error.
#![no_main]

use chorus_transports::shm::ring::{Place, RESTART_AFTER, place, record_size};
use chorus_transports::shm::sim::SliceRing;
use libfuzzer_sys::fuzz_target;

/// The payload of the frame tagged `tag`, so the reader can check it.
fn payload(tag: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(tag) as u8)
        .collect()
}

/// The reader's side of "exchange": frames received, and the whole frames
/// read and not released (their records' start and end).
#[derive(Default)]
struct Reader {
    got: Vec<(u32, u64, Vec<u8>)>,
    held: Vec<(u64, u64)>,
}

impl Reader {
    fn read(&mut self, ring: &mut SliceRing) {
        for (channel, tag, bytes, record) in ring.read().expect("the writer's own records are valid") {
            self.got.push((channel, tag, bytes));
            self.held.extend(record);
        }
    }

    fn release(&mut self, ring: &mut SliceRing, index: usize) {
        if !self.held.is_empty() {
            let (start, end) = self.held.remove(index % self.held.len());
            ring.released.release(start, end);
        }
    }

    fn release_all(&mut self, ring: &mut SliceRing) {
        while !self.held.is_empty() {
            self.release(ring, 0);
        }
    }
}

fn exchange(capacity: usize, scale: usize, ops: &[u8]) {
    let mut ring = SliceRing::new(capacity, usize::MAX);
    let mut reader = Reader::default();
    let mut sent = Vec::new();
    for op in ops.chunks_exact(4) {
        let arg = usize::from(u16::from_le_bytes([op[2], op[3]]));
        match op[0] % 4 {
            0 | 1 => {
                let (channel, tag) = (u32::from(op[1]), sent.len() as u64);
                let frame = payload(tag, arg * scale);
                for piece in ring.pieces(&frame) {
                    while !ring.try_put(channel, tag, frame.len() as u64, &piece) {
                        reader.read(&mut ring);
                        reader.release_all(&mut ring);
                    }
                }
                sent.push((channel, tag, frame));
            }
            2 => reader.read(&mut ring),
            _ => reader.release(&mut ring, arg),
        }
    }
    reader.read(&mut ring);
    reader.release_all(&mut ring);
    assert_eq!(ring.cursor.pos(), ring.head);
    assert_eq!(ring.released.tail(), ring.head, "everything released, tail is head");
    assert!(reader.got == sent, "frames lost, changed or reordered");
    let lap = ring.head % ring.capacity();
    if lap >= RESTART_AFTER {
        let size = record_size(0).unwrap();
        assert!(matches!(
            place(ring.head, ring.head, ring.capacity(), size),
            Place::Restart { .. }
        ));
    }
}

fn forged(capacity: usize, max_frame: usize, rest: &[u8]) {
    let split = rest.len().min(capacity);
    let mut ring = SliceRing::new(capacity, max_frame);
    ring.data[..split].copy_from_slice(&rest[..split]);
    for step in rest[split..].chunks_exact(2) {
        ring.head = ring
            .head
            .wrapping_add(u64::from(u16::from_le_bytes([step[0], step[1]])));
        if ring.read().is_err() {
            return;
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    // Small rings wrap often; 2 MiB ones go past RESTART_AFTER.
    let (capacity, scale) = if mode & 0x40 != 0 {
        (2 << 20, 64)
    } else {
        (usize::from(mode >> 2 & 0xf) * 256 + 256, 1)
    };
    if mode & 1 == 0 {
        exchange(capacity, scale, rest);
    } else {
        let max_frame = if mode & 2 == 0 { usize::MAX } else { 4 * capacity };
        forged(capacity, max_frame, rest);
    }
});
