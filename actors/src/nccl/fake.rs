//! An in-process stand-in for NCCL, for tests on machines without a GPU:
//! "device" buffers are host memory, a [`FakeFabric`] shared by the ranks of
//! a process does the arithmetic once every rank has launched a collective,
//! and faults are injected per communicator ([`Fault`]).
//!
//! It keeps the semantics the supervision relies on: a launch returns at
//! once and completes later; a rank that never launches (or hangs) leaves
//! its peers waiting forever; collectives are matched by their order among
//! collectives, and the sends and receives of grouped operations (gather,
//! scatter, all-to-all, send, recv: [`NcclOp::p2p_calls`]) by their order
//! between each pair of ranks, as NCCL matches them; `status` reports an injected asynchronous
//! error, and `ncclRemoteError` once a peer has aborted; abort ends
//! everything and is idempotent.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use chorus_runtime::collective::{CollectiveKind, ReduceOp, finalize_avg, reduce_into};

use super::code::NcclCode;
use super::comm::{Backend, Communicator, DeviceBuffer};
use super::types::{CommStatus, NcclError, NcclOp, P2pCall, UNIQUE_ID_BYTES, UniqueId};

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // No code path panics while holding these locks; recover the data if one ever does.
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// A fake device buffer: host memory shared with the fabric, which writes
/// it when a collective completes (as a kernel writes device memory after
/// the launch returned).
#[derive(Debug, Clone)]
pub struct FakeBuffer(Arc<Mutex<Vec<u8>>>);

impl FakeBuffer {
    /// A buffer holding `bytes`.
    pub fn from_host(bytes: Vec<u8>) -> Self {
        Self(Arc::new(Mutex::new(bytes)))
    }

    /// A buffer of `len` zero bytes.
    pub fn zeros(len: usize) -> Self {
        Self::from_host(vec![0; len])
    }

    /// A copy of its contents.
    pub fn to_host(&self) -> Vec<u8> {
        lock(&self.0).clone()
    }
}

impl DeviceBuffer for FakeBuffer {
    fn len(&self) -> usize {
        lock(&self.0).len()
    }
}

/// A fault injected into one fake communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Collective number `n` (counted from 0 per communicator) never runs on
    /// this rank: its kernel hangs, and so do its peers', until aborted.
    HangAt(u64),
    /// Once collective number `seq` is launched, `ncclCommGetAsyncError`
    /// reports `code` (a peer or the network failed) and the collective
    /// hangs.
    AsyncErrorAt {
        /// The collective.
        seq: u64,
        /// The error.
        code: NcclCode,
    },
}

/// Ranks that share a unique id.
#[derive(Debug)]
struct World {
    size: usize,
    state: Mutex<WorldState>,
}

#[derive(Debug)]
struct WorldState {
    joined: Vec<bool>,
    aborted: Vec<bool>,
    slots: HashMap<u64, Slot>,
    transfers: HashMap<TransferKey, Transfer>,
}

/// The `n`th transfer from rank `from` to rank `to`.
type TransferKey = (usize, usize, u64);

/// One send matched with one receive.
#[derive(Debug, Default)]
struct Transfer {
    sent: Option<(NcclOp, Vec<u8>)>,
    receiver: Option<(NcclOp, FakeBuffer, usize)>,
    done: Option<Result<(), NcclError>>,
}

impl Transfer {
    /// Copies the data once both sides are there.
    fn complete(&mut self) {
        let (Some((send_op, data)), Some((recv_op, output, offset))) = (&self.sent, &self.receiver) else {
            return;
        };
        self.done = Some(
            if send_op.dtype != recv_op.dtype || data.len() != recv_op.count * recv_op.dtype.size() {
                Err(NcclError::Call {
                    call: "ncclCommGetAsyncError",
                    code: NcclCode::InvalidUsage,
                    detail: format!(
                        "mismatched send and receive: {send_op} sent {} bytes to {recv_op}",
                        data.len()
                    ),
                })
            } else {
                lock(&output.0)[*offset..*offset + data.len()].copy_from_slice(data);
                Ok(())
            },
        );
    }
}

#[derive(Debug)]
struct Deposit {
    op: NcclOp,
    input: Vec<u8>,
    output: FakeBuffer,
}

/// One collective: what each rank launched, then its outcome.
#[derive(Debug)]
enum Slot {
    Pending(Vec<Option<Deposit>>),
    Done(Result<(), NcclError>),
}

