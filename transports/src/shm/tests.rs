//! The link's tests, named after the rules of the module doc they check
//! (`shm4_...`), and the two-process ones (a child process runs
//! [`child_process`]).
//! The cursor's own tests are in `tests/ring.rs`.

use std::future::Future;
use std::io::{BufRead, BufReader, Read, Write};
use std::pin::pin;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::ring::{DATA, RECORD_HEADER, RecordHeader, SKIP};
use super::*;
use crate::link::{CloseNotice, Frame, HEARTBEAT_CHANNEL, Link, TransportError, TransportKind};

mod ring;

/// The env var naming a child process's role in the two-process tests.
const ROLE: &str = "CHORUS_SHM_TEST_ROLE";
const PARENT_NONCE: &str = "CHORUS_SHM_TEST_PARENT_NONCE";
const NONCE_LINE: &str = "CHORUS_SHM_TEST_NONCE=";
/// Where a child process makes its rings (default: `/dev/shm`).
const DIR: &str = "CHORUS_SHM_TEST_DIR";
const BIG: usize = 64 << 20;

async fn within<T>(fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), fut)
        .await
        .expect("shm test hung")
}

fn options(capacity: usize) -> ShmOptions {
    ShmOptions {
        capacity,
        connect_timeout: Duration::from_secs(10),
        ..ShmOptions::default()
    }
}

/// Links 0 -> 1 and 1 -> 0 between two endpoints of this process.
async fn pair(capacity: usize) -> (ShmLink, ShmLink) {
    pair_with(options(capacity)).await
}

async fn pair_with(options: ShmOptions) -> (ShmLink, ShmLink) {
    let a = ShmEndpoint::new(0, options.clone()).unwrap();
    let b = ShmEndpoint::new(1, options).unwrap();
    let (ab, ba) = tokio::join!(
        a.connect(ShmPeer {
            rank: 1,
            nonce: b.nonce()
        }),
        b.connect(ShmPeer {
            rank: 0,
            nonce: a.nonce()
        })
    );
    let (ab, ba) = (ab.unwrap(), ba.unwrap());
    for (endpoint, peer) in [(&a, 1), (&b, 0)] {
        let path = ring_path(&endpoint.options.dir, endpoint.nonce, peer);
        assert!(!path.exists(), "{} must be unlinked once mapped", path.display());
    }
    (ab, ba)
}

fn pattern(len: usize, seed: u8) -> Bytes {
    Bytes::from((0..len).map(|i| (i % 251) as u8 ^ seed).collect::<Vec<u8>>())
}

#[test]
fn shm1_every_endpoint_draws_its_own_nonce_and_names_its_rings_by_it() {
    let nonces: std::collections::HashSet<u64> = (0..256)
        .map(|_| ShmEndpoint::new(0, ShmOptions::default()).expect("a nonce").nonce())
        .collect();
    assert_eq!(nonces.len(), 256, "two endpoints drew the same nonce");
    let dir = Path::new("/dev/shm");
    let (a, b) = (ring_path(dir, 1, 3), ring_path(dir, 2, 3));
    assert_ne!(a, b, "rings of two writers to one reader share a name");
    assert_eq!(a, dir.join("chorus-0000000000000001-to-3"));
}

#[tokio::test]
async fn shm6_frames_on_several_channels_arrive_in_order_and_apart() {
    within(async {
        let (a, b) = pair(1 << 20).await;
        // Within the queue depth (16): a channel left unread beyond it
        // stalls the others (see the module doc).
        for tag in 0..16u64 {
            a.send(1, tag, pattern(100 + tag as usize, 1)).await.unwrap();
            a.send(2, 1000 + tag, Bytes::new()).await.unwrap();
        }
        // Channel 2 is read first although frames were interleaved.
        for tag in 0..16u64 {
            let frame = b.recv(2).await.unwrap();
            assert_eq!((frame.tag, frame.payload.len()), (1000 + tag, 0));
        }
        for tag in 0..16u64 {
            let frame = b.recv(1).await.unwrap();
            assert_eq!(frame.tag, tag);
            assert_eq!(frame.payload, pattern(100 + tag as usize, 1));
            assert_eq!(frame.payload.as_ptr() as usize % RECORD_HEADER, 0);
        }
        b.send(9, 5, Bytes::from_static(b"back")).await.unwrap();
        assert_eq!(a.recv(9).await.unwrap().payload, Bytes::from_static(b"back"));
        assert_eq!(a.kind(), TransportKind::Shm);
    })
    .await;
}

