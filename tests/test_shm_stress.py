"""Many frontends and workers hammering one arena: nothing is corrupted, nothing is read stale,
nothing leaks.

Four writer processes (frontend slots 0-3, each the only writer of its own partition) allocate
tensors of random sizes, fill each with bytes derived from its request id, publish it in the
shared cache index and submit its descriptor on the request queue. Two reader processes
(worker slots 0-1) take descriptors off that queue, check the bytes (half through
``read_tensor``, half through the zero-copy ``view_tensor`` + ``recheck``) and send
``Released`` to the writer's reply queue; only then does the writer unpublish and free the
tensor. Writers also look up each other's index entries under the index lock and check that
what they find is complete and reads back intact.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest

from shmgate.shared.instance import Instance
from shmgate.shared.wire import Cancel
from tests import shm_children
from tests.shm_children import STOP_ID, scratch_instance

N_WRITERS = 4
N_READERS = 2
ALLOCATIONS_PER_WRITER = 2_600  # 10,400 in all
PARTITION = 4 << 20


@pytest.fixture()
def instance():  # type: ignore[no-untyped-def]
    with scratch_instance(
        arena_size=N_WRITERS * PARTITION, n_frontends=N_WRITERS, n_workers=N_READERS, queue_depth=4
    ) as inst:
        yield inst


def test_writers_and_readers_exchange_10k_tensors_without_corruption_or_leaks(instance: Instance) -> None:
    ctx = multiprocessing.get_context("spawn")
    instance_id = instance.names.instance_id
    pipes, processes = [], []
    for k in range(N_WRITERS):
        ours, theirs = ctx.Pipe(duplex=False)
        pipes.append(("writer", ours))
        processes.append(
            ctx.Process(target=shm_children.stress_writer, args=(instance_id, k, ALLOCATIONS_PER_WRITER, k, theirs))
        )
    for w in range(N_READERS):
        ours, theirs = ctx.Pipe(duplex=False)
        pipes.append(("reader", ours))
        processes.append(ctx.Process(target=shm_children.stress_reader, args=(instance_id, w, theirs)))
    try:
        for process in processes:
            process.start()
        results: dict[str, list[dict[str, int]]] = {"writer": [], "reader": []}
        deadline = time.monotonic() + 90
        for role, conn in pipes[:N_WRITERS]:  # writers finish once every tensor came back
            assert conn.poll(max(0.0, deadline - time.monotonic())), "a writer did not finish in time"
            results[role].append(conn.recv())
        requests = instance.request_queue()
        for _ in range(N_READERS):
            requests.send(Cancel(STOP_ID, 0), 10.0)
        requests.close()
        for role, conn in pipes[N_WRITERS:]:
            assert conn.poll(max(0.0, deadline - time.monotonic())), "a reader did not finish in time"
            results[role].append(conn.recv())
        for process in processes:
            process.join(10)
            assert process.exitcode == 0
    finally:
        for process in processes:
            shm_children.stop_process(process)

    writers, readers = results["writer"], results["reader"]
    total = sum(w["sent"] for w in writers)
    assert total == N_WRITERS * ALLOCATIONS_PER_WRITER >= 10_000
    assert sum(w["released"] for w in writers) == total, "a tensor was never released"
    assert all(w["timeouts"] == 0 for w in writers)
    assert sum(r["ok"] for r in readers) == total
    assert sum(r["corrupt"] for r in readers) == 0, "a reader saw bytes that were not the writer's"
    assert sum(r["stale"] for r in readers) == 0, "a tensor was freed before its reader released it"
    assert sum(r["rejected"] for r in readers) == 0
    assert all(w["used_bytes"] == 0 and w["live_blocks"] == 0 for w in writers), "a partition is not empty"
    assert sum(w["index_bad"] for w in writers) == 0, "an index entry was torn, missing or did not read back"
    assert sum(w["index_hits"] for w in writers) > 0, "writers never found each other's entries"
    assert instance.cache_index().count() == 0
