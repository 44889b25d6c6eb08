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

Before anything is timed the run checks that it measures a server and not a mistake: ``--base-url``
may end in ``/v1`` (as OpenAI clients take it); without ``--model`` the model is the first one
``GET /v1/models`` lists; and a warm-up in which no request succeeded, or one was refused as a bad
request (a 4xx other than 429), stops the run with exit status 1, the URL and the server's first
error, since every timed request would fail the same way. ``--warmup 0`` skips that check.

Throughput counts successful requests only; failures are counted by status and error code, the first
one's body is shown, and any failure makes the exit status 1 (``--allow-errors``: 0, for runs meant to
overload a server). For generative models (a ``/v1/models`` card with ``max_model_len``, as ``hf:``
chat models and vLLM give) the report adds output tokens/s from each answer's ``usage`` and, with
``--stream``, TTFT, TPOT and ITL defined as ``vllm bench serve`` defines them: TTFT is the time to
the first chunk with content; TPOT is (latency - TTFT) / (output tokens - 1) per request with more
than one token; ITL is every gap between successive content chunks (a chunk carrying several tokens
is one gap, so ITL can exceed TPOT).

A content cache answers repeated image bytes without decoding them again: with the default six
photos every request after the first six repeats one. The report says so, with the hit ratio the
server's ``/metrics`` counted during the timed phase; ``--unique`` makes every request a miss.

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

from shmgate.gateway.stages import parse_server_timing, stage_breakdown
from shmgate.shared.rawhttp import NoHttpAnswer, RawClient, Response

__all__ = [
    "BenchAborted",
    "add_arguments",
    "api_root",
    "arrival_times",
    "count_mismatches",
    "count_vector_mismatches",
    "error_kind",
    "main",
    "percentile",
    "process_tree",
    "run",
    "tree_cpu_seconds",
    "warmup_failure",
]

IMAGE_TYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".webp": "image/webp"}
PROMPT = "What is in this image?"
VECTOR_AGREEMENT = 0.9999  # --embeddings: the cosine two answers for one image must reach
NONCE_BYTES = 15  # a multiple of 3, so its base64 appends to the image's without re-encoding
DETAIL_CHARS = 300  # of a server's error body in the report: enough for an OpenAI error's message


class BenchAborted(Exception):
    """The run cannot measure anything (no server, a model it does not serve, ...); the message says why."""


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
    """What one request produced. ``error`` is None for a success, else its kind (``error_kind``)."""

    image: str
    latency_s: float
    ttft_s: float | None
    status: int | None
    text: str
    error: str | None
    server_timing: dict[str, float] | None = None  # ms per stage, from the answer's Server-Timing header
    output_tokens: int | None = None  # the answer's usage.completion_tokens, when it had one
    itl_s: tuple[float, ...] = ()  # streamed: gaps between successive chunks with content
    detail: str | None = None  # a failure: the server's error body (truncated) or the transport's message


def error_kind(status: int, payload: bytes) -> str:
    """``"429 overloaded"``: the status and the OpenAI error's code (or type), or the status alone."""
    code = _error_code(payload)
    return f"{status} {code}" if code else str(status)


def _error_code(payload: bytes) -> str | None:
    """The ``code`` (else ``type``) of an OpenAI error object; None when ``payload`` is not one."""
    try:
        error = json.loads(payload)["error"]
        code = error.get("code") or error.get("type")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return code if isinstance(code, str) and code else None


