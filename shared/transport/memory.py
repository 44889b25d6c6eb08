"""The seam in one process: threads and queues, an anonymous mapping for the arena, no semaphores.

For unit tests of the request life cycle (retry, cancel, timeout, worker death) without
``shmgate serve`` (tests/test_reply_routing.py). ``MemoryNode`` stands for an instance: the
arena, the request queue, the worker table, each frontend's reply queue and each worker's
control queue. A frontend gets a ``MemoryFrontendLink``; a worker either is a real
``worker.main.Worker`` on a ``MemoryWorkerLink`` (in a thread), or the test plays it with
``MemoryNode.take`` / ``reply`` / ``kill_worker``. Replies may be sent from any thread: they are
queued and delivered on the frontend's event loop, as the POSIX reader does.
``MemorySupervisorLink`` gives the supervisor rows the test sets as its children would.

What it does not model: other processes (liveness is a flag, not a pid and a heartbeat), the
arena's block headers and generations (``MemoryCache`` is a bump allocator; ``validate`` checks
bounds only), message encoding (objects pass as they are) and locks between frontends.
"""

from __future__ import annotations

import asyncio
import collections
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shmgate.shared.errors import ChannelFull, DescriptorError, SetupError
from shmgate.shared.stats_layout import (
    BATCH_BUCKETS,
    ENGINE_FIELDS,
    ENGINE_GAUGES,
    STATS_WORDS,
    WORKER_CACHE_FIELDS,
    WORKER_CACHE_WORDS,
    WORKER_CACHES,
    Counter,
)
from shmgate.shared.transport.base import (
    INTERACTIVE,
    FrontendLink,
    NodeStats,
    ReplyHandler,
    Role,
    SupervisorLink,
    WorkerLink,
    WorkerTotals,
)
from shmgate.shared.vocabulary import AllocateFn, CacheStats, InstanceState, SlotState, TensorGroup
from shmgate.shared.wire import DTYPE_ITEMSIZE, Cancel, Submit, TensorRef

__all__ = [
    "MemoryCache",
    "MemoryFrontendLink",
    "MemoryNode",
    "MemoryNodeStats",
    "MemoryQueue",
    "MemorySupervisorLink",
    "MemoryWorkerLink",
]


