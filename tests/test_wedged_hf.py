"""A wedged stepping worker (a generation engine on an ``hf:`` model), on a real ``shmgate serve``.

A generation engine steps many times a second, so a worker with work that has made no step for far longer
than its recent steps took is wedged: the supervisor replaces it then (worker/health.py ``StepClock``),
not after the stall timeout, which must cover the slowest batch of any model. The servers here run with
a stall timeout of 600 s, so a replacement before it can only come from the step bound, and the
supervisor's log line says which rule fired.

A worker paused long enough for its frontends to judge it dead (they retry or fail what it had claimed)
and then resumed must not step those requests' rows again: it drops them before its next step and serves
the requests that waited. SIGSTOP makes both cases; the tiny Qwen2-VL (tests/hf_fixture.py) generates with
its end-of-sequence tokens biased away, so its rows run until stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shmgate.shared.segment import HEARTBEAT_LAPSE_S
from shmgate.shared.vocabulary import DEAD_AFTER_S
from tests.hf_fixture import no_eos_bias
from tests.serving import IMAGES, Server, data_url, start_server, stop_and_check, wait_until

GUARD_S = 120.0  # hang guard only; far below the servers' stall timeout is what matters
STALL_TIMEOUT_S = 600
LONG_TOKENS = 8000  # a row that only a stop ends


def _body(model_dir: Path, *, max_tokens: int, stream: bool, bias: bool = True) -> dict:
    body: dict = {
        "model": "tiny-qwen2-vl",
        "stream": stream,
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url((IMAGES / "chelsea_640.jpg").read_bytes())}},
                    {"type": "text", "text": "Describe the photo."},
                ],
            }
        ],
    }
    if bias:
        body["logit_bias"] = no_eos_bias(model_dir)
    return body


class Stream(threading.Thread):
    """One streamed request read in a thread: how many content chunks it got, and how it ended."""

    def __init__(self, server: Server, body: dict) -> None:
        super().__init__(daemon=True)
        self.server, self.body = server, body
        self.chunks = 0
        self.ending = ""  # "done", "in-band:<code>" or "<status>"

    def run(self) -> None:
        with httpx.Client(base_url=self.server.base_url, timeout=GUARD_S) as client:
            with client.stream("POST", "/v1/chat/completions", json=self.body) as response:
                if response.status_code != 200:
                    self.ending = str(response.status_code)
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.ending = self.ending or "done"
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.ending = f"in-band:{chunk['error']['code']}"
                    else:
                        self.chunks += 1


def _post(server: Server, body: dict, out: list[httpx.Response]) -> threading.Thread:
    def send() -> None:
        out.append(httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=GUARD_S))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _streaming(server: Server, model_dir: Path, count: int) -> list[Stream]:
    """``count`` long generations, each streaming before this returns."""
    streams = [Stream(server, _body(model_dir, max_tokens=LONG_TOKENS, stream=True)) for _ in range(count)]
    for stream in streams:
        stream.start()
    wait_until(lambda: all(s.chunks >= 2 for s in streams), GUARD_S, "every long generation streaming")
    return streams


def _serve(model_dir: Path, tmp_path_factory: pytest.TempPathFactory, stall_timeout_s: int) -> Iterator[Server]:
    server = start_server(
        f"hf:{model_dir}",
        tmp_path_factory.mktemp("wedged"),
        "--threads",
        "1",
        "--frontends",
        "1",
        "--stall-timeout-s",
        str(stall_timeout_s),
    )
    try:
        yield server
    finally:
        stop_and_check(server)


@pytest.fixture
def watched(tiny_qwen2_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve(tiny_qwen2_vl_dir, tmp_path_factory, STALL_TIMEOUT_S)


@pytest.fixture
def unwatched(tiny_qwen2_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Stall detection off: nobody replaces a paused worker, so it resumes."""
    yield from _serve(tiny_qwen2_vl_dir, tmp_path_factory, 0)


