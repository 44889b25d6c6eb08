"""Producer -> consumer handoff of one preprocessed tensor: shmgate against the usual Python ways.

Transports (the producer is this process; each consumer is a spawned child process):

    shmgate             the full handoff: a numpy array in the producer's hands -> one copy into
                        an arena allocation -> descriptor on a shmgate queue -> the consumer
                        receives, validates, holds a zero-copy torch view (torch.frombuffer on
                        the arena), rechecks -> Released back -> the producer frees
    shmgate_descriptor  the same without the copy: the bytes are already in the arena
    mp_queue_pickle     multiprocessing.Queue carrying the pickled numpy array, ack back
    torch_mp_queue      torch.multiprocessing.Queue carrying a torch tensor (moved into shared
                        memory and passed as a file descriptor), ack back
    memcpy              one np.copyto of the same bytes into destinations cycling through 256 MiB
                        (larger than any cache): the physical limit, no second process
    memcpy_shm          diagnostic: the same copy into a POSIX shared-memory mapping (tmpfs,
                        4 KiB pages where /sys/kernel/mm/transparent_hugepage/shmem_enabled is
                        "never"), i.e. the limit for any copy into the arena

Latency (p50/p99, microseconds) is the producer's round trip with one item in flight: from the
tensor in hand to the consumer's acknowledgement (for shmgate: the Released notice, after which
the space is free again). ``oneway_p50_us`` (shmgate only) runs from the start of the handoff to
the consumer holding a usable view, on CLOCK_MONOTONIC, which both processes share. Throughput
(``gb_per_s``) keeps ``--inflight`` items in flight. Extra lines: ``alloc`` (allocate + free of a
partition block), ``index_lock`` (the index critical section, acquire to release, around an
insert, a lookup and a remove) and ``shmgate_stages`` (where one full handoff's time goes).

Usage: ``python bench/handoff.py [--quick] [--json] [--inflight 8] [--transport NAME ...] [--pin same|split]``.
Every child is joined (or killed) and the instance unlinked in a ``finally``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from shmgate.shared.arena import Partition, recheck, validate  # noqa: E402
from shmgate.shared.cache_index import IndexEntry  # noqa: E402
from shmgate.shared.instance import Instance  # noqa: E402
from shmgate.shared.locks import HolderKind  # noqa: E402
from shmgate.shared.segment import LockId, SlotState  # noqa: E402
from shmgate.shared.wire import Cancel, Released, Submit, TensorRef  # noqa: E402

SIZES: list[tuple[int, str, tuple[int, ...]]] = [
    (150_528, "uint8", (3, 224, 224)),
    (602_112, "float32", (3, 224, 224)),
    (2_408_448, "float32", (3, 448, 448)),
    (12_582_912, "float32", (3, 1024, 1024)),
]
TRANSPORTS = ["memcpy", "memcpy_shm", "shmgate_descriptor", "shmgate", "mp_queue_pickle", "torch_mp_queue"]
COLD_BYTES = 256 << 20
WARMUP = 20
SPAWN = multiprocessing.get_context("spawn")


def now_us() -> float:
    return time.perf_counter_ns() / 1000


def percentiles(samples_us: list[float]) -> tuple[float, float]:
    ordered = sorted(samples_us)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def counts(nbytes: int, quick: bool) -> tuple[int, int]:
    """(latency samples, throughput items) for one size: fewer for big tensors."""
    if quick:
        return (60, 60) if nbytes < 4 << 20 else (20, 24)
    if nbytes < 1 << 20:
        return 1000, 2000
    return (400, 800) if nbytes < 4 << 20 else (150, 200)


def drive(
    send: Callable[[str], None], wait_one: Callable[[], None], n_lat: int, n_tp: int, inflight: int, nbytes: int
) -> dict[str, float]:
    """Latency with one in flight (``send("lat")``), then throughput with ``inflight`` in flight."""
    # Warm-up with the full in-flight count, so every block the throughput phase uses has been
    # touched once: first-touch page faults of the arena are a start-up cost, not a handoff cost.
    for _ in range(max(WARMUP, 2 * inflight) // inflight):
        for _ in range(inflight):
            send("warm")
        for _ in range(inflight):
            wait_one()
    samples = []
    for _ in range(n_lat):
        t0 = now_us()
        send("lat")
        wait_one()
        samples.append(now_us() - t0)
    pending = sent = 0
    t0 = now_us()
    while sent < n_tp or pending:
        while pending < inflight and sent < n_tp:
            send("tp")
            sent += 1
            pending += 1
        wait_one()
        pending -= 1
    elapsed_s = (now_us() - t0) / 1e6
    p50, p99 = percentiles(samples)
    return {"p50_us": round(p50, 1), "p99_us": round(p99, 1), "gb_per_s": round(nbytes * n_tp / elapsed_s / 1e9, 3)}


def start_child(process: Any, cpus: set[int] | None) -> None:
    """Start a child, pinned to ``cpus`` if given (a spawned child inherits the affinity mask)."""
    if cpus is None:
        process.start()
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        process.start()
    finally:
        os.sched_setaffinity(0, mine)


def source(nbytes: int) -> np.ndarray:
    return np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8)


# -- memcpy: the physical limit ------------------------------------------------------------------------


def bench_memcpy(nbytes: int, quick: bool, shm: bool = False) -> dict[str, float]:
    slots = max(2, COLD_BYTES // nbytes)
    if shm:
        inst = Instance.create(arena_size=slots * nbytes + (1 << 20), n_frontends=1, n_workers=1, queue_depth=1)
        pool = np.frombuffer(inst.segment.mm, np.uint8, slots * nbytes, inst.segment.data_offset)
    else:
        pool = np.empty(slots * nbytes, np.uint8)
    try:
        pool[:] = 1  # touched, so page faults are not measured
        src = source(nbytes)
        position = [0]

        def copy(_: str) -> None:
            i = position[0] = (position[0] + 1) % slots
            # `pool` is a cell the finally below clears (so the segment can close); ruff reads the
            # `del` as leaving the name undefined here, but copy() only runs inside the try.
            np.copyto(pool[i * nbytes : (i + 1) * nbytes], src)  # noqa: F821

        n_lat, n_tp = counts(nbytes, quick)
        return drive(copy, lambda: None, n_lat, max(n_tp, 2 * slots), 1, nbytes)
    finally:
        del pool
        if shm:
            inst.unlink()
            inst.close()


# -- shmgate --------------------------------------------------------------------------------------------


def shm_consumer(instance_id: str, results: Any) -> None:
    """Worker slot 0: receive, validate, hold a zero-copy torch view, recheck, release."""
    import torch

    dtypes = {"uint8": torch.uint8, "float32": torch.float32}
    inst = Instance.attach(instance_id)
    seg = inst.segment
    seg.claim_slot(seg.workers, 0, model="bench")
    seg.workers[0]["state"] = SlotState.READY
    requests, replies = inst.request_queue(), inst.reply_queue(0)
    oneway: dict[str, list[float]] = {}
    stages: dict[str, dict[str, list[float]]] = {}
    try:
        while True:
            t0 = time.perf_counter_ns()
            message = requests.receive(60.0)
            if message is None or isinstance(message, Cancel):
                break
            t1 = time.perf_counter_ns()
            (ref,) = message.tensors
            validate(seg, ref)
            t2 = time.perf_counter_ns()
            tensor = torch.frombuffer(seg.mm, dtype=dtypes[ref.dtype], count=prod(ref.shape), offset=ref.offset)
            tensor = tensor.view(ref.shape)
            held_ns = time.monotonic_ns()
            t3 = time.perf_counter_ns()
            recheck(seg, ref)
            t4 = time.perf_counter_ns()
            del tensor
            replies.send(Released(message.request_id), 10.0)
            t5 = time.perf_counter_ns()
            if message.model.endswith(":lat"):
                oneway.setdefault(message.model, []).append((held_ns - int.from_bytes(message.inline, "little")) / 1e3)
                samples = stages.setdefault(message.model, {})
                for name, a, b in (
                    ("c_wait_receive", t0, t1),
                    ("c_validate", t1, t2),
                    ("c_view", t2, t3),
                    ("c_recheck", t3, t4),
                    ("c_send_released", t4, t5),
                ):
                    samples.setdefault(name, []).append((b - a) / 1e3)
        results.send({"oneway": oneway, "stages": stages})
    finally:
        requests.close()
        replies.close()


class ShmgateProducer:
    """Frontend slot 0 of a one-frontend instance; the consumer child is worker slot 0."""

    def __init__(self, arena_bytes: int, consumer_cpus: set[int] | None) -> None:
        self.inst = Instance.create(arena_size=arena_bytes, n_frontends=1, n_workers=1, queue_depth=10)
        self.consumer: Any = None
        try:
            seg = self.inst.segment
            seg.claim_slot(seg.frontends, 0)
            seg.frontends[0]["state"] = SlotState.READY
            self.partition = Partition(seg, 0)
            self.requests = self.inst.request_queue()
            self.replies = self.inst.reply_queue(0)
            ours, theirs = SPAWN.Pipe(duplex=False)
            self.results = ours
            self.consumer = SPAWN.Process(target=shm_consumer, args=(self.inst.names.instance_id, theirs), daemon=True)
            start_child(self.consumer, consumer_cpus)
            theirs.close()
        except BaseException:
            self.close()
            raise
        self.inflight: dict[int, Any] = {}
        self.next_id = 1
        self.stages: dict[str, list[float]] = {}

    def _timed(self, tag: str, name: str, t0: int) -> int:
        t1 = time.monotonic_ns()
        if tag.endswith(":lat"):
            self.stages.setdefault(name, []).append((t1 - t0) / 1e3)
        return t1

    def submit(self, ref: TensorRef, tag: str, allocation: Any = None, t0: int | None = None) -> None:
        rid = self.next_id
        self.next_id += 1
        self.inflight[rid] = allocation
        start = (t0 or time.monotonic_ns()).to_bytes(8, "little")
        self.requests.send(Submit(request_id=rid, reply_slot=0, model=tag, tensors=(ref,), inline=start), 10.0)

    def send_copy(self, src: np.ndarray, dtype: str, shape: tuple[int, ...], tag: str) -> None:
        """The full handoff's producer half: allocate, one copy in, submit the descriptor."""
        t0 = time.monotonic_ns()
        allocation = self.partition.allocate(src.nbytes)
        if allocation is None:
            raise RuntimeError("the arena is too small for the in-flight bound")
        t1 = self._timed(tag, "p_allocate", t0)
        np.copyto(self.partition.array(allocation, "uint8", (src.nbytes,)), src)
        t2 = self._timed(tag, "p_copy", t1)
        ref = TensorRef(
            offset=allocation.offset, nbytes=src.nbytes, generation=allocation.generation, dtype=dtype, shape=shape
        )
        self.submit(ref, tag, allocation, t0)
        self._timed(tag, "p_send", t2)

    def wait_one(self, tag: str = "") -> None:
        t0 = time.monotonic_ns()
        message = self.replies.receive(30.0)
        if not isinstance(message, Released):
            raise RuntimeError("the consumer sent no Released within 30 s")
        t1 = self._timed(tag, "p_wait_released", t0)
        allocation = self.inflight.pop(message.request_id)
        if allocation is not None:
            self.partition.free(allocation)
        self._timed(tag, "p_free", t1)

    def close(self) -> dict[str, Any]:
        report: dict[str, Any] = {}
        try:
            if self.consumer is not None and self.consumer.is_alive():
                self.requests.send(Cancel(0, 0), 1.0)
                if self.results.poll(60):
                    report = self.results.recv()
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
        return report


