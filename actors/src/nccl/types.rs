//! What an NCCL operation is, how chorus's dtypes and operators map onto
//! NCCL's (`ncclDataType_t`, `ncclRedOp_t`), and the errors of NCCL calls.

use std::fmt;

use chorus_runtime::collective::{CollectiveKind, DType, ReduceOp};
use cudarc::nccl::sys::{ncclDataType_t, ncclRedOp_t};
use thiserror::Error;

use super::code::NcclCode;
use super::probe::ProbeError;

/// Size of an `ncclUniqueId` in bytes.
pub const UNIQUE_ID_BYTES: usize = 128;

/// An `ncclUniqueId`: made by one rank, handed to every rank through the
/// store, it names one communicator.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId([u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    /// The id made of these bytes.
    pub const fn from_array(bytes: [u8; UNIQUE_ID_BYTES]) -> Self {
        Self(bytes)
    }

    /// The id in `bytes`, or `None` when they are not exactly
    /// [`UNIQUE_ID_BYTES`] long.
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    /// The raw bytes, as the store holds them.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.0
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The first bytes are enough to tell two ids apart in a log.
        write!(f, "UniqueId(")?;
        for byte in &self.0[..8] {
            write!(f, "{byte:02x}")?;
        }
        write!(f, "..)")
    }
}

/// What `ncclCommGetAsyncError` says of a healthy communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommStatus {
    /// Idle or running: the last call has been taken in.
    Ready,
    /// A non-blocking call (init, a launch, abort) is still being carried out.
    InProgress,
}

/// Errors from NCCL and CUDA calls and from checking an operation.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NcclError {
    /// An NCCL call returned an error.
    #[error("{call} failed with {code}{}", detail_suffix(detail))]
    Call {
        /// The function called.
        call: &'static str,
        /// What it returned.
        code: NcclCode,
        /// `ncclGetLastError`'s text, when it had one.
        detail: String,
    },
    /// A CUDA driver call failed.
    #[error("CUDA {call} failed: {detail}")]
    Cuda {
        /// The function called.
        call: &'static str,
        /// The driver's error.
        detail: String,
    },
    /// The communicator was aborted: it takes no more calls.
    #[error("the NCCL communicator of rank {rank} was aborted; form a new group (a new unique id)")]
    Aborted {
        /// Its rank.
        rank: usize,
    },
    /// CUDA or NCCL cannot be used on this machine.
    #[error(transparent)]
    Unavailable(#[from] ProbeError),
    /// A reduction operator NCCL does not have.
    #[error("NCCL has no {op} reduction (its operators are sum, prod, min, max, avg); use the CPU backend for {op}")]
    UnsupportedOp {
        /// The operator.
        op: ReduceOp,
    },
    /// A collective the NCCL library has no call for (barrier: NCCL groups
    /// run it as a one-element all-reduce, `NcclGroup::barrier`).
    #[error("{kind} is not an NCCL operation; a barrier is a one-element all_reduce (NcclGroup::barrier)")]
    UnsupportedKind {
        /// The collective.
        kind: CollectiveKind,
    },
    /// A send or receive whose peer is the rank itself: NCCL would match it
    /// only with its twin in one group call, so alone it never completes.
    #[error("rank {rank} cannot {kind} to or from itself")]
    PeerIsSelf {
        /// Send or recv.
        kind: CollectiveKind,
        /// The rank.
        rank: usize,
    },
    /// A rooted collective without a root in the group.
    #[error("{kind} needs a root in 0..{world}, got {root:?}")]
    BadRoot {
        /// The collective.
        kind: CollectiveKind,
        /// The root given.
        root: Option<usize>,
        /// The world size.
        world: usize,
    },
    /// A buffer of the wrong length.
    #[error("{operation} needs {expected} bytes in its {which} buffer, got {got}")]
    BufferSize {
        /// The operation.
        operation: String,
        /// "input" or "output".
        which: &'static str,
        /// Bytes it needs.
        expected: usize,
        /// Bytes it got.
        got: usize,
    },
}

fn detail_suffix(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!(": {detail}")
    }
}

