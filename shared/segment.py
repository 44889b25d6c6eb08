"""The shared-memory segment: its layout, creation, attachment and slot tables.

Layout (every region 64-byte aligned, data partitions 4 KiB aligned):

    0        header          magic, versions, sizes, label, supervisor heartbeat
    512      lock records    who holds each semaphore (one record per lock)
    1024     frontend slots  one row per frontend: epoch, pid, heartbeat, state, generation counter
    ...      worker slots    one row per worker: epoch, pid, heartbeat, state, model
    ...      stats           one row of u64 counters per frontend (metrics any frontend can sum)
    ...      cache index     open-addressing table (shared/cache_index.py)
    data     partitions      n_frontends equal partitions; frontend k is the only writer of partition k

Rules:
- The creator (the gateway's supervisor) writes the header once; everyone else
  checks magic and ``WIRE_VERSION`` on attach and refuses a mismatch.
- A slot row is written only by the process that claimed it (heartbeat, state)
  and by whoever claims it next; claims happen under the table lock.
- Liveness never relies on seeing another process's PID: a heartbeat timestamp
  (CLOCK_MONOTONIC, which every container on one kernel shares) decides. When the
  row's PID namespace is ours, ``kill(pid, 0)`` gives a faster answer.
"""

from __future__ import annotations

import enum
import mmap
import os
import threading
import time
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import posix_ipc

from shared.errors import SetupError
from shared.names import IPC_MODE, InstanceNames, check_shm_space
from shared.wire import WIRE_VERSION

__all__ = ["BATCH_BUCKETS", "Heartbeat", "Segment", "SlotState", "now_ns", "own_pidns"]

MAGIC = int.from_bytes(b"SHMGATE1", "little")
LAYOUT_VERSION = 2  # 2: slot rows carry ``preparing`` and the worker batch-size counters
ALIGN = 64
PAGE = 4096

HEADER = np.dtype(
    [
        ("magic", "<u8"),
        ("wire_version", "<u4"),
        ("layout_version", "<u4"),
        ("total_size", "<u8"),
        ("n_frontends", "<u8"),
        ("n_workers", "<u8"),
        ("index_capacity", "<u8"),
        ("index_offset", "<u8"),
        ("data_offset", "<u8"),
        ("partition_size", "<u8"),
        ("created_ns", "<u8"),
        ("supervisor_beat_ns", "<u8"),
        ("supervisor_pid", "<u8"),
        ("supervisor_pidns", "<u8"),
        ("state", "<u8"),  # InstanceState
        ("label", "S32"),
        ("instance_id", "S16"),
    ]
)

LOCK_RECORD = np.dtype(
    [
        ("kind", "<u8"),  # 0 = nobody recorded, else HolderKind
        ("slot", "<u8"),
        ("epoch", "<u8"),
        ("pid", "<u8"),
        ("acquired_ns", "<u8"),
        ("count", "<u8"),  # incremented by every acquirer: progress detector for repair
    ]
)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # upper bounds of the batch-size histogram

SLOT = np.dtype(
    [
        ("epoch", "<u8"),  # +1 at every claim; a message stamped with an older epoch is stale
        ("pid", "<u8"),
        ("pidns", "<u8"),  # inode of /proc/self/ns/pid of the claimant
        ("beat_ns", "<u8"),
        ("state", "<u8"),  # SlotState
        ("gen_counter", "<u8"),  # frontend rows: last generation handed out in this partition
        ("busy_ns", "<u8"),  # worker rows: total time spent running batches
        ("model", "S48"),  # worker rows: the model it serves
        ("preparing", "<u8"),  # frontend rows: admitted requests still decoding (a batch window waits for them)
        ("batches", "<u8"),  # worker rows, never reset: batches run ...
        ("batched_requests", "<u8"),  # ... and the requests in them
        ("batch_hist", "<u8", (len(BATCH_BUCKETS) + 1,)),  # batches of size <= BATCH_BUCKETS[i]; last: larger
    ]
)

N_LOCKS = 3  # index, repair, table
STATS_WORDS = 128  # u64 counters per frontend; each frontend writes only its own row


class SlotState(enum.IntEnum):
    FREE = 0  # never claimed, or released cleanly
    STARTING = 1  # claimed; loading (a worker loading its model)
    READY = 2  # serving
    DRAINING = 3  # finishing in-flight work, takes nothing new
    DEAD = 4  # marked dead by the supervisor (faster than waiting for the heartbeat to age)


class InstanceState(enum.IntEnum):
    RUNNING = 1
    DRAINING = 2  # new requests get 503; requests in flight finish
    STOPPED = 3
    DRAINED = 4  # still draining, and no request is in flight any more: workers following the drain exit


