"""Child-process bodies and helpers for the multi-process shared-memory tests.

The stress and crash tests start these functions in fresh interpreters (multiprocessing's
"spawn" context), so each child attaches to the instance by id exactly as a real frontend or
worker does. They live here, not in the test modules, so a child imports numpy and shared/
only (no pytest, no hypothesis). Children talk to the test through ``multiprocessing`` pipes:
the pipes are harness plumbing; descriptors themselves only ever travel on shmgate queues.

Every blocking call in a child has a timeout, so a broken test fails instead of hanging.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import posix_ipc

from shmgate.shared.arena import Partition, read_tensor, recheck, view_tensor
from shmgate.shared.cache import ContentCache
from shmgate.shared.cache_index import IndexEntry
from shmgate.shared.errors import DescriptorError, StaleGeneration
from shmgate.shared.instance import Instance
from shmgate.shared.locks import HolderKind
from shmgate.shared.names import InstanceNames
from shmgate.shared.segment import MAX_MODELS, Heartbeat, LockId, SlotState
from shmgate.shared.wire import Cancel, Claimed, Released, Submit, TensorRef

STOP_ID = 0  # a Cancel with this request id tells a stress reader to exit


# -- helpers shared by the tests ---------------------------------------------------------------


def pattern(tag: int, nbytes: int) -> np.ndarray:
    """Bytes that only the allocation ``tag`` holds: a 251-byte digest stream, tiled.

    The period is prime, so a shifted or misaligned read does not look right by accident.
    """
    seed = b"".join(hashlib.blake2b(tag.to_bytes(8, "little") + bytes([i]), digest_size=64).digest() for i in range(4))
    return np.resize(np.frombuffer(seed[:251], np.uint8), nbytes)


def entry_key(slot: int, seq: int) -> bytes:
    return hashlib.blake2b(f"{slot}:{seq}".encode(), digest_size=16).digest()


def leftovers(instance_id: str, slots: int = 8) -> list[str]:
    """What of the instance is still there: /dev/shm entries, and queues that still open.

    Queues are probed by name (no /dev/mqueue mount here) for slots below ``slots``.
    """
    found = [entry for entry in os.listdir("/dev/shm") if instance_id in entry]
    names = InstanceNames(instance_id)
    candidates = [names.model_request_queue(i) for i in range(MAX_MODELS)] + [
        names.reply_queue(k) for k in range(slots)
    ]
    candidates += [names.control_queue(w) for w in range(slots)]
    for name in candidates:
        try:
            posix_ipc.MessageQueue(name).close()
        except posix_ipc.ExistentialError:
            continue
        found.append(name)
    return found


@contextlib.contextmanager
def scratch_instance(**create: Any) -> Iterator[Instance]:
    """A fresh instance (``Instance.create(**create)``), removed afterwards and proven gone."""
    inst = Instance.create(**create)
    try:
        yield inst
    finally:
        instance_id = inst.names.instance_id
        inst.unlink()
        inst.close()
        assert leftovers(instance_id) == []


def claim_frontend(inst: Instance, k: int) -> tuple[int, Heartbeat]:
    seg = inst.segment
    epoch = seg.claim_slot(seg.frontends, k)
    seg.frontends[k]["state"] = SlotState.READY
    return epoch, Heartbeat(seg.frontends, k, epoch).start()


def claim_worker(inst: Instance, w: int) -> tuple[int, Heartbeat]:
    seg = inst.segment
    epoch = seg.claim_slot(seg.workers, w, model="test")
    seg.workers[w]["state"] = SlotState.READY
    return epoch, Heartbeat(seg.workers, w, epoch).start()


# -- stress: writers (frontends) and readers (workers) -----------------------------------------


def stress_writer(instance_id: str, k: int, n_allocations: int, seed: int, results: Connection) -> None:
    """Frontend k: allocate, fill, index, submit; free only on the reader's Released."""
    inst = Instance.attach(instance_id)
    epoch, heartbeat = claim_frontend(inst, k)
    seg = inst.segment
    part = Partition(seg, k)
    index = inst.cache_index()
    lock = inst.lock(LockId.INDEX, (HolderKind.FRONTEND, k, epoch))
    requests, replies = inst.request_queue(), inst.reply_queue(k)
    # At most as many in flight as the reply queue holds: a reader's Released never blocks.
    bound = replies.depth
    rng = random.Random(seed)
    inflight: dict[int, tuple[Any, bytes]] = {}
    stats = {"sent": 0, "released": 0, "timeouts": 0, "arena_full": 0, "index_hits": 0, "index_bad": 0}
    seq = 0

    def on_released(rid: int) -> None:
        allocation, key = inflight.pop(rid)
        with lock.hold(5.0):
            if not index.remove(key, k, allocation.generation):
                stats["index_bad"] += 1
        part.free(allocation)  # after the reader said it is done, never before
        stats["released"] += 1

    try:
        while seq < n_allocations or inflight:
            must_wait = len(inflight) >= bound or seq >= n_allocations
            message = replies.receive(10.0) if must_wait else replies.try_receive()
            if must_wait and message is None:
                stats["timeouts"] += 1
                break
            while message is not None:
                assert isinstance(message, Released)
                on_released(message.request_id)
                message = replies.try_receive()
            if seq >= n_allocations or len(inflight) >= bound:
                continue
            nbytes = int(2 ** rng.uniform(6, 16))
            allocation = part.allocate(nbytes)
            if allocation is None:
                stats["arena_full"] += 1
                continue
            rid = (k + 1) << 40 | seq
            part.array(allocation, "uint8", (nbytes,))[:] = pattern(rid, nbytes)
            ref = TensorRef(
                offset=allocation.offset,
                nbytes=nbytes,
                generation=allocation.generation,
                dtype="uint8",
                shape=(nbytes,),
                name=f"{rid}",
            )
            key = entry_key(k, seq)
            with lock.hold(5.0):
                if not index.insert(IndexEntry(key, k, epoch, (ref,))):
                    stats["index_bad"] += 1
                if seq % 4 == 0:
                    _check_other_writers_entry(inst, index, rng, k, stats)
            inflight[rid] = (allocation, key)
            requests.send(Submit(request_id=rid, reply_slot=k, model="stress", tensors=(ref,)), 10.0)
            stats["sent"] += 1
            seq += 1
        stats["used_bytes"] = part.used_bytes
        stats["live_blocks"] = part.live_blocks()
        results.send(stats)
    finally:
        heartbeat.stop()
        seg.frontends[k]["state"] = SlotState.FREE