/// The NCCL type of a chorus dtype. Every dtype has one (bfloat16 needs
/// NCCL 2.10, below the 2.14 the backend requires anyway).
pub const fn nccl_data_type(dtype: DType) -> ncclDataType_t {
    match dtype {
        DType::Int8 => ncclDataType_t::ncclInt8,
        DType::UInt8 => ncclDataType_t::ncclUint8,
        DType::Int32 => ncclDataType_t::ncclInt32,
        DType::UInt32 => ncclDataType_t::ncclUint32,
        DType::Int64 => ncclDataType_t::ncclInt64,
        DType::UInt64 => ncclDataType_t::ncclUint64,
        DType::Float16 => ncclDataType_t::ncclFloat16,
        DType::BFloat16 => ncclDataType_t::ncclBfloat16,
        DType::Float32 => ncclDataType_t::ncclFloat32,
        DType::Float64 => ncclDataType_t::ncclFloat64,
    }
}

/// The NCCL operator of a chorus operator: the bitwise ones have none.
/// `avg` on integers truncates in NCCL as in chorus's CPU kernels.
pub fn nccl_red_op(op: ReduceOp) -> Result<ncclRedOp_t, NcclError> {
    match op {
        ReduceOp::Sum => Ok(ncclRedOp_t::ncclSum),
        ReduceOp::Prod => Ok(ncclRedOp_t::ncclProd),
        ReduceOp::Min => Ok(ncclRedOp_t::ncclMin),
        ReduceOp::Max => Ok(ncclRedOp_t::ncclMax),
        ReduceOp::Avg => Ok(ncclRedOp_t::ncclAvg),
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => Err(NcclError::UnsupportedOp { op }),
    }
}

/// One NCCL operation as submitted: which, on what, how many.
///
/// Buffer lengths on rank `r` (`count` elements, `P` ranks):
/// - all-reduce, broadcast, reduce: input and output `count`; without an
///   input the operation runs in place in the output (for broadcast, the
///   root's output holds the data).
/// - all-gather: input `count`, output `count * P` (block `i` from rank `i`).
/// - reduce-scatter: input `count * P`, output `count` (the reduction of
///   every rank's block `r`).
/// - gather: input `count`; output `count * P` at the root (block `i` from
///   rank `i`), empty elsewhere.
/// - scatter: input `count * P` at the root (block `i` goes to rank `i`),
///   none elsewhere; output `count`.
/// - all-to-all: input and output `count * P`: input block `j` goes to rank
///   `j`, output block `i` comes from rank `i`. Never in place.
/// - send and recv (`root` is the peer): no input; the output is the data
///   sent, or the place the data received goes (`count`).
///
/// Only operations whose input and output have the same length run in place
/// (no input given); an operation that reads nothing takes no input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclOp {
    /// Which collective.
    pub kind: CollectiveKind,
    /// The element type.
    pub dtype: DType,
    /// Elements per rank (see above).
    pub count: usize,
    /// The root of broadcast, reduce, gather and scatter; the peer of send
    /// and recv.
    pub root: Option<usize>,
    /// The operator of reducing collectives (sum when `None`).
    pub op: Option<ReduceOp>,
}

impl NcclOp {
    /// An all-reduce of `count` elements with `op`.
    pub fn all_reduce(dtype: DType, count: usize, op: ReduceOp) -> Self {
        Self {
            kind: CollectiveKind::AllReduce,
            dtype,
            count,
            root: None,
            op: Some(op),
        }
    }

    /// A broadcast of `count` elements from `root`.
    pub fn broadcast(dtype: DType, count: usize, root: usize) -> Self {
        Self {
            kind: CollectiveKind::Broadcast,
            dtype,
            count,
            root: Some(root),
            op: None,
        }
    }

    /// A reduction of `count` elements with `op` into `root`.
    pub fn reduce(dtype: DType, count: usize, op: ReduceOp, root: usize) -> Self {
        Self {
            kind: CollectiveKind::Reduce,
            dtype,
            count,
            root: Some(root),
            op: Some(op),
        }
    }

    /// An all-gather of `count` elements from each rank.
    pub fn all_gather(dtype: DType, count: usize) -> Self {
        Self {
            kind: CollectiveKind::AllGather,
            dtype,
            count,
            root: None,
            op: None,
        }
    }

    /// A reduce-scatter leaving `count` reduced elements on each rank.
    pub fn reduce_scatter(dtype: DType, count: usize, op: ReduceOp) -> Self {
        Self {
            kind: CollectiveKind::ReduceScatter,
            dtype,
            count,
            root: None,
            op: Some(op),
        }
    }

