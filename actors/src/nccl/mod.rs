//! The GPU backend: collectives through NCCL (cudarc, loaded at run time),
//! supervised like PyTorch's ProcessGroupNCCL.
//!
//! A rank forms its communicator through the store ([`init_communicator`]),
//! then [`NcclGroup::start`] runs it: an actor launches operations in order
//! on the device's stream, a watchdog thread polls for asynchronous errors
//! and overdue operations and aborts the communicator, and the abort is
//! published for a supervisor that re-forms the group in the next
//! generation.
//!
//! # Rules
//! Each has a test named after it (`ncN_...`), here or in `tests/nccl.rs`,
//! run with the fake communicator unless it says otherwise.
//! - NC-1: nothing calls into CUDA or NCCL before [`probe`] has found both
//!   libraries, the NCCL functions the backend calls, and NCCL 2.14+; where
//!   they are missing every entry point returns a [`ProbeError`] naming the
//!   library and where to get it, never a panic (tested for real on
//!   machines without them).
//! - NC-2: every chorus dtype maps to its `ncclDataType_t` and every
//!   operator to its `ncclRedOp_t`, except the bitwise ones: a typed error;
//!   an operation is checked (kind, operator, root, buffer lengths) before
//!   launch, and a refused one leaves the group usable.
//! - NC-3: rank 0 makes the unique id and sets it under
//!   `chorus/<run id>/g<generation>/nccl/<group>/unique_id`; the others get
//!   it with a timeout: a missing rank 0 is an error naming the key, a value
//!   of the wrong size a typed error. Each generation has its own key, so a
//!   re-formed group gets a new id.
//! - NC-4: communicators are non-blocking (`ncclConfig_t.blocking = 0`), so
//!   init is polled and, when a rank never joins, aborted at its timeout
//!   with a typed error.
//! - NC-5: a rank's operations run one at a time in submission order on its
//!   stream: launch, wait until NCCL has taken the launch in, record an
//!   event, poll it.
//! - NC-6: every 100 ms the watchdog polls `ncclCommGetAsyncError` and the
//!   operation in flight; an asynchronous error or an operation past its
//!   timeout aborts the group (in the modes that abort).
//! - NC-7: an abort fails the operation in flight and every queued one with
//!   [`GroupAborted`](crate::supervision::GroupAborted); later operations
//!   fail at once, without touching the communicator.
//! - NC-8: an abort is published once and calls `ncclCommAbort` once, the
//!   only way to end a hung kernel, however many paths ask for it; a peer of
//!   an aborted rank sees an error and aborts too.
//! - NC-9: in blocking-wait mode the waiting caller gets its own error (the
//!   timeout, or the NCCL error) rather than the abort; the group is aborted
//!   all the same and later operations fail at once.
//! - NC-10: with async error handling off the watchdog only logs; an
//!   operation still fails at its timeout, which breaks the group (later
//!   operations fail at once) without aborting the communicator.
//! - NC-11: every operation is recorded in the group's flight recorder
//!   (collectives numbered per group, sends and receives per peer and
//!   direction); when the group aborts or breaks, every rank dumps it once
//!   into `<trace dir>/nccl` (`CHORUS_TRACE_DIR`), where `chorus trace`
//!   names the rank that never entered the operation the others wait in.
//!
//! Tear-down mode (async error handling 3) exits the process at the abort
//! without calling `ncclCommAbort`, as PyTorch's does.
//!
//! # Layout
//! - `code`: [`NcclCode`], NCCL's result codes.
//! - `probe`: [`probe`], NC-1.
//! - `types`: [`NcclOp`], the dtype and operator mapping, [`NcclError`]
//!   (which wraps the probe's [`ProbeError`]; the probe uses none of it).
//! - `comm`: the [`Backend`] and [`Communicator`] traits the rest is written
//!   against.
//! - `cuda`: the real implementation ([`CudaBackend`], [`CudaComm`],
//!   [`CudaBuffer`]) over cudarc's `sys` bindings.
//! - [`fake`]: an in-process implementation with injectable faults, for
//!   tests on machines without a GPU.
//! - `bootstrap`: the unique id exchange through the store and the
//!   abortable init.
//! - `group`: [`NcclGroup`], its actor and its watchdog.

mod bootstrap;
mod code;
mod comm;
mod cuda;
pub mod fake;
mod group;
mod probe;
mod types;

pub use bootstrap::{BootstrapError, CommKey, exchange_unique_id, init_communicator, wait_ready};
pub use code::NcclCode;
pub use comm::{Backend, Communicator, DeviceBuffer};
pub use cuda::{CudaBackend, CudaBuffer, CudaComm};
pub use group::{Buffers, DEFAULT_TIMEOUT, NcclCollective, NcclGroup, NcclGroupConfig, NcclOpError, NcclRankActor};
pub use probe::{Availability, MIN_NCCL, NcclVersion, ProbeError, REQUIRED_SYMBOLS, probe};
pub use types::{CommStatus, NcclError, NcclOp, P2pCall, UNIQUE_ID_BYTES, UniqueId, nccl_data_type, nccl_red_op};
