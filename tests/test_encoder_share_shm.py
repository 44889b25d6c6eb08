"""A model's shared vision-tower outputs (shared/encoder_store.py) under concurrency and kill -9.

Workers are spawned interpreters that attach by instance id, as real workers do. Every output's bytes
are a function of its key (tests/encoder_share_children.py), so a read is either exactly the
published bytes or a miss; a torn or stale read that slipped through would fail ``wrong == 0``.
Every test unlinks its instance and checks that nothing of it is left in /dev/shm.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shmgate.shared.cache_index import EntryState
from shmgate.shared.encoder_store import EncoderStore
from shmgate.shared.instance import Instance, cleanup_leftovers
from shmgate.shared.locks import HolderKind
from shmgate.shared.names import InstanceNames, new_instance_id
from tests import encoder_share_children as children
from tests.shm_children import scratch_instance

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture()
def instance() -> Iterator[Instance]:
    with scratch_instance(arena_size=2 << 20, n_frontends=1, n_workers=children.N_SLOTS, queue_depth=4) as inst:
        yield inst
        names = [e for e in os.listdir("/dev/shm") if inst.names.instance_id in e]
        assert any(".enc0" in e for e in names), "the test never made the shared encoder segment"


def start(target: Any, *args: Any) -> tuple[Any, Any]:
    ours, theirs = SPAWN.Pipe(duplex=False)
    process = SPAWN.Process(target=target, args=(*args, theirs), daemon=True)
    process.start()
    theirs.close()
    return process, ours


def receive(conn: Any, timeout_s: float = 30.0) -> Any:
    assert conn.poll(timeout_s), "the child did not report in time"
    return conn.recv()


def kill(process: Any) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    assert process.exitcode == -signal.SIGKILL


def test_concurrent_workers_read_exactly_what_was_published_or_miss(instance: Instance) -> None:
    workers = [
        # 64 outputs of 16-208 KiB (7 MiB) in four 1 MiB partitions: blocks are evicted and reused while read
        start(children.stress_worker, instance.names.instance_id, slot, 64, 2.5, seed)
        for seed, slot in enumerate(range(children.N_SLOTS))
    ]
    for _, conn in workers:
        assert receive(conn) == "ready"
    results = [receive(conn) for _, conn in workers]
    for process, _ in workers:
        process.join(10)
        assert process.exitcode == 0
    assert [r["wrong"] for r in results] == [0] * len(results), results
    assert sum(r["hit"] for r in results) > 0, results  # one worker's output served another
    assert sum(r["published"] for r in results) > 0, results
    assert sum(r["evictions"] for r in results) > 0, results  # blocks were reused while others read


def test_a_publisher_killed_mid_write_leaves_no_torn_entry_and_its_successor_takes_over(instance: Instance) -> None:
    reader, reader_conn = start(children.stress_worker, instance.names.instance_id, 0, 12, 4.0, 7)
    assert receive(reader_conn) == "ready"
    rng = random.Random(3)
    for _ in range(5):  # each successor claims the same slot: a new epoch over the dead one's partition
        publisher, conn = start(children.slow_publisher, instance.names.instance_id, 1, 12)
        assert receive(conn) == "ready"
        time.sleep(rng.uniform(0.05, 0.3))
        kill(publisher)
    results = receive(reader_conn)
    reader.join(10)
    assert results["wrong"] == 0, results
    assert results["hit"] > 0, results

    # A successor in this process: the dead publisher's entries are purged, its blocks stale.
    store = children.open_store(instance, 1)
    try:
        table = store._index._table
        live = (table["state"] == EntryState.VALID) & (table["partition"] == 1)
        assert int(np.count_nonzero(live)) == 0
        assert children.publish(store, 100)  # a key the reader never published
        assert children.read_and_check(store, 100) == "hit"
    finally:
        store.close()


def test_a_worker_killed_holding_the_index_lock_costs_misses_then_is_repaired(instance: Instance) -> None:
    holder, conn = start(children.lock_holder, instance.names.instance_id, 2)
    assert receive(conn) == "holding"
    kill(holder)
    began = time.monotonic()
    store = children.open_store(instance, 3)  # its purge waits for the repair of the dead holder's lock
    try:
        assert time.monotonic() - began < 10
        assert children.publish(store, 5)
        assert children.read_and_check(store, 5) == "hit"
    finally:
        store.close()


def test_a_busy_index_is_a_miss_not_a_wait(instance: Instance) -> None:
    store = children.open_store(instance, 0)
    try:
        assert children.publish(store, 1)
        assert store._lock.acquire(1.0)  # another holder, alive: no repair
        try:
            began = time.monotonic()
            assert children.read_and_check(store, 1) == "miss"
            assert not children.publish(store, 2)
            assert time.monotonic() - began < 2.0
        finally:
            store._lock.release()
        assert children.read_and_check(store, 1) == "hit"
    finally:
        store.close()


def test_an_encoder_segment_whose_instance_is_gone_is_removed_by_cleanup() -> None:
    """A worker that made its model's segment while its instance was being unlinked leaves no trace."""
    names = InstanceNames(new_instance_id())
    store = EncoderStore.open(
        names,
        0,
        slot=0,
        n_slots=1,
        partition_bytes=children.PARTITION_BYTES,
        identity=(HolderKind.WORKER, 0, 1),
        is_dead=lambda *_: False,
    )
    store.close()
    assert [e for e in os.listdir("/dev/shm") if names.instance_id in e]  # the segment and its two semaphores
    assert names.instance_id in cleanup_leftovers()
    assert [e for e in os.listdir("/dev/shm") if names.instance_id in e] == []


def test_a_found_output_is_used_only_with_the_dtype_and_shape_this_images_tower_gives(instance: Instance) -> None:
    import torch

    from shmgate.worker.encoder_share import SharedEncoderOutputs

    store = children.open_store(instance, 0)
    try:
        door = SharedEncoderOutputs(store, model="m", device=torch.device("cpu"), merge_size=2)
        features = torch.randn(16, 32)  # grid (1, 8, 8) merged 2x2: 16 tokens
        door.publish(b"k" * 16, (1, 8, 8), features)
        found = door.get(b"k" * 16, (1, 8, 8), torch.float32, 32)
        assert found is not None and torch.equal(found, features)
        assert door.get(b"k" * 16, (1, 8, 8), torch.float32, 64) is None  # another width: never used
        assert door.get(b"k" * 16, (1, 8, 8), torch.bfloat16, 32) is None  # another dtype: another key
        assert door.get(b"k" * 16, (1, 8, 16), torch.float32, 32) is None  # another grid: another key
        assert door.get(b"j" * 16, (1, 8, 8), torch.float32, 32) is None  # another image
        assert door.counters() == (1, 4, 1)
    finally:
        store.close()


def test_a_worker_whose_slot_was_taken_over_publishes_nothing_more(instance: Instance) -> None:
    old = children.open_store(instance, 1)
    new = None
    try:
        assert children.publish(old, 1)
        new = children.open_store(instance, 1)  # a successor claims the slot while the old one still runs
        assert not children.publish(old, 2)
        assert children.read_and_check(new, 1) == "miss"  # the old epoch's entry was purged
        assert children.publish(new, 2) and children.read_and_check(old, 2) == "hit"
    finally:
        old.close()
        if new is not None:
            new.close()
