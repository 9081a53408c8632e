//! The state transfer's decisions, sans IO: who sends and who receives,
//! how the state is cut into chunks, which source serves which chunk in
//! each round (striped, then reassigned after a bad checksum), the chunk
//! header and checksum, the bad-chunk bitmaps ranks agree on, and the
//! [`Offer`] a receiver makes for cross-memory attach.
//! [`super::transfer`] does the communication.

use std::collections::HashMap;
use std::ops::Range;

/// Bytes in front of every chunk's payload: chunk index (`u32` LE), round
/// (`u32` LE), checksum of the payload (`u64` LE).
pub const HEADER: usize = 16;

/// What every rank says first, as `u64` words for one all-gather.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Fingerprint of its list of entries.
    pub fingerprint: u64,
    /// Bytes of its encoded entry list (broadcast on a mismatch).
    pub entries: u64,
    /// The step its state is at, if it has one.
    pub step: Option<u64>,
    /// Bytes of its extras.
    pub extra_len: u64,
    /// A random number; rank 0's names this call's frames.
    pub nonce: u64,
    /// A checksum of its whole state (entries and extras), when the call
    /// verifies the states too: equal states give equal checksums.
    pub state: Option<u64>,
}

impl Hello {
    /// Words per rank.
    pub const WORDS: usize = 8;

    /// As words.
    pub fn encode(&self) -> [u64; Self::WORDS] {
        [
            self.fingerprint,
            self.entries,
            self.step.is_some() as u64,
            self.step.unwrap_or(0),
            self.extra_len,
            self.nonce,
            self.state.is_some() as u64,
            self.state.unwrap_or(0),
        ]
    }

    /// From [`encode`](Self::encode)'s words (`None` unless exactly [`WORDS`](Self::WORDS)).
    pub fn decode(words: &[u64]) -> Option<Self> {
        let &[fingerprint, entries, has_step, step, extra_len, nonce, has_state, state] = words else {
            return None;
        };
        Some(Self {
            fingerprint,
            entries,
            step: (has_step != 0).then_some(step),
            extra_len,
            nonce,
            state: (has_state != 0).then_some(state),
        })
    }
}

/// Who sends and who receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roles {
    /// The agreed step: the most advanced members' (0 when none has one).
    pub step: u64,
    /// The ranks at that step (rank 0 when no rank has a step).
    pub sources: Vec<usize>,
    /// Everyone else: behind, or without state.
    pub receivers: Vec<usize>,
}

/// Sources are the ranks at the highest step; everyone behind receives.
pub fn roles(steps: &[Option<u64>]) -> Roles {
    match steps.iter().flatten().max() {
        Some(&max) => {
            let (sources, receivers) = (0..steps.len()).partition(|&r| steps[r] == Some(max));
            Roles {
                step: max,
                sources,
                receivers,
            }
        }
        None => Roles {
            step: 0,
            sources: vec![0],
            receivers: (1..steps.len()).collect(),
        },
    }
}

/// A byte range of one entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The entry's index.
    pub entry: usize,
    /// Bytes of the entry.
    pub bytes: Range<usize>,
    /// Where they sit in the chunk's payload.
    pub at: usize,
}

/// The state as one run of bytes (every entry in order) cut into chunks,
/// plus one last chunk for the extras.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunks {
    /// Offset of each entry in the run, and the run's length last.
    starts: Vec<usize>,
    chunk_bytes: usize,
}

impl Chunks {
    /// Entries of these sizes in bytes, in chunks of `chunk_bytes` (at least 1).
    pub fn new(sizes: &[usize], chunk_bytes: usize) -> Self {
        let mut starts = Vec::with_capacity(sizes.len() + 1);
        let mut at = 0;
        starts.push(0);
        for size in sizes {
            at += size;
            starts.push(at);
        }
        Self {
            starts,
            chunk_bytes: chunk_bytes.max(1),
        }
    }

    /// Bytes of all entries.
    pub fn total(&self) -> usize {
        *self.starts.last().expect("starts holds the total")
    }

    /// Chunks of entry bytes (the extras chunk comes after them).
    pub fn data_chunks(&self) -> usize {
        self.total().div_ceil(self.chunk_bytes)
    }

