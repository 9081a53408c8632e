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

use std::fmt;

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

/// Why a link failed. Errors are per link: the rest of the mesh keeps working.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum TransportError {
    /// The link was closed, by either side or by a fault.
    #[error("link to rank {peer} is closed: {reason}")]
    Closed {
        /// The peer.
        peer: usize,
        /// Why, as far as this side knows.
        reason: String,
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
    async fn send(&self, channel: ChannelId, tag: u64, payload: Bytes) -> Result<(), SendError>;

    /// Receives the next frame of `channel`.
    async fn recv(&self, channel: ChannelId) -> Result<Frame, TransportError>;

    /// Closes the link; pending and later operations on both sides fail.
    fn close(&self, reason: &str);
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
mod tests {
    use super::*;
    use proptest::prelude::*;

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
    }
}