def _snippet(status: int | None, payload: bytes | str) -> str:
    text = payload.decode(errors="replace") if isinstance(payload, bytes) else payload
    text = " ".join(text.split())
    text = text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS] + "..."
    return text if status is None else f"{status} {text}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the `bench` options on ``parser`` (the `shmgate` CLI and ``main`` both call this)."""
    parser.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="server URL, with or without a trailing /v1 (default: %(default)s)",
    )
    parser.add_argument(
        "--model", default=None, help="model id sent in each request (default: the first one GET /v1/models lists)"
    )
    parser.add_argument(
        "--concurrency", "-c", type=int, default=8, help="requests in flight at once (default: %(default)s)"
    )
    parser.add_argument("--requests", "-n", type=int, default=200, help="timed requests to send (default: %(default)s)")
    parser.add_argument("--images", required=True, type=Path, help="folder of jpg/jpeg/png/webp images")
    parser.add_argument(
        "--stream",
        action="store_true",
        help="ask for SSE streaming (generative models: adds TTFT, TPOT and ITL to the report)",
    )
    parser.add_argument(
        "--embeddings", action="store_true", help="POST /v1/embeddings with one image per request instead of chat"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    parser.add_argument("--repeat-one", action="store_true", help="always send the first image (cache hits)")
    parser.add_argument(
        "--unique",
        action="store_true",
        help="make every request's bytes unique (same pixels), so no content cache can hit",
    )
    parser.add_argument("--api-key", default=None, help="sent as a Bearer token")
    parser.add_argument("--max-tokens", type=int, default=None, help="max_tokens of each request")
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="temperature of each request (0: greedy, so a generative model's answers can agree)",
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="per-request timeout in seconds (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="uncounted requests first (default min(C, N)); when none succeeds, or one is refused "
        "with a 4xx other than 429, the run stops there (exit 1); 0: no warm-up, no check",
    )
    parser.add_argument(
        "--server-pid",
        action="append",
        default=[],
        help="server pid whose CPU time (with descendants) to measure; repeat or comma list",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="open loop: Poisson arrivals at this many requests/s (--concurrency then only sizes the warm-up)",
    )
    parser.add_argument("--seed", type=int, default=0, help="--rate: seed of the arrival schedule")
    parser.add_argument(
        "--no-stages", action="store_true", help="do not scrape /metrics (no stage breakdown, no cache hit ratio)"
    )
    parser.add_argument(
        "--allow-errors",
        action="store_true",
        help="exit 0 even when requests failed (overload runs); disagreeing answers still exit 1",
    )


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


def build_body(
    model: str,
    url: str,
    *,
    stream: bool,
    max_tokens: int | None,
    temperature: float | None = None,
    embeddings: bool = False,
    include_usage: bool = False,
) -> dict[str, Any]:
    """The OpenAI chat request for one image (with ``embeddings``: the embeddings request).

    ``include_usage`` (streamed only) asks for the usage chunk that gives a streamed answer's token count.
    """
    if embeddings:
        return {"model": model, "input": url, "encoding_format": "base64"}
    content = [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": url}}]
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}], "stream": stream}
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
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

    def __init__(
        self,
        model: str,
        *,
        stream: bool,
        max_tokens: int | None,
        temperature: float | None = None,
        embeddings: bool = False,
        include_usage: bool = False,
    ) -> None:
        body = build_body(
            model,
            self._MARK,
            stream=stream,
            max_tokens=max_tokens,
            temperature=temperature,
            embeddings=embeddings,
            include_usage=include_usage,
        )
        encoded = json.dumps(body).encode()
        self.prefix, self.suffix = encoded.split(json.dumps(self._MARK).encode())
        self.stream = stream

    def render(self, url: str) -> bytes:
        return b"".join((self.prefix, b'"', url.encode("ascii"), b'"', self.suffix))


async def send_one(
    client: RawClient, body: bytes, image: str, *, stream: bool, embeddings: bool = False, start: float | None = None
) -> Outcome:
    """Send one request (a JSON body) and time it. Never raises for server or transport failures.

    With ``embeddings`` the outcome's text is the answer's base64 vector. ``start``: the
    ``time.perf_counter()`` the latency counts from (open loop: the scheduled arrival), default now.
    """
    start = time.perf_counter() if start is None else start
    try:
        if stream:
            outcome = await asyncio.wait_for(_send_streaming(client, body, image, start), client.timeout_s)
        else:
            outcome = await asyncio.wait_for(_send_plain(client, body, image, start, embeddings), client.timeout_s)
    except (TimeoutError, NoHttpAnswer) as exc:  # the server never gave a full answer
        kind = exc.kind if isinstance(exc, NoHttpAnswer) else "Timeout"
        detail = str(exc) if isinstance(exc, NoHttpAnswer) else f"no full answer in {client.timeout_s:g} s"
        return Outcome(image, time.perf_counter() - start, None, None, "", f"transport:{kind}", detail=detail)
    return outcome


