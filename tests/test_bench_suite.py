"""The benchmark suite's front door: ``python -m bench`` lists every scenario and runs none it does not list.

The suite is run as a command here, as users run it: tests import no module of bench/. Each entry of
bench/__main__.py's table must name a module that exists and defines ``main(argv)``, and no file of
bench/ may reach into ``sys.path`` (the package is found from the repository root).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _bench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench", *argv], capture_output=True, text=True, timeout=60, cwd=REPO)


def _scenarios() -> dict[str, str]:
    """bench/__main__.py's SCENARIOS, read from its source: scenario -> module."""
    tree = ast.parse((REPO / "bench" / "__main__.py").read_text())
    table = next(
        node.value
        for node in tree.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "SCENARIOS"
    )
    return {name: module for name, (module, _) in ast.literal_eval(table).items()}


def test_the_listing_names_every_scenario_of_the_table() -> None:
    listed = _bench()
    assert listed.returncode == 2  # no scenario given
    names = {line.split()[0] for line in listed.stdout.splitlines() if line.startswith("  ")}
    assert names == set(_scenarios()) and "e2e" in names and "gateway-cost" in names


def test_every_scenario_module_exists_and_has_a_main_that_takes_argv() -> None:
    for name, module in _scenarios().items():
        # shmgate.bench_client.x is bench_client/x.py (setup.py maps each part into shmgate)
        path = REPO / Path(*module.removeprefix("shmgate.").split(".")).with_suffix(".py")
        assert path.exists(), f"{name}: {path} is missing"
        mains = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        assert mains and mains[0].args.args, f"{name}: {module} has no main(argv)"


def test_an_unknown_scenario_is_refused_with_a_suggestion() -> None:
    done = _bench("gateway_cost")
    assert done.returncode == 2 and "did you mean 'gateway-cost'" in done.stderr


def test_a_scenario_gets_its_own_options() -> None:
    done = _bench("queue-model", "--servers", "2", "--capacity", "100", "--load", "50")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n| 50 ") == 1  # one row, at the offered load asked for


def test_no_file_of_bench_touches_sys_path() -> None:
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "bench").rglob("*.py") if "sys.path" in p.read_text()]
    assert offenders == []


def test_the_handoff_scenario_runs_each_transport_at_each_size() -> None:
    done = _bench(
        "handoff",
        "--rounds",
        "1",
        "--samples",
        "10",
        "--json",
        "--transport",
        "shmgate",
        "--transport",
        "shmgate_descriptor",
        "--transport",
        "mp_queue_pickle",
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert {(r["transport"], r["rounds"]) for r in rows} == {
        ("shmgate", 2),
        ("shmgate_descriptor", 2),
        ("mp_queue_pickle", 2),
    }  # A B B A: each transport twice in a round
    assert len(rows) == 3 * 4 and all(r["p50_us"] > 0 and r["gb_s"] > 0 for r in rows)
