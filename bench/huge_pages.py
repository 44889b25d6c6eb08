"""EfficientNet-Lite0 on CPU with and without transparent huge pages for torch's large tensors.

    .venv/bin/python bench/huge_pages.py [--starts N] [--passes P] [--processes 1|2] [--json]

Each start is a fresh process (or two side by side, as the default CPU layout runs two workers of
one torch thread) that loads the served model, warms it up, then runs P forward passes of 2 images
(the CPU worker's pass) and reports the process's CPU ms per pass, its anonymous huge pages and
its resident set (what the huge pages cost in memory).
Starts alternate ``THP_MEM_ALLOC_ENABLE=0`` and ``=1`` (what worker/__main__.py sets unless told
otherwise), so both settings share the machine's moods; each start places memory afresh, so the
spread from start to start shows too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.cpu_passes import backend_and_pixels, children_side_by_side  # noqa: E402

IMAGES_PER_PASS = 2


def memory_kib() -> dict[str, int]:
    """This process's anonymous huge pages and resident set, in KiB (/proc/self/smaps_rollup)."""
    fields = {"AnonHugePages:": "huge_kib", "Rss:": "rss_kib"}
    found = {}
    with open("/proc/self/smaps_rollup") as smaps:
        for line in smaps:
            name = line.split(maxsplit=1)[0]
            if name in fields:
                found[fields[name]] = int(line.split()[1])
    return found


def measure(passes: int) -> dict[str, float]:
    """CPU and wall ms per pass of this process, and its memory (``memory_kib``)."""
    backend, pixels = backend_and_pixels(IMAGES_PER_PASS)
    for _ in range(20):
        backend.classify(pixels)  # warm-up
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(passes):
        backend.classify(pixels)
    cpu_ms = (time.process_time() - cpu) / passes * 1000
    wall_ms = (time.perf_counter() - wall) / passes * 1000
    return {"cpu_ms": round(cpu_ms, 2), "wall_ms": round(wall_ms, 2), **memory_kib()}


def start(thp: str, processes: int, passes: int) -> list[dict[str, float]]:
    """``processes`` fresh processes measuring side by side with THP_MEM_ALLOC_ENABLE=``thp``."""
    env = dict(os.environ, THP_MEM_ALLOC_ENABLE=thp)
    return [json.loads(out) for out in children_side_by_side(__file__, [str(passes)], processes, env)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=6, help="starts per setting, alternated")
    parser.add_argument("--passes", type=int, default=300)
    parser.add_argument("--processes", type=int, default=1, choices=(1, 2))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    cpu: dict[str, list[float]] = {"0": [], "1": []}
    if not args.json:
        print("| start | THP_MEM_ALLOC_ENABLE | CPU ms per pass | wall ms per pass | AnonHugePages KiB | RSS KiB |")
        print("|---:|---:|---:|---:|---:|---:|")
    for number in range(1, args.starts + 1):
        for thp in ("0", "1"):
            for row in start(thp, args.processes, args.passes):
                cpu[thp].append(row["cpu_ms"])
                if args.json:
                    print(json.dumps({"start": number, "thp": int(thp), **row}), flush=True)
                else:
                    print(
                        f"| {number} | {thp} | {row['cpu_ms']} | {row['wall_ms']} | {row['huge_kib']} | {row['rss_kib']} |",
                        flush=True,
                    )
    off, on = round(statistics.median(cpu["0"]), 2), round(statistics.median(cpu["1"]), 2)
    summary = {
        "median_cpu_ms_off": off,
        "median_cpu_ms_on": on,
        "ratio_off_to_on": round(off / on, 2),
        "range_off": [min(cpu["0"]), max(cpu["0"])],
        "range_on": [min(cpu["1"]), max(cpu["1"])],
    }
    print(
        json.dumps(summary)
        if args.json
        else f"\nmedian CPU ms per pass: off {off}, on {on}, off/on {summary['ratio_off_to_on']}"
    )


if __name__ == "__main__":
    main()
