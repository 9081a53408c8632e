//! The CPU backend's driver: runs one rank's [`Plan`] over its links.
//!
//! The plan is pure (`chorus_runtime::collective`); this module only moves
//! bytes, by the plan's execution rules:
//! 1. Every collective first sends its [`Signature`] to every other rank, on
//!    the collective's channel, ahead of its data, and reads theirs. Every
//!    rank reads every signature, so when ranks disagree each of them fails
//!    naming the ranks and both signatures, instead of one hanging or
//!    reducing garbage. A send carries its signature to its receiver only.
//!    In a large world ([`Job::sign_data`]) the signature goes first to the
//!    next rank only, and along the plan's edges with the data: the first
//!    frame to a peer carries it when every payload to that peer is small;
//!    either way no data is used before its sender's signature matched.
//! 2. A step runs once its dependencies have: a copy at once; a send of
//!    output bytes goes straight into the link ([`Link::poll_send_copy_by`]),
//!    and while the link has no room the step waits, receives still
//!    served, until the link wakes the loop; on a link that takes no
//!    borrowed payload it copies its region into a frame (an input region
//!    goes as a view) and sends it, polled once on the spot, so only a send
//!    that must wait becomes a task (either way it counts as done once
//!    copied, rule 2 of the plan);
//!    to a peer in this process, where the plan allows it
//!    (`Plan::lendable`, the ring) and the region is large, a view of the
//!    region goes instead ([`Link::send_in_place`], [`crate::lend`]): the
//!    peer reduces or copies straight from this rank's output, a write to
//!    the region waits until the view is released, and the collective
//!    returns only once every view is;
//!    a receive once its frame has arrived. An average divides at the
//!    plan's completing receives when it has them. A collective whose
//!    buffers are larger than half the last-level cache copies (into the
//!    link, out of a frame, input to output) with non-temporal stores
//!    ([`copy_streaming`]): its copies would leave the cache before anyone
//!    read them, and this way they are not read in first.
//! 3. One receive per peer is pending at a time, polled by the collective
//!    itself (no task per peer: in a process of many ranks a task and a
//!    hand-over per frame cost more than the frame), so each peer's frames
//!    are read in order from the channel and handed over by tag, and
//!    receives may complete in any order the plan allows.
//! 4. A deadline bounds the whole collective; on expiry the error names the
//!    ranks whose frames never came.
//! 5. An abort of the group (`supervision`, SV-1) ends the collective at
//!    once, whatever it waits on, with the abort as its error.

use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::{Buf, Bytes};
use chorus_runtime::collective::{
    Action, Combine, ENCODED_LEN, Plan, PlanError, ReduceError, ReduceOp, Region, Signature, SignatureError, StepId,
    Tag, copy_streaming, finalize_avg, reduce_complete_from, reduce_complete_into, reduce_from, reduce_into,
    streaming_threshold,
};
use chorus_transports::link::{ChannelId, Frame, Link, TransportError};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;

use crate::lend::{Leases, Lender};
use crate::supervision::GroupAborted;
use thiserror::Error;
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};

/// The tag of a signature frame (data tags pack round and segment).
pub(crate) const SIGNATURE_TAG: u64 = u64::MAX;

/// Smallest region lent to an in-process peer ([`crate::lend`]): below it a
/// copy costs less than a view and the wait for its release at the end.
const LEND_MIN_BYTES: usize = 64 << 10;

/// Set in a data frame's tag when its payload starts with the sender's
/// signature ([`Job::sign_data`]). Rounds stay far below 2^31.
const SIGNED: u64 = 1 << 63;

/// Largest data payload that carries a signature; a peer sent more gets
/// the signature in a frame of its own first, as announced peers do.
const SIGNED_MAX: usize = 4 << 10;

fn data_tag(tag: Tag) -> u64 {
    (u64::from(tag.round) << 32) | u64::from(tag.segment)
}

