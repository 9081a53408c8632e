//! Data-parallel gradient sync: PyTorch's `DistributedDataParallel` for a
//! Rust model (candle, burn, hand-written), on a [`ProcessGroup`].
//!
//! A model lists its named parameters through [`Parameters`];
//! [`DistributedSync::new`] checks that every rank listed the same ones
//! (names, dtypes, sizes, order), broadcasts rank 0's values to all, and
//! lays the gradients out in buckets. During the backward pass the caller
//! writes each gradient straight into its bucket ([`DistributedSync::grad_mut`])
//! and calls [`DistributedSync::mark_ready`]; a bucket's all-reduce starts
//! on the rank's actor as soon as its last gradient is ready, while the
//! caller computes the next ones. [`DistributedSync::finish`] waits for the
//! rest and leaves the averaged gradients in place. On an elastic group a
//! step the abort interrupted is [`SyncError::Aborted`], and
//! [`DistributedSync::rebind`] goes on in the next generation;
//! [`DistributedSync::join`] lets a rank out of data shadow the others
//! (with [`SyncOptions::join`]).
//!
//! - [`plan`]: the decisions, sans IO (bucket assignment, ready tracking,
//!   list comparison, broadcast chunks, divergence).
//! - [`hook`]: what reduces a bucket ([`Average`], [`Compress`], or yours);
//!   [`powersgd`]: [`PowerSgd`], low-rank compression with error feedback.

pub mod hook;
pub mod plan;
pub mod powersgd;

use std::sync::Arc;

use chorus_actors::driver::CollectiveError;
use chorus_actors::supervision::GroupAborted;
use chorus_runtime::collective::{DType, ReduceOp};
use thiserror::Error;
use tokio::task::JoinHandle;

pub use hook::{Average, BucketInfo, CommHook, Compress, HookFuture};
pub use plan::{BucketCaps, Layout, ParamSpec};
pub use powersgd::{PowerSgd, PowerSgdOptions};

use crate::group::ProcessGroup;
use crate::tensor::{Element, Tensor};
use plan::{MarkError, ReadyTracker};

/// How long a failed step waits for the group's abort to explain it.
const ABORT_GRACE: std::time::Duration = std::time::Duration::from_millis(250);

/// A parameter's storage, wherever it lives: the sync layer only copies
/// byte ranges in and out of it (the start-up broadcast and checksums), so
/// a host `Vec` implements it with `memcpy` and a device buffer could with
/// a copy to or from the host.
pub trait ParamBuffer {
    /// Its element type.
    fn dtype(&self) -> DType;
    /// Its number of elements.
    fn len(&self) -> usize;
    /// Whether it has no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies bytes `offset..offset + out.len()` into `out` (always in range).
    fn read_bytes(&self, offset: usize, out: &mut [u8]);
    /// Overwrites bytes `offset..offset + data.len()` (always in range).
    fn write_bytes(&mut self, offset: usize, data: &[u8]);
    /// All its bytes in place, where the buffer keeps them in this
    /// process's memory as one run: the state transfer reads a source's
    /// chunks from here with no copy. `None` (the default): through
    /// [`read_bytes`](Self::read_bytes) only.
    fn as_bytes(&self) -> Option<&[u8]> {
        None
    }
    /// [`as_bytes`](Self::as_bytes), to write. The state transfer lets
    /// another rank process write into these bytes (cross-memory attach)
    /// while it holds the state, between visits of the buffer, but only
    /// for a state that promises its buffers stay in place
    /// ([`TrainState::buffers_in_place`](crate::train::TrainState::buffers_in_place),
    /// an `unsafe` promise): a buffer built for one visit (a copy of a
    /// device tensor written back after) breaks it.
    fn as_bytes_mut(&mut self) -> Option<&mut [u8]> {
        None
    }
}

impl<T: Element> ParamBuffer for [T] {
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn len(&self) -> usize {
        <[T]>::len(self)
    }
    fn read_bytes(&self, offset: usize, out: &mut [u8]) {
        out.copy_from_slice(&bytemuck::cast_slice(self)[offset..offset + out.len()]);
    }
    fn write_bytes(&mut self, offset: usize, data: &[u8]) {
        bytemuck::cast_slice_mut(self)[offset..offset + data.len()].copy_from_slice(data);
    }
    fn as_bytes(&self) -> Option<&[u8]> {
        Some(bytemuck::cast_slice(self))
    }
    fn as_bytes_mut(&mut self) -> Option<&mut [u8]> {
        Some(bytemuck::cast_slice_mut(self))
    }
}

impl<T: Element> ParamBuffer for Vec<T> {
    fn dtype(&self) -> DType {
        T::DTYPE
    }
    fn len(&self) -> usize {
        <[T]>::len(self)
    }
    fn read_bytes(&self, offset: usize, out: &mut [u8]) {
        self.as_slice().read_bytes(offset, out)
    }
    fn write_bytes(&mut self, offset: usize, data: &[u8]) {
        self.as_mut_slice().write_bytes(offset, data)
    }
    fn as_bytes(&self) -> Option<&[u8]> {
        self.as_slice().as_bytes()
    }
    fn as_bytes_mut(&mut self) -> Option<&mut [u8]> {
        self.as_mut_slice().as_bytes_mut()
    }
}

