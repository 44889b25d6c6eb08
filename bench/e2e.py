"""Side-by-side end-to-end benchmark: shmgate against the naive baseline and LitServe.

For each selected scenario this starts the server under test as a subprocess on a free loopback
port, waits until it answers its readiness path, drives it with ``bench_client.loadgen.run`` at each
concurrency (1, 8, 32 by default) on the 1024 px test photos, then stops it. Results print as a
markdown table (and JSON lines with ``--json``).

Invariants: every server is started in its own session and stopped as a process group (SIGTERM,
then SIGKILL after a grace period), in a ``finally``, so no worker a server forked outlives the
run. Only 127.0.0.1 is ever contacted. Each load run is bounded by its request count and the
load generator's per-request timeout.

The command lines live in ``SCENARIOS``, a plain table, so they can be adjusted as the shmgate CLI
changes. Placeholders: ``{python}`` (this interpreter), ``{bin}`` (its bin folder), ``{repo}``,
``{port}``, ``{litserve_python}``, ``{base}`` (``SHMGATE_BENCH_BASE``).

Shared-machine and open-loop figures: ``--background-cores X`` runs spinning processes
of our own worth X cores (bench/disturb.py) during each measured run, started and stopped around
it; ``--open-loop 50 80 95`` then drives each server with Poisson arrivals (``shmgate bench --rate``)
at those percentages of the capacity it just measured closed-loop (its req/s at the last
concurrency), and ``--plot FILE`` draws p50/p99 against offered load. ``--rounds K`` repeats the
scenario list K times, alternating the servers, so a before/after pair shares the machine's moods.

Usage: ``python bench/e2e.py [--quick] [--scenario NAME ...] [--embeddings] [--stream] [--json] [--out FILE]
[--background-cores X] [--open-loop PCT ...] [--plot FILE] [--rounds K]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.disturb import Disturbance  # noqa: E402
from shmgate.bench_client import loadgen  # noqa: E402

LITSERVE_PYTHON = REPO / "bench" / ".venv-litserve" / "bin" / "python"
# An earlier checkout to compare with in the same run (scenario shmgate-base), e.g.
# `git worktree add --detach /tmp/base <commit>`, then SHMGATE_BENCH_BASE=/tmp/base. Its code runs on
# this environment's packages (PYTHONPATH puts it before the editable install).
BASE_TREE = Path(os.environ.get("SHMGATE_BENCH_BASE", "/nonexistent-base-tree"))
IMAGES = sorted((REPO / "tests" / "data" / "images").glob("*_1024.jpg"))


@dataclass(frozen=True)
class Scenario:
    """One server under test and how to load it."""

    command: tuple[str, ...]  # with placeholders, see the module docstring
    model: str  # the model id the load generator sends
    ready_path: str = "/health"  # GET that answers 200 once the server can serve
    bench_flags: tuple[str, ...] = ("--unique",)  # distinct bytes per request: no cache hits
    needs: Path | None = None  # a file that must exist for the scenario to run
    ready_timeout_s: float = 180.0


NAIVE = ("{python}", "{repo}/bench/naive_server.py", "--port", "{port}")
LITSERVE = ("{litserve_python}", "{repo}/bench/litserve_server.py", "--port", "{port}")
SHMGATE = ("{bin}/shmgate", "serve", "--host", "127.0.0.1", "--port", "{port}", "--server-timing")
SCENARIOS: dict[str, Scenario] = {
    "naive-checksum": Scenario(NAIVE + ("--mode", "checksum"), "checksum"),
    "naive-efficientnet": Scenario(NAIVE + ("--mode", "efficientnet"), "efficientnet-lite0"),
    "litserve": Scenario(LITSERVE, "efficientnet-lite0", needs=LITSERVE_PYTHON),
    "litserve-checksum": Scenario(LITSERVE + ("--mode", "checksum"), "checksum", needs=LITSERVE_PYTHON),
    "shmgate-checksum": Scenario(SHMGATE + ("--model", "checksum"), "checksum", ready_path="/ready"),
    "shmgate-checksum-cached": Scenario(
        SHMGATE + ("--model", "checksum"), "checksum", ready_path="/ready", bench_flags=("--repeat-one",)
    ),
    "shmgate-efficientnet": Scenario(
        SHMGATE + ("--model", "efficientnet-lite0"), "efficientnet-lite0", ready_path="/ready"
    ),
    # The other batch policy (shared/flags.py --batch-policy; the default is held), for alternated
    # runs on one build.
    "shmgate-efficientnet-fcfs": Scenario(
        SHMGATE + ("--model", "efficientnet-lite0", "--batch-policy", "fcfs"), "efficientnet-lite0", ready_path="/ready"
    ),
    # Batches of 8 requests, the old default (now one forward pass on CPU: 2 per torch
    # thread), for alternated before/after runs on one build.
    "shmgate-efficientnet-b8": Scenario(
        SHMGATE + ("--model", "efficientnet-lite0", "--max-batch-size", "8"), "efficientnet-lite0", ready_path="/ready"
    ),
    # The same default command on the checkout in SHMGATE_BENCH_BASE (before/after in one run).
    # (From the base directory: the frontends start with `python -m shmgate.gateway`, which looks in the cwd first.)
    "shmgate-base": Scenario(
        (
            "sh",
            "-c",
            "cd {base} && PYTHONPATH={base} exec {bin}/shmgate serve --host 127.0.0.1 "
            "--port {port} --model efficientnet-lite0",
        ),
        "efficientnet-lite0",
        ready_path="/ready",
        needs=BASE_TREE / "gateway" / "cli.py",
    ),
    # The default on CPU is 2 workers splitting the cores (LitServe's best layout on 2 cores, too);
    # this is the other choice, one worker with every core.
    "shmgate-efficientnet-1w": Scenario(
        SHMGATE + ("--model", "efficientnet-lite0", "--workers", "1"), "efficientnet-lite0", ready_path="/ready"
    ),
    # Huge pages for torch's large tensors (worker/__main__.py turns them on by default): without
    # them in our workers, and with them in LitServe's, for alternated runs on one build.
    "shmgate-efficientnet-nothp": Scenario(
        ("env", "THP_MEM_ALLOC_ENABLE=0") + SHMGATE + ("--model", "efficientnet-lite0"),
        "efficientnet-lite0",
        ready_path="/ready",
    ),
    "litserve-thp": Scenario(("env", "THP_MEM_ALLOC_ENABLE=1") + LITSERVE, "efficientnet-lite0", needs=LITSERVE_PYTHON),
}
# /v1/embeddings (one image per request; req/s = images/s). "-repeat": the same image every time
# (the naive server and LitServe have no cache to hit; shmgate hits its tensor cache, and with
# --result-cache-mb its result cache, which skips the worker).
_EMBED = ("--unique", "--embeddings")
_EMBED_REPEAT = ("--repeat-one", "--embeddings")
SCENARIOS.update(
    {
        "naive-embed": Scenario(NAIVE + ("--mode", "efficientnet"), "efficientnet-lite0", bench_flags=_EMBED),
        "naive-embed-repeat": Scenario(
            NAIVE + ("--mode", "efficientnet"), "efficientnet-lite0", bench_flags=_EMBED_REPEAT
        ),
        "litserve-embed": Scenario(
            LITSERVE + ("--embeddings",), "efficientnet-lite0", needs=LITSERVE_PYTHON, bench_flags=_EMBED
        ),
        "litserve-embed-repeat": Scenario(
            LITSERVE + ("--embeddings",), "efficientnet-lite0", needs=LITSERVE_PYTHON, bench_flags=_EMBED_REPEAT
        ),
        "shmgate-embed": Scenario(
            SHMGATE + ("--model", "efficientnet-lite0"), "efficientnet-lite0", ready_path="/ready", bench_flags=_EMBED
        ),
        "shmgate-embed-repeat": Scenario(
            SHMGATE + ("--model", "efficientnet-lite0"),
            "efficientnet-lite0",
            ready_path="/ready",
            bench_flags=_EMBED_REPEAT,
        ),
        "shmgate-embed-result-cache": Scenario(
            SHMGATE + ("--model", "efficientnet-lite0", "--result-cache-mb", "64"),
            "efficientnet-lite0",
            ready_path="/ready",
            bench_flags=_EMBED_REPEAT,
        ),
    }
)
EMBEDDING_SCENARIOS = [
    "naive-embed",
    "litserve-embed",
    "shmgate-embed",
    "naive-embed-repeat",
    "litserve-embed-repeat",
    "shmgate-embed-repeat",
    "shmgate-embed-result-cache",
]
DEFAULT_SCENARIOS = ["naive-checksum", "naive-efficientnet", "litserve"]


@dataclass
class ServerProcess:
    """A server under test, started in its own session so its whole tree can be stopped."""

    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
            )

    @property
    def pid(self) -> int:
        assert self.process is not None, "start() first"
        return self.process.pid

    def log_tail(self, nbytes: int = 3000) -> str:
        return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")

    async def wait_ready(self, url: str, timeout_s: float) -> None:
        """Poll ``url`` until it answers 200. Raises RuntimeError if the server exits or times out."""
        import httpx

        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process is None or self.process.poll() is not None:
                    raise RuntimeError(f"server exited before it was ready:\n{self.log_tail()}")
                try:
                    if (await client.get(url)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, wait, then SIGKILL whatever is left of it."""
        if self.process is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(self.process.pid):
                break
            time.sleep(0.5)  # the leader is gone; give its children a moment before the next signal
        self.process.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def expand(command: tuple[str, ...], port: int) -> list[str]:
    values = {
        "python": sys.executable,
        "bin": str(Path(sys.executable).parent),
        "repo": str(REPO),
        "port": str(port),
        "litserve_python": str(LITSERVE_PYTHON),
        "base": str(BASE_TREE),
    }
    return [part.format(**values) for part in command]


