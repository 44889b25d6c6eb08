"""How deep each POSIX message queue may be within the message-queue memory a process actually has.

Why this exists: every POSIX message queue is charged, when it is created, to its
creator's uid against ``RLIMIT_MSGQUEUE`` (``ulimit -q``; 819,200 bytes by default),
for its whole capacity, whether or not messages are ever sent. Docker cannot raise
that limit where the engine lacks CAP_SYS_RESOURCE (rootless Docker, many CI
sandboxes: "error setting rlimit type 12: operation not permitted"), and Kubernetes
has no per-pod knob for it at all. So the gateway asks for deep queues, and when the
limit does not allow them it lowers their depth to what fits (and logs what it
chose) instead of failing; only when even the minimum depth does not fit does it stop,
with an error that names the fixes.

``plan_queue_depths`` is a pure function of the budget and the queues wanted, so it
is unit-testable and reusable wherever a budget is known some other way (for
instance a per-uid budget shared by several pods of one Kubernetes node).

Kernel accounting (ipc/mqueue.c, ``mqueue_get_inode``): a queue of ``depth``
messages of ``size`` bytes costs ``depth * (size + sizeof(struct msg_msg))`` plus
one ``struct posix_msg_tree_node`` per message (up to 32,768): 48 + 48 bytes of
overhead per message on 64-bit Linux.
"""

from __future__ import annotations

import resource
from collections.abc import Sequence
from dataclasses import dataclass

from shmgate.shared.errors import SetupError

__all__ = [
    "MessageQueueBudgetError",
    "QueuePlan",
    "QueueSpec",
    "message_queue_budget",
    "plan_queue_depths",
    "queue_bytes",
]

# sizeof(struct msg_msg) + sizeof(struct posix_msg_tree_node) on 64-bit Linux.
KERNEL_BYTES_PER_MESSAGE = 96
UNLIMITED = 1 << 62


class MessageQueueBudgetError(SetupError):
    """Even the smallest useful queues do not fit in the message-queue memory this uid may use."""


@dataclass(frozen=True)
class QueueSpec:
    """``count`` queues of one role, each wanting ``wanted_depth`` messages of ``message_bytes``."""

    role: str  # names the queues in the log line and the error: "request", "reply", "control"
    count: int
    message_bytes: int
    wanted_depth: int
    min_depth: int = 1

    def bytes_at(self, depth: int) -> int:
        return self.count * queue_bytes(depth, self.message_bytes)


@dataclass(frozen=True)
class QueuePlan:
    """The depth chosen for each role, what the queues cost, and against which budget."""

    depths: dict[str, int]
    total_bytes: int
    budget_bytes: int
    lowered: bool  # some depth is below what was wanted (after the system's msg_max cap)

    def describe(self, specs: Sequence[QueueSpec]) -> str:
        """One log line: each role's count, depth and message size, the total and the budget."""
        parts = [f"{s.count} {s.role} x {self.depths[s.role]} msgs of {s.message_bytes} B" for s in specs]
        budget = "unlimited" if self.budget_bytes >= UNLIMITED else f"{self.budget_bytes:,} B"
        text = f"message queues: {', '.join(parts)}: {self.total_bytes:,} B of RLIMIT_MSGQUEUE {budget}"
        if self.lowered:
            text += " (depths lowered to fit; raise `ulimit -q` for deeper queues, see docs/DEPLOY.md)"
        return text


def queue_bytes(depth: int, message_bytes: int) -> int:
    """What the kernel charges against RLIMIT_MSGQUEUE for one queue of this shape."""
    return depth * (message_bytes + KERNEL_BYTES_PER_MESSAGE)


def plan_queue_depths(
    budget_bytes: int, specs: Sequence[QueueSpec], *, system_max_depth: int | None = None
) -> QueuePlan:
    """Choose one depth per role so that all queues together fit in ``budget_bytes``.

    Each role gets ``min(wanted_depth, system_max_depth, cap)`` (never below its
    ``min_depth``) for the largest common ``cap`` that fits: deep queues are lowered
    first, shallow ones (control) only once the others are down to their size.
    ``system_max_depth`` is ``fs.mqueue.msg_max`` (an unprivileged creator cannot exceed it).
    Raises MessageQueueBudgetError, naming the fixes, when even every ``min_depth`` does not fit.
    """

    def depth(spec: QueueSpec, cap: int) -> int:
        wanted = spec.wanted_depth if system_max_depth is None else min(spec.wanted_depth, system_max_depth)
        return max(spec.min_depth, min(wanted, cap))

    def total(cap: int) -> int:
        return sum(spec.bytes_at(depth(spec, cap)) for spec in specs)

    full = max((spec.wanted_depth for spec in specs), default=1)
    if total(0) > budget_bytes:
        raise MessageQueueBudgetError(_too_small(budget_bytes, specs, total(0)))
    lo, hi = 0, full  # total(lo) fits; find the largest cap that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if total(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    depths = {spec.role: depth(spec, lo) for spec in specs}
    lowered = any(depths[spec.role] < depth(spec, full) for spec in specs)
    return QueuePlan(depths, total(lo), budget_bytes, lowered)


def _too_small(budget_bytes: int, specs: Sequence[QueueSpec], needed: int) -> str:
    parts = ", ".join(f"{s.count} {s.role} x {s.min_depth} x {s.message_bytes} B" for s in specs)
    return (
        f"the POSIX message queues need at least {needed:,} bytes ({parts}), but this uid may use only "
        f"{budget_bytes:,} bytes of message-queue memory (RLIMIT_MSGQUEUE, `ulimit -q`, less what its other "
        "queues already take). Raise the limit (`ulimit -q`; docker: --ulimit msgqueue=N or compose "
        "`ulimits: msgqueue:`, which needs an engine allowed to raise it), use fewer frontends (--frontends) "
        "or fewer worker slots (--max-workers), or stop other shmgate instances of this user"
    )


def message_queue_budget() -> int:
    """The RLIMIT_MSGQUEUE this process has, after raising its soft limit to the hard one (always allowed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MSGQUEUE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_MSGQUEUE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return UNLIMITED if soft == resource.RLIM_INFINITY else int(soft)
