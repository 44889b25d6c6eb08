"""A hit in another frontend's partition, copied on the event loop when nothing would make it wait.

``ContentCache.try_remote_hit`` is what the event loop calls after a local miss of the content key:
it copies the other frontend's tensors into a private group of ours (as a decode thread's ``acquire``
does) only if the index lock is free at once, no decode of the key is pending here, the tensors are
small enough and they fit without evicting; otherwise None, and the image goes to the decode pool.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from shared.arena import Partition
from shared.cache import ContentCache
from shared.instance import Instance
from shared.locks import HolderKind
from shared.segment import LockId, SlotState

KEY = b"k" * 16
SHAPE = (3, 64, 64)
NBYTES = 3 * 64 * 64


def _make(allocate) -> None:  # type: ignore[no-untyped-def]
    allocate("pixels", "uint8", SHAPE)[:] = np.arange(NBYTES, dtype=np.uint32).reshape(SHAPE) % 253


@pytest.fixture
def caches():  # type: ignore[no-untyped-def]
    inst = Instance.create(arena_size=2 << 20, n_frontends=2, n_workers=1, queue_depth=1, index_capacity=256)
    seg = inst.segment
    out = []
    for k in range(2):
        epoch = seg.claim_slot(seg.frontends, k)
        seg.frontends[k]["state"] = SlotState.READY
        lock = inst.lock(LockId.INDEX, (HolderKind.FRONTEND, k, epoch))
        out.append(ContentCache(Partition(seg, k), inst.cache_index(), lock, epoch))
    try:
        yield inst, out
    finally:
        inst.unlink()
        inst.close()


def test_a_remote_hit_is_copied_into_a_private_group_of_ours(caches) -> None:  # type: ignore[no-untyped-def]
    _, (owner, other) = caches
    placed, kind = owner.acquire(KEY, _make)
    assert kind == "miss"
    copy = other.try_remote_hit(KEY, max_bytes=1 << 20)
    assert copy is not None and not copy.indexed and copy.holds == 1
    assert other.stats.remote_hits == 1
    assert copy.refs[0].shape == SHAPE and copy.refs[0].dtype == "uint8"
    ours = other.partition.array(copy.allocations[0], "uint8", SHAPE)
    theirs = owner.partition.array(placed.allocations[0], "uint8", SHAPE)
    assert np.array_equal(ours, theirs)
    assert other.held_bytes == NBYTES
    other.release(copy)  # private: freed at once
    owner.release(placed)
    assert other.partition.used_bytes == 0 and other.held_bytes == 0


def test_it_gives_up_instead_of_waiting(caches) -> None:  # type: ignore[no-untyped-def]
    inst, (owner, other) = caches
    placed, _ = owner.acquire(KEY, _make)
    assert other.try_remote_hit(b"x" * 16, max_bytes=1 << 20) is None, "not in the index at all"
    assert other.try_remote_hit(KEY, max_bytes=NBYTES - 1) is None, "larger than the loop may copy"
    assert owner.try_remote_hit(KEY, max_bytes=1 << 20) is None, "our own partition is a local hit, not remote"
    # the index lock held by someone else (a third process's frontend slot would do the same)
    lock = inst.lock(LockId.INDEX, (HolderKind.FRONTEND, 0, int(inst.segment.frontends[0]["epoch"])))
    assert lock.acquire(1.0)
    try:
        assert other.try_remote_hit(KEY, max_bytes=1 << 20) is None, "waited for the index lock"
    finally:
        lock.release()
    # a decode thread of ours placing something (it may be evicting): the loop does not wait for it
    other._placing.acquire()
    try:
        assert other.try_remote_hit(KEY, max_bytes=1 << 20) is None, "waited for another thread's placement"
    finally:
        other._placing.release()
    # a decode of the same key pending in one of our threads: that thread's result is the one to share
    other._pending[KEY] = threading.Event()
    try:
        assert other.try_remote_hit(KEY, max_bytes=1 << 20) is None
    finally:
        del other._pending[KEY]
    assert other.stats.remote_hits == 0 and other.partition.used_bytes == 0
    copy = other.try_remote_hit(KEY, max_bytes=1 << 20)
    assert copy is not None
    other.release(copy)
    owner.release(placed)


def test_no_room_without_evicting_means_no_copy(caches) -> None:  # type: ignore[no-untyped-def]
    """The loop never evicts: with no free room in our partition it leaves the copy to a thread, which evicts."""
    _, (owner, other) = caches
    placed, _ = owner.acquire(KEY, _make)
    group, _ = other.acquire(b"f" * 16, _make)  # one cached image of ours, evictable once released
    other.release(group)
    while other.partition.allocate(NBYTES) is not None:  # and the rest of the partition taken
        pass
    evictions = other.stats.evictions
    assert other.try_remote_hit(KEY, max_bytes=1 << 20) is None
    assert other.stats.evictions == evictions
    group, kind = other.acquire(KEY, _make)  # the thread path evicts and copies
    assert kind == "remote"
    other.release(group)
    owner.release(placed)