#[tokio::test]
async fn shm10_an_empty_ring_starts_over_at_its_start_and_a_busy_one_goes_on() {
    within(async {
        let (a, b) = pair(4 << 20).await;
        let capacity = b.shared.inbound.capacity as usize;
        let offset = |frame: &Frame| (frame.payload.as_ptr() as usize - b.shared.inbound.at(0) as usize) % capacity;
        // Each frame received before the next is sent: the ring is empty
        // at every send, so records stay near the ring's start (within
        // RESTART_AFTER and a frame), cache-warm.
        for tag in 0..100u64 {
            a.send(0, tag, pattern(60 << 10, tag as u8)).await.unwrap();
            let frame = b.recv(0).await.unwrap();
            assert!(frame.payload == pattern(60 << 10, tag as u8));
            // A quarter of the 4 MiB ring, which 100 frames of 60 KiB
            // would go round one and a half times without starting over.
            assert!(offset(&frame) < 1 << 20, "frame {tag} at offset {}", offset(&frame));
        }
        // A frame larger than the space before the writer's position is
        // written where the writer is, not after a skip.
        let before = b.shared.inbound.header().writer.head.load(Ordering::SeqCst) as usize % capacity;
        a.send(0, 100, pattern(3 << 20, 1)).await.unwrap();
        let frame = b.recv(0).await.unwrap();
        assert!(frame.payload == pattern(3 << 20, 1));
        assert_eq!(offset(&frame), (before + RECORD_HEADER) % capacity);
        drop(frame);
        // Frames left unreceived keep the ring busy: the writer goes on
        // past RESTART_AFTER, and everything arrives in order.
        for tag in 0..40u64 {
            a.send(1, tag, pattern(60 << 10, tag as u8)).await.unwrap();
        }
        let mut furthest = 0;
        for tag in 0..40u64 {
            let frame = b.recv(1).await.unwrap();
            assert_eq!(frame.tag, tag);
            assert!(frame.payload == pattern(60 << 10, tag as u8));
            furthest = furthest.max(offset(&frame));
        }
        assert!(furthest > 2 << 20, "a busy ring started over (furthest {furthest})");
        // A frame larger than the ring, received as it comes: the ring
        // may empty between its pieces, and a skip among them is
        // passed over.
        let a = Arc::new(a);
        for seed in 0..3 {
            let sender = tokio::spawn({
                let a = a.clone();
                async move { a.send(2, seed, pattern(10 << 20, seed as u8)).await }
            });
            let frame = b.recv(2).await.unwrap();
            assert!(frame.payload == pattern(10 << 20, seed as u8));
            sender.await.unwrap().unwrap();
        }
    })
    .await;
}

#[tokio::test]
async fn shm5_a_64_mib_frame_and_frames_larger_than_the_ring_arrive_intact() {
    within(async {
        let (a, b) = pair(ShmOptions::default().capacity).await;
        let big = pattern(BIG, 7);
        a.send(0, 1, big.clone()).await.unwrap();
        let frame = b.recv(0).await.unwrap();
        let ring = b.shared.inbound.at(0) as usize;
        assert!(
            (ring..ring + 2 * b.shared.inbound.capacity as usize).contains(&(frame.payload.as_ptr() as usize)),
            "a frame that fits the ring is received without a copy"
        );
        assert!(frame.payload == big);
        drop(frame);
        // 5 MiB through a 1 MiB ring goes in pieces, reassembled.
        let (a, b) = pair(1 << 20).await;
        let sender = tokio::spawn(async move {
            for seed in 0..3 {
                a.send(4, seed as u64, pattern(5 << 20, seed)).await.unwrap();
            }
            a
        });
        for seed in 0..3 {
            let frame = b.recv(4).await.unwrap();
            assert_eq!(frame.tag, seed as u64);
            assert!(frame.payload == pattern(5 << 20, seed));
        }
        // With no receive waiting, the watcher takes the pieces in, so
        // the send completes before anyone receives.
        let a = sender.await.unwrap();
        a.send(4, 9, pattern(3 << 20, 9)).await.unwrap();
        let frame = b.recv(4).await.unwrap();
        assert_eq!(frame.tag, 9);
        assert!(frame.payload == pattern(3 << 20, 9));
    })
    .await;
}

