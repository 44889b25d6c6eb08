"""The gateway's own cost per request: shmgate ``--model checksum`` against the floors, in ratios.

On a GPU the model is cheap and the gateway's CPU per request is what bounds throughput; on a
2-core machine the model bounds it, so the model is taken out: ``--model checksum`` decodes,
preprocesses, writes the arena and sends the descriptor, and its worker digests the exact bytes.
It is measured against servers that do the same HTTP and image work without shmgate
(bench/floor_server.py):

* ``decode-floor``: uvicorn + msgspec + the same draft decode, resize and digest in a process pool;
* ``http-floor``: the same server without the image work (JSON in, an answer of the same size out);
* ``litserve``: LitServe with the same preprocessing and a null (checksum) predict, when
  bench/.venv-litserve exists (bench/setup_litserve.sh; ``--litserve-python`` or
  ``$SHMGATE_LITSERVE_PYTHON`` names one made elsewhere); skipped otherwise. Its "hit" load is the
  same image repeated: LitServe has no cache, so it decodes every time;
* ``shmgate-result-cache`` (not in the default list): hits answered from ``--result-cache-mb``,
  which skip the worker;
* ``shmgate-base`` and ``shmgate-base-result-cache`` (with ``--base DIR``): shmgate from another checkout, e.g. the commit before a cut,
  for an ABBA figure in the same run.

Each server is started, loaded at every concurrency with every request a cache miss (``--unique``)
and, for shmgate, with every request a tensor-cache hit (``--repeat-one``), then stopped. Server CPU
is all of the server's processes (the started pid and its descendants, from /proc, by
``bench_client.loadgen``). Rounds alternate the servers' order (A B C, C B A, ...), so a machine's
moods fall on all of them; the printed ratios are per round (median, and the range), not absolute
figures, which on a shared machine move with the neighbours' load.

Usage: ``python bench/gateway_cost.py [--quick] [--rounds K] [--requests N] [--concurrency 1 8 32]
[--server NAME ...] [--base DIR] [--json FILE]``. ``--quick`` is a smoke check (1 round, c=8, 48
requests). Exit status 1 when any request failed or answers disagreed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.e2e import IMAGES, LITSERVE_PYTHON, ServerProcess, free_port, render_table  # noqa: E402
from shmgate.bench_client import loadgen  # noqa: E402

MISS, HIT = "miss", "hit"


@dataclass(frozen=True)
class Server:
    """One server under test: how to start it and which loads it takes."""

    command: tuple[str, ...]  # {python}, {repo}, {port}, {litserve_python}, {base}, {bin}
    ready_path: str
    loads: tuple[str, ...]  # MISS (--unique) and/or HIT (--repeat-one)
    needs: Path | None = None


SHMGATE = ("{bin}/shmgate", "serve", "--host", "127.0.0.1", "--port", "{port}", "--model", "checksum")
FLOOR = ("{python}", "{repo}/bench/floor_server.py", "--port", "{port}")
SERVERS: dict[str, Server] = {
    "shmgate": Server(SHMGATE, "/ready", (MISS, HIT)),
    # Hits answered from the frontend's result cache: no worker, no arena (how near the floor a hit can get).
    "shmgate-result-cache": Server(SHMGATE + ("--result-cache-mb", "64"), "/ready", (HIT,)),
    "decode-floor": Server(FLOOR, "/health", (MISS,)),
    "http-floor": Server(FLOOR + ("--no-decode",), "/health", (MISS,)),
    "litserve": Server(
        ("{litserve_python}", "{repo}/bench/litserve_server.py", "--port", "{port}", "--mode", "checksum"),
        "/health",
        (MISS, HIT),
        needs=LITSERVE_PYTHON,
    ),
    # From the base checkout's directory: the frontends start with `python -m shmgate.gateway`, which looks in the cwd first.
    "shmgate-base": Server(
        (
            "sh",
            "-c",
            "cd {base} && PYTHONPATH={base} exec {bin}/shmgate serve --host 127.0.0.1 --port {port} --model checksum",
        ),
        "/ready",
        (MISS, HIT),
    ),
    "shmgate-base-result-cache": Server(
        (
            "sh",
            "-c",
            "cd {base} && PYTHONPATH={base} exec {bin}/shmgate serve "
            "--host 127.0.0.1 --port {port} --model checksum --result-cache-mb 64",
        ),
        "/ready",
        (HIT,),
    ),
}
DEFAULT_SERVERS = ["shmgate", "decode-floor", "http-floor", "litserve"]
# (numerator, denominator, what the ratio says): shmgate's cost over the least a Python server can do.
RATIOS = [
    (("shmgate", MISS), ("decode-floor", MISS), "shmgate miss / decode floor"),
    (("shmgate", HIT), ("http-floor", MISS), "shmgate hit / HTTP floor"),
    (("shmgate-result-cache", HIT), ("http-floor", MISS), "shmgate result-cache hit / HTTP floor"),
    (("litserve", MISS), ("shmgate", MISS), "LitServe / shmgate miss"),
    (("litserve", HIT), ("shmgate", HIT), "LitServe / shmgate repeated image (LitServe has no cache)"),
    (("shmgate", MISS), ("shmgate-base", MISS), "shmgate miss / base miss"),
    (("shmgate", HIT), ("shmgate-base", HIT), "shmgate hit / base hit"),
    (("shmgate-result-cache", HIT), ("shmgate-base-result-cache", HIT), "result-cache hit / base result-cache hit"),
]


def expand(
    command: tuple[str, ...], port: int, base: Path | None, litserve_python: Path = LITSERVE_PYTHON
) -> list[str]:
    values = {
        "python": sys.executable,
        "bin": str(Path(sys.executable).parent),
        "repo": str(REPO),
        "port": str(port),
        "litserve_python": str(litserve_python),
        "base": str(base),
    }
    return [part.format(**values) for part in command]


async def measure_server(
    name: str, server: Server, args: argparse.Namespace, images: Path, log_dir: Path, round_index: int
) -> list[dict[str, Any]]:
    """Start one server, run every load at every concurrency, stop it."""
    port = free_port()
    process = ServerProcess(
        expand(server.command, port, args.base, args.litserve_python), log_dir / f"{name}-{round_index}.log"
    )
    base_url = f"http://127.0.0.1:{port}"
    results = []
    process.start()
    try:
        await process.wait_ready(base_url + server.ready_path, 180.0)
        for load in server.loads:
            for concurrency in args.concurrency:
                parser = argparse.ArgumentParser()
                loadgen.add_arguments(parser)
                flag = "--unique" if load == MISS else "--repeat-one"
                before = role_cpu_ticks(process.pid)
                sleeps_before = worker_sleeps(process.pid)
                result = await loadgen.run(
                    parser.parse_args(
                        [
                            "--base-url",
                            base_url,
                            "--model",
                            "checksum",
                            "--concurrency",
                            str(concurrency),
                            "--requests",
                            str(args.requests),
                            "--images",
                            str(images),
                            "--server-pid",
                            str(process.pid),
                            "--no-stages",
                            flag,
                        ]
                    )
                )
                row = {
                    "server": name,
                    "load": load,
                    "round": round_index,
                    "concurrency": concurrency,
                    "requests_per_s": result["requests_per_s"],
                    "cpu_ms": result["cpu_s_per_request"] * 1000,
                    "p50_ms": result["p50_ms"],
                    "p99_ms": result["p99_ms"],
                    "errors": result["errors"],
                    "mismatches": result["mismatches"],
                    "other_load_cores": result["other_load_cores"],
                    "first_error": result["first_error"],
                }
                row.update(role_split(before, role_cpu_ticks(process.pid), row["cpu_ms"]))
                served = args.requests + min(concurrency, args.requests)  # the warm-up round counts here too
                row["worker_wakeups"] = round((worker_sleeps(process.pid) - sleeps_before) / served, 2)
                results.append(row)
                print(
                    f"  round {round_index + 1} {name:<13} {load:<4} c={concurrency:<3} "
                    f"{row['requests_per_s']:>8} req/s  {row['cpu_ms']:6.2f} ms CPU/req  "
                    f"errors {row['errors']}  other load {row['other_load_cores']} cores",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        process.stop()
    return results


def _role(pid: int) -> str:
    """What a server process is, from its command line: frontend, worker, pool or main."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    if b"frontend" in argv and b"gateway" in argv:
        return "frontend"
    if b"worker" in argv:
        return "worker"
    return "main" if b"serve" in argv or any(a.endswith(b".py") for a in argv) else "pool"


