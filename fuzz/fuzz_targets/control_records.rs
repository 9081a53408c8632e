//! Control records read from the store (bincode, `chorus_runtime::codec`):
//! the rendezvous `PeerRecord` (`PeerRecord::decode`) and `Claimant`, and
//! the elastic rendezvous `Joiner`, which the pure membership decisions
//! (`accounted_for`, `assign_ranks`) then consume.
//!
//! Input: byte 0 picks the record type; the rest is the stored value. For
//! joiners, the rest is a list of values, each prefixed with a `u8` length
//! (a generation's `joiner/<i>` keys), and the ones that decode are the
//! members.
//!
//! Checks, besides "no panic, no allocation past `MAX_RECORD`":
//! - a decoded record encodes to at most the bytes it came from (the
//!   encoding is the shortest one; trailing bytes are refused) and decodes
//!   back to itself;
//! - `assign_ranks` gives a permutation of `0..n`, survivors first in
//!   old-rank order, new processes after them in arrival order;
//! - `accounted_for` holds only when some member names a previous world,
//!   and then every rank below it joined or was seen to fail.
#![no_main]

use chorus_runtime::codec;
use chorus_runtime::rendezvous::elastic::{Joiner, accounted_for, assign_ranks};
use chorus_runtime::rendezvous::{Claimant, PeerRecord};
use libfuzzer_sys::fuzz_target;

fn roundtrip<T>(bytes: &[u8], decode: impl Fn(&[u8]) -> Option<T>, encode: impl Fn(&T) -> Vec<u8>) -> Option<T>
where
    T: PartialEq + std::fmt::Debug,
{
    let value = decode(bytes)?;
    let encoded = encode(&value);
    assert!(
        encoded.len() <= bytes.len(),
        "{value:?} re-encodes to {} bytes, from {}",
        encoded.len(),
        bytes.len()
    );
    assert_eq!(decode(&encoded).as_ref(), Some(&value));
    Some(value)
}

fn joiners(data: &[u8]) {
    let mut members = Vec::new();
    let mut rest = data;
    while let Some((&len, tail)) = rest.split_first() {
        let len = usize::from(len).min(tail.len());
        let (record, tail) = tail.split_at(len);
        rest = tail;
        if let Some(joiner) = roundtrip(record, |b| codec::decode::<Joiner>(b).ok(), codec::encode) {
            members.push(joiner);
        }
    }

    let ranks = assign_ranks(&members);
    assert_eq!(ranks.len(), members.len());
    let mut by_rank = vec![usize::MAX; members.len()];
    for (i, &rank) in ranks.iter().enumerate() {
        assert_eq!(by_rank[rank], usize::MAX, "rank {rank} assigned twice");
        by_rank[rank] = i;
    }
    for pair in by_rank.windows(2) {
        let (a, b) = (&members[pair[0]], &members[pair[1]]);
        match (a.old_rank, b.old_rank) {
            (Some(x), Some(y)) => assert!(x < y || (x == y && pair[0] < pair[1])),
            (Some(_), None) => {}
            (None, Some(_)) => panic!("a new process ranked before a survivor"),
            (None, None) => assert!(pair[0] < pair[1], "new processes out of arrival order"),
        }
    }

    let accounted = accounted_for(&members);
    match members.iter().filter_map(|m| m.previous_world).max() {
        None => assert!(!accounted),
        // Check the answer only where checking it is cheap.
        Some(world) if world <= 4096 => {
            let expected = (0..world).all(|r| members.iter().any(|m| m.old_rank == Some(r) || m.failed.contains(&r)));
            assert_eq!(accounted, expected);
        }
        Some(_) => {}
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    match selector % 3 {
        0 => {
            if let Some(record) = roundtrip(bytes, |b| PeerRecord::decode(b).ok(), PeerRecord::encode) {
                for (name, _) in &record.extras {
                    assert!(record.extra(name).is_some());
                }
            }
        }
        1 => {
            roundtrip(bytes, |b| codec::decode::<Claimant>(b).ok(), codec::encode);
        }
        _ => joiners(bytes),
    }
});