    /// A gather of `count` elements from each rank into `root`.
    pub fn gather(dtype: DType, count: usize, root: usize) -> Self {
        Self::rooted(CollectiveKind::Gather, dtype, count, root)
    }

    /// A scatter of `count` elements to each rank from `root`.
    pub fn scatter(dtype: DType, count: usize, root: usize) -> Self {
        Self::rooted(CollectiveKind::Scatter, dtype, count, root)
    }

    /// An all-to-all of `count` elements between every pair of ranks.
    pub fn all_to_all(dtype: DType, count: usize) -> Self {
        Self {
            kind: CollectiveKind::AllToAll,
            dtype,
            count,
            root: None,
            op: None,
        }
    }

    /// A send of `count` elements to `peer`.
    pub fn send(dtype: DType, count: usize, peer: usize) -> Self {
        Self::rooted(CollectiveKind::Send, dtype, count, peer)
    }

    /// A receive of `count` elements from `peer`.
    pub fn recv(dtype: DType, count: usize, peer: usize) -> Self {
        Self::rooted(CollectiveKind::Recv, dtype, count, peer)
    }

    fn rooted(kind: CollectiveKind, dtype: DType, count: usize, root: usize) -> Self {
        Self {
            kind,
            dtype,
            count,
            root: Some(root),
            op: None,
        }
    }

    /// Whether it is a point-to-point operation (send, recv): only the two
    /// ranks take part, matched in the order each pair issues them.
    pub fn is_p2p(&self) -> bool {
        matches!(self.kind, CollectiveKind::Send | CollectiveKind::Recv)
    }

    /// Whether NCCL runs it as grouped sends and receives (gather, scatter,
    /// all-to-all, send, recv) rather than one collective call.
    pub fn is_grouped_p2p(&self) -> bool {
        matches!(
            self.kind,
            CollectiveKind::Gather
                | CollectiveKind::Scatter
                | CollectiveKind::AllToAll
                | CollectiveKind::Send
                | CollectiveKind::Recv
        )
    }

    /// The sends and receives `rank` issues, in one NCCL group, for a
    /// [grouped](Self::is_grouped_p2p) operation (as PyTorch's
    /// ProcessGroupNCCL issues them); empty for the others. Each moves
    /// `count` elements; a send reads its input (the output for send), a
    /// receive writes its output.
    pub fn p2p_calls(&self, world: usize, rank: usize) -> Vec<P2pCall> {
        let block = self.count.saturating_mul(self.dtype.size());
        let root = self.root.unwrap_or(0);
        let every = |call: fn(usize, usize) -> P2pCall| (0..world).map(move |peer| call(peer, peer * block));
        let send = |peer, offset| P2pCall::Send { peer, offset };
        let recv = |peer, offset| P2pCall::Recv { peer, offset };
        match self.kind {
            CollectiveKind::Send => vec![send(root, 0)],
            CollectiveKind::Recv => vec![recv(root, 0)],
            CollectiveKind::AllToAll => every(send).zip(every(recv)).flat_map(|(s, r)| [s, r]).collect(),
            CollectiveKind::Gather if rank == root => std::iter::once(send(root, 0)).chain(every(recv)).collect(),
            CollectiveKind::Gather => vec![send(root, 0)],
            CollectiveKind::Scatter if rank == root => every(send).chain(std::iter::once(recv(root, 0))).collect(),
            CollectiveKind::Scatter => vec![recv(root, 0)],
            _ => Vec::new(),
        }
    }

    /// The operator it reduces with (sum by default), for reducing kinds.
    pub fn reduce_op(&self) -> Option<ReduceOp> {
        self.kind.reduces().then(|| self.op.unwrap_or(ReduceOp::Sum))
    }

    /// Bytes of its input buffer on `rank` of `world` ranks.
    pub fn input_bytes(&self, world: usize, rank: usize) -> usize {
        let elements = match self.kind {
            CollectiveKind::ReduceScatter | CollectiveKind::AllToAll => self.count.saturating_mul(world),
            CollectiveKind::Scatter if self.root == Some(rank) => self.count.saturating_mul(world),
            CollectiveKind::Scatter | CollectiveKind::Send | CollectiveKind::Recv => 0,
            _ => self.count,
        };
        elements.saturating_mul(self.dtype.size())
    }

