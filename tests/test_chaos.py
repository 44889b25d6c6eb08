"""The short chaos soak (``python -m bench chaos``): mixed traffic while workers and frontends are SIGKILLed and
SIGSTOPped at random. The script is the test: it exits 1 when any request ended in a wrong answer,
an unclean error or a hang, when holds did not return to 0, when fds or threads grew, or when the
server did not stop cleanly and leave /dev/shm empty. The 10-minute run is ``python -m bench chaos``
(figures in docs/RELIABILITY.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_short_chaos_soak_ends_every_request_cleanly(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "chaos",
            "--duration-s",
            "15",
            "--json",
            "--seed",
            "1",
            "--log-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
    )
    assert done.stdout.strip(), done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"\nchaos (15 s): {summary['requests']} requests, {summary['faults']} faults {summary['faults_by_kind']}, "
        f"back to full capacity median {summary['back_to_full_capacity_s']['median']} s; {summary['outcomes']}"
    )
    assert done.returncode == 0 and not summary["failures"], summary["failures"]
    assert summary["faults"] >= 2 and summary["requests"] > 50
