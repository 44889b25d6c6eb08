"""Which device each worker of ``shmgate serve`` runs on: one GPU per worker, never "all on GPU 0".

Who uses this: gateway/cli.py, when it builds the worker commands. Pure functions of the flags and
the visible GPU ids, so the mapping is tested without a GPU (tests/test_cli_gpus.py).

Rules:
- every CUDA worker sees exactly one GPU (its own ``CUDA_VISIBLE_DEVICES``) and runs on
  ``cuda:0`` inside it: nothing it does (a context, a registration, a stray kernel) can reach
  another GPU;
- ``--device cuda``: ``--workers`` (default GPUs x ``--workers-per-gpu``) spread round robin over
  the visible GPUs, so each GPU gets ``--workers-per-gpu`` of them;
- ``--device cuda:N``: GPU N of the visible ones only (as CUDA numbers them: the Nth entry of
  ``CUDA_VISIBLE_DEVICES`` when that is set); ``--workers`` (default ``--workers-per-gpu``) all there;
- GPUs not countable here (no /proc/driver/nvidia, e.g. some containers): the device is passed
  as asked and each worker chooses (worker/device.py ``pick_device``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from shmgate.shared.errors import SetupError

__all__ = ["Placement", "gpu_count", "worker_placements"]


@dataclass(frozen=True)
class Placement:
    """One worker's device flag and the ``CUDA_VISIBLE_DEVICES`` it starts with (None: inherited)."""

    device: str
    visible: str | None = None


def worker_placements(
    device: str, *, workers: int, workers_per_gpu: int, gpu_ids: list[str], cpu_workers: int
) -> list[Placement]:
    """One Placement per worker. ``workers`` 0 means the default for the device.

    ``gpu_ids``: the visible GPUs (gateway/cli.py ``visible_gpus``); ``cpu_workers``: the default
    count on a non-CUDA device. Raises SetupError for ``cuda:N`` past the visible GPUs and for a device
    that is none of ``cpu``, ``cuda``, ``cuda:N`` (whether CUDA works is the worker's check: it needs torch).
    """
    if not device.startswith("cuda"):
        if device not in ("cpu", "cpu:0"):  # a typo (gpu, cuda0): said now, not by every worker after torch loads
            raise SetupError(f"--device {device}: expected cpu, cuda or cuda:N")
        return [Placement(device)] * (workers or cpu_workers)
    index = _cuda_index(device)
    per_gpu = max(1, workers_per_gpu)
    if not gpu_ids:  # cannot see the GPUs from here: the worker decides
        return [Placement(device)] * (workers or per_gpu)
    if index is None:
        n = workers or len(gpu_ids) * per_gpu
        return [Placement("cuda:0", gpu_ids[i % len(gpu_ids)]) for i in range(n)]
    if index >= len(gpu_ids):
        raise SetupError(f"--device {device}: only {len(gpu_ids)} GPU(s) are visible (cuda:0..cuda:{len(gpu_ids) - 1})")
    return [Placement("cuda:0", gpu_ids[index])] * (workers or per_gpu)


def gpu_count(proc_dir: str = "/proc/driver/nvidia/gpus", dev_dir: str = "/dev") -> int:
    """NVIDIA GPUs this machine (or container) has, without importing torch.

    The driver's /proc entries first; where they are not mounted (some container runtimes, gVisor),
    the device nodes /dev/nvidia0, /dev/nvidia1, ... (a container has those of its granted GPUs).
    """
    try:
        return len(os.listdir(proc_dir))
    except OSError:
        pass
    try:
        return sum(1 for name in os.listdir(dev_dir) if re.fullmatch(r"nvidia\d+", name))
    except OSError:
        return 0


def _cuda_index(device: str) -> int | None:
    """N of ``cuda:N``; None for ``cuda``. Raises SetupError for anything else."""
    if device == "cuda":
        return None
    head, _, tail = device.partition(":")
    if head != "cuda" or not tail.isdigit():
        raise SetupError(f"--device {device}: expected cpu, cuda or cuda:N")
    return int(tail)
