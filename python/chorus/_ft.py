"""Fault tolerance in the user's own training loop: ``Manager``,
``DistributedDataParallel``, ``Optimizer`` and ``DistributedSampler``, the
shape torchft's wrappers have, on chorus's elastic layer.

A step is the user's: ``optimizer.zero_grad()`` starts it (the member
joins the current generation; when the membership changed, the state moves
from the most advanced members to the others and is checked equal on
every member), the backward pass syncs the gradients bucket by bucket
while it runs, ``optimizer.step()`` applies the update only if every
member's sync succeeded (the commit vote). A step that fails anywhere is
discarded by every member; nobody rolls back.
"""

from __future__ import annotations

import abc
import contextlib
import math
import os
import pickle
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from chorus import _chorus
from chorus._errors import GroupAborted, InvalidArgument, JobFinished
from chorus.torch import python_backend  # defined before chorus.torch imports this module

Named = Tuple[str, torch.Tensor]
#: Times one step's gradient sync is run again in a next generation.
_SYNC_RETRIES = 3
_TENSOR = "__chorus_tensor__"
_ENTRY = "__chorus_entry__"
#: How long a rejoining replica group's rank, its group failed, looks for
#: the job's end before it takes the failure for a fault.
_END_GRACE = 2.0
#: The loss is the user's: without ``Manager.report_loss`` the vote carries
#: none (a dashboard and the commit records then show no loss).
_NO_LOSS = float("nan")


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A tensor's own memory: a DTensor's local shard (what a sharded
    model holds on this rank), any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _tensor_leaves(value: Any, path: str = "") -> List[Tuple[str, torch.Tensor]]:
    """The tensors of a state dict with their key paths, in the order
    ``_encode`` meets them."""
    if torch.is_tensor(value):
        return [(path, value)]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _tensor_leaves(v, f"{path}.{k}")]
    if isinstance(value, (list, tuple)):
        return [leaf for i, v in enumerate(value) for leaf in _tensor_leaves(v, f"{path}.{i}")]
    return []


def _encode(value: Any, tensor: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with every tensor replaced by ``tensor(t)``, met in
    ``_tensor_leaves``'s order."""
    if torch.is_tensor(value):
        return tensor(value)
    if isinstance(value, dict):
        return {k: _encode(v, tensor) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_encode(v, tensor) for v in value)
    return value


def _inline(t: torch.Tensor) -> Any:
    """A tensor carried inside the pickle (an empty or non-CPU one): its
    dtype, shape and raw bytes, which are the same on members holding the
    same values (a pickled tensor's are not)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return (_TENSOR, _dtype_name(t), tuple(t.shape), flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")


def _decode(value: Any, entries: List[torch.Tensor]) -> Any:
    """``_encode``'s inverse; ``(_ENTRY, i)`` is ``entries[i]``, which the
    transfer has already filled."""
    if isinstance(value, tuple) and len(value) == 2 and value[0] == _ENTRY:
        return entries[value[1]]
    if isinstance(value, tuple) and len(value) == 4 and value[0] == _TENSOR:
        _, dtype, shape, data = value
        dtype = getattr(torch, dtype)
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
    if isinstance(value, dict):
        return {k: _decode(v, entries) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_decode(v, entries) for v in value)
    return value


class _RngState:
    """torch's CPU random number generator as state."""

    def state_dict(self) -> Dict[str, Any]:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])


class _UserState:
    """The user's ``state_dict``/``load_state_dict`` pair as an object."""

    def __init__(self, save: Callable[[], Dict[str, Any]], load: Callable[[Dict[str, Any]], None]) -> None:
        self.state_dict, self.load_state_dict = save, load


class _Snapshot:
    """The registered state at one join, as the Rust side moves it: every
    CPU tensor an entry of raw bytes (any dtype; the name carries dtype and
    shape, so members holding different state are told apart by name),
    the rest pickled. A tensor ``state_dict()`` returns as the object's own
    memory (the same twice) is read and written in place; any other (a
    copy, as an RNG state is) goes through a buffer of the snapshot's."""

    def __init__(self, objects: Dict[str, Any]) -> None:
        self._objects = objects
        self._held: List[torch.Tensor] = []
        # Each sharded tensor's layout (mesh, placements, global shape): a
        # DTensor moves as its local shard and is loaded as a DTensor again.
        self._specs: List[Any] = []
        self.entries: List[Named] = []
        for name, obj in objects.items():
            # One byte under the object's name, so that members registering
            # different objects are told apart by the entry lists.
            self.entries.append((name, torch.zeros(1, dtype=torch.uint8)))
            first, again = _tensor_leaves(obj.state_dict(), name), _tensor_leaves(obj.state_dict())
            for (path, t), (_, u) in zip(first, again):
                index = len(self._held)
                self._specs.append(t._spec if isinstance(t, DTensor) else None)
                t, u = _local(t), _local(u)
                if t.device.type != "cpu":
                    raise InvalidArgument(
                        f"{path} is on {t.device}: the manager moves CPU tensors (keep the model and optimizer on the "
                        "CPU)")
                if t.numel() == 0 or t.is_sparse:
                    self._held.append(torch.empty(0))
                    continue
                live = t.is_contiguous() and t.data_ptr() == u.data_ptr()
                held = t.detach() if live else torch.empty(t.shape, dtype=t.dtype)
                self._held.append(held)
                flat = held.view(-1) if held.dim() else held.reshape(1)
                self.entries.append((f"{path}:{_dtype_name(t)}{list(t.shape)}", flat.view(torch.uint8)))

    def _slot(self, t: torch.Tensor, index: int) -> Any:
        t = _local(t)
        held = self._held[index] if index < len(self._held) else None
        if held is None or held.numel() == 0 or held.shape != t.shape or held.dtype != t.dtype:
            return _inline(t)
        if held.data_ptr() != t.data_ptr():
            held.copy_(t)
        return (_ENTRY, index)

    def save_extra(self) -> bytes:
        counter = iter(range(1 << 62))
        saved = {}
        for name, obj in self._objects.items():
            saved[name] = _encode(obj.state_dict(), lambda t: self._slot(t, next(counter)))
        return pickle.dumps(saved, protocol=4)

    def load_extra(self, data: bytes) -> None:
        saved = pickle.loads(data)
        loadable = [held if spec is None else
                    DTensor.from_local(held, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                                       stride=spec.stride)
                    for held, spec in zip(self._held, self._specs)]
        for name, obj in self._objects.items():
            obj.load_state_dict(_decode(saved[name], loadable))