/// Sends three frames on channel 3 that `b` leaves unreceived, then
/// `frames` on channel 4 from a task, which need the ring's room.
async fn behind_unreceived_frames(frames: Vec<Bytes>) {
    within(async {
        let (a, b) = pair(1 << 20).await;
        for tag in 0..3 {
            a.send(3, tag, pattern(1000, tag as u8)).await.unwrap();
        }
        let sender = tokio::spawn({
            let frames = frames.clone();
            async move {
                for (tag, frame) in frames.into_iter().enumerate() {
                    a.send(4, tag as u64, frame).await.unwrap();
                }
                a
            }
        });
        for (tag, sent) in frames.iter().enumerate() {
            let frame = tokio::time::timeout(Duration::from_secs(5), b.recv(4))
                .await
                .unwrap_or_else(|_| panic!("frame {tag} on channel 4 never came: the unreceived frames pin the ring"))
                .unwrap();
            assert_eq!(frame.tag, tag as u64);
            assert!(frame.payload == *sent);
        }
        let _a = sender.await.unwrap();
        for tag in 0..3 {
            let frame = b.recv(3).await.unwrap();
            assert_eq!((frame.tag, frame.payload), (tag, pattern(1000, tag as u8)));
        }
    })
    .await;
}

#[tokio::test]
async fn shm9_unreceived_frames_are_copied_out_when_a_frame_larger_than_the_ring_needs_their_room() {
    behind_unreceived_frames(vec![pattern(5 << 20, 4)]).await;
}

#[tokio::test]
async fn shm9_unreceived_frames_are_copied_out_when_later_frames_wrap_the_ring() {
    behind_unreceived_frames((0..40).map(|seed| pattern(64 << 10, seed)).collect()).await;
}

#[tokio::test]
async fn shm6_a_full_queue_holds_the_frames_behind_it_until_its_channel_takes_one() {
    within(async {
        let (a, b) = pair_with(ShmOptions {
            depth: 2,
            ..options(1 << 20)
        })
        .await;
        for tag in 0..3 {
            a.send(1, tag, pattern(64, 1)).await.unwrap();
        }
        a.send(2, 7, Bytes::from_static(b"behind")).await.unwrap();
        // Channel 1's queue holds two: its third frame waits for room,
        // and channel 2's frame waits behind it (the module doc).
        let early = tokio::time::timeout(Duration::from_millis(150), b.recv(2)).await;
        assert!(early.is_err(), "a frame behind a full queue came: {early:?}");
        assert_eq!(b.recv(1).await.unwrap().tag, 0);
        assert_eq!(b.recv(2).await.unwrap().payload, Bytes::from_static(b"behind"));
        for tag in 1..3 {
            assert_eq!(b.recv(1).await.unwrap().tag, tag);
        }
    })
    .await;
}

#[tokio::test]
async fn shm6_shm7_a_waiting_receive_is_woken_for_its_channel_only_and_lowers_its_bit_when_done() {
    within(async {
        let (a, b) = pair(1 << 20).await;
        let b = Arc::new(b);
        let awaited = || b.shared.inbound.header().reader.awaited.load(Ordering::SeqCst);
        let heartbeat = tokio::spawn({
            let b = b.clone();
            async move { b.recv(HEARTBEAT_CHANNEL).await }
        });
        let data = tokio::spawn({
            let b = b.clone();
            async move { b.recv(3).await }
        });
        // Both wait past their polling, with their bits up.
        while awaited() != (1 << 31 | 1 << 3) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        a.send(3, 1, pattern(10, 3)).await.unwrap();
        let frame = data.await.unwrap().unwrap();
        assert_eq!((frame.tag, frame.payload), (1, pattern(10, 3)));
        assert_eq!(awaited(), 1 << 31, "the data receive is done");
        assert!(
            !heartbeat.is_finished(),
            "a heartbeat receive took another channel's frame"
        );
        a.send(HEARTBEAT_CHANNEL, 2, Bytes::new()).await.unwrap();
        assert_eq!(heartbeat.await.unwrap().unwrap().tag, 2);
        assert_eq!(awaited(), 0);
    })
    .await;
}

#[tokio::test]
async fn a_borrowed_payload_goes_straight_in_only_when_the_ring_has_room() {
    within(async {
        let (a, b) = pair(64 << 10).await;
        let piece = pattern((16 << 10) - RECORD_HEADER, 3);
        // 4 records fill the ring; the fifth finds no room, and one
        // larger than the ring never goes this way.
        for tag in 0..4 {
            assert_eq!(a.try_send_copy(0, tag, &piece), Ok(true));
        }
        assert_eq!(a.try_send_copy(0, 4, &piece), Ok(false));
        assert_eq!(a.try_send_copy(0, 5, &pattern(128 << 10, 0)), Ok(false));
        for tag in 0..4 {
            let frame = b.recv(0).await.unwrap();
            assert_eq!((frame.tag, &frame.payload), (tag, &piece));
        }
        // Released: room again.
        assert_eq!(a.try_send_copy(0, 6, b"again"), Ok(true));
        assert_eq!(&b.recv(0).await.unwrap().payload[..], b"again");
        b.close("done");
        assert!(matches!(
            a.try_send_copy(0, 7, b"late"),
            Err(TransportError::PeerClosed { .. })
        ));
    })
    .await;
}

