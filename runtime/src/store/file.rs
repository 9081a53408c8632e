//! [`FileStore`]: the store in a file, for `file://` (PyTorch's FileStore
//! analogue), shared by processes on one host or on a shared file system.
//!
//! Unlike PyTorch's, a file left by an earlier run (finished or crashed) never
//! poisons the next run, and the last member out removes it.
//!
//! # On disk
//! Two files: the data file at `path` and the liveness file `path.members`.
//!
//! The data file is an append-only log, all integers little-endian:
//! - a header: magic `b"CHORUSFS"`, `u32` format version, `u64` random run nonce;
//! - records: `u8` kind (0 set, 1 delete, 2 queue push, 3 queue pop,
//!   4 append), `u32` key length, the key, `u64` value length, the value
//!   (empty for delete and queue pop).
//!
//! Lengths are checked against [`Limits`] before anything is allocated, so a
//! foreign or damaged file gives [`StoreError::CorruptFile`]. A final record cut
//! short is the trace of a member that died (or failed) mid-append: the
//! reader holds the exclusive lock, so no append can be in progress, and the
//! cut record was never acknowledged to anyone; it is truncated away.
//!
//! Every operation replays the records added since its last one into a
//! cached [`KvState`], applies itself there (the semantics live in
//! [`KvState`] alone) and appends the records of its effect. When the log
//! passes 1 MiB and four times the size of the live state, the member holding
//! the lock writes a snapshot next to it and renames it over `path`.
//!
//! # Locking (all `flock`, which the kernel drops when a process dies)
//! 1. Every operation, open and close holds an exclusive lock on the data
//!    file, then checks that its descriptor is still the file at `path`
//!    (device and inode); if not (compacted or removed), it reopens and retries.
//! 2. Every live member holds a shared lock on the liveness file.
//! 3. Opening: under rule 1, a *non-blocking* exclusive lock on the liveness
//!    file succeeds only when no member is alive: every earlier user finished
//!    or crashed, so the data file is stale and is reset to a fresh header
//!    (a file without chorus's header is refused instead: a mistyped path
//!    must not destroy someone's file). The opener then takes its shared lock.
//! 4. Closing: under rule 1, a member drops its shared lock and tries the
//!    exclusive one; when it gets it, it is the last member out and unlinks
//!    the liveness file, then the data file. That order matters: an opener
//!    that creates a data file after the unlink can only find a new liveness
//!    file, never the old one (still locked by the closer).
//! 5. Every read checks the header's run nonce, so a store reset under a live
//!    member (its liveness file removed by hand, say) is reported, not mixed.
//!
//! `flock` locks belong to an open file description, so two `FileStore`s in
//! one process behave like two processes. On NFS, Linux emulates `flock` with
//! POSIX locks, which do not conflict within one process: use one `FileStore`
//! per process there.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::time::Instant;

use super::protocol::Limits;
use super::state::{KvState, StateError};
use super::{DEFAULT_TIMEOUT, Store, StoreError, check_sizes};

const MAGIC: &[u8; 8] = b"CHORUSFS";
const VERSION: u32 = 1;
const HEADER_LEN: u64 = 8 + 4 + 8;
/// Kind, key length and value length: a record's size less its key and value.
const RECORD_OVERHEAD: u64 = 1 + 4 + 8;
/// Logs smaller than this are never compacted: rewriting them gains nothing.
const COMPACT_MIN: u64 = 1024 * 1024;
/// Compact when the log is this many times the size of a snapshot.
const COMPACT_RATIO: u64 = 4;
const POLL_START: Duration = Duration::from_millis(1);
const POLL_MAX: Duration = Duration::from_millis(50);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Set = 0,
    Delete = 1,
    QueuePush = 2,
    QueuePop = 3,
    Append = 4,
}

impl Kind {
    fn from_byte(byte: u8) -> Option<Self> {
        Some(match byte {
            0 => Kind::Set,
            1 => Kind::Delete,
            2 => Kind::QueuePush,
            3 => Kind::QueuePop,
            4 => Kind::Append,
            _ => return None,
        })
    }

    fn has_value(self) -> bool {
        !matches!(self, Kind::Delete | Kind::QueuePop)
    }
}

fn encode(log: &mut Vec<u8>, kind: Kind, key: &[u8], value: &[u8]) {
    log.push(kind as u8);
    // Keys are bounded by `Limits::max_key` (KiBs) before they get here.
    log.extend_from_slice(&(key.len() as u32).to_le_bytes());
    log.extend_from_slice(key);
    log.extend_from_slice(&(value.len() as u64).to_le_bytes());
    log.extend_from_slice(value);
}

fn header(nonce: u64) -> [u8; HEADER_LEN as usize] {
    let mut header = [0; HEADER_LEN as usize];
    header[..8].copy_from_slice(MAGIC);
    header[8..12].copy_from_slice(&VERSION.to_le_bytes());
    header[12..].copy_from_slice(&nonce.to_le_bytes());
    header
}

fn record_len(key: &[u8], value: &[u8]) -> u64 {
    RECORD_OVERHEAD + key.len() as u64 + value.len() as u64
}

