"""The shared-memory segment: its layout, creation, attachment and slot tables.

Layout (every region 64-byte aligned, data partitions 4 KiB aligned):

    0        header          magic, versions, sizes, label, supervisor heartbeat
    512      lock records    who holds each semaphore (one record per lock)
    1024     model table     the declared models: public id, stall timeout, state (one row per model)
    ...      frontend slots  one row per frontend: epoch, pid, heartbeat, state, generation counter
    ...      worker slots    one row per worker: epoch, pid, heartbeat, state, model
    ...      stats           one row of u64 counters per frontend (metrics any frontend can sum; shared/stats_layout.py)
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
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import posix_ipc

from shmgate.shared.cache_index import ENTRY
from shmgate.shared.errors import SetupError
from shmgate.shared.names import IPC_MODE, InstanceNames, check_shm_space
from shmgate.shared.stats_layout import (
    BATCH_BUCKETS,
    ENGINE_FIELDS,
    ENGINE_GAUGES,
    MODEL_SLOTS,
    STATS_WORDS,
    WORKER_CACHE_WORDS,
    WORKER_CACHES,
    Counter,
)
from shmgate.shared.vocabulary import (
    DEAD_AFTER_S,
    HEARTBEAT_INTERVAL_S,
    MODEL_NAME_BYTES,
    InstanceState,
    SlotState,
    now_ns,
)
from shmgate.shared.wire import WIRE_VERSION

__all__ = [
    "ENGINE_FIELDS",
    "ENGINE_GAUGES",
    "Heartbeat",
    "HeaderPeek",
    "MAX_MODELS",
    "ModelState",
    "Segment",
    "own_pidns",
    "peek_header",
    # the seam's words, defined in shared/vocabulary.py and shared/stats_layout.py; importable from
    # here too for the tests and benchmarks that drive a segment directly
    "STATS_WORDS",
    "InstanceState",
    "SlotState",
    "now_ns",
]

MAGIC = int.from_bytes(b"SHMGATE1", "little")
# 2: slot rows carry ``preparing`` and the worker batch-size counters
# 3: slot rows carry ``progress_ns`` and ``stalls``; ``model`` widened to MODEL_NAME_BYTES
# 4: stats rows of 256 words (the per-stage latency histograms, gateway/stages.py)
# 5: a table of the declared models (several models on one node) replaces the header's one ``model``
# 7: worker rows' ``engine`` words carry the shared encoder outputs' counters
# 8: worker rows carry ``step_bound_ns`` (a stepping engine's stall bound) and ``caches`` (its caches' gauges)
LAYOUT_VERSION = 8
ALIGN = 64
PAGE = 4096

# The fields up to ``state`` keep these offsets in every layout version: ``peek_header`` reads
# them from an instance of any version, so cleanup never mistakes a live instance of another
# version for a dead one (shared/instance.py: cleanup_leftovers).
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
        # set by the supervisor: a READY worker whose progress_ns is older than this is stalled
        # (not counted ready; the supervisor replaces it). 0: stall detection off.
        ("stall_timeout_ns", "<u8"),
        # set by the gateway: how many rows of the model table (MODEL_ROW) it declared; a worker whose
        # model is not among them refuses to attach. 0: unknown, any worker may attach.
        ("n_models", "<u8"),
        # set by a worker that refused to attach because it serves another model, so the gateway's own
        # log says so too (the worker's log may be in another container): how many, and the last one's model
        ("refused_workers", "<u8"),
        ("refused_model", f"S{MODEL_NAME_BYTES}"),
    ]
)
assert HEADER.itemsize <= 512, "the header must end before the lock records"

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

SLOT = np.dtype(
    [
        ("epoch", "<u8"),  # +1 at every claim; a message stamped with an older epoch is stale
        ("pid", "<u8"),
        ("pidns", "<u8"),  # inode of /proc/self/ns/pid of the claimant
        ("beat_ns", "<u8"),
        ("state", "<u8"),  # SlotState
        ("gen_counter", "<u8"),  # frontend rows: last generation handed out in this partition
        ("busy_ns", "<u8"),  # worker rows: total time spent running batches
        ("model", f"S{MODEL_NAME_BYTES}"),  # worker rows: the model it serves
        ("preparing", "<u8"),  # frontend rows: admitted requests still decoding (a batch window waits for them)
        ("batches", "<u8"),  # worker rows, never reset: batches run ...
        ("batched_requests", "<u8"),  # ... and the requests in them
        ("batch_hist", "<u8", (len(BATCH_BUCKETS) + 1,)),  # batches of size <= BATCH_BUCKETS[i]; last: larger
        # Stamped only by the loop that does the work (worker: batching/model loop, per batch and per
        # decode step; frontend: a callback on its event loop), never by the heartbeat thread: a
        # process whose beat_ns is fresh but progress_ns old is wedged (supervise/supervisor.py).
        ("progress_ns", "<u8"),
        ("stalls", "<u8"),  # times this slot's process was declared stalled (never reset: a counter)
        # Worker rows of a generation engine (worker/generation/engine.py), see ENGINE_FIELDS: gauges set per
        # step (zeroed at claim and release), counters added to (never reset).
        ("engine", "<u8", (len(ENGINE_FIELDS),)),
        # Worker rows of a stepping engine, while it has work: how long without a progress stamp reads as
        # wedged, derived from its recent step times (worker/health.py StepClock); 0: only the stall timeout.
        ("step_bound_ns", "<u8"),
        # Worker rows: its caches' gauges and eviction counters, WORKER_CACHE_WORDS words per entry of
        # WORKER_CACHES (shared/stats_layout.py); set by the worker, summed by /metrics.
        ("caches", "<u8", (len(WORKER_CACHES) * WORKER_CACHE_WORDS,)),
    ]
)

N_LOCKS = 3  # index, repair, table

# The models one gateway serves: each has its own request queue (shared/instance.py), its own
# workers and, here, the facts every process of the node reads about it.
MAX_MODELS = MODEL_SLOTS  # each row has its words in the frontends' stats rows (per-model metrics)
MODEL_ROW = np.dtype(
    [
        ("name", f"S{MODEL_NAME_BYTES}"),  # the public id clients send as ``model``
        # a READY worker of this model whose progress_ns is older than this is stalled; 0: the header's
        ("stall_timeout_ns", "<u8"),
        ("state", "<u8"),  # ModelState, written by the supervisor: 0 serving as its workers allow, 1 failed
    ]
)
MODELS_OFFSET = 1024


class ModelState(enum.IntEnum):
    """What the supervisor says of a model; ready/loading/draining are read off its workers and the instance."""

    SERVING = 0
    FAILED = 1  # its workers died beyond their restart budget; the others keep serving


class LockId(enum.IntEnum):
    INDEX = 0
    REPAIR = 1
    TABLE = 2


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
        return _align(MODELS_OFFSET + MAX_MODELS * MODEL_ROW.itemsize, ALIGN)

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
        return _align(self.index_offset + self.index_capacity * ENTRY.itemsize, PAGE)

    @cached_property
    def partition_size(self) -> int:
        return (self.arena_size // self.n_frontends) // PAGE * PAGE

    @cached_property
    def total_size(self) -> int:
        return self.data_offset + self.partition_size * self.n_frontends


INDEX_SLOT_PER_ARENA_BYTES = 32 << 10  # one index slot per 32 KiB of arena: room for small images too
MIN_INDEX_CAPACITY, MAX_INDEX_CAPACITY = 4096, 65536


def index_capacity_for(arena_size: int) -> int:
    """The content index's slots for an arena: a power of two, one per 32 KiB, 4,096 to 65,536.

    Why: an image is cached only while it has an index entry, and the frontends together fill at most
    half of the index (shared/cache.py ``index_quota``). A fixed 4,096 slots capped a 1 GiB arena at
    2,048 cached images of any size; one slot per 32 KiB lets the arena, not the index,
    bound how many small images stay cached. An entry is 432 bytes: 14 MiB for 1 GiB of arena.
    """
    wanted = max(1, arena_size // INDEX_SLOT_PER_ARENA_BYTES)
    return min(MAX_INDEX_CAPACITY, max(MIN_INDEX_CAPACITY, 1 << (wanted - 1).bit_length()))


class Segment:
    """One mapped arena segment plus numpy views of its tables.

    ``create`` is for the instance owner (the gateway's supervisor); ``attach``
    for everyone else. ``close`` unmaps; ``unlink`` removes the name (owner).
    """

    def __init__(
        self, names: InstanceNames, shm: posix_ipc.SharedMemory, mm: mmap.mmap, shm_name: str | None = None
    ) -> None:
        self.names = names
        # the object's name: the instance's arena, or another segment of the same layout (a model's shared
        # encoder outputs, shared/encoder_store.py)
        self.shm_name = shm_name or names.arena
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
        self.models = np.frombuffer(mm, MODEL_ROW, MAX_MODELS, MODELS_OFFSET)
        self.frontends = np.frombuffer(mm, SLOT, self.layout.n_frontends, self.layout.frontend_offset)
        self.workers = np.frombuffer(mm, SLOT, self.layout.n_workers, self.layout.worker_offset)
        self.stats = np.frombuffer(mm, "<u8", self.layout.n_frontends * STATS_WORDS, self.layout.stats_offset).reshape(
            self.layout.n_frontends, STATS_WORDS
        )

    # -- life cycle -----------------------------------------------------------

    @classmethod
    def create(
        cls,
        names: InstanceNames,
        *,
        arena_size: int,
        n_frontends: int,
        n_workers: int,
        index_capacity: int = 0,
        label: str,
        stall_timeout_s: float = 0.0,
        shm_name: str | None = None,
    ) -> Segment:
        """Create and initialise the segment (owner only). Raises SetupError.

        ``index_capacity``: the content index's slots, a power of two; 0 sizes it from the arena
        (``index_capacity_for``). ``shm_name``: another name than the instance's arena (a segment
        of the same layout for another use; its partitions' owners are its "frontend" rows)."""
        index_capacity = index_capacity or index_capacity_for(arena_size)
        if n_frontends < 1 or n_workers < 1:
            raise SetupError("an instance needs at least one frontend slot and one worker slot")
        if index_capacity & (index_capacity - 1):
            raise SetupError("index capacity must be a power of two")
        layout = Layout(n_frontends, n_workers, index_capacity, arena_size)
        if layout.partition_size < 1 << 20:
            raise SetupError(f"arena of {arena_size} bytes is too small for {n_frontends} frontends")
        check_shm_space(layout.total_size)
        try:
            shm = posix_ipc.SharedMemory(
                shm_name or names.arena, posix_ipc.O_CREX, mode=IPC_MODE, size=layout.total_size
            )
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
        h["stall_timeout_ns"] = int(stall_timeout_s * 1e9)
        h["magic"] = MAGIC  # last: a half-initialised segment never looks valid
        del h, header
        return cls(names, shm, mm, shm_name)

    @classmethod
    def attach(cls, names: InstanceNames, shm_name: str | None = None) -> Segment:
        """Map an existing segment. Raises SetupError when it is missing or incompatible."""
        try:
            shm = posix_ipc.SharedMemory(shm_name or names.arena)
        except posix_ipc.ExistentialError as exc:
            raise SetupError("no running shmgate instance with that id") from exc
        if shm.size < HEADER.itemsize:  # its creator has not sized it yet
            shm.close_fd()
            raise SetupError("the shared-memory segment is not a shmgate arena (bad magic)")
        mm = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        return cls(names, shm, mm, shm_name)

    def close(self) -> None:
        """Unmap. Views handed out earlier must not be used afterwards."""
        for attr in ("header", "locks", "models", "frontends", "workers", "stats", "buf"):
            self.__dict__.pop(attr, None)
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes with the last reference

    def unlink(self) -> None:
        try:
            posix_ipc.unlink_shared_memory(self.shm_name)
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
    def served_model(self) -> str:
        """The public id of the first model the gateway serves ('' when it did not say)."""
        served = self.served_models
        return served[0] if served else ""

    @property
    def served_models(self) -> list[str]:
        """The public ids of the models the gateway declared, in order (a model's index names its queue)."""
        n = min(int(self.header[0]["n_models"]), MAX_MODELS)
        return [bytes(self.models[i]["name"]).decode(errors="replace") for i in range(n)]

    def declare_models(self, models: list[tuple[str, float]]) -> None:
        """Write the model table (owner, before any worker can attach): (public id, stall timeout s; 0: the
        instance's) per model. Raises SetupError for too many models or a repeated id."""
        names = [name for name, _ in models]
        if len(models) > MAX_MODELS:
            raise SetupError(f"{len(models)} models declared; one gateway serves at most {MAX_MODELS}")
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise SetupError(f"model id {twice[0]!r} is declared twice; give each model its own served name")
        for i, (name, stall_s) in enumerate(models):
            row = self.models[i]
            row["name"] = name.encode()[:MODEL_NAME_BYTES]
            row["stall_timeout_ns"] = int(stall_s * 1e9)
            row["state"] = ModelState.SERVING
        self.header[0]["n_models"] = len(models)

    def model_index(self, name: str) -> int:
        """The row (and request queue) of model ``name``: 0 when the gateway declared none, -1 when not declared."""
        served = self.served_models
        if not served:
            return 0
        return served.index(name) if name in served else -1

    def model_state(self, index: int) -> ModelState:
        return ModelState(int(self.models[index]["state"]))

    def mark_model(self, index: int, state: ModelState) -> None:
        self.models[index]["state"] = state

    def note_refused_worker(self, model: str) -> None:
        """A worker serving ``model`` refused to attach (two at once may count as one: a log hint, not a metric)."""
        h = self.header[0]
        h["refused_model"] = model.encode()[:MODEL_NAME_BYTES]
        h["refused_workers"] = int(h["refused_workers"]) + 1

    def refused_workers(self) -> tuple[int, str]:
        """(workers refused so far, the last one's model)."""
        h = self.header[0]
        return int(h["refused_workers"]), bytes(h["refused_model"]).decode(errors="replace")

    @property
    def stall_timeout_s(self) -> float | None:
        """How long a READY worker may go without progress before it counts as stalled (None: never)."""
        ns = int(self.header[0]["stall_timeout_ns"])
        return ns / 1e9 if ns else None

    def stalled(self, table: np.ndarray, slot: int) -> bool:
        """Is the process in ``table[slot]`` serving but its work loop not turning?"""
        bound_ns = self.stall_bound_ns(table, slot)
        if not bound_ns or int(table[slot]["state"]) != SlotState.READY:
            return False
        return now_ns() - int(table[slot]["progress_ns"]) > bound_ns

    def stall_bound_ns(self, table: np.ndarray, slot: int) -> int:
        """How long ``table[slot]`` may go without progress (0: stall detection off): its model's stall timeout
        (or the header's), or less for a stepping worker with work whose recent steps set a tighter bound
        (``step_bound_ns``: worker/health.py StepClock)."""
        timeout_ns = int(self.header[0]["stall_timeout_ns"])
        row = table[slot]
        if table is not self.workers:
            return timeout_ns
        if int(self.header[0]["n_models"]):
            index = self.model_index(bytes(row["model"]).decode(errors="replace"))
            if index >= 0 and int(self.models[index]["stall_timeout_ns"]):
                timeout_ns = int(self.models[index]["stall_timeout_ns"])  # this model's own
        step_bound = int(row["step_bound_ns"])
        return min(timeout_ns, step_bound) if timeout_ns and step_bound else timeout_ns

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
        # busy_ns is not reset: it is exported as a counter, which must never go backwards
        row["preparing"] = 0  # a dead predecessor's requests died with it
        row["progress_ns"] = now_ns()
        row["model"] = model.encode()[:MODEL_NAME_BYTES]
        row["engine"][:ENGINE_GAUGES] = 0  # a dead predecessor's rows died with it
        row["step_bound_ns"] = 0
        for cache in range(len(WORKER_CACHES)):  # a predecessor's caches died with it (evictions: a counter)
            row["caches"][cache * WORKER_CACHE_WORDS : (cache + 1) * WORKER_CACHE_WORDS - 1] = 0
        row["state"] = SlotState.STARTING
        return epoch

    def interactive_in_flight(self) -> int:
        """Interactive requests the serving frontends have in hand (stats word INTERACTIVE_IN_FLIGHT, gateway/lane.py)."""
        rows = self.frontends
        words = self.stats[:, Counter.INTERACTIVE_IN_FLIGHT].tolist()
        total = 0
        for state, count in zip(rows["state"].tolist(), words):
            if state == SlotState.READY or state == SlotState.DRAINING:
                total += count
        return total

    def preparing_requests(self) -> int:
        """Requests the serving frontends admitted and are still decoding: they reach the queue soon."""
        rows = self.frontends  # a worker's batch window asks this per wait: a loop over lists, 1 µs, not 7 in numpy
        total = 0
        for state, preparing in zip(rows["state"].tolist(), rows["preparing"].tolist()):
            if state == SlotState.READY or state == SlotState.DRAINING:
                total += preparing
        return total

    def live_workers(self, dead_after_s: float, model: str | None = None) -> list[int]:
        """Slots of workers that are READY, not stalled (and serve ``model``, if given)."""
        out = []
        for slot in range(self.layout.n_workers):
            row = self.workers[slot]
            if int(row["state"]) != SlotState.READY:
                continue
            if model is not None and bytes(row["model"]).decode(errors="replace") != model:
                continue
            if self.stalled(self.workers, slot):
                continue  # its heartbeat thread beats, but its model loop has not turned
            if self.slot_alive(self.workers, slot, dead_after_s):
                out.append(slot)
        return out


def _header_prefix(last: str) -> np.dtype[np.void]:
    """HEADER's fields up to and including ``last``, at their offsets (a structured dtype)."""
    fields, names = HEADER.fields, HEADER.names
    assert fields is not None and names is not None, "HEADER is a structured dtype"
    spec = {name: fields[name] for name in names[: names.index(last) + 1]}
    return np.dtype(spec)  # type: ignore[call-overload,no-any-return]  # numpy's stubs omit the {name: (dtype, offset)} form


_LIVENESS_PREFIX = _header_prefix("state")


@dataclass(frozen=True)
class HeaderPeek:
    """The version-independent part of an arena's header (see HEADER)."""

    magic_ok: bool
    wire_version: int
    layout_version: int
    n_frontends: int
    n_workers: int
    created_ns: int
    supervisor_beat_ns: int
    supervisor_pid: int
    supervisor_pidns: int
    state: int


def peek_header(names: InstanceNames) -> HeaderPeek | None:
    """Read the liveness prefix of an arena's header, whatever its version. None when it is gone or short.

    No mapping and no version check: cleanup must tell a live instance of another shmgate
    version from a dead one, and ``Segment.attach`` refuses other versions.
    """
    try:
        shm = posix_ipc.SharedMemory(names.arena)
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
        return None
    try:
        data = os.pread(shm.fd, _LIVENESS_PREFIX.itemsize, 0)
    except OSError:
        return None
    finally:
        shm.close_fd()
    if len(data) < _LIVENESS_PREFIX.itemsize:
        return None
    h = np.frombuffer(data, _LIVENESS_PREFIX, 1)[0]
    return HeaderPeek(
        magic_ok=int(h["magic"]) == MAGIC,
        wire_version=int(h["wire_version"]),
        layout_version=int(h["layout_version"]),
        n_frontends=int(h["n_frontends"]),
        n_workers=int(h["n_workers"]),
        created_ns=int(h["created_ns"]),
        supervisor_beat_ns=int(h["supervisor_beat_ns"]),
        supervisor_pid=int(h["supervisor_pid"]),
        supervisor_pidns=int(h["supervisor_pidns"]),
        state=int(h["state"]),
    )


# A heartbeat gap this long means the frontends judged the process dead and retried or failed what it had
# claimed (gateway/replies.py): a second past DEAD_AFTER_S, as their watchdogs look every 0.1 s.
HEARTBEAT_LAPSE_S = DEAD_AFTER_S + 1.0


class Heartbeat:
    """A daemon thread that stamps ``beat_ns`` of one slot row every ``interval_s``.

    A thread (not the main loop) so a long model call or a busy event loop does not
    make a live process look dead; the worker separately proves its loop turns.
    """

    def __init__(
        self,
        table: np.ndarray,
        slot: int,
        epoch: int,
        interval_s: float = HEARTBEAT_INTERVAL_S,
        on_declared_dead: Callable[[], None] | None = None,
    ) -> None:
        """``on_declared_dead``: called (from the heartbeat thread) when the slot is taken over or
        marked DEAD by someone else; a process that cannot be signalled (another container) uses it
        to exit, so its restart policy replaces it and it never answers a request it was relieved of.
        """
        self._on_declared_dead = on_declared_dead
        self._table = table
        self._slot = slot
        self._epoch = epoch
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{slot}", daemon=True)
        # The last beat before the latest gap of HEARTBEAT_LAPSE_S (a SIGSTOP, a starved thread); 0: none yet.
        self.lapse_started_ns = 0

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _run(self) -> None:
        row = self._table[self._slot]
        lapse_ns = int(HEARTBEAT_LAPSE_S * 1e9)
        last = now_ns()
        while not self._stop.wait(self._interval_s):
            if int(row["epoch"]) != self._epoch or int(row["state"]) == SlotState.DEAD:
                # someone else owns the slot now, or the supervisor declared us dead
                if self._on_declared_dead is not None and not self._stop.is_set():
                    self._on_declared_dead()
                return
            now = now_ns()
            if now - last > lapse_ns:
                self.lapse_started_ns = last
            row["beat_ns"] = last = now

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1)
