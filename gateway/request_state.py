"""One request's life in a frontend, as one state with explicit transitions.

It replaces five booleans (claimed, released, produced_output, abandoned, done) whose
combinations were implicit. The legal moves are listed once, in ``_NEXT``; any other
raises ``IllegalTransition`` (a bug in the reply routing, never a client's doing).

    QUEUED     descriptor sent (or being sent); no worker has claimed it
    CLAIMED    a worker took it (Claimed): we know whom to watch
    RELEASED   that worker copied the tensors out (Released)
    STREAMING  output reached the client's event queue (Delta/Vector): no retry any more
    ABANDONED  the client went away: a Cancel goes out; holds stay until the worker's end
    DONE       Finished/Failed delivered (or failed here); holds released

A retry (the worker died before any output) moves CLAIMED/RELEASED/QUEUED back to QUEUED.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shmgate.gateway.stages import RequestTiming
from shmgate.shared.vocabulary import TensorGroup
from shmgate.shared.wire import Delta, Failed, Finished, Submit, TokenLogprobs, Vector

if TYPE_CHECKING:
    from shmgate.gateway.request_spans import RequestTrace

__all__ = ["IllegalTransition", "Phase", "RequestState"]


class Phase(enum.Enum):
    QUEUED = "queued"
    CLAIMED = "claimed"
    RELEASED = "released"
    STREAMING = "streaming"
    ABANDONED = "abandoned"
    DONE = "done"


_NEXT: dict[Phase, frozenset[Phase]] = {
    # QUEUED -> STREAMING: output whose Claimed was lost (a worker drops a reply after its channel
    # stayed full for seconds) is still the request's answer, as it always was.
    Phase.QUEUED: frozenset({Phase.QUEUED, Phase.CLAIMED, Phase.STREAMING, Phase.ABANDONED, Phase.DONE}),
    Phase.CLAIMED: frozenset({Phase.QUEUED, Phase.RELEASED, Phase.STREAMING, Phase.ABANDONED, Phase.DONE}),
    Phase.RELEASED: frozenset({Phase.QUEUED, Phase.STREAMING, Phase.ABANDONED, Phase.DONE}),
    Phase.STREAMING: frozenset({Phase.STREAMING, Phase.ABANDONED, Phase.DONE}),
    Phase.ABANDONED: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A move the request life cycle does not allow (e.g. DONE -> STREAMING)."""


@dataclass(eq=False)
class RequestState:
    request_id: int
    submit: Submit
    groups: list[TensorGroup]
    started: float
    events: asyncio.Queue[Delta | Vector | TokenLogprobs | Finished | Failed] = field(default_factory=asyncio.Queue)
    timing: RequestTiming = field(default_factory=RequestTiming)  # per-stage latency (gateway/stages.py)
    worker: tuple[int, int] | None = None  # (slot, epoch) of the claiming worker; kept when ABANDONED
    phase: Phase = Phase.QUEUED
    send_seq: int = 0  # this frontend's count of sends when its descriptor went onto the queue (0: not yet)
    ahead_seq: int = 0  # our interactive sends already on the queue when this one's send began: FIFO put them ahead
    ahead_bulk_seq: int = 0  # the same for our bulk sends (a bulk descriptor is behind both lanes')
    taken_at: float | None = None  # when we learned it left the queue while still unclaimed (monotonic)
    cancel_sent_at: float = 0.0  # when a Cancel last went to its worker (monotonic; 0: never)
    trace: RequestTrace | None = None  # its attempts' spans (gateway/request_spans.py); None: tracing off

    def to(self, phase: Phase) -> None:
        """Move to ``phase``; raises IllegalTransition when the life cycle does not allow it."""
        if phase not in _NEXT[self.phase]:
            raise IllegalTransition(f"request {self.request_id:x}: {self.phase.value} -> {phase.value}")
        self.phase = phase

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    @property
    def abandoned(self) -> bool:
        return self.phase is Phase.ABANDONED

    @property
    def retryable(self) -> bool:
        """No output reached the client and the client is still there: a dead worker's request may go again."""
        return self.phase in (Phase.QUEUED, Phase.CLAIMED, Phase.RELEASED)
