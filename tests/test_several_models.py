"""Several models on one node: one ``shmgate serve --model efficientnet-lite0 --model checksum``, one arena.

Each model has its own workers and its own request queue; the frontends route by the request's
``model``. A request that reached the other model's worker would be answered wrongly (a classifier's
labels where a digest is expected) or failed, so correct answers to both under interleaved load are the
proof that routing holds. The two models preprocess alike, so one decode of an image serves both.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from tests.serving import IMAGES, Server, expected_checksum, image_request, noise_png, start_server, stop_and_check

LABELS = json.loads((IMAGES / "labels.json").read_text())["images"]
PHOTOS = ["chelsea_640.jpg", "coffee_640.jpg", "camera_640.jpg"]


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server("efficientnet-lite0", tmp_path_factory.mktemp("serve"), "--model", "checksum",
                          "--workers", "1")
    try:
        yield server
    finally:
        stop_and_check(server)


def _top1(answer: str) -> str:
    return answer.strip().splitlines()[0].rsplit(":", 1)[0].strip()


def _answer(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    content: str = response.json()["choices"][0]["message"]["content"]
    return content


def test_both_models_answer_correctly_under_interleaved_concurrent_load(two_models: Server) -> None:
    photos = [(IMAGES / name).read_bytes() for name in PHOTOS]
    noise = [noise_png(seed) for seed in range(300, 312)]
    jobs: list[tuple[str, bytes, str]] = []
    for i, data in enumerate(noise):  # classifier and checksum requests alternate
        jobs.append(("checksum", data, ""))
        photo = PHOTOS[i % len(PHOTOS)]
        jobs.append(("efficientnet-lite0", photos[i % len(photos)], photo))

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=two_models.base_url, timeout=120,
                                     limits=httpx.Limits(max_connections=len(jobs))) as client:
            return await asyncio.gather(*(client.post("/v1/chat/completions", json=image_request(model, data))
                                          for model, data, _ in jobs))

    responses = asyncio.run(run())
    for (model, data, photo), response in zip(jobs, responses):
        answer = _answer(response)
        assert response.json()["model"] == model
        if model == "checksum":
            assert expected_checksum(data) in answer, answer
        else:
            assert _top1(answer) in LABELS[photo]["accept_top1"], answer


def test_one_decode_serves_both_models_when_their_preprocessing_agrees(two_models: Server) -> None:
    data = noise_png(977)  # an image no other test sends
    misses = two_models.metric("shmgate_cache_misses_total")
    hits = two_models.metric("shmgate_cache_hits_total") + two_models.metric("shmgate_cache_remote_hits_total")
    first = httpx.post(two_models.base_url + "/v1/chat/completions", json=image_request("checksum", data),
                       timeout=60)
    assert expected_checksum(data) in _answer(first)
    assert two_models.metric("shmgate_cache_misses_total") == misses + 1
    second = httpx.post(two_models.base_url + "/v1/chat/completions",
                        json=image_request("efficientnet-lite0", data), timeout=60)
    _answer(second)
    assert two_models.metric("shmgate_cache_misses_total") == misses + 1, "the classifier decoded it again"
    assert two_models.metric("shmgate_cache_hits_total") + two_models.metric(
        "shmgate_cache_remote_hits_total") == hits + 1


def test_models_lists_each_model_with_its_state_and_capabilities(two_models: Server) -> None:
    url = two_models.base_url
    cards = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert [card["id"] for card in cards] == ["efficientnet-lite0", "checksum"]
    assert [card["state"] for card in cards] == ["ready", "ready"]
    # the classifier also embeds (its 1280-wide features); the checksum model only answers chat
    assert [card["capabilities"] for card in cards] == [
        {"chat": True, "embeddings": True, "tokenize": False, "max_model_len": None},
        {"chat": True, "embeddings": False, "tokenize": False, "max_model_len": None}]
    one = httpx.get(url + "/v1/models/checksum", timeout=10)
    assert one.status_code == 200 and one.json() == cards[1]


def test_readiness_is_per_model_and_for_all(two_models: Server) -> None:
    url = two_models.base_url
    assert httpx.get(url + "/ready", timeout=10).status_code == 200
    for model in ("efficientnet-lite0", "checksum"):
        assert httpx.get(f"{url}/ready/{model}", timeout=10).json() == {"status": "ready", "model": model}
        assert httpx.get(url + "/ready", params={"model": model}, timeout=10).status_code == 200
    missing = httpx.get(url + "/ready/gpt-4", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/embeddings", "/tokenize"])
def test_an_unknown_model_is_a_404_naming_the_served_ones(two_models: Server, path: str) -> None:
    body = {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}
    if path == "/v1/embeddings":
        body = {"model": "gpt-4", "input": "hi"}
    response = httpx.post(two_models.base_url + path, json=body, timeout=10)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "model"
    assert "'efficientnet-lite0', 'checksum'" in error["message"]


def test_each_model_has_its_own_workers(two_models: Server) -> None:
    workers = [cmd for _, cmd in two_models.children() if "-m worker" in cmd]
    assert sorted(cmd.split("--model ", 1)[1].split()[0] for cmd in workers) == ["checksum", "efficientnet-lite0"]
    assert two_models.metric("shmgate_workers_ready") == 2


def test_the_log_says_how_the_queue_budget_was_split(two_models: Server) -> None:
    log = two_models.log_path.read_text()
    assert "1 request efficientnet-lite0 x" in log and "1 request checksum x" in log, log[-3000:]


def test_the_startup_summary_names_both_models(two_models: Server) -> None:
    assert 'clients send "model": "efficientnet-lite0" or "checksum"' in two_models.log_path.read_text()
