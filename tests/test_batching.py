"""The batch window: waited only for requests known to be coming, cut when the model frees up.

The first tests drive a real ``Batcher`` on a real instance's request queue (POSIX message
queue), playing the frontends by hand: what "more is coming" and "the model is busy" say is
set by the test, so each outcome is a state, not a race. Windows are far longer than the hang
guards, so "the batch was cut early" is a yes/no outcome (old behaviour: the whole window).
The last two tests run a real ``shmgate serve`` (a slow model, a two-minute window): a lone
request is not held for the window, and /metrics counts every batch and its size.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from shmgate.shared.channels import Queue
from shmgate.shared.instance import Instance
from shmgate.shared.wire import Submit
from shmgate.worker import batcher as batcher_module
from shmgate.worker.batcher import Batcher
from tests.serving import (
    Server,
    expected_checksum,
    image_request,
    noise_png,
    start_server,
    stop_and_check,
)
from tests.shm_children import scratch_instance

LONG_WINDOW_S = 120.0  # a window no test may wait out
HANG_S = 30.0  # hang guard: the outcome is "cut early" (seconds at most) or "waited the window"


@pytest.fixture()
def instance() -> Iterator[Instance]:
    with scratch_instance(arena_size=1 << 20, n_frontends=1, n_workers=1, queue_depth=8) as inst:
        yield inst


@pytest.fixture()
def requests(instance: Instance) -> Iterator[Queue]:
    """The worker side of the request queue (closed after the test: its memory counts until then)."""
    q = instance.request_queue()
    try:
        yield q
    finally:
        q.close()


@pytest.fixture()
def wake() -> Iterator[tuple[int, int]]:
    """The wake pipe a worker's prefetcher gives its batcher: (read end, write end), non-blocking."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    try:
        yield read_end, write_end
    finally:
        os.close(read_end)
        os.close(write_end)


def _batcher(
    requests: Queue,
    wake: tuple[int, int],
    *,
    max_batch_wait_s: float = LONG_WINDOW_S,
    more_coming: Callable[[], bool],
    policy: str = "held",
) -> Batcher[int]:
    return Batcher(
        requests,
        max_batch_size=8,
        max_batch_wait_s=max_batch_wait_s,
        on_take=lambda submit: submit.request_id,
        on_invalid=lambda what: pytest.fail(f"invalid message {what!r}"),
        more_coming=more_coming,
        wake_fd=wake[0],
        policy=policy,
    )


def _send(inst: Instance, *request_ids: int) -> None:
    q = inst.request_queue()
    try:
        for request_id in request_ids:
            q.send(Submit(request_id, 0, "checksum"), HANG_S)
    finally:
        q.close()


def _timed_collect(batcher: Batcher[int], **kwargs: object) -> tuple[list[int], float]:
    started = time.monotonic()
    batch = batcher.collect(idle_timeout_s=HANG_S, **kwargs)  # type: ignore[arg-type]
    return batch, time.monotonic() - started


def test_a_lone_request_runs_at_once_instead_of_waiting_the_window(
    instance: Instance, requests: Queue, wake: tuple[int, int]
) -> None:
    _send(instance, 1)
    batch, took = _timed_collect(_batcher(requests, wake, more_coming=lambda: False))
    assert batch == [1]
    assert took < HANG_S


def test_queued_requests_join_the_batch_without_waiting_the_window(
    instance: Instance, requests: Queue, wake: tuple[int, int]
) -> None:
    _send(instance, 1, 2, 3)
    batch, took = _timed_collect(_batcher(requests, wake, more_coming=lambda: False))
    assert batch == [1, 2, 3]
    assert took < HANG_S


def test_the_window_waits_for_a_request_a_frontend_is_still_decoding(
    instance: Instance, requests: Queue, wake: tuple[int, int]
) -> None:
    decoding = threading.Event()
    decoding.set()  # request 2 is admitted and decoding when the batch starts

    def frontend() -> None:
        time.sleep(0.3)  # the decode; the batch must wait for it however long it takes
        decoding.clear()  # as Frontend.submit does: it stops counting the request, then sends it
        _send(instance, 2)

    _send(instance, 1)
    thread = threading.Thread(target=frontend)
    thread.start()
    batch, took = _timed_collect(_batcher(requests, wake, more_coming=decoding.is_set))
    thread.join()
    assert batch == [1, 2]
    assert took < HANG_S


