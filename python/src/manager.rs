//! `Trainer`: one member of an elastic training job over a torch model
//! (per-step commit vote, survivors never roll back, live state transfer
//! to joiners). Either the user's loop drives it step by step
//! (`begin_step`, `commit_step`: a `chorus::train::Stepper`; the state is
//! named tensors of any dtype plus pickled extras, built only when a join
//! needs it), or chorus's own loop does (`train`: `chorus::train::train`,
//! calling back into Python under the GIL for the gradients and the
//! optimizer). The tensors are read and written in place through their
//! memory.

use std::time::Duration;

use chorus::rendezvous::InitMethod;
use chorus::sync::ParamBuffer;
use chorus::train::{
    Begin, Cadence, Committed, InPlace, IntegrityOptions, Job, Mode, Step, Stepper, StepperOptions, TrainOptions,
    TrainReport, TrainState,
};
use chorus::{Admission, DType, DistributedSync, ElasticGroup, InitOptions, Parameters};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::group::Group;
use crate::runtime::runtime;
use crate::work::{Class, Failure};

/// A CPU tensor's memory, seen as a chorus buffer, and the tensor, held so
/// that the memory lives as long as this does. Valid while the tensor is
/// not resized or given new storage: torch optimizers update parameters
/// and their state in place.
struct TensorMemory {
    ptr: *mut u8,
    bytes: usize,
    dtype: DType,
    _tensor: Py<PyAny>,
}

// SAFETY: plain memory; the trainer runs on one thread at a time and the
// Python side does not touch the tensors while Rust reads or writes them.
unsafe impl Send for TensorMemory {}

impl TensorMemory {
    /// A float32 tensor (parameters, gradients, optimizer state).
    fn float32(tensor: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
        let dtype = tensor.getattr("dtype")?.str()?.to_string();
        if dtype != "torch.float32" {
            return Err(PyTypeError::new_err(format!(
                "{what} is {dtype}: the trainer keeps float32 state (cast the model with .float())"
            )));
        }
        Self::of(tensor, what, DType::Float32)
    }

    /// Any tensor's bytes (the extra state's tensors, whose dtype the
    /// entry's name carries).
    fn raw(tensor: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
        Self::of(tensor, what, DType::UInt8)
    }

    fn of(tensor: &Bound<'_, PyAny>, what: &str, dtype: DType) -> PyResult<Self> {
        if tensor.getattr("device")?.getattr("type")?.extract::<String>()? != "cpu"
            || !tensor.call_method0("is_contiguous")?.extract::<bool>()?
        {
            return Err(PyValueError::new_err(format!("{what} must be a contiguous CPU tensor")));
        }
        let elements = tensor.call_method0("numel")?.extract::<usize>()?;
        let element_size = tensor.call_method0("element_size")?.extract::<usize>()?;
        let ptr = tensor.call_method0("data_ptr")?.extract::<usize>()? as *mut u8;
        Ok(Self {
            ptr,
            bytes: elements * element_size,
            dtype,
            _tensor: tensor.clone().unbind(),
        })
    }

    fn bytes(&self) -> &[u8] {
        if self.bytes == 0 {
            return &[];
        }
        // SAFETY: the `numel * element_size` bytes of a live contiguous
        // tensor (see the type).
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        if self.bytes == 0 {
            return &mut [];
        }
        // SAFETY: as in `bytes`; `&mut self` is the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) }
    }
}

impl ParamBuffer for TensorMemory {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.bytes / self.dtype.size()
    }
    fn read_bytes(&self, offset: usize, out: &mut [u8]) {
        out.copy_from_slice(&self.bytes()[offset..offset + out.len()]);
    }
    fn write_bytes(&mut self, offset: usize, data: &[u8]) {
        self.bytes_mut()[offset..offset + data.len()].copy_from_slice(data);
    }
    fn as_bytes(&self) -> Option<&[u8]> {
        Some(self.bytes())
    }
    fn as_bytes_mut(&mut self) -> Option<&mut [u8]> {
        Some(self.bytes_mut())
    }
}

