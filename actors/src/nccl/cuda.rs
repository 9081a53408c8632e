//! The real backend: NCCL through cudarc's `sys` bindings (loaded at run
//! time), on one CUDA device and one stream per rank.
//!
//! Communicators are non-blocking (`ncclConfig_t.blocking = 0`), so no
//! NCCL call holds the caller: init, launches and abort return
//! `ncclInProgress` and are polled with `ncclCommGetAsyncError` (NC-4).
//! cudarc's safe `Comm` is not used: it has neither `ncclCommGetAsyncError`
//! nor a config, and its `Drop` panics when `ncclCommAbort` fails.

use std::ffi::{CStr, c_int, c_void};
use std::ptr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError};
use cudarc::nccl::sys;

use super::code::NcclCode;
use super::comm::{Backend, Communicator, DeviceBuffer};
use super::probe::{NcclVersion, probe};
use super::types::{CommStatus, NcclError, NcclOp, P2pCall, UNIQUE_ID_BYTES, UniqueId, nccl_data_type, nccl_red_op};
use chorus_runtime::collective::{CollectiveKind, ReduceOp};

/// How long an abort that returned `ncclInProgress` is polled before the
/// communicator is given up on.
const ABORT_TIMEOUT: Duration = Duration::from_secs(10);

/// `NCCL_CONFIG_UNDEF_INT`: "let NCCL choose".
const UNDEF_INT: c_int = c_int::MIN;

fn cuda(call: &'static str) -> impl Fn(DriverError) -> NcclError {
    move |e| NcclError::Cuda {
        call,
        detail: format!("{e:?}"),
    }
}

/// A device buffer on a rank's stream.
#[derive(Debug)]
pub struct CudaBuffer(CudaSlice<u8>);

impl DeviceBuffer for CudaBuffer {
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// One CUDA device and the stream its rank's collectives run on.
#[derive(Debug, Clone)]
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    version: NcclVersion,
}

