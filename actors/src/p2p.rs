//! Point-to-point operations as Gloo runs them: each send and receive runs
//! on its own as soon as it is submitted, beside the rank's collectives and
//! other point-to-point operations, so a receive posted before the matching
//! send (on either side), or two ranks exchanging tensors larger than the
//! transport's buffers, cannot deadlock.
//!
//! Rules:
//! - PP-1: operations of one lane (direction, peer, tag) run in the order
//!   they were submitted; different lanes run concurrently. Frames of one
//!   lane travel on one channel, so a send and its receive pair up in
//!   order, as Gloo matches them.
//! - PP-2: a tag selects the channel ([`p2p_channel`]); a receive waits
//!   only for the sends of its own tag. Tags equal modulo [`P2P_TAGS`]
//!   share a lane.
//! - PP-3: a receive from any source waits until no earlier receive of
//!   its tag is pending, then takes the first sender's message; it is the
//!   last operation of every receiving lane of its tag until it ends.
//! - PP-4: lanes number their operations when they start, so a receive
//!   from any source takes the number its sender's lane gave; both ends'
//!   signatures are checked as for collectives.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use std::time::Duration;

use chorus_runtime::collective::{CollectiveKind, PlanError, Signature};
use chorus_transports::link::{ChannelId, Frame, Link};
use futures_util::future::select_all;
use tokio::sync::watch;

use crate::driver::{CollectiveError, until_aborted};
use crate::supervision::GroupAborted;

/// The first channel of point-to-point operations: tag `t` uses
/// `P2P_FIRST_CHANNEL + t % P2P_TAGS` (PP-2).
pub const P2P_FIRST_CHANNEL: ChannelId = crate::rank::COLLECTIVE_CHANNELS;

/// Distinct point-to-point tags (PP-2).
pub const P2P_TAGS: u64 = 1 << 24;

/// The channel of tag `tag`'s messages (PP-2).
pub fn p2p_channel(tag: u64) -> ChannelId {
    P2P_FIRST_CHANNEL + (tag % P2P_TAGS) as ChannelId
}

/// Which way a lane carries messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Way {
    /// This rank sends.
    Out,
    /// This rank receives.
    In,
}

/// A lane: direction, peer, channel (PP-1).
pub(crate) type Lane = (Way, usize, ChannelId);

/// A queued operation's turn: the ends it waits for, and the end it marks.
pub(crate) struct Turn {
    before: Vec<watch::Receiver<bool>>,
    end: watch::Sender<bool>,
    numbers: Arc<Mutex<HashMap<Lane, u64>>>,
}

impl Turn {
    /// Waits until every operation before this one on its lanes has ended.
    pub(crate) async fn wait(&mut self) {
        for before in &mut self.before {
            // An Err: the operation before went away without marking its end,
            // which ends it as well.
            let _ = before.wait_for(|ended| *ended).await;
        }
    }

    /// The number of the next operation on `lane` (PP-4).
    pub(crate) fn number(&self, lane: Lane) -> u64 {
        let mut numbers = self.numbers.lock().unwrap_or_else(|p| p.into_inner());
        let next = numbers.entry(lane).or_default();
        *next += 1;
        *next - 1
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.end.send_replace(true);
    }
}

/// One rank's lanes: the last operation queued on each, and the numbers
/// they hand out.
#[derive(Debug, Default)]
pub(crate) struct Lanes {
    last: HashMap<Lane, watch::Receiver<bool>>,
    numbers: Arc<Mutex<HashMap<Lane, u64>>>,
}

impl Lanes {
    /// Queues an operation on `lanes` (several for a receive from any
    /// source): its turn comes once the operations queued before it on
    /// each of them have ended.
    pub(crate) fn enqueue(&mut self, lanes: &[Lane]) -> Turn {
        let (end, ended) = watch::channel(false);
        let before = lanes
            .iter()
            .filter_map(|lane| self.last.insert(*lane, ended.clone()))
            .collect();
        // Lanes whose last operation has ended are forgotten: a job that
        // uses many tags keeps no memory for the ones it is done with.
        self.last.retain(|_, last| !*last.borrow());
        Turn {
            before,
            end,
            numbers: self.numbers.clone(),
        }
    }
}

