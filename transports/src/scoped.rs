//! [`ScopedLink`]: a view of a link for a subgroup. The subgroup's frames
//! travel on the parent's connection, on channels shifted past the
//! parent's, so the two groups' collectives never see each other's frames;
//! the peer is named by its rank in the subgroup.

use std::sync::Arc;
use std::task::{Context, Poll};

use async_trait::async_trait;
use bytes::Bytes;

use crate::link::{ChannelId, CloseNotice, Frame, Link, SendError, TransportError, TransportKind};

/// A link whose channels are offset by a base.
#[derive(Debug)]
pub struct ScopedLink {
    inner: Arc<dyn Link>,
    base: ChannelId,
    peer: usize,
}

impl ScopedLink {
    /// `inner`'s channels `base..` as this link's `0..`, with the peer known
    /// as rank `peer`.
    pub fn new(inner: Arc<dyn Link>, base: ChannelId, peer: usize) -> Self {
        Self { inner, base, peer }
    }

    fn channel(&self, channel: ChannelId) -> ChannelId {
        self.base.wrapping_add(channel)
    }

    fn renamed(&self, error: TransportError) -> TransportError {
        match error {
            TransportError::Closed { reason, .. } => TransportError::Closed {
                peer: self.peer,
                reason,
            },
            // The failed ranks are the parent's numbers, which mean nothing
            // here: the subgroup learns of its failures itself.
            TransportError::PeerClosed { reason, .. } => TransportError::PeerClosed {
                peer: self.peer,
                reason,
                failed: Vec::new(),
            },
            TransportError::FrameTooLarge { len, limit, .. } => TransportError::FrameTooLarge {
                peer: self.peer,
                len,
                limit,
            },
            TransportError::Protocol { reason, .. } => TransportError::Protocol {
                peer: self.peer,
                reason,
            },
            TransportError::Connect { reason, .. } => TransportError::Connect {
                peer: self.peer,
                reason,
            },
        }
    }
}

#[async_trait]
impl Link for ScopedLink {
    fn peer(&self) -> usize {
        self.peer
    }

    fn kind(&self) -> TransportKind {
        self.inner.kind()
    }

    async fn send(&self, channel: ChannelId, tag: u64, payload: Bytes) -> Result<(), SendError> {
        self.inner
            .send(self.channel(channel), tag, payload)
            .await
            .map_err(|e| SendError {
                error: self.renamed(e.error),
                payload: e.payload,
            })
    }

    fn try_send_copy(&self, channel: ChannelId, tag: u64, payload: &[u8]) -> Result<bool, TransportError> {
        self.inner
            .try_send_copy(self.channel(channel), tag, payload)
            .map_err(|e| self.renamed(e))
    }

    fn poll_send_with(
        &self,
        cx: &mut Context<'_>,
        channel: ChannelId,
        tag: u64,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Poll<Result<bool, TransportError>> {
        self.inner
            .poll_send_with(cx, self.channel(channel), tag, len, fill)
            .map_err(|e| self.renamed(e))
    }

    fn send_in_place(&self, channel: ChannelId, tag: u64, payload: &Bytes) -> Result<bool, TransportError> {
        self.inner
            .send_in_place(self.channel(channel), tag, payload)
            .map_err(|e| self.renamed(e))
    }

    fn injects_faults(&self) -> bool {
        self.inner.injects_faults()
    }

    async fn recv(&self, channel: ChannelId) -> Result<Frame, TransportError> {
        self.inner
            .recv(self.channel(channel))
            .await
            .map_err(|e| self.renamed(e))
    }

    /// Closing a subgroup's view closes the shared connection: a failure in
    /// either group breaks the link for both. The failed ranks stay behind:
    /// they are subgroup numbers, which the parent's peer would misread.
    fn close_with(&self, notice: &CloseNotice) {
        self.inner.close_with(&CloseNotice::new(notice.reason.clone()));
    }

    fn cut(&self, reason: &str) {
        self.inner.cut(reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::local::LocalLink;

    #[tokio::test]
    async fn scoped_channels_do_not_meet_the_parents() {
        let (a, b) = LocalLink::pair(3, 7);
        let (a, b): (Arc<dyn Link>, Arc<dyn Link>) = (Arc::new(a), Arc::new(b));
        let (sub_a, sub_b) = (
            ScopedLink::new(a.clone(), 1 << 16, 1),
            ScopedLink::new(b.clone(), 1 << 16, 0),
        );
        sub_a.send(0, 1, Bytes::from_static(b"sub")).await.unwrap();
        a.send(0, 2, Bytes::from_static(b"parent")).await.unwrap();
        let parent = tokio::time::timeout(std::time::Duration::from_secs(5), b.recv(0))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(parent.tag, 2, "the parent's channel 0 holds only the parent's frame");
        assert_eq!(sub_b.recv(0).await.unwrap().tag, 1);
        assert_eq!(sub_b.peer(), 0);
        sub_a.close_with(&CloseNotice {
            reason: "test".into(),
            failed: vec![1],
        });
        assert_eq!(
            sub_b.recv(0).await,
            Err(TransportError::PeerClosed {
                peer: 0,
                reason: "test".into(),
                failed: Vec::new()
            })
        );
    }
}