#[tokio::test]
async fn shm7_a_borrowed_send_waits_for_room_and_fails_when_the_peer_goes() {
    within(async {
        let (a, b) = pair(64 << 10).await;
        let piece = pattern((16 << 10) - RECORD_HEADER, 5);
        let send = |tag: u64, payload: Bytes| {
            let a = &a;
            async move { std::future::poll_fn(|cx| a.poll_send_copy(cx, 0, tag, &payload)).await }
        };
        for tag in 0..4 {
            assert_eq!(send(tag, piece.clone()).await, Ok(true));
        }
        assert_eq!(send(9, pattern(128 << 10, 0)).await, Ok(false), "larger than the ring");
        let mut held = Vec::new();
        for _ in 0..4 {
            held.push(b.recv(0).await.unwrap());
        }
        // The ring is full: the fifth waits, then goes in once the
        // receiver drops the first payload.
        let mut fifth = pin!(send(4, piece.clone()));
        let waited = tokio::time::timeout(Duration::from_millis(200), fifth.as_mut()).await;
        assert!(waited.is_err(), "a full ring must make a borrowed send wait");
        held.remove(0);
        assert_eq!(fifth.await, Ok(true));
        held.push(b.recv(0).await.unwrap());
        assert_eq!((held[3].tag, &held[3].payload), (4, &piece));
        // Full again, with the peer gone while a send waits: it fails,
        // typed, instead of waiting for room that never comes.
        let mut sixth = pin!(send(5, piece.clone()));
        let waited = tokio::time::timeout(Duration::from_millis(100), sixth.as_mut()).await;
        assert!(waited.is_err(), "the ring is still full");
        b.cut("gone");
        assert!(matches!(sixth.await, Err(TransportError::Closed { peer: 1, .. })));
        assert!(matches!(
            send(6, piece.clone()).await,
            Err(TransportError::Closed { .. })
        ));
    })
    .await;
}

#[tokio::test]
async fn a_filled_send_writes_in_the_ring_only_once_it_has_room() {
    within(async {
        let (a, b) = pair(64 << 10).await;
        let len = (16 << 10) - RECORD_HEADER;
        let fills = std::sync::atomic::AtomicUsize::new(0);
        let send = |tag: u64, len: usize| {
            let (a, fills) = (&a, &fills);
            async move {
                std::future::poll_fn(|cx| {
                    a.poll_send_with(cx, 0, tag, len, &mut |dst: &mut [u8]| {
                        fills.fetch_add(1, Ordering::SeqCst);
                        dst.copy_from_slice(&pattern(dst.len(), tag as u8));
                    })
                })
                .await
            }
        };
        for tag in 0..4 {
            assert_eq!(send(tag, len).await, Ok(true));
        }
        assert_eq!(send(9, 128 << 10).await, Ok(false), "larger than the ring");
        assert_eq!(fills.load(Ordering::SeqCst), 4, "a refused frame is never filled");
        let first = b.recv(0).await.unwrap();
        assert_eq!((first.tag, &first.payload), (0, &pattern(len, 0)));
        // The ring is full: the fifth waits unfilled until the first goes.
        let mut fifth = pin!(send(4, len));
        let waited = tokio::time::timeout(Duration::from_millis(200), fifth.as_mut()).await;
        assert!(waited.is_err(), "a full ring must make a filled send wait");
        assert_eq!(fills.load(Ordering::SeqCst), 4, "a waiting frame is not filled yet");
        drop(first);
        assert_eq!(fifth.await, Ok(true));
        for tag in 1..5 {
            let frame = b.recv(0).await.unwrap();
            assert_eq!((frame.tag, &frame.payload), (tag, &pattern(len, tag as u8)));
        }
        b.cut("gone");
        assert!(matches!(send(6, len).await, Err(TransportError::Closed { .. })));
    })
    .await;
}

