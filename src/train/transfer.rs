//! Live state transfer: members behind (a relaunched worker, a new node, a
//! lagging rank) receive the most advanced members' [`TrainState`] over the
//! group's own links, chunked, striped over every source, each chunk
//! checksummed and fetched again from another source when it arrives
//! damaged. Nothing is serialized: between rank processes of one host a
//! source writes each chunk straight into the receiver's state memory
//! (cross-memory attach: `process_vm_writev`, one copy) and sends only a
//! notice; elsewhere chunks are raw bytes read with
//! [`ParamBuffer::read_bytes`] (into the link's ring where it has one) and
//! written with [`ParamBuffer::write_bytes`] straight from the received
//! frame (a view of the ring).
//!
//! # Data flow of [`sync_state`]
//! 1. One all-gather of a [`Hello`] per rank: its step (or none), a
//!    fingerprint of its entry list, its extras' length, a nonce (and, for
//!    [`sync_verified`], a checksum of its whole state). A list
//!    that differs from rank 0's is [`TransferError::Mismatch`] on every
//!    rank (both lists are broadcast so every rank names the same entry).
//! 2. [`roles`]: sources are the ranks at the highest step, receivers
//!    everyone behind; nobody behind, nothing moves.
//! 3. Rounds ([`Schedule`]): in round 0 chunk `i` comes from source
//!    `i mod S`. On a shared-memory link the receiver first sends each of
//!    its sources an [`Offer`]: its pid and the address and length of
//!    every entry with a byte view ([`ParamBuffer::as_bytes_mut`]), when
//!    its state promises they stay put ([`TrainState::buffers_in_place`]). A
//!    source in another process whose link no fault acts on
//!    ([`Link::injects_faults`]) then writes each data chunk whose entries
//!    the offer covers into the receiver's memory, hashing each 256 KiB run
//!    just before it writes it, and sends a notice: the chunk's 16-byte
//!    [`Header`] alone. The receiver hashes the landed bytes in place,
//!    through pointers it takes when the notice arrives, while the sources
//!    write later chunks (the hash runs beside the copies, on the other
//!    core). Every other chunk (the extras, entries without a view, QUIC,
//!    in-process ranks, a link a fault acts on, a write the kernel refused)
//!    goes as a frame (`Header` + payload): written straight into the
//!    receiver's shared-memory ring where it can
//!    ([`Link::poll_send_with`]), otherwise read once into a frame that a
//!    sender task per receiver link sends. A receiver reads from all its
//!    sources at once (a reader task per link on [`TRANSFER_CHANNEL`],
//!    which checks each frame's [`checksum`] while the chunks checked
//!    before it are written into the state); a damaged frame is never
//!    written, a damaged landed chunk is written over in the next round.
//!    After each round all ranks all-gather a bitmap of the chunks that
//!    failed (and the bytes that landed by cross-memory attach), so they
//!    agree on the next round: each bad chunk from another source, up to
//!    `max_rounds`.
//! 4. The extras travel as the last chunk; receivers [`load_extra`] them.
//! 5. [`sync_verified`] only: every rank's per-entry checksums are
//!    compared ([`verify_state`]'s check, without its hello). Where nothing
//!    moved, the hellos' state checksums already agreed, so step 5 runs
//!    only when they differ, to name the entry.
//!
//! # Cross-memory attach: where it works, and what it asks
//! The kernel lets a process write another's memory where it may ptrace
//! it: same user, and under Yama `kernel.yama.ptrace_scope` 0, or root
//! (this machine). With `ptrace_scope` 1 (Ubuntu's default) sibling rank
//! processes may not, so every write fails with `EPERM`; the source then
//! logs a warning once and sends that receiver's chunks as frames for the
//! rest of the round, and the transfer succeeds as before (EPERM, ENOSYS,
//! EFAULT and partial writes all fall back so, per link). Nothing here
//! lowers a protection (no `PR_SET_PTRACER`). Only a state that promises,
//! in `unsafe` code ([`InPlace`](super::InPlace)), that its buffers are its
//! own memory and stay where they are is offered: another process writes
//! into them, so a buffer made for one visit would let it write into freed
//! memory. One that moved all the same is [`TransferError::Moved`]. A source checks the group is not aborted
//! before each write, and a receiver aborts the group before it returns an
//! error, but a source stopped between that check and its write (frozen,
//! then resumed) could still write one chunk after the receiver returned:
//! its state's bytes from the same step, into the buffer it offered.
//!
//! The chunks move on the raw links of the group, beside its actor (whose
//! operations run one at a time, RA-1, which would serialize the sources):
//! a link failure or a source that sends nothing within the group's
//! collective timeout aborts the group, as a failed collective does (RA-4),
//! and `sync_state` returns the error on every rank.
//!
//! # After a failure
//! An [`ElasticGroup`](crate::ElasticGroup) re-forms the group; every member
//! calls `sync_state` again on the new generation with **the step it passed
//! before**. A receiver whose state was half written passed an older step
//! (or `None`), so it is behind again and receives again, as long as one
//! member at the newest step survived. (If every such member died, the
//! half-written receiver must pass `None`: its state is no step's.)
//!
//! [`load_extra`]: TrainState::load_extra
//! [`Link::injects_faults`]: chorus_transports::link::Link::injects_faults

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chorus_actors::driver::CollectiveError;
use chorus_transports::link::{ChannelId, Link, TransportError, TransportKind};
use thiserror::Error;
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::cma;
use super::integrity;
use super::state::{StateEntry, TrainState, entries, for_each_entry};
use super::transfer_plan::{
    BLOCK, Chunks, HEADER, Header, Hello, Offer, Piece, Region, Roles, Schedule, block_checksum, checksum,
    chunk_checksum, combine, decode_round, encode_round, roles, segments,
};
use crate::group::ProcessGroup;
use crate::sync::plan::{self as sync_plan, ParamSpec};
use crate::sync::{Diverged, ParamBuffer};
use crate::tensor::Tensor;

/// The channel chunks travel on: past the collectives' (RA-2), the
/// point-to-point one (RA-3) and the subgroups' (`base + channel`, bases up
/// to `0xfffe << 16`), below the heartbeats'.
pub const TRANSFER_CHANNEL: ChannelId = 0xFFFF_FF00;

/// Frames a source keeps queued per receiver while it reads the next chunk.
const QUEUED_PER_RECEIVER: usize = 4;

