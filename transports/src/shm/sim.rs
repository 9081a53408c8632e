//! The ring's records without a mapping: a writer and a reader that use
//! [`place`], [`ReadCursor`] and [`Released`] as the link does, over a
//! plain byte vector (positions wrap by copying modulo the capacity where
//! the link's double mapping makes a record one slice). The unit tests
//! (`tests/ring.rs`) and the `shm_ring` fuzz target drive it; built for
//! them only (`cfg(test)`, the `fuzzing` feature).
//!
//! Besides what each caller checks, it asserts what must hold of every
//! ring, a forged one included: the writer's placement leaves room and
//! restarts only an empty ring (SHM-4, SHM-10); the cursor asks for a
//! record header only at its position and where one is published, hands
//! out only records inside what was published, each at the cursor, no
//! longer than the ring, frames within the reader's limit and pieces
//! within their frame; after an error it has not moved.

use super::ring::{
    DATA, Place, RECORD_FIELDS, RECORD_HEADER, RESTART_AFTER, ReadCursor, Record, RecordError, RecordHeader, Released,
    piece_len, place, record_size,
};

/// A frame as the reader got it: channel, tag, payload, and where its
/// record lies when it was one record (`None`: pieced together, its pieces
/// released as read; otherwise the caller releases it).
pub type Got = (u32, u64, Vec<u8>, Option<(u64, u64)>);

/// A ring over a byte vector, with its writer's `head` and its reader's
/// cursor and released records.
#[derive(Debug)]
pub struct SliceRing {
    /// The ring's bytes (`capacity` of them).
    pub data: Vec<u8>,
    /// What the writer published (a forging test may set any value).
    pub head: u64,
    /// The reader's released records and `tail`.
    pub released: Released,
    /// The reader's walk.
    pub cursor: ReadCursor,
    max_frame: usize,
    /// The frame being pieced together.
    pool: Vec<u8>,
}

impl SliceRing {
    /// An empty ring of `capacity` bytes whose reader takes frames of up to
    /// `max_frame` bytes.
    pub fn new(capacity: usize, max_frame: usize) -> Self {
        Self {
            data: vec![0; capacity],
            head: 0,
            released: Released::default(),
            cursor: ReadCursor::new(capacity as u64, max_frame),
            max_frame,
            pool: Vec::new(),
        }
    }

    /// The ring's size in bytes.
    pub fn capacity(&self) -> u64 {
        self.data.len() as u64
    }

    fn write_at(&mut self, pos: u64, bytes: &[u8]) {
        let capacity = self.data.len();
        for (i, &byte) in bytes.iter().enumerate() {
            self.data[(pos as usize + i) % capacity] = byte;
        }
    }

    /// Writes one record as the link's writer does; `false` when full.
    pub fn try_put(&mut self, channel: u32, tag: u64, total: u64, piece: &[u8]) -> bool {
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
                self.write_at(head, &RecordHeader::skip(head, at).encode());
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
        self.write_at(at, &record.encode());
        self.write_at(at + RECORD_HEADER as u64, piece);
        self.head = at + size;
        assert!(self.head - self.released.tail() <= capacity, "head past tail's lap");
        true
    }

    /// The records of a frame as the link's writer cuts it (SHM-5).
    pub fn pieces(&self, payload: &[u8]) -> Vec<Vec<u8>> {
        if record_size(payload.len() as u64).unwrap() <= self.capacity() {
            return vec![payload.to_vec()];
        }
        payload.chunks(piece_len(self.capacity())).map(<[u8]>::to_vec).collect()
    }

    /// Reads everything published; whole frames in one record stay in
    /// the ring (the caller releases them), pieces are copied and released,
    /// skip records released.
    pub fn read(&mut self) -> Result<Vec<Got>, RecordError> {
        let mut got = Vec::new();
        loop {
            let (pos, head, capacity) = (self.cursor.pos(), self.head, self.capacity());
            let data = &self.data;
            let fields = |at: u64| -> [u8; RECORD_FIELDS] {
                assert_eq!(at, pos, "a header read away from the cursor");
                let published = head.wrapping_sub(at);
                assert!(
                    (RECORD_HEADER as u64..=capacity).contains(&published),
                    "a header read where {published} bytes are published"
                );
                read_at(data, at, RECORD_FIELDS).try_into().unwrap()
            };
            let record = match self.cursor.next(head, fields) {
                Ok(Some(record)) => record,
                Ok(None) => return Ok(got),
                Err(error) => {
                    assert_eq!(self.cursor.pos(), pos, "moved past a bad record: {error}");
                    return Err(error);
                }
            };
            self.check(&record, pos);
            assert!(self.cursor.pos() <= self.head, "read past head");
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
                    let payload = read_at(&self.data, start + RECORD_HEADER as u64, len);
                    got.push((channel, tag, payload, Some((start, end))));
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
                    let piece = read_at(&self.data, start + RECORD_HEADER as u64, len);
                    self.pool.extend_from_slice(&piece);
                    self.released.release(start, end);
                    if filled + len as u64 == total {
                        got.push((channel, tag, std::mem::take(&mut self.pool), None));
                    }
                }
            }
        }
    }

    /// Checks a record the cursor handed out, from `pos`, against what was
    /// published.
    fn check(&self, record: &Record, pos: u64) {
        let (start, end) = match *record {
            Record::Skip { start, end } => (start, end),
            Record::Frame { start, end, len, .. } => {
                assert!(len <= self.max_frame);
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
                assert!(filled + len as u64 <= total && total <= self.max_frame as u64);
                assert_eq!(end - start, record_size(len as u64).unwrap());
                (start, end)
            }
        };
        assert_eq!(start, pos, "a record not at the cursor");
        assert!(
            end > start && end <= self.head && end - start <= self.capacity(),
            "{record:?} past head {}",
            self.head
        );
    }

    /// Sends `frames` (channel, tag, payload), the reader taking and
    /// releasing what it finds whenever the writer has no room; returns
    /// what was received, in order.
    pub fn exchange(&mut self, frames: &[(u32, u64, Vec<u8>)]) -> Vec<Got> {
        let mut got = Vec::new();
        for (channel, tag, payload) in frames {
            for piece in self.pieces(payload) {
                while !self.try_put(*channel, *tag, payload.len() as u64, &piece) {
                    let read = self.read().unwrap();
                    assert!(!read.is_empty() || self.released.tail() == self.head || !self.pool.is_empty());
                    self.release_all(&read);
                    got.extend(read);
                }
            }
        }
        let read = self.read().unwrap();
        self.release_all(&read);
        got.extend(read);
        got
    }

    /// Releases the frames of `got` still in the ring.
    pub fn release_all(&mut self, got: &[Got]) {
        for (_, _, _, record) in got {
            if let Some((start, end)) = record {
                self.released.release(*start, *end);
            }
        }
    }

    /// Publishes raw header fields at `head` and moves `head` by `publish`.
    pub fn forge(&mut self, record: RecordHeader, publish: u64) {
        self.write_at(self.head, &record.encode());
        self.head += publish;
    }
}

/// `len` bytes of `data` from position `pos`, wrapping at its end.
fn read_at(data: &[u8], pos: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| data[(pos as usize + i) % data.len()]).collect()
}
