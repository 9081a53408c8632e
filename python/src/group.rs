//! `Group`: one rank's chorus process group, formed through a torch store,
//! running collectives on CPU tensors where they lie: a contiguous tensor's
//! memory is lent to the operation (its reference held until the operation
//! ends) and the GIL is released while the ranks work.

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus::rendezvous::InitMethod;
use chorus::{Collective, CollectiveKind, DType, InitOptions, ProcessGroup, ReduceOp, Tensor};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::runtime::runtime;
use crate::store::TorchStore;
use crate::work::{Class, Failure, Work};

/// How long `destroy` waits for the other ranks to destroy the group too.
const LEAVE_BARRIER: Duration = Duration::from_secs(30);

/// One rank's process group.
#[pyclass(module = "chorus._chorus", frozen)]
pub(crate) struct Group {
    /// `None` once destroyed. Shared when it is an elastic job's
    /// generation, lent by its `Trainer` (which ends it).
    group: Mutex<Option<Arc<ProcessGroup>>>,
    rank: usize,
    world_size: usize,
    local_rank: usize,
}

fn seconds(what: &str, value: f64) -> PyResult<Duration> {
    if value.is_finite() && value > 0.0 {
        Ok(Duration::from_secs_f64(value))
    } else {
        Err(PyValueError::new_err(format!(
            "{what} must be a positive number of seconds, not {value}"
        )))
    }
}

fn invalid(message: String) -> PyErr {
    Python::attach(|py| Failure::new(Class::InvalidArgument, message).to_err(py))
}

/// A submitted operation: a receive also names its sender.
enum Pending {
    Receive(chorus::Work<(Tensor, usize)>),
    Other(chorus::Work<Tensor>),
}

/// A lent tensor's place in memory, to refuse an input that overlaps the
/// output (the input is read while the output is written).
type Span = (usize, usize);

/// `tensor`'s memory as a chorus tensor, in place.
fn lend(tensor: &Bound<'_, PyAny>, what: &str) -> PyResult<(Tensor, Span)> {
    let device = tensor.getattr("device")?.getattr("type")?.extract::<String>()?;
    if device != "cpu" {
        return Err(PyTypeError::new_err(format!(
            "{what} is on {device}: the chorus backend takes CPU tensors (register it for cpu only, e.g. \
             backend=\"cpu:chorus,cuda:nccl\")"
        )));
    }
    if !tensor.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(PyValueError::new_err(format!(
            "{what} is not contiguous: pass tensor.contiguous() (chorus works on the tensor's memory in place, \
             and a copy would not be written back)"
        )));
    }
    let name = tensor.getattr("dtype")?.str()?.to_string();
    let dtype = DType::from_str(name.trim_start_matches("torch.")).map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} has dtype {name}, which chorus does not reduce; it takes float16, bfloat16, float32, float64, \
             int8, uint8, int32, uint32, int64 and uint64"
        ))
    })?;
    let numel = tensor.call_method0("numel")?.extract::<usize>()?;
    let len = numel * dtype.size();
    let ptr = tensor.call_method0("data_ptr")?.extract::<usize>()?;
    if len > 0 && (ptr == 0 || !ptr.is_multiple_of(dtype.size())) {
        return Err(PyValueError::new_err(format!(
            "{what}'s memory at {ptr:#x} is not aligned for {dtype}"
        )));
    }
    let owner: Py<PyAny> = tensor.clone().unbind();
    // SAFETY: a contiguous CPU tensor's `data_ptr()` addresses `numel *
    // element_size` bytes of its storage, which the tensor reference held
    // as the owner keeps alive until the operation drops the buffer; the
    // caller (torch.distributed's contract, as with Gloo) neither reads nor
    // writes the tensor while the operation runs.
    let lent = unsafe { Tensor::from_raw_parts(dtype, ptr as *mut u8, len, Box::new(owner)) };
    Ok((lent, (ptr, ptr + len)))
}

impl Group {
    /// A generation of an elastic job, lent as a group: its collectives
    /// run here, its lifetime stays the job's.
    pub(crate) fn lent(group: Arc<ProcessGroup>) -> Self {
        Group {
            rank: group.rank(),
            world_size: group.world_size(),
            local_rank: group.local_rank(),
            group: Mutex::new(Some(group)),
        }
    }