class _ReplicaGroup:
    """This worker's replica group: ``size`` consecutive ranks of the
    launcher's world (rank ``r`` is in group ``r // size``) that shard the
    model among themselves over a process group of their own, torch's
    default group in this process. A group is one unit of failure: when
    any of its ranks fails, the others leave too and the launcher relaunches
    them all, as a new incarnation of the group (its ranks meet under a
    store prefix of their own, counted by arrivals)."""

    def __init__(self, size: int, timeout: float, heartbeat_timeout: Optional[float]) -> None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if size < 1 or world % size:
            raise InvalidArgument(f"replica_group_size {size} does not divide the launcher's world of {world} ranks")
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise InvalidArgument("replica groups meet through the launcher's store: run under `chorus launch` "
                                  "(MASTER_ADDR and MASTER_PORT are not set)")
        if dist.is_initialized():
            raise InvalidArgument("the manager makes the replica group's process group: do not call "
                                  "init_process_group() yourself")
        wait = timedelta(seconds=timeout)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=wait)
        promotion = os.environ.get("CHORUS_STANDBY", "").strip()
        if promotion:
            _take_promoted_slot(store, promotion)
        rank = int(os.environ.get("RANK", "0"))
        self.size, self.index, self.local, self.groups = size, rank // size, rank % size, world // size
        arrival = store.add(f"chorus/replica-group/{self.index}/arrivals", 1)
        self.incarnation = (arrival - 1) // size
        self._store, self._finished_key = store, f"chorus/replica-group/{self.index}/{self.incarnation}/finished"
        here = dist.PrefixStore(f"chorus/replica-group/{self.index}/{self.incarnation}/", store)
        # The group's heartbeats find a frozen group-mate as the shards' do.
        options = None if heartbeat_timeout is None else {"heartbeat_timeout": heartbeat_timeout}
        dist.init_process_group("chorus", store=here, rank=self.local, world_size=size, timeout=wait,
                                pg_options=options)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("shard",))

    def all_true(self, *flags: bool) -> List[bool]:
        """Whether each flag holds on every rank of the group; a group that
        lost a rank ends this worker (see :meth:`leave`)."""
        t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        except Exception as error:
            self.leave(error)
        return [bool(v) for v in t.tolist()]

    def mark_finished(self) -> None:
        """Tells the group-mates that the job ended before this group
        rejoined it (this rank exits, and their group fails with it)."""
        self._store.set(self._finished_key, "1")

    def finished(self) -> bool:
        """Whether a group-mate found the job ended: the group's failure is
        then the end of the job, not a fault."""
        try:
            return self._store.check([self._finished_key])
        except Exception:  # the launcher's store is gone with the job
            return True

    def leave(self, error: BaseException) -> None:
        """Ends this worker after its group lost a rank: exits with an
        error, so that the launcher relaunches it beside the failed one
        (without one when the job ended)."""
        if self.job_ended():
            print(f"chorus: the job ended while replica group {self.index} rejoined it; this worker exits",
                  file=sys.stderr, flush=True)
            raise SystemExit(0)
        self.on_leave(f"replica group {self.index} lost a rank")
        print(f"chorus: replica group {self.index} (incarnation {self.incarnation}) lost a rank ({error}); rank "
              f"{self.local} of the group leaves so that the launcher relaunches the whole group", file=sys.stderr,
              flush=True)
        sys.stdout.flush()
        os._exit(1)  # relaunched once gone: the interpreter's teardown would only delay it

    def on_leave(self, why: str) -> None:
        """Set by the manager: leaves the shard's elastic group at once."""

    def job_ended(self) -> bool:
        """Set by the manager: whether the group's failure is the job's end."""
        return self.finished()

    def cut_off(self, reason: str) -> None:
        """Fault injection: cuts this rank's links in the group's process
        group, so the group-mates' next collective with it fails."""
        python_backend(dist.group.WORLD._get_backend(torch.device("cpu")))._core.cut_links(reason)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _take_promoted_slot(store: "dist.Store", key: str) -> None:
    """A standby worker of a replica-group job (``chorus launch --standby``):
    waits, as long as it takes, until the launcher promotes it into a failed
    rank's slot (writing the slot's local rank under ``key``), then takes
    that slot's ``RANK`` and ``LOCAL_RANK``: its replica group and shard
    follow from them, so it forms its group only then."""
    import torch._dynamo  # noqa: F401  (what the optimizer's first construction imports: done while waiting)

    while True:
        try:
            store.wait([key], timedelta(hours=1))  # long: torch's client logs every wait that times out
            break
        except dist.DistStoreError as error:
            if "timeout" not in str(error).lower():
                raise
    local = int(store.get(key).decode())
    base = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
    os.environ["RANK"], os.environ["LOCAL_RANK"] = str(base + local), str(local)


class _Counter:
    """The committed steps a replica-group member applied, as state."""

    def __init__(self) -> None:
        self.applied = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"applied": self.applied}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.applied = state["applied"]


