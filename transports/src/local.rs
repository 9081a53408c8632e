//! In-process links: ranks that are actors of one process exchange `Bytes`
//! through bounded queues, so a payload moves without a copy; a view of the
//! sender's buffer ([`Link::send_in_place`]) is queued whatever the room,
//! as it holds no memory of its own.
//!
//! Built to scale to thousands of ranks in one process ([`LocalMesh`]): the
//! state two ranks share (a pair) is made when either first uses their
//! link, so memory follows the pairs an algorithm touches, not the n^2 of a
//! full mesh; a pair has one queue per direction, its frames tagged with
//! their channel; and
//! instead of heartbeats (n^2 tasks, and a rank of this process cannot
//! fall silent on its own) each rank's [`LocalWatch`] is told when a link
//! of it closes.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::Notify;

use crate::link::{ChannelId, CloseNotice, Frame, Link, SendError, TransportError, TransportKind};

/// Frames a channel may hold before `send` waits (back-pressure).
const DEFAULT_DEPTH: usize = 16;

/// Largest payload [`Link::try_send_copy`] copies; larger ones go by
/// `send`, which moves the sender's frame without a copy.
const SMALL_COPY: usize = 16 << 10;

/// How a pair was closed, and by which rank.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Shut {
    /// On purpose ([`Link::close_with`]).
    Notice { by: usize, notice: CloseNotice },
    /// Lost: cut, or dropped without closing.
    Lost { reason: String },
}

impl Shut {
    /// The error a rank sees on its link to `peer` once the pair is shut.
    fn error(&self, peer: usize) -> TransportError {
        let reason = match self {
            Shut::Notice { by, notice } if *by == peer => return notice.clone().into_error(peer),
            Shut::Notice { by, notice } => format!("closed by rank {by}: {}", notice.reason),
            Shut::Lost { reason } => reason.clone(),
        };
        TransportError::Closed { peer, reason }
    }
}

#[derive(Default)]
struct PairState {
    /// Queued frames by sender (0: the lower rank), with their channels, in
    /// the order sent: one queue per direction (a pair rarely holds frames
    /// of more than one channel at once), so queuing a frame neither hashes
    /// nor allocates once the queue has grown.
    queues: [VecDeque<(ChannelId, Frame)>; 2],
    shut: Option<Shut>,
}

impl PairState {
    /// Frames `side` has queued on `channel`.
    fn queued(&self, side: usize, channel: ChannelId) -> usize {
        self.queues[side].iter().filter(|(c, _)| *c == channel).count()
    }
}

/// The state two ranks share. A change to one direction's frames (one
/// queued or taken) wakes that direction's waiters, the close both; they
/// look again (a direction has few).
struct Pair {
    low: usize,
    state: Mutex<PairState>,
    changed: [Notify; 2],
    depth: usize,
}

impl Pair {
    fn new(low: usize, depth: usize, shut: Option<Shut>) -> Self {
        Self {
            low,
            state: Mutex::new(PairState {
                shut,
                ..PairState::default()
            }),
            changed: [Notify::new(), Notify::new()],
            depth: depth.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PairState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn side(&self, from: usize) -> usize {
        usize::from(from != self.low)
    }

    /// Shuts the pair unless it was; returns whether this call did.
    fn shut(&self, shut: Shut) -> bool {
        let first = {
            let mut state = self.lock();
            if state.shut.is_some() {
                false
            } else {
                state.shut = Some(shut);
                true
            }
        };
        if first {
            self.changed.iter().for_each(Notify::notify_waiters);
        }
        first
    }
}

/// What one rank of a [`LocalMesh`] has: its watcher's inbox, and the
/// closes of its links made before their pair existed.
#[derive(Default)]
struct RankState {
    /// Closed links `(peer, error)` not yet taken by the rank's watcher.
    events: Mutex<Vec<(usize, TransportError)>>,
    notify: Notify,
    /// Whether a [`LocalWatch`] takes the events (none are kept otherwise).
    watching: AtomicBool,
    /// The rank left cleanly ([`LocalMesh::leave`]).
    left: AtomicBool,
    /// Every link of the rank was dropped.
    dropped: AtomicBool,
    /// Closes of links whose pair did not exist yet: each shut once, with
    /// the peers it applies to (a rank's abort closes all its links alike).
    early: Mutex<Vec<(Shut, HashSet<usize>)>>,
}

/// The links of `world` ranks of one process, made when first used.
pub struct LocalMesh {
    world: usize,
    depth: usize,
    /// Pairs by their lower rank, then their higher.
    pairs: Vec<Mutex<HashMap<usize, Arc<Pair>>>>,
    ranks: Vec<RankState>,
}

impl std::fmt::Debug for LocalMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LocalMesh({} ranks)", self.world)
    }
}

