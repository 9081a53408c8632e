//! The ring's records, sans IO: where the writer puts a record (SHM-4,
//! SHM-5, SHM-10), how the reader walks and checks what was published (SHM-4, SHM-5,
//! SHM-10) and when `tail` moves (SHM-5), as plain functions of positions and
//! header bytes. The mapped ring (`shm/mapped.rs`) and the link on top
//! ([`ShmLink`](super::ShmLink)) do the memory and the waiting; the unit tests and the
//! `shm_ring` fuzz target drive these over a byte slice instead (`shm::sim`).
//!
//! Positions (`head`, `tail`, a record's `start` and `end`) count bytes
//! since the ring was made and never wrap; a position `p` lives at data
//! offset `p % capacity`, and the ring's double mapping makes the next
//! `capacity` bytes from any position one slice.

use std::collections::BTreeMap;

use thiserror::Error;

use crate::link::ChannelId;

/// Bytes in front of every record's payload; also the record alignment.
pub const RECORD_HEADER: usize = 64;
/// The bytes of a record header that hold its fields ([`RecordHeader`]);
/// the rest of its [`RECORD_HEADER`] bytes is unused.
pub const RECORD_FIELDS: usize = 32;
/// A record's kind (bytes 4..8 of its header): a frame or a piece of one.
pub const DATA: u32 = 0;
/// A record's kind: space the writer skipped, with no frame (SHM-10).
pub const SKIP: u32 = 1;
/// How far into the ring an empty ring starts over at its start (SHM-10).
pub const RESTART_AFTER: u64 = 1 << 20;

/// A record header's fields, as the writer stores them (little-endian):
/// channel, kind, tag, this record's payload length, the frame's length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    /// The frame's channel.
    pub channel: ChannelId,
    /// [`DATA`] or [`SKIP`]; anything else is refused.
    pub kind: u32,
    /// The frame's tag.
    pub tag: u64,
    /// Payload bytes in this record.
    pub len: u64,
    /// Payload bytes in the whole frame (`len` unless cut into pieces).
    pub total: u64,
}

impl RecordHeader {
    /// The header of a skip record from `from` to `to` (SHM-10).
    #[inline]
    pub fn skip(from: u64, to: u64) -> Self {
        let len = to - from - RECORD_HEADER as u64;
        Self {
            channel: 0,
            kind: SKIP,
            tag: 0,
            len,
            total: len,
        }
    }

    /// The stored form.
    #[inline]
    pub fn encode(&self) -> [u8; RECORD_FIELDS] {
        let mut record = [0u8; RECORD_FIELDS];
        record[0..4].copy_from_slice(&self.channel.to_le_bytes());
        record[4..8].copy_from_slice(&self.kind.to_le_bytes());
        record[8..16].copy_from_slice(&self.tag.to_le_bytes());
        record[16..24].copy_from_slice(&self.len.to_le_bytes());
        record[24..32].copy_from_slice(&self.total.to_le_bytes());
        record
    }

    /// Reads [`encode`](Self::encode)'s form; every byte string is some
    /// header (the reader checks it against what was published).
    #[inline]
    pub fn decode(record: &[u8; RECORD_FIELDS]) -> Self {
        let word = |at: usize| u64::from_le_bytes(record[at..at + 8].try_into().expect("8 bytes"));
        let half = |at: usize| u32::from_le_bytes(record[at..at + 4].try_into().expect("4 bytes"));
        Self {
            channel: half(0),
            kind: half(4),
            tag: word(8),
            len: word(16),
            total: word(24),
        }
    }
}

/// Bytes a record of `payload` bytes takes: its header, the payload, and
/// padding to a multiple of [`RECORD_HEADER`], so payloads are aligned.
/// `None` past `u64`, which no ring holds.
#[inline]
pub fn record_size(payload: u64) -> Option<u64> {
    payload
        .checked_add(2 * RECORD_HEADER as u64 - 1)
        .map(|end| end & !(RECORD_HEADER as u64 - 1))
}

/// Payload bytes in each piece of a frame whose record does not fit a ring
/// of `capacity` bytes: a quarter of the ring, less its header (SHM-5).
#[inline]
pub fn piece_len(capacity: u64) -> usize {
    (capacity as usize / 4).max(2 * RECORD_HEADER) - RECORD_HEADER
}