impl CudaBackend {
    /// The backend of device `ordinal`. Probes CUDA and NCCL first (NC-1):
    /// on a machine without them this is an error, never a panic.
    pub fn new(ordinal: usize) -> Result<Self, NcclError> {
        let found = probe()?;
        if ordinal >= found.devices {
            return Err(NcclError::Cuda {
                call: "cuDeviceGet",
                detail: format!("device {ordinal} does not exist: {} visible", found.devices),
            });
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda("cuDevicePrimaryCtxRetain"))?;
        // SAFETY: every buffer of this backend lives on its one stream, so stream order alone
        // synchronizes them; cudarc's per-buffer events would be recorded before a non-blocking
        // launch has been enqueued, and order nothing.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(cuda("cuStreamCreate"))?;
        Ok(Self {
            ctx,
            stream,
            version: found.nccl,
        })
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name.
    pub fn device_name(&self) -> Result<String, NcclError> {
        self.ctx.name().map_err(cuda("cuDeviceGetName"))
    }

    /// The NCCL version in use.
    pub fn nccl_version(&self) -> NcclVersion {
        self.version
    }

    /// A device buffer holding `bytes`.
    pub fn upload(&self, bytes: &[u8]) -> Result<CudaBuffer, NcclError> {
        self.stream
            .clone_htod(bytes)
            .map(CudaBuffer)
            .map_err(cuda("cuMemcpyHtoDAsync"))
    }

    /// A device buffer of `len` zero bytes.
    pub fn zeros(&self, len: usize) -> Result<CudaBuffer, NcclError> {
        self.stream
            .alloc_zeros(len)
            .map(CudaBuffer)
            .map_err(cuda("cuMemsetD8Async"))
    }

    /// The contents of `buffer`, once the work before it on the stream is done.
    pub fn download(&self, buffer: &CudaBuffer) -> Result<Vec<u8>, NcclError> {
        let bytes = self.stream.clone_dtoh(&buffer.0).map_err(cuda("cuMemcpyDtoHAsync"))?;
        self.stream.synchronize().map_err(cuda("cuStreamSynchronize"))?;
        Ok(bytes)
    }

    /// Waits for everything enqueued on the stream.
    pub fn synchronize(&self) -> Result<(), NcclError> {
        self.stream.synchronize().map_err(cuda("cuStreamSynchronize"))
    }

    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`, versioned as the loaded
    /// library, which then reads only the fields it knows.
    fn config(&self) -> sys::ncclConfig_t {
        sys::ncclConfig_t {
            size: std::mem::size_of::<sys::ncclConfig_t>(),
            magic: 0xcafe_beef,
            version: self.version.code(),
            blocking: 0,
            cgaClusterSize: UNDEF_INT,
            minCTAs: UNDEF_INT,
            maxCTAs: UNDEF_INT,
            netName: ptr::null(),
            splitShare: UNDEF_INT,
            trafficClass: UNDEF_INT,
            commName: ptr::null(),
            collnetEnable: UNDEF_INT,
            CTAPolicy: UNDEF_INT,
            shrinkShare: UNDEF_INT,
            nvlsCTAs: UNDEF_INT,
            nChannelsPerNetPeer: UNDEF_INT,
            nvlinkCentricSched: UNDEF_INT,
            graphUsageMode: UNDEF_INT,
            numRmaCtx: UNDEF_INT,
            maxP2pPeers: UNDEF_INT,
        }
    }
}

/// The text of `code`, with the communicator's last error when it has one.
fn nccl_error(call: &'static str, result: sys::ncclResult_t, comm: sys::ncclComm_t) -> Option<NcclError> {
    let code = NcclCode::from_result(result)?;
    // SAFETY: ncclGetLastError takes a live communicator or null and returns a static or
    // comm-owned NUL-terminated string, copied before the communicator can change.
    let last = unsafe { sys::ncclGetLastError(comm) };
    let detail = if last.is_null() {
        String::new()
    } else {
        // SAFETY: non-null, NUL-terminated (see above).
        unsafe { CStr::from_ptr(last) }.to_string_lossy().into_owned()
    };
    Some(NcclError::Call { call, code, detail })
}

/// Issues `calls` between `ncclGroupStart` and `ncclGroupEnd`, which
/// launches them as one operation. A failing call is reported, and the
/// group is ended all the same, as NCCL requires.
///
/// # Safety
/// `comm` must be live; for every call, `count` elements of `dtype` at its
/// offset must lie within the allocation `send` (sends) or `recv`
/// (receives) points to, on `stream`'s device.
unsafe fn grouped(
    calls: &[P2pCall],
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: sys::ncclDataType_t,
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
) -> (&'static str, sys::ncclResult_t) {
    let failed = |result| NcclCode::from_result(result).is_some_and(|code| code != NcclCode::InProgress);
    // SAFETY: opens the group the calls below join.
    let started = unsafe { sys::ncclGroupStart() };
    if failed(started) {
        return ("ncclGroupStart", started);
    }
    let mut first_failure = None;
    for call in calls {
        // SAFETY: the caller's contract covers each call's range.
        let (name, result) = unsafe {
            match *call {
                P2pCall::Send { peer, offset } => (
                    "ncclSend",
                    sys::ncclSend(send.byte_add(offset), count, dtype, peer as c_int, comm, stream),
                ),
                P2pCall::Recv { peer, offset } => (
                    "ncclRecv",
                    sys::ncclRecv(recv.byte_add(offset), count, dtype, peer as c_int, comm, stream),
                ),
            }
        };
        if failed(result) && first_failure.is_none() {
            first_failure = Some((name, result));
        }
    }
    // SAFETY: ends the group opened above.
    let ended = unsafe { sys::ncclGroupEnd() };
    first_failure.unwrap_or(("ncclGroupEnd", ended))
}

/// Success or in progress is fine for a non-blocking call.
fn accepted(call: &'static str, result: sys::ncclResult_t, comm: sys::ncclComm_t) -> Result<(), NcclError> {
    match nccl_error(call, result, comm) {
        None
        | Some(NcclError::Call {
            code: NcclCode::InProgress,
            ..
        }) => Ok(()),
        Some(error) => Err(error),
    }
}

impl Backend for CudaBackend {
    type Comm = CudaComm;

    fn unique_id(&self) -> Result<UniqueId, NcclError> {
        let mut id = sys::ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: the probe checked the library and the symbol; the pointer is to a live id.
        let result = unsafe { sys::ncclGetUniqueId(&mut id) };
        if let Some(error) = nccl_error("ncclGetUniqueId", result, ptr::null_mut()) {
            return Err(error);
        }
        Ok(UniqueId::from_array(id.internal.map(|c| c as u8)))
    }

    fn init(&self, id: &UniqueId, rank: usize, world: usize) -> Result<CudaComm, NcclError> {
        let invalid = |detail: String| NcclError::Call {
            call: "ncclCommInitRankConfig",
            code: NcclCode::InvalidArgument,
            detail,
        };
        let world_c = c_int::try_from(world).map_err(|_| invalid(format!("{world} ranks are too many")))?;
        let rank_c = c_int::try_from(rank).map_err(|_| invalid(format!("rank {rank} is too large")))?;
        // NCCL creates the communicator on the current device.
        self.ctx.bind_to_thread().map_err(cuda("cuCtxSetCurrent"))?;
        let mut config = self.config();
        let raw_id = sys::ncclUniqueId {
            internal: id.as_bytes().map(|b| b as std::ffi::c_char),
        };
        let mut comm: sys::ncclComm_t = ptr::null_mut();
        // SAFETY: the probe checked ncclCommInitRankConfig exists (NCCL >= 2.14); every pointer
        // is to a live local; NCCL copies the config before returning.
        let result = unsafe { sys::ncclCommInitRankConfig(&mut comm, world_c, raw_id, rank_c, &mut config) };
        if let Err(error) = accepted("ncclCommInitRankConfig", result, comm) {
            if !comm.is_null() {
                // SAFETY: comm is the handle NCCL just returned; nothing else holds it.
                unsafe { sys::ncclCommAbort(comm) };
            }
            return Err(error);
        }
        Ok(CudaComm {
            raw: Mutex::new(Raw(comm)),
            ctx: self.ctx.clone(),
            stream: self.stream.clone(),
            rank,
            world,
        })
    }
}

/// The communicator handle; null once aborted.
struct Raw(sys::ncclComm_t);

// SAFETY: NCCL allows calls on a communicator from any thread; the handle is only used under
// the mutex that holds it, so calls are never concurrent and none follows the abort that frees it.
unsafe impl Send for Raw {}

/// An NCCL communicator on one device's stream.
pub struct CudaComm {
    raw: Mutex<Raw>,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
}

impl std::fmt::Debug for CudaComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaComm")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.ctx.ordinal())
            .finish()
    }
}

impl CudaComm {
    /// The live handle, or [`NcclError::Aborted`].
    fn handle(&self) -> Result<(MutexGuard<'_, Raw>, sys::ncclComm_t), NcclError> {
        let guard = self.raw.lock().unwrap_or_else(|p| p.into_inner());
        let comm = guard.0;
        if comm.is_null() {
            return Err(NcclError::Aborted { rank: self.rank });
        }
        Ok((guard, comm))
    }
}

impl Communicator for CudaComm {
    type Buffer = CudaBuffer;
    type Event = CudaEvent;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn zeros(&self, len: usize) -> Result<CudaBuffer, NcclError> {
        self.ctx.bind_to_thread().map_err(cuda("cuCtxSetCurrent"))?;
        self.stream
            .alloc_zeros(len)
            .map(CudaBuffer)
            .map_err(cuda("cuMemsetD8Async"))
    }

    fn launch(&self, op: &NcclOp, input: Option<&CudaBuffer>, output: &mut CudaBuffer) -> Result<(), NcclError> {
        // The pointers below must be valid for these lengths: checked here, not only by the caller.
        op.check(self.world, self.rank, input.map(DeviceBuffer::len), output.len())?;
        let dtype = nccl_data_type(op.dtype);
        let red_op = nccl_red_op(op.reduce_op().unwrap_or(ReduceOp::Sum))?;
        let root = op.root.map_or(0, |r| r as c_int);
        self.ctx.bind_to_thread().map_err(cuda("cuCtxSetCurrent"))?;
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        // Event tracking is off (see CudaBackend::new): the guards record nothing.
        let (recv, _recv_guard) = output.0.device_ptr_mut(&self.stream);
        let send = match input {
            Some(buffer) => buffer.0.device_ptr(&self.stream).0,
            None => recv,
        };
        let (send, recv) = (send as *const c_void, recv as *mut c_void);
        let (_guard, comm) = self.handle()?;
        let count = op.count;
        if op.is_grouped_p2p() {
            let calls = op.p2p_calls(self.world, self.rank);
            // SAFETY: comm is live (held under its lock); every call's offset plus `count`
            // elements stays within the buffer `check` verified for this kind and rank (send
            // reads the output, recv writes it, both by `is_grouped_p2p`'s rules).
            let (call, result) = unsafe { grouped(&calls, send, recv, count, dtype, comm, stream) };
            return accepted(call, result, comm);
        }
        // SAFETY: comm is live (held under its lock); send and recv are device allocations of
        // the lengths `check` verified for this kind, on this communicator's device; the stream
        // belongs to the same context.
        let (call, result) = unsafe {
            match op.kind {
                CollectiveKind::AllReduce => (
                    "ncclAllReduce",
                    sys::ncclAllReduce(send, recv, count, dtype, red_op, comm, stream),
                ),
                CollectiveKind::Broadcast => (
                    "ncclBroadcast",
                    sys::ncclBroadcast(send, recv, count, dtype, root, comm, stream),
                ),
                CollectiveKind::Reduce => (
                    "ncclReduce",
                    sys::ncclReduce(send, recv, count, dtype, red_op, root, comm, stream),
                ),
                CollectiveKind::AllGather => (
                    "ncclAllGather",
                    sys::ncclAllGather(send, recv, count, dtype, comm, stream),
                ),
                CollectiveKind::ReduceScatter => (
                    "ncclReduceScatter",
                    sys::ncclReduceScatter(send, recv, count, dtype, red_op, comm, stream),
                ),
                kind => return Err(NcclError::UnsupportedKind { kind }),
            }
        };
        accepted(call, result, comm)
    }

    fn record(&self) -> Result<CudaEvent, NcclError> {
        let event = self.ctx.new_event(None).map_err(cuda("cuEventCreate"))?;
        event.record(&self.stream).map_err(cuda("cuEventRecord"))?;
        Ok(event)
    }

    fn query(&self, event: &CudaEvent) -> Result<bool, NcclError> {
        event.try_is_complete().map_err(cuda("cuEventQuery"))
    }

    fn status(&self) -> Result<CommStatus, NcclError> {
        let (_guard, comm) = self.handle()?;
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: comm is live (held under its lock); the pointer is to a live local.
        let result = unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
        if let Some(error) = nccl_error("ncclCommGetAsyncError", result, comm) {
            return Err(error);
        }
        match nccl_error("ncclCommGetAsyncError", state, comm) {
            None => Ok(CommStatus::Ready),
            Some(NcclError::Call {
                code: NcclCode::InProgress,
                ..
            }) => Ok(CommStatus::InProgress),
            Some(error) => Err(error),
        }
    }

    fn abort(&self) -> Result<bool, NcclError> {
        let mut guard = self.raw.lock().unwrap_or_else(|p| p.into_inner());
        let comm = std::mem::replace(&mut guard.0, ptr::null_mut());
        if comm.is_null() {
            return Ok(false);
        }
        // SAFETY: comm is live and, taken out of the lock, used by no other call.
        let mut result = unsafe { sys::ncclCommAbort(comm) };
        // A non-blocking communicator may finish aborting in the background (PyTorch polls it too).
        let started = Instant::now();
        while result == sys::ncclResult_t::ncclInProgress && started.elapsed() < ABORT_TIMEOUT {
            std::thread::sleep(Duration::from_millis(1));
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: NCCL keeps the communicator until its abort completes.
            unsafe { sys::ncclCommGetAsyncError(comm, &mut state) };
            result = state;
        }
        match NcclCode::from_result(result) {
            None => Ok(true),
            Some(code) => Err(NcclError::Call {
                call: "ncclCommAbort",
                code,
                detail: if code == NcclCode::InProgress {
                    format!("still aborting after {ABORT_TIMEOUT:?}; the communicator is abandoned")
                } else {
                    String::new()
                },
            }),
        }
    }
}

impl Drop for CudaComm {
    fn drop(&mut self) {
        // ncclCommAbort, not ncclCommDestroy: destroy waits for peers, which may be gone.
        if let Err(e) = self.abort() {
            tracing::warn!(rank = self.rank, error = %e, "freeing the NCCL communicator failed");
        }
    }
}