    /// Bytes of its output buffer on `rank` of `world` ranks.
    pub fn output_bytes(&self, world: usize, rank: usize) -> usize {
        let elements = match self.kind {
            CollectiveKind::AllGather | CollectiveKind::AllToAll => self.count.saturating_mul(world),
            CollectiveKind::Gather if self.root == Some(rank) => self.count.saturating_mul(world),
            CollectiveKind::Gather => 0,
            _ => self.count,
        };
        elements.saturating_mul(self.dtype.size())
    }

    /// Checks the operation on `rank` of `world` against NCCL and the
    /// buffers against the operation, before anything is launched: the
    /// kind, the operator, the root or peer, and the lengths (`input` is
    /// `None` in place, or when the operation reads no input).
    pub fn check(&self, world: usize, rank: usize, input: Option<usize>, output: usize) -> Result<(), NcclError> {
        if self.kind == CollectiveKind::Barrier {
            return Err(NcclError::UnsupportedKind { kind: self.kind });
        }
        if let Some(op) = self.reduce_op() {
            nccl_red_op(op)?;
        }
        if self.kind.rooted() && self.root.is_none_or(|r| r >= world) {
            return Err(NcclError::BadRoot {
                kind: self.kind,
                root: self.root,
                world,
            });
        }
        if self.is_p2p() && self.root == Some(rank) {
            return Err(NcclError::PeerIsSelf { kind: self.kind, rank });
        }
        let size = |which, expected: usize, got: usize| {
            if expected == got {
                Ok(())
            } else {
                Err(NcclError::BufferSize {
                    operation: self.to_string(),
                    which,
                    expected,
                    got,
                })
            }
        };
        let wanted = self.input_bytes(world, rank);
        size("output", self.output_bytes(world, rank), output)?;
        match input {
            Some(len) => size("input", wanted, len),
            None if wanted == 0 => Ok(()),
            // Each rank's block is sent while others land in the output.
            None if self.kind == CollectiveKind::AllToAll && world > 1 => {
                size("input (all_to_all never runs in place)", wanted, 0)
            }
            // In place: the output must hold the input too.
            None => size("input (in place, so output)", wanted, output),
        }
    }
}

/// One call of a grouped point-to-point operation ([`NcclOp::p2p_calls`]):
/// `ncclSend` or `ncclRecv` of the operation's `count` elements at a byte
/// offset of the buffer it reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum P2pCall {
    /// Send to `peer` from `offset` of the input.
    Send {
        /// The receiving rank.
        peer: usize,
        /// Byte offset into the input.
        offset: usize,
    },
    /// Receive from `peer` into `offset` of the output.
    Recv {
        /// The sending rank.
        peer: usize,
        /// Byte offset into the output.
        offset: usize,
    },
}