def _check_other_writers_entry(inst: Instance, index: Any, rng: random.Random, k: int, stats: dict) -> None:
    """Under the index lock: pick a live entry of another writer; it is complete and reads back intact.

    Its owner removes an entry under this lock before freeing the tensor, so what we find
    here must be whole and must read back exactly.
    """
    table = index._table
    candidates = np.nonzero((table["state"] == 1) & (table["partition"] != k))[0]
    if len(candidates) == 0:
        return
    key = bytes(table[int(rng.choice(candidates))]["key"]).ljust(16, b"\0")
    entry = index.lookup(key, inst.segment.frontends["epoch"])
    stats["index_hits"] += 1
    if entry is None or len(entry.tensors) != 1:
        stats["index_bad"] += 1
        return
    (ref,) = entry.tensors
    rid = int(ref.name)
    other, seq = (rid >> 40) - 1, rid & ((1 << 40) - 1)
    good = entry.partition == other and key == entry_key(other, seq)
    if not good or not np.array_equal(read_tensor(inst.segment, ref), pattern(rid, ref.nbytes)):
        stats["index_bad"] += 1


def stress_reader(instance_id: str, w: int, results: Connection) -> None:
    """Worker w: verify every tensor it receives, then tell its writer it is released."""
    inst = Instance.attach(instance_id)
    _, heartbeat = claim_worker(inst, w)
    seg = inst.segment
    requests = inst.request_queue()
    replies: dict[int, Any] = {}
    stats = {"ok": 0, "corrupt": 0, "stale": 0, "rejected": 0, "idle": 0}
    try:
        while True:
            message = requests.receive(1.0)
            if message is None:
                stats["idle"] += 1
                if stats["idle"] > 60:
                    break
                continue
            if isinstance(message, Cancel) and message.request_id == STOP_ID:
                break
            assert isinstance(message, Submit)
            for ref in message.tensors:
                stats[_verify(seg, message.request_id, ref)] += 1
            if message.reply_slot not in replies:
                replies[message.reply_slot] = inst.reply_queue(message.reply_slot)
            replies[message.reply_slot].send(Released(message.request_id), 10.0)
        results.send(stats)
    finally:
        heartbeat.stop()


