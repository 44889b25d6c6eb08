"""What a frontend pays on its event loop for a cache hit: a thread-pool hop vs hashing the image.

Why: the frontend takes local cache hits on the event loop (gateway/frontend.py,
``_resolve_images``) instead of in its decode pool. That is worth it only if the hop it saves
costs as much as the work it moves onto the loop; this measures both on the test photos.

Usage: ``python bench/loop_costs.py [--iters N]``. Prints microseconds per operation.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gateway.preprocess.vision import ChecksumPreprocessor
from shared.cache import content_key


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
        start = time.perf_counter()
        for _ in range(args.iters):
            content_key(data, params)
        print(f"content key of {path.name} ({len(data) // 1024} KiB): "
              f"{(time.perf_counter() - start) / args.iters * 1e6:.0f} µs")


if __name__ == "__main__":
    main()