/// Why a collective failed on this rank.
#[derive(Error, Clone)]
pub enum CollectiveError {
    /// Ranks called different collectives (or the same with other arguments).
    #[error("collective desync between rank {ours_rank} and rank {theirs_rank}: {detail}")]
    Desync {
        /// This rank.
        ours_rank: usize,
        /// The rank that disagrees.
        theirs_rank: usize,
        /// Both signatures and what differs.
        detail: String,
    },
    /// A link failed.
    #[error("{0}")]
    Transport(#[from] TransportError),
    /// The collective ran out of time.
    // "Timed out" as Gloo words it: code written against torch's backends matches it.
    #[error("{signature} on rank {rank}: Timed out after {waited:?} waiting for frames from ranks {waiting_for:?}")]
    Timeout {
        /// The collective.
        signature: Signature,
        /// This rank.
        rank: usize,
        /// How long it ran.
        waited: Duration,
        /// Ranks whose frames never came.
        waiting_for: Vec<usize>,
    },
    /// The arguments cannot make a plan (a bad root, a size over the limit).
    #[error("{0}")]
    Plan(#[from] PlanError),
    /// The operator does not apply to the dtype.
    #[error("{0}")]
    Reduce(#[from] ReduceError),
    /// A peer sent a frame of the wrong size or a bad signature.
    #[error("rank {peer} broke the collective protocol: {reason}")]
    Protocol {
        /// The peer.
        peer: usize,
        /// What was wrong.
        reason: String,
    },
    /// A buffer does not have the length the collective needs.
    #[error("{which} buffer holds {got} bytes but {signature} needs {want}")]
    BufferSize {
        /// The collective.
        signature: Signature,
        /// "input" or "output".
        which: &'static str,
        /// Its length.
        got: usize,
        /// The length needed.
        want: usize,
    },
    /// The group failed earlier and must be restarted.
    #[error("the process group is broken by an earlier failure: {0}")]
    Broken(String),
    /// The group was aborted (a peer failed, an operation timed out) while
    /// this operation was pending, or before it was submitted.
    #[error("{0}")]
    GroupAborted(#[from] GroupAborted),
}

chorus_runtime::debug_as_report!(CollectiveError);

impl From<SignatureError> for CollectiveError {
    fn from(e: SignatureError) -> Self {
        CollectiveError::Protocol {
            peer: usize::MAX,
            reason: e.to_string(),
        }
    }
}

/// Everything one rank needs to run one collective.
pub struct Job<'a> {
    /// This rank.
    pub rank: usize,
    /// Links indexed by rank (`None` for this rank).
    pub links: &'a [Option<Arc<dyn Link>>],
    /// The channel this collective uses.
    pub channel: ChannelId,
    /// What every rank should be calling.
    pub signature: Signature,
    /// This rank's plan.
    pub plan: &'a Plan,
    /// Ranks this rank sends its signature to.
    pub announce_to: Vec<usize>,
    /// Ranks whose signatures this rank checks.
    pub check_from: Vec<usize>,
    /// Also check the signature of every rank the plan receives from, and
    /// send ours to every rank it sends to: in the first data frame to
    /// that rank when every payload to it is small (a frame saved per
    /// peer), else in a frame of its own.
    pub sign_data: bool,
    /// The read-only input (shared with send frames without a copy).
    pub input: Bytes,
    /// The output, written in place.
    pub output: &'a mut [u8],
    /// Deadline for the whole collective.
    pub timeout: Duration,
    /// Where send frames' buffers come from.
    pub pool: &'a FramePool,
    /// Lends `output`'s regions to peers in this process, when the plan
    /// allows it (`Plan::lendable`); `None`: never lend.
    pub lender: Option<Lender>,
    /// Turns `Some` when the group is aborted.
    pub abort: watch::Receiver<Option<GroupAborted>>,
}

/// Buffers for send frames, reused across collectives: a frame copied into
/// fresh memory pays a page fault per 4 KiB (the allocator hands large
/// blocks back to the kernel), which profiled as most of an in-process
/// all-reduce. A buffer returns here when the last holder of its frame (the
/// transport, or the receiving rank) drops it.
#[derive(Debug, Clone, Default)]
pub struct FramePool(Arc<Mutex<Vec<Vec<u8>>>>);

/// Buffers kept for reuse at most; more are freed.
const POOLED_BUFFERS: usize = 64;

/// Bytes kept for reuse at most (capacity, all buffers together): the pool
/// stays resident between collectives, so without a bound one large send
/// would keep its buffer for the process's life, and 64 ring segments would
/// keep 64 MiB, a whole 64 MiB tensor's worth.
const POOLED_BYTES: usize = 16 << 20;

struct PooledFrame {
    buffer: Vec<u8>,
    pool: FramePool,
}

impl AsRef<[u8]> for PooledFrame {
    fn as_ref(&self) -> &[u8] {
        &self.buffer
    }
}

impl Drop for PooledFrame {
    fn drop(&mut self) {
        let mut free = self.pool.0.lock().unwrap_or_else(|p| p.into_inner());
        let kept: usize = free.iter().map(Vec::capacity).sum();
        if free.len() < POOLED_BUFFERS && kept + self.buffer.capacity() <= POOLED_BYTES {
            free.push(std::mem::take(&mut self.buffer));
        }
    }
}

impl FramePool {
    /// A frame holding a copy of `data`, in a reused buffer when one fits.
    pub fn frame(&self, data: &[u8]) -> Bytes {
        let reused = {
            let mut free = self.0.lock().unwrap_or_else(|p| p.into_inner());
            free.iter()
                .position(|b| b.capacity() >= data.len())
                .map(|i| free.swap_remove(i))
        };
        let mut buffer = reused.unwrap_or_default();
        buffer.clear();
        buffer.extend_from_slice(data);
        Bytes::from_owner(PooledFrame {
            buffer,
            pool: self.clone(),
        })
    }
}

enum Event {
    Frame { from: usize, tag: u64, payload: Bytes },
    Failed(CollectiveError),
}

/// A pending receive from one peer: the link's own (boxed) future, tagged
/// with the peer without a second box.
struct Arrival<'a> {
    peer: usize,
    recv: Pin<Box<dyn Future<Output = Result<Frame, TransportError>> + Send + 'a>>,
}

impl Future for Arrival<'_> {
    type Output = (usize, Result<Frame, TransportError>);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        this.recv.as_mut().poll(cx).map(|received| (this.peer, received))
    }
}

/// What a collective knows of one peer, indexed by rank (no hashing per
/// frame).
#[derive(Debug, Clone, Copy, Default)]
struct PeerState {
    /// Frames it still owes beyond its pending receive.
    owed: u32,
    /// Its signature is still to be checked.
    unverified: bool,
    /// This rank's signature goes in the next data frame sent to it
    /// ([`SIGNED`]) rather than a frame of its own.
    sign: bool,
    /// Planning only: this rank sends it, or receives from it, a payload
    /// too large to carry a signature.
    large_out: bool,
    large_in: bool,
}

/// Where a collective's events come from: the one pending receive per peer
/// (the next is made when one completes, while the peer owes frames), and
/// the failures of send tasks (a channel made with the first such task).
struct Inbox<'a> {
    links: &'a [Option<Arc<dyn Link>>],
    channel: ChannelId,
    arrivals: FuturesUnordered<Arrival<'a>>,
    /// By rank, sorted.
    peers: Vec<(usize, PeerState)>,
    /// Peers whose `unverified` is set.
    unverified: usize,
    failures: Option<mpsc::UnboundedReceiver<Event>>,
}

impl<'a> Inbox<'a> {
    fn peer(&self, rank: usize) -> Option<&PeerState> {
        let at = self.peers.binary_search_by_key(&rank, |(r, _)| *r).ok()?;
        Some(&self.peers[at].1)
    }

    fn peer_mut(&mut self, rank: usize) -> Option<&mut PeerState> {
        let at = self.peers.binary_search_by_key(&rank, |(r, _)| *r).ok()?;
        Some(&mut self.peers[at].1)
    }

    fn receive(&mut self, peer: usize) {
        if let Some(link) = self.links.get(peer).and_then(Option::as_deref) {
            self.arrivals.push(Arrival {
                peer,
                recv: link.recv(self.channel),
            });
        }
    }