def _verify(seg: Any, rid: int, ref: TensorRef) -> str:
    expected = pattern(rid, ref.nbytes)
    try:
        if rid % 2:  # the zero-copy path a worker takes: view, use, recheck
            good = np.array_equal(view_tensor(seg, ref), expected)
            recheck(seg, ref)
        else:
            good = np.array_equal(read_tensor(seg, ref), expected)
    except StaleGeneration:
        return "stale"
    except DescriptorError:
        return "rejected"
    return "ok" if good else "corrupt"


# -- crash tests: processes that get killed ------------------------------------------------------


def hold_index_lock(instance_id: str, k: int, conn: Connection) -> None:
    """Take the index lock as frontend k, say so, and sleep inside the critical section."""
    inst = Instance.attach(instance_id)
    epoch, _ = claim_frontend(inst, k)
    lock = inst.lock(LockId.INDEX, (HolderKind.FRONTEND, k, epoch))
    if not lock.acquire(10.0):
        conn.send("timeout")
        return
    conn.send("holding")
    time.sleep(120)


def index_entry(i: int, epoch: int, data_offset: int) -> IndexEntry:
    """Entry number i, every field derived from i, so a torn entry is recognisable."""
    tensors = tuple(
        TensorRef(
            offset=data_offset + 64 * (4 * i + j + 1),
            nbytes=1 + (i * 7 + j) % 1000,
            generation=4 * i + j + 1,
            dtype="uint8",
            shape=(1 + (i * 7 + j) % 1000,),
            name=f"t{i}.{j}",
        )
        for j in range(1 + i % 3)
    )
    return IndexEntry(entry_key(0, i), 0, epoch, tensors)


def insert_forever(instance_id: str, k: int, conn: Connection) -> None:
    """Insert entries 0, 1, 2, ... under the index lock as fast as possible (and drop old ones)."""
    inst = Instance.attach(instance_id)
    epoch, _ = claim_frontend(inst, k)
    lock = inst.lock(LockId.INDEX, (HolderKind.FRONTEND, k, epoch))
    index = inst.cache_index()
    data_offset = inst.segment.data_offset
    i = 0
    while True:
        with lock.hold(10.0):
            index.insert(index_entry(i, epoch, data_offset))
            if i >= 300:
                old = index_entry(i - 300, epoch, data_offset)
                index.remove(old.key, 0, old.tensors[0].generation)
        i += 1
        if i == 200:
            conn.send(epoch)


def hold_cached_tensors(instance_id: str, k: int, n_keys: int, conn: Connection) -> None:
    """Frontend k: cache and hold ``n_keys`` tensors, hand their descriptors out, then sleep."""
    inst = Instance.attach(instance_id)
    epoch, _ = claim_frontend(inst, k)
    lock = inst.lock(LockId.INDEX, (HolderKind.FRONTEND, k, epoch))
    cache = ContentCache(Partition(inst.segment, k), inst.cache_index(), lock, epoch)
    refs = []
    for i in range(n_keys):

        def make(allocate: Any, i: int = i) -> None:
            nbytes = 4096 + 10_000 * i
            allocate("pixels", "uint8", (nbytes,))[:] = pattern(i, nbytes)

        group, kind = cache.acquire(entry_key(k, i), make)
        assert kind == "miss"
        refs.extend(group.refs)
    conn.send((epoch, refs))
    time.sleep(120)


