"""How many CPUs this process may use: the cgroup CPU limit, not the node's core count.

Why: in a container ``os.cpu_count()`` is the node's core count, so a pod limited to 4 CPUs
on a 96-core node would start 96 frontends (and 96 torch threads per worker), each thrashing
against a quota of 4. Kubernetes and docker express a CPU limit as a CFS quota: cgroup v2
writes ``<quota> <period>`` (or ``max``) to ``cpu.max``; cgroup v1 splits it into
``cpu.cfs_quota_us`` (-1: none) and ``cpu.cfs_period_us``. The usable count is the smallest
of the quota (rounded up: a limit of 1.5 CPUs can keep 2 threads partly busy), the CPUs in
the affinity mask (cpusets, ``taskset``) and the node's cores.

Only the files of this process's own cgroup are read (``/proc/self/cgroup`` names it; in a
container with a private cgroup namespace that is ``/``, i.e. the mount's root).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

__all__ = ["cgroup_cpu_limit", "usable_cpus"]


def _own_cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """Directories that may hold this process's CPU controller files, most specific first.

    ``/proc/self/cgroup`` lines are ``id:controllers:path``; v2 is ``0::path``, v1 names the
    controllers (``cpu,cpuacct``). Inside a container the path may not exist under the mount
    (the mount is already the container's cgroup), so the mount root is the fallback.
    """
    candidates: list[Path] = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":  # cgroup v2
            candidates.append(root / rel)
        elif "cpu" in controllers.split(","):  # cgroup v1: cpu,cpuacct (or cpu alone)
            for name in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
                candidates.append(root / name / rel)
    candidates += [root, root / "cpu,cpuacct", root / "cpu"]
    return candidates


def _quota_v2(directory: Path) -> float | None:
    """CPUs allowed by ``cpu.max`` in ``directory``; None when absent or unlimited."""
    try:
        fields = (directory / "cpu.max").read_text().split()
    except OSError:
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _quota_v1(directory: Path) -> float | None:
    """CPUs allowed by ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; None when absent or -1."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _has_cpu_files(directory: Path) -> bool:
    return (directory / "cpu.max").exists() or (directory / "cpu.cfs_quota_us").exists()


def cgroup_cpu_limit(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPU limit of this process's cgroup in CPUs (e.g. 1.5), or None when unlimited or unknown.

    The first directory that has the controller's files decides; a nested cgroup's parents
    may be stricter, but a container's limit is set on its own cgroup, which is what matters here.
    """
    for directory in _own_cgroup_dirs(root, proc_cgroup):
        if not _has_cpu_files(directory):
            continue
        v2 = _quota_v2(directory)
        return v2 if v2 is not None else _quota_v1(directory)
    return None


def usable_cpus(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Whole CPUs this process can keep busy: min(cgroup quota rounded up, affinity mask, cores); at least 1."""
    counts = [os.cpu_count() or 1]
    if hasattr(os, "sched_getaffinity"):
        counts.append(len(os.sched_getaffinity(0)))
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        counts.append(math.ceil(limit))
    return max(1, min(counts))
