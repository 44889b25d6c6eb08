"""The worker's pipeline: the next batch is copied and released while the current one runs.

That is the ``held`` batch policy (worker/batcher.py, the default), which these tests pin; with
``fcfs`` a busy worker takes nothing, and one rig test covers that.

Most tests run a real ``Worker`` (real instance, arena, queues, DeviceCopier's CPU path,
the checksum backend) in a thread of the test process and play the frontend by hand on
the real queues. The backend is the checksum backend behind a gate that holds the first
batch until the test opens it, so "while batch k runs" is a state the test controls, not
a timing. The last test kills a worker of a real ``shmgate serve`` while it holds a
prepared batch.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import pytest

from shmgate.shared.arena import Allocation, Partition
from shmgate.shared.channels import Queue
from shmgate.shared.common_options import BatchingOptions
from shmgate.shared.instance import Instance
from shmgate.shared.wire import (
    GRAMMAR_TENSOR,
    INLINE_TENSOR,
    Cancel,
    Claimed,
    Delta,
    Failed,
    Finished,
    Released,
    Submit,
    TensorRef,
)
from shmgate.worker.backends.base import BackendEvent, ModelBackend, WorkItem
from shmgate.worker.backends.checksum import ChecksumBackend
from shmgate.worker.main import Worker, WorkerOptions
from tests.serving import Server, expected_checksum, image_request, noise_png
from tests.shm_children import claim_frontend, leftovers, pattern

HANG_S = 30.0  # hang guard for every wait: never a pass/fail timing
SHAPE = (3, 32, 32)
NBYTES = 3 * 32 * 32


class GatedChecksum(ModelBackend):
    """The checksum backend; its first batch waits for ``gate`` (``started`` lists each batch's ids)."""

    name = "checksum"

    def __init__(self) -> None:
        self.inner = ChecksumBackend()
        self.gate = threading.Event()
        self.started: queue.Queue[list[int]] = queue.Queue()
        self.items: dict[int, WorkItem] = {}  # what each request reached the backend as

    def run(self, batch: Sequence[WorkItem]) -> Iterator[BackendEvent]:
        self.items.update((item.request_id, item) for item in batch)
        self.started.put([item.request_id for item in batch])
        if not self.gate.wait(HANG_S):
            raise RuntimeError("the test never opened the gate")
        yield from self.inner.run(batch)


@dataclass
class Rig:
    """One instance, one frontend played by the test, one worker thread."""

    inst: Instance
    partition: Partition
    backend: GatedChecksum
    worker: Worker
    thread: threading.Thread
    log: dict[int, list[object]] = field(default_factory=dict)  # replies by request id, in arrival order
    queues: dict[str, Queue] = field(default_factory=dict)

    def queue(self, which: str) -> Queue:
        """The test frontend's queues, opened once and closed at teardown (their memory counts until then)."""
        if which not in self.queues:
            opener = {
                "requests": self.inst.request_queue,
                "replies": lambda: self.inst.reply_queue(0),
                "control": lambda: self.inst.control_queue(self.worker.slot),
            }[which]
            self.queues[which] = opener()
        return self.queues[which]

    def place(self, request_id: int) -> tuple[Allocation, TensorRef]:
        """Write request ``request_id``'s tensor into the arena, as a frontend does."""
        allocation = self.partition.allocate(NBYTES)
        assert allocation is not None
        self.partition.array(allocation, "uint8", (NBYTES,))[:] = pattern(request_id, NBYTES)
        return allocation, TensorRef(
            offset=allocation.offset,
            nbytes=NBYTES,
            generation=allocation.generation,
            dtype="uint8",
            shape=SHAPE,
            name="pixels",
        )

    def submit(self, request_id: int, ref: TensorRef | None = None) -> Allocation | None:
        allocation = None
        if ref is None:
            allocation, ref = self.place(request_id)
        self.queue("requests").send(
            Submit(request_id=request_id, reply_slot=0, model="checksum", tensors=(ref,)), HANG_S
        )
        return allocation

    def read_until(self, done: object) -> None:
        """Read replies into ``log`` until ``done(log)`` is true."""
        replies = self.queue("replies")
        deadline = time.monotonic() + HANG_S
        while not done(self.log):  # type: ignore[operator]
            assert time.monotonic() < deadline, f"replies so far: {self.log}"
            message = replies.receive(0.5)
            if message is not None:
                self.log.setdefault(message.request_id, []).append(message)

    def kinds(self, request_id: int) -> list[str]:
        return [type(m).__name__ for m in self.log.get(request_id, [])]

    def started(self) -> list[int]:
        ids = self.backend.started.get(timeout=HANG_S)
        return ids


def _has(kind: type, request_id: int) -> object:
    return lambda log: any(isinstance(m, kind) for m in log.get(request_id, []))


@pytest.fixture()
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    """Max batch size 1 (or the test's indirect parameter), batch window 0."""
    inst = Instance.create(arena_size=4 << 20, n_frontends=1, n_workers=1, queue_depth=4)
    _, heartbeat = claim_frontend(inst, 0)
    backend = GatedChecksum()
    size, policy = getattr(request, "param", (1, "held"))
    options = WorkerOptions(
        model="checksum", batching=BatchingOptions(max_batch_size=size, max_batch_wait_ms=0, batch_policy=policy)
    )
    worker = Worker(inst, options, backend=backend)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    rig = Rig(inst, Partition(inst.segment, 0), backend, worker, thread)
    try:
        yield rig
    finally:
        backend.gate.set()
        worker.stop()
        deadline = time.monotonic() + HANG_S
        while thread.is_alive() and time.monotonic() < deadline:
            rig.queue("replies").receive(0.1)  # keep reading, so a worker never waits on a full channel
        for q in rig.queues.values():
            q.close()
        heartbeat.stop()
        instance_id = inst.names.instance_id
        inst.unlink()
        inst.close()
        assert not thread.is_alive(), "the worker did not stop"
        assert leftovers(instance_id) == []


def _digest(request_id: int) -> str:
    return hashlib.blake2b(pattern(request_id, NBYTES).tobytes(), digest_size=16).hexdigest()


def _answer(rig: Rig, request_id: int) -> str:
    return "".join(m.text for m in rig.log[request_id] if isinstance(m, (Delta, Finished)))  # last piece in Finished


def test_next_batch_is_copied_and_released_while_the_current_one_runs(rig: Rig) -> None:
    rig.submit(1)
    assert rig.started() == [1]  # request 1 is on the model, held there by the gate
    allocation = rig.submit(2)
    assert allocation is not None
    rig.read_until(_has(Released, 2))  # would never come without the pipeline: the model is busy
    assert rig.kinds(1) == ["Claimed", "Released"]
    assert rig.kinds(2) == ["Claimed", "Released"]
    # Released means the worker is done reading the arena: the owner may reuse the bytes now.
    rig.partition.array(allocation, "uint8", (NBYTES,))[:] = 0
    rig.backend.gate.set()
    rig.read_until(lambda log: all(_has(Finished, r)(log) for r in (1, 2)))
    assert rig.started() == [2]
    for request_id in (1, 2):
        kinds = rig.kinds(request_id)
        # Claimed, then Released before any Delta, then exactly one terminal message, last
        assert kinds[:2] == ["Claimed", "Released"] and kinds[-1] == "Finished"
        assert set(kinds[2:-1]) <= {"Delta"}  # a burst of output may ride entirely in the Finished
        assert _digest(request_id) in _answer(rig, request_id)  # the bytes before the overwrite


@pytest.mark.parametrize("rig", [(4, "held")], indirect=True)
def test_the_prepared_batch_stays_open_while_the_model_is_busy(rig: Rig) -> None:
    rig.submit(41)
    assert rig.started() == [41]
    rig.submit(42)
    rig.read_until(_has(Claimed, 42))  # taken; its window (0 ms) is over, but the model is busy
    rig.submit(43)
    rig.read_until(_has(Claimed, 43))  # would never come if 42's batch had been cut alone
    rig.backend.gate.set()
    rig.read_until(lambda log: all(_has(Finished, r)(log) for r in (41, 42, 43)))
    assert rig.started() == [42, 43]  # one batch: what arrived while 41 ran
    for request_id in (42, 43):
        assert rig.kinds(request_id)[:2] == ["Claimed", "Released"]
        assert _digest(request_id) in _answer(rig, request_id)


@pytest.mark.parametrize("rig", [(4, "fcfs")], indirect=True)
def test_fcfs_a_busy_worker_leaves_new_requests_on_the_queue_then_runs_them_in_order(rig: Rig) -> None:
    """Issue 16: nothing is claimed behind a running batch; freed, the worker takes them oldest first."""
    rig.submit(61)
    assert rig.started() == [61]
    rig.submit(62)
    rig.submit(63)
    rig.read_until(_has(Released, 61))
    assert rig.kinds(62) == [] and rig.kinds(63) == []  # not claimed: another worker could take them
    assert rig.queue("requests").current_messages() == 2
    rig.backend.gate.set()
    rig.read_until(lambda log: all(_has(Finished, r)(log) for r in (61, 62, 63)))
    assert rig.started() == [62, 63]  # one batch, in arrival order
    for request_id in (62, 63):
        kinds = rig.kinds(request_id)
        assert kinds[:2] == ["Claimed", "Released"] and kinds[-1] == "Finished"
        assert _digest(request_id) in _answer(rig, request_id)


def test_prompt_token_ids_in_the_arena_reach_the_backend_as_host_bytes(rig: Rig) -> None:
    # An inline payload over the descriptor's limit rides in the arena as __inline__; the worker reads
    # it on the host (no device round trip) and hands it over as WorkItem.inline, not as a tensor.
    _, pixels = rig.place(51)
    allocation = rig.partition.allocate(8)
    assert allocation is not None
    rig.partition.array(allocation, "uint8", (8,))[:] = list(range(1, 9))
    inline = TensorRef(
        offset=allocation.offset,
        nbytes=8,
        generation=allocation.generation,
        dtype="uint8",
        shape=(8,),
        name=INLINE_TENSOR,
    )
    rig.backend.gate.set()
    rig.queue("requests").send(Submit(request_id=51, reply_slot=0, model="checksum", tensors=(pixels, inline)), HANG_S)
    rig.read_until(_has(Finished, 51))
    answer = _answer(rig, 51)
    assert hashlib.blake2b(bytes(range(1, 9)), digest_size=16).hexdigest() in answer
    assert _digest(51) in answer and INLINE_TENSOR not in answer


def _arena_bytes(rig: Rig, data: bytes, name: str) -> TensorRef:
    allocation = rig.partition.allocate(len(data))
    assert allocation is not None
    rig.partition.array(allocation, "uint8", (len(data),))[:] = list(data)
    return TensorRef(allocation.offset, len(data), allocation.generation, "uint8", (len(data),), name)


def test_a_grammar_in_the_arena_reaches_the_backend_in_its_sampling_params(rig: Rig) -> None:
    # A grammar over the descriptor's limit rides in the arena as __grammar__ (shared/wire.py); the worker
    # puts it back into SamplingParams.grammar, and a grammar that is not UTF-8 fails its request alone.
    grammar = '{"grammars":[{"json_schema":{"type":"object","description":"' + "é" * 4000 + '"}}]}'
    _, pixels = rig.place(53)
    carried = _arena_bytes(rig, grammar.encode(), GRAMMAR_TENSOR)
    rig.backend.gate.set()
    rig.queue("requests").send(Submit(request_id=53, reply_slot=0, model="checksum", tensors=(pixels, carried)), HANG_S)
    rig.read_until(_has(Finished, 53))
    item = rig.backend.items[53]
    assert item.params.grammar == grammar and GRAMMAR_TENSOR not in item.tensors
    _, pixels = rig.place(54)
    broken = _arena_bytes(rig, b"\xff\xfe" * 8, GRAMMAR_TENSOR)
    rig.queue("requests").send(Submit(request_id=54, reply_slot=0, model="checksum", tensors=(pixels, broken)), HANG_S)
    rig.read_until(_has(Failed, 54))
    assert 54 not in rig.backend.items
    failed = [m for m in rig.log[54] if isinstance(m, Failed)][0]
    assert "grammar" in failed.message


def test_the_prepared_batch_still_runs_when_the_worker_stops(rig: Rig) -> None:
    rig.submit(11)
    assert rig.started() == [11]
    rig.submit(12)
    rig.read_until(_has(Released, 12))
    rig.worker.stop()  # SIGTERM's handler: stop after the current batch, and run the prepared one
    rig.backend.gate.set()
    rig.read_until(lambda log: all(_has(Finished, r)(log) for r in (11, 12)))
    rig.thread.join(HANG_S)
    assert not rig.thread.is_alive() and rig.worker.exit_code == 0
    assert _digest(12) in _answer(rig, 12)


def test_a_cancel_for_a_prepared_request_ends_it_without_output(rig: Rig) -> None:
    rig.submit(21)
    assert rig.started() == [21]
    rig.submit(22)
    rig.read_until(_has(Released, 22))
    rig.queue("control").send(Cancel(22, 0), HANG_S)
    rig.backend.gate.set()
    rig.read_until(lambda log: all(_has(Finished, r)(log) or _has(Failed, r)(log) for r in (21, 22)))
    assert rig.kinds(22) == ["Claimed", "Released", "Finished"]
    assert _digest(21) in _answer(rig, 21)


def test_a_bad_descriptor_in_the_prepared_batch_fails_only_that_request(rig: Rig) -> None:
    rig.submit(31)
    assert rig.started() == [31]
    allocation, ref = rig.place(32)
    rig.partition.free(allocation)  # the owner freed it: the descriptor's generation is stale now
    rig.submit(32, ref)
    rig.submit(33)
    rig.read_until(lambda log: _has(Failed, 32)(log) and _has(Released, 33)(log))  # while 31 still runs
    assert rig.kinds(32) == ["Claimed", "Released", "Failed"]
    assert rig.log[32][-1].code == "bad_descriptor"  # type: ignore[attr-defined]
    rig.backend.gate.set()
    rig.read_until(lambda log: all(_has(Finished, r)(log) for r in (31, 33)))
    assert _digest(33) in _answer(rig, 33)


# -- a real server: SIGKILL while a worker holds a prepared batch ----------------------------------


@pytest.fixture()
def slow_checksum_server(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    from tests.conftest import _serve

    # Each batch sleeps 300 ms before it runs, so a busy worker always holds a running batch and a
    # prepared (claimed, copied, released) one while the queue has work.
    monkeypatch.setenv("SHMGATE_DIAG_BATCH_DELAY_MS", "300")
    yield from _serve("checksum", tmp_path_factory, "--workers", "2", "--max-batch-size", "2")


def test_requests_of_a_worker_killed_while_it_holds_a_prepared_batch_are_retried(
    slow_checksum_server: Server,
) -> None:
    import httpx

    server = slow_checksum_server
    retries = server.metric("shmgate_retries_total")
    images = [noise_png(9000 + i, size=64) for i in range(12)]
    bodies = [image_request("checksum", d, mime="image/png") for d in images]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=120, limits=httpx.Limits(max_connections=len(bodies))
        ) as client:
            task = asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
            await asyncio.sleep(0.8)  # both workers busy: 12 requests, ~6 per second per worker
            os.kill(server.pids("worker")[0], signal.SIGKILL)
            return await asyncio.wait_for(task, 90)

    responses = asyncio.run(run())
    for data, response in zip(images, responses):
        if response.status_code == 200:
            assert expected_checksum(data) in response.json()["choices"][0]["message"]["content"]
        else:  # only a request whose output had already streamed
            assert response.json()["error"]["code"] == "worker_died", response.text
    # the killed worker held at least its prepared batch (claimed, nothing streamed): retried
    assert server.metric("shmgate_retries_total") >= retries + 1
    deadline = time.monotonic() + 60
    while server.metric("shmgate_in_flight_requests") > 0:  # nothing held: every request ended
        assert time.monotonic() < deadline, "requests stayed in flight"
        time.sleep(0.2)
