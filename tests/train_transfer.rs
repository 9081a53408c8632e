//! Live state transfer (`chorus::train::sync_state`, issue 14) on real
//! ranks (`chorus::spawn`, ranks as actors in one process): joiners get state
//! byte-equal to the survivors' from 1, 2 and 3 sources; a lagging member
//! is brought forward; a chunk corrupted on the wire (`corrupt` fault) is
//! fetched again from another source; mismatched lists and a dying source
//! are errors on every rank, never a hang (also a silent one, at the
//! collective timeout, and a joiner frozen mid-transfer at its sources'
//! timeout); rank processes over shm (chunks written into the joiner's
//! memory by cross-memory attach) and QUIC, a chunk corrupted on its way
//! into a shm ring, a chunk damaged where it landed in the joiner's
//! memory, and a source frozen or killed between such writes;
//! `verify_state` names a diverged rank; `sync_verified` moves and checks
//! in one call, naming a divergence where nothing moved too.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use chorus::train::{TransferError, TransferOptions, TransferReport, sync_state, sync_verified, verify_state};
use chorus::{CollectiveError, InitOptions, NamedState};

mod common;
use common::within;

/// The tests set `CHORUS_FAULTS`, which `chorus::spawn` reads: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `body` on a fresh runtime with `CHORUS_FAULTS` set to `faults`
/// (`None`: unset), restoring it after.
fn run<T>(faults: Option<&str>, body: impl std::future::Future<Output = T>) -> T {
    let _serial = one_at_a_time();
    let saved = std::env::var("CHORUS_FAULTS").ok();
    let set = |value: Option<&str>| {
        // SAFETY: every test of this binary holds ONE_AT_A_TIME while it
        // sets the variable and while chorus::spawn reads it.
        unsafe {
            match value {
                Some(value) => std::env::set_var("CHORUS_FAULTS", value),
                None => std::env::remove_var("CHORUS_FAULTS"),
            }
        }
    };
    set(faults);
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(body);
    set(saved.as_deref());
    result
}

/// Odd sizes (entries cut across chunks, an empty one), buffers, optimizer
/// state and extras; `seed` changes every value.
fn state(seed: u32) -> NamedState {
    let values = |n: usize, k: u32| -> Vec<f32> {
        (0..n)
            .map(|i| f32::from_bits((i as u32).wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(k + 1) ^ 0x3f00_0000))
            .collect()
    };
    NamedState {
        params: vec![
            ("embed".into(), values(10_007, 1)),
            ("bias".into(), values(3, 2)),
            ("empty".into(), values(0, 3)),
            ("head".into(), values(77_777, 4)),
        ],
        buffers: vec![
            ("running_mean".into(), values(5, 5)),
            ("running_var".into(), values(13, 6)),
        ],
        optimizer: vec![
            ("embed.exp_avg".into(), values(10_007, 7)),
            ("head.exp_avg".into(), values(77_777, 8)),
        ],
        extra: format!("data position {seed}; rng {}", seed.wrapping_mul(31)).into_bytes(),
    }
}

/// Every value as bits, so equality is byte equality.
fn bits(state: &NamedState) -> (Vec<Vec<u32>>, Vec<u8>) {
    let all = state.params.iter().chain(&state.buffers).chain(&state.optimizer);
    (
        all.map(|(_, v)| v.iter().map(|x| x.to_bits()).collect()).collect(),
        state.extra.clone(),
    )
}

/// Small odd chunks, so a few hundred KiB make dozens of chunks.
fn small_chunks() -> TransferOptions {
    TransferOptions {
        chunk_bytes: 24_571,
        ..TransferOptions::default()
    }
}

fn options() -> InitOptions {
    InitOptions::default()
        .heartbeat_timeout(Duration::from_secs(1))
        .collective_timeout(Duration::from_secs(10))
}

/// Each rank's (step, starting state): `None` for a rank without state.
type Start = fn(usize) -> (Option<u64>, NamedState);