/// How [`sync_state`] moves the state.
#[derive(Debug, Clone)]
pub struct TransferOptions {
    /// Bytes per chunk (each one frame, checksummed on its own).
    pub chunk_bytes: usize,
    /// Rounds in all, the first included: a chunk that fails its checksum
    /// is fetched again from another source in the next round, up to here.
    pub max_rounds: u32,
    /// Testing only (`None` in real use): in round 0, a source that wrote
    /// this chunk into a receiver's memory by cross-memory attach then
    /// flips one bit of what landed there, as a faulty write would, so a
    /// test sees the receiver catch it and fetch the chunk again.
    /// (`CHORUS_FAULTS` acts on frames; a link it acts on takes no
    /// cross-memory writes.)
    pub damage_cma_chunk: Option<usize>,
}

impl Default for TransferOptions {
    fn default() -> Self {
        Self {
            // Measured (bench/HISTORY.md §12, issue 14): on shm 1-2 MiB
            // chunks ran 1.5-3x faster than 8-32 MiB (a chunk stays in the
            // L2/L3 cache between its read, checksum and copy into the
            // ring), and on QUIC no slower.
            chunk_bytes: 2 << 20,
            max_rounds: 3,
            damage_cma_chunk: None,
        }
    }
}

/// What [`sync_state`] did; the same on every rank (but `elapsed`).
#[derive(Debug, Clone, Default)]
pub struct TransferReport {
    /// The agreed step: the most advanced members' step (0 when no member had state).
    pub step: u64,
    /// Ranks that sent.
    pub sources: Vec<usize>,
    /// Ranks that received (empty: all were equal, nothing moved).
    pub receivers: Vec<usize>,
    /// State bytes (entries and extras) each receiver got.
    pub bytes: u64,
    /// Chunks fetched again after a bad checksum.
    pub refetched: usize,
    /// Entry bytes that landed intact in receivers' memory by cross-memory
    /// attach, over all receivers (0: every chunk went on the links).
    pub cma_bytes: u64,
    /// Time the call took on this rank.
    pub elapsed: Duration,
}

/// Why the state could not be synced; every message says what to do.
#[derive(Error)]
pub enum TransferError {
    /// A collective failed, or the group was aborted (a member died).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// Ranks list different state.
    #[error(
        "rank {rank} lists different state than rank 0: at #{index} rank 0 has {reference}, rank {rank} has {other}; build the same model and optimizer on every rank"
    )]
    Mismatch {
        /// The first rank whose list differs from rank 0's.
        rank: usize,
        /// Position of the first difference.
        index: usize,
        /// Rank 0's entry there.
        reference: String,
        /// That rank's entry there.
        other: String,
    },
    /// A chunk failed its checksum from every source tried, in every round.
    #[error(
        "chunk {chunk} of the state reached rank {receiver} damaged from every source tried (ranks {}) in {rounds} rounds; check the links, or raise max_rounds",
        .sources.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
    )]
    Corrupt {
        /// The chunk.
        chunk: usize,
        /// The rank that could not get it.
        receiver: usize,
        /// The sources tried, one per round.
        sources: Vec<usize>,
        /// Rounds run.
        rounds: u32,
    },
    /// `load_extra` refused the sources' extras.
    #[error("load_extra refused the extras received from the survivors: {0}")]
    Extra(String),
    /// A source sent a frame that does not belong to this transfer.
    #[error("state transfer: rank {peer} sent {reason}; the group is aborted, sync again on the next generation")]
    Protocol {
        /// The sender.
        peer: usize,
        /// What was wrong.
        reason: String,
    },
    /// A chunk did not move to or from a rank within the group's collective timeout.
    #[error(
        "state transfer: no chunk moved to or from rank {peer} within {waited:?} (the collective timeout); the group is aborted, sync again on the next generation"
    )]
    Timeout {
        /// The silent peer.
        peer: usize,
        /// How long this rank waited.
        waited: Duration,
    },
    /// A buffer's memory moved while other processes wrote into it.
    #[error(
        "state transfer: the buffer of '{entry}' moved while other processes wrote into it; ParamBuffer::as_bytes_mut must return memory that stays put while the state is borrowed, or None"
    )]
    Moved {
        /// The entry.
        entry: String,
    },
    /// The state no longer agrees across ranks ([`verify_state`]).
    #[error("state diverged from rank 0 on {}", describe(.0))]
    Diverged(Vec<Diverged>),
}

chorus_runtime::debug_as_report!(TransferError);

fn describe(ranks: &[Diverged]) -> String {
    ranks
        .iter()
        .map(|d| format!("rank {} (first at '{}')", d.rank, d.first))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Collective: every member of `group` calls it, with the step its state is
/// at (`None`: it has none yet, a fresh joiner). Members behind the most
/// advanced step (or with `None`) receive that step's state from the most
/// advanced members; when no member has a step, rank 0 is the source and
/// the step is 0. Returns the same report on every rank. After an error,
/// call it again on the next generation with the same `step` (see the
/// module docs).
///
/// # Cancel safety
///
/// Not cancel safe: a receiver dropped half-way holds a state partly
/// written; the peers wait for it until their frame timeout. As after an
/// error, call it again with the same `step` on the next generation.
pub async fn sync_state(
    group: &ProcessGroup,
    state: &mut dyn TrainState,
    step: Option<u64>,
    options: &TransferOptions,
) -> Result<TransferReport, TransferError> {
    transfer(group, state, step, options, false).await
}

/// [`sync_state`], then [`verify_state`], as a join needs them, for less:
/// each member's [`Hello`] carries a checksum of its whole state, so when
/// nobody is behind (a group that only shrank) one collective both finds
/// nothing to move and shows the states equal; after a transfer the check
/// reuses the hello's agreement on the entry lists. A divergence is
/// [`TransferError::Diverged`], as from [`verify_state`].
///
/// # Cancel safety
///
/// As [`sync_state`].
pub async fn sync_verified(
    group: &ProcessGroup,
    state: &mut dyn TrainState,
    step: Option<u64>,
    options: &TransferOptions,
) -> Result<TransferReport, TransferError> {
    transfer(group, state, step, options, true).await
}

async fn transfer(
    group: &ProcessGroup,
    state: &mut dyn TrainState,
    step: Option<u64>,
    options: &TransferOptions,
    verify: bool,
) -> Result<TransferReport, TransferError> {
    let started = Instant::now();
    let list = entries(state);
    let extra = state.save_extra();
    // Hashed before the roles are known: a receiver's checksum is wasted,
    // but a group where nothing moves then needs no second collective.
    let sums = verify.then(|| entry_sums(state, Some(&extra)));
    let checksum = sums.as_deref().map(integrity::fingerprint);
    let hellos = hello(group, &list, step, extra.len(), checksum).await?;
    let roles = roles(&hellos.iter().map(|h| h.step).collect::<Vec<_>>());
    let sizes: Vec<usize> = list.iter().map(StateEntry::bytes).collect();
    let chunks = Chunks::new(&sizes, options.chunk_bytes);
    let mut report = TransferReport {
        step: roles.step,
        bytes: (chunks.total() + hellos[roles.sources[0]].extra_len as usize) as u64,
        sources: roles.sources.clone(),
        receivers: roles.receivers.clone(),
        ..TransferReport::default()
    };
    if roles.receivers.is_empty() {
        report.bytes = 0;
        report.sources.clear();
        if let Some(sums) = sums.filter(|_| hellos.iter().any(|h| h.state != hellos[0].state)) {
            // Some state differs: the rows name the entry.
            compare_sums(group, &list, &sums).await?;
        }
        report.elapsed = started.elapsed();
        return Ok(report);
    }
    let moving = Moving {
        roles: &roles,
        chunks: &chunks,
        sizes: &sizes,
        extra: &extra,
        extra_lens: &hellos.iter().map(|h| h.extra_len as usize).collect::<Vec<_>>(),
        // Rank 0's nonce names this call's frames; never u64::MAX (a signature's tag).
        nonce: hellos[0].nonce >> 1,
    };
    run_rounds(group, state, &moving, options, &mut report).await?;
    if verify {
        // Saved again: a receiver's extras are what it loaded.
        let extra = state.save_extra();
        compare_sums(group, &list, &entry_sums(state, Some(&extra))).await?;
    }
    report.elapsed = started.elapsed();
    tracing::info!(
        rank = group.rank(),
        step = report.step,
        bytes = report.bytes,
        sources = ?report.sources,
        receivers = ?report.receivers,
        refetched = report.refetched,
        cma_bytes = report.cma_bytes,
        elapsed_ms = report.elapsed.as_millis() as u64,
        "state transfer done"
    );
    Ok(report)
}

/// What one transfer moves, the same on every rank.
struct Moving<'a> {
    roles: &'a Roles,
    chunks: &'a Chunks,
    sizes: &'a [usize],
    /// This rank's extras (sent when it is a source).
    extra: &'a [u8],
    /// Every rank's extras' length.
    extra_lens: &'a [usize],
    /// The frames' tags start here, a round each.
    nonce: u64,
}

