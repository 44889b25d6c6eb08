"""`shmgate bench`: a closed- or open-loop load generator for OpenAI-compatible image chat servers.

It measures what a client sees (throughput, latency, time to first token, errors) and checks one
correctness property that only shows under load: every answer for the same image must be the same
text. A server that mixes up replies between concurrent requests (cross-talk) breaks that, so a
non-zero ``mismatches`` is a bug, never noise, for a deterministic model.

With ``--embeddings`` each request is ``POST /v1/embeddings`` of one image (``encoding_format:
base64``) and answers agree when their vectors' cosine is at least ``VECTOR_AGREEMENT`` (a batch
of 8 and a batch of 1 round differently in the last float bits, so equal bytes would be too strict).

Theory of operation: the images are read and base64-encoded once, before the clock starts. C tasks
share one counter and each takes the next request index until N have been sent, so at most C
requests are in flight (closed loop: a slow server is offered less load, as real clients are).
A warm-up round of min(C, N) requests runs first and is not counted: it opens the keep-alive
connections and lets the server load lazily-initialised state.

With ``--rate R`` the load is open instead: N requests arrive at the times of a Poisson process of
rate R (exponential gaps drawn from ``random.Random(--seed)``, so a seed gives the same schedule
every time), each sent at its time whatever is still in flight. Latency then counts from the
scheduled arrival, so a client or server that falls behind shows as latency, not as less load
(closed loops hide queueing: a slow server is simply offered less).

When the server has a Prometheus ``/metrics`` with ``shmgate_stage_duration_seconds``, it is
scraped before and after the timed phase and the report shows where the run's requests spent their
time, stage by stage (gateway/stages.py).

With ``--server-pid`` the server's CPU time (the pids and all their descendants, from /proc) is
sampled before and after the timed phase, so servers that burn different amounts of CPU for the same
throughput can be told apart. The load generator runs on the same machine, so its own CPU time is
reported too: on a small machine it competes with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import random
import secrets
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.rawhttp import RawClient, Response, TransportError
from gateway.stages import parse_server_timing, stage_breakdown

__all__ = ["add_arguments", "arrival_times", "count_mismatches", "count_vector_mismatches", "main", "percentile", "process_tree", "run",
           "tree_cpu_seconds"]

IMAGE_TYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".webp": "image/webp"}
PROMPT = "What is in this image?"
VECTOR_AGREEMENT = 0.9999  # --embeddings: the cosine two answers for one image must reach
NONCE_BYTES = 15  # a multiple of 3, so its base64 appends to the image's without re-encoding


@dataclass(frozen=True)
class BenchImage:
    """One source image, encoded once. ``b64`` is padded to a multiple of 3 bytes (see ``data_url``)."""

    name: str
    mime: str
    b64: str

    def data_url(self, nonce: int | None) -> str:
        """The data URL to send; with a nonce, bytes no other request sends (defeats content caches).

        The nonce goes after the image's end marker (JPEG EOI, PNG IEND, the RIFF size of WebP), where
        decoders stop reading, so the pixels, and hence a deterministic answer, stay the same.
        """
        if nonce is None:
            return f"data:{self.mime};base64,{self.b64}"
        tail = base64.b64encode(f"{nonce:0{NONCE_BYTES}d}".encode()[-NONCE_BYTES:]).decode()
        return f"data:{self.mime};base64,{self.b64}{tail}"


@dataclass
class Outcome:
    """What one request produced. ``error`` is None for a success."""

    image: str
    latency_s: float
    ttft_s: float | None
    status: int | None
    text: str
    error: str | None
    server_timing: dict[str, float] | None = None  # ms per stage, from the answer's Server-Timing header


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the `bench` options on ``parser`` (the `shmgate` CLI and ``main`` both call this)."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    parser.add_argument("--model", required=True, help="model id sent in each request")
    parser.add_argument("--concurrency", "-c", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--requests", "-n", type=int, default=200, help="timed requests to send")
    parser.add_argument("--images", required=True, type=Path, help="folder of jpg/jpeg/png/webp images")
    parser.add_argument("--stream", action="store_true", help="ask for SSE streaming")
    parser.add_argument("--embeddings", action="store_true",
                        help="POST /v1/embeddings with one image per request instead of chat")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    parser.add_argument("--repeat-one", action="store_true", help="always send the first image (cache hits)")
    parser.add_argument("--unique", action="store_true",
                        help="make every request's bytes unique (same pixels), so no content cache can hit")
    parser.add_argument("--api-key", default=None, help="sent as a Bearer token")
    parser.add_argument("--max-tokens", type=int, default=None, help="max_tokens of each request")
    parser.add_argument("--temperature", type=float, default=None,
                        help="temperature of each request (0: greedy, so a generative model's answers can agree)")
    parser.add_argument("--timeout", type=float, default=60.0, help="per-request timeout in seconds")
    parser.add_argument("--warmup", type=int, default=None, help="uncounted requests first (default min(C, N))")
    parser.add_argument("--server-pid", action="append", default=[],
                        help="server pid whose CPU time (with descendants) to measure; repeat or comma list")
    parser.add_argument("--rate", type=float, default=None,
                        help="open loop: Poisson arrivals at this many requests/s (--concurrency then only "
                             "sizes the warm-up)")
    parser.add_argument("--seed", type=int, default=0, help="--rate: seed of the arrival schedule")
    parser.add_argument("--no-stages", action="store_true", help="do not scrape /metrics for the stage breakdown")


def load_images(folder: Path) -> list[BenchImage]:
    """Read and encode every image of ``folder``, sorted by name so `--repeat-one` is stable.

    Raises ValueError when the folder has none, since a bench of nothing would report nonsense.
    """
    images = []
    for path in sorted(folder.iterdir()):
        mime = IMAGE_TYPES.get(path.suffix.lower())
        if mime is None or not path.is_file():
            continue
        data = path.read_bytes()
        data += b"\0" * (-len(data) % 3)  # padding after the end marker, so a nonce appends cleanly
        images.append(BenchImage(path.name, mime, base64.b64encode(data).decode()))
    if not images:
        raise ValueError(f"no .jpg/.jpeg/.png/.webp images in {folder}")
    return images


def build_body(model: str, url: str, *, stream: bool, max_tokens: int | None,
               temperature: float | None = None, embeddings: bool = False) -> dict[str, Any]:
    """The OpenAI chat request for one image (with ``embeddings``: the embeddings request)."""
    if embeddings:
        return {"model": model, "input": url, "encoding_format": "base64"}
    content = [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": url}}]
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    return body


class BodyTemplate:
    """Serialises request bodies by splicing the data URL into JSON encoded once.

    Why: ``json.dumps`` of a 200 KB data URL costs the client about 1 ms per request, as much as the
    server's whole per-request overhead on a cache hit. On a small machine the load generator shares
    the cores with the server, so its cost lowers the throughput it measures. A base64 data URL
    holds no character JSON escapes, so splicing gives exactly the bytes ``json.dumps`` would.
    """

    _MARK = "\x00url\x00"

    def __init__(self, model: str, *, stream: bool, max_tokens: int | None, temperature: float | None = None,
                 embeddings: bool = False) -> None:
        body = build_body(model, self._MARK, stream=stream, max_tokens=max_tokens, temperature=temperature,
                          embeddings=embeddings)
        encoded = json.dumps(body).encode()
        self.prefix, self.suffix = encoded.split(json.dumps(self._MARK).encode())
        self.stream = stream

    def render(self, url: str) -> bytes:
        return b"".join((self.prefix, b'"', url.encode("ascii"), b'"', self.suffix))


async def send_one(client: RawClient, body: bytes, image: str, *, stream: bool, embeddings: bool = False,
                   start: float | None = None) -> Outcome:
    """Send one request (a JSON body) and time it. Never raises for server or transport failures.

    With ``embeddings`` the outcome's text is the answer's base64 vector. ``start``: the
    ``time.perf_counter()`` the latency counts from (open loop: the scheduled arrival), default now.
    """
    start = time.perf_counter() if start is None else start
    timing = None
    try:
        if stream:
            status, text, ttft, error = await asyncio.wait_for(_send_streaming(client, body, start), client.timeout_s)
        else:
            status, text, error, timing = await asyncio.wait_for(_send_plain(client, body, embeddings),
                                                                 client.timeout_s)
            ttft = None
    except (TimeoutError, TransportError) as exc:  # the server never gave a full answer
        kind = exc.kind if isinstance(exc, TransportError) else "Timeout"
        return Outcome(image, time.perf_counter() - start, None, None, "", f"transport:{kind}")
    latency = time.perf_counter() - start
    return Outcome(image, latency, latency if ttft is None else ttft, status, text, error, timing)


async def _send_plain(client: RawClient, body: bytes,
                      embeddings: bool = False) -> tuple[int, str, str | None, dict[str, float] | None]:
    """(status, answer text, error, the Server-Timing stages when the server sent them)."""
    response, lease = await client.post("/v1/embeddings" if embeddings else "/v1/chat/completions", body)
    try:
        payload = await response.read()
    finally:
        lease.release()
    header = response.headers.get("server-timing")
    timing = parse_server_timing(header) if header else None
    if not response.is_success:
        return response.status, "", str(response.status), timing
    try:
        answer = json.loads(payload)
        text = _vector_text(answer["data"][0]["embedding"]) if embeddings else (
            answer["choices"][0]["message"]["content"] or "")
    except (ValueError, KeyError, IndexError, TypeError):
        return response.status, "", "bad_body", timing
    return response.status, text, None, timing


def _vector_text(embedding: str | list[float]) -> str:
    """An answer's vector as base64 float32 (servers that ignore encoding_format answer floats)."""
    if isinstance(embedding, str):
        return embedding
    import numpy as np

    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode()