def bench_shmgate(
    sizes: list[tuple[int, str, tuple[int, ...]]],
    quick: bool,
    inflight: int,
    which: list[str],
    before_each_size: Callable[[int], None],
    consumer_cpus: set[int] | None,
) -> list[dict[str, Any]]:
    largest = max(n for n, _, _ in sizes)
    producer = ShmgateProducer(max(64 << 20, (inflight + 2) * (largest + 4096)), consumer_cpus)
    rows: list[dict[str, Any]] = []
    try:
        for nbytes, dtype, shape in sizes:
            before_each_size(nbytes)
            src = source(nbytes)
            if "shmgate" in which:
                producer.stages = {}
                tag = f"shmgate:{nbytes}"
                last = {"phase": ""}

                def send_full(phase: str, tag: str = tag) -> None:
                    last["phase"] = phase
                    producer.send_copy(src, dtype, shape, f"{tag}:{phase}")

                result = drive(
                    send_full,
                    lambda tag=tag: producer.wait_one(f"{tag}:{last['phase']}"),
                    *counts(nbytes, quick),
                    inflight,
                    nbytes,
                )
                rows.append({"transport": "shmgate", "size_bytes": nbytes, **result, "_producer": producer.stages})
            if "shmgate_descriptor" in which:
                blocks = [producer.partition.allocate(nbytes) for _ in range(inflight)]
                refs = []
                for block in blocks:
                    assert block is not None
                    np.copyto(producer.partition.array(block, "uint8", (nbytes,)), src)
                    refs.append(
                        TensorRef(
                            offset=block.offset, nbytes=nbytes, generation=block.generation, dtype=dtype, shape=shape
                        )
                    )
                turn = [0]

                def send_descriptor(phase: str, nbytes: int = nbytes) -> None:
                    turn[0] += 1
                    producer.submit(refs[turn[0] % inflight], f"shmgate_descriptor:{nbytes}:{phase}")

                result = drive(send_descriptor, producer.wait_one, *counts(1, quick), inflight, nbytes)
                rows.append({"transport": "shmgate_descriptor", "size_bytes": nbytes, **result})
                for block in blocks:
                    producer.partition.free(block)
            if producer.partition.used_bytes:
                raise RuntimeError("the benchmark leaked arena space")
    finally:
        report = producer.close()
    return _merge_consumer_report(rows, report)