/// A model's named parameters (PyTorch's `named_parameters()` and
/// `named_buffers()`), visited in the same order on every rank.
pub trait Parameters {
    /// Calls `visit` with each trainable parameter, in registration order.
    fn visit_parameters(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer));
    /// Calls `visit` with each buffer that has no gradient but must match
    /// across ranks (running statistics): broadcast at construction and
    /// checked by [`DistributedSync::verify`]. None by default.
    fn visit_buffers(&mut self, _visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {}
}

/// A list of named host vectors is a model.
impl<T: Element> Parameters for Vec<(String, Vec<T>)> {
    fn visit_parameters(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        for (name, values) in self.iter_mut() {
            visit(name, values);
        }
    }
}

/// How [`DistributedSync`] buckets and checks (PyTorch DDP's defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct SyncOptions {
    /// Cap of every bucket after the first, in MiB (DDP: 25).
    pub bucket_cap_mb: f64,
    /// Cap of each dtype's first bucket, in bytes (DDP: 1 MiB), small so
    /// that the first all-reduce starts early in the backward pass.
    pub first_bucket_bytes: usize,
    /// Chunk of the start-up broadcast, in MiB (DDP: 250).
    pub broadcast_chunk_mb: usize,
    /// Broadcast rank 0's parameters and buffers at construction (DDP's `init_sync`: true).
    pub init_sync: bool,
    /// Parameters not marked ready by [`DistributedSync::finish`] count as
    /// zero gradients instead of an error (DDP's `find_unused_parameters`: false).
    pub find_unused_parameters: bool,
    /// Rebuild the buckets once, after the first synced step, in the order
    /// gradients became ready on rank 0 (DDP does: true).
    pub rebuild_buckets: bool,
    /// Uneven inputs (PyTorch's `with ddp.join():`): every synced step
    /// starts with an all-reduce of one "still have data" flag, so a rank
    /// out of data can shadow the others' steps with
    /// [`DistributedSync::join`]. Every rank sets the same (default false).
    pub join: bool,
    /// With `join`, whether the average divides by the whole world (joined
    /// ranks counting as zeros, PyTorch's default: true) or by the ranks
    /// that still had data in the step (false).
    pub divide_by_initial_world_size: bool,
}

impl Default for SyncOptions {
    fn default() -> Self {
        Self {
            bucket_cap_mb: 25.0,
            first_bucket_bytes: 1 << 20,
            broadcast_chunk_mb: 250,
            init_sync: true,
            find_unused_parameters: false,
            rebuild_buckets: true,
            join: false,
            divide_by_initial_world_size: true,
        }
    }
}

impl SyncOptions {
    fn caps(&self) -> BucketCaps {
        BucketCaps {
            first: self.first_bucket_bytes.max(1),
            rest: ((self.bucket_cap_mb * (1 << 20) as f64) as usize).max(1),
        }
    }
}

/// What went wrong while syncing; every message names what to fix.
#[derive(Error)]
pub enum SyncError {
    /// A collective failed (the group may be broken or aborted).
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// Ranks registered different parameters.
    #[error(
        "rank {rank} registered different parameters than rank 0: at #{index} rank 0 has {reference}, rank {rank} has {other}; register the same parameters in the same order on every rank"
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
    /// Parameters no longer agree across ranks.
    #[error("parameters diverged from rank 0 on {}", describe_diverged(.0))]
    Diverged(Vec<Diverged>),
    /// Parameters not marked ready by `finish` (and not in `find_unused_parameters` mode).
    #[error(
        "gradients never marked ready in step {step}: {}; call mark_ready for each, or set find_unused_parameters to count them as zero",
        .names.join(", ")
    )]
    Unmarked {
        /// The synced step (from 0).
        step: u64,
        /// Their names, in registration order.
        names: Vec<String>,
    },
    /// `mark_ready` twice for one parameter in one step.
    #[error("gradient of '{0}' marked ready twice in one step; mark each once per step")]
    MarkedTwice(String),
    /// No parameter with this id or name.
    #[error("no registered parameter {0}")]
    Unknown(String),
    /// A gradient read as the wrong element type.
    #[error("gradient of '{name}' holds {held}, not {asked}")]
    WrongType {
        /// The parameter.
        name: String,
        /// Its dtype.
        held: DType,
        /// The dtype asked for.
        asked: DType,
    },
    /// A gradient touched while its bucket is being reduced.
    #[error("gradient of '{0}' is being reduced; read or write it after finish()")]
    InFlight(String),
    /// A bucket's storage is not aligned for its element type.
    #[error("bucket storage of '{0}' is not aligned for its dtype (the allocator returned unaligned memory)")]
    Misaligned(String),
    /// The model's parameters changed since construction.
    #[error("the model's parameters changed since construction: {0}; build a new DistributedSync")]
    Changed(String),
    /// A hook broke its contract or panicked.
    #[error("communication hook failed on bucket {bucket}: {reason}")]
    Hook {
        /// The bucket.
        bucket: usize,
        /// What happened.
        reason: String,
    },
    /// Rank 0 sent a bucket order that is not a permutation of the parameters.
    #[error(
        "rank 0's bucket order is not a permutation of the {0} parameters; the ranks run different chorus versions?"
    )]
    BadOrder(usize),
    /// The group was aborted (a peer failed, a collective timed out) while
    /// this step's buckets were reduced: the gradients are zeroed, and the
    /// step must be redone on the group's next generation
    /// ([`DistributedSync::rebind`]).
    #[error(
        "the process group was aborted during synced step {step}: {aborted}; rebind to the next generation and redo the step"
    )]
    Aborted {
        /// The synced step (from 0) that failed.
        step: u64,
        /// The group's abort.
        aborted: GroupAborted,
    },
    /// `join` without [`SyncOptions::join`].
    #[error("join needs SyncOptions::join set on every rank (each step then starts with a flag all-reduce)")]
    JoinOff,
    /// `mark_ready` or `finish` was called outside a tokio runtime.
    #[error("gradient sync needs a tokio runtime: call mark_ready inside one")]
    NoRuntime,
}

