//! The one transport abstraction: a [`Link`] to one peer carries tagged,
//! ordered frames on independent channels.
//!
//! - A frame is a `u64` tag and a raw payload (`Bytes`); tensors are never
//!   serialized, and on the wire a frame is a fixed [`FrameHeader`] then the
//!   payload bytes.
//! - Channels are independent ordered streams: two collectives in flight use
//!   two channels and never see each other's frames; frames of one channel
//!   arrive in the order sent.
//! - Back-pressure is explicit: `send` resolves only once the transport has
//!   room (a bounded queue, a flow-control window), so a fast sender cannot
//!   grow a slow receiver's memory without bound.
//! - A failed send hands the payload back ([`SendError`]), as tokio's do.
//! - A transport that copies every payload anyway (shared memory) may take
//!   a borrowed one straight from the caller's slice, with the same
//!   back-pressure ([`Link::poll_send_copy`]) or only when it has room at
//!   once ([`Link::try_send_copy`]): one copy per byte instead of two. A
//!   caller that produces the payload may write it in the transport's
//!   buffer itself ([`Link::poll_send_with`]).
//!
//! # Cancel safety
//! What happens to a [`Link::send`] or [`Link::recv`] future dropped before
//! it completes (a `select!` branch that lost, a timeout, an aborted
//! collective), per implementation; each method's own section says it
//! again. In short: no link loses or tears a frame. A dropped receive
//! loses nothing; a dropped send sends nothing if it had not begun its
//! frame, and otherwise the whole frame, in the background.
//!
//! | | `send` dropped | `recv` dropped |
//! |---|---|---|
//! | [`local`](crate::local) | nothing sent (the frame is queued in the poll that returns `Ok`) | nothing lost |
//! | [`shm`](crate::shm) | nothing sent while it waits behind another send; once it holds the writer, the frame is sent whole in the background | nothing lost |
//! | [`quic`](crate::quic) | nothing sent before its first byte is written (while it waits behind another send, or for flow-control credit); after that, the frame is sent whole by a spawned task that holds the channel's stream, and later sends wait for it | nothing lost: a frame read part-way stays with its channel, and the next `recv` goes on from it |
//! | [`fault`](crate::fault) | as the link it wraps; dropped during an injected delay, nothing sent (the frame still counts toward `after_frames`) | as the link it wraps |
//!
//! The poll-based sends ([`Link::poll_send_copy`], [`Link::poll_send_with`])
//! and the `try_` forms take nothing unless they return `Ok(true)`: dropping
//! a caller that polled them loses nothing.

use std::fmt;
use std::task::{Context, Poll};

use async_trait::async_trait;
use bytes::{Buf, BufMut, Bytes};
use thiserror::Error;

/// Names an independent, ordered stream of frames between two ranks.
pub type ChannelId = u32;

/// The channel rank heartbeats use (`chorus_actors::heartbeat`). Its frames
/// are driven by time, not by the program, so fault injection does not count
/// them toward `after_frames` triggers (which stay deterministic).
pub const HEARTBEAT_CHANNEL: ChannelId = u32::MAX - 1;

/// One received frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The sender's tag (a collective's step, a sequence number, ...).
    pub tag: u64,
    /// The payload, as sent.
    pub payload: Bytes,
}

/// Which path a link takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// Channels between ranks of one process; payloads move without a copy.
    Local,
    /// The QUIC mesh.
    Quic,
    /// Shared-memory rings between processes of one host.
    Shm,
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportKind::Local => "local",
            TransportKind::Quic => "quic",
            TransportKind::Shm => "shm",
        })
    }
}

/// What a rank tells its peer when it closes a link on purpose (it leaves or
/// aborts): why, and the ranks it takes for failed. The peer then blames
/// those ranks, not the one that closed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CloseNotice {
    /// Why the link closes, e.g. "rank 1 aborted: rank 2 (pid 7) died".
    pub reason: String,
    /// The ranks the closer takes for failed, in the group's numbering.
    pub failed: Vec<usize>,
}

/// Marks an encoded [`CloseNotice`]: 0xC1 never starts UTF-8 text, so a
/// plain-text reason (an older peer, a QUIC stack's own close) is told apart.
const NOTICE_MARKER: u8 = 0xC1;

