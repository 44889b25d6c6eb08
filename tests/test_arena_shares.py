"""Per-model arena shares in one frontend's content cache (shared/cache.py ``set_shares``, ``ModelShare``).

A 1 MiB partition, two models with half each: a model's cached images are evicted for the other model
only beyond its share, and a model that would go beyond its own share evicts its own images first.
Free space is anyone's: a share protects what a model keeps, it does not reserve room.
Without shares the cache is one LRU for everything (the other tests of the cache cover that).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import Iterator

import numpy as np
import pytest
from PIL import Image

from shmgate.gateway.images import ImageResolver
from shmgate.gateway.metrics import FrontendStats
from shmgate.shared.arena import Partition
from shmgate.shared.cache import ContentCache, ModelShare, block_bytes
from shmgate.shared.errors import ArenaFull
from shmgate.shared.instance import Instance
from shmgate.shared.locks import HolderKind
from shmgate.shared.segment import LockId, SlotState
from shmgate.shared.stats_layout import STATS_WORDS
from shmgate.shared.vocabulary import AllocateFn, TensorGroup
from tests.test_arena_placement import NaturalSize

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


# -- the resolver's pack-from-empty retry (gateway/images.py) under fragmentation ---------------------------

SMALL = 99_000  # cached images: a hole of one is too small for the request's 224 x 224 x 3 tensor


def _png(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", compress_level=0)
    return out.getvalue()


def _place_small(cache: ContentCache, owner: int, key: bytes) -> None:
    group, _ = cache.acquire(key, lambda allocate: allocate("pixels", "uint8", (SMALL,)).fill(1), owner=owner)
    cache.release(group)


def test_the_resolvers_retry_from_an_emptied_cache_spares_another_models_share() -> None:
    """Model 0 keeps five images within its half, placed between model 1's five. Model 1's request needs one
    contiguous block larger than any hole the evictions it may make leave (its own until it is within its share,
    then none: model 0 is within its own), so the resolver retries from an emptied cache: emptying for model 1
    evicts the rest of its own, which frees the top of the partition, and leaves model 0's five where they are."""
    request = _png(224, 224)  # 150,528 bytes of pixels
    assert block_bytes(224 * 224 * 3) > block_bytes(SMALL)  # one freed small slot cannot take it
    assert PARTITION - 9 * block_bytes(SMALL) >= block_bytes(224 * 224 * 3)  # the top slot and the tail can
    with shared_cache() as cache:
        cache.set_shares({0: 0.5, 1: 0.5})
        for i in range(10):  # first-fit, bottom up: 0 1 0 1 0 1 0 1 0 1
            _place_small(cache, i % 2, b"m%d-%d" % (i % 2, i))
        assert cache.owned_bytes(0) == 5 * block_bytes(SMALL) <= PARTITION // 2
        stats = FrontendStats(np.zeros(STATS_WORDS, np.uint64))
        resolver = ImageResolver(ModelShare(cache, 1), NaturalSize(), stats, max_pixels=40_000_000, threads=1)
        try:
            groups: list[TensorGroup] = []
            asyncio.run(resolver.resolve([request], ["image 0"], groups))
            assert groups and groups[0].refs[0].nbytes == 224 * 224 * 3
            resolver.release(groups)
        finally:
            resolver.close()
        assert all(_cached(cache, b"m0-%d" % i) for i in range(0, 9, 2)), "model 1's retry emptied model 0's share"
        assert cache.owned_bytes(1) == block_bytes(224 * 224 * 3)  # the retry emptied model 1's own
        assert not any(_cached(cache, b"m1-%d" % i) for i in range(1, 10, 2))


def test_emptying_for_one_model_keeps_another_models_share_and_takes_what_is_beyond_it() -> None:
    with shared_cache() as cache:
        cache.set_shares({0: 0.25, 1: 0.5})
        for i in range(4):  # model 0: four images, beyond its quarter (2.6 fit it)
            _place_small(cache, 0, b"m0-%d" % i)
        _place_small(cache, 1, b"m1-0")
        ModelShare(cache, 1).clear()
        assert not _cached(cache, b"m1-0")
        # model 0's oldest went until it was back within its share; the rest it keeps
        kept = [i for i in range(4) if _cached(cache, b"m0-%d" % i)]
        assert kept == [2, 3] and cache.owned_bytes(0) <= PARTITION // 4
        cache.clear()  # no model named: everything
        assert cache.used_bytes == 0