#[tokio::test]
async fn shm5_a_receiver_holding_payloads_makes_the_sender_wait() {
    within(async {
        let (a, b) = pair(64 << 10).await;
        // 4 records of 16 KiB fill the ring; the receiver keeps them all.
        let mut held = Vec::new();
        for tag in 0..4 {
            a.send(0, tag, pattern((16 << 10) - RECORD_HEADER, 0)).await.unwrap();
        }
        for _ in 0..4 {
            held.push(b.recv(0).await.unwrap());
        }
        let a = Arc::new(a);
        let blocked = tokio::spawn({
            let a = a.clone();
            async move { a.send(0, 4, pattern(100, 0)).await }
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!blocked.is_finished(), "the fifth send must wait for room");
        // Released out of order: nothing frees until the first goes.
        held.swap_remove(3);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!blocked.is_finished(), "tail must wait for the first record");
        held.remove(0);
        blocked.await.unwrap().unwrap();
        assert_eq!(b.recv(0).await.unwrap().tag, 4);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_dropped_loses_nothing_and_lowers_its_bit() {
    within(async {
        let (a, b) = pair(1 << 20).await;
        let cut = crate::link::tests::receives_cut_short_lose_nothing(&a, Arc::new(b), 200).await;
        assert!(cut > 0, "no receive was cut short: the test shows nothing");
    })
    .await;
    // A receive dropped while it waits, its bit up: the bit goes down and
    // the frame that comes later is the next receive's.
    within(async {
        let (a, b) = pair(1 << 20).await;
        let bit = || b.shared.inbound.header().reader.awaited.load(Ordering::SeqCst);
        let waited = tokio::time::timeout(Duration::from_millis(50), b.recv(5)).await;
        assert!(waited.is_err(), "nothing was sent");
        assert_eq!(bit(), 0, "a dropped receive lowers its channel's bit");
        a.send(5, 1, Bytes::from_static(b"later")).await.unwrap();
        assert_eq!(b.recv(5).await.unwrap().payload, Bytes::from_static(b"later"));
    })
    .await;
}

#[tokio::test]
async fn a_send_dropped_after_it_began_finishes_its_frame_and_one_dropped_before_sends_nothing() {
    within(async {
        let (a, b) = pair(1 << 20).await;
        // The receiver holds a record at the ring's start, so `tail` stays
        // there: a quarter-ring piece fits after it, the next ones do not.
        a.send(1, 0, pattern(600 << 10, 1)).await.unwrap();
        let held = b.recv(1).await.unwrap();
        let big = pattern(5 << 20, 2);
        let begun = tokio::time::timeout(Duration::from_millis(200), a.send(2, 1, big.clone())).await;
        assert!(begun.is_err(), "the frame cannot be sent while the ring is held");
        let head = a.shared.outbound.header().writer.head.load(Ordering::SeqCst);
        assert!(
            head > (600 << 10) + (256 << 10),
            "the dropped send wrote no piece (head {head})"
        );
        // Behind the frame still being written, a send that never got the
        // writer is dropped: it sends nothing.
        let behind = tokio::time::timeout(Duration::from_millis(50), a.send(3, 2, pattern(10, 3))).await;
        assert!(behind.is_err(), "a send behind a frame being written must wait");
        drop(held);
        let frame = b.recv(2).await.unwrap();
        assert_eq!(frame.tag, 1);
        assert!(frame.payload == big, "the dropped send's frame arrives whole");
        a.send(4, 3, pattern(10, 4)).await.unwrap();
        assert_eq!(
            b.recv(4).await.unwrap().payload,
            pattern(10, 4),
            "later frames follow it"
        );
        let late = tokio::time::timeout(Duration::from_millis(100), b.recv(3)).await;
        assert!(
            late.is_err(),
            "the send dropped before it began sent its frame: {late:?}"
        );
    })
    .await;
}

#[tokio::test]
async fn shm8_close_fails_both_sides_after_delivering_what_was_sent() {
    within(async {
        let (a, b) = pair(1 << 20).await;
        a.send(0, 1, Bytes::from_static(b"last words")).await.unwrap();
        a.close("test");
        let frame = b.recv(0).await.unwrap();
        assert_eq!(frame.payload, Bytes::from_static(b"last words"));
        let err = b.recv(0).await.unwrap_err();
        assert_eq!(err, CloseNotice::new("test").into_error(0));
        let err = b.send(0, 0, Bytes::from_static(b"kept")).await.unwrap_err();
        assert_eq!(err.payload, Bytes::from_static(b"kept"));
        let err = a.recv(0).await.unwrap_err();
        assert!(matches!(err, TransportError::Closed { peer: 1, .. }), "{err}");
    })
    .await;
}

#[tokio::test]
async fn shm8_a_close_on_purpose_carries_its_notice_both_ways_and_a_cut_or_a_drop_does_not() {
    within(async {
        let notice = CloseNotice {
            reason: "rank 0 aborted: rank 2 (pid 7) died".into(),
            failed: vec![2],
        };
        let (a, b) = pair(1 << 16).await;
        a.close_with(&notice);
        a.cut("too late: the first close counts");
        assert_eq!(b.recv(0).await.unwrap_err(), notice.clone().into_error(0));
        let err = b.send(0, 0, Bytes::new()).await.unwrap_err();
        assert!(
            matches!(err.error, TransportError::PeerClosed { peer: 0, .. }),
            "{}",
            err.error
        );

        let (a, b) = pair(1 << 16).await;
        a.cut("fault injection");
        let err = b.send(0, 0, Bytes::new()).await.unwrap_err();
        assert!(
            matches!(err.error, TransportError::Closed { peer: 0, .. }),
            "{}",
            err.error
        );

        let (a, b) = pair(1 << 16).await;
        drop(a);
        let err = b.recv(0).await.unwrap_err();
        assert!(matches!(err, TransportError::Closed { peer: 0, .. }), "{err}");
    })
    .await;
}

#[tokio::test]
async fn shm3_a_ring_with_a_bad_header_is_a_typed_error_and_leaks_nothing() {
    within(async {
        let b = ShmEndpoint::new(1, options(4096)).unwrap();
        let fake = 0x5eed_u64;
        let garbage = ring_path(&b.options.dir, fake, 1);
        std::fs::write(&garbage, vec![0xab; 2 * page_size()]).unwrap();
        let mut perms = std::fs::metadata(&garbage).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o600);
        std::fs::set_permissions(&garbage, perms).unwrap();
        let err = b.connect(ShmPeer { rank: 0, nonce: fake }).await.unwrap_err();
        std::fs::remove_file(&garbage).unwrap();
        assert!(
            matches!(&err, TransportError::Protocol { peer: 0, reason } if reason.contains("magic")),
            "{err}"
        );
        assert!(
            !ring_path(&b.options.dir, b.nonce, 0).exists(),
            "a failed connect removes its own ring"
        );
    })
    .await;
}

#[tokio::test]
async fn shm4_forged_record_lengths_are_typed_errors() {
    within(async {
        let (a, b) = pair(64 << 10).await;
        // A frame announced far over the receiver's limit.
        a.shared.put(0, 1, 2, 1 << 40, b"x");
        let err = b.recv(1).await.unwrap_err();
        assert!(
            matches!(err, TransportError::FrameTooLarge { peer: 0, len, .. } if len == 1 << 40),
            "{err}"
        );
        // A record header (kind, lengths) published alone.
        let forged = |a: &ShmLink, kind: u32, len: u64| {
            let record = RecordHeader {
                channel: 0,
                kind,
                tag: 0,
                len,
                total: len,
            }
            .encode();
            let ring = &a.shared.outbound;
            // SAFETY: the ring is empty and only this test writes to it.
            unsafe { std::ptr::copy_nonoverlapping(record.as_ptr(), ring.at(0), record.len()) };
            ring.header().writer.head.store(RECORD_HEADER as u64, Ordering::SeqCst);
            ring.poke();
        };
        // A record of an unknown kind, and skipped space longer than
        // what was published (SHM-10).
        for kind in [7, SKIP] {
            let (a, b) = pair(64 << 10).await;
            forged(&a, kind, 1000);
            let err = b.recv(0).await.unwrap_err();
            assert!(
                matches!(&err, TransportError::Protocol { peer: 0, reason } if reason.contains(&format!("kind {kind}"))),
                "{err}"
            );
        }
        // A frame longer than what was published.
        let (a, b) = pair(64 << 10).await;
        forged(&a, DATA, 1000);
        let err = b.recv(0).await.unwrap_err();
        assert!(matches!(err, TransportError::Protocol { peer: 0, .. }), "{err}");
        // The writer learns that the reader gave up, and why.
        let err = a.send(0, 0, Bytes::new()).await.unwrap_err();
        assert!(
            matches!(&err.error, TransportError::PeerClosed { peer: 1, reason, .. } if reason.contains("rank 0 broke the framing")),
            "{}",
            err.error
        );
    })
    .await;
}

#[tokio::test]
async fn shm2_a_peer_that_never_comes_times_out() {
    within(async {
        let a = ShmEndpoint::new(
            0,
            ShmOptions {
                connect_timeout: Duration::from_millis(200),
                ..options(4096)
            },
        )
        .unwrap();
        let err = a.connect(ShmPeer { rank: 1, nonce: 1 }).await.unwrap_err();
        assert!(matches!(err, TransportError::Connect { peer: 1, .. }), "{err}");
        assert!(!ring_path(&a.options.dir, a.nonce, 1).exists());
    })
    .await;
}

/// A child process running [`child_process`] in `role`, killed on drop.
struct ChildProcess {
    child: Child,
    nonce: u64,
}

impl ChildProcess {
    fn spawn(role: &str, parent_nonce: u64, env: &[(&str, String)]) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "shm::tests::child_process",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, role)
            .env(PARENT_NONCE, format!("{parent_nonce:016x}"))
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (found, nonce) = std::sync::mpsc::channel();
        // Reads the child's nonce, then drains its output.
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                // libtest may print the test's name on the same line.
                if let Some(at) = line.find(NONCE_LINE) {
                    let hex = line[at + NONCE_LINE.len()..].trim();
                    let _ = found.send(u64::from_str_radix(hex, 16).unwrap());
                }
            }
        });
        let nonce = nonce
            .recv_timeout(Duration::from_secs(20))
            .expect("the child did not print its nonce");
        Self { child, nonce }
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Rank 0 here, connected to rank 1 in a child process.
async fn with_child(role: &str, env: &[(&str, String)]) -> (ShmLink, ChildProcess) {
    let endpoint = ShmEndpoint::new(0, ShmOptions::default()).unwrap();
    let child = ChildProcess::spawn(role, endpoint.nonce(), env);
    let link = endpoint
        .connect(ShmPeer {
            rank: 1,
            nonce: child.nonce,
        })
        .await
        .unwrap();
    (link, child)
}