impl CloseNotice {
    /// Most bytes [`encode`](Self::encode) produces: it fits a QUIC close
    /// frame in one packet and the shared-memory ring header.
    pub const MAX_ENCODED: usize = 1000;

    /// A notice with a reason and no failed ranks.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            failed: Vec::new(),
        }
    }

    /// The wire form: the marker, a `u16` count, that many `u32` ranks, then
    /// the reason as UTF-8; at most [`MAX_ENCODED`](Self::MAX_ENCODED)
    /// bytes (ranks first, the reason cut at a character boundary).
    pub fn encode(&self) -> Vec<u8> {
        let room = (Self::MAX_ENCODED - 3) / 4;
        let failed: Vec<u32> = self
            .failed
            .iter()
            .filter_map(|&r| u32::try_from(r).ok())
            .take(room)
            .collect();
        let mut out = Vec::with_capacity(Self::MAX_ENCODED);
        out.put_u8(NOTICE_MARKER);
        out.put_u16_le(failed.len() as u16);
        for rank in failed {
            out.put_u32_le(rank);
        }
        let mut end = self.reason.len().min(Self::MAX_ENCODED - out.len());
        while !self.reason.is_char_boundary(end) {
            end -= 1;
        }
        out.extend_from_slice(&self.reason.as_bytes()[..end]);
        out
    }

    /// Reads [`encode`](Self::encode)'s form; anything else is a plain
    /// reason with no failed ranks.
    pub fn decode(bytes: &[u8]) -> Self {
        if bytes.len() >= 3 && bytes[0] == NOTICE_MARKER {
            let mut cursor = &bytes[1..];
            let count = usize::from(cursor.get_u16_le());
            if cursor.len() >= count * 4 {
                let failed = (0..count).map(|_| cursor.get_u32_le() as usize).collect();
                return Self {
                    reason: String::from_utf8_lossy(cursor).into_owned(),
                    failed,
                };
            }
        }
        Self::new(String::from_utf8_lossy(bytes))
    }

    /// The error the peer's operations get.
    pub fn into_error(self, peer: usize) -> TransportError {
        TransportError::PeerClosed {
            peer,
            reason: self.reason,
            failed: self.failed,
        }
    }
}

/// Why a link failed. Errors are per link: the rest of the mesh keeps working.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TransportError {
    /// The link was lost: the peer died or dropped the link without closing
    /// it, the connection was reset or timed out, this side closed it, or a
    /// fault cut it.
    #[error("link to rank {peer} is closed: {reason}")]
    Closed {
        /// The peer.
        peer: usize,
        /// Why, as far as this side knows.
        reason: String,
    },
    /// The peer closed the link on purpose ([`Link::close_with`]): it left
    /// or aborted. Not a failure of the peer; `failed` names the ranks it
    /// blamed.
    #[error("rank {peer} closed the link: {reason}")]
    PeerClosed {
        /// The peer.
        peer: usize,
        /// The peer's reason.
        reason: String,
        /// The ranks the peer took for failed.
        failed: Vec<usize>,
    },
    /// The peer sent a frame larger than this side accepts.
    #[error("rank {peer} sent a frame of {len} bytes, over the limit of {limit}; closing the link")]
    FrameTooLarge {
        /// The peer.
        peer: usize,
        /// The announced length.
        len: u64,
        /// The configured limit.
        limit: usize,
    },
    /// The peer broke the framing (a truncated frame, a bad header).
    #[error("rank {peer} broke the framing: {reason}")]
    Protocol {
        /// The peer.
        peer: usize,
        /// What was wrong.
        reason: String,
    },
    /// A connection could not be set up or authenticated.
    #[error("could not connect to rank {peer}: {reason}")]
    Connect {
        /// The peer.
        peer: usize,
        /// What failed.
        reason: String,
    },
}

/// A failed send, handing the payload back to the caller.
#[derive(Debug, Error)]
#[error("{error}")]
pub struct SendError {
    /// Why it failed.
    pub error: TransportError,
    /// The payload that was not sent.
    pub payload: Bytes,
}

/// A connection to one peer.
#[async_trait]
pub trait Link: Send + Sync + fmt::Debug {
    /// The peer's rank.
    fn peer(&self) -> usize;