chorus_runtime::debug_as_report!(SyncError);

/// One rank whose parameters differ from rank 0's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diverged {
    /// The rank.
    pub rank: usize,
    /// The first parameter (or buffer) that differs.
    pub first: String,
}

fn describe_diverged(ranks: &[Diverged]) -> String {
    ranks
        .iter()
        .map(|d| format!("rank {} (first at '{}')", d.rank, d.first))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Calls `f(index, buffer)` for every parameter, then every buffer.
fn for_each_entry(model: &mut (dyn Parameters + Send), mut f: impl FnMut(usize, &str, &mut dyn ParamBuffer)) {
    let mut index = 0;
    let mut visit = |name: &str, buffer: &mut dyn ParamBuffer| {
        f(index, name, buffer);
        index += 1;
    };
    model.visit_parameters(&mut visit);
    model.visit_buffers(&mut visit);
}

/// The specs of `model`'s parameters and of all its entries (buffers after).
fn describe(model: &mut (dyn Parameters + Send)) -> (Vec<ParamSpec>, Vec<ParamSpec>) {
    let spec = |name: &str, b: &mut dyn ParamBuffer| ParamSpec {
        name: name.to_owned(),
        dtype: b.dtype(),
        len: b.len(),
    };
    let mut params = vec![];
    model.visit_parameters(&mut |name, b| params.push(spec(name, b)));
    let mut all = params.clone();
    model.visit_buffers(&mut |name, b| all.push(spec(name, b)));
    (params, all)
}

/// The one `u32` of a flag all-reduce, widened.
fn u64s_of_u32(t: &Tensor) -> Result<u64, SyncError> {
    match t.to_vec::<u32>().ok().as_deref() {
        Some([n]) => Ok(u64::from(*n)),
        _ => Err(SyncError::Collective(CollectiveError::Protocol {
            peer: usize::MAX,
            reason: "a join flag all-reduce returned other than one u32".into(),
        })),
    }
}

fn u64s(t: Tensor) -> Result<Vec<u64>, SyncError> {
    t.to_vec::<u64>().map_err(|e| {
        SyncError::Collective(CollectiveError::Protocol {
            peer: usize::MAX,
            reason: e.to_string(),
        })
    })
}

/// Checks that every rank's entries equal rank 0's: an all-gather of a
/// fingerprint, then, only on a mismatch, both full lists by broadcast, so
/// every rank reports the same first difference.
async fn check_same_everywhere(group: &ProcessGroup, specs: &[ParamSpec]) -> Result<(), SyncError> {
    let bytes = plan::encode_specs(specs);
    let mine = [plan::fnv1a(plan::FNV_OFFSET, &bytes), bytes.len() as u64];
    let all = u64s(group.all_gather(Tensor::from_slice(&mine)).await?)?;
    let rows: Vec<&[u64]> = all.chunks(2).collect();
    let Some(rank) = rows.iter().position(|row| *row != rows[0]) else {
        return Ok(());
    };
    let d = list_difference(
        group,
        &bytes,
        rank,
        [rows[0][1], rows[rank][1]],
        [rows[0][0], rows[rank][0]],
    )
    .await?;
    Err(SyncError::Mismatch {
        rank,
        index: d.index,
        reference: d.reference,
        other: d.other,
    })
}

/// Where one rank's entry list first differs from rank 0's.
pub(crate) struct ListDifference {
    /// Position of the first difference.
    pub index: usize,
    /// Rank 0's entry there.
    pub reference: String,
    /// The other rank's entry there.
    pub other: String,
}

/// Collective, after an all-gather showed rank `rank`'s list (fingerprint
/// `fingerprints[1]`, `lens[1]` encoded bytes) differs from rank 0's
/// (`fingerprints[0]`, `lens[0]`): both lists are broadcast, so every rank
/// names the same first difference. `mine` is this rank's encoded list.
pub(crate) async fn list_difference(
    group: &ProcessGroup,
    mine: &[u8],
    rank: usize,
    lens: [u64; 2],
    fingerprints: [u64; 2],
) -> Result<ListDifference, CollectiveError> {
    let mut lists = vec![];
    for (root, len) in [(0, lens[0]), (rank, lens[1])] {
        let payload = if group.rank() == root {
            mine.to_vec()
        } else {
            vec![0; len as usize]
        };
        let got = group.broadcast(Tensor::from_bytes(DType::UInt8, payload), root).await?;
        lists.push(plan::decode_specs(got.as_bytes()).unwrap_or_default());
    }
    let show = |s: Option<ParamSpec>| s.map_or_else(|| "nothing (its list ends there)".to_owned(), |s| s.to_string());
    Ok(match plan::first_difference(&lists[0], &lists[1]) {
        Some(d) => ListDifference {
            index: d.index,
            reference: show(d.reference),
            other: show(d.other),
        },
        // Equal lists with different fingerprints: the lists did not survive decoding.
        None => ListDifference {
            index: 0,
            reference: format!("fingerprint {:#x}", fingerprints[0]),
            other: format!("fingerprint {:#x}", fingerprints[1]),
        },
    })
}

/// Every entry of `model` gets rank 0's values, `chunk` bytes per broadcast.
async fn broadcast_entries(
    group: &ProcessGroup,
    model: &mut (dyn Parameters + Send),
    specs: &[ParamSpec],
    chunk: usize,
) -> Result<(), SyncError> {
    let sizes: Vec<usize> = specs.iter().map(ParamSpec::bytes).collect();
    for pieces in plan::broadcast_chunks(&sizes, chunk) {
        let total: usize = pieces.iter().map(|p| p.end - p.start).sum();
        let mut payload = vec![0u8; total];
        if group.rank() == 0 {
            let mut at = 0;
            for piece in &pieces {
                let n = piece.end - piece.start;
                let out = &mut payload[at..at + n];
                for_each_entry(model, |i, _, b| {
                    if i == piece.param {
                        b.read_bytes(piece.start, out)
                    }
                });
                at += n;
            }
        }
        let got = group.broadcast(Tensor::from_bytes(DType::UInt8, payload), 0).await?;
        let got = got.as_bytes();
        let mut at = 0;
        for piece in &pieces {
            let n = piece.end - piece.start;
            for_each_entry(model, |i, _, b| {
                if i == piece.param {
                    b.write_bytes(piece.start, &got[at..at + n])
                }
            });
            at += n;
        }
    }
    Ok(())
}

/// The group a [`DistributedSync`] runs on: borrowed for the group's
/// lifetime, or shared (an [`ElasticGroup`](crate::ElasticGroup)'s
/// `current()`), which makes the sync `'static`.
#[derive(Debug, Clone)]
pub enum GroupRef<'g> {
    /// A group the caller keeps.
    Borrowed(&'g ProcessGroup),
    /// A group held by reference count.
    Shared(Arc<ProcessGroup>),
}

impl std::ops::Deref for GroupRef<'_> {
    type Target = ProcessGroup;
    fn deref(&self) -> &ProcessGroup {
        match self {
            GroupRef::Borrowed(group) => group,
            GroupRef::Shared(group) => group,
        }
    }
}