/// Runs `sync_state` on `world` in-process ranks and returns each rank's
/// result and state afterwards.
async fn transfer(
    world: usize,
    start: Start,
    transfer: TransferOptions,
) -> Vec<(Result<TransferReport, TransferError>, NamedState)> {
    chorus::spawn_with(world, options(), move |pg| {
        let transfer = transfer.clone();
        async move {
            let (step, mut state) = start(pg.rank());
            let report = sync_state(&pg, &mut state, step, &transfer).await;
            (report, state)
        }
    })
    .await
    .expect("the group forms")
}

/// The joiner's rank with 1, 2 or 3 sources: rank 0, 1 and 3 in turn.
fn joiner(sources: usize) -> usize {
    [0, 1, 3][sources - 1]
}

#[test]
fn a_joiner_gets_the_survivors_state_byte_for_byte_from_one_two_and_three_sources() {
    for sources in 1..=3 {
        let world = sources + 1;
        let results = run(
            None,
            within(60, "state transfer to a joiner", async move {
                chorus::spawn_with(world, options(), move |pg| async move {
                    let joiner = joiner(world - 1);
                    let (step, mut state) = if pg.rank() == joiner {
                        let mut blank = state(99);
                        blank.extra.clear();
                        (None, blank)
                    } else {
                        (Some(41), state(7))
                    };
                    let report = sync_state(&pg, &mut state, step, &small_chunks()).await;
                    let verified = verify_state(&pg, &mut state).await;
                    (report, verified, state)
                })
                .await
                .expect("the group forms")
            }),
        );
        let joiner = joiner(sources);
        let expected = bits(&state(7));
        for (rank, (report, verified, state)) in results.into_iter().enumerate() {
            let report = report.unwrap_or_else(|e| panic!("{sources} sources, rank {rank}: {e}"));
            verified.unwrap_or_else(|e| panic!("{sources} sources, rank {rank}: verify: {e}"));
            assert_eq!(bits(&state), expected, "{sources} sources: rank {rank}'s state");
            assert_eq!(report.step, 41);
            assert_eq!(report.receivers, [joiner]);
            assert_eq!(report.sources, (0..world).filter(|&r| r != joiner).collect::<Vec<_>>());
            let entries: usize = 2 * 10_007 + 3 + 2 * 77_777 + 5 + 13;
            assert_eq!(report.bytes, (entries * 4 + state.extra.len()) as u64);
            assert_eq!(report.refetched, 0);
        }
    }
}

#[test]
fn a_lagging_member_is_brought_forward_and_equal_members_move_nothing() {
    let results = run(
        None,
        within(60, "a lagging member", async {
            transfer(
                3,
                |rank| match rank {
                    2 => (Some(4), state(4)),
                    _ => (Some(9), state(9)),
                },
                small_chunks(),
            )
            .await
        }),
    );
    for (rank, (report, state)) in results.iter().enumerate() {
        let report = report.as_ref().unwrap();
        assert_eq!(
            (report.step, &report.sources[..], &report.receivers[..]),
            (9, &[0, 1][..], &[2][..])
        );
        assert_eq!(bits(state), bits(&self::state(9)), "rank {rank}");
    }

    let results = run(
        None,
        within(60, "equal members", async {
            transfer(2, |_| (Some(3), state(3)), small_chunks()).await
        }),
    );
    for (report, _) in &results {
        let report = report.as_ref().unwrap();
        assert!(report.receivers.is_empty() && report.bytes == 0, "{report:?}");
    }

    // Nobody has state: rank 0's is everyone's, at step 0.
    let results = run(
        None,
        within(60, "no state anywhere", async {
            transfer(3, |rank| (None, state(rank as u32 + 1)), small_chunks()).await
        }),
    );
    for (report, state) in &results {
        let report = report.as_ref().unwrap();
        assert_eq!(
            (report.step, &report.sources[..], &report.receivers[..]),
            (0, &[0][..], &[1, 2][..])
        );
        assert_eq!(bits(state), bits(&self::state(1)));
    }
}

