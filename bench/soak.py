"""Soak: many requests mixing cache hits, misses and bad inputs, then proof that nothing accumulated.

    python -m bench soak                          # 20,000 requests against a server it starts
    python -m bench soak -n 300 --json            # short (what tests/test_soak.py runs)
    python -m bench soak --base-url http://127.0.0.1:8000 --server-pid <supervisor pid>

Theory of operation: a warm-up round (same mix) opens the server's thread pools and fills its cache,
then the client closes its connections and the server is measured at rest ("before"): arena bytes
held by requests and in use (from /metrics), and for every server process (the supervisor and all
its descendants, from /proc) resident memory, open file descriptors and threads. The timed run sends
``--requests`` requests from ``--concurrency`` tasks; request i is a cache hit (one of a few images,
same bytes every time), a miss (unique bytes, same pixels: bench_client/loadgen.py's nonce) or a bad input
(a rotation of malformed bodies, each must get its 4xx OpenAI error), by ``i % 20`` in the proportion
of ``--mix``. The run is sent in two halves; the server is measured at rest after each ("mid", "after").

With ``--minutes M`` the soak is timed instead (``run_timed``): the same mix, sent without pause for M
minutes, while every ``--sample-s`` seconds each server process's resident and private memory and the
server's /dev/shm use (the files its processes map, by their blocks) are recorded; the report gives them
over time and each one's slope over the last half of the run (least squares, MiB per minute), which is
what "levels off" means. ``--tiny-vlm`` serves the tests' tiny Qwen2-VL (tests/hf_fixture.py, random
weights), so the worker's encoder, prefix and processor caches fill as they would under VLM traffic:

    python -m bench soak --minutes 30 --tiny-vlm --json      # figures in docs/BENCHMARKS.md

Exit status 1 when: any hit/miss failed or two answers for one image disagreed, any bad input got
anything but its expected 4xx, the arena holds are not back to their baseline (0), any process's fds
or threads grew in the second half, a process was replaced (a crash), or resident memory grew by more than
``--max-rss-growth-mib`` in one process. Figures go to docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.servers import REPO, ServerProcess, free_port, shmgate_serve
from shmgate.bench_client import loadgen
from shmgate.bench_client.processes import ProcessSample, sample_tree
from shmgate.shared.rawhttp import NoHttpAnswer, RawClient

IMAGES = REPO / "tests" / "data" / "images"
MAX_WARMUP_ROUNDS = 5
SETTLE_S = 10.0  # how long the server gets to close client sockets and finish after the load


def metric(base_url: str, name: str) -> float:
    """One gauge or counter from /metrics, summed over its label sets."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


# -- the request mix ----------------------------------------------------------------------------------