/// Step 3: the rounds, until every receiver holds every chunk intact (or
/// `max_rounds` ran out); then the receivers load the extras.
async fn run_rounds(
    group: &ProcessGroup,
    state: &mut dyn TrainState,
    moving: &Moving<'_>,
    options: &TransferOptions,
    report: &mut TransferReport,
) -> Result<(), TransferError> {
    let Moving {
        roles,
        chunks,
        sizes,
        extra,
        extra_lens,
        nonce,
    } = *moving;
    let tag = |round: u32| nonce.wrapping_add(u64::from(round));
    let me = group.rank();
    let mut schedule = Schedule::new(&roles.sources, &roles.receivers, chunks.count(), options.max_rounds);
    let mut received_extra = None;
    loop {
        let round = schedule.round();
        let mut bad = Vec::new();
        let mut cma_bytes = 0;
        if roles.sources.contains(&me) {
            let sends = schedule.sends(me);
            let sending = Sending {
                chunks,
                sizes,
                extra,
                round,
                tag: tag(round),
                damage: options.damage_cma_chunk.filter(|_| round == 0),
            };
            send_round(group, state, &sending, &sends).await?;
        } else {
            let receives = schedule.receives(me);
            let mut ctx = Receiving {
                state: &mut *state,
                chunks,
                sizes,
                extra_lens,
                round,
                tag: tag(round),
                extra: &mut received_extra,
                bad: &mut bad,
                cma_bytes: &mut cma_bytes,
            };
            receive_round(group, &mut ctx, &receives).await?;
        }
        let words = u64s(
            group
                .all_gather(Tensor::from_slice(&encode_round(chunks.count(), &bad, cma_bytes)))
                .await?,
        )?;
        let per_rank = words.len() / group.world_size();
        let mut all_bad: Vec<(usize, usize)> = Vec::new();
        for &r in &roles.receivers {
            let (bad, cma) =
                decode_round(chunks.count(), &words[r * per_rank..(r + 1) * per_rank]).ok_or_else(|| {
                    CollectiveError::Protocol {
                        peer: r,
                        reason: format!("state transfer: a round's row of {per_rank} words"),
                    }
                })?;
            all_bad.extend(bad.into_iter().map(|c| (r, c)));
            report.cma_bytes += cma;
        }
        match schedule.finish_round(&all_bad) {
            Ok(true) => break,
            Ok(false) => {
                tracing::warn!(
                    rank = me,
                    round,
                    chunks = all_bad.len(),
                    "state transfer: fetching damaged chunks again"
                );
            }
            Err(exhausted) => {
                return Err(TransferError::Corrupt {
                    chunk: exhausted.chunk,
                    receiver: exhausted.receiver,
                    sources: exhausted.tried,
                    rounds: round + 1,
                });
            }
        }
    }
    if let Some(extra) = received_extra {
        state.load_extra(&extra).map_err(TransferError::Extra)?;
    }
    report.refetched = schedule.refetched();
    Ok(())
}

/// Checksums of every entry (and the extras) compared across ranks: an
/// error on every rank naming each rank that differs from rank 0 and its
/// first differing entry.
///
/// # Cancel safety
///
/// Not cancel safe (a collective, see [`Work`](crate::Work)); it changes
/// no state, so after the group is re-formed it can simply be called again.
pub async fn verify_state(group: &ProcessGroup, state: &mut dyn TrainState) -> Result<(), TransferError> {
    let list = entries(state);
    let extra = state.save_extra();
    hello(group, &list, None, extra.len(), None).await?;
    compare_sums(group, &list, &entry_sums(state, Some(&extra))).await
}

/// Every rank's [`entry_sums`] (the lists already agreed) compared: an
/// error on every rank naming each rank that differs from rank 0.
async fn compare_sums(group: &ProcessGroup, list: &[StateEntry], sums: &[u64]) -> Result<(), TransferError> {
    let all = u64s(group.all_gather(Tensor::from_slice(sums)).await?)?;
    let rows: Vec<Vec<u64>> = all.chunks(sums.len()).map(<[u64]>::to_vec).collect();
    let diverged = sync_plan::diverged(&rows);
    if diverged.is_empty() {
        return Ok(());
    }
    let name = |i: usize| list.get(i).map_or_else(|| "extras".to_owned(), |e| e.name.clone());
    Err(TransferError::Diverged(
        diverged
            .into_iter()
            .map(|(rank, i)| Diverged { rank, first: name(i) })
            .collect(),
    ))
}

