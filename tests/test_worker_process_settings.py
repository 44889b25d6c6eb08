"""What ``python -m shmgate.worker`` sets up before torch loads: huge pages for the model's large tensors.

worker/__main__.py sets ``THP_MEM_ALLOC_ENABLE=1`` (unless the environment says otherwise) before
torch is imported, so torch's CPU allocator aligns tensors of 2 MiB and more to 2 MiB and asks the
kernel for transparent huge pages (``madvise``). On the bench machine that made the model's passes
about a quarter cheaper (docs/BENCHMARKS.md). These tests check the effect, not the variable: a
process that imports the worker's entry point and fills a large tensor holds anonymous huge pages,
and where the kernel gives huge pages only on request, a process told ``THP_MEM_ALLOC_ENABLE=0``
holds none.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Import the worker's entry point (which must come before torch), fill 64 MiB, report the process's
# anonymous huge pages in KiB.
CHILD = """
import shmgate.worker.__main__
import torch
from bench.huge_pages import memory_kib
tensor = torch.empty(16 * 1024 * 1024, dtype=torch.float32)
tensor.fill_(1.0)
print(memory_kib()["huge_kib"])
"""


def _thp_mode() -> str:
    """The kernel's transparent huge page mode: always, madvise or never ("" if unknown)."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else ""


def _huge_kib(env_value: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="the kernel gives no transparent huge pages")
def test_the_worker_puts_large_tensors_on_huge_pages() -> None:
    assert _huge_kib(None) >= 2048


@pytest.mark.skipif(_thp_mode() != "madvise", reason="only in madvise mode does the request alone decide")
def test_the_environment_can_turn_huge_pages_off() -> None:
    assert _huge_kib("0") == 0
