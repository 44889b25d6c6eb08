"""Videos per second and time to first token for video chat, shmgate against a naive one-process server.

Both serve the same tiny random-weight Qwen2-VL (tests/hf_fixture.py) with the same processing code
(gateway/preprocess/qwen_video.py); shmgate decodes videos in its frontends' decode threads and keeps
them in the arena's content cache, the naive server (bench/naive_video_server.py) decodes each video
on its model thread right before generating. Clips: 10 s of 320 x 240 H.264 at 30 fps, sampled at
the checkpoint's default 2 fps (20 frames, 1,400 video tokens each). Every request at c = 1, 4, 16
sends a video not sent before (a miss); then, on each server, a new video twice in a row (the second
is a cache hit on shmgate). Streams with max_tokens 4; TTFT is the first content chunk.

Usage: ``flock /tmp/bench.lock python -m bench video [--requests-per-level N]`` (about 3 minutes on
2 cores). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

import httpx

from bench.servers import ServerProcess, free_port
from tests.hf_fixture import build_tiny_vlm
from tests.video_samples import MP4, make_video

LEVELS = (1, 4, 16)


def _body(data: bytes) -> dict[str, object]:
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]
    return {
        "model": "tiny-qwen2-vl",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }


async def _one(client: httpx.AsyncClient, data: bytes) -> float:
    """Seconds to the first content chunk (the stream is read to its end)."""
    start = time.perf_counter()
    first = 0.0
    async with client.stream("POST", "/v1/chat/completions", json=_body(data)) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not first and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - start
    return first


async def _level(base_url: str, clips: list[bytes], concurrency: int) -> tuple[float, list[float]]:
    queue = list(clips)
    ttfts: list[float] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:

        async def user() -> None:
            while queue:
                ttfts.append(await _one(client, queue.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        return len(clips) / (time.perf_counter() - start), ttfts


async def _hit_and_miss(base_url: str, clips: list[bytes]) -> tuple[float, float]:
    first, again = [], []
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        for clip in clips:
            first.append(await _one(client, clip))
            again.append(await _one(client, clip))
    return statistics.median(first), statistics.median(again)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(per_level: int) -> str:
    work = Path(tempfile.mkdtemp(prefix="bench-video-"))
    model_dir = build_tiny_vlm(work / "tiny-qwen2-vl")
    shift = iter(range(1, 256))
    clips = {
        name: {
            c: [
                make_video(MP4, width=320, height=240, frames=300, fps=30, gop=30, shift=next(shift))
                for _ in range(max(per_level, c))
            ]
            for c in LEVELS
        }
        for name in ("shmgate", "naive")
    }
    repeat = [make_video(MP4, width=320, height=240, frames=300, fps=30, gop=30, shift=next(shift)) for _ in range(3)]
    contenders = {
        "shmgate": (
            [
                sys.executable,
                "-m",
                "shmgate.gateway",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
                "--model",
                f"hf:{model_dir}",
                "--workers",
                "1",
                "--threads",
                "1",
            ],
            "/ready",
        ),
        "naive": (
            [
                sys.executable,
                "-m",
                "bench.naive_video_server",
                "--port",
                "{port}",
                "--model-dir",
                str(model_dir),
                "--threads",
                "1",
            ],
            "/health",
        ),
    }
    rows = ["| server | c | videos/s | TTFT p50 (s) | TTFT p90 (s) |", "|---|---|---|---|---|"]
    repeats = []
    for name, (argv, ready) in contenders.items():
        port = free_port()
        server = ServerProcess([a.replace("{port}", str(port)) for a in argv], work / f"{name}.log")
        server.start()
        try:
            base_url = f"http://127.0.0.1:{port}"
            await server.wait_ready(base_url + ready, 120)
            await _level(base_url, [repeat[0]], 1)  # warm-up (not counted; its video is the first repeat's)
            for c in LEVELS:
                rate, ttfts = await _level(base_url, clips[name][c], c)
                rows.append(f"| {name} | {c} | {rate:.2f} | {_p(ttfts, 0.5):.3f} | {_p(ttfts, 0.9):.3f} |")
            first, again = await _hit_and_miss(base_url, repeat[1:])
            repeats.append(f"| {name} | {first:.3f} | {again:.3f} |")
        finally:
            server.stop()
    table = "\n".join(rows)
    hits = "\n".join(["| server | first video TTFT (s) | same video again TTFT (s) |", "|---|---|---|", *repeats])
    return f"{table}\n\n{hits}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests-per-level", type=int, default=8, help="videos sent at each concurrency (at least c)"
    )
    args = parser.parse_args(argv)
    print(asyncio.run(run(args.requests_per_level)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
