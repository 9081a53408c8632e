//! Shared-memory links between processes of one host (as NCCL's SHM
//! transport): one ring per direction in a file under `/dev/shm`, mapped by
//! both processes.
//!
//! # Ring layout
//! The file `<dir>/chorus-<writer nonce, 16 hex digits>-to-<reader rank>` is
//! one header page then `capacity` bytes of data (a multiple of the page
//! size). Both sides map the data area twice, back to back (a "magic ring
//! buffer"), so a record that crosses the end of the ring is still
//! contiguous in memory and any record up to `capacity` bytes is one slice.
//!
//! | header bytes | field (all little-endian atomics) | written by |
//! |---|---|---|
//! | 0..8 | magic `chorusR1`, stored last (`Release`) | writer, once |
//! | 8..12, 12..16 | version, writer pid | writer, once |
//! | 16..24, 24..32 | capacity, data offset (the page size) | writer, once |
//! | 32..40, 40..48 | writer rank, reader rank | writer, once |
//! | 48..52 | reader pid (non-zero once the reader has attached) | reader, once |
//! | 56..64 | writer's pid namespace (inode of `/proc/self/ns/pid`, 0 if unknown) | writer, once |
//! | 128..136 | `head`: bytes published | writer |
//! | 136..140, 140..144, 144..148 | `head_seq` (futex), writer sleeping, writer closed | writer |
//! | 256..264 | `tail`: bytes released | reader |
//! | 264..268, 268..272, 272..276 | `tail_seq` (futex), channels awaited (a mask), reader closed | reader |
//! | 384..388, 388..1408 | writer's close notice: length, bytes | writer, once |
//! | 1408..1412, 1412..2432 | reader's close notice: length, bytes | reader, once |
//!
//! `head` and `tail` count bytes since the ring was made and never wrap; a
//! position `p` lives at data offset `p % capacity`. A record is a 64-byte
//! header (`u32` channel, `u32` kind: 0 a frame or a piece of one, 1
//! skipped space (rule 10); `u64` tag, `u64` length of this record's
//! payload, `u64` length of the whole frame) then the payload, padded to a
//! multiple of 64 bytes, so payloads are 64-byte aligned.
//!
//! # Protocol
//! 1. A rank draws a random 64-bit nonce ([`ShmEndpoint::new`]) and
//!    publishes it through rendezvous; the nonce names its rings, so names
//!    never collide across processes or runs.
//! 2. Connecting ([`ShmEndpoint::connect_mesh`]) first creates every
//!    outbound ring (`O_EXCL`, mode 0600, sized with `ftruncate` after
//!    checking that the tmpfs has room for it, so a small `/dev/shm` is an
//!    error now rather than a `SIGBUS` later), then attaches every inbound
//!    ring, then waits until every peer has attached to this rank's rings.
//!    Both sides of a pair must connect concurrently. The ring's pages are
//!    reserved (`posix_fallocate`) by a background thread, not while
//!    connecting, and mapped in by faults on first use: reserving and
//!    `MAP_POPULATE`-ing 64 MiB rings to every local peer took 0.1-0.7 s on
//!    2 cores, most of a group restart, and populating them in the
//!    background held the mmap lock the ranks need (0.1-0.5 s more). A ring
//!    that does not fit fails its link before the writer's next record.
//! 3. The writer fills the header and stores the magic last; a reader that
//!    finds magic 0 waits, any other wrong magic, version or size is a typed
//!    [`TransportError::Protocol`]. The reader checks that the file is its
//!    own user's, maps it, stores its pid, and unlinks the file: from then on
//!    nothing is left behind whatever happens. A crash between creating and
//!    the peer's attach (the connect window) leaves the file behind, until
//!    [`remove_dead_rings`] finds it: a ring whose writer's pid is dead in
//!    the writer's own pid namespace is removed (the lowest local rank of
//!    a mesh sweeps before creating its rings, `chorus launch` once its
//!    workers are gone).
//! 4. The writer alone moves `head`, the reader alone moves `tail`;
//!    `head - tail <= capacity` always. The writer copies a record into
//!    `[head, head + size)` only once `tail` allows it, then publishes it
//!    with one `head` store; the reader reads nothing past `head` and the
//!    writer writes nothing in `[tail, head)`.
//! 5. A frame whose record fits the ring is one record, handed to the
//!    receiver without a copy (a `Bytes` over the mapping); `tail` passes it
//!    once that `Bytes` and all its clones are dropped (records released out
//!    of order wait for the ones before them). A larger frame is cut into
//!    pieces of a quarter of the ring, consecutive in the ring, which the
//!    receiver copies into a reused buffer and releases at once.
//! 6. Reading: records are read in order and filed into bounded
//!    per-channel queues by whichever thread reads, under one lock. A
//!    receive that finds its queue empty reads the ring itself, on its own
//!    thread, polling for up to 50 us (yielding the core between rounds of
//!    polls); a frame that comes in that time costs no thread a wake-up.
//!    Then it raises its channel's bit in the `awaited` mask, reads once
//!    more, and waits: from then on the link's watcher thread reads for it.
//! 7. Sleeping: the writer spins for a few microseconds for room, then
//!    reads the futex word, raises its sleeping flag, re-checks `tail` and
//!    `FUTEX_WAIT`s with a timeout; the reader bumps the word and wakes it
//!    after moving `tail` if the flag is up. The watcher sleeps on the
//!    other word; the writer bumps it and wakes it after publishing a
//!    record whose channel is awaited, or a piece of a frame larger than the
//!    ring (the rest of the frame needs the room the piece frees). Every
//!    timeout (the liveness interval, 100 ms by default) checks the peer's
//!    pid, so a peer that died without closing is an error, not a hang.
//! 8. Closing raises this side's closed flag in both rings and wakes every
//!    sleeper; the peer still receives every record published before it.
//!    A close on purpose ([`Link::close_with`]) first writes its encoded
//!    [`CloseNotice`] next to the flag (length last), so the peer gets
//!    [`TransportError::PeerClosed`]; a flag without a notice (a cut, a
//!    dropped link) is a lost link. A ring of another version is a typed
//!    error when attaching (rule 3).
//! 9. Frames read but not received (in their channels' queues, or
//!    waiting for room in one) lie in the ring and hold `tail` back, so
//!    frames of another channel behind them could wait for room forever
//!    (a frame larger than the ring, or enough frames to go round it,
//!    behind a frame its receiver takes only later). When the watcher
//!    finds the writer sleeping for room and `tail` unmoved for 20 ms with
//!    such frames in the ring, it copies them out, which releases their
//!    records. It looks on each wake, at least once per liveness
//!    interval.
//! 10. A writer that finds the ring empty (`tail == head`) 1 MiB or more
//!     into it, with the record fitting before that point, publishes a
//!     skip record to the ring's end and writes at its start: the lines it
//!     writes were written and read a moment ago and are still in the
//!     cache, instead of lines never touched since the last lap (a
//!     2 MiB all-reduce ran 2.5x faster, BENCHMARKS 22). The reader
//!     releases a skip record as it reads it. A ring in use goes on as
//!     before, so a backlog still has the whole ring.
//!
//! # Copies and costs
//! A frame that fits the ring is copied once (sender into the ring);
//! [`Link::poll_send_copy`] (and [`Link::try_send_copy`], which does not
//! wait) copies a borrowed payload straight in, so a caller needs no owned
//! frame either; while the ring is full one watcher thread per link waits
//! on the futex for every such sender and wakes them. The
//! receiver must drop received payloads promptly: a payload held forever
//! pins its bytes of the ring, and the sender waits once the ring is full
//! (the collectives reduce from a payload, then drop it); frames not
//! received yet are copied out instead when they hold the writer up
//! (rule 9). A channel whose queue is full stops reading until a receive
//! of it takes a frame, so frames of other channels behind it wait too
//! (receive every channel you send on). Small frames cost a receive that
//! comes in time no thread hand-off; one that waits costs two (the
//! watcher, then the receiving task), as every frame did when a reader
//! thread read them all. Peer liveness uses pids: both processes must
//! share a pid namespace.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use tokio::sync::{Notify, watch};

use crate::link::{ChannelId, CloseNotice, Frame, HEARTBEAT_CHANNEL, Link, SendError, TransportError, TransportKind};

/// `chorusR1`: marks a fully initialized ring.
const MAGIC: u64 = u64::from_le_bytes(*b"chorusR1");
const VERSION: u32 = 3;
/// Bytes in front of every record's payload; also the record alignment.
const RECORD_HEADER: usize = 64;
/// A record's kind (bytes 4..8 of its header): a frame or a piece of one.
const DATA: u32 = 0;
/// A record's kind: space the writer skipped, with no frame (rule 10).
const SKIP: u32 = 1;
/// How far into the ring an empty ring starts over at its start (rule 10).
const RESTART_AFTER: u64 = 1 << 20;
/// How many times a side polls before sleeping on the futex: counted, not
/// timed (reading the clock on every turn profiled at 11% of a small
/// all-reduce), and short, since on a machine with fewer cores than
/// spinning threads a long spin steals the core the peer needs (4096 polls
/// made an 8-byte all-reduce 50% slower on 2 cores).
const SPIN_POLLS: u32 = 128;
/// Payloads up to this size are copied on the calling task when the ring
/// has room; larger ones are copied on the blocking pool.
const INLINE_LIMIT: usize = 64 << 10;
/// How long a receive that finds nothing polls the ring on its own thread
/// before it waits to be woken: a peer a few microseconds behind then
/// costs no wake-ups (a wake-up costs 10-25 us here, BENCHMARKS 18).
const RECEIVE_SPIN: Duration = Duration::from_micros(50);
/// How long the writer may wait for room behind frames read but not
/// received before they are copied out of the ring (rule 9): long enough
/// that a receive about to take them usually does, since the copy is then
/// wasted.
const UNRECEIVED_GRACE: Duration = Duration::from_millis(20);

/// The ring header, at the start of the file. Every field is an atomic, so
/// both processes may touch it through shared references.
#[repr(C)]
struct Header {
    magic: AtomicU64,
    version: AtomicU32,
    writer_pid: AtomicU32,
    capacity: AtomicU64,
    data_offset: AtomicU64,
    writer_rank: AtomicU64,
    reader_rank: AtomicU64,
    reader_pid: AtomicU32,
    writer_pid_ns: AtomicU64,
    writer: WriterLine,
    reader: ReaderLine,
    writer_notice: NoticeArea,
    reader_notice: NoticeArea,
}

/// Bytes of an encoded close notice a ring header holds per side.
const NOTICE_BYTES: usize = 1020;
const _: () = assert!(CloseNotice::MAX_ENCODED <= NOTICE_BYTES);

/// Where one side leaves its [`CloseNotice`] when it closes on purpose
/// (rule 8): written once, before that side's closed flag.
#[repr(C)]
struct NoticeArea {
    len: AtomicU32,
    bytes: [AtomicU8; NOTICE_BYTES],
}

impl NoticeArea {
    fn write(&self, encoded: &[u8]) {
        let encoded = &encoded[..encoded.len().min(NOTICE_BYTES)];
        for (slot, &byte) in self.bytes.iter().zip(encoded) {
            slot.store(byte, Ordering::Relaxed);
        }
        self.len.store(encoded.len() as u32, Ordering::Release);
    }

    /// The notice, if the side left one; read after seeing its closed flag.
    fn read(&self) -> Option<CloseNotice> {
        let len = (self.len.load(Ordering::Acquire) as usize).min(NOTICE_BYTES);
        (len > 0).then(|| {
            let bytes: Vec<u8> = self.bytes[..len].iter().map(|b| b.load(Ordering::Relaxed)).collect();
            CloseNotice::decode(&bytes)
        })
    }
}

/// Fields the writer moves, on their own cache lines (128 bytes: adjacent
/// line prefetch would otherwise share them with the reader's).
#[repr(C, align(128))]
struct WriterLine {
    head: AtomicU64,
    head_seq: AtomicU32,
    sleeping: AtomicU32,
    closed: AtomicU32,
}

/// Fields the reader moves.
#[repr(C, align(128))]
struct ReaderLine {
    tail: AtomicU64,
    tail_seq: AtomicU32,
    /// Channels ([`channel_bit`]) whose records wake the reader's watcher.
    awaited: AtomicU32,
    closed: AtomicU32,
}

