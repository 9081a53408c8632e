//! The shared-memory ring's records (`chorus_transports::shm::ring`): the
//! writer's placement (`place`, skip records), the reader's cursor
//! (`ReadCursor`, every check on what a peer published) and `tail`'s
//! bookkeeping (`Released`), over a byte vector instead of the mapping
//! (positions wrap by copying modulo the capacity, where the mapping's
//! second view makes a record one slice).
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
//! Checks, besides "no panic":
//! - exchange: every frame arrives whole, in order, with its channel and
//!   tag; the cursor never passes `head`; once everything is released,
//!   `tail` is `head`; a ring left empty past `RESTART_AFTER` restarts.
//! - forged: the cursor asks for a record header only where one is
//!   published, hands out only records inside what was published, each at
//!   the cursor, no longer than the ring, frames within the limit and
//!   pieces within their frame; after an error it has not moved.
#![no_main]

use chorus_transports::shm::ring::{
    DATA, Place, RECORD_FIELDS, RECORD_HEADER, RESTART_AFTER, ReadCursor, Record, RecordHeader, Released, piece_len,
    place, record_size,
};
use libfuzzer_sys::fuzz_target;

fn read_at(data: &[u8], pos: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| data[(pos as usize + i) % data.len()]).collect()
}

fn write_at(data: &mut [u8], pos: u64, bytes: &[u8]) {
    let capacity = data.len();
    for (i, &byte) in bytes.iter().enumerate() {
        data[(pos as usize + i) % capacity] = byte;
    }
}

/// The payload of the frame tagged `tag`, so the reader can check it.
fn payload(tag: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(31).wrapping_add(tag) as u8)
        .collect()
}

/// Checks a record the cursor handed out against what was published.
fn check(record: &Record, pos: u64, head: u64, capacity: u64, max_frame: usize) {
    let (start, end) = match *record {
        Record::Skip { start, end } => (start, end),
        Record::Frame { start, end, len, .. } => {
            assert!(len <= max_frame);
            assert_eq!(end - start, record_size(len as u64).unwrap());
            (start, end)
        }
        Record::Piece {
            start,
            end,
            len,
            filled,
            total,
            ..
        } => {
            assert!(filled + len as u64 <= total && total <= max_frame as u64);
            assert_eq!(end - start, record_size(len as u64).unwrap());
            (start, end)
        }
    };
    assert_eq!(start, pos, "a record not at the cursor");
    assert!(
        end > start && end <= head && end - start <= capacity,
        "{record:?} past head {head}"
    );
}

struct Ring {
    data: Vec<u8>,
    head: u64,
    released: Released,
    cursor: ReadCursor,
    max_frame: usize,
    pool: Vec<u8>,
    /// Whole frames read and not released: (start, end).
    held: Vec<(u64, u64)>,
    /// Frames received: (channel, tag, payload).
    got: Vec<(u32, u64, Vec<u8>)>,
}

impl Ring {
    fn capacity(&self) -> u64 {
        self.data.len() as u64
    }

    fn try_put(&mut self, channel: u32, tag: u64, total: u64, piece: &[u8]) -> bool {
        let size = record_size(piece.len() as u64).unwrap();
        let (head, tail, capacity) = (self.head, self.released.tail(), self.capacity());
        let at = match place(head, tail, capacity, size) {
            Place::Full => {
                assert!(head + size - tail > capacity, "room refused");
                return false;
            }
            Place::At(at) => at,
            Place::Restart { at } => {
                assert!(head == tail && head % capacity >= RESTART_AFTER && at % capacity == 0);
                write_at(&mut self.data, head, &RecordHeader::skip(head, at).encode());
                at
            }
        };
        let record = RecordHeader {
            channel,
            kind: DATA,
            tag,
            len: piece.len() as u64,
            total,
        };
        write_at(&mut self.data, at, &record.encode());
        write_at(&mut self.data, at + RECORD_HEADER as u64, piece);
        self.head = at + size;
        assert!(self.head - self.released.tail() <= capacity);
        true
    }

