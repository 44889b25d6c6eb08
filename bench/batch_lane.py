"""The Batch API beside interactive traffic, and alone (the bulk lane, docs/BATCH.md).

One ``shmgate serve`` of the checksum model (a worker slowed by ``--diag-batch-delay-ms`` so the
model, like a GPU's, costs per batch rather than per row, and is not free), two frontends. Every
image is distinct (no cache hits). Two parts, in one run:

1. Beside interactive load: for each ``--concurrency``, windows alternate, idle then with a batch
   of ``--lines`` lines running, ``--windows`` times; in each, closed-loop clients send interactive
   requests. Prints p50/p99 per kind of window (and their ratio), and the batch lines done per
   second while the interactive load ran.
2. Alone: a batch of ``--alone-lines`` lines, then the same number of such requests sent over HTTP
   in a closed loop at ``--batch-in-flight`` clients (the runner's own cap), alternated
   ``--alone-rounds`` times. Both rates are steady state: lines (requests) done between the first
   and the last one seen done, polled every 100 ms (a batch's pick-up, at most the runner's 0.5 s
   poll, and its output files are left out, and printed apart).

    flock /tmp/bench.lock python -m bench batch-lane --concurrency 2 8 --windows 3 --window-s 6
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
from typing import Any

import httpx

from bench.servers import REPO, ServerProcess, free_port, shmgate_serve
from shmgate.gateway.stages import parse_server_timing
from shmgate.shared.rawhttp import RawClient
from tests.serving import image_request, noise_png

POLL_S = 0.1


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _body(seed: int) -> bytes:
    return json.dumps(image_request("checksum", noise_png(seed % 1_000_000_000, 32))).encode()


async def _interactive(
    base: str, concurrency: int, seconds: float, seed0: int, stages: dict[str, list[float]] | None = None
) -> list[float]:
    """Closed-loop interactive requests for ``seconds``: their latencies; each one's Server-Timing
    durations (ms) added to ``stages`` by stage name."""
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    counter = iter(range(seed0, seed0 + 10_000_000))
    client = RawClient(base)

    async def one_client() -> None:
        while time.monotonic() < deadline:
            body = _body(next(counter))
            start = time.perf_counter()
            reply, lease = await client.post("/v1/chat/completions", body)
            await reply.read()
            lease.release()
            if reply.status == 200:
                latencies.append(time.perf_counter() - start)
                if stages is not None:
                    for name, ms in parse_server_timing(reply.headers.get("server-timing", "")).items():
                        stages.setdefault(name, []).append(ms)

    try:
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
    finally:
        await client.aclose()
    return latencies


async def _closed_loop(base: str, concurrency: int, bodies: list[bytes]) -> float:
    """The same requests a batch runs, over HTTP, ``concurrency`` at a time (with the load generator's
    client, shared/rawhttp.py, the one the batch runner uses): requests per second."""
    todo = iter(bodies)
    client = RawClient(base)

    async def one_client() -> None:
        for body in todo:
            reply, lease = await client.post("/v1/chat/completions", body)
            await reply.read()
            lease.release()
            if reply.status != 200:
                raise RuntimeError(f"HTTP {reply.status}")

    try:
        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return len(bodies) / (time.perf_counter() - started)
    finally:
        await client.aclose()


def _lines(seed0: int, n: int) -> bytes:
    return b"".join(
        b'{"custom_id": "b-%d", "method": "POST", "url": "/v1/chat/completions", "body": %s}\n' % (i, _body(seed0 + i))
        for i in range(n)
    )


async def _create(http: httpx.AsyncClient, base: str, lines: bytes) -> str:
    uploaded = (
        await http.post(base + "/v1/files", files={"file": ("b.jsonl", io.BytesIO(lines))}, data={"purpose": "batch"})
    ).json()
    batch = await http.post(
        base + "/v1/batches",
        json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    return str(batch.json()["id"])


async def _done(http: httpx.AsyncClient, base: str, batch_id: str) -> tuple[str, int]:
    batch = (await http.get(f"{base}/v1/batches/{batch_id}")).json()
    return batch["status"], batch["request_counts"]["completed"] + batch["request_counts"]["failed"]


async def _until_started(http: httpx.AsyncClient, base: str, batch_id: str) -> None:
    while (await _done(http, base, batch_id))[1] == 0:
        await asyncio.sleep(POLL_S)


async def _cancel(http: httpx.AsyncClient, base: str, batch_id: str) -> None:
    await http.post(f"{base}/v1/batches/{batch_id}/cancel")
    while (await _done(http, base, batch_id))[0] not in ("cancelled", "completed"):
        await asyncio.sleep(POLL_S)


async def _beside(http: httpx.AsyncClient, base: str, args: argparse.Namespace, c: int) -> dict[str, Any]:
    idle: list[float] = []
    busy: list[float] = []
    rates: list[float] = []
    idle_stages: dict[str, list[float]] = {}
    busy_stages: dict[str, list[float]] = {}
    finished_early = 0
    for window in range(args.windows):
        seed = (c * 100 + window) * 1_000_000
        idle += await _interactive(base, c, args.window_s, seed, idle_stages)
        batch_id = await _create(http, base, _lines(seed + 500_000, args.lines))
        await _until_started(http, base, batch_id)
        _, before = await _done(http, base, batch_id)
        started = time.monotonic()
        busy += await _interactive(base, c, args.window_s, seed + 200_000, busy_stages)
        status, after = await _done(http, base, batch_id)
        rates.append((after - before) / (time.monotonic() - started))
        finished_early += status != "in_progress"
        await _cancel(http, base, batch_id)
    result: dict[str, Any] = {"concurrency": c, "batch_lines_per_s": rates, "batches_done_early": finished_early}
    for name, values, stages in (("idle", idle, idle_stages), ("batch", busy, busy_stages)):
        result[name] = {
            "n": len(values),
            "p50_ms": statistics.median(values) * 1e3,
            "p99_ms": _percentile(values, 0.99) * 1e3,
            "stages_mean_ms": {stage: statistics.fmean(ms) for stage, ms in stages.items()},
        }
    return result


async def _batch_alone(http: httpx.AsyncClient, base: str, lines: bytes, n: int) -> tuple[float, float]:
    """A batch run alone: its steady lines/s, and lines over the time from create to completed."""
    created = time.monotonic()
    batch_id = await _create(http, base, lines)
    first: tuple[float, int] | None = None
    while True:
        status, done = await _done(http, base, batch_id)
        now = time.monotonic()
        if first is None and done > 0:
            first = (now, done)
        if done >= n and first is not None:
            last = (now, done)
            break
        await asyncio.sleep(POLL_S)
    while status != "completed":
        await asyncio.sleep(POLL_S)
        status, _ = await _done(http, base, batch_id)
    steady = (last[1] - first[1]) / max(1e-9, last[0] - first[0])
    return steady, n / (time.monotonic() - created)


async def _alone(http: httpx.AsyncClient, base: str, args: argparse.Namespace) -> dict[str, Any]:
    batch: list[float] = []
    end_to_end: list[float] = []
    over_http: list[float] = []
    n = args.alone_lines
    for round_ in range(args.alone_rounds):
        seed = (900 + round_) * 1_000_000
        steady, whole = await _batch_alone(http, base, _lines(seed, n), n)
        batch.append(steady)
        end_to_end.append(whole)
        over_http.append(await _closed_loop(base, args.batch_in_flight, [_body(seed + 500_000 + i) for i in range(n)]))
    return {
        "lines": n,
        "batch_lines_per_s": batch,
        "batch_create_to_completed_lines_per_s": end_to_end,
        "http_closed_loop_req_per_s": over_http,
        "http_concurrency": args.batch_in_flight,
        "ratio": [b / h for b, h in zip(batch, over_http)],
    }


def _report(beside: list[dict[str, Any]], alone: dict[str, Any] | None) -> None:
    for r in beside:
        idle, busy = r["idle"], r["batch"]
        print(
            f"c={r['concurrency']}: idle n={idle['n']} p50={idle['p50_ms']:.1f} ms p99={idle['p99_ms']:.1f} ms | "
            f"with a batch n={busy['n']} p50={busy['p50_ms']:.1f} ms p99={busy['p99_ms']:.1f} ms | "
            f"ratio p50 {busy['p50_ms'] / idle['p50_ms']:.2f}x p99 {busy['p99_ms'] / idle['p99_ms']:.2f}x | "
            f"batch lines/s {', '.join(f'{x:.0f}' for x in r['batch_lines_per_s'])}"
            + (f" ({r['batches_done_early']} finished early)" if r["batches_done_early"] else "")
        )
        stages = sorted(set(idle["stages_mean_ms"]) | set(busy["stages_mean_ms"]))
        print(
            "   stage means (ms), idle -> with a batch: "
            + "; ".join(
                f"{stage} {idle['stages_mean_ms'].get(stage, 0):.2f} -> {busy['stages_mean_ms'].get(stage, 0):.2f}"
                for stage in stages
            )
        )
    if alone is not None:
        fmt = ", ".join
        print(
            f"alone ({alone['lines']} lines): batch {fmt(f'{x:.0f}' for x in alone['batch_lines_per_s'])} lines/s "
            f"(create to completed {fmt(f'{x:.0f}' for x in alone['batch_create_to_completed_lines_per_s'])}); "
            f"HTTP closed loop c={alone['http_concurrency']} "
            f"{fmt(f'{x:.0f}' for x in alone['http_closed_loop_req_per_s'])} req/s; "
            f"ratio {fmt(f'{x:.2f}' for x in alone['ratio'])}"
        )


async def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    port = free_port()
    flags = ["--model", "checksum", "--workers", "1", "--frontends", "2", "--batch-dir", str(tmp / "batches")]
    flags += ["--diag-batch-delay-ms", str(args.delay_ms), "--batch-max-in-flight", str(args.batch_in_flight)]
    flags += ["--server-timing"]
    server = ServerProcess(shmgate_serve(port, *flags, *args.serve_flag), tmp / "serve.log", tree=args.tree)
    server.start()
    base = f"http://127.0.0.1:{port}"
    try:
        await server.wait_ready(base + "/ready")
        async with httpx.AsyncClient(timeout=60) as http:
            await _interactive(base, 2, 1.0, 7_000_000_000)  # warm-up
            beside = [await _beside(http, base, args, c) for c in args.concurrency]
            alone = await _alone(http, base, args) if args.alone_rounds else None
        _report(beside, alone)
        if args.json:
            print(json.dumps({"beside": beside, "alone": alone}))
    finally:
        server.stop()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench batch-lane", description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[2, 8], help="interactive clients, each in turn")
    parser.add_argument("--windows", type=int, default=3, help="idle / batch pairs per concurrency")
    parser.add_argument("--window-s", type=float, default=6.0)
    parser.add_argument("--lines", type=int, default=3000, help="lines of each batch run beside interactive load")
    parser.add_argument("--alone-lines", type=int, default=1000, help="lines of a batch run alone (0 rounds: skip)")
    parser.add_argument("--alone-rounds", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=5.0, help="--diag-batch-delay-ms of the worker")
    parser.add_argument("--batch-in-flight", type=int, default=4, help="--batch-max-in-flight of the node")
    parser.add_argument("--serve-flag", action="append", default=[], help="one more shmgate serve argument")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    parser.add_argument(
        "--tree", type=Path, default=REPO, help="run the server from this checkout (e.g. an earlier commit's)"
    )
    asyncio.run(run(parser.parse_args(argv)))
    return 0