    /// All chunks, the extras' included.
    pub fn count(&self) -> usize {
        self.data_chunks() + 1
    }

    /// The index of the extras' chunk.
    pub fn extra(&self) -> usize {
        self.data_chunks()
    }

    /// A data chunk's range in the run.
    pub fn range(&self, chunk: usize) -> Range<usize> {
        let start = chunk * self.chunk_bytes;
        start.min(self.total())..(start + self.chunk_bytes).min(self.total())
    }

    /// The entry pieces a data chunk covers, in order.
    pub fn pieces(&self, chunk: usize) -> Vec<Piece> {
        let range = self.range(chunk);
        if range.is_empty() {
            return Vec::new();
        }
        // The last entry starting at or before range.start (empty entries skipped below).
        let first = self.starts.partition_point(|&s| s <= range.start).saturating_sub(1);
        let mut pieces = Vec::new();
        for entry in first..self.starts.len() - 1 {
            let (start, end) = (self.starts[entry], self.starts[entry + 1]);
            if start >= range.end {
                break;
            }
            let (from, to) = (start.max(range.start), end.min(range.end));
            if from < to {
                pieces.push(Piece {
                    entry,
                    bytes: from - start..to - start,
                    at: from - range.start,
                });
            }
        }
        pieces
    }
}

/// One chunk going from a source to a receiver in a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Transfer {
    /// The sender.
    pub source: usize,
    /// The receiver.
    pub receiver: usize,
    /// The chunk.
    pub chunk: usize,
}

/// A chunk that failed its checksum from every source tried, in every round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exhausted {
    /// The chunk.
    pub chunk: usize,
    /// The receiver that could not get it.
    pub receiver: usize,
    /// The sources tried, in order (one per round).
    pub tried: Vec<usize>,
}

/// Rounds of a transfer: round 0 stripes chunk `i` over source
/// `i mod S` for every receiver; after each round, the chunks that failed
/// their checksum go again, each from the next source it has not tried
/// (round robin over the sources once all were tried).
#[derive(Debug, Clone)]
pub struct Schedule {
    sources: Vec<usize>,
    round: u32,
    max_rounds: u32,
    pending: Vec<Transfer>,
    tried: HashMap<(usize, usize), Vec<usize>>,
    refetched: usize,
}

impl Schedule {
    /// Every receiver gets all `chunks` from `sources` (not empty), in at
    /// most `max_rounds` rounds (at least 1).
    pub fn new(sources: &[usize], receivers: &[usize], chunks: usize, max_rounds: u32) -> Self {
        assert!(!sources.is_empty(), "a transfer needs a source");
        let mut pending: Vec<Transfer> = receivers
            .iter()
            .flat_map(|&receiver| {
                (0..chunks).map(move |chunk| Transfer {
                    source: sources[chunk % sources.len()],
                    receiver,
                    chunk,
                })
            })
            .collect();
        pending.sort_unstable();
        let tried = pending
            .iter()
            .map(|t| ((t.receiver, t.chunk), vec![t.source]))
            .collect();
        Self {
            sources: sources.to_vec(),
            round: 0,
            max_rounds: max_rounds.max(1),
            pending,
            tried,
            refetched: 0,
        }
    }

    /// The current round (from 0).
    pub fn round(&self) -> u32 {
        self.round
    }

    /// This round's transfers, sorted by source, receiver, chunk.
    pub fn pending(&self) -> &[Transfer] {
        &self.pending
    }

    /// What `source` sends this round: each chunk once, with its receivers.
    pub fn sends(&self, source: usize) -> Vec<(usize, Vec<usize>)> {
        let mut by_chunk: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut mine: Vec<&Transfer> = self.pending.iter().filter(|t| t.source == source).collect();
        mine.sort_unstable_by_key(|t| (t.chunk, t.receiver));
        for t in mine {
            match by_chunk.last_mut() {
                Some((chunk, receivers)) if *chunk == t.chunk => receivers.push(t.receiver),
                _ => by_chunk.push((t.chunk, vec![t.receiver])),
            }
        }
        by_chunk
    }