impl<'g> From<&'g ProcessGroup> for GroupRef<'g> {
    fn from(group: &'g ProcessGroup) -> Self {
        GroupRef::Borrowed(group)
    }
}

impl From<Arc<ProcessGroup>> for GroupRef<'static> {
    fn from(group: Arc<ProcessGroup>) -> Self {
        GroupRef::Shared(group)
    }
}

/// The data-parallel gradient sync of one model on one group (PyTorch's
/// `DistributedDataParallel`, without the forward pass: the model is
/// yours, the gradients live here).
///
/// # Cancel safety
///
/// None of its `async fn`s ([`new`](Self::new), [`finish`](Self::finish),
/// [`join`](Self::join), [`rebind`](Self::rebind), [`verify`](Self::verify))
/// is cancel safe: each runs collectives with the peers (see
/// [`Work`](crate::Work)). A bucket's reduction, once launched, is a task
/// of its own and runs on when `finish` is dropped, so the peers' step
/// completes; but the reduced gradients of the buckets `finish` had not
/// collected are lost to this instance, which is left mid-step (its
/// gradients refuse with [`SyncError::InFlight`]). The first synced step
/// is the exception: with [`rebuild_buckets`](SyncOptions::rebuild_buckets)
/// it ends with a broadcast of rank 0's ready order, which a dropped
/// `finish` never submits, so the peers' `finish` fails by their
/// collective timeout. Bound a step with the group's collective timeout;
/// after an abort or a dropped step, `rebind` (every rank of the group) is
/// the way back.
pub struct DistributedSync<'g> {
    group: GroupRef<'g>,
    options: SyncOptions,
    /// Trainable parameters, in registration order.
    specs: Vec<ParamSpec>,
    /// Parameters then buffers, as checked at construction.
    entries: Vec<ParamSpec>,
    layout: Layout,
    /// Per bucket: its storage, `None` while its reduction is in flight.
    storage: Vec<Option<Vec<u8>>>,
    in_flight: Vec<Option<JoinHandle<Result<Tensor, CollectiveError>>>>,
    tracker: ReadyTracker,
    hook: Box<dyn CommHook>,
    require_sync: bool,
    rebuilt: bool,
    step: u64,
    /// With `join`: this step's flag all-reduce, once submitted (active
    /// ranks submit 1 before their first bucket; joined ranks 0).
    flag: Option<JoinHandle<Result<Tensor, CollectiveError>>>,
    flag_sent: bool,
    /// Inside [`join`](DistributedSync::join): shadowing, gradients are zeros.
    joined: bool,
}