/// The "network" of fake communicators: ranks meet by unique id.
#[derive(Debug, Default)]
pub struct FakeFabric {
    worlds: Mutex<HashMap<UniqueId, Arc<World>>>,
    ids: AtomicU64,
}

/// A [`Backend`] on a [`FakeFabric`]; clones share it.
#[derive(Debug, Clone, Default)]
pub struct FakeBackend {
    fabric: Arc<FakeFabric>,
}

impl FakeBackend {
    /// A backend on a fabric of its own.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Backend for FakeBackend {
    type Comm = FakeComm;

    fn unique_id(&self) -> Result<UniqueId, NcclError> {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        let n = self.fabric.ids.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        bytes[..8].copy_from_slice(&n.to_le_bytes());
        bytes[8..24].copy_from_slice(&nanos.to_le_bytes());
        bytes[24..28].copy_from_slice(&std::process::id().to_le_bytes());
        Ok(UniqueId::from_array(bytes))
    }

    fn init(&self, id: &UniqueId, rank: usize, world: usize) -> Result<FakeComm, NcclError> {
        let invalid = |code, detail: String| NcclError::Call {
            call: "ncclCommInitRankConfig",
            code,
            detail,
        };
        if rank >= world {
            return Err(invalid(
                NcclCode::InvalidArgument,
                format!("rank {rank} is not in 0..{world}"),
            ));
        }
        let shared = lock(&self.fabric.worlds)
            .entry(*id)
            .or_insert_with(|| {
                Arc::new(World {
                    size: world,
                    state: Mutex::new(WorldState {
                        joined: vec![false; world],
                        aborted: vec![false; world],
                        slots: HashMap::new(),
                        transfers: HashMap::new(),
                    }),
                })
            })
            .clone();
        if shared.size != world {
            return Err(invalid(
                NcclCode::InvalidArgument,
                format!("{world} ranks, but the id names a communicator of {}", shared.size),
            ));
        }
        let mut state = lock(&shared.state);
        if std::mem::replace(&mut state.joined[rank], true) {
            return Err(invalid(NcclCode::InvalidUsage, format!("rank {rank} joined twice")));
        }
        drop(state);
        Ok(FakeComm {
            inner: Arc::new(Inner {
                rank,
                world: shared,
                state: Mutex::new(CommState::default()),
            }),
        })
    }
}

#[derive(Debug, Default)]
struct CommState {
    launched: u64,
    /// What each launch waits on, by launch number.
    launches: HashMap<u64, Launch>,
    collectives: u64,
    sent: HashMap<usize, u64>,
    received: HashMap<usize, u64>,
    faults: Vec<Fault>,
    hung: Vec<u64>,
    async_error: Option<NcclCode>,
    aborted: bool,
    abort_calls: u64,
}

#[derive(Debug)]
struct Inner {
    rank: usize,
    world: Arc<World>,
    state: Mutex<CommState>,
}

/// A fake communicator. Clones are handles to the same one, so a test can
/// inject faults into, and watch, a communicator a group owns.
#[derive(Debug, Clone)]
pub struct FakeComm {
    inner: Arc<Inner>,
}

/// What a launch completes with.
#[derive(Debug)]
enum Launch {
    /// A collective, by its number among collectives.
    Collective(u64),
    /// Sends and receives, every one of which must complete.
    Transfers(Vec<TransferKey>),
}

/// The end of the work launched before it: the number of the last
/// launch, if any.
#[derive(Debug)]
pub struct FakeEvent(Option<u64>);

impl FakeComm {
    /// Injects `fault`.
    pub fn inject(&self, fault: Fault) {
        lock(&self.inner.state).faults.push(fault);
    }

    /// How many times `abort` was called.
    pub fn abort_calls(&self) -> u64 {
        lock(&self.inner.state).abort_calls
    }

    /// Whether it was aborted.
    pub fn is_aborted(&self) -> bool {
        lock(&self.inner.state).aborted
    }

    /// How many collectives were launched on it.
    pub fn launched(&self) -> u64 {
        lock(&self.inner.state).launched
    }

    fn aborted_error(&self) -> NcclError {
        NcclError::Aborted { rank: self.inner.rank }
    }
}

impl Communicator for FakeComm {
    type Buffer = FakeBuffer;
    type Event = FakeEvent;

    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn world(&self) -> usize {
        self.inner.world.size
    }