    /// Checks `from`'s signature against ours; it counts as checked
    /// either way (an error ends the collective).
    fn verify(&mut self, ours: &Signature, rank: usize, from: usize, encoded: &[u8]) -> Result<(), CollectiveError> {
        if let Some(peer) = self.peer_mut(from).filter(|p| p.unverified) {
            peer.unverified = false;
            self.unverified -= 1;
        }
        let theirs = Signature::decode(encoded).map_err(|e| CollectiveError::Protocol {
            peer: from,
            reason: e.to_string(),
        })?;
        if let Some(detail) = ours.mismatch(&theirs) {
            return Err(CollectiveError::Desync {
                ours_rank: rank,
                theirs_rank: from,
                detail,
            });
        }
        Ok(())
    }

    /// The peers whose signatures never came.
    fn waiting_for_signatures(&self) -> impl Iterator<Item = usize> + '_ {
        self.peers.iter().filter(|(_, p)| p.unverified).map(|(r, _)| *r)
    }

    /// The next frame or failure; pending while nothing can come.
    async fn next(&mut self) -> Event {
        std::future::poll_fn(|cx| {
            if let Some(failures) = &mut self.failures
                && let Poll::Ready(Some(failure)) = failures.poll_recv(cx)
            {
                return Poll::Ready(failure);
            }
            // An empty set is Ready(None): nothing to wait for there.
            let Poll::Ready(Some((from, received))) = self.arrivals.poll_next_unpin(cx) else {
                return Poll::Pending;
            };
            Poll::Ready(match received {
                Ok(frame) => {
                    if let Some(peer) = self.peer_mut(from).filter(|p| p.owed > 0) {
                        peer.owed -= 1;
                        self.receive(from);
                    }
                    Event::Frame {
                        from,
                        tag: frame.tag,
                        payload: frame.payload,
                    }
                }
                Err(e) => Event::Failed(e.into()),
            })
        })
        .await
    }
}

/// The link to `peer`, borrowed: a clone (an atomic write to the link,
/// cold in a world of a thousand ranks) only for a send task.
fn link(links: &[Option<Arc<dyn Link>>], rank: usize, peer: usize) -> Result<&Arc<dyn Link>, CollectiveError> {
    links
        .get(peer)
        .and_then(Option::as_ref)
        .ok_or_else(|| CollectiveError::Protocol {
            peer,
            reason: format!("rank {rank} has no link to it"),
        })
}

/// Runs `job` to completion on this rank, or until the group is aborted
/// (rule 5: dropping the run aborts its reader and sender tasks).
pub async fn run(job: Job<'_>) -> Result<(), CollectiveError> {
    let mut abort = job.abort.clone();
    if let Some(aborted) = abort.borrow_and_update().clone() {
        return Err(aborted.into());
    }
    tokio::select! {
        biased;
        aborted = until_aborted(abort) => Err(aborted.into()),
        result = run_plan(job) => result,
    }
}

/// Resolves with the abort once the group is aborted; pending forever if
/// the supervision state went with its group (nothing will abort).
pub(crate) async fn until_aborted(mut abort: watch::Receiver<Option<GroupAborted>>) -> GroupAborted {
    match abort.wait_for(Option::is_some).await {
        Ok(aborted) => aborted.clone().expect("waited for Some"),
        Err(_) => std::future::pending().await,
    }
}

async fn run_plan(job: Job<'_>) -> Result<(), CollectiveError> {
    let timeout = job.timeout;
    let (mut collective, announce) = Collective::new(job)?;
    collective.announce(&announce).await?;
    // One timer for the whole collective, not one per wait.
    let expiry = tokio::time::sleep_until(collective.started + timeout);
    tokio::pin!(expiry);
    let result = collective.drive(expiry).await;
    collective.complete(result).await
}

/// One collective on this rank: its buffers, links and progress, made once
/// and borrowed by each step, so that running a step allocates nothing.
struct Collective<'a> {
    rank: usize,
    links: &'a [Option<Arc<dyn Link>>],
    channel: ChannelId,
    signature: Signature,
    /// The signature as it goes on the wire.
    encoded: [u8; ENCODED_LEN],
    plan: &'a Plan,
    /// Bytes per element.
    size: usize,
    input: Bytes,
    output: &'a mut [u8],
    /// Data larger than the cache: what this rank copies will have left the
    /// cache before anyone reads it, so copies skip reading it in first.
    copy: fn(&mut [u8], &[u8]),
    pool: &'a FramePool,
    lender: Option<Lender>,
    started: Instant,
    inbox: Inbox<'a>,
    /// By step: whether it has run.
    done: Vec<bool>,
    /// Steps not yet run.
    remaining: usize,
    /// Every step before it has run.
    first_open: usize,
    /// Frames that came before their receive could run: few at a time.
    arrived: Vec<(usize, u64, Bytes)>,
    /// Regions lent to peers, and whether a write waits for one's release.
    leases: Leases,
    blocked_on_lease: bool,
    /// Send tasks, made for sends that could not be handed over at once,
    /// and the channel they report failures on.
    tasks: JoinSet<()>,
    events: Option<mpsc::UnboundedSender<Event>>,
    /// Woken by a link that has room again for a send that found none;
    /// made when a send first finds none.
    room: Option<(Arc<Notify>, Waker)>,
    /// A signature and the data it is carried with.
    signed: Vec<u8>,
}