    /// The path this link takes.
    fn kind(&self) -> TransportKind;

    /// Sends one frame on `channel`, waiting while the transport has no room.
    ///
    /// # Cancel safety
    /// Not cancel safe: a dropped `send` may or may not have sent its frame,
    /// and its payload is not handed back. No implementation here sends
    /// part of a frame and goes on: an in-process link queues the frame in
    /// the poll that returns `Ok`; a shared-memory link, once its send holds
    /// the ring's writer, finishes the frame on a blocking thread, and a
    /// QUIC link, once its send wrote the frame's first byte, finishes it
    /// on a spawned task (either way later sends of the channel wait for
    /// it); before that, both send nothing (the module doc).
    async fn send(&self, channel: ChannelId, tag: u64, payload: Bytes) -> Result<(), SendError>;

    /// Sends a copy of `payload` as one frame now if the transport has room
    /// for it without waiting and nothing else is being written: `Ok(true)`
    /// when sent, `Ok(false)` when the caller must [`send`](Self::send)
    /// instead. Saves the copy into an owned frame where the transport
    /// copies anyway (shared memory), or a task per send where a copy of a
    /// small payload is cheaper (in-process links).
    fn try_send_copy(&self, _channel: ChannelId, _tag: u64, _payload: &[u8]) -> Result<bool, TransportError> {
        Ok(false)
    }

    /// Sends a copy of `payload` as one frame straight from the caller's
    /// slice, waiting for room as [`send`](Self::send) does but without an
    /// owned frame: `Ready(Ok(true))` once sent; `Pending` while the
    /// transport has no room (`cx` is woken when it may have: poll again
    /// with the same frame); `Ready(Ok(false))` when this transport takes
    /// no borrowed payload of this size, so the caller must `send` an owned
    /// frame. Nothing is taken unless it returns `Ready(Ok(true))`, so a
    /// failed, pending or dropped send loses nothing. It is
    /// [`poll_send_with`](Self::poll_send_with) copying `payload`, and where
    /// the transport takes no frame that way, [`try_send_copy`](Self::try_send_copy),
    /// which waits for nothing.
    fn poll_send_copy(
        &self,
        cx: &mut Context<'_>,
        channel: ChannelId,
        tag: u64,
        payload: &[u8],
    ) -> Poll<Result<bool, TransportError>> {
        self.poll_send_copy_by(cx, channel, tag, payload, <[u8]>::copy_from_slice)
    }

    /// [`poll_send_copy`](Self::poll_send_copy) copying with `copy` where
    /// the transport's own buffer is written in place: a caller that knows
    /// the receiver will not find the bytes in cache anyway writes them
    /// with non-temporal stores.
    fn poll_send_copy_by(
        &self,
        cx: &mut Context<'_>,
        channel: ChannelId,
        tag: u64,
        payload: &[u8],
        copy: fn(&mut [u8], &[u8]),
    ) -> Poll<Result<bool, TransportError>> {
        match self.poll_send_with(cx, channel, tag, payload.len(), &mut |frame| copy(frame, payload)) {
            Poll::Ready(Ok(false)) => Poll::Ready(self.try_send_copy(channel, tag, payload)),
            polled => polled,
        }
    }

    /// [`poll_send_copy`](Self::poll_send_copy) for a payload the caller
    /// produces: the transport hands `fill` the `len` bytes of the frame
    /// in its own buffer (a shared-memory ring) to write in place, so a
    /// payload read out of, say, a model's state is written once instead
    /// of staged and copied. `fill` runs only when this returns
    /// `Ready(Ok(true))`, at most once per call. The default takes no
    /// payload this way: `Ready(Ok(false))`, the caller sends an owned frame.
    fn poll_send_with(
        &self,
        _cx: &mut Context<'_>,
        _channel: ChannelId,
        _tag: u64,
        _len: usize,
        _fill: &mut dyn FnMut(&mut [u8]),
    ) -> Poll<Result<bool, TransportError>> {
        Poll::Ready(Ok(false))
    }