    fn zeros(&self, len: usize) -> Result<FakeBuffer, NcclError> {
        Ok(FakeBuffer::zeros(len))
    }

    fn launch(&self, op: &NcclOp, input: Option<&FakeBuffer>, output: &mut FakeBuffer) -> Result<(), NcclError> {
        let (rank, size) = (self.inner.rank, self.inner.world.size);
        op.check(size, rank, input.map(DeviceBuffer::len), output.len())?;
        let mut state = lock(&self.inner.state);
        if state.aborted {
            return Err(self.aborted_error());
        }
        let seq = state.launched;
        state.launched += 1;
        let mut hangs = false;
        for fault in state.faults.clone() {
            match fault {
                Fault::HangAt(n) if n == seq => hangs = true,
                Fault::AsyncErrorAt { seq: n, code } if n == seq => {
                    state.async_error = Some(code);
                    hangs = true;
                }
                _ => {}
            }
        }
        if hangs {
            state.hung.push(seq);
            return Ok(());
        }
        let input = input.unwrap_or(output).to_host();
        let mut world = lock(&self.inner.world.state);
        if op.is_grouped_p2p() {
            let mut keys = Vec::new();
            for call in op.p2p_calls(size, rank) {
                let key = match call {
                    P2pCall::Send { peer, .. } => (rank, peer, next(&mut state.sent, peer)),
                    P2pCall::Recv { peer, .. } => (peer, rank, next(&mut state.received, peer)),
                };
                let transfer = world.transfers.entry(key).or_default();
                match call {
                    P2pCall::Send { offset, .. } => {
                        transfer.sent = Some((*op, input[offset..offset + op.count * op.dtype.size()].to_vec()));
                    }
                    P2pCall::Recv { offset, .. } => transfer.receiver = Some((*op, output.clone(), offset)),
                }
                transfer.complete();
                keys.push(key);
            }
            state.launches.insert(seq, Launch::Transfers(keys));
            return Ok(());
        }
        let collective = state.collectives;
        state.collectives += 1;
        state.launches.insert(seq, Launch::Collective(collective));
        let deposit = Deposit {
            op: *op,
            input,
            output: output.clone(),
        };
        let slot = world
            .slots
            .entry(collective)
            .or_insert_with(|| Slot::Pending((0..size).map(|_| None).collect()));
        if let Slot::Pending(deposits) = slot {
            deposits[rank] = Some(deposit);
            if deposits.iter().all(Option::is_some) {
                let deposits: Vec<Deposit> = std::mem::take(deposits).into_iter().flatten().collect();
                *slot = Slot::Done(run(&deposits));
            }
        }
        Ok(())
    }

    fn record(&self) -> Result<FakeEvent, NcclError> {
        let state = lock(&self.inner.state);
        if state.aborted {
            return Err(self.aborted_error());
        }
        Ok(FakeEvent(state.launched.checked_sub(1)))
    }

