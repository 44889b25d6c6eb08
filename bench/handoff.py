"""One preprocessed tensor from a producer process to a consumer process: shmgate's descriptor path
against a pickled ``multiprocessing.Queue`` and a plain memcpy (the measurement the shared-memory
design was built on; docs/benchmarks-history.md "Shared-memory handoff").

Transports (the producer is this process, a frontend's part; each consumer is a spawned child, a
worker's part):

    shmgate             the whole handoff: the array in the producer's hands -> allocate in the arena
                        (shared/arena.py Partition) -> one copy into it -> ``Submit`` descriptor on the
                        POSIX request queue -> the consumer receives, ``view_tensor`` (validate, then a
                        zero-copy view), ``recheck`` -> ``Released`` on the reply queue -> the producer frees
    shmgate_descriptor  the same without the copy (the bytes already in the arena): the descriptor path alone
    mp_queue_pickle     ``multiprocessing.Queue.put(array)`` (pickled through a pipe), an ack back on a second queue
    memcpy              one ``np.copyto`` of the same bytes into destinations cycling through 256 MiB (more
                        than any cache): the physical limit, no second process

Latency (p50/p99, microseconds) is the producer's round trip with one item in flight, from the tensor in
hand to the consumer's acknowledgement (shmgate's: the ``Released``, after which the space is free
again); throughput keeps ``--inflight`` items in flight. Each round runs the transports in one order and
then in the reverse one (A B B A), so each ratio compares measurements taken under the same load; the
table is the median over the rounds. Every child is joined (or killed) and the instance unlinked in a
``finally``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.report import add_arguments, fmt, publish, render_table
from shmgate.shared.arena import Partition, recheck, view_tensor
from shmgate.shared.instance import Instance
from shmgate.shared.vocabulary import SlotState
from shmgate.shared.wire import Cancel, Released, Submit, TensorRef

SIZES: list[tuple[str, tuple[int, ...]]] = [
    ("uint8", (3, 224, 224)),  # a classifier's input, 150 KB
    ("float32", (3, 224, 224)),  # 602 KB
    ("float32", (3, 448, 448)),  # 2.4 MB
    ("float32", (3, 1024, 1024)),  # 12.6 MB
]
TRANSPORTS = ("memcpy", "shmgate", "shmgate_descriptor", "mp_queue_pickle")
COLD_BYTES = 256 << 20
SPAWN = multiprocessing.get_context("spawn")

Send = Callable[[], None]


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


def drive(send: Send, wait_one: Send, n: int, inflight: int, nbytes: int) -> dict[str, float]:
    """Latency with one in flight, then throughput with ``inflight`` in flight (after a warm-up that
    touches every block the throughput phase uses: first-touch page faults are start-up, not handoff)."""
    for _ in range(2):
        for _ in range(inflight):
            send()
        for _ in range(inflight):
            wait_one()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        send()
        wait_one()
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    pending = sent = 0
    t0 = time.perf_counter_ns()
    while sent < 2 * n or pending:
        while pending < inflight and sent < 2 * n:
            send()
            sent, pending = sent + 1, pending + 1
        wait_one()
        pending -= 1
    elapsed_s = (time.perf_counter_ns() - t0) / 1e9
    samples.sort()
    return {
        "p50_us": samples[n // 2],
        "p99_us": samples[min(n - 1, n * 99 // 100)],
        "gb_s": nbytes * sent / elapsed_s / 1e9,
    }


def _consume_descriptors(instance_id: str) -> None:
    """The consumer child (worker slot 0): receive, validate and view, recheck, release; until a Cancel."""
    inst = Instance.attach(instance_id)
    seg = inst.segment
    seg.claim_slot(seg.workers, 0, model="bench")
    requests, replies = inst.request_queue(), inst.reply_queue(0)
    try:
        while isinstance(message := requests.receive(60.0), Submit):
            (ref,) = message.tensors
            view = view_tensor(seg, ref)  # what a worker reads from: no copy
            recheck(seg, ref)
            del view
            replies.send(Released(message.request_id), 10.0)
    finally:
        requests.close()
        replies.close()
        inst.close()


class Shmgate:
    """Frontend slot 0 of a one-frontend instance, with its consumer child in worker slot 0."""

    def __init__(self, arena_bytes: int) -> None:
        self.inst = Instance.create(arena_size=arena_bytes, n_frontends=1, n_workers=1, queue_depth=10)
        self.consumer: Any = None
        try:
            seg = self.inst.segment
            seg.claim_slot(seg.frontends, 0)
            seg.frontends[0]["state"] = SlotState.READY
            self.partition = Partition(seg, 0)
            self.requests, self.replies = self.inst.request_queue(), self.inst.reply_queue(0)
            self.consumer = SPAWN.Process(target=_consume_descriptors, args=(self.inst.names.instance_id,))
            self.consumer.start()
        except BaseException:
            self.close()
            raise
        self.held: dict[int, Any] = {}
        self.next_id = 1

    def submit(self, ref: TensorRef, allocation: Any = None) -> None:
        rid, self.next_id = self.next_id, self.next_id + 1
        self.held[rid] = allocation
        self.requests.send(Submit(request_id=rid, reply_slot=0, model="bench", tensors=(ref,)), 10.0)

    def copy_and_submit(self, src: np.ndarray) -> None:
        """The whole handoff's producer half: allocate, one copy in, submit the descriptor."""
        allocation = self.partition.allocate(src.nbytes)
        if allocation is None:
            raise RuntimeError("the arena is too small for the in-flight bound")
        np.copyto(self.partition.array(allocation, src.dtype.name, src.shape), src)
        self.submit(self._ref(allocation, src), allocation)

    def wait_one(self) -> None:
        message = self.replies.receive(30.0)
        if not isinstance(message, Released):
            raise RuntimeError("the consumer sent no Released within 30 s")
        allocation = self.held.pop(message.request_id)
        if allocation is not None:
            self.partition.free(allocation)

    def run(self, src: np.ndarray, n: int, inflight: int, *, copy: bool) -> dict[str, float]:
        if copy:
            return drive(lambda: self.copy_and_submit(src), self.wait_one, n, inflight, src.nbytes)
        blocks = [self.partition.allocate(src.nbytes) for _ in range(inflight)]
        refs = []
        for block in blocks:
            assert block is not None, "the arena holds the in-flight bound"
            np.copyto(self.partition.array(block, src.dtype.name, src.shape), src)
            refs.append(self._ref(block, src))
        turn = iter(range(1 << 62))
        try:
            return drive(lambda: self.submit(refs[next(turn) % inflight]), self.wait_one, n, inflight, src.nbytes)
        finally:
            for block in blocks:
                self.partition.free(block)  # type: ignore[arg-type]

    @staticmethod
    def _ref(allocation: Any, src: np.ndarray) -> TensorRef:
        return TensorRef(
            offset=allocation.offset,
            nbytes=src.nbytes,
            generation=allocation.generation,
            dtype=src.dtype.name,
            shape=src.shape,
        )

    def close(self) -> None:
        try:
            if self.consumer is not None and self.consumer.is_alive():
                self.requests.send(Cancel(request_id=0, reply_slot=0), 1.0)
                self.consumer.join(10)
        finally:
            if self.consumer is not None and self.consumer.is_alive():
                self.consumer.kill()
                self.consumer.join(5)
            for queue in ("requests", "replies"):
                if hasattr(self, queue):
                    getattr(self, queue).close()
            self.inst.unlink()
            self.inst.close()