/// The other process of the two-process tests; does nothing unless
/// started by one of them.
#[test]
#[ignore = "a helper process started by the two-process tests"]
fn child_process() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let parent = u64::from_str_radix(&std::env::var(PARENT_NONCE).unwrap(), 16).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        if role == "tcp-sink" {
            return tcp_sink();
        }
        let options = match std::env::var(DIR) {
            Ok(dir) => ShmOptions {
                dir: dir.into(),
                ..ShmOptions::default()
            },
            Err(_) => ShmOptions::default(),
        };
        // "orphan": the parent never connects back, so the ring stays
        // in the connect window until the parent kills this process.
        let endpoint = ShmEndpoint::new(1, options).unwrap();
        println!("{NONCE_LINE}{:016x}", endpoint.nonce());
        std::io::stdout().flush().unwrap();
        let link = endpoint.connect(ShmPeer { rank: 0, nonce: parent }).await.unwrap();
        match role.as_str() {
            // Echoes channel 4's frame, then channel 3's five frames.
            "echo" => {
                for channel in [4, 3, 3, 3, 3, 3] {
                    let frame = link.recv(channel).await.unwrap();
                    link.send(channel, frame.tag, frame.payload).await.unwrap();
                }
                // The parent closes once it has every echo.
                let _ = link.recv(0).await;
            }
            // Sends one frame, reads nothing, waits to be killed.
            "hold" => {
                link.send(0, 7, Bytes::from_static(b"alive")).await.unwrap();
                tokio::time::sleep(Duration::from_secs(60)).await;
            }
            // Receives and drops frames until the count, then acks.
            "sink" => {
                let count: usize = std::env::var("CHORUS_SHM_TEST_COUNT").unwrap().parse().unwrap();
                for _ in 0..count {
                    let frame = link.recv(0).await.unwrap();
                    assert_eq!(frame.payload.len(), BIG);
                }
                link.send(0, 0, Bytes::new()).await.unwrap();
                let _ = link.recv(0).await;
            }
            other => panic!("unknown role {other}"),
        }
    });
}