class MemoryQueue:
    """A bounded FIFO with the POSIX ``Queue``'s methods, pollable like it (``fd`` is an eventfd).

    The eventfd counts the messages (semaphore mode): readable exactly while one is queued, so
    the worker's batcher can ``select`` on it as on a message queue descriptor.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._items: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._fd = os.eventfd(0, os.EFD_SEMAPHORE | os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    @property
    def fd(self) -> int:
        return self._fd

    def current_messages(self) -> int:
        return len(self._items)

    def try_send(self, message: Any) -> bool:
        with self._cond:
            if len(self._items) >= self.depth:
                return False
            self._items.append(message)
            os.eventfd_write(self._fd, 1)
            self._cond.notify_all()
        return True

    def send(self, message: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._items) >= self.depth:
                if not self._cond.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    raise ChannelFull("a message channel stayed full; the receiver is not keeping up")
            self._items.append(message)
            os.eventfd_write(self._fd, 1)
            self._cond.notify_all()

    def try_receive(self) -> Any | None:
        with self._cond:
            if not self._items:
                return None
            os.eventfd_read(self._fd)
            self._cond.notify_all()
            return self._items.popleft()

    def receive(self, timeout_s: float) -> Any | None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._items:
                if not self._cond.wait(max(0.0, deadline - time.monotonic())) and time.monotonic() >= deadline:
                    return None
            os.eventfd_read(self._fd)
            self._cond.notify_all()
            return self._items.popleft()

    def close(self) -> None:
        """Descriptors live as long as the node (a worker closes its queues on exit; others still use them)."""


@dataclass
class _WorkerRow:
    model: str
    epoch: int
    alive: bool = True
    state: SlotState = SlotState.READY
    progress_ns: int = 0
    step_bound_ns: int = 0  # worker/health.py StepClock
    caches: tuple[int, ...] = ()  # WORKER_CACHES gauges (shared/stats_layout.py)


class MemoryNode:
    """One in-process "instance": an arena, a bounded FIFO request queue, worker rows, reply queues."""

    def __init__(self, *, queue_depth: int = 64, arena_size: int = 16 << 20) -> None:
        self.arena = mmap.mmap(-1, arena_size)
        self.requests = MemoryQueue(queue_depth)
        self.workers: list[_WorkerRow] = []
        self.control: list[MemoryQueue] = []
        self.cancels: list[tuple[int, Cancel]] = []  # (worker slot, cancel), in sending order
        self.state = InstanceState.RUNNING
        self.links: dict[int, MemoryFrontendLink] = {}
        self.batches: list[int] = []
        self.engine: dict[str, int] = dict.fromkeys(ENGINE_FIELDS, 0)  # what report_engine said (one engine)
        self._lock = threading.Lock()
        self._next_offset = 4096

    def allocate(self, nbytes: int) -> int:
        """Arena offset of ``nbytes`` fresh bytes (8-aligned; a bump allocator: tests are short)."""
        with self._lock:
            offset = self._next_offset
            end = offset + max(8, (nbytes + 7) // 8 * 8)
            if end > len(self.arena):
                raise SetupError("the in-memory arena is full; give MemoryNode a larger arena_size")
            self._next_offset = end
            return offset

    # -- the test plays the workers ----------------------------------------------------

    def add_worker(self, model: str, state: SlotState = SlotState.READY) -> tuple[int, int]:
        """A worker row for ``model``; returns (slot, epoch)."""
        with self._lock:
            self.workers.append(_WorkerRow(model, epoch=1, state=state))
            self.control.append(MemoryQueue(8))
            return len(self.workers) - 1, 1

    def kill_worker(self, slot: int) -> None:
        self.workers[slot].alive = False

    def take(self) -> Submit | None:
        """Take the oldest descriptor off the request queue, as a worker would (None when empty)."""
        message: Submit | None = self.requests.try_receive()
        return message

    def reply(self, message: object, frontend_slot: int = 0) -> None:
        """Send a reply to a frontend (any thread)."""
        self.links[frontend_slot].deliver(message)


class MemoryCache:
    """A content cache in process memory with ContentCache's accounting (holds, hits, misses)."""

    def __init__(self, node: MemoryNode) -> None:
        self.stats = CacheStats()
        self._node = node
        self._size = len(node.arena)
        self._groups: dict[bytes, TensorGroup] = {}
        self._used = 0
        self._held = 0
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self._size

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def held_bytes(self) -> int:
        return self._held

    def try_hit(self, key: bytes) -> TensorGroup | None:
        with self._lock:
            group = self._groups.get(key)
            if group is None:
                return None
            self._hold(group)
            self.stats.hits += 1
            return group

    def acquire(self, key: bytes, make: Callable[[AllocateFn], None]) -> tuple[TensorGroup, str]:
        group = self.try_hit(key)
        if group is not None:
            return group, "hit"
        group = self._make(key, make)
        with self._lock:
            self.stats.misses += 1
            self._groups[key] = group
            group.indexed = True
        return group, "miss"

    def acquire_private(self, make: Callable[[AllocateFn], None]) -> TensorGroup:
        return self._make(None, make)

    def release(self, group: TensorGroup) -> None:
        with self._lock:
            group.holds -= 1
            if group.holds == 0:
                self._held -= _nbytes(group)
                if not group.indexed:
                    self._used -= _nbytes(group)  # a private group is freed (its bytes are not reused)

    def clear(self) -> None:
        with self._lock:
            for key, group in list(self._groups.items()):
                if group.holds == 0:
                    del self._groups[key]
                    group.indexed = False
                    self._used -= _nbytes(group)

    def footprint(self, group: TensorGroup) -> int:
        return sum(max(8, (ref.nbytes + 7) // 8 * 8) for ref in group.refs)  # as MemoryNode.allocate rounds

    def _hold(self, group: TensorGroup) -> None:
        if group.holds == 0:
            self._held += _nbytes(group)
        group.holds += 1

    def _make(self, key: bytes | None, make: Callable[[AllocateFn], None]) -> TensorGroup:
        group = TensorGroup(key)

        def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPE_ITEMSIZE[dtype]
            offset = self._node.allocate(nbytes)
            group.refs.append(
                TensorRef(offset=offset, nbytes=nbytes, generation=1, dtype=dtype, shape=tuple(shape), name=name)
            )
            out: np.ndarray = np.frombuffer(self._node.arena, dtype, nbytes // DTYPE_ITEMSIZE[dtype], offset)
            return out.reshape(shape)

        make(allocate)
        with self._lock:
            self._used += _nbytes(group)
            self._hold(group)
        return group


def _nbytes(group: TensorGroup) -> int:
    return sum(ref.nbytes for ref in group.refs)


class MemoryFrontendLink:
    """FrontendLink over a MemoryNode (see shared/transport/base.py for each method's contract)."""

    def __init__(self, node: MemoryNode, slot: int = 0) -> None:
        self.node = node
        self.slot = slot
        self.epoch = 0
        self.state = SlotState.FREE
        self.preparing = 0
        self.progress_stamps = 0
        self.cache = MemoryCache(node)
        self.row = np.zeros(STATS_WORDS, dtype="<u8")
        self._inbox: collections.deque[object] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_message: ReplyHandler | None = None
        self._on_error: Callable[[BaseException], None] | None = None
        node.links[slot] = self

    def take_over(self) -> int:
        self.epoch += 1
        self.state = SlotState.STARTING
        return self.epoch

    def content_cache(self) -> MemoryCache:
        return self.cache

    def stats_row(self) -> np.ndarray:
        return self.row

    def mark(self, state: SlotState) -> None:
        self.state = state

    def release(self) -> None:
        self.state = SlotState.FREE

    def stamp_progress(self) -> None:
        self.progress_stamps += 1

    def set_preparing(self, count: int) -> None:
        self.preparing = count

    def instance_running(self) -> bool:
        return self.node.state == InstanceState.RUNNING

    def has_live_worker(self, model: str) -> bool:
        return self.live_workers(model) > 0

    def live_workers(self, model: str) -> int:
        return sum(1 for w in self.node.workers if w.alive and w.state == SlotState.READY and w.model == model)

    def worker_alive(self, slot: int, epoch: int) -> bool:
        if slot >= len(self.node.workers):
            return False
        row = self.node.workers[slot]
        return row.alive and row.epoch == epoch and row.state not in (SlotState.FREE, SlotState.DEAD)

    async def send_request(self, submit: Submit, timeout_s: float, priority: int = INTERACTIVE) -> None:
        # the in-memory twin keeps one FIFO: the lanes' order is the POSIX queues' (tests/test_bulk_lane.py)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if self.node.requests.try_send(submit):
                return
            if loop.time() >= deadline:
                raise ChannelFull("the channel stayed full; its receivers are saturated")
            await asyncio.sleep(0.005)

    def queue_depth(self) -> int:
        return self.node.requests.current_messages()

    def start_replies(self, on_message: ReplyHandler, on_error: Callable[[BaseException], None]) -> None:
        self._inbox.clear()  # answers addressed to a predecessor
        self._loop = asyncio.get_running_loop()
        self._on_message = on_message
        self._on_error = on_error

    def deliver(self, message: object) -> None:
        """Queue a reply and have the frontend's loop drain it (thread-safe)."""
        self._inbox.append(message)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.drain_replies)

    def drain_replies(self) -> None:
        while self._inbox and self._on_message is not None:
            message = self._inbox.popleft()
            try:
                self._on_message(message)
            except Exception as exc:
                if self._on_error is not None:
                    self._on_error(exc)

    def stop_replies(self) -> None:
        self._on_message = None
        self._loop = None

    def send_cancel(self, worker_slot: int, cancel: Cancel) -> None:
        if worker_slot < len(self.node.workers):
            self.node.cancels.append((worker_slot, cancel))
            self.node.control[worker_slot].try_send(cancel)


class MemoryWorkerLink:
    """WorkerLink over a MemoryNode: a real ``Worker`` runs on it in a thread of the test process."""

    def __init__(self, node: MemoryNode) -> None:
        self.node = node
        self.mm = node.arena
        self.slot = -1
        self.epoch = 0
        self._on_declared_dead: Callable[[], None] | None = None

    @property
    def row(self) -> _WorkerRow:
        return self.node.workers[self.slot]

    def claim(self, model: str) -> tuple[int, int]:
        self.slot, self.epoch = self.node.add_worker(model, SlotState.STARTING)
        return self.slot, self.epoch

    def start_heartbeat(self, on_declared_dead: Callable[[], None]) -> None:
        self._on_declared_dead = on_declared_dead  # nothing beats: liveness is the row's flag

    def stop_heartbeat(self) -> None:
        pass

    def heartbeat_lapse_ns(self) -> int:
        return 0  # nothing beats, so nothing lapses

    def step_bound_stamper(self) -> Callable[[int], None]:
        row = self.row

        def stamp(ns: int) -> None:
            row.step_bound_ns = ns

        return stamp

    def report_caches(self, words: Sequence[int]) -> None:
        old = self.row.caches or (0,) * len(words)
        step = WORKER_CACHE_WORDS  # gauges set, evictions (each cache's last word) added
        self.row.caches = tuple(w + o if i % step == step - 1 else w for i, (w, o) in enumerate(zip(words, old)))

    def progress_stamper(self) -> Callable[[int], None]:
        row = self.row

        def stamp(ns: int) -> None:
            row.progress_ns = ns

        return stamp

    def set_model(self, model_id: str) -> None:
        self.row.model = model_id

    def mark(self, state: SlotState) -> None:
        self.row.state = state

    def release(self) -> None:
        if self.still_ours():
            self.row.state = SlotState.FREE

    def still_ours(self) -> bool:
        return self.row.epoch == self.epoch

    def declared_dead(self) -> bool:
        return not self.still_ours() or self.row.state == SlotState.DEAD or not self.row.alive

    def instance_state(self) -> int:
        return int(self.node.state)

    def instance_alive(self) -> bool:
        return self.node.state != InstanceState.STOPPED

    def preparing_requests(self) -> int:
        return sum(link.preparing for link in self.node.links.values())

    def interactive_in_flight(self) -> int:
        return sum(int(link.row[Counter.INTERACTIVE_IN_FLIGHT]) for link in self.node.links.values())

    def request_queue(self) -> MemoryQueue:
        return self.node.requests

    def put_back(self, submit: Submit, timeout_s: float) -> None:
        self.node.requests.send(submit, timeout_s)

    def try_receive_control(self) -> Any | None:
        return self.node.control[self.slot].try_receive()

    def n_frontends(self) -> int:
        return max(self.node.links, default=-1) + 1

    def send_reply(self, frontend_slot: int, message: object, timeout_s: float) -> None:
        link = self.node.links.get(frontend_slot)
        if link is not None:
            link.deliver(message)

    def frontend_alive(self, frontend_slot: int) -> bool:
        return frontend_slot in self.node.links

    def validate(self, ref: TensorRef) -> None:
        if ref.offset < 4096 or ref.offset + ref.nbytes > len(self.node.arena):
            raise DescriptorError("a tensor descriptor points outside the arena")
        if (
            ref.dtype not in DTYPE_ITEMSIZE
            or int(np.prod(ref.shape, dtype=np.int64)) * DTYPE_ITEMSIZE[ref.dtype] != ref.nbytes
        ):
            raise DescriptorError("a tensor descriptor's dtype and shape disagree with its size")

    def recheck(self, ref: TensorRef) -> None:
        """Bytes are never reused here, so the allocation is always still the same."""

    def count_batch(self, n_requests: int, busy_ns: int) -> None:
        self.node.batches.append(n_requests)

    def report_engine(self, gauges: Sequence[int], added: Sequence[int]) -> None:
        engine = self.node.engine
        for name, value in zip(ENGINE_FIELDS, gauges):
            engine[name] = value
        for name, value in zip(ENGINE_FIELDS[ENGINE_GAUGES:], added):
            engine[name] += value

    def close(self) -> None:
        pass


class MemoryNodeStats:
    """NodeStats over a MemoryNode: what /metrics would read."""

    def __init__(self, node: MemoryNode) -> None:
        self.node = node

    def frontend_totals(self) -> np.ndarray:
        rows = [link.row for link in self.node.links.values()]
        total: np.ndarray = np.sum(rows, axis=0) if rows else np.zeros(STATS_WORDS, dtype="<u8")
        return total

    def live_workers(self) -> int:
        return sum(1 for w in self.node.workers if w.alive)

    def worker_totals(self) -> WorkerTotals:
        starts = sum(w.epoch for w in self.node.workers)
        return WorkerTotals(starts, 0, 0, 0, len(self.node.batches), sum(self.node.batches))

    def engine_totals(self) -> dict[str, int]:
        return dict(self.node.engine)

    def worker_caches(self) -> dict[str, dict[str, int]]:
        summed = [0] * (len(WORKER_CACHES) * WORKER_CACHE_WORDS)
        for row in self.node.workers:
            for i, value in enumerate(row.caches):
                summed[i] += value
        return {
            name: dict(zip(WORKER_CACHE_FIELDS, summed[index * WORKER_CACHE_WORDS : (index + 1) * WORKER_CACHE_WORDS]))
            for index, name in enumerate(WORKER_CACHES)
        }

    def engine_by_worker(self) -> list[tuple[int, str, dict[str, int]]]:
        return []  # one engine's words, summed in engine_totals: no per-worker rows here

    def batch_histogram(self) -> np.ndarray:
        return np.zeros(len(BATCH_BUCKETS) + 1, dtype="<u8")

    def preparing_requests(self) -> int:
        return sum(link.preparing for link in self.node.links.values())

    def interactive_in_flight(self) -> int:
        return sum(int(link.row[Counter.INTERACTIVE_IN_FLIGHT]) for link in self.node.links.values())


@dataclass
class MemorySlot:
    """One child's row as the supervisor sees it; the test plays the child and sets the fields."""

    pid: int
    state: SlotState = SlotState.STARTING
    beating: bool = True  # its heartbeat is fresh
    stalled: bool = False  # its progress stamp is older than the stall timeout
    busy: bool = False  # a frontend with requests in flight or decoding
    stalls: int = 0  # how often the supervisor counted it stalled


class MemorySupervisorLink:
    """SupervisorLink over plain rows, for unit tests of the supervisor's decisions
    (tests/test_supervisor_decisions.py) with real child processes and no shared memory.

    The test claims a row for a child (``claim``) and sets its state, heartbeat, stall and busy
    flags as the child would; the supervisor's marks (instance states, DEAD rows, stall counts)
    are recorded for the test to read. Worker rows are keyed by slot like frontend rows; a worker
    claims the slot the test gives it.
    """

    def __init__(self, *, stall_timeout_s: float = 0.0) -> None:
        self.rows: dict[Role, dict[int, MemorySlot]] = {"frontend": {}, "worker": {}}
        self.instance_states: list[InstanceState] = []
        self.beats = 0
        self.locks_left_taken = 0  # what the next repair_locks finds (a dead child held them)
        self._stall_timeout_s = stall_timeout_s

    def claim(self, role: Role, slot: int, pid: int, state: SlotState = SlotState.READY) -> MemorySlot:
        """The child ``pid`` takes ``slot`` (as its process would on start-up)."""
        row = self.rows[role][slot] = MemorySlot(pid, state)
        return row

    def beat(self) -> None:
        self.beats += 1

    def mark_instance(self, state: InstanceState) -> None:
        self.instance_states.append(state)

    def stall_timeout_s(self) -> float:
        return self._stall_timeout_s

    def frontend_alive(self, slot: int) -> bool:
        row = self.rows["frontend"].get(slot)
        return row is not None and row.beating and row.state != SlotState.DEAD

    def has_live_worker(self, model: str) -> bool:
        return any(r.state == SlotState.READY and r.beating and not r.stalled for r in self.rows["worker"].values())

    def slot_of(self, role: Role, pid: int, frontend_slot: int) -> int | None:
        if role == "frontend":
            row = self.rows["frontend"].get(frontend_slot)
            return frontend_slot if row is not None and row.pid == pid else None
        return next((slot for slot, row in self.rows["worker"].items() if row.pid == pid), None)

    def slot_state(self, role: Role, slot: int) -> int:
        return int(self.rows[role][slot].state)

    def stalled(self, role: Role, slot: int) -> bool:
        """As the segment judges it: only a READY row stalls (a DEAD one is already dealt with)."""
        row = self.rows[role][slot]
        return self._stall_timeout_s > 0 and row.state == SlotState.READY and row.stalled

    def stall_bound_s(self, role: Role, slot: int) -> tuple[float, bool]:
        return self._stall_timeout_s, False  # a row's stall is a flag the test sets

    def count_stall(self, role: Role, slot: int) -> None:
        self.rows[role][slot].stalls += 1

    def stalled_foreign_workers(self, our_pids: set[int]) -> list[tuple[int, int]]:
        return [
            (slot, row.pid)
            for slot, row in self.rows["worker"].items()
            if row.pid not in our_pids and self.stalled("worker", slot)
        ]

    def mark_dead(self, role: Role, slot: int) -> None:
        self.rows[role][slot].state = SlotState.DEAD

    def mark_dead_by_pid(self, role: Role, pid: int) -> None:
        for row in self.rows[role].values():
            if row.pid == pid:
                row.state = SlotState.DEAD

    def repair_locks(self) -> int:
        repaired, self.locks_left_taken = self.locks_left_taken, 0
        return repaired

    def frontend_busy(self, slot: int) -> bool:
        row = self.rows["frontend"].get(slot)
        return row is not None and row.busy


if TYPE_CHECKING:  # mypy checks that each implementation satisfies its Protocol
    _frontend_link: type[FrontendLink] = MemoryFrontendLink
    _node_stats: type[NodeStats] = MemoryNodeStats
    _worker_link: type[WorkerLink] = MemoryWorkerLink
    _supervisor_link: type[SupervisorLink] = MemorySupervisorLink
