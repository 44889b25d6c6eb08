"""A long generation on an ``hf:`` model stops when its client hangs up, on a real ``shmgate serve``.

The tiny Qwen2-VL checkpoint (tests/hf_fixture.py) generates with its end-of-sequence tokens biased
away, so a request for 8,000 tokens runs to its limit unless the Cancel stops it. The worker checks for
a Cancel between decode steps, and the frontend counts the tokens a worker generated for a request
whose client had gone (``shmgate_cancelled_tokens_total``): far fewer than asked proves the generation
stopped once the client left, instead of running to the end for nobody.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.hf_fixture import no_eos_bias
from tests.serving import IMAGES, Server, data_url, wait_until

MAX_TOKENS = 8000
HANG_GUARD_S = 60.0


@pytest.fixture
def hf_server(tiny_qwen2_vl_server: Server) -> Server:
    """The tiny Qwen2-VL server this file shares with the others of its group (tests/conftest.py)."""
    return tiny_qwen2_vl_server


def _request(model_dir: Path, *, stream: bool) -> bytes:
    body = json.dumps(
        {
            "model": "tiny-qwen2-vl",
            "stream": stream,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "logit_bias": no_eos_bias(model_dir),
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": data_url((IMAGES / "chelsea_640.jpg").read_bytes())},
                        },
                        {"type": "text", "text": "Describe the photo at length."},
                    ],
                }
            ],
        }
    ).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    ) + body


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_a_long_generation_stops_when_its_client_hangs_up(
    hf_server: Server, tiny_qwen2_vl_dir: Path, stream: bool
) -> None:
    server = hf_server
    cancelled = server.metric('shmgate_requests_total{outcome="cancelled"}')
    ok = server.metric('shmgate_requests_total{outcome="ok"}')
    tokens = server.metric("shmgate_cancelled_tokens_total")
    go = threading.Event()

    def client() -> None:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(_request(tiny_qwen2_vl_dir, stream=stream))
            go.wait(HANG_GUARD_S)

    thread = threading.Thread(target=client)
    thread.start()
    try:
        wait_until(lambda: server.metric("shmgate_in_flight_requests") >= 1, HANG_GUARD_S, "the request in flight")
        time.sleep(1.0)  # generating by now (the tiny model's prefill takes milliseconds)
    finally:
        go.set()
        thread.join()
    wait_until(
        lambda: (
            server.metric('shmgate_requests_total{outcome="cancelled"}') == cancelled + 1
            and server.metric("shmgate_in_flight_requests") == 0
        ),
        HANG_GUARD_S,
        "the hang-up cancelled",
    )
    generated = server.metric("shmgate_cancelled_tokens_total") - tokens
    assert server.metric('shmgate_requests_total{outcome="ok"}') == ok
    assert generated < MAX_TOKENS / 2, f"{generated:.0f} of {MAX_TOKENS} tokens generated for nobody"
    print(
        f"\nhf hang-up ({'streamed' if stream else 'non-streamed'}) after 1 s: the worker stopped after "
        f"{generated:.0f} of {MAX_TOKENS} tokens"
    )


def test_a_stream_read_token_by_token_stops_within_a_few_tokens_of_the_hang_up(
    hf_server: Server, tiny_qwen2_vl_dir: Path
) -> None:
    """The client reads as the tokens come and leaves after READ of them: the worker's count says how many more
    it generated (those already on their way, plus the steps until the Cancel reached it). Printed, and bounded
    loosely: the exact figure depends on how far the client lags behind the model."""
    read = 200
    server = hf_server
    tokens = server.metric("shmgate_cancelled_tokens_total")
    cancelled = server.metric('shmgate_requests_total{outcome="cancelled"}')
    seen = 0
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(_request(tiny_qwen2_vl_dir, stream=True))
        pending = b""
        while seen < read:
            chunk = s.recv(65536)
            assert chunk, "the stream ended early"
            pending += chunk
            *lines, pending = pending.split(b"\n")
            seen += sum(line.startswith(b"data: ") and b'"content":' in line for line in lines)
    wait_until(
        lambda: (
            server.metric('shmgate_requests_total{outcome="cancelled"}') == cancelled + 1
            and server.metric("shmgate_in_flight_requests") == 0
        ),
        HANG_GUARD_S,
        "the hang-up cancelled",
    )
    generated = server.metric("shmgate_cancelled_tokens_total") - tokens
    assert seen <= generated < MAX_TOKENS / 2
    print(
        f"\nhf stream left after {seen} content chunks: the worker generated {generated:.0f} tokens "
        f"({generated - seen:.0f} after the client's last read)"
    )
