"""A client of ``POST /v1/embeddings`` that hangs up while its vectors are computed cancels the work.

A real ``shmgate gateway`` (efficientnet-lite0, one frontend) and one real ``python -m shmgate.worker``
attached to it, started with ``--diag-batch-delay-ms``: every batch sleeps that long before it runs,
so a request stays in flight, its image pinned in the arena, long enough for a hang-up to land
while the work runs. Clients are raw sockets, so a hang-up is exactly a closed connection at a
chosen moment. Every outcome is read from ``shmgate_requests_total``; the arena's held bytes must
come back to 0 (the hold is released when the worker's terminal message arrives).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.serving import (
    Server,
    data_url,
    free_port,
    noise_png,
    raw_post,
    request_outcomes,
    server_idle,
    stop_and_check,
    wait_until,
)

MODEL = "efficientnet-lite0"
BATCH_DELAY_MS = 2000  # the slow model: long enough to hang up inside it, short enough to keep the tests quick
HANG_GUARD_S = 30.0  # only a hang trips it (the request deadline is 60 s, which would also free the holds)


@pytest.fixture(scope="module")
def slow_embedder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("embed-hangup")
    port = free_port()
    label = f"embed-hangup-{os.getpid()}-{port}"
    gateway_log, worker_log = tmp / "gateway.log", tmp / "worker.log"
    with open(gateway_log, "wb") as out:
        gateway = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shmgate.gateway",
                "gateway",
                "--port",
                str(port),
                "--label",
                label,
                "--model",
                MODEL,
                "--frontends",
                "1",
                "--arena-size",
                "64MiB",
                "--max-workers",
                "2",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Server(gateway, port, MODEL, gateway_log)
    with open(worker_log, "wb") as out:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shmgate.worker",
                "--model",
                MODEL,
                "--label",
                label,
                "--device",
                "cpu",
                "--threads",
                "1",
                "--diag-batch-delay-ms",
                str(BATCH_DELAY_MS),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        server.wait_ready()
        yield server
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        stop_and_check(server)


def _raw_request(inputs: list[str]) -> bytes:
    return raw_post("/v1/embeddings", {"model": MODEL, "input": inputs})


def _hang_up_while_computed(server: Server, inputs: list[str]) -> None:
    """Send the request, wait until all its inputs are in flight, then close the connection."""
    go = threading.Event()

    def client() -> None:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(_raw_request(inputs))
            go.wait(HANG_GUARD_S)
        # leaving the block closes the connection: the hang-up

    thread = threading.Thread(target=client)
    thread.start()
    try:
        wait_until(
            lambda: server.metric("shmgate_in_flight_requests") >= len(inputs), HANG_GUARD_S, "the inputs in flight"
        )
        time.sleep(0.3)  # well inside the worker's delay
    finally:
        go.set()
        thread.join()


def _change_once_released(server: Server, before: dict[str, float], cancelled: int) -> dict[str, float]:
    try:

        def released() -> bool:
            return request_outcomes(server)["cancelled"] >= before["cancelled"] + cancelled and server_idle(server)

        wait_until(released, HANG_GUARD_S, f"{cancelled} cancelled and the arena holds released")
    finally:  # on a failure, what was counted instead (a hang-up not noticed is counted ok)
        after = request_outcomes(server)
        print(
            {o: after[o] - before[o] for o in after},
            server.metric("shmgate_in_flight_requests"),
            server.metric("shmgate_arena_held_bytes"),
        )
    return {o: after[o] - before[o] for o in after}


def test_an_embeddings_client_that_hangs_up_is_counted_cancelled_and_its_arena_hold_released(
    slow_embedder: Server,
) -> None:
    server = slow_embedder
    wait_until(lambda: server_idle(server), HANG_GUARD_S, "idle")
    before = request_outcomes(server)
    _hang_up_while_computed(server, [data_url(noise_png(1, size=128), "image/png")])
    change = _change_once_released(server, before, 1)
    assert change == {"ok": 0, "cancelled": 1, "client_error": 0, "server_error": 0}


def test_every_input_of_a_hung_up_embeddings_request_is_cancelled(slow_embedder: Server) -> None:
    server = slow_embedder
    wait_until(lambda: server_idle(server), HANG_GUARD_S, "idle")
    before = request_outcomes(server)
    # each input is its own request to the workers, as each choice of a chat's n is: each is cancelled
    _hang_up_while_computed(server, [data_url(noise_png(10 + i, size=128), "image/png") for i in range(3)])
    change = _change_once_released(server, before, 3)
    assert change == {"ok": 0, "cancelled": 3, "client_error": 0, "server_error": 0}


def test_an_embeddings_client_that_waits_for_the_slow_model_gets_its_vector(slow_embedder: Server) -> None:
    server = slow_embedder
    before = request_outcomes(server)
    response = httpx.post(
        server.base_url + "/v1/embeddings",
        timeout=HANG_GUARD_S,
        json={"model": MODEL, "input": [data_url(noise_png(20, size=128), "image/png")]},
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["data"][0]["embedding"]) == 1280
    after = request_outcomes(server)
    assert {o: after[o] - before[o] for o in after} == {"ok": 1, "cancelled": 0, "client_error": 0, "server_error": 0}


def test_clients_that_hang_up_30_ms_after_sending_are_all_cancelled(slow_embedder: Server) -> None:
    """Hang-ups that may land before the inputs are submitted (while their images decode): the
    watcher starts after the submits and finds the disconnect already waiting."""
    server = slow_embedder
    wait_until(lambda: server_idle(server), HANG_GUARD_S, "idle")
    before = request_outcomes(server)

    def client(seed: int) -> None:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(_raw_request([data_url(noise_png(seed, size=128), "image/png")]))
            time.sleep(0.03)

    clients = [threading.Thread(target=client, args=(30 + i,)) for i in range(4)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    change = _change_once_released(server, before, 4)
    assert change == {"ok": 0, "cancelled": 4, "client_error": 0, "server_error": 0}