impl<'a> Collective<'a> {
    /// Checks the buffers and starts the receives; also returns the peers
    /// to announce this rank's signature to.
    fn new(job: Job<'a>) -> Result<(Self, Vec<usize>), CollectiveError> {
        let Job {
            rank,
            links,
            channel,
            signature,
            plan,
            announce_to,
            check_from,
            sign_data,
            input,
            output,
            timeout: _,
            pool,
            lender,
            abort: _,
        } = job;
        let size = signature.dtype.size();
        check_len(&signature, "input", input.len(), plan.input_len() * size)?;
        check_len(&signature, "output", output.len(), plan.output_len() * size)?;
        let copy: fn(&mut [u8], &[u8]) = if input.len().max(output.len()) >= streaming_threshold() {
            copy_streaming
        } else {
            <[u8]>::copy_from_slice
        };
        let mut collective = Collective {
            rank,
            links,
            channel,
            signature,
            encoded: signature.encode(),
            plan,
            size,
            input,
            output,
            copy,
            pool,
            lender: lender.filter(|_| plan.lendable()),
            started: Instant::now(),
            inbox: Inbox {
                links,
                channel,
                arrivals: FuturesUnordered::new(),
                peers: peers(plan, &check_from, sign_data),
                unverified: 0,
                failures: None,
            },
            done: vec![false; plan.steps().len()],
            remaining: plan.steps().len(),
            first_open: 0,
            arrived: Vec::new(),
            leases: Leases::default(),
            blocked_on_lease: false,
            tasks: JoinSet::new(),
            events: None,
            room: None,
            signed: Vec::new(),
        };
        let announce = collective.expect_frames(announce_to, &check_from, sign_data)?;
        Ok((collective, announce))
    }

    /// Counts the frames each peer owes (its signature, then its data) and
    /// starts a receive from each that owes any (rule 3). Returns the peers
    /// to announce to: `announce_to`, and with `sign_data` those sent data
    /// too large to carry the signature.
    fn expect_frames(
        &mut self,
        mut announce: Vec<usize>,
        check_from: &[usize],
        sign_data: bool,
    ) -> Result<Vec<usize>, CollectiveError> {
        let inbox = &mut self.inbox;
        for &peer in check_from {
            let state = inbox.peer_mut(peer).expect("listed");
            if !state.unverified {
                state.unverified = true;
                state.owed += 1;
                inbox.unverified += 1;
            }
        }
        for step in self.plan.steps() {
            match &step.action {
                Action::Recv { from, dst, .. } => {
                    let state = inbox.peer_mut(*from).expect("listed");
                    state.owed += 1;
                    // Its signature comes with its data, or on its own
                    // before data too large to carry it in (as it sends).
                    if sign_data && !check_from.contains(from) {
                        state.large_in |= dst.len() * self.size > SIGNED_MAX;
                        if !state.unverified {
                            state.unverified = true;
                            inbox.unverified += 1;
                        }
                    }
                }
                Action::Send { to, src, .. } if sign_data && !announce.contains(to) => {
                    let state = inbox.peer_mut(*to).expect("listed");
                    let (Region::Input(r) | Region::Output(r)) = src;
                    state.sign = true;
                    state.large_out |= r.len() * self.size > SIGNED_MAX;
                }
                _ => {}
            }
        }
        for index in 0..inbox.peers.len() {
            let (peer, state) = &mut inbox.peers[index];
            let peer = *peer;
            if state.large_in {
                state.owed += 1;
            }
            if state.sign && state.large_out {
                state.sign = false;
                announce.push(peer);
            }
            if state.owed > 0 {
                state.owed -= 1;
                // Every peer that owes frames must have a link (an error naming it).
                link(self.links, self.rank, peer)?;
                inbox.receive(peer);
            }
        }
        Ok(announce)
    }

    /// Sends this rank's signature to `peers` (rule 1), before anything can
    /// fail here, so that even a rank that detects a desync first has told
    /// every other rank what it was calling.
    async fn announce(&mut self, peers: &[usize]) -> Result<(), CollectiveError> {
        for &peer in peers {
            let link = link(self.links, self.rank, peer)?;
            // Copied straight into the link when it has room (no frame, no
            // waiting future); otherwise, or on a failure, the send below.
            if let Ok(true) = link.try_send_copy(self.channel, SIGNATURE_TAG, &self.encoded) {
                continue;
            }
            let sent = link
                .send(self.channel, SIGNATURE_TAG, Bytes::copy_from_slice(&self.encoded))
                .await;
            if let Err(e) = sent {
                // The pending receives are polled through the grace period
                // (`explain_failure`) and dropped with the inbox afterwards.
                return Err(self.explain(e.error.into()).await);
            }
        }
        Ok(())
    }

    /// Runs the steps as they become ready, waiting between for frames,
    /// room in a link or a lent region's release, until every step has run,
    /// every signature matched and no peer reads the output any more.
    async fn drive(&mut self, mut expiry: Pin<&mut Sleep>) -> Result<(), CollectiveError> {
        loop {
            self.run_ready().await?;
            // The output goes back (or is averaged) only once no peer
            // reads it any more.
            let lent = self.lender.as_ref().is_some_and(|l| l.outstanding() > 0);
            if self.remaining == 0 && self.inbox.unverified == 0 && !lent {
                return Ok(());
            }
            let wait_release = self.blocked_on_lease || (self.remaining == 0 && lent);
            if let Some(event) = self.wait(expiry.as_mut(), wait_release).await? {
                self.accept(event).await?;
            }
        }
    }

    /// Runs every step whose dependencies have run, until none can (rule 2).
    async fn run_ready(&mut self) -> Result<(), CollectiveError> {
        let plan = self.plan;
        let steps = plan.steps();
        self.blocked_on_lease = false;
        let mut progressed = true;
        while progressed {
            progressed = false;
            while self.first_open < steps.len() && self.done[self.first_open] {
                self.first_open += 1;
            }
            for (index, step) in steps.iter().enumerate().skip(self.first_open) {
                if self.done[index] || !plan.deps(StepId(index as u32)).iter().all(|d| self.done[d.index()]) {
                    continue;
                }
                let ran = match self.step(&step.action) {
                    Ok(ran) => ran,
                    // A link's failure may be the echo of a desync.
                    Err(e @ CollectiveError::Transport(_)) => return Err(self.explain(e).await),
                    Err(e) => return Err(e),
                };
                if ran {
                    self.done[index] = true;
                    self.remaining -= 1;
                    progressed = true;
                }
            }
        }
        Ok(())
    }