async def bench_scenario(
    name: str, scenario: Scenario, args: argparse.Namespace, images_dir: Path, log_dir: Path, round_index: int = 0
) -> list[dict[str, Any]]:
    """Start the scenario's server, load it at every concurrency, stop it. One result per concurrency."""
    port = free_port()
    server = ServerProcess(expand(scenario.command, port), log_dir / f"{name}-{round_index}.log")
    base_url = f"http://127.0.0.1:{port}"
    results = []
    started = time.monotonic()
    server.start()
    try:
        await server.wait_ready(base_url + scenario.ready_path, scenario.ready_timeout_s)
        startup_s = time.monotonic() - started
        loads: list[tuple[int, float | None]] = [(c, None) for c in args.concurrency]
        capacity = None
        for index in range(len(loads) + len(args.open_loop)):
            if index < len(loads):
                concurrency, rate = loads[index]
            else:  # open loop at a share of the capacity measured closed-loop just before
                if not capacity:
                    break
                concurrency, rate = 8, round(capacity * args.open_loop[index - len(loads)] / 100, 2)
            argv = [
                "--base-url",
                base_url,
                "--model",
                scenario.model,
                "--concurrency",
                str(concurrency),
                "--requests",
                str(args.requests),
                "--images",
                str(images_dir),
                "--server-pid",
                str(server.pid),
                *scenario.bench_flags,
            ]
            if rate is not None:
                argv += ["--rate", str(rate), "--seed", str(args.seed)]
            if args.stream:
                argv.append("--stream")
            parser = argparse.ArgumentParser()
            loadgen.add_arguments(parser)
            began = time.monotonic()
            with Disturbance(args.background_cores):
                result = await loadgen.run(parser.parse_args(argv))
            if rate is None:
                capacity = result["requests_per_s"]
            result.update(
                scenario=name,
                run_s=round(time.monotonic() - began, 2),
                startup_s=round(startup_s, 2),
                background_cores=args.background_cores,
                round=round_index,
                capacity=None if rate is None else capacity,
            )
            results.append(result)
            emit_progress(result, args)
    finally:
        server.stop()
    return results


