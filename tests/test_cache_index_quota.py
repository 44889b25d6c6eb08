"""The content cache keeps caching new images after the shared index filled up.

The index is fixed in size and an entry left it only when its tensors were evicted, which happens
when the partition is full. Small tensors fill the index first: a server that had seen a few
thousand distinct images then decoded every new one, every time, with most of its arena free. Each
frontend now keeps its entries within a quota (half the index over all frontends), evicting its
least recently used image to publish a new one, and the index is sized from the arena.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from shmgate.shared.arena import Partition
from shmgate.shared.cache import ContentCache, TensorGroup
from shmgate.shared.instance import Instance
from shmgate.shared.locks import HolderKind
from shmgate.shared.segment import (
    MAX_INDEX_CAPACITY,
    MIN_INDEX_CAPACITY,
    LockId,
    SlotState,
    index_capacity_for,
)

CAPACITY = 64  # 32 entries for one frontend: a quarter of what fits in the partition below
IMAGES = 200


def _key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()


def _make(i: int):  # type: ignore[no-untyped-def]
    def make(allocate) -> None:  # type: ignore[no-untyped-def]
        allocate("pixels", "uint8", (1024,))[:] = i % 251

    return make


@pytest.fixture
def cache():  # type: ignore[no-untyped-def]
    inst = Instance.create(arena_size=1 << 20, n_frontends=1, n_workers=1, queue_depth=1, index_capacity=CAPACITY)
    seg = inst.segment
    epoch = seg.claim_slot(seg.frontends, 0)
    seg.frontends[0]["state"] = SlotState.READY
    lock = inst.lock(LockId.INDEX, (HolderKind.FRONTEND, 0, epoch))
    try:
        yield inst, ContentCache(Partition(seg, 0), inst.cache_index(), lock, epoch)
    finally:
        inst.unlink()
        inst.close()


def test_every_new_image_is_cached_after_the_index_filled(cache) -> None:  # type: ignore[no-untyped-def]
    inst, c = cache
    assert IMAGES * 1024 * 4 < c.size, "the partition must never fill: only the index bounds the cache here"
    for i in range(IMAGES):
        group, kind = c.acquire(_key(i), _make(i))
        assert kind == "miss"
        c.release(group)
        again, kind = c.acquire(_key(i), _make(i))
        assert kind == "hit", f"image {i} was decoded again: it was never cached"
        assert np.all(c.partition.array(again.allocations[0], "uint8", (1024,)) == i % 251)
        c.release(again)
        assert inst.cache_index().count() <= CAPACITY // 2, "the index went past half full"
    assert c.index_quota == CAPACITY // 2
    assert c.stats.evictions == IMAGES - c.index_quota
    # the most recent quota's worth stay cached, the older ones were evicted least recently used first
    newest, kind = c.acquire(_key(IMAGES - c.index_quota), _make(0))
    assert kind == "hit"
    c.release(newest)
    oldest, kind = c.acquire(_key(0), _make(0))
    assert kind == "miss"
    c.release(oldest)


def test_held_images_are_never_evicted_for_the_index(cache) -> None:  # type: ignore[no-untyped-def]
    """With every entry of ours held by a request in flight, a new image is served but not indexed."""
    inst, c = cache
    held: list[TensorGroup] = []
    for i in range(c.index_quota):
        group, _ = c.acquire(_key(i), _make(i))
        held.append(group)
    extra, kind = c.acquire(_key(10_000), _make(7))
    assert kind == "miss" and not extra.indexed
    assert all(g.indexed for g in held) and c.stats.evictions == 0
    assert inst.cache_index().count() == c.index_quota
    c.release(extra)  # private: freed at once
    for group in held:
        c.release(group)
    assert c.held_bytes == 0
    again, kind = c.acquire(_key(10_000), _make(7))  # now an unheld one makes room
    assert kind == "miss" and again.indexed and c.stats.evictions == 1
    c.release(again)


@pytest.mark.parametrize(
    ("arena", "slots"),
    [(1 << 20, MIN_INDEX_CAPACITY), (256 << 20, 8192), (1 << 30, 32768), (64 << 30, MAX_INDEX_CAPACITY)],
)
def test_the_index_is_sized_from_the_arena(arena: int, slots: int) -> None:
    assert index_capacity_for(arena) == slots
    assert slots & (slots - 1) == 0