#[test]
fn a_corrupted_chunk_is_fetched_again_from_another_source() {
    // Rank 1's 12th frame to rank 0 is a chunk (the hello takes a few):
    // one bit of it flips on the wire.
    let results = run(
        Some("corrupt(1->0, p=1, after_frames=12, times=1)"),
        within(60, "a corrupted chunk", async {
            transfer(
                3,
                |rank| match rank {
                    0 => (
                        None,
                        NamedState {
                            extra: Vec::new(),
                            ..state(5)
                        },
                    ),
                    _ => (Some(12), state(12)),
                },
                small_chunks(),
            )
            .await
        }),
    );
    for (rank, (report, state)) in results.iter().enumerate() {
        let report = report.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(report.refetched, 1, "rank {rank}: one chunk fetched again");
        assert_eq!(bits(state), bits(&self::state(12)), "rank {rank}");
    }
}

#[test]
fn a_chunk_damaged_in_every_round_is_an_error_naming_it_on_every_rank() {
    let results = run(
        Some("corrupt(1->0, p=1, after_frames=12, times=1)"),
        within(60, "one round only", async {
            transfer(
                2,
                |rank| match rank {
                    0 => (None, state(5)),
                    _ => (Some(12), state(12)),
                },
                TransferOptions {
                    max_rounds: 1,
                    ..small_chunks()
                },
            )
            .await
        }),
    );
    for (rank, (report, _)) in results.iter().enumerate() {
        match report {
            Err(
                e @ TransferError::Corrupt {
                    receiver: 0,
                    sources,
                    rounds: 1,
                    ..
                },
            ) => {
                assert_eq!(sources, &[1], "rank {rank}");
                assert!(e.to_string().contains("raise max_rounds"), "{e}");
            }
            other => panic!("rank {rank}: expected Corrupt, got {other:?}"),
        }
    }
}

#[test]
fn mismatched_lists_are_a_typed_error_on_every_rank() {
    let results = run(
        None,
        within(30, "mismatched lists", async {
            transfer(
                3,
                |rank| {
                    let mut s = state(1);
                    if rank == 2 {
                        s.optimizer[1].1.pop();
                    }
                    (if rank == 1 { None } else { Some(1) }, s)
                },
                small_chunks(),
            )
            .await
        }),
    );
    for (rank, (report, _)) in results.iter().enumerate() {
        match report {
            Err(e @ TransferError::Mismatch { rank: 2, index: 7, .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("'head.exp_avg' float32 x 77777") && text.contains("77776"),
                    "{text}"
                );
            }
            other => panic!("rank {rank}: expected Mismatch at #7 naming rank 2, got {other:?}"),
        }
    }
}

#[test]
fn a_source_dying_mid_transfer_fails_every_rank_instead_of_hanging() {
    // Rank 1 (a source) dies after 15 frames: a few chunks in.
    let results = run(
        Some("kill(rank=1, after_frames=15)"),
        within(30, "a dying source", async {
            transfer(
                3,
                |rank| match rank {
                    0 => (None, state(5)),
                    _ => (Some(3), state(3)),
                },
                small_chunks(),
            )
            .await
        }),
    );
    for (rank, (report, _)) in results.iter().enumerate() {
        match report {
            Err(TransferError::Collective(_)) => {}
            other => panic!("rank {rank}: expected the group's failure, got {other:?}"),
        }
    }
    // The survivors saw the group aborted (what an ElasticGroup restarts on).
    assert!(matches!(
        &results[0].0,
        Err(TransferError::Collective(
            CollectiveError::GroupAborted(_) | CollectiveError::Transport(_)
        ))
    ));
}

#[test]
fn verify_state_names_the_diverged_ranks_and_their_first_entry() {
    let results = run(
        None,
        within(30, "verify_state", async {
            chorus::spawn_with(3, options(), |pg| async move {
                let mut s = state(2);
                match pg.rank() {
                    1 => s.buffers[1].1[12] = f32::from_bits(s.buffers[1].1[12].to_bits() ^ 1),
                    2 => s.extra.push(0),
                    _ => {}
                }
                verify_state(&pg, &mut s).await
            })
            .await
            .unwrap()
        }),
    );
    for (rank, verified) in results.iter().enumerate() {
        match verified {
            Err(TransferError::Diverged(ranks)) => {
                let named: Vec<(usize, &str)> = ranks.iter().map(|d| (d.rank, d.first.as_str())).collect();
                assert_eq!(named, [(1, "running_var"), (2, "extras")], "rank {rank}");
            }
            other => panic!("rank {rank}: expected Diverged, got {other:?}"),
        }
    }
}