/// Named tensors, as the Python side hands them over.
type Named<'py> = Vec<(String, Bound<'py, PyAny>)>;

/// The torch side of a training job, as chorus's trainer sees it.
struct TorchJob {
    /// `(name, parameter memory)`, in the model's order.
    params: Vec<(String, TensorMemory)>,
    /// `(name, memory)` of every optimizer state tensor, in a fixed order.
    optimizer: Vec<(String, TensorMemory)>,
    /// `(name, memory)` of the extra state's tensors (moved as entries;
    /// the rest of the extra state travels pickled).
    extras: Vec<(String, TensorMemory)>,
    /// The Python half: `backward(step) -> loss`, `grads() -> [tensor]`,
    /// `apply(step)`, `save_extra() -> bytes`, `load_extra(bytes)`.
    hooks: Py<PyAny>,
}

impl TorchJob {
    /// The job over `params` and `optimizer_state` (named float32 tensors)
    /// and `extras` (named tensors of any dtype).
    fn new(hooks: Py<PyAny>, params: Named<'_>, optimizer_state: Named<'_>, extras: Named<'_>) -> PyResult<Self> {
        let memory = |list: Named<'_>, view: fn(&Bound<'_, PyAny>, &str) -> PyResult<TensorMemory>| {
            list.into_iter()
                .map(|(name, t)| view(&t, &name).map(|m| (name, m)))
                .collect::<PyResult<Vec<_>>>()
        };
        Ok(Self {
            params: memory(params, TensorMemory::float32)?,
            optimizer: memory(optimizer_state, TensorMemory::float32)?,
            extras: memory(extras, TensorMemory::raw)?,
            hooks,
        })
    }
}

fn step_dict<'py>(py: Python<'py>, step: &Step) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("step", step.step)?;
    dict.set_item("rank", step.rank)?;
    dict.set_item("world_size", step.world_size)?;
    dict.set_item("generation", step.generation)?;
    dict.set_item("global_batch", step.global_batch)?;
    dict.set_item("grad_scale", step.grad_scale)?;
    let shard = step.shard();
    dict.set_item("shard", (shard.start, shard.end))?;
    Ok(dict)
}

/// A Python error as the trainer's job error text (with its traceback kind).
fn job_error(py: Python<'_>, error: PyErr) -> String {
    let kind = error.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
    format!("{kind}: {}", error.value(py))
}

/// Named tensors' memory, visited as parameters (for their checksum).
struct Tensors(Vec<(String, TensorMemory)>);

impl Parameters for Tensors {
    fn visit_parameters(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        for (name, memory) in &mut self.0 {
            visit(name, memory);
        }
    }
}

impl Parameters for TorchJob {
    fn visit_parameters(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        for (name, memory) in &mut self.params {
            visit(name, memory);
        }
    }
}

impl TrainState for TorchJob {
    /// Lets sibling rank processes write a joiner's state straight into
    /// its tensors (cross-memory attach), one copy instead of two.
    fn buffers_in_place(&self) -> Option<InPlace> {
        // SAFETY: every buffer visited is a `TensorMemory` whose tensor it
        // holds, so the memory lives as long as the job; the Python side
        // does not run while a transfer does (the trainer calls it between
        // steps), and torch updates parameters, optimizer state and the
        // manager's extra buffers in place, never reallocating them.
        Some(unsafe { InPlace::promise() })
    }

    fn visit_optimizer(&mut self, visit: &mut dyn FnMut(&str, &mut dyn ParamBuffer)) {
        for (name, memory) in self.optimizer.iter_mut().chain(&mut self.extras) {
            visit(name, memory);
        }
    }

    fn save_extra(&self) -> Vec<u8> {
        Python::attach(|py| {
            self.hooks
                .bind(py)
                .call_method0("save_extra")
                .and_then(|b| b.extract::<Vec<u8>>())
                .unwrap_or_else(|e| {
                    e.write_unraisable(py, None);
                    Vec::new()
                })
        })
    }