def role_cpu_ticks(root: int) -> dict[int, tuple[str, int]]:
    """Each live process of the server's tree: (role, CPU ticks so far)."""
    out: dict[int, tuple[str, int]] = {}
    for pid in loadgen.process_tree([root]):
        stat = loadgen._read_stat(pid)
        if stat is not None:
            out[pid] = (_role(pid), stat[1])
    return out


def worker_sleeps(root: int) -> int:
    """Voluntary context switches of every thread of the server's workers: how often they went to sleep.

    Each wake-up of a waiting thread ends in one, so their count per request says how often a worker
    woke, useful or not (a wake-up that finds its message taken by another worker costs CPU, not work).
    """
    total = 0
    for pid in loadgen.process_tree([root]):
        if _role(pid) != "worker":
            continue
        for status in Path(f"/proc/{pid}/task").glob("*/status"):
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches"):
                        total += int(line.split()[1])
            except OSError:
                continue  # a thread that ended meanwhile
    return total


def role_split(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], cpu_ms: float) -> dict[str, Any]:
    """The point's CPU per request by role (shares of the /proc deltas, warm-up included, scaled to
    ``cpu_ms``), and how unevenly the frontends shared theirs (the busiest one's share)."""
    deltas: dict[str, float] = {}
    frontends: list[float] = []
    for pid, (role, ticks) in after.items():
        delta = ticks - before.get(pid, (role, 0))[1]
        deltas[role] = deltas.get(role, 0.0) + delta
        if role == "frontend":
            frontends.append(delta)
    total = sum(deltas.values())
    split: dict[str, Any] = {
        f"{role}_ms": round(cpu_ms * d / total, 3) if total else None for role, d in deltas.items()
    }
    if len(frontends) > 1 and sum(frontends):
        split["busiest_frontend_share"] = round(max(frontends) / sum(frontends), 3)
    return split


