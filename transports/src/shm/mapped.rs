//! The ring as mapped by both processes: its file's header (the layout in
//! the module doc of [`super`]), the double mapping of its data area, the
//! futex waits and the peer's liveness. What the records mean is
//! [`super::ring`]'s.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::ring::Released;
use super::{connect_error, page_size, pid_namespace, protocol_error, space_of};
use crate::link::{CloseNotice, TransportError};

/// `chorusR1`: marks a fully initialized ring.
pub(super) const MAGIC: u64 = u64::from_le_bytes(*b"chorusR1");
pub(super) const VERSION: u32 = 3;

/// The ring header, at the start of the file. Every field is an atomic, so
/// both processes may touch it through shared references.
#[repr(C)]
pub(super) struct Header {
    pub(super) magic: AtomicU64,
    pub(super) version: AtomicU32,
    pub(super) writer_pid: AtomicU32,
    pub(super) capacity: AtomicU64,
    pub(super) data_offset: AtomicU64,
    pub(super) writer_rank: AtomicU64,
    pub(super) reader_rank: AtomicU64,
    pub(super) reader_pid: AtomicU32,
    pub(super) writer_pid_ns: AtomicU64,
    pub(super) writer: WriterLine,
    pub(super) reader: ReaderLine,
    pub(super) writer_notice: NoticeArea,
    pub(super) reader_notice: NoticeArea,
}

/// Bytes of an encoded close notice a ring header holds per side.
const NOTICE_BYTES: usize = 1020;
const _: () = assert!(CloseNotice::MAX_ENCODED <= NOTICE_BYTES);

/// Where one side leaves its [`CloseNotice`] when it closes on purpose
/// (SHM-8): written once, before that side's closed flag.
#[repr(C)]
pub(super) struct NoticeArea {
    len: AtomicU32,
    bytes: [AtomicU8; NOTICE_BYTES],
}

impl NoticeArea {
    pub(super) fn write(&self, encoded: &[u8]) {
        let encoded = &encoded[..encoded.len().min(NOTICE_BYTES)];
        for (slot, &byte) in self.bytes.iter().zip(encoded) {
            slot.store(byte, Ordering::Relaxed);
        }
        self.len.store(encoded.len() as u32, Ordering::Release);
    }

    /// The notice, if the side left one; read after seeing its closed flag.
    pub(super) fn read(&self) -> Option<CloseNotice> {
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
pub(super) struct WriterLine {
    pub(super) head: AtomicU64,
    pub(super) head_seq: AtomicU32,
    pub(super) sleeping: AtomicU32,
    pub(super) closed: AtomicU32,
}

/// Fields the reader moves.
#[repr(C, align(128))]
pub(super) struct ReaderLine {
    pub(super) tail: AtomicU64,
    pub(super) tail_seq: AtomicU32,
    /// Channels ([`channel_bit`]) whose records wake the reader's watcher.
    pub(super) awaited: AtomicU32,
    pub(super) closed: AtomicU32,
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

/// Reserves a ring's pages in the tmpfs (`posix_fallocate`) on a thread of
/// its own (SHM-2), so a full tmpfs fails the link rather than `SIGBUS`ing
/// the writer later; records why it failed in `failed`. Only the file is
/// touched, not the mapping: the connecting and running ranks need their
/// process's mmap lock, which `MAP_POPULATE` or `MADV_POPULATE_WRITE` would
/// hold (measured: 0.1-0.5 s added to a restart on 2 busy cores). Pages
/// reserved this way are mapped in by minor faults on first use.
pub(super) fn reserve_in_background(file: File, len: u64, failed: Arc<std::sync::OnceLock<String>>) {
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
pub(super) struct Ring {
    map: Mapping,
    pub(super) data_offset: usize,
    pub(super) capacity: u64,
    released: Mutex<Released>,
    /// Why reserving the ring's pages failed, once it did (writer side).
    pub(super) reservation: Arc<std::sync::OnceLock<String>>,
}

impl Ring {
    /// Creates, sizes and initializes the ring `writer_rank` sends on.
    pub(super) fn create(
        path: &Path,
        capacity: usize,
        writer_rank: usize,
        reader_rank: usize,
    ) -> io::Result<(Ring, File)> {
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
    pub(super) fn open(path: &Path, writer_rank: usize, reader_rank: usize) -> Result<Option<Ring>, TransportError> {
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

    pub(super) fn header(&self) -> &Header {
        self.map.header_ref()
    }

    /// Where position `pos` lives; the double mapping makes the next
    /// `capacity` bytes contiguous.
    pub(super) fn at(&self, pos: u64) -> *mut u8 {
        // SAFETY: `data_offset + pos % capacity < data_offset + capacity`,
        // inside the reservation.
        unsafe { self.map.base.add(self.data_offset + (pos % self.capacity) as usize) }
    }

    /// Whether `ptr` points into the data area (either mapping of it).
    pub(super) fn holds(&self, ptr: *const u8) -> bool {
        let start = self.at(0) as usize;
        (start..start + 2 * self.capacity as usize).contains(&(ptr as usize))
    }

    /// Bumps both futex words and wakes everyone sleeping on them.
    pub(super) fn poke(&self) {
        let header = self.header();
        for word in [&header.writer.head_seq, &header.reader.tail_seq] {
            word.fetch_add(1, Ordering::SeqCst);
            futex_wake(word);
        }
    }

    /// Marks `start..end` consumed; advances `tail` over every released
    /// range now contiguous with it and wakes a sleeping writer.
    pub(super) fn release(&self, start: u64, end: u64) {
        // Held while `tail` is stored, so stores never go backwards.
        let mut released = self.released.lock().unwrap_or_else(|p| p.into_inner());
        let Some(tail) = released.release(start, end) else {
            return;
        };
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
pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> bool {
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

pub(super) fn futex_wake(word: &AtomicU32) {
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
pub(super) fn alive(pid: u32) -> bool {
    if pid == 0 {
        return true;
    }
    if !crate::process::exists(pid) {
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
