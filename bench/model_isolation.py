"""Flood isolation between models on one node: does one model's flood change another model's latency?

One ``shmgate gateway --config`` serving two models from one arena, each with its own worker attached by
label (``shmgate worker --model X``) and its own request queue:

    slow   the checksum model served as ``slow``, its worker made slow on purpose (``--diag-batch-delay-ms``,
           batches of one): its capacity is 1000 / delay requests per second
    fast   the checksum model served as ``fast``, an ordinary worker

Two phases of ``--seconds`` each, the ``fast`` model measured by one closed-loop client (a new image per
request, so every one is decoded):

    alone    only the fast client
    flooded  the fast client, while an open-loop client (a process of its own) sends ``--flood-x`` times the
             slow model's capacity of requests to ``slow`` (one repeated image: the flood costs the
             frontends little decode, but every request still costs its HTTP, parse and admission)

Printed and written as JSON (``--out``): the fast model's p50/p99 in each phase, and what the flood got
(answered, 429, 503: its max_in_flight and its queue depth turn the excess away with Retry-After).
Then the shared decode: 20 new images, each sent to both models (one preprocessing): the decodes and
cache hits that took, from /metrics.

Usage (from the repository root; the children run this checkout's code):
    python bench/model_isolation.py [--seconds 20] [--slow-delay-ms 50] [--flood-x 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import io
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent

NODE_TOML = """
[[models]]
model = "checksum"
served_model_name = "slow"
max_in_flight = {slow_in_flight}
queue_depth = 4

[[models]]
model = "checksum"
served_model_name = "fast"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _png(seed: int, size: int = 64) -> str:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _body(model: str, url: str) -> dict[str, object]:
    return {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "digest"}, {"type": "image_url", "image_url": {"url": url}}],
            }
        ],
    }


class Node:
    """The gateway and its two workers, started and stopped by this script."""

    def __init__(self, tmp: Path, slow_delay_ms: float, slow_in_flight: int) -> None:
        config = tmp / "node.toml"
        config.write_text(NODE_TOML.format(slow_in_flight=slow_in_flight))
        self.port = _free_port()
        label = f"isolation-{os.getpid()}"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.log = open(tmp / "gateway.log", "wb")
        self.gateway = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shmgate.gateway",
                "gateway",
                "--port",
                str(self.port),
                "--config",
                str(config),
                "--frontends",
                "2",
                "--arena-size",
                "256MiB",
                "--label",
                label,
            ],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        common = ["--label", label, "--device", "cpu", "--threads", "1", "--model", "checksum"]
        self.workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "shmgate.worker",
                    *common,
                    "--served-model-name",
                    "slow",
                    "--max-batch-size",
                    "1",
                    "--diag-batch-delay-ms",
                    str(slow_delay_ms),
                ],
                env=env,
                stdout=self.log,
                stderr=subprocess.STDOUT,
            ),
            subprocess.Popen(
                [sys.executable, "-m", "shmgate.worker", *common, "--served-model-name", "fast"],
                env=env,
                stdout=self.log,
                stderr=subprocess.STDOUT,
            ),
        ]
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.log.flush()
        tail = Path(self.log.name).read_text(errors="replace")[-3000:]
        raise SystemExit(f"the node did not become ready; its log ends:\n{tail}")

    def stop(self) -> None:
        self.gateway.send_signal(signal.SIGTERM)
        self.gateway.wait(60)
        for worker in self.workers:
            worker.terminate()
            worker.wait(30)
        self.log.close()


async def _measure(client: httpx.AsyncClient, seconds: float, seed: int) -> list[float]:
    """The fast model's latencies (s), one request at a time, each with a new image."""
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        body = _body("fast", _png(seed + len(latencies)))
        started = time.perf_counter()
        response = await client.post("/v1/chat/completions", json=body)
        if response.status_code != 200:
            raise SystemExit(f"the fast model answered {response.status_code}: {response.text[:200]}")
        latencies.append(time.perf_counter() - started)
    return latencies


