"""A client that hangs up cancels its request, whatever stage the request is at, on a real ``shmgate serve``.

The checksum backend's ``checksum:trickle <n>`` keeps a request in the worker for n x 20 ms and stops at
once when the worker sees a Cancel; ``checksum:hold <n>`` holds a batch back n x 20 ms before its first
output. A trickle of 90,000 steps would last 30 minutes (and the request deadline is 60 s), so a request's
arena holds (released only by the worker's terminal message) come back within the hang guard only if the
Cancel reached the worker and it stopped producing. Clients are raw sockets, so a hang-up is exactly a
closed connection at a chosen moment. Every outcome is read from ``shmgate_requests_total``.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from tests.serving import (
    Server,
    image_request,
    noise_png,
    raw_post,
    request_outcomes,
    server_idle,
    start_server,
    stop_and_check,
    wait_until,
)


@pytest.fixture
def checksum_server(shared_checksum_server: Server) -> Server:
    """The checksum server this file shares with the others of its group (tests/conftest.py)."""
    return shared_checksum_server


HANG_GUARD_S = 30.0  # well under the 60 s request deadline, which would also free the holds


def _raw_request(body: dict[str, object]) -> bytes:
    return raw_post("/v1/chat/completions", body)


def _send_and_hang_up(port: int, payload: bytes, until: threading.Event | float) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(payload)
        if isinstance(until, threading.Event):
            until.wait(HANG_GUARD_S)
        else:
            time.sleep(until)
    # leaving the block closes the connection: the hang-up


def _hang_up_while_in_flight(server: Server, body: dict[str, object]) -> None:
    """Send ``body``, wait until the frontend has it in flight, then close the connection."""
    _hang_up_while_in_flight_with(server, _raw_request(body), 1)


def _hang_up_while_in_flight_with(server: Server, payload: bytes, in_flight: int) -> None:
    """Send ``payload``, wait until the node has ``in_flight`` requests in flight, then close the connection."""
    go = threading.Event()
    client = threading.Thread(target=_send_and_hang_up, args=(server.port, payload, go))
    client.start()
    try:
        wait_until(
            lambda: server.metric("shmgate_in_flight_requests") >= in_flight, HANG_GUARD_S, "the request in flight"
        )
        time.sleep(0.3)  # a few trickle steps / well inside the hold
    finally:
        go.set()
        client.join()


def _cancelled_and_released(server: Server, before: dict[str, float], n: int) -> dict[str, float]:
    try:
        wait_until(
            lambda: request_outcomes(server)["cancelled"] >= before["cancelled"] + n and server_idle(server),
            HANG_GUARD_S,
            f"{n} hang-ups counted cancelled and their arena holds released",
        )
    finally:
        after = request_outcomes(server)
        print(
            {o: after[o] - before[o] for o in after},
            server.metric("shmgate_in_flight_requests"),
            server.metric("shmgate_arena_held_bytes"),
        )
    return {o: after[o] - before[o] for o in after}


def test_a_non_streamed_request_whose_client_hangs_up_is_cancelled_and_the_worker_stops(
    checksum_server: Server,
) -> None:
    server = checksum_server
    wait_until(lambda: server_idle(server), HANG_GUARD_S, "idle")
    before = request_outcomes(server)
    body = image_request("checksum", noise_png(1, size=128), mime="image/png", text="checksum:trickle 90000")
    _hang_up_while_in_flight(server, body)
    change = _cancelled_and_released(server, before, 1)
    assert change == {"ok": 0, "cancelled": 1, "client_error": 0, "server_error": 0}


def test_a_stream_whose_client_hangs_up_before_its_first_event_is_cancelled(checksum_server: Server) -> None:
    server = checksum_server
    wait_until(lambda: server_idle(server), HANG_GUARD_S, "idle")
    before = request_outcomes(server)
    body = image_request(
        "checksum", noise_png(2, size=128), mime="image/png", stream=True, text="checksum:hold 100"
    )  # 2 s before any output
    _hang_up_while_in_flight(server, body)
    change = _cancelled_and_released(server, before, 1)
    assert change == {"ok": 0, "cancelled": 1, "client_error": 0, "server_error": 0}


def test_twelve_clients_that_hang_up_30_ms_after_sending_are_all_cancelled(checksum_server: Server) -> None:
    server = checksum_server
    wait_until(lambda: server_idle(server), HANG_GUARD_S, "idle")
    before = request_outcomes(server)
    payloads = [
        _raw_request(
            image_request("checksum", noise_png(100 + i, size=128), mime="image/png", text="checksum:trickle 90000")
        )
        for i in range(12)
    ]
    clients = [threading.Thread(target=_send_and_hang_up, args=(server.port, p, 0.03)) for p in payloads]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    change = _cancelled_and_released(server, before, 12)
    assert change == {"ok": 0, "cancelled": 12, "client_error": 0, "server_error": 0}


def test_a_client_that_closes_mid_body_is_cancelled_without_a_traceback(checksum_server: Server) -> None:
    server = checksum_server
    before = request_outcomes(server)
    logged = server.log_path.read_text()
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n"
    )
    for _ in range(3):
        _send_and_hang_up(server.port, head + b'{"model": "checksum", "messages": [', 0.2)
    wait_until(
        lambda: request_outcomes(server)["cancelled"] >= before["cancelled"] + 3,
        HANG_GUARD_S,
        "three mid-body hang-ups counted cancelled",
    )
    after = request_outcomes(server)
    assert {o: after[o] - before[o] for o in after} == {"ok": 0, "cancelled": 3, "client_error": 0, "server_error": 0}
    new_lines = server.log_path.read_text()[len(logged) :]
    assert "Traceback" not in new_lines and "ClientDisconnect" not in new_lines, new_lines[-3000:]


def test_a_stream_that_hangs_up_while_held_behind_a_running_batch_is_cancelled_before_that_batch_ends(
    tmp_path: Path,
) -> None:
    """One worker whose model runs a batch whole: a long batch runs, a stream's request waits in the next
    batch (held open while the model is busy) and its client hangs up before any event. The worker answers
    the Cancel while the long batch still runs, rather than when that batch ends and the held one is admitted.

    Nothing here is timed: the witness is the order. The stream's request has ended (in flight 1) while the
    long batch's client has not had a byte of its answer yet.
    """
    server = start_server("checksum", tmp_path, "--workers", "1", "--frontends", "1")
    try:
        before = request_outcomes(server)
        long_batch = _raw_request(
            image_request("checksum", noise_png(7, size=64), mime="image/png", text="checksum:hold 250")
        )  # 5 s before any output
        held = _raw_request(image_request("checksum", noise_png(8, size=64), mime="image/png", stream=True))
        with socket.create_connection(("127.0.0.1", server.port)) as running:
            running.sendall(long_batch)
            wait_until(lambda: server.metric("shmgate_in_flight_requests") >= 1, HANG_GUARD_S, "the long batch")
            time.sleep(0.3)  # the worker runs it: the next request it takes waits in a held batch
            _hang_up_while_in_flight_with(server, held, 2)
            wait_until(lambda: server.metric("shmgate_in_flight_requests") <= 1, HANG_GUARD_S, "the held stream ended")
            running.setblocking(False)
            try:
                answered = running.recv(1)
            except BlockingIOError:
                answered = b""
            assert answered == b"", "the held request ended only when the running batch did"
            assert request_outcomes(server)["cancelled"] == before["cancelled"] + 1
            running.setblocking(True)
            running.settimeout(HANG_GUARD_S)
            assert running.recv(12).startswith(b"HTTP/1.1 200")
        wait_until(lambda: server_idle(server), HANG_GUARD_S, "idle")
        after = request_outcomes(server)
        assert {o: after[o] - before[o] for o in after} == {
            "ok": 1,
            "cancelled": 1,
            "client_error": 0,
            "server_error": 0,
        }
    finally:
        stop_and_check(server)
