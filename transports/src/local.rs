//! In-process links: ranks that are actors (threads, tasks) of one process
//! exchange `Bytes` through bounded queues, so a payload moves without a copy.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::{mpsc, watch};

use crate::link::{ChannelId, CloseNotice, Frame, Link, SendError, TransportError, TransportKind};

/// Frames a channel may hold before `send` waits (back-pressure).
const DEFAULT_DEPTH: usize = 16;

struct Queue {
    tx: mpsc::Sender<Frame>,
    rx: tokio::sync::Mutex<mpsc::Receiver<Frame>>,
}

/// How a pair was closed, and by which rank.
#[derive(Debug, Clone)]
enum Shut {
    /// On purpose ([`Link::close_with`]).
    Notice { by: usize, notice: CloseNotice },
    /// Lost: cut, or dropped without closing.
    Lost { reason: String },
}

/// The state two ranks share: one queue per direction and channel, and
/// whether the pair is closed (and how).
struct Pair {
    queues: Mutex<HashMap<(usize, ChannelId), Arc<Queue>>>,
    closed: watch::Sender<Option<Shut>>,
    depth: usize,
}

impl Pair {
    fn queue(&self, from: usize, channel: ChannelId) -> Arc<Queue> {
        let mut queues = self.queues.lock().unwrap_or_else(|p| p.into_inner());
        queues
            .entry((from, channel))
            .or_insert_with(|| {
                let (tx, rx) = mpsc::channel(self.depth);
                Arc::new(Queue {
                    tx,
                    rx: tokio::sync::Mutex::new(rx),
                })
            })
            .clone()
    }
}

/// One rank's link to another rank of the same process.
pub struct LocalLink {
    me: usize,
    peer: usize,
    pair: Arc<Pair>,
}

impl std::fmt::Debug for LocalLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LocalLink({} -> {})", self.me, self.peer)
    }
}

impl LocalLink {
    /// Two connected ends: `(a's link to b, b's link to a)`.
    pub fn pair(a: usize, b: usize) -> (LocalLink, LocalLink) {
        Self::pair_with_depth(a, b, DEFAULT_DEPTH)
    }

    /// Like [`LocalLink::pair`], with `depth` frames of room per channel.
    pub fn pair_with_depth(a: usize, b: usize, depth: usize) -> (LocalLink, LocalLink) {
        let pair = Arc::new(Pair {
            queues: Mutex::new(HashMap::new()),
            closed: watch::Sender::new(None),
            depth: depth.max(1),
        });
        (
            LocalLink {
                me: a,
                peer: b,
                pair: pair.clone(),
            },
            LocalLink { me: b, peer: a, pair },
        )
    }

    fn closed_error(&self, shut: &Option<Shut>) -> TransportError {
        let reason = match shut {
            Some(Shut::Notice { by, notice }) if *by == self.peer => return notice.clone().into_error(self.peer),
            Some(Shut::Notice { by, notice }) => format!("closed by rank {by}: {}", notice.reason),
            Some(Shut::Lost { reason }) => reason.clone(),
            None => "closed".into(),
        };
        TransportError::Closed {
            peer: self.peer,
            reason,
        }
    }

    fn shut(&self, shut: Shut) {
        self.pair.closed.send_if_modified(|current| {
            if current.is_none() {
                *current = Some(shut);
                true
            } else {
                false
            }
        });
    }
}

/// Links for `world` ranks of one process: `mesh[r][p]` is rank `r`'s link
/// to rank `p` (`None` on the diagonal).
pub fn local_mesh(world: usize) -> Vec<Vec<Option<Arc<dyn Link>>>> {
    let mut pairs: HashMap<(usize, usize), LocalLink> = HashMap::new();
    for a in 0..world {
        for b in a + 1..world {
            let (ab, ba) = LocalLink::pair(a, b);
            pairs.insert((a, b), ab);
            pairs.insert((b, a), ba);
        }
    }
    (0..world)
        .map(|me| {
            (0..world)
                .map(|peer| pairs.remove(&(me, peer)).map(|link| Arc::new(link) as Arc<dyn Link>))
                .collect()
        })
        .collect()
}

#[async_trait]
impl Link for LocalLink {
    fn peer(&self) -> usize {
        self.peer
    }

    fn kind(&self) -> TransportKind {
        TransportKind::Local
    }

    async fn send(&self, channel: ChannelId, tag: u64, payload: Bytes) -> Result<(), SendError> {
        let mut closed = self.pair.closed.subscribe();
        let shut = closed.borrow_and_update().clone();
        if shut.is_some() {
            return Err(SendError {
                error: self.closed_error(&shut),
                payload,
            });
        }
        let queue = self.pair.queue(self.me, channel);
        let permit = tokio::select! {
            permit = queue.tx.reserve() => permit.expect("the pair owns both ends of every queue"),
            _ = closed.changed() => {
                let reason = closed.borrow().clone();
                return Err(SendError { error: self.closed_error(&reason), payload });
            }
        };
        permit.send(Frame { tag, payload });
        Ok(())
    }