async def _send_plain(client: RawClient, body: bytes, image: str, start: float, embeddings: bool) -> Outcome:
    """One non-streamed request; its ttft is its latency (the whole answer arrives at once)."""
    response, lease = await client.post("/v1/embeddings" if embeddings else "/v1/chat/completions", body)
    try:
        payload = await response.read()
    finally:
        lease.release()
    latency = time.perf_counter() - start
    header = response.headers.get("server-timing")
    timing = parse_server_timing(header) if header else None
    if not response.is_success:
        return Outcome(
            image,
            latency,
            None,
            response.status,
            "",
            error_kind(response.status, payload),
            timing,
            detail=_snippet(response.status, payload),
        )
    try:
        answer = json.loads(payload)
        text = (
            _vector_text(answer["data"][0]["embedding"])
            if embeddings
            else (answer["choices"][0]["message"]["content"] or "")
        )
    except (ValueError, KeyError, IndexError, TypeError):
        return Outcome(
            image, latency, None, response.status, "", "bad_body", timing, detail=_snippet(response.status, payload)
        )
    tokens = None if embeddings else _completion_tokens(answer)
    return Outcome(image, latency, latency, response.status, text, None, timing, output_tokens=tokens)


def _completion_tokens(answer: Any) -> int | None:
    """``usage.completion_tokens`` of an answer or chunk; None when it has none."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) else None


def _vector_text(embedding: str | list[float]) -> str:
    """An answer's vector as base64 float32 (servers that ignore encoding_format answer floats)."""
    if isinstance(embedding, str):
        return embedding
    import numpy as np

    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode()


async def _send_streaming(client: RawClient, body: bytes, image: str, start: float) -> Outcome:
    response, lease = await client.post("/v1/chat/completions", body)
    try:
        return await _read_sse(response, image, start)
    finally:
        lease.release()


async def _read_sse(response: Response, image: str, start: float) -> Outcome:
    """Read an SSE reply to its end. ttft: the first chunk whose delta has content; the ITL gaps are
    between successive such chunks (vllm bench serve's definitions); the token count from the usage chunk."""
    if not response.is_success:
        payload = await response.read()
        return Outcome(
            image,
            time.perf_counter() - start,
            None,
            response.status,
            "",
            error_kind(response.status, payload),
            detail=_snippet(response.status, payload),
        )
    parts: list[str] = []
    arrivals: list[float] = []  # perf_counter of each chunk with content
    tokens: int | None = None
    event = "message"
    error: str | None = "no_done"
    detail: str | None = "the stream ended without data: [DONE]"
    done = False
    async for line in response.lines():
        if done:
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
            error, detail, done = None, None, True
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            error, detail, done = "bad_sse", _snippet(None, data), True
            continue
        if event == "error" or "error" in chunk:
            error, detail, done = f"stream {_error_code(data.encode()) or 'error'}", _snippet(None, data), True
            continue
        pieces = [
            piece for choice in chunk.get("choices") or () if (piece := (choice.get("delta") or {}).get("content"))
        ]
        if pieces:
            arrivals.append(time.perf_counter())
            parts.extend(pieces)
        tokens = _completion_tokens(chunk) if tokens is None else tokens
    latency = time.perf_counter() - start
    ttft = arrivals[0] - start if arrivals else None
    gaps = tuple(b - a for a, b in zip(arrivals, arrivals[1:]))
    return Outcome(
        image, latency, ttft, response.status, "".join(parts), error, output_tokens=tokens, itl_s=gaps, detail=detail
    )


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
    fields = raw[raw.rfind(")") + 2 :].split()  # the command name may hold spaces and parentheses
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
    template = BodyTemplate(
        args.model,
        stream=args.stream,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        embeddings=args.embeddings,
        include_usage=getattr(args, "include_usage", False),
    )

    async def worker() -> None:
        while (index := next(counter)) < count:
            image = images[0] if args.repeat_one else images[index % len(images)]
            body = template.render(image.data_url(first + index if args.unique else None))
            outcomes.append(await send_one(client, body, image.name, stream=args.stream, embeddings=args.embeddings))

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
    template = BodyTemplate(
        args.model,
        stream=args.stream,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        embeddings=args.embeddings,
        include_usage=getattr(args, "include_usage", False),
    )
    schedule = arrival_times(args.rate, count, args.seed)
    tasks = []
    origin = time.perf_counter()
    for index, at in enumerate(schedule):
        delay = origin + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        image = images[0] if args.repeat_one else images[index % len(images)]
        body = template.render(image.data_url(first + index if args.unique else None))
        tasks.append(
            asyncio.create_task(
                send_one(client, body, image.name, stream=args.stream, embeddings=args.embeddings, start=origin + at)
            )
        )
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