/// A checksum of each entry of `state` in [`for_each_entry`]'s order, and
/// of `extra` (its saved extras) last when given: equal states give equal
/// rows.
pub(super) fn entry_sums(state: &mut dyn TrainState, extra: Option<&[u8]>) -> Vec<u64> {
    const PIECE: usize = 4 << 20;
    let mut sums = Vec::new();
    let mut scratch = Vec::new();
    for_each_entry(state, |i, _, buffer| {
        // Chained over pieces, so a large entry needs no copy of its size.
        let total = buffer.len() * buffer.dtype().size();
        let (mut at, mut sum) = (0, i as u64);
        while at < total {
            let n = (total - at).min(PIECE);
            sum = match buffer.as_bytes() {
                Some(bytes) => checksum(sum, &bytes[at..at + n]),
                None => {
                    scratch.resize(PIECE, 0u8);
                    buffer.read_bytes(at, &mut scratch[..n]);
                    checksum(sum, &scratch[..n])
                }
            };
            at += n;
        }
        sums.push(sum);
    });
    if let Some(extra) = extra {
        sums.push(checksum(u64::MAX, extra));
    }
    sums
}

fn specs(list: &[StateEntry]) -> Vec<ParamSpec> {
    list.iter()
        .map(|e| ParamSpec {
            name: e.name.clone(),
            dtype: e.dtype,
            len: e.len,
        })
        .collect()
}

/// A fresh random number: it only tells this call's frames from an
/// earlier, failed call's, so the standard library's hash keys suffice.
fn random_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new().build_hasher().finish()
}

fn u64s(t: Tensor) -> Result<Vec<u64>, CollectiveError> {
    t.to_vec::<u64>().map_err(|e| CollectiveError::Protocol {
        peer: usize::MAX,
        reason: e.to_string(),
    })
}

/// Step 1: every rank's [`Hello`]; a list that differs from rank 0's is a
/// [`TransferError::Mismatch`] on every rank.
async fn hello(
    group: &ProcessGroup,
    list: &[StateEntry],
    step: Option<u64>,
    extra_len: usize,
    state: Option<u64>,
) -> Result<Vec<Hello>, TransferError> {
    let encoded = sync_plan::encode_specs(&specs(list));
    let mine = Hello {
        fingerprint: sync_plan::fnv1a(sync_plan::FNV_OFFSET, &encoded),
        entries: encoded.len() as u64,
        step,
        extra_len: extra_len as u64,
        nonce: random_nonce(),
        state,
    };
    let all = u64s(group.all_gather(Tensor::from_slice(&mine.encode())).await?)?;
    let hellos: Vec<Hello> = all.chunks(Hello::WORDS).filter_map(Hello::decode).collect();
    if hellos.len() != group.world_size() {
        return Err(CollectiveError::Protocol {
            peer: usize::MAX,
            reason: format!(
                "state transfer: {} hello words from {} ranks",
                all.len(),
                group.world_size()
            ),
        }
        .into());
    }
    let same = |h: &Hello| (h.fingerprint, h.entries) == (hellos[0].fingerprint, hellos[0].entries);
    let Some(rank) = hellos.iter().position(|h| !same(h)) else {
        return Ok(hellos);
    };
    let (h0, h) = (&hellos[0], &hellos[rank]);
    let d = crate::sync::list_difference(
        group,
        &encoded,
        rank,
        [h0.entries, h.entries],
        [h0.fingerprint, h.fingerprint],
    )
    .await?;
    Err(TransferError::Mismatch {
        rank,
        index: d.index,
        reference: d.reference,
        other: d.other,
    })
}

/// A link failure or silence mid-transfer may leave frames in flight: the
/// group is aborted (RA-4). An abort that came first (supervision saw a
/// rank die) is the better error: it names the failed ranks.
fn fail(group: &ProcessGroup, error: TransferError) -> TransferError {
    let earlier = group.failures().borrow().clone();
    if let Some(aborted) = earlier {
        tracing::debug!(%error, "state transfer failed under an abort");
        return TransferError::Collective(aborted.into());
    }
    group.abort(format!("state transfer failed: {error}"));
    error
}

fn link(group: &ProcessGroup, peer: usize) -> Result<Arc<dyn Link>, TransferError> {
    group.link(peer).cloned().ok_or_else(|| TransferError::Protocol {
        peer,
        reason: format!("nothing: rank {} has no link to it", group.rank()),
    })
}

/// Waits for `future` unless the group is aborted first.
async fn unless_aborted<T>(
    group: &ProcessGroup,
    future: impl std::future::Future<Output = Result<T, TransferError>>,
) -> Result<T, TransferError> {
    let mut failures = group.failures();
    if let Some(aborted) = failures.borrow_and_update().clone() {
        return Err(CollectiveError::from(aborted).into());
    }
    tokio::select! {
        biased;
        aborted = failures.wait_for(Option::is_some) => match aborted {
            Ok(aborted) => Err(CollectiveError::from(aborted.clone().expect("waited for Some")).into()),
            Err(_) => Err(CollectiveError::Broken("the group's supervision stopped".into()).into()),
        },
        result = future => result,
    }
}

/// What a source's round sends.
struct Sending<'a> {
    chunks: &'a Chunks,
    sizes: &'a [usize],
    extra: &'a [u8],
    round: u32,
    tag: u64,
    /// [`TransferOptions::damage_cma_chunk`], in round 0 only.
    damage: Option<usize>,
}