    fn load_extra(&mut self, bytes: &[u8]) -> Result<(), String> {
        Python::attach(|py| {
            self.hooks
                .bind(py)
                .call_method1("load_extra", (PyBytes::new(py, bytes),))
                .map(drop)
                .map_err(|e| job_error(py, e))
        })
    }
}

impl Job for TorchJob {
    fn backward(&mut self, step: &Step, grads: &mut DistributedSync<'static>) -> Result<f64, String> {
        Python::attach(|py| {
            let hooks = self.hooks.bind(py);
            let loss = hooks
                .call_method1("backward", (step_dict(py, step).map_err(|e| job_error(py, e))?,))
                .and_then(|l| l.extract::<f64>())
                .map_err(|e| job_error(py, e))?;
            let computed = hooks
                .call_method0("grads")
                .and_then(|g| g.extract::<Vec<Bound<'_, PyAny>>>())
                .map_err(|e| job_error(py, e))?;
            // Last parameter first, as a backward pass produces them.
            for (id, grad) in computed.iter().enumerate().rev() {
                let memory = TensorMemory::float32(grad, "a gradient").map_err(|e| job_error(py, e))?;
                let view = grads.grad_mut::<f32>(id).map_err(|e| e.to_string())?;
                if view.len() != memory.len() {
                    return Err(format!(
                        "the gradient of parameter {id} has {} elements, the parameter {}",
                        memory.len(),
                        view.len()
                    ));
                }
                let source: &[f32] = bytemuck::try_cast_slice(memory.bytes())
                    .map_err(|e| format!("the gradient of parameter {id} is not float32 memory: {e}"))?;
                for (g, s) in view.iter_mut().zip(source) {
                    *g = s * step.grad_scale;
                }
                grads.mark_ready(id).map_err(|e| e.to_string())?;
            }
            Ok(loss)
        })
    }

    fn apply(&mut self, step: &Step, grads: &DistributedSync<'static>) -> Result<(), String> {
        Python::attach(|py| {
            let hooks = self.hooks.bind(py);
            let targets = hooks
                .call_method0("grads")
                .and_then(|g| g.extract::<Vec<Bound<'_, PyAny>>>())
                .map_err(|e| job_error(py, e))?;
            for (id, target) in targets.iter().enumerate() {
                let mut memory = TensorMemory::float32(target, "a gradient").map_err(|e| job_error(py, e))?;
                let summed = grads.grad::<f32>(id).map_err(|e| e.to_string())?;
                memory.write_bytes(0, bytemuck::cast_slice(summed));
            }
            hooks
                .call_method1("apply", (step_dict(py, step).map_err(|e| job_error(py, e))?,))
                .map(drop)
                .map_err(|e| job_error(py, e))
        })
    }
}

fn train_mode(name: &str, every: u64, outer_lr: f32, outer_momentum: f32, fragments: u32) -> PyResult<Mode> {
    match name {
        "ddp" => Ok(Mode::Ddp),
        "local-sgd" | "local_sgd" => Ok(Mode::LocalSgd { every }),
        "diloco" => Ok(Mode::DiLoCo {
            every,
            outer_lr,
            outer_momentum,
            fragments,
        }),
        other => Err(PyValueError::new_err(format!(
            "mode {other:?}: the trainer runs \"ddp\", \"local-sgd\" or \"diloco\""
        ))),
    }
}

/// One member of an elastic training job.
#[pyclass(module = "chorus._chorus")]
pub(crate) struct Trainer {
    group: Option<ElasticGroup>,
    /// Per-step commit for the user's own loop (`begin_step`,
    /// `commit_step`), made at the first step.
    stepper: Option<Stepper>,
    /// The generation lent to Python at the last step, kept while it runs
    /// (one `Group` object per generation, not per step).
    lent: Option<(u64, Py<Group>)>,
    /// Steps voted down in a row before the job stops.
    max_rejections: u32,
}

fn report_dict<'py>(py: Python<'py>, report: &TrainReport) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("steps", report.steps)?;
    dict.set_item("applied", report.applied)?;
    dict.set_item("adopted", report.adopted)?;
    dict.set_item("outer_syncs", report.outer_syncs)?;
    dict.set_item("rejected", report.rejected)?;
    let recoveries: Vec<Bound<'_, PyDict>> = report
        .recoveries
        .iter()
        .map(|r| -> PyResult<Bound<'_, PyDict>> {
            let d = PyDict::new(py);
            d.set_item("generation", r.generation)?;
            d.set_item("world_size", r.world_size)?;
            d.set_item("resumed_step", r.resumed_step)?;
            d.set_item("bytes", r.bytes)?;
            d.set_item("rendezvous_ms", r.rendezvous.as_secs_f64() * 1e3)?;
            d.set_item("transfer_ms", r.transfer.as_secs_f64() * 1e3)?;
            d.set_item("first_step_ms", r.first_step.as_secs_f64() * 1e3)?;
            d.set_item("total_ms", r.total().as_secs_f64() * 1e3)?;
            let at = r
                .first_step_at
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            d.set_item("first_step_at", at)?;
            Ok(d)
        })
        .collect::<PyResult<_>>()?;
    dict.set_item("recoveries", recoveries)?;
    Ok(dict)
}