    fn with_group<T>(&self, what: &str, f: impl FnOnce(&ProcessGroup) -> T) -> PyResult<T> {
        let guard = self.group.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref() {
            Some(group) => Ok(f(group)),
            None => Err(Python::attach(|py| self.destroyed(what).to_err(py))),
        }
    }

    /// The group, unless destroyed.
    pub(crate) fn live(&self) -> Option<Arc<ProcessGroup>> {
        self.group.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// What `what` fails with once the group is destroyed.
    pub(crate) fn destroyed(&self, what: &str) -> Failure {
        Failure::new(
            Class::GroupAborted,
            format!("{what} on rank {}: the process group was destroyed", self.rank),
        )
    }
}

#[pymethods]
impl Group {
    /// Forms this rank's group through `store` (a `torch.distributed.Store`):
    /// rendezvous, links to every peer (shared memory on this host, QUIC
    /// between hosts), supervision. Blocks up to `timeout` seconds with the
    /// GIL released. `store_host` is the host the store lives on (None: in
    /// this process), which tells whether the job spans hosts;
    /// `heartbeat_timeout` the silence after which a peer is taken for
    /// dead or frozen (None: `CHORUS_HEARTBEAT_TIMEOUT`, else 5 s).
    #[staticmethod]
    #[pyo3(signature = (store, rank, world_size, timeout, collective_timeout, store_host = None, heartbeat_timeout = None))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn init(
        py: Python<'_>,
        store: Py<PyAny>,
        rank: usize,
        world_size: usize,
        timeout: f64,
        collective_timeout: f64,
        store_host: Option<String>,
        heartbeat_timeout: Option<f64>,
    ) -> PyResult<Group> {
        if world_size == 0 || rank >= world_size {
            return Err(PyValueError::new_err(format!(
                "rank {rank} is not in a world of {world_size}: ranks run from 0 to world_size - 1"
            )));
        }
        let store = TorchStore::new(py, store)?;
        let options = InitOptions {
            init_method: InitMethod::Store(Arc::new(store)),
            rank: Some(rank),
            world_size: Some(world_size),
            timeout: seconds("timeout", timeout)?,
            collective_timeout: seconds("collective_timeout", collective_timeout)?,
            store_host,
            heartbeat_timeout: heartbeat_timeout.map(|h| seconds("heartbeat_timeout", h)).transpose()?,
            ..InitOptions::default()
        };
        let rt = runtime()?;
        let formed = py.detach(|| rt.block_on(chorus::init_process_group(options)));
        let group = formed.map_err(|e| {
            Failure::new(
                Class::Backend,
                format!("chorus could not form the group: {}", chorus::error_report(&e)),
            )
            .to_err(py)
        })?;
        Ok(Group {
            rank: group.rank(),
            world_size: group.world_size(),
            local_rank: group.local_rank(),
            group: Mutex::new(Some(Arc::new(group))),
        })
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    #[getter]
    pub(crate) fn world_size(&self) -> usize {
        self.world_size
    }

    /// This rank's index among the ranks on its host.
    #[getter]
    fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// Submits one collective and returns its `Work` at once; operations
    /// run in submission order. `kind` is chorus's name (`all_reduce`,
    /// `broadcast`, `reduce`, `all_gather`, `gather`, `scatter`,
    /// `reduce_scatter`, `all_to_all`, `barrier`, `send`, `recv`), `count`
    /// the elements per rank, `input` the read-only input (reducing kinds
    /// then run out of place), `output` the tensor written in place. A
    /// send's or receive's `tag` pairs it with the peer's of the same tag;
    /// a receive without `root` takes the first message from any rank (its
    /// work's `source` then names the sender).
    #[pyo3(signature = (kind, count, input = None, output = None, root = None, op = None, timeout = None, tag = 0))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        kind: &str,
        count: usize,
        input: Option<Bound<'_, PyAny>>,
        output: Option<Bound<'_, PyAny>>,
        root: Option<usize>,
        op: Option<&str>,
        timeout: Option<f64>,
        tag: i64,
    ) -> PyResult<Work> {
        let kind = CollectiveKind::from_str(kind).map_err(|e| PyValueError::new_err(e.to_string()))?;
        let op = op
            .map(ReduceOp::from_str)
            .transpose()
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let timeout = timeout.map(|t| seconds("timeout", t)).transpose()?;
        if let Some(root) = root
            && root >= self.world_size
        {
            return Err(invalid(format!(
                "{} from rank {root}: the group has ranks 0 to {}",
                kind.name(),
                self.world_size - 1
            )));
        }
        let input = input.map(|t| lend(&t, "the input")).transpose()?;
        let output = output.map(|t| lend(&t, "the output")).transpose()?;
        if let (Some((i, (a, b))), Some((o, (c, d)))) = (&input, &output)
            && a < d
            && c < b
            && !i.is_empty()
            && !o.is_empty()
        {
            return Err(invalid(format!(
                "{}: the input and output tensors share memory; pass separate tensors",
                kind.name()
            )));
        }
        let dtype = match (&input, &output) {
            (Some((i, _)), Some((o, _))) if i.dtype() != o.dtype() => {
                return Err(invalid(format!(
                    "{}: the input is {} but the output {}",
                    kind.name(),
                    i.dtype(),
                    o.dtype()
                )));
            }
            (Some((t, _)), _) | (None, Some((t, _))) => t.dtype(),
            (None, None) => DType::UInt8,
        };
        let collective = Collective {
            kind,
            dtype,
            count,
            root,
            op,
            input: input.map(|(t, _)| t.into_shared()).unwrap_or_default(),
            output: output.map(|(t, _)| t.into_buffer()).unwrap_or_default(),
            timeout,
            // Negative tags (torch's are C ints) keep their own lanes.
            tag: tag as u64,
        };
        let rt = runtime()?;
        let receive = kind == CollectiveKind::Recv;
        let (pending, failures) = self.with_group(kind.name(), |group| {
            let _enter = rt.enter();
            let pending = match receive {
                true => Pending::Receive(group.submit_recv(collective)),
                false => Pending::Other(group.submit_tensor(collective)),
            };
            (pending, group.failures())
        })?;
        let (work, state) = Work::pending();
        rt.spawn(async move {
            let result = match pending {
                Pending::Receive(work) => work.await.map(|(_, from)| state.received_from(from)),
                Pending::Other(work) => work.await.map(drop),
            };
            state.complete(result.map_err(|e| Failure::from_collective(&e, &failures)));
        });
        Ok(work)
    }

