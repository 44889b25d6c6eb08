"""How ``shmgate serve``'s frontends share the connections, per ``--listen`` mode (gateway/listen.py).

Each mode's server (``--model checksum``, 2 frontends, 1 worker) is started in turn, the order
alternated per round, and loaded with one photo's chat request (a tensor-cache hit after the first):

* ``fresh c=C``: C clients, each sending its requests one at a time, every request on a new
  connection (``Connection: close``): which frontend answered each request;
* ``pools of C``: C keep-alive connections opened at once, as a client's pool warms up (the
  load generator's warm-up does this), one request on each: which frontend holds each connection.
  Repeated ``--pools`` times; a keep-alive load stays where its connections landed.

The figure is the busiest frontend's share of the requests (fresh: the median of the rounds and
their range) or of a pool's connections (pools: the median, 90th percentile and worst of every pool
of every round, and how many pools had every connection on one frontend). Usage: ``python bench/listen_spread.py [--rounds 3]
[--requests 200] [--pools 20] [--mode shared --mode reuseport]``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.e2e import ServerProcess, free_port  # noqa: E402

PHOTO = REPO / "tests" / "data" / "images" / "coffee_640.jpg"


def chat_request(port: int, *, close: bool) -> bytes:
    import base64

    url = "data:image/jpeg;base64," + base64.b64encode(PHOTO.read_bytes()).decode()
    body = json.dumps(
        {
            "model": "checksum",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n"
    )
    return head.encode() + body


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> int:
    """Send ``request``, read the whole answer; the slot of the frontend that answered."""
    writer.write(request)
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
    assert head.startswith("http/1.1 200"), head[:200]
    length = int(head.split("content-length:", 1)[1].split("\r\n", 1)[0])
    await reader.readexactly(length)
    return int(head.split("x-shmgate-frontend:", 1)[1].split("\r\n", 1)[0])


async def fresh(port: int, clients: int, requests: int) -> collections.Counter[int]:
    request = chat_request(port, close=True)
    seen: collections.Counter[int] = collections.Counter()

    async def client(n: int) -> None:
        for _ in range(n):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                seen[await exchange(reader, writer, request)] += 1
            finally:
                writer.close()

    await asyncio.gather(*(client(requests // clients) for _ in range(clients)))
    return seen


async def pool(port: int, size: int) -> collections.Counter[int]:
    request = chat_request(port, close=False)
    connections = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in range(size)))
    try:
        slots = await asyncio.gather(*(exchange(r, w, request) for r, w in connections))
    finally:
        for _, writer in connections:
            writer.close()
    return collections.Counter(slots)


def busiest(seen: collections.Counter[int], frontends: int = 2) -> float:
    total = sum(seen.values())
    return max(seen.values()) / total if total else 0.0


async def measure(mode: str, args: argparse.Namespace, log_dir: Path, round_index: int) -> dict[str, object]:
    port = free_port()
    shmgate = str(Path(sys.executable).parent / "shmgate")
    flags = f"--port {port} --model checksum --frontends 2 --workers 1 --arena-size 128MiB --listen {mode}"
    server = ServerProcess(
        [shmgate, "serve", *flags.split()],
        log_dir / f"{mode}-{round_index}.log",
    )
    server.start()
    row: dict[str, object] = {"mode": mode, "round": round_index}
    try:
        await server.wait_ready(f"http://127.0.0.1:{port}/ready", 120)
        await asyncio.sleep(1.0)  # both frontends listening (reuseport: the second may still be starting)
        for clients in args.fresh:
            row[f"fresh c={clients}"] = busiest(await fresh(port, clients, args.requests))
        for size in args.pool:
            row[f"pools of {size}"] = [busiest(await pool(port, size)) for _ in range(args.pools)]
    finally:
        server.stop()
    shown = {k: round(statistics.median(v), 3) if isinstance(v, list) else v for k, v in row.items()}
    print(f"  round {round_index + 1} {mode:<10} {shown} (pools: median)", file=sys.stderr, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", action="append", default=None, help="repeatable; default: shared and reuseport")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200, help="requests per fresh-connection point")
    parser.add_argument("--fresh", type=int, nargs="+", default=[1, 8], help="clients of the fresh-connection loads")
    parser.add_argument("--pool", type=int, nargs="+", default=[8, 32], help="sizes of the keep-alive pools")
    parser.add_argument("--pools", type=int, default=20, help="pools opened per size")
    args = parser.parse_args(argv)
    modes = args.mode or ["shared", "reuseport"]
    started = time.monotonic()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="shmgate-spread-") as tmp:
        for round_index in range(args.rounds):
            for mode in modes if round_index % 2 == 0 else modes[::-1]:
                rows.append(asyncio.run(measure(mode, args, Path(tmp), round_index)))
    points = [f"fresh c={c}" for c in args.fresh] + [f"pools of {s}" for s in args.pool]
    print("| busiest frontend's share | " + " | ".join(points) + " |")
    print("|---|" + "---:|" * len(points))
    for mode in modes:
        cells = []
        for point in points:
            values = [r[point] for r in rows if r["mode"] == mode]
            if point.startswith("pools"):  # every pool of every round
                shares = sorted(share for v in values for share in v)  # type: ignore[attr-defined]
                p90 = shares[int(0.9 * (len(shares) - 1))]
                alone = sum(share == 1.0 for share in shares)
                cells.append(
                    f"{statistics.median(shares):.2f}, p90 {p90:.2f}, worst {shares[-1]:.2f}, "
                    f"all on one {alone}/{len(shares)}"
                )
            else:
                cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")  # type: ignore[type-var,arg-type]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    print(f"\n{args.rounds} round(s), {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