    /// What `receiver` gets this round from each source, chunks ascending
    /// (the order the source sends them in).
    pub fn receives(&self, receiver: usize) -> Vec<(usize, Vec<usize>)> {
        let mut by_source: Vec<(usize, Vec<usize>)> = Vec::new();
        for t in self.pending.iter().filter(|t| t.receiver == receiver) {
            match by_source.last_mut() {
                Some((source, chunks)) if *source == t.source => chunks.push(t.chunk),
                _ => by_source.push((t.source, vec![t.chunk])),
            }
        }
        by_source
    }

    /// Chunks fetched again so far.
    pub fn refetched(&self) -> usize {
        self.refetched
    }

    /// Ends the round with the `(receiver, chunk)` pairs that failed their
    /// checksum (as every rank agreed): `Ok(true)` when none did, `Ok(false)`
    /// when the next round fetches them again, an error when one of them
    /// has no round left.
    pub fn finish_round(&mut self, bad: &[(usize, usize)]) -> Result<bool, Exhausted> {
        if bad.is_empty() {
            self.pending.clear();
            return Ok(true);
        }
        if self.round + 1 >= self.max_rounds {
            let &(receiver, chunk) = bad.iter().min().expect("not empty");
            return Err(Exhausted {
                chunk,
                receiver,
                tried: self.tried.get(&(receiver, chunk)).cloned().unwrap_or_default(),
            });
        }
        let mut next = Vec::with_capacity(bad.len());
        for &(receiver, chunk) in bad {
            let tried = self.tried.entry((receiver, chunk)).or_default();
            let last = tried
                .last()
                .and_then(|s| self.sources.iter().position(|x| x == s))
                .unwrap_or(0);
            let n = self.sources.len();
            // The next source after the last one tried that was not tried
            // yet; once all were, simply the next one.
            let source = (1..=n)
                .map(|k| self.sources[(last + k) % n])
                .find(|s| !tried.contains(s))
                .unwrap_or(self.sources[(last + 1) % n]);
            tried.push(source);
            next.push(Transfer {
                source,
                receiver,
                chunk,
            });
        }
        next.sort_unstable();
        next.dedup();
        self.refetched += next.len();
        self.pending = next;
        self.round += 1;
        Ok(false)
    }
}

/// Words of a bitmap over `chunks` chunks (at least one, so every rank's
/// row has the same non-zero length).
pub fn bitmap_words(chunks: usize) -> usize {
    chunks.div_ceil(64).max(1)
}

/// The chunks in `bad` as a bitmap of [`bitmap_words`] words.
pub fn encode_bad(chunks: usize, bad: &[usize]) -> Vec<u64> {
    let mut words = vec![0u64; bitmap_words(chunks)];
    for &chunk in bad.iter().filter(|&&c| c < chunks) {
        words[chunk / 64] |= 1 << (chunk % 64);
    }
    words
}

/// The chunks set in a bitmap, ascending (bits past `chunks` ignored).
pub fn decode_bad(chunks: usize, words: &[u64]) -> Vec<usize> {
    (0..chunks)
        .filter(|&c| words.get(c / 64).is_some_and(|w| w & (1 << (c % 64)) != 0))
        .collect()
}

/// Bytes per checksum block: a chunk's checksum is [`combine`] of its
/// blocks' [`checksum`]s, so each block is hashed right after it is copied,
/// while it is still in the cache (one pass over memory, not two).
pub const BLOCK: usize = 256 << 10;

/// The checksum of block `index` of a chunk seeded `seed`.
pub fn block_checksum(seed: u64, index: usize, block: &[u8]) -> u64 {
    // Odd multiplier (2^64 / golden ratio): every index a distinct seed.
    checksum(seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15), block)
}

/// A chunk's checksum from its blocks' ([`block_checksum`], in order).
pub fn combine(seed: u64, blocks: &[u64]) -> u64 {
    let bytes: Vec<u8> = blocks.iter().flat_map(|b| b.to_le_bytes()).collect();
    checksum(seed, &bytes)
}

/// A whole chunk's checksum, as [`block_checksum`] and [`combine`] make it.
pub fn chunk_checksum(seed: u64, data: &[u8]) -> u64 {
    let blocks: Vec<u64> = data
        .chunks(BLOCK)
        .enumerate()
        .map(|(i, block)| block_checksum(seed, i, block))
        .collect();
    combine(seed, &blocks)
}