class Manager:
    """Keeps a training job's replicas in sync through failures, with the
    training loop left as the user wrote it (run the workers under ``chorus
    launch --restart-policy worker``, which relaunches a failed worker, or
    keeps ``--standby`` workers warm). Wrap the model in
    :class:`DistributedDataParallel` and the optimizer in
    :class:`Optimizer`; shard the data with :class:`DistributedSampler`.

    The state a joiner receives from the survivors, live over the mesh:
    every object given to :meth:`register_state` (the wrappers register the
    model and the optimizer, the sampler its position; add LR schedulers, a
    ``GradScaler``, anything with ``state_dict()``/``load_state_dict()``),
    the user's ``state_dict``/``load_state_dict`` pair if given, and torch's
    RNG state (``rng=False`` leaves it out, for members that draw different
    random numbers on purpose). Tensors of every dtype move as raw bytes;
    the rest (an optimizer's ``param_groups``, a scheduler's counters) is
    pickled. Right after every join, every member's state is hashed and
    compared: a divergence raises there, naming the first entry that
    differs. At the very first step every member takes rank 0's state, as
    DDP's construction does.

    ``min_replica_size``: the fewest members a step may run with (None:
    the launcher's world size, so a failed member's replacement is waited
    for); ``max_world``: the most (None: the launcher's world size). The
    first generation waits up to ``first_wait`` seconds for the launcher's
    whole world once ``min_replica_size`` members came; a worker that
    comes later joins at a step boundary.

    A worker that comes to a running job (relaunched, or a promoted
    standby) joins in the background at its first ``zero_grad()``, and
    that first step runs on its own as a warm-up (its gradients are not
    synced, ``should_commit()`` is False, nothing is applied): the members
    keep training while the next generation forms, and they do not wait
    for a cold first step. Its state arrives at the next ``zero_grad()``.

    A launcher that restarts every worker from step 0 when one fails
    (torchrun, ``chorus launch`` without ``--restart-policy worker``) would
    undo what the manager keeps; it is refused at construction unless
    ``allow_full_restart``.

    ``replica_group_size``: fault-tolerant HSDP. The launcher's ranks form
    replica groups of that many consecutive ranks; inside a group the model
    is sharded (``fully_shard(module, mesh=manager.device_mesh)``, wrapped
    in :class:`ReplicateShards`) over the group's own process group, which
    the manager makes as torch's default group. Across groups each shard
    is replicated, and rank ``i`` of every group is a member of shard
    ``i``'s elastic group, whose members are the replica groups
    (``min_replica_size`` and ``max_world`` count groups). A step applies
    only when every shard's vote committed it, so all groups apply the
    same steps. A rank that dies takes its group out: its group-mates
    leave when their group fails, the launcher relaunches them, and each
    new rank receives its shard's state from the matching rank of a
    healthy group, checked by hash. A relaunched group is admitted at a
    step boundary, the same one in every shard; its ranks wait for it in
    their first ``zero_grad()`` (no warm-up step of their own).
    """

    def __init__(
        self,
        *,
        state_dict: Optional[Callable[[], Dict[str, Any]]] = None,
        load_state_dict: Optional[Callable[[Dict[str, Any]], None]] = None,
        min_replica_size: Optional[int] = None,
        max_world: Optional[int] = None,
        timeout: float = 300.0,
        heartbeat_timeout: Optional[float] = None,
        rng: bool = True,
        first_wait: float = 3.0,
        allow_full_restart: bool = False,
        replica_group_size: Optional[int] = None,
    ) -> None:
        if (state_dict is None) != (load_state_dict is None):
            raise InvalidArgument("give state_dict and load_state_dict together (or neither)")
        if not allow_full_restart:
            _refuse_full_restarts()
        self._replica = _ReplicaGroup(replica_group_size, timeout, heartbeat_timeout) if replica_group_size else None
        # Why this worker left its shard's elastic group mid-job (it exits next).
        self._left: Optional[str] = None
        # Whether this process applied a step in a replica group.
        self._applied_here = False
        self._applied_steps = _Counter()
        self._objects: Dict[str, Any] = {}
        if state_dict is not None:
            self._objects["user"] = _UserState(state_dict, load_state_dict)
        if rng:
            self._objects["rng"] = _RngState()
        self._timeout = timeout
        self._join_options: Tuple[Any, ...] = (timeout, heartbeat_timeout, min_replica_size, max_world, first_wait)
        if self._replica is not None:
            replica = self._replica
            # Steps voted down because another shard's group failed are the
            # normal course of a group's loss, not a member's fault.
            self._join_options += (replica.index, replica.groups, f"replica-shard-{replica.local}", 1000)
            self._objects["replica"] = self._applied_steps
            replica.on_leave, replica.job_ended = self._leave_now, self._job_ended
            # A group-mate's failure mostly surfaces inside the user's forward
            # or backward pass (FSDP2's collectives) and ends the worker with
            # a traceback: the shard's other members hear it at once instead
            # of when this process is gone (its teardown takes a second).
            hook = sys.excepthook

            def leave_then_report(kind, value, traceback):
                if self._job_ended():
                    print(f"chorus: the job ended while replica group {replica.index} rejoined it; this worker "
                          "exits", file=sys.stderr, flush=True)
                    os._exit(0)  # the exception was the group-mate's exit at the end, not a fault
                self._leave_now(f"replica group {replica.index}'s rank {replica.local} failed: {value}")
                hook(kind, value, traceback)
                # The launcher relaunches the group once this process is
                # gone: skip the interpreter's teardown (about a second).
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)

            sys.excepthook = leave_then_report
        # Joined at the first step, not here: survivors keep training while
        # a joiner builds its model, optimizer and data loader.
        self._trainer: Optional[_chorus.Trainer] = None
        self._step: Optional[Dict[str, Any]] = None
        self._errors: List[BaseException] = []
        # Until the first step, the launcher's view (the sampler's first draw).
        self._last: Dict[str, Any] = {"step": 0, "rank": int(os.environ.get("RANK", "0")),
                                      "world_size": int(os.environ.get("WORLD_SIZE", "1")), "generation": 0}
        self._joins: List[Dict[str, Any]] = []
        # The step's generation failed and a joiner came: it ends unapplied.
        self._given_up = False
        # A joiner's first step, run on its own while it joins.
        self._warming = False
        self._joining: Optional[_Joining] = None
        self._join_hooks: List[Callable[[], None]] = []
        self._quorum_started = 0.0
        self._loss = _NO_LOSS

    # -- the state ----------------------------------------------------------

    def register_state(self, name: str, obj: Any) -> None:
        """Adds ``obj`` (anything with ``state_dict()`` and
        ``load_state_dict()``) to the state moved to joiners, under
        ``name``; every member must register the same names, in the same
        order."""
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise InvalidArgument(f"{name}: {type(obj).__name__} has no state_dict()/load_state_dict()")
        if name in self._objects:
            raise InvalidArgument(f"{name} is registered already")
        if self._step is not None or self._last["step"]:
            raise InvalidArgument(f"register {name} before the first step")
        for _, t in _tensor_leaves(obj.state_dict()):
            if t.device.type != "cpu":
                raise InvalidArgument(
                    f"{name} holds a tensor on {t.device}: the manager keeps CPU state (move the model and the "
                    "optimizer to the CPU, or leave the tensor out of state_dict())")
        self._objects[name] = obj

    def on_join(self, hook: Callable[[], None]) -> None:
        """Calls ``hook()`` each time this member has just received the
        survivors' state (a joiner's first step, a member that was behind)."""
        self._join_hooks.append(hook)

    def _state(self) -> Tuple[_Snapshot, List[Named]]:
        snapshot = _Snapshot(self._objects)
        return snapshot, snapshot.entries

    # -- one step -----------------------------------------------------------

    def start_quorum(self) -> None:
        """Starts a step: joins the current generation, receiving the state
        first if this member is behind. Calling it again before the step is
        committed continues the same step."""
        self._begin(warm_up=False)

    def _begin(self, warm_up: bool) -> None:
        """:meth:`start_quorum`; with ``warm_up`` (``Optimizer.zero_grad``),
        a worker that comes to a running job starts joining in the
        background and runs this first step on its own."""
        if self._step is not None or self._warming:
            return
        if self._left is not None:
            raise SystemExit(f"chorus: this worker left the job ({self._left}); it exits so that the launcher "
                             "relaunches its replica group")
        self._given_up = False
        self._quorum_started = time.monotonic()
        if self._trainer is None:
            # A replica group's ranks run every step together: none of them
            # warms up alone while the others are in a step.
            if warm_up and self._replica is None and self._joining is None and _joins_running_job():
                self._joining = _Joining(self._join_options)
                self._warming = True
                return
            try:
                self._trainer = self._joining.wait() if self._joining else _chorus.Trainer(*self._join_options)
            except JobFinished as finished:
                # A replacement that came after the last step: its work is done.
                self._end_with_the_job(str(finished))
            finally:
                self._joining = None
        try:
            step = self._trainer.begin_step(self._state)
        except GroupAborted:
            # Admitted as the members took their last step: they left.
            if self._trainer.job_finished():
                self._end_with_the_job("the job ended as this worker joined it")
            raise
        if step["transfer"] is not None:
            self._joins.append({**step["transfer"], "generation": step["generation"],
                                "world_size": step["world_size"], "verified": True,
                                "ms": (time.monotonic() - self._quorum_started) * 1e3})
            if step["rank"] in step["transfer"]["receivers"]:
                for hook in self._join_hooks:
                    hook()
        self._errors = []
        self._step = step
        self._last = {k: step[k] for k in ("step", "rank", "world_size", "generation")}

    def _job_ended(self) -> bool:
        """Whether a replica group's failure is the end of the job: a
        group-mate found it ended, or, for a group that rejoins and has
        applied nothing yet, this shard's members leave it within a grace
        (the shards end together; a healthy group never waits here)."""
        if self._replica.finished():
            return True
        if self._trainer is None or self._applied_here:
            return False
        deadline = time.monotonic() + _END_GRACE
        while time.monotonic() < deadline:
            try:
                if self._trainer.job_finished():
                    return True
            except Exception:
                return False
            time.sleep(0.05)
        return False

    def _end_with_the_job(self, why: str) -> None:
        if self._replica is not None:
            self._replica.mark_finished()
        if self._trainer is not None:
            try:
                self._trainer.destroy()  # the members' last barrier counts this process too
            except Exception:  # leaving anyway
                pass
        print(f"chorus: {why}; this worker exits", file=sys.stderr, flush=True)
        raise SystemExit(0) from None

    def _group(self):
        if self._step is None:
            raise InvalidArgument("no step is under way: call optimizer.zero_grad() (or manager.start_quorum()) first")
        return self._step["group"]

    def allreduce(self, tensor: torch.Tensor) -> "_Averaged":
        """Averages ``tensor`` (in place) over the step's members, at once
        in the background; ``wait()`` on the result. A failure does not
        raise: it votes the step down (``should_commit()`` is then False)."""
        if tensor.device.type != "cpu":
            raise InvalidArgument(f"a tensor on {tensor.device}: the manager syncs CPU tensors")
        if self._warming:
            return _Averaged(self, None, tensor, 1)
        group = self._group()
        try:
            work = group.submit("all_reduce", tensor.numel(), None, tensor, None, "sum", self._timeout)
        except Exception as error:  # the group is gone: the step fails, the vote says so
            self._errors.append(error)
            work = None
        return _Averaged(self, work, tensor, self._step["world_size"])

    def _group_failed(self) -> bool:
        """Whether the step's generation failed under it (every error of
        the step is the group's abort, none is this member's own)."""
        return bool(self._errors) and all(isinstance(e, GroupAborted) for e in self._errors)

    def _rejoin(self) -> bool:
        """Leaves the step's failed generation (its vote fails at once, on
        every member) and, when the next one only lost members, begins the
        same step there and returns True. When it also admitted one, the
        state must move at a step boundary, not in the middle of this step
        (after its forward pass changed buffers and drew random numbers):
        the step is given up (``should_commit()`` says False) and the next
        begins at the next ``zero_grad()``."""
        before = self._step["world_size"]
        self._trainer.commit_step(False, False, _NO_LOSS)
        self._step = None
        _, world = self._trainer.next_generation()
        if world >= before:
            self._given_up = True
            return False
        self.start_quorum()
        return True

    def report_loss(self, loss: Union[float, torch.Tensor]) -> None:
        """Reports this member's loss for the step under way (its mean over
        the local batch, as under DDP). Optional: the step's vote carries
        it, so the job's dashboard plots the members' mean and the commit
        records (``CHORUS_TRAIN_RECORD``, read by ``chorus chaos``) hold it."""
        self._loss = float(loss.detach().item() if isinstance(loss, torch.Tensor) else loss)

    def report_error(self, error: BaseException) -> None:
        """Votes the current step down (a member-local failure)."""
        self._errors.append(error)

    def should_commit(self) -> bool:
        """The step's vote (``Optimizer.step`` calls it): True when every
        member's sync succeeded; apply the update only then. Ends the step."""
        if self._warming or (self._step is None and self._given_up):
            self._given_up = self._warming = False
            self._loss = _NO_LOSS
            return False
        if self._step is None:
            raise InvalidArgument("should_commit() without a step: call optimizer.zero_grad() first")
        if self._replica is not None:
            return self._replica_should_commit()
        ok = not self._errors
        self._step = None
        loss, self._loss = self._loss, _NO_LOSS
        committed, _ = self._trainer.commit_step(ok, False, loss)
        if committed:
            self._last["step"] += 1
        return committed

    def _replica_should_commit(self) -> bool:
        """The vote across replica groups: the group's ranks agree first
        (a rank whose sync failed makes its whole group vote no in every
        shard, so no shard's members count a step the group does not
        apply; a joining group's ranks are swapped in by every shard at
        the same step, when each shard holds its generation with them),
        each shard's elastic group votes, and the step applies only when
        every shard committed it."""
        replica = self._replica
        ok, ready = replica.all_true(not self._errors, self._trainer.next_ready())
        self._step = None
        loss, self._loss = self._loss, _NO_LOSS
        committed, _ = self._trainer.commit_step(ok, False, loss, ready)
        (applied,) = replica.all_true(committed)
        if applied:
            self._applied_steps.applied += 1
            self._applied_here = True
        return applied

    def _applied(self, params: List[torch.Tensor]) -> None:
        """The committed step's update is applied to ``params``: its commit
        record (when recording) carries their checksum."""
        if self._trainer.recording():
            self._trainer.record_step([(str(i), p.detach()) for i, p in enumerate(params)])

    def current_step(self) -> int:
        """Committed steps so far (the same on every member)."""
        return self._applied_steps.applied if self._replica is not None else self._last["step"]

    def num_participants(self) -> int:
        """Members of the current step."""
        return self._last["world_size"]

    def participating_rank(self) -> int:
        """This member's rank in the current step."""
        return self._last["rank"]

    @property
    def device_mesh(self):
        """With ``replica_group_size``: this replica group's one-dimensional
        DeviceMesh (dimension ``"shard"``), to shard the model on."""
        if self._replica is None:
            raise InvalidArgument("device_mesh belongs to replica groups: pass Manager(replica_group_size=N)")
        return self._replica.mesh

    def _data_shard(self) -> Tuple[int, int]:
        """This worker's share of each global batch: ``(index, shares)``.
        Every rank of every replica group reads its own."""
        members = max(1, self.num_participants())
        rank = min(self.participating_rank(), members - 1)
        if self._replica is None:
            return rank, members
        return rank * self._replica.size + self._replica.local, members * self._replica.size

    @property
    def generation(self) -> int:
        """The membership's generation (it changes at each failure or join)."""
        return self._last["generation"]

    # -- checks and faults --------------------------------------------------

    def report(self) -> Dict[str, Any]:
        """What happened here: ``steps``, ``applied``, ``adopted`` (steps
        taken over by receiving state), ``rejected``, ``recoveries`` (each
        with its phases in ms) and ``joins`` (each transfer, verified)."""
        report = self._joined().step_report()
        report["joins"] = list(self._joins)
        if self._replica is not None:
            # The shard's own count may hold a step another shard failed.
            report["steps"] = self._applied_steps.applied
        return report

    def verify(self) -> None:
        """Raises unless every member holds the same state (checksums of
        every entry compared across the members, naming the first that
        differs). Call it between steps, on every member. After a step that
        swapped joiners in, it checks nothing (they hold no state yet; the
        members' was checked at their last join)."""
        if self._joined().generation != self._last["generation"] and self._step is None:
            # Joiners were swapped in as the last step ended and wait for
            # their state, which they will not need: the members leave next
            # and the joiners find the job ended. The members' state was
            # checked at their last join.
            return
        snapshot, entries = self._state()
        self._joined().verify(snapshot, [], [], entries)

    def cut_off(self, reason: str = "injected partition") -> None:
        """Fault injection: cuts this member's links to every other member
        while it keeps running, as a network partition would. In a replica
        group it cuts its links to its group-mates and leaves its shard:
        the partition takes the whole group out."""
        if self._replica is not None:
            # Its group is out: the group-mates' links are cut, and it
            # leaves its shard (cut links there would have its elastic
            # group try to re-form with it while it leaves).
            self._replica.cut_off(reason)
            self._leave_now(reason)
            return
        self._joined().cut_links(reason)

    def _leave_now(self, why: str) -> None:
        self._left = why
        trainer, self._trainer = self._trainer, None
        if trainer is not None:
            try:
                trainer.leave(why)
            except Exception:  # leaving anyway: the process ends next
                pass

    def shutdown(self) -> None:
        """Leaves the job (after the last step)."""
        if self._trainer is not None:
            self._trainer.destroy()
        if self._replica is not None:
            self._replica.close()

    def _joined(self) -> "_chorus.Trainer":
        if self._trainer is None:
            raise InvalidArgument("the manager has not joined the job yet: it joins at the first step")
        return self._trainer


