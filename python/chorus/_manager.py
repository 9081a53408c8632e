"""Fault-tolerant training of a torch model on chorus's elastic layer."""

from __future__ import annotations

import itertools
import pickle
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from chorus import _chorus
from chorus._errors import JobFinished
from chorus._ft import _ENTRY, _decode, _encode, _inline, _materialize, _tensor_leaves


@dataclass(frozen=True)
class Step:
    """The step a member computes."""

    step: int
    """The committed step it becomes (pick the data and the learning rate from it)."""
    rank: int
    world_size: int
    generation: int
    global_batch: int
    grad_scale: float
    shard: range
    """This member's samples: positions within the step's global batch."""


class ElasticTrainer:
    """Trains a torch model fault-tolerantly in a loop of chorus's own,
    which calls the user back for each step's gradients (run it under
    ``chorus launch --restart-policy worker``). :class:`Manager` does the
    same job in the user's own loop; this one also runs local SGD and
    DiLoCo.

    Every step is committed only when every member's gradient sync
    succeeded (a vote), so survivors never roll back. When a member dies,
    freezes or is cut off, the others re-form within the heartbeat window
    and go on (as a smaller group when ``min_world`` allows: the global
    batch is re-split); a relaunched or new worker joins at a step boundary
    and receives the model's parameters, the optimizer's state tensors and
    ``extra_state`` live from the survivors over the mesh (chunked,
    striped over every source, checksummed), with no checkpoint file.

    Modes: ``"ddp"`` (gradients summed every step), ``"local-sgd"``
    (parameters averaged every ``every`` steps), ``"diloco"`` (an outer
    Nesterov step every ``every`` steps; ``fragments`` > 1 streams it).

    The model's parameters and the optimizer's state must be float32 CPU
    tensors. The optimizer's state is created at construction (one step of
    zero gradients, then the parameters restored and step counters reset),
    so that every member, a joiner too, holds the same entries.
    ``extra_state`` is any object with ``state_dict()`` and
    ``load_state_dict()`` (a data position, an RNG, a scheduler), moved with
    the state: the CPU tensors its ``state_dict()`` holds travel as state
    entries, raw bytes like the model's (so they must have the same dtype
    and shape on every member, the joiner's included, as the model's
    parameters do), the rest pickled. A tensor ``state_dict()`` returns
    itself (not a copy) is read and written in place; a copy (an RNG's
    state) is copied into a buffer the manager keeps at each transfer.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        mode: str = "ddp",
        every: int = 10,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        fragments: int = 1,
        extra_state: Any = None,
        timeout: float = 300.0,
        heartbeat_timeout: Optional[float] = None,
        min_world: Optional[int] = None,
        max_world: Optional[int] = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.extra_state = extra_state
        self._mode = (mode, every, outer_lr, outer_momentum, fragments)
        self._params = [p for p in model.parameters() if p.requires_grad]
        _materialize(optimizer)
        self._extras = _ExtraTensors(extra_state)
        try:
            self._trainer = _chorus.Trainer(timeout, heartbeat_timeout, min_world, max_world)
        except JobFinished as finished:
            # A replacement that came after the last step: its work is done.
            print(f"chorus: {finished}; this worker exits", file=sys.stderr, flush=True)
            raise SystemExit(0) from None

    @property
    def rank(self) -> int:
        """This member's rank in the current generation."""
        return self._trainer.rank

    @property
    def generation(self) -> int:
        """The current generation; a relaunched worker joins one past 0."""
        return self._trainer.generation

    def _state(self) -> Tuple[List[Named], List[Named], List[Named]]:
        params = [(f"param.{i}", p.data) for i, p in enumerate(self._params)]
        state = []
        for i, p in enumerate(self._params):
            for key in sorted(self.optimizer.state.get(p, {})):
                value = self.optimizer.state[p][key]
                if torch.is_tensor(value):
                    state.append((f"optim.{i}.{key}", value))
        return params, state, self._extras.entries

    def train(
        self,
        steps: int,
        global_batch: int,
        backward: Callable[[Step], float],
        on_commit: Optional[Callable[[int, float, int, int], None]] = None,
    ) -> Dict[str, Any]:
        """Runs until ``steps`` steps are committed (a joiner: until the job's
        are). ``backward(step)`` computes the loss summed over the samples
        ``step.shard`` of the step's global batch, calls ``.backward()`` on
        it and returns its value; the manager scales and syncs the
        gradients and runs the optimizer once the step is committed.
        ``on_commit(step, mean_loss, world_size, generation)`` sees each
        committed step. Returns the report: steps, applied, adopted,
        recoveries (each with its phases in ms)."""
        params, state, extras = self._state()
        hooks = _Hooks(self, backward)
        return self._trainer.train(
            hooks, params, state, extras, steps, global_batch, on_commit or (lambda *_: None), *self._mode
        )

    def verify(self) -> None:
        """Raises unless every member holds the same parameters and
        optimizer state (checksums compared across the members)."""
        self._trainer.verify(_Hooks(self, lambda step: 0.0), *self._state())

    def cut_off(self, reason: str = "injected partition") -> None:
        """Fault injection: cuts this member's links to every other member
        while it keeps running, as a network partition would. Every member's
        current generation aborts; the group re-forms (with this member,
        whose store is still reachable) and the step is re-run."""
        self._trainer.cut_links(reason)

    def destroy(self) -> None:
        """Leaves the job (after the last step)."""
        self._trainer.destroy()