/// Runs `sync_verified` on 3 in-process ranks, each starting as `start`
/// says, and returns each rank's result and state afterwards.
fn sync_verified_on_three(start: Start) -> Vec<(Result<TransferReport, TransferError>, NamedState)> {
    run(
        None,
        within(30, "sync_verified", async move {
            chorus::spawn_with(3, options(), move |pg| async move {
                let (step, mut state) = start(pg.rank());
                let report = sync_verified(&pg, &mut state, step, &small_chunks()).await;
                (report, state)
            })
            .await
            .unwrap()
        }),
    )
}

#[test]
fn sync_verified_moves_the_state_then_checks_it_and_names_a_divergence_where_nothing_moved() {
    // Nobody behind, all equal: nothing moves, and that is the check.
    for (rank, (report, _)) in sync_verified_on_three(|_| (Some(5), state(2))).iter().enumerate() {
        let report = report.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(
            report.receivers.is_empty() && report.bytes == 0,
            "rank {rank}: {report:?}"
        );
    }
    // A joiner: it receives, then every member's state is checked equal.
    let joined = sync_verified_on_three(|rank| match rank {
        2 => (None, state(9)),
        _ => (Some(5), state(2)),
    });
    for (rank, (report, after)) in joined.iter().enumerate() {
        let report = report.as_ref().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(report.receivers, [2], "rank {rank}");
        assert_eq!(bits(after), bits(&state(2)), "rank {rank}");
    }
    // Nobody behind, but two states differ at the same step: named on every rank.
    let diverged = sync_verified_on_three(|rank| {
        let mut s = state(2);
        match rank {
            1 => s.buffers[1].1[12] = f32::from_bits(s.buffers[1].1[12].to_bits() ^ 1),
            2 => s.extra.push(0),
            _ => {}
        }
        (Some(5), s)
    });
    for (rank, (verified, _)) in diverged.iter().enumerate() {
        match verified {
            Err(TransferError::Diverged(ranks)) => {
                let named: Vec<(usize, &str)> = ranks.iter().map(|d| (d.rank, d.first.as_str())).collect();
                assert_eq!(named, [(1, "running_var"), (2, "extras")], "rank {rank}");
            }
            other => panic!("rank {rank}: expected Diverged, got {other:?}"),
        }
    }
}

/// `chorus bench transfer` of 3 MiB in 256 KiB chunks from 2 source
/// processes to a joiner, which ends with verify_state (a rank whose
/// state differs exits with an error), over `transports`, with `extra`
/// flags.
fn bench_command(transports: &str, extra: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new(common::chorus_bin());
    command.args([
        "bench",
        "transfer",
        "--size",
        "3M",
        "--sources",
        "2",
        "--transport",
        transports,
        "--rounds",
        "1",
        "--chunk",
        "256K",
        "--json",
        "--timeout",
        "60",
    ]);
    command.args(extra);
    command
}

/// [`bench_command`] with `CHORUS_FAULTS` set to `faults`: the result rows.
fn bench_transfer(transports: &str, faults: Option<&str>, extra: &[&str]) -> Vec<serde_json::Value> {
    let _serial = one_at_a_time();
    let mut command = bench_command(transports, extra);
    if let Some(faults) = faults {
        command.env("CHORUS_FAULTS", faults);
    }
    let output = common::run(&mut command, 90, "chorus bench transfer", common::Stop::Kill);
    let text = common::joined(&output);
    assert!(output.status.success(), "{text}");
    let rows: Vec<serde_json::Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert_eq!(rows.len(), transports.split(',').count(), "{text}");
    rows
}

