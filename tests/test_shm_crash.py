"""Processes die with kill -9 at the worst moments; the instance recovers and nothing leaks.

Each test starts the process that will die in a fresh interpreter (spawn), waits until it
says it is in the dangerous state, kills it with SIGKILL and reaps it (so its pid is gone,
which is how a survivor in the same PID namespace learns of the death at once; across
containers the heartbeat ages out instead). Every test unlinks its instance and checks that
nothing of it is left.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shmgate.shared.arena import Partition, read_tensor
from shmgate.shared.cache_index import CacheIndex, EntryState
from shmgate.shared.errors import StaleGeneration
from shmgate.shared.instance import DEAD_AFTER_S, Instance, cleanup_leftovers
from shmgate.shared.locks import HolderKind
from shmgate.shared.segment import LockId
from shmgate.shared.wire import Claimed, Released, Submit, TensorRef
from tests import shm_children
from tests.shm_children import (
    claim_frontend,
    claim_worker,
    entry_key,
    index_entry,
    leftovers,
    pattern,
    scratch_instance,
)

SPAWN = multiprocessing.get_context("spawn")
PARTITION = 4 << 20
REPAIR_BOUND_S = DEAD_AFTER_S + 5  # a survivor must get the lock within this (usually at once)


@pytest.fixture()
def instance() -> Iterator[Instance]:
    with scratch_instance(arena_size=2 * PARTITION, n_frontends=2, n_workers=2, queue_depth=4) as inst:
        yield inst


def start(target: Any, *args: Any) -> tuple[Any, Any]:
    """Start ``target(*args, conn)`` in a spawned child; returns (process, our end of its pipe)."""
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


def survivor_lock(inst: Instance, k: int) -> Any:
    epoch, heartbeat = claim_frontend(inst, k)
    heartbeat.stop()
    return inst.lock(LockId.INDEX, (HolderKind.FRONTEND, k, epoch))


# -- (a) killed inside the index critical section ---------------------------------------------------


def test_lock_held_by_a_killed_frontend_is_repaired_for_the_next_acquirer(instance: Instance) -> None:
    process, conn = start(shm_children.hold_index_lock, instance.names.instance_id, 0)
    try:
        assert receive(conn) == "holding"
        lock = survivor_lock(instance, 1)
        assert not lock.acquire(0.2), "the lock should still be held by the live child"
        assert lock.holder() == (HolderKind.FRONTEND, 0, int(instance.segment.frontends[0]["epoch"]), process.pid)
        kill(process)
    finally:
        shm_children.stop_process(process)
    assert not instance.segment.slot_alive(instance.segment.frontends, 0, DEAD_AFTER_S)
    assert lock.acquire(REPAIR_BOUND_S), "the dead holder's lock was never repaired"
    try:
        assert lock.holder() == (HolderKind.FRONTEND, 1, int(instance.segment.frontends[1]["epoch"]), os.getpid())
        assert instance.cache_index().count() == 0
    finally:
        lock.release()
    assert instance.index_sem.value == 1, "the repair posted the semaphore more than once"


@pytest.mark.parametrize("round_", range(4))
def test_frontend_killed_during_index_inserts_leaves_entries_complete_or_invisible(
    instance: Instance, round_: int
) -> None:
    process, conn = start(shm_children.insert_forever, instance.names.instance_id, 0)
    try:
        epoch = receive(conn)
        time.sleep(0.003 * round_)  # land the kill at a different point of the loop each round
        kill(process)
    finally:
        shm_children.stop_process(process)
    held_by_the_dead = instance.segment.locks[int(LockId.INDEX)]["kind"] != 0
    lock = survivor_lock(instance, 1)
    assert lock.acquire(REPAIR_BOUND_S), "the dead inserter's lock was never repaired"
    try:
        _assert_every_visible_entry_is_complete(instance.cache_index(), epoch, instance.segment.data_offset)
    finally:
        lock.release()
    assert instance.index_sem.value == 1, f"semaphore over-posted (killed inside the section: {held_by_the_dead})"


def _assert_every_visible_entry_is_complete(index: CacheIndex, epoch: int, data_offset: int) -> None:
    """Each VALID row of the raw table is entry i written in full, and a lookup of its key finds it."""
    table = index._table
    rows = np.nonzero(table["state"] == EntryState.VALID)[0]
    assert len(rows) == index.count() > 0
    for row in rows:
        i = (int(table[row]["tensors"][0]["generation"]) - 1) // 4
        expected = index_entry(i, epoch, data_offset)
        assert bytes(table[row]["key"]).ljust(16, b"\0") == expected.key, f"row {row} is torn"
        assert index.lookup(expected.key) == expected, f"entry {i} is torn"


# -- (b) killed while holding allocations ----------------------------------------------------------


def test_partition_of_a_killed_frontend_is_taken_over_and_fully_reusable(instance: Instance) -> None:
    seg = instance.segment
    process, conn = start(shm_children.hold_cached_tensors, instance.names.instance_id, 0, 10)
    try:
        dead_epoch, refs = receive(conn)
        kill(process)
    finally:
        shm_children.stop_process(process)
    index = instance.cache_index()
    assert index.count() == 10

    # Before anyone takes over, the dead frontend's tensors are still whole.
    for i, ref in enumerate(refs):
        assert np.array_equal(read_tensor(seg, ref), pattern(i, ref.nbytes))

    # The successor claims slot 0 (new epoch), builds a fresh Partition and purges the index.
    epoch, heartbeat = claim_frontend(instance, 0)
    heartbeat.stop()
    assert epoch == dead_epoch + 1
    for i in range(10):
        assert index.lookup(entry_key(0, i), seg.frontends["epoch"]) is None, "a dead epoch's entry was a hit"
    partition = Partition(seg, 0)
    lock = instance.lock(LockId.INDEX, (HolderKind.FRONTEND, 0, epoch))
    with lock.hold(REPAIR_BOUND_S):
        assert index.purge_partition(0) == 10
    assert index.count() == 0
    for ref in refs:
        with pytest.raises(StaleGeneration):
            read_tensor(seg, ref)

    # The whole partition is reusable: one block of all of it, then many small ones.
    whole = partition.allocate(partition.size - 64)
    assert whole is not None
    partition.array(whole, "uint8", (whole.nbytes,))[:] = 0xAB
    for ref in refs:
        with pytest.raises(StaleGeneration):
            read_tensor(seg, ref)
    partition.free(whole)
    small = [partition.allocate(1000) for _ in range(100)]
    assert all(a is not None for a in small)
    for a in small:
        partition.free(a)
    assert partition.used_bytes == 0


def test_old_header_over_overwritten_data_is_never_accepted_after_take_over(instance: Instance) -> None:
    """A successor cannot zero the headers of blocks it never knew about.

    The dead frontend had blocks A (big) and B. The successor allocates C over exactly A's
    span plus B's header and has not written C yet (a decode in progress), then allocates and
    writes D right after: B's header is intact while B's data is now D's header and bytes.
    Without the epoch in the block header, a reader of B's old descriptor accepted D's bytes.
    """
    seg = instance.segment
    claim_frontend(instance, 0)[1].stop()
    old = Partition(seg, 0)
    a = old.allocate(100_000)
    b = old.allocate(50_000)
    assert a is not None and b is not None
    old.array(b, "uint8", (b.nbytes,))[:] = pattern(2, b.nbytes)
    b_ref = TensorRef(offset=b.offset, nbytes=b.nbytes, generation=b.generation, dtype="uint8", shape=(b.nbytes,))
    assert np.array_equal(read_tensor(seg, b_ref), pattern(2, b.nbytes))

    claim_frontend(instance, 0)[1].stop()  # the successor (the old owner is gone)
    new = Partition(seg, 0)
    c = new.allocate(b.block - seg.partition_bounds(0)[0])  # spans A and B's header, left unwritten
    d = new.allocate(50_000)
    assert c is not None and d is not None and d.block == b.block + 64
    new.array(d, "uint8", (d.nbytes,))[:] = pattern(4, d.nbytes)
    with pytest.raises(StaleGeneration):
        read_tensor(seg, b_ref)


def test_reader_of_a_dead_frontends_descriptors_sees_old_bytes_or_stale_never_garbage(instance: Instance) -> None:
    seg = instance.segment
    process, conn = start(shm_children.hold_cached_tensors, instance.names.instance_id, 0, 10)
    try:
        _, refs = receive(conn)
        kill(process)
    finally:
        shm_children.stop_process(process)
    partition = None
    outcomes = {"old": 0, "stale": 0}
    for round_ in range(30):
        if round_ == 10:  # take over in the middle of the reads, and overwrite everything
            claim_frontend(instance, 0)[1].stop()
            partition = Partition(seg, 0)
        if partition is not None:
            partition.reset()
            for size in (10_000 + 333 * round_, 70_000, 123_456):
                while (a := partition.allocate(size)) is not None:
                    partition.array(a, "uint8", (size,))[:] = pattern(1000 + round_, size)
        for i, ref in enumerate(refs):
            try:
                data = read_tensor(seg, ref)
            except StaleGeneration:
                outcomes["stale"] += 1
                continue
            assert np.array_equal(data, pattern(i, ref.nbytes)), "garbage accepted as a valid tensor"
            outcomes["old"] += 1
    assert outcomes == {"old": 100, "stale": 200}


# -- (c) killed in the middle of writing a tensor --------------------------------------------------


def test_frontend_killed_mid_write_never_publishes_the_half_written_tensor(instance: Instance) -> None:
    seg = instance.segment
    big_nbytes = 2 << 20
    process, conn = start(shm_children.write_slowly, instance.names.instance_id, 0, 4, big_nbytes)
    try:
        forged = receive(conn)  # the half-written tensor's descriptor, which was never sent
        kill(process)
    finally:
        shm_children.stop_process(process)

    raw = np.frombuffer(seg.mm, np.uint8, forged.nbytes, forged.offset)
    expected = pattern(999, forged.nbytes)
    assert np.array_equal(raw[: forged.nbytes // 8], expected[: forged.nbytes // 8])
    assert not np.array_equal(raw, expected), "the kill should have landed mid-write"
    del raw

    requests = instance.request_queue()
    received = []
    while (message := requests.try_receive()) is not None:
        received.append(message)
    requests.close()
    assert [m.request_id for m in received] == [1, 2, 3, 4], "only complete tensors were submitted"
    for message in received:
        (ref,) = message.tensors
        assert np.array_equal(read_tensor(seg, ref), pattern(message.request_id, ref.nbytes))

    claim_frontend(instance, 0)[1].stop()  # the successor reclaims the partition
    partition = Partition(seg, 0)
    for ref in [forged] + [m.tensors[0] for m in received]:
        with pytest.raises(StaleGeneration):
            read_tensor(seg, ref)
    whole = partition.allocate(partition.size - 64)
    assert whole is not None
    partition.free(whole)
    assert partition.used_bytes == 0


# -- a worker killed while it holds a descriptor ---------------------------------------------------


def test_tensors_held_by_a_killed_worker_are_freed_and_late_readers_see_stale(instance: Instance) -> None:
    seg = instance.segment
    claim_frontend(instance, 0)[1].stop()
    partition = Partition(seg, 0)
    requests, replies = instance.request_queue(), instance.reply_queue(0)
    inflight: dict[int, Any] = {}
    try:
        # Request 1 goes to a worker that claims it and is then killed.
        inflight[1] = _submit(partition, requests, 1, 300_000)
        worker, conn = start(shm_children.take_and_hold, instance.names.instance_id, 0)
        try:
            assert receive(conn) == (1, int(pattern(1, 1)[0]))
            kill(worker)
        finally:
            shm_children.stop_process(worker)
        claimed = replies.receive(10.0)
        assert isinstance(claimed, Claimed) and claimed.request_id == 1
        # The frontend learns the claimant died (pid gone here; heartbeat across containers).
        assert not seg.slot_alive(seg.workers, claimed.worker_slot, DEAD_AFTER_S, claimed.worker_epoch)
        partition.free(inflight.pop(1)[0])

        # Request 2 is never taken at all: the frontend frees it at its deadline. A reader that
        # finds it afterwards gets StaleGeneration, never someone else's bytes.
        inflight[2] = _submit(partition, requests, 2, 200_000)
        assert replies.receive(0.2) is None  # nobody answers before the deadline
        partition.free(inflight.pop(2)[0])
        reuse = partition.allocate(200_000)  # the space goes to someone else meanwhile
        assert reuse is not None
        partition.array(reuse, "uint8", (200_000,))[:] = 0x55
        late = requests.receive(1.0)
        assert isinstance(late, Submit) and late.request_id == 2
        with pytest.raises(StaleGeneration):
            read_tensor(seg, late.tensors[0])
        partition.free(reuse)
        assert partition.used_bytes == 0

        # A live worker on the same slot (a replacement) still serves normally.
        epoch, heartbeat = claim_worker(instance, 0)
        heartbeat.stop()
        inflight[3] = _submit(partition, requests, 3, 100_000)
        message = requests.receive(1.0)
        assert np.array_equal(read_tensor(seg, message.tensors[0]), pattern(3, 100_000))
        replies.send(Released(3), 1.0)
        assert isinstance(replies.receive(1.0), Released)
        partition.free(inflight.pop(3)[0])
        assert partition.used_bytes == 0
    finally:
        requests.close()
        replies.close()


def _submit(partition: Partition, requests: Any, rid: int, nbytes: int) -> tuple[Any, TensorRef]:
    allocation = partition.allocate(nbytes)
    assert allocation is not None
    partition.array(allocation, "uint8", (nbytes,))[:] = pattern(rid, nbytes)
    ref = TensorRef(
        offset=allocation.offset, nbytes=nbytes, generation=allocation.generation, dtype="uint8", shape=(nbytes,)
    )
    requests.send(Submit(request_id=rid, reply_slot=partition.slot, model="test", tensors=(ref,)), 1.0)
    return allocation, ref


# -- leftovers of a killed supervisor -----------------------------------------------------------------


# serial (both clean-up tests): cleanup_leftovers removes every dead instance on the machine, and a serve
# starting beside this test would remove its killed creator's instance first.
@pytest.mark.serial
def test_cleanup_removes_the_instance_of_a_killed_creator() -> None:
    process, conn = start(shm_children.create_and_die)
    try:
        instance_id = receive(conn)
        assert leftovers(instance_id), "the child's instance should exist"
        kill(process)
    finally:
        shm_children.stop_process(process)
    assert leftovers(instance_id), "nothing unlinked it: it was killed"
    # A long heartbeat bound: only instances whose creator pid is gone go (not other live tests').
    removed = cleanup_leftovers(dead_after_s=3600)
    assert instance_id in removed
    assert leftovers(instance_id) == []


@pytest.mark.serial
@pytest.mark.skipif(os.geteuid() != 0, reason="making an object owned by another user needs root")
def test_cleanup_leaves_another_users_instance_alone() -> None:
    """Another user's instance is 0600: we can neither attach to it nor unlink it. It must not stop us."""
    from shmgate.shared.names import list_arena_instances, new_instance_id

    other = new_instance_id()
    path = f"/dev/shm/shmgate.{other}.arena"
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)  # not even a valid header: ours would be removed as garbage
    os.chown(path, 65534, 65534)
    try:
        assert other not in list_arena_instances()
        assert other not in cleanup_leftovers()
        assert os.path.exists(path)
    finally:
        os.unlink(path)