/// A chunk's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The chunk.
    pub chunk: u32,
    /// The round it was sent in.
    pub round: u32,
    /// [`chunk_checksum`] of the payload, seeded with the chunk index.
    pub checksum: u64,
}

impl Header {
    /// Writes it into the first [`HEADER`] bytes of `out`.
    pub fn write(&self, out: &mut [u8]) {
        out[0..4].copy_from_slice(&self.chunk.to_le_bytes());
        out[4..8].copy_from_slice(&self.round.to_le_bytes());
        out[8..16].copy_from_slice(&self.checksum.to_le_bytes());
    }

    /// Reads it from a frame (`None` when shorter than [`HEADER`]).
    pub fn read(frame: &[u8]) -> Option<Self> {
        let head = frame.get(..HEADER)?;
        Some(Self {
            chunk: u32::from_le_bytes(head[0..4].try_into().ok()?),
            round: u32::from_le_bytes(head[4..8].try_into().ok()?),
            checksum: u64::from_le_bytes(head[8..16].try_into().ok()?),
        })
    }
}

/// Where one entry lies in a receiver's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Its first byte's address in the receiver's process.
    pub addr: u64,
    /// Its bytes.
    pub len: u64,
}

/// What a receiver tells a source on a shared-memory link before each
/// round: its pid and where each entry lies in its memory, so the source
/// may write chunks there with cross-memory attach (`process_vm_writev`)
/// and send only a [`Header`] (a notice) on the link. `pid` 0 or no
/// regions: every chunk comes in a frame. An entry without a region (its
/// buffer has no byte view) comes in frames too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    /// The receiver's process id (0: no cross-memory attach).
    pub pid: u32,
    /// One per entry, in [`super::state::for_each_entry`]'s order.
    pub regions: Vec<Option<Region>>,
}

impl Offer {
    /// The offer of a receiver that takes every chunk in frames.
    pub fn none() -> Self {
        Self {
            pid: 0,
            regions: Vec::new(),
        }
    }

    /// Bytes: pid (`u32` LE), entries (`u32` LE), per entry address and
    /// length (`u64` LE each; both 0: no region), then [`checksum`] of
    /// everything before (`u64` LE), so a damaged offer is refused.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + 16 * self.regions.len() + 8);
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        for region in &self.regions {
            let Region { addr, len } = region.unwrap_or(Region { addr: 0, len: 0 });
            out.extend_from_slice(&addr.to_le_bytes());
            out.extend_from_slice(&len.to_le_bytes());
        }
        let sum = checksum(OFFER_SEED, &out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    /// From [`encode`](Self::encode)'s bytes: `None` when the length or
    /// the checksum is wrong.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        let (body, sum) = bytes.split_at_checked(bytes.len().checked_sub(8)?)?;
        if checksum(OFFER_SEED, body) != u64::from_le_bytes(sum.try_into().ok()?) {
            return None;
        }
        let word = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
        let pid = u32::from_le_bytes(body.get(0..4)?.try_into().ok()?);
        let count = u32::from_le_bytes(body.get(4..8)?.try_into().ok()?) as usize;
        if body.len() != 8 + 16 * count {
            return None;
        }
        let regions = (0..count)
            .map(|i| {
                let (addr, len) = (word(8 + 16 * i), word(16 + 16 * i));
                (addr != 0).then_some(Region { addr, len })
            })
            .collect();
        Some(Self { pid, regions })
    }

    /// Whether `chunk`'s bytes may be written into the receiver's memory
    /// with these `pieces` of entries of `sizes` bytes: a region for every
    /// piece, each exactly its entry's size (anything else, and nothing is
    /// written outside the entries: the chunk comes in a frame).
    pub fn covers(&self, pieces: &[Piece], sizes: &[usize]) -> bool {
        self.pid != 0
            && !pieces.is_empty()
            && self.regions.len() == sizes.len()
            && pieces.iter().all(|p| {
                self.regions[p.entry].is_some_and(|r| r.len == sizes[p.entry] as u64 && p.bytes.end <= sizes[p.entry])
            })
    }
}