def _consume_pickles(items: Any, acks: Any) -> None:
    """The pickled queue's consumer: take arrays until None, acknowledge each once it is unpickled here."""
    while (item := items.get(timeout=60)) is not None:
        acks.put(item[0])


class PickledQueue:
    def __init__(self) -> None:
        self.items, self.acks = SPAWN.Queue(), SPAWN.Queue()
        self.consumer = SPAWN.Process(target=_consume_pickles, args=(self.items, self.acks))
        self.consumer.start()

    def run(self, src: np.ndarray, n: int, inflight: int) -> dict[str, float]:
        return drive(lambda: self.items.put((0, src)), lambda: self.acks.get(timeout=60), n, inflight, src.nbytes)

    def close(self) -> None:
        self.items.put(None)
        self.consumer.join(30)
        if self.consumer.is_alive():
            self.consumer.kill()
            self.consumer.join(5)
        for queue in (self.items, self.acks):
            queue.close()
            queue.join_thread()


def memcpy(src: np.ndarray, n: int) -> dict[str, float]:
    slots = max(2, COLD_BYTES // src.nbytes)
    pool = np.ones(slots * src.nbytes, np.uint8)  # touched: page faults are not measured
    flat = src.reshape(-1).view(np.uint8)
    turn = iter(range(1 << 62))

    def copy() -> None:
        i = next(turn) % slots
        np.copyto(pool[i * src.nbytes : (i + 1) * src.nbytes], flat)

    return drive(copy, lambda: None, n, 1, src.nbytes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="rounds of A B B A (the table: the median)")
    p.add_argument("--samples", type=int, default=300, help="latency samples per size (throughput: twice as many)")
    p.add_argument("--inflight", type=int, default=8, help="items in flight for throughput (1..9: queue depth 10)")
    p.add_argument("--transport", action="append", choices=TRANSPORTS, help="only these (repeatable)")
    add_arguments(p)
    args = p.parse_args(argv)
    if not 1 <= args.inflight <= 9:
        p.error("--inflight must be 1..9")
    which = [t for t in TRANSPORTS if not args.transport or t in args.transport]
    largest = max(_nbytes(*s) for s in SIZES)
    shm = (
        Shmgate(max(64 << 20, (args.inflight + 2) * (largest + 4096)))
        if {"shmgate", "shmgate_descriptor"} & {*which}
        else None
    )
    pickled = PickledQueue() if "mp_queue_pickle" in which else None
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        for dtype, shape in SIZES:
            src = np.random.default_rng(1).integers(0, 255, shape).astype(dtype)
            n = args.samples if src.nbytes < 4 << 20 else max(20, args.samples // 4)
            for transport in [*which, *reversed(which)] * args.rounds:
                if transport == "memcpy":
                    result = memcpy(src, n)
                elif transport == "mp_queue_pickle":
                    assert pickled is not None
                    result = pickled.run(src, n, args.inflight)
                else:
                    assert shm is not None
                    result = shm.run(src, n, args.inflight, copy=transport == "shmgate")
                runs.setdefault((transport, src.nbytes), []).append(result)
            if shm is not None and shm.partition.used_bytes:
                raise RuntimeError("the benchmark leaked arena space")
    finally:
        if shm is not None:
            shm.close()
        if pickled is not None:
            pickled.close()
    results = [
        {
            "transport": t,
            "size_bytes": size,
            **{k: statistics.median(r[k] for r in rs) for k in rs[0]},
            "rounds": len(rs),
        }
        for (t, size), rs in runs.items()
    ]
    rows = [
        (r["transport"], f"{r['size_bytes']:,}", fmt(r["p50_us"]), fmt(r["p99_us"]), fmt(r["gb_s"], 2))
        for r in sorted(results, key=lambda r: (r["size_bytes"], TRANSPORTS.index(r["transport"])))
    ]
    publish(render_table(["transport", "bytes", "p50 µs", "p99 µs", "GB/s in flight"], rows), results, args)
    return 0
