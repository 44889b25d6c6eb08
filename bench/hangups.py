"""Clients that hang up, and clients that are slow on purpose, against a real ``shmgate serve --model checksum``.

Three measurements, each against a server this script starts and stops (run it from the checkout to
measure; ``PYTHONPATH`` is set to the current directory, so the children run this checkout's code):

    hangup   a non-streamed request of ~10 s of work (``checksum:trickle 500``) whose client hangs up
             after 1 s; a streamed one held back ~5 s before its first output (``checksum:hold 500``)
             whose client hangs up after 1 s; 12 clients that hang up 30 ms after sending. Printed: how
             the requests were counted (``shmgate_requests_total`` by outcome) and how long after the
             hang-up the arena holds came back (the worker's terminal message releases them: the time
             the worker kept working for nobody).
    loris    N connections (default 200) that send their request head one byte a second, 20 that send a
             body one byte a second, 10 that never send a byte, while one ordinary client keeps asking.
             Printed: how many of each were cut and when, the ordinary requests' latency and status,
             and the frontend's open file descriptors (``/proc/<pid>/fd``), sampled every second.
    watcher  the disconnect watcher's own CPU cost per request, alone (an asyncio loop, no server).
    cpu      CPU per request of the frontend (``shmgate bench --server-pid``), this checkout against
             another tree (``--other``, e.g. an export of main), ABBA, a few hundred requests each.

Usage (from the repository root):
    python bench/hangups.py hangup
    python bench/hangups.py loris [--connections 200] [--seconds 20] [-- extra serve flags]
    python bench/hangups.py watcher
    python bench/hangups.py cpu --other /tmp/shmgate-main [--pairs 2] [--requests 400] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.serving import Server, free_port, image_request, noise_png, shm_entries  # noqa: E402

IMAGES = ROOT / "tests" / "data" / "images"


def start(tree: Path, *extra: str, env: dict[str, str] | None = None) -> Server:
    """``shmgate serve --model checksum`` of ``tree`` (one frontend, one worker), ready; ``env`` on top of ours."""
    port = free_port()
    log_path = Path(f"/tmp/shmgate-bench-{port}.log")
    env = dict(os.environ, PYTHONPATH=str(tree), **(env or {}))
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shmgate.gateway",
            "serve",
            "--port",
            str(port),
            "--model",
            "checksum",
            "--frontends",
            "1",
            "--workers",
            "1",
            "--arena-size",
            "128MiB",
            *extra,
        ],
        cwd=tree,
        env=env,
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
    )
    server = Server(process, port, "checksum", log_path)
    server.wait_ready()
    return server


def outcomes(server: Server) -> dict[str, float]:
    names = ("ok", "cancelled", "client_error", "server_error", "overloaded")
    return {o: server.metric(f'shmgate_requests_total{{outcome="{o}"}}') for o in names}


def change(before: dict[str, float], after: dict[str, float]) -> str:
    return ", ".join(f"{o} +{after[o] - before[o]:.0f}" for o in after if after[o] != before[o]) or "nothing"


def raw_request(body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(data)
    ) + data


def send_and_hang_up(port: int, body: dict[str, object], after_s: float) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(raw_request(body))
        time.sleep(after_s)


def held_back_after(server: Server, since: float, before: dict[str, float], n: int, guard_s: float = 40.0) -> float:
    """Seconds from ``since`` until ``n`` more requests were counted, none is in flight and no arena byte is held.

    A request leaves the frontend's in-flight set only at its worker's terminal message: this is when the
    worker stopped working on it."""
    while time.monotonic() - since < guard_s:
        counted = sum(outcomes(server).values()) - sum(before.values())
        if (
            counted >= n
            and server.metric("shmgate_in_flight_requests") == 0
            and server.metric("shmgate_arena_held_bytes") == 0
        ):
            return time.monotonic() - since
        time.sleep(0.05)
    return float("inf")


def hangup(args: argparse.Namespace) -> None:
    server = start(Path.cwd(), *args.extra)
    try:
        data = noise_png(1, size=128)
        cases = [
            (
                "non-streamed, trickle 500 (~10 s), hang up at 1 s",
                image_request("checksum", data, mime="image/png", text="checksum:trickle 500"),
            ),
            (
                "streamed, hold 250 (~5 s before output), hang up at 1 s",
                image_request("checksum", data, mime="image/png", stream=True, text="checksum:hold 250"),
            ),
        ]
        for what, body in cases:
            before = outcomes(server)
            send_and_hang_up(server.port, body, 1.0)
            hung_up = time.monotonic()
            back = held_back_after(server, hung_up, before, 1)
            after = outcomes(server)
            print(f"{what}: worker done {back:.2f} s after the hang-up; counted {change(before, after)}")

        before = outcomes(server)
        bodies = [
            image_request("checksum", noise_png(100 + i, size=128), mime="image/png", text="checksum:trickle 50")
            for i in range(12)
        ]

        async def twelve() -> None:
            await asyncio.gather(*(asyncio.to_thread(send_and_hang_up, server.port, b, 0.03) for b in bodies))

        asyncio.run(twelve())
        back = held_back_after(server, time.monotonic(), before, 12)
        after = outcomes(server)
        print(
            f"12 clients, trickle 50 (~1 s), hang up at 30 ms: all done {back:.2f} s after; "
            f"counted {change(before, after)}"
        )
    finally:
        server.stop()


# -- slow clients ---------------------------------------------------------------------------------------------


class Slow:
    """One deliberately slow connection: what it sends each second, and when the server cut it."""

    def __init__(self, kind: str, port: int) -> None:
        self.kind = kind
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setblocking(False)
        self.opened = time.monotonic()
        self.cut_after: float | None = None
        self.answer = b""
        if kind == "body":
            self.sock.send(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            )
        self.pending = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10000

    def tick(self) -> None:
        """Send one byte (head or body kind), then see whether the server answered or closed."""
        if self.cut_after is not None:
            return
        try:
            if self.kind in ("head", "body"):
                self.sock.send(self.pending[:1] if self.kind == "head" else b" ")
                self.pending = self.pending[1:]
        except OSError:
            self.cut()
            return
        try:
            chunk = self.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        self.answer += chunk
        if not chunk:
            self.cut()

    def cut(self) -> None:
        self.cut_after = time.monotonic() - self.opened
        self.sock.close()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def loris(args: argparse.Namespace) -> None:
    server = start(Path.cwd(), *args.extra)
    import httpx

    try:
        frontend = server.frontend_pid(0)
        assert frontend is not None
        fds_idle = open_fds(frontend)
        slow = [Slow("head", server.port) for _ in range(args.connections)]
        slow += [Slow("body", server.port) for _ in range(20)] + [Slow("idle", server.port) for _ in range(10)]
        body = image_request("checksum", noise_png(7, size=128), mime="image/png")
        latencies: list[float] = []
        statuses: dict[int, int] = {}
        fds: list[int] = []
        started = time.monotonic()
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            while time.monotonic() - started < args.seconds:
                tick = time.monotonic()
                for s in slow:
                    s.tick()
                fds.append(open_fds(frontend))
                for _ in range(4):
                    t = time.monotonic()
                    try:
                        status = client.post("/v1/chat/completions", json=body).status_code
                    except httpx.HTTPError:
                        status = 0
                    latencies.append(time.monotonic() - t)
                    statuses[status] = statuses.get(status, 0) + 1
                time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
        for kind, total in (("head", args.connections), ("body", 20), ("idle", 10)):
            cut = [s.cut_after for s in slow if s.kind == kind and s.cut_after is not None]
            answered = sum(s.answer.startswith(b"HTTP/1.1 408") for s in slow if s.kind == kind)
            when = f", after {min(cut):.1f}-{max(cut):.1f} s" if cut else ""
            print(f"{kind:>5}: {len(cut)}/{total} cut within {args.seconds:.0f} s{when}, {answered} got a 408")
        lat = sorted(latencies)
        print(
            f"ordinary requests: {len(lat)}, statuses {statuses}, p50 {statistics.median(lat) * 1000:.0f} ms, "
            f"max {lat[-1] * 1000:.0f} ms"
        )
        print(f"frontend fds: {fds_idle} idle, max {max(fds)} during, {fds[-1]} at the end")
        for s in slow:
            if s.cut_after is None:
                s.sock.close()
    finally:
        server.stop()
    left = {n for n in shm_entries() if server.instance_id in n}
    assert not left, left


# -- CPU per request ---------------------------------------------------------------------------------------------


def cpu_run(tree: Path, requests: int, stream: bool) -> float:
    server = start(tree)
    try:
        pids = ",".join(str(p) for p in server.pids("frontend"))
        command = [
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
            "-n",
            str(requests),
            "--unique",
            "--no-stages",
            "--json",
            "--server-pid",
            pids,
            *(["--stream"] if stream else []),
        ]
        out = subprocess.run(
            command, check=True, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT))
        ).stdout
        result = json.loads(out)
        return float(result["cpu_s_per_request"]) * 1000
    finally:
        server.stop()


def cpu(args: argparse.Namespace) -> None:
    trees = {"this": Path.cwd(), "other": Path(args.other)}
    seen: dict[str, list[float]] = {"this": [], "other": []}
    for _ in range(args.pairs):
        for name in ("other", "this", "this", "other"):
            ms = cpu_run(trees[name], args.requests, args.stream)
            seen[name].append(ms)
            print(f"{name:>5} ({trees[name]}): frontend CPU {ms:.3f} ms/request", flush=True)
    for name, values in seen.items():
        print(f"{name:>5}: mean {statistics.mean(values):.3f} ms/request over {len(values)} runs")


def watcher(args: argparse.Namespace) -> None:
    """The disconnect watcher's own CPU cost, alone: start, park on receive(), cancel, unwind (no server)."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        never = asyncio.Event()

        async def receive() -> dict[str, str]:
            await never.wait()
            return {"type": "http.disconnect"}

        async def watch() -> None:  # the shape of gateway/render.py's cancel_on_hang_up
            while (await receive())["type"] != "http.disconnect":
                pass

        for label in ("with the watcher", "without"):
            started = time.process_time()
            for _ in range(args.n):
                task = loop.create_task(watch()) if label == "with the watcher" else None
                await asyncio.sleep(0)  # the request's work: the watcher starts and parks
                if task is not None:
                    task.cancel()
                await asyncio.sleep(0)  # the cancelled watcher unwinds
            print(f"{label}: {(time.process_time() - started) / args.n * 1e6:.1f} us of CPU per request")

    asyncio.run(run())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    h = sub.add_parser("hangup")
    h.add_argument("extra", nargs="*", help="extra `shmgate serve` flags (after --)")
    lo = sub.add_parser("loris")
    lo.add_argument("--connections", type=int, default=200)
    lo.add_argument("--seconds", type=float, default=20)
    lo.add_argument("extra", nargs="*", help="extra `shmgate serve` flags (after --)")
    c = sub.add_parser("cpu")
    c.add_argument("--other", required=True, help="another source tree to compare with (e.g. an export of main)")
    c.add_argument("--pairs", type=int, default=2)
    c.add_argument("--requests", type=int, default=400)
    c.add_argument("--stream", action="store_true", help="streamed requests (SSE)")
    w = sub.add_parser("watcher")
    w.add_argument("-n", type=int, default=50_000)
    args = p.parse_args()
    {"hangup": hangup, "loris": loris, "cpu": cpu, "watcher": watcher}[args.what](args)


if __name__ == "__main__":
    main()
