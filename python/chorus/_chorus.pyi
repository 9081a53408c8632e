"""Type stubs of chorus's extension module (the Rust half of the package)."""

from typing import Any, Callable, Optional

__version__: str

class Work:
    """An operation in flight (or finished)."""

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the operation ends, at most `timeout` seconds (None:
        its own deadline), the GIL released; True, or raises its error, or
        chorus.WaitTimeout when `timeout` passes first."""
    @property
    def source(self) -> Optional[int]:
        """The rank a receive took its message from (None until it has,
        and for other operations)."""
    def is_completed(self) -> bool:
        """Whether the operation has ended (successfully or not)."""
    def is_success(self) -> bool:
        """Whether it ended successfully."""
    def exception(self) -> Optional[BaseException]:
        """The exception it failed with, or None (also while it runs)."""
    def add_done_callback(self, callback: Callable[[], Any]) -> None:
        """Calls `callback()` once the operation has ended: at once if it
        has, else from one of chorus's threads, holding the GIL."""

class Group:
    """One rank's chorus process group."""

    @staticmethod
    def init(
        store: Any,
        rank: int,
        world_size: int,
        timeout: float,
        collective_timeout: float,
        store_host: Optional[str] = None,
    ) -> "Group":
        """Forms this rank's group through `store` (a torch.distributed.Store):
        rendezvous, links (shared memory on a host, QUIC between hosts),
        supervision; blocks up to `timeout` seconds with the GIL released."""
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    def submit(
        self,
        kind: str,
        count: int,
        input: Optional[Any] = None,
        output: Optional[Any] = None,
        root: Optional[int] = None,
        op: Optional[str] = None,
        timeout: Optional[float] = None,
        tag: int = 0,
    ) -> Work:
        """Submits one collective over contiguous CPU tensors, lent in place;
        returns at once. `kind`: all_reduce, broadcast, reduce, all_gather,
        gather, scatter, reduce_scatter, all_to_all, barrier, send, recv;
        `count`: elements per rank; `op`: sum, avg, prod, min, max, band, bor,
        bxor. A send or receive pairs with the peer's of the same `tag`; a
        receive without `root` takes the first sender's message (its work's
        `source` names the sender)."""
    def destroy(self) -> None:
        """Leaves the group: a barrier over the links, then a shutdown peers
        see as a departure."""
    def is_alive(self) -> bool:
        """Whether the group is still formed (not destroyed)."""
