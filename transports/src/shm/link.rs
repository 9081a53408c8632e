//! [`ShmLink`] over two mapped rings: the writer (SHM-4, SHM-5, SHM-10), reading
//! records into per-channel queues (SHM-6), receives that poll then wait,
//! the watcher thread (SHM-7, SHM-9), closing (SHM-8).

use std::collections::{HashMap, VecDeque};
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use tokio::sync::{Notify, watch};

use super::mapped::{NoticeArea, Ring, alive, futex_wait, futex_wake};
use super::ring::{self, Place, RECORD_FIELDS, RECORD_HEADER, ReadCursor, Record, RecordError, RecordHeader};
use super::{ShmOptions, protocol_error};
use crate::link::{ChannelId, CloseNotice, Frame, HEARTBEAT_CHANNEL, Link, SendError, TransportError, TransportKind};

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
/// costs no wake-ups (a wake-up costs 10-25 us here, bench/HISTORY.md §18).
const RECEIVE_SPIN: Duration = Duration::from_micros(50);
/// How long the writer may wait for room behind frames read but not
/// received before they are copied out of the ring (SHM-9): long enough
/// that a receive about to take them usually does, since the copy is then
/// wasted.
const UNRECEIVED_GRACE: Duration = Duration::from_millis(20);

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
        // (SHM-4).
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

/// Reading the inbound ring: the cursor over its records, the frame being
/// reassembled from pieces, a frame waiting for room in its queue.
struct ReadState {
    cursor: ReadCursor,
    pool: BytesMut,
    stalled: Option<(ChannelId, Frame)>,
    /// A bad record failed the link: nothing after it is read.
    broken: bool,
}

/// Bytes the record of a `len`-byte payload takes in the ring.
#[inline]
fn record_size(len: usize) -> u64 {
    ring::record_size(len as u64).expect("a slice's length is far below u64::MAX")
}

/// What a link's handle and its watcher thread share.
pub(super) struct Shared {
    me: usize,
    peer: usize,
    pub(super) outbound: Arc<Ring>,
    pub(super) inbound: Arc<Ring>,
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
    liveness_interval: Duration,
    /// Why the link failed, once it has.
    closed: watch::Sender<Option<TransportError>>,
    /// Whether the peer was told (SHM-8): only the first close counts.
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

    /// Fails the link (the first error wins) and tells the peer (SHM-8),
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
    /// an empty ring is first skipped to its start (SHM-10), which needs
    /// the writer's lock as a write does.
    fn room(&self, size: u64) -> Result<Option<u64>, TransportError> {
        if let Some(error) = self.write_blocker() {
            return Err(error);
        }
        let header = self.outbound.header();
        let head = header.writer.head.load(Ordering::Relaxed);
        let tail = header.reader.tail.load(Ordering::Acquire);
        Ok(match ring::place(head, tail, self.outbound.capacity, size) {
            Place::At(at) => Some(at),
            Place::Restart { at } => {
                self.skip_to(head, at);
                Some(at)
            }
            Place::Full => None,
        })
    }