impl LocalMesh {
    /// A mesh for `world` ranks; nothing per pair is made yet.
    pub fn new(world: usize) -> Arc<Self> {
        Self::with_depth(world, DEFAULT_DEPTH)
    }

    /// Like [`LocalMesh::new`], with `depth` frames of room per channel.
    pub fn with_depth(world: usize, depth: usize) -> Arc<Self> {
        Arc::new(Self {
            world,
            depth,
            pairs: (0..world).map(|_| Mutex::new(HashMap::new())).collect(),
            ranks: (0..world).map(|_| RankState::default()).collect(),
        })
    }

    /// How many ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Rank `me`'s links, indexed by rank (`None` for itself). When every
    /// one of them is dropped without closing, the rank is lost to its peers.
    pub fn links(self: &Arc<Self>, me: usize) -> Vec<Option<Arc<dyn Link>>> {
        let owner = Arc::new(RankLinks { me, mesh: self.clone() });
        (0..self.world)
            .map(|peer| {
                (peer != me).then(|| {
                    Arc::new(LocalLink {
                        me,
                        peer,
                        owner: owner.clone(),
                        pair: OnceLock::new(),
                    }) as Arc<dyn Link>
                })
            })
            .collect()
    }

    /// Rank `me`'s watcher: it is told of every link of `me` that closes
    /// from now on.
    pub fn watch(self: &Arc<Self>, me: usize) -> LocalWatch {
        self.ranks[me].watching.store(true, Ordering::SeqCst);
        LocalWatch { me, mesh: self.clone() }
    }

    /// Rank `me` leaves cleanly: its links closing from now on are not a
    /// failure for its peers' watchers (heartbeats' goodbye, SV-8).
    pub fn leave(&self, me: usize) {
        self.ranks[me].left.store(true, Ordering::SeqCst);
    }

    fn existing(&self, a: usize, b: usize) -> Option<Arc<Pair>> {
        let (low, high) = (a.min(b), a.max(b));
        self.pairs[low]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&high)
            .cloned()
    }

    /// The pair of `a` and `b`, made now if it was not, shut already when
    /// either side closed or dropped its link before.
    fn pair(&self, a: usize, b: usize) -> Arc<Pair> {
        let (low, high) = (a.min(b), a.max(b));
        let mut pairs = self.pairs[low].lock().unwrap_or_else(|p| p.into_inner());
        pairs
            .entry(high)
            .or_insert_with(|| Arc::new(Pair::new(low, self.depth, self.early_shut(low, high))))
            .clone()
    }

    fn early_shut(&self, a: usize, b: usize) -> Option<Shut> {
        for (me, peer) in [(a, b), (b, a)] {
            let early = self.ranks[me].early.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((shut, _)) = early.iter().find(|(_, peers)| peers.contains(&peer)) {
                return Some(shut.clone());
            }
            if self.ranks[me].dropped.load(Ordering::SeqCst) {
                return Some(dropped(me));
            }
        }
        None
    }

    /// `by` shut its link to `peer`: the pair (made or not) and both ranks'
    /// watchers learn it.
    fn shut(&self, by: usize, peer: usize, shut: Shut) {
        let first = match self.existing(by, peer) {
            Some(pair) => pair.shut(shut.clone()),
            None => {
                let mut early = self.ranks[by].early.lock().unwrap_or_else(|p| p.into_inner());
                if early.iter().any(|(_, peers)| peers.contains(&peer)) {
                    false
                } else {
                    match early.iter_mut().find(|(s, _)| *s == shut) {
                        Some((_, peers)) => {
                            peers.insert(peer);
                        }
                        None => early.push((shut.clone(), HashSet::from([peer]))),
                    }
                    true
                }
            }
        };
        if first {
            self.tell(peer, by, shut.error(by));
            self.tell(by, peer, shut.error(peer));
        }
    }

    /// Tells `me`'s watcher, if it has one, that its link to `peer` failed.
    fn tell(&self, me: usize, peer: usize, error: TransportError) {
        let rank = &self.ranks[me];
        if rank.watching.load(Ordering::SeqCst) {
            rank.events
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((peer, error));
            rank.notify.notify_one();
        }
    }
}