impl std::fmt::Debug for DistributedSync<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedSync")
            .field("params", &self.specs.len())
            .field("buckets", &self.layout.buckets.len())
            .field("step", &self.step)
            .finish()
    }
}

impl<'g> DistributedSync<'g> {
    /// Registers `model`'s parameters on `group` (every rank calls it):
    /// checks every rank registered the same list as rank 0 (an error on
    /// every rank names the first difference), broadcasts rank 0's
    /// parameters and buffers (with `init_sync`), and lays out zeroed
    /// gradients in buckets, last parameter first.
    pub async fn new(
        group: impl Into<GroupRef<'g>>,
        model: &mut (dyn Parameters + Send),
        options: SyncOptions,
    ) -> Result<Self, SyncError> {
        let group = group.into();
        let group_ref: &ProcessGroup = &group;
        let (specs, entries) = describe(model);
        check_same_everywhere(group_ref, &entries).await?;
        if options.init_sync && group_ref.world_size() > 1 {
            broadcast_entries(group_ref, model, &entries, options.broadcast_chunk_mb.max(1) << 20).await?;
        }
        let layout = plan::assign_buckets(&specs, &plan::reverse_order(specs.len()), options.caps());
        Ok(Self {
            group,
            storage: zeroed(&layout),
            in_flight: layout.buckets.iter().map(|_| None).collect(),
            tracker: ReadyTracker::new(&layout),
            layout,
            specs,
            entries,
            options,
            hook: Box::new(Average),
            require_sync: true,
            rebuilt: false,
            step: 0,
            flag: None,
            flag_sent: false,
            joined: false,
        })
    }

    /// Replaces the hook that reduces each bucket (default: [`Average`]).
    /// Every rank must register the same kind of hook.
    pub fn register_comm_hook(&mut self, hook: Box<dyn CommHook>) {
        self.hook = hook;
    }

