"""Self-healing against a real ``shmgate serve``: wedged workers and frontends are detected from their
*progress* (not their heartbeat) and replaced, and no request's data can take a worker down.

The faults come from the checksum backend's diagnostics, honoured only because the server runs with
``SHMGATE_CHECKSUM_FAULTS=1`` (worker/backends/checksum.py): ``checksum:hang`` blocks the model call
forever (the heartbeat thread keeps beating: only progress can tell), ``checksum:crash`` kills the
worker that runs it, ``checksum:device-assert`` raises what a CUDA device-side assert raises, and
``checksum:block-loop <s>`` blocks a frontend's event loop (its build_prompt runs on the loop).
SIGSTOP is the other wedge: the kernel pauses everything, heartbeat included.

Timings printed with ``-s`` feed docs/RELIABILITY.md; assertions use only generous hang guards.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from shmgate.shared.errors import EXIT_CONFIG, EXIT_DECLARED_DEAD
from tests.serving import (
    Server,
    expected_checksum,
    free_port,
    image_request,
    noise_png,
    start_server,
    stop_and_check,
    wait_until,
)

STALL_S = 5.0  # the servers' --stall-timeout-s: above DEAD_AFTER_S (3 s), so a short SIGSTOP is retried, not killed
GUARD_S = 60.0


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    os.environ["SHMGATE_CHECKSUM_FAULTS"] = "1"
    try:
        server = start_server(
            "checksum",
            tmp_path_factory.mktemp("selfheal"),
            "--workers",
            "2",
            "--stall-timeout-s",
            str(STALL_S),
            "--request-timeout-s",
            "50",
        )
    finally:
        del os.environ["SHMGATE_CHECKSUM_FAULTS"]
    try:
        yield server
    finally:
        stop_and_check(server)


def request(seed: int, text: str = "What is in this image?", *, stream: bool = False) -> tuple[bytes, dict]:
    data = noise_png(seed, size=64)
    return data, image_request("checksum", data, mime="image/png", text=text, stream=stream)


def is_right(response: httpx.Response, data: bytes) -> bool:
    return (
        response.status_code == 200 and expected_checksum(data) in response.json()["choices"][0]["message"]["content"]
    )


def error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


def wait_idle(server: Server) -> None:
    wait_until(
        lambda: server.metric("shmgate_in_flight_requests") == 0 and server.metric("shmgate_arena_held_bytes") == 0,
        GUARD_S,
        "holds back to 0",
    )


def wait_full_capacity(server: Server, workers: int = 2) -> float:
    return wait_until(
        lambda: server.metric("shmgate_workers_ready") == workers and len(server.pids("worker")) == workers,
        GUARD_S,
        "every worker ready",
    )


async def _closed_loop(
    base_url: str, clients: int, stop: asyncio.Event, seed: int, text: str = "hi", stream: bool = False
) -> list[tuple[str, float]]:
    """``clients`` connections sending requests back to back until ``stop``; (outcome, seconds) of each."""
    outcomes: list[tuple[str, float]] = []

    async def one(k: int) -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=GUARD_S) as client:
            i = 0
            while not stop.is_set():
                i += 1
                data, body = request(seed + 1000 * k + i, text, stream=stream)
                started = time.monotonic()
                if stream:
                    outcome = await _streamed(client, body, data)
                else:
                    response = await client.post("/v1/chat/completions", json=body)
                    outcome = "ok" if is_right(response, data) else f"{response.status_code}:{response.text[:80]}"
                outcomes.append((outcome, time.monotonic() - started))

    await asyncio.gather(*(one(k) for k in range(clients)))
    return outcomes


async def _streamed(client: httpx.AsyncClient, body: dict, data: bytes) -> str:
    """A streamed answer must be exactly one complete, correct answer, or one clean error."""
    text, errors = "", []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return f"{response.status_code}:{error_code(response)}"
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"]["code"])
                continue
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
    if errors:
        return f"in-band:{errors[0]}"
    answer = json.loads(text)  # a duplicated or interleaved answer is not one JSON document
    assert answer["tensors"][0]["blake2b"] == expected_checksum(data), text[:200]
    return "ok"


# -- wedged workers ---------------------------------------------------------------------------------------


def test_a_sigstopped_worker_under_load_is_replaced_and_no_request_fails(faulty_server: Server) -> None:
    server = faulty_server
    wait_full_capacity(server)
    stalls = server.metric("shmgate_worker_stalls_total")

    async def run() -> tuple[list[tuple[str, float]], float, float]:
        stop = asyncio.Event()
        load = asyncio.ensure_future(_closed_loop(server.base_url, 8, stop, 100_000))
        await asyncio.sleep(1.0)
        victim = server.pids("worker")[0]
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            await asyncio.to_thread(
                wait_until, lambda: victim not in server.pids("worker"), GUARD_S, "the stopped worker killed"
            )
            killed = time.monotonic() - stopped_at
            await asyncio.to_thread(wait_full_capacity, server)
            back = time.monotonic() - stopped_at
        finally:
            try:
                os.kill(victim, signal.SIGCONT)  # (already killed: harmless)
            except ProcessLookupError:
                pass
        await asyncio.sleep(1.0)
        stop.set()
        return await asyncio.wait_for(load, GUARD_S), killed, back

    outcomes, killed, back = asyncio.run(run())
    counts = Counter(outcome for outcome, _ in outcomes)
    assert set(counts) == {"ok"}, counts
    assert back < 30.0 + STALL_S, f"back to full capacity only after {back:.1f} s"
    assert server.metric("shmgate_worker_stalls_total") == stalls + 1
    wait_idle(server)
    slowest = max(seconds for _, seconds in outcomes)
    print(
        f"\nSIGSTOP under load: {len(outcomes)} requests, all correct (slowest {slowest:.1f} s); "
        f"stalled worker killed {killed:.1f} s after the stop, full capacity again after {back:.1f} s"
    )


def test_a_worker_paused_and_resumed_adds_no_duplicate_answer(faulty_server: Server) -> None:
    """SIGSTOP longer than the heartbeat's 3 s (frontends retry its requests elsewhere) but shorter than the
    stall timeout (nobody kills it), then SIGCONT: the resumed worker finishes what it had claimed, and none
    of that may reach a client a second time. Answers stream for 3 s (150 pieces), so a retried request is
    still streaming from its new worker when the resumed one runs the batch it had prepared: before retries
    got a new request id, the two interleaved into one answer and this test failed."""
    server = faulty_server
    wait_full_capacity(server)

    async def run() -> list[tuple[str, float]]:
        stop = asyncio.Event()
        load = asyncio.ensure_future(
            _closed_loop(server.base_url, 8, stop, 200_000, "checksum:trickle 150", stream=True)
        )
        await asyncio.sleep(1.0)
        victim = server.pids("worker")[0]
        os.kill(victim, signal.SIGSTOP)
        await asyncio.sleep(3.0 + (STALL_S - 3.0) / 2)
        os.kill(victim, signal.SIGCONT)
        await asyncio.sleep(2.0)
        stop.set()
        return await asyncio.wait_for(load, GUARD_S)

    outcomes = asyncio.run(run())
    counts = Counter(outcome for outcome, _ in outcomes)
    # mid-stream at the stop: a clean in-band worker_died; everything else one exact answer
    assert set(counts) <= {"ok", "in-band:worker_died"}, counts
    assert counts["ok"] > 0
    wait_idle(server)
    print(f"\nSIGSTOP {3.0 + (STALL_S - 3.0) / 2:.1f} s then SIGCONT: {dict(counts)}, no duplicate answer")


def test_a_worker_whose_model_call_hangs_is_replaced_and_the_request_gets_no_third_worker(
    faulty_server: Server,
) -> None:
    server = faulty_server
    wait_full_capacity(server)
    stalls = server.metric("shmgate_worker_stalls_total")
    starts = server.metric("shmgate_worker_starts_total")

    async def run() -> tuple[httpx.Response, list[bool], float]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=GUARD_S) as client:
            started = time.monotonic()
            hang = asyncio.ensure_future(client.post("/v1/chat/completions", json=request(1, "checksum:hang")[1]))
            await asyncio.sleep(0.5)
            served = []
            while not hang.done():  # the other worker (and the replacements) keep serving meanwhile
                data, body = request(300_000 + len(served))
                response = await client.post("/v1/chat/completions", json=body)
                served.append(is_right(response, data) or error_code(response) == "worker_died")
                await asyncio.sleep(0.2)
            return await hang, served, time.monotonic() - started

    hang, served, took = asyncio.run(run())
    # two workers hung on it and were replaced; it was not handed to a third
    assert hang.status_code == 502 and error_code(hang) == "worker_died", hang.text
    assert all(served) and served
    assert server.metric("shmgate_worker_stalls_total") == stalls + 2
    wait_full_capacity(server)
    assert server.metric("shmgate_worker_starts_total") == starts + 2
    wait_idle(server)
    print(
        f"\nhung model call: detected and replaced twice, the request failed worker_died after {took:.1f} s; "
        f"{len(served)} other requests served meanwhile"
    )


def test_a_request_that_kills_its_worker_kills_two_at_most(faulty_server: Server) -> None:
    server = faulty_server
    wait_full_capacity(server)
    starts = server.metric("shmgate_worker_starts_total")
    response = httpx.post(
        server.base_url + "/v1/chat/completions", json=request(2, "checksum:crash")[1], timeout=GUARD_S
    )
    assert response.status_code == 502 and error_code(response) == "worker_died", response.text
    wait_full_capacity(server)
    assert server.metric("shmgate_worker_starts_total") == starts + 2
    data, body = request(3)
    assert is_right(httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=GUARD_S), data)


def test_a_sticky_device_error_restarts_the_worker_at_once(faulty_server: Server) -> None:
    server = faulty_server
    wait_full_capacity(server)
    starts = server.metric("shmgate_worker_starts_total")
    response = httpx.post(
        server.base_url + "/v1/chat/completions", json=request(4, "checksum:device-assert")[1], timeout=GUARD_S
    )
    assert response.status_code == 500 and error_code(response) == "model_error", response.text
    wait_until(lambda: server.metric("shmgate_worker_starts_total") == starts + 1, GUARD_S, "worker restarted")
    wait_full_capacity(server)
    assert "sticky device error" in server.log_path.read_text()
    data, body = request(5)
    assert is_right(httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=GUARD_S), data)


# -- a wedged frontend ------------------------------------------------------------------------------------


def test_a_frontend_whose_event_loop_is_blocked_is_replaced_and_the_other_is_unaffected(faulty_server: Server) -> None:
    server = faulty_server
    victim_pid = server.frontend_pid(0)
    stalls = server.metric("shmgate_frontend_stalls_total")

    async def run() -> tuple[list[str], str, float]:
        pinned: dict[int, httpx.AsyncClient] = {}
        spare: list[httpx.AsyncClient] = []
        while len(pinned) < 2:  # one keep-alive connection on each frontend
            client = httpx.AsyncClient(
                base_url=server.base_url, timeout=GUARD_S, limits=httpx.Limits(max_connections=1)
            )
            slot = int((await client.get("/health")).headers["x-shmgate-frontend"])
            (spare.append(client) if slot in pinned else pinned.__setitem__(slot, client))
        started = time.monotonic()
        try:
            blocked = asyncio.ensure_future(
                pinned[0].post("/v1/chat/completions", json=request(6, "checksum:block-loop 120")[1])
            )
            other: list[str] = []
            while server.frontend_pid(0) in (victim_pid, None):
                data, body = request(400_000 + len(other))
                response = await pinned[1].post("/v1/chat/completions", json=body)
                other.append("ok" if is_right(response, data) else response.text[:80])
                assert time.monotonic() - started < GUARD_S, "frontend 0 not replaced"
            replaced = time.monotonic() - started
            try:
                await blocked
                victim = "answered"
            except httpx.TransportError as exc:
                victim = type(exc).__name__
        finally:
            for client in [*pinned.values(), *spare]:
                await client.aclose()
        return other, victim, replaced

    other, victim, replaced = asyncio.run(run())
    assert other and set(other) == {"ok"}, other
    assert victim != "answered"  # its connection went with the killed process
    assert server.metric("shmgate_frontend_stalls_total") == stalls + 1
    wait_until(lambda: httpx.get(server.base_url + "/ready", timeout=5).status_code == 200, GUARD_S, "ready")
    print(
        f"\nblocked event loop: frontend 0 replaced {replaced:.1f} s after the block; the other frontend "
        f"answered all {len(other)} requests meanwhile"
    )


# -- a worker in another process tree (compose) -------------------------------------------------------------


def test_a_stalled_worker_attached_by_label_exits_by_itself(tmp_path: Path) -> None:
    """``shmgate gateway`` cannot signal a worker it did not start: it marks the stalled worker's row DEAD,
    and the worker exits (EXIT_DECLARED_DEAD) from its heartbeat thread, stuck model call or not. Here the
    test plays compose's restart policy."""
    label = f"selfheal-{os.getpid()}"
    port = free_port()
    env = {**os.environ, "SHMGATE_CHECKSUM_FAULTS": "1"}
    log = open(tmp_path / "gateway.log", "wb")
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shmgate.gateway",
            "gateway",
            "--port",
            str(port),
            "--model",
            "checksum",
            "--frontends",
            "1",
            "--arena-size",
            "64MiB",
            "--label",
            label,
            "--stall-timeout-s",
            str(STALL_S),
            "--max-workers",
            "2",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = Server(gateway, port, "checksum", tmp_path / "gateway.log")

    def start_worker(n: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shmgate.worker",
                "--model",
                "checksum",
                "--label",
                label,
                "--device",
                "cpu",
                "--threads",
                "1",
            ],
            env=env,
            stdout=open(tmp_path / f"worker{n}.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # its own session: not in the gateway's process tree

    workers = [start_worker(0)]
    try:
        server.wait_ready()
        started = time.monotonic()
        with httpx.Client(base_url=server.base_url, timeout=GUARD_S) as client:
            # SIGSTOP: declared dead while paused; on SIGCONT it must exit rather than serve on
            os.kill(workers[0].pid, signal.SIGSTOP)
            wait_until(lambda: server.metric("shmgate_worker_stalls_total") == 1, GUARD_S, "stall seen")
            os.kill(workers[0].pid, signal.SIGCONT)
            assert workers[0].wait(GUARD_S) == EXIT_DECLARED_DEAD
            stopped_took = time.monotonic() - started
            workers.append(start_worker(1))
            server.wait_ready()
            # a hung model call: the heartbeat thread beats on, and still the worker goes
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(client.post, "/v1/chat/completions", json=request(7, "checksum:hang")[1])
                assert workers[1].wait(GUARD_S) == EXIT_DECLARED_DEAD
                workers.append(start_worker(2))  # its retry hangs this one too; then no third attempt
                assert workers[2].wait(GUARD_S) == EXIT_DECLARED_DEAD
                hung = pending.result(GUARD_S)
            assert hung.status_code == 502 and error_code(hung) == "worker_died", hung.text
            assert server.metric("shmgate_worker_stalls_total") == 3
            workers.append(start_worker(3))
            server.wait_ready()
            data, body = request(8)
            assert is_right(client.post("/v1/chat/completions", json=body), data)
        print(
            f"\nworker in another process tree: SIGSTOPped one exited by itself {stopped_took:.1f} s after the "
            f"stop (on SIGCONT); two hung ones exited by themselves; the hung request failed after 2 attempts"
        )
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        stop_and_check(server)


# -- configuration errors --------------------------------------------------------------------------------


def test_a_configuration_error_stops_serve_with_the_reason_instead_of_restarting(tmp_path: Path) -> None:
    # A checkpoint of an architecture chat does not serve: only the children find out (the flags only
    # check that the directory is a checkpoint), so the supervisor must stop on their exit status.
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmgate.gateway",
            "serve",
            "--port",
            str(free_port()),
            "--model",
            f"hf:{tmp_path}",
            "--frontends",
            "1",
            "--workers",
            "1",
            "--arena-size",
            "64MiB",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "configuration error: " in done.stderr and "model_type 'bert' is not supported" in done.stderr
    assert "failed on a configuration error" in done.stderr
    assert f"exited with {EXIT_CONFIG}; restarting" not in done.stderr
    print(f"\nconfiguration error: serve exited 2 after {time.monotonic() - started:.1f} s")


def test_a_device_typo_stops_serve_before_anything_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmgate.gateway",
            "serve",
            "--port",
            str(free_port()),
            "--model",
            "checksum",
            "--frontends",
            "1",
            "--workers",
            "1",
            "--arena-size",
            "64MiB",
            "--device",
            "gpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--device: 'gpu' is not a device: use cpu, cuda or cuda:N" in done.stderr
    assert "started" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("device", ["gpu", "cuda"])
def test_a_worker_refuses_a_device_it_cannot_use_in_one_line(device: str) -> None:
    """Checked before the worker looks for a gateway: a standalone worker (compose) says it at once."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is usable here")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmgate.worker",
            "--model",
            "checksum",
            "--device",
            device,
            "--label",
            "no-such-gateway",
            "--attach-wait-s",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]  # a usage error, as every command's bad flag value
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shmgate worker: error: ") and "--device" in lines[0], done.stderr


def test_cuda_where_it_cannot_run_stops_serve_with_the_workers_reason_instead_of_restarting(tmp_path: Path) -> None:
    """``cuda`` cannot work with a CPU-only torch (or without a GPU); only the worker, which loads torch,
    can tell. It says so in one line and exits with EXIT_CONFIG; serve stops with status 2 quoting it."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is usable here")
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmgate.gateway",
            "serve",
            "--port",
            str(free_port()),
            "--model",
            "checksum",
            "--frontends",
            "1",
            "--workers",
            "1",
            "--arena-size",
            "64MiB",
            "--device",
            "cuda",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    # Refused by serve itself when it sees no GPU (gateway/config_checks.py), else by the worker,
    # which loads torch: either way one reason, no restarts.
    assert (
        "shmgate serve: error: --device cuda: " in done.stderr
        or "failed on a configuration error: --device cuda" in done.stderr
    ), done.stderr[-2000:]
    assert "restarting" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    print(f"\n--device cuda without CUDA: serve exited 2 after {time.monotonic() - started:.1f} s")