    fn query(&self, event: &FakeEvent) -> Result<bool, NcclError> {
        let state = lock(&self.inner.state);
        if state.aborted {
            return Err(self.aborted_error());
        }
        let Some(seq) = event.0 else {
            return Ok(true);
        };
        if state.hung.contains(&seq) {
            return Ok(false);
        }
        let world = lock(&self.inner.world.state);
        match state.launches.get(&seq) {
            Some(Launch::Collective(n)) => match world.slots.get(n) {
                Some(Slot::Done(outcome)) => outcome.clone().map(|()| true),
                _ => Ok(false),
            },
            Some(Launch::Transfers(keys)) => {
                for key in keys {
                    match world.transfers.get(key).and_then(|t| t.done.clone()) {
                        Some(Ok(())) => {}
                        Some(Err(error)) => return Err(error),
                        None => return Ok(false),
                    }
                }
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn status(&self) -> Result<CommStatus, NcclError> {
        let state = lock(&self.inner.state);
        if state.aborted {
            return Err(self.aborted_error());
        }
        if let Some(code) = state.async_error {
            return Err(NcclError::Call {
                call: "ncclCommGetAsyncError",
                code,
                detail: "injected".into(),
            });
        }
        let world = lock(&self.inner.world.state);
        if let Some(peer) = world.aborted.iter().position(|&a| a) {
            return Err(NcclError::Call {
                call: "ncclCommGetAsyncError",
                code: NcclCode::RemoteError,
                detail: format!("rank {peer} aborted its communicator"),
            });
        }
        Ok(if world.joined.iter().all(|&j| j) {
            CommStatus::Ready
        } else {
            CommStatus::InProgress
        })
    }

    fn abort(&self) -> Result<bool, NcclError> {
        let mut state = lock(&self.inner.state);
        state.abort_calls += 1;
        if std::mem::replace(&mut state.aborted, true) {
            return Ok(false);
        }
        lock(&self.inner.world.state).aborted[self.inner.rank] = true;
        Ok(true)
    }
}

/// The next number of `peer`'s counter.
fn next(counters: &mut HashMap<usize, u64>, peer: usize) -> u64 {
    let counter = counters.entry(peer).or_default();
    *counter += 1;
    *counter - 1
}

/// Runs one collective once every rank has launched it: checks that they
/// agree, computes, and writes every rank's output.
fn run(deposits: &[Deposit]) -> Result<(), NcclError> {
    let op = deposits[0].op;
    if let Some((rank, other)) = deposits.iter().enumerate().find(|(_, d)| d.op != op) {
        return Err(NcclError::Call {
            call: "ncclCommGetAsyncError",
            code: NcclCode::InvalidUsage,
            detail: format!("mismatched collectives: rank 0 ran {op}, rank {rank} ran {}", other.op),
        });
    }
    let world = deposits.len();
    let reduce = |blocks: &mut dyn Iterator<Item = &[u8]>| -> Result<Vec<u8>, NcclError> {
        let reduce_op = op.reduce_op().unwrap_or(ReduceOp::Sum);
        let invalid = |e: chorus_runtime::collective::ReduceError| NcclError::Call {
            call: "ncclCommGetAsyncError",
            code: NcclCode::InvalidArgument,
            detail: e.to_string(),
        };
        let mut acc = blocks.next().unwrap_or_default().to_vec();
        for block in blocks {
            reduce_into(reduce_op, op.dtype, &mut acc, block).map_err(invalid)?;
        }
        if reduce_op == ReduceOp::Avg {
            finalize_avg(op.dtype, &mut acc, world).map_err(invalid)?;
        }
        Ok(acc)
    };
    let write = |rank: usize, bytes: &[u8]| lock(&deposits[rank].output.0).copy_from_slice(bytes);
    match op.kind {
        CollectiveKind::AllReduce | CollectiveKind::Reduce => {
            let result = reduce(&mut deposits.iter().map(|d| d.input.as_slice()))?;
            for rank in 0..world {
                if op.kind == CollectiveKind::AllReduce || op.root == Some(rank) {
                    write(rank, &result);
                }
            }
        }
        CollectiveKind::Broadcast => {
            let root = &deposits[op.root.unwrap_or(0)].input;
            (0..world).for_each(|rank| write(rank, root));
        }
        CollectiveKind::AllGather => {
            let all: Vec<u8> = deposits.iter().flat_map(|d| d.input.iter().copied()).collect();
            (0..world).for_each(|rank| write(rank, &all));
        }
        CollectiveKind::ReduceScatter => {
            let block = op.output_bytes(world, 0);
            for rank in 0..world {
                let result = reduce(&mut deposits.iter().map(|d| &d.input[rank * block..(rank + 1) * block]))?;
                write(rank, &result);
            }
        }
        kind => {
            return Err(NcclError::UnsupportedKind { kind });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_runtime::collective::DType;

    fn f32s(values: &[f32]) -> FakeBuffer {
        FakeBuffer::from_host(values.iter().flat_map(|v| v.to_ne_bytes()).collect())
    }

    fn host_f32(buffer: &FakeBuffer) -> Vec<f32> {
        buffer
            .to_host()
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn world(n: usize) -> Vec<FakeComm> {
        let backend = FakeBackend::new();
        let id = backend.unique_id().unwrap();
        (0..n).map(|rank| backend.init(&id, rank, n).unwrap()).collect()
    }

    #[test]
    fn a_collective_completes_once_every_rank_launched_it() {
        let comms = world(3);
        let op = NcclOp::all_reduce(DType::Float32, 2, ReduceOp::Avg);
        let mut outputs: Vec<FakeBuffer> = (0..3).map(|r| f32s(&[r as f32, 3.0 * r as f32])).collect();
        for (comm, output) in comms.iter().zip(&mut outputs).take(2) {
            comm.launch(&op, None, output).unwrap();
        }
        let event = comms[0].record().unwrap();
        assert!(!comms[0].query(&event).unwrap(), "rank 2 has not launched");
        comms[2].launch(&op, None, &mut outputs[2]).unwrap();
        assert!(comms[0].query(&event).unwrap());
        for output in &outputs {
            assert_eq!(host_f32(output), vec![1.0, 3.0]);
        }
    }

    #[test]
    fn gathers_scatters_broadcasts_and_reduces_to_a_root() {
        let comms = world(2);
        let run = |op: NcclOp, inputs: Vec<Vec<f32>>, out_len: usize| -> Vec<Vec<f32>> {
            let mut outputs: Vec<FakeBuffer> = (0..2).map(|_| f32s(&vec![0.0; out_len])).collect();
            for (rank, comm) in comms.iter().enumerate() {
                comm.launch(&op, Some(&f32s(&inputs[rank])), &mut outputs[rank])
                    .unwrap();
            }
            outputs.iter().map(host_f32).collect()
        };
        let gathered = run(
            NcclOp::all_gather(DType::Float32, 2),
            vec![vec![1.0, 2.0], vec![3.0, 4.0]],
            4,
        );
        assert_eq!(gathered, vec![vec![1.0, 2.0, 3.0, 4.0]; 2]);
        let scattered = run(
            NcclOp::reduce_scatter(DType::Float32, 1, ReduceOp::Max),
            vec![vec![1.0, 8.0], vec![5.0, 2.0]],
            1,
        );
        assert_eq!(scattered, vec![vec![5.0], vec![8.0]]);
        let broadcast = run(NcclOp::broadcast(DType::Float32, 1, 1), vec![vec![0.0], vec![7.0]], 1);
        assert_eq!(broadcast, vec![vec![7.0]; 2]);
        let reduced = run(
            NcclOp::reduce(DType::Float32, 1, ReduceOp::Prod, 0),
            vec![vec![3.0], vec![4.0]],
            1,
        );
        assert_eq!(
            reduced,
            vec![vec![12.0], vec![0.0]],
            "only the root's output is written"
        );
    }

    #[test]
    fn mismatched_collectives_fail_on_every_rank() {
        let comms = world(2);
        let mut a = f32s(&[1.0]);
        let mut b = f32s(&[1.0, 2.0]);
        comms[0]
            .launch(&NcclOp::all_reduce(DType::Float32, 1, ReduceOp::Sum), None, &mut a)
            .unwrap();
        comms[1]
            .launch(&NcclOp::all_reduce(DType::Float32, 2, ReduceOp::Sum), None, &mut b)
            .unwrap();
        let event = comms[1].record().unwrap();
        let err = comms[1].query(&event).unwrap_err();
        assert!(err.to_string().contains("mismatched collectives"), "{err}");
    }

    #[test]
    fn init_is_in_progress_until_every_rank_joined_and_checks_its_arguments() {
        let backend = FakeBackend::new();
        let id = backend.unique_id().unwrap();
        assert_ne!(id, backend.unique_id().unwrap());
        let first = backend.init(&id, 0, 2).unwrap();
        assert_eq!(first.status(), Ok(CommStatus::InProgress));
        assert!(
            backend
                .init(&id, 0, 2)
                .unwrap_err()
                .to_string()
                .contains("joined twice")
        );
        assert!(backend.init(&id, 1, 3).is_err(), "a different world size");
        assert!(backend.init(&id, 2, 2).is_err(), "a rank outside the world");
        let _second = backend.init(&id, 1, 2).unwrap();
        assert_eq!(first.status(), Ok(CommStatus::Ready));
    }

    #[test]
    fn abort_is_idempotent_and_peers_see_a_remote_error() {
        let comms = world(2);
        assert_eq!(comms[0].abort(), Ok(true));
        assert_eq!(comms[0].abort(), Ok(false));
        assert_eq!((comms[0].abort_calls(), comms[0].is_aborted()), (2, true));
        assert_eq!(comms[0].status(), Err(NcclError::Aborted { rank: 0 }));
        let mut buffer = f32s(&[1.0]);
        assert!(matches!(
            comms[0].launch(&NcclOp::all_reduce(DType::Float32, 1, ReduceOp::Sum), None, &mut buffer),
            Err(NcclError::Aborted { .. })
        ));
        assert!(matches!(
            comms[1].status(),
            Err(NcclError::Call {
                code: NcclCode::RemoteError,
                ..
            })
        ));
    }
}
