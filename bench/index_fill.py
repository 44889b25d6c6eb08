"""Does the content cache still cache a new image after thousands of distinct ones? (the index-fill check)

    python bench/index_fill.py [--distinct 6000] [--repeats 6] [--base DIR]

Starts ``shmgate serve --model checksum`` (default arena), sends ``--distinct`` different images (one
photo with a nonce after its end marker: bench_client/loadgen.py ``--unique``), then one image never
sent before ``--repeats`` times, one after another, and prints the server's cache counters before and
after the repeats. A working cache decodes the new image once: 1 miss, the rest hits. Before the index
quota (shared/cache.py ``index_quota``) a 4,096-slot index filled with the first ~4,000 small images
while the arena had room, and every later image was a miss on every request. ``--base DIR`` runs the
server from another checkout (its frontends import from DIR), to show the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.e2e import IMAGES, ServerProcess, free_port  # noqa: E402
from shmgate.bench_client import loadgen  # noqa: E402

COUNTERS = ("shmgate_cache_hits_total", "shmgate_cache_remote_hits_total", "shmgate_cache_misses_total")


def counters(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return {name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)) for name in COUNTERS}  # type: ignore[union-attr]


def send_new_image(url: str, repeats: int) -> None:
    data = IMAGES[1].read_bytes() + os.urandom(16)  # bytes no earlier request carried
    body = loadgen.BodyTemplate("checksum", stream=False, max_tokens=None).render(
        "data:image/jpeg;base64," + base64.b64encode(data).decode()
    )
    for _ in range(repeats):
        request = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
        urllib.request.urlopen(request, timeout=30).read()


async def main_async(args: argparse.Namespace) -> None:
    port = free_port()
    shmgate = f"{Path(sys.executable).parent}/shmgate serve --host 127.0.0.1 --port {port} --model checksum"
    argv = ["sh", "-c", f"cd {args.base} && PYTHONPATH={args.base} exec {shmgate}"] if args.base else shmgate.split()
    with tempfile.TemporaryDirectory(prefix="shmgate-index-") as tmp:
        server = ServerProcess(argv, Path(tmp) / "serve.log")
        server.start()
        try:
            url = f"http://127.0.0.1:{port}"
            await server.wait_ready(url + "/ready", 120.0)
            subprocess.run(
                [sys.executable, "-m", "shmgate.bench_client.loadgen", "--base-url", url, "-c", "16", "-n", str(args.distinct),
                 "--images", str(IMAGES[0].parent), "--unique", "--no-stages", "--warmup", "0"],
                check=True, capture_output=True, cwd=REPO,
            )  # fmt: skip
            before = counters(url)
            send_new_image(url, args.repeats)
            after = counters(url)
        finally:
            server.stop()
    delta = {
        name.removeprefix("shmgate_cache_").removesuffix("_total"): after[name] - before[name] for name in COUNTERS
    }
    print(f"after {args.distinct} distinct images, one new image sent {args.repeats} times: {json.dumps(delta)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distinct", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--base", type=Path, default=None)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
