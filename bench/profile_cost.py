"""Where a loaded shmgate ``--model checksum`` spends its CPU, by process role, from py-spy.

The gateway-cost table (bench/gateway_cost.py) says how much CPU a request costs; this says where.
It starts ``shmgate serve --model checksum``, loads it with bench_client.loadgen (misses or
tensor-cache hits), and meanwhile runs ``py-spy record`` on one frontend and one worker (``--role``),
then prints each profile's top frames by own samples (the leaf: where the CPU was when sampled)
and by inclusive samples (a function and what it called). py-spy leaves out idle samples by
default, so a thread asleep in a wait does not count; a wake-up that finds nothing to do does.

Usage: ``python bench/profile_cost.py [--load miss|hit] [--concurrency 8] [--seconds 15]
[--role frontend worker] [--top 25] [--svg DIR]``. Needs py-spy (``pip install py-spy``) and
permission to ptrace the server (root, or ``kernel.yama.ptrace_scope = 0``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.e2e import IMAGES, ServerProcess, free_port  # noqa: E402
from bench.gateway_cost import _role  # noqa: E402
from shmgate.bench_client import loadgen  # noqa: E402


def summarize(collapsed: Path, top: int) -> str:
    """Top frames of a py-spy ``--format raw`` (collapsed stacks) file: own and inclusive shares."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [
            frame.split(" (")[0] + " " + frame.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1]
            for frame in stack.split(";")[1:]
        ]  # [0] is the thread
        if frames:
            own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    if not total:
        return "  (no samples)"
    lines = [f"  {total} samples"]
    lines += ["  own:"] + [f"    {100 * n / total:5.1f} %  {name}" for name, n in own.most_common(top)]
    lines += ["  inclusive:"] + [f"    {100 * n / total:5.1f} %  {name}" for name, n in inclusive.most_common(top)]
    return "\n".join(lines)


async def load(base_url: str, images: Path, flag: str, concurrency: int, seconds: float, pid: int) -> None:
    parser = argparse.ArgumentParser()
    loadgen.add_arguments(parser)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        await loadgen.run(
            parser.parse_args(
                [
                    "--base-url",
                    base_url,
                    "--model",
                    "checksum",
                    "--concurrency",
                    str(concurrency),
                    "--requests",
                    str(max(concurrency * 20, 200)),
                    "--images",
                    str(images),
                    "--server-pid",
                    str(pid),
                    "--no-stages",
                    flag,
                ]
            )
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", choices=["miss", "hit"], default="hit")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=15.0, help="how long py-spy samples")
    parser.add_argument("--role", nargs="+", default=["frontend", "worker"], choices=["frontend", "worker"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--svg", type=Path, default=None, help="also write a flame graph per role here")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra `shmgate serve` argument")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        print("py-spy is missing: pip install py-spy", file=sys.stderr)
        return 2
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="shmgate-profile-") as tmp:
        images = Path(tmp) / "images"
        images.mkdir()
        for image in IMAGES:
            (images / image.name).symlink_to(image)
        command = [
            str(Path(sys.executable).parent / "shmgate"),
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            "checksum",
            *args.serve_arg,
        ]
        server = ServerProcess(command, Path(tmp) / "server.log")
        server.start()
        try:
            asyncio.run(server.wait_ready(f"http://127.0.0.1:{port}/ready", 180.0))
            pids = {role: [p for p in loadgen.process_tree([server.pid]) if _role(p) == role] for role in args.role}
            flag = "--unique" if args.load == "miss" else "--repeat-one"
            records = []
            for role in args.role:
                if not pids[role]:
                    print(f"no {role} process found", file=sys.stderr)
                    return 1
                out = Path(tmp) / f"{role}.txt"
                records.append(
                    (
                        role,
                        pids[role][0],
                        out,
                        subprocess.Popen(
                            [
                                py_spy,
                                "record",
                                "--pid",
                                str(pids[role][0]),
                                "--duration",
                                str(int(args.seconds)),
                                "--rate",
                                "200",
                                "--format",
                                "raw",
                                "--output",
                                str(out),
                                "--nonblocking",
                            ],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        ),
                    )
                )
            asyncio.run(load(f"http://127.0.0.1:{port}", images, flag, args.concurrency, args.seconds + 3, server.pid))
            for role, pid, out, spy in records:
                spy.wait(60)
                print(f"{role} pid {pid}, {args.load} load at c={args.concurrency}:")
                print(summarize(out, args.top) if out.exists() else "  (py-spy wrote nothing)")
                if args.svg is not None:
                    args.svg.mkdir(parents=True, exist_ok=True)
                    shutil.copy(out, args.svg / f"{role}-{args.load}.txt")
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
