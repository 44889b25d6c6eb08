"""Generated answers, chat and Responses, rendered by the one collector of gateway/render.py when a choice fails.

A real ``Frontend`` runs on the in-memory transport (shared/transport/memory.py) and the test plays
the worker, so a choice can fail at an exact moment: before any output (the answer is an HTTP
error, never a 200 stream) or after some (an error event ends the stream). The HTTP response is framed as the edge frames it (gateway/edge.py ``framed``). What n > 1 records
over real HTTP (TTFT, the delivery stage, Server-Timing, a hang-up) is in tests/test_hf_serve.py,
on the tiny Qwen2-VL: the models that sample tokens are those that take ``n``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
from collections.abc import Awaitable, Callable

import pytest
from PIL import Image
from starlette.responses import StreamingResponse

from shmgate.gateway.choices import submit_choices
from shmgate.gateway.edge import framed
from shmgate.gateway.frontend import Frontend, FrontendLimits, RequestState
from shmgate.gateway.intake import IntakeLimits, parse_chat_request
from shmgate.gateway.metrics import Counter
from shmgate.gateway.preprocess.vision import ChecksumPreprocessor
from shmgate.gateway.render import answer
from shmgate.gateway.request_state import Phase
from shmgate.gateway.responses import parse_responses_request
from shmgate.gateway.responses_format import ResponsesFormat
from shmgate.gateway.sse import ChatFormat
from shmgate.shared.errors import Cancelled, InvalidRequest
from shmgate.shared.transport.memory import MemoryFrontendLink, MemoryNode
from shmgate.shared.wire import Claimed, Delta, Submit, failed_reply


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
    body = json.dumps(
        {
            "model": "checksum",
            "n": 2,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is it?"},
                        {"type": "image_url", "image_url": {"url": _png()}},
                    ],
                }
            ],
        }
    ).encode()
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
        answering = asyncio.create_task(
            framed(frontend.stats, answer(frontend, states, ChatFormat("checksum"), time.monotonic(), stream=stream))
        )
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
        response = await asyncio.wait_for(
            framed(frontend.stats, answer(frontend, states, ChatFormat("checksum"), time.monotonic(), stream=True)), 10
        )
        assert isinstance(response, StreamingResponse) and response.status_code == 200
        node.reply(failed_reply(submits[1].request_id, 0, InvalidRequest("the worker refused this choice")))
        body = b"".join([bytes(c) async for c in response.body_iterator])
        chunks = [json.loads(event.removeprefix(b"data: ")) for event in body.split(b"\n\n") if event]
        assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]  # each choice's role chunk
        assert chunks[2]["choices"][0]["delta"] == {"content": "a cat"}
        assert chunks[3]["error"]["message"] == "the worker refused this choice" and len(chunks) == 4
        assert states[0].phase is Phase.ABANDONED
        assert int(link.row[Counter.REQUESTS_CLIENT_ERROR]) == 1 and int(link.row[Counter.REQUESTS_OK]) == 0

    _run(scenario)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_hang_up_before_any_output_cancels_every_choice(stream: bool) -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        states, _ = await _two_choices(frontend, node)
        gone = asyncio.Event()

        async def receive() -> dict[str, str]:  # the ASGI receive of a connection that closes on `gone`
            await gone.wait()
            return {"type": "http.disconnect"}

        answering = asyncio.create_task(
            framed(
                frontend.stats,
                answer(frontend, states, ChatFormat("checksum"), time.monotonic(), stream=stream, receive=receive),
            )
        )
        await asyncio.sleep(0.05)
        assert not answering.done()  # waiting for the first output
        gone.set()
        response = await asyncio.wait_for(answering, 10)
        assert not isinstance(response, StreamingResponse) and response.status_code == Cancelled.status_hint
        assert [state.phase for state in states] == [Phase.ABANDONED, Phase.ABANDONED]
        assert int(link.row[Counter.CANCELLED]) == 2  # one per choice, as each is a request in flight
        assert int(link.row[Counter.REQUESTS_OK]) == 0 and int(link.row[Counter.REQUESTS_CLIENT_ERROR]) == 0

    _run(scenario)


def test_a_response_failing_after_output_began_ends_its_stream_with_response_failed() -> None:
    """The same walk in the Responses format: its events in order, then response.failed carrying the error."""

    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        body = json.dumps({"model": "checksum", "input": "what is it?", "stream": True}).encode()
        chat, req = parse_responses_request(body, IntakeLimits())
        states = await submit_choices(frontend, chat)
        submit = node.take()
        assert submit is not None
        node.reply(Claimed(submit.request_id, 0, 1))
        node.reply(Delta(submit.request_id, 0, "a cat"))
        response = await asyncio.wait_for(
            framed(frontend.stats, answer(frontend, states, ResponsesFormat(req), time.monotonic(), stream=True)), 10
        )
        assert isinstance(response, StreamingResponse) and response.status_code == 200
        node.reply(failed_reply(submit.request_id, 0, InvalidRequest("the worker refused it")))
        body = b"".join([bytes(c) async for c in response.body_iterator])
        frames = [e for e in body.split(b"\n\n") if e]
        assert frames[-1] == b"data: [DONE]"  # the stream's end, after response.failed too
        events = [json.loads(e.split(b"\ndata: ", 1)[1]) for e in frames[:-1]]
        assert [e["type"] for e in events] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.failed",
        ]
        assert [e["sequence_number"] for e in events] == list(range(6))
        assert events[-1]["response"]["error"] == {"code": "invalid_prompt", "message": "the worker refused it"}
        assert int(link.row[Counter.REQUESTS_CLIENT_ERROR]) == 1 and int(link.row[Counter.REQUESTS_OK]) == 0

    _run(scenario)
