"""chorus: supervised collectives for PyTorch.

``import chorus.torch`` registers the ``"chorus"`` backend of
``torch.distributed`` (CPU tensors): ``dist.init_process_group("chorus")``.
The exceptions below are ``torch.distributed.DistBackendError``\\ s.
"""

from chorus._chorus import __version__
from chorus._errors import (
    ChorusError,
    CollectiveTimeout,
    DesyncError,
    GroupAborted,
    InvalidArgument,
    JobFinished,
    WaitTimeout,
)

__all__ = [
    "ChorusError",
    "CollectiveTimeout",
    "DesyncError",
    "GroupAborted",
    "InvalidArgument",
    "JobFinished",
    "WaitTimeout",
    "__version__",
]