def emit_progress(result: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        load = f"c={result['concurrency']:<3}" if result["offered_rate"] is None else f"rate={result['offered_rate']}"
        print(
            f"  {result['scenario']:<24} {load} {result['requests_per_s']:>8} req/s  "
            f"p50 {result['p50_ms']} ms  p99 {result['p99_ms']} ms  errors {result['errors']}  "
            f"mismatches {result['mismatches']}  other load {result['other_load_cores']} cores  "
            f"({result['run_s']} s)",
            file=sys.stderr,
            flush=True,
        )


def render_table(columns: list[str], rows: list[list[object]], *, left: int = 1) -> str:
    """A markdown table; the first ``left`` columns are text, the rest right-aligned numbers."""
    align = ["---"] * left + ["---:"] * (len(columns) - left)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 1) -> str:
    """A number for a table; '-' when it was not measured."""
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown_table(results: list[dict[str, Any]]) -> str:
    """The comparison table; server CPU is per request, all of the server's processes included."""
    rounds = any(r.get("round") for r in results)
    columns = ["round"] * rounds + [
        "scenario",
        "conc",
        "req/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "p99/p50",
        "ttft p50 ms",
        "errors",
        "mismatches",
        "server CPU ms/req",
        "other load (cores)",
        "workers busy",
        "run s",
    ]
    rows = []
    for r in results:
        cpu = r["cpu_s_per_request"]
        load = r["concurrency"] if r.get("offered_rate") is None else f"open {r['offered_rate']}/s"
        ratio = r["p99_ms"] / r["p50_ms"] if r["p99_ms"] and r["p50_ms"] else None
        rows.append(
            [r.get("round", 0) + 1] * rounds
            + [
                r["scenario"],
                load,
                r["requests_per_s"],
                fmt(r["p50_ms"]),
                fmt(r["p90_ms"]),
                fmt(r["p99_ms"]),
                fmt(ratio, 2),
                fmt(r["ttft_p50_ms"]),
                r["errors"],
                r["mismatches"],
                fmt(None if cpu is None else cpu * 1000),
                fmt(r.get("other_load_cores")),
                fmt(r.get("workers_busy"), 2),
                r["run_s"],
            ]
        )
    return render_table(columns, rows, left=1 + rounds)