class LockId(enum.IntEnum):
    INDEX = 0
    REPAIR = 1
    TABLE = 2


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns: the clock of every heartbeat and deadline."""
    return time.monotonic_ns()


_pidns: tuple[int, int] = (-1, 0)  # (pid, inode): a process's PID namespace is fixed, but a fork may differ


def own_pidns() -> int:
    """Inode of our PID namespace; cached per pid, since liveness checks ask on every request."""
    global _pidns
    pid = os.getpid()
    if _pidns[0] != pid:
        try:
            inode = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            inode = 0
        _pidns = (pid, inode)
    return _pidns[1]


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to


@dataclass(frozen=True)
class Layout:
    """Where everything lies. Offsets are cached: readers consult them for every descriptor."""

    n_frontends: int
    n_workers: int
    index_capacity: int
    arena_size: int

    @cached_property
    def frontend_offset(self) -> int:
        return 1024

    @cached_property
    def worker_offset(self) -> int:
        return _align(self.frontend_offset + self.n_frontends * SLOT.itemsize, ALIGN)

    @cached_property
    def stats_offset(self) -> int:
        return _align(self.worker_offset + self.n_workers * SLOT.itemsize, ALIGN)

    @cached_property
    def index_offset(self) -> int:
        return _align(self.stats_offset + self.n_frontends * STATS_WORDS * 8, PAGE)

    @cached_property
    def data_offset(self) -> int:
        from shared.cache_index import ENTRY

        return _align(self.index_offset + self.index_capacity * ENTRY.itemsize, PAGE)

    @cached_property
    def partition_size(self) -> int:
        return (self.arena_size // self.n_frontends) // PAGE * PAGE

    @cached_property
    def total_size(self) -> int:
        return self.data_offset + self.partition_size * self.n_frontends


class Segment:
    """One mapped arena segment plus numpy views of its tables.

    ``create`` is for the instance owner (the gateway's supervisor); ``attach``
    for everyone else. ``close`` unmaps; ``unlink`` removes the name (owner).
    """

    def __init__(self, names: InstanceNames, shm: posix_ipc.SharedMemory, mm: mmap.mmap) -> None:
        self.names = names
        self._shm = shm
        self.mm = mm
        self.buf = memoryview(mm)
        self.header = np.frombuffer(mm, HEADER, 1, 0)
        h = self.header[0]
        if int(h["magic"]) != MAGIC:
            self.close()
            raise SetupError("the shared-memory segment is not a shmgate arena (bad magic)")
        if int(h["wire_version"]) != WIRE_VERSION or int(h["layout_version"]) != LAYOUT_VERSION:
            found = (int(h["wire_version"]), int(h["layout_version"]))
            self.close()
            raise SetupError(
                f"this shmgate speaks wire version {WIRE_VERSION}, but the running instance speaks "
                f"{found[0]}; run the same shmgate version in the gateway and the workers"
            )
        self.layout = Layout(
            n_frontends=int(h["n_frontends"]),
            n_workers=int(h["n_workers"]),
            index_capacity=int(h["index_capacity"]),
            arena_size=int(h["partition_size"]) * int(h["n_frontends"]),
        )
        self.locks = np.frombuffer(mm, LOCK_RECORD, N_LOCKS, 512)
        self.frontends = np.frombuffer(mm, SLOT, self.layout.n_frontends, self.layout.frontend_offset)
        self.workers = np.frombuffer(mm, SLOT, self.layout.n_workers, self.layout.worker_offset)
        self.stats = np.frombuffer(
            mm, "<u8", self.layout.n_frontends * STATS_WORDS, self.layout.stats_offset
        ).reshape(self.layout.n_frontends, STATS_WORDS)

    # -- life cycle -----------------------------------------------------------

    @classmethod
    def create(
        cls,
        names: InstanceNames,
        *,
        arena_size: int,
        n_frontends: int,
        n_workers: int,
        index_capacity: int = 4096,
        label: str = "default",
    ) -> Segment:
        """Create and initialise the segment (owner only). Raises SetupError."""
        if n_frontends < 1 or n_workers < 1:
            raise SetupError("an instance needs at least one frontend slot and one worker slot")
        if index_capacity & (index_capacity - 1):
            raise SetupError("index capacity must be a power of two")
        layout = Layout(n_frontends, n_workers, index_capacity, arena_size)
        if layout.partition_size < 1 << 20:
            raise SetupError(f"arena of {arena_size} bytes is too small for {n_frontends} frontends")
        check_shm_space(layout.total_size)
        try:
            shm = posix_ipc.SharedMemory(names.arena, posix_ipc.O_CREX, mode=IPC_MODE, size=layout.total_size)
        except posix_ipc.ExistentialError as exc:
            raise SetupError("an arena with this instance id exists already") from exc
        mm = mmap.mmap(shm.fd, layout.total_size)
        shm.close_fd()
        header = np.frombuffer(mm, HEADER, 1, 0)
        h = header[0]
        h["wire_version"] = WIRE_VERSION
        h["layout_version"] = LAYOUT_VERSION
        h["total_size"] = layout.total_size
        h["n_frontends"] = n_frontends
        h["n_workers"] = n_workers
        h["index_capacity"] = index_capacity
        h["index_offset"] = layout.index_offset
        h["data_offset"] = layout.data_offset
        h["partition_size"] = layout.partition_size
        h["created_ns"] = now_ns()
        h["supervisor_beat_ns"] = now_ns()
        h["supervisor_pid"] = os.getpid()
        h["supervisor_pidns"] = own_pidns()
        h["state"] = InstanceState.RUNNING
        h["label"] = label.encode()[:32]
        h["instance_id"] = names.instance_id.encode()
        h["magic"] = MAGIC  # last: a half-initialised segment never looks valid
        del h, header
        return cls(names, shm, mm)

    @classmethod
    def attach(cls, names: InstanceNames) -> Segment:
        """Map an existing segment. Raises SetupError when it is missing or incompatible."""
        try:
            shm = posix_ipc.SharedMemory(names.arena)
        except posix_ipc.ExistentialError as exc:
            raise SetupError("no running shmgate instance with that id") from exc
        mm = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        return cls(names, shm, mm)

    def close(self) -> None:
        """Unmap. Views handed out earlier must not be used afterwards."""
        for attr in ("header", "locks", "frontends", "workers", "stats", "buf"):
            self.__dict__.pop(attr, None)
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the last reference

    def unlink(self) -> None:
        try:
            posix_ipc.unlink_shared_memory(self.names.arena)
        except posix_ipc.ExistentialError:
            pass

    # -- geometry ---------------------------------------------------------------

    @property
    def data_offset(self) -> int:
        return self.layout.data_offset

    def partition_bounds(self, slot: int) -> tuple[int, int]:
        """Absolute [start, end) of frontend ``slot``'s partition."""
        start = self.layout.data_offset + slot * self.layout.partition_size
        return start, start + self.layout.partition_size

    def partition_of(self, offset: int) -> int:
        """Which partition an absolute offset lies in, or -1."""
        rel = offset - self.layout.data_offset
        if rel < 0 or rel >= self.layout.partition_size * self.layout.n_frontends:
            return -1
        return rel // self.layout.partition_size

    @property
    def label(self) -> str:
        return bytes(self.header[0]["label"]).decode(errors="replace")

    # -- slots ------------------------------------------------------------------

    def slot_alive(self, table: np.ndarray, slot: int, dead_after_s: float, epoch: int | None = None) -> bool:
        """Is the process in ``table[slot]`` (optionally: of that epoch) alive?"""
        row = table[slot]
        if epoch is not None and int(row["epoch"]) != epoch:
            return False
        if int(row["state"]) in (SlotState.FREE, SlotState.DEAD):
            return False
        pid = int(row["pid"])
        if pid and int(row["pidns"]) == own_pidns():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                pass
        return now_ns() - int(row["beat_ns"]) <= int(dead_after_s * 1e9)

    def claim_slot(self, table: np.ndarray, slot: int, *, model: str = "") -> int:
        """Take over ``table[slot]`` for this process; returns the new epoch.

        Caller holds the table lock (or is the supervisor assigning slots).
        """
        row = table[slot]
        epoch = int(row["epoch"]) + 1
        row["epoch"] = epoch
        row["pid"] = os.getpid()
        row["pidns"] = own_pidns()
        row["beat_ns"] = now_ns()
        row["busy_ns"] = 0
        row["preparing"] = 0  # a dead predecessor's requests died with it
        row["model"] = model.encode()[:48]
        row["state"] = SlotState.STARTING
        return epoch

    def preparing_requests(self) -> int:
        """Requests the serving frontends admitted and are still decoding: they reach the queue soon."""
        rows = self.frontends
        serving = (rows["state"] == SlotState.READY) | (rows["state"] == SlotState.DRAINING)
        return int(rows["preparing"][serving].sum())

    def live_workers(self, dead_after_s: float, model: str | None = None) -> list[int]:
        """Slots of workers that are READY (and serve ``model``, if given)."""
        out = []
        for slot in range(self.layout.n_workers):
            row = self.workers[slot]
            if int(row["state"]) != SlotState.READY:
                continue
            if model is not None and bytes(row["model"]).decode(errors="replace") != model:
                continue
            if self.slot_alive(self.workers, slot, dead_after_s):
                out.append(slot)
        return out


class Heartbeat:
    """A daemon thread that stamps ``beat_ns`` of one slot row every ``interval_s``.

    A thread (not the main loop) so a long model call or a busy event loop does not
    make a live process look dead; the worker separately proves its loop turns.
    """

    def __init__(self, table: np.ndarray, slot: int, epoch: int, interval_s: float = 0.2) -> None:
        self._table = table
        self._slot = slot
        self._epoch = epoch
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{slot}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _run(self) -> None:
        row = self._table[self._slot]
        while not self._stop.wait(self._interval_s):
            if int(row["epoch"]) != self._epoch:
                return  # someone else owns the slot now: we were declared dead
            row["beat_ns"] = now_ns()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1)
