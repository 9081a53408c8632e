"""chorus: supervised collectives for PyTorch.

``import chorus.torch`` registers the ``"chorus"`` backend of
``torch.distributed`` (CPU tensors): ``dist.init_process_group("chorus")``.
The exceptions below are ``torch.distributed.DistBackendError``\\ s.
"""

import socket

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
    "free_port",
]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a launcher's ``--master-port``
    (as torch's ``get_free_port``); another process may take it before it
    is used."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
