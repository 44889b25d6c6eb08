"""What a frontend pays on its event loop for a cache hit: a thread-pool hop vs hashing the image.

Why: the frontend takes local cache hits on the event loop (gateway/images.py,
``ImageResolver.resolve``) instead of in its decode pool. That is worth it only if the hop it saves
costs as much as the work it moves onto the loop; this measures both on the test photos. It
also shows what keying a data URL on its base64 text saves: the base64 decode a hit no longer
needs (gateway/intake.py, ``EncodedImage``).

Usage: ``python bench/loop_costs.py [--iters N]``. Prints microseconds per operation.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from shmgate.gateway.intake import EncodedImage
from shmgate.gateway.preprocess.vision import ChecksumPreprocessor
from shmgate.shared.cache import content_key


async def _hop_us(pool: ThreadPoolExecutor, iters: int) -> tuple[float, float]:
    """(wall, CPU) µs of one ``run_in_executor`` round trip of a no-op, as the frontend awaits it."""
    loop = asyncio.get_running_loop()
    for _ in range(200):
        await loop.run_in_executor(pool, int)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        await loop.run_in_executor(pool, int)
    return (time.perf_counter() - wall) / iters * 1e6, (time.process_time() - cpu) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3000)
    args = parser.parse_args()
    with ThreadPoolExecutor(max_workers=2) as pool:
        wall, cpu = asyncio.run(_hop_us(pool, args.iters))
    print(f"thread-pool hop: {wall:.0f} µs wall, {cpu:.0f} µs CPU")
    params = ChecksumPreprocessor().cache_params()
    for path in sorted((REPO / "tests" / "data" / "images").glob("*.jpg")):
        data = path.read_bytes()
        text = base64.b64encode(data).decode()
        image = EncodedImage(text, 20 << 20)
        print(
            f"{path.name} ({len(data) // 1024} KiB, {len(text) // 1024} KiB as base64): "
            f"BLAKE2b of the bytes (the old key) "
            f"{_us(lambda: hashlib.blake2b(data, digest_size=16).digest(), args.iters):.0f} µs, "
            f"key of the bytes {_us(lambda: content_key(data, params), args.iters):.0f} µs, "
            f"key of the base64 text {_us(lambda: content_key(text, params), args.iters):.0f} µs, "
            f"base64 decode {_us(image.decode, args.iters):.0f} µs"
        )


def _us(fn: Callable[[], object], iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


if __name__ == "__main__":
    main()