def _merge_consumer_report(rows: list[dict[str, Any]], report: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        key = f"{row['transport']}:{row['size_bytes']}:lat"
        samples = report.get("oneway", {}).get(key, [])
        if samples:
            row["oneway_p50_us"] = round(percentiles(samples)[0], 1)
        producer = row.pop("_producer", None)
        out.append(row)
        consumer = report.get("stages", {}).get(key)
        if producer and consumer:  # medians of each stage over the latency samples
            stages = {**producer, **consumer}
            out.append(
                {
                    "transport": "shmgate_stages",
                    "size_bytes": row["size_bytes"],
                    **{f"{k}_p50_us": round(percentiles(v)[0], 1) for k, v in stages.items()},
                }
            )
    return out


# -- multiprocessing queues ---------------------------------------------------------------------------------


def mp_consumer(kind: str, items: Any, acks: Any) -> None:
    """Take items until None; acknowledge each once it is usable here."""
    if kind == "torch":
        import torch  # noqa: F401  (registers the tensor reducers before the first item arrives)
    while True:
        item = items.get(timeout=60)
        if item is None:
            break
        acks.put(item[0])
        del item


def bench_mp_queue(
    kind: str, sizes: list[tuple[int, str, tuple[int, ...]]], quick: bool, inflight: int, consumer_cpus: set[int] | None
) -> list[dict[str, Any]]:
    if kind == "torch":
        import torch
        import torch.multiprocessing as tmp

        ctx: Any = tmp.get_context("spawn")
        transport = "torch_mp_queue"
    else:
        ctx = SPAWN
        transport = "mp_queue_pickle"
    items, acks = ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=mp_consumer, args=(kind, items, acks), daemon=True)
    start_child(consumer, consumer_cpus)
    rows = []
    try:
        for nbytes, dtype, shape in sizes:
            src = source(nbytes).view(np.dtype(dtype)).reshape(shape)

            def send(_: str) -> None:
                # A fresh tensor each time, as after preprocessing: torch moves its storage into
                # a new shared-memory file on every put (one copy + file + mmap + fd passing).
                payload = torch.from_numpy(src) if kind == "torch" else src
                items.put((time.monotonic_ns(), payload))

            result = drive(send, lambda: acks.get(timeout=60), *counts(nbytes, quick), inflight, nbytes)
            rows.append({"transport": transport, "size_bytes": nbytes, **result})
    finally:
        items.put(None)
        consumer.join(30)
        if consumer.is_alive():
            consumer.kill()
            consumer.join(5)
        for queue in (items, acks):
            queue.close()
            queue.join_thread()
    return rows


