"""The exceptions chorus raises.

Every one is a ``torch.distributed.DistBackendError`` when torch is
installed (a ``RuntimeError`` otherwise), so code that catches torch's
errors catches chorus's too. ``ranks`` lists the ranks taken for failed
(dead, frozen, cut off) or waited for, when known.
"""

try:  # torch is optional for `import chorus`; the backend needs it.
    from torch.distributed import DistBackendError as _Base
except ImportError:  # pragma: no cover - exercised only without torch
    _Base = RuntimeError


class ChorusError(_Base):
    """An operation of the chorus backend failed."""

    ranks: "list[int]" = []


class GroupAborted(ChorusError):
    """The group aborted: a rank died, froze or was cut off (named in
    ``ranks`` and the message), or an operation broke it. Every pending and
    later operation of the group raises it; form a new group to go on."""


class DesyncError(ChorusError):
    """Ranks called different collectives (or the same one with other
    arguments); the message shows both signatures."""


class CollectiveTimeout(ChorusError):
    """An operation ran past its deadline; ``ranks`` are those whose data
    never came."""


class WaitTimeout(ChorusError):
    """``Work.wait(timeout)`` returned before the operation finished; the
    operation goes on under its own deadline."""


class InvalidArgument(ChorusError, ValueError):
    """The call's arguments are wrong: tensor sizes that disagree across
    ranks or with the collective, a root outside the group, an operator the
    dtype has not."""


class JobFinished(ChorusError):
    """The elastic job finished (its members left on purpose) before this
    process could join it: a relaunched worker that came too late."""
