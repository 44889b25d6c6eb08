"""Round-three hostile input on a real ``shmgate serve --model hf:<tiny Qwen2-VL>``: one client's request never
fails another's, and per-request image options stay inside the operator's bounds.

- ``temperature: 1e-300`` (inside OpenAI's 0..2) made ``logits / temperature`` infinite and the softmax
  NaN: ``multinomial`` raised and the worker failed the whole batch. Sent together with ordinary
  requests (streamed and not), everyone now gets a whole answer ending with ``[DONE]``.
- ``mm_processor_kwargs`` may lower the image budget, never raise it past the server's; mistyped or
  out-of-range options (and ones that would make pixels NaN) are 400s naming ``mm_processor_kwargs``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving import IMAGES, Server, data_url, start_server
from tests.shm_children import leftovers

CHAT = "/v1/chat/completions"
PHOTO = data_url((IMAGES / "chelsea_640.jpg").read_bytes())


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # One worker that waits for its batch to fill: concurrent requests share a batch.
    extra = (
        "--threads",
        "1",
        "--frontends",
        "1",
        "--workers",
        "1",
        "--max-batch-size",
        "8",
        "--max-batch-wait-ms",
        "200",
    )
    server = start_server(f"hf:{tiny_qwen2_vl_dir}", tmp_path_factory.mktemp("serve"), *extra)
    try:
        yield server
    finally:
        assert server.stop() == 0
        assert not leftovers(server.instance_id, slots=64)


def _body(**extra: Any) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": PHOTO}}, {"type": "text", "text": "What is it?"}]
    return {"model": "tiny-qwen2-vl", "messages": [{"role": "user", "content": content}], "max_tokens": 6, **extra}


async def _send(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, str]:
    reply = await client.post(CHAT, json=body)
    return reply.status_code, reply.text


def test_a_tiny_temperature_fails_none_of_its_batch_mates(server: Server) -> None:
    ordinary = [_body(seed=i, stream=i % 2 == 1) for i in range(5)]
    hostile = _body(temperature=1e-300, stream=True)

    bodies = [*ordinary[:2], hostile, *ordinary[2:]]

    async def run() -> list[tuple[int, str]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            return await asyncio.gather(*(_send(client, b) for b in bodies))

    answers = asyncio.run(run())
    failed = [text[:120] for status, text in answers if status != 200 or '"error"' in text]
    assert not failed, f"{len(failed)} of {len(answers)} failed: {failed}"
    for (_, text), body in zip(answers, bodies):
        if body["stream"]:
            assert text.rstrip().endswith("data: [DONE]"), text


@pytest.mark.parametrize(
    "options",
    [
        {"max_pixels": "abc"},
        {"max_pixels": -1},
        {"max_pixels": 1_003_520},  # above the server's bound (the checkpoint's 25,088)
        {"min_pixels": 20_000_000, "max_pixels": 20_000_000},
        {"image_std": [0.0, 0.0, 0.0]},  # NaN pixels
        {"rescale_factor": 1e308},  # infinite pixels
        {"image_mean": [0.5] * 1000},
        {"resample": 99},
        {"do_resize": "yes"},
        {"size": {"longest_edge": 10**9}},
    ],
)
def test_image_options_outside_their_type_range_or_bound_are_a_400_naming_them(
    server: Server, options: dict[str, Any]
) -> None:
    reply = httpx.post(server.base_url + CHAT, json=_body(mm_processor_kwargs=options), timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "mm_processor_kwargs"


def test_a_request_may_lower_the_image_budget(server: Server) -> None:
    def prompt_tokens(**extra: Any) -> int:
        reply = httpx.post(server.base_url + CHAT, json=_body(**extra), timeout=60)
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["prompt_tokens"])

    full = prompt_tokens()
    assert prompt_tokens(mm_processor_kwargs={"max_pixels": 6272}) < full
    # Integers where the processor wants floats are numbers all the same.
    assert prompt_tokens(mm_processor_kwargs={"image_std": [1, 1, 1]}) == full


def test_an_image_over_the_context_is_refused_from_its_header_before_any_decode(tiny_qwen2_vl_dir: Path) -> None:
    # An operator's generous bound: 20 million pixels would be 25,510 tokens of a 4,096-token context.
    import io

    from PIL import Image

    from shmgate.gateway.decode_budget import DecodeBudget
    from shmgate.gateway.preprocess.hf import HFPreprocessor
    from shmgate.shared.errors import InvalidRequest

    pre = HFPreprocessor(tiny_qwen2_vl_dir, processor_kwargs={"max_pixels": 20_000_000})
    options = pre.image_options({"min_pixels": 20_000_000}, None)
    png = io.BytesIO()
    Image.new("RGB", (64, 64)).save(png, format="PNG")
    budget = DecodeBudget(1 << 30, wait_s=1)
    with pytest.raises(InvalidRequest, match="alone would take 25600 tokens"):
        budget.preprocess(pre, png.getvalue(), lambda *a: pytest.fail("allocated"), max_pixels=1 << 30, options=options)
    assert budget.reserved_bytes == 0
    assert pre.plan_image(64, 64, pre.image_options({"max_pixels": 6272}, None)) > 0  # counted, and it fits


def test_memory_of_a_large_decode_is_handed_back_once_the_budget_is_idle() -> None:
    from shmgate.gateway.decode_budget import TRIM_AFTER_BYTES, DecodeBudget

    budget = DecodeBudget(1 << 30, wait_s=1)
    with budget.reserve(1 << 20):
        pass
    assert budget.trims == 0  # small decodes leave nothing worth a trim
    with budget.reserve(1 << 20):
        with budget.reserve(TRIM_AFTER_BYTES):
            pass
        assert budget.trims == 0  # not while another decode is running
    assert budget.trims == (1 if budget._trim is not None else 0)


def test_a_maximum_below_the_configured_minimum_lowers_the_minimum_too() -> None:
    from shmgate.gateway.preprocess.options import bounded_options
    from shmgate.shared.errors import InvalidRequest

    configured = {"shortest_edge": 3136, "longest_edge": 25088}
    assert bounded_options({"max_pixels": 1000}, configured, {})["size"] == {
        "shortest_edge": 1000,
        "longest_edge": 1000,
    }
    with pytest.raises(InvalidRequest):
        bounded_options({"max_pixels": 1000, "min_pixels": 2000}, configured, {})