    /// Runs one ready step; false when it must wait (for its frame, room
    /// in its link, or a lent region's release).
    fn step(&mut self, action: &Action) -> Result<bool, CollectiveError> {
        match action {
            Action::Copy { src, dst } => {
                let (src, dst) = (self.bytes(src), self.bytes(dst));
                if self.leases.busy(&dst) {
                    self.blocked_on_lease = true;
                    return Ok(false);
                }
                (self.copy)(&mut self.output[dst], &self.input[src]);
                Ok(true)
            }
            Action::Send { to, tag, src } => self.send(*to, data_tag(*tag), src),
            Action::Recv { from, tag, dst, then } => self.receive(*from, data_tag(*tag), dst, *then),
        }
    }

    /// The bytes of the elements `r`.
    fn bytes(&self, r: &Range<usize>) -> Range<usize> {
        r.start * self.size..r.end * self.size
    }

    /// Runs a send: lent to an in-process peer, else copied straight into
    /// the link, else handed over as a frame. False while the link has no
    /// room (the loop is woken when it has).
    fn send(&mut self, to: usize, tag: u64, src: &Region) -> Result<bool, CollectiveError> {
        let link = link(self.links, self.rank, to)?;
        let sign = self.inbox.peer(to).is_some_and(|p| p.sign);
        let (Region::Input(r) | Region::Output(r)) = src;
        let region = self.bytes(r);
        let lendable = matches!(src, Region::Output(_)) && !sign && region.len() >= LEND_MIN_BYTES;
        if lendable && self.lend(link, to, tag, region.clone())? {
            return Ok(true);
        }
        match self.send_copy(link, tag, src, region.clone(), sign) {
            Poll::Ready(Ok(true)) => {
                if let Some(peer) = self.inbox.peer_mut(to) {
                    peer.sign = false;
                }
                Ok(true)
            }
            Poll::Pending => Ok(false),
            Poll::Ready(Err(e)) => Err(e.into()),
            Poll::Ready(Ok(false)) => {
                self.send_frame(link, to, tag, src, region, sign);
                Ok(true)
            }
        }
    }

    /// Sends a view of the output's `region` to `to`, a peer in this
    /// process that reads it in place; false when no view can go (the
    /// link or the buffer takes none).
    fn lend(
        &mut self,
        link: &Arc<dyn Link>,
        to: usize,
        tag: u64,
        region: Range<usize>,
    ) -> Result<bool, CollectiveError> {
        let Some(lender) = &self.lender else {
            return Ok(false);
        };
        // SAFETY: every write of the output waits for the leases over it
        // (`leases.busy`).
        let Some((view, lease)) = (unsafe { lender.lend(&self.output[region.clone()]) }) else {
            return Ok(false);
        };
        if !link.send_in_place(self.channel, tag, &view)? {
            return Ok(false);
        }
        self.leases.push(region, to, lease);
        Ok(true)
    }

    /// Copies a send's bytes straight from the buffer into the transport
    /// (one copy, none into a frame; the signature written in front when
    /// `sign`), or registers for room; `Ready(Ok(false))` when the link
    /// takes no borrowed payload (then `signed` holds a signed payload).
    fn send_copy(
        &mut self,
        link: &Arc<dyn Link>,
        tag: u64,
        src: &Region,
        region: Range<usize>,
        sign: bool,
    ) -> Poll<Result<bool, TransportError>> {
        let (copy, encoded) = (self.copy, &self.encoded);
        let bytes = match src {
            Region::Input(_) => &self.input[region],
            Region::Output(_) => &self.output[region],
        };
        let (_, waker) = self.room.get_or_insert_with(|| {
            let notify = Arc::new(Notify::new());
            (notify.clone(), Waker::from(Arc::new(RoomWaker(notify))))
        });
        let mut cx = Context::from_waker(waker);
        if !sign {
            return link.poll_send_copy_by(&mut cx, self.channel, tag, bytes, copy);
        }
        let at = encoded.len();
        let polled = link.poll_send_with(&mut cx, self.channel, tag | SIGNED, at + bytes.len(), &mut |frame| {
            frame[..at].copy_from_slice(encoded);
            copy(&mut frame[at..], bytes);
        });
        if !matches!(polled, Poll::Ready(Ok(false))) {
            return polled;
        }
        self.signed.clear();
        self.signed.extend_from_slice(encoded);
        self.signed.extend_from_slice(bytes);
        Poll::Ready(link.try_send_copy(self.channel, tag | SIGNED, &self.signed))
    }

    /// Hands a send to its link as a frame (of the input, without a copy,
    /// when unsigned; else pooled): polled once here, so that a link with
    /// room takes it now and no task is made for it, and over QUIC it leaves
    /// in the packet that carries what this collective wrote before (its
    /// signature). It counts as done either way (rule 2 of the plan).
    fn send_frame(
        &mut self,
        link: &Arc<dyn Link>,
        to: usize,
        tag: u64,
        src: &Region,
        region: Range<usize>,
        sign: bool,
    ) {
        let (tag, payload) = match src {
            // `send_copy` left the signed payload in `signed`.
            _ if sign => (tag | SIGNED, self.pool.frame(&self.signed)),
            Region::Input(_) => (tag, self.input.slice(region)),
            Region::Output(_) => (tag, self.pool.frame(&self.output[region])),
        };
        if let Some(peer) = self.inbox.peer_mut(to) {
            peer.sign = false;
        }
        let events = self.events.get_or_insert_with(|| {
            let (events, failures) = mpsc::unbounded_channel();
            self.inbox.failures = Some(failures);
            events
        });
        let (events, link, channel) = (events.clone(), link.clone(), self.channel);
        let mut send = Box::pin(async move {
            if let Err(e) = link.send(channel, tag, payload).await {
                let _ = events.send(Event::Failed(e.error.into()));
            }
        });
        if send.as_mut().poll(&mut Context::from_waker(Waker::noop())).is_pending() {
            self.tasks.spawn(send);
        }
    }

