"""chorus as a ``torch.distributed`` backend.

Importing this module registers the ``"chorus"`` backend for CPU tensors,
so unchanged PyTorch code runs on it::

    import chorus.torch  # noqa: F401
    import torch.distributed as dist

    dist.init_process_group("chorus")  # env://, tcp://, file:// or store=
    dist.all_reduce(tensor)

Collectives run in chorus (shared memory between ranks on a host, QUIC
between hosts) on the tensors' own memory: a contiguous CPU tensor is lent
to the operation in place and kept alive until it ends, and the GIL is
released while the ranks work. A non-contiguous tensor is refused with a
``ValueError`` (the result would not land in it); pass ``t.contiguous()``.
Collectives run in the order they are called, as on every torch backend.

Supervision: when a rank dies, freezes or is cut off, every pending and
later operation of the group raises :class:`chorus.GroupAborted` (a
``torch.distributed.DistBackendError``) within the heartbeat window
(``CHORUS_HEARTBEAT_TIMEOUT`` seconds, default 5), naming the rank; ranks
that call different collectives raise :class:`chorus.DesyncError`.

The operations DDP and FSDP2 issue most (all-reduce, broadcast,
all_gather_into_tensor, reduce_scatter_tensor on one dense tensor) go from
torch's dispatcher to the library through a C++ front with no Python step
(:mod:`chorus.cpp_backend`, built against the installed torch on first
use); everything else goes to :class:`ChorusBackend` behind it, which runs
alone where the front cannot build.

Point-to-point operations run as Gloo's do: each send and receive starts
at once, beside the collectives (a receive may be posted before its send,
on either side); tags are matched, and ``recv`` from any source returns the
sender.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from chorus import _chorus, cpp_backend
from chorus._errors import ChorusError, CollectiveTimeout, InvalidArgument

__all__ = ["ChorusBackend", "ChorusWork", "BACKEND", "python_backend", "register"]

BACKEND = "chorus"
#: torch's default for a CPU group's timeouts, in seconds.
_DEFAULT_TIMEOUT = 1800.0
#: The point-to-point tag of monitored barriers' messages, far from the
#: small tags programs use.
_MONITORED_BARRIER_TAG = (1 << 24) - 1
#: Backends not yet shut down (see ``ChorusBackend.__init__``).
_LIVE: "set[ChorusBackend]" = set()

_R = dist.ReduceOp.RedOpType
_OPS = {
    _R.SUM: "sum",
    _R.AVG: "avg",
    _R.PRODUCT: "prod",
    _R.MIN: "min",
    _R.MAX: "max",
    _R.BAND: "band",
    _R.BOR: "bor",
    _R.BXOR: "bxor",
}


def _op(reduce_op) -> str:
    kind = getattr(reduce_op, "op", reduce_op)
    try:
        return _OPS[kind]
    except KeyError:
        raise InvalidArgument(
            f"the chorus backend has no reduce op {kind}; it offers SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR"
        ) from None


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor chorus sees: bool as the bytes it is stored in."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor


def _seconds(timeout) -> Optional[float]:
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    # torch passes a zero or negative timedelta for "no timeout".
    return seconds if seconds > 0 else None


class ChorusWork(dist._Work):
    """One or more chorus operations in flight, as one torch ``Work``.

    ``finish`` runs once they all succeeded, before ``wait()`` returns and
    before the future completes (copying results out of scratch buffers for
    the list forms of the collectives). The future's value is ``result``.
    Whoever sees the operations end first finishes the work: the thread in
    ``wait()``, or, once ``get_future()`` was asked for, the chorus thread
    that runs the done-callbacks (a plain synchronous call never pays for
    that thread's wake-up).
    """

    def __init__(self, cores: Sequence[_chorus.Work], result, finish: Sequence[Callable[[], None]] = ()):
        super().__init__()
        self._cores = list(cores)
        self._result = result
        self._finish = list(finish)
        self._error: Optional[BaseException] = None
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._future: Optional[torch.futures.Future] = None
        self._left = len(self._cores)

    def _one_done(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._end()

    def _end(self) -> None:
        """Finishes the work once (its operations have all ended)."""
        with self._lock:
            if self._ended.is_set():
                return
            for core in self._cores:
                error = core.exception()
                if error is not None:
                    self._error = error
                    break
            if self._error is None:
                try:
                    for finish in self._finish:
                        finish()
                except BaseException as error:  # the caller sees it from wait()
                    self._error = error
            self._ended.set()
            future = self._future
        if future is not None:
            self._complete(future)

    def _complete(self, future: torch.futures.Future) -> None:
        if self._error is None:
            future.set_result(self._result)
        else:
            future.set_exception(self._error)

    def wait(self, timeout=None) -> bool:
        seconds = _seconds(timeout)
        for core in self._cores:
            core.wait(seconds)  # raises the operation's error, or WaitTimeout
        self._end()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._ended.is_set() and all(core.is_completed() for core in self._cores):
            self._end()
        return self._ended.is_set()

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        self.is_completed()
        return self._error

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is not None:
                return self._future
            self._future = future = torch.futures.Future()
            ended = self._ended.is_set()
        if ended:
            self._complete(future)
        elif not self._cores:
            self._end()
        else:
            for core in self._cores:
                core.add_done_callback(self._one_done)
        return future

    def result(self):
        return self._result

    def synchronize(self) -> None:
        self.wait()


class ChorusBackend(_c10d.Backend):
    """The chorus backend of a ``torch.distributed`` process group, in
    Python: alone, or behind the C++ front (:mod:`chorus.cpp_backend`),
    which hands it what it does not run itself.

    torch makes the group (named, registered, with this backend for the
    CPU), so everything that looks a group's backend up works on it:
    DeviceMesh, DTensor, FSDP2, tensor parallel, compiled DDP, batched
    point-to-point, ``split_group``."""

    def __init__(self, core: _chorus.Group, timeout: Optional[float] = None):
        super().__init__(core.rank, core.world_size)
        self._core = core
        self._timeout = timeout
        self._coalescing: Optional[List[ChorusWork]] = None
        self._collectives = 0
        self._options = _c10d.Backend.Options(BACKEND, timedelta(seconds=timeout or _DEFAULT_TIMEOUT))
        # Held until the group is shut down: torch keeps only the C++ half
        # of a Python backend where it wraps one (TORCH_DISTRIBUTED_DEBUG=
        # DETAIL's checking wrapper), and without this object its calls
        # would find no method.
        _LIVE.add(self)

    @property
    def options(self):
        """torch's options record (its timeout). Defined here because
        torch's lookup of a Python backend's options without one recurses."""
        return self._options

    # -- identity and lifetime -------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks on its host."""
        return self._core.local_rank

    def shutdown(self) -> None:
        """Leaves the group on purpose (``destroy_process_group`` calls it):
        peers see this rank shut down, not fail."""
        self._core.destroy()
        _LIVE.discard(self)

    def abort(self) -> None:
        self._core.destroy()
        _LIVE.discard(self)

    @property
    def supports_splitting(self) -> bool:
        return True

    def split(self, store, ranks, opts=None):
        """The backend of the group of `ranks` (this group's ranks, this
        rank among them), formed through `store` (``split_group``)."""
        me = list(ranks).index(self.rank())
        timeout = (_seconds(opts._timeout) if opts is not None else None) or self._timeout
        return ChorusBackend(_form(store, me, len(ranks), timeout), timeout)

    @property
    def supports_coalescing(self) -> bool:
        return True

    def start_coalescing(self) -> None:
        """Collects the operations issued until `end_coalescing` into one
        work (``batch_isend_irecv``, the coalescing manager)."""
        self._coalescing = []

    def end_coalescing(self):
        works, self._coalescing = self._coalescing or [], None
        return ChorusWork([c for w in works for c in w._cores], [w._result for w in works],
                          [f for w in works for f in w._finish])

    def _get_sequence_number_for_group(self) -> int:
        """How many collectives this rank has issued on the group (what
        torch's debug wrapper compares across ranks before each one)."""
        return self._collectives

    def _work(self, cores: Sequence[_chorus.Work], result, finish: Sequence[Callable[[], None]] = (),
              collective: bool = True):
        self._collectives += collective
        work = ChorusWork(cores, result, finish)
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    # -- helpers ------------------------------------------------------------

    def _submit(self, kind, count, input=None, output=None, root=None, op=None, timeout=None) -> _chorus.Work:
        if input is not None and output is not None and _overlap(input, output):
            # In place, as FSDP2 gathers (the input is the output's own
            # block): the ranks read the input while writing the output.
            input = input.clone()
        return self._core.submit(
            kind,
            count,
            None if input is None else _raw(input),
            None if output is None else _raw(output),
            root,
            op,
            _seconds(timeout) or self._timeout,
        )

    def _blocks(self, what: str, tensor: torch.Tensor) -> int:
        world = self.size()
        if tensor.numel() % world:
            raise InvalidArgument(f"{what}: {tensor.numel()} elements do not split into {world} equal blocks")
        return tensor.numel() // world

    @staticmethod
    def _one(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise InvalidArgument(f"{what} takes one tensor per rank on the CPU, not {len(tensors)}")
        return tensors[0]

    # -- all-reduce, broadcast, reduce -------------------------------------

    def allreduce(self, tensors, opts=None):
        if tensors and tensors[0].is_sparse:
            return self.allreduce_sparse(tensors, opts)
        op = _op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        timeout = opts.timeout if opts is not None else None
        cores = [self._submit("all_reduce", t.numel(), output=t, op=op, timeout=timeout) for t in tensors]
        return self._work(cores, list(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def allreduce_sparse(self, tensors, opts=None):
        """All-reduce of sparse COO tensors (SUM, as Gloo offers): every
        rank's indices and values are gathered and summed."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if getattr(op, "op", op) != _R.SUM:
            raise InvalidArgument("a sparse all_reduce sums (ReduceOp.SUM); no other operator is offered")
        for tensor in tensors:
            summed = self._sparse_sum(tensor.coalesce())
            tensor.copy_(summed)
        return self._work([], list(tensors))

    def _sparse_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        indices, values = tensor.indices().contiguous(), tensor.values().contiguous()
        world = self.size()
        nnz = torch.tensor([indices.shape[1]], dtype=torch.int64)
        counts = torch.empty(world, dtype=torch.int64)
        self._submit("all_gather", 1, input=nnz, output=counts).wait()
        most = int(counts.max())
        padded_indices = torch.zeros((indices.shape[0], most), dtype=torch.int64)
        padded_indices[:, : indices.shape[1]] = indices
        padded_values = torch.zeros((most,) + tuple(values.shape[1:]), dtype=values.dtype)
        padded_values[: values.shape[0]] = values
        all_indices = torch.empty((world,) + tuple(padded_indices.shape), dtype=torch.int64)
        all_values = torch.empty((world,) + tuple(padded_values.shape), dtype=values.dtype)
        self._submit("all_gather", padded_indices.numel(), input=padded_indices, output=all_indices).wait()
        self._submit("all_gather", padded_values.numel(), input=padded_values, output=all_values).wait()
        parts = [
            torch.sparse_coo_tensor(all_indices[r][:, : counts[r]], all_values[r][: counts[r]], tensor.shape)
            for r in range(world)
        ]
        return torch.stack(parts).sum(0).coalesce() if world > 1 else parts[0].coalesce()

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        timeout = opts.timeout if opts is not None else None
        cores = [self._submit("broadcast", t.numel(), output=t, root=root, timeout=timeout) for t in tensors]
        return self._work(cores, list(tensors))

    def reduce(self, tensors, opts=None):
        tensor = self._one(tensors, "reduce")
        root, op = opts.rootRank, _op(opts.reduceOp)
        # Ranks other than the root keep their input, as on Gloo: they
        # reduce a copy (the algorithm leaves partial sums in its buffer).
        target = tensor if self.rank() == root else tensor.clone()
        core = self._submit("reduce", tensor.numel(), output=target, root=root, op=op, timeout=opts.timeout)
        return self._work([core], [tensor])

    # -- all-gather, gather -------------------------------------------------

    def _check_same(self, what: str, tensors: Sequence[torch.Tensor], like: torch.Tensor) -> None:
        if len(tensors) != self.size():
            raise InvalidArgument(f"{what} needs {self.size()} tensors, one per rank, not {len(tensors)}")
        for t in tensors:
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise InvalidArgument(
                    f"{what}: a tensor of {t.numel()} {t.dtype} does not match the input's {like.numel()} {like.dtype}"
                )

    def _all_gather_list(self, outputs: List[torch.Tensor], tensor: torch.Tensor, timeout=None):
        """The all-gather into a list: its operation and the copy-out."""
        self._check_same("all_gather", outputs, tensor)
        n = tensor.numel()
        flat = torch.empty(n * self.size(), dtype=tensor.dtype)
        core = self._submit("all_gather", n, input=tensor.contiguous(), output=flat, timeout=timeout)

        def finish():
            for i, out in enumerate(outputs):
                out.copy_(flat[i * n : (i + 1) * n].view_as(out))

        return core, finish

    def allgather(self, output_tensors, input_tensors, opts=None):
        tensor = self._one(input_tensors, "all_gather")
        timeout = opts.timeout if opts is not None else None
        core, finish = self._all_gather_list(self._one(output_tensors, "all_gather"), tensor, timeout)
        return self._work([core], output_tensors, [finish])

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        # torch's layout: output_lists[rank][i] receives that rank's input i.
        if len(output_lists) != self.size():
            raise InvalidArgument(
                f"all_gather_coalesced needs {self.size()} output lists, one per rank, not {len(output_lists)}"
            )
        for outs in output_lists:
            if len(outs) != len(input_tensors):
                raise InvalidArgument(
                    f"all_gather_coalesced: an output list has {len(outs)} tensors for {len(input_tensors)} inputs"
                )
        timeout = opts.timeout if opts is not None else None
        parts = [
            self._all_gather_list([outs[i] for outs in output_lists], t, timeout) for i, t in enumerate(input_tensors)
        ]
        return self._work([c for c, _ in parts], output_lists, [f for _, f in parts])

    def _all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, timeout=None) -> _chorus.Work:
        if output.numel() != tensor.numel() * self.size():
            raise InvalidArgument(
                f"all_gather_into_tensor: the output has {output.numel()} elements, not "
                f"{self.size()} x {tensor.numel()}"
            )
        return self._submit("all_gather", tensor.numel(), input=tensor, output=output, timeout=timeout)

    def all_gather_single(self, output, input, opts=None):
        timeout = opts.timeout if opts is not None else None
        return self._work([self._all_gather_into(output, input, timeout)], [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        timeout = opts.timeout if opts is not None else None
        return self._work([self._all_gather_into(o, i, timeout) for o, i in zip(outputs, inputs)], list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors, input_tensors, opts=None):
        tensor = self._one(input_tensors, "gather")
        root, n = opts.rootRank, tensor.numel()
        if self.rank() != root:
            return self._work([self._submit("gather", n, input=tensor, root=root, timeout=opts.timeout)], [])
        outputs = self._one(output_tensors, "gather")
        self._check_same("gather", outputs, tensor)
        flat = torch.empty(n * self.size(), dtype=tensor.dtype)
        core = self._submit("gather", n, input=tensor, output=flat, root=root, timeout=opts.timeout)

        def finish():
            for i, out in enumerate(outputs):
                out.copy_(flat[i * n : (i + 1) * n].view_as(out))

        return self._work([core], output_tensors, [finish])

    # -- scatter, reduce-scatter -------------------------------------------

    def scatter(self, output_tensors, input_tensors, opts=None):
        output = self._one(output_tensors, "scatter")
        root = opts.rootRank
        if self.rank() != root:
            core = self._submit("scatter", output.numel(), output=output, root=root, timeout=opts.timeout)
            return self._work([core], [output])
        inputs = self._one(input_tensors, "scatter")
        self._check_same("scatter", inputs, output)
        flat = torch.cat([t.reshape(-1) for t in inputs])
        core = self._submit("scatter", output.numel(), input=flat, output=output, root=root, timeout=opts.timeout)
        return self._work([core], [output])

    def _reduce_scatter_into(self, output: torch.Tensor, flat: torch.Tensor, opts):
        """The reduce-scatter of `flat` into `output`: its operation and the copy-out."""
        n = output.numel()
        if flat.numel() != n * self.size():
            raise InvalidArgument(
                f"reduce_scatter: the input has {flat.numel()} elements, not {self.size()} x {n}"
            )
        # Out of place: the input is only read; the rank's block is copied
        # out of the scratch output.
        scratch = torch.empty_like(flat)
        core = self._submit("reduce_scatter", n, input=flat, output=scratch, op=_op(opts.reduceOp),
                            timeout=opts.timeout)
        start = self.rank() * n

        def finish():
            output.copy_(scratch[start : start + n].view_as(output))

        return core, finish

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        output = self._one(output_tensors, "reduce_scatter")
        inputs = self._one(input_tensors, "reduce_scatter")
        self._check_same("reduce_scatter", inputs, output)
        flat = torch.cat([t.reshape(-1) for t in inputs])
        core, finish = self._reduce_scatter_into(output, flat, opts)
        return self._work([core], [output], [finish])

    def reduce_scatter_single(self, output, input, opts=None):
        core, finish = self._reduce_scatter_into(output, input, opts)
        return self._work([core], [output], [finish])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        parts = [self._reduce_scatter_into(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._work([c for c, _ in parts], list(outputs), [f for _, f in parts])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- all-to-all -----------------------------------------------------------

    def _padded_all_to_all(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], timeout=None):
        """All-to-all of blocks of any sizes: every rank pads its blocks to
        the largest anywhere (agreed by a MAX all-reduce), then copies the
        received blocks out."""
        dtype = inputs[0].dtype
        longest = torch.tensor([max([t.numel() for t in inputs] + [t.numel() for t in outputs])], dtype=torch.int64)
        self._submit("all_reduce", 1, output=longest, op="max", timeout=timeout).wait()
        block = int(longest.item())
        world = self.size()
        send = torch.zeros(block * world, dtype=dtype)
        for i, t in enumerate(inputs):
            send[i * block : i * block + t.numel()] = t.reshape(-1)
        received = torch.empty_like(send)
        core = self._submit("all_to_all", block, input=send, output=received, timeout=timeout)

        def finish():
            for i, out in enumerate(outputs):
                out.copy_(received[i * block : i * block + out.numel()].view_as(out))

        return self._work([core], outputs, [finish])

    def alltoall(self, output_tensors, input_tensors, opts=None):
        world = self.size()
        if len(output_tensors) != world or len(input_tensors) != world:
            raise InvalidArgument(f"all_to_all needs {world} input and {world} output tensors")
        timeout = opts.timeout if opts is not None else None
        return self._padded_all_to_all(list(output_tensors), list(input_tensors), timeout)

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None):
        world = self.size()
        timeout = opts.timeout if opts is not None else None
        if not output_split_sizes and not input_split_sizes:
            count = self._blocks("all_to_all_single", input)
            if output.numel() != input.numel():
                raise InvalidArgument(
                    f"all_to_all_single: the output has {output.numel()} elements, the input {input.numel()}"
                )
            return self._work([self._submit("all_to_all", count, input=input, output=output, timeout=timeout)],
                              [output])
        ins = _split(input, input_split_sizes, world)
        outs = _split(output, output_split_sizes, world)
        return self._padded_all_to_all(outs, ins, timeout)

    alltoall_base = all_to_all_single

    # -- barrier, point to point --------------------------------------------

    def barrier(self, opts=None):
        timeout = opts.timeout if opts is not None else None
        return self._work([self._submit("barrier", 0, timeout=timeout)], [])

    def monitored_barrier(self, opts=None, wait_all_ranks: bool = False) -> None:
        """Gloo's monitored barrier: rank 0 hears from every other rank
        within the timeout, then answers each; the error names the ranks
        that did not come (the first, or with `wait_all_ranks` all of
        them), in Gloo's words. A failed one leaves the group broken (a
        rank is stuck)."""
        seconds = opts.timeout.total_seconds() if opts is not None else self._options._timeout.total_seconds()
        deadline = time.monotonic() + max(seconds, 0.0)
        token = torch.zeros(1, dtype=torch.uint8)
        me, world = self.rank(), self.size()

        def exchange(kind: str, peer: int):
            left = deadline - time.monotonic()
            if left <= 0:
                raise CollectiveTimeout(f"Rank {me} timed out in monitoredBarrier after {seconds * 1e3:.0f} ms")
            tensor = token if kind == "send" else torch.zeros(1, dtype=torch.uint8)
            input, output = (tensor, None) if kind == "send" else (None, tensor)
            self._core.submit(kind, 1, input, output, peer, None, left, _MONITORED_BARRIER_TAG).wait()

        if me != 0:
            try:
                exchange("send", 0)
                exchange("recv", 0)
            except ChorusError as e:
                raise CollectiveTimeout(
                    f"Rank {me} successfully reached monitoredBarrier, but received errors while waiting for "
                    f"send/recv from rank 0. Please check rank 0 logs for faulty rank: {e}"
                ) from e
            return
        missing = []
        for peer in range(1, world):
            try:
                exchange("recv", peer)
            except ChorusError as e:
                if isinstance(e, CollectiveTimeout) and str(e).startswith(f"Rank {me} timed out"):
                    raise
                missing.append(peer)
                if not wait_all_ranks:
                    error = CollectiveTimeout(
                        f"Rank {peer} failed to pass monitoredBarrier in {seconds * 1e3:.0f} ms: {e}")
                    error.ranks = [peer]
                    raise error from e
        if missing:
            error = CollectiveTimeout(
                f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in {seconds * 1e3:.0f} ms")
            error.ranks = missing
            raise error
        for peer in range(1, world):
            exchange("send", peer)

    def send(self, tensors, dstRank, tag=0):  # noqa: N803 - torch's name
        tensor = self._one(tensors, "send")
        core = self._core.submit("send", tensor.numel(), _raw(tensor), None, dstRank, None, self._timeout, tag)
        return self._work([core], [tensor], collective=False)

    def recv(self, tensors, srcRank, tag=0):  # noqa: N803 - torch's name
        return self._receive(tensors, srcRank, tag)

    def recv_anysource(self, tensors, tag=0):
        return self._receive(tensors, None, tag)

    def _receive(self, tensors, source: Optional[int], tag: int) -> ChorusWork:
        """A receive from `source` (None: the first sender of `tag`); the
        sender is recorded for torch's ``work._source_rank()``."""
        tensor = self._one(tensors, "recv")
        core = self._core.submit("recv", tensor.numel(), None, _raw(tensor), source, None, self._timeout, tag)

        def record_sender():
            setattr(tensor, _SENDER, core.source)

        return self._work([core], [tensor], [record_sender], collective=False)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory intersects."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _split(tensor: torch.Tensor, sizes, world: int) -> List[torch.Tensor]:
    """`tensor`'s dim-0 blocks of `sizes` rows (equal blocks when empty)."""
    if not sizes:
        sizes = [tensor.shape[0] // world] * world if tensor.dim() > 0 else [0] * world
    if len(sizes) != world or sum(sizes) != (tensor.shape[0] if tensor.dim() > 0 else 0):
        raise InvalidArgument(f"all_to_all_single: split sizes {list(sizes)} do not cover the tensor's {tensor.shape[0]} rows")
    return list(torch.split(tensor, list(sizes)))


def _store_host(store) -> Optional[str]:
    """The host the store torch made lives on (a TCPStore's), else
    MASTER_ADDR; None when neither says (the store is local)."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host = getattr(store, "host", None)
    return host if host else os.environ.get("MASTER_ADDR")


def _form(store, rank: int, world_size: int, timeout: Optional[float],
          heartbeat_timeout: Optional[float] = None) -> _chorus.Group:
    """Forms one rank's chorus group through `store`."""
    seconds = timeout or _DEFAULT_TIMEOUT
    if world_size == 1:
        # Nothing to meet: torch may hand two one-rank groups the same
        # store prefix (one per rank), which would look like a rank claimed
        # twice in a shared store.
        store = dist.HashStore()
    return _chorus.Group.init(store, rank, world_size, seconds, seconds, _store_host(store), heartbeat_timeout)


def _creator(implementation: Optional[str] = None):
    """torch's backend constructor (the extended API) for `implementation`
    ("cpp" or "python"; None reads ``CHORUS_TORCH_BACKEND`` when a group is
    made, see :mod:`chorus.cpp_backend`)."""

    def create(opts, backend_options=None):
        """The group's store, this rank's place in it and its timeout.
        ``backend_options`` is ``init_process_group``'s ``pg_options``: a
        dict whose ``"heartbeat_timeout"`` (seconds) is how long a silent
        peer is waited for before it is taken for dead or frozen."""
        timeout = _seconds(opts.timeout)
        heartbeat = None
        if backend_options is not None:
            if not isinstance(backend_options, dict) or set(backend_options) - {"heartbeat_timeout"}:
                raise InvalidArgument(
                    f"chorus takes pg_options={{'heartbeat_timeout': seconds}}, not {backend_options!r}")
            heartbeat = backend_options.get("heartbeat_timeout")
        front = cpp_backend.load(implementation)
        python = ChorusBackend(_form(opts.store, opts.group_rank, opts.group_size, timeout, heartbeat), timeout)
        if front is None:
            return python
        api, group = python._core.c_api()
        return front.ChorusCppBackend(python, api, group, timeout or _DEFAULT_TIMEOUT)

    return create


def register(name: str, implementation: str) -> None:
    """Registers chorus under another backend name with a fixed
    implementation, "cpp" or "python" (the benchmarks run both side by
    side)."""
    if implementation not in ("cpp", "python"):
        raise InvalidArgument(f"implementation {implementation!r}: expected 'cpp' or 'python'")
    dist.Backend.register_backend(name, _creator(implementation), extended_api=True, devices=["cpu"])


def python_backend(backend) -> ChorusBackend:
    """The Python backend of a group's chorus backend, behind its C++ front
    or itself (``group._get_backend(torch.device("cpu"))``)."""
    return getattr(backend, "python", backend)


#: The attribute a received tensor carries its sender's rank in, for
#: torch's ``work._source_rank()`` (the work torch hands out cannot ask
#: chorus's).
_SENDER = "_chorus_sender"


def _forward_work_state() -> None:
    """torch (2.15) wraps a Python backend's work in a holder that forwards
    ``wait`` and ``get_future`` but answers ``is_completed``, ``exception``
    and ``_source_rank`` from its own state, which nothing sets: a polled
    work would never complete. Works whose own answer is "not yet" (or
    none) are asked again through their future, which the holder does
    forward."""
    work_class = _c10d.Work
    is_completed, exception, source_rank = work_class.is_completed, work_class.exception, work_class._source_rank

    def future_of(work):
        try:
            return work.get_future()
        except RuntimeError:  # a backend without futures
            return None

    def forwarded_is_completed(work) -> bool:
        if is_completed(work):
            return True
        future = future_of(work)
        return future is not None and future.done()

    def forwarded_exception(work):
        error = exception(work)
        if error is not None:
            return error
        future = future_of(work)
        if future is None or not future.done():
            return None
        try:
            future.value()
        except Exception as e:  # noqa: BLE001 - the work's error, returned
            return e
        return None

    def forwarded_source_rank(work) -> int:
        try:
            return source_rank(work)
        except RuntimeError:
            future = future_of(work)
            received = future.value() if future is not None and future.done() else None
            sender = getattr(received[0], _SENDER, None) if received else None
            if sender is None:
                raise
            return sender

    work_class.is_completed = forwarded_is_completed
    work_class.exception = forwarded_exception
    work_class._source_rank = forwarded_source_rank


_forward_work_state()
dist.Backend.register_backend(BACKEND, _creator(), extended_api=True, devices=["cpu"])

from chorus._ft import (  # noqa: E402
    DiLoCo, DistributedDataParallel, DistributedSampler, LocalSGD, Manager, Optimizer, ReplicateShards)
from chorus._manager import ElasticTrainer, Step  # noqa: E402  (after the backend's registration)

__all__ += ["DiLoCo", "DistributedDataParallel", "DistributedSampler", "ElasticTrainer", "LocalSGD", "Manager",
            "Optimizer", "ReplicateShards", "Step"]
