"""A reproducible background CPU load: "the machine is shared", on demand.

Why: the latency tail of a server on a small machine depends on what else runs there, and a
benchmark that only ever runs on a quiet machine says nothing about that. ``Disturbance(cores)``
starts processes of our own that spin for that many cores' worth of CPU (``floor(cores)``
processes spinning all the time, plus one spinning the fractional rest by duty cycle: busy for
``duty x 10 ms`` of every 10 ms), each in its own session, and stops them (SIGKILL to each process
group, then a wait) when the ``with`` block ends, whatever happened inside it.

Run alone: ``python -m shmgate.bench_client.disturb --cores 1 --seconds 30`` (stops by itself).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import time
from types import TracebackType

__all__ = ["Disturbance", "spin"]

PERIOD_S = 0.01  # one duty cycle: short enough that the load looks continuous to a scheduler


def spin(duty: float, seconds: float) -> None:
    """Burn ``duty`` of one core for ``seconds`` (busy loop, then sleep, every PERIOD_S)."""
    end = time.monotonic() + seconds
    while (now := time.monotonic()) < end:
        busy_until = now + PERIOD_S * duty
        while time.monotonic() < busy_until:
            pass
        if duty < 1.0:
            time.sleep(PERIOD_S * (1.0 - duty))


def duties(cores: float) -> list[float]:
    """The duty cycle of each process for ``cores`` cores: ones, then the fraction (if any)."""
    if cores < 0:
        raise ValueError("--background-cores must be >= 0")
    whole = math.floor(cores)
    rest = round(cores - whole, 3)
    return [1.0] * whole + ([rest] if rest > 0 else [])


class Disturbance:
    """Spinning processes worth ``cores`` cores while the ``with`` block runs (none for 0)."""

    def __init__(self, cores: float, *, max_seconds: float = 3600.0) -> None:
        self.cores = cores
        self.max_seconds = max_seconds  # each spinner stops by itself after this, even if we die
        self.processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Disturbance:
        try:
            for duty in duties(self.cores):
                self.processes.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            os.path.abspath(__file__),
                            "--duty",
                            str(duty),
                            "--seconds",
                            str(self.max_seconds),
                        ],
                        start_new_session=True,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def stop(self) -> None:
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for process in self.processes:
            process.wait()
        self.processes = []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duty", type=float, default=None, help="one spinner: its duty cycle (0-1)")
    parser.add_argument("--cores", type=float, default=None, help="spinners worth this many cores")
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    if args.duty is not None:
        spin(min(1.0, max(0.0, args.duty)), args.seconds)
        return 0
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # `kill` stops the spinners too
    with Disturbance(args.cores or 1.0, max_seconds=args.seconds + 5):
        time.sleep(args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