def test_a_sigstopped_stepping_worker_is_replaced_by_its_step_bound_and_the_waiting_requests_are_answered(
    watched: Server, tiny_qwen2_vl_dir: Path
) -> None:
    server = watched
    warm = httpx.post(
        server.base_url + "/v1/chat/completions",
        json=_body(tiny_qwen2_vl_dir, max_tokens=40, stream=False),
        timeout=GUARD_S,
    )
    assert warm.status_code == 200, warm.text  # 40 steps: enough for the worker's step bound
    streams = _streaming(server, tiny_qwen2_vl_dir, 2)
    (victim,) = server.pids("worker")
    os.kill(victim, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        answers: list[httpx.Response] = []
        waiting = [_post(server, _body(tiny_qwen2_vl_dir, max_tokens=8, stream=False), answers) for _ in range(2)]
        wait_until(lambda: victim not in server.pids("worker"), GUARD_S, "the wedged worker replaced")
        killed = time.monotonic() - stopped
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone once replaced; never leave a stopped process behind
            os.kill(victim, signal.SIGCONT)
    for thread in (*waiting, *streams):
        thread.join(GUARD_S)
    answered = time.monotonic() - stopped
    log = server.log_path.read_text()
    assert f"(pid {victim}) is wedged: it has work and made no step for" in log, log[-3000:]
    assert "made no progress for" not in log
    # the streams had output when their worker stopped: each ends with a clean in-band error
    assert [s.ending for s in streams] == ["in-band:worker_died"] * 2
    # the requests that waited behind it are answered in full by its replacement
    assert [r.status_code for r in answers] == [200, 200], [r.text[:200] for r in answers]
    assert [r.json()["choices"][0]["finish_reason"] for r in answers] == ["length", "length"]
    assert server.metric("shmgate_worker_stalls_total") == 1
    print(
        f"\nSIGSTOP of a stepping hf worker: killed {killed:.1f} s after the stop, waiting requests answered {answered:.1f} s after it"
    )


def test_a_resumed_worker_drops_the_rows_its_frontends_gave_up_on_before_stepping_again(
    unwatched: Server, tiny_qwen2_vl_dir: Path
) -> None:
    server = unwatched
    streams = _streaming(server, tiny_qwen2_vl_dir, 2)
    (worker,) = server.pids("worker")
    os.kill(worker, signal.SIGSTOP)
    try:
        # queued while the worker still counts as alive (a node with no live worker refuses new requests)
        answers: list[httpx.Response] = []
        waiting = _post(server, _body(tiny_qwen2_vl_dir, max_tokens=8, stream=False, bias=False), answers)
        wait_until(lambda: server.metric("shmgate_request_queue_depth") >= 1, GUARD_S, "a request waiting")
        # the frontend judges the worker dead after 3 s without a heartbeat: the streams, which had
        # output, end with an in-band error
        for stream in streams:
            stream.join(GUARD_S)
        assert [s.ending for s in streams] == ["in-band:worker_died"] * 2
        # and the lapse is long enough for the worker to know it (shared/segment.py HEARTBEAT_LAPSE_S)
        time.sleep(HEARTBEAT_LAPSE_S - DEAD_AFTER_S + 0.5)
        stepped = server.metric("shmgate_engine_step_tokens_total")
    finally:
        os.kill(worker, signal.SIGCONT)
    waiting.join(GUARD_S)
    assert [r.status_code for r in answers] == [200], [r.text[:200] for r in answers]
    # the two rows nobody reads left before the worker's next step: they would run 8,000 tokens otherwise
    wait_until(lambda: server.metric("shmgate_engine_running_requests") == 0, GUARD_S, "no rows running")
    # Dropped by the worker's lapse check, or by the frontends' cancels it reads before each step: either
    # way the steps after the resume ran only the waiting request (its prompt and 8 tokens), not 2 x 8,000
    assert server.metric("shmgate_engine_step_tokens_total") - stepped < 1000
    assert server.pids("worker") == [worker]  # resumed, not replaced