def api_root(base_url: str) -> str:
    """The server's root URL: ``--base-url`` without a trailing ``/`` or ``/v1`` (OpenAI clients take both)."""
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


async def model_card(client: RawClient, root: str) -> dict[str, Any]:
    """The first entry of ``GET /v1/models``. Raises BenchAborted, saying why, when there is none."""
    where = f"{root}/v1/models"
    try:
        response, lease = await asyncio.wait_for(client.get("/v1/models"), client.timeout_s)
        try:
            payload = await asyncio.wait_for(response.read(), client.timeout_s)
        finally:
            lease.release()
    except (TimeoutError, NoHttpAnswer) as exc:
        raise BenchAborted(f"cannot list the served models at {where}: {exc or 'timed out'}") from exc
    if not response.is_success:
        raise BenchAborted(f"cannot list the served models at {where}: {_snippet(response.status, payload)}")
    try:
        card = json.loads(payload)["data"][0]
        if not isinstance(card["id"], str):
            raise TypeError("the id is not a string")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise BenchAborted(f"{where} lists no model: {_snippet(None, payload)}") from exc
    return dict(card)


def warmup_failure(warm: Sequence[Outcome]) -> str | None:
    """Why the warm-up says the timed run would measure nothing but failures; None when it may go on.

    It may not when no warm-up request succeeded, or when one was refused as a bad request (a 4xx
    other than 429: the wrong model, a key, an image the server rejects), which every timed request
    would repeat. Overload (429, 503) and a few transport errors amid successes are measurements.
    """
    failed = [o for o in warm if o.error is not None]
    refused = [o for o in failed if o.status is not None and 400 <= o.status < 500 and o.status != 429]
    if not failed or (len(failed) < len(warm) and not refused):
        return None
    first = (refused or failed)[0]
    return (
        f"{len(failed)} of {len(warm)} warm-up requests failed: {_error_counts(failed)}\n"
        f"  first error: {first.detail or first.error}"
    )


def _error_counts(failed: Iterable[Outcome]) -> str:
    """``"429 overloaded: 10, 503 no_worker: 2"``, the most frequent first."""
    counts = Counter(o.error for o in failed)
    return ", ".join(f"{kind}: {n}" for kind, n in counts.most_common())


