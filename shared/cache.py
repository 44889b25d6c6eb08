"""A frontend's content cache: held tensor groups in its partition, indexed for every frontend.

Who calls this: a frontend's decode threads (never the event loop: ``acquire``
may wait on the index semaphore and runs the decode).

Life of a tensor group (one image's tensors):

    miss   -> make() writes into fresh allocations -> inserted in the shared index
              -> held by the request (holds = 1)
    hit    -> found in our own partition -> holds + 1 (no decode, no copy)
    remote -> found in another frontend's partition -> copied into ours (a memcpy,
              checked by generation before and after) -> private, not indexed
    release-> holds - 1; at 0 an indexed group becomes evictable (LRU order),
              a private group is freed at once
    evict  -> when an allocation does not fit, or when publishing would take this
              frontend past its quota of the shared index: the least recently used
              unheld group is removed from the index first, then freed

Placement is one step at a time: a decode thread's allocation and the evictions it
needs run under one process-local lock. Without it, a thread that had taken the last
evictable group off the LRU list but not yet freed it (it was still removing it from
the index) was invisible to a sibling thread, which found nothing to evict and failed
with arena_full although the space on its way back was enough for both.

Holds are process-local: only the owner can free its partition, so a crashed
frontend's holds vanish with it and its successor resets the partition (and
purges its index entries) on take-over. Concurrent misses of one key in one
frontend wait for the first decode instead of decoding twice.
"""

from __future__ import annotations

import collections
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping

import numpy as np

from shmgate.shared.allocator import ALIGN
from shmgate.shared.arena import BLOCK_HEADER_BYTES, Allocation, Partition, read_tensor
from shmgate.shared.cache_index import CacheIndex, IndexEntry
from shmgate.shared.errors import ArenaFull, DescriptorError, ImageTooLarge, Overloaded
from shmgate.shared.locks import SharedLock
from shmgate.shared.names import format_bytes
from shmgate.shared.vocabulary import AllocateFn, CacheStats, TensorGroup, content_key
from shmgate.shared.wire import DTYPE_ITEMSIZE, TensorRef

# TensorGroup and content_key are the seam's words (shared/vocabulary.py), importable from here too
# for the tests and benchmarks that drive a ContentCache directly.
__all__ = ["ContentCache", "ModelShare", "TensorGroup", "content_key"]


