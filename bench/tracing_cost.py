"""What tracing costs: CPU per request of the frontend and the worker, tracing off against another tree
(e.g. main before tracing existed) and tracing on at 100 % sampling.

Each run starts a real ``shmgate serve --model checksum`` (1 frontend, 1 worker), sends a warm-up, then
``--requests`` requests with ``shmgate bench`` (8 concurrent, every image unique so each one is decoded),
and reads the processes' CPU time (``/proc/<pid>/stat`` utime + stime) before and after: CPU per request
is the difference over the requests. The three configurations run in a mirrored order per round
(other, off, on, on, off, other), so drift from other load on the machine falls on each alike.

    off    this checkout, no --otlp-traces-endpoint (the default)
    on     this checkout, --otlp-traces-endpoint to a collector this script runs on 127.0.0.1 (it reads
           and drops every export, answering 200), OTEL_TRACES_SAMPLER=always_on
    other  the tree given by --other, no tracing flag (e.g. ``git archive <base> | tar -x -C DIR``)

Usage (from the repository root):
    python bench/tracing_cost.py --other /tmp/shmgate-base [--rounds 2] [--requests 400]
    python bench/tracing_cost.py --span-cost    # in process: the SDK's CPU per span, bare and encoded
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.hangups import start  # noqa: E402

IMAGES = ROOT / "tests" / "data" / "images"
TICKS = os.sysconf("SC_CLK_TCK")


class DiscardingCollector:
    """An OTLP/HTTP endpoint that reads each export and drops it: the exporter's full cost, no storage."""

    def __init__(self) -> None:
        self.exports = 0
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                collector.exports += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def run(tree: Path, requests: int, extra: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(frontend, worker) CPU ms per request of one serve of ``tree``; a start refused for want of
    message-queue memory (other instances of this user hold it for now) is tried again."""
    for _ in range(20):
        try:
            return _run(tree, requests, extra, env)
        except RuntimeError as exc:
            if "message-queue memory" not in str(exc):
                raise
            time.sleep(5)
    raise RuntimeError("no message-queue memory for a server after 20 tries")


def _run(tree: Path, requests: int, extra: list[str], env: dict[str, str]) -> tuple[float, float]:
    server = start(tree, *extra, env=env)
    try:
        bench = [
            sys.executable,
            "-m",
            "shmgate.gateway",
            "bench",
            "--base-url",
            server.base_url,
            "--model",
            "checksum",
            "--images",
            str(IMAGES),
            "-c",
            "8",
            "--unique",
            "--no-stages",
            "--json",
        ]
        bench_env = dict(os.environ, PYTHONPATH=str(ROOT))
        subprocess.run([*bench, "-n", "40"], check=True, capture_output=True, cwd=ROOT, env=bench_env)  # warm-up
        pids = {role: server.pids(role) for role in ("frontend", "worker")}
        before = {role: sum(cpu_s(p) for p in ps) for role, ps in pids.items()}
        subprocess.run(
            [*bench, "-n", str(requests), "--warmup", "0"], check=True, capture_output=True, cwd=ROOT, env=bench_env
        )
        after = {role: sum(cpu_s(p) for p in ps) for role, ps in pids.items()}
        return tuple((after[r] - before[r]) / requests * 1000 for r in ("frontend", "worker"))  # type: ignore[return-value]
    finally:
        server.stop()


def span_cost(n: int = 20_000) -> None:
    """CPU per span in process: made and ended (no processor), then through a batch processor whose
    exporter encodes to OTLP protobuf as the real one does (no network)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Encoding(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            encode_spans(spans).SerializeToString()
            return SpanExportResult.SUCCESS

    attributes = {
        "shmgate.attempt": 0,
        "shmgate.request_id": "1000000001",
        "shmgate.frontend_slot": 0,
        "gen_ai.request.model": "checksum",
    }
    for label, processor in (
        ("bare", None),
        ("encoded", BatchSpanProcessor(Encoding(), max_queue_size=n + 1, max_export_batch_size=512)),
    ):
        provider = TracerProvider()
        if processor is not None:
            provider.add_span_processor(processor)
        tracer = provider.get_tracer("bench")
        started = time.process_time()
        for _ in range(n):
            tracer.start_span("attempt", start_time=time.time_ns(), attributes=attributes).end()
        provider.force_flush(60_000)
        print(f"{label}: {(time.process_time() - started) / n * 1e6:.1f} us of CPU per span")
        provider.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--other", help="the tree to compare with (tracing off there too)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--span-cost", action="store_true", help="only the SDK's CPU per span, in process")
    args = p.parse_args()
    if args.span_cost:
        span_cost()
        return
    if not args.other:
        p.error("--other is required (the tree to compare with)")
    collector = DiscardingCollector()
    configs: dict[str, tuple[Path, list[str], dict[str, str]]] = {
        "other": (Path(args.other), [], {}),
        "off": (ROOT, [], {}),
        "on": (ROOT, ["--otlp-traces-endpoint", collector.url], {"OTEL_TRACES_SAMPLER": "always_on"}),
    }
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name in ("other", "off", "on", "on", "off", "other"):
            tree, extra, env = configs[name]
            frontend, worker = run(tree, args.requests, extra, env)
            seen[name].append((frontend, worker))
            print(f"{name:>5}: frontend {frontend:.3f} ms/request, worker {worker:.3f} ms/request", flush=True)
    print(f"collector received {collector.exports} exports")
    for name, values in seen.items():
        front = [v[0] for v in values]
        work = [v[1] for v in values]
        print(
            f"{name:>5}: frontend mean {statistics.mean(front):.3f} ms (sd {statistics.stdev(front):.3f}), "
            f"worker mean {statistics.mean(work):.3f} ms (sd {statistics.stdev(work):.3f}) over {len(values)} runs"
        )


if __name__ == "__main__":
    main()