/// Seed of an [`Offer`]'s checksum.
const OFFER_SEED: u64 = 0x000F_FE12;

/// A chunk's pieces cut at the [`BLOCK`] boundaries of the chunk's
/// payload: the runs a chunk written with cross-memory attach is hashed
/// in, on both sides (each contiguous in both processes' memory). Its
/// checksum is [`combine`] of [`block_checksum`] of each segment in turn.
pub fn segments(pieces: &[Piece]) -> Vec<Piece> {
    let mut out = Vec::with_capacity(pieces.len());
    for p in pieces {
        let (mut at, end, mut from) = (p.at, p.at + p.bytes.len(), p.bytes.start);
        while at < end {
            let stop = ((at / BLOCK + 1) * BLOCK).min(end);
            out.push(Piece {
                entry: p.entry,
                bytes: from..from + (stop - at),
                at,
            });
            from += stop - at;
            at = stop;
        }
    }
    out
}

/// One rank's row of the all-gather that ends a round: the bitmap of the
/// chunks it got damaged ([`encode_bad`]), then the bytes that landed in
/// its memory by cross-memory attach this round.
pub fn encode_round(chunks: usize, bad: &[usize], cma_bytes: u64) -> Vec<u64> {
    let mut words = encode_bad(chunks, bad);
    words.push(cma_bytes);
    words
}

/// [`encode_round`]'s row back: the damaged chunks and the bytes moved by
/// cross-memory attach (`None` when the row has the wrong length).
pub fn decode_round(chunks: usize, words: &[u64]) -> Option<(Vec<usize>, u64)> {
    let (&cma, bitmap) = words.split_last()?;
    (bitmap.len() == bitmap_words(chunks)).then(|| (decode_bad(chunks, bitmap), cma))
}