    /// Hands `payload` to a peer that reads it in place, in this process:
    /// no copy, and no room waited for (a queued handle costs the transport
    /// no memory of its own; the sender's buffer holds the bytes).
    /// `Ok(true)` once queued; `Ok(false)` where the transport copies or
    /// ships payloads, or acts on them (fault injection), so the caller
    /// must [`send`](Self::send) instead and must not count on the peer
    /// reading its memory.
    fn send_in_place(&self, _channel: ChannelId, _tag: u64, _payload: &Bytes) -> Result<bool, TransportError> {
        Ok(false)
    }

    /// Whether fault injection (`CHORUS_FAULTS`) may change, lose, hold or
    /// cut the frames this side sends on this link (a rule other than a
    /// rank's `kill` or `freeze`, which stop the rank whatever it sends): a
    /// caller that could move bytes beside the link (into another
    /// process's memory directly) must not, so that the faults keep acting
    /// on what travels.
    fn injects_faults(&self) -> bool {
        false
    }

    /// Receives the next frame of `channel`.
    ///
    /// # Cancel safety
    /// Cancel safe. In-process and shared-memory links take a frame from
    /// its channel's queue only in the poll that returns it; a QUIC link
    /// keeps the part of a frame it has read with the channel's stream. So
    /// a `recv` dropped while it waits, or part-way through a frame, loses
    /// nothing: the next `recv` of the channel gets the frame whole.
    async fn recv(&self, channel: ChannelId) -> Result<Frame, TransportError>;

    /// Closes the link on purpose: pending and later operations on both
    /// sides fail, the peer's with [`TransportError::PeerClosed`] carrying
    /// `notice` (where the transport has room for it). Only the first close
    /// or cut of a link counts.
    fn close_with(&self, notice: &CloseNotice);

    /// [`close_with`](Self::close_with) a reason and no failed ranks.
    fn close(&self, reason: &str) {
        self.close_with(&CloseNotice::new(reason));
    }

    /// Ends the link as if it were lost, as a crash would: the peer gets
    /// [`TransportError::Closed`]. What fault injection's cuts and kills do.
    fn cut(&self, reason: &str);
}

/// The fixed header in front of every payload on a byte stream:
/// `u64` tag, `u64` payload length, little-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The frame's tag.
    pub tag: u64,
    /// The payload's length in bytes.
    pub len: u64,
}

impl FrameHeader {
    /// Encoded size.
    pub const SIZE: usize = 16;