#[test]
fn rank_processes_transfer_over_shm_and_quic() {
    let rows = bench_transfer("shm,quic", None, &[]);
    // Over shm (processes of one host, which may write each other's
    // memory here: root, no Yama) every entry byte is written into the
    // joiner's memory by cross-memory attach; QUIC carries them in frames.
    for (row, link, path, cma) in [(&rows[0], "shm", "cma", 3 << 20), (&rows[1], "quic", "quic", 0)] {
        assert_eq!(row["link"], link, "{row}");
        assert_eq!(row["path"], path, "{row}");
        assert_eq!(row["cma_bytes"], cma, "{row}");
        assert_eq!(row["bytes"], (3 << 20) + 64, "{row}");
        assert_eq!(row["sources"], 2, "{row}");
        assert_eq!(row["refetched"], 0, "{row}");
        assert!(row["transfer_gbps"].as_f64().is_some_and(|g| g > 0.0), "{row}");
    }
}

#[test]
fn a_chunk_corrupted_on_its_way_into_a_shm_ring_is_fetched_again() {
    // Sources write chunks straight into the joiner's ring; a frame the
    // fault plan corrupts must take the owned path, where the fault acts.
    // Source 1's link carries a rule, so it writes no chunk into the
    // joiner's memory (the fault acts on every byte it sends); source 0's
    // link has none, so its chunks land by cross-memory attach.
    let rows = bench_transfer("shm", Some("corrupt(1->2, p=1, after_frames=8, times=1)"), &[]);
    assert_eq!(rows[0]["link"], "shm", "{}", rows[0]);
    assert_eq!(rows[0]["refetched"], 1, "the corrupted chunk went again: {}", rows[0]);
    assert_eq!(rows[0]["path"], "cma+ring", "{}", rows[0]);
}

#[test]
fn a_chunk_damaged_as_it_lands_by_cross_memory_attach_is_fetched_again() {
    // Chunk 3 comes from source 1 (3 mod 2) in round 0; after writing it
    // into the joiner's memory, source 1 flips one bit of it there. The
    // joiner's hash of what landed differs from the notice's checksum, so
    // the chunk goes again from source 0 in round 1, by the same path;
    // verify_state at the end proves the states equal. The bench makes
    // two transfers (one untimed): each fetches it again once.
    let rows = bench_transfer("shm", None, &["--damage-cma-chunk", "3"]);
    let row = &rows[0];
    assert_eq!(row["path"], "cma", "{row}");
    assert_eq!(
        row["refetched"], 2,
        "the damaged chunk went again in each transfer: {row}"
    );
    assert_eq!(row["cma_bytes"], 3 << 20, "every byte landed intact once: {row}");
}

/// Runs the shm transfer bench with `fault` acting on source 1 a few
/// notices in, its heartbeats out of the picture (60 s); checks that the
/// run failed and that source 1 had begun writing into the joiner's
/// memory before `acted` was logged. Returns the output and how long it ran.
fn fault_between_cross_memory_writes(fault: &str, collective_timeout: &str, acted: &str) -> (String, Duration) {
    let _serial = one_at_a_time();
    let mut command = bench_command("shm", &["--collective-timeout", collective_timeout]);
    command
        .env("CHORUS_FAULTS", fault)
        .env("CHORUS_HEARTBEAT_TIMEOUT", "60")
        .env(
            "CHORUS_LOG",
            "chorus::train::transfer=debug,chorus_transports::fault=warn",
        );
    let started = std::time::Instant::now();
    let output = common::run(&mut command, 90, "chorus bench transfer", common::Stop::Kill);
    let took = started.elapsed();
    let text = common::joined(&output);
    assert!(!output.status.success(), "{text}");
    let writing = text
        .find("writing chunks into the receiver's memory source=1")
        .unwrap_or_else(|| panic!("source 1 wrote into the joiner's memory: {text}"));
    let at = text
        .find(acted)
        .unwrap_or_else(|| panic!("the fault acted ({acted}): {text}"));
    assert!(writing < at, "it acted mid-transfer: {text}");
    (text, took)
}