/// Waits for the first message of `channel` from any of `peers` (a
/// receive from any source, PP-3): returns the sender and the first frame
/// it sent, its signature. Receives that lost the race are dropped, which
/// loses no frame (every link's `recv` is cancel safe). `ours` and `rank`
/// name the receive in a timeout's error.
pub(crate) async fn first_sender(
    links: &[Option<Arc<dyn Link>>],
    peers: &[usize],
    channel: ChannelId,
    (ours, rank, timeout): (Signature, usize, Duration),
    abort: watch::Receiver<Option<GroupAborted>>,
) -> Result<(usize, Frame), CollectiveError> {
    let receives: Vec<_> = peers
        .iter()
        .filter_map(|&peer| {
            let link = links.get(peer)?.as_ref()?.clone();
            Some(Box::pin(async move { (peer, link.recv(channel).await) }))
        })
        .collect();
    if receives.is_empty() {
        return Err(PlanError::Root {
            kind: CollectiveKind::Recv,
            root: None,
            world: links.len(),
        }
        .into());
    }
    tokio::select! {
        biased;
        aborted = until_aborted(abort) => Err(aborted.into()),
        ((peer, received), _, _) = select_all(receives) => Ok((peer, received?)),
        () = tokio::time::sleep(timeout) => Err(CollectiveError::Timeout {
            signature: ours,
            rank,
            waited: timeout,
            waiting_for: peers.to_vec(),
        }),
    }
}

/// Checks a sender's signature frame (`encoded`) against this receive's.
pub(crate) fn check_sender(ours: &Signature, rank: usize, from: usize, encoded: &[u8]) -> Result<(), CollectiveError> {
    let theirs = Signature::decode(encoded).map_err(|e| CollectiveError::Protocol {
        peer: from,
        reason: e.to_string(),
    })?;
    match ours.mismatch(&theirs) {
        Some(detail) => Err(CollectiveError::Desync {
            ours_rank: rank,
            theirs_rank: from,
            detail,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(rx: &watch::Receiver<bool>) -> bool {
        *rx.borrow()
    }

    #[test]
    fn pp1_a_lane_runs_in_order_and_lanes_are_independent() {
        let mut lanes = Lanes::default();
        let a = (Way::Out, 1, p2p_channel(0));
        let b = (Way::In, 1, p2p_channel(0));
        let first = lanes.enqueue(&[a]);
        let second = lanes.enqueue(&[a]);
        let other = lanes.enqueue(&[b]);
        assert_eq!(second.before.len(), 1, "the second waits for the first");
        assert!(other.before.is_empty(), "another lane waits for nothing");
        assert!(!ended(&second.before[0]));
        drop(first);
        assert!(ended(&second.before[0]), "the first's end lets the second run");
    }

    #[test]
    fn pp2_tags_pick_channels_above_the_collectives() {
        assert_eq!(p2p_channel(0), crate::rank::COLLECTIVE_CHANNELS);
        assert_ne!(p2p_channel(1), p2p_channel(2));
        assert_eq!(p2p_channel(5), p2p_channel(5 + P2P_TAGS));
        // Far below the channels others reserve (heartbeats, transfers).
        assert!(p2p_channel(u64::MAX) < 0xFF00_0000);
    }

    #[test]
    fn pp3_a_receive_from_any_source_waits_for_and_holds_every_lane_of_its_tag() {
        let mut lanes = Lanes::default();
        let from = |peer| (Way::In, peer, p2p_channel(3));
        let named = lanes.enqueue(&[from(1)]);
        let any = lanes.enqueue(&[from(1), from(2)]);
        assert_eq!(any.before.len(), 1, "it waits for the named receive before it");
        let after = lanes.enqueue(&[from(2)]);
        assert_eq!(after.before.len(), 1, "a later receive from rank 2 waits for it");
        drop(named);
        assert!(!ended(&after.before[0]));
        drop(any);
        assert!(ended(&after.before[0]));
    }

    #[test]
    fn pp4_lanes_number_their_operations_apart() {
        let mut lanes = Lanes::default();
        let turn = lanes.enqueue(&[]);
        let a = (Way::Out, 1, p2p_channel(0));
        let b = (Way::Out, 1, p2p_channel(1));
        assert_eq!((turn.number(a), turn.number(a), turn.number(b)), (0, 1, 0));
    }

    #[test]
    fn ended_lanes_are_forgotten() {
        let mut lanes = Lanes::default();
        for tag in 0..100 {
            drop(lanes.enqueue(&[(Way::Out, 1, p2p_channel(tag))]));
        }
        lanes.enqueue(&[(Way::Out, 1, p2p_channel(100))]);
        assert!(lanes.last.len() <= 2, "{} lanes kept", lanes.last.len());
    }
}