/// `path` with `suffix` appended to its file name.
fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// Whether `file` is still the file at `path` (not replaced nor removed).
fn is_current(file: &File, path: &Path) -> io::Result<bool> {
    let open = file.metadata()?;
    match fs::metadata(path) {
        Ok(named) => Ok(named.dev() == open.dev() && named.ino() == open.ino()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

fn remove_if_present(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

fn open_rw(path: &Path, create: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        .open(path)
}

/// Options of [`FileStore::open`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileStoreOptions {
    /// The default timeout of blocking operations.
    pub timeout: Duration,
    /// Largest keys and values stored, and read back from the file.
    pub limits: Limits,
}

impl Default for FileStoreOptions {
    fn default() -> Self {
        Self {
            timeout: DEFAULT_TIMEOUT,
            limits: Limits::default(),
        }
    }
}

/// One member's view of the store, behind a mutex so blocking tasks own it.
struct Inner {
    path: PathBuf,
    members_path: PathBuf,
    limits: Limits,
    data: File,
    /// Our shared lock on the liveness file; `None` once closed.
    members: Option<File>,
    /// The run this store belongs to, from the header.
    nonce: u64,
    /// The log up to here is applied to `state`; 0 means reread all.
    offset: u64,
    state: KvState<()>,
    /// The log length past which compaction is considered again.
    compact_at: u64,
}

impl Inner {
    fn location(&self) -> String {
        format!("file://{}", self.path.display())
    }

    fn io(&self, source: io::Error) -> StoreError {
        StoreError::Io {
            location: self.location(),
            source,
        }
    }

    fn corrupt(&self, reason: impl Into<String>) -> StoreError {
        StoreError::CorruptFile {
            path: self.path.clone(),
            reason: reason.into(),
        }
    }

    /// Forgets the cache: the next sync rereads the log from its header.
    fn reset_cache(&mut self) {
        self.offset = 0;
        self.state = KvState::new(self.limits.max_value);
    }

    /// Takes the exclusive data lock on the file now at `path` (rule 1).
    fn lock_data(&mut self) -> Result<(), StoreError> {
        loop {
            self.data.lock().map_err(|e| self.io(e))?;
            let fresh = match is_current(&self.data, &self.path) {
                Ok(true) => return Ok(()),
                Ok(false) => open_rw(&self.path, false),
                Err(e) => Err(e),
            };
            let fresh = match fresh {
                Ok(file) => file,
                Err(e) => {
                    let _ = self.data.unlock();
                    return Err(if e.kind() == io::ErrorKind::NotFound {
                        self.corrupt("the file was removed while members still used it")
                    } else {
                        self.io(e)
                    });
                }
            };
            // Dropping the old descriptor releases its lock.
            self.data = fresh;
            self.reset_cache();
        }
    }

    /// Reads the header and returns its nonce.
    fn read_header(&self) -> Result<u64, StoreError> {
        let mut header = [0; HEADER_LEN as usize];
        match self.data.read_exact_at(&mut header, 0) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                return Err(self.corrupt("the header is missing"));
            }
            Err(e) => return Err(self.io(e)),
        }
        if &header[..8] != MAGIC {
            return Err(self.corrupt("it is not a chorus file store (bad magic)"));
        }
        let version = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
        if version != VERSION {
            return Err(self.corrupt(format!("format version {version}, expected {VERSION}")));
        }
        let mut nonce = [0; 8];
        nonce.copy_from_slice(&header[12..]);
        Ok(u64::from_le_bytes(nonce))
    }

    /// Applies the records appended since the last sync (under the data lock).
    fn sync(&mut self) -> Result<(), StoreError> {
        if self.read_header()? != self.nonce {
            return Err(self.corrupt("it was reset by another run while this member used it"));
        }
        let len = self.data.metadata().map_err(|e| self.io(e))?.len();
        if self.offset == 0 {
            self.offset = HEADER_LEN;
        }
        if len < self.offset {
            return Err(self.corrupt("it shrank while this member used it"));
        }
        let mut pos = self.offset;
        (&self.data).seek(SeekFrom::Start(pos)).map_err(|e| self.io(e))?;
        let mut reader = BufReader::new(&self.data);
        while pos < len {
            // Each length is checked against the limits, then against the
            // bytes left, before anything is allocated. A short tail still
            // gets its kind checked, so garbage is not mistaken for a torn record.
            let mut head = [0; 5];
            let available = (len - pos).min(5) as usize;
            reader.read_exact(&mut head[..available]).map_err(|e| self.io(e))?;
            let kind = Kind::from_byte(head[0])
                .ok_or_else(|| self.corrupt(format!("unknown record kind {} at byte {pos}", head[0])))?;
            let key_len = u64::from(u32::from_le_bytes([head[1], head[2], head[3], head[4]]));
            if key_len > self.limits.max_key as u64 {
                return Err(self.corrupt(format!("a key of {key_len} bytes at byte {pos}, over the limit")));
            }
            if len - pos < RECORD_OVERHEAD + key_len {
                break;
            }
            let mut key = vec![0; key_len as usize];
            reader.read_exact(&mut key).map_err(|e| self.io(e))?;
            let mut value_len = [0; 8];
            reader.read_exact(&mut value_len).map_err(|e| self.io(e))?;
            let value_len = u64::from_le_bytes(value_len);
            if value_len > self.limits.max_value as u64 || (!kind.has_value() && value_len != 0) {
                return Err(self.corrupt(format!(
                    "a value of {value_len} bytes at byte {pos}, over the limit or on a kind without values"
                )));
            }
            if len - pos - RECORD_OVERHEAD - key_len < value_len {
                break;
            }
            let mut value = vec![0; value_len as usize];
            reader.read_exact(&mut value).map_err(|e| self.io(e))?;
            let (key, value) = (Bytes::from(key), Bytes::from(value));
            match kind {
                Kind::Set => drop(self.state.set(key, value)),
                Kind::Delete => {
                    self.state.delete(&key);
                }
                Kind::QueuePush => drop(self.state.queue_push(key, value)),
                Kind::QueuePop => {
                    self.state.queue_pop(&key);
                }
                Kind::Append => {
                    if let Err(e) = self.state.append(key, &value) {
                        return Err(self.corrupt(format!("record at byte {pos}: {e}")));
                    }
                }
            }
            pos += RECORD_OVERHEAD + key_len + value_len;
            self.offset = pos;
        }
        drop(reader);
        if pos < len {
            // A torn final record: see the module doc.
            tracing::warn!(
                path = %self.path.display(),
                bytes = len - pos,
                "discarding a partly written record left by a member that died or failed mid-append"
            );
            self.data.set_len(pos).map_err(|e| self.io(e))?;
        }
        Ok(())
    }

    /// Appends `log` at the end of the synced file.
    fn append_log(&mut self, log: &[u8]) -> Result<(), StoreError> {
        if log.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.data.write_all_at(log, self.offset) {
            // Best effort: undo a partial record now (else the next reader
            // discards it); the cache already holds the effect, so drop it.
            let _ = self.data.set_len(self.offset);
            self.reset_cache();
            return Err(self.io(e));
        }
        self.offset += log.len() as u64;
        Ok(())
    }

    fn snapshot_len(&self) -> u64 {
        let entries: u64 = self.state.entries().map(|(k, v)| record_len(k, v)).sum();
        let queues: u64 = self
            .state
            .queues()
            .flat_map(|(k, q)| q.iter().map(move |v| record_len(k, v)))
            .sum();
        HEADER_LEN + entries + queues
    }

    fn maybe_compact(&mut self) {
        if self.offset <= self.compact_at {
            return;
        }
        let snapshot = self.snapshot_len();
        self.compact_at = COMPACT_MIN.max(COMPACT_RATIO * snapshot);
        if self.offset <= COMPACT_RATIO * snapshot {
            return;
        }
        let before = self.offset;
        match self.compact() {
            Ok(()) => {
                tracing::debug!(path = %self.path.display(), before, after = self.offset, "compacted file store")
            }
            Err(e) => {
                // The operation itself succeeded; a bloated log is only slower.
                tracing::warn!(path = %self.path.display(), error = %e, "could not compact file store");
                self.compact_at = self.offset + COMPACT_MIN;
            }
        }
    }

    /// Writes a snapshot beside the log and renames it over `path`.
    fn compact(&mut self) -> io::Result<()> {
        let temp = sibling(&self.path, ".compact");
        let written = (|| {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&temp)?;
            // Locked before it gets its name, so nobody uses it before we are done.
            file.lock()?;
            let mut out = BufWriter::new(&file);
            out.write_all(&header(self.nonce))?;
            let mut record = Vec::new();
            for (key, value) in self.state.entries() {
                record.clear();
                encode(&mut record, Kind::Set, key, value);
                out.write_all(&record)?;
            }
            for (key, queue) in self.state.queues() {
                for value in queue {
                    record.clear();
                    encode(&mut record, Kind::QueuePush, key, value);
                    out.write_all(&record)?;
                }
            }
            out.flush()?;
            drop(out);
            let len = file.metadata()?.len();
            fs::rename(&temp, &self.path)?;
            Ok((file, len))
        })();
        match written {
            Ok((file, len)) => {
                // Dropping the old descriptor releases its lock; members
                // waiting on it see the new inode and reread.
                self.data = file;
                self.offset = len;
                Ok(())
            }
            Err(e) => {
                let _ = remove_if_present(&temp);
                Err(e)
            }
        }
    }

    /// One operation under the data lock: sync, apply `op` (which appends the
    /// records of its effect to the log it is given), write, maybe compact.
    fn transact<T>(
        &mut self,
        op: impl FnOnce(&mut KvState<()>, &mut Vec<u8>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        if self.members.is_none() {
            return Err(self.io(io::Error::other("the file store is closed")));
        }
        self.lock_data()?;
        let result = self.sync().and_then(|()| {
            let mut log = Vec::new();
            let value = op(&mut self.state, &mut log)?;
            self.append_log(&log)?;
            self.maybe_compact();
            Ok(value)
        });
        let unlocked = self.data.unlock();
        let value = result?;
        unlocked.map_err(|e| self.io(e))?;
        Ok(value)
    }

    /// Leaves the store; the last member out removes its files (rule 4).
    fn close(&mut self) -> Result<(), StoreError> {
        let Some(members) = self.members.take() else {
            return Ok(());
        };
        // Without the data lock, removing files would race openers: only
        // give up membership (dropping `members`) then.
        self.lock_data()?;
        let result = (|| {
            members.unlock()?;
            match members.try_lock() {
                Ok(()) => {
                    remove_if_present(&self.members_path)?;
                    remove_if_present(&self.path)?;
                    // Left by a member that died while compacting.
                    remove_if_present(&sibling(&self.path, ".compact"))
                }
                Err(TryLockError::WouldBlock) => Ok(()),
                Err(TryLockError::Error(e)) => Err(e),
            }
        })();
        drop(members);
        let unlocked = self.data.unlock();
        result.and(unlocked).map_err(|e| self.io(e))
    }
}

/// Opens and joins the store at `path` (rule 3).
fn open_blocking(path: PathBuf, limits: Limits) -> Result<Inner, StoreError> {
    let location = format!("file://{}", path.display());
    let io_err = |source| StoreError::Io {
        location: location.clone(),
        source,
    };
    let data = loop {
        let data = open_rw(&path, true).map_err(io_err)?;
        data.lock().map_err(io_err)?;
        if is_current(&data, &path).map_err(io_err)? {
            break data;
        }
    };
    let mut inner = Inner {
        members_path: sibling(&path, ".members"),
        path,
        limits,
        data,
        members: None,
        nonce: 0,
        offset: 0,
        state: KvState::new(limits.max_value),
        compact_at: COMPACT_MIN,
    };
    let joined = join(&mut inner);
    let unlocked = inner.data.unlock();
    joined?;
    unlocked.map_err(io_err)?;
    Ok(inner)
}

/// The part of opening done under the data lock.
fn join(inner: &mut Inner) -> Result<(), StoreError> {
    let members = open_rw(&inner.members_path, true).map_err(|e| inner.io(e))?;
    match members.try_lock() {
        Ok(()) => {
            // Nobody alive holds the store: a chorus store file is stale. A
            // file chorus never wrote (a mistyped path) is left alone.
            let len = inner.data.metadata().map_err(|e| inner.io(e))?.len();
            let mut start = [0u8; 8];
            let read = inner.data.read_at(&mut start, 0).map_err(|e| inner.io(e))?;
            if start[..read] != MAGIC[..read] {
                return Err(StoreError::CorruptFile {
                    path: inner.path.clone(),
                    reason: "it is not a chorus store file, so it is not overwritten; pick another path".into(),
                });
            }
            if len > 0 {
                tracing::info!(path = %inner.path.display(), "reset a stale file store left by an earlier run");
            }
            let nonce =
                getrandom::u64().map_err(|e| inner.io(io::Error::other(format!("no random run nonce: {e}"))))?;
            inner.data.set_len(0).map_err(|e| inner.io(e))?;
            inner.data.write_all_at(&header(nonce), 0).map_err(|e| inner.io(e))?;
            members.unlock().map_err(|e| inner.io(e))?;
        }
        Err(TryLockError::WouldBlock) => {}
        Err(TryLockError::Error(e)) => return Err(inner.io(e)),
    }
    members.lock_shared().map_err(|e| inner.io(e))?;
    inner.members = Some(members);
    inner.nonce = inner.read_header()?;
    inner.sync()
}

/// The store in a file: an append-only log at `path`, with `path.members`
/// locked (shared) by every live member. A file no live member holds is stale
/// and is reset on open, so a finished or crashed run never poisons the next.
///
/// Dropping it (or [`FileStore::close`]) leaves the store, and the last
/// member out removes the files.
pub struct FileStore {
    inner: Arc<Mutex<Inner>>,
    location: String,
    timeout: Duration,
    limits: Limits,
}

impl std::fmt::Debug for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStore")
            .field("location", &self.location)
            .field("timeout", &self.timeout)
            .finish()
    }
}

fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    // A panic under the lock leaves at worst a stale cache, which the next
    // sync tolerates; keep going rather than poison every later call.
    inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
    location: &str,
) -> Result<T, StoreError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Err(StoreError::Io {
            location: location.to_string(),
            source: io::Error::other("the runtime shut down during a file store operation"),
        }),
    }
}

fn bytes(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

/// Pops queue `key`, logging the pop when there was a value.
fn pop(state: &mut KvState<()>, log: &mut Vec<u8>, key: &Bytes) -> Option<Bytes> {
    let popped = state.queue_pop(key).map(|(_, value)| value);
    if popped.is_some() {
        encode(log, Kind::QueuePop, key, b"");
    }
    popped
}

/// What a polled operation found: its result, or the keys it still misses.
type Poll<T> = Result<T, Vec<Bytes>>;

impl FileStore {
    /// Opens (creating, or resetting when stale) the store at `path` and joins it.
    pub async fn open(path: impl AsRef<Path>, options: FileStoreOptions) -> Result<FileStore, StoreError> {
        let path = path.as_ref();
        let location = format!("file://{}", path.display());
        // Absolute, so the last member out removes the right files even if
        // the working directory changes meanwhile.
        let path = std::path::absolute(path).map_err(|source| StoreError::Io {
            location: location.clone(),
            source,
        })?;
        let limits = options.limits;
        let inner = blocking(move || open_blocking(path, limits), &location).await?;
        Ok(FileStore {
            location: inner.location(),
            inner: Arc::new(Mutex::new(inner)),
            timeout: options.timeout,
            limits,
        })
    }

    /// Leaves the store now, reporting errors that dropping it only logs.
    pub async fn close(self) -> Result<(), StoreError> {
        let inner = Arc::clone(&self.inner);
        // `self` drops afterwards and finds the store already closed.
        blocking(move || lock(&inner).close(), &self.location).await
    }

    async fn run<T: Send + 'static>(
        &self,
        op: impl FnOnce(&mut KvState<()>, &mut Vec<u8>) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let inner = Arc::clone(&self.inner);
        blocking(move || lock(&inner).transact(op), &self.location).await
    }

    /// Retries `op` with backoff until it finds its keys or `timeout` passes.
    async fn poll<T: Send + 'static>(
        &self,
        timeout: Duration,
        op: impl Fn(&mut KvState<()>, &mut Vec<u8>) -> Poll<T> + Clone + Send + 'static,
    ) -> Result<T, StoreError> {
        let started = Instant::now();
        let mut pause = POLL_START;
        loop {
            let attempt = op.clone();
            let missing = match self.run(move |state, log| Ok(attempt(state, log))).await? {
                Ok(value) => return Ok(value),
                Err(missing) => missing,
            };
            let waited = started.elapsed();
            if waited >= timeout {
                return Err(StoreError::Timeout {
                    keys: missing
                        .iter()
                        .map(|k| String::from_utf8_lossy(k).into_owned())
                        .collect(),
                    location: self.location(),
                    waited,
                });
            }
            tokio::time::sleep(pause.min(timeout - waited)).await;
            pause = (pause * 2).min(POLL_MAX);
        }
    }

    fn rejected(&self, source: StateError) -> StoreError {
        StoreError::Rejected {
            location: self.location(),
            source,
        }
    }
}

