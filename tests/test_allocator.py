"""Stateful specifications of the allocator and of the content cache built on it.

Two hypothesis state machines:

- ``AllocatorMachine`` drives ``shared.allocator.Allocator`` with random allocate and
  release sequences and checks after every step that live blocks never overlap, are
  64-aligned and inside the partition, that ``used + free == size`` and the live lengths
  add up to ``used``, and that free blocks are always coalesced. Releasing everything at
  the end must leave exactly one free block.
- ``CacheMachine`` drives two ``ContentCache``s (two frontend slots of one real, small
  instance) with acquires from a small key space, releases, allocations big enough to
  force eviction and ``make`` callbacks that fail half way. After every step no live
  allocation overlaps, every held group still holds its pattern (read back through
  ``read_tensor``), and the byte and index accounting is exact. At the end, releasing
  every hold and clearing both caches leaves both partitions and the index empty.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from shmgate.shared.allocator import ALIGN, Allocator
from shmgate.shared.arena import Partition, read_tensor
from shmgate.shared.cache import ContentCache, TensorGroup
from shmgate.shared.cache_index import IndexEntry
from shmgate.shared.errors import ArenaFull
from shmgate.shared.instance import Instance
from shmgate.shared.locks import HolderKind
from shmgate.shared.segment import LockId, SlotState
from shmgate.shared.wire import TensorRef

# -- the allocator ------------------------------------------------------------------------------

ARENA = 64 * 96  # small on purpose: fragmentation and "nothing fits" happen within a few steps


class AllocatorMachine(RuleBasedStateMachine):
    blocks = Bundle("blocks")

    def __init__(self) -> None:
        super().__init__()
        self.allocator = Allocator(ARENA)
        self.live: dict[int, int] = {}  # start -> requested bytes (the model)

    @rule(target=blocks, nbytes=st.integers(min_value=0, max_value=ARENA // 3))
    def allocate(self, nbytes: int) -> int:
        need = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        largest = self.allocator.largest_free()
        start = self.allocator.allocate(nbytes)
        if start is None:
            assert largest < need, "allocation failed although a free block was large enough"
            return -1
        assert start not in self.live
        assert self.allocator.live_blocks[start] == need
        self.live[start] = need
        return start

    @rule(start=consumes(blocks))
    def release(self, start: int) -> None:
        if start == -1:  # a failed allocation: nothing to release
            return
        assert self.allocator.release(start) == self.live.pop(start)

    @precondition(lambda self: self.allocator.free_blocks)
    @rule(data=st.data())
    def releasing_a_free_start_is_refused(self, data: st.DataObject) -> None:
        start, _ = data.draw(st.sampled_from(self.allocator.free_blocks))
        free_blocks = self.allocator.free_blocks
        with pytest.raises(KeyError):  # a double free is a bug, and changes nothing
            self.allocator.release(start)
        assert self.allocator.free_blocks == free_blocks

    @invariant()
    def live_blocks_are_aligned_inside_and_disjoint(self) -> None:
        live = sorted(self.allocator.live_blocks.items())
        assert dict(live) == self.live
        for start, length in live:
            assert start % ALIGN == 0 and length % ALIGN == 0 and length > 0
            assert 0 <= start and start + length <= ARENA
        for (a, a_len), (b, _) in zip(live, live[1:]):
            assert a + a_len <= b, "two live blocks overlap"

    @invariant()
    def accounting_is_exact(self) -> None:
        a = self.allocator
        assert a.used + a.free == a.size
        assert sum(a.live_blocks.values()) == a.used
        assert sum(length for _, length in a.free_blocks) == a.free

    @invariant()
    def free_blocks_are_coalesced_and_disjoint_from_live_ones(self) -> None:
        free = self.allocator.free_blocks
        assert free == sorted(free)
        for (a, a_len), (b, _) in zip(free, free[1:]):
            assert a + a_len < b, "two free blocks touch or overlap: they should have been merged"
        everything = sorted(free + list(self.allocator.live_blocks.items()))
        position = 0
        for start, length in everything:  # free and live blocks tile [0, size) exactly
            assert start == position
            position += length
        assert position == ARENA

    def teardown(self) -> None:
        for start in list(self.live):
            self.allocator.release(start)
        assert self.allocator.free_blocks == [(0, ARENA)]
        assert self.allocator.used == 0


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_allocator_keeps_blocks_disjoint_aligned_and_coalesced = AllocatorMachine.TestCase


def test_reset_forgets_every_allocation() -> None:
    allocator = Allocator(ARENA)
    for _ in range(5):
        allocator.allocate(100)
    allocator.reset()
    assert allocator.used == 0
    assert allocator.free_blocks == [(0, ARENA)]
    assert allocator.live_blocks == {}


@pytest.mark.parametrize("size", [0, -64, 100])
def test_sizes_that_are_not_positive_multiples_of_align_are_refused(size: int) -> None:
    with pytest.raises(ValueError):
        Allocator(size)


def test_index_finds_and_removes_keys_that_end_in_zero_bytes() -> None:
    """numpy strips trailing NULs from fixed-width byte fields; the index must not care."""
    inst = Instance.create(arena_size=PARTITION, n_frontends=1, n_workers=1, queue_depth=1, index_capacity=64)
    try:
        index = inst.cache_index()
        ref = TensorRef(offset=inst.segment.data_offset + 64, nbytes=4, generation=1, dtype="uint8", shape=(4,))
        key = b"\x07" * 8 + b"\x00" * 8
        assert index.insert(IndexEntry(key, 0, 0, (ref,)))
        assert not index.insert(IndexEntry(key, 0, 0, (ref,))), "the same key was inserted twice"
        found = index.lookup(key)
        assert found is not None and found.tensors == (ref,)
        assert index.remove(key, 0, 1)
        assert index.count() == 0
    finally:
        inst.unlink()
        inst.close()


# -- the content cache ------------------------------------------------------------------------------

PARTITION = 1 << 20  # the smallest partition an instance accepts
N_KEYS = 10
BIG_KEY = N_KEYS  # a key whose tensor takes most of a partition: forces eviction


def _key(i: int) -> bytes:
    return i.to_bytes(2, "little") * 8  # 16 bytes, spread over the index by its first 8


def _shapes(i: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """The tensors of key i: (name, dtype, shape). Sizes from a few KiB to ~600 KiB."""
    if i == BIG_KEY:
        return [("pixels", "uint8", (3, 400, 500))]
    tensors = [("pixels", "float32" if i % 2 else "uint8", (3, 32 + 16 * i, 48 + 8 * i))]
    if i % 3 == 0:
        tensors.append(("grid", "int64", (1, 3)))
    return tensors


def _pattern(i: int, j: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(i * 16 + j).integers(0, 256, nbytes, dtype=np.uint8)


def _make_for(i: int):  # type: ignore[no-untyped-def]
    def make(allocate) -> None:  # type: ignore[no-untyped-def]
        for j, (name, dtype, shape) in enumerate(_shapes(i)):
            array = allocate(name, dtype, shape)
            flat = array.reshape(-1).view(np.uint8)
            flat[:] = _pattern(i, j, flat.nbytes)

    return make


def _failing_make(allocate) -> None:  # type: ignore[no-untyped-def]
    allocate("pixels", "uint8", (1000,))[:] = 7
    raise ValueError("the decoder gave up half way")


class CacheMachine(RuleBasedStateMachine):
    """Two frontends (slots 0 and 1) sharing one index; holds are tracked as a multiset."""

    def __init__(self) -> None:
        super().__init__()
        self.inst = Instance.create(
            arena_size=2 * PARTITION, n_frontends=2, n_workers=1, queue_depth=1, index_capacity=256
        )
        seg = self.inst.segment
        self.caches: list[ContentCache] = []
        for k in range(2):
            epoch = seg.claim_slot(seg.frontends, k)
            seg.frontends[k]["state"] = SlotState.READY
            lock = self.inst.lock(LockId.INDEX, (HolderKind.FRONTEND, k, epoch))
            self.caches.append(ContentCache(Partition(seg, k), self.inst.cache_index(), lock, epoch))
        self.held: list[tuple[int, int, TensorGroup]] = []  # (cache, key, group)

    @initialize()
    def start_empty(self) -> None:
        assert self.inst.cache_index().count() == 0

    @rule(c=st.integers(0, 1), i=st.integers(0, N_KEYS - 1))
    def acquire(self, c: int, i: int) -> None:
        cache = self.caches[c]
        try:
            group, kind = cache.acquire(_key(i), _make_for(i))
        except ArenaFull:
            assert cache.evictable_count() == 0, "ArenaFull although something was evictable"
            event("arena full")
            return
        assert kind in ("hit", "remote", "miss")
        event(kind)
        if cache.stats.evictions:
            event("evicted")
        assert group.holds >= 1
        self.held.append((c, i, group))

    @rule(c=st.integers(0, 1))
    def acquire_big_forces_eviction(self, c: int) -> None:
        self.acquire(c, BIG_KEY)

    @rule(c=st.integers(0, 1), i=st.integers(0, N_KEYS - 1))
    def make_that_fails_frees_its_partial_group(self, c: int, i: int) -> None:
        cache = self.caches[c]
        key = _key(100 + i)  # never cached: the failing make always runs
        used_before = cache.partition.used_bytes
        with pytest.raises((ValueError, ArenaFull)):
            cache.acquire(key, _failing_make)
        assert cache.partition.used_bytes <= used_before  # only eviction can have changed it
        assert self.inst.cache_index().lookup(key) is None

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, len(self.held) - 1))
        c, _, group = self.held.pop(n)
        self.caches[c].release(group)

    @rule(c=st.integers(0, 1))
    def clear_evicts_only_unheld_groups(self, c: int) -> None:
        self.caches[c].clear()
        assert self.caches[c].evictable_count() == 0

    # -- invariants ----------------------------------------------------------------------

    def _groups_of(self, c: int) -> set[TensorGroup]:
        cache = self.caches[c]
        groups = set(cache._groups.values()) | set(cache._evictable.values())
        return groups | {g for k, _, g in self.held if k == c}

    @invariant()
    def live_allocations_are_disjoint_and_accounted_exactly(self) -> None:
        for c, cache in enumerate(self.caches):
            part = cache.partition
            blocks = sorted(part._allocator.live_blocks.items())
            for (a, a_len), (b, _) in zip(blocks, blocks[1:]):
                assert a + a_len <= b
            owned = [a.block - part.start for g in self._groups_of(c) for a in g.allocations]
            assert len(owned) == len(set(owned))
            assert sorted(owned) == [start for start, _ in blocks], "an allocation leaked or is missing"
            assert part.used_bytes == sum(length for _, length in blocks)
            assert part.used_bytes + part.free_bytes == part.size

    @invariant()
    def every_held_group_still_holds_its_pattern(self) -> None:
        seg = self.inst.segment
        for _, i, group in self.held:
            assert group.allocations, "a held group lost its allocations"
            for j, ref in enumerate(group.refs):
                data = read_tensor(seg, ref)
                assert np.array_equal(data, _pattern(i, j, ref.nbytes)), "a held tensor was overwritten"

    @invariant()
    def holds_match_and_the_index_lists_exactly_the_indexed_groups(self) -> None:
        for c in range(len(self.caches)):
            for group in self._groups_of(c):
                assert group.holds == sum(1 for k, _, g in self.held if k == c and g is group)
        indexed = sum(len(cache._groups) for cache in self.caches)
        assert self.inst.cache_index().count() == indexed

    @invariant()
    def held_bytes_are_the_data_bytes_of_the_groups_requests_hold(self) -> None:
        for c, cache in enumerate(self.caches):
            held = {id(g): g for k, _, g in self.held if k == c}
            assert cache.held_bytes == sum(a.nbytes for g in held.values() for a in g.allocations)

    def teardown(self) -> None:
        try:
            for c, _, group in self.held:
                self.caches[c].release(group)
            self.held.clear()
            for cache in self.caches:
                cache.clear()
            for cache in self.caches:
                assert cache.partition.used_bytes == 0
                assert cache.partition.live_blocks() == 0
            assert self.inst.cache_index().count() == 0
        finally:
            instance_id = self.inst.names.instance_id
            self.inst.unlink()
            self.inst.close()
            assert not [e for e in os.listdir("/dev/shm") if instance_id in e]


CacheMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_content_cache_holds_evicts_and_accounts_exactly = CacheMachine.TestCase