#[test]
fn a_source_silent_between_cross_memory_writes_is_a_timeout_at_the_collective_timeout() {
    // Source 1 freezes (a freeze changes no frame, so its link still
    // writes into the joiner's memory); the transfer's own deadlines (the
    // collective timeout, 2 s) must end every rank.
    let (text, took) =
        fault_between_cross_memory_writes("freeze(rank=1, after_frames=12)", "2", "freezing this rank rank=1");
    assert!(took < Duration::from_secs(20), "{took:?}: {text}");
    assert!(
        text.contains("within 2s (the collective timeout)") || text.contains("Timed out after 2"),
        "a deadline of 2 s ended it: {text}"
    );
}

#[test]
fn a_source_killed_between_cross_memory_writes_fails_the_transfer_at_once() {
    // Source 1 is SIGKILLed: its links close, so every rank fails well
    // before the heartbeat window (60 s) or the collective timeout (10 s)
    // would say so.
    let (text, took) =
        fault_between_cross_memory_writes("kill(rank=1, after_frames=12)", "10", "killing this rank rank=1");
    assert!(took < Duration::from_secs(9), "{took:?}: {text}");
}

#[test]
fn a_silent_source_is_a_timeout_at_the_collective_timeout() {
    // Rank 1 freezes after 15 frames; heartbeats would take 60 s to notice,
    // so the deadlines (the collective timeout, 2 s) must.
    let started = std::time::Instant::now();
    let results = run(
        Some("freeze(rank=1, after_frames=15)"),
        within(30, "a frozen source", async {
            let options = InitOptions::default()
                .heartbeat_timeout(Duration::from_secs(60))
                .collective_timeout(Duration::from_secs(2));
            chorus::spawn_with(3, options, |pg| async move {
                let (step, mut state) = match pg.rank() {
                    0 => (None, state(5)),
                    _ => (Some(3), state(3)),
                };
                sync_state(&pg, &mut state, step, &small_chunks()).await
            })
            .await
            .expect("the group forms")
        }),
    );
    // The joiner's frame deadline, the other source's all-gather deadline
    // or the frozen rank's own send deadline fires first (all 2 s): every
    // rank fails, well before the heartbeat window.
    assert!(
        matches!(
            &results[0],
            Err(TransferError::Timeout { .. } | TransferError::Collective(_))
        ),
        "{:?}",
        results[0]
    );
    assert!(results.iter().all(Result::is_err), "{results:?}");
    assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
}

#[test]
fn a_joiner_freezing_mid_transfer_is_a_timeout_on_its_sources() {
    // The joiner (rank 0) freezes as it takes in its 40th frame, a few
    // dozen chunks into the state (its hello needs fewer): it reads
    // nothing more, its links fill, and the sources' wait for room must
    // end at the collective timeout (2 s), heartbeats being far slower.
    let started = std::time::Instant::now();
    let results = run(
        Some("freeze(rank=0, after_received=40)"),
        within(30, "a frozen joiner", async {
            let options = InitOptions::default()
                .heartbeat_timeout(Duration::from_secs(60))
                .collective_timeout(Duration::from_secs(2));
            chorus::spawn_with(3, options, |pg| async move {
                let (step, mut state) = match pg.rank() {
                    0 => (None, big_state(5)),
                    _ => (Some(3), big_state(3)),
                };
                sync_state(&pg, &mut state, step, &small_chunks()).await
            })
            .await
            .expect("the group forms")
        }),
    );
    // A source whose deadline fires first names the joiner and aborts the
    // group; the other fails by its own deadline or by that abort.
    let names_the_joiner = |result: &Result<_, _>| matches!(result, Err(TransferError::Timeout { peer: 0, .. }));
    assert!(results[1..].iter().any(names_the_joiner), "{results:?}");
    for (rank, result) in results.iter().enumerate().skip(1) {
        assert!(
            names_the_joiner(result)
                || matches!(result, Err(TransferError::Collective(CollectiveError::GroupAborted(_)))),
            "source {rank}: expected a timeout naming the joiner or the group aborted, got {result:?}"
        );
    }
    assert!(results[0].is_err(), "{:?}", results[0]);
    assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
}

/// [`state`] with 16 MiB more optimizer state: far more chunks than the
/// links hold.
fn big_state(seed: u32) -> NamedState {
    let mut state = state(seed);
    state.optimizer.push(("momentum".into(), vec![seed as f32; 4 << 20]));
    state
}