// The layout in the module doc.
const _: () = assert!(
    std::mem::size_of::<Header>() <= 4096
        && std::mem::offset_of!(Header, reader_pid) == 48
        && std::mem::offset_of!(Header, writer_pid_ns) == 56
        && std::mem::offset_of!(Header, writer) == 128
        && std::mem::offset_of!(Header, reader) == 256
        && std::mem::offset_of!(Header, writer_notice) == 384
        && std::mem::offset_of!(Header, reader_notice) == 1408
);

/// Settings of shared-memory links.
#[derive(Debug, Clone)]
pub struct ShmOptions {
    /// Bytes of ring per direction (rounded up to the page size). Frames
    /// whose record (64 bytes + payload) fits are sent without a copy on the
    /// receiver; larger ones go in pieces and are copied once more.
    pub capacity: usize,
    /// Largest frame accepted from a peer.
    pub max_frame: usize,
    /// Frames a channel's receive queue holds before reading stops behind it.
    pub depth: usize,
    /// How long connecting may take.
    pub connect_timeout: Duration,
    /// How often a sleeping side checks that its peer is alive.
    pub liveness_interval: Duration,
    /// Where the ring files live (a tmpfs).
    pub dir: PathBuf,
}

impl Default for ShmOptions {
    fn default() -> Self {
        Self {
            // A 64 MiB frame (a typical gradient bucket) plus its header is
            // one record, so it reaches the receiver without a copy.
            capacity: (64 << 20) + (64 << 10),
            max_frame: 1 << 30,
            depth: 16,
            connect_timeout: Duration::from_secs(60),
            liveness_interval: Duration::from_millis(100),
            dir: PathBuf::from("/dev/shm"),
        }
    }
}

/// A peer as rendezvous described it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmPeer {
    /// Its rank.
    pub rank: usize,
    /// The nonce it published ([`ShmEndpoint::nonce`]).
    pub nonce: u64,
}

/// One rank's side of the shared-memory transport: its nonce and settings.
#[derive(Debug)]
pub struct ShmEndpoint {
    rank: usize,
    nonce: u64,
    options: ShmOptions,
}

fn connect_error(peer: usize, reason: impl std::fmt::Display) -> TransportError {
    TransportError::Connect {
        peer,
        reason: reason.to_string(),
    }
}

fn protocol_error(peer: usize, reason: impl std::fmt::Display) -> TransportError {
    TransportError::Protocol {
        peer,
        reason: reason.to_string(),
    }
}

/// The page size, which ring sizes are multiples of.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096).max(4096)
}

fn ring_path(dir: &Path, writer_nonce: u64, reader_rank: usize) -> PathBuf {
    dir.join(format!("chorus-{writer_nonce:016x}-to-{reader_rank}"))
}

/// A record header's fields as bytes (the rest of its 64 bytes is unused):
/// channel, kind, tag, this record's payload length, the frame's length.
fn record_header(channel: ChannelId, kind: u32, tag: u64, len: u64, total: u64) -> [u8; 32] {
    let mut record = [0u8; 32];
    record[0..4].copy_from_slice(&channel.to_le_bytes());
    record[4..8].copy_from_slice(&kind.to_le_bytes());
    record[8..16].copy_from_slice(&tag.to_le_bytes());
    record[16..24].copy_from_slice(&len.to_le_bytes());
    record[24..32].copy_from_slice(&total.to_le_bytes());
    record
}

fn record_size(payload: usize) -> u64 {
    (RECORD_HEADER + payload).next_multiple_of(RECORD_HEADER) as u64
}

impl ShmEndpoint {
    /// Rank `rank`'s endpoint with a fresh random nonce; nothing is created
    /// until [`connect_mesh`](Self::connect_mesh).
    pub fn new(rank: usize, options: ShmOptions) -> Result<Self, TransportError> {
        let mut nonce = [0u8; 8];
        // SAFETY: getrandom writes at most `nonce.len()` bytes into `nonce`.
        let got = unsafe { libc::getrandom(nonce.as_mut_ptr().cast(), nonce.len(), 0) };
        if got != nonce.len() as isize {
            return Err(connect_error(
                rank,
                format!("no random nonce: {}", io::Error::last_os_error()),
            ));
        }
        Ok(Self::with_nonce(rank, u64::from_le_bytes(nonce), options))
    }

    /// Rank `rank`'s endpoint with a nonce it already published (so the
    /// options can be chosen once the peers are known).
    pub fn with_nonce(rank: usize, nonce: u64, options: ShmOptions) -> Self {
        let page = page_size();
        let options = ShmOptions {
            capacity: options.capacity.max(1).next_multiple_of(page),
            depth: options.depth.max(1),
            ..options
        };
        Self { rank, nonce, options }
    }

    /// The value to publish through rendezvous.
    pub fn nonce(&self) -> u64 {
        self.nonce
    }

    /// Connects to every peer but this rank; the peers do the same
    /// concurrently. Returns the links indexed by rank (`None` for this rank).
    pub async fn connect_mesh(&self, peers: &[ShmPeer]) -> Result<Vec<Option<Arc<dyn Link>>>, TransportError> {
        let world = peers.iter().map(|p| p.rank + 1).max().unwrap_or(0).max(self.rank + 1);
        let mut links: Vec<Option<Arc<dyn Link>>> = (0..world).map(|_| None).collect();
        for link in self.connect_all(peers).await? {
            let peer = link.peer;
            links[peer] = Some(Arc::new(link));
        }
        Ok(links)
    }

    /// Connects to one peer, which must connect back concurrently.
    pub async fn connect(&self, peer: ShmPeer) -> Result<ShmLink, TransportError> {
        let mut links = self.connect_all(&[peer]).await?;
        links
            .pop()
            .ok_or_else(|| connect_error(peer.rank, "a rank cannot link to itself"))
    }

