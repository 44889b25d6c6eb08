"""Where should a VLM's image processing run? shmgate's frontends vs the model's own process.

Servers of the same tiny Qwen2-VL (tests/hf_fixture.py, built into a temporary directory),
side by side in one run:
- ``shmgate``: ``shmgate serve --model hf:<dir>``: decoding, the image processor, chat template
  and tokenizer run in the frontend processes; the worker only copies tensors out of the arena
  and generates, up to 8 requests per padded batched forward (the default).
- ``shmgate, --max-batch-size 1``: the same, one request at a time start to finish, to separate
  the effect of batching from that of where processing runs.
- ``naive``: bench/naive_hf_server.py: one process; the same preprocessing and backend code runs
  on the thread that owns the model, right before each request's generation (what a plain
  FastAPI + transformers server does).

Why this comparison, and not shmgate with processing moved into its worker: the naive server
is the design people actually deploy, and with the same code, one model thread and the same
greedy answers, what differs is where the processing runs, the transport, and scheduling: the
naive server interleaves its requests per token (each with its own forward pass), shmgate
decodes a batch in one forward per token (or, at batch size 1, runs one request at a time). Both give the model one torch
thread (a 64-wide model gains nothing from more; the machine has 2 cores).

Per concurrency (1 and 16 by default), ``bench_client.loadgen`` sends streamed, greedy
(temperature 0) requests with unique bytes (no cache hits) over the 1024 px test photos and
reports requests/s, latency and time to first token. Worker busy time is read from each
server before and after the load (shmgate: ``shmgate_worker_busy_seconds_total`` on /metrics,
the time its workers spend running batches; naive: ``busy_s`` on /stats, the time its model
thread spends running anything) and divided by the requests sent (timed + warm-up).
Identical greedy answers per image (``mismatches`` 0) check that neither server mixed requests.

The shared 2-core machine is noisy (+-40 % between runs of one server), so the servers take
turns for ``--rounds`` rounds and the table shows medians, with the range of requests/s.

Usage: ``python bench/hf_processing.py [--rounds 3] [--requests N] [--concurrency 1 16] [--max-tokens 16]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.e2e import IMAGES, ServerProcess, fmt, free_port, render_table
from shmgate.bench_client import loadgen
from tests.hf_fixture import FAMILIES, build_tiny_vlm


@dataclass(frozen=True)
class Contender:
    """A server of the tiny model: how to start it, and how to read its model's busy seconds."""

    name: str
    command: tuple[str, ...]  # placeholders: {python}, {repo}, {port}, {model_dir}, {device}
    ready_path: str
    busy_path: str

    def busy_seconds(self, client: httpx.Client) -> tuple[float, float | None]:
        """(model busy seconds, of which image + prompt processing; None where it is not in the model's process)."""
        response = client.get(self.busy_path)
        response.raise_for_status()
        if self.busy_path == "/stats":
            stats = response.json()
            return float(stats["busy_s"]), float(stats["processing_s"])
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in response.text.splitlines()
            if line.startswith("shmgate_worker_busy_seconds_total")
        ), None


CONTENDERS = (
    Contender(
        "shmgate (frontend processing)",
        (
            "{python}",
            "-m",
            "shmgate.gateway",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--model",
            "hf:{model_dir}",
            "--workers",
            "1",
            "--threads",
            "1",
            "--device",
            "{device}",
        ),
        "/ready",
        "/metrics",
    ),
    Contender(
        "shmgate, --max-batch-size 1",
        (
            "{python}",
            "-m",
            "shmgate.gateway",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--model",
            "hf:{model_dir}",
            "--workers",
            "1",
            "--threads",
            "1",
            "--max-batch-size",
            "1",
            "--device",
            "{device}",
        ),
        "/ready",
        "/metrics",
    ),
    Contender(
        "naive (processing in the model thread)",
        (
            "{python}",
            "{repo}/bench/naive_hf_server.py",
            "--port",
            "{port}",
            "--model-dir",
            "{model_dir}",
            "--threads",
            "1",
            "--device",
            "{device}",
        ),
        "/health",
        "/stats",
    ),
)


