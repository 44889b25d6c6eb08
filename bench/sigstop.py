"""The issue's experiment, with every default: a worker SIGSTOPped under load is replaced.

    python bench/sigstop.py            # efficientnet-lite0, 2 workers, 16 clients of 1024 px photos

Starts ``shmgate serve --workers 2`` (default ``--stall-timeout-s``), runs 16 closed-loop clients
sending the 1024 px photos of tests/data/images for 15 s, SIGSTOPs one worker, waits until the
stalled worker was killed and a new one is ready (both workers ready again), runs 15 s more, and
prints: requests and failures, when the stalled worker was killed and when the node was back at
full capacity (from the SIGSTOP), and p99 latency before, while wedged and after. Figures:
docs/RELIABILITY.md, "Stalls".
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.serving import free_port  # noqa: E402

CLIENTS = 16
PHASE_S = 15.0


def main() -> int:
    images = [p.read_bytes() for p in sorted((REPO / "tests" / "data" / "images").glob("*_1024.jpg"))]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkdtemp(prefix="shmgate-sigstop-")) / "serve.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shmgate.gateway",
            "serve",
            "--port",
            str(port),
            "--workers",
            "2",
            "--frontends",
            "2",
            "--arena-size",
            "256MiB",
        ],
        cwd=REPO,
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
    )

    def metric(name: str) -> float:
        text = httpx.get(url + "/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))

    def workers() -> list[int]:
        out = []
        for entry in os.listdir("/proc"):
            try:
                if (
                    entry.isdigit()
                    and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == proc.pid
                    and b"-m\0worker" in Path(f"/proc/{entry}/cmdline").read_bytes()
                ):
                    out.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
        return out

    def body(i: int) -> dict[str, object]:
        data = base64.b64encode(images[i % len(images)]).decode()
        return {
            "model": "efficientnet-lite0",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + data}}],
                }
            ],
        }

    async def run() -> None:
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200 and len(workers()) == 2:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(log_path.read_text()[-3000:])
            await asyncio.sleep(0.5)
        results: list[tuple[float, float, bool]] = []  # (ended at, latency, 200)
        stop = asyncio.Event()

        async def client(k: int) -> None:
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                i = k
                while not stop.is_set():
                    started = time.monotonic()
                    response = await c.post("/v1/chat/completions", json=body(i))
                    results.append((time.monotonic(), time.monotonic() - started, response.status_code == 200))
                    i += CLIENTS

        tasks = [asyncio.ensure_future(client(k)) for k in range(CLIENTS)]
        await asyncio.sleep(PHASE_S)
        victim = workers()[0]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        while victim in workers():
            await asyncio.sleep(0.1)
        killed = time.monotonic() - t0
        while not (len(workers()) == 2 and await asyncio.to_thread(metric, "shmgate_workers_ready") == 2):
            await asyncio.sleep(0.2)
        back = time.monotonic() - t0
        await asyncio.sleep(PHASE_S)
        stop.set()
        await asyncio.gather(*tasks)

        def p99(xs: list[float]) -> float:
            return sorted(xs)[int(len(xs) * 0.99)] if xs else 0.0

        before = [lat for end, lat, _ in results if end < t0]
        during = [lat for end, lat, _ in results if t0 <= end < t0 + back]
        after = [lat for end, lat, _ in results if end >= t0 + back]
        print(
            f"requests {len(results)}, failed {sum(not ok for *_, ok in results)}; stalled worker killed "
            f"{killed:.1f} s after SIGSTOP, full capacity after {back:.1f} s; p99 before {p99(before):.2f} s, "
            f"while wedged {p99(during):.2f} s, after {p99(after):.2f} s; "
            f"shmgate_worker_stalls_total {metric('shmgate_worker_stalls_total'):.0f}"
        )

    try:
        asyncio.run(run())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