class _Hooks:
    """What the Rust trainer calls back."""

    def __init__(self, manager: ElasticTrainer, backward: Callable[[Step], float]) -> None:
        self._manager = manager
        self._backward = backward

    def backward(self, step: Dict[str, Any]) -> float:
        for p in self._manager._params:
            p.grad = None
        start, end = step.pop("shard")
        return float(self._backward(Step(shard=range(start, end), **step)))

    def grads(self) -> List[torch.Tensor]:
        out = []
        for p in self._manager._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
            out.append(p.grad)
        return out

    def apply(self, step: Dict[str, Any]) -> None:
        self._manager.optimizer.step()

    def save_extra(self) -> bytes:
        return self._manager._extras.save()

    def load_extra(self, data: bytes) -> None:
        self._manager._extras.load(data)


Named = Tuple[str, torch.Tensor]
def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and not t.is_sparse and t.numel() > 0


class _ExtraTensors:
    """``extra_state``'s tensors as state entries: the bytes travel like
    the model's, chunked and striped, instead of inside the pickle. Each
    entry is the tensor ``state_dict()`` returns when it returns the same
    memory twice (read and written in place), otherwise a buffer of the
    manager's that each save copies into."""

    def __init__(self, extra: Any) -> None:
        self._extra = extra
        self._held: List[torch.Tensor] = []
        self.entries: List[Named] = []
        if extra is None:
            return
        first = [t for _, t in _tensor_leaves(extra.state_dict())]
        again = [t for _, t in _tensor_leaves(extra.state_dict())]
        for i, (t, u) in enumerate(zip(first, again)):
            if not _movable(t):
                self._held.append(torch.empty(0))
                continue
            live = t.is_contiguous() and t.data_ptr() == u.data_ptr()
            held = t.detach() if live else torch.empty(t.shape, dtype=t.dtype)
            self._held.append(held)
            # Dtype and shape in the name: the members' entry lists are
            # compared by name and byte length.
            dtype = str(t.dtype).removeprefix("torch.")
            self.entries.append((f"extra.{i}:{dtype}{list(t.shape)}", held))

    def _slot(self, t: torch.Tensor, index: int) -> Any:
        held = self._held[index] if index < len(self._held) else None
        if (held is None or held.numel() == 0 or held.shape != t.shape
                or held.dtype != t.dtype or not _movable(t)):
            return _inline(t)
        if held.data_ptr() != t.data_ptr():
            held.copy_(t)
        return (_ENTRY, index)

    def save(self) -> bytes:
        if self._extra is None:
            return b""
        index = itertools.count()
        return pickle.dumps(_encode(self._extra.state_dict(), lambda t: self._slot(t, next(index))))

    def load(self, data: bytes) -> None:
        if self._extra is not None and data:
            self._extra.load_state_dict(_decode(pickle.loads(data), self._held))