/// Where the writer puts a record ([`place`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// At this position, `head`.
    At(u64),
    /// The ring is empty far into its lap: a skip record
    /// ([`RecordHeader::skip`]) from `head` to `at`, the lap's end, then
    /// the record at `at` (SHM-10).
    Restart {
        /// The lap's end.
        at: u64,
    },
    /// No room until `tail` moves.
    Full,
}

/// Where a record of `size` bytes goes in a ring of `capacity` bytes with
/// the writer at `head` and the reader's `tail` (SHM-4, SHM-10). The writer
/// alone moves `head`, in multiples of [`RECORD_HEADER`]; a `tail` past
/// `head` (a broken reader) is no room.
#[inline]
pub fn place(head: u64, tail: u64, capacity: u64, size: u64) -> Place {
    let offset = head % capacity;
    // An empty ring starts over at its start, if the record fits before
    // the skipped space.
    if head == tail && offset >= RESTART_AFTER && size <= offset {
        return Place::Restart {
            at: head - offset + capacity,
        };
    }
    if (head + size).wrapping_sub(tail) <= capacity {
        Place::At(head)
    } else {
        Place::Full
    }
}

/// Released ranges of a ring not yet contiguous with `tail`: records are
/// released in any order (a received payload is dropped when its owner
/// likes), `tail` passes a record once it and all before it are (SHM-5).
#[derive(Debug, Default)]
pub struct Released {
    tail: u64,
    pending: BTreeMap<u64, u64>,
}

impl Released {
    /// Where `tail` stands.
    pub fn tail(&self) -> u64 {
        self.tail
    }

    /// Marks the record `start..end` released; the new `tail` when it moved
    /// (over every released range now contiguous with it).
    #[inline]
    pub fn release(&mut self, start: u64, end: u64) -> Option<u64> {
        if start != self.tail {
            self.pending.insert(start, end);
            return None;
        }
        let mut tail = end;
        while let Some(next) = self.pending.remove(&tail) {
            tail = next;
        }
        self.tail = tail;
        Some(tail)
    }
}

/// A published record, as [`ReadCursor::next`] read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// Skipped space (SHM-10): released as read.
    Skip {
        /// Where the record starts.
        start: u64,
        /// Where the next one starts.
        end: u64,
    },
    /// A whole frame in one record: its payload is the `len` bytes at
    /// `start + RECORD_HEADER`.
    Frame {
        /// The frame's channel.
        channel: ChannelId,
        /// The frame's tag.
        tag: u64,
        /// Where the record starts.
        start: u64,
        /// Where the next one starts.
        end: u64,
        /// Payload bytes.
        len: usize,
    },
    /// A piece of a frame larger than the ring (SHM-5): its `len` bytes at
    /// `start + RECORD_HEADER` follow the frame's first `filled`; the frame
    /// is whole once `filled + len == total`.
    Piece {
        /// The frame's channel.
        channel: ChannelId,
        /// The frame's tag.
        tag: u64,
        /// Payload bytes of the whole frame.
        total: u64,
        /// Where the record starts.
        start: u64,
        /// Where the next one starts.
        end: u64,
        /// Payload bytes in this piece.
        len: usize,
        /// Payload bytes of the frame in the pieces before this one.
        filled: u64,
    },
}

/// Why published records cannot be read: the writer broke the ring's
/// framing (or lied), so the link fails and nothing after is read.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
pub enum RecordError {
    /// `head` moved less than a record header, or past the ring's capacity.
    #[error("head moved to {head} with the reader at {pos}")]
    Head {
        /// The published `head`.
        head: u64,
        /// The reader's position.
        pos: u64,
    },
    /// A kind that is neither [`DATA`] nor [`SKIP`], or a skip record
    /// longer than what was published.
    #[error("a record of kind {kind} ({len} bytes, {total} in all) with {available} bytes published")]
    Kind {
        /// The record's kind.
        kind: u32,
        /// Its payload length.
        len: u64,
        /// Its frame's length.
        total: u64,
        /// Bytes published past the reader.
        available: u64,
    },
    /// A frame over the reader's limit.
    #[error("a frame of {len} bytes, over the limit of {limit}")]
    TooLarge {
        /// The announced length.
        len: u64,
        /// The reader's limit.
        limit: usize,
    },
    /// A record longer than its frame or than what was published.
    #[error("a record of {len} bytes (frame of {total}) with {available} bytes published")]
    Length {
        /// Its payload length.
        len: u64,
        /// Its frame's length.
        total: u64,
        /// Bytes published past the reader.
        available: u64,
    },
    /// A record of one frame while another's pieces were coming.
    #[error(
        "a piece of frame ({channel}, {tag}, {total} bytes) inside frame ({open_channel}, {open_tag}, {open_total} bytes)"
    )]
    Interleaved {
        /// The record's channel.
        channel: ChannelId,
        /// Its tag.
        tag: u64,
        /// Its frame's length.
        total: u64,
        /// The channel of the frame being pieced together.
        open_channel: ChannelId,
        /// Its tag.
        open_tag: u64,
        /// Its length.
        open_total: u64,
    },
    /// Pieces longer than their frame.
    #[error("pieces overflow a {total}-byte frame")]
    Overflow {
        /// The frame's length.
        total: u64,
    },
}

