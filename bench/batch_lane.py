"""Interactive latency with and without a batch running (the bulk lane, docs/BATCH.md).

One ``shmgate serve`` of the checksum model (a worker slowed by ``--diag-batch-delay-ms`` so the
model, not the HTTP path, is the bottleneck). Windows alternate: idle, then with a batch of
``--lines`` lines running, then idle again, and so on; in each, ``--concurrency`` closed-loop
clients send interactive requests with distinct images (no cache hits). Prints p50/p99 per kind of
window, and the batch lines done per second while the interactive load ran.

    flock /tmp/bench.lock python -m bench batch-lane --concurrency 2 --windows 2 --window-s 8
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.servers import ServerProcess, free_port, shmgate_serve
from tests.serving import image_request, noise_png


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _interactive(base: str, concurrency: int, seconds: float, seed0: int) -> list[float]:
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    counter = iter(range(seed0, seed0 + 10_000_000))

    async def client(http: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            body = image_request("checksum", noise_png(next(counter) % 100_000, 32))
            start = time.perf_counter()
            reply = await http.post(base + "/v1/chat/completions", json=body)
            if reply.status_code == 200:
                latencies.append(time.perf_counter() - start)

    async with httpx.AsyncClient(timeout=60) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return latencies


async def _done(http: httpx.AsyncClient, base: str, batch_id: str) -> tuple[str, int]:
    batch = (await http.get(f"{base}/v1/batches/{batch_id}")).json()
    return batch["status"], batch["request_counts"]["completed"] + batch["request_counts"]["failed"]


async def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    port = free_port()
    flags = ["--model", "checksum", "--workers", "1", "--frontends", "2", "--batch-dir", str(tmp / "batches")]
    flags += ["--diag-batch-delay-ms", str(args.delay_ms), "--batch-max-in-flight", str(args.batch_in_flight)]
    server = ServerProcess(shmgate_serve(port, *flags), tmp / "serve.log")
    server.start()
    base = f"http://127.0.0.1:{port}"
    try:
        await server.wait_ready(base + "/ready")
        lines = b"".join(
            json.dumps(
                {
                    "custom_id": f"b-{i}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": image_request("checksum", noise_png(500_000 + i, 32)),
                }
            ).encode()
            + b"\n"
            for i in range(args.lines)
        )
        idle: list[float] = []
        busy: list[float] = []
        rates: list[float] = []
        async with httpx.AsyncClient(timeout=60) as http:
            for window in range(args.windows):
                idle += await _interactive(base, args.concurrency, args.window_s, window * 1_000_000)
                uploaded = (
                    await http.post(
                        base + "/v1/files", files={"file": ("b.jsonl", io.BytesIO(lines))}, data={"purpose": "batch"}
                    )
                ).json()
                batch = (
                    await http.post(
                        base + "/v1/batches",
                        json={
                            "input_file_id": uploaded["id"],
                            "endpoint": "/v1/chat/completions",
                            "completion_window": "24h",
                        },
                    )
                ).json()
                await asyncio.sleep(1.0)  # the runner picks it up
                _, before = await _done(http, base, batch["id"])
                started = time.monotonic()
                busy += await _interactive(base, args.concurrency, args.window_s, window * 1_000_000 + 500_000)
                status, after = await _done(http, base, batch["id"])
                rates.append((after - before) / (time.monotonic() - started))
                await http.post(f"{base}/v1/batches/{batch['id']}/cancel")
                while status not in ("cancelled", "completed"):
                    await asyncio.sleep(0.5)
                    status, _ = await _done(http, base, batch["id"])
        for name, values in (("idle", idle), ("with a batch", busy)):
            print(
                f"c={args.concurrency} {name:>12}: n={len(values)} p50={statistics.median(values) * 1e3:.1f} ms "
                f"p99={_percentile(values, 0.99) * 1e3:.1f} ms"
            )
        print(f"batch lines/s while interactive load ran: {', '.join(f'{r:.1f}' for r in rates)}")
    finally:
        server.stop()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench batch-lane", description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--windows", type=int, default=2, help="idle / batch pairs")
    parser.add_argument("--window-s", type=float, default=8.0)
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--delay-ms", type=float, default=5.0, help="--diag-batch-delay-ms of the worker")
    parser.add_argument("--batch-in-flight", type=int, default=4)
    asyncio.run(run(parser.parse_args(argv)))
    return 0