    /// Runs a receive whose frame has arrived, copying or reducing it into
    /// its region; false while it has not, or the region is still lent.
    fn receive(&mut self, from: usize, tag: u64, dst: &Range<usize>, then: Combine) -> Result<bool, CollectiveError> {
        let Some(at) = self.arrived.iter().position(|(f, t, _)| (*f, *t) == (from, tag)) else {
            return Ok(false);
        };
        let dst = self.bytes(dst);
        // A region still lent waits for its release (checked only once
        // there is something to write).
        if self.leases.busy(&dst) {
            self.blocked_on_lease = true;
            return Ok(false);
        }
        let (_, _, payload) = self.arrived.swap_remove(at);
        let (op, dtype, world) = (
            self.signature.reduce_op.unwrap_or(ReduceOp::Sum),
            self.signature.dtype,
            self.plan.world(),
        );
        let (input, target) = (&self.input, &mut self.output[dst.clone()]);
        if payload.len() != target.len() {
            return Err(CollectiveError::Protocol {
                peer: from,
                reason: format!("sent {} bytes for a {}-byte segment", payload.len(), target.len()),
            });
        }
        match then {
            Combine::Copy => (self.copy)(target, &payload),
            Combine::Reduce => reduce_into(op, dtype, target, &payload)?,
            Combine::ReduceInput => reduce_from(op, dtype, target, &input[dst], &payload)?,
            Combine::ReduceCompleteInput => reduce_complete_from(op, dtype, target, &input[dst], &payload, world)?,
            Combine::ReduceComplete => reduce_complete_into(op, dtype, target, &payload, world)?,
        }
        Ok(true)
    }