def test_an_unknown_model_stops_serve_before_anything_starts(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmgate.gateway",
            "serve",
            "--port",
            str(free_port()),
            "--model",
            "no-such-model",
            "--frontends",
            "1",
            "--workers",
            "1",
            "--arena-size",
            "64MiB",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "unknown model 'no-such-model'" in done.stderr
    assert "started frontend" not in done.stderr and f"exited with {EXIT_CONFIG}" not in done.stderr


def test_a_worker_that_dies_before_it_is_ever_ready_stops_serve_after_three_tries(tmp_path: Path) -> None:
    """A crash at start-up repeats on every restart: the third death in a row before ready is fatal, with the
    worker's last stderr line. The deaths are real: the worker process is SIGKILLed while it starts."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shmgate.gateway",
                "serve",
                "--port",
                str(port),
                "--model",
                "checksum",
                "--frontends",
                "1",
                "--workers",
                "1",
                "--arena-size",
                "64MiB",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    server = Server(process, port, "checksum", log_path)
    killed: set[int] = set()
    try:
        deadline = time.monotonic() + GUARD_S
        while process.poll() is None and time.monotonic() < deadline:
            for pid in server.pids("worker"):  # a fresh worker imports torch for a second or more: not ready yet
                if pid not in killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
            time.sleep(0.05)
        code = process.wait(GUARD_S)
    finally:
        if process.poll() is None:
            for pid, _ in server.children():  # never leave a server behind, even when the test failed
                os.kill(pid, signal.SIGKILL)
            process.kill()
            process.wait()
    text = log_path.read_text()
    assert code == 2, text[-3000:]
    assert len(killed) == 3, text[-3000:]
    assert "worker process 0 exited 3 times in a row before it became ready (last exit status -9)" in text
    assert "stopped; IPC objects unlinked" in text
