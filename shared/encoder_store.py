"""A model's vision-tower outputs in shared memory: one worker's tower run serves every worker of the model.

Who calls this: a worker of a generation engine (worker/encoder_share.py turns tensors into bytes and
back), on its model loop, before running the vision tower (``get``) and after (``put``).

The machinery is the content cache's, in a segment of its own per model (``InstanceNames.encoder_arena``):
the same ``Segment`` layout, whose partition owners (its "frontend" rows) are here the model's workers,
one partition per worker slot of the instance; the same ``CacheIndex`` under a ``SharedLock`` of its own;
the same blocks, generations and epochs (shared/arena.py). So the same rules hold:

- One writer per partition: worker slot w alone allocates, writes and frees in partition w. A worker
  that takes slot w over (its predecessor died) claims row w first (a new epoch: every block and index
  entry of the old epoch reads stale at once), resets the partition and purges its index entries; a
  predecessor still running (declared dead, not yet exited) sees the new epoch and publishes nothing more.
- Publish order: the bytes are written into a fresh block, then the entry is inserted in the index
  under the index semaphore (fields first, state last). A reader looks up under the same semaphore, so
  the semaphore's post/wait orders the data before the entry; a writer killed before the insert left
  nothing visible, and one killed inside the insert left an invisible half-written slot.
- Reads are a seqlock: ``read_tensor`` checks the block's generation and epoch before the copy and again
  after it; the owner zeroes a block's generation before it frees or reuses it. A mismatch is a miss
  (the caller runs the tower), never a wrong answer.
- Eviction: each worker evicts only its own entries, least recently published first, when its
  partition or its quota of the index is full; an entry is removed from the index before its block
  is freed.
- A lock holder that died is repaired as every ``SharedLock`` is (its identity is the worker's slot
  and epoch in the instance, whose liveness the caller's ``is_dead`` reads). Waits are short: a busy
  lock makes a ``get`` a miss and a ``put`` a no-op, never a stall of the model loop.

Life cycle: the model's first sharing worker creates the segment and its two semaphores (the others
attach); the supervisor unlinks them with the instance (shared/instance.py ``_unlink_all``), and
``cleanup_leftovers`` removes those of a dead instance.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import posix_ipc

from shmgate.shared.arena import Allocation, Partition, read_tensor
from shmgate.shared.cache_index import CacheIndex, IndexEntry
from shmgate.shared.errors import DescriptorError, Overloaded, SetupError
from shmgate.shared.locks import Identity, IsDead, SharedLock
from shmgate.shared.names import IPC_MODE, InstanceNames
from shmgate.shared.segment import LockId, Segment, SlotState
from shmgate.shared.wire import DTYPE_ITEMSIZE, TensorRef

__all__ = ["EncoderStore", "EncoderStoreStats"]

INDEX_CAPACITY = 4096  # entries of all workers together (a power of two); each worker keeps at most its share of half
LOCK_TIMEOUT_S = 0.2  # the model loop never waits longer for the index: a miss (or no publish) instead
ATTACH_WAIT_S = 5.0  # how long an attaching worker waits for the creating worker to finish the header
MIN_PARTITION_BYTES = 1 << 20


@dataclass
class EncoderStoreStats:
    """This worker's counts since it started (exported per worker in /metrics)."""

    hits: int = 0  # lookups answered from shared memory
    misses: int = 0  # lookups not found (or the index was busy)
    stale: int = 0  # found, but evicted or taken over during the read: a miss all the same
    publishes: int = 0  # outputs this worker put in the index
    evictions: int = 0