impl fmt::Display for NcclOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({} x {}", self.kind.name(), self.dtype, self.count)?;
        if let Some(op) = self.reduce_op() {
            write!(f, ", {op}")?;
        }
        if let Some(root) = self.root {
            let role = if self.is_p2p() { "peer" } else { "root" };
            write!(f, ", {role} {root}")?;
        }
        f.write_str(")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nc2_every_dtype_maps_to_its_nccl_type() {
        let expected = [
            (DType::Int8, ncclDataType_t::ncclInt8),
            (DType::UInt8, ncclDataType_t::ncclUint8),
            (DType::Int32, ncclDataType_t::ncclInt32),
            (DType::UInt32, ncclDataType_t::ncclUint32),
            (DType::Int64, ncclDataType_t::ncclInt64),
            (DType::UInt64, ncclDataType_t::ncclUint64),
            (DType::Float16, ncclDataType_t::ncclFloat16),
            (DType::BFloat16, ncclDataType_t::ncclBfloat16),
            (DType::Float32, ncclDataType_t::ncclFloat32),
            (DType::Float64, ncclDataType_t::ncclFloat64),
        ];
        assert_eq!(expected.len(), DType::ALL.len(), "a dtype was added: map it");
        for (dtype, nccl) in expected {
            assert_eq!(nccl_data_type(dtype), nccl, "{dtype}");
        }
        // The numeric values are NCCL's ABI.
        assert_eq!(nccl_data_type(DType::BFloat16) as u32, 9);
        assert_eq!(nccl_data_type(DType::Float64) as u32, 8);
    }

    #[test]
    fn nc2_reduce_ops_map_and_bitwise_ones_are_a_typed_error() {
        let expected = [
            (ReduceOp::Sum, Some(ncclRedOp_t::ncclSum)),
            (ReduceOp::Prod, Some(ncclRedOp_t::ncclProd)),
            (ReduceOp::Min, Some(ncclRedOp_t::ncclMin)),
            (ReduceOp::Max, Some(ncclRedOp_t::ncclMax)),
            (ReduceOp::Avg, Some(ncclRedOp_t::ncclAvg)),
            (ReduceOp::BAnd, None),
            (ReduceOp::BOr, None),
            (ReduceOp::BXor, None),
        ];
        assert_eq!(expected.len(), ReduceOp::ALL.len(), "an operator was added: map it");
        for (op, nccl) in expected {
            match (nccl_red_op(op), nccl) {
                (Ok(got), Some(want)) => assert_eq!(got, want, "{op}"),
                (Err(NcclError::UnsupportedOp { op: named }), None) => {
                    assert_eq!(named, op);
                    let text = nccl_red_op(op).unwrap_err().to_string();
                    assert!(text.contains(op.name()) && text.contains("CPU backend"), "{text}");
                }
                (got, want) => panic!("{op}: got {got:?}, want {want:?}"),
            }
        }
        assert_eq!(ncclRedOp_t::ncclAvg as u32, 4);
    }

    #[test]
    fn nc2_checks_kinds_roots_and_buffer_lengths_before_launch() {
        let world = 4;
        let ar = NcclOp::all_reduce(DType::Float32, 8, ReduceOp::Sum);
        assert_eq!(ar.check(world, 0, Some(32), 32), Ok(()));
        assert_eq!(ar.check(world, 0, None, 32), Ok(()));
        assert!(matches!(
            ar.check(world, 0, Some(32), 16),
            Err(NcclError::BufferSize {
                which: "output",
                expected: 32,
                got: 16,
                ..
            })
        ));
        let bitwise = NcclOp::all_reduce(DType::Int32, 8, ReduceOp::BXor);
        assert_eq!(
            bitwise.check(world, 0, None, 32),
            Err(NcclError::UnsupportedOp { op: ReduceOp::BXor })
        );
        let ag = NcclOp::all_gather(DType::Float16, 3);
        assert_eq!((ag.input_bytes(world, 0), ag.output_bytes(world, 0)), (6, 24));
        assert_eq!(ag.check(world, 0, Some(6), 24), Ok(()));
        assert!(
            ag.check(world, 0, None, 24).is_err(),
            "all-gather does not run in place here"
        );
        let rs = NcclOp::reduce_scatter(DType::Int64, 2, ReduceOp::Max);
        assert_eq!((rs.input_bytes(world, 0), rs.output_bytes(world, 0)), (64, 16));
        assert_eq!(rs.check(world, 0, Some(64), 16), Ok(()));
        let bcast = NcclOp::broadcast(DType::UInt8, 5, 4);
        assert!(matches!(
            bcast.check(world, 0, None, 5),
            Err(NcclError::BadRoot { root: Some(4), .. })
        ));
        assert_eq!(
            NcclOp::reduce(DType::UInt8, 5, ReduceOp::Min, 3).check(world, 0, None, 5),
            Ok(())
        );
        let barrier = NcclOp {
            kind: CollectiveKind::Barrier,
            dtype: DType::UInt8,
            count: 0,
            root: None,
            op: None,
        };
        assert_eq!(
            barrier.check(world, 0, None, 0),
            Err(NcclError::UnsupportedKind {
                kind: CollectiveKind::Barrier
            })
        );
        // Gather: the root's output holds every block, the others' none.
        let gather = NcclOp::gather(DType::Float32, 2, 1);
        assert_eq!(gather.check(world, 1, Some(8), 32), Ok(()));
        assert_eq!(gather.check(world, 0, Some(8), 0), Ok(()));
        assert!(
            gather.check(world, 0, Some(8), 32).is_err(),
            "a non-root's output is empty"
        );
        // Scatter: the root's input holds every block, the others take none.
        let scatter = NcclOp::scatter(DType::Float32, 2, 0);
        assert_eq!(scatter.check(world, 0, Some(32), 8), Ok(()));
        assert_eq!(scatter.check(world, 3, None, 8), Ok(()));
        assert!(scatter.check(world, 0, None, 8).is_err(), "the root needs its input");
        let a2a = NcclOp::all_to_all(DType::Int32, 3);
        assert_eq!(a2a.check(world, 2, Some(48), 48), Ok(()));
        let in_place = a2a.check(world, 2, None, 48).unwrap_err().to_string();
        assert!(in_place.contains("never runs in place"), "{in_place}");
        assert_eq!(
            a2a.check(1, 0, None, 12),
            Ok(()),
            "alone, all-to-all is a copy onto itself"
        );
        // Send and recv: the output is the data; no input; never to oneself.
        let send = NcclOp::send(DType::UInt8, 5, 2);
        assert_eq!(send.check(world, 0, None, 5), Ok(()));
        assert!(send.check(world, 0, Some(5), 5).is_err());
        assert_eq!(
            send.check(world, 2, None, 5),
            Err(NcclError::PeerIsSelf {
                kind: CollectiveKind::Send,
                rank: 2
            })
        );
        assert!(matches!(
            NcclOp::recv(DType::UInt8, 5, 4).check(world, 0, None, 5),
            Err(NcclError::BadRoot { root: Some(4), .. })
        ));
        assert_eq!(send.to_string(), "send(uint8 x 5, peer 2)");
        assert_eq!(ar.to_string(), "all_reduce(float32 x 8, sum)");
        assert_eq!(bcast.to_string(), "broadcast(uint8 x 5, root 4)");
    }

    #[test]
    fn grouped_operations_issue_the_sends_and_receives_pytorch_does() {
        use P2pCall::{Recv, Send};
        let (world, block) = (3, 8);
        // all-to-all: block j of the input to rank j, block i of the output from rank i.
        let a2a = NcclOp::all_to_all(DType::Float32, 2);
        assert_eq!(
            a2a.p2p_calls(world, 1),
            (0..world)
                .flat_map(|p| [
                    Send {
                        peer: p,
                        offset: p * block
                    },
                    Recv {
                        peer: p,
                        offset: p * block
                    }
                ])
                .collect::<Vec<_>>()
        );
        // gather to 2: everyone sends its input to the root; the root receives block i from rank i.
        let gather = NcclOp::gather(DType::Float32, 2, 2);
        assert_eq!(gather.p2p_calls(world, 0), [Send { peer: 2, offset: 0 }]);
        assert_eq!(
            gather.p2p_calls(world, 2),
            [
                Send { peer: 2, offset: 0 },
                Recv { peer: 0, offset: 0 },
                Recv { peer: 1, offset: 8 },
                Recv { peer: 2, offset: 16 },
            ]
        );
        // scatter from 0: the root sends block i to rank i; everyone receives its block.
        let scatter = NcclOp::scatter(DType::Float32, 2, 0);
        assert_eq!(
            scatter.p2p_calls(world, 0),
            [
                Send { peer: 0, offset: 0 },
                Send { peer: 1, offset: 8 },
                Send { peer: 2, offset: 16 },
                Recv { peer: 0, offset: 0 },
            ]
        );
        assert_eq!(scatter.p2p_calls(world, 1), [Recv { peer: 0, offset: 0 }]);
        assert_eq!(
            NcclOp::send(DType::Float32, 2, 1).p2p_calls(world, 0),
            [Send { peer: 1, offset: 0 }]
        );
        assert_eq!(
            NcclOp::recv(DType::Float32, 2, 0).p2p_calls(world, 1),
            [Recv { peer: 0, offset: 0 }]
        );
        let all_reduce = NcclOp::all_reduce(DType::Float32, 2, ReduceOp::Sum);
        assert!(all_reduce.p2p_calls(world, 0).is_empty() && !all_reduce.is_grouped_p2p());
        // Every offset plus a block stays within the buffer `check` accepts.
        for op in [a2a, gather, scatter] {
            for rank in 0..world {
                for call in op.p2p_calls(world, rank) {
                    let (offset, len) = match call {
                        Send { offset, .. } => (offset, op.input_bytes(world, rank)),
                        Recv { offset, .. } => (offset, op.output_bytes(world, rank)),
                    };
                    assert!(offset + block <= len, "{op} on rank {rank}: {call:?} past {len} bytes");
                }
            }
        }
    }

    #[test]
    fn unique_ids_are_exactly_128_bytes() {
        assert!(UniqueId::from_bytes(&[7u8; 128]).is_some());
        assert!(UniqueId::from_bytes(&[7u8; 127]).is_none());
        assert!(UniqueId::from_bytes(&[7u8; 129]).is_none());
        let id = UniqueId::from_array([0xab; 128]);
        assert_eq!(format!("{id:?}"), "UniqueId(abababababababab..)");
    }
}
