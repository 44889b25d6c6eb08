"""A step engine's trace: each engine step that answered a traced request is a ``step`` span linking to it,
and the request's ``compute`` span splits into ``prefill`` and ``decode`` (worker/tracing.py).

The real worker loop and the tiny Qwen2-VL on the in-memory transport; the frontend's link stamps each
Submit with a traceparent, as a traced frontend does; spans go to the SDK's in-memory exporter.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import msgspec
import pytest

pytest.importorskip("transformers")
pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from shmgate.gateway.frontend import Frontend, FrontendLimits  # noqa: E402
from shmgate.gateway.intake import IntakeLimits, parse_chat_request  # noqa: E402
from shmgate.gateway.preprocess.hf import HFPreprocessor  # noqa: E402
from shmgate.shared.transport.base import INTERACTIVE  # noqa: E402
from shmgate.shared.transport.memory import MemoryFrontendLink, MemoryNode, MemoryWorkerLink  # noqa: E402
from shmgate.shared.wire import Finished, Submit  # noqa: E402
from shmgate.worker.main import Worker, WorkerOptions  # noqa: E402
from shmgate.worker.tracing import BatchSpans  # noqa: E402
from tests.hf_fixture import no_eos_bias  # noqa: E402
from tests.test_engine import _chat  # noqa: E402


def _traceparent(request_id: int) -> str:
    return f"00-{0xABC0000 + request_id:032x}-{0xDEF000 + request_id:016x}-01"


class _TracedLink(MemoryFrontendLink):
    """What a traced frontend sends: each Submit carries its attempt's traceparent."""

    async def send_request(self, submit: Submit, timeout_s: float, priority: int = INTERACTIVE) -> None:
        traced = msgspec.structs.replace(submit, traceparent=_traceparent(submit.request_id))
        await super().send_request(traced, timeout_s, priority)


def test_engine_steps_are_spans_linking_the_requests_they_answered(tiny_qwen2_vl_dir: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    node = MemoryNode()
    worker = Worker(MemoryWorkerLink(node), WorkerOptions(model=f"hf:{tiny_qwen2_vl_dir}", device="cpu"))
    worker.spans = BatchSpans(provider.get_tracer("test"), slot=0, model="tiny-qwen2-vl")
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    endless = tuple(sorted((int(k), v) for k, v in no_eos_bias(tiny_qwen2_vl_dir).items()))
    ids: list[int] = []

    async def main() -> None:
        frontend = Frontend(
            _TracedLink(node, slot=0), HFPreprocessor(tiny_qwen2_vl_dir), FrontendLimits(request_timeout_s=60)
        )
        await frontend.start()
        try:
            for _ in range(400):
                if frontend.ready():
                    break
                await asyncio.sleep(0.05)

            async def run(text: str, tokens: int) -> None:
                state = await frontend.submit(parse_chat_request(_chat(text, tokens, endless), IntakeLimits()))
                ids.append(state.request_id)
                async for event in frontend.events(state):
                    if isinstance(event, Finished):
                        return

            await asyncio.gather(run("A long answer.", 12), run("A short one.", 3))
        finally:
            await frontend.stop()

    try:
        asyncio.run(main())
    finally:
        worker.stop()
        thread.join(30)
    assert not thread.is_alive()
    spans = exporter.get_finished_spans()
    linked: dict[int, int] = {}  # request id -> the step spans that link to its attempt
    for step in (s for s in spans if s.name == "step"):
        assert step.attributes is not None and step.attributes["shmgate.step.answered"] >= 1
        assert step.attributes["shmgate.step.step_tokens"] >= 1  # what the step ran
        for link in step.links:
            request_id = int(str(link.attributes["shmgate.request_id"]), 16)
            assert link.context.trace_id == 0xABC0000 + request_id  # the request's own trace
            linked[request_id] = linked.get(request_id, 0) + 1
    # A step links to the requests it produced output for: at most one per token (text the detokenizer holds
    # back makes no event), and the 12-token answer had more such steps than the 3-token one.
    assert set(linked) == set(ids)
    short, long = sorted(linked.values())
    assert 1 <= short <= 3 < long <= 12
    for request_id in ids:
        mine = [s for s in spans if s.context.trace_id == 0xABC0000 + request_id]
        compute = next(s for s in mine if s.name == "compute")
        assert compute.attributes is not None and compute.attributes["shmgate.steps"] >= linked[request_id]
        prefill = next(s for s in mine if s.name == "prefill")
        decode = next(s for s in mine if s.name == "decode")
        assert prefill.parent is not None and prefill.parent.span_id == compute.context.span_id
        assert decode.parent is not None and decode.parent.span_id == compute.context.span_id
        assert prefill.end_time is not None and decode.start_time is not None
        assert prefill.end_time <= decode.start_time