    /// The wire form.
    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut out = [0u8; Self::SIZE];
        let mut cursor = &mut out[..];
        cursor.put_u64_le(self.tag);
        cursor.put_u64_le(self.len);
        out
    }

    /// Parses a header, refusing lengths over `max_frame` before anything is
    /// allocated for them.
    pub fn decode(bytes: &[u8; Self::SIZE], peer: usize, max_frame: usize) -> Result<Self, TransportError> {
        let mut cursor = &bytes[..];
        let header = Self {
            tag: cursor.get_u64_le(),
            len: cursor.get_u64_le(),
        };
        if header.len > max_frame as u64 {
            return Err(TransportError::FrameTooLarge {
                peer,
                len: header.len,
                limit: max_frame,
            });
        }
        Ok(header)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    proptest! {
        #[test]
        fn headers_roundtrip_or_refuse(tag in any::<u64>(), len in any::<u64>()) {
            let bytes = FrameHeader { tag, len }.encode();
            match FrameHeader::decode(&bytes, 1, 1 << 20) {
                Ok(h) => prop_assert_eq!(h, FrameHeader { tag, len }),
                Err(TransportError::FrameTooLarge { len: l, .. }) => prop_assert!(l > 1 << 20 && l == len),
                Err(other) => prop_assert!(false, "unexpected {other}"),
            }
        }

        #[test]
        fn close_notices_roundtrip_within_their_bound(
            reason in ".{0,1200}",
            failed in proptest::collection::vec(0usize..1 << 20, 0..400),
        ) {
            let notice = CloseNotice { reason: reason.clone(), failed: failed.clone() };
            let bytes = notice.encode();
            prop_assert!(bytes.len() <= CloseNotice::MAX_ENCODED);
            let back = CloseNotice::decode(&bytes);
            prop_assert!(failed.starts_with(&back.failed));
            prop_assert!(reason.starts_with(&back.reason));
            // Shorter than any cut: nothing was left out.
            if bytes.len() < CloseNotice::MAX_ENCODED - 4 {
                prop_assert_eq!(back, notice);
            }
        }

        #[test]
        fn any_bytes_decode_to_some_notice(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            CloseNotice::decode(&bytes);
        }
    }

    #[tokio::test]
    async fn a_borrowed_send_on_a_link_that_cannot_wait_is_its_try_form() {
        // In-process links keep the default: small payloads are copied in
        // at once, larger ones (or a full channel) ask for an owned frame.
        let mesh = crate::local::local_mesh(2);
        let (tx, rx) = (mesh[0][1].as_ref().unwrap(), mesh[1][0].as_ref().unwrap());
        let borrowed = |payload: Vec<u8>| std::future::poll_fn(move |cx| tx.poll_send_copy(cx, 0, 7, &payload));
        assert_eq!(borrowed(b"small".to_vec()).await, Ok(true));
        assert_eq!(&rx.recv(0).await.unwrap().payload[..], b"small");
        assert_eq!(borrowed(vec![1; 1 << 20]).await, Ok(false));
        tx.close("done");
        assert!(borrowed(b"late".to_vec()).await.is_err(), "a closed link refuses");
    }

    /// Receives `count` frames on `rx`'s channel 0 that `tx` sends one at a
    /// time, each receive a task aborted right after the send: wherever
    /// the abort lands, every frame arrives once, in order (the module
    /// doc's cancel safety). Returns how many receives were cut short.
    pub(crate) async fn receives_cut_short_lose_nothing(tx: &dyn Link, rx: Arc<dyn Link>, count: u64) -> u64 {
        let mut cut = 0;
        let mut got = Vec::new();
        for tag in 0..count {
            let receive = tokio::spawn({
                let rx = rx.clone();
                async move { rx.recv(0).await }
            });
            // Every other receive first waits for its frame.
            if tag % 2 == 1 {
                tokio::task::yield_now().await;
            }
            tx.send(0, tag, Bytes::from(tag.to_le_bytes().to_vec())).await.unwrap();
            receive.abort();
            match receive.await {
                Ok(frame) => got.push(frame.unwrap().tag),
                Err(e) => {
                    assert!(e.is_cancelled(), "{e}");
                    cut += 1;
                    let frame = tokio::time::timeout(std::time::Duration::from_secs(5), rx.recv(0))
                        .await
                        .unwrap_or_else(|_| panic!("frame {tag} was lost with the receive cut short"))
                        .unwrap();
                    got.push(frame.tag);
                }
            }
        }
        assert_eq!(got, (0..count).collect::<Vec<_>>());
        cut
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_local_receive_dropped_loses_nothing_and_a_local_send_dropped_sends_nothing() {
        let (tx, rx) = crate::local::LocalLink::pair_with_depth(0, 1, 2);
        let rx: Arc<dyn Link> = Arc::new(rx);
        let cut = receives_cut_short_lose_nothing(&tx, rx.clone(), 200).await;
        assert!(cut > 0, "no receive was cut short: the test shows nothing");
        // A send waiting for room in a full channel, dropped: nothing sent.
        for tag in 0..2 {
            tx.send(1, tag, Bytes::new()).await.unwrap();
        }
        let waited = tokio::time::timeout(std::time::Duration::from_millis(50), tx.send(1, 9, Bytes::new())).await;
        assert!(waited.is_err(), "a full channel must make the send wait");
        for tag in 0..2 {
            assert_eq!(rx.recv(1).await.unwrap().tag, tag);
        }
        let late = tokio::time::timeout(std::time::Duration::from_millis(50), rx.recv(1)).await;
        assert!(late.is_err(), "the dropped send's frame came: {late:?}");
    }

    #[test]
    fn plain_text_is_a_reason_without_failed_ranks() {
        assert_eq!(CloseNotice::decode(b"gone"), CloseNotice::new("gone"));
        assert_eq!(
            CloseNotice::decode(&[NOTICE_MARKER, 9]),
            CloseNotice::new(String::from_utf8_lossy(&[NOTICE_MARKER, 9]))
        );
    }
}
