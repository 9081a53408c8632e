//! The narrow interface the backend needs from NCCL: a [`Backend`] that makes
//! unique ids and communicators, and a [`Communicator`] that launches
//! collectives on its device's stream, tells when they completed, reports
//! asynchronous errors and aborts. [`cuda`](super::cuda) implements it on
//! cudarc, [`fake`](super::fake) in memory for tests.

use super::types::{CommStatus, NcclError, NcclOp, UniqueId};

/// Memory a communicator reads and writes (device memory, for the real
/// one). Dropping a buffer whose work has not finished is safe: the real
/// buffers are freed in stream order, after the work.
pub trait DeviceBuffer: Send + 'static {
    /// Its length in bytes.
    fn len(&self) -> usize;

    /// Whether it holds no byte.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Makes unique ids and communicators: NCCL on one device, or the fake.
pub trait Backend: Send + Sync + 'static {
    /// The communicators it makes.
    type Comm: Communicator;

    /// A new unique id (`ncclGetUniqueId`; rank 0 calls it, NC-3).
    fn unique_id(&self) -> Result<UniqueId, NcclError>;

    /// Starts creating `rank`'s communicator of `world` ranks named by `id`
    /// (`ncclCommInitRankConfig`, non-blocking). It is ready once
    /// [`Communicator::status`] says so; until every rank has joined it says
    /// [`CommStatus::InProgress`] (NC-4).
    fn init(&self, id: &UniqueId, rank: usize, world: usize) -> Result<Self::Comm, NcclError>;
}

/// One rank's NCCL communicator, shared by its actor (which launches and
/// waits) and its watchdog (which polls and aborts) on different threads.
///
/// After [`abort`](Self::abort) every other call returns
/// [`NcclError::Aborted`] without touching NCCL (the handle is freed).
pub trait Communicator: Send + Sync + 'static {
    /// Its buffers.
    type Buffer: DeviceBuffer;
    /// A marker of completion recorded on its stream (a CUDA event).
    type Event: Send + 'static;

    /// Its rank.
    fn rank(&self) -> usize;

    /// The number of ranks.
    fn world(&self) -> usize;

    /// A buffer of `len` zero bytes on its device, for operations that need
    /// scratch memory (a barrier).
    fn zeros(&self, len: usize) -> Result<Self::Buffer, NcclError>;

    /// Enqueues `op` on the stream, reading `input` (or `output`, in place)
    /// and writing `output`. The buffers were checked with
    /// [`NcclOp::check`]. The communicator may be
    /// [`InProgress`](CommStatus::InProgress) afterwards: the launch is
    /// being enqueued in the background.
    fn launch(&self, op: &NcclOp, input: Option<&Self::Buffer>, output: &mut Self::Buffer) -> Result<(), NcclError>;

    /// Marks the end of the work enqueued so far (once the communicator is
    /// ready again after a launch).
    fn record(&self) -> Result<Self::Event, NcclError>;

    /// Whether the work before `event` has completed (`cuEventQuery`).
    fn query(&self, event: &Self::Event) -> Result<bool, NcclError>;

    /// `ncclCommGetAsyncError`: ready, still carrying out a non-blocking
    /// call, or failed (a peer went away, a CUDA error).
    fn status(&self) -> Result<CommStatus, NcclError>;

    /// `ncclCommAbort`: ends every operation of this communicator, hung
    /// kernels included (the only way to unblock one), and frees it.
    /// Idempotent: returns whether this call aborted (NC-8).
    fn abort(&self) -> Result<bool, NcclError>;
}