/// Reads `count` 64 MiB transfers from the parent's TCP port into one
/// reused buffer, then acks with one byte.
fn tcp_sink() {
    let port: u16 = std::env::var("CHORUS_SHM_TEST_PORT").unwrap().parse().unwrap();
    let count: usize = std::env::var("CHORUS_SHM_TEST_COUNT").unwrap().parse().unwrap();
    println!("{NONCE_LINE}0");
    std::io::stdout().flush().unwrap();
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut buffer = vec![1u8; BIG];
    for _ in 0..count {
        stream.read_exact(&mut buffer).unwrap();
    }
    stream.write_all(&[1]).unwrap();
}

#[tokio::test]
async fn shm3_a_ring_left_by_a_killed_writer_is_removed_and_live_or_foreign_ones_stay() {
    within(async {
        let dir = PathBuf::from(format!("/dev/shm/chorus-sweep-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let env = [(DIR, dir.display().to_string())];
        let mut child = ChildProcess::spawn("orphan", 1, &env);
        let orphan = ring_path(&dir, child.nonce, 0);
        // Killed once the ring is initialized (its magic stored last).
        let initialized = || {
            let mut magic = [0u8; 8];
            File::open(&orphan).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && magic == MAGIC.to_le_bytes()
        };
        while !initialized() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        child.child.kill().unwrap();
        child.child.wait().unwrap();
        let dead_pid = child.child.id();
        // A ring of this live process, and one that claims the dead
        // pid in another pid namespace, where that pid may be alive.
        let live = ring_path(&dir, 2, 3);
        let (_live_ring, _) = Ring::create(&live, 4096, 2, 3).unwrap();
        let foreign = ring_path(&dir, 4, 5);
        let (foreign_ring, _) = Ring::create(&foreign, 4096, 4, 5).unwrap();
        let header = foreign_ring.header();
        header.writer_pid.store(dead_pid, Ordering::Relaxed);
        header.writer_pid_ns.fetch_add(1, Ordering::Relaxed);
        assert_eq!(remove_dead_rings(&dir), 1);
        assert!(!orphan.exists(), "the killed writer's ring is still there");
        assert!(live.exists() && foreign.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    })
    .await;
}

#[tokio::test]
async fn two_processes_exchange_frames_on_several_channels() {
    within(async {
        let (link, _child) = with_child("echo", &[]).await;
        let big = pattern(BIG, 3);
        for tag in 0..5u64 {
            link.send(3, tag, pattern(1000 + tag as usize, 9)).await.unwrap();
        }
        link.send(4, 99, big.clone()).await.unwrap();
        let frame = link.recv(4).await.unwrap();
        assert_eq!(frame.tag, 99);
        assert!(frame.payload == big, "the 64 MiB frame came back altered");
        for tag in 0..5u64 {
            let frame = link.recv(3).await.unwrap();
            assert_eq!(frame.tag, tag);
            assert_eq!(frame.payload, pattern(1000 + tag as usize, 9));
        }
        link.close("done");
    })
    .await;
}

#[tokio::test]
async fn shm7_a_peer_killed_with_sigkill_fails_sends_and_receives_within_seconds() {
    within(async {
        let (link, mut child) = with_child("hold", &[]).await;
        assert_eq!(link.recv(0).await.unwrap().tag, 7);
        let link = Arc::new(link);
        // The child reads nothing: fill its queue and the ring until a
        // send waits.
        let sender = tokio::spawn({
            let link = link.clone();
            async move {
                let frame = Bytes::from(vec![0u8; 16 << 20]);
                loop {
                    if let Err(e) = link.send(0, 0, frame.clone()).await {
                        return e;
                    }
                }
            }
        });
        let receiver = tokio::spawn({
            let link = link.clone();
            async move { link.recv(0).await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!sender.is_finished() && !receiver.is_finished());
        child.child.kill().unwrap();
        let killed = Instant::now();
        let err = sender.await.unwrap();
        assert!(
            matches!(err.error, TransportError::Closed { peer: 1, .. }),
            "{}",
            err.error
        );
        assert_eq!(err.payload.len(), 16 << 20);
        let err = receiver.await.unwrap().unwrap_err();
        assert!(matches!(err, TransportError::Closed { peer: 1, .. }), "{err}");
        assert!(killed.elapsed() < Duration::from_secs(2), "took {:?}", killed.elapsed());
    })
    .await;
}

/// Prints GB/s for 64 MiB transfers to another process, over shared
/// memory and over raw TCP on loopback, measured in the same run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: cargo test --release -p chorus-transports shm_throughput -- --ignored --nocapture"]
async fn shm_throughput_against_tcp() {
    const COUNT: usize = 20;
    let count = [("CHORUS_SHM_TEST_COUNT", (COUNT + 2).to_string())];
    let payload = pattern(BIG, 5);
    let gbps = |elapsed: Duration| (COUNT * BIG) as f64 / elapsed.as_secs_f64() / 1e9;

    let (link, _child) = with_child("sink", &count).await;
    // Two warm-up transfers, then the timed ones; the ack ends the clock.
    for _ in 0..2 {
        link.send(0, 0, payload.clone()).await.unwrap();
    }
    let start = Instant::now();
    for _ in 0..COUNT {
        link.send(0, 0, payload.clone()).await.unwrap();
    }
    link.recv(0).await.unwrap();
    let shm = gbps(start.elapsed());
    link.close("done");

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port().to_string();
    let _child = ChildProcess::spawn("tcp-sink", 0, &[count[0].clone(), ("CHORUS_SHM_TEST_PORT", port)]);
    let (mut stream, _) = listener.accept().unwrap();
    for _ in 0..2 {
        stream.write_all(&payload).unwrap();
    }
    let start = Instant::now();
    for _ in 0..COUNT {
        stream.write_all(&payload).unwrap();
    }
    stream.read_exact(&mut [0u8]).unwrap();
    let tcp = gbps(start.elapsed());
    println!(
        "64 MiB x {COUNT} to another process: shm {shm:.2} GB/s, raw TCP loopback {tcp:.2} GB/s ({:.2}x)",
        shm / tcp
    );
}
