"""Why a worker's speed moves from one start to the next: the model alone, started afresh under conditions
that each take one suspect away.

    .venv/bin/python bench/start_spread.py [--starts 6] [--passes 100] [--pads 0 1024 2048 3072] [--json]

Each start is a fresh process that loads the served model (EfficientNet-Lite0, one torch thread, huge
pages as worker/__main__.py sets them), warms it up and reports its CPU ms per forward pass of 2 images
(bench/cpu_passes.py's inputs). The conditions, alternated start by start so they share the machine's
moods:

- ``aslr``: as a worker starts (the kernel randomizes where the stack, the heap and every library land);
- ``fixed``: the same with address-space randomization off (``setarch -R``): every start of one
  environment lays out its memory alike;
- ``fixed+pad N``: randomization off and the environment N bytes longer (one variable), which moves
  the stack and what is placed after it, as a longer checkout path or another variable does;
- ``pinned``: randomization on, the process pinned to one core (``taskset``): CPU placement taken away.

If the spread is where memory lands, ``fixed`` is tight, the ``fixed+pad`` conditions differ from each
other, and ``aslr`` spans them; if it is CPU placement, ``pinned`` is tight.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def measure(passes: int) -> dict[str, float]:
    """This process's CPU ms per pass (after a warm-up) and its huge pages, as bench/huge_pages.py measures."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch: as worker/__main__.py does
    from bench.huge_pages import measure as measure_passes

    return measure_passes(passes)


def conditions(pads: list[int]) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, command prefix, extra environment) of each condition."""
    out: list[tuple[str, list[str], dict[str, str]]] = [("aslr", [], {})]
    for pad in pads:
        out.append((f"fixed+pad {pad}" if pad else "fixed", ["setarch", "-R"], {"SHMGATE_BENCH_PAD": "x" * pad}))
    out.append(("pinned", ["taskset", "-c", "1"], {}))
    return out


def run_start(prefix: list[str], extra: dict[str, str], passes: int) -> dict[str, float]:
    env = dict(os.environ, **extra)
    out = subprocess.run(
        [*prefix, sys.executable, __file__, "--child", str(passes)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        check=True,
    ).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=6, help="starts per condition, alternated")
    parser.add_argument("--passes", type=int, default=100)
    parser.add_argument("--pads", type=int, nargs="+", default=[0, 1024, 2048, 3072])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return
    for tool in ("setarch", "taskset"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is needed (util-linux)")
    plan = conditions(args.pads)
    results: dict[str, list[float]] = {name: [] for name, _, _ in plan}
    huge: list[tuple[float, float]] = []  # (AnonHugePages KiB, CPU ms per pass) of every start
    for number in range(1, args.starts + 1):
        for name, prefix, extra in plan:
            row = run_start(prefix, extra, args.passes)
            results[name].append(row["cpu_ms"])
            huge.append((row["huge_kib"], row["cpu_ms"]))
            line = {"start": number, "condition": name, **row, "load": os.getloadavg()[0]}
            text = f"  start {number} {name:<16} {row['cpu_ms']:7.2f} ms/pass  huge pages {row['huge_kib']} KiB"
            print(json.dumps(line) if args.json else text, flush=True)
    print("\n| condition | starts | CPU ms per pass: median | min-max | max/min |")
    print("|---|---:|---:|---:|---:|")
    for name, values in results.items():
        low, high = min(values), max(values)
        print(f"| {name} | {len(values)} | {statistics.median(values):.2f} | {low:.2f}-{high:.2f} | {high / low:.2f} |")
    if len({h for h, _ in huge}) > 1:
        r = statistics.correlation([h for h, _ in huge], [c for _, c in huge])
        print(f"\nhuge pages per start: {min(h for h, _ in huge):.0f}-{max(h for h, _ in huge):.0f} KiB; "
              f"correlation with CPU per pass {r:+.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