/// A source's round. First, each receiver on a shared-memory link sends
/// its [`Offer`]; where it offers its memory (and is another process), a
/// chunk whose entries it covers is written there with cross-memory
/// attach ([`cma::write`], one copy, each block hashed just before it is
/// written) and only its [`Header`] goes on the link: the notice. Every
/// other chunk is read from the state straight into the receiver's
/// transport buffer where the link takes it ([`Link::poll_send_with`]: a
/// shared-memory ring), so its bytes are copied once; otherwise it is read
/// once into a frame that a sender task per receiver link sends. A link
/// that has owned frames queued takes the next ones owned too, which keeps
/// each link's frames in order. A cross-memory write that fails (refused,
/// partial) sends that chunk, and the receiver's later ones, on the link.
async fn send_round(
    group: &ProcessGroup,
    state: &mut dyn TrainState,
    sending: &Sending<'_>,
    sends: &[(usize, Vec<usize>)],
) -> Result<(), TransferError> {
    let Sending {
        chunks,
        extra,
        round,
        tag,
        ..
    } = *sending;
    let timeout = group.collective_timeout();
    let receivers = sends.iter().flat_map(|(_, r)| r.iter().copied());
    let (mut outbound, mut tasks) = spawn_senders(group, receivers, tag, timeout)?;
    let pool = Pool::default();
    let work = async {
        let mut offers = receive_offers(group, &outbound, round, tag, timeout).await?;
        'chunks: for (chunk, receivers) in sends {
            let len = HEADER + chunk_len(extra, chunks, *chunk);
            let pieces = chunks.pieces(*chunk);
            let mut owned = None;
            for receiver in receivers {
                let (link, queue, queued) = &outbound[receiver];
                let notice = write_into_receiver(group, state, sending, (*chunk, &pieces), &mut offers, *receiver);
                let frame_len = if notice.is_some() { HEADER } else { len };
                if queued.load(Ordering::Acquire) == 0 {
                    let in_place = std::future::poll_fn(|cx| {
                        link.poll_send_with(cx, TRANSFER_CHANNEL, tag, frame_len, &mut |frame| match &notice {
                            Some(header) => header.write(frame),
                            None => write_chunk(state, extra, chunks, *chunk, round, frame),
                        })
                    });
                    match tokio::time::timeout(timeout, in_place).await {
                        Ok(Ok(true)) => continue,
                        Ok(Ok(false)) => {}
                        Ok(Err(e)) => return Err(transport(e)),
                        Err(_) => {
                            return Err(TransferError::Timeout {
                                peer: *receiver,
                                waited: timeout,
                            });
                        }
                    }
                }
                let frame = match &notice {
                    Some(header) => {
                        let mut head = [0u8; HEADER];
                        header.write(&mut head);
                        Bytes::copy_from_slice(&head)
                    }
                    None => owned
                        .get_or_insert_with(|| {
                            let mut frame = pool.take(len);
                            write_chunk(state, extra, chunks, *chunk, round, &mut frame);
                            pool.frame(frame)
                        })
                        .clone(),
                };
                queued.fetch_add(1, Ordering::AcqRel);
                // A closed queue means its task failed: its error comes below.
                if queue.send(frame).await.is_err() {
                    break 'chunks;
                }
            }
        }
        outbound.clear();
        while let Some(joined) = tasks.join_next().await {
            joined.map_err(|e| CollectiveError::Broken(format!("a state transfer task failed: {e}")))??;
        }
        Ok(())
    };
    unless_aborted(group, work).await.map_err(|e| fail(group, e))
}

/// Per receiver: its link, the queue its sender task reads frames from,
/// and how many frames wait there.
type Outbound = std::collections::HashMap<usize, (Arc<dyn Link>, mpsc::Sender<Bytes>, Arc<AtomicUsize>)>;

/// A sender task per receiver, sending the frames queued for it in order
/// (each within `timeout`).
fn spawn_senders(
    group: &ProcessGroup,
    receivers: impl Iterator<Item = usize>,
    tag: u64,
    timeout: Duration,
) -> Result<(Outbound, JoinSet<Result<(), TransferError>>), TransferError> {
    let mut outbound = Outbound::new();
    let mut tasks = JoinSet::new();
    for receiver in receivers {
        if outbound.contains_key(&receiver) {
            continue;
        }
        let link = link(group, receiver)?;
        let (tx, mut rx) = mpsc::channel::<Bytes>(QUEUED_PER_RECEIVER);
        let queued = Arc::new(AtomicUsize::new(0));
        outbound.insert(receiver, (link.clone(), tx, queued.clone()));
        tasks.spawn(async move {
            while let Some(frame) = rx.recv().await {
                match tokio::time::timeout(timeout, link.send(TRANSFER_CHANNEL, tag, frame)).await {
                    Ok(Ok(())) => queued.fetch_sub(1, Ordering::AcqRel),
                    Ok(Err(e)) => return Err(TransferError::Collective(e.error.into())),
                    Err(_) => {
                        return Err(TransferError::Timeout {
                            peer: receiver,
                            waited: timeout,
                        });
                    }
                };
            }
            Ok(())
        });
    }
    Ok((outbound, tasks))
}

/// The [`Offer`]s of the receivers on shared-memory links whose memory
/// this source may write into.
async fn receive_offers(
    group: &ProcessGroup,
    outbound: &Outbound,
    round: u32,
    tag: u64,
    timeout: Duration,
) -> Result<std::collections::HashMap<usize, Offer>, TransferError> {
    let mut offers = std::collections::HashMap::new();
    for (&receiver, (link, ..)) in outbound {
        if link.kind() == TransportKind::Shm {
            let offer = receive_offer(link.as_ref(), receiver, tag, timeout).await?;
            // Ranks of one process share its memory (no use for this),
            // and a fault must act on every byte this link carries.
            if offer.pid != 0 && offer.pid != std::process::id() && !link.injects_faults() {
                tracing::debug!(
                    source = group.rank(),
                    receiver,
                    round,
                    "state transfer: writing chunks into the receiver's memory"
                );
                offers.insert(receiver, offer);
            }
        }
    }
    Ok(offers)
}

/// Writes `chunk` into `receiver`'s memory where its offer covers it and
/// returns the notice to send instead of the chunk; `None`: the chunk
/// goes on the link (a refused write also drops the receiver's offer).
fn write_into_receiver(
    group: &ProcessGroup,
    state: &mut dyn TrainState,
    sending: &Sending<'_>,
    (chunk, pieces): (usize, &[Piece]),
    offers: &mut std::collections::HashMap<usize, Offer>,
    receiver: usize,
) -> Option<Header> {
    let offer = offers.get(&receiver).filter(|o| o.covers(pieces, sending.sizes))?;
    // After an abort the receiver may have returned and reused its
    // memory: no write then (the module docs say what remains).
    let written = match group.failures().borrow().is_some() {
        true => Err(std::io::Error::other("the group was aborted")),
        false => write_cma(
            state,
            chunk,
            pieces,
            offer,
            sending.round,
            sending.damage == Some(chunk),
        ),
    };
    match written {
        Ok(header) => Some(header),
        Err(e) => {
            tracing::warn!(
                receiver,
                error = %e,
                "state transfer: cross-memory attach refused; this receiver's chunks go on the link"
            );
            offers.remove(&receiver);
            None
        }
    }
}