async def measure(
    contender: Contender, model_dir: Path, images: Path, log_dir: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Start one server, load it at every concurrency, stop it."""
    port = free_port()
    values = {
        "python": sys.executable,
        "repo": str(REPO),
        "port": str(port),
        "model_dir": str(model_dir),
        "device": args.device,
    }
    server = ServerProcess(
        [part.format(**values) for part in contender.command], log_dir / f"{contender.name.split()[0]}.log"
    )
    base_url = f"http://127.0.0.1:{port}"
    results = []
    for attempt in range(3):  # other jobs on a shared machine can exhaust the message-queue quota for a while
        server.start()
        try:
            await server.wait_ready(base_url + contender.ready_path, 180.0)
            break
        except RuntimeError as exc:
            server.stop()
            if attempt == 2:
                raise
            print(f"  start failed, retrying in 20 s: {str(exc).splitlines()[-1][:200]}", file=sys.stderr)
            await asyncio.sleep(20)
    try:
        for concurrency in args.concurrency:
            parser = argparse.ArgumentParser()
            loadgen.add_arguments(parser)
            load = parser.parse_args(
                [
                    "--base-url",
                    base_url,
                    "--model",
                    model_dir.name,
                    "--concurrency",
                    str(concurrency),
                    "--requests",
                    str(args.requests),
                    "--images",
                    str(images),
                    "--server-pid",
                    str(server.pid),
                    "--unique",
                    "--stream",
                    "--temperature",
                    "0",
                    "--max-tokens",
                    str(args.max_tokens),
                ]
            )
            with httpx.Client(base_url=base_url, timeout=10) as client:
                busy_before, processing_before = contender.busy_seconds(client)
                began = time.monotonic()
                result = await loadgen.run(load)
                busy_after, processing_after = contender.busy_seconds(client)
            sent = result["requests"] + result["warmup"]
            processing = None if processing_after is None else processing_after - (processing_before or 0.0)
            result.update(
                server=contender.name,
                busy_ms_per_request=1000 * (busy_after - busy_before) / sent,
                processing_ms_per_request=None if processing is None else 1000 * processing / sent,
                run_s=round(time.monotonic() - began, 1),
            )
            print(
                f"  {contender.name} c={concurrency}: {result['requests_per_s']} req/s, "
                f"ttft p50 {result['ttft_p50_ms']} ms, busy {result['busy_ms_per_request']:.1f} ms/req, "
                f"errors {result['errors']}, mismatches {result['mismatches']}",
                file=sys.stderr,
                flush=True,
            )
            results.append(result)
    finally:
        server.stop()
    return results


def table(results: list[dict[str, Any]], max_tokens: int) -> str:
    """One row per (server, concurrency): medians over the rounds, and the range of req/s.

    tokens/s is req/s x ``max_tokens``: the tiny fixtures never end early (their control tokens'
    logits are zeroed), so every answer is ``max_tokens`` long.
    """
    columns = [
        "server",
        "conc",
        "req/s (median)",
        "tokens/s",
        "req/s range",
        "ttft p50 ms",
        "ttft p90 ms",
        "latency p50 ms",
        "worker busy ms/req",
        "of which processing",
        "server CPU ms/req",
        "errors",
        "mismatches",
    ]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["server"], r["concurrency"]), []).append(r)
    rows = []
    for (server, concurrency), runs in groups.items():

        def med(key: str, scale: float = 1.0, runs: list[dict[str, Any]] = runs) -> float | None:
            values = [r[key] * scale for r in runs if r[key] is not None]
            return statistics.median(values) if values else None

        rates = [r["requests_per_s"] for r in runs]
        rate = med("requests_per_s")
        rows.append(
            [
                server,
                concurrency,
                fmt(rate),
                fmt(None if rate is None else rate * max_tokens),
                f"{min(rates):.1f}-{max(rates):.1f}",
                fmt(med("ttft_p50_ms")),
                fmt(med("ttft_p90_ms")),
                fmt(med("p50_ms")),
                fmt(med("busy_ms_per_request")),
                fmt(med("processing_ms_per_request")),
                fmt(med("cpu_s_per_request", 1000.0)),
                sum(r["errors"] for r in runs),
                sum(r["mismatches"] for r in runs),
            ]
        )
    return render_table(columns, rows)


async def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="shmgate-hfbench-") as tmp:
        model_dir = build_tiny_vlm(Path(tmp) / ("tiny-" + args.family.replace("_", "-")), args.family)
        images = Path(tmp) / "images"
        images.mkdir()
        for image in IMAGES:  # the 1024 px photos only
            (images / image.name).symlink_to(image)
        log_dir = Path(args.log_dir) if args.log_dir else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for round_no in range(1, args.rounds + 1):  # contenders alternate, so a noisy spell hits all of them
            for contender in CONTENDERS:
                print(f"round {round_no}: {contender.name}", file=sys.stderr, flush=True)
                results += await measure(contender, model_dir, images, log_dir, args)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96, help="timed requests per point")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--device", default="cpu", help="where every server runs the model: cpu or cuda")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all servers; the table shows medians")
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    parser.add_argument(
        "--family",
        default="qwen2_vl",
        choices=FAMILIES,
        help="which tiny model tests/hf_fixture.py builds (config.json model_type)",
    )
    args = parser.parse_args(argv)
    results = asyncio.run(run_all(args))
    print(table(results, args.max_tokens))
    return 0 if results and all(r["errors"] == 0 and r["mismatches"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