    fn read(&mut self) {
        loop {
            let pos = self.cursor.pos();
            let data = &self.data;
            let record = self
                .cursor
                .next(self.head, |at| read_at(data, at, RECORD_FIELDS).try_into().unwrap())
                .expect("the writer's own records are valid");
            let Some(record) = record else { return };
            check(&record, pos, self.head, self.capacity(), self.max_frame);
            match record {
                Record::Skip { start, end } => {
                    self.released.release(start, end);
                }
                Record::Frame {
                    channel,
                    tag,
                    start,
                    end,
                    len,
                } => {
                    let bytes = read_at(&self.data, start + RECORD_HEADER as u64, len);
                    self.got.push((channel, tag, bytes));
                    self.held.push((start, end));
                }
                Record::Piece {
                    channel,
                    tag,
                    total,
                    start,
                    end,
                    len,
                    filled,
                } => {
                    assert_eq!(filled, self.pool.len() as u64);
                    let bytes = read_at(&self.data, start + RECORD_HEADER as u64, len);
                    self.pool.extend_from_slice(&bytes);
                    self.released.release(start, end);
                    if filled + len as u64 == total {
                        self.got.push((channel, tag, std::mem::take(&mut self.pool)));
                    }
                }
            }
        }
    }

    fn release(&mut self, index: usize) {
        if !self.held.is_empty() {
            let (start, end) = self.held.remove(index % self.held.len());
            self.released.release(start, end);
        }
    }

    fn release_all(&mut self) {
        while !self.held.is_empty() {
            self.release(0);
        }
    }
}

fn exchange(capacity: usize, scale: usize, ops: &[u8]) {
    let mut ring = Ring {
        data: vec![0; capacity],
        head: 0,
        released: Released::default(),
        cursor: ReadCursor::new(capacity as u64, usize::MAX),
        max_frame: usize::MAX,
        pool: Vec::new(),
        held: Vec::new(),
        got: Vec::new(),
    };
    let mut sent = Vec::new();
    for op in ops.chunks_exact(4) {
        let arg = usize::from(u16::from_le_bytes([op[2], op[3]]));
        match op[0] % 4 {
            0 | 1 => {
                let (channel, tag) = (u32::from(op[1]), sent.len() as u64);
                let frame = payload(tag, arg * scale);
                let pieces: Vec<&[u8]> = if record_size(frame.len() as u64).unwrap() <= ring.capacity() {
                    vec![&frame]
                } else {
                    frame.chunks(piece_len(ring.capacity())).collect()
                };
                for piece in pieces {
                    while !ring.try_put(channel, tag, frame.len() as u64, piece) {
                        ring.read();
                        ring.release_all();
                    }
                }
                sent.push((channel, tag, frame));
            }
            2 => ring.read(),
            _ => ring.release(arg),
        }
    }
    ring.read();
    ring.release_all();
    assert_eq!(ring.cursor.pos(), ring.head);
    assert_eq!(ring.released.tail(), ring.head, "everything released, tail is head");
    assert!(ring.got == sent, "frames lost, changed or reordered");
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
    let mut data = vec![0; capacity];
    data[..split].copy_from_slice(&rest[..split]);
    let mut cursor = ReadCursor::new(capacity as u64, max_frame);
    let mut head = 0u64;
    for step in rest[split..].chunks_exact(2) {
        head = head.wrapping_add(u64::from(u16::from_le_bytes([step[0], step[1]])));
        loop {
            let pos = cursor.pos();
            let asked = |at: u64| {
                assert_eq!(at, pos);
                let published = head.wrapping_sub(at);
                assert!((RECORD_HEADER as u64..=capacity as u64).contains(&published));
                read_at(&data, at, RECORD_FIELDS).try_into().unwrap()
            };
            match cursor.next(head, asked) {
                Ok(Some(record)) => check(&record, pos, head, capacity as u64, max_frame),
                Ok(None) => break,
                Err(error) => {
                    assert_eq!(cursor.pos(), pos, "moved past a bad record: {error}");
                    return;
                }
            }
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