def plot_open_loop(results: list[dict[str, Any]], path: Path) -> bool:
    """p50 and p99 against offered load (% of measured capacity), one line pair per scenario (mean of its rounds).

    Needs matplotlib (not a project dependency: ``pip install matplotlib`` in the bench venv);
    False when it is missing or there is nothing to draw.
    """
    open_runs = [r for r in results if r.get("offered_rate") and r.get("capacity")]
    if not open_runs:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed; no plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name in dict.fromkeys(r["scenario"] for r in open_runs):
        by_load: dict[int, list[dict[str, Any]]] = {}  # rounds of one point: drawn as their mean
        for r in open_runs:
            if r["scenario"] == name:
                by_load.setdefault(round(100 * r["offered_rate"] / r["capacity"]), []).append(r)
        x = sorted(by_load)

        def mean(key: str, load: int) -> float:
            return sum(r[key] for r in by_load[load]) / len(by_load[load])

        rounds = max(len(runs) for runs in by_load.values())
        label = name if rounds == 1 else f"{name} (mean of {rounds} rounds)"
        line = ax.plot(x, [mean("p50_ms", load) for load in x], marker="o", label=f"{label} p50")[0]
        ax.plot(
            x,
            [mean("p99_ms", load) for load in x],
            marker="s",
            linestyle="--",
            color=line.get_color(),
            label=f"{label} p99",
        )
    ax.set_xlabel("offered load, % of the capacity measured closed-loop")
    ax.set_ylabel("latency, ms")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Open loop (Poisson arrivals), 1024 px photos, every request a cache miss", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


async def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="shmgate-e2e-") as tmp:
        images_dir = Path(tmp) / "images"
        images_dir.mkdir()
        for image in IMAGES:  # the load generator takes a folder: give it only the 1024 px photos
            (images_dir / image.name).symlink_to(image)
        log_dir = Path(args.log_dir) if args.log_dir else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        for round_index in range(args.rounds):
            for name in args.scenario:
                scenario = SCENARIOS[name]
                if scenario.needs is not None and not scenario.needs.exists():
                    print(
                        f"skipping {name}: {scenario.needs} is missing (for litserve: run bench/setup_litserve.sh; for shmgate-base: set SHMGATE_BENCH_BASE)",
                        file=sys.stderr,
                    )
                    continue
                print(f"{name}: {' '.join(expand(scenario.command, 0))}", file=sys.stderr, flush=True)
                try:
                    results += await bench_scenario(name, scenario, args, images_dir, log_dir, round_index)
                except RuntimeError as exc:
                    print(f"{name} failed: {exc}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenario",
        action="append",
        choices=sorted(SCENARIOS),
        help=f"repeatable; default: {', '.join(DEFAULT_SCENARIOS)}",
    )
    parser.add_argument("--all", action="store_true", help="every scenario of the table")
    parser.add_argument(
        "--embeddings", action="store_true", help=f"the /v1/embeddings comparison: {', '.join(EMBEDDING_SCENARIOS)}"
    )
    parser.add_argument("--quick", action="store_true", help="48 requests per point instead of 200")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--stream", action="store_true", help="streaming requests")
    parser.add_argument("--json", action="store_true", help="print JSON lines as results come")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    parser.add_argument(
        "--background-cores",
        type=float,
        default=0.0,
        help="spin this many cores of our own during each measured run (fractions by duty cycle)",
    )
    parser.add_argument(
        "--open-loop",
        type=float,
        nargs="*",
        default=[],
        help="after the closed-loop runs, open-loop runs at these %% of the measured capacity",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the open-loop arrival schedule")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the scenario list, alternating servers")
    parser.add_argument("--plot", default=None, help="PNG of the open-loop p50/p99 against offered load")
    parser.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="run nothing: print the table (and --plot) of the JSON lines an earlier --json run wrote",
    )
    args = parser.parse_args(argv)
    if args.from_json is not None:
        saved = [json.loads(line) for line in args.from_json.read_text().splitlines() if line.startswith("{")]
        print(markdown_table(saved))
        if args.plot:
            plot_open_loop(saved, Path(args.plot))
        return 0
    args.scenario = (
        sorted(SCENARIOS)
        if args.all
        else (args.scenario or (EMBEDDING_SCENARIOS if args.embeddings else DEFAULT_SCENARIOS))
    )
    args.requests = args.requests or (48 if args.quick else 200)
    results = asyncio.run(run_all(args))
    table = markdown_table(results)
    if not args.json:
        print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    if args.plot:
        plot_open_loop(results, Path(args.plot))
    return 0 if results and all(r["errors"] == 0 and r["mismatches"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
