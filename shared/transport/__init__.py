"""The transport seam: what the gateway and the worker program against instead of the segment.

``base`` holds the Protocols (a frontend's link, a worker's link, the node's statistics);
``posix`` implements them over one instance's shared segment, semaphores and message queues
(the production data path, unchanged); ``memory`` implements the frontend's side in one
process with plain queues, for unit tests of the request life cycle without ``shmgate serve``.
Nothing outside shared/ indexes a segment record or builds a lock, queue, partition, cache
index or heartbeat: it asks its link.
"""

from typing import TYPE_CHECKING

from shmgate.shared.transport.base import (
    FrontendLink,
    MessageQueue,
    NodeStats,
    ReplyHandler,
    Role,
    SupervisorLink,
    WorkerLink,
    WorkerTotals,
)

if TYPE_CHECKING:
    from shmgate.shared.transport.posix import (
        PosixFrontendLink,
        PosixNodeStats,
        PosixSupervisorLink,
        PosixWorkerLink,
    )

__all__ = [
    "FrontendLink",
    "MessageQueue",
    "NodeStats",
    "PosixFrontendLink",
    "PosixNodeStats",
    "PosixSupervisorLink",
    "PosixWorkerLink",
    "ReplyHandler",
    "Role",
    "SupervisorLink",
    "WorkerLink",
    "WorkerTotals",
]

_POSIX_LINKS = frozenset({"PosixFrontendLink", "PosixNodeStats", "PosixSupervisorLink", "PosixWorkerLink"})


def __getattr__(name: str) -> object:
    """The POSIX links load on first use, so a module that imports only the Protocols (from
    ``shared.transport.base``, which runs this package first) never loads the shared-memory layer."""
    if name in _POSIX_LINKS:
        from shmgate.shared.transport import posix

        return getattr(posix, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
