"""Per-model arena shares in one frontend's content cache (shared/cache.py ``set_shares``, ``ModelShare``).

A 1 MiB partition, two models with half each: a model's cached images are evicted for the other model
only beyond its share, and a model that would go beyond its own share evicts its own images first.
Free space is anyone's: a share protects what a model keeps, it does not reserve room.
Without shares the cache is one LRU for everything (the other tests of the cache cover that).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from shared.arena import Partition
from shared.cache import ContentCache, ModelShare, block_bytes
from shared.errors import ArenaFull
from shared.instance import Instance
from shared.locks import HolderKind
from shared.segment import LockId, SlotState
from shared.vocabulary import AllocateFn

PARTITION = 1 << 20
IMAGE = 100_000  # bytes of one cached image: ten fit the partition, five a half share


@contextlib.contextmanager
def shared_cache() -> Iterator[ContentCache]:
    inst = Instance.create(arena_size=PARTITION, n_frontends=1, n_workers=1, queue_depth=1, index_capacity=256)
    try:
        seg = inst.segment
        epoch = seg.claim_slot(seg.frontends, 0)
        seg.frontends[0]["state"] = SlotState.READY
        lock = inst.lock(LockId.INDEX, (HolderKind.FRONTEND, 0, epoch))
        yield ContentCache(Partition(seg, 0), inst.cache_index(), lock, epoch)
    finally:
        inst.unlink()
        inst.close()


def _make(allocate: AllocateFn) -> None:
    allocate("pixels", "uint8", (IMAGE,))[:] = 7


def _cache_one(view: ModelShare, key: bytes) -> None:
    """Place one image for the view's model and release it: cached, unheld, evictable."""
    group, kind = view.acquire(key, _make)
    assert kind == "miss"
    view.release(group)


def _cached(cache: ContentCache, key: bytes) -> bool:
    group = cache.try_hit(key)
    if group is None:
        return False
    cache.release(group)
    return True


def test_a_model_over_its_share_evicts_its_own_images_not_the_others() -> None:
    with shared_cache() as cache:
        cache.set_shares({0: 0.5, 1: 0.5})
        flood, other = ModelShare(cache, 0), ModelShare(cache, 1)
        for i in range(4):
            _cache_one(other, b"other-%d" % i)  # within its half
        for i in range(30):  # the flood: far more than its half
            _cache_one(flood, b"flood-%d" % i)
        assert all(_cached(cache, b"other-%d" % i) for i in range(4)), "the flood evicted the other model's images"
        # free space is anyone's: the flood used what model 1 left, then evicted only its own
        assert cache.owned_bytes(1) == 4 * block_bytes(IMAGE)
        assert _cached(cache, b"flood-29") and not _cached(cache, b"flood-0")


def test_a_model_within_its_share_may_evict_what_another_keeps_beyond_its_share() -> None:
    with shared_cache() as cache:
        cache.set_shares({0: 0.5, 1: 0.5})
        early, late = ModelShare(cache, 0), ModelShare(cache, 1)
        # no share used by model 1 yet: model 0 may fill the partition past its half
        cache.set_shares({0: 0.5})
        for i in range(9):
            _cache_one(early, b"early-%d" % i)
        assert cache.owned_bytes(0) > PARTITION // 2
        cache.set_shares({0: 0.5, 1: 0.5})
        for i in range(4):
            _cache_one(late, b"late-%d" % i)  # evicts model 0's oldest, beyond its share
        assert all(_cached(cache, b"late-%d" % i) for i in range(4))
        assert not _cached(cache, b"early-0")


def test_when_only_protected_images_remain_the_request_gets_arena_full_not_another_model_s_space() -> None:
    with shared_cache() as cache:
        cache.set_shares({0: 0.3, 1: 0.7})
        small, large = ModelShare(cache, 0), ModelShare(cache, 1)
        for i in range(6):
            _cache_one(large, b"large-%d" % i)  # within its 70 %
        held = [small.acquire(b"small-%d" % i, _make)[0] for i in range(2)]  # in flight: not evictable
        with pytest.raises(ArenaFull):
            for i in range(2, 8):  # beyond its 30 %, and its own images are all held
                small.acquire(b"small-%d" % i, _make)
        assert all(_cached(cache, b"large-%d" % i) for i in range(6))
        for group in held:
            small.release(group)
