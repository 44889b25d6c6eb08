"""Child-process bodies for the shared encoder outputs' stress and crash tests (tests/test_encoder_share_shm.py).

Each child is a worker in a fresh interpreter (spawn): it attaches to the instance by id, claims a worker
slot, opens its model's store (shared/encoder_store.py) as worker/main.py does, and reports through a
``multiprocessing`` pipe. An output's bytes are a function of its key alone (``expected``), so any read
that returns other bytes, torn or stale, is caught.
"""

from __future__ import annotations

import random
import time
from multiprocessing.connection import Connection

import numpy as np

from shmgate.shared.encoder_store import EncoderStore
from shmgate.shared.instance import Instance
from shmgate.shared.locks import HolderKind
from tests.shm_children import claim_worker, entry_key, pattern

N_SLOTS = 4
PARTITION_BYTES = 1 << 20


def key_of(k: int) -> bytes:
    return entry_key(1000, k)


def shape_of(k: int) -> tuple[int, int]:
    """Outputs of 16 to 208 KiB: a partition holds a handful, so evictions reuse blocks all the time."""
    return (16 + 16 * (k % 13), 256)


def expected(k: int) -> np.ndarray:
    rows, width = shape_of(k)
    return pattern(k + 1, rows * width * 4)


def open_store(inst: Instance, slot: int) -> EncoderStore:
    epoch, _ = claim_worker(inst, slot)
    return EncoderStore.open(
        inst.names,
        0,
        slot=slot,
        n_slots=N_SLOTS,
        partition_bytes=PARTITION_BYTES,
        identity=(HolderKind.WORKER, slot, epoch),
        is_dead=inst.holder_is_dead,
    )


def read_and_check(store: EncoderStore, k: int) -> str:
    """'hit', 'miss' or 'wrong' (bytes other than the ones published under the key)."""
    rows, width = shape_of(k)
    out = np.zeros(rows * width * 4, np.uint8)

    def out_for(dtype: str, shape: tuple[int, ...]) -> np.ndarray | None:
        return out if dtype == "float32" and tuple(shape) == (rows, width) else None

    if not store.get(key_of(k), out_for):
        return "miss"
    return "hit" if np.array_equal(out, expected(k)) else "wrong"


def publish(store: EncoderStore, k: int, *, slow: bool = False) -> bool:
    data = expected(k)

    def write(dest: np.ndarray) -> None:
        if not slow:
            np.copyto(dest, data)
            return
        for part in np.array_split(np.arange(len(data)), 4):  # a kill lands mid-write often
            dest[part] = data[part]
            time.sleep(0.002)

    return store.put(key_of(k), "float32", shape_of(k), write)


def stress_worker(instance_id: str, slot: int, n_keys: int, duration_s: float, seed: int, conn: Connection) -> None:
    """Look each key up; use it when found (checked), else 'run the tower' and publish it."""
    inst = Instance.attach(instance_id)
    store = open_store(inst, slot)
    rng = random.Random(seed)
    counts = {"hit": 0, "miss": 0, "wrong": 0, "published": 0}
    conn.send("ready")
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        k = rng.randrange(n_keys)
        outcome = read_and_check(store, k)
        counts[outcome] += 1
        if outcome == "miss" and publish(store, k):
            counts["published"] += 1
    counts.update(stale=store.stats.stale, evictions=store.stats.evictions)
    conn.send(counts)
    store.close()
    inst.close()


def slow_publisher(instance_id: str, slot: int, n_keys: int, conn: Connection) -> None:
    """Publish every key over and over, each write slow, until killed."""
    inst = Instance.attach(instance_id)
    store = open_store(inst, slot)
    conn.send("ready")
    k = 0
    while True:
        publish(store, k % n_keys, slow=True)
        k += 1


def lock_holder(instance_id: str, slot: int, conn: Connection) -> None:
    """Take the store's index lock and keep it until killed."""
    inst = Instance.attach(instance_id)
    store = open_store(inst, slot)
    assert store._lock.acquire(5.0)
    conn.send("holding")
    time.sleep(600)