def _refuse_full_restarts() -> None:
    """Raises when this worker's launcher restarts every worker on a
    failure: torchrun, or ``chorus launch`` without an elastic world (which
    it sets under ``--restart-policy worker``)."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ
    elastic = "CHORUS_MIN_WORLD" in os.environ or "CHORUS_ELASTIC_JOIN" in os.environ
    if launched and not elastic:
        launcher = "chorus launch" if "CHORUS_JOB_SECRET" in os.environ else "torchrun"
        raise InvalidArgument(
            f"this worker's launcher ({launcher}) restarts every worker from step 0 when one fails, which undoes "
            "the Manager's recovery (the others keep training; only the failed worker is replaced): launch with "
            "`chorus launch --restart-policy worker`, or pass Manager(allow_full_restart=True) to run anyway")


def _joins_running_job() -> bool:
    """Whether this worker was started to join a running job (relaunched
    by ``chorus launch --restart-policy worker``, or a standby)."""
    return os.environ.get("CHORUS_ELASTIC_JOIN", "").strip() == "1" or bool(os.environ.get("CHORUS_STANDBY"))


class _Joining:
    """A join under way in a thread (the Rust side lets go of the GIL)."""

    def __init__(self, options: tuple) -> None:
        self._trainer: Optional[_chorus.Trainer] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(options,), name="chorus-join", daemon=True)
        self._thread.start()

    def _run(self, options: tuple) -> None:
        try:
            self._trainer = _chorus.Trainer(*options)
        except BaseException as error:  # raised where the join is waited for
            self._error = error

    def wait(self) -> "_chorus.Trainer":
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._trainer


class _Averaged:
    """An all-reduce in flight whose result is divided by the members."""

    def __init__(self, manager: Manager, work, tensor: torch.Tensor, world: int) -> None:
        self._manager, self._work, self._tensor, self._world = manager, work, tensor, world
        self._done = work is None

    def wait(self) -> torch.Tensor:
        if not self._done:
            self._done = True
            try:
                self._work.wait()
                if self._world > 1:
                    self._tensor.div_(self._world)
            except Exception as error:  # the vote carries it to every member
                self._manager.report_error(error)
        return self._tensor


class _Bucket:
    def __init__(self, params: List[torch.nn.Parameter]) -> None:
        self.params = params
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
        self.views: List[torch.Tensor] = []
        at = 0
        for p in params:
            self.views.append(self.flat[at : at + p.numel()].view_as(p))
            at += p.numel()
        self.ready = 0
        self.work: Optional[_Averaged] = None


class DistributedDataParallel(torch.nn.Module):
    """``module``, its gradients averaged over the manager's current
    members while the backward pass runs: buckets of about
    ``bucket_cap_mb`` (the first ``first_bucket_mb``, so that the sync
    starts early), filled in reverse parameter order as DDP does, each
    all-reduced as soon as its gradients are all ready. When ``backward()``
    returns, every parameter's ``.grad`` holds the average (a view into its
    bucket), so clipping, unscaling and logging work as under DDP. The
    layout depends only on the parameters, so every member, a joiner too,
    buckets alike. ``no_sync()`` accumulates locally, as DDP's does."""

    def __init__(self, manager: Manager, module: torch.nn.Module, bucket_cap_mb: float = 25.0,
                 first_bucket_mb: float = 1.0) -> None:
        super().__init__()
        self.module = module
        self._manager = manager
        params, seen = [], set()
        for name, p in module.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if p.device.type != "cpu":
                raise InvalidArgument(f"parameter {name} is on {p.device}: the manager syncs CPU tensors")
            if not p.is_contiguous():
                raise InvalidArgument(f"parameter {name} is not contiguous")
            params.append(p)
        if not params:
            raise InvalidArgument(f"{type(module).__name__} has no parameter that requires grad: nothing to sync")
        if manager._replica is not None:
            raise InvalidArgument("with replica groups, shard the module and wrap it in ReplicateShards")
        self._buckets = _bucketize(params, bucket_cap_mb, first_bucket_mb)
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._sync = True
        self._in_backward = False
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        manager.register_state("model", module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally inside; the next backward outside syncs them all."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        if not self._sync:
            return
        if not self._in_backward:
            self._in_backward = True
            for bucket in self._buckets:
                bucket.ready, bucket.work = 0, None
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        for p, view in zip(bucket.params, bucket.views):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
        bucket.work = self._manager.allreduce(bucket.flat)

    def _finish(self) -> None:
        """At the end of the backward pass: the buckets some parameter
        never reached (unused in this step) go with zeros, then every
        average lands in ``.grad``."""
        self._in_backward = False
        for bucket in self._buckets:
            if bucket.work is None:
                self._launch(bucket)
        for bucket in self._buckets:
            bucket.work.wait()
        retries = 0
        while self._manager._group_failed() and self._local_grads_kept() and retries < _SYNC_RETRIES:
            # The generation failed under the sync (a member died, froze or
            # was cut off): sync the same gradients again in the next one
            # rather than discard the step's forward and backward passes.
            retries += 1
            if not self._manager._rejoin():
                break
            for bucket in self._buckets:
                self._launch(bucket)
            for bucket in self._buckets:
                bucket.work.wait()
        for bucket in self._buckets:
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view

    def _local_grads_kept(self) -> bool:
        """Whether every gradient is still this member's own (not the bucket
        an all-reduce wrote into), so the sync can run again."""
        return all(p.grad is None or p.grad.data_ptr() != view.data_ptr()
                   for bucket in self._buckets for p, view in zip(bucket.params, bucket.views))


class ReplicateShards(torch.nn.Module):
    """``module``, sharded inside the replica group (``fully_shard`` over
    ``manager.device_mesh``, FSDP2), its gradient shards averaged across
    the replica groups when each backward pass ends, after FSDP2's
    reduce-scatter inside the group: rank ``i`` of every group averages
    shard ``i`` over shard ``i``'s elastic group. When ``backward()``
    returns, every ``.grad`` holds the average over every rank of every
    group, so clipping (``clip_grad_norm_`` on the sharded gradients) and
    logging work as under HSDP. Registers the module's sharded state."""

    def __init__(self, manager: Manager, module: torch.nn.Module) -> None:
        super().__init__()
        if manager._replica is None:
            raise InvalidArgument("ReplicateShards needs replica groups: pass Manager(replica_group_size=N)")
        self.module = module
        self._manager = manager
        self._params = [p for p in module.parameters() if p.requires_grad]
        if not self._params:
            raise InvalidArgument(f"{type(module).__name__} has no parameter that requires grad: nothing to sync")
        for name, p in module.named_parameters():
            if p.requires_grad and not isinstance(p, DTensor):
                raise InvalidArgument(f"parameter {name} is not sharded: fully_shard the module (and its "
                                      "blocks) over manager.device_mesh before wrapping it")
            if p.device.type != "cpu":
                raise InvalidArgument(f"parameter {name} is on {p.device}: the manager syncs CPU tensors")
        self._in_backward = False
        module.register_forward_hook(self._watch_backward)
        manager.register_state("model", module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _watch_backward(self, _module, _inputs, output) -> None:
        for t in _tensor_leaves(output):
            if t[1].requires_grad:
                t[1].register_hook(self._backward_started)

    def _backward_started(self, grad: torch.Tensor) -> torch.Tensor:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_fsdp)
        return grad

    def _after_fsdp(self) -> None:
        # FSDP2 finishes its reduce-scatter in a callback of its own, queued
        # in this backward pass too: run after it.
        torch.autograd.Variable._execution_engine.queue_callback(self._sync)

    def _sync(self) -> None:
        self._in_backward = False
        shards = [_local(p.grad) for p in self._params if p.grad is not None]
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for g in shards:
            by_dtype.setdefault(g.dtype, []).append(g)
        flats = [(torch.cat([g.reshape(-1) for g in group]), group) for group in by_dtype.values()]
        for work in [self._manager.allreduce(flat) for flat, _ in flats]:
            work.wait()
        for flat, group in flats:
            at = 0
            for g in group:
                g.copy_(flat[at : at + g.numel()].view_as(g))
                at += g.numel()


def _bucketize(params: List[torch.nn.Parameter], cap_mb: float, first_mb: float) -> List[_Bucket]:
    """Reverse parameter order (a backward pass produces gradients about
    so), one dtype per bucket, the first capped at ``first_mb``."""
    buckets: List[_Bucket] = []
    current: List[torch.nn.Parameter] = []
    size, cap = 0, first_mb * 2**20
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap or p.dtype != current[0].dtype):
            buckets.append(_Bucket(current))
            current, size, cap = [], 0, cap_mb * 2**20
        current.append(p)
        size += nbytes
    if current:
        buckets.append(_Bucket(current))
    return buckets