    /// The parameters, in registration order (their index is their id).
    pub fn params(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// The id of the parameter named `name`.
    pub fn param_id(&self, name: &str) -> Result<usize, SyncError> {
        self.specs
            .iter()
            .position(|s| s.name == name)
            .ok_or_else(|| SyncError::Unknown(format!("'{name}'")))
    }

    /// The current buckets (launch order) and every parameter's place.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Synced steps finished so far.
    pub fn step(&self) -> u64 {
        self.step
    }

    fn spec(&self, id: usize) -> Result<&ParamSpec, SyncError> {
        self.specs.get(id).ok_or_else(|| SyncError::Unknown(format!("#{id}")))
    }

    /// The gradient's byte range in its bucket's storage.
    fn grad_range<T: Element>(&self, id: usize) -> Result<(usize, std::ops::Range<usize>), SyncError> {
        let spec = self.spec(id)?;
        if spec.dtype != T::DTYPE {
            return Err(SyncError::WrongType {
                name: spec.name.clone(),
                held: spec.dtype,
                asked: T::DTYPE,
            });
        }
        let (bucket, offset) = self.layout.place[id];
        let size = spec.dtype.size();
        Ok((bucket, offset * size..(offset + spec.len) * size))
    }

    /// Parameter `id`'s gradient, a view into its bucket.
    pub fn grad<T: Element>(&self, id: usize) -> Result<&[T], SyncError> {
        let (bucket, range) = self.grad_range::<T>(id)?;
        let name = &self.specs[id].name;
        if range.is_empty() {
            return Ok(&[]);
        }
        let storage = self.storage[bucket]
            .as_ref()
            .ok_or_else(|| SyncError::InFlight(name.clone()))?;
        bytemuck::try_cast_slice(&storage[range]).map_err(|_| SyncError::Misaligned(name.clone()))
    }

    /// Parameter `id`'s gradient, to write or accumulate into during the
    /// backward pass (no copy: it is its bucket's storage).
    pub fn grad_mut<T: Element>(&mut self, id: usize) -> Result<&mut [T], SyncError> {
        let (bucket, range) = self.grad_range::<T>(id)?;
        let name = &self.specs[id].name;
        if range.is_empty() {
            return Ok(&mut []);
        }
        let storage = self.storage[bucket]
            .as_mut()
            .ok_or_else(|| SyncError::InFlight(name.clone()))?;
        bytemuck::try_cast_slice_mut(&mut storage[range]).map_err(|_| SyncError::Misaligned(name.clone()))
    }

    /// Sets every gradient to zero (PyTorch's `optimizer.zero_grad()`).
    pub fn zero_grad(&mut self) -> Result<(), SyncError> {
        if let Some(b) = self.storage.iter().position(Option::is_none) {
            return Err(SyncError::InFlight(
                self.specs[self.layout.buckets[b].params[0]].name.clone(),
            ));
        }
        self.storage.iter_mut().flatten().for_each(|s| s.fill(0));
        Ok(())
    }

    /// Parameter `id`'s gradient is final for this step: once every
    /// gradient of its bucket is (and every earlier bucket has started),
    /// the bucket's reduction starts, without waiting. Inside
    /// [`no_sync`](Self::no_sync) it only checks `id`.
    pub fn mark_ready(&mut self, id: usize) -> Result<(), SyncError> {
        let name = self.spec(id)?.name.clone();
        if !self.require_sync {
            return Ok(());
        }
        let start = match self.tracker.mark(id) {
            Ok(buckets) => buckets,
            Err(MarkError::Twice) => return Err(SyncError::MarkedTwice(name)),
            Err(MarkError::Unknown) => return Err(SyncError::Unknown(format!("#{id}"))),
        };
        for bucket in start {
            self.launch(bucket)?;
        }
        Ok(())
    }

    /// With `join`, submits this step's "I have data" flag ahead of its
    /// first bucket, so that it lines up with joined ranks' flags.
    fn send_flag(&mut self) -> Result<(), SyncError> {
        if self.options.join && !self.flag_sent {
            let runtime = tokio::runtime::Handle::try_current().map_err(|_| SyncError::NoRuntime)?;
            self.flag_sent = true;
            // A task, so that the sync stays `Sync` (a `Work` is not).
            self.flag = Some(runtime.spawn(self.group.all_reduce(Tensor::from_slice(&[1u32]), ReduceOp::Sum)));
        }
        Ok(())
    }

    fn launch(&mut self, bucket: usize) -> Result<(), SyncError> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| SyncError::NoRuntime)?;
        self.send_flag()?;
        let Some(bytes) = self.storage[bucket].take() else {
            return Ok(());
        };
        let info = BucketInfo {
            index: bucket,
            count: self.layout.buckets.len(),
            step: self.step,
        };
        let data = Tensor::from_bytes(self.layout.buckets[bucket].dtype, bytes);
        // Spawned so the post-processing (a hook's decompression) also runs
        // while the caller computes, not only at finish().
        self.in_flight[bucket] = Some(runtime.spawn(self.hook.reduce(&self.group, info, data)));
        Ok(())
    }

    /// Ends the step: starts the buckets still waiting (unmarked gradients
    /// count as zero), waits for every bucket, and leaves the averaged
    /// gradients in place. A gradient never marked ready is an error naming
    /// it (after its bucket was reduced, so no peer waits forever), unless
    /// `find_unused_parameters` is set. After the first synced step the
    /// buckets are rebuilt in rank 0's ready order. Inside
    /// [`no_sync`](Self::no_sync) it returns at once.
    pub async fn finish(&mut self) -> Result<(), SyncError> {
        if !self.require_sync {
            return Ok(());
        }
        let unmarked = self.tracker.unmarked();
        for &p in &unmarked {
            // A gradient this rank did not produce contributes zero.
            let (bucket, offset) = self.layout.place[p];
            let size = self.specs[p].dtype.size();
            if let Some(storage) = self.storage[bucket].as_mut() {
                storage[offset * size..(offset + self.specs[p].len) * size].fill(0);
            }
        }
        let mut result = self.send_flag();
        if let Err(e) = self.tracker.mark_rest().try_for_each(|b| self.launch(b)) {
            result = Err(e);
        }
        for bucket in 0..self.layout.buckets.len() {
            let Some(handle) = self.in_flight[bucket].take() else {
                continue;
            };
            let spec = &self.layout.buckets[bucket];
            let outcome = match handle.await {
                Ok(Ok(t)) if t.dtype() == spec.dtype && t.len() == spec.len => Ok(t.into_bytes()),
                Ok(Ok(t)) => Err(SyncError::Hook {
                    bucket,
                    reason: format!(
                        "returned {} x {}, not the bucket's {} x {}",
                        t.len(),
                        t.dtype(),
                        spec.len,
                        spec.dtype
                    ),
                }),
                Ok(Err(e)) => Err(e.into()),
                Err(e) => Err(SyncError::Hook {
                    bucket,
                    reason: e.to_string(),
                }),
            };
            self.storage[bucket] = Some(match outcome {
                Ok(bytes) => bytes,
                Err(e) => {
                    if result.is_ok() {
                        result = Err(e);
                    }
                    vec![0; spec.len * spec.dtype.size()]
                }
            });
        }
        self.flag_sent = false;
        if let (Some(flag), true) = (self.flag.take(), result.is_ok()) {
            let joined = flag
                .await
                .map_err(|e| SyncError::Collective(CollectiveError::Broken(format!("the join flag's task: {e}"))));
            match joined.and_then(|r| Ok(r?)).and_then(|t| u64s_of_u32(&t)) {
                Ok(active) => self.divide_for_join(active),
                Err(e) => result = Err(e),
            }
        }
        let order = self.tracker.ready_order();
        self.tracker = ReadyTracker::new(&self.layout);
        let step = self.step;
        self.step += 1;
        if let Err(e) = result {
            return Err(self.aborted(step, e).await);
        }
        // Before the unmarked check: every rank must take part in the rebuild.
        if self.options.rebuild_buckets && !self.rebuilt {
            self.rebuilt = true;
            self.rebuild(order).await?;
        }
        if !unmarked.is_empty() && !self.options.find_unused_parameters && !self.joined {
            return Err(SyncError::Unmarked {
                step,
                names: unmarked.iter().map(|&p| self.specs[p].name.clone()).collect(),
            });
        }
        Ok(())
    }

    /// With `divide_by_initial_world_size` off, turns the average over the
    /// world into one over the `active` ranks that had data (floats only:
    /// an integer average cannot be rescaled exactly).
    fn divide_for_join(&mut self, active: u64) {
        let world = self.group.world_size() as u64;
        if self.options.divide_by_initial_world_size || active == 0 || active >= world {
            return;
        }
        let by = world as f64 / active as f64;
        for (bucket, storage) in self.layout.buckets.iter().zip(self.storage.iter_mut().flatten()) {
            match bucket.dtype {
                DType::Float32 => {
                    if let Ok(v) = bytemuck::try_cast_slice_mut::<u8, f32>(storage) {
                        v.iter_mut().for_each(|x| *x *= by as f32);
                    }
                }
                DType::Float64 => {
                    if let Ok(v) = bytemuck::try_cast_slice_mut::<u8, f64>(storage) {
                        v.iter_mut().for_each(|x| *x *= by);
                    }
                }
                _ => {}
            }
        }
    }

    /// Called by a rank that ran out of data, with `join` set (PyTorch's
    /// `join()` context manager around the loop): shadows the other
    /// ranks' synced steps, contributing zero gradients to every bucket,
    /// until every rank has joined; then returns with the gradients
    /// zeroed. Every rank calls it once its data ends, so nobody waits
    /// forever at the end of an epoch.
    pub async fn join(&mut self) -> Result<(), SyncError> {
        if !self.options.join {
            return Err(SyncError::JoinOff);
        }
        if !self.require_sync {
            return Ok(());
        }
        self.joined = true;
        let result: Result<(), SyncError> = async {
            loop {
                self.zero_grad()?;
                self.flag_sent = true;
                let flag = self.group.all_reduce(Tensor::from_slice(&[0u32]), ReduceOp::Sum);
                let active = u64s_of_u32(&flag.await?)?;
                if active == 0 {
                    return Ok(());
                }
                self.finish().await?;
            }
        }
        .await;
        self.joined = false;
        self.flag_sent = false;
        result?;
        self.zero_grad()
    }

    /// A failed bucket's error, as the group's abort when the group was
    /// aborted (the collective may have failed on a lost link just before
    /// supervision aborted the group): the gradients are zeroed then, since
    /// the other buckets' averages are of no use without this one.
    async fn aborted(&mut self, step: u64, error: SyncError) -> SyncError {
        let aborted = match error {
            SyncError::Collective(CollectiveError::GroupAborted(ref aborted)) => Some(aborted.clone()),
            SyncError::Collective(_) => {
                let mut failures = self.group.failures();
                // A short grace: supervision aborts the group right after
                // the link failure this collective saw first.
                let waited = tokio::time::timeout(ABORT_GRACE, failures.wait_for(Option::is_some)).await;
                waited.ok().and_then(|r| r.ok()).and_then(|a| a.clone())
            }
            _ => None,
        };
        match aborted {
            Some(aborted) => {
                self.storage.iter_mut().flatten().for_each(|s| s.fill(0));
                SyncError::Aborted { step, aborted }
            }
            None => error,
        }
    }

    /// Moves the sync to another group, typically an `ElasticGroup`'s next
    /// generation after [`finish`](Self::finish) returned
    /// [`SyncError::Aborted`] (every rank of the new group calls it, or
    /// [`new`](Self::new) with `init_sync: false` on a rank that joins):
    /// drops the buckets in flight, zeroes the gradients, forgets the
    /// step's ready marks, goes back to the registration-order buckets (so
    /// that the next step rebuilds them in agreement with the new rank 0),
    /// and checks that every rank of the new group registered the same
    /// parameters. Broadcasts nothing: the survivors' parameters are equal
    /// already. A hook that holds a group (PowerSGD) must be registered
    /// anew.
    pub async fn rebind(&mut self, group: impl Into<GroupRef<'g>>) -> Result<(), SyncError> {
        for handle in self
            .in_flight
            .iter_mut()
            .filter_map(Option::take)
            .chain(self.flag.take())
        {
            handle.abort();
        }
        self.layout = plan::assign_buckets(&self.specs, &plan::reverse_order(self.specs.len()), self.options.caps());
        self.storage = zeroed(&self.layout);
        self.in_flight = self.layout.buckets.iter().map(|_| None).collect();
        self.tracker = ReadyTracker::new(&self.layout);
        self.rebuilt = false;
        self.flag_sent = false;
        self.group = group.into();
        check_same_everywhere(&self.group, &self.entries).await
    }

    /// The group the buckets are reduced on.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Adopts rank 0's ready order as the bucket layout, moving the
    /// current gradients over (once, so a copy is acceptable).
    async fn rebuild(&mut self, order: Vec<usize>) -> Result<(), SyncError> {
        let n = self.specs.len();
        let mine: Vec<u32> = order.iter().map(|&p| p as u32).collect();
        let agreed = self.group.broadcast(Tensor::from_slice(&mine), 0).await?;
        let agreed: Vec<usize> = agreed
            .to_vec::<u32>()
            .map_err(|_| SyncError::BadOrder(n))?
            .into_iter()
            .map(|p| p as usize)
            .collect();
        if !plan::check_order(&agreed, n) {
            return Err(SyncError::BadOrder(n));
        }
        let layout = plan::assign_buckets(&self.specs, &agreed, self.options.caps());
        if layout == self.layout {
            return Ok(());
        }
        let mut storage = zeroed(&layout);
        for (p, spec) in self.specs.iter().enumerate() {
            let size = spec.dtype.size();
            let ((old_b, old_off), (new_b, new_off)) = (self.layout.place[p], layout.place[p]);
            let (Some(old), Some(new)) = (self.storage[old_b].as_ref(), storage[new_b].as_mut()) else {
                continue;
            };
            new[new_off * size..(new_off + spec.len) * size]
                .copy_from_slice(&old[old_off * size..(old_off + spec.len) * size]);
        }
        self.in_flight = layout.buckets.iter().map(|_| None).collect();
        self.tracker = ReadyTracker::new(&layout);
        self.storage = storage;
        self.layout = layout;
        Ok(())
    }

    /// Gradient accumulation (PyTorch's `with ddp.no_sync():`): while the
    /// guard lives, `mark_ready` and `finish` communicate nothing and the
    /// gradients accumulate in place; the next synced step reduces the sum.
    pub fn no_sync(&mut self) -> NoSync<'_, 'g> {
        self.require_sync = false;
        NoSync(self)
    }

    /// Compares a checksum of every parameter and buffer of `model` across
    /// ranks: an error on every rank names each rank that differs from
    /// rank 0 and its first differing entry.
    pub async fn verify(&self, model: &mut (dyn Parameters + Send)) -> Result<(), SyncError> {
        let (_, entries) = describe(model);
        if let Some(d) = plan::first_difference(&self.entries, &entries) {
            let show = |s: Option<ParamSpec>| s.map_or_else(|| "nothing".to_owned(), |s| s.to_string());
            return Err(SyncError::Changed(format!(
                "#{} was {}, is {}",
                d.index,
                show(d.reference),
                show(d.other)
            )));
        }
        let mut sums = vec![plan::FNV_OFFSET; entries.len()];
        let mut scratch = vec![0u8; 1 << 20];
        for_each_entry(model, |i, _, b| {
            let total = b.len() * b.dtype().size();
            let mut at = 0;
            while at < total {
                let n = (total - at).min(scratch.len());
                b.read_bytes(at, &mut scratch[..n]);
                sums[i] = plan::fnv1a(sums[i], &scratch[..n]);
                at += n;
            }
        });
        let all = u64s(self.group.all_gather(Tensor::from_slice(&sums)).await?)?;
        let rows: Vec<Vec<u64>> = all.chunks(entries.len().max(1)).map(<[u64]>::to_vec).collect();
        let diverged = plan::diverged(&rows);
        if diverged.is_empty() {
            return Ok(());
        }
        Err(SyncError::Diverged(
            diverged
                .into_iter()
                .map(|(rank, i)| Diverged {
                    rank,
                    first: entries[i].name.clone(),
                })
                .collect(),
        ))
    }
}

fn zeroed(layout: &Layout) -> Vec<Option<Vec<u8>>> {
    layout
        .buckets
        .iter()
        .map(|b| Some(vec![0; b.len * b.dtype.size()]))
        .collect()
}

/// [`DistributedSync::no_sync`]'s guard: the sync, with communication off
/// until it drops.
pub struct NoSync<'a, 'g>(&'a mut DistributedSync<'g>);

impl<'g> std::ops::Deref for NoSync<'_, 'g> {
    type Target = DistributedSync<'g>;
    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl std::ops::DerefMut for NoSync<'_, '_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.0
    }
}

impl Drop for NoSync<'_, '_> {
    fn drop(&mut self) {
        self.0.require_sync = true;
    }
}
