//! The ring's records without a mapping, driven by [`SliceRing`] (the
//! simulator the `shm_ring` fuzz target drives too), and the pure parts
//! ([`place`], [`Released`], [`RecordHeader`]) called directly.

use crate::shm::ring::{
    DATA, Place, RECORD_HEADER, RESTART_AFTER, RecordError, RecordHeader, Released, SKIP, piece_len, place, record_size,
};
use crate::shm::sim::{Got, SliceRing};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

fn payloads(got: &[Got]) -> Vec<(u32, u64, Vec<u8>)> {
    got.iter().map(|(c, t, p, _)| (*c, *t, p.clone())).collect()
}

#[test]
fn shm4_records_crossing_the_end_of_the_ring_arrive_intact() {
    let mut ring = SliceRing::new(4096, 1 << 20);
    // Sizes that are not multiples of 64 leave padding; 7 laps of the ring.
    let frames: Vec<_> = (0..60u64)
        .map(|tag| (tag as u32 % 3, tag, pattern(100 + 37 * tag as usize % 900, tag as u8)))
        .collect();
    let got = ring.exchange(&frames);
    assert_eq!(payloads(&got), frames);
    assert!(ring.head > 7 * 4096, "the ring went round");
    assert_eq!(ring.released.tail(), ring.head, "every record released");
    // Payloads are 64-byte aligned in the ring.
    assert!(
        got.iter()
            .all(|(_, _, _, at)| at.unwrap().0 % RECORD_HEADER as u64 == 0)
    );
}

#[test]
fn shm10_an_empty_ring_far_into_its_lap_restarts_after_a_skip_record() {
    let capacity = 4 << 20;
    let mut ring = SliceRing::new(capacity, 8 << 20);
    // Busy: two frames not yet released carry the writer past RESTART_AFTER.
    let frames = vec![(0, 0, pattern(600 << 10, 1)), (0, 1, pattern(600 << 10, 2))];
    for (channel, tag, payload) in &frames {
        assert!(ring.try_put(*channel, *tag, payload.len() as u64, payload));
    }
    assert!(ring.head > RESTART_AFTER);
    let got = ring.read().unwrap();
    assert_eq!(payloads(&got), frames);
    // A frame while the ring is busy goes where the writer is.
    let third = pattern(100, 3);
    let head = ring.head;
    assert!(ring.try_put(1, 2, 100, &third));
    assert_eq!(ring.read().unwrap()[0].3.unwrap().0, head);
    ring.release_all(&got);
    ring.released.release(head, head + record_size(100).unwrap());
    // Empty now: the next frame starts over at the lap's start.
    let head = ring.head;
    assert_eq!(
        place(head, ring.released.tail(), capacity as u64, record_size(100).unwrap()),
        Place::Restart { at: capacity as u64 }
    );
    assert!(ring.try_put(1, 3, 100, &third));
    let got = ring.read().unwrap();
    assert_eq!(got.len(), 1, "the skip record is passed over");
    assert_eq!(got[0].3.unwrap().0, capacity as u64);
    assert_eq!(ring.released.tail(), capacity as u64, "the skip is released as read");
    // A record larger than the space before the writer does not restart.
    ring.release_all(&got);
    let head = ring.head;
    let big = record_size((3 << 20) - 64).unwrap() + head % capacity as u64;
    assert_eq!(place(head, head, capacity as u64, big), Place::At(head));
}

#[test]
fn shm5_frames_larger_than_the_ring_come_in_pieces_of_a_quarter_ring() {
    let mut ring = SliceRing::new(4096, 1 << 20);
    assert_eq!(piece_len(4096), 1024 - RECORD_HEADER);
    let frames = vec![
        (1, 7, pattern(10_000, 1)),
        (2, 8, pattern(40, 2)),
        (1, 9, pattern(4096, 3)),
        (3, 10, Vec::new()),
    ];
    let got = ring.exchange(&frames);
    assert_eq!(payloads(&got), frames);
    assert!(got[0].3.is_none() && got[2].3.is_none(), "pieced together");
    assert!(got[1].3.is_some(), "one record");
}

