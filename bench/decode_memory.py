"""What one upload costs a frontend in memory, and what an ordinary photo costs in decode time.

    .venv/bin/python bench/decode_memory.py [--root DIR ...] [--rounds N]

Why: a 75 KB 16-bit grayscale PNG of 6300 x 6300 zeros (tests/decode_samples.py ``attack_png``) is
under the 40 M pixel cap, and decoding it once took a frontend from ~144 to ~875 MiB. For each code
root (default: this checkout; pass ``--root /path/to/other/checkout`` too for a before/after), this
starts a real ``shmgate serve --model checksum --frontends 1`` from that root and reports the
frontend's peak RSS (VmHWM, reset with /proc/PID/clear_refs before each case) over its resting RSS
for one request with 1 and with 4 distinct attack images, at the default ``--max-pixels`` and at
``--max-pixels 60000000`` (which lets the image through the pixel check, so the decode itself is
measured), and the answer's status; and the time a neighbour's ordinary photo takes beside two such
requests. It then times ``decode`` of the 1024 px test JPEG in-process (full decode, the
classifier's drafted preprocess, and the header-only ``predict`` a frontend now adds; median thread
CPU time of --rounds) under each root.
The machine may be shared: read memory as exact, times as ratios between roots.
"""

from __future__ import annotations

import argparse
import base64
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.decode_samples import attack_png  # noqa: E402
from tests.serving import free_port  # noqa: E402

PHOTO = REPO / "tests" / "data" / "images" / "chelsea_1024.jpg"

TIMING_CHILD = """
import statistics, sys, time
from pathlib import Path
from shmgate.gateway.imaging import decode
from shmgate.gateway.preprocess.vision import ChecksumPreprocessor
data = Path(sys.argv[1]).read_bytes()
rounds = int(sys.argv[2])
pre = ChecksumPreprocessor()
out = {}
def alloc(name, dtype, shape):
    import numpy as np
    out[name] = np.empty(shape, dtype)
    return out[name]
def median_ms(fn):
    # CPU time of this thread: the machine is shared, and wall time mostly measures the neighbours.
    fn()
    times = []
    for _ in range(rounds):
        t = time.thread_time(); fn(); times.append(time.thread_time() - t)
    return statistics.median(times) * 1e3
full = median_ms(lambda: decode(data, max_pixels=40_000_000))
drafted = median_ms(lambda: pre.preprocess_image(data, alloc, max_pixels=40_000_000))
try:
    from shmgate.gateway.imaging import predict
    header = median_ms(lambda: predict(data, max_pixels=40_000_000))
except ImportError:
    header = float("nan")
print(f"{full:.3f} {drafted:.3f} {header:.3f}")
"""


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def _frontend_pid(supervisor: int) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == supervisor and b"frontend" in cmd:
            return int(entry)
    raise RuntimeError("no frontend child")


def _request(images: list[bytes]) -> dict[str, object]:
    parts: list[dict[str, object]] = [{"type": "text", "text": "x"}]
    for data in images:
        parts.append(
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}
        )
    return {"model": "checksum", "messages": [{"role": "user", "content": parts}]}


def serve_cases(root: Path, max_pixels: int | None) -> list[tuple[str, float, int]]:
    """(case, peak MiB over rest, status) for 1 and 4 attack images in one request."""
    port = free_port()
    extra = ["--max-pixels", str(max_pixels)] if max_pixels else []
    log = tempfile.NamedTemporaryFile(prefix="decode-memory-", suffix=".log", delete=False)
    server = subprocess.Popen(
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
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"server from {root} did not start; see {log.name}")
            time.sleep(0.3)
        frontend = _frontend_pid(server.pid)
        for count in (1, 4):
            images = [attack_png(6300 - i) for i in range(count)]
            rest = _kib(frontend, "VmRSS")
            Path(f"/proc/{frontend}/clear_refs").write_text("5")
            response = httpx.post(url + "/v1/chat/completions", json=_request(images), timeout=300)
            peak = _kib(frontend, "VmHWM")
            rows.append((f"{count} attack image{'s' if count > 1 else ''}", (peak - rest) / 1024, response.status_code))
            time.sleep(1)
        # A neighbour's photo while two 4-image attack requests run.
        photo = _request([PHOTO.read_bytes()])
        with ThreadPoolExecutor(3) as pool:
            attacks = [
                pool.submit(
                    httpx.post,
                    url + "/v1/chat/completions",
                    json=_request([attack_png(6290 - 4 * j - i) for i in range(4)]),
                    timeout=300,
                )
                for j in range(2)
            ]
            time.sleep(0.2)
            started = time.perf_counter()
            answer = httpx.post(url + "/v1/chat/completions", json=photo, timeout=300)
            rows.append(("photo beside 2 x 4 attack images (s)", time.perf_counter() - started, answer.status_code))
            for a in attacks:
                a.result()
    finally:
        server.terminate()
        server.wait(60)
    return rows


def decode_times(root: Path, rounds: int) -> tuple[float, float, float]:
    out = subprocess.run(
        [sys.executable, "-c", TIMING_CHILD, str(PHOTO), str(rounds)],
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    full, drafted, header = map(float, out.stdout.split())
    return full, drafted, header


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", action="append", type=Path, help="a checkout to measure (repeatable)")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    roots: list[Path] = args.root or [REPO]
    print(f"attack image: 6300x6300 16-bit gray PNG, {len(attack_png(6300))} bytes")
    print(f"{'root':28s} {'--max-pixels':>12s} {'case':40s} {'peak MiB / s':>12s} {'status':>6s}")
    for root in roots:
        for max_pixels in (None, 60_000_000):
            for case, value, status in serve_cases(root, max_pixels):
                print(
                    f"{str(root)[-28:]:28s} {max_pixels or 'default':>12} {case:40s} {value:12.2f} {status:6d}",
                    flush=True,
                )
    print(f"\n1024 px JPEG ({PHOTO.name}), median thread CPU time of {args.rounds}:")
    print(f"{'root':28s} {'decode ms':>10s} {'drafted preprocess ms':>22s} {'header predict ms':>18s}")
    for root in roots:
        full, drafted, header = decode_times(root, args.rounds)
        print(f"{str(root)[-28:]:28s} {full:10.2f} {drafted:22.2f} {header:18.3f}", flush=True)


if __name__ == "__main__":
    main()
