//! Live state transfer: members behind the most advanced committed step
//! (joiners, or survivors whose last vote did not complete) receive the
//! state of the most advanced members over the group itself.
//!
//! This is a simple version (one source, whole-group broadcasts) kept to
//! the API of the striped, checksummed transfer it will be replaced by.

use std::time::{Duration, Instant};

use chorus_actors::driver::CollectiveError;
use chorus_runtime::collective::DType;
use thiserror::Error;

use super::state::{TrainState, entries, for_each_entry};
use crate::group::ProcessGroup;
use crate::sync::plan::{self, ParamSpec};
use crate::tensor::Tensor;

/// How the state moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferOptions {
    /// Bytes per broadcast.
    pub chunk_bytes: usize,
    /// How many times a chunk may be fetched again.
    pub max_rounds: u32,
}

impl Default for TransferOptions {
    fn default() -> Self {
        Self {
            chunk_bytes: 64 << 20,
            max_rounds: 3,
        }
    }
}

/// What a [`sync_state`] did (the same on every member).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferReport {
    /// The step every member holds now.
    pub step: u64,
    /// Members whose state was sent.
    pub sources: Vec<usize>,
    /// Members that received it.
    pub receivers: Vec<usize>,
    /// Bytes each receiver took in.
    pub bytes: u64,
    /// Chunks fetched again.
    pub refetched: usize,
    /// How long it took here.
    pub elapsed: Duration,
}

/// Why the state could not be moved or checked.
#[derive(Debug, Error)]
pub enum TransferError {
    /// A collective failed (the group may be aborted: wait for the next generation).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// Members hold different tensors.
    #[error("rank {rank} holds different state tensors than rank {source_rank}; build the same model and optimizer on every rank")]
    Mismatch {
        /// The member that differs.
        rank: usize,
        /// The source it was compared with.
        source_rank: usize,
    },
    /// The state refused the source's extras.
    #[error("the state refused the source's extra bytes: {0}")]
    Extra(String),
    /// Members' states differ after a transfer.
    #[error("state differs from rank 0's on ranks {0:?}")]
    Diverged(Vec<usize>),
}

fn u64s(t: Tensor) -> Result<Vec<u64>, TransferError> {
    t.to_vec::<u64>().map_err(|e| {
        TransferError::Collective(CollectiveError::Protocol {
            peer: usize::MAX,
            reason: e.to_string(),
        })
    })
}

fn fingerprint(state: &mut dyn TrainState) -> u64 {
    let specs: Vec<ParamSpec> = entries(state)
        .into_iter()
        .map(|e| ParamSpec {
            name: e.name,
            dtype: e.dtype,
            len: e.len,
        })
        .collect();
    plan::fnv1a(plan::FNV_OFFSET, &plan::encode_specs(&specs))
}

/// Collective: members behind the most advanced step (or `None`) receive
/// its state from the most advanced ones; when no member has a step,
/// rank 0 is the source, at step 0.
pub async fn sync_state(
    group: &ProcessGroup,
    state: &mut dyn TrainState,
    step: Option<u64>,
    options: &TransferOptions,
) -> Result<TransferReport, TransferError> {
    let started = Instant::now();
    let mine = [step.is_some() as u64, step.unwrap_or(0), fingerprint(state)];
    let rows = u64s(group.all_gather(Tensor::from_slice(&mine)).await?)?;
    let rows: Vec<&[u64]> = rows.chunks(3).collect();
    let best = rows.iter().filter(|r| r[0] == 1).map(|r| r[1]).max();
    let (step, sources): (u64, Vec<usize>) = match best {
        Some(best) => (best, (0..rows.len()).filter(|&r| rows[r] [0] == 1 && rows[r][1] == best).collect()),
        None => (0, vec![0]),
    };
    let root = sources[0];
    if let Some(rank) = (0..rows.len()).find(|&r| rows[r][2] != rows[root][2]) {
        return Err(TransferError::Mismatch { rank, source_rank: root });
    }
    let receivers: Vec<usize> = (0..rows.len()).filter(|r| !sources.contains(r)).collect();
    let mut report = TransferReport {
        step,
        sources,
        receivers,
        bytes: 0,
        refetched: 0,
        elapsed: Duration::ZERO,
    };
    if report.receivers.is_empty() {
        report.elapsed = started.elapsed();
        return Ok(report);
    }
    let sizes: Vec<usize> = entries(state).iter().map(|e| e.bytes()).collect();
    let me = group.rank();
    for pieces in plan::broadcast_chunks(&sizes, options.chunk_bytes.max(1)) {
        let total: usize = pieces.iter().map(|p| p.end - p.start).sum();
        let mut payload = vec![0u8; total];
        if me == root {
            let mut at = 0;
            for piece in &pieces {
                let n = piece.end - piece.start;
                let out = &mut payload[at..at + n];
                for_each_entry(state, |i, _, b| {
                    if i == piece.param {
                        b.read_bytes(piece.start, out)
                    }
                });
                at += n;
            }
        }
        let got = group.broadcast(Tensor::from_bytes(DType::UInt8, payload), root).await?;
        report.bytes += total as u64;
        if me == root {
            continue;
        }
        let got = got.as_bytes();
        let mut at = 0;
        for piece in &pieces {
            let n = piece.end - piece.start;
            for_each_entry(state, |i, _, b| {
                if i == piece.param {
                    b.write_bytes(piece.start, &got[at..at + n])
                }
            });
            at += n;
        }
    }
    let extra = if me == root { state.save_extra() } else { Vec::new() };
    let len = group.broadcast(Tensor::from_slice(&[extra.len() as u64]), root).await?;
    let len = u64s(len)?[0] as usize;
    let payload = if me == root { extra } else { vec![0; len] };
    let got = group.broadcast(Tensor::from_bytes(DType::UInt8, payload), root).await?;
    report.bytes += len as u64;
    if me != root {
        state.load_extra(got.as_bytes()).map_err(TransferError::Extra)?;
    }
    report.elapsed = started.elapsed();
    Ok(report)
}

/// Collective: checks that every member holds the same state (tensors and
/// extras), by all-gathered checksums.
pub async fn verify_state(group: &ProcessGroup, state: &mut dyn TrainState) -> Result<(), TransferError> {
    let mut sum = plan::fnv1a(plan::FNV_OFFSET, &fingerprint(state).to_le_bytes());
    let mut scratch = vec![0u8; 1 << 20];
    for_each_entry(state, |_, _, b| {
        let total = b.len() * b.dtype().size();
        let mut at = 0;
        while at < total {
            let n = (total - at).min(scratch.len());
            b.read_bytes(at, &mut scratch[..n]);
            sum = plan::fnv1a(sum, &scratch[..n]);
            at += n;
        }
    });
    sum = plan::fnv1a(sum, &state.save_extra());
    let all = u64s(group.all_gather(Tensor::from_slice(&[sum])).await?)?;
    let diverged: Vec<usize> = (0..all.len()).filter(|&r| all[r] != all[0]).collect();
    if diverged.is_empty() {
        Ok(())
    } else {
        Err(TransferError::Diverged(diverged))
    }
}