async def _send_streaming(client: RawClient, body: bytes, start: float) -> tuple[int, str, float | None, str | None]:
    """Read the SSE reply; ttft is the first `data:` line whose delta has content."""
    response, lease = await client.post("/v1/chat/completions", body)
    try:
        return await _read_sse(response, start)
    finally:
        lease.release()


async def _read_sse(response: Response, start: float) -> tuple[int, str, float | None, str | None]:
    parts: list[str] = []
    ttft: float | None = None
    if not response.is_success:
        await response.read()
        return response.status, "", None, str(response.status)
    event = "message"
    outcome: tuple[int, str, float | None, str | None] | None = None
    async for line in response.lines():
        if outcome is not None:
            continue  # read to the end so the connection can be reused
        if line.startswith("event:"):
            event = line[6:].strip()
            continue
        if not line.startswith("data:"):
            if not line:
                event = "message"  # a blank line ends one SSE event
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            outcome = (response.status, "".join(parts), ttft, None)
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            outcome = (response.status, "".join(parts), ttft, "bad_sse")
            continue
        if event == "error" or "error" in chunk:
            outcome = (response.status, "".join(parts), ttft, "sse_error")
            continue
        for choice in chunk.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                if ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(piece)
    return outcome if outcome is not None else (response.status, "".join(parts), ttft, "no_done")