def test_the_window_still_bounds_the_wait(instance: Instance, requests: Queue, wake: tuple[int, int]) -> None:
    _send(instance, 1)
    # a frontend that never finishes decoding: the window (0.2 s) ends the wait
    batch, took = _timed_collect(_batcher(requests, wake, max_batch_wait_s=0.2, more_coming=lambda: True))
    assert batch == [1]
    assert took < HANG_S


def test_a_batch_held_open_while_the_model_is_busy_is_cut_by_the_wake_up(
    instance: Instance, requests: Queue, wake: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hold polls every WAKE_SLICE_S only as a fallback; the wake descriptor cuts it at once."""
    monkeypatch.setattr(batcher_module, "WAKE_SLICE_S", LONG_WINDOW_S)
    busy = threading.Event()
    busy.set()
    batcher = _batcher(requests, wake, max_batch_wait_s=0.0, more_coming=lambda: False, policy="held")

    def model_finishes() -> None:
        time.sleep(0.3)
        _send(instance, 2)  # arrives while the model is still busy: joins the held batch
        time.sleep(0.3)
        busy.clear()
        os.write(wake[1], b"w")

    _send(instance, 1)
    thread = threading.Thread(target=model_finishes)
    thread.start()
    batch, took = _timed_collect(batcher, hold_open=busy.is_set)
    thread.join()
    assert batch == [1, 2]
    assert took < HANG_S


def test_fcfs_a_busy_worker_takes_nothing_so_requests_stay_in_the_shared_queue(
    instance: Instance, requests: Queue, wake: tuple[int, int]
) -> None:
    """Issue 16: what a busy worker would hold, another worker that is free can take instead."""
    _send(instance, 1, 2)
    batcher = _batcher(requests, wake, more_coming=lambda: False, policy="fcfs")
    assert batcher.collect(idle_timeout_s=0.2, hold_open=lambda: True) == []
    assert requests.current_messages() == 2  # still there, for whichever worker frees first


def test_fcfs_the_batch_is_collected_when_the_model_frees_in_arrival_order(
    instance: Instance, requests: Queue, wake: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batcher_module, "WAKE_SLICE_S", LONG_WINDOW_S)  # the wake-up, not a poll, must end it
    busy = threading.Event()
    busy.set()
    batcher = _batcher(requests, wake, more_coming=lambda: False, policy="fcfs")

    def model_finishes() -> None:
        time.sleep(0.2)
        _send(instance, 3)  # arrives while the model is busy: waits in the queue behind 1 and 2
        busy.clear()
        os.write(wake[1], b"w")

    _send(instance, 1, 2)
    thread = threading.Thread(target=model_finishes)
    thread.start()
    batch, took = _timed_collect(batcher, hold_open=busy.is_set)
    thread.join()
    assert batch == [1, 2, 3]
    assert took < HANG_S


def test_fcfs_the_free_worker_takes_what_the_busy_one_left(
    instance: Instance, requests: Queue, wake: tuple[int, int]
) -> None:
    """Two workers on one queue: the busy one's batcher leaves every request to the free one."""
    other = instance.request_queue()
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    try:
        busy_worker = _batcher(requests, wake, more_coming=lambda: False, policy="fcfs")
        free_worker = _batcher(other, (read_end, write_end), more_coming=lambda: False, policy="fcfs")
        _send(instance, 1, 2, 3)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            held = pool.submit(busy_worker.collect, idle_timeout_s=0.5, hold_open=lambda: True)
            taken = pool.submit(free_worker.collect, idle_timeout_s=HANG_S, hold_open=lambda: False)
            assert taken.result(HANG_S) == [1, 2, 3]
            assert held.result(HANG_S) == []
    finally:
        other.close()
        os.close(read_end)
        os.close(write_end)


def test_an_unknown_batch_policy_is_refused(requests: Queue, wake: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="batch policy"):
        _batcher(requests, wake, more_coming=lambda: False, policy="lifo")


@pytest.fixture(scope="module")
def slow_model_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """checksum with a 300 ms model and a two-minute window: batches form only while the model is busy."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SHMGATE_DIAG_BATCH_DELAY_MS", "300")  # read by the workers serve starts
        server = start_server(
            "checksum",
            tmp_path_factory.mktemp("batching"),
            "--workers",
            "1",
            "--max-batch-size",
            "8",
            "--max-batch-wait-ms",
            str(int(LONG_WINDOW_S * 1000)),
        )
    try:
        yield server
    finally:
        stop_and_check(server)


def _ask(server: Server, data: bytes) -> str:
    r = httpx.post(server.base_url + "/v1/chat/completions", json=image_request("checksum", data), timeout=HANG_S)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_lone_request_is_not_held_for_the_window_end_to_end(slow_model_server: Server) -> None:
    image = noise_png(1)
    started = time.monotonic()
    assert expected_checksum(image) in _ask(slow_model_server, image)
    assert time.monotonic() - started < HANG_S


def test_metrics_count_every_batch_and_its_size(slow_model_server: Server) -> None:
    before_count = slow_model_server.metric("shmgate_batch_size_count")
    before_sum = slow_model_server.metric("shmgate_batch_size_sum")
    before_single = _bucket(slow_model_server, "1")
    images = [noise_png(100 + i) for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
        answers = list(pool.map(lambda image: _ask(slow_model_server, image), images))
    for image, answer in zip(images, answers):
        assert expected_checksum(image) in answer
    batches = slow_model_server.metric("shmgate_batch_size_count") - before_count
    assert slow_model_server.metric("shmgate_batch_size_sum") - before_sum == len(images)
    assert 2 <= batches < len(images)  # 12 requests at max batch 8: at least 2 batches, and some batched
    assert _bucket(slow_model_server, "1") - before_single < batches
    assert _bucket(slow_model_server, "+Inf") == slow_model_server.metric("shmgate_batch_size_count")
    assert slow_model_server.metric("shmgate_preparing_requests") == 0


def _bucket(server: Server, le: str) -> float:
    return server.metric(f'shmgate_batch_size_bucket{{le="{le}"}}')


def _voluntary_switches(native_thread_id: int) -> int:
    """How often a thread went to sleep: each wake-up of a waiting thread ends in one."""
    with open(f"/proc/self/task/{native_thread_id}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches in /proc")


def test_a_message_wakes_one_of_two_workers_filling_their_batches(
    instance: Instance, requests: Queue, wake: tuple[int, int]
) -> None:
    """Two workers wait in their batch windows on one queue: each message must wake one, not both.

    Counted from the kernel's side (context switches of the two waiting threads), so it is what a
    worker pays, whatever the code path: a select on the queue's descriptor wakes every waiter.
    """
    other = instance.request_queue()
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    filling = threading.Event()
    filling.set()
    thread_ids: list[int] = []
    batches: list[list[int]] = []

    def worker(queue: Queue, wake_pipe: tuple[int, int]) -> None:
        thread_ids.append(threading.get_native_id())
        batcher = Batcher(
            queue,
            max_batch_size=1000,
            max_batch_wait_s=HANG_S,
            on_take=lambda s: s.request_id,
            on_invalid=lambda what: None,
            more_coming=filling.is_set,
            wake_fd=wake_pipe[0],
        )
        batches.append(batcher.collect(idle_timeout_s=HANG_S))

    messages = 30
    try:
        threads = [
            threading.Thread(target=worker, args=(requests, wake)),
            threading.Thread(target=worker, args=(other, (read_end, write_end))),
        ]
        for thread in threads:
            thread.start()
        _send(instance, 0, 1)  # one each: both are now in their windows, waiting
        time.sleep(0.3)
        before = sum(_voluntary_switches(tid) for tid in thread_ids)
        for request_id in range(2, 2 + messages):
            _send(instance, request_id)
            time.sleep(0.01)  # each message arrives while both wait
        time.sleep(0.1)
        wakeups = sum(_voluntary_switches(tid) for tid in thread_ids) - before
        filling.clear()  # nothing more is coming: the next message each takes ends its batch
        for request_id in range(2 + messages, 4 + messages):
            _send(instance, request_id)
            time.sleep(0.05)
        for thread in threads:
            thread.join(HANG_S)
        assert not any(thread.is_alive() for thread in threads)
        assert sorted(i for batch in batches for i in batch) == list(range(4 + messages))
        assert wakeups < 1.5 * messages, f"{wakeups} wake-ups for {messages} messages"
    finally:
        other.close()
        os.close(read_end)
        os.close(write_end)
