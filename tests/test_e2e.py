"""End to end against a real ``shmgate serve``: OpenAI client, curl, labels, integrity, cache, faults."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import time

import httpx
import numpy as np
import openai
import pytest

from tests.serving import (
    IMAGES,
    Server,
    data_url,
    expected_checksum,
    image_request,
    noise_png,
)


@pytest.fixture
def checksum_server(shared_checksum_server: Server) -> Server:
    """The checksum server this file shares with the others of its group (tests/conftest.py); the killed
    worker's test waits until the replacement is ready, so the next file finds the server whole."""
    return shared_checksum_server


LABELS = json.loads((IMAGES / "labels.json").read_text())["images"]


def _content(path: str) -> list[dict[str, object]]:
    return [
        {"type": "text", "text": "What is in this photo?"},
        {"type": "image_url", "image_url": {"url": data_url((IMAGES / path).read_bytes())}},
    ]


def _top1(answer: str) -> str:
    return answer.strip().splitlines()[0].rsplit(":", 1)[0].strip()


# -- the model, through the real OpenAI client ------------------------------------------------


@pytest.mark.parametrize("photo", ["chelsea_1024.jpg", "coffee_1024.jpg", "camera_640.jpg"])
def test_openai_client_gets_the_right_label(efficientnet_server: Server, photo: str) -> None:
    client = openai.OpenAI(base_url=efficientnet_server.base_url + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="efficientnet-lite0", messages=[{"role": "user", "content": _content(photo)}]
    )
    assert reply.choices[0].finish_reason == "stop"
    assert _top1(reply.choices[0].message.content or "") in LABELS[photo]["accept_top1"]
    assert reply.usage is not None and reply.usage.completion_tokens == 5


def test_openai_client_streams_several_chunks_then_usage(efficientnet_server: Server) -> None:
    client = openai.OpenAI(base_url=efficientnet_server.base_url + "/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="efficientnet-lite0",
        messages=[{"role": "user", "content": _content("coffee_640.jpg")}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) >= 2
    assert _top1("".join(texts)) == "espresso"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None


def test_curl_with_a_data_url(efficientnet_server: Server, tmp_path) -> None:
    body = tmp_path / "body.json"
    body.write_text(
        json.dumps(
            {"model": "efficientnet-lite0", "messages": [{"role": "user", "content": _content("chelsea_640.jpg")}]}
        )
    )
    headers = tmp_path / "headers.txt"
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            f"@{body}",
            "-D",
            str(headers),
            efficientnet_server.base_url + "/v1/chat/completions",
        ],
        capture_output=True,
        check=True,
        timeout=60,
    )
    answer = json.loads(out.stdout)["choices"][0]["message"]["content"]
    assert _top1(answer) in LABELS["chelsea_640.jpg"]["accept_top1"]
    assert "server-timing" not in headers.read_text().lower()  # opt-in (--server-timing)


def test_models_lists_the_served_model(efficientnet_server: Server) -> None:
    client = openai.OpenAI(base_url=efficientnet_server.base_url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["efficientnet-lite0"]


# -- integrity and the cache (checksum backend) ----------------------------------------------------


async def _post_all(base_url: str, bodies: list[dict[str, object]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))


def test_64_concurrent_distinct_images_each_get_their_own_answer(checksum_server: Server) -> None:
    images = [noise_png(seed) for seed in range(64)]
    responses = asyncio.run(
        _post_all(checksum_server.base_url, [image_request("checksum", d, mime="image/png") for d in images])
    )
    for data, response in zip(images, responses):
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]["message"]["content"]
        assert expected_checksum(data) in answer


def test_a_repeated_image_is_a_cache_hit_not_a_second_decode(checksum_server: Server) -> None:
    data = noise_png(1000)
    body = image_request("checksum", data, mime="image/png")
    first = httpx.post(checksum_server.base_url + "/v1/chat/completions", json=body, timeout=60)
    misses = checksum_server.metric("shmgate_cache_misses_total")
    hits = checksum_server.metric("shmgate_cache_hits_total") + checksum_server.metric(
        "shmgate_cache_remote_hits_total"
    )
    for _ in range(4):
        again = httpx.post(checksum_server.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert again.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]
    assert checksum_server.metric("shmgate_cache_misses_total") == misses
    assert (
        checksum_server.metric("shmgate_cache_hits_total") + checksum_server.metric("shmgate_cache_remote_hits_total")
        == hits + 4
    )