    /// Publishes a skip record from `head` to `to` (SHM-10).
    fn skip_to(&self, head: u64, to: u64) {
        let record = RecordHeader::skip(head, to).encode();
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

    /// Copies one record to `head` and publishes it (SHM-4).
    pub(super) fn put(&self, head: u64, channel: ChannelId, tag: u64, total: u64, piece: &[u8]) {
        self.put_with(head, channel, tag, total, piece.len(), &mut |payload| {
            payload.copy_from_slice(piece)
        });
    }

    /// Writes one record of `len` payload bytes to `head`, the payload by
    /// `fill` in place, and publishes it (SHM-4).
    fn put_with(
        &self,
        head: u64,
        channel: ChannelId,
        tag: u64,
        total: u64,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) {
        let record = RecordHeader {
            channel,
            kind: ring::DATA,
            tag,
            len: len as u64,
            total,
        }
        .encode();
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
    /// otherwise pieces of a quarter ring (SHM-5).
    fn write(&self, channel: ChannelId, tag: u64, payload: &[u8]) -> Result<(), TransportError> {
        let total = payload.len() as u64;
        let capacity = self.outbound.capacity as usize;
        if record_size(payload.len()) <= capacity as u64 {
            let head = self.wait_room(record_size(payload.len()))?;
            self.put(head, channel, tag, total, payload);
            return Ok(());
        }
        for piece in payload.chunks(ring::piece_len(capacity as u64)) {
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

    /// Reads every published record into the channel queues (SHM-6), on
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

    /// Reads records in order from `state.cursor`, validated there, and files
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
            let head = ring.header().writer.head.load(Ordering::Acquire);
            let fields = |pos| {
                let mut fields = [0u8; RECORD_FIELDS];
                // SAFETY: the cursor asks only for a published record
                // header (`pos + 64 <= head`), contiguous in the double
                // mapping; the writer does not touch it until `tail` passes it.
                unsafe { std::ptr::copy_nonoverlapping(ring.at(pos), fields.as_mut_ptr(), fields.len()) };
                fields
            };
            let record = state.cursor.next(head, fields).map_err(|e| self.record_error(e))?;
            let (channel, frame) = match record {
                None => return Ok(()),
                Some(Record::Skip { start, end }) => {
                    ring.release(start, end);
                    self.read_pos.store(end, Ordering::SeqCst);
                    continue;
                }
                Some(Record::Frame {
                    channel,
                    tag,
                    start,
                    end,
                    len,
                }) => {
                    let payload = if len == 0 {
                        ring.release(start, end);
                        Bytes::new()
                    } else {
                        Bytes::from_owner(RingSlice {
                            ring: ring.clone(),
                            start,
                            end,
                            len,
                        })
                    };
                    (channel, Some(Frame { tag, payload }))
                }
                Some(Record::Piece {
                    channel,
                    tag,
                    total,
                    start,
                    end,
                    len,
                    filled,
                }) => {
                    if filled == 0 {
                        // Reclaims the pool once earlier frames are dropped.
                        state.pool.reserve(total as usize);
                    }
                    // SAFETY: as for the record header: `start + 64 .. + len`
                    // is published, contiguous and not written by the peer.
                    let piece = unsafe { std::slice::from_raw_parts(ring.at(start).add(RECORD_HEADER), len) };
                    state.pool.extend_from_slice(piece);
                    ring.release(start, end);
                    let whole = filled + len as u64 == total;
                    (
                        channel,
                        whole.then(|| Frame {
                            tag,
                            payload: state.pool.split().freeze(),
                        }),
                    )
                }
            };
            self.read_pos.store(state.cursor.pos(), Ordering::SeqCst);
            if let Some(frame) = frame
                && let Err(frame) = self.file(channel, frame)
            {
                state.stalled = Some((channel, frame));
                self.stalled.store(true, Ordering::SeqCst);
                return Ok(());
            }
        }
    }

    /// The link's error for records the peer broke.
    fn record_error(&self, error: RecordError) -> TransportError {
        match error {
            RecordError::TooLarge { len, limit } => TransportError::FrameTooLarge {
                peer: self.peer,
                len,
                limit,
            },
            other => protocol_error(self.peer, other),
        }
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

    /// SHM-9: once the writer has waited for room for
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
    /// releases its record (SHM-9).
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
    pub(super) shared: Arc<Shared>,
}

impl std::fmt::Debug for ShmLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShmLink({} -> {})", self.shared.me, self.peer)
    }
}

impl ShmLink {
    pub(super) fn new(me: usize, peer: usize, outbound: Arc<Ring>, inbound: Arc<Ring>, options: &ShmOptions) -> Self {
        let cursor = ReadCursor::new(inbound.capacity, options.max_frame);
        let shared = Arc::new(Shared {
            me,
            peer,
            outbound,
            inbound,
            queues: Mutex::new(HashMap::new()),
            depth: options.depth,
            reading: Mutex::new(ReadState {
                cursor,
                pool: BytesMut::new(),
                stalled: None,
                broken: false,
            }),
            read_pos: AtomicU64::new(0),
            stalled: AtomicBool::new(false),
            pump_wanted: AtomicBool::new(false),
            awaited: Mutex::default(),
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
        // an owned payload outlives a dropped send for (SHM-5).
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