def distinct_images(args: argparse.Namespace, images: Sequence[BenchImage], warmup: int) -> int:
    """How many different request images (as bytes) the run sends, warm-up included."""
    if args.unique:
        return warmup + args.requests
    return 1 if args.repeat_one else min(len(images), max(warmup, args.requests))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args`` (see ``add_arguments``) and return the result dict.

    Raises ValueError for a bad argument and BenchAborted when the server cannot be measured (no
    model listed, a failed warm-up: see ``warmup_failure``).
    """
    if args.concurrency < 1 or args.requests < 1:
        raise ValueError("--concurrency and --requests must be at least 1")
    images = load_images(Path(args.images))
    pids = parse_pids(args.server_pid)
    if missing := [p for p in pids if not Path(f"/proc/{p}").exists()]:
        raise ValueError(f"--server-pid: no process {', '.join(map(str, missing))}")
    warmup = min(args.concurrency, args.requests) if args.warmup is None else args.warmup
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    root = api_root(args.base_url)
    client = RawClient(root, headers=headers, timeout_s=args.timeout)
    # Nonces must differ between runs, too: a bench run against a server an earlier run warmed
    # would otherwise send it bytes it has cached, and "--unique" would measure cache hits.
    nonces = secrets.randbelow(10**5) * 10**10
    try:
        if args.model is None:
            card: dict[str, Any] | None = await model_card(client, root)
        else:  # only to tell a generative model; a server without the list is measured all the same
            try:
                card = await model_card(client, root)
            except BenchAborted:
                card = None
        model = args.model if args.model is not None else str(card["id"] if card else "")
        generative = (
            not args.embeddings
            and card is not None
            and card.get("id") == model
            and card.get("max_model_len") is not None
        )
        args = argparse.Namespace(**{**vars(args), "model": model, "include_usage": generative})
        warm = await _drive(client, args, images, warmup, nonces) if warmup > 0 else []
        if (why := warmup_failure(warm)) is not None:
            path = "/v1/embeddings" if args.embeddings else "/v1/chat/completions"
            served = "" if card is None or card.get("id") == model else f" (the server serves {card.get('id')!r})"
            raise BenchAborted(
                f"the warm-up against {root}{path} with model {model!r}{served} failed, so nothing was timed\n  {why}"
            )
        scraped = None if args.no_stages else await scrape_metrics(root, headers)
        cpu_before = tree_cpu_seconds(pids) if pids else None
        busy_before, client_cpu_before = machine_busy_seconds(), time.process_time()
        start = time.perf_counter()
        drive = _drive if args.rate is None else _drive_open
        outcomes = await drive(client, args, images, args.requests, nonces + warmup)
        wall = time.perf_counter() - start
        busy, client_cpu = machine_busy_seconds() - busy_before, time.process_time() - client_cpu_before
        server_cpu = None if cpu_before is None else tree_cpu_seconds(pids) - cpu_before
        after = None if scraped is None else await scrape_metrics(root, headers)
    finally:
        await client.aclose()
    result = summarize(args, outcomes, wall, warm, client_cpu, server_cpu)
    result.update(
        base_url=root,
        generative=generative,
        distinct_images=distinct_images(args, images, warmup),
        image_count=len(images),
        cache=cache_counts(scraped, after),
    )
    # Whatever else ran during the timed phase took CPU from the server: on a small machine that
    # skews a comparison, so say how much (only known when the server's own share is).
    result["other_load_cores"] = (
        None if server_cpu is None or wall <= 0 else round(max(0.0, busy - server_cpu - client_cpu) / wall, 2)
    )
    result["stages"] = stage_breakdown(scraped, after) if scraped is not None and after is not None else []
    busy_start = _counter(scraped, "shmgate_worker_busy_seconds_total")
    busy_end = _counter(after, "shmgate_worker_busy_seconds_total")
    # workers busy on average (0..workers): low while requests wait says they wait for something else
    result["workers_busy"] = (
        None if busy_start is None or busy_end is None or wall <= 0 else round((busy_end - busy_start) / wall, 2)
    )
    return result


CACHE_COUNTERS = {
    "hits": "shmgate_cache_hits_total",
    "remote_hits": "shmgate_cache_remote_hits_total",
    "misses": "shmgate_cache_misses_total",
    "result_hits": "shmgate_result_cache_hits_total",
}


def cache_counts(before: str | None, after: str | None) -> dict[str, Any] | None:
    """The server's image-cache lookups during the timed phase (two /metrics scrapes), with the hit
    ratio; None when the server has no such counters."""
    counts: dict[str, Any] = {}
    for key, name in CACHE_COUNTERS.items():
        start, end = _counter(before, name), _counter(after, name)
        if start is None or end is None:
            return None
        counts[key] = int(end - start)
    looked_up = counts["hits"] + counts["remote_hits"] + counts["misses"]
    counts["hit_ratio"] = None if looked_up == 0 else round((counts["hits"] + counts["remote_hits"]) / looked_up, 4)
    return counts


def _counter(text: str | None, name: str) -> float | None:
    """An unlabelled sample of a /metrics text; None when absent."""
    for line in (text or "").splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def summarize(
    args: argparse.Namespace,
    outcomes: list[Outcome],
    wall_s: float,
    warm: list[Outcome],
    client_cpu_s: float,
    server_cpu_s: float | None,
) -> dict[str, Any]:
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

    # vllm bench serve's TPOT: the time per output token after the first, per request of 2+ tokens
    tpots = [
        (o.latency_s - o.ttft_s) / (o.output_tokens - 1)
        for o in ok
        if args.stream and o.ttft_s is not None and o.output_tokens is not None and o.output_tokens > 1
    ]
    itls = [gap for o in ok for gap in o.itl_s]
    counted = [o.output_tokens for o in ok if o.output_tokens is not None]
    output_tokens = sum(counted) if counted else None
    first_error = next((o for o in outcomes if o.error is not None), None)

    n = len(outcomes)
    rate = getattr(args, "rate", None)
    return {
        "model": args.model,
        "stream": bool(args.stream),
        "embeddings": bool(args.embeddings),
        "concurrency": args.concurrency,
        "requests": n,
        "offered_rate": rate,
        "repeat_one": bool(args.repeat_one),
        "unique": bool(args.unique),
        "warmup": len(warm),
        # successful requests only: a failure is often fast, and counting it would flatter a broken server
        "duration_s": round(wall_s, 3),
        "requests_per_s": round(len(ok) / wall_s, 2) if wall_s > 0 else None,
        "p50_ms": ms(percentile(latencies, 50)),
        "p90_ms": ms(percentile(latencies, 90)),
        "p99_ms": ms(percentile(latencies, 99)),
        "ttft_p50_ms": ms(percentile(ttfts, 50)),
        "ttft_p90_ms": ms(percentile(ttfts, 90)),
        "ttft_p99_ms": ms(percentile(ttfts, 99)),
        "output_tokens": output_tokens,
        "output_tokens_per_s": None if output_tokens is None or wall_s <= 0 else round(output_tokens / wall_s, 2),
        "tpot_p50_ms": ms(percentile(tpots, 50)),
        "tpot_p90_ms": ms(percentile(tpots, 90)),
        "tpot_p99_ms": ms(percentile(tpots, 99)),
        "itl_p50_ms": ms(percentile(itls, 50)),
        "itl_p90_ms": ms(percentile(itls, 90)),
        "itl_p99_ms": ms(percentile(itls, 99)),
        "errors": sum(errors.values()),
        "errors_by_kind": dict(sorted(errors.items())),
        "first_error": None if first_error is None else first_error.detail or first_error.error,
        "mismatches": mismatches,
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
    slowest = timed[-max(1, round(len(timed) * TAIL_SHARE)) :]

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
    return [
        {
            "stage": n,
            "all_mean_ms": round(everyone.get(n, 0.0), 2),
            "tail_mean_ms": round(tail.get(n, 0.0), 2),
            "tail_count": len(slowest),
        }
        for n in names
    ]


def format_report(result: dict[str, Any]) -> str:
    """The human-readable form of a result."""

    def f(key: str, source: dict[str, Any] = result) -> str:
        value = source.get(key)
        return "-" if value is None else f"{value:.1f}"

    def spread(name: str) -> str:
        return f"p50 {f(name + '_p50_ms')}  p90 {f(name + '_p90_ms')}  p99 {f(name + '_p99_ms')}"

    cpu = result["cpu_s_per_request"]
    load = (
        f"concurrency {result['concurrency']}"
        if result.get("offered_rate") is None
        else f"open loop {result['offered_rate']} req/s offered"
    )
    kind = "embeddings" if result["embeddings"] else ("chat, streamed" if result["stream"] else "chat")
    generative = bool(result.get("generative"))
    ok = result["requests"] - result["errors"]
    lines = [
        f"shmgate bench  {result.get('base_url', '')}  model {result['model']}  ({kind})",
        f"load         {load}  requests {result['requests']} (+{result['warmup']} warm-up) "
        f"in {result['duration_s']:.2f} s",
        f"throughput   {result['requests_per_s']} req/s ({ok} successful requests)",
    ]
    if generative:
        tokens = result.get("output_tokens")
        lines.append(
            f"tokens       {'-' if tokens is None else tokens} output tokens, "
            f"{'-' if result.get('output_tokens_per_s') is None else result['output_tokens_per_s']} "
            "tokens/s (from each answer's usage)"
        )
    lines.append(f"latency ms   p50 {f('p50_ms')}  p90 {f('p90_ms')}  p99 {f('p99_ms')}")
    if generative and result["stream"]:
        lines += [
            f"ttft ms      {spread('ttft')}  (to the first content chunk)",
            f"tpot ms      {spread('tpot')}  (per output token after the first)",
            f"itl ms       {spread('itl')}  (between content chunks)",
        ]
    elif generative:
        lines.append("ttft ms      -  (ttft, tpot and itl need --stream)")
    elif not result["embeddings"]:
        lines.append(f"ttft ms      p50 {f('ttft_p50_ms')}  p90 {f('ttft_p90_ms')}")
    if result["errors"]:
        counts = ", ".join(
            f"{kind}: {n}" for kind, n in sorted(result["errors_by_kind"].items(), key=lambda item: -item[1])
        )
        lines += [f"errors       {result['errors']} ({counts})", f"first error  {result.get('first_error')}"]
    else:
        lines.append("errors       0")
    lines.append(f"mismatches   {result['mismatches']}")
    lines += _cache_lines(result)
    lines += [
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
            lines.append(
                f"  {row['stage']:<12} {row['count']:>6} {f('mean_ms', row):>10} {f('p50_ms', row):>9} "
                f"{f('p99_ms', row):>9}"
            )
    if result.get("tail"):
        lines.append(
            f"slowest {result['tail'][0]['tail_count']}   all mean ms   slowest mean ms   "
            "(per request, from Server-Timing)"
        )
        for row in result["tail"]:
            lines.append(f"  {row['stage']:<12} {f('all_mean_ms', row):>12} {f('tail_mean_ms', row):>17}")
    return "\n".join(lines)


def _cache_lines(result: dict[str, Any]) -> list[str]:
    """What the images sent let a content cache do, and what the server's cache did (when it says)."""
    if "distinct_images" not in result:
        return []
    sent = result["requests"] + result["warmup"]
    if result["unique"]:
        lines = [f"images       {sent} distinct of {sent} sent (--unique): every request a cache miss"]
    else:
        distinct = result["distinct_images"]
        lines = [
            f"images       {distinct} distinct of {sent} sent: all but the first {distinct} repeat bytes "
            "a content cache answers (--unique: every request a miss)"
        ]
    cache = result.get("cache")
    if cache is not None:
        ratio = "-" if cache["hit_ratio"] is None else f"{cache['hit_ratio'] * 100:.1f}%"
        line = (
            f"cache        hit ratio {ratio} this run ({cache['hits'] + cache['remote_hits']} hits, "
            f"{cache['misses']} misses, from the server's /metrics)"
        )
        if cache["result_hits"]:
            line += f"; {cache['result_hits']} answers from its result cache"
        lines.append(line)
    return lines