impl Drop for FileStore {
    fn drop(&mut self) {
        if let Err(e) = lock(&self.inner).close() {
            tracing::warn!(store = %self.location, error = %e, "could not leave the file store cleanly");
        }
    }
}

#[async_trait]
impl Store for FileStore {
    fn location(&self) -> String {
        self.location.clone()
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }

    async fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_sizes(key, value, &self.limits)?;
        let (key, value) = (bytes(key), Bytes::copy_from_slice(value));
        self.run(move |state, log| {
            encode(log, Kind::Set, &key, &value);
            drop(state.set(key, value));
            Ok(())
        })
        .await
    }

    async fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Bytes, StoreError> {
        let key = bytes(key);
        self.poll(timeout, move |state, _| {
            state.get(&key).ok_or_else(|| vec![key.clone()])
        })
        .await
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        check_sizes(key, b"", &self.limits)?;
        let key = bytes(key);
        let added = self
            .run(move |state, log| {
                let added = state.add(key.clone(), delta);
                if let Ok((value, _)) = &added {
                    encode(log, Kind::Set, &key, value.to_string().as_bytes());
                }
                Ok(added.map(|(value, _)| value))
            })
            .await?;
        added.map_err(|e| self.rejected(e))
    }

    async fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Bytes, StoreError> {
        check_sizes(key, desired, &self.limits)?;
        let (key, expected, desired) = (
            bytes(key),
            Bytes::copy_from_slice(expected),
            Bytes::copy_from_slice(desired),
        );
        self.run(move |state, log| {
            let before = state.get(&key);
            let (current, _) = state.compare_set(key.clone(), expected, desired);
            let after = state.get(&key);
            if after != before
                && let Some(value) = after
            {
                encode(log, Kind::Set, &key, &value);
            }
            Ok(current)
        })
        .await
    }

    async fn check(&self, keys: &[&str]) -> Result<bool, StoreError> {
        let keys: Vec<Bytes> = keys.iter().map(|k| bytes(k)).collect();
        self.run(move |state, _| Ok(state.check(&keys))).await
    }

    async fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<(), StoreError> {
        let keys: Vec<Bytes> = keys.iter().map(|k| bytes(k)).collect();
        self.poll(timeout, move |state, _| {
            let missing: Vec<Bytes> = keys.iter().filter(|k| !state.check(&[k])).cloned().collect();
            if missing.is_empty() { Ok(()) } else { Err(missing) }
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let key = bytes(key);
        self.run(move |state, log| {
            let existed = state.delete(&key) == 1;
            if existed {
                encode(log, Kind::Delete, &key, b"");
            }
            Ok(existed)
        })
        .await
    }

    async fn num_keys(&self) -> Result<i64, StoreError> {
        self.run(|state, _| Ok(state.num_keys())).await
    }

    async fn multi_get(&self, keys: &[&str]) -> Result<Vec<Bytes>, StoreError> {
        let keys: Vec<Bytes> = keys.iter().map(|k| bytes(k)).collect();
        self.poll(self.timeout, move |state, _| {
            state
                .multi_get(&keys)
                .map_err(|_| keys.iter().filter(|k| state.get(k).is_none()).cloned().collect())
        })
        .await
    }

    async fn multi_set(&self, pairs: &[(&str, &[u8])]) -> Result<(), StoreError> {
        for (key, value) in pairs {
            check_sizes(key, value, &self.limits)?;
        }
        let pairs: Vec<(Bytes, Bytes)> = pairs
            .iter()
            .map(|(k, v)| (bytes(k), Bytes::copy_from_slice(v)))
            .collect();
        self.run(move |state, log| {
            for (key, value) in pairs {
                encode(log, Kind::Set, &key, &value);
                drop(state.set(key, value));
            }
            Ok(())
        })
        .await
    }

    async fn append(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_sizes(key, value, &self.limits)?;
        let (key, value) = (bytes(key), Bytes::copy_from_slice(value));
        let appended = self
            .run(move |state, log| {
                // An append record, not the whole value: repeated appends
                // would otherwise grow the log quadratically.
                let appended = state.append(key.clone(), &value).map(drop);
                if appended.is_ok() {
                    encode(log, Kind::Append, &key, &value);
                }
                Ok(appended)
            })
            .await?;
        appended.map_err(|e| self.rejected(e))
    }

    async fn queue_push(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_sizes(key, value, &self.limits)?;
        let (key, value) = (bytes(key), Bytes::copy_from_slice(value));
        self.run(move |state, log| {
            encode(log, Kind::QueuePush, &key, &value);
            drop(state.queue_push(key, value));
            Ok(())
        })
        .await
    }

    async fn queue_pop(&self, key: &str, block: bool) -> Result<Option<Bytes>, StoreError> {
        let key = bytes(key);
        if !block {
            return self.run(move |state, log| Ok(pop(state, log, &key))).await;
        }
        self.poll(self.timeout, move |state, log| {
            pop(state, log, &key).map(Some).ok_or_else(|| vec![key.clone()])
        })
        .await
    }

    async fn queue_len(&self, key: &str) -> Result<i64, StoreError> {
        let key = bytes(key);
        self.run(move |state, _| Ok(state.queue_len(&key))).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;

    /// Tells `crashed_member_child` to run its body, and where the store is.
    const CHILD_ENV: &str = "CHORUS_FILE_STORE_CHILD";
    const CHILD_READY: &str = "CHORUS_FILE_STORE_CHILD_READY";

    fn options() -> FileStoreOptions {
        FileStoreOptions {
            timeout: Duration::from_secs(5),
            ..FileStoreOptions::default()
        }
    }

    async fn within<F: Future>(test: F) -> F::Output {
        tokio::time::timeout(Duration::from_secs(30), test)
            .await
            .expect("test did not finish within 30 s")
    }

    fn b(s: &str) -> Bytes {
        Bytes::copy_from_slice(s.as_bytes())
    }

    fn append_raw(path: &Path, raw: &[u8]) {
        let mut file = OpenOptions::new().append(true).open(path).unwrap();
        file.write_all(raw).unwrap();
    }

    fn assert_corrupt<T: std::fmt::Debug>(result: Result<T, StoreError>) {
        match result {
            Err(StoreError::CorruptFile { .. }) => {}
            other => panic!("expected CorruptFile, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn operations_follow_store_semantics() {
        within(async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("store");
            let s = FileStore::open(&path, options()).await.unwrap();
            assert!(s.location().starts_with("file://"));

            s.set("k", b"v").await.unwrap();
            assert_eq!(s.get("k").await.unwrap(), b("v"));

            // compare_set, PyTorch's four cases.
            assert_eq!(s.compare_set("c", b"x", b"y").await.unwrap(), b("x"));
            assert!(!s.check(&["c"]).await.unwrap());
            assert_eq!(s.compare_set("c", b"", b"y").await.unwrap(), b("y"));
            assert_eq!(s.compare_set("c", b"z", b"w").await.unwrap(), b("y"));
            assert_eq!(s.compare_set("c", b"y", b"w").await.unwrap(), b("w"));

            assert_eq!(s.add("n", 5).await.unwrap(), 5);
            assert_eq!(s.add("n", -7).await.unwrap(), -2);
            assert!(matches!(s.add("k", 1).await, Err(StoreError::Rejected { .. })));

            s.append("a", b"ab").await.unwrap();
            s.append("a", b"cd").await.unwrap();
            assert_eq!(s.get("a").await.unwrap(), b("abcd"));

            s.multi_set(&[("m1", b"1"), ("m2", b"2")]).await.unwrap();
            assert_eq!(s.multi_get(&["m1", "m2"]).await.unwrap(), vec![b("1"), b("2")]);
            assert!(s.check(&["m1", "m2"]).await.unwrap());

            s.set("gone", b"x").await.unwrap();
            assert!(s.delete("gone").await.unwrap());
            assert!(!s.delete("gone").await.unwrap());
            // k, c, n, a, m1, m2.
            assert_eq!(s.num_keys().await.unwrap(), 6);

            assert_eq!(s.queue_pop("q", false).await.unwrap(), None);
            s.queue_push("q", b"1").await.unwrap();
            s.queue_push("q", b"2").await.unwrap();
            s.queue_push("q", b"3").await.unwrap();
            assert!(s.check(&["q"]).await.unwrap());
            assert_eq!(s.queue_len("q").await.unwrap(), 3);
            assert_eq!(s.queue_pop("q", false).await.unwrap(), Some(b("1")));
            assert_eq!(s.queue_pop("q", true).await.unwrap(), Some(b("2")));
            assert_eq!(s.num_keys().await.unwrap(), 6, "queues are not keys");

            let long = "x".repeat(Limits::default().max_key + 1);
            assert!(matches!(
                s.set(&long, b"").await,
                Err(StoreError::TooLarge { what: "key", .. })
            ));

            // Another member replays the log to the same contents.
            let r = FileStore::open(&path, options()).await.unwrap();
            for (key, value) in [
                ("k", "v"),
                ("c", "w"),
                ("n", "-2"),
                ("a", "abcd"),
                ("m1", "1"),
                ("m2", "2"),
            ] {
                assert_eq!(r.get(key).await.unwrap(), b(value), "key {key}");
            }
            assert!(!r.check(&["gone"]).await.unwrap());
            assert_eq!(r.num_keys().await.unwrap(), 6);
            assert_eq!(r.queue_len("q").await.unwrap(), 1);
            assert_eq!(r.queue_pop("q", false).await.unwrap(), Some(b("3")));
            assert_eq!(s.queue_len("q").await.unwrap(), 0);
        })
        .await
    }

    #[tokio::test]
    async fn timeouts_name_the_missing_keys_and_the_file() {
        within(async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("store");
            let s = FileStore::open(
                &path,
                FileStoreOptions {
                    timeout: Duration::from_millis(100),
                    ..FileStoreOptions::default()
                },
            )
            .await
            .unwrap();
            s.set("here", b"1").await.unwrap();
            match s.wait_timeout(&["here", "late"], Duration::from_millis(50)).await {
                Err(StoreError::Timeout { keys, location, waited }) => {
                    assert_eq!(keys, vec!["late".to_string()]);
                    assert_eq!(location, format!("file://{}", path.display()));
                    assert!(waited >= Duration::from_millis(50));
                }
                other => panic!("expected a timeout, got {other:?}"),
            }
            assert!(s.get_timeout("late", Duration::ZERO).await.unwrap_err().is_timeout());
            assert!(s.multi_get(&["here", "late"]).await.unwrap_err().is_timeout());
            assert!(s.queue_pop("q", true).await.unwrap_err().is_timeout());
        })
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn members_see_each_others_writes() {
        within(async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("store");
            let a = FileStore::open(&path, options()).await.unwrap();
            let b_store = Arc::new(FileStore::open(&path, options()).await.unwrap());
            a.set("x", b"1").await.unwrap();
            assert_eq!(b_store.get("x").await.unwrap(), b("1"));

            let reader = Arc::clone(&b_store);
            let waiting = tokio::spawn(async move { reader.get_timeout("later", Duration::from_secs(10)).await });
            let popper = Arc::clone(&b_store);
            let popping = tokio::spawn(async move { popper.queue_pop("jobs", true).await });
            tokio::time::sleep(Duration::from_millis(100)).await;
            a.set("later", b"2").await.unwrap();
            a.queue_push("jobs", b"j").await.unwrap();
            assert_eq!(waiting.await.unwrap().unwrap(), b("2"));
            assert_eq!(popping.await.unwrap().unwrap(), Some(b("j")));
            assert_eq!(a.queue_len("jobs").await.unwrap(), 0);
        })
        .await
    }

    #[tokio::test]
    async fn a_live_member_keeps_the_store_and_the_last_out_removes_it() {
        within(async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("store");
            let members = sibling(&path, ".members");
            let a = FileStore::open(&path, options()).await.unwrap();
            a.set("k", b"v").await.unwrap();
            let b_store = FileStore::open(&path, options()).await.unwrap();
            assert_eq!(b_store.get("k").await.unwrap(), b("v"));
            drop(a);
            assert!(path.exists() && members.exists(), "b is still a member");
            let c = FileStore::open(&path, options()).await.unwrap();
            assert_eq!(c.get("k").await.unwrap(), b("v"), "a live member protects the store");
            b_store.close().await.unwrap();
            assert!(path.exists());
            drop(c);
            assert!(
                !path.exists() && !members.exists(),
                "the last member out removes both files"
            );

            // A new run on the same path starts empty.
            let d = FileStore::open(&path, options()).await.unwrap();
            assert_eq!(d.num_keys().await.unwrap(), 0);
            d.close().await.unwrap();
            assert!(!path.exists() && !members.exists());
        })
        .await
    }

    /// Not a test on its own: the body of `a_crashed_run_does_not_poison_the_next`'s
    /// child process, which joins the store, writes, and is then killed.
    #[test]
    fn crashed_member_child() {
        let Some(path) = std::env::var_os(CHILD_ENV) else {
            return;
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let store = FileStore::open(&path, options()).await.unwrap();
            store.set("left", b"behind").await.unwrap();
            println!("{CHILD_READY}");
            // The parent kills us; never leave cleanly even if it does not.
            tokio::time::sleep(Duration::from_secs(60)).await;
            std::mem::forget(store);
        });
        std::process::exit(3);
    }

    #[tokio::test]
    async fn a_crashed_run_does_not_poison_the_next() {
        use tokio::io::AsyncBufReadExt;
        within(async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("store");
            let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "store::file::tests::crashed_member_child", "--nocapture"])
                .env(CHILD_ENV, &path)
                .stdout(std::process::Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .unwrap();
            let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
            loop {
                let line = lines
                    .next_line()
                    .await
                    .unwrap()
                    .expect("the child exited before it was ready");
                if line.contains(CHILD_READY) {
                    break;
                }
            }
            child.kill().await.unwrap(); // SIGKILL: no destructor runs.
            let contents = fs::read(&path).unwrap();
            assert!(
                contents.windows(6).any(|w| w == b"behind"),
                "the crashed run left its data behind"
            );
            assert!(sibling(&path, ".members").exists());

            let s = FileStore::open(&path, options()).await.unwrap();
            assert!(!s.check(&["left"]).await.unwrap(), "the stale key must be gone");
            assert_eq!(s.num_keys().await.unwrap(), 0);
            s.close().await.unwrap();
            assert!(!path.exists());
        })
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_adds_from_members_and_threads_sum() {
        within(async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("store");
            // Keeps the store alive to the end: the last member out removes it.
            let check = FileStore::open(&path, options()).await.unwrap();
            let mut tasks = Vec::new();
            // 4 members, each shared by 2 tasks of 50 adds.
            for _ in 0..4 {
                let member = Arc::new(FileStore::open(&path, options()).await.unwrap());
                for _ in 0..2 {
                    let member = Arc::clone(&member);
                    tasks.push(tokio::spawn(async move {
                        for _ in 0..50 {
                            member.add("sum", 1).await.unwrap();
                        }
                    }));
                }
            }
            // 2 more members, each on its own OS thread and runtime.
            let mut threads = Vec::new();
            for _ in 0..2 {
                let path = path.clone();
                threads.push(tokio::task::spawn_blocking(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    runtime.block_on(async {
                        let member = FileStore::open(&path, options()).await.unwrap();
                        for _ in 0..100 {
                            member.add("sum", 1).await.unwrap();
                        }
                    });
                }));
            }
            for task in tasks {
                task.await.unwrap();
            }
            for thread in threads {
                thread.await.unwrap();
            }
            assert_eq!(check.get("sum").await.unwrap(), b("600"));
        })
        .await
    }

    #[tokio::test]
    async fn compaction_keeps_the_contents_for_every_member() {
        within(async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("store");
            let a = FileStore::open(&path, options()).await.unwrap();
            let r = FileStore::open(&path, options()).await.unwrap();
            a.set("small", b"s").await.unwrap();
            a.queue_push("q", b"1").await.unwrap();
            a.queue_push("q", b"2").await.unwrap();
            // `r` caches a position in the first file.
            assert_eq!(r.get("small").await.unwrap(), b("s"));
            let first = fs::metadata(&path).unwrap().ino();

            let mut last = Vec::new();
            for i in 0..40u8 {
                last = vec![i; 64 * 1024];
                a.set("big", &last).await.unwrap();
            }
            let len = fs::metadata(&path).unwrap().len();
            assert!(
                len < COMPACT_MIN,
                "40 x 64 KiB overwrites must have been compacted, log is {len} bytes"
            );
            assert_ne!(
                fs::metadata(&path).unwrap().ino(),
                first,
                "compaction renames a new file in"
            );
            assert!(!sibling(&path, ".compact").exists());

            assert_eq!(r.get("big").await.unwrap(), Bytes::from(last));
            assert_eq!(r.get("small").await.unwrap(), b("s"));
            assert_eq!(r.queue_pop("q", false).await.unwrap(), Some(b("1")));
            r.set("after", b"yes").await.unwrap();
            assert_eq!(a.get("after").await.unwrap(), b("yes"));
            assert_eq!(a.queue_pop("q", false).await.unwrap(), Some(b("2")));
            assert_eq!(a.num_keys().await.unwrap(), 3);
        })
        .await
    }

    #[tokio::test]
    async fn a_foreign_file_is_refused_not_overwritten() {
        within(async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("store");
            let mut noise = vec![0u8; 4096];
            getrandom::fill(&mut noise).unwrap();
            noise[0] = b'#';
            fs::write(&path, &noise).unwrap();
            assert_corrupt(FileStore::open(&path, options()).await);
            assert_eq!(
                fs::read(&path).unwrap(),
                noise,
                "a file chorus did not write must stay as it was"
            );
        })
        .await
    }

    #[tokio::test]
    async fn garbage_under_a_live_member_is_corrupt_not_a_panic() {
        within(async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("store");
            let a = FileStore::open(&path, options()).await.unwrap();
            a.set("k", b"v").await.unwrap();
            append_raw(&path, b"\xffgarbage");
            assert_corrupt(a.get("k").await);
            assert_corrupt(a.set("k", b"w").await);
            assert_corrupt(FileStore::open(&path, options()).await);
        })
        .await
    }

    #[tokio::test]
    async fn huge_lengths_are_corrupt_not_allocated() {
        within(async {
            let dir = tempfile::tempdir().unwrap();
            for (key_len, value_len) in [(u32::MAX, 0u64), (1, u64::MAX), (1, 64 * 1024 * 1024 + 1)] {
                let path = dir.path().join(format!("store-{key_len}-{value_len}"));
                let a = FileStore::open(&path, options()).await.unwrap();
                let mut raw = vec![Kind::Set as u8];
                raw.extend_from_slice(&key_len.to_le_bytes());
                if key_len == 1 {
                    raw.push(b'k');
                    raw.extend_from_slice(&value_len.to_le_bytes());
                }
                raw.extend_from_slice(&[0; 64]);
                append_raw(&path, &raw);
                assert_corrupt(a.num_keys().await);
            }
        })
        .await
    }

    #[tokio::test]
    async fn a_torn_final_record_is_discarded() {
        within(async {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("store");
            let a = FileStore::open(&path, options()).await.unwrap();
            a.set("k", b"v").await.unwrap();
            let intact = fs::metadata(&path).unwrap().len();
            // What a member killed in the middle of its write leaves.
            let mut record = Vec::new();
            encode(&mut record, Kind::Set, b"torn", &[7; 100]);
            append_raw(&path, &record[..40]);

            a.set("x", b"1").await.unwrap();
            let mut expected = Vec::new();
            encode(&mut expected, Kind::Set, b"x", b"1");
            assert_eq!(fs::metadata(&path).unwrap().len(), intact + expected.len() as u64);
            let r = FileStore::open(&path, options()).await.unwrap();
            assert_eq!(r.get("x").await.unwrap(), b("1"));
            assert!(!r.check(&["torn"]).await.unwrap());
            assert_eq!(r.num_keys().await.unwrap(), 2);
        })
        .await
    }

    #[test]
    fn file_store_is_send_sync_debug() {
        fn assert_traits<T: Send + Sync + std::fmt::Debug + Store>() {}
        assert_traits::<FileStore>();
    }
}
