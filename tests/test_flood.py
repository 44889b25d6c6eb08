"""A flood: ten times more concurrent requests than a deliberately small server can hold.

The server gets 2 frontends of at most 4 requests in flight each, a 2 MiB arena (1 MiB, about six
preprocessed images, per frontend), a request queue 4 deep and one worker: it can hold 8 requests.
Three waves of 80 concurrent requests (two images per request, then one, then two: the arena or the
in-flight bound is met first), each on its own connection and each held in flight ~0.5 s by the
checksum backend's trickle, must each get a correct answer or a quick 429/503 OpenAI error with
Retry-After (in-flight bound, full arena, full queue); frontend private memory stays bounded; and
afterwards the service recovers on its own: arena holds back to 0, a normal request answered.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from shmgate.bench_client.processes import sample_process
from tests.serving import (
    Server,
    data_url,
    expected_checksum,
    image_request,
    noise_png,
    start_server,
    stop_and_check,
    wait_until,
)

CAPACITY = 8  # 2 frontends x --max-in-flight 4
FLOOD = 10 * CAPACITY
WAVES = 3
HANG_GUARD_S = 60.0
# Generous bounds: 40 concurrent bodies in one frontend take tens of MiB while they are parsed; a leak of
# one body per request (~135 KiB, 80 per wave) shows as steady growth from wave to wave instead.
MAX_FRONTEND_GROWTH_KIB = 128 << 10  # first wave over the idle frontend
MAX_GROWTH_AFTER_FIRST_WAVE_KIB = 32 << 10


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        "checksum",
        tmp_path_factory.mktemp("flood"),
        "--workers",
        "1",
        "--max-in-flight",
        "4",
        "--arena-size",
        "2MiB",
        "--queue-depth",
        "4",
        "--max-batch-size",
        "4",
    )
    try:
        yield server
    finally:
        stop_and_check(server)


def _request(seed: int, n_images: int) -> tuple[list[bytes], dict[str, object]]:
    images = [noise_png(seed + 50_000 * k, size=128) for k in range(n_images)]
    body = image_request("checksum", images[0], mime="image/png", text="checksum:trickle 25")
    content = body["messages"][0]["content"]  # type: ignore[index]
    content += [{"type": "image_url", "image_url": {"url": data_url(d, "image/png")}} for d in images[1:]]
    return images, body


async def _one(
    client: httpx.AsyncClient, data: list[bytes], body: dict[str, object]
) -> tuple[httpx.Response, float, list[bytes]]:
    started = time.monotonic()
    response = await client.post("/v1/chat/completions", json=body)
    return response, time.monotonic() - started, data


def _wave(base_url: str, seed: int, n_images: int) -> list[tuple[httpx.Response, float, list[bytes]]]:
    bodies = [_request(seed + i, n_images) for i in range(FLOOD)]

    async def run() -> list[tuple[httpx.Response, float, list[bytes]]]:
        limits = httpx.Limits(max_connections=FLOOD)  # all at once: one connection each
        async with httpx.AsyncClient(base_url=base_url, timeout=HANG_GUARD_S, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(*(_one(client, d, b) for d, b in bodies)), HANG_GUARD_S)

    return asyncio.run(run())


def _private_kib(server: Server) -> dict[int, int]:
    return {pid: s.anon_kib for pid in server.pids("frontend") if (s := sample_process(pid)) is not None}


def test_a_flood_of_ten_times_capacity_is_refused_quickly_and_the_server_recovers(small_server: Server) -> None:
    server = small_server
    warm = noise_png(1)
    assert (
        httpx.post(
            server.base_url + "/v1/chat/completions", json=image_request("checksum", warm, mime="image/png"), timeout=60
        ).status_code
        == 200
    )
    memory = [_private_kib(server)]
    outcomes: Counter[str] = Counter()
    slowest_refusal_s = 0.0
    for wave in range(WAVES):
        # two images per request fill the arena first (503 arena_full), one per request mostly meets
        # the in-flight bound first (429 overloaded)
        for response, took_s, data in _wave(server.base_url, 100_000 + wave * FLOOD, 2 - wave % 2):
            if response.status_code == 200:
                answer = response.json()["choices"][0]["message"]["content"]
                assert all(expected_checksum(d) in answer for d in data), answer
                outcomes["ok"] += 1
                continue
            assert response.status_code in (429, 503), response.text
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] in ("overloaded", "arena_full", "channel_full"), error
            assert int(response.headers["retry-after"]) >= 1
            outcomes[f"{response.status_code} {error['code']}"] += 1
            slowest_refusal_s = max(slowest_refusal_s, took_s)
        memory.append(_private_kib(server))
    assert outcomes["ok"] >= 1 and outcomes["ok"] < WAVES * FLOOD, outcomes
    for pid, before in memory[0].items():
        assert memory[-1][pid] - before < MAX_FRONTEND_GROWTH_KIB, memory
        assert memory[-1][pid] - memory[1][pid] < MAX_GROWTH_AFTER_FIRST_WAVE_KIB, memory
    # recovery, with nobody's help
    took = wait_until(
        lambda: server.metric("shmgate_in_flight_requests") == 0 and server.metric("shmgate_arena_held_bytes") == 0,
        30,
        "arena holds released",
    )
    after = noise_png(2)
    response = httpx.post(
        server.base_url + "/v1/chat/completions", json=image_request("checksum", after, mime="image/png"), timeout=60
    )
    assert (
        response.status_code == 200 and expected_checksum(after) in response.json()["choices"][0]["message"]["content"]
    )
    print(
        f"\nflood: {WAVES} x {FLOOD} concurrent: {dict(outcomes)}; slowest refusal {slowest_refusal_s:.2f} s; "
        f"frontend private KiB per wave {memory}; holds 0 after {took:.1f} s"
    )
