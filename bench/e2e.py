"""Side-by-side end-to-end benchmark: shmgate against the naive baseline and LitServe.

For each selected scenario this starts the server under test as a subprocess on a free loopback
port, waits until it answers its readiness path, drives it with ``bench_client.loadgen.run`` at each
concurrency (1, 8, 32 by default) on the 1024 px test photos, then stops it. Results print as a
markdown table (and JSON lines with ``--json``). Servers start and stop through bench/servers.py;
each load run is bounded by its request count and the load generator's per-request timeout.
``SCENARIOS`` is the table of servers and their flags.

Shared-machine and open-loop figures: ``--background-cores X`` runs spinning processes
of our own worth X cores (bench_client/disturb.py) during each measured run, started and stopped around
it; ``--open-loop 50 80 95`` then drives each server with Poisson arrivals (``shmgate bench --rate``)
at those percentages of the capacity it just measured closed-loop (its req/s at the last
concurrency), and ``--plot FILE`` draws p50/p99 against offered load. ``--rounds K`` repeats the
scenario list K times, alternating the servers, so a before/after pair shares the machine's moods.

Usage: ``python -m bench e2e [--quick] [--scenario NAME ...] [--embeddings] [--stream] [--json] [--out FILE]
[--background-cores X] [--open-loop PCT ...] [--plot FILE] [--rounds K]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import load, report
from bench.report import fmt, render_table
from bench.servers import (
    BASE_TREE,
    LITSERVE_PYTHON,
    REPO,
    ServerProcess,
    comparison_server,
    free_port,
    parse_variant,
    photo_folder,
    shmgate_serve,
)
from shmgate.bench_client.disturb import Disturbance


@dataclass(frozen=True)
class Scenario:
    """One server under test and how to load it."""

    server: str  # "shmgate", "shmgate-base" (SHMGATE_BENCH_BASE's tree) or a comparison server's module
    flags: tuple[str, ...]  # the server's own flags
    model: str  # the model id the load generator sends
    bench_flags: tuple[str, ...] = ("--unique",)  # distinct bytes per request: no cache hits
    ready_timeout_s: float = 180.0

    @property
    def ready_path(self) -> str:  # GET that answers 200 once the server can serve
        return "/ready" if self.server.startswith("shmgate") else "/health"

    @property
    def needs(self) -> Path | None:  # a file that must exist for the scenario to run
        return {"litserve_server": LITSERVE_PYTHON, "shmgate-base": BASE_TREE / "gateway"}.get(self.server)

    def argv(self, port: int) -> list[str]:
        if self.server.startswith("shmgate"):
            return shmgate_serve(port, *self.flags)
        python = LITSERVE_PYTHON if self.server == "litserve_server" else sys.executable
        return comparison_server(self.server, port, *self.flags, python=python)


LITE0 = "efficientnet-lite0"
SHMGATE = ("--server-timing", "--model")  # then the model
SCENARIOS: dict[str, Scenario] = {
    "naive-checksum": Scenario("naive_server", ("--mode", "checksum"), "checksum"),
    "naive-efficientnet": Scenario("naive_server", ("--mode", "efficientnet"), LITE0),
    "litserve": Scenario("litserve_server", (), LITE0),
    "litserve-checksum": Scenario("litserve_server", ("--mode", "checksum"), "checksum"),
    "shmgate-checksum": Scenario("shmgate", (*SHMGATE, "checksum"), "checksum"),
    "shmgate-checksum-cached": Scenario("shmgate", (*SHMGATE, "checksum"), "checksum", bench_flags=("--repeat-one",)),
    "shmgate-efficientnet": Scenario("shmgate", (*SHMGATE, LITE0), LITE0),
    # The default command on the checkout in SHMGATE_BENCH_BASE (before/after in one run).
    "shmgate-base": Scenario("shmgate-base", ("--model", LITE0), LITE0),
}
# /v1/embeddings (one image per request; req/s = images/s). "-repeat": the same image every time
# (the naive server and LitServe have no cache to hit; shmgate hits its tensor cache, and with
# --result-cache-mb its result cache, which skips the worker).
_EMBED = ("--unique", "--embeddings")
_EMBED_REPEAT = ("--repeat-one", "--embeddings")
SCENARIOS.update(
    {
        "naive-embed": Scenario("naive_server", ("--mode", "efficientnet"), LITE0, bench_flags=_EMBED),
        "naive-embed-repeat": Scenario("naive_server", ("--mode", "efficientnet"), LITE0, bench_flags=_EMBED_REPEAT),
        "litserve-embed": Scenario("litserve_server", ("--embeddings",), LITE0, bench_flags=_EMBED),
        "litserve-embed-repeat": Scenario("litserve_server", ("--embeddings",), LITE0, bench_flags=_EMBED_REPEAT),
        "shmgate-embed": Scenario("shmgate", (*SHMGATE, LITE0), LITE0, bench_flags=_EMBED),
        "shmgate-embed-repeat": Scenario("shmgate", (*SHMGATE, LITE0), LITE0, bench_flags=_EMBED_REPEAT),
        "shmgate-embed-result-cache": Scenario(
            "shmgate", (*SHMGATE, LITE0, "--result-cache-mb", "64"), LITE0, bench_flags=_EMBED_REPEAT
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


async def bench_scenario(
    name: str, scenario: Scenario, args: argparse.Namespace, images_dir: Path, log_dir: Path, round_index: int = 0
) -> list[dict[str, Any]]:
    """Start the scenario's server, load it at every concurrency, stop it. One result per concurrency."""
    port = free_port()
    tree = BASE_TREE if scenario.server == "shmgate-base" else REPO
    server = ServerProcess(scenario.argv(port), log_dir / f"{name}-{round_index}.log", tree)
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
            flags = [*scenario.bench_flags, *(["--stream"] if args.stream else [])]
            if rate is not None:
                flags += ["--rate", str(rate), "--seed", str(args.seed)]
            began = time.monotonic()
            with Disturbance(args.background_cores):
                result = await load.run(
                    base_url,
                    scenario.model,
                    images_dir,
                    concurrency=concurrency,
                    requests=args.requests,
                    server_pid=server.pid,
                    flags=flags,
                )
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
        images_dir = photo_folder(Path(tmp) / "images")
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
                print(f"{name}: {' '.join(scenario.argv(0))}", file=sys.stderr, flush=True)
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
        "--variant",
        action="append",
        default=[],
        help="NAME=FLAGS: shmgate-efficientnet with extra serve flags as one more scenario (repeatable), "
        'e.g. fcfs="--batch-policy fcfs" or 1w="--workers 1"',
    )
    parser.add_argument(
        "--embeddings", action="store_true", help=f"the /v1/embeddings comparison: {', '.join(EMBEDDING_SCENARIOS)}"
    )
    parser.add_argument("--quick", action="store_true", help="48 requests per point instead of 200")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--stream", action="store_true", help="streaming requests")
    report.add_arguments(parser)
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
        else (args.scenario or ([] if args.variant else EMBEDDING_SCENARIOS if args.embeddings else DEFAULT_SCENARIOS))
    )
    for spec in args.variant:
        name, flags = parse_variant(spec, SCENARIOS)
        SCENARIOS[name] = Scenario("shmgate", (*SHMGATE, LITE0, *flags), LITE0)
        args.scenario.append(name)
    args.requests = args.requests or (48 if args.quick else 200)
    results = asyncio.run(run_all(args))
    table = markdown_table(results)
    report.publish(table, [], args)  # --json printed each result as it came
    if args.plot:
        plot_open_loop(results, Path(args.plot))
    return 0 if results and all(r["errors"] == 0 and r["mismatches"] == 0 for r in results) else 1