def write_slowly(instance_id: str, k: int, n_small: int, big_nbytes: int, conn: Connection) -> None:
    """Send ``n_small`` complete tensors, then write a big one chunk by chunk (killed meanwhile)."""
    inst = Instance.attach(instance_id)
    epoch, _ = claim_frontend(inst, k)
    part = Partition(inst.segment, k)
    requests = inst.request_queue()
    for i in range(n_small):
        nbytes = 1000 + 100 * i
        allocation = part.allocate(nbytes)
        assert allocation is not None
        part.array(allocation, "uint8", (nbytes,))[:] = pattern(i + 1, nbytes)  # written before the send
        ref = TensorRef(
            offset=allocation.offset, nbytes=nbytes, generation=allocation.generation, dtype="uint8", shape=(nbytes,)
        )
        requests.send(Submit(request_id=i + 1, reply_slot=k, model="test", tensors=(ref,)), 10.0)
    big = part.allocate(big_nbytes)
    assert big is not None
    ref = TensorRef(offset=big.offset, nbytes=big_nbytes, generation=big.generation, dtype="uint8", shape=(big_nbytes,))
    view = part.array(big, "uint8", (big_nbytes,))
    expected = pattern(999, big_nbytes)
    chunk = big_nbytes // 64
    for c in range(64):
        view[c * chunk : (c + 1) * chunk] = expected[c * chunk : (c + 1) * chunk]
        if c == 8:
            conn.send(ref)  # to the test only, as a forged descriptor: it is never submitted
        time.sleep(0.02)
    # never reached: killed before
    requests.send(Submit(request_id=999, reply_slot=k, model="test", tensors=(ref,)), 10.0)


def take_and_hold(instance_id: str, w: int, conn: Connection) -> None:
    """Worker w: take one request, claim it, report, and hold it (never release)."""
    inst = Instance.attach(instance_id)
    epoch, _ = claim_worker(inst, w)
    message = inst.request_queue().receive(10.0)
    assert isinstance(message, Submit)
    view = view_tensor(inst.segment, message.tensors[0])  # a live zero-copy view into the arena
    inst.reply_queue(message.reply_slot).send(Claimed(message.request_id, w, epoch), 10.0)
    conn.send((message.request_id, int(view[0])))
    time.sleep(120)


def send_behind_a_full_queue(instance_id: str, first_id: int, n_sends: int, conn: Connection) -> None:
    """A frontend's AsyncSender with ``n_sends`` sends waiting on a full request queue; reports, then waits to die."""
    import asyncio

    from shmgate.shared.channels import AsyncSender

    async def main() -> None:
        inst = Instance.attach(instance_id)
        sender = AsyncSender(inst.request_queue())
        sends = []
        for request_id in range(first_id, first_id + n_sends):
            sends.append(asyncio.ensure_future(sender.send(Submit(request_id, 0, "m"), 60.0)))
            await asyncio.sleep(0.02)  # each in the kernel's line of blocked senders before the next
        conn.send(sum(not send.done() for send in sends))
        await asyncio.sleep(120)

    asyncio.run(main())


def create_and_die(conn: Connection) -> None:
    """Create a whole instance (as a supervisor would) and wait to be killed."""
    inst = Instance.create(arena_size=1 << 20, n_frontends=1, n_workers=1, queue_depth=1)
    conn.send(inst.names.instance_id)
    time.sleep(120)


def stop_process(process: Any) -> None:
    """Kill and reap a child that may still be running (test clean-up)."""
    if process.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, 9)
    process.join(10)