    /// Leaves the group on purpose (`destroy_process_group`): a barrier over
    /// the links first, so every rank has finished its operations, then a
    /// shutdown that peers see as a departure, not a failure. Needs no
    /// store: torch's store may already be gone with rank 0. Blocks (GIL
    /// released) at most `LEAVE_BARRIER` for late peers; later calls do
    /// nothing.
    fn destroy(&self, py: Python<'_>) -> PyResult<()> {
        let group = self.group.lock().unwrap_or_else(|p| p.into_inner()).take();
        // A lent generation is not this handle's to end.
        if let Some(Ok(group)) = group.map(Arc::try_unwrap) {
            let rt = runtime()?;
            py.detach(|| {
                rt.block_on(async move {
                    // A failed or late barrier changes nothing: this rank leaves either way.
                    let _ = group.barrier().wait(LEAVE_BARRIER).await;
                    group.shutdown("the process group was destroyed").await;
                })
            });
        }
        Ok(())
    }

    /// Fault injection: cuts this rank's links to every peer while it
    /// keeps running, as a network partition would; their next collective
    /// with it fails.
    fn cut_links(&self, reason: &str) {
        if let Some(group) = self.group.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            group.cut_links(reason);
        }
    }

    /// The address of the C entry table (`capi`) and this object's handle,
    /// for a `c10d::Backend` in C++ over this group, which must hold this
    /// object while it uses the handle.
    fn c_api(&self) -> (usize, usize) {
        crate::capi::export(self)
    }

    /// Whether the group is still formed (not destroyed).
    fn is_alive(&self) -> bool {
        self.group.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }
}