/// The next frame of this transfer (tagged `tag`) from `peer` on `link`:
/// a frame of another tag is a protocol error, nothing within `timeout` a
/// [`TransferError::Timeout`].
async fn recv_tagged(link: &dyn Link, peer: usize, tag: u64, timeout: Duration) -> Result<Bytes, TransferError> {
    match tokio::time::timeout(timeout, link.recv(TRANSFER_CHANNEL)).await {
        Ok(Ok(frame)) if frame.tag == tag => Ok(frame.payload),
        Ok(Ok(frame)) => Err(TransferError::Protocol {
            peer,
            reason: format!("a frame tagged {:#x}, not this transfer's {tag:#x}", frame.tag),
        }),
        Ok(Err(e)) => Err(transport(e)),
        Err(_) => Err(TransferError::Timeout { peer, waited: timeout }),
    }
}

/// A receiver's [`Offer`] on a shared-memory link; a damaged one is no
/// offer (the chunks go on the link).
async fn receive_offer(link: &dyn Link, receiver: usize, tag: u64, timeout: Duration) -> Result<Offer, TransferError> {
    let payload = recv_tagged(link, receiver, tag, timeout).await?;
    Ok(Offer::decode(&payload).unwrap_or_else(|| {
        tracing::warn!(receiver, "state transfer: a damaged offer; chunks go on the link");
        Offer::none()
    }))
}

/// Writes `chunk` into the memory `offer` names ([`cma::write`]), each
/// [`segments`] run hashed right before it is written (while it is in the
/// cache): the notice to send, or why nothing (or not all) landed. With
/// `damage` (testing), one bit of what landed is flipped after.
fn write_cma(
    state: &mut dyn TrainState,
    chunk: usize,
    pieces: &[Piece],
    offer: &Offer,
    round: u32,
    damage: bool,
) -> std::io::Result<Header> {
    let seed = chunk as u64;
    let segments = segments(pieces);
    let mut sums = Vec::with_capacity(segments.len());
    let mut scratch = Vec::new();
    let mut result = Ok(());
    let mut first = None;
    let mut next = 0;
    for_each_entry(state, |i, _, buffer| {
        while let Some(s) = segments.get(next).filter(|s| s.entry == i) {
            next += 1;
            if result.is_err() {
                continue;
            }
            let local = match buffer.as_bytes() {
                Some(view) => &view[s.bytes.clone()],
                None => {
                    scratch.resize(s.bytes.len(), 0);
                    buffer.read_bytes(s.bytes.start, &mut scratch);
                    &scratch[..]
                }
            };
            sums.push(block_checksum(seed, sums.len(), local));
            let region: Region = offer.regions[i].expect("covers() checked every piece's region");
            let at = region.addr + s.bytes.start as u64;
            first.get_or_insert((local[0], at));
            result = cma::write(offer.pid, local, at);
        }
    });
    result?;
    if damage && let Some((byte, at)) = first {
        tracing::warn!(
            chunk,
            "state transfer: damaging a chunk written by cross-memory attach (testing)"
        );
        cma::write(offer.pid, &[byte ^ 1], at)?;
    }
    Ok(Header {
        chunk: chunk as u32,
        round,
        checksum: combine(seed, &sums),
    })
}

/// Frame buffers of one round, reused once the transports drop them: a
/// fresh 8 MiB buffer pays a page fault per 4 KiB on first touch.
#[derive(Default, Clone)]
struct Pool(Arc<std::sync::Mutex<Vec<Vec<u8>>>>);

struct Pooled {
    buffer: Vec<u8>,
    pool: Pool,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buffer
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        let mut free = self.pool.0.lock().unwrap_or_else(|p| p.into_inner());
        free.push(std::mem::take(&mut self.buffer));
    }
}

impl Pool {
    fn take(&self, len: usize) -> Vec<u8> {
        let mut buffer = self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop()
            .unwrap_or_default();
        // Its old bytes are all overwritten: resize only zeroes what it adds.
        buffer.resize(len, 0);
        buffer
    }

    fn frame(&self, buffer: Vec<u8>) -> Bytes {
        Bytes::from_owner(Pooled {
            buffer,
            pool: self.clone(),
        })
    }
}

/// Payload bytes of `chunk`.
fn chunk_len(extra: &[u8], chunks: &Chunks, chunk: usize) -> usize {
    if chunk == chunks.extra() {
        extra.len()
    } else {
        chunks.range(chunk).len()
    }
}

/// Writes one chunk's frame into `frame` ([`HEADER`] + [`chunk_len`]
/// bytes): the bytes read from the state, each block checksummed right
/// after it is written (while it is in the cache), then the header.
fn write_chunk(state: &mut dyn TrainState, extra: &[u8], chunks: &Chunks, chunk: usize, round: u32, frame: &mut [u8]) {
    let seed = chunk as u64;
    let sum;
    let (head, payload) = frame.split_at_mut(HEADER);
    if chunk == chunks.extra() {
        payload.copy_from_slice(extra);
        sum = chunk_checksum(seed, extra);
    } else {
        let pieces = chunks.pieces(chunk);
        let len = payload.len();
        let mut blocks = Vec::with_capacity(len.div_ceil(BLOCK));
        let mut next = 0;
        for_each_entry(state, |i, _, buffer| {
            while let Some(p) = pieces.get(next).filter(|p| p.entry == i) {
                let (mut at, end, mut from) = (p.at, p.at + p.bytes.len(), p.bytes.start);
                while at < end {
                    let stop = ((at / BLOCK + 1) * BLOCK).min(end);
                    buffer.read_bytes(from, &mut payload[at..stop]);
                    from += stop - at;
                    at = stop;
                    if at % BLOCK == 0 || at == len {
                        let index = (at - 1) / BLOCK;
                        blocks.push(block_checksum(seed, index, &payload[index * BLOCK..at]));
                    }
                }
                next += 1;
            }
        });
        sum = combine(seed, &blocks);
    }
    Header {
        chunk: chunk as u32,
        round,
        checksum: sum,
    }
    .write(head);
}

/// What a receiver's round works on.
struct Receiving<'a> {
    state: &'a mut dyn TrainState,
    chunks: &'a Chunks,
    sizes: &'a [usize],
    extra_lens: &'a [usize],
    round: u32,
    tag: u64,
    extra: &'a mut Option<Vec<u8>>,
    bad: &'a mut Vec<usize>,
    /// Bytes that landed by cross-memory attach this round, intact.
    cma_bytes: &'a mut u64,
}

/// This process's [`Offer`]: its pid and where each entry's bytes lie,
/// for the entries with a byte view ([`ParamBuffer::as_bytes_mut`]).
fn offer(state: &mut dyn TrainState) -> Offer {
    let in_place = state.buffers_in_place().is_some();
    let mut regions = Vec::new();
    for_each_entry(state, |_, _, buffer| {
        let view = if in_place { buffer.as_bytes_mut() } else { None };
        regions.push(view.map(|view| {
            cma::advise_huge_pages(view);
            Region {
                addr: view.as_mut_ptr() as u64,
                len: view.len() as u64,
            }
        }))
    });
    Offer {
        pid: std::process::id(),
        regions,
    }
}

