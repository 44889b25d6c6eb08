"""Every cache a worker keeps is bounded in bytes and visible in /metrics, on a real ``shmgate serve``.

An ``hf:`` Qwen2-VL worker keeps vision-tower outputs by image (encoder cache), prompts' KV by prefix
(prefix cache) and compiled grammars (grammar cache). Under varied traffic they fill to their bounds and
then evict, so the worker's memory grows for a while and levels off; these gauges are how an operator
tells that from a leak (docs/OBSERVABILITY.md). The server runs with bounds small enough for a few
distinct images to overflow them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shmgate.shared.stats_layout import WORKER_CACHES
from tests.serving import Server, data_url, noise_png, start_server, stop_and_check, wait_until

ENCODER_CACHE_MB = 0.02  # a handful of the tiny model's tower outputs
PREFIX_CACHE_MB = 0.05
GUARD_S = 60.0


@pytest.fixture(scope="module")
def small_caches(tiny_qwen2_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        f"hf:{tiny_qwen2_vl_dir}",
        tmp_path_factory.mktemp("caches"),
        "--threads",
        "1",
        "--frontends",
        "1",
        "--workers",
        "1",
        "--encoder-cache-mb",
        str(ENCODER_CACHE_MB),
        "--prefix-cache-mb",
        str(PREFIX_CACHE_MB),
    )
    try:
        yield server
    finally:
        stop_and_check(server)


def _by_cache(text: str, name: str) -> dict[str, float]:
    """``name{cache="..."}`` samples of a /metrics text, by cache."""
    pattern = re.compile(rf'^{name}{{cache="([a-z]+)"}} (\S+)$', re.M)
    return {cache: float(value) for cache, value in pattern.findall(text)}


def _chat(server: Server, seed: int, **extra: object) -> httpx.Response:
    body = {
        "model": "tiny-qwen2-vl",
        "max_tokens": 2,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(noise_png(seed, size=96), "image/png")}},
                    {"type": "text", "text": f"Describe picture number {seed} in a few words, please."},
                ],
            }
        ],
        **extra,
    }
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=GUARD_S)


def test_the_workers_caches_fill_to_their_bounds_and_evict_and_say_so_in_metrics(small_caches: Server) -> None:
    server = small_caches
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for seed in range(12):
        extra = {}
        if seed < 2:  # two requests under one grammar: one compiled grammar, kept
            extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
        response = _chat(server, seed, **extra)
        assert response.status_code == 200, response.text

    def gauges() -> tuple[dict[str, float], ...]:
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
        return tuple(
            _by_cache(text, name)
            for name in (
                "shmgate_worker_cache_bytes",
                "shmgate_worker_cache_bound_bytes",
                "shmgate_worker_cache_entries",
                "shmgate_worker_cache_evictions_total",
            )
        )

    # published with the engine's report when the worker goes idle
    wait_until(lambda: gauges()[2].get("grammar", 0) >= 1, GUARD_S, "the caches' gauges published")
    held, bound, entries, evictions = gauges()
    assert set(held) == set(bound) == set(entries) == set(evictions) == set(WORKER_CACHES)
    assert bound["encoder"] == int(ENCODER_CACHE_MB * (1 << 20))
    assert bound["prefix"] == int(PREFIX_CACHE_MB * (1 << 20))
    for cache in ("encoder", "prefix"):
        # twelve distinct images overflow the bound: full, evicting, never above it
        assert 0 < held[cache] <= bound[cache], (cache, held, bound)
        assert entries[cache] >= 1 and evictions[cache] >= 1, (cache, entries, evictions)
    assert entries["grammar"] == 1 and evictions["grammar"] == 0
    assert 0 < held["grammar"] <= bound["grammar"]


def test_the_result_cache_says_its_bound_and_entries(small_caches: Server) -> None:
    """The frontends' result cache (off for a chat model: none of its answers is cached) reads zeros, never absent."""
    text = httpx.get(small_caches.base_url + "/metrics", timeout=10).text
    for name in ("shmgate_result_cache_bytes", "shmgate_result_cache_bound_bytes", "shmgate_result_cache_entries"):
        assert re.search(rf"^{name} 0\.0$", text, re.M), name
