"""Server CPU per request: one ``shmgate serve`` with two models against two one-model servers, same load.

The two models are the checksum model under two served names (``a`` and ``b``), so the work per request
is the gateway's own (HTTP, decode, arena, queues, the digest) and not a model's. Each configuration
gets one frontend and one worker per model:

    together   shmgate serve --model checksum --served-model-name a --model checksum --served-model-name b
    apart      shmgate serve --model checksum --served-model-name a, and another for b

The load: ``--requests`` requests alternating a and b, ``--concurrency`` at a time, each a new image
(no cache hits: the two models would share a repeated image's decode), sent to the server that serves
the model. The figure is the CPU time (user + system, every process of the server trees, from /proc)
per request, over rounds in ABBA order.

Usage (from the repository root; the children run this checkout's code):
    python bench/models_cpu.py [--requests 600] [--concurrency 8] [--pairs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
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
TICKS = os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _png(seed: int) -> str:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (96, 96, 3), dtype=np.uint8)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _tree_cpu_s(root: int) -> float:
    """User + system CPU seconds of ``root`` and every live descendant."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / TICKS
    total = 0.0
    for pid, cpu in times.items():
        walk = pid
        while walk > 1 and walk != root:
            walk = parents.get(walk, 0)
        if walk == root:
            total += cpu
    return total


class Serve:
    def __init__(self, tmp: Path, names: list[str]) -> None:
        self.port = _free_port()
        flags = [f for name in names for f in ("--model", "checksum", "--served-model-name", name)]
        self.log = open(tmp / f"serve-{'-'.join(names)}.log", "wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shmgate.gateway",
                "serve",
                "--port",
                str(self.port),
                *flags,
                "--frontends",
                "1",
                "--workers",
                "1",
                "--arena-size",
                "128MiB",
                "--threads",
                "1",
            ],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"not ready; see {self.log.name}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)
        self.log.close()


async def _load(routes: dict[str, str], requests: int, concurrency: int, seed: int) -> None:
    """``requests`` alternating a and b, each a new image, ``concurrency`` at a time; every answer a 200."""
    limits = httpx.Limits(max_connections=2 * concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(i)

        async def runner() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                model = "ab"[i % 2]
                body = {
                    "model": model,
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png(seed + i)}}]}
                    ],
                }
                response = await client.post(routes[model] + "/v1/chat/completions", json=body)
                if response.status_code != 200:
                    raise SystemExit(f"{model}: {response.status_code} {response.text[:200]}")

        await asyncio.gather(*(runner() for _ in range(concurrency)))


def _round(tmp: Path, together: bool, requests: int, concurrency: int, seed: int) -> float:
    """ms of server CPU per request for one configuration."""
    servers = [Serve(tmp, ["a", "b"])] if together else [Serve(tmp, ["a"]), Serve(tmp, ["b"])]
    try:
        for server in servers:
            server.wait_ready()
        routes = {"a": servers[0].url, "b": servers[-1].url}
        asyncio.run(_load(routes, 40, concurrency, seed + 10_000_000))  # warm
        before = sum(_tree_cpu_s(s.process.pid) for s in servers)
        asyncio.run(_load(routes, requests, concurrency, seed))
        after = sum(_tree_cpu_s(s.process.pid) for s in servers)
    finally:
        for server in servers:
            server.stop()
    return 1000 * (after - before) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=2, help="ABBA pairs of rounds")
    args = parser.parse_args()
    figures: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = (True, False) if pair % 2 == 0 else (False, True)
            for together in order:
                ms = _round(Path(tmp), together, args.requests, args.concurrency, seed=pair * 100_000 + together)
                figures[together].append(ms)
                print(f"{'together' if together else 'apart':8s} {ms:.2f} ms CPU per request", flush=True)
    for together, values in figures.items():
        print(
            f"{'one two-model server' if together else 'two one-model servers'}: median "
            f"{statistics.median(values):.2f} ms CPU per request ({', '.join(f'{v:.2f}' for v in values)})"
        )


if __name__ == "__main__":
    main()
