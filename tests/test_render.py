"""The chat answer for n choices, rendered by the one loop of gateway/render.py.

The first tests run a real ``Frontend`` on the in-memory transport (shared/transport/memory.py)
and play the worker, so a choice can fail at an exact moment: before any output (the answer is an
HTTP error, never a 200 stream) or after some (an error event in the stream). The rest run a real
``shmgate serve`` of the tiny Qwen2-VL (the models that sample tokens are those that take ``n``)
and read what n > 1 records from /metrics: a TTFT and a ``delivery`` stage per choice, the
Server-Timing header, and a hang-up that cancels every choice.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image
from starlette.responses import StreamingResponse

from gateway.choices import submit_choices
from gateway.frontend import Frontend, FrontendLimits, RequestState
from gateway.intake import IntakeLimits, parse_chat_request
from gateway.metrics import Counter
from gateway.preprocess.vision import ChecksumPreprocessor
from gateway.render import answer
from gateway.request_state import Phase
from gateway.stages import parse_server_timing
from shared.errors import InvalidRequest
from shared.transport.memory import MemoryFrontendLink, MemoryNode
from shared.wire import Claimed, Delta, Submit, failed_reply
from tests.serving import IMAGES, Server, data_url, start_server, stop_and_check, wait_until

HANG_GUARD_S = 60.0


def _png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 24), (20, 140, 90)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


Scenario = Callable[[Frontend, MemoryNode, MemoryFrontendLink], Awaitable[None]]


def _run(scenario: Scenario) -> None:
    async def main() -> None:
        node = MemoryNode()
        node.add_worker("checksum")
        link = MemoryFrontendLink(node, slot=0)
        frontend = Frontend(link, ChecksumPreprocessor(), FrontendLimits())
        await frontend.start()
        try:
            await scenario(frontend, node, link)
        finally:
            await frontend.stop()

    asyncio.run(main())


async def _two_choices(frontend: Frontend, node: MemoryNode) -> tuple[list[RequestState], list[Submit]]:
    """Submit a two-choice request and claim both choices, as a worker would."""
    body = json.dumps({"model": "checksum", "n": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": _png()}}]}]}).encode()
    states = await submit_choices(frontend, parse_chat_request(body, IntakeLimits()))
    submits = [node.take(), node.take()]
    assert all(s is not None for s in submits)
    taken = [s for s in submits if s is not None]
    for submit in taken:
        node.reply(Claimed(submit.request_id, 0, 1))
    return states, taken


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_choice_failing_before_any_output_is_an_http_error_not_a_200_stream(stream: bool) -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        states, submits = await _two_choices(frontend, node)
        answering = asyncio.create_task(answer(frontend, states, "checksum", time.monotonic(), stream=stream))
        node.reply(failed_reply(submits[1].request_id, 0, InvalidRequest("the worker refused this choice")))
        response = await asyncio.wait_for(answering, 10)
        assert not isinstance(response, StreamingResponse)
        assert response.status_code == 400
        error = json.loads(bytes(response.body))["error"]
        assert error["message"] == "the worker refused this choice" and error["type"] == "invalid_request_error"
        assert states[0].phase is Phase.ABANDONED  # the other choice's work is cancelled
        assert int(link.row[Counter.REQUESTS_CLIENT_ERROR]) == 1 and int(link.row[Counter.CANCELLED]) == 1
        assert int(link.row[Counter.REQUESTS_OK]) == 0

    _run(scenario)


def test_a_choice_failing_after_output_began_is_an_error_event_ending_the_stream() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        states, submits = await _two_choices(frontend, node)
        node.reply(Delta(submits[0].request_id, 0, "a cat"))
        response = await asyncio.wait_for(answer(frontend, states, "checksum", time.monotonic(), stream=True), 10)
        assert isinstance(response, StreamingResponse) and response.status_code == 200
        node.reply(failed_reply(submits[1].request_id, 0, InvalidRequest("the worker refused this choice")))
        chunks = [json.loads(bytes(c).removeprefix(b"data: ")) async for c in response.body_iterator]
        assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]  # each choice's role chunk
        assert chunks[2]["choices"][0]["delta"] == {"content": "a cat"}
        assert chunks[3]["error"]["message"] == "the worker refused this choice" and len(chunks) == 4
        assert states[0].phase is Phase.ABANDONED
        assert int(link.row[Counter.REQUESTS_CLIENT_ERROR]) == 1 and int(link.row[Counter.REQUESTS_OK]) == 0

    _run(scenario)


# -- over HTTP, on a model that takes n ------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_server(tiny_qwen2_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(f"hf:{tiny_qwen2_vl_dir}", tmp_path_factory.mktemp("serve"), "--threads", "1",
                          "--frontends", "1", "--server-timing")
    try:
        yield server
    finally:
        stop_and_check(server)


def _body(n: int, *, stream: bool = False, max_tokens: int = 4, **extra: object) -> dict[str, object]:
    return {"model": "tiny-qwen2-vl", "n": n, "stream": stream, "max_tokens": max_tokens, "seed": 7,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url((IMAGES / "chelsea_640.jpg").read_bytes())}},
                {"type": "text", "text": "What is it?"}]}], **extra}


_COUNTS = {"ok": 'shmgate_requests_total{outcome="ok"}',
           "cancelled": 'shmgate_requests_total{outcome="cancelled"}',
           "server_error": 'shmgate_requests_total{outcome="server_error"}',
           "ttft": "shmgate_time_to_first_token_seconds_count",
           "delivery": 'shmgate_stage_duration_seconds_count{stage="delivery"}'}


def _counts(server: Server) -> dict[str, float]:
    return {name: server.metric(metric) for name, metric in _COUNTS.items()}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_record_one_ttft_and_a_delivery_stage_per_choice(hf_server: Server, stream: bool) -> None:
    before = _counts(hf_server)
    r = httpx.post(hf_server.base_url + "/v1/chat/completions", json=_body(3, stream=stream), timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        finished = {c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]}
        assert finished == {0, 1, 2}
    else:
        assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]
    after = _counts(hf_server)
    assert {k: after[k] - before[k] for k in ("ok", "ttft", "delivery")} == {"ok": 1, "ttft": 1, "delivery": 3}


def test_n_choices_say_where_their_time_went_in_server_timing(hf_server: Server) -> None:
    r = httpx.post(hf_server.base_url + "/v1/chat/completions", json=_body(2), timeout=60)
    assert r.status_code == 200, r.text
    spent = parse_server_timing(r.headers["server-timing"])
    assert {"body_read", "preprocess", "queue", "compute", "delivery", "total"} <= set(spent)
    assert all(value >= 0 for value in spent.values())
    assert spent["compute"] <= spent["total"]


def _no_eos_bias(model_dir: Path) -> dict[str, float]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return {str(i): -100.0 for i in ids}


def test_n_choices_whose_client_hangs_up_are_all_cancelled(hf_server: Server, tiny_qwen2_vl_dir: Path) -> None:
    """Two long generations (end of sequence biased away) stop when the client of the whole answer leaves."""
    server = hf_server
    wait_until(lambda: server.metric("shmgate_in_flight_requests") == 0, HANG_GUARD_S, "idle")
    before = _counts(server)
    tokens = server.metric("shmgate_cancelled_tokens_total")
    max_tokens = 8000
    data = json.dumps(_body(2, max_tokens=max_tokens, temperature=0,
                            logit_bias=_no_eos_bias(tiny_qwen2_vl_dir))).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(data)) + data
    go = threading.Event()

    def client() -> None:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(request)
            go.wait(HANG_GUARD_S)

    thread = threading.Thread(target=client)
    thread.start()
    try:
        wait_until(lambda: server.metric("shmgate_in_flight_requests") >= 2, HANG_GUARD_S, "both choices in flight")
        time.sleep(0.5)  # generating by now
    finally:
        go.set()
        thread.join()
    wait_until(lambda: server.metric(_COUNTS["cancelled"]) >= before["cancelled"] + 2
               and server.metric("shmgate_in_flight_requests") == 0, HANG_GUARD_S, "both choices cancelled")
    after = _counts(server)
    assert {k: after[k] - before[k] for k in ("ok", "cancelled", "server_error")} == {
        "ok": 0, "cancelled": 2, "server_error": 0}
    generated = server.metric("shmgate_cancelled_tokens_total") - tokens
    assert generated < max_tokens, f"{generated:.0f} of {2 * max_tokens} tokens generated for nobody"