async def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    names = [n for n in args.server if runnable(n, args)]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="shmgate-cost-") as tmp:
        images = Path(tmp) / "images"
        images.mkdir()
        for image in IMAGES:  # 1024 px photos only
            (images / image.name).symlink_to(image)
        for round_index in range(args.rounds):
            order = names if round_index % 2 == 0 else names[::-1]
            for name in order:
                try:
                    results += await measure_server(name, SERVERS[name], args, images, Path(tmp), round_index)
                except (RuntimeError, loadgen.BenchAborted) as exc:
                    print(f"{name} failed: {exc}", file=sys.stderr)
                    results.append({"server": name, "failed": str(exc)[:500], "round": round_index})
    return results


def parse_variant(spec: str, taken: Collection[str]) -> tuple[str, tuple[str, ...]]:
    """``--variant NAME=FLAGS``: the new server's name and its extra serve flags (also bench/wrk_tail.py's)."""
    name, sep, flags = spec.partition("=")
    if not sep or not name or name in taken:
        raise SystemExit(f"--variant {spec!r}: give NAME=FLAGS with a new NAME")
    return name, tuple(shlex.split(flags))


def add_variant(spec: str) -> None:
    """``NAME=FLAGS``: shmgate with extra serve flags as one more server, compared with plain shmgate."""
    name, flags = parse_variant(spec, SERVERS)
    SERVERS[name] = Server(SHMGATE + flags, "/ready", (MISS, HIT))
    RATIOS.append(((name, MISS), ("shmgate", MISS), f"{name} miss / shmgate miss"))
    RATIOS.append(((name, MISS), ("decode-floor", MISS), f"{name} miss / decode floor"))
    RATIOS.append(((name, HIT), ("shmgate", HIT), f"{name} hit / shmgate hit"))


def runnable(name: str, args: argparse.Namespace) -> bool:
    if name not in SERVERS:
        print(f"skipping {name}: not a server (give it with --variant {name}=FLAGS)", file=sys.stderr)
        return False
    server = SERVERS[name]
    if name.startswith("shmgate-base") and args.base is None:
        print(f"skipping {name}: give --base DIR (a checkout of the commit to compare with)", file=sys.stderr)
        return False
    needs = args.litserve_python if server.needs == LITSERVE_PYTHON else server.needs
    if needs is not None and not needs.exists():
        print(
            f"skipping {name}: {needs} is missing (run bench/setup_litserve.sh, or give --litserve-python)",
            file=sys.stderr,
        )
        return False
    return True