/// The frame whose pieces are coming (SHM-5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Assembly {
    channel: ChannelId,
    tag: u64,
    total: u64,
    filled: u64,
}

/// The reader's walk over published records (SHM-4, SHM-5, SHM-10): where the
/// next record starts and which frame's pieces are coming. It reads
/// nothing past `head` and checks every record against what was published
/// before handing it out.
#[derive(Debug)]
pub struct ReadCursor {
    pos: u64,
    capacity: u64,
    max_frame: usize,
    assembling: Option<Assembly>,
}

impl ReadCursor {
    /// A cursor at the start of a ring of `capacity` bytes (a multiple of
    /// [`RECORD_HEADER`]) whose reader takes frames of up to `max_frame`
    /// bytes.
    pub fn new(capacity: u64, max_frame: usize) -> Self {
        Self {
            pos: 0,
            capacity,
            max_frame,
            assembling: None,
        }
    }

    /// Where the next record starts.
    #[inline]
    pub fn pos(&self) -> u64 {
        self.pos
    }

    /// The next record, given the writer's `head` and `fields(pos)`, the
    /// first [`RECORD_FIELDS`] bytes at a position (called at most once,
    /// only when a whole record header is published there); `None` when
    /// nothing more is published. The cursor moves past the record it
    /// returns; after an error the ring is broken and the caller reads no
    /// more.
    #[inline]
    pub fn next(
        &mut self,
        head: u64,
        fields: impl FnOnce(u64) -> [u8; RECORD_FIELDS],
    ) -> Result<Option<Record>, RecordError> {
        let pos = self.pos;
        if head == pos {
            return Ok(None);
        }
        let available = head.wrapping_sub(pos);
        if available > self.capacity || available < RECORD_HEADER as u64 {
            return Err(RecordError::Head { head, pos });
        }
        let RecordHeader {
            channel,
            kind,
            tag,
            len,
            total,
        } = RecordHeader::decode(&fields(pos));
        // `len <= available` first: then `record_size(len)` exists.
        let size = |len: u64| record_size(len).expect("at most the ring's capacity");
        if kind == SKIP && len == total && len <= available && size(len) <= available {
            let end = pos + size(len);
            self.pos = end;
            return Ok(Some(Record::Skip { start: pos, end }));
        }
        if kind != DATA {
            return Err(RecordError::Kind {
                kind,
                len,
                total,
                available,
            });
        }
        if total > self.max_frame as u64 {
            return Err(RecordError::TooLarge {
                len: total,
                limit: self.max_frame,
            });
        }
        // The writer publishes whole records (padding included).
        if len > total || len > available || size(len) > available {
            return Err(RecordError::Length { len, total, available });
        }
        let (start, end) = (pos, pos + size(len));
        let record = match self.assembling {
            None if len == total => Record::Frame {
                channel,
                tag,
                start,
                end,
                len: len as usize,
            },
            assembling => {
                let filled = match assembling {
                    None => 0,
                    Some(open) if (open.channel, open.tag, open.total) == (channel, tag, total) => open.filled,
                    Some(open) => {
                        return Err(RecordError::Interleaved {
                            channel,
                            tag,
                            total,
                            open_channel: open.channel,
                            open_tag: open.tag,
                            open_total: open.total,
                        });
                    }
                };
                if filled + len > total {
                    return Err(RecordError::Overflow { total });
                }
                self.assembling = (filled + len != total).then_some(Assembly {
                    channel,
                    tag,
                    total,
                    filled: filled + len,
                });
                Record::Piece {
                    channel,
                    tag,
                    total,
                    start,
                    end,
                    len: len as usize,
                    filled,
                }
            }
        };
        self.pos = end;
        Ok(Some(record))
    }
}