class Optimizer(torch.optim.Optimizer):
    """``optimizer`` whose ``zero_grad()`` starts the manager's step and
    whose ``step()`` applies the update only if the step is committed (see
    :meth:`Manager.should_commit`). Registers the optimizer's whole
    ``state_dict()`` (its ``param_groups`` too) as state."""

    def __init__(self, manager: Manager, optimizer: torch.optim.Optimizer) -> None:
        self.optim = optimizer
        self.manager = manager
        _materialize(optimizer)
        manager.register_state("optimizer", optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager._begin(warm_up=True)
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        if closure is not None:
            raise InvalidArgument("optimizers that take a closure are not supported (as torchft's)")
        if self.manager.should_commit():
            self.optim.step()
            self.manager._applied([p for g in self.optim.param_groups for p in g["params"]])
        return None

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def state_dict(self) -> Dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    @property
    def param_groups(self):  # noqa: D401 - the wrapped optimizer's
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.optim.param_groups = value

    @property
    def state(self):
        return self.optim.state

    @state.setter
    def state(self, value) -> None:
        self.optim.state = value

    @property
    def defaults(self):
        return self.optim.defaults

    @defaults.setter
    def defaults(self, value) -> None:
        self.optim.defaults = value

    def __repr__(self) -> str:
        return f"chorus.torch.Optimizer({self.optim!r})"


def _materialize(optimizer: torch.optim.Optimizer) -> None:
    """Creates the optimizer's lazily made state, unchanged in effect (one
    step with zero gradients, then the parameters restored and step
    counters reset), so that every member, a joiner too, holds the same
    entries before its first step."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    for p, g in zip(params, grads):
        p.grad = g
    for state in optimizer.state.values():
        for key, value in state.items():
            if key == "step" and torch.is_tensor(value):
                value.zero_()


class DistributedSampler(torch.utils.data.Sampler):
    """Each member's share of ``dataset``, following the membership: every
    batch of ``batch_size`` indices this member draws is its slice of the
    next ``batch_size x members`` samples of the epoch's order (shuffled
    by ``seed + epoch`` when ``shuffle``), taken with the membership known
    when the batch is drawn. The position in the epoch is state: a joiner
    receives it and goes on from there. Give the ``DataLoader`` the same
    ``batch_size``. A step that is not committed loses its batch (as on
    torchft); an epoch ends when its samples are used up (the last batch
    may be short, or dropped with ``drop_last``), and the next pass over
    the sampler is the next epoch."""

    def __init__(self, dataset, manager: Manager, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        if batch_size < 1:
            raise InvalidArgument(f"batch_size must be positive, not {batch_size}")
        self._size = len(dataset)
        self._manager = manager
        self.batch_size, self.shuffle, self.seed, self.drop_last = batch_size, shuffle, seed, drop_last
        self.epoch = 0
        self.cursor = 0
        manager.register_state("sampler", self)

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch`` from its beginning if it is past the
        current one. Epochs only move forward: a joiner's loop, counting
        from 0, must not take the sampler back."""
        if epoch > self.epoch:
            self.epoch, self.cursor = epoch, 0

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self._size)
        return torch.randperm(self._size, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def __iter__(self) -> Iterator[int]:
        if self.cursor >= self._size:
            # The last pass ended: this one is the next epoch.
            self.epoch, self.cursor = self.epoch + 1, 0
        epoch, order = self.epoch, self._order()
        while self.cursor < self._size:
            if self.epoch != epoch:  # a joiner received the survivors' position
                epoch, order = self.epoch, self._order()
            rank, members = self._manager._data_shard()
            start = self.cursor + rank * self.batch_size
            mine = order[start : min(start + self.batch_size, self._size)].tolist()
            self.cursor += members * self.batch_size
            if not mine or (self.drop_last and len(mine) < self.batch_size):
                return
            yield from mine

    def __len__(self) -> int:
        _, members = self._manager._data_shard()
        per_member = self._size / members
        return int(per_member) if self.drop_last else math.ceil(per_member)

    def state_dict(self) -> Dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]