/// A receiver's round. To each source on a shared-memory link it offers
/// its memory ([`Offer`]); the source writes there or sends frames, and a
/// chunk offered may come either way. A reader task per source link then
/// checks each frame as it comes (its length, header and checksum), while
/// this task writes the intact chunks checked before it into the state,
/// and, for a notice (a chunk the source wrote into this process's
/// memory), hashes the landed bytes and compares: the checksums of
/// several sources, and of one source's next chunk, run beside the copies
/// and the sources' writes.
async fn receive_round(
    group: &ProcessGroup,
    ctx: &mut Receiving<'_>,
    receives: &[(usize, Vec<usize>)],
) -> Result<(), TransferError> {
    let timeout = group.collective_timeout();
    let mut mine = None;
    let (tx, mut rx) = mpsc::channel::<(usize, usize, Result<Checked, TransferError>)>(2 * receives.len().max(1));
    let mut readers = JoinSet::new();
    let mut offers = std::collections::HashMap::new();
    for (source, list) in receives {
        let (source, tx, link) = (*source, tx.clone(), link(group, *source)?);
        // The source decides whether to use it (not on a link a fault acts on).
        let offer =
            (link.kind() == TransportKind::Shm).then(|| mine.get_or_insert_with(|| offer(&mut *ctx.state)).clone());
        let by_cma: Vec<bool> = list
            .iter()
            .map(|&chunk| {
                offer
                    .as_ref()
                    .is_some_and(|o| o.covers(&ctx.chunks.pieces(chunk), ctx.sizes))
            })
            .collect();
        if let Some(offer) = &offer {
            offers.insert(source, offer.clone());
        }
        let lens: Vec<usize> = list.iter().map(|&chunk| ctx.payload_len(source, chunk)).collect();
        let (list, expected_tag, round) = (list.clone(), ctx.tag, ctx.round);
        readers.spawn(async move {
            if let Some(offer) = offer {
                let sent = tokio::time::timeout(
                    timeout,
                    link.send(TRANSFER_CHANNEL, expected_tag, Bytes::from(offer.encode())),
                )
                .await;
                let failed = match sent {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(TransferError::Collective(e.error.into())),
                    Err(_) => Some(TransferError::Timeout {
                        peer: source,
                        waited: timeout,
                    }),
                };
                if let Some(e) = failed {
                    let _ = tx.send((source, list[0], Err(e))).await;
                    return;
                }
            }
            for ((&chunk, &len), &cma) in list.iter().zip(&lens).zip(&by_cma) {
                let checked = recv_tagged(link.as_ref(), source, expected_tag, timeout)
                    .await
                    .and_then(|payload| match Header::read(&payload) {
                        // A notice: the bytes are in this process's memory already.
                        Some(header) if cma && payload.len() == HEADER => Ok(Checked::Notice(header)),
                        _ => check(source, chunk, len, round, payload),
                    });
                let failed = checked.is_err();
                if tx.send((source, chunk, checked)).await.is_err() || failed {
                    return;
                }
            }
        });
    }
    drop(tx);
    let work = async {
        while let Some((source, chunk, checked)) = rx.recv().await {
            accept(ctx, &offers, source, chunk, checked?)?;
        }
        Ok(())
    };
    unless_aborted(group, work).await.map_err(|e| fail(group, e))
}

fn transport(e: TransportError) -> TransferError {
    TransferError::Collective(e.into())
}

/// A received frame, checked; or a notice, checked by [`accept`].
enum Checked {
    /// A chunk in the frame.
    Frame { frame: Bytes, intact: bool },
    /// The header of a chunk written into this process's memory.
    Notice(Header),
}

impl Receiving<'_> {
    /// The payload bytes of `chunk` as `source` sends it.
    fn payload_len(&self, source: usize, chunk: usize) -> usize {
        if chunk == self.chunks.extra() {
            self.extra_lens[source]
        } else {
            self.chunks.range(chunk).len()
        }
    }
}

/// Checks a frame of `chunk` from `source`: a wrong length is a protocol
/// error; a wrong header or checksum makes it damaged (fetched again).
fn check(source: usize, chunk: usize, len: usize, round: u32, frame: Bytes) -> Result<Checked, TransferError> {
    if frame.len() != HEADER + len {
        return Err(TransferError::Protocol {
            peer: source,
            reason: format!("{} bytes for chunk {chunk}, which takes {}", frame.len(), HEADER + len),
        });
    }
    let header = Header::read(&frame).expect("length checked");
    let intact = header.chunk as usize == chunk
        && header.round == round
        && header.checksum == chunk_checksum(chunk as u64, &frame[HEADER..]);
    Ok(Checked::Frame { frame, intact })
}

/// Writes an intact chunk where it belongs; a damaged one goes on the bad
/// list and never touches the state. A notice's chunk is in the state
/// already: it is hashed there; damaged, it goes on the bad list too (and
/// is written over in the next round).
fn accept(
    ctx: &mut Receiving<'_>,
    offers: &std::collections::HashMap<usize, Offer>,
    source: usize,
    chunk: usize,
    checked: Checked,
) -> Result<(), TransferError> {
    let intact = match &checked {
        Checked::Frame { intact, .. } => *intact,
        Checked::Notice(header) => {
            let offer = offers
                .get(&source)
                .expect("notices are read only where an offer was made");
            header.chunk as usize == chunk
                && header.round == ctx.round
                && landed_checksum(ctx, offer, chunk)? == header.checksum
        }
    };
    if !intact {
        tracing::warn!(
            source,
            chunk,
            round = ctx.round,
            "state transfer: a chunk failed its checksum"
        );
        ctx.bad.push(chunk);
        return Ok(());
    }
    let frame = match checked {
        Checked::Frame { frame, .. } => frame,
        Checked::Notice(_) => {
            *ctx.cma_bytes += ctx.chunks.range(chunk).len() as u64;
            return Ok(());
        }
    };
    let payload = &frame[HEADER..];
    if chunk == ctx.chunks.extra() {
        *ctx.extra = Some(payload.to_vec());
        return Ok(());
    }
    let pieces = ctx.chunks.pieces(chunk);
    let mut next = 0;
    for_each_entry(ctx.state, |i, _, buffer: &mut dyn ParamBuffer| {
        while let Some(p) = pieces.get(next).filter(|p| p.entry == i) {
            buffer.write_bytes(p.bytes.start, &payload[p.at..p.at + p.bytes.len()]);
            next += 1;
        }
    });
    Ok(())
}