impl Trainer {
    fn group(&self) -> PyResult<&ElasticGroup> {
        self.group
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("the trainer was destroyed"))
    }
}

#[pymethods]
impl Trainer {
    /// Joins the job's elastic group through the launcher's environment
    /// (`chorus launch --restart-policy worker`, or torchrun): a relaunched
    /// worker joins the running generation. `min_world`..`max_world` ranks
    /// may form a generation (None: the launcher's world size). A process
    /// that comes to join is admitted at the members' next step boundary
    /// (the commit vote carries it), so no step under way is lost to it.
    /// `rank`, `world_size` and `scope` make it one of several
    /// elastic groups of the launcher's run (a replica group's shard
    /// `scope`, its place among the replica groups `rank`).
    #[new]
    #[pyo3(signature = (timeout = 300.0, heartbeat_timeout = None, min_world = None, max_world = None, last_call = 0.3,
                        rank = None, world_size = None, scope = None, max_rejections = 3))]
    #[allow(clippy::too_many_arguments)] // Python's keyword arguments
    fn new(
        py: Python<'_>,
        timeout: f64,
        heartbeat_timeout: Option<f64>,
        min_world: Option<usize>,
        max_world: Option<usize>,
        last_call: f64,
        rank: Option<usize>,
        world_size: Option<usize>,
        scope: Option<String>,
        max_rejections: u32,
    ) -> PyResult<Self> {
        let mut options = InitOptions {
            init_method: InitMethod::Env,
            rank,
            world_size,
            timeout: Duration::from_secs_f64(timeout.max(0.001)),
            last_call: Duration::from_secs_f64(last_call.max(0.0)),
            min_world,
            max_world,
            admission: Admission::at_step_boundary(),
            elastic_scope: scope,
            ..InitOptions::default()
        }
        .restart_budget(1000, Duration::from_secs(600));
        if let Some(h) = heartbeat_timeout {
            options = options.heartbeat_timeout(Duration::from_secs_f64(h.max(0.001)));
        }
        let rt = runtime()?;
        let group = py.detach(|| rt.block_on(ElasticGroup::init(options))).map_err(|e| {
            let class = if e.job_finished() {
                Class::JobFinished
            } else {
                Class::Backend
            };
            Failure::new(class, format!("joining the job: {}", chorus::error_report(&e))).to_err(py)
        })?;
        Ok(Self {
            group: Some(group),
            stepper: None,
            lent: None,
            max_rejections,
        })
    }

    /// This member's rank in the current generation.
    #[getter]
    fn rank(&self) -> usize {
        self.group.as_ref().map_or(0, ElasticGroup::rank)
    }

    /// The number of members in the current generation.
    #[getter]
    fn world_size(&self) -> usize {
        self.group.as_ref().map_or(0, |g| g.current().world_size())
    }

    /// The current generation (0: the first; a relaunched worker joins a later one).
    #[getter]
    fn generation(&self) -> u64 {
        self.group.as_ref().map_or(0, ElasticGroup::generation)
    }

    /// Runs `steps` committed steps. `hooks` is the Python half (see
    /// `chorus.torch.Manager`); `params` and `optimizer_state` are the float32
    /// tensors whose memory is the state, in a fixed order, `extras` the
    /// extra state's tensors (any dtype); `on_commit(step,
    /// loss, world_size, generation)` sees each committed step. Returns the
    /// report as a dict. Blocks with the GIL released between callbacks.
    #[pyo3(signature = (hooks, params, optimizer_state, extras, steps, global_batch, on_commit, mode = "ddp", every = 10, outer_lr = 0.7, outer_momentum = 0.9, fragments = 1))]
    #[allow(clippy::too_many_arguments)]
    fn train(
        &self,
        py: Python<'_>,
        hooks: Py<PyAny>,
        params: Named<'_>,
        optimizer_state: Named<'_>,
        extras: Named<'_>,
        steps: u64,
        global_batch: usize,
        on_commit: Py<PyAny>,
        mode: &str,
        every: u64,
        outer_lr: f32,
        outer_momentum: f32,
        fragments: u32,
    ) -> PyResult<Py<PyAny>> {
        let group = self.group()?;
        let mut job = TorchJob::new(hooks, params, optimizer_state, extras)?;
        let options = TrainOptions {
            mode: train_mode(mode, every, outer_lr, outer_momentum, fragments)?,
            steps,
            global_batch,
            ..TrainOptions::default()
        };
        let rt = runtime()?;
        let outcome = py.detach(|| {
            rt.block_on(chorus::train::train(group, &mut job, &options, |c: &Committed| {
                Python::attach(|py| {
                    if let Err(e) = on_commit.call1(py, (c.step, c.loss, c.world_size, c.generation)) {
                        e.write_unraisable(py, None);
                    }
                });
            }))
        });
        let report = outcome.map_err(|e| {
            Failure::new(
                Class::GroupAborted,
                format!("training stopped: {}", chorus::error_report(&e)),
            )
            .to_err(py)
        })?;
        Ok(report_dict(py, &report)?.into_any().unbind())
    }

    /// Starts a step of the user's loop on the current generation and
    /// returns `{step, rank, world_size, generation, group, transfer}`:
    /// `group` runs the step's gradient sync, `transfer` (None when the
    /// generation did not change) says what the join moved. When the
    /// generation changed, `state()` is called for `(hooks, entries)`: the
    /// named tensors whose memory is the state (any dtype, moved as bytes)
    /// and the object whose `save_extra()`/`load_extra(bytes)` move the
    /// rest; the state moves from the most advanced members and is then
    /// checked equal on every member (an error names the first entry that
    /// differs). Blocks with the GIL released.
    fn begin_step(&mut self, py: Python<'_>, state: Py<PyAny>) -> PyResult<Py<PyAny>> {
        let group = self
            .group
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("the trainer was destroyed"))?;
        let rt = runtime()?;
        let max_rejections = self.max_rejections;
        let stepper = self.stepper.get_or_insert_with(|| {
            let _runtime = rt.enter();
            // No periodic state check yet: the snapshot's entries include
            // copies (RNG states, buffers `state_dict()` returns anew) that
            // are filled only as the extras are saved and may differ per
            // rank by design, and the check cannot tell them apart from the
            // model's and optimizer's own tensors. Every join is verified.
            let integrity = IntegrityOptions {
                cadence: Cadence::Off,
                ..IntegrityOptions::default()
            };
            Stepper::new(
                group,
                StepperOptions {
                    integrity,
                    max_rejections,
                    ..StepperOptions::default()
                },
            )
        });
        let mut job: Option<TorchJob> = None;
        let begun = loop {
            let outcome =
                py.detach(|| rt.block_on(stepper.begin(group, job.as_mut().map(|j| j as &mut dyn TrainState))));
            match outcome {
                Ok(Begin::Ready(begun)) => break begun,
                Ok(Begin::NeedState) => {
                    let (hooks, entries): (Py<PyAny>, Named<'_>) = state.call0(py)?.extract(py)?;
                    job = Some(TorchJob::new(hooks, Vec::new(), Vec::new(), entries)?);
                }
                Err(e) => {
                    return Err(Failure::new(
                        Class::GroupAborted,
                        format!("joining the step: {}", chorus::error_report(&e)),
                    )
                    .to_err(py));
                }
            }
        };
        let dict = PyDict::new(py);
        dict.set_item("step", begun.step)?;
        dict.set_item("rank", begun.group.rank())?;
        dict.set_item("world_size", begun.group.world_size())?;
        dict.set_item("generation", begun.group.generation())?;
        let transfer = begun
            .transfer
            .as_ref()
            .map(|t| -> PyResult<Bound<'_, PyDict>> {
                let d = PyDict::new(py);
                d.set_item("step", t.step)?;
                d.set_item("sources", t.sources.clone())?;
                d.set_item("receivers", t.receivers.clone())?;
                d.set_item("bytes", t.bytes)?;
                Ok(d)
            })
            .transpose()?;
        dict.set_item("transfer", transfer)?;
        let generation = begun.group.generation();
        let lent = match self.lent.take() {
            Some((g, lent)) if g == generation => lent,
            _ => Py::new(py, Group::lent(begun.group))?,
        };
        dict.set_item("group", lent.clone_ref(py))?;
        self.lent = Some((generation, lent));
        Ok(dict.into_any().unbind())
    }

    /// Whether the job's members left it on purpose (it ended; the store
    /// out of reach counts as ended). Blocks with the GIL released.
    fn job_finished(&self, py: Python<'_>) -> PyResult<bool> {
        let group = self.group()?;
        let rt = runtime()?;
        Ok(py.detach(|| rt.block_on(group.job_finished())).unwrap_or(true))
    }

    /// Whether this process holds the next generation, formed beside the
    /// current step's (its word toward the swap to it).
    fn next_ready(&self) -> bool {
        match (&self.stepper, &self.group) {
            (Some(stepper), Some(group)) => stepper.next_ready(group),
            _ => false,
        }
    }

    /// The vote of the step begun last: `ok` when this member's gradient
    /// sync succeeded and its loss is finite, `fatal` when it stops for
    /// good; `ready`, when given, replaces this member's own word on the
    /// swap to the next generation (agreed with other elastic groups that
    /// must swap at the same step). Returns `(committed, summed loss)`:
    /// apply the update only when committed. Blocks with the GIL released.
    #[pyo3(signature = (ok, fatal, loss, ready = None))]
    fn commit_step(
        &mut self,
        py: Python<'_>,
        ok: bool,
        fatal: bool,
        loss: f64,
        ready: Option<bool>,
    ) -> PyResult<(bool, f64)> {
        let stepper = self
            .stepper
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("no step was begun (begin_step first)"))?;
        let group = self
            .group
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("the trainer was destroyed"))?;
        let rt = runtime()?;
        py.detach(|| rt.block_on(stepper.commit_with(group, ok, fatal, loss, ready)))
            .map_err(|e| {
                Failure::new(
                    Class::GroupAborted,
                    format!("training stopped: {}", chorus::error_report(&e)),
                )
                .to_err(py)
            })
    }

    /// Whether committed steps are recorded (`CHORUS_TRAIN_RECORD`, for
    /// `chorus chaos`): `record_step` then wants the parameters.
    fn recording(&self) -> bool {
        self.stepper.as_ref().is_some_and(Stepper::recording)
    }

    /// Writes the commit record of the step committed last, its update
    /// applied: `params` are the named parameters (any dtype), whose bytes'
    /// checksum the record carries. Does nothing when not recording.
    fn record_step(&mut self, params: Named<'_>) -> PyResult<()> {
        let Some(stepper) = self.stepper.as_mut().filter(|s| s.recording()) else {
            return Ok(());
        };
        let mut tensors = Tensors(
            params
                .into_iter()
                .map(|(name, t)| TensorMemory::raw(&t, &name).map(|m| (name, m)))
                .collect::<PyResult<_>>()?,
        );
        stepper.record(Some(chorus::train::checksum(&mut tensors)));
        Ok(())
    }

    /// After a step that failed with its generation: waits for the next
    /// generation and returns its `(generation, world_size)`, moving no
    /// state (the next `begin_step` joins it). Blocks with the GIL released.
    fn next_generation(&mut self, py: Python<'_>) -> PyResult<(u64, usize)> {
        let group = self
            .group
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("the trainer was destroyed"))?;
        let stepper = self
            .stepper
            .as_mut()
            .ok_or_else(|| PyValueError::new_err("no step was begun (begin_step first)"))?;
        let rt = runtime()?;
        let pg = py.detach(|| rt.block_on(stepper.next_generation(group))).map_err(|e| {
            Failure::new(
                Class::GroupAborted,
                format!("training stopped: {}", chorus::error_report(&e)),
            )
            .to_err(py)
        })?;
        Ok((pg.generation(), pg.world_size()))
    }

    /// What the user's loop did so far (`steps`, `applied`, `adopted`,
    /// `rejected`, `recoveries` with their phases in ms).
    fn step_report(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let report = self.stepper.as_ref().map(Stepper::report).unwrap_or_default();
        Ok(report_dict(py, &report)?.into_any().unbind())
    }

    /// Checks that every member holds the same state (a checksum of every
    /// entry, the extras included, compared across the members); raises
    /// naming the first that differs.
    fn verify(
        &self,
        py: Python<'_>,
        hooks: Py<PyAny>,
        params: Named<'_>,
        optimizer_state: Named<'_>,
        extras: Named<'_>,
    ) -> PyResult<()> {
        let group = self.group()?;
        let mut job = TorchJob::new(hooks, params, optimizer_state, extras)?;
        let rt = runtime()?;
        let pg = group.current();
        py.detach(|| rt.block_on(chorus::train::verify_state(&pg, &mut job)))
            .map_err(|e| Failure::new(Class::Backend, chorus::error_report(&e)).to_err(py))
    }

    /// Cuts this member's links to every other member of the current
    /// generation while it keeps running: fault injection, what a network
    /// partition does to it. Every member's group aborts and re-forms.
    fn cut_links(&self, reason: &str) -> PyResult<()> {
        self.group()?.current().cut_links(reason);
        Ok(())
    }

    /// Leaves the job now, in the middle of it (this worker is about to
    /// exit): the other members re-form without it at once, told `why`,
    /// rather than when its links drop as the process ends.
    fn leave(&mut self, py: Python<'_>, why: &str) -> PyResult<()> {
        self.lent = None;
        if let Some(group) = self.group.take() {
            let rt = runtime()?;
            py.detach(|| rt.block_on(group.shutdown(why)));
        }
        Ok(())
    }

    /// Leaves the job on purpose (after the last step).
    fn destroy(&mut self, py: Python<'_>) -> PyResult<()> {
        self.lent = None;
        if let Some(group) = self.group.take() {
            let rt = runtime()?;
            py.detach(|| rt.block_on(group.destroy()))
                .map_err(|e| Failure::new(Class::Backend, chorus::error_report(&e)).to_err(py))?;
        }
        Ok(())
    }
}