# -- allocation and index lock costs --------------------------------------------------------------------------


def bench_alloc_and_index(quick: bool) -> list[dict[str, Any]]:
    n = 2_000 if quick else 20_000
    inst = Instance.create(arena_size=64 << 20, n_frontends=1, n_workers=1, queue_depth=1)
    rows: list[dict[str, Any]] = []
    try:
        seg = inst.segment
        epoch = seg.claim_slot(seg.frontends, 0)
        seg.frontends[0]["state"] = SlotState.READY
        partition = Partition(seg, 0)
        keep = [partition.allocate(n) for n in (150_528, 602_112, 1_000)]  # a non-trivial free list
        for nbytes, _, _ in SIZES:
            alloc_us, free_us = [], []
            for _ in range(n):
                t0 = now_us()
                allocation = partition.allocate(nbytes)
                t1 = now_us()
                partition.free(allocation)  # type: ignore[arg-type]
                t2 = now_us()
                alloc_us.append(t1 - t0)
                free_us.append(t2 - t1)
            for op, samples in (("allocate", alloc_us), ("free", free_us)):
                p50, p99 = percentiles(samples)
                rows.append(
                    {
                        "transport": "alloc",
                        "op": op,
                        "size_bytes": nbytes,
                        "p50_us": round(p50, 2),
                        "p99_us": round(p99, 2),
                        "gb_per_s": None,
                    }
                )
        for allocation in keep:
            partition.free(allocation)  # type: ignore[arg-type]

        lock = inst.lock(LockId.INDEX, (HolderKind.FRONTEND, 0, epoch))
        index = inst.cache_index()
        ref = TensorRef(
            offset=seg.data_offset + 64,
            nbytes=602_112,
            generation=1,
            dtype="float32",
            shape=(3, 224, 224),
            name="pixels",
        )
        entries = [IndexEntry(os.urandom(16), 0, epoch, (ref,)) for _ in range(min(n, 2_000))]
        epochs = seg.frontends["epoch"]
        held: dict[str, list[float]] = {"insert": [], "lookup": [], "remove": [], "acquire_release": []}
        for _ in range(max(1, n // len(entries))):
            for op in ("insert", "lookup", "remove"):
                for entry in entries:
                    t0 = now_us()
                    lock.acquire(5.0)
                    t1 = now_us()
                    if op == "insert":
                        index.insert(entry)
                    elif op == "lookup":
                        index.lookup(entry.key, epochs)
                    else:
                        index.remove(entry.key, 0, 1)
                    t2 = now_us()
                    lock.release()
                    t3 = now_us()
                    held[op].append(t2 - t1 + (t3 - t2))  # in the section: from acquired to posted
                    held["acquire_release"].append((t1 - t0) + (t3 - t2))
        for op, samples in held.items():
            p50, p99 = percentiles(samples)
            rows.append(
                {
                    "transport": "index_lock",
                    "op": op,
                    "size_bytes": 0,
                    "p50_us": round(p50, 2),
                    "p99_us": round(p99, 2),
                    "gb_per_s": None,
                }
            )
    finally:
        inst.unlink()
        inst.close()
    return rows


# -- main ----------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = [s for s in SIZES if not args.sizes or s[0] in args.sizes]
    which = args.transport or TRANSPORTS
    rows: list[dict[str, Any]] = []

    def emit(new: list[dict[str, Any]]) -> None:
        for row in new:
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)

    def copies(nbytes: int) -> None:
        if "memcpy" in which:
            emit([{"transport": "memcpy", "size_bytes": nbytes, **bench_memcpy(nbytes, args.quick)}])
        if "memcpy_shm" in which:
            emit([{"transport": "memcpy_shm", "size_bytes": nbytes, **bench_memcpy(nbytes, args.quick, shm=True)}])

    consumer_cpus = None
    if args.pin:  # the producer on CPU 0; the consumer on the same CPU or the other one
        os.sched_setaffinity(0, {0})
        consumer_cpus = {0} if args.pin == "same" else {1}

    # The copy baselines run right before shmgate at each size, so that a ratio compares two
    # measurements taken under the same machine load (this machine is shared).
    if "shmgate" in which or "shmgate_descriptor" in which:
        emit(bench_shmgate(sizes, args.quick, args.inflight, which, copies, consumer_cpus))
    else:
        for nbytes, _, _ in sizes:
            copies(nbytes)
    if "mp_queue_pickle" in which:
        emit(bench_mp_queue("pickle", sizes, args.quick, args.inflight, consumer_cpus))
    if "torch_mp_queue" in which:
        emit(bench_mp_queue("torch", sizes, args.quick, args.inflight, consumer_cpus))
    if not args.transport:
        emit(bench_alloc_and_index(args.quick))
    emit([{"transport": "machine", "cpus": os.cpu_count(), "loadavg_1m_at_end": round(os.getloadavg()[0], 2)}])
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'transport':<20} {'size':>10} {'p50 us':>10} {'p99 us':>10} {'GB/s':>8} {'one-way p50':>12}")
    for row in rows:
        if "gb_per_s" not in row:
            continue
        label = row["transport"] + (f"/{row['op']}" if "op" in row else "")
        gbps = "" if row["gb_per_s"] is None else f"{row['gb_per_s']:.2f}"
        print(
            f"{label:<20} {row['size_bytes']:>10} {row['p50_us']:>10} {row['p99_us']:>10} {gbps:>8} "
            f"{row.get('oneway_p50_us', ''):>12}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples: finishes in under a minute")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--inflight", type=int, default=8, help="items in flight for throughput (<= 10)")
    parser.add_argument("--transport", action="append", choices=TRANSPORTS, help="run only these (repeatable)")
    parser.add_argument("--sizes", type=int, nargs="*", help="only these sizes in bytes")
    parser.add_argument(
        "--pin",
        choices=["same", "split"],
        help="pin producer and consumer to one CPU, or to CPUs 0 and 1 (default: the scheduler decides)",
    )
    args = parser.parse_args()
    if not 1 <= args.inflight <= 10:
        parser.error("--inflight must be 1..10 (the POSIX queue depth here is 10)")
    rows = run(args)
    if not args.json:
        print_table(rows)


if __name__ == "__main__":
    main()