fn dropped(me: usize) -> Shut {
    Shut::Lost {
        reason: format!("rank {me} dropped the link without closing it"),
    }
}

/// One rank's closed links, as they happen ([`LocalMesh::watch`]).
pub struct LocalWatch {
    me: usize,
    mesh: Arc<LocalMesh>,
}

impl std::fmt::Debug for LocalWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LocalWatch(rank {})", self.me)
    }
}

impl LocalWatch {
    /// Waits for links to close; returns each `(peer, error)`.
    pub async fn next(&self) -> Vec<(usize, TransportError)> {
        let rank = &self.mesh.ranks[self.me];
        loop {
            let events = std::mem::take(&mut *rank.events.lock().unwrap_or_else(|p| p.into_inner()));
            if !events.is_empty() {
                return events;
            }
            rank.notify.notified().await;
        }
    }

    /// Whether `peer` left cleanly ([`LocalMesh::leave`]).
    pub fn has_left(&self, peer: usize) -> bool {
        self.mesh.ranks.get(peer).is_some_and(|r| r.left.load(Ordering::SeqCst))
    }
}

impl Drop for LocalWatch {
    fn drop(&mut self) {
        let rank = &self.mesh.ranks[self.me];
        rank.watching.store(false, Ordering::SeqCst);
        rank.events.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// Shared by all of one rank's links: when the last goes, the rank is lost
/// to the peers it had no pair with yet, and their watchers learn it.
struct RankLinks {
    me: usize,
    mesh: Arc<LocalMesh>,
}

impl Drop for RankLinks {
    fn drop(&mut self) {
        let mesh = &self.mesh;
        mesh.ranks[self.me].dropped.store(true, Ordering::SeqCst);
        for peer in (0..mesh.world).filter(|&p| p != self.me) {
            if mesh.ranks[peer].watching.load(Ordering::SeqCst) {
                mesh.tell(peer, self.me, dropped(self.me).error(self.me));
            }
        }
    }
}

/// One rank's link to another rank of the same process.
pub struct LocalLink {
    me: usize,
    peer: usize,
    owner: Arc<RankLinks>,
    /// The pair, once this link used it.
    pair: OnceLock<Arc<Pair>>,
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
        let mesh = LocalMesh::with_depth(a.max(b) + 1, depth);
        let end = |me: usize, peer: usize| LocalLink {
            me,
            peer,
            owner: Arc::new(RankLinks { me, mesh: mesh.clone() }),
            pair: OnceLock::from(mesh.pair(me, peer)),
        };
        (end(a, b), end(b, a))
    }

    fn pair_state(&self) -> &Arc<Pair> {
        self.pair.get_or_init(|| self.owner.mesh.pair(self.me, self.peer))
    }
}

impl LocalLink {
    /// The next frame of `channel` queued by the peer (frames sent before a
    /// close are still delivered), the close once none is left, or nothing.
    fn take(&self, pair: &Pair, side: usize, channel: ChannelId) -> Option<Result<Frame, TransportError>> {
        let mut state = pair.lock();
        if let Some(at) = state.queues[side].iter().position(|(c, _)| *c == channel) {
            let (_, frame) = state.queues[side].remove(at).expect("found");
            // A sender waits for room only on a channel that was full.
            let was_full = state.queues[side].len() + 1 >= pair.depth && state.queued(side, channel) + 1 == pair.depth;
            drop(state);
            if was_full {
                pair.changed[side].notify_waiters();
            }
            return Some(Ok(frame));
        }
        state.shut.as_ref().map(|shut| Err(shut.error(self.peer)))
    }
}

/// Links for `world` ranks of one process: `mesh[r][p]` is rank `r`'s link
/// to rank `p` (`None` on the diagonal).
pub fn local_mesh(world: usize) -> Vec<Vec<Option<Arc<dyn Link>>>> {
    let mesh = LocalMesh::new(world);
    (0..world).map(|me| mesh.links(me)).collect()
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
        let pair = self.pair_state();
        let side = pair.side(self.me);
        loop {
            let changed = pair.changed[side].notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut state = pair.lock();
                if let Some(shut) = &state.shut {
                    return Err(SendError {
                        error: shut.error(self.peer),
                        payload,
                    });
                }
                if state.queued(side, channel) < pair.depth {
                    state.queues[side].push_back((channel, Frame { tag, payload }));
                    drop(state);
                    pair.changed[side].notify_waiters();
                    return Ok(());
                }
            }
            changed.await;
        }
    }

    /// Small payloads are copied into a frame right here when the channel
    /// has room: cheaper than a task waiting on a send that would not wait.
    fn try_send_copy(&self, channel: ChannelId, tag: u64, payload: &[u8]) -> Result<bool, TransportError> {
        if payload.len() > SMALL_COPY {
            return Ok(false);
        }
        let pair = self.pair_state();
        let side = pair.side(self.me);
        let mut state = pair.lock();
        if let Some(shut) = &state.shut {
            return Err(shut.error(self.peer));
        }
        if state.queued(side, channel) >= pair.depth {
            return Ok(false);
        }
        let frame = Frame {
            tag,
            payload: Bytes::copy_from_slice(payload),
        };
        state.queues[side].push_back((channel, frame));
        drop(state);
        pair.changed[side].notify_waiters();
        Ok(true)
    }

    /// Queued whatever the channel holds: the frame is a handle to the
    /// sender's buffer, so room (bounding memory) does not apply.
    fn send_in_place(&self, channel: ChannelId, tag: u64, payload: &Bytes) -> Result<bool, TransportError> {
        let pair = self.pair_state();
        let side = pair.side(self.me);
        let mut state = pair.lock();
        if let Some(shut) = &state.shut {
            return Err(shut.error(self.peer));
        }
        let frame = Frame {
            tag,
            payload: payload.clone(),
        };
        state.queues[side].push_back((channel, frame));
        drop(state);
        pair.changed[side].notify_waiters();
        Ok(true)
    }

    async fn recv(&self, channel: ChannelId) -> Result<Frame, TransportError> {
        let pair = self.pair_state();
        let side = 1 - pair.side(self.me);
        // A frame already queued is taken without registering for a wake-up
        // (a thousand ranks in one process find theirs queued often).
        if let Some(taken) = self.take(pair, side, channel) {
            return taken;
        }
        loop {
            let changed = pair.changed[side].notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(taken) = self.take(pair, side, channel) {
                return taken;
            }
            changed.await;
        }
    }

    fn close_with(&self, notice: &CloseNotice) {
        self.owner.mesh.shut(
            self.me,
            self.peer,
            Shut::Notice {
                by: self.me,
                notice: notice.clone(),
            },
        );
    }

    fn cut(&self, reason: &str) {
        self.owner.mesh.shut(
            self.me,
            self.peer,
            Shut::Lost {
                reason: format!("cut by rank {}: {reason}", self.me),
            },
        );
    }
}