/// The checksum of `chunk` as it landed in this process's memory (the
/// sender's way: [`segments`]), through pointers taken now; a buffer no
/// longer where `offer` said is [`TransferError::Moved`].
fn landed_checksum(ctx: &mut Receiving<'_>, offer: &Offer, chunk: usize) -> Result<u64, TransferError> {
    let seed = chunk as u64;
    let segments = segments(&ctx.chunks.pieces(chunk));
    let mut sums = Vec::with_capacity(segments.len());
    let mut moved = None;
    let mut next = 0;
    for_each_entry(ctx.state, |i, name, buffer| {
        while let Some(s) = segments.get(next).filter(|s| s.entry == i) {
            next += 1;
            let base = buffer.as_bytes_mut().map(|view| (view.as_mut_ptr(), view.len()));
            let offered = offer.regions.get(i).copied().flatten();
            match (base, offered) {
                (Some((ptr, len)), Some(region)) if ptr as u64 == region.addr && len as u64 == region.len => {
                    // SAFETY: `ptr..ptr + len` is the buffer's own memory,
                    // taken just now from it (the `&mut` it came from ended
                    // on the line above: no reference is held across the
                    // other processes' writes), and `s.bytes` lies within
                    // it. Those bytes were written by the source before it
                    // sent the notice this follows (the link orders them:
                    // the source's write returned, then it queued the
                    // notice, which this task received through the ring's
                    // acquire). No source writes them again this round
                    // (each chunk comes from one source once per round;
                    // a refetch comes after the round's all-gather), and
                    // this process writes them only in later rounds, so
                    // nothing writes them while this slice lives. Other
                    // sources may be writing other chunks of the buffer
                    // meanwhile: bytes this slice does not cover.
                    let landed = unsafe { std::slice::from_raw_parts(ptr.add(s.bytes.start), s.bytes.len()) };
                    sums.push(block_checksum(seed, sums.len(), landed));
                }
                _ => {
                    moved.get_or_insert_with(|| name.to_owned());
                }
            }
        }
    });
    match moved {
        Some(entry) => Err(TransferError::Moved { entry }),
        None => Ok(combine(seed, &sums)),
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use crate::train::NamedState;

    fn state(values: impl Fn(usize) -> f32) -> NamedState {
        NamedState {
            params: vec![
                ("a".into(), (0..100_000).map(&values).collect()),
                ("b".into(), (0..70_000).map(|i| values(i + 7)).collect()),
            ],
            ..NamedState::default()
        }
    }

    /// The same buffers, from a state that makes no promise.
    struct Unpromised(NamedState);

    impl crate::sync::Parameters for Unpromised {
        fn visit_parameters(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
            self.0.visit_parameters(visit)
        }
    }

    impl TrainState for Unpromised {}

    #[test]
    fn only_a_state_that_promises_its_buffers_stay_put_offers_them() {
        let promised = offer(&mut state(|i| i as f32));
        assert!(promised.regions.iter().all(Option::is_some), "{promised:?}");
        let unpromised = offer(&mut Unpromised(state(|i| i as f32)));
        assert_eq!(
            unpromised.regions,
            vec![None, None],
            "the chunks must come over the link"
        );
    }

    /// A receiver's round `round` over `state`, with no extras.
    fn receiving<'a>(
        state: &'a mut NamedState,
        chunks: &'a Chunks,
        sizes: &'a [usize],
        round: u32,
        extra: &'a mut Option<Vec<u8>>,
        bad: &'a mut Vec<usize>,
        cma_bytes: &'a mut u64,
    ) -> Receiving<'a> {
        Receiving {
            state,
            chunks,
            sizes,
            extra_lens: &[0],
            round,
            tag: 0,
            extra,
            bad,
            cma_bytes,
        }
    }

    /// What a source in another process does, into this process's memory
    /// (a process may always write its own this way), and the receiver's
    /// check of what landed: intact, damaged, and a buffer that moved.
    #[test]
    fn chunks_written_into_offered_memory_are_checked_where_they_landed() {
        let mut source = state(|i| i as f32 * 0.5);
        let mut receiver = state(|_| 0.0);
        let sizes = [400_000, 280_000];
        // Chunk 1 spans both entries; the last one is short.
        let chunks = Chunks::new(&sizes, 300_001);
        let offer = offer(&mut receiver);
        assert_eq!(offer.pid, std::process::id());
        let (mut extra, mut bad, mut cma_bytes) = (None, Vec::new(), 0);
        let mut headers = Vec::new();
        for chunk in 0..chunks.data_chunks() {
            let pieces = chunks.pieces(chunk);
            assert!(offer.covers(&pieces, &sizes), "chunk {chunk}");
            headers.push(write_cma(&mut source, chunk, &pieces, &offer, 2, chunk == 1).unwrap());
        }
        let mut ctx = receiving(&mut receiver, &chunks, &sizes, 2, &mut extra, &mut bad, &mut cma_bytes);
        let offers = std::collections::HashMap::from([(0, offer.clone())]);
        for (chunk, header) in headers.iter().enumerate() {
            accept(&mut ctx, &offers, 0, chunk, Checked::Notice(*header)).unwrap();
        }
        assert_eq!(*ctx.bad, [1], "the damaged chunk, only");
        assert_eq!(*ctx.cma_bytes, (680_000 - chunks.range(1).len()) as u64);
        // Written again intact (the next round), it passes.
        let header = write_cma(&mut source, 1, &chunks.pieces(1), &offer, 2, false).unwrap();
        ctx.bad.clear();
        accept(&mut ctx, &offers, 0, 1, Checked::Notice(header)).unwrap();
        assert!(ctx.bad.is_empty());
        assert_eq!(receiver, source, "every byte landed");

        // A notice naming another round or chunk is damage too.
        let mut ctx = receiving(&mut receiver, &chunks, &sizes, 3, &mut extra, &mut bad, &mut cma_bytes);
        accept(&mut ctx, &offers, 0, 0, Checked::Notice(headers[0])).unwrap();
        assert_eq!(*ctx.bad, [0]);

        // A buffer that is no longer where the offer said.
        receiver.params[1].1 = vec![0.0; 70_000];
        let mut ctx = receiving(&mut receiver, &chunks, &sizes, 2, &mut extra, &mut bad, &mut cma_bytes);
        match accept(&mut ctx, &offers, 0, 2, Checked::Notice(headers[2])) {
            Err(e @ TransferError::Moved { .. }) => assert!(e.to_string().contains("'b'"), "{e}"),
            other => panic!("expected Moved, got {:?}", other.err()),
        }
    }
}