    async fn connect_all(&self, peers: &[ShmPeer]) -> Result<Vec<ShmLink>, TransportError> {
        let peers: Vec<ShmPeer> = peers.iter().copied().filter(|p| p.rank != self.rank).collect();
        let deadline = Instant::now() + self.options.connect_timeout;
        // Files this rank made and no peer has unlinked yet (rule 3).
        let mut created = Created(Vec::new());
        let mut outbound = Vec::new();
        for peer in &peers {
            let path = ring_path(&self.options.dir, self.nonce, peer.rank);
            let ring = Ring::create(&path, self.options.capacity, self.rank, peer.rank)
                .map_err(|e| connect_error(peer.rank, format!("creating {}: {e}", path.display())))?;
            created.0.push(path);
            outbound.push((Arc::new(ring.0), Some(ring.1)));
        }
        let mut inbound = Vec::new();
        for peer in &peers {
            let path = ring_path(&self.options.dir, peer.nonce, self.rank);
            inbound.push(Arc::new(self.attach(&path, *peer, deadline).await?));
        }
        for ((ring, _), peer) in outbound.iter().zip(&peers) {
            while ring.header().reader_pid.load(Ordering::Acquire) == 0 {
                if Instant::now() >= deadline {
                    return Err(connect_error(
                        peer.rank,
                        format!("it did not attach within {:?}", self.options.connect_timeout),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        // Every reader mapped its ring: the names go before the pages are
        // reserved, since an unlink waits for a running fallocate (the
        // file's lock) while holding the directory's, which stalls every
        // rank creating or opening a ring on this host meanwhile.
        for (path, (ring, file)) in created.0.drain(..).zip(&mut outbound) {
            let _ = std::fs::remove_file(&path);
            if let Some(file) = file.take() {
                let len = ring.data_offset as u64 + ring.capacity;
                reserve_in_background(file, len, ring.reservation.clone());
            }
        }
        let outbound: Vec<Arc<Ring>> = outbound.into_iter().map(|(ring, _)| ring).collect();
        Ok(peers
            .iter()
            .zip(outbound.into_iter().zip(inbound))
            .map(|(peer, (outbound, inbound))| ShmLink::new(self.rank, peer.rank, outbound, inbound, &self.options))
            .collect())
    }

    /// Waits until the peer's ring to this rank exists and is initialized,
    /// then maps it and unlinks it.
    async fn attach(&self, path: &Path, peer: ShmPeer, deadline: Instant) -> Result<Ring, TransportError> {
        loop {
            if let Some(ring) = Ring::open(path, peer.rank, self.rank)? {
                // Mapped: the name is no longer needed (rule 3).
                let _ = std::fs::remove_file(path);
                return Ok(ring);
            }
            if Instant::now() >= deadline {
                return Err(connect_error(
                    peer.rank,
                    format!(
                        "its ring {} did not appear within {:?}",
                        path.display(),
                        self.options.connect_timeout
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// Ring files to unlink if connecting fails.
struct Created(Vec<PathBuf>);

impl Drop for Created {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// An address-space reservation holding a ring's mappings; unmapped on drop.
struct Mapping {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; all shared state
// in it is accessed through atomics or within the ring protocol's ranges.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only hands out raw pointers and atomics.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base..base + len` is a reservation this value made and
        // owns; nothing borrows from it once the last owner is dropped.
        unsafe {
            libc::munmap(self.base.cast(), self.len);
        }
    }
}

fn mmap_error(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl Mapping {
    /// Maps `file`'s header page and then its data area twice in a row.
    fn ring(file: &File, data_offset: usize, capacity: usize) -> io::Result<Self> {
        let len = data_offset + 2 * capacity;
        // SAFETY: a fresh anonymous PROT_NONE reservation; the kernel picks
        // the address.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(mmap_error("reserving address space"));
        }
        let mapping = Self { base: base.cast(), len };
        let views = [
            (0, 0, data_offset + capacity),
            (data_offset + capacity, data_offset, capacity),
        ];
        for (at, offset, view_len) in views {
            // SAFETY: MAP_FIXED replaces pages inside our own reservation
            // (`at + view_len <= len`); the file is at least
            // `data_offset + capacity` bytes long.
            let view = unsafe {
                libc::mmap(
                    mapping.base.add(at).cast(),
                    view_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    file.as_raw_fd(),
                    offset as libc::off_t,
                )
            };
            if view == libc::MAP_FAILED {
                return Err(mmap_error("mapping the ring"));
            }
        }
        Ok(mapping)
    }

    /// Maps only the header page, to read a ring's geometry.
    fn header(file: &File, data_offset: usize) -> io::Result<Self> {
        // SAFETY: a fresh shared mapping of the file's first page; the
        // caller checked that the file is at least that long.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                data_offset,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(mmap_error("mapping a ring header"));
        }
        Ok(Self {
            base: base.cast(),
            len: data_offset,
        })
    }

    fn header_ref(&self) -> &Header {
        // SAFETY: `base` is page-aligned and at least one page (>= the
        // header's size) is mapped read-write for `self`'s lifetime; every
        // field is an atomic, so the peer writing them is no data race.
        unsafe { &*self.base.cast::<Header>() }
    }
}

/// Released ranges of the inbound ring not yet contiguous with `tail`.
#[derive(Default)]
struct Released {
    tail: u64,
    pending: BTreeMap<u64, u64>,
}

/// Room in the tmpfs that holds the rings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TmpfsSpace {
    /// Bytes free for an unprivileged user.
    pub free: u64,
    /// The filesystem's size in bytes.
    pub size: u64,
}

/// The room on the filesystem holding `file`.
fn space_of(file: &File) -> io::Result<TmpfsSpace> {
    // SAFETY: statvfs is plain data; fstatvfs fills it from our own fd.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid fd and a valid out-pointer.
    if unsafe { libc::fstatvfs(file.as_raw_fd(), &mut stat) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let block = stat.f_frsize as u64;
    Ok(TmpfsSpace {
        free: stat.f_bavail as u64 * block,
        size: stat.f_blocks as u64 * block,
    })
}

/// The room in the directory `dir` (where [`ShmOptions::dir`] puts rings).
pub fn tmpfs_space(dir: &Path) -> io::Result<TmpfsSpace> {
    space_of(&File::open(dir)?)
}

/// This process's pid namespace (the inode of `/proc/self/ns/pid`), 0 where
/// `/proc` does not say: a pid only means something within its namespace.
fn pid_namespace() -> u64 {
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |meta| meta.ino())
}

/// Removes the ring files in `dir` left by writers that died before their
/// reader attached (rule 3): files of this user whose header is a chorus
/// ring written from this pid namespace by a pid that no longer runs.
/// Anything else (another user's file, a ring of a live writer or of
/// another pid namespace, whose pids this process cannot check, a file
/// being initialized) stays. Returns how many it removed.
pub fn remove_dead_rings(dir: &Path) -> usize {
    let namespace = pid_namespace();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if namespace == 0 || !name.starts_with("chorus-") || !name.contains("-to-") {
            continue;
        }
        let path = entry.path();
        // Not followed and a plain file only: opening a FIFO would block.
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if !meta.file_type().is_file() || meta.uid() != me {
            continue;
        }
        let mut head = [0u8; 64];
        let read = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .and_then(|mut file| io::Read::read_exact(&mut file, &mut head));
        if read.is_err() {
            continue;
        }
        let field = |at: usize, len: usize| {
            let mut bytes = [0u8; 8];
            bytes[..len].copy_from_slice(&head[at..at + len]);
            u64::from_le_bytes(bytes)
        };
        let (magic, writer_pid, writer_namespace) = (field(0, 8), field(12, 4) as u32, field(56, 8));
        if magic == MAGIC && writer_namespace == namespace && !alive(writer_pid) && std::fs::remove_file(&path).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

/// Reserves a ring's pages in the tmpfs (`posix_fallocate`) on a thread of
/// its own (rule 2), so a full tmpfs fails the link rather than `SIGBUS`ing
/// the writer later; records why it failed in `failed`. Only the file is
/// touched, not the mapping: the connecting and running ranks need their
/// process's mmap lock, which `MAP_POPULATE` or `MADV_POPULATE_WRITE` would
/// hold (measured: 0.1-0.5 s added to a restart on 2 busy cores). Pages
/// reserved this way are mapped in by minor faults on first use.
fn reserve_in_background(file: File, len: u64, failed: Arc<std::sync::OnceLock<String>>) {
    let reported = failed.clone();
    let spawned = std::thread::Builder::new()
        .name("chorus-shm-reserve".into())
        .spawn(move || {
            // Zeroing the pages yields to the ranks' own threads.
            // SAFETY: changes only this thread's nice value.
            unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 10) };
            // SAFETY: fallocate on an fd this thread owns; it only reserves pages.
            let err = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
            if err != 0 {
                let e = io::Error::from_raw_os_error(err);
                let _ = reported.set(format!("reserving the {len}-byte ring in the tmpfs failed: {e}"));
            }
        });
    if let Err(e) = spawned {
        let _ = failed.set(format!("could not start the thread reserving the ring: {e}"));
    }
}

/// One direction's ring, as mapped by either side.
struct Ring {
    map: Mapping,
    data_offset: usize,
    capacity: u64,
    released: Mutex<Released>,
    /// Why reserving the ring's pages failed, once it did (writer side).
    reservation: Arc<std::sync::OnceLock<String>>,
}

impl Ring {
    /// Creates, sizes and initializes the ring `writer_rank` sends on.
    fn create(path: &Path, capacity: usize, writer_rank: usize, reader_rank: usize) -> io::Result<(Ring, File)> {
        let data_offset = page_size();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)?;
        let ring = (|| {
            let len = (data_offset + capacity) as u64;
            let free = space_of(&file)?.free;
            if free < len {
                return Err(io::Error::new(
                    io::ErrorKind::StorageFull,
                    format!("a ring needs {len} bytes and the tmpfs has {free} free (is it big enough?)"),
                ));
            }
            file.set_len(len)?;
            let map = Mapping::ring(&file, data_offset, capacity)?;
            let header = map.header_ref();
            header.version.store(VERSION, Ordering::Relaxed);
            header.writer_pid.store(std::process::id(), Ordering::Relaxed);
            header.writer_pid_ns.store(pid_namespace(), Ordering::Relaxed);
            header.capacity.store(capacity as u64, Ordering::Relaxed);
            header.data_offset.store(data_offset as u64, Ordering::Relaxed);
            header.writer_rank.store(writer_rank as u64, Ordering::Relaxed);
            header.reader_rank.store(reader_rank as u64, Ordering::Relaxed);
            header.magic.store(MAGIC, Ordering::Release);
            Ok((
                Ring {
                    map,
                    data_offset,
                    capacity: capacity as u64,
                    released: Mutex::default(),
                    reservation: Arc::default(),
                },
                file,
            ))
        })();
        if ring.is_err() {
            let _ = std::fs::remove_file(path);
        }
        ring
    }

    /// Opens and maps the ring `writer_rank` made for `reader_rank`:
    /// `None` while it does not exist or is not initialized yet.
    fn open(path: &Path, writer_rank: usize, reader_rank: usize) -> Result<Option<Ring>, TransportError> {
        let peer = writer_rank;
        let file = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
        {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(connect_error(peer, format!("opening {}: {e}", path.display())));
            }
        };
        let meta = file
            .metadata()
            .map_err(|e| connect_error(peer, format!("inspecting {}: {e}", path.display())))?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me || meta.mode() & 0o077 != 0 {
            return Err(connect_error(
                peer,
                format!("{} is not a private file of this user", path.display()),
            ));
        }
        let data_offset = page_size();
        if meta.len() < data_offset as u64 {
            return Ok(None);
        }
        let bad = |reason: String| Err(protocol_error(peer, format!("{}: {reason}", path.display())));
        let capacity = {
            let map = Mapping::header(&file, data_offset).map_err(|e| connect_error(peer, e))?;
            let header = map.header_ref();
            match header.magic.load(Ordering::Acquire) {
                0 => return Ok(None),
                MAGIC => {}
                other => return bad(format!("not a chorus ring (magic {other:#018x})")),
            }
            let version = header.version.load(Ordering::Relaxed);
            if version != VERSION {
                return bad(format!("ring version {version}, expected {VERSION}"));
            }
            let offset = header.data_offset.load(Ordering::Relaxed);
            let capacity = header.capacity.load(Ordering::Relaxed);
            if offset != data_offset as u64
                || capacity == 0
                || capacity % data_offset as u64 != 0
                || meta.len() != data_offset as u64 + capacity
            {
                return bad(format!(
                    "inconsistent geometry: data offset {offset}, capacity {capacity}, file size {}",
                    meta.len()
                ));
            }
            let (from, to) = (
                header.writer_rank.load(Ordering::Relaxed),
                header.reader_rank.load(Ordering::Relaxed),
            );
            if (from, to) != (writer_rank as u64, reader_rank as u64) {
                return bad(format!(
                    "the ring links rank {from} to {to}, expected {writer_rank} to {reader_rank}"
                ));
            }
            capacity as usize
        };
        let map = Mapping::ring(&file, data_offset, capacity).map_err(|e| connect_error(peer, e))?;
        // The geometry was read from another mapping; the one used must agree.
        if map.header_ref().capacity.load(Ordering::Acquire) != capacity as u64 {
            return Err(protocol_error(peer, "the ring's capacity changed while attaching"));
        }
        map.header_ref().reader_pid.store(std::process::id(), Ordering::Release);
        Ok(Some(Ring {
            map,
            data_offset,
            capacity: capacity as u64,
            released: Mutex::default(),
            // The writer reserves the pages; a failure shows on its side.
            reservation: Arc::default(),
        }))
    }

    fn header(&self) -> &Header {
        self.map.header_ref()
    }

    /// Where position `pos` lives; the double mapping makes the next
    /// `capacity` bytes contiguous.
    fn at(&self, pos: u64) -> *mut u8 {
        // SAFETY: `data_offset + pos % capacity < data_offset + capacity`,
        // inside the reservation.
        unsafe { self.map.base.add(self.data_offset + (pos % self.capacity) as usize) }
    }

    /// Whether `ptr` points into the data area (either mapping of it).
    fn holds(&self, ptr: *const u8) -> bool {
        let start = self.at(0) as usize;
        (start..start + 2 * self.capacity as usize).contains(&(ptr as usize))
    }

    /// Bumps both futex words and wakes everyone sleeping on them.
    fn poke(&self) {
        let header = self.header();
        for word in [&header.writer.head_seq, &header.reader.tail_seq] {
            word.fetch_add(1, Ordering::SeqCst);
            futex_wake(word);
        }
    }

    /// Marks `start..end` consumed; advances `tail` over every released
    /// range now contiguous with it and wakes a sleeping writer.
    fn release(&self, start: u64, end: u64) {
        let mut released = self.released.lock().unwrap_or_else(|p| p.into_inner());
        if start != released.tail {
            released.pending.insert(start, end);
            return;
        }
        let mut tail = end;
        while let Some(next) = released.pending.remove(&tail) {
            tail = next;
        }
        released.tail = tail;
        let header = self.header();
        header.reader.tail.store(tail, Ordering::SeqCst);
        if header.writer.sleeping.load(Ordering::SeqCst) != 0 {
            header.reader.tail_seq.fetch_add(1, Ordering::SeqCst);
            futex_wake(&header.reader.tail_seq);
        }
    }
}

/// Sleeps while `word` holds `expected`, at most `timeout`; whether it
/// timed out (then the caller checks the peer is alive).
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> bool {
    let timeout = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned u32 in a shared mapping (no PRIVATE
    // flag: the peer process wakes it); the kernel only reads it. Timeouts,
    // spurious wakes and EAGAIN all just return to the caller's re-check.
    let slept = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &timeout as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        )
    };
    slept != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ETIMEDOUT)
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned u32; FUTEX_WAKE does not touch it.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Whether process `pid` still runs (a killed child its parent has not
/// reaped yet is a zombie and counts as dead). Pid 0 means not known yet.
fn alive(pid: u32) -> bool {
    if pid == 0 {
        return true;
    }
    // SAFETY: signal 0 only checks that the process exists.
    if unsafe { libc::kill(pid as libc::pid_t, 0) } != 0
        && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rfind(')').and_then(|i| stat[i + 1..].trim_start().chars().next()),
            Some('Z' | 'X')
        ),
        Err(_) => true,
    }
}

/// A received payload still in the ring; dropping the last clone releases
/// its record.
struct RingSlice {
    ring: Arc<Ring>,
    start: u64,
    end: u64,
    len: usize,
}

impl AsRef<[u8]> for RingSlice {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the reader validated `len + RECORD_HEADER <= end - start <=
        // capacity`, so the slice lies in the double-mapped data area, which
        // `ring` keeps mapped; the writer does not write `[tail, head)` and
        // `tail` stays at or before `start` until this value is dropped
        // (rule 4).
        unsafe { std::slice::from_raw_parts(self.ring.at(self.start).add(RECORD_HEADER), self.len) }
    }
}

impl Drop for RingSlice {
    fn drop(&mut self) {
        self.ring.release(self.start, self.end);
    }
}

/// A channel's frames read but not received yet.
#[derive(Default)]
struct Queue {
    frames: Mutex<VecDeque<Frame>>,
    /// Wakes the receive waiting for the next frame.
    filed: Notify,
    /// One receive of a channel at a time, so frames go out in order.
    receiving: tokio::sync::Mutex<()>,
}

impl Queue {
    fn pop(&self) -> Option<Frame> {
        self.frames.lock().unwrap_or_else(|p| p.into_inner()).pop_front()
    }
}

/// Reading the inbound ring: the next record's position, the frame being
/// reassembled from pieces, a frame waiting for room in its queue.
#[derive(Default)]
struct ReadState {
    pos: u64,
    pool: BytesMut,
    /// (channel, tag, total length) of the frame being reassembled.
    assembling: Option<(ChannelId, u64, u64)>,
    stalled: Option<(ChannelId, Frame)>,
    /// A bad record failed the link: nothing after it is read.
    broken: bool,
}

/// What a link's handle and its watcher thread share.
struct Shared {
    me: usize,
    peer: usize,
    outbound: Arc<Ring>,
    inbound: Arc<Ring>,
    queues: Mutex<HashMap<ChannelId, Arc<Queue>>>,
    depth: usize,
    /// Where reading the inbound ring stands; whoever reads holds it.
    reading: Mutex<ReadState>,
    /// `reading`'s position, for checks without the lock.
    read_pos: AtomicU64,
    /// Whether a frame waits for room in its channel's queue (reading
    /// stops behind it until a receive of that channel takes a frame).
    stalled: AtomicBool,
    /// A read was asked for while another thread was reading ([`Shared::pump`]).
    pump_wanted: AtomicBool,
    /// Receives waiting per bit of the reader's `awaited` mask.
    awaited: Mutex<[u32; 32]>,
    max_frame: usize,
    liveness_interval: Duration,
    /// Why the link failed, once it has.
    closed: watch::Sender<Option<TransportError>>,
    /// Whether the peer was told (rule 8): only the first close counts.
    told: Mutex<bool>,
    /// One writer at a time; owned guards survive a cancelled `send`.
    writing: Arc<tokio::sync::Mutex<()>>,
    /// Borrowed sends waiting for room ([`Link::poll_send_copy`]).
    room: Mutex<RoomWaiters>,
}

/// A watcher's claim on its link: dropping it ends the watch and wakes the
/// waiters, who poll again (and start the next watcher if still no room).
struct Watching(Arc<Shared>);

impl Drop for Watching {
    fn drop(&mut self) {
        let wakers = {
            let mut room = self.0.room.lock().unwrap_or_else(|p| p.into_inner());
            room.watching = false;
            std::mem::take(&mut room.wakers)
        };
        wakers.into_iter().for_each(Waker::wake);
    }
}

/// Tasks whose borrowed send found no room, and whether a watcher thread
/// waits for room on their behalf (at most one per link).
#[derive(Default)]
struct RoomWaiters {
    wakers: Vec<Waker>,
    watching: bool,
}

impl Shared {
    fn queue(&self, channel: ChannelId) -> Arc<Queue> {
        let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        queues.entry(channel).or_default().clone()
    }

    fn failure(&self) -> Option<TransportError> {
        self.closed.borrow().clone()
    }

    fn closed(&self, reason: impl std::fmt::Display) -> TransportError {
        TransportError::Closed {
            peer: self.peer,
            reason: reason.to_string(),
        }
    }

    /// Fails the link (the first error wins) and tells the peer (rule 8),
    /// leaving `notice` when this side closes on purpose.
    fn fail(&self, error: TransportError, notice: Option<&CloseNotice>) {
        // Flags first: whoever sees the error here also sees them there.
        let mut told = self.told.lock().unwrap_or_else(|p| p.into_inner());
        if !std::mem::replace(&mut *told, true) {
            if let Some(notice) = notice {
                let encoded = notice.encode();
                self.outbound.header().writer_notice.write(&encoded);
                self.inbound.header().reader_notice.write(&encoded);
            }
            self.outbound.header().writer.closed.store(1, Ordering::SeqCst);
            self.inbound.header().reader.closed.store(1, Ordering::SeqCst);
        }
        drop(told);
        self.closed.send_if_modified(|current| {
            if current.is_none() {
                *current = Some(error);
                true
            } else {
                false
            }
        });
        self.outbound.poke();
        self.inbound.poke();
    }

    /// Why the writer cannot go on, if it cannot.
    fn write_blocker(&self) -> Option<TransportError> {
        if let Some(error) = self.failure() {
            return Some(error);
        }
        if let Some(reason) = self.outbound.reservation.get() {
            let error = self.closed(reason);
            self.fail(error.clone(), Some(&CloseNotice::new(error.to_string())));
            return Some(error);
        }
        let header = self.outbound.header();
        if header.reader.closed.load(Ordering::SeqCst) != 0 {
            return Some(self.peer_closed(&header.reader_notice));
        }
        None
    }

    /// The error once the peer raised its closed flag: its notice when it
    /// left one (a close on purpose), a lost link otherwise.
    fn peer_closed(&self, notice: &NoticeArea) -> TransportError {
        match notice.read() {
            Some(notice) => notice.into_error(self.peer),
            None => self.closed(format!("rank {} dropped the link without closing it", self.peer)),
        }
    }

    fn peer_died(&self, pid: u32) -> TransportError {
        self.closed(format!("rank {} (pid {pid}) died", self.peer))
    }

    /// Where a record of `size` bytes may be written now, if anywhere;
    /// an empty ring is first skipped to its start (rule 10), which needs
    /// the writer's lock as a write does.
    fn room(&self, size: u64) -> Result<Option<u64>, TransportError> {
        if let Some(error) = self.write_blocker() {
            return Err(error);
        }
        let header = self.outbound.header();
        let head = header.writer.head.load(Ordering::Relaxed);
        let tail = header.reader.tail.load(Ordering::Acquire);
        let capacity = self.outbound.capacity;
        let offset = head % capacity;
        // An empty ring starts over at its start (rule 10), if the record
        // fits before the skipped space.
        if head == tail && offset >= RESTART_AFTER && size <= offset {
            let lap_end = head - offset + capacity;
            self.skip_to(head, lap_end);
            return Ok(Some(lap_end));
        }
        Ok((head + size - tail <= capacity).then_some(head))
    }

    /// Publishes a skip record from `head` to `to` (rule 10).
    fn skip_to(&self, head: u64, to: u64) {
        let len = to - head - RECORD_HEADER as u64;
        let record = record_header(0, SKIP, 0, len, len);
        // SAFETY: as in `put_with`: `head..to` is free (the caller checked
        // `tail`), and the reader reads nothing past `head`.
        unsafe { std::ptr::copy_nonoverlapping(record.as_ptr(), self.outbound.at(head), record.len()) };
        self.outbound.header().writer.head.store(to, Ordering::SeqCst);
    }

    /// Waits (spinning, then on the futex) until a record of `size` bytes
    /// fits; returns the position to write it at.
    fn wait_room(&self, size: u64) -> Result<u64, TransportError> {
        for _ in 0..SPIN_POLLS {
            if let Some(head) = self.room(size)? {
                return Ok(head);
            }
            std::hint::spin_loop();
        }
        let header = self.outbound.header();
        loop {
            let seq = header.reader.tail_seq.load(Ordering::SeqCst);
            header.writer.sleeping.store(1, Ordering::SeqCst);
            let room = self.room(size);
            if !matches!(room, Ok(None)) {
                header.writer.sleeping.store(0, Ordering::SeqCst);
                return room.map(|head| head.expect("matched above"));
            }
            let timed_out = futex_wait(&header.reader.tail_seq, seq, self.liveness_interval);
            header.writer.sleeping.store(0, Ordering::SeqCst);
            let pid = header.reader_pid.load(Ordering::Acquire);
            if timed_out && !alive(pid) {
                return Err(self.peer_died(pid));
            }
        }
    }

    /// Copies one record to `head` and publishes it (rule 4).
    fn put(&self, head: u64, channel: ChannelId, tag: u64, total: u64, piece: &[u8]) {
        self.put_with(head, channel, tag, total, piece.len(), &mut |payload| {
            payload.copy_from_slice(piece)
        });
    }

    /// Writes one record of `len` payload bytes to `head`, the payload by
    /// `fill` in place, and publishes it (rule 4).
    fn put_with(
        &self,
        head: u64,
        channel: ChannelId,
        tag: u64,
        total: u64,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) {
        let record = record_header(channel, DATA, tag, len as u64, total);
        let at = self.outbound.at(head);
        // SAFETY: the caller found `record_size(len)` bytes free at `head`
        // (`tail` is past them), which the double mapping makes contiguous;
        // only this writer touches free space, and the reader reads nothing
        // past `head`, so no one else sees these bytes until the store below.
        let payload = unsafe {
            std::ptr::copy_nonoverlapping(record.as_ptr(), at, record.len());
            std::slice::from_raw_parts_mut(at.add(RECORD_HEADER), len)
        };
        fill(payload);
        let header = self.outbound.header();
        header.writer.head.store(head + record_size(len), Ordering::SeqCst);
        // A piece of a frame larger than the ring always wakes the watcher:
        // the rest of the frame needs the room it frees.
        let awaited = header.reader.awaited.load(Ordering::SeqCst) & (1 << channel_bit(channel)) != 0;
        if awaited || total != len as u64 {
            header.writer.head_seq.fetch_add(1, Ordering::SeqCst);
            futex_wake(&header.writer.head_seq);
        }
    }

    /// Writes a frame of `len` bytes (filled in place) now if it is one
    /// record and fits; `false` if it must wait.
    fn try_write_with(
        &self,
        channel: ChannelId,
        tag: u64,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, TransportError> {
        let size = record_size(len);
        if size > self.outbound.capacity {
            return Ok(false);
        }
        match self.room(size)? {
            Some(head) => {
                self.put_with(head, channel, tag, len as u64, len, fill);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// [`try_write_with`](Self::try_write_with) a copy of `payload`.
    fn try_write(&self, channel: ChannelId, tag: u64, payload: &[u8]) -> Result<bool, TransportError> {
        self.try_write_with(channel, tag, payload.len(), &mut |dst| dst.copy_from_slice(payload))
    }

    /// Writes a frame, waiting for room: one record if it fits the ring,
    /// otherwise pieces of a quarter ring (rule 5).
    fn write(&self, channel: ChannelId, tag: u64, payload: &[u8]) -> Result<(), TransportError> {
        let total = payload.len() as u64;
        let capacity = self.outbound.capacity as usize;
        if record_size(payload.len()) <= capacity as u64 {
            let head = self.wait_room(record_size(payload.len()))?;
            self.put(head, channel, tag, total, payload);
            return Ok(());
        }
        let piece_len = (capacity / 4).max(2 * RECORD_HEADER) - RECORD_HEADER;
        for piece in payload.chunks(piece_len) {
            let head = self.wait_room(record_size(piece.len()))?;
            self.put(head, channel, tag, total, piece);
        }
        Ok(())
    }

    /// Wakes `waker` once a record of `size` bytes may fit, the writer lock
    /// is free, or the link fails. The wait needs a thread (the peer moves
    /// `tail` and wakes a futex); one per link serves every waiter, and the
    /// waiters list and the `watching` flag change under one lock, so a
    /// waker registered while a watcher finishes starts the next one.
    fn wake_on_room(self: &Arc<Self>, waker: &Waker, size: u64) {
        let mut room = self.room.lock().unwrap_or_else(|p| p.into_inner());
        if !room.wakers.iter().any(|w| w.will_wake(waker)) {
            room.wakers.push(waker.clone());
        }
        if std::mem::replace(&mut room.watching, true) {
            return;
        }
        drop(room);
        // Wakes the waiters however the watcher ends, also when it never
        // runs (a runtime shutting down drops it unrun).
        let watching = Watching(self.clone());
        let watch = move || {
            let shared = &watching.0;
            // Behind a send in flight (it may be mid-frame), then for room;
            // a link that fails ends the wait with its error recorded, so
            // the woken sender sees it.
            let guard = shared.writing.blocking_lock();
            if let Err(error) = shared.wait_room(size) {
                shared.fail(error, None);
            }
            drop(guard);
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(watch)),
            Err(_) => {
                if let Err(e) = std::thread::Builder::new().name("chorus-shm-room".into()).spawn(watch) {
                    self.fail(self.closed(format!("no thread to wait for ring room: {e}")), None);
                }
            }
        }
    }

    /// Whether records wait in the inbound ring that reading can take now
    /// (not behind a frame stalled on its channel's full queue).
    fn records_ready(&self) -> bool {
        self.unread() && !self.stalled.load(Ordering::SeqCst)
    }

    /// Whether the peer published records not read yet.
    fn unread(&self) -> bool {
        self.inbound.header().writer.head.load(Ordering::SeqCst) != self.read_pos.load(Ordering::SeqCst)
    }

    /// Polls the inbound ring for up to [`RECEIVE_SPIN`] on the calling
    /// thread, yielding the core between rounds of polls so that a thread
    /// with work (the peer, where ranks outnumber cores) gets it. Ends
    /// early when records come or another thread read some (the watcher,
    /// woken for another receive, may have filed this one's frame).
    fn spin_for_records(&self) {
        let started = Instant::now();
        let read = self.read_pos.load(Ordering::SeqCst);
        loop {
            for _ in 0..SPIN_POLLS {
                if self.records_ready() || self.read_pos.load(Ordering::SeqCst) != read {
                    return;
                }
                std::hint::spin_loop();
            }
            if started.elapsed() >= RECEIVE_SPIN {
                return;
            }
            std::thread::yield_now();
        }
    }

    /// Reads every published record into the channel queues (rule 6), on
    /// whichever thread calls: a receive or the watcher. When another
    /// thread is reading, that one reads again before it stops, so nothing
    /// published before this call is left unread.
    fn pump(&self) {
        self.pump_wanted.store(true, Ordering::SeqCst);
        while self.pump_wanted.swap(false, Ordering::SeqCst) {
            let Ok(mut state) = self.reading.try_lock() else {
                return;
            };
            if let Err(error) = self.read_published(&mut state) {
                state.broken = true;
                drop(state);
                // This side gives up on purpose (a bad record).
                let notice = CloseNotice::new(error.to_string());
                self.fail(error, Some(&notice));
                return;
            }
        }
    }

    /// Files a frame into its channel's queue; hands it back when the
    /// queue is full.
    fn file(&self, channel: ChannelId, frame: Frame) -> Result<(), Frame> {
        let queue = self.queue(channel);
        let mut frames = queue.frames.lock().unwrap_or_else(|p| p.into_inner());
        if frames.len() >= self.depth {
            return Err(frame);
        }
        frames.push_back(frame);
        drop(frames);
        queue.filed.notify_one();
        Ok(())
    }

    /// Reads records in order from `state.pos`, validates them and files
    /// the frames by channel, until nothing more is published or a
    /// channel's queue is full (that frame waits in `state.stalled`).
    fn read_published(&self, state: &mut ReadState) -> Result<(), TransportError> {
        if state.broken {
            return Ok(());
        }
        if let Some((channel, frame)) = state.stalled.take() {
            if let Err(frame) = self.file(channel, frame) {
                state.stalled = Some((channel, frame));
                return Ok(());
            }
            self.stalled.store(false, Ordering::SeqCst);
        }
        let ring = &self.inbound;
        loop {
            let (pos, head) = (state.pos, ring.header().writer.head.load(Ordering::Acquire));
            if head == pos {
                return Ok(());
            }
            let available = head.wrapping_sub(pos);
            if available > ring.capacity || available < RECORD_HEADER as u64 {
                return Err(protocol_error(
                    self.peer,
                    format!("head moved to {head} with the reader at {pos}"),
                ));
            }
            let mut record = [0u8; 32];
            // SAFETY: `pos..pos + 64` is published (`available >= 64`) and
            // contiguous in the double mapping; the writer does not touch
            // it until `tail` passes it.
            unsafe {
                std::ptr::copy_nonoverlapping(ring.at(pos), record.as_mut_ptr(), record.len());
            }
            let field = |at: usize| u64::from_le_bytes(record[at..at + 8].try_into().expect("8 bytes"));
            let channel = u32::from_le_bytes(record[0..4].try_into().expect("4 bytes"));
            let kind = u32::from_le_bytes(record[4..8].try_into().expect("4 bytes"));
            let (tag, len, total) = (field(8), field(16), field(24));
            if kind == SKIP && len == total && record_size(len as usize) <= available {
                let end = pos + record_size(len as usize);
                ring.release(pos, end);
                state.pos = end;
                self.read_pos.store(end, Ordering::SeqCst);
                continue;
            }
            if kind != DATA {
                return Err(protocol_error(
                    self.peer,
                    format!("a record of kind {kind} ({len} bytes, {total} in all) with {available} bytes published"),
                ));
            }
            if total > self.max_frame as u64 {
                return Err(TransportError::FrameTooLarge {
                    peer: self.peer,
                    len: total,
                    limit: self.max_frame,
                });
            }
            // The writer publishes whole records (padding included).
            if len > total || len > available || record_size(len as usize) > available {
                return Err(protocol_error(
                    self.peer,
                    format!("a record of {len} bytes (frame of {total}) with {available} bytes published"),
                ));
            }
            let (start, end) = (pos, pos + record_size(len as usize));
            let frame = if state.assembling.is_none() && len == total {
                let payload = if len == 0 {
                    ring.release(start, end);
                    Bytes::new()
                } else {
                    Bytes::from_owner(RingSlice {
                        ring: ring.clone(),
                        start,
                        end,
                        len: len as usize,
                    })
                };
                Some(Frame { tag, payload })
            } else {
                self.assemble(state, (channel, tag, total), start, len as usize)?
            };
            state.pos = end;
            self.read_pos.store(end, Ordering::SeqCst);
            if let Some(frame) = frame
                && let Err(frame) = self.file(channel, frame)
            {
                state.stalled = Some((channel, frame));
                self.stalled.store(true, Ordering::SeqCst);
                return Ok(());
            }
        }
    }

    /// Copies the `len`-byte piece at `start` of `frame` (channel, tag,
    /// total length), a frame larger than the ring, into the pool and
    /// releases it; returns the frame once its last piece came.
    fn assemble(
        &self,
        state: &mut ReadState,
        frame: (ChannelId, u64, u64),
        start: u64,
        len: usize,
    ) -> Result<Option<Frame>, TransportError> {
        let (channel, tag, total) = frame;
        match state.assembling {
            None => {
                // Reclaims the pool once earlier frames are dropped.
                state.pool.reserve(total as usize);
                state.assembling = Some(frame);
            }
            Some(current) if current == frame => {}
            Some((c, t, n)) => {
                return Err(protocol_error(
                    self.peer,
                    format!("a piece of frame ({channel}, {tag}, {total} bytes) inside frame ({c}, {t}, {n} bytes)"),
                ));
            }
        }
        if (state.pool.len() + len) as u64 > total {
            return Err(protocol_error(
                self.peer,
                format!("pieces overflow a {total}-byte frame"),
            ));
        }
        let ring = &self.inbound;
        // SAFETY: as for the record header: `start + 64 .. + len` is
        // published, contiguous and not written by the peer.
        let piece = unsafe { std::slice::from_raw_parts(ring.at(start).add(RECORD_HEADER), len) };
        state.pool.extend_from_slice(piece);
        ring.release(start, start + record_size(len));
        if state.pool.len() as u64 != total {
            return Ok(None);
        }
        state.assembling = None;
        Ok(Some(Frame {
            tag,
            payload: state.pool.split().freeze(),
        }))
    }

    /// The watcher thread: reads records for receives that wait (their
    /// channels' bits in the reader's `awaited` mask make the writer wake
    /// it) and pieces of frames larger than the ring; fails the link once
    /// the peer closed its side or died, after reading what it published.
    fn watch_inbound(&self) {
        let header = self.inbound.header();
        let mut held_up = None;
        loop {
            let seq = header.writer.head_seq.load(Ordering::SeqCst);
            self.pump();
            if self.failure().is_some() {
                return;
            }
            let closed = header.writer.closed.load(Ordering::SeqCst) != 0;
            // `head` after the flag: a record published before the close is
            // read (next turn) before the link fails.
            if closed && !self.unread() {
                self.fail(self.peer_closed(&header.writer_notice), None);
                return;
            }
            let wait = self.free_room_held_by_unreceived(&mut held_up);
            let timed_out = futex_wait(&header.writer.head_seq, seq, wait);
            let pid = header.writer_pid.load(Ordering::Relaxed);
            if timed_out && !alive(pid) && !self.unread() {
                self.fail(self.peer_died(pid), None);
                return;
            }
        }
    }

    /// Rule 9: once the writer has waited for room for
    /// [`UNRECEIVED_GRACE`] with `tail` held by frames read but not
    /// received, copies them out of the ring. `held_up` is `tail` and when
    /// the wait was first seen; returns how long the watcher may sleep.
    fn free_room_held_by_unreceived(&self, held_up: &mut Option<(u64, Instant)>) -> Duration {
        let header = self.inbound.header();
        let tail = header.reader.tail.load(Ordering::SeqCst);
        if header.writer.sleeping.load(Ordering::SeqCst) == 0 || !self.holds_unreceived() {
            *held_up = None;
            return self.liveness_interval;
        }
        match *held_up {
            Some((since_tail, since)) if since_tail == tail => match UNRECEIVED_GRACE.checked_sub(since.elapsed()) {
                Some(left) if !left.is_zero() => left,
                _ => {
                    self.detach_unreceived();
                    *held_up = None;
                    self.liveness_interval
                }
            },
            _ => {
                *held_up = Some((tail, Instant::now()));
                UNRECEIVED_GRACE
            }
        }
    }

    /// The channels' queues as they are now.
    fn every_queue(&self) -> Vec<Arc<Queue>> {
        let queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        queues.values().cloned().collect()
    }

    /// Whether a frame read but not received still lies in the ring.
    fn holds_unreceived(&self) -> bool {
        let in_ring = |frame: &Frame| self.inbound.holds(frame.payload.as_ptr());
        self.every_queue().iter().any(|queue| {
            queue
                .frames
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .any(in_ring)
        }) || self.with_stalled(|frame| in_ring(frame))
    }

    /// Copies every frame read but not received out of the ring, which
    /// releases its record (rule 9).
    fn detach_unreceived(&self) {
        let detach = |frame: &mut Frame| {
            if self.inbound.holds(frame.payload.as_ptr()) {
                frame.payload = Bytes::copy_from_slice(&frame.payload);
            }
        };
        for queue in self.every_queue() {
            queue
                .frames
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter_mut()
                .for_each(detach);
        }
        self.with_stalled(|frame| {
            detach(frame);
            false
        });
    }

    /// Applies `f` to the frame stalled on a full queue, if any; `false`
    /// without one. Holding the reading lock, it then reads for any
    /// [`pump`](Self::pump) that found the lock taken meanwhile.
    fn with_stalled(&self, f: impl FnOnce(&mut Frame) -> bool) -> bool {
        let mut state = self.reading.lock().unwrap_or_else(|p| p.into_inner());
        let found = state.stalled.as_mut().is_some_and(|(_, frame)| f(frame));
        drop(state);
        if self.pump_wanted.load(Ordering::SeqCst) {
            self.pump();
        }
        found
    }

    /// A frame a receive took from its queue: a frame stalled on a full
    /// queue may fit now.
    fn taken(&self, frame: Frame) -> Frame {
        if self.stalled.load(Ordering::SeqCst) {
            self.pump();
        }
        frame
    }

    /// Raises `channel`'s bit in the reader's `awaited` mask until the
    /// guard drops, so the writer wakes the watcher for its records.
    fn await_channel(self: &Arc<Self>, channel: ChannelId) -> Awaiting {
        let bit = channel_bit(channel);
        let mut counts = self.awaited.lock().unwrap_or_else(|p| p.into_inner());
        counts[bit] += 1;
        if counts[bit] == 1 {
            self.inbound
                .header()
                .reader
                .awaited
                .fetch_or(1 << bit, Ordering::SeqCst);
        }
        Awaiting {
            shared: self.clone(),
            bit,
        }
    }
}

/// Which bit of the `awaited` mask stands for `channel`: heartbeats (always
/// awaited) have one of their own, so they wake nobody for other frames.
fn channel_bit(channel: ChannelId) -> usize {
    if channel == HEARTBEAT_CHANNEL {
        31
    } else {
        (channel % 31) as usize
    }
}

/// A receive waiting on its channel ([`Shared::await_channel`]).
struct Awaiting {
    shared: Arc<Shared>,
    bit: usize,
}

impl Drop for Awaiting {
    fn drop(&mut self) {
        let mut counts = self.shared.awaited.lock().unwrap_or_else(|p| p.into_inner());
        counts[self.bit] -= 1;
        if counts[self.bit] == 0 {
            self.shared
                .inbound
                .header()
                .reader
                .awaited
                .fetch_and(!(1 << self.bit), Ordering::SeqCst);
        }
    }
}

/// A link to a rank of another process on this host, over two rings.
pub struct ShmLink {
    peer: usize,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ShmLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShmLink({} -> {})", self.shared.me, self.peer)
    }
}

impl ShmLink {
    fn new(me: usize, peer: usize, outbound: Arc<Ring>, inbound: Arc<Ring>, options: &ShmOptions) -> Self {
        let shared = Arc::new(Shared {
            me,
            peer,
            outbound,
            inbound,
            queues: Mutex::new(HashMap::new()),
            depth: options.depth,
            reading: Mutex::default(),
            read_pos: AtomicU64::new(0),
            stalled: AtomicBool::new(false),
            pump_wanted: AtomicBool::new(false),
            awaited: Mutex::default(),
            max_frame: options.max_frame,
            liveness_interval: options.liveness_interval,
            closed: watch::Sender::new(None),
            told: Mutex::new(false),
            writing: Arc::new(tokio::sync::Mutex::new(())),
            room: Mutex::new(RoomWaiters::default()),
        });
        let watcher = shared.clone();
        // The thread ends once the link fails or closes (close wakes it).
        std::thread::Builder::new()
            .name(format!("chorus-shm-{me}<-{peer}"))
            .spawn(move || watcher.watch_inbound())
            .expect("spawning a thread");
        Self { peer, shared }
    }

    /// Writes a frame of `len` bytes, filled in place, if it fits now and
    /// no other send is mid-frame; `false` if it must wait.
    fn try_send_with(
        &self,
        channel: ChannelId,
        tag: u64,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<bool, TransportError> {
        if let Some(error) = self.shared.failure() {
            return Err(error);
        }
        // A send holding the lock may be mid-frame (pieces): wait behind it.
        let Ok(_guard) = self.shared.writing.try_lock() else {
            return Ok(false);
        };
        self.shared.try_write_with(channel, tag, len, fill)
    }
}

#[async_trait]
impl Link for ShmLink {
    fn peer(&self) -> usize {
        self.peer
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    async fn send(&self, channel: ChannelId, tag: u64, payload: Bytes) -> Result<(), SendError> {
        if let Some(error) = self.shared.failure() {
            return Err(SendError { error, payload });
        }
        let guard = self.shared.writing.clone().lock_owned().await;
        if payload.len() <= INLINE_LIMIT {
            match self.shared.try_write(channel, tag, &payload) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(error) => return Err(SendError { error, payload }),
            }
        }
        // Waiting for room and copying big payloads happen off the runtime;
        // the guard goes along, so a cancelled send still finishes its frame
        // before the next one starts.
        let shared = self.shared.clone();
        let kept = payload.clone();
        let written = tokio::task::spawn_blocking(move || {
            let _guard = guard;
            shared.write(channel, tag, &kept)
        })
        .await;
        match written {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => Err(SendError { error, payload }),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(SendError {
                error: self.shared.closed(format!("the send was abandoned: {e}")),
                payload,
            }),
        }
    }

    fn try_send_copy(&self, channel: ChannelId, tag: u64, payload: &[u8]) -> Result<bool, TransportError> {
        self.try_send_with(channel, tag, payload.len(), &mut |dst| dst.copy_from_slice(payload))
    }

    fn poll_send_with(
        &self,
        cx: &mut Context<'_>,
        channel: ChannelId,
        tag: u64,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Poll<Result<bool, TransportError>> {
        let size = record_size(len);
        // A frame cut into pieces must be finished once begun, which only
        // an owned payload outlives a dropped send for (rule 5).
        if size > self.shared.outbound.capacity {
            return Poll::Ready(Ok(false));
        }
        match self.try_send_with(channel, tag, len, fill) {
            Ok(false) => {
                self.shared.wake_on_room(cx.waker(), size);
                Poll::Pending
            }
            done => Poll::Ready(done),
        }
    }

    async fn recv(&self, channel: ChannelId) -> Result<Frame, TransportError> {
        let shared = &self.shared;
        let mut closed = shared.closed.subscribe();
        let queue = shared.queue(channel);
        let _receiving = queue.receiving.lock().await;
        if let Some(frame) = queue.pop() {
            return Ok(shared.taken(frame));
        }
        // Read the ring on this thread: a frame a few microseconds away
        // then costs no wake-up of this thread or the watcher's. Frames
        // that time drives are not worth the spin.
        if channel != HEARTBEAT_CHANNEL && shared.failure().is_none() {
            shared.spin_for_records();
        }
        shared.pump();
        if let Some(frame) = queue.pop() {
            return Ok(shared.taken(frame));
        }
        // Nothing yet: the watcher reads for this receive from now on. A
        // record published before the bit went up woke nobody: read again.
        let _awaiting = shared.await_channel(channel);
        shared.pump();
        loop {
            // Registered before looking, so a frame filed in between wakes it.
            let mut filed = pin!(queue.filed.notified());
            filed.as_mut().enable();
            // Frames filed before a failure are still delivered.
            if let Some(frame) = queue.pop() {
                return Ok(shared.taken(frame));
            }
            if let Some(error) = closed.borrow_and_update().clone() {
                shared.pump();
                return queue.pop().map(|frame| shared.taken(frame)).ok_or(error);
            }
            tokio::select! {
                _ = filed => {}
                _ = closed.changed() => {}
            }
        }
    }

    fn close_with(&self, notice: &CloseNotice) {
        let error = self
            .shared
            .closed(format!("closed by rank {}: {}", self.shared.me, notice.reason));
        self.shared.fail(error, Some(notice));
    }

    fn cut(&self, reason: &str) {
        let error = self.shared.closed(format!("cut by rank {}: {reason}", self.shared.me));
        self.shared.fail(error, None);
    }
}

impl Drop for ShmLink {
    // Going away without a close (an unwinding rank) is a lost link.
    fn drop(&mut self) {
        let error = self
            .shared
            .closed(format!("rank {} dropped the link without closing it", self.shared.me));
        self.shared.fail(error, None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::io::{BufRead, BufReader, Read, Write};
    use std::pin::pin;
    use std::process::{Child, Command, Stdio};

    /// The env var naming a child process's role in the two-process tests.
    const ROLE: &str = "CHORUS_SHM_TEST_ROLE";
    const PARENT_NONCE: &str = "CHORUS_SHM_TEST_PARENT_NONCE";
    const NONCE_LINE: &str = "CHORUS_SHM_TEST_NONCE=";
    /// Where a child process makes its rings (default: `/dev/shm`).
    const DIR: &str = "CHORUS_SHM_TEST_DIR";
    const BIG: usize = 64 << 20;

    async fn within<T>(fut: impl Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(30), fut)
            .await
            .expect("shm test hung")
    }

    fn options(capacity: usize) -> ShmOptions {
        ShmOptions {
            capacity,
            connect_timeout: Duration::from_secs(10),
            ..ShmOptions::default()
        }
    }

    /// Links 0 -> 1 and 1 -> 0 between two endpoints of this process.
    async fn pair(capacity: usize) -> (ShmLink, ShmLink) {
        pair_with(options(capacity)).await
    }

    async fn pair_with(options: ShmOptions) -> (ShmLink, ShmLink) {
        let a = ShmEndpoint::new(0, options.clone()).unwrap();
        let b = ShmEndpoint::new(1, options).unwrap();
        let (ab, ba) = tokio::join!(
            a.connect(ShmPeer {
                rank: 1,
                nonce: b.nonce()
            }),
            b.connect(ShmPeer {
                rank: 0,
                nonce: a.nonce()
            })
        );
        let (ab, ba) = (ab.unwrap(), ba.unwrap());
        for (endpoint, peer) in [(&a, 1), (&b, 0)] {
            let path = ring_path(&endpoint.options.dir, endpoint.nonce, peer);
            assert!(!path.exists(), "{} must be unlinked once mapped", path.display());
        }
        (ab, ba)
    }

    fn pattern(len: usize, seed: u8) -> Bytes {
        Bytes::from((0..len).map(|i| (i % 251) as u8 ^ seed).collect::<Vec<u8>>())
    }

    #[tokio::test]
    async fn frames_on_several_channels_arrive_in_order_and_apart() {
        within(async {
            let (a, b) = pair(1 << 20).await;
            // Within the queue depth (16): a channel left unread beyond it
            // stalls the others (see the module doc).
            for tag in 0..16u64 {
                a.send(1, tag, pattern(100 + tag as usize, 1)).await.unwrap();
                a.send(2, 1000 + tag, Bytes::new()).await.unwrap();
            }
            // Channel 2 is read first although frames were interleaved.
            for tag in 0..16u64 {
                let frame = b.recv(2).await.unwrap();
                assert_eq!((frame.tag, frame.payload.len()), (1000 + tag, 0));
            }
            for tag in 0..16u64 {
                let frame = b.recv(1).await.unwrap();
                assert_eq!(frame.tag, tag);
                assert_eq!(frame.payload, pattern(100 + tag as usize, 1));
                assert_eq!(frame.payload.as_ptr() as usize % RECORD_HEADER, 0);
            }
            b.send(9, 5, Bytes::from_static(b"back")).await.unwrap();
            assert_eq!(a.recv(9).await.unwrap().payload, Bytes::from_static(b"back"));
            assert_eq!(a.kind(), TransportKind::Shm);
        })
        .await;
    }

    #[tokio::test]
    async fn an_empty_ring_starts_over_at_its_start_and_a_busy_one_goes_on() {
        within(async {
            let (a, b) = pair(4 << 20).await;
            let capacity = b.shared.inbound.capacity as usize;
            let offset = |frame: &Frame| (frame.payload.as_ptr() as usize - b.shared.inbound.at(0) as usize) % capacity;
            // Each frame received before the next is sent: the ring is empty
            // at every send, so records stay near the ring's start (within
            // RESTART_AFTER and a frame), cache-warm.
            for tag in 0..100u64 {
                a.send(0, tag, pattern(60 << 10, tag as u8)).await.unwrap();
                let frame = b.recv(0).await.unwrap();
                assert!(frame.payload == pattern(60 << 10, tag as u8));
                // A quarter of the 4 MiB ring, which 100 frames of 60 KiB
                // would go round one and a half times without starting over.
                assert!(offset(&frame) < 1 << 20, "frame {tag} at offset {}", offset(&frame));
            }
            // A frame larger than the space before the writer's position is
            // written where the writer is, not after a skip.
            let before = b.shared.inbound.header().writer.head.load(Ordering::SeqCst) as usize % capacity;
            a.send(0, 100, pattern(3 << 20, 1)).await.unwrap();
            let frame = b.recv(0).await.unwrap();
            assert!(frame.payload == pattern(3 << 20, 1));
            assert_eq!(offset(&frame), (before + RECORD_HEADER) % capacity);
            drop(frame);
            // Frames left unreceived keep the ring busy: the writer goes on
            // past RESTART_AFTER, and everything arrives in order.
            for tag in 0..40u64 {
                a.send(1, tag, pattern(60 << 10, tag as u8)).await.unwrap();
            }
            let mut furthest = 0;
            for tag in 0..40u64 {
                let frame = b.recv(1).await.unwrap();
                assert_eq!(frame.tag, tag);
                assert!(frame.payload == pattern(60 << 10, tag as u8));
                furthest = furthest.max(offset(&frame));
            }
            assert!(furthest > 2 << 20, "a busy ring started over (furthest {furthest})");
            // A frame larger than the ring, received as it comes: the ring
            // may empty between its pieces, and a skip among them is
            // passed over.
            let a = Arc::new(a);
            for seed in 0..3 {
                let sender = tokio::spawn({
                    let a = a.clone();
                    async move { a.send(2, seed, pattern(10 << 20, seed as u8)).await }
                });
                let frame = b.recv(2).await.unwrap();
                assert!(frame.payload == pattern(10 << 20, seed as u8));
                sender.await.unwrap().unwrap();
            }
        })
        .await;
    }

    #[tokio::test]
    async fn a_64_mib_frame_and_frames_larger_than_the_ring_arrive_intact() {
        within(async {
            let (a, b) = pair(ShmOptions::default().capacity).await;
            let big = pattern(BIG, 7);
            a.send(0, 1, big.clone()).await.unwrap();
            let frame = b.recv(0).await.unwrap();
            let ring = b.shared.inbound.at(0) as usize;
            assert!(
                (ring..ring + 2 * b.shared.inbound.capacity as usize).contains(&(frame.payload.as_ptr() as usize)),
                "a frame that fits the ring is received without a copy"
            );
            assert!(frame.payload == big);
            drop(frame);
            // 5 MiB through a 1 MiB ring goes in pieces, reassembled.
            let (a, b) = pair(1 << 20).await;
            let sender = tokio::spawn(async move {
                for seed in 0..3 {
                    a.send(4, seed as u64, pattern(5 << 20, seed)).await.unwrap();
                }
                a
            });
            for seed in 0..3 {
                let frame = b.recv(4).await.unwrap();
                assert_eq!(frame.tag, seed as u64);
                assert!(frame.payload == pattern(5 << 20, seed));
            }
            // With no receive waiting, the watcher takes the pieces in, so
            // the send completes before anyone receives.
            let a = sender.await.unwrap();
            a.send(4, 9, pattern(3 << 20, 9)).await.unwrap();
            let frame = b.recv(4).await.unwrap();
            assert_eq!(frame.tag, 9);
            assert!(frame.payload == pattern(3 << 20, 9));
        })
        .await;
    }

    /// Sends three frames on channel 3 that `b` leaves unreceived, then
    /// `frames` on channel 4 from a task, which need the ring's room.
    async fn behind_unreceived_frames(frames: Vec<Bytes>) {
        within(async {
            let (a, b) = pair(1 << 20).await;
            for tag in 0..3 {
                a.send(3, tag, pattern(1000, tag as u8)).await.unwrap();
            }
            let sender = tokio::spawn({
                let frames = frames.clone();
                async move {
                    for (tag, frame) in frames.into_iter().enumerate() {
                        a.send(4, tag as u64, frame).await.unwrap();
                    }
                    a
                }
            });
            for (tag, sent) in frames.iter().enumerate() {
                let frame = tokio::time::timeout(Duration::from_secs(5), b.recv(4))
                    .await
                    .unwrap_or_else(|_| {
                        panic!("frame {tag} on channel 4 never came: the unreceived frames pin the ring")
                    })
                    .unwrap();
                assert_eq!(frame.tag, tag as u64);
                assert!(frame.payload == *sent);
            }
            let _a = sender.await.unwrap();
            for tag in 0..3 {
                let frame = b.recv(3).await.unwrap();
                assert_eq!((frame.tag, frame.payload), (tag, pattern(1000, tag as u8)));
            }
        })
        .await;
    }

    #[tokio::test]
    async fn unreceived_frames_are_copied_out_when_a_frame_larger_than_the_ring_needs_their_room() {
        behind_unreceived_frames(vec![pattern(5 << 20, 4)]).await;
    }

    #[tokio::test]
    async fn unreceived_frames_are_copied_out_when_later_frames_wrap_the_ring() {
        behind_unreceived_frames((0..40).map(|seed| pattern(64 << 10, seed)).collect()).await;
    }

    #[tokio::test]
    async fn a_full_queue_holds_the_frames_behind_it_until_its_channel_takes_one() {
        within(async {
            let (a, b) = pair_with(ShmOptions {
                depth: 2,
                ..options(1 << 20)
            })
            .await;
            for tag in 0..3 {
                a.send(1, tag, pattern(64, 1)).await.unwrap();
            }
            a.send(2, 7, Bytes::from_static(b"behind")).await.unwrap();
            // Channel 1's queue holds two: its third frame waits for room,
            // and channel 2's frame waits behind it (the module doc).
            let early = tokio::time::timeout(Duration::from_millis(150), b.recv(2)).await;
            assert!(early.is_err(), "a frame behind a full queue came: {early:?}");
            assert_eq!(b.recv(1).await.unwrap().tag, 0);
            assert_eq!(b.recv(2).await.unwrap().payload, Bytes::from_static(b"behind"));
            for tag in 1..3 {
                assert_eq!(b.recv(1).await.unwrap().tag, tag);
            }
        })
        .await;
    }

    #[tokio::test]
    async fn a_waiting_receive_is_woken_for_its_channel_only_and_lowers_its_bit_when_done() {
        within(async {
            let (a, b) = pair(1 << 20).await;
            let b = Arc::new(b);
            let awaited = || b.shared.inbound.header().reader.awaited.load(Ordering::SeqCst);
            let heartbeat = tokio::spawn({
                let b = b.clone();
                async move { b.recv(HEARTBEAT_CHANNEL).await }
            });
            let data = tokio::spawn({
                let b = b.clone();
                async move { b.recv(3).await }
            });
            // Both wait past their polling, with their bits up.
            while awaited() != (1 << 31 | 1 << 3) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            a.send(3, 1, pattern(10, 3)).await.unwrap();
            let frame = data.await.unwrap().unwrap();
            assert_eq!((frame.tag, frame.payload), (1, pattern(10, 3)));
            assert_eq!(awaited(), 1 << 31, "the data receive is done");
            assert!(
                !heartbeat.is_finished(),
                "a heartbeat receive took another channel's frame"
            );
            a.send(HEARTBEAT_CHANNEL, 2, Bytes::new()).await.unwrap();
            assert_eq!(heartbeat.await.unwrap().unwrap().tag, 2);
            assert_eq!(awaited(), 0);
        })
        .await;
    }

    #[tokio::test]
    async fn a_borrowed_payload_goes_straight_in_only_when_the_ring_has_room() {
        within(async {
            let (a, b) = pair(64 << 10).await;
            let piece = pattern((16 << 10) - RECORD_HEADER, 3);
            // 4 records fill the ring; the fifth finds no room, and one
            // larger than the ring never goes this way.
            for tag in 0..4 {
                assert_eq!(a.try_send_copy(0, tag, &piece), Ok(true));
            }
            assert_eq!(a.try_send_copy(0, 4, &piece), Ok(false));
            assert_eq!(a.try_send_copy(0, 5, &pattern(128 << 10, 0)), Ok(false));
            for tag in 0..4 {
                let frame = b.recv(0).await.unwrap();
                assert_eq!((frame.tag, &frame.payload), (tag, &piece));
            }
            // Released: room again.
            assert_eq!(a.try_send_copy(0, 6, b"again"), Ok(true));
            assert_eq!(&b.recv(0).await.unwrap().payload[..], b"again");
            b.close("done");
            assert!(matches!(
                a.try_send_copy(0, 7, b"late"),
                Err(TransportError::PeerClosed { .. })
            ));
        })
        .await;
    }

    #[tokio::test]
    async fn a_borrowed_send_waits_for_room_and_fails_when_the_peer_goes() {
        within(async {
            let (a, b) = pair(64 << 10).await;
            let piece = pattern((16 << 10) - RECORD_HEADER, 5);
            let send = |tag: u64, payload: Bytes| {
                let a = &a;
                async move { std::future::poll_fn(|cx| a.poll_send_copy(cx, 0, tag, &payload)).await }
            };
            for tag in 0..4 {
                assert_eq!(send(tag, piece.clone()).await, Ok(true));
            }
            assert_eq!(send(9, pattern(128 << 10, 0)).await, Ok(false), "larger than the ring");
            let mut held = Vec::new();
            for _ in 0..4 {
                held.push(b.recv(0).await.unwrap());
            }
            // The ring is full: the fifth waits, then goes in once the
            // receiver drops the first payload.
            let mut fifth = pin!(send(4, piece.clone()));
            let waited = tokio::time::timeout(Duration::from_millis(200), fifth.as_mut()).await;
            assert!(waited.is_err(), "a full ring must make a borrowed send wait");
            held.remove(0);
            assert_eq!(fifth.await, Ok(true));
            held.push(b.recv(0).await.unwrap());
            assert_eq!((held[3].tag, &held[3].payload), (4, &piece));
            // Full again, with the peer gone while a send waits: it fails,
            // typed, instead of waiting for room that never comes.
            let mut sixth = pin!(send(5, piece.clone()));
            let waited = tokio::time::timeout(Duration::from_millis(100), sixth.as_mut()).await;
            assert!(waited.is_err(), "the ring is still full");
            b.cut("gone");
            assert!(matches!(sixth.await, Err(TransportError::Closed { peer: 1, .. })));
            assert!(matches!(
                send(6, piece.clone()).await,
                Err(TransportError::Closed { .. })
            ));
        })
        .await;
    }

    #[tokio::test]
    async fn a_filled_send_writes_in_the_ring_only_once_it_has_room() {
        within(async {
            let (a, b) = pair(64 << 10).await;
            let len = (16 << 10) - RECORD_HEADER;
            let fills = std::sync::atomic::AtomicUsize::new(0);
            let send = |tag: u64, len: usize| {
                let (a, fills) = (&a, &fills);
                async move {
                    std::future::poll_fn(|cx| {
                        a.poll_send_with(cx, 0, tag, len, &mut |dst: &mut [u8]| {
                            fills.fetch_add(1, Ordering::SeqCst);
                            dst.copy_from_slice(&pattern(dst.len(), tag as u8));
                        })
                    })
                    .await
                }
            };
            for tag in 0..4 {
                assert_eq!(send(tag, len).await, Ok(true));
            }
            assert_eq!(send(9, 128 << 10).await, Ok(false), "larger than the ring");
            assert_eq!(fills.load(Ordering::SeqCst), 4, "a refused frame is never filled");
            let first = b.recv(0).await.unwrap();
            assert_eq!((first.tag, &first.payload), (0, &pattern(len, 0)));
            // The ring is full: the fifth waits unfilled until the first goes.
            let mut fifth = pin!(send(4, len));
            let waited = tokio::time::timeout(Duration::from_millis(200), fifth.as_mut()).await;
            assert!(waited.is_err(), "a full ring must make a filled send wait");
            assert_eq!(fills.load(Ordering::SeqCst), 4, "a waiting frame is not filled yet");
            drop(first);
            assert_eq!(fifth.await, Ok(true));
            for tag in 1..5 {
                let frame = b.recv(0).await.unwrap();
                assert_eq!((frame.tag, &frame.payload), (tag, &pattern(len, tag as u8)));
            }
            b.cut("gone");
            assert!(matches!(send(6, len).await, Err(TransportError::Closed { .. })));
        })
        .await;
    }

    #[tokio::test]
    async fn a_receiver_holding_payloads_makes_the_sender_wait() {
        within(async {
            let (a, b) = pair(64 << 10).await;
            // 4 records of 16 KiB fill the ring; the receiver keeps them all.
            let mut held = Vec::new();
            for tag in 0..4 {
                a.send(0, tag, pattern((16 << 10) - RECORD_HEADER, 0)).await.unwrap();
            }
            for _ in 0..4 {
                held.push(b.recv(0).await.unwrap());
            }
            let a = Arc::new(a);
            let blocked = tokio::spawn({
                let a = a.clone();
                async move { a.send(0, 4, pattern(100, 0)).await }
            });
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(!blocked.is_finished(), "the fifth send must wait for room");
            // Released out of order: nothing frees until the first goes.
            held.swap_remove(3);
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(!blocked.is_finished(), "tail must wait for the first record");
            held.remove(0);
            blocked.await.unwrap().unwrap();
            assert_eq!(b.recv(0).await.unwrap().tag, 4);
        })
        .await;
    }

    #[tokio::test]
    async fn close_fails_both_sides_after_delivering_what_was_sent() {
        within(async {
            let (a, b) = pair(1 << 20).await;
            a.send(0, 1, Bytes::from_static(b"last words")).await.unwrap();
            a.close("test");
            let frame = b.recv(0).await.unwrap();
            assert_eq!(frame.payload, Bytes::from_static(b"last words"));
            let err = b.recv(0).await.unwrap_err();
            assert_eq!(err, CloseNotice::new("test").into_error(0));
            let err = b.send(0, 0, Bytes::from_static(b"kept")).await.unwrap_err();
            assert_eq!(err.payload, Bytes::from_static(b"kept"));
            let err = a.recv(0).await.unwrap_err();
            assert!(matches!(err, TransportError::Closed { peer: 1, .. }), "{err}");
        })
        .await;
    }

    #[tokio::test]
    async fn a_close_on_purpose_carries_its_notice_both_ways_and_a_cut_or_a_drop_does_not() {
        within(async {
            let notice = CloseNotice {
                reason: "rank 0 aborted: rank 2 (pid 7) died".into(),
                failed: vec![2],
            };
            let (a, b) = pair(1 << 16).await;
            a.close_with(&notice);
            a.cut("too late: the first close counts");
            assert_eq!(b.recv(0).await.unwrap_err(), notice.clone().into_error(0));
            let err = b.send(0, 0, Bytes::new()).await.unwrap_err();
            assert!(
                matches!(err.error, TransportError::PeerClosed { peer: 0, .. }),
                "{}",
                err.error
            );

            let (a, b) = pair(1 << 16).await;
            a.cut("fault injection");
            let err = b.send(0, 0, Bytes::new()).await.unwrap_err();
            assert!(
                matches!(err.error, TransportError::Closed { peer: 0, .. }),
                "{}",
                err.error
            );

            let (a, b) = pair(1 << 16).await;
            drop(a);
            let err = b.recv(0).await.unwrap_err();
            assert!(matches!(err, TransportError::Closed { peer: 0, .. }), "{err}");
        })
        .await;
    }

    #[tokio::test]
    async fn a_ring_with_a_bad_header_is_a_typed_error_and_leaks_nothing() {
        within(async {
            let b = ShmEndpoint::new(1, options(4096)).unwrap();
            let fake = 0x5eed_u64;
            let garbage = ring_path(&b.options.dir, fake, 1);
            std::fs::write(&garbage, vec![0xab; 2 * page_size()]).unwrap();
            let mut perms = std::fs::metadata(&garbage).unwrap().permissions();
            std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o600);
            std::fs::set_permissions(&garbage, perms).unwrap();
            let err = b.connect(ShmPeer { rank: 0, nonce: fake }).await.unwrap_err();
            std::fs::remove_file(&garbage).unwrap();
            assert!(
                matches!(&err, TransportError::Protocol { peer: 0, reason } if reason.contains("magic")),
                "{err}"
            );
            assert!(
                !ring_path(&b.options.dir, b.nonce, 0).exists(),
                "a failed connect removes its own ring"
            );
        })
        .await;
    }

    #[tokio::test]
    async fn forged_record_lengths_are_typed_errors() {
        within(async {
            let (a, b) = pair(64 << 10).await;
            // A frame announced far over the receiver's limit.
            a.shared.put(0, 1, 2, 1 << 40, b"x");
            let err = b.recv(1).await.unwrap_err();
            assert!(
                matches!(err, TransportError::FrameTooLarge { peer: 0, len, .. } if len == 1 << 40),
                "{err}"
            );
            // A record header (kind, lengths) published alone.
            let forged = |a: &ShmLink, kind: u32, len: u64| {
                let record = record_header(0, kind, 0, len, len);
                let ring = &a.shared.outbound;
                // SAFETY: the ring is empty and only this test writes to it.
                unsafe { std::ptr::copy_nonoverlapping(record.as_ptr(), ring.at(0), record.len()) };
                ring.header().writer.head.store(RECORD_HEADER as u64, Ordering::SeqCst);
                ring.poke();
            };
            // A record of an unknown kind, and skipped space longer than
            // what was published (rule 10).
            for kind in [7, SKIP] {
                let (a, b) = pair(64 << 10).await;
                forged(&a, kind, 1000);
                let err = b.recv(0).await.unwrap_err();
                assert!(
                    matches!(&err, TransportError::Protocol { peer: 0, reason } if reason.contains(&format!("kind {kind}"))),
                    "{err}"
                );
            }
            // A frame longer than what was published.
            let (a, b) = pair(64 << 10).await;
            forged(&a, DATA, 1000);
            let err = b.recv(0).await.unwrap_err();
            assert!(matches!(err, TransportError::Protocol { peer: 0, .. }), "{err}");
            // The writer learns that the reader gave up, and why.
            let err = a.send(0, 0, Bytes::new()).await.unwrap_err();
            assert!(
                matches!(&err.error, TransportError::PeerClosed { peer: 1, reason, .. } if reason.contains("rank 0 broke the framing")),
                "{}",
                err.error
            );
        })
        .await;
    }

    #[tokio::test]
    async fn a_peer_that_never_comes_times_out() {
        within(async {
            let a = ShmEndpoint::new(
                0,
                ShmOptions {
                    connect_timeout: Duration::from_millis(200),
                    ..options(4096)
                },
            )
            .unwrap();
            let err = a.connect(ShmPeer { rank: 1, nonce: 1 }).await.unwrap_err();
            assert!(matches!(err, TransportError::Connect { peer: 1, .. }), "{err}");
            assert!(!ring_path(&a.options.dir, a.nonce, 1).exists());
        })
        .await;
    }

    /// A child process running [`child_process`] in `role`, killed on drop.
    struct ChildProcess {
        child: Child,
        nonce: u64,
    }

    impl ChildProcess {
        fn spawn(role: &str, parent_nonce: u64, env: &[(&str, String)]) -> Self {
            let mut child = Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "shm::tests::child_process",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(ROLE, role)
                .env(PARENT_NONCE, format!("{parent_nonce:016x}"))
                .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                .stdout(Stdio::piped())
                .spawn()
                .unwrap();
            let stdout = BufReader::new(child.stdout.take().unwrap());
            let (found, nonce) = std::sync::mpsc::channel();
            // Reads the child's nonce, then drains its output.
            std::thread::spawn(move || {
                for line in stdout.lines().map_while(Result::ok) {
                    // libtest may print the test's name on the same line.
                    if let Some(at) = line.find(NONCE_LINE) {
                        let hex = line[at + NONCE_LINE.len()..].trim();
                        let _ = found.send(u64::from_str_radix(hex, 16).unwrap());
                    }
                }
            });
            let nonce = nonce
                .recv_timeout(Duration::from_secs(20))
                .expect("the child did not print its nonce");
            Self { child, nonce }
        }
    }

    impl Drop for ChildProcess {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// Rank 0 here, connected to rank 1 in a child process.
    async fn with_child(role: &str, env: &[(&str, String)]) -> (ShmLink, ChildProcess) {
        let endpoint = ShmEndpoint::new(0, ShmOptions::default()).unwrap();
        let child = ChildProcess::spawn(role, endpoint.nonce(), env);
        let link = endpoint
            .connect(ShmPeer {
                rank: 1,
                nonce: child.nonce,
            })
            .await
            .unwrap();
        (link, child)
    }

    /// The other process of the two-process tests; does nothing unless
    /// started by one of them.
    #[test]
    #[ignore = "a helper process started by the two-process tests"]
    fn child_process() {
        let Ok(role) = std::env::var(ROLE) else {
            return;
        };
        let parent = u64::from_str_radix(&std::env::var(PARENT_NONCE).unwrap(), 16).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            if role == "tcp-sink" {
                return tcp_sink();
            }
            let options = match std::env::var(DIR) {
                Ok(dir) => ShmOptions {
                    dir: dir.into(),
                    ..ShmOptions::default()
                },
                Err(_) => ShmOptions::default(),
            };
            // "orphan": the parent never connects back, so the ring stays
            // in the connect window until the parent kills this process.
            let endpoint = ShmEndpoint::new(1, options).unwrap();
            println!("{NONCE_LINE}{:016x}", endpoint.nonce());
            std::io::stdout().flush().unwrap();
            let link = endpoint.connect(ShmPeer { rank: 0, nonce: parent }).await.unwrap();
            match role.as_str() {
                // Echoes channel 4's frame, then channel 3's five frames.
                "echo" => {
                    for channel in [4, 3, 3, 3, 3, 3] {
                        let frame = link.recv(channel).await.unwrap();
                        link.send(channel, frame.tag, frame.payload).await.unwrap();
                    }
                    // The parent closes once it has every echo.
                    let _ = link.recv(0).await;
                }
                // Sends one frame, reads nothing, waits to be killed.
                "hold" => {
                    link.send(0, 7, Bytes::from_static(b"alive")).await.unwrap();
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
                // Receives and drops frames until the count, then acks.
                "sink" => {
                    let count: usize = std::env::var("CHORUS_SHM_TEST_COUNT").unwrap().parse().unwrap();
                    for _ in 0..count {
                        let frame = link.recv(0).await.unwrap();
                        assert_eq!(frame.payload.len(), BIG);
                    }
                    link.send(0, 0, Bytes::new()).await.unwrap();
                    let _ = link.recv(0).await;
                }
                other => panic!("unknown role {other}"),
            }
        });
    }

    /// Reads `count` 64 MiB transfers from the parent's TCP port into one
    /// reused buffer, then acks with one byte.
    fn tcp_sink() {
        let port: u16 = std::env::var("CHORUS_SHM_TEST_PORT").unwrap().parse().unwrap();
        let count: usize = std::env::var("CHORUS_SHM_TEST_COUNT").unwrap().parse().unwrap();
        println!("{NONCE_LINE}0");
        std::io::stdout().flush().unwrap();
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let mut buffer = vec![1u8; BIG];
        for _ in 0..count {
            stream.read_exact(&mut buffer).unwrap();
        }
        stream.write_all(&[1]).unwrap();
    }

    #[tokio::test]
    async fn a_ring_left_by_a_killed_writer_is_removed_and_live_or_foreign_ones_stay() {
        within(async {
            let dir = PathBuf::from(format!("/dev/shm/chorus-sweep-test-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let env = [(DIR, dir.display().to_string())];
            let mut child = ChildProcess::spawn("orphan", 1, &env);
            let orphan = ring_path(&dir, child.nonce, 0);
            // Killed once the ring is initialized (its magic stored last).
            let initialized = || {
                let mut magic = [0u8; 8];
                File::open(&orphan).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && magic == MAGIC.to_le_bytes()
            };
            while !initialized() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            child.child.kill().unwrap();
            child.child.wait().unwrap();
            let dead_pid = child.child.id();
            // A ring of this live process, and one that claims the dead
            // pid in another pid namespace, where that pid may be alive.
            let live = ring_path(&dir, 2, 3);
            let (_live_ring, _) = Ring::create(&live, 4096, 2, 3).unwrap();
            let foreign = ring_path(&dir, 4, 5);
            let (foreign_ring, _) = Ring::create(&foreign, 4096, 4, 5).unwrap();
            let header = foreign_ring.header();
            header.writer_pid.store(dead_pid, Ordering::Relaxed);
            header.writer_pid_ns.fetch_add(1, Ordering::Relaxed);
            assert_eq!(remove_dead_rings(&dir), 1);
            assert!(!orphan.exists(), "the killed writer's ring is still there");
            assert!(live.exists() && foreign.exists());
            std::fs::remove_dir_all(&dir).unwrap();
        })
        .await;
    }

    #[tokio::test]
    async fn two_processes_exchange_frames_on_several_channels() {
        within(async {
            let (link, _child) = with_child("echo", &[]).await;
            let big = pattern(BIG, 3);
            for tag in 0..5u64 {
                link.send(3, tag, pattern(1000 + tag as usize, 9)).await.unwrap();
            }
            link.send(4, 99, big.clone()).await.unwrap();
            let frame = link.recv(4).await.unwrap();
            assert_eq!(frame.tag, 99);
            assert!(frame.payload == big, "the 64 MiB frame came back altered");
            for tag in 0..5u64 {
                let frame = link.recv(3).await.unwrap();
                assert_eq!(frame.tag, tag);
                assert_eq!(frame.payload, pattern(1000 + tag as usize, 9));
            }
            link.close("done");
        })
        .await;
    }

    #[tokio::test]
    async fn a_peer_killed_with_sigkill_fails_sends_and_receives_within_seconds() {
        within(async {
            let (link, mut child) = with_child("hold", &[]).await;
            assert_eq!(link.recv(0).await.unwrap().tag, 7);
            let link = Arc::new(link);
            // The child reads nothing: fill its queue and the ring until a
            // send waits.
            let sender = tokio::spawn({
                let link = link.clone();
                async move {
                    let frame = Bytes::from(vec![0u8; 16 << 20]);
                    loop {
                        if let Err(e) = link.send(0, 0, frame.clone()).await {
                            return e;
                        }
                    }
                }
            });
            let receiver = tokio::spawn({
                let link = link.clone();
                async move { link.recv(0).await }
            });
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert!(!sender.is_finished() && !receiver.is_finished());
            child.child.kill().unwrap();
            let killed = Instant::now();
            let err = sender.await.unwrap();
            assert!(
                matches!(err.error, TransportError::Closed { peer: 1, .. }),
                "{}",
                err.error
            );
            assert_eq!(err.payload.len(), 16 << 20);
            let err = receiver.await.unwrap().unwrap_err();
            assert!(matches!(err, TransportError::Closed { peer: 1, .. }), "{err}");
            assert!(killed.elapsed() < Duration::from_secs(2), "took {:?}", killed.elapsed());
        })
        .await;
    }

    /// Prints GB/s for 64 MiB transfers to another process, over shared
    /// memory and over raw TCP on loopback, measured in the same run.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a benchmark: cargo test --release -p chorus-transports shm_throughput -- --ignored --nocapture"]
    async fn shm_throughput_against_tcp() {
        const COUNT: usize = 20;
        let count = [("CHORUS_SHM_TEST_COUNT", (COUNT + 2).to_string())];
        let payload = pattern(BIG, 5);
        let gbps = |elapsed: Duration| (COUNT * BIG) as f64 / elapsed.as_secs_f64() / 1e9;

        let (link, _child) = with_child("sink", &count).await;
        // Two warm-up transfers, then the timed ones; the ack ends the clock.
        for _ in 0..2 {
            link.send(0, 0, payload.clone()).await.unwrap();
        }
        let start = Instant::now();
        for _ in 0..COUNT {
            link.send(0, 0, payload.clone()).await.unwrap();
        }
        link.recv(0).await.unwrap();
        let shm = gbps(start.elapsed());
        link.close("done");

        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port().to_string();
        let _child = ChildProcess::spawn("tcp-sink", 0, &[count[0].clone(), ("CHORUS_SHM_TEST_PORT", port)]);
        let (mut stream, _) = listener.accept().unwrap();
        for _ in 0..2 {
            stream.write_all(&payload).unwrap();
        }
        let start = Instant::now();
        for _ in 0..COUNT {
            stream.write_all(&payload).unwrap();
        }
        stream.read_exact(&mut [0u8]).unwrap();
        let tcp = gbps(start.elapsed());
        println!(
            "64 MiB x {COUNT} to another process: shm {shm:.2} GB/s, raw TCP loopback {tcp:.2} GB/s ({:.2}x)",
            shm / tcp
        );
    }
}