impl Drop for LocalLink {
    // A rank that goes away without closing (a task that panicked, a rank
    // dropped mid-operation) is lost, not leaving. A pair not made yet
    // learns it from `RankLinks` when it is.
    fn drop(&mut self) {
        let pair = self
            .pair
            .get()
            .cloned()
            .or_else(|| self.owner.mesh.existing(self.me, self.peer));
        if let Some(pair) = pair {
            pair.shut(dropped(self.me));
        }
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
    async fn small_frames_are_copied_straight_into_a_channel_with_room() {
        within(async {
            let (a, b) = LocalLink::pair_with_depth(0, 1, 1);
            assert_eq!(a.try_send_copy(0, 1, b"small"), Ok(true));
            assert_eq!(a.try_send_copy(0, 2, b"full"), Ok(false), "the channel is full");
            assert_eq!(
                a.try_send_copy(1, 3, &vec![0; SMALL_COPY + 1]),
                Ok(false),
                "too large to copy"
            );
            let frame = b.recv(0).await.unwrap();
            assert_eq!((frame.tag, frame.payload), (1, Bytes::from_static(b"small")));
            b.close("done");
            assert!(a.try_send_copy(0, 4, b"late").is_err(), "a closed pair refuses");
        })
        .await;
    }

    #[tokio::test]
    async fn a_view_is_queued_whatever_the_room_and_arrives_as_it_was_sent() {
        within(async {
            let (a, b) = LocalLink::pair_with_depth(0, 1, 1);
            a.send(0, 1, Bytes::new()).await.unwrap();
            let view = Bytes::from(vec![3u8; 1 << 20]);
            assert_eq!(
                a.send_in_place(0, 2, &view),
                Ok(true),
                "a full channel still takes a view"
            );
            assert_eq!(b.recv(0).await.unwrap().tag, 1);
            let frame = b.recv(0).await.unwrap();
            assert_eq!(
                (frame.tag, frame.payload.as_ptr()),
                (2, view.as_ptr()),
                "the same bytes, not a copy"
            );
            b.close("done");
            assert!(a.send_in_place(0, 3, &view).is_err(), "a closed pair refuses");
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
    async fn one_direction_queues_channels_apart_with_room_counted_per_channel() {
        within(async {
            let (a, b) = LocalLink::pair_with_depth(0, 1, 2);
            a.send(0, 1, Bytes::new()).await.unwrap();
            a.send(1, 10, Bytes::new()).await.unwrap();
            a.send(0, 2, Bytes::new()).await.unwrap();
            assert_eq!(a.try_send_copy(0, 3, b"x"), Ok(false), "channel 0 is full");
            assert_eq!(a.try_send_copy(1, 11, b"y"), Ok(true), "channel 1 has room");
            // The other direction is apart: b's frames wait on nothing of a's.
            b.send(0, 100, Bytes::new()).await.unwrap();
            assert_eq!(a.recv(0).await.unwrap().tag, 100);
            assert_eq!(b.recv(1).await.unwrap().tag, 10);
            assert_eq!(b.recv(1).await.unwrap().tag, 11);
            // A sender waiting for room on channel 0 wakes when it drains.
            let (sent, first) = tokio::join!(a.send(0, 3, Bytes::new()), async {
                tokio::time::sleep(Duration::from_millis(20)).await;
                b.recv(0).await
            });
            sent.unwrap();
            assert_eq!(first.unwrap().tag, 1);
            assert_eq!(b.recv(0).await.unwrap().tag, 2);
            assert_eq!(b.recv(0).await.unwrap().tag, 3);
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