def _cell(values: list[float], digits: int = 2) -> str:
    """Median, with the range when there are several rounds."""
    if not values:
        return "-"
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.{digits}f}"
    return f"{median:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def tables(results: list[dict[str, Any]], concurrencies: list[int]) -> str:
    """The absolute table (median over rounds) and the ratio table (per-round ratios, median and range)."""
    rows = [r for r in results if "failed" not in r]
    by_key: dict[tuple[str, str, int], dict[int, dict[str, Any]]] = {}
    for r in rows:
        by_key.setdefault((r["server"], r["load"], r["concurrency"]), {})[r["round"]] = r
    absolute = []
    for (server, load, c), rounds in by_key.items():
        absolute.append(
            [
                server,
                load,
                c,
                _cell([r["cpu_ms"] for r in rounds.values()]),
                _cell([r["requests_per_s"] for r in rounds.values()], 1),
                _cell([r["p99_ms"] / r["p50_ms"] for r in rounds.values() if r["p50_ms"]]),
                _cell([r["other_load_cores"] or 0.0 for r in rounds.values()], 2),
            ]
        )
    out = [
        render_table(
            ["server", "requests", "c", "server CPU ms/req", "req/s", "p99/p50", "other load (cores)"], absolute, left=2
        )
    ]
    ratio_rows = []
    for num, den, label in RATIOS:
        cpu_cells, rps_cells = [], []
        for c in concurrencies:
            a, b = by_key.get((*num, c), {}), by_key.get((*den, c), {})
            shared = sorted(set(a) & set(b))
            cpu_cells.append(_cell([a[i]["cpu_ms"] / b[i]["cpu_ms"] for i in shared if b[i]["cpu_ms"]]))
            rps_cells.append(
                _cell([a[i]["requests_per_s"] / b[i]["requests_per_s"] for i in shared if b[i]["requests_per_s"]])
            )
        if any(cell != "-" for cell in cpu_cells):
            ratio_rows.append([label, *cpu_cells, *rps_cells])
    columns = ["ratio", *(f"CPU/req c={c}" for c in concurrencies), *(f"req/s c={c}" for c in concurrencies)]
    if ratio_rows:
        out.append(render_table(columns, ratio_rows))
    split_rows = []
    for (server, load, c), rounds in by_key.items():
        if any("frontend_ms" in r for r in rounds.values()):
            split_rows.append(
                [
                    server,
                    load,
                    c,
                    *(
                        _cell([r.get(k) or 0.0 for r in rounds.values()])
                        for k in ("frontend_ms", "worker_ms", "main_ms")
                    ),
                    _cell([r.get("busiest_frontend_share") or 0.0 for r in rounds.values()]),
                    _cell([r.get("worker_wakeups") or 0.0 for r in rounds.values()]),
                ]
            )
    if split_rows:
        out.append(
            render_table(
                [
                    "server",
                    "requests",
                    "c",
                    "frontends ms/req",
                    "workers ms/req",
                    "supervisor ms/req",
                    "busiest frontend's share",
                    "worker sleeps/req",
                ],
                split_rows,
                left=2,
            )
        )
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--server",
        action="append",
        help=f"repeatable, one of {', '.join(sorted(SERVERS))} or a --variant's NAME, "
        f", in this order; default: {', '.join(DEFAULT_SERVERS)} (+ shmgate-base with --base)",
    )
    # A venv made once serves every checkout: worktrees need not each run bench/setup_litserve.sh.
    parser.add_argument(
        "--litserve-python",
        type=Path,
        default=Path(os.environ.get("SHMGATE_LITSERVE_PYTHON", LITSERVE_PYTHON)),
        help="the LitServe venv's python (default: $SHMGATE_LITSERVE_PYTHON, else bench/.venv-litserve/bin/python)",
    )
    parser.add_argument("--base", type=Path, default=None, help="a checkout to run as shmgate-base")
    parser.add_argument("--rounds", type=int, default=None, help="alternated rounds (default 4; --quick: 1)")
    parser.add_argument("--requests", type=int, default=None, help="timed requests per point (default 400)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="default: 1 8 32")
    parser.add_argument("--quick", action="store_true", help="a smoke check: 1 round, c=8, 48 requests")
    parser.add_argument("--json", type=Path, default=None, help="also write every measured point as JSON lines")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="repeatable: also run `shmgate serve --model checksum FLAGS` as server NAME (e.g. "
        "'one-frontend=--frontends 1'), with its ratios to shmgate",
    )
    args = parser.parse_args(argv)
    for spec in args.variant:
        add_variant(spec)
    if args.base is not None:
        args.base = args.base.resolve()
    args.server = args.server or DEFAULT_SERVERS + (["shmgate-base"] if args.base else [])
    args.rounds = args.rounds or (1 if args.quick else 4)
    args.requests = args.requests or (48 if args.quick else 400)
    args.concurrency = args.concurrency or ([8] if args.quick else [1, 8, 32])
    started = time.monotonic()
    results = asyncio.run(run_all(args))
    if args.json is not None:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in results))
    print(tables(results, args.concurrency))
    print(
        f"\n{args.rounds} round(s), {args.requests} requests per point, 1024 px photos, "
        f"{time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    failed = [r for r in results if "failed" in r or r["errors"] or r["mismatches"]]
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
