"""Two workers of a tiny Qwen2-VL behind a real ``shmgate serve --encoder-share-mb``: one worker's tower run
serves the other (worker/encoder_share.py), visible per worker in /metrics, with the same answer."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving import Server, data_url, noise_png, start_server, stop_and_check, wait_until

MODEL = "tiny-qwen2-vl"


@pytest.fixture(scope="module")
def shared_server(tiny_qwen2_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        f"hf:{tiny_qwen2_vl_dir}",
        tmp_path_factory.mktemp("serve"),
        "--workers",
        "2",
        "--frontends",
        "1",
        "--threads",
        "1",
        "--encoder-share-mb",
        "4",
    )
    try:
        yield server
    finally:
        stop_and_check(server)  # the shared encoder segment and its semaphores go with the instance


def per_worker(server: Server, word: str) -> dict[str, float]:
    """worker slot -> shmgate_encoder_shared_<word>_total of the served model."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    pattern = rf'^shmgate_encoder_shared_{word}_total\{{model="{MODEL}",worker="(\d+)"\}} (\S+)$'
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE)}


def ask(server: Server, image_url: str) -> str:
    body = {
        "model": MODEL,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "What?"}],
            }
        ],
        "max_tokens": 8,
        "temperature": 0,
    }
    response = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    content: str = response.json()["choices"][0]["message"]["content"]
    return content


def test_a_second_workers_request_for_an_image_the_first_encoded_is_a_shared_hit_with_the_same_answer(
    shared_server: Server,
) -> None:
    image = data_url(noise_png(5150, size=96), mime="image/png")
    first = ask(shared_server, image)  # the tower runs in one worker, which publishes its output
    wait_until(lambda: sum(per_worker(shared_server, "publishes").values()) == 1, 10, "the publish reported")
    publishes = per_worker(shared_server, "publishes")
    assert sorted(publishes.values()) == [0.0, 1.0], publishes
    publisher = next(slot for slot, n in publishes.items() if n == 1)
    other = next(slot for slot in publishes if slot != publisher)
    # Idle workers take the shared request queue in turn; the publisher answers a repeat from its own
    # encoder cache, the other one from the shared outputs. Ask until the other one has answered.
    answers = []
    for _ in range(12):
        answers.append(ask(shared_server, image))
        if _settled(lambda: per_worker(shared_server, "hits").get(other, 0) >= 1):
            break
    hits = per_worker(shared_server, "hits")
    assert hits.get(other) == 1, (hits, per_worker(shared_server, "misses"))
    assert per_worker(shared_server, "publishes") == publishes  # nobody ran the tower again
    assert answers and all(answer == first for answer in answers), (first, answers)
    assert shared_server.metric("shmgate_vision_tower_runs_total") == 1


def test_a_new_image_is_a_miss_then_published(shared_server: Server) -> None:
    before_misses = sum(per_worker(shared_server, "misses").values())
    before_publishes = sum(per_worker(shared_server, "publishes").values())
    ask(shared_server, data_url(noise_png(5151, size=96), mime="image/png"))
    wait_until(lambda: sum(per_worker(shared_server, "publishes").values()) == before_publishes + 1, 10, "the publish")
    assert sum(per_worker(shared_server, "misses").values()) == before_misses + 1


def _settled(predicate: Callable[[], bool]) -> bool:
    """``predicate`` within the engines' report interval (worker/main.py ENGINE_REPORT_S), polled."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False
