"""The frontend's side of the seam in one process: plain queues, no shared memory, no semaphores.

For unit tests of the request life cycle (retry, cancel, timeout, worker death) without
``shmgate serve`` (tests/test_reply_routing.py). ``MemoryNode`` stands for an instance: the
request queue, the worker table and each frontend's reply queue. A test plays the workers
with ``MemoryNode.take`` / ``reply`` / ``kill_worker``; the frontend under test gets a
``MemoryFrontendLink``. Replies may be sent from any thread: they are queued and delivered on
the frontend's event loop, as the POSIX reader does.

What it does not model: the arena's bytes (``MemoryCache`` hands out process-local arrays and
refs with made-up offsets) and the worker's side (the worker's tests use a real instance).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shared.cache import AllocateFn, CacheStats, TensorGroup
from shared.errors import ChannelFull
from shared.segment import BATCH_BUCKETS, STATS_WORDS, InstanceState, SlotState
from shared.transport.base import FrontendLink, NodeStats, ReplyHandler, WorkerTotals
from shared.wire import DTYPE_ITEMSIZE, Cancel, Submit, TensorRef

__all__ = ["MemoryCache", "MemoryFrontendLink", "MemoryNode", "MemoryNodeStats"]


@dataclass
class _WorkerRow:
    model: str
    epoch: int
    alive: bool = True


class MemoryNode:
    """One in-process "instance": a bounded FIFO request queue, worker rows, reply queues."""

    def __init__(self, *, queue_depth: int = 64) -> None:
        self.queue_depth = queue_depth
        self.requests: collections.deque[Submit] = collections.deque()
        self.workers: list[_WorkerRow] = []
        self.cancels: list[tuple[int, Cancel]] = []  # (worker slot, cancel), in sending order
        self.state = InstanceState.RUNNING
        self.links: dict[int, MemoryFrontendLink] = {}
        self.batches: list[int] = []
        self._lock = threading.Lock()

    # -- the test plays the workers ----------------------------------------------------

    def add_worker(self, model: str) -> tuple[int, int]:
        """A READY worker for ``model``; returns (slot, epoch)."""
        self.workers.append(_WorkerRow(model, epoch=1))
        return len(self.workers) - 1, 1

    def kill_worker(self, slot: int) -> None:
        self.workers[slot].alive = False

    def take(self) -> Submit | None:
        """Take the oldest descriptor off the request queue, as a worker would (None when empty)."""
        with self._lock:
            return self.requests.popleft() if self.requests else None

    def reply(self, message: object, frontend_slot: int = 0) -> None:
        """Send a reply to a frontend (any thread)."""
        self.links[frontend_slot].deliver(message)


class MemoryCache:
    """A content cache in process memory with ContentCache's accounting (holds, hits, misses)."""

    def __init__(self, size: int = 1 << 30) -> None:
        self.stats = CacheStats()
        self._size = size
        self._groups: dict[bytes, TensorGroup] = {}
        self._arrays: dict[int, list[np.ndarray]] = {}
        self._used = 0
        self._held = 0
        self._next_offset = 4096
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
                    self._used -= _nbytes(group)
                    self._arrays.pop(id(group), None)

    def _hold(self, group: TensorGroup) -> None:
        if group.holds == 0:
            self._held += _nbytes(group)
        group.holds += 1

    def _make(self, key: bytes | None, make: Callable[[AllocateFn], None]) -> TensorGroup:
        group = TensorGroup(key)
        arrays: list[np.ndarray] = []

        def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPE_ITEMSIZE[dtype]
            with self._lock:
                offset = self._next_offset
                self._next_offset += max(nbytes, 1)
            group.refs.append(TensorRef(offset, nbytes, 1, dtype, tuple(shape), name))
            out = np.zeros(shape, dtype=dtype)
            arrays.append(out)
            return out

        make(allocate)
        with self._lock:
            self._arrays[id(group)] = arrays
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
        self.cache = MemoryCache()
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
        return any(w.alive and w.model == model for w in self.node.workers)

    def worker_alive(self, slot: int, epoch: int) -> bool:
        if slot >= len(self.node.workers):
            return False
        row = self.node.workers[slot]
        return row.alive and row.epoch == epoch

    async def send_request(self, submit: Submit, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            with self.node._lock:
                if len(self.node.requests) < self.node.queue_depth:
                    self.node.requests.append(submit)
                    return
            if loop.time() >= deadline:
                raise ChannelFull("the channel stayed full; its receivers are saturated")
            await asyncio.sleep(0.005)

    def queue_depth(self) -> int:
        return len(self.node.requests)

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

    def batch_histogram(self) -> np.ndarray:
        return np.zeros(len(BATCH_BUCKETS) + 1, dtype="<u8")

    def preparing_requests(self) -> int:
        return sum(link.preparing for link in self.node.links.values())


if TYPE_CHECKING:  # mypy checks that each implementation satisfies its Protocol
    _frontend_link: type[FrontendLink] = MemoryFrontendLink
    _node_stats: type[NodeStats] = MemoryNodeStats
