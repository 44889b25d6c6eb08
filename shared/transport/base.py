"""The Protocols of the transport seam (who implements them: shared/transport/posix.py, memory.py).

Two sides, each one object per process, in the spirit of vLLM's EngineCoreClient (an
in-process and a multiprocess client behind one interface), kept small:

- ``FrontendLink``: a frontend's view. Claim its slot (heartbeat, cache purge), the content
  cache of its partition, its statistics row, submitting requests, receiving replies, sending
  cancels, liveness of the workers it waits on, its own progress stamp and slot state.
- ``WorkerLink``: a worker's view. Claim a slot, heartbeat, progress, slot state, the
  request queue it batches from, cancels, replies to frontends, batch statistics.
- ``NodeStats``: the read side for /metrics (any frontend reports the whole node).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple, Protocol

import numpy as np

from shmgate.shared.vocabulary import AllocateFn, CacheStats, InstanceState, SlotState, TensorGroup
from shmgate.shared.wire import Cancel, Submit, TensorRef

# Request queue priorities (POSIX message queues deliver the highest first): batch lines (the bulk
# lane) wait behind every interactive request of their model.
INTERACTIVE = 1
BULK = 0

__all__ = [
    "BULK",
    "INTERACTIVE",
    "FrontendLink",
    "MessageQueue",
    "NodeStats",
    "ReplyHandler",
    "Role",
    "SupervisorLink",
    "TensorCache",
    "WorkerLink",
    "WorkerTotals",
]

Role = Literal["frontend", "worker"]

ReplyHandler = Callable[[Any], None]


class MessageQueue(Protocol):
    """A bounded FIFO of messages, pollable through ``fd`` (shared/channels.py Queue in production)."""

    @property
    def fd(self) -> int: ...

    def current_messages(self) -> int: ...

    def try_send(self, message: Any) -> bool: ...

    def send(self, message: Any, timeout_s: float) -> None: ...

    def try_receive(self) -> Any | None: ...

    def receive(self, timeout_s: float) -> Any | None: ...

    def close(self) -> None: ...


class TensorCache(Protocol):
    """The content cache a frontend resolves images through (shared/cache.py ContentCache in production)."""

    stats: CacheStats

    @property
    def size(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def held_bytes(self) -> int: ...

    def acquire(self, key: bytes, make: Callable[[AllocateFn], None]) -> tuple[TensorGroup, str]: ...

    def try_hit(self, key: bytes) -> TensorGroup | None: ...

    def acquire_private(self, make: Callable[[AllocateFn], None]) -> TensorGroup: ...

    def release(self, group: TensorGroup) -> None: ...

    def footprint(self, group: TensorGroup) -> int:
        """Bytes of ``size`` that ``group`` takes (what a request's images add up to against it)."""
        ...

    def clear(self) -> None:
        """Evict every group no request holds (a request placed again from an emptied partition)."""
        ...


class FrontendLink(Protocol):
    """One frontend process's side of the seam. ``slot`` is given; ``epoch`` is known after ``take_over``."""

    slot: int
    epoch: int

    def take_over(self) -> int:
        """Claim the slot (new epoch), start the heartbeat, purge a predecessor's cache entries.

        May wait on a semaphore: call it from a thread, never from the event loop. Returns the epoch.
        """

    def content_cache(self) -> TensorCache:
        """The content cache over this frontend's partition (after ``take_over``)."""

    def stats_row(self) -> np.ndarray:
        """This frontend's u64 counter row (gateway/metrics.py FrontendStats writes it)."""

    def mark(self, state: SlotState) -> None:
        """Set this frontend's slot state (READY once serving, DRAINING at stop)."""

    def release(self) -> None:
        """Stop the heartbeat and free the slot if it is still ours."""

    def stamp_progress(self) -> None:
        """The event loop turned (called on the loop itself)."""

    def set_preparing(self, count: int) -> None:
        """Publish how many admitted requests are still decoding (workers wait for them)."""

    def instance_running(self) -> bool:
        """False once the instance drains or stops."""

    def has_live_worker(self, model: str) -> bool:
        """Is some worker READY, beating and progressing for ``model``?"""

    def live_workers(self, model: str) -> int:
        """How many workers are READY, beating and progressing for ``model`` (for /metrics)."""

    def worker_alive(self, slot: int, epoch: int) -> bool:
        """Is worker ``slot`` still the process of ``epoch``, and alive?"""

    async def send_request(self, submit: Submit, timeout_s: float, priority: int = INTERACTIVE) -> None:
        """Put a descriptor on the shared request queue; raises ChannelFull after ``timeout_s``. Workers take
        the highest ``priority`` waiting first: ``BULK`` descriptors wait behind every ``INTERACTIVE`` one."""

    def queue_depth(self) -> int:
        """Descriptors waiting on the request queue."""

    def start_replies(self, on_message: ReplyHandler, on_error: Callable[[BaseException], None]) -> None:
        """Drop replies addressed to a predecessor, then deliver ours to ``on_message`` on the running loop."""

    def drain_replies(self) -> None:
        """Deliver what is queued now (the watchdog calls it before any verdict)."""

    def stop_replies(self) -> None: ...

    def send_cancel(self, worker_slot: int, cancel: Cancel) -> None:
        """Best effort: a full control queue means a busy worker; an unknown slot is ignored."""


class WorkerLink(Protocol):
    """One worker process's side of the seam."""

    slot: int
    epoch: int
    mm: Any  # the mapped segment (the device copier reads tensors from it)

    def claim(self, model: str) -> tuple[int, int]:
        """Claim a free or dead worker slot; returns (slot, epoch). Raises SetupError."""

    def start_heartbeat(self, on_declared_dead: Callable[[], None]) -> None: ...

    def stop_heartbeat(self) -> None: ...

    def heartbeat_lapse_ns(self) -> int:
        """When the latest gap of our heartbeat began, one long enough for frontends to judge us dead (0: none):
        what we had claimed up to ``DEAD_AFTER_S`` into it was retried or failed by them (shared/segment.py
        Heartbeat)."""

    def progress_stamper(self) -> Callable[[int], None]:
        """A cheap callable storing a progress stamp (ns) in our slot row."""

    def step_bound_stamper(self) -> Callable[[int], None]:
        """A cheap callable storing our stall bound (ns, 0: none) in our slot row (worker/health.py StepClock)."""

    def report_caches(self, words: Sequence[int]) -> None:
        """Our caches' gauges and eviction counts, WORKER_CACHE_WORDS per WORKER_CACHES entry (shared/stats_layout.py)."""

    def set_model(self, model_id: str) -> None: ...

    def mark(self, state: SlotState) -> None: ...

    def release(self) -> None:
        """Free the slot if it is still ours."""

    def still_ours(self) -> bool:
        """Our epoch still owns the slot (nobody took it over)."""

    def declared_dead(self) -> bool:
        """Taken over or marked DEAD by the supervisor."""

    def instance_state(self) -> int: ...

    def instance_alive(self) -> bool: ...

    def preparing_requests(self) -> int: ...

    def interactive_in_flight(self) -> int:
        """Interactive requests the node's frontends have in hand: while any, bulk-lane work waits for them."""

    def request_queue(self) -> MessageQueue:
        """The shared request queue, for the worker's batcher."""

    def put_back(self, submit: Submit, timeout_s: float) -> None:
        """Return a request to the queue for another worker; raises ChannelFull."""

    def try_receive_control(self) -> Any | None: ...

    def n_frontends(self) -> int: ...

    def send_reply(self, frontend_slot: int, message: object, timeout_s: float) -> None:
        """Send to a frontend's reply queue (opened once per slot); raises ChannelFull."""

    def frontend_alive(self, frontend_slot: int) -> bool: ...

    def validate(self, ref: TensorRef) -> None: ...

    def recheck(self, ref: TensorRef) -> None: ...

    def count_batch(self, n_requests: int, busy_ns: int) -> None:
        """Add one batch to this worker's counters (busy time, batch-size histogram)."""

    def report_engine(self, gauges: Sequence[int], added: Sequence[int]) -> None:
        """A generation engine's state: set its gauges and add to its counters (shared/segment.py ENGINE_FIELDS
        order: the first ENGINE_GAUGES words, then the counters' increments since the last report)."""

    def close(self) -> None: ...


class WorkerTotals(NamedTuple):
    """The worker table summed over slots (counters: they never go backwards)."""

    starts: int  # epochs: worker (re)starts
    stalls: int  # workers declared stalled and replaced
    frontend_stalls: int  # frontends whose loop stopped turning
    busy_ns: int
    batches: int
    batched_requests: int


class NodeStats(Protocol):
    """What /metrics reads: the frontends' summed counters and the worker table's totals."""

    def frontend_totals(self) -> np.ndarray: ...

    def live_workers(self) -> int: ...

    def worker_totals(self) -> WorkerTotals: ...

    def engine_totals(self) -> dict[str, int]:
        """The generation engines' words (shared/segment.py ENGINE_FIELDS) summed over worker rows."""

    def worker_caches(self) -> dict[str, dict[str, int]]:
        """The workers' caches (shared/stats_layout.py WORKER_CACHES: their WORKER_CACHE_FIELDS) summed over
        worker rows."""

    def batch_histogram(self) -> np.ndarray: ...

    def preparing_requests(self) -> int: ...

    def engine_by_worker(self) -> list[tuple[int, str, dict[str, int]]]:
        """(slot, model, ENGINE_FIELDS words) of every worker slot that was ever claimed."""

    def interactive_in_flight(self) -> int:
        """Interactive requests the node's frontends have in hand (the batch runner yields to them)."""


class SupervisorLink(Protocol):
    """The supervisor's side: the instance's heartbeat and state, and its children's slots."""

    def beat(self) -> None: ...

    def mark_instance(self, state: InstanceState) -> None: ...

    def stall_timeout_s(self) -> float:
        """0.0 when stall detection is off."""

    def frontend_alive(self, slot: int) -> bool: ...

    def has_live_worker(self, model: str) -> bool:
        """A worker serving ``model`` is READY, heartbeating and progressing: what /ready checks."""

    def slot_of(self, role: Role, pid: int, frontend_slot: int) -> int | None:
        """The slot the child ``pid`` claimed (a frontend claims ``frontend_slot``; a worker a free one)."""

    def slot_state(self, role: Role, slot: int) -> int:
        """The ``SlotState`` in that row (READY once the child has started serving)."""

    def stalled(self, role: Role, slot: int) -> bool: ...

    def stall_bound_s(self, role: Role, slot: int) -> tuple[float, bool]:
        """How long that row may go without progress now, and whether that is a stepping worker's own bound
        from its recent step times (else the stall timeout)."""

    def count_stall(self, role: Role, slot: int) -> None: ...

    def stalled_foreign_workers(self, our_pids: set[int]) -> list[tuple[int, int]]:
        """(slot, pid) of stalled workers this supervisor did not start (another container or tree)."""

    def mark_dead(self, role: Role, slot: int) -> None: ...

    def mark_dead_by_pid(self, role: Role, pid: int) -> None:
        """Mark DEAD every row of ``role`` that ``pid`` (in our PID namespace) holds."""

    def repair_locks(self) -> int:
        """Repair the shared locks a dead holder left taken; returns how many were."""

    def frontend_busy(self, slot: int) -> bool:
        """Has frontend ``slot`` requests in flight or still decoding?"""
