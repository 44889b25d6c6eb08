"""The soak (bench/soak.py), short: a few hundred mixed requests leave nothing behind.

The full run (20,000 requests) is a benchmark; its figures are in docs/RELIABILITY.md.
"""

from __future__ import annotations

import json

import pytest

from bench import soak
from tests.serving import Server


def test_a_short_soak_of_hits_misses_and_bad_inputs_leaves_nothing_behind(
        checksum_server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    code = soak.main(["--base-url", checksum_server.base_url, "--server-pid", str(checksum_server.process.pid),
                      "--requests", "300", "--warmup", "60", "--concurrency", "8", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["problems"] == [] and code == 0
    outcomes = result["outcomes"]
    assert outcomes["hit:ok"] + outcomes["miss:ok"] + outcomes["bad:ok"] == 300
    assert result["after"]["held_bytes"] == 0
    assert {p["role"] for p in result["after"]["processes"]} >= {"supervisor", "frontend 0", "frontend 1", "worker"}
