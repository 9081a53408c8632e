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
//! skipped space (SHM-10); `u64` tag, `u64` length of this record's
//! payload, `u64` length of the whole frame) then the payload, padded to a
//! multiple of 64 bytes, so payloads are 64-byte aligned.
//!
//! # Protocol (rules SHM-1..SHM-10)
//! - SHM-1: A rank draws a random 64-bit nonce ([`ShmEndpoint::new`]) and
//!   publishes it through rendezvous; the nonce names its rings, so names
//!   never collide across processes or runs.
//! - SHM-2: Connecting ([`ShmEndpoint::connect_mesh`]) first creates every
//!   outbound ring (`O_EXCL`, mode 0600, sized with `ftruncate` after
//!   checking that the tmpfs has room for it, so a small `/dev/shm` is an
//!   error now rather than a `SIGBUS` later), then attaches every inbound
//!   ring, then waits until every peer has attached to this rank's rings.
//!   Both sides of a pair must connect concurrently. The ring's pages are
//!   reserved (`posix_fallocate`) by a background thread, not while
//!   connecting, and mapped in by faults on first use: reserving and
//!   `MAP_POPULATE`-ing 64 MiB rings to every local peer took 0.1-0.7 s on
//!   2 cores, most of a group restart, and populating them in the
//!   background held the mmap lock the ranks need (0.1-0.5 s more). A ring
//!   that does not fit fails its link before the writer's next record.
//! - SHM-3: The writer fills the header and stores the magic last; a reader that
//!   finds magic 0 waits, any other wrong magic, version or size is a typed
//!   [`TransportError::Protocol`]. The reader checks that the file is its
//!   own user's, maps it, stores its pid, and unlinks the file: from then on
//!   nothing is left behind whatever happens. A crash between creating and
//!   the peer's attach (the connect window) leaves the file behind, until
//!   [`remove_dead_rings`] finds it: a ring whose writer's pid is dead in
//!   the writer's own pid namespace is removed (the lowest local rank of
//!   a mesh sweeps before creating its rings, `chorus launch` once its
//!   workers are gone).
//! - SHM-4: The writer alone moves `head`, the reader alone moves `tail`;
//!   `head - tail <= capacity` always. The writer copies a record into
//!   `[head, head + size)` only once `tail` allows it, then publishes it
//!   with one `head` store; the reader reads nothing past `head` and the
//!   writer writes nothing in `[tail, head)`.
//! - SHM-5: A frame whose record fits the ring is one record, handed to the
//!   receiver without a copy (a `Bytes` over the mapping); `tail` passes it
//!   once that `Bytes` and all its clones are dropped (records released out
//!   of order wait for the ones before them). A larger frame is cut into
//!   pieces of a quarter of the ring, consecutive in the ring, which the
//!   receiver copies into a reused buffer and releases at once.
//! - SHM-6: Reading: records are read in order and filed into bounded
//!   per-channel queues by whichever thread reads, under one lock. A
//!   receive that finds its queue empty reads the ring itself, on its own
//!   thread, polling for up to 50 us (yielding the core between rounds of
//!   polls); a frame that comes in that time costs no thread a wake-up.
//!   Then it raises its channel's bit in the `awaited` mask, reads once
//!   more, and waits: from then on the link's watcher thread reads for it.
//! - SHM-7: Sleeping: the writer spins for a few microseconds for room, then
//!   reads the futex word, raises its sleeping flag, re-checks `tail` and
//!   `FUTEX_WAIT`s with a timeout; the reader bumps the word and wakes it
//!   after moving `tail` if the flag is up. The watcher sleeps on the
//!   other word; the writer bumps it and wakes it after publishing a
//!   record whose channel is awaited, or a piece of a frame larger than the
//!   ring (the rest of the frame needs the room the piece frees). Every
//!   timeout (the liveness interval, 100 ms by default) checks the peer's
//!   pid, so a peer that died without closing is an error, not a hang.
//! - SHM-8: Closing raises this side's closed flag in both rings and wakes every
//!   sleeper; the peer still receives every record published before it.
//!   A close on purpose ([`Link::close_with`]) first writes its encoded
//!   [`CloseNotice`](crate::link::CloseNotice) next to the flag (length last), so the peer gets
//!   [`TransportError::PeerClosed`]; a flag without a notice (a cut, a
//!   dropped link) is a lost link. A ring of another version is a typed
//!   error when attaching (SHM-3).
//! - SHM-9: Frames read but not received (in their channels' queues, or
//!   waiting for room in one) lie in the ring and hold `tail` back, so
//!   frames of another channel behind them could wait for room forever
//!   (a frame larger than the ring, or enough frames to go round it,
//!   behind a frame its receiver takes only later). When the watcher
//!   finds the writer sleeping for room and `tail` unmoved for 20 ms with
//!   such frames in the ring, it copies them out, which releases their
//!   records. It looks on each wake, at least once per liveness
//!   interval.
//! - SHM-10: A writer that finds the ring empty (`tail == head`) 1 MiB or more
//!   into it, with the record fitting before that point, publishes a
//!   skip record to the ring's end and writes at its start: the lines it
//!   writes were written and read a moment ago and are still in the
//!   cache, instead of lines never touched since the last lap (a
//!   2 MiB all-reduce ran 2.5x faster, bench/HISTORY.md §22). The
//!   reader releases a skip record as it reads it. A ring in use goes on as
//!   before, so a backlog still has the whole ring.
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
//! (SHM-9). A channel whose queue is full stops reading until a receive
//! of it takes a frame, so frames of other channels behind it wait too
//! (receive every channel you send on). Small frames cost a receive that
//! comes in time no thread hand-off; one that waits costs two (the
//! watcher, then the receiving task), as every frame did when a reader
//! thread read them all. Peer liveness uses pids: both processes must
//! share a pid namespace.
//!
//! # Layout
//! - this file: the options, the endpoint (connecting, SHM-2 and SHM-3),
//!   sweeping rings of dead writers, tmpfs space.
//! - [`ring`]: the records sans IO, public so that tests and the `shm_ring`
//!   fuzz target drive them over a byte slice: where the writer puts a
//!   record ([`ring::place`], SHM-4 and SHM-10), the reader's walk over
//!   published records with every check ([`ring::ReadCursor`], SHM-4, SHM-5
//!   and 10), when `tail` moves ([`ring::Released`]).
//! - `sim`: a writer and a reader of those records over a byte vector,
//!   with the checks every ring must pass; built for the unit tests and,
//!   behind the `fuzzing` feature, the `shm_ring` fuzz target.
//! - `mapped`: the ring in `/dev/shm`: header layout, the double mapping,
//!   futex waits and wakes, the peer's liveness by pid (SHM-3, SHM-7).
//! - `link`: [`ShmLink`] on top: the writer (SHM-4, SHM-5, SHM-10), reading into
//!   per-channel queues (SHM-6), the watcher thread (SHM-7, SHM-9), closing
//!   (SHM-8).
//! - `tests`: the link's tests (a test per numbered rule, two-process
//!   tests), and `tests/ring.rs`, the records' (over `sim`).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::link::{Link, TransportError};

mod link;
mod mapped;
pub mod ring;
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod sim;
#[cfg(test)]
mod tests;

pub use link::ShmLink;
use mapped::{MAGIC, Ring, alive, reserve_in_background};

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
            let peer = link.peer();
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
        // Files this rank made and no peer has unlinked yet (SHM-3).
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
                // Mapped: the name is no longer needed (SHM-3).
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
/// reader attached (SHM-3): files of this user whose header is a chorus
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