class _PeriodicSync(abc.ABC):
    """Local steps, then a sync of the members every ``sync_every`` of them
    (a committed step of the manager each), the shape torchft's LocalSGD
    and DiLoCo have: a context manager around the user's loop, hooked on
    the optimizer's ``step()``.

    The members' live parameters differ between syncs, so they are not the
    state: the anchor is (the parameters as of the last sync, equal on
    every member) and the position in the period, with whatever the
    subclass adds. Each period begins right after a sync commits, when the
    members agree, so that is where a joiner is admitted; it receives the
    anchor and the position, and starts from there."""

    def __init__(self, manager: Manager, params: List[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
                 sync_every: int, name: str) -> None:
        if sync_every < 1:
            raise InvalidArgument(f"sync_every must be at least 1, not {sync_every}")
        if not params:
            raise InvalidArgument("no parameter that requires grad: nothing to sync")
        for p in params:
            if p.device.type != "cpu":
                raise InvalidArgument(f"a parameter is on {p.device}: the manager syncs CPU tensors")
        self._manager, self._params, self._optimizer = manager, params, optimizer
        self.sync_every, self._local_step = sync_every, 0
        self._anchor = [p.detach().clone() for p in params]
        manager.register_state(name, self)
        manager.on_join(self._restart_from_anchor)
        self._hook = None

    def __enter__(self):
        self._hook = self._optimizer.register_step_post_hook(lambda *_: self._after_step())
        # The first period's quorum: every member starts from rank 0's anchor.
        self._manager.start_quorum()
        return self

    def __exit__(self, *exc) -> bool:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        return False

    def state_dict(self) -> Dict[str, Any]:
        """The anchor and the position in the period (which fragment syncs next)."""
        return {"anchor": self._anchor, "local_step": self._local_step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for mine, theirs in zip(self._anchor, state["anchor"]):
            if mine.data_ptr() != theirs.data_ptr():
                mine.copy_(theirs)
        self._local_step = state["local_step"]

    def _restart_from_anchor(self) -> None:
        with torch.no_grad():
            for p, a in zip(self._params, self._anchor):
                p.copy_(a)

    def _after_step(self) -> None:
        self._local_step += 1
        if self._local_step % self.sync_every in self._due():
            self.sync()

    def _due(self) -> "set[int]":
        return {0}

    def sync(self) -> bool:
        """Syncs now; returns whether the sync committed. The next period
        begins at once (its quorum admits joiners)."""
        self._manager.start_quorum()
        committed = self._sync()
        self._manager.start_quorum()
        return committed

    @abc.abstractmethod
    def _sync(self) -> bool:
        """Contributes to the sync on the current step, votes, and applies
        the result if it committed; returns whether it did."""

    def _average(self, tensors: List[torch.Tensor]) -> bool:
        """Averages ``tensors`` in place over the members, then the vote:
        whether the sync committed."""
        for work in [self._manager.allreduce(t) for t in tensors]:
            work.wait()
        return self._manager.should_commit()


class LocalSGD(_PeriodicSync):
    """Local SGD: every member steps ``optimizer`` on its own data, and
    every ``sync_every`` steps the parameters are averaged over the members
    (a committed step of the manager; a failed sync leaves each member's
    parameters as they were). The model's state moved to a joiner is the
    last average. Use it around the user's loop::

        with ct.LocalSGD(manager, model, optimizer, sync_every=8):
            for x, y in loader:
                optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
    """

    def __init__(self, manager: Manager, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 sync_every: int) -> None:
        super().__init__(manager, [p for p in model.parameters() if p.requires_grad], optimizer, sync_every,
                         "local_sgd")

    def _sync(self) -> bool:
        averages = [p.detach().clone() for p in self._params]
        if not self._average(averages):
            return False
        with torch.no_grad():
            for p, a, avg in zip(self._params, self._anchor, averages):
                p.copy_(avg)
                a.copy_(avg)
        return True


class DiLoCo(_PeriodicSync):
    """DiLoCo: inner steps of ``inner_optimizer`` on each member's data;
    every ``sync_every`` steps the members' average drift from the anchor
    (the pseudo-gradient) takes a step of ``outer_optimizer`` (built over
    the model's parameters, e.g. SGD with lr 0.7, momentum 0.9, Nesterov)
    from the anchor, which becomes the parameters. With several
    ``model_fragments`` (Streaming DiLoCo) each fragment syncs once per
    ``sync_every`` steps, at staggered steps, so a sync moves a fraction of
    the model. The anchor and the outer optimizer's state are what a
    joiner receives. A failed sync leaves the parameters as they were."""

    def __init__(self, manager: Manager, model_fragments: List[torch.nn.Module],
                 inner_optimizer: torch.optim.Optimizer, outer_optimizer: torch.optim.Optimizer,
                 sync_every: int) -> None:
        if not model_fragments or sync_every < len(model_fragments):
            raise InvalidArgument(f"{len(model_fragments)} fragments cannot each sync once in {sync_every} steps")
        fragments = [[p for p in f.parameters() if p.requires_grad] for f in model_fragments]
        super().__init__(manager, [p for f in fragments for p in f], inner_optimizer, sync_every, "diloco")
        # Fragment i syncs at step floor(sync_every / n * (i + 1)) of each period.
        n = len(fragments)
        self._at = {math.floor(sync_every / n * (i + 1)) % sync_every: i for i in range(n)}
        starts = [0]
        for f in fragments:
            starts.append(starts[-1] + len(f))
        self._fragments = [range(starts[i], starts[i + 1]) for i in range(n)]
        self._outer = outer_optimizer
        _materialize(outer_optimizer)
        manager.register_state("outer_optimizer", outer_optimizer)

    def _due(self) -> "set[int]":
        return set(self._at)

    def _sync(self) -> bool:
        fragment = self._fragments[self._at[self._local_step % self.sync_every]]
        drift = [self._anchor[i] - self._params[i].detach() for i in fragment]
        if not self._average(drift):
            return False
        saved = {i: p.grad for i, p in enumerate(self._params)}
        with torch.no_grad():
            for i in range(len(self._params)):
                # Only this fragment's parameters move in the outer step.
                self._params[i].grad = None
            for i, d in zip(fragment, drift):
                self._params[i].copy_(self._anchor[i])
                self._params[i].grad = d
        self._outer.step()
        with torch.no_grad():
            for i in fragment:
                self._anchor[i].copy_(self._params[i])
        for i, p in enumerate(self._params):
            p.grad = saved[i]
        return True