#[test]
fn shm5_tail_passes_a_record_once_it_and_every_one_before_it_are_released() {
    let mut released = Released::default();
    assert_eq!(released.release(64, 128), None);
    assert_eq!(released.release(128, 256), None);
    assert_eq!(released.tail(), 0);
    assert_eq!(released.release(0, 64), Some(256));
    assert_eq!(released.release(256, 320), Some(320));
}

#[test]
fn shm4_a_full_ring_has_no_room_and_a_tail_past_head_is_none() {
    assert_eq!(place(0, 0, 4096, 4096), Place::At(0));
    assert_eq!(place(64, 0, 4096, 4096), Place::Full);
    assert_eq!(place(4096, 64, 4096, 64), Place::At(4096));
    assert_eq!(place(64, 1000, 4096, 64), Place::Full, "a broken reader's tail");
}

#[test]
fn shm4_forged_records_are_typed_errors_and_never_read_past_head() {
    let header = |kind, len, total| RecordHeader {
        channel: 5,
        kind,
        tag: 1,
        len,
        total,
    };
    type Case = (RecordHeader, u64, fn(&RecordError) -> bool);
    let cases: Vec<Case> = vec![
        // head moved less than a header, or past the capacity
        (header(DATA, 0, 0), 32, |e| matches!(e, RecordError::Head { .. })),
        (header(DATA, 0, 0), 8192, |e| matches!(e, RecordError::Head { .. })),
        // an unknown kind; a skip longer than published, or absurdly long
        (header(7, 0, 0), 64, |e| matches!(e, RecordError::Kind { kind: 7, .. })),
        (header(SKIP, 1000, 1000), 64, |e| {
            matches!(e, RecordError::Kind { kind: SKIP, .. })
        }),
        (header(SKIP, u64::MAX, u64::MAX), 4096, |e| {
            matches!(e, RecordError::Kind { .. })
        }),
        // over the reader's limit, longer than its frame or than published
        (
            header(DATA, 1, 1 << 40),
            128,
            |e| matches!(e, RecordError::TooLarge { len, .. } if *len == 1 << 40),
        ),
        (header(DATA, 100, 50), 192, |e| matches!(e, RecordError::Length { .. })),
        (header(DATA, 1000, 1000), 128, |e| {
            matches!(e, RecordError::Length { .. })
        }),
        (header(DATA, u64::MAX - 10, u64::MAX - 10), 4096, |e| {
            matches!(e, RecordError::TooLarge { .. })
        }),
    ];
    for (record, publish, expected) in cases {
        let mut ring = SliceRing::new(4096, 1 << 20);
        ring.forge(record, publish);
        let err = ring.read().unwrap_err();
        assert!(expected(&err), "{record:?} published {publish}: {err}");
        assert_eq!(ring.cursor.pos(), 0, "a bad record is not passed");
    }
    // A piece of another frame, and pieces longer than their frame.
    let mut ring = SliceRing::new(4096, 1 << 20);
    ring.forge(header(DATA, 64, 128), 128);
    ring.forge(
        RecordHeader {
            tag: 2,
            ..header(DATA, 64, 128)
        },
        128,
    );
    let err = ring.read().unwrap_err();
    assert!(
        matches!(
            err,
            RecordError::Interleaved {
                tag: 2,
                open_tag: 1,
                ..
            }
        ),
        "{err}"
    );
    let mut ring = SliceRing::new(4096, 1 << 20);
    ring.forge(header(DATA, 64, 100), 128);
    ring.forge(header(DATA, 64, 100), 128);
    let err = ring.read().unwrap_err();
    assert_eq!(err, RecordError::Overflow { total: 100 });
    assert_eq!(err.to_string(), "pieces overflow a 100-byte frame");
}

#[test]
fn record_headers_round_trip() {
    let record = RecordHeader {
        channel: u32::MAX - 1,
        kind: DATA,
        tag: 0x0102_0304_0506_0708,
        len: 17,
        total: 1 << 33,
    };
    assert_eq!(RecordHeader::decode(&record.encode()), record);
    assert_eq!(record_size(0), Some(64));
    assert_eq!(record_size(1), Some(128));
    assert_eq!(record_size(64), Some(128));
    assert_eq!(record_size(u64::MAX - 64), None);
}