    /// Waits for the next frame or failure; `None` when a link has room
    /// again or a peer released a lent region (the steps run again). At the
    /// deadline, fails naming the ranks waited for (rule 4).
    async fn wait(&mut self, expiry: Pin<&mut Sleep>, wait_release: bool) -> Result<Option<Event>, CollectiveError> {
        let (room, lender) = (&self.room, &self.lender);
        let has_room = async {
            match room {
                Some((notify, _)) => notify.notified().await,
                None => std::future::pending().await,
            }
        };
        let released = async {
            match lender {
                Some(lender) => lender.released().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            event = self.inbox.next() => Ok(Some(event)),
            () = has_room => Ok(None),
            () = released, if wait_release => Ok(None),
            () = expiry => Err(self.timed_out()),
        }
    }

    /// The error at the deadline: it names the ranks whose signature or
    /// frames never came, that hold a lent region, or that do not drain the
    /// link of a send that could run.
    fn timed_out(&mut self) -> CollectiveError {
        let mut waiting_for: Vec<usize> = self.inbox.waiting_for_signatures().collect();
        waiting_for.extend(self.leases.holders());
        for (index, step) in self.plan.steps().iter().enumerate() {
            let ready = || {
                self.plan
                    .deps(StepId(index as u32))
                    .iter()
                    .all(|d| self.done[d.index()])
            };
            match (self.done[index], &step.action) {
                (false, Action::Recv { from, .. }) => waiting_for.push(*from),
                (false, Action::Send { to, .. }) if ready() => waiting_for.push(*to),
                _ => {}
            }
        }
        waiting_for.sort_unstable();
        waiting_for.dedup();
        CollectiveError::Timeout {
            signature: self.signature,
            rank: self.rank,
            waited: self.started.elapsed(),
            waiting_for,
        }
    }

    /// Takes in an event: a signature is checked, a data frame kept for its
    /// receive (the signature it carries checked first), a send task's
    /// failure ends the collective.
    async fn accept(&mut self, event: Event) -> Result<(), CollectiveError> {
        match event {
            Event::Failed(e) => Err(self.explain(e).await),
            Event::Frame {
                from,
                tag: SIGNATURE_TAG,
                payload,
            } => self.inbox.verify(&self.signature, self.rank, from, &payload),
            Event::Frame { from, tag, payload } => {
                let (tag, theirs, payload) = split_signed(from, tag, payload)?;
                if let Some(theirs) = theirs {
                    self.inbox.verify(&self.signature, self.rank, from, &theirs)?;
                }
                if self.inbox.peer(from).is_some_and(|p| p.unverified) {
                    return Err(CollectiveError::Protocol {
                        peer: from,
                        reason: "data arrived before its signature".into(),
                    });
                }
                self.arrived.push((from, tag, payload));
                Ok(())
            }
        }
    }

    /// A link's failure, or the desync it echoes (`explain_failure`).
    async fn explain(&mut self, failure: CollectiveError) -> CollectiveError {
        explain_failure(failure, &self.signature, self.rank, &mut self.inbox).await
    }

    /// Ends the collective: on failure its send tasks are aborted; else
    /// they are joined (sends must be handed over before the next
    /// collective reuses the channel) and an average the steps did not
    /// divide is divided.
    async fn complete(mut self, result: Result<(), CollectiveError>) -> Result<(), CollectiveError> {
        if result.is_err() {
            self.tasks.abort_all();
            return result;
        }
        while let Some(joined) = self.tasks.join_next().await {
            if joined.is_err() {
                return Err(CollectiveError::Broken("a transport task panicked".into()));
            }
        }
        if let Some(failures) = &mut self.inbox.failures {
            while let Ok(event) = failures.try_recv() {
                if let Event::Failed(e) = event {
                    return Err(e);
                }
            }
        }
        if self.signature.reduce_op == Some(ReduceOp::Avg) && !self.plan.averages_in_steps() {
            finalize_avg(self.signature.dtype, self.output, self.plan.world())?;
        }
        Ok(())
    }
}

/// The peers a collective deals with, sorted (a few, whatever the world):
/// those whose signatures it checks, receives from, and with `sign_data`
/// sends to.
fn peers(plan: &Plan, check_from: &[usize], sign_data: bool) -> Vec<(usize, PeerState)> {
    let mut peers = check_from.to_vec();
    for step in plan.steps() {
        match &step.action {
            Action::Recv { from, .. } => peers.push(*from),
            Action::Send { to, .. } if sign_data => peers.push(*to),
            _ => {}
        }
    }
    peers.sort_unstable();
    peers.dedup();
    peers.into_iter().map(|peer| (peer, PeerState::default())).collect()
}

/// A data frame's tag and payload, and the signature it carries
/// ([`SIGNED`]): the payload's first [`ENCODED_LEN`] bytes, copied out so
/// the payload is advanced past them rather than shared by two slices
/// (which costs an allocation per frame).
fn split_signed(
    from: usize,
    tag: u64,
    mut payload: Bytes,
) -> Result<(u64, Option<[u8; ENCODED_LEN]>, Bytes), CollectiveError> {
    if tag & SIGNED == 0 {
        return Ok((tag, None, payload));
    }
    let Some(carried) = payload.get(..ENCODED_LEN) else {
        return Err(CollectiveError::Protocol {
            peer: from,
            reason: format!(
                "a signed frame of {} bytes has no room for its signature",
                payload.len()
            ),
        });
    };
    let mut signature = [0; ENCODED_LEN];
    signature.copy_from_slice(carried);
    payload.advance(ENCODED_LEN);
    Ok((tag & !SIGNED, Some(signature), payload))
}

/// Turns a link's wake-up (it has room for a send that waited) into a
/// permit the collective's loop waits on next to its inbox.
struct RoomWaker(Arc<Notify>);

impl Wake for RoomWaker {
    fn wake(self: Arc<Self>) {
        self.0.notify_one();
    }
}

/// A link failure during a collective is often the echo of a desync: the
/// rank that disagreed gave up and left. Signatures still in flight get a
/// short grace period, so the error names the cause rather than the echo.
async fn explain_failure(
    failure: CollectiveError,
    signature: &Signature,
    rank: usize,
    inbox: &mut Inbox<'_>,
) -> CollectiveError {
    let grace = Instant::now() + Duration::from_millis(200);
    while inbox.unverified > 0 {
        let Ok(event) = tokio::time::timeout_at(grace, inbox.next()).await else {
            break;
        };
        let Event::Frame { from, tag, payload } = event else {
            continue;
        };
        let verified = match tag {
            SIGNATURE_TAG => inbox.verify(signature, rank, from, &payload),
            _ => match split_signed(from, tag, payload) {
                Ok((_, Some(theirs), _)) => inbox.verify(signature, rank, from, &theirs),
                _ => continue,
            },
        };
        if let Err(e @ CollectiveError::Desync { .. }) = verified {
            return e;
        }
    }
    failure
}

fn check_len(signature: &Signature, which: &'static str, got: usize, want: usize) -> Result<(), CollectiveError> {
    if got != want {
        return Err(CollectiveError::BufferSize {
            signature: *signature,
            which,
            got,
            want,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_runtime::collective::{Algorithm, CollectiveKind, DType, Spec};
    use chorus_transports::shm::{ShmEndpoint, ShmOptions, ShmPeer};

    /// A world-2 ring all-reduce of `count` float32s: its signature and
    /// both ranks' plans.
    fn ring_all_reduce(count: usize, op: ReduceOp) -> (Signature, [Plan; 2]) {
        let signature = Signature {
            seq: 0,
            kind: CollectiveKind::AllReduce,
            dtype: DType::Float32,
            count,
            root: None,
            reduce_op: Some(op),
        };
        let spec = Spec {
            kind: CollectiveKind::AllReduce,
            dtype: DType::Float32,
            count,
            root: None,
            world: 2,
        };
        (signature, [0, 1].map(|rank| spec.plan(rank, Algorithm::Ring).unwrap()))
    }

    /// Runs `plans` on both ranks of a world of 2 at once, rank `r` over
    /// `links[r]` into `outputs[r]`, lending with `lenders[r]`; fails the
    /// test on an error or after 60 s.
    async fn run_world_two(
        links: [&[Option<Arc<dyn Link>>]; 2],
        signature: Signature,
        plans: &[Plan; 2],
        pools: &[FramePool; 2],
        outputs: [&mut [u8]; 2],
        lenders: [Option<Lender>; 2],
    ) {
        let (_abort, aborts) = watch::channel(None);
        let job = |rank: usize, output, lender| Job {
            rank,
            links: links[rank],
            channel: 0,
            signature,
            plan: &plans[rank],
            announce_to: vec![1 - rank],
            check_from: vec![1 - rank],
            sign_data: false,
            input: Bytes::new(),
            output,
            timeout: Duration::from_secs(30),
            pool: &pools[rank],
            lender,
            abort: aborts.clone(),
        };
        let ([zero, one], [zero_lends, one_lends]) = (outputs, lenders);
        let (a, b) = (job(0, zero, zero_lends), job(1, one, one_lends));
        let (a, b) = tokio::time::timeout(Duration::from_secs(60), async { tokio::join!(run(a), run(b)) })
            .await
            .expect("the all-reduce hung");
        a.unwrap();
        b.unwrap();
    }

    #[tokio::test]
    async fn sends_that_find_a_full_shm_ring_wait_for_room_instead_of_copying_into_frames() {
        // Rings of two 1 MiB segments; a 16 MiB ring all-reduce has its
        // first round's 8 MiB ready at once, so most sends find no room.
        let options = ShmOptions {
            capacity: 2 * ((1 << 20) + 4096),
            connect_timeout: Duration::from_secs(10),
            ..ShmOptions::default()
        };
        let ends = [0, 1].map(|rank| ShmEndpoint::new(rank, options.clone()).unwrap());
        let peer = |rank: usize| ShmPeer {
            rank,
            nonce: ends[rank].nonce(),
        };
        let (to_one, to_zero) = ([peer(1)], [peer(0)]);
        let (zero, one) = tokio::join!(ends[0].connect_mesh(&to_one), ends[1].connect_mesh(&to_zero));
        let meshes = [zero.unwrap(), one.unwrap()];
        let count = 4 << 20;
        let (signature, plans) = ring_all_reduce(count, ReduceOp::Sum);
        let pools = [FramePool::default(), FramePool::default()];
        let mut outputs = [0, 1].map(|rank| {
            (0..count)
                .flat_map(|i| ((i % 1000 + rank * 1000) as f32).to_le_bytes())
                .collect::<Vec<u8>>()
        });
        let [first, second] = &mut outputs;
        let links = [&meshes[0][..], &meshes[1][..]];
        run_world_two(links, signature, &plans, &pools, [first, second], [None, None]).await;
        for output in &outputs {
            for (i, value) in output.chunks_exact(4).enumerate() {
                let want = (2 * (i % 1000) + 1000) as f32;
                assert_eq!(f32::from_le_bytes(value.try_into().unwrap()), want, "element {i}");
            }
        }
        // A frame, once dropped, returns to its pool: empty pools mean
        // every send went straight into the ring.
        for pool in &pools {
            assert!(pool.0.lock().unwrap().is_empty(), "a send was copied into a frame");
        }
    }

    #[tokio::test]
    async fn in_process_ring_sends_lend_their_regions_instead_of_copying_into_frames() {
        let links = chorus_transports::local::local_mesh(2);
        let count = 1 << 20;
        for op in [ReduceOp::Sum, ReduceOp::Avg] {
            let (signature, plans) = ring_all_reduce(count, op);
            assert!(plans[0].lendable());
            let pools = [FramePool::default(), FramePool::default()];
            let mut outputs = [0, 1].map(|rank| {
                crate::lend::LentOutput::new(
                    (0..count)
                        .flat_map(|i| ((i % 1000 + rank * 1000) as f32).to_le_bytes())
                        .collect::<Vec<u8>>()
                        .into(),
                )
            });
            let lenders = outputs.each_ref().map(|o| o.lender());
            let [first, second] = &mut outputs;
            let slices = [first, second].map(|output| output.as_mut_slice().expect("nothing lent yet"));
            let links = [&links[0][..], &links[1][..]];
            let lent = lenders.clone().map(Some);
            run_world_two(links, signature, &plans, &pools, slices, lent).await;
            for (lender, pool) in lenders.iter().zip(&pools) {
                assert_eq!(
                    lender.outstanding(),
                    0,
                    "the driver returned while a peer read its output"
                );
                assert!(pool.0.lock().unwrap().is_empty(), "a send was copied into a frame");
            }
            for output in outputs {
                let output = output.into_inner().expect("every view released");
                for (i, value) in output.chunks_exact(4).enumerate() {
                    let sum = (2 * (i % 1000) + 1000) as f32;
                    let want = if op == ReduceOp::Avg { sum / 2.0 } else { sum };
                    assert_eq!(
                        f32::from_le_bytes(value.try_into().unwrap()),
                        want,
                        "{op:?} element {i}"
                    );
                }
            }
        }
    }

    #[tokio::test]
    async fn a_lent_region_is_neither_overwritten_nor_handed_back_while_the_peer_holds_it() {
        let links = chorus_transports::local::local_mesh(2);
        // Two 1 MiB segments per chunk: rank 0 lends chunk 1's two segments.
        let count = 1 << 20;
        let (signature, plans) = ring_all_reduce(count, ReduceOp::Sum);
        let pool = FramePool::default();
        let mut output = crate::lend::LentOutput::new(1f32.to_le_bytes().repeat(count).into());
        let lender = output.lender();
        let (_abort, aborts) = watch::channel(None);
        let job = Job {
            rank: 0,
            links: &links[0],
            channel: 0,
            signature,
            plan: &plans[0],
            announce_to: vec![1],
            check_from: vec![1],
            sign_data: false,
            input: Bytes::new(),
            output: output.as_mut_slice().expect("nothing lent yet"),
            timeout: Duration::from_secs(30),
            pool: &pool,
            lender: Some(lender.clone()),
            abort: aborts,
        };
        let mut ranked = Box::pin(run(job));
        // Rank 1 by hand: its signature and every frame of its plan at once
        // (its all-gather would overwrite rank 0's lent chunk), while it
        // holds all that rank 0 sends it.
        let peer = links[1][0].clone().expect("a link to rank 0");
        peer.send(0, SIGNATURE_TAG, Bytes::copy_from_slice(&signature.encode()))
            .await
            .unwrap();
        for step in plans[1].steps() {
            if let Action::Send {
                tag,
                src: Region::Output(r),
                ..
            } = &step.action
            {
                peer.send(0, data_tag(*tag), Bytes::from(vec![0; r.len() * 4]))
                    .await
                    .unwrap();
            }
        }
        let mut held = Vec::new();
        tokio::select! {
            result = &mut ranked => panic!("returned while its output was lent: {result:?}"),
            () = async {
                // Its signature, two reduce-scatter and two all-gather segments.
                for _ in 0..5 {
                    held.push(peer.recv(0).await.unwrap());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            } => {}
        }
        assert_eq!(lender.outstanding(), 4, "every segment went as a view");
        drop(held);
        tokio::time::timeout(Duration::from_secs(10), ranked)
            .await
            .expect("the release did not wake the collective")
            .unwrap();
        assert_eq!(lender.outstanding(), 0);
        let output = output.into_inner().expect("nothing lent any more");
        // Chunk 0 reduced (1 + 0), chunk 1 copied from rank 1 (0).
        assert!(output[..count * 2].chunks_exact(4).all(|v| v == 1f32.to_le_bytes()));
        assert!(output[count * 2..].iter().all(|&b| b == 0));
    }

    #[test]
    fn the_frame_pool_keeps_a_bounded_number_of_bytes() {
        let pool = FramePool::default();
        let held = || pool.0.lock().unwrap().iter().map(Vec::capacity).sum::<usize>();
        // Two 1 MiB frames come back and are reused.
        let (a, b) = (pool.frame(&[1; 1 << 20]), pool.frame(&[2; 1 << 20]));
        assert_eq!(&a[..4], &[1; 4]);
        drop((a, b));
        assert_eq!(pool.0.lock().unwrap().len(), 2);
        let again = pool.frame(&[3; 1000]);
        assert_eq!((&again[..], pool.0.lock().unwrap().len()), (&[3; 1000][..], 1));
        drop(again);
        // A frame larger than the whole budget is freed, not kept.
        drop(pool.frame(&vec![4; POOLED_BYTES + 1]));
        assert_eq!(pool.0.lock().unwrap().len(), 2);
        // Many frames in flight at once: at most POOLED_BYTES stay.
        let many: Vec<Bytes> = (0..64).map(|_| pool.frame(&[5; 1 << 20])).collect();
        drop(many);
        assert!(held() <= POOLED_BYTES, "{} bytes pooled", held());
        assert!(held() >= POOLED_BYTES - (1 << 20), "the pool still reuses");
    }
}