def count_mismatches(answers: Iterable[tuple[str, str]]) -> int:
    """Count answers that differ from the first answer seen for the same image.

    ``answers`` are (image, text) pairs of successful requests, in completion order. The first
    answer of each image is the reference; with a deterministic model any difference means one
    request got another's reply (or a corrupted one).
    """
    first: dict[str, str] = {}
    mismatches = 0
    for image, text in answers:
        if first.setdefault(image, text) != text:
            mismatches += 1
    return mismatches


def count_vector_mismatches(answers: Iterable[tuple[str, str]]) -> int:
    """Answers (image, base64 float32 vector) whose vector is not within VECTOR_AGREEMENT of the
    first one for the same image; an answer that is not a vector counts as a mismatch."""
    import numpy as np

    first: dict[str, Any] = {}
    bad = 0
    for image, text in answers:
        try:
            vector = np.frombuffer(base64.b64decode(text), dtype="<f4")
        except (ValueError, TypeError):
            bad += 1
            continue
        ref = first.setdefault(image, vector)
        norms = float(np.linalg.norm(vector) * np.linalg.norm(ref))
        if vector.shape != ref.shape or norms == 0 or float(vector @ ref) / norms < VECTOR_AGREEMENT:
            bad += 1
    return bad


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation, as numpy's default; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def parse_pids(raw: Iterable[str]) -> list[int]:
    """`--server-pid 1 --server-pid 2,3` -> [1, 2, 3]."""
    return [int(p) for item in raw for p in str(item).split(",") if p.strip()]