EPILOG = """\
example:
  shmgate bench --base-url http://127.0.0.1:8000/v1 --images tests/data/images -c 8 -n 200

The report: throughput over successful requests; latency percentiles; failures by status and error
code with the first error body; for generative models output tokens/s (from usage) and, with
--stream, TTFT (to the first content chunk), TPOT ((latency - TTFT) / (tokens - 1)) and ITL (gaps
between content chunks), as vllm bench serve defines them; how many distinct images were sent and
the cache hit ratio the server's /metrics counted (--unique: every request a miss).

exit status: 0 all requests succeeded and answers agreed; 1 the run could not start (no server, no
model listed, a failed warm-up), a request failed (unless --allow-errors) or answers for one image
disagreed; 2 a bad argument."""


def main(argv: list[str] | None = None) -> int:
    """Parse, run, print. Exit status 1 when the run could not start (no server, a failed warm-up),
    any request failed (unless ``--allow-errors``) or answers disagreed; 2 for a bad argument."""
    parser = argparse.ArgumentParser(
        prog="shmgate bench",
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        result = asyncio.run(run(args))
    except BenchAborted as exc:
        print(f"shmgate bench: {exc}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as exc:
        print(f"shmgate bench: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_report(result))
    failed = result["errors"] and not args.allow_errors
    return 1 if failed or result["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