async def _flood(url: str, rate: float, seconds: float) -> collections.Counter[int]:
    """Open loop: ``rate`` requests a second to the slow model for ``seconds``; the statuses it got."""
    statuses: collections.Counter[int] = collections.Counter()
    body = _body("slow", _png(1))
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one() -> None:
            try:
                statuses[(await client.post("/v1/chat/completions", json=body)).status_code] += 1
            except httpx.HTTPError:
                statuses[0] += 1

        tasks = []
        started = time.monotonic()
        sent = 0
        while time.monotonic() - started < seconds:
            await asyncio.sleep(max(0.0, started + sent / rate - time.monotonic()))
            tasks.append(asyncio.create_task(one()))
            sent += 1
        await asyncio.gather(*tasks)
    return statuses


def _flood_process(url: str, rate: float, seconds: float, out: multiprocessing.Queue[dict[int, int]]) -> None:
    """The flood in a process of its own: its client's CPU is not the measuring client's event loop."""
    out.put(dict(asyncio.run(_flood(url, rate, seconds))))


def _summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "requests": len(ordered),
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


async def _run(url: str, seconds: float, flood_rate: float) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for i in range(20):  # warm both models
            await client.post("/v1/chat/completions", json=_body("fast", _png(10_000 + i)))
            await client.post("/v1/chat/completions", json=_body("slow", _png(1)))
        alone = await _measure(client, seconds, seed=20_000)
        results: multiprocessing.Queue[dict[int, int]] = multiprocessing.Queue()
        flood = multiprocessing.Process(target=_flood_process, args=(url, flood_rate, seconds + 2.0, results))
        flood.start()
        await asyncio.sleep(1.5)  # the slow model's queue and in-flight bound fill first
        flooded = await _measure(client, seconds, seed=40_000)
        statuses = results.get(timeout=120)
        flood.join(30)
        shared = await _shared_decode(client, 20)
    return {
        "alone": _summary(alone),
        "flooded": _summary(flooded),
        "flood": {"rate_per_s": flood_rate, "statuses": {str(k): v for k, v in sorted(statuses.items())}},
        "shared_decode": shared,
    }


async def _metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


async def _shared_decode(client: httpx.AsyncClient, n: int) -> dict[str, float]:
    """``n`` new images, each sent to one model and then to the other (both the checksum pipeline):
    the decodes (cache misses) and cache hits that cost, from /metrics."""
    names = ("shmgate_cache_misses_total", "shmgate_cache_hits_total", "shmgate_cache_remote_hits_total")
    before = [await _metric(client, name) for name in names]
    for i in range(n):
        url = _png(60_000 + i)
        for model in ("fast", "slow"):
            response = await client.post("/v1/chat/completions", json=_body(model, url))
            if response.status_code != 200:
                raise SystemExit(f"{model} answered {response.status_code}: {response.text[:200]}")
    after = [await _metric(client, name) for name in names]
    return {
        "images": n,
        "requests": 2 * n,
        "decodes": after[0] - before[0],
        "cache_hits": after[1] - before[1] + after[2] - before[2],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--slow-delay-ms", type=float, default=50.0)
    parser.add_argument("--flood-x", type=float, default=10.0, help="the flood, in multiples of the slow capacity")
    parser.add_argument("--slow-in-flight", type=int, default=8, help="the slow model's max_in_flight per frontend")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    capacity = 1000.0 / args.slow_delay_ms
    with tempfile.TemporaryDirectory() as tmp:
        node = Node(Path(tmp), args.slow_delay_ms, args.slow_in_flight)
        try:
            node.wait_ready()
            result = asyncio.run(_run(node.url, args.seconds, args.flood_x * capacity))
        finally:
            node.stop()
    result["slow_capacity_per_s"] = capacity
    alone, flooded = result["alone"], result["flooded"]
    assert isinstance(alone, dict) and isinstance(flooded, dict)
    print(f"fast model alone:   p50 {alone['p50_ms']:.1f} ms, p99 {alone['p99_ms']:.1f} ms ({alone['requests']} req)")
    print(
        f"fast model flooded: p50 {flooded['p50_ms']:.1f} ms, p99 {flooded['p99_ms']:.1f} ms "
        f"({flooded['requests']} req) while slow got {args.flood_x:g}x its {capacity:g} req/s: "
        f"{result['flood']}"
    )
    print(f"shared decode: {result['shared_decode']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