def _read_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime+stime+cutime+cstime in ticks) of ``pid``, or None when it is gone.

    cutime/cstime hold the time of children that exited and were reaped, which are no longer in
    /proc; counting them keeps short-lived helpers in the total without counting anyone twice.
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), sum(int(f) for f in fields[11:15])


def _all_stats() -> dict[int, tuple[int, int]]:
    stats: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _read_stat(int(entry))) is not None:
            stats[int(entry)] = stat
    return stats


def _tree(roots: Iterable[int], stats: dict[int, tuple[int, int]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    seen: set[int] = set()
    pending = [p for p in roots if p in stats]
    while pending:
        pid = pending.pop()
        if pid not in seen:
            seen.add(pid)
            pending.extend(children.get(pid, ()))
    return seen


def process_tree(roots: Iterable[int]) -> set[int]:
    """``roots`` and all their live descendants (Linux /proc)."""
    return _tree(roots, _all_stats())


def tree_cpu_seconds(roots: Iterable[int]) -> float:
    """CPU seconds used so far by ``roots`` and all their live descendants (Linux /proc)."""
    stats = _all_stats()
    return sum(stats[p][1] for p in _tree(roots, stats)) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all cores), from the first line of /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(f) for f in stat.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


async def _drive(
    client: RawClient, args: argparse.Namespace, images: list[BenchImage], count: int, first: int
) -> list[Outcome]:
    """Send ``count`` requests from ``args.concurrency`` tasks; ``first`` offsets the nonces."""
    counter = itertools.count()
    outcomes: list[Outcome] = []
    template = BodyTemplate(args.model, stream=args.stream, max_tokens=args.max_tokens,
                            temperature=args.temperature, embeddings=args.embeddings)

    async def worker() -> None:
        while (index := next(counter)) < count:
            image = images[0] if args.repeat_one else images[index % len(images)]
            body = template.render(image.data_url(first + index if args.unique else None))
            outcomes.append(await send_one(client, body, image.name, stream=args.stream,
                                           embeddings=args.embeddings))

    await asyncio.gather(*(worker() for _ in range(min(args.concurrency, count))))
    return outcomes


def arrival_times(rate: float, count: int, seed: int) -> list[float]:
    """Seconds from the start at which each of ``count`` requests arrives: a Poisson process of ``rate``/s.

    The gaps are exponential with mean 1/rate, drawn from ``random.Random(seed)``: the same seed
    gives the same schedule, so runs at one rate differ only in the server.
    """
    if rate <= 0:
        raise ValueError("--rate must be positive")
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


async def _drive_open(
    client: RawClient, args: argparse.Namespace, images: list[BenchImage], count: int, first: int
) -> list[Outcome]:
    """Send ``count`` requests at Poisson arrival times (``args.rate``), never waiting for answers."""
    template = BodyTemplate(args.model, stream=args.stream, max_tokens=args.max_tokens,
                            temperature=args.temperature, embeddings=args.embeddings)
    schedule = arrival_times(args.rate, count, args.seed)
    tasks = []
    origin = time.perf_counter()
    for index, at in enumerate(schedule):
        delay = origin + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        image = images[0] if args.repeat_one else images[index % len(images)]
        body = template.render(image.data_url(first + index if args.unique else None))
        tasks.append(asyncio.create_task(send_one(client, body, image.name, stream=args.stream,
                                                  embeddings=args.embeddings, start=origin + at)))
    return list(await asyncio.gather(*tasks))


async def scrape_metrics(base_url: str, headers: dict[str, str]) -> str | None:
    """The server's /metrics text, or None when it has none (another server, or a key it wants)."""
    import urllib.error
    import urllib.request

    def get() -> str | None:
        request = urllib.request.Request(base_url.rstrip("/") + "/metrics", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.read().decode()
        except (urllib.error.URLError, OSError, ValueError):
            return None

    return await asyncio.to_thread(get)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args`` (see ``add_arguments``) and return the result dict."""
    if args.concurrency < 1 or args.requests < 1:
        raise ValueError("--concurrency and --requests must be at least 1")
    images = load_images(Path(args.images))
    pids = parse_pids(args.server_pid)
    if missing := [p for p in pids if not Path(f"/proc/{p}").exists()]:
        raise ValueError(f"--server-pid: no process {', '.join(map(str, missing))}")
    warmup = min(args.concurrency, args.requests) if args.warmup is None else args.warmup
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = RawClient(args.base_url, headers=headers, timeout_s=args.timeout)
    # Nonces must differ between runs, too: a bench run against a server an earlier run warmed
    # would otherwise send it bytes it has cached, and "--unique" would measure cache hits.
    nonces = secrets.randbelow(10**5) * 10**10
    try:
        warm = await _drive(client, args, images, warmup, nonces) if warmup > 0 else []
        scraped = None if args.no_stages else await scrape_metrics(args.base_url, headers)
        cpu_before = tree_cpu_seconds(pids) if pids else None
        busy_before, client_cpu_before = machine_busy_seconds(), time.process_time()
        start = time.perf_counter()
        drive = _drive if args.rate is None else _drive_open
        outcomes = await drive(client, args, images, args.requests, nonces + warmup)
        wall = time.perf_counter() - start
        busy, client_cpu = machine_busy_seconds() - busy_before, time.process_time() - client_cpu_before
        server_cpu = None if cpu_before is None else tree_cpu_seconds(pids) - cpu_before
        after = None if scraped is None else await scrape_metrics(args.base_url, headers)
    finally:
        await client.aclose()
    result = summarize(args, outcomes, wall, warm, client_cpu, server_cpu)
    # Whatever else ran during the timed phase took CPU from the server: on a small machine that
    # skews a comparison, so say how much (only known when the server's own share is).
    result["other_load_cores"] = (None if server_cpu is None or wall <= 0
                                  else round(max(0.0, busy - server_cpu - client_cpu) / wall, 2))
    result["stages"] = stage_breakdown(scraped, after) if scraped is not None and after is not None else []
    busy_start = _counter(scraped, "shmgate_worker_busy_seconds_total")
    busy_end = _counter(after, "shmgate_worker_busy_seconds_total")
    # workers busy on average (0..workers): low while requests wait says they wait for something else
    result["workers_busy"] = (None if busy_start is None or busy_end is None or wall <= 0
                              else round((busy_end - busy_start) / wall, 2))
    return result


def _counter(text: str | None, name: str) -> float | None:
    """An unlabelled sample of a /metrics text; None when absent."""
    for line in (text or "").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def summarize(args: argparse.Namespace, outcomes: list[Outcome], wall_s: float, warm: list[Outcome],
              client_cpu_s: float, server_cpu_s: float | None) -> dict[str, Any]:
    """Turn the timed outcomes into the result dict (latencies of successful requests only)."""
    ok = [o for o in outcomes if o.error is None]
    latencies = [o.latency_s for o in ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    errors = Counter(o.error for o in outcomes if o.error is not None)
    # Warm-up answers count for agreement too: they are the same images from the same server.
    answers = [(o.image, o.text) for o in warm + outcomes if o.error is None]
    mismatches = count_vector_mismatches(answers) if args.embeddings else count_mismatches(answers)

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000.0, 3)

    n = len(outcomes)
    rate = getattr(args, "rate", None)
    return {
        "model": args.model, "stream": bool(args.stream), "embeddings": bool(args.embeddings),
        "concurrency": args.concurrency, "requests": n, "offered_rate": rate,
        "repeat_one": bool(args.repeat_one), "unique": bool(args.unique), "warmup": len(warm),
        "duration_s": round(wall_s, 3), "requests_per_s": round(n / wall_s, 2) if wall_s > 0 else None,
        "p50_ms": ms(percentile(latencies, 50)), "p90_ms": ms(percentile(latencies, 90)),
        "p99_ms": ms(percentile(latencies, 99)), "ttft_p50_ms": ms(percentile(ttfts, 50)),
        "ttft_p90_ms": ms(percentile(ttfts, 90)), "errors": sum(errors.values()),
        "errors_by_kind": dict(sorted(errors.items())), "mismatches": mismatches,
        "distinct_answers": len({(o.image, o.text) for o in ok}),
        "cpu_s_per_request": None if server_cpu_s is None else round(server_cpu_s / n, 6),
        "client_cpu_s_per_request": round(client_cpu_s / n, 6),
        "tail": tail_breakdown(ok),
    }


TAIL_SHARE = 0.01  # "the slowest": this share of the successful requests, at least one


def tail_breakdown(ok: Sequence[Outcome]) -> list[dict[str, Any]]:
    """Where the slowest requests' time went, beside the median request's: from Server-Timing headers.

    Rows per stage (the server's names, then ``client``: latency the server did not see, i.e. the
    network, the client's own queueing and, open loop, a late send), with the mean ms of all
    requests and of the slowest ``TAIL_SHARE``. Empty when the server sent no Server-Timing
    (``shmgate serve --server-timing``). The histograms say the p99 is slow; this says why.
    """
    timed = sorted((o for o in ok if o.server_timing), key=lambda o: o.latency_s)
    if not timed:
        return []
    slowest = timed[-max(1, round(len(timed) * TAIL_SHARE)):]

    def means(group: Sequence[Outcome]) -> dict[str, float]:
        totals: dict[str, float] = {}
        for o in group:
            timing = o.server_timing or {}
            for name, value in timing.items():
                totals[name] = totals.get(name, 0.0) + value
            totals["client"] = totals.get("client", 0.0) + max(0.0, o.latency_s * 1000 - timing.get("total", 0.0))
            totals["latency"] = totals.get("latency", 0.0) + o.latency_s * 1000
        return {name: total / len(group) for name, total in totals.items()}

    everyone, tail = means(timed), means(slowest)
    names = [n for n in everyone if n not in ("total", "client", "latency")] + ["client", "latency"]
    return [{"stage": n, "all_mean_ms": round(everyone.get(n, 0.0), 2), "tail_mean_ms": round(tail.get(n, 0.0), 2),
             "tail_count": len(slowest)} for n in names]


def format_report(result: dict[str, Any]) -> str:
    """The human-readable form of a result."""
    def f(key: str, source: dict[str, Any] = result) -> str:
        value = source[key]
        return "-" if value is None else f"{value:.1f}"

    cpu = result["cpu_s_per_request"]
    load = (f"concurrency {result['concurrency']}" if result.get("offered_rate") is None
            else f"open loop {result['offered_rate']} req/s offered")
    lines = [
        f"model {result['model']}  stream={result['stream']}  {load}  "
        f"requests {result['requests']} (+{result['warmup']} warm-up) in {result['duration_s']:.2f} s",
        f"throughput   {result['requests_per_s']} req/s",
        f"latency ms   p50 {f('p50_ms')}  p90 {f('p90_ms')}  p99 {f('p99_ms')}",
        f"ttft ms      p50 {f('ttft_p50_ms')}  p90 {f('ttft_p90_ms')}",
        f"errors       {result['errors']} {result['errors_by_kind'] or ''}".rstrip(),
        f"mismatches   {result['mismatches']}",
        f"server cpu   {'-' if cpu is None else f'{cpu * 1000:.2f} ms/request'}",
        f"client cpu   {result['client_cpu_s_per_request'] * 1000:.2f} ms/request",
        f"other load   {'-' if result['other_load_cores'] is None else result['other_load_cores']} cores "
        "(CPU used by other processes while timing)",
    ]
    if result.get("workers_busy") is not None:
        lines.append(f"workers busy {result['workers_busy']} on average (from the server's /metrics)")
    if result.get("stages"):
        lines.append("stages       count     mean ms    p50 ms    p99 ms   (from the server's /metrics, this run)")
        for row in result["stages"]:
            lines.append(f"  {row['stage']:<12} {row['count']:>6} {f('mean_ms', row):>10} {f('p50_ms', row):>9} "
                         f"{f('p99_ms', row):>9}")
    if result.get("tail"):
        lines.append(f"slowest {result['tail'][0]['tail_count']}   all mean ms   slowest mean ms   "
                     "(per request, from Server-Timing)")
        for row in result["tail"]:
            lines.append(f"  {row['stage']:<12} {f('all_mean_ms', row):>12} {f('tail_mean_ms', row):>17}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse, run, print. Exit status 1 when any request failed or answers disagreed."""
    parser = argparse.ArgumentParser(prog="shmgate bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        result = asyncio.run(run(args))
    except (ValueError, OSError) as exc:
        print(f"shmgate bench: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_report(result))
    return 1 if result["errors"] or result["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