class EncoderStore:
    """Worker slot ``slot``'s view of its model's shared encoder outputs: read anyone's, write its own."""

    def __init__(
        self,
        segment: Segment,
        slot: int,
        index_lock: SharedLock,
        semaphores: list[posix_ipc.Semaphore],
        *,
        lock_timeout_s: float = LOCK_TIMEOUT_S,
    ) -> None:
        """Claims partition ``slot`` (a new epoch: whatever a predecessor left there turns stale), then
        purges the predecessor's index entries. Raises Overloaded when the index stays busy."""
        self.segment = segment
        self.slot = slot
        self._semaphores = semaphores
        self._lock = index_lock
        self._lock_timeout_s = lock_timeout_s
        self._index = CacheIndex.in_segment(segment)
        segment.claim_slot(segment.frontends, slot)  # epoch + 1 before anything of ours is written
        self._partition = Partition(segment, slot)
        self._epoch = int(segment.frontends[slot]["epoch"])
        with self._lock.hold(2.0):
            self._index.purge_partition(slot)
        segment.frontends[slot]["state"] = SlotState.READY
        self._mutex = threading.Lock()
        self._own: OrderedDict[bytes, Allocation] = OrderedDict()  # our published entries, oldest first
        self.quota = max(1, self._index.capacity // (2 * segment.layout.n_frontends))
        self.stats = EncoderStoreStats()

    @classmethod
    def open(
        cls,
        names: InstanceNames,
        model_index: int,
        *,
        slot: int,
        n_slots: int,
        partition_bytes: int,
        identity: Identity,
        is_dead: IsDead,
        lock_timeout_s: float = LOCK_TIMEOUT_S,
    ) -> EncoderStore:
        """Create (first worker of the model) or attach the model's segment and take partition ``slot``.

        ``n_slots``: the instance's worker slots (one partition each); ``partition_bytes``: each partition's
        size, as the creator asks (attachers take the segment as it is). ``identity``/``is_dead``: this
        worker's lock identity in the instance and the liveness test for a recorded lock holder. Raises
        SetupError (no room in /dev/shm, a segment of another layout, a slot past its partitions).
        """
        if partition_bytes < MIN_PARTITION_BYTES:
            raise SetupError(f"a shared encoder partition needs at least {MIN_PARTITION_BYTES} bytes")
        sems = [
            posix_ipc.Semaphore(name, posix_ipc.O_CREAT, mode=IPC_MODE, initial_value=1)
            for name in names.encoder_semaphores(model_index)
        ]
        try:
            segment = _create_or_attach(names, names.encoder_arena(model_index), n_slots, partition_bytes)
        except BaseException:
            for sem in sems:
                sem.close()
            raise
        try:
            if slot >= segment.layout.n_frontends:
                raise SetupError(f"worker slot {slot} has no shared encoder partition ({segment.layout.n_frontends})")
            lock = SharedLock(
                sems[0], segment.locks[int(LockId.INDEX)], sems[1], segment.locks[int(LockId.REPAIR)], identity, is_dead
            )
            return cls(segment, slot, lock, sems, lock_timeout_s=lock_timeout_s)
        except BaseException:  # nothing stays mapped or open for a worker that goes on without sharing
            segment.close()
            for sem in sems:
                sem.close()
            raise

    # -- reading --------------------------------------------------------------------

    def get(self, key: bytes, out_for: Callable[[str, tuple[int, ...]], np.ndarray | None]) -> bool:
        """Copy the output published under ``key`` into ``out_for(dtype, shape)`` (a uint8 array of its bytes;
        None refuses it) and re-check it. False on a miss, a busy index, a refusal or a stale read: the
        caller runs the tower. True only when the bytes copied are the ones published under ``key``."""
        try:
            with self._lock.hold(self._lock_timeout_s):
                entry = self._index.lookup(key, self.segment.frontends["epoch"])
        except Overloaded:
            entry = None
        if entry is None or len(entry.tensors) != 1:
            self.stats.misses += 1
            return False
        ref = entry.tensors[0]
        out = out_for(ref.dtype, ref.shape)
        if out is None or out.nbytes != ref.nbytes:
            self.stats.misses += 1
            return False
        try:
            read_tensor(self.segment, ref, out)  # generation and epoch checked before and after the copy
        except DescriptorError:
            self.stats.stale += 1
            self.stats.misses += 1
            return False
        self.stats.hits += 1
        return True

    # -- writing (own partition only) -------------------------------------------------

    def put(self, key: bytes, dtype: str, shape: tuple[int, ...], write: Callable[[np.ndarray], None]) -> bool:
        """Publish an output under ``key``: ``write`` fills a uint8 array of its bytes in our partition, then
        the entry goes into the index. False when it is there already (anyone's), does not fit, or the
        index is busy or full near the key (nothing is left allocated)."""
        itemsize = DTYPE_ITEMSIZE.get(dtype)
        if itemsize is None:
            return False
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        if nbytes <= 0 or nbytes > self._partition.size // 2:
            return False  # one output must not empty the partition of everything else
        if not self._owner():
            return False
        with self._mutex:
            if key in self._own:
                return False
            allocation = self._allocate(nbytes)
        if allocation is None:
            return False
        write(self._partition.array(allocation, "uint8", (nbytes,)))
        if not self._owner():
            return False  # taken over while we wrote: the partition is the successor's, publish nothing
        ref = TensorRef(allocation.offset, nbytes, allocation.generation, dtype, tuple(shape), "encoder")
        try:
            with self._lock.hold(self._lock_timeout_s):
                inserted = self._index.insert(IndexEntry(key, self.slot, self._epoch, (ref,)))
        except Overloaded:
            inserted = False
        if not inserted:
            self._partition.free(allocation)
            return False
        with self._mutex:
            self._own[key] = allocation
        self.stats.publishes += 1
        return True

    def _owner(self) -> bool:
        """Is partition ``slot`` still ours? A worker declared dead (stalled, or in another container) runs on
        until its heartbeat thread notices, while a successor may already have claimed the slot: it must
        stop writing at once. Its successor loads a model before it publishes, seconds in which the old
        process exits (worker/main.py ``_declared_dead``)."""
        return int(self.segment.frontends[self.slot]["epoch"]) == self._epoch

    def _allocate(self, nbytes: int) -> Allocation | None:
        """A block for ``nbytes``, evicting our oldest entries for room or for our index quota (mutex held)."""
        while len(self._own) >= self.quota:
            if not self._evict_oldest():
                return None
        while (allocation := self._partition.allocate(nbytes)) is None:
            if not self._evict_oldest():
                return None
        return allocation

    def _evict_oldest(self) -> bool:
        """Remove our oldest entry from the index, then free its block. False when none (or the index is busy)."""
        if not self._own:
            return False
        key, allocation = next(iter(self._own.items()))
        try:
            with self._lock.hold(self._lock_timeout_s):
                self._index.remove(key, self.slot, allocation.generation)
        except Overloaded:
            return False  # still indexed: it must not be freed
        del self._own[key]
        self._partition.free(allocation)  # generation 0 first: a reader copying it now sees a stale block
        self.stats.evictions += 1
        return True

    @property
    def published(self) -> int:
        """Entries of ours in the index now."""
        return len(self._own)

    def close(self) -> None:
        """Unmap and close the semaphores (the supervisor unlinks them). Our entries stay readable until a
        successor claims the slot: they are complete, and nobody else writes our partition."""
        for sem in self._semaphores:
            with contextlib.suppress(posix_ipc.Error):
                sem.close()
        self.segment.close()


def _create_or_attach(names: InstanceNames, shm_name: str, n_slots: int, partition_bytes: int) -> Segment:
    """The segment named ``shm_name``: created when it does not exist (its header's magic is written last),
    attached once its creator finished it otherwise. Raises SetupError."""
    deadline = time.monotonic() + ATTACH_WAIT_S
    while True:
        try:
            return Segment.attach(names, shm_name)
        except SetupError as exc:
            missing = "no running" in str(exc)
            if not missing and time.monotonic() > deadline:
                raise
        if missing:
            try:
                return Segment.create(
                    names,
                    arena_size=partition_bytes * n_slots,
                    n_frontends=n_slots,
                    n_workers=1,
                    index_capacity=INDEX_CAPACITY,
                    label="encoder",
                    shm_name=shm_name,
                )
            except SetupError as exc:
                if "exists already" not in str(exc):
                    raise
        time.sleep(0.01)  # another worker is creating it: attach once its header is complete