# -- bad input ------------------------------------------------------------------------------------------


# The cases' names, for parametrize: their bodies (_bad_bodies, one an 81-megapixel PNG, ~3 s to encode) are
# made when the first case runs, not when each test process imports this file.
BAD_CASES = (
    "invalid json",
    "missing messages",
    "bad base64",
    "not an image",
    "truncated jpeg",
    "unsupported format",
    "too many images",
    "too many pixels",
    "unknown model",
    "http url",
)


@functools.cache  # one 81-megapixel PNG to encode, not one per case (6 s each)
def _bad_bodies() -> dict[str, tuple[bytes, int]]:
    photo = (IMAGES / "coffee_640.jpg").read_bytes()

    def req(url: str, **extra: object) -> bytes:
        body = {
            "model": "checksum",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
            **extra,
        }
        return json.dumps(body).encode()

    big = np.random.default_rng(0).integers(0, 255, (20, 20, 3), dtype=np.uint8)
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(big).resize((9000, 9000)).save(buf, format="PNG", compress_level=1)
    return {
        "invalid json": (b"{not json", 400),
        "missing messages": (b'{"model": "checksum"}', 400),
        "bad base64": (req("data:image/jpeg;base64,@@@notbase64@@@"), 400),
        "not an image": (req(data_url(b"hello, I am text", "image/png")), 400),
        "truncated jpeg": (req(data_url(photo[: len(photo) // 3])), 400),
        "unsupported format": (req("data:image/gif;base64,R0lGODlhAQABAAAAACw="), 400),
        "too many images": (
            json.dumps(
                {
                    "model": "checksum",
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(photo)}}] * 9}
                    ],
                }
            ).encode(),
            400,
        ),
        "too many pixels": (req(data_url(buf.getvalue(), "image/png")), 413),
        "unknown model": (
            json.dumps({"model": "gpt-99", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            404,
        ),
        "http url": (req("http://169.254.169.254/latest"), 400),
    }


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_gets_an_openai_error_and_the_server_stays_healthy(checksum_server: Server, case: str) -> None:
    assert tuple(_bad_bodies()) == BAD_CASES  # every body made is a case that runs
    body, status = _bad_bodies()[case]
    response = httpx.post(
        checksum_server.base_url + "/v1/chat/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "shmgate." not in error["message"]
    assert httpx.get(checksum_server.base_url + "/ready", timeout=10).status_code == 200


def test_a_body_over_the_limit_is_refused(checksum_server: Server) -> None:
    response = httpx.post(
        checksum_server.base_url + "/v1/chat/completions",
        content=b"x" * (33 << 20),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


# -- faults -----------------------------------------------------------------------------------------------


def test_a_killed_worker_is_restarted_and_no_request_is_lost(checksum_server: Server) -> None:
    starts = checksum_server.metric("shmgate_worker_starts_total")
    images = [noise_png(5000 + i, size=256) for i in range(48)]
    bodies = [image_request("checksum", d, mime="image/png") for d in images]

    async def run() -> list[httpx.Response]:
        task = asyncio.ensure_future(_post_all(checksum_server.base_url, bodies))
        await asyncio.sleep(0.3)
        victim = checksum_server.pids("worker")[0]
        os.kill(victim, signal.SIGKILL)
        return await asyncio.wait_for(task, 90)

    responses = asyncio.run(run())
    for data, response in zip(images, responses):
        if response.status_code == 200:  # completed, on the first try or retried on another worker
            assert expected_checksum(data) in response.json()["choices"][0]["message"]["content"]
        else:  # only if output had already streamed; never a hang, never a wrong answer
            assert response.json()["error"]["code"] == "worker_died"
    deadline = time.monotonic() + 60
    while (
        checksum_server.metric("shmgate_worker_starts_total") <= starts
        or checksum_server.metric("shmgate_workers_ready") < 2
    ):
        assert time.monotonic() < deadline, "the killed worker was not restarted"
        time.sleep(0.2)
    after = httpx.post(
        checksum_server.base_url + "/v1/chat/completions", json=image_request("checksum", noise_png(7)), timeout=60
    )
    assert after.status_code == 200