    async fn recv(&self, channel: ChannelId) -> Result<Frame, TransportError> {
        let mut closed = self.pair.closed.subscribe();
        let queue = self.pair.queue(self.peer, channel);
        let mut rx = queue.rx.lock().await;
        // Frames sent before a close are still delivered.
        if let Ok(frame) = rx.try_recv() {
            return Ok(frame);
        }
        let shut = closed.borrow_and_update().clone();
        if shut.is_some() {
            return Err(self.closed_error(&shut));
        }
        // A frame sent just before the close wins over the close.
        tokio::select! {
            biased;
            frame = rx.recv() => Ok(frame.expect("the pair owns both ends of every queue")),
            _ = closed.changed() => match rx.try_recv() {
                Ok(frame) => Ok(frame),
                Err(_) => Err(self.closed_error(&closed.borrow().clone())),
            },
        }
    }

    fn close_with(&self, notice: &CloseNotice) {
        self.shut(Shut::Notice {
            by: self.me,
            notice: notice.clone(),
        });
    }

    fn cut(&self, reason: &str) {
        self.shut(Shut::Lost {
            reason: format!("cut by rank {}: {reason}", self.me),
        });
    }
}

impl Drop for LocalLink {
    // A rank that goes away without closing (a task that panicked, a rank
    // dropped mid-operation) is lost, not leaving.
    fn drop(&mut self) {
        self.shut(Shut::Lost {
            reason: format!("rank {} dropped the link without closing it", self.me),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn within<T>(fut: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(10), fut)
            .await
            .expect("local link test hung")
    }

    #[tokio::test]
    async fn frames_move_without_a_copy_and_channels_stay_apart() {
        within(async {
            let (a, b) = LocalLink::pair(0, 1);
            let payload = Bytes::from(vec![7u8; 1 << 20]);
            let address = payload.as_ptr();
            a.send(2, 11, Bytes::from_static(b"other channel")).await.unwrap();
            a.send(1, 10, payload).await.unwrap();
            let frame = b.recv(1).await.unwrap();
            assert_eq!(frame.tag, 10);
            assert_eq!(frame.payload.as_ptr(), address, "the payload must not be copied");
            assert_eq!(b.recv(2).await.unwrap().payload, Bytes::from_static(b"other channel"));
        })
        .await;
    }

    #[tokio::test]
    async fn a_full_channel_makes_the_sender_wait() {
        within(async {
            let (a, b) = LocalLink::pair_with_depth(0, 1, 2);
            a.send(0, 0, Bytes::new()).await.unwrap();
            a.send(0, 1, Bytes::new()).await.unwrap();
            let third = tokio::time::timeout(Duration::from_millis(50), a.send(0, 2, Bytes::new())).await;
            assert!(third.is_err(), "the third send must wait for room");
            assert_eq!(b.recv(0).await.unwrap().tag, 0);
            a.send(0, 2, Bytes::new()).await.unwrap();
            assert_eq!(b.recv(0).await.unwrap().tag, 1);
            assert_eq!(b.recv(0).await.unwrap().tag, 2);
        })
        .await;
    }

    #[tokio::test]
    async fn close_wakes_the_peer_and_hands_payloads_back() {
        within(async {
            let (a, b) = LocalLink::pair(3, 5);
            let waiting = tokio::spawn(async move { (b.recv(0).await, b) });
            tokio::time::sleep(Duration::from_millis(20)).await;
            a.close("test");
            let (result, b) = waiting.await.unwrap();
            assert_eq!(
                result,
                Err(TransportError::PeerClosed {
                    peer: 3,
                    reason: "test".into(),
                    failed: Vec::new()
                })
            );
            let err = b.send(0, 0, Bytes::from_static(b"kept")).await.unwrap_err();
            assert_eq!(err.payload, Bytes::from_static(b"kept"));
            assert!(
                matches!(a.recv(0).await, Err(TransportError::Closed { peer: 5, .. })),
                "the closing side's own link is closed, not closed by its peer"
            );
        })
        .await;
    }

    #[tokio::test]
    async fn a_close_carries_its_notice_and_a_cut_or_a_drop_is_a_lost_link() {
        within(async {
            let (a, b) = LocalLink::pair(1, 2);
            let notice = CloseNotice {
                reason: "rank 1 aborted: rank 0 (pid 7) died".into(),
                failed: vec![0],
            };
            a.close_with(&notice);
            a.cut("too late: the first close counts");
            assert_eq!(b.recv(0).await, Err(notice.into_error(1)));
            let (a, b) = LocalLink::pair(1, 2);
            a.cut("fault injection");
            assert!(matches!(b.recv(0).await, Err(TransportError::Closed { peer: 1, .. })));
            let (a, b) = LocalLink::pair(1, 2);
            drop(a);
            assert!(matches!(b.recv(0).await, Err(TransportError::Closed { peer: 1, .. })));
        })
        .await;
    }

    #[tokio::test]
    async fn a_mesh_connects_every_pair() {
        within(async {
            let mesh = local_mesh(4);
            for (a, row) in mesh.iter().enumerate() {
                for (b, link) in row.iter().enumerate() {
                    if let Some(link) = link {
                        link.send(0, (a * 10 + b) as u64, Bytes::new()).await.unwrap();
                    }
                }
            }
            for (b, row) in mesh.iter().enumerate() {
                for (a, link) in row.iter().enumerate() {
                    if let Some(link) = link {
                        assert_eq!(link.recv(0).await.unwrap().tag, (a * 10 + b) as u64);
                    }
                }
            }
        })
        .await;
    }
}
