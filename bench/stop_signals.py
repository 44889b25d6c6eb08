"""How ``shmgate serve`` ends when its whole process group is signalled, as a terminal's Ctrl-C does.

    python bench/stop_signals.py                  # 6 tries of SIGINT to the group
    python bench/stop_signals.py SIGTERM 3        # 3 tries of `kill -TERM -PGID`

Each try starts ``shmgate serve --model checksum --frontends 2 --workers 1`` as the leader of its own
process group, waits for /ready, signals the group and prints the exit status, the seconds from the
signal to the exit, and how many "Traceback" and "restarting" lines the output has. Figures:
docs/RELIABILITY.md (the Ctrl-C row).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_try(signum: int) -> tuple[int, float, str]:
    """(exit status, seconds from the signal to the exit, the server's output)."""
    port = _free_port()
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
            "2",
            "--workers",
            "1",
            "--arena-size",
            "64MiB",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    started = time.monotonic()
    if process.poll() is None:
        os.killpg(process.pid, signum)
    out, _ = process.communicate(timeout=120)
    return process.returncode, time.monotonic() - started, out.decode(errors="replace")


def main() -> None:
    signum = signal.Signals[sys.argv[1]] if len(sys.argv) > 1 else signal.SIGINT
    tries = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    for i in range(tries):
        code, took_s, out = one_try(signum)
        print(
            f"{signum.name} try {i + 1}: exit {code} after {took_s:.1f} s, "
            f"{out.count('Traceback')} Traceback, {out.count('restarting')} restarting",
            flush=True,
        )


if __name__ == "__main__":
    main()