class ContentCache:
    def __init__(
        self,
        partition: Partition,
        index: CacheIndex,
        index_lock: SharedLock,
        partition_epoch: int,
        *,
        lock_timeout_s: float = 2.0,
    ) -> None:
        self.partition = partition
        self._index = index
        self._index_lock = index_lock
        self._epoch = partition_epoch
        self._lock_timeout_s = lock_timeout_s
        self._mutex = threading.Lock()
        # Held by a decode thread from a failed allocation through the evictions that make room to the
        # allocation that uses it (never by the event loop): see the module docstring.
        self._placing = threading.Lock()
        self._groups: dict[bytes, TensorGroup] = {}  # our indexed groups by key
        self._evictable: OrderedDict[int, TensorGroup] = OrderedDict()  # unheld indexed groups, LRU first
        self._pending: dict[bytes, threading.Event] = {}
        self._held_bytes = 0  # data bytes of groups with holds > 0: what requests in flight pin
        self.stats = CacheStats()
        # Per-model arena shares (several models on one node): the partition bytes each model may keep
        # against the others' evictions, by model-table row; empty: one LRU for everything, as before.
        self._shares: dict[int, int] = {}
        self._owner: dict[int, int] = {}  # id(group) -> the model row that placed it (shares only)
        self._owned: collections.Counter[int] = collections.Counter()  # partition bytes per model row
        # Our share of the shared index, at most half of it for all frontends together: linear probing
        # within MAX_PROBE slots then rarely finds a neighbourhood full (shared/cache_index.py).
        self.index_quota = max(1, index.capacity // (2 * partition.segment.layout.n_frontends))

    def set_shares(self, shares: Mapping[int, float]) -> None:
        """Give models (by model-table row) a share of this partition (0..1]: a model's images are evicted
        for another model's only beyond its share, and a model over its share evicts its own first."""
        self._shares = {owner: int(fraction * self.partition.size) for owner, fraction in shares.items()}

    @property
    def size(self) -> int:
        """This cache's partition size in bytes."""
        return self.partition.size

    @property
    def used_bytes(self) -> int:
        """Bytes allocated in this cache's partition (cached and held alike)."""
        return self.partition.used_bytes

    @property
    def held_bytes(self) -> int:
        """Arena data bytes pinned by requests in flight (cached, unheld tensors excluded).

        Zero whenever no request is in flight: the witness that every request, whatever its
        end (answer, error, cancel, dead worker), gave its space back.
        """
        return self._held_bytes

    # -- the one entry point ----------------------------------------------------

    def acquire(self, key: bytes, make: Callable[[AllocateFn], None], *, owner: int = -1) -> tuple[TensorGroup, str]:
        """A held group for ``key``: ("hit" | "remote" | "miss"). ``make`` runs on a miss.

        ``owner``: the model-table row placing it, for the arena shares (-1: none).
        Raises whatever ``make`` raises (the partial group is freed), ArenaFull, Overloaded.
        """
        while True:
            with self._mutex:
                group = self._groups.get(key)
                if group is not None:
                    self._hold(group)
                    self.stats.hits += 1
                    return group, "hit"
                pending = self._pending.get(key)
                if pending is None:
                    self._pending[key] = threading.Event()
                    break
            pending.wait()  # another thread of ours is decoding this very image
        try:
            group = self._copy_remote(key, owner)
            kind = "remote"
            if group is None:
                group = self._make(key, make, owner)
                kind = "miss"
            return group, kind
        finally:
            with self._mutex:
                self._pending.pop(key).set()

    def try_hit(self, key: bytes) -> TensorGroup | None:
        """A held group for ``key`` when this frontend already has it indexed, else None.

        Why: a local hit needs only the process-local mutex (held for microseconds, never across
        a semaphore wait), so the event loop may call this directly and skip a thread hop. Anything
        else (a remote hit, a miss, a decode in progress) goes through ``acquire`` in a thread.
        """
        with self._mutex:
            group = self._groups.get(key)
            if group is None:
                return None
            self._hold(group)
            self.stats.hits += 1
            return group

    def release(self, group: TensorGroup) -> None:
        with self._mutex:
            group.holds -= 1
            if group.holds > 0:
                return
            self._held_bytes -= _group_nbytes(group)
            if group.indexed:
                self._evictable[id(group)] = group
                return
        self._free_group(group)

    # -- internals ----------------------------------------------------------------

    def _hold(self, group: TensorGroup) -> None:
        if group.holds == 0:
            self._held_bytes += _group_nbytes(group)
        group.holds += 1
        self._evictable.pop(id(group), None)

    def _make(self, key: bytes | None, make: Callable[[AllocateFn], None], owner: int = -1) -> TensorGroup:
        group = self._new_group(key, owner)

        def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPE_ITEMSIZE[dtype]
            allocation = self._allocate(nbytes, owner)
            group.allocations.append(allocation)
            group.refs.append(
                TensorRef(
                    offset=allocation.offset,
                    nbytes=nbytes,
                    generation=allocation.generation,
                    dtype=dtype,
                    shape=tuple(shape),
                    name=name,
                )
            )
            return self.partition.array(allocation, dtype, tuple(shape))

        try:
            make(allocate)
        except BaseException:
            self._free_group(group)
            raise
        with self._mutex:
            self._held_bytes += _group_nbytes(group)
        if key is not None:
            self.stats.misses += 1
            self._publish(group, owner)
        return group

    def acquire_private(self, make: Callable[[AllocateFn], None], *, owner: int = -1) -> TensorGroup:
        """A held group that is never indexed (e.g. a large prompt payload). Freed on release."""
        return self._make(None, make, owner)

    def _new_group(self, key: bytes | None, owner: int) -> TensorGroup:
        group = TensorGroup(key, holds=1)
        if self._shares and owner >= 0:
            with self._mutex:
                self._owner[id(group)] = owner
        return group

    def _publish(self, group: TensorGroup, owner: int = -1) -> None:
        assert group.key is not None
        entry = IndexEntry(group.key, self.partition.slot, self._epoch, tuple(group.refs))
        try:
            if not self._index_room(owner):
                return  # every entry of ours is held: private to this request, as when the index is busy
            with self._index_lock.hold(self._lock_timeout_s):
                inserted = self._index.insert(entry)
        except Overloaded:
            return  # the group stays private to this request: correct, just not shared
        if inserted:
            with self._mutex:
                group.indexed = True
                self._groups[group.key] = group

    def _index_room(self, owner: int) -> bool:
        """Keep our index entries under ``index_quota`` by evicting our least recently used; False when
        every one of them is held.

        Why: the index is shared and fixed in size, and an entry leaves it only when its tensors are
        evicted, which happens when the partition is full. Small tensors (a 150 KB uint8 image) fill the
        index long before the partition: with no bound, the first few thousand distinct images filled it
        and every later image was decoded and never cached again, however often it was sent.
        """
        while len(self._groups) >= self.index_quota:
            with self._placing:  # evictions run one at a time, as an allocation's do (module docstring)
                if not self._evict_one(owner):
                    return False
        return True

    def _copy_remote(self, key: bytes, owner: int = -1) -> TensorGroup | None:
        with self._index_lock.hold(self._lock_timeout_s):
            entry = self._index.lookup(key, self.partition.segment.frontends["epoch"])
        if entry is None or entry.partition == self.partition.slot:
            return None
        group = self._new_group(key, owner)
        try:
            for ref in entry.tensors:
                allocation = self._allocate(ref.nbytes, owner)
                group.allocations.append(allocation)
                out = self.partition.array(allocation, "uint8", (ref.nbytes,))
                read_tensor(self.partition.segment, ref, out)
                group.refs.append(
                    TensorRef(
                        offset=allocation.offset,
                        nbytes=ref.nbytes,
                        generation=allocation.generation,
                        dtype=ref.dtype,
                        shape=ref.shape,
                        name=ref.name,
                    )
                )
        except DescriptorError:
            self._free_group(group)  # the owner evicted it meanwhile: decode instead
            return None
        except BaseException:
            self._free_group(group)
            raise
        with self._mutex:
            self._held_bytes += _group_nbytes(group)
        self.stats.remote_hits += 1
        return group

    def footprint(self, group: TensorGroup) -> int:
        """Bytes of the partition ``group`` takes: its blocks, headers and alignment included."""
        return sum(block_bytes(a.nbytes) for a in group.allocations)

    def _allocate(self, nbytes: int, owner: int = -1) -> Allocation:
        need = block_bytes(nbytes)
        if need > self.partition.size:
            # Eviction can never make room for it: 413 naming the limit, not 503 arena_full forever.
            raise ImageTooLarge(  # short enough to survive the error message cap (gateway/http_errors.py)
                f"the preprocessed image needs {need:,} bytes of shared memory, more than this frontend's arena "
                f"partition holds ({self.partition.size:,} bytes: --arena-size / --frontends); send a smaller image or "
                "raise --arena-size"
            )
        with self._placing:
            while True:
                allocation = self.partition.allocate(nbytes)
                if allocation is not None:
                    if self._shares and owner >= 0:
                        with self._mutex:
                            self._owned[owner] += block_bytes(allocation.nbytes)
                    return allocation
                if not self._evict_one(owner, need):
                    full = ArenaFull(
                        f"no room for a {nbytes:,}-byte tensor in this frontend's arena partition "
                        f"({format_bytes(self.partition.size)}) while other requests in flight hold it; retry shortly"
                    )
                    full.needed_bytes = need
                    raise full

    def _victim(self, owner: int, need: int) -> TensorGroup | None:
        """The group to evict for ``owner``'s allocation of ``need`` bytes (caller holds the mutex): the least
        recently used, except that with shares a model within its share keeps its groups, and a model that
        would go beyond its own share evicts only its own."""
        if not self._shares:
            return next(iter(self._evictable.values()), None)
        mine = self._shares.get(owner)
        if mine is not None and self._owned[owner] + need > mine:
            return next((g for g in self._evictable.values() if self._owner.get(id(g)) == owner), None)
        for group in self._evictable.values():
            other = self._owner.get(id(group), -1)
            if other not in self._shares or self._owned[other] > self._shares[other]:
                return group
        return None

    def _clearable(self, owner: int) -> TensorGroup | None:
        """The next group ``owner`` may evict when it empties the cache to pack a request (caller holds the
        mutex): its own, and those of models without a share or beyond theirs; never what another model
        keeps within its share, however fragmented the partition."""
        for group in self._evictable.values():
            other = self._owner.get(id(group), -1)
            if other == owner or other not in self._shares or self._owned[other] > self._shares[other]:
                return group
        return None

    def _evict_one(self, owner: int = -1, need: int = 0, *, clearing: bool = False) -> bool:
        with self._mutex:
            if owner < 0 or not self._shares:
                group_or_none = next(iter(self._evictable.values()), None)
            else:
                group_or_none = self._clearable(owner) if clearing else self._victim(owner, need)
            if group_or_none is None:
                return False
            group = group_or_none
            del self._evictable[id(group)]
            group.indexed = False
            if group.key is not None:
                self._groups.pop(group.key, None)
        try:
            with self._index_lock.hold(self._lock_timeout_s):
                self._index.remove(group.key or b"", self.partition.slot, group.refs[0].generation if group.refs else 0)
        except Overloaded:
            # Still published, so it must not be freed; put it back rather than leak it.
            with self._mutex:
                group.indexed = True
                if group.key is not None:
                    self._groups[group.key] = group
                self._evictable[id(group)] = group
                self._evictable.move_to_end(id(group), last=False)
            raise
        self._free_group(group)
        self.stats.evictions += 1
        return True

    def _free_group(self, group: TensorGroup) -> None:
        if self._shares:
            with self._mutex:
                owner = self._owner.pop(id(group), -1)
                if owner >= 0:
                    self._owned[owner] -= sum(block_bytes(a.nbytes) for a in group.allocations)
        for allocation in group.allocations:
            self.partition.free(allocation)
        group.allocations.clear()

    def owned_bytes(self, owner: int) -> int:
        """Partition bytes the model-table row ``owner`` holds (cached or in flight; shares only)."""
        return self._owned[owner]

    def evictable_count(self) -> int:
        return len(self._evictable)

    def clear(self, owner: int = -1) -> None:
        """Evict everything unheld (tests, shutdown, and the resolver's pack-from-empty retry,
        gateway/images.py). ``owner``: a model-table row, with shares: only what that model may evict
        (``_clearable``), so one model's retry under fragmentation cannot empty another's share."""
        while self._evict_one(owner, clearing=True):
            pass


class ModelShare:
    """One model's view of a frontend's cache (a TensorCache): what it places counts against its arena
    share (``ContentCache.set_shares``); hits, releases and the rest are the cache's own."""

    def __init__(self, cache: ContentCache, owner: int) -> None:
        self.cache = cache
        self.owner = owner
        self.stats = cache.stats  # the same counters: a model's hits and misses are the frontend's

    @property
    def size(self) -> int:
        return self.cache.size

    @property
    def used_bytes(self) -> int:
        return self.cache.used_bytes

    @property
    def held_bytes(self) -> int:
        return self.cache.held_bytes

    def acquire(self, key: bytes, make: Callable[[AllocateFn], None]) -> tuple[TensorGroup, str]:
        return self.cache.acquire(key, make, owner=self.owner)

    def try_hit(self, key: bytes) -> TensorGroup | None:
        return self.cache.try_hit(key)

    def acquire_private(self, make: Callable[[AllocateFn], None]) -> TensorGroup:
        return self.cache.acquire_private(make, owner=self.owner)

    def release(self, group: TensorGroup) -> None:
        self.cache.release(group)

    def footprint(self, group: TensorGroup) -> int:
        return self.cache.footprint(group)

    def clear(self) -> None:
        """Empty what this model may evict: its own images and unprotected ones, not another's share."""
        self.cache.clear(owner=self.owner)


def block_bytes(nbytes: int) -> int:
    """The partition bytes one tensor of ``nbytes`` takes: its block header, then ALIGN rounding."""
    return (BLOCK_HEADER_BYTES + max(nbytes, 1) + ALIGN - 1) // ALIGN * ALIGN


def _group_nbytes(group: TensorGroup) -> int:
    return sum(a.nbytes for a in group.allocations)