def bad_bodies(model: str) -> list[tuple[str, bytes, int]]:
    """(kind, raw body, expected status): malformed requests a client may send by mistake."""

    def with_url(url: str) -> bytes:
        return json.dumps(loadgen.build_body(model, url, stream=False, max_tokens=None)).encode()

    return [
        ("invalid_json", b'{"model": "' + model.encode() + b'", "messages": [', 400),
        ("bad_base64", with_url("data:image/jpeg;base64,@@not base64@@"), 400),
        ("not_an_image", with_url("data:image/png;base64,aGVsbG8sIEkgYW0gdGV4dA=="), 400),
        (
            "unknown_model",
            json.dumps({"model": "gpt-99", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            404,
        ),
        ("no_messages", json.dumps({"model": model}).encode(), 400),
    ]


def parse_mix(text: str) -> tuple[int, int, int]:
    """'hit=9,miss=9,bad=2' -> slots out of 20 for each kind (they must add up to 20)."""
    parts = dict(item.split("=") for item in text.split(","))
    mix = int(parts.get("hit", 0)), int(parts.get("miss", 0)), int(parts.get("bad", 0))
    if sum(mix) != 20 or min(mix) < 0:
        raise ValueError("--mix needs hit+miss+bad = 20, e.g. hit=9,miss=9,bad=2")
    return mix


@dataclass
class Tally:
    """What the requests of one run produced."""

    outcomes: Counter[str]
    answers: list[tuple[str, str]]  # (image, text) of successful hits and misses, for agreement
    latencies_s: list[float]


async def _send_bad(client: RawClient, body: bytes, expected: int) -> bool:
    try:
        response, lease = await client.post("/v1/chat/completions", body)
        try:
            payload = await asyncio.wait_for(response.read(), client.timeout_s)
        finally:
            lease.release()
        error = json.loads(payload).get("error", {})
    except (TimeoutError, NoHttpAnswer, ValueError, AttributeError):
        return False
    return response.status == expected and set(error) == {"message", "type", "param", "code"}


async def drive(
    base_url: str,
    model: str,
    images: list[loadgen.BenchImage],
    count: int,
    first: int,
    concurrency: int,
    mix: tuple[int, int, int],
    timeout_s: float,
    *,
    until: float = float("inf"),
    max_tokens: int | None = None,
) -> Tally:
    """Send ``count`` requests of the mix (or as many as fit before ``until``, monotonic); request numbers
    start at ``first`` (nonces stay unique)."""
    hits, misses, _ = mix
    bad = bad_bodies(model)
    tally = Tally(Counter(), [], [])
    counter = itertools.count()
    temperature = 0.0 if max_tokens is not None else None
    template = loadgen.BodyTemplate(model, stream=False, max_tokens=max_tokens, temperature=temperature)

    async def one(client: RawClient, i: int) -> None:
        slot = i % 20
        if slot < hits + misses:
            kind = "hit" if slot < hits else "miss"
            image = images[i % min(3, len(images))] if kind == "hit" else images[i % len(images)]
            body = template.render(image.data_url(None if kind == "hit" else i))
            outcome = await loadgen.send_one(client, body, image.name, stream=False)
            if outcome.error is None:
                tally.answers.append((image.name, outcome.text))
                tally.latencies_s.append(outcome.latency_s)
            tally.outcomes[f"{kind}:{'ok' if outcome.error is None else outcome.error}"] += 1
            return
        _, raw, expected = bad[(i // 20) % len(bad)]
        tally.outcomes[f"bad:{'ok' if await _send_bad(client, raw, expected) else 'unexpected'}"] += 1

    async def task(client: RawClient) -> None:
        while (index := next(counter)) < count and time.monotonic() < until:
            await one(client, first + index)

    client = RawClient(base_url, timeout_s=timeout_s)
    try:
        await asyncio.gather(*(task(client) for _ in range(min(concurrency, count))))
    finally:
        await client.aclose()
    return tally


# -- before / after --------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    held_bytes: float
    used_bytes: float
    in_flight: float
    processes: dict[int, ProcessSample]


def snapshot(base_url: str, server_pid: int) -> Snapshot:
    return Snapshot(
        metric(base_url, "shmgate_arena_held_bytes"),
        metric(base_url, "shmgate_arena_used_bytes"),
        metric(base_url, "shmgate_in_flight_requests"),
        sample_tree(server_pid),
    )


def problems(before: Snapshot, after: Snapshot, max_rss_growth_kib: int, mid: Snapshot | None = None) -> list[str]:
    """Everything that accumulated (empty: the server is where it started).

    Holds and memory compare ``after`` with ``before``; fds and threads compare it with ``mid`` (at rest
    half-way through, when given): a pool that starts its last thread only under the timed load's
    concurrency has done so by then, while a leak keeps growing in the second half too.
    """
    found = []
    counts = mid or before
    if after.held_bytes != before.held_bytes or after.in_flight:
        found.append(
            f"arena holds {after.held_bytes:g} B (baseline {before.held_bytes:g}), "
            f"{after.in_flight:g} requests in flight"
        )
    if set(after.processes) != set(before.processes):
        found.append(f"server processes changed: {sorted(before.processes)} -> {sorted(after.processes)}")
    for pid, b in before.processes.items():
        a, m = after.processes.get(pid), counts.processes.get(pid)
        if a is None or m is None:
            continue
        if a.fds > m.fds:
            found.append(f"{b.role} (pid {pid}): open fds {m.fds} -> {a.fds}")
        if a.threads > m.threads:
            found.append(f"{b.role} (pid {pid}): threads {m.threads} -> {a.threads}")
        if a.anon_kib - b.anon_kib > max_rss_growth_kib:
            found.append(f"{b.role} (pid {pid}): private RSS {b.anon_kib} -> {a.anon_kib} KiB")
    return found


def settle(
    base_url: str, server_pid: int, before: Snapshot, max_rss_growth_kib: int, mid: Snapshot | None = None
) -> Snapshot:
    """The server at rest after the load: retried for a while, as closing sockets takes a moment."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        after = snapshot(base_url, server_pid)
        if not problems(before, after, max_rss_growth_kib, mid) or time.monotonic() > deadline:
            return after
        time.sleep(0.25)


def _counts(s: Snapshot) -> dict[int, tuple[int, int]]:
    return {pid: (p.fds, p.threads) for pid, p in s.processes.items()}


def table(before: Snapshot, mid: Snapshot, after: Snapshot) -> str:
    rows = [
        (
            "| process | pid | RSS KiB before | after | private RSS KiB before | after "
            "| fds before / mid / after | threads before / mid / after |"
        ),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for pid, b in sorted(before.processes.items(), key=lambda kv: kv[1].role):
        a, m = after.processes.get(pid), mid.processes.get(pid)
        if a is None or m is None:
            rows.append(f"| {b.role} | {pid} | {b.rss_kib} | gone | {b.anon_kib} | gone | {b.fds} | {b.threads} |")
            continue
        rows.append(
            f"| {b.role} | {pid} | {b.rss_kib} | {a.rss_kib} | {b.anon_kib} | {a.anon_kib} | "
            f"{b.fds} / {m.fds} / {a.fds} | {b.threads} / {m.threads} / {a.threads} |"
        )
    rows.append(f"| arena held bytes | | {before.held_bytes:.0f} | {after.held_bytes:.0f} | | | | |")
    rows.append(f"| arena used bytes (cache) | | {before.used_bytes:.0f} | {after.used_bytes:.0f} | | | | |")
    return "\n".join(rows)


# -- main ----------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, base_url: str, server_pid: int) -> dict[str, Any]:
    images = loadgen.load_images(Path(args.images))
    mix = parse_mix(args.mix)

    def load(count: int, first: int) -> Tally:
        return asyncio.run(drive(base_url, args.model, images, count, first, args.concurrency, mix, args.timeout))

    # Warm up in rounds, each on fresh connections (the kernel spreads them over the frontends), until
    # a round leaves fds and threads where the previous one did: lazily started pools and lazily
    # opened queues are then all there, and what grows afterwards is accumulation.
    warm = Tally(Counter(), [], [])
    before = snapshot(base_url, server_pid)
    for round_ in range(1, 1 + MAX_WARMUP_ROUNDS):
        w = load(args.warmup, (round_ - 1) * args.warmup)
        warm.answers += w.answers
        previous, before = before, settle(base_url, server_pid, before, 1 << 30)
        if _counts(previous) == _counts(before):
            break
    first = round_ * args.warmup
    half = args.requests // 2
    started = time.perf_counter()
    tally = load(half, first)
    paused = time.perf_counter()
    mid = settle(base_url, server_pid, before, 1 << 30)
    resumed = time.perf_counter()
    second = load(args.requests - half, first + half)
    wall_s = time.perf_counter() - started - (resumed - paused)
    tally.outcomes += second.outcomes
    tally.answers += second.answers
    tally.latencies_s += second.latencies_s
    after = settle(base_url, server_pid, before, args.max_rss_growth_mib * 1024, mid)
    failed = {k: v for k, v in tally.outcomes.items() if not k.endswith(":ok")}
    mismatches = loadgen.count_mismatches(warm.answers + tally.answers)
    found = problems(before, after, args.max_rss_growth_mib * 1024, mid)
    if failed:
        found.append(f"requests that did not get their expected answer: {failed}")
    if mismatches:
        found.append(f"{mismatches} answers disagreed with an earlier answer for the same image")
    return {
        "requests": args.requests,
        "warmup": round_ * args.warmup,
        "concurrency": args.concurrency,
        "mix": args.mix,
        "duration_s": round(wall_s, 2),
        "requests_per_s": round(args.requests / wall_s, 1),
        "p50_ms": round(1000 * (loadgen.percentile(tally.latencies_s, 50) or 0), 1),
        "p99_ms": round(1000 * (loadgen.percentile(tally.latencies_s, 99) or 0), 1),
        "outcomes": dict(sorted(tally.outcomes.items())),
        "mismatches": mismatches,
        "before": {
            "held_bytes": before.held_bytes,
            "used_bytes": before.used_bytes,
            "processes": [vars(p) for p in before.processes.values()],
        },
        "after": {
            "held_bytes": after.held_bytes,
            "used_bytes": after.used_bytes,
            "processes": [vars(p) for p in after.processes.values()],
        },
        "mid": {"processes": [vars(p) for p in mid.processes.values()]},
        "table": table(before, mid, after),
        "problems": found,
        "ok": not found,
    }


# -- the timed soak: memory over time ------------------------------------------------------------------------


def shm_bytes(pids: list[int]) -> int:
    """Bytes of /dev/shm files mapped by ``pids`` (each file once, by its allocated blocks)."""
    paths: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
                        paths.add(parts[5].strip().removesuffix(" (deleted)"))
        except OSError:
            continue
    total = 0
    for path in paths:
        try:
            total += os.stat(path).st_blocks * 512
        except OSError:
            continue
    return total


def slope_mib_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, KiB) points, in MiB per minute (0.0 for fewer than two)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if not var:
        return 0.0
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 60 / 1024


@dataclass
class Series:
    """One measured quantity over the run: (seconds since the start, KiB)."""

    name: str
    points: list[tuple[float, float]]

    def summary(self) -> dict[str, Any]:
        half = [p for p in self.points if p[0] >= self.points[-1][0] / 2] if self.points else []
        return {
            "name": self.name,
            "first_mib": round(self.points[0][1] / 1024, 1) if self.points else None,
            "last_mib": round(self.points[-1][1] / 1024, 1) if self.points else None,
            "max_mib": round(max(v for _, v in self.points) / 1024, 1) if self.points else None,
            "slope_last_half_mib_per_min": round(slope_mib_per_min(half), 3),
        }


def sample_memory(server_pid: int, started: float, series: dict[str, Series]) -> None:
    """Add one sample of every server process's RSS and private RSS, and of the server's /dev/shm use."""
    t = time.monotonic() - started
    processes = sample_tree(server_pid)
    for p in processes.values():
        for what, kib in (("rss", p.rss_kib), ("private", p.anon_kib)):
            key = f"{p.role} {what}"
            if p.role in ("worker", "pool"):
                key = f"{p.role} pid {p.pid} {what}"  # workers are alike: one series per process
            series.setdefault(key, Series(key, [])).points.append((t, kib))
    shm = series.setdefault("/dev/shm mapped", Series("/dev/shm mapped", []))
    shm.points.append((t, shm_bytes(list(processes)) / 1024))


def run_timed(args: argparse.Namespace, base_url: str, server_pid: int) -> dict[str, Any]:
    """The mix for ``args.minutes`` minutes, memory sampled every ``args.sample_s`` s (module docstring)."""
    images = loadgen.load_images(Path(args.images))
    mix = parse_mix(args.mix)
    max_tokens = args.max_tokens
    series: dict[str, Series] = {}
    started = time.monotonic()
    sample_memory(server_pid, started, series)
    stop = threading.Event()

    def sampler() -> None:
        while not stop.wait(args.sample_s):
            sample_memory(server_pid, started, series)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    until = started + args.minutes * 60
    try:
        tally = asyncio.run(
            drive(
                base_url,
                args.model,
                images,
                1 << 62,
                0,
                args.concurrency,
                mix,
                args.timeout,
                until=until,
                max_tokens=max_tokens,
            )
        )
    finally:
        stop.set()
        thread.join()
    sample_memory(server_pid, started, series)
    wall_s = time.monotonic() - started
    failed = {k: v for k, v in tally.outcomes.items() if not k.endswith(":ok")}
    summaries = [s.summary() for s in sorted(series.values(), key=lambda s: s.name)]
    found = [f"requests that did not get their expected answer: {failed}"] if failed else []
    return {
        "minutes": args.minutes,
        "requests": sum(tally.outcomes.values()),
        "concurrency": args.concurrency,
        "mix": args.mix,
        "model": args.model,
        "duration_s": round(wall_s, 1),
        "requests_per_s": round(sum(tally.outcomes.values()) / wall_s, 2),
        "p50_ms": round(1000 * (loadgen.percentile(tally.latencies_s, 50) or 0), 1),
        "p99_ms": round(1000 * (loadgen.percentile(tally.latencies_s, 99) or 0), 1),
        "outcomes": dict(sorted(tally.outcomes.items())),
        "series": summaries,
        "samples": {s.name: [(round(t, 1), round(v / 1024, 1)) for t, v in s.points] for s in series.values()},
        "cache_metrics": cache_metrics(base_url),
        "problems": found,
        "ok": not found,
    }


def cache_metrics(base_url: str) -> dict[str, float]:
    """The caches' gauges at the end (shmgate_cache_*, shmgate_result_cache_*, shmgate_worker_cache_*)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(("shmgate_worker_cache_", "shmgate_result_cache_", "shmgate_cache_", "shmgate_arena_used"))
    }


def _human_timed(result: dict[str, Any]) -> str:
    lines = [
        (
            f"timed soak: {result['minutes']} min of {result['model']}, {result['requests']} requests, "
            f"concurrency {result['concurrency']}, mix {result['mix']}: {result['requests_per_s']} req/s, "
            f"p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms"
        ),
        f"outcomes {result['outcomes']}",
        "",
        "| series | first MiB | last MiB | max MiB | slope of the last half, MiB/min |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for s in result["series"]:
        lines.append(
            f"| {s['name']} | {s['first_mib']} | {s['last_mib']} | {s['max_mib']} | "
            f"{s['slope_last_half_mib_per_min']} |"
        )
    lines += ["", "OK" if result["ok"] else "PROBLEMS:\n  " + "\n  ".join(result["problems"])]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", "-n", type=int, default=20_000)
    p.add_argument(
        "--warmup",
        type=int,
        default=200,
        help="uncounted requests per warm-up round (rounds repeat until fds/threads are steady)",
    )
    p.add_argument("--concurrency", "-c", type=int, default=16)
    p.add_argument("--mix", default="hit=9,miss=9,bad=2", help="of every 20 requests: hits, misses, bad inputs")
    p.add_argument("--model", default="checksum")
    p.add_argument("--images", type=Path, default=IMAGES)
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout in seconds")
    p.add_argument("--max-rss-growth-mib", type=int, default=64, help="per process, before -> after")
    p.add_argument("--base-url", help="an already running server (then --server-pid is required)")
    p.add_argument("--server-pid", type=int, help="the server's root pid (its descendants are measured too)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `shmgate serve` flag (repeat)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--minutes", type=float, help="a timed soak of this many minutes, memory sampled over time")
    p.add_argument("--sample-s", type=float, default=15.0, help="timed soak: seconds between memory samples")
    p.add_argument("--max-tokens", type=int, help="per request (a generative model; greedy when given)")
    p.add_argument("--tiny-vlm", action="store_true", help="serve the tests' tiny Qwen2-VL (random weights) as --model")
    args = p.parse_args(argv)
    if bool(args.base_url) != bool(args.server_pid):
        p.error("--base-url and --server-pid go together")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    human = _human_timed if args.minutes else _human
    report: Callable[[dict[str, Any]], str] = json.dumps if args.json else human
    soak = run_timed if args.minutes else run
    if args.base_url:
        result = soak(args, args.base_url.rstrip("/"), args.server_pid)
        print(report(result))
        return 0 if result["ok"] else 1
    scratch = Path(tempfile.mkdtemp(prefix="shmgate-soak-"))
    model = args.model
    if args.tiny_vlm:
        from tests.hf_fixture import build_tiny_vlm

        args.model = "tiny-qwen2-vl"  # what requests name: the served directory's name
        model = f"hf:{build_tiny_vlm(scratch / args.model)}"
        if args.max_tokens is None:
            args.max_tokens = 16
    port = free_port()
    log_path = scratch / "serve.log"
    server = ServerProcess(shmgate_serve(port, "--model", model, *args.serve_arg), log_path)
    base_url = f"http://127.0.0.1:{port}"
    server.start()
    try:
        asyncio.run(server.wait_ready(base_url + "/ready", 300))
        result = soak(args, base_url, server.pid)
    finally:
        server.stop()
    result["server_log"] = str(log_path)
    print(report(result))
    return 0 if result["ok"] else 1


def _human(result: dict[str, Any]) -> str:
    lines = [
        (
            f"soak: {result['requests']} requests (+{result['warmup']} warm-up), "
            f"concurrency {result['concurrency']}, mix {result['mix']}: {result['duration_s']} s, "
            f"{result['requests_per_s']} req/s, p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms"
        ),
        f"outcomes {result['outcomes']}  mismatches {result['mismatches']}",
        "",
        result["table"],
        "",
        "OK: nothing accumulated" if result["ok"] else "PROBLEMS:\n  " + "\n  ".join(result["problems"]),
    ]
    return "\n".join(lines)