/// XXH3 (64-bit) of `data` under `seed`: 20 GB/s on one core here with
/// SSE2 alone, twice XXH64's (a state transfer hashes every byte twice).
pub fn checksum(seed: u64, data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(data, seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_catch_flips_seeds_and_swapped_blocks() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut flipped = data.clone();
        flipped[517] ^= 0x10;
        assert_ne!(checksum(5, &data), checksum(5, &flipped), "one bit changes it");
        assert_ne!(
            checksum(5, &data),
            checksum(6, &data),
            "the seed (chunk index) changes it"
        );
        // Blocks: a flip anywhere, and swapping two blocks, change a chunk's sum.
        let big: Vec<u8> = (0..3 * BLOCK + 100).map(|i| (i * 13 % 251) as u8).collect();
        let sum = chunk_checksum(9, &big);
        let mut flipped = big.clone();
        flipped[2 * BLOCK + 7] ^= 1;
        assert_ne!(sum, chunk_checksum(9, &flipped));
        let mut swapped = big[BLOCK..2 * BLOCK].to_vec();
        swapped.extend_from_slice(&big[..BLOCK]);
        swapped.extend_from_slice(&big[2 * BLOCK..]);
        assert_ne!(sum, chunk_checksum(9, &swapped));
        assert_ne!(chunk_checksum(9, &[]), chunk_checksum(10, &[]));
    }

    #[test]
    fn the_most_advanced_ranks_send() {
        assert_eq!(
            roles(&[Some(5), None, Some(7), Some(7), Some(3)]),
            Roles {
                step: 7,
                sources: vec![2, 3],
                receivers: vec![0, 1, 4]
            }
        );
        assert_eq!(
            roles(&[None, None, None]),
            Roles {
                step: 0,
                sources: vec![0],
                receivers: vec![1, 2]
            }
        );
        let equal = roles(&[Some(4), Some(4)]);
        assert!(equal.receivers.is_empty());
        let hello = Hello {
            fingerprint: 9,
            entries: 3,
            step: None,
            extra_len: 12,
            nonce: 77,
            state: None,
        };
        assert_eq!(Hello::decode(&hello.encode()), Some(hello));
        let zero = Hello {
            step: Some(0),
            state: Some(0),
            ..hello
        };
        assert_eq!(Hello::decode(&zero.encode()), Some(zero), "0 is not None");
        assert_eq!(Hello::decode(&[1, 2]), None);
    }

    #[test]
    fn chunks_cut_across_entries_and_skip_empty_ones() {
        let chunks = Chunks::new(&[10, 0, 3, 20], 8);
        assert_eq!(chunks.total(), 33);
        assert_eq!(chunks.data_chunks(), 5);
        assert_eq!(chunks.extra(), 5);
        assert_eq!(chunks.range(4), 32..33);
        let piece = |entry, bytes: Range<usize>, at| Piece { entry, bytes, at };
        assert_eq!(chunks.pieces(0), [piece(0, 0..8, 0)]);
        assert_eq!(
            chunks.pieces(1),
            [piece(0, 8..10, 0), piece(2, 0..3, 2), piece(3, 0..3, 5)]
        );
        assert_eq!(chunks.pieces(4), [piece(3, 19..20, 0)]);
        // Every byte is covered exactly once.
        let mut covered = [0u8; 33];
        for c in 0..chunks.data_chunks() {
            let start = chunks.range(c).start;
            for p in chunks.pieces(c) {
                let base = [0, 10, 10, 13][p.entry];
                assert_eq!(base + p.bytes.start, start + p.at);
                for b in p.bytes {
                    covered[base + b] += 1;
                }
            }
        }
        assert!(covered.iter().all(|&n| n == 1));
        let empty = Chunks::new(&[0, 0], 8);
        assert_eq!((empty.data_chunks(), empty.count()), (0, 1));
        assert!(empty.pieces(0).is_empty());
    }

    #[test]
    fn chunks_are_striped_over_the_sources() {
        let schedule = Schedule::new(&[1, 3], &[0, 2], 5, 3);
        assert_eq!(schedule.sends(1), [(0, vec![0, 2]), (2, vec![0, 2]), (4, vec![0, 2])]);
        assert_eq!(schedule.sends(3), [(1, vec![0, 2]), (3, vec![0, 2])]);
        assert_eq!(schedule.receives(2), [(1, vec![0, 2, 4]), (3, vec![1, 3])]);
        assert!(schedule.sends(0).is_empty());
    }

    #[test]
    fn bad_chunks_go_again_from_another_source_until_the_rounds_run_out() {
        let mut schedule = Schedule::new(&[1, 2, 3], &[0], 6, 3);
        assert_eq!(schedule.finish_round(&[(0, 4)]), Ok(false));
        // Chunk 4 came from source 2 (4 mod 3 = 1); next is 3.
        assert_eq!(
            schedule.pending(),
            [Transfer {
                source: 3,
                receiver: 0,
                chunk: 4
            }]
        );
        assert_eq!(schedule.refetched(), 1);
        assert_eq!(schedule.finish_round(&[(0, 4)]), Ok(false));
        assert_eq!(schedule.pending()[0].source, 1, "then the one not tried yet");
        assert_eq!(
            schedule.finish_round(&[(0, 4)]),
            Err(Exhausted {
                chunk: 4,
                receiver: 0,
                tried: vec![2, 3, 1]
            }),
            "three rounds in all"
        );

        let mut single = Schedule::new(&[5], &[0, 1], 2, 4);
        assert_eq!(single.finish_round(&[(1, 0)]), Ok(false));
        assert_eq!(single.pending()[0].source, 5, "one source: it is asked again");
        assert_eq!(single.finish_round(&[]), Ok(true));
        assert!(single.pending().is_empty());

        // Once every source was tried, the rotation goes on.
        let mut two = Schedule::new(&[0, 1], &[2], 2, 5);
        for expected in [1, 0, 1, 0] {
            assert_eq!(two.finish_round(&[(2, 0)]), Ok(false));
            assert_eq!(two.pending()[0].source, expected);
        }
        let exhausted = two.finish_round(&[(2, 0)]).unwrap_err();
        assert_eq!(exhausted.tried, [0, 1, 0, 1, 0]);
    }

    #[test]
    fn bitmaps_and_headers_round_trip() {
        let words = encode_bad(130, &[0, 63, 64, 129, 400]);
        assert_eq!(words.len(), 3);
        assert_eq!(decode_bad(130, &words), [0, 63, 64, 129]);
        assert_eq!(encode_bad(0, &[]), [0]);
        let header = Header {
            chunk: 7,
            round: 2,
            checksum: 0xdead_beef,
        };
        let mut frame = [0u8; 20];
        header.write(&mut frame);
        assert_eq!(Header::read(&frame), Some(header));
        assert_eq!(Header::read(&frame[..15]), None);
    }
    #[test]
    fn offers_round_trip_and_refuse_damage() {
        let offer = Offer {
            pid: 4242,
            regions: vec![
                Some(Region { addr: 0x7000, len: 40 }),
                None,
                Some(Region { addr: 0x9000, len: 8 }),
            ],
        };
        let bytes = offer.encode();
        assert_eq!(Offer::decode(&bytes), Some(offer.clone()));
        assert_eq!(Offer::decode(&Offer::none().encode()), Some(Offer::none()));
        for at in [0, 5, 12, bytes.len() - 1] {
            let mut damaged = bytes.clone();
            damaged[at] ^= 4;
            assert_eq!(Offer::decode(&damaged), None, "a flip at {at} is refused");
        }
        assert_eq!(Offer::decode(&bytes[..bytes.len() - 1]), None);
        assert_eq!(Offer::decode(&[]), None);

        // Entries of 40, 0 and 8 bytes, one chunk over all of them.
        let sizes = [40, 0, 8];
        let chunks = Chunks::new(&sizes, 64);
        assert!(offer.covers(&chunks.pieces(0), &sizes), "the empty entry has no piece");
        let wrong_len = Offer {
            regions: vec![
                Some(Region { addr: 0x7000, len: 41 }),
                None,
                Some(Region { addr: 0x9000, len: 8 }),
            ],
            ..offer.clone()
        };
        assert!(!wrong_len.covers(&chunks.pieces(0), &sizes), "a region of another size");
        let missing = Offer {
            regions: vec![Some(Region { addr: 0x7000, len: 40 }), None, None],
            ..offer.clone()
        };
        assert!(!missing.covers(&chunks.pieces(0), &sizes), "an entry without a view");
        assert!(
            !Offer {
                pid: 0,
                ..offer.clone()
            }
            .covers(&chunks.pieces(0), &sizes)
        );
        assert!(!offer.covers(&chunks.pieces(0), &sizes[..2]), "another entry count");
    }

    #[test]
    fn segments_cut_pieces_at_block_boundaries() {
        let sizes = [BLOCK + 10, 2 * BLOCK, 5];
        let chunks = Chunks::new(&sizes, 3 * BLOCK);
        let piece = |entry, bytes: Range<usize>, at| Piece { entry, bytes, at };
        assert_eq!(
            segments(&chunks.pieces(0)),
            [
                piece(0, 0..BLOCK, 0),
                piece(0, BLOCK..BLOCK + 10, BLOCK),
                piece(1, 0..BLOCK - 10, BLOCK + 10),
                piece(1, BLOCK - 10..2 * BLOCK - 10, 2 * BLOCK),
            ]
        );
        assert_eq!(
            segments(&chunks.pieces(1)),
            [piece(1, 2 * BLOCK - 10..2 * BLOCK, 0), piece(2, 0..5, 10)]
        );
        // For one contiguous run, the segments' checksum is the chunk's.
        let data: Vec<u8> = (0..2 * BLOCK + 3).map(|i| (i % 251) as u8).collect();
        let one = Chunks::new(&[data.len()], data.len());
        let sums: Vec<u64> = segments(&one.pieces(0))
            .iter()
            .enumerate()
            .map(|(k, s)| block_checksum(0, k, &data[s.bytes.clone()]))
            .collect();
        assert_eq!(combine(0, &sums), chunk_checksum(0, &data));
    }

    #[test]
    fn round_rows_carry_the_bitmap_and_the_cma_bytes() {
        let row = encode_round(70, &[3, 69], 1 << 33);
        assert_eq!(row.len(), 3);
        assert_eq!(decode_round(70, &row), Some((vec![3, 69], 1 << 33)));
        assert_eq!(decode_round(70, &row[1..]), None);
        assert_eq!(decode_round(70, &[]), None);
    }
}
