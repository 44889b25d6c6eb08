"""shared/cpus.py against fake cgroup trees (v2, v1, unlimited, nested paths) and this machine's own."""

from __future__ import annotations

import math
import os
from pathlib import Path

from shmgate.shared.cpus import cgroup_cpu_limit, usable_cpus


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _cores() -> int:
    counts = [os.cpu_count() or 1]
    if hasattr(os, "sched_getaffinity"):
        counts.append(len(os.sched_getaffinity(0)))
    return min(counts)


def test_v2_quota_in_a_private_cgroup_namespace(tmp_path: Path) -> None:
    _write(tmp_path / "cg" / "cpu.max", "150000 100000\n")
    _write(tmp_path / "proc", "0::/\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") == 1.5
    assert usable_cpus(tmp_path / "cg", tmp_path / "proc") == min(2, _cores())


def test_v2_unlimited_is_none(tmp_path: Path) -> None:
    _write(tmp_path / "cg" / "cpu.max", "max 100000\n")
    _write(tmp_path / "proc", "0::/\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") is None
    assert usable_cpus(tmp_path / "cg", tmp_path / "proc") == _cores()


def test_v2_own_nested_cgroup_wins_over_the_root(tmp_path: Path) -> None:
    # a host's view: the root has no limit file, the pod's cgroup has one
    _write(tmp_path / "cg" / "kubepods.slice" / "pod1" / "cpu.max", "400000 100000\n")
    _write(tmp_path / "proc", "0::/kubepods.slice/pod1\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") == 4.0


def test_v1_quota_and_period(tmp_path: Path) -> None:
    _write(tmp_path / "cg" / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_quota_us", "50000\n")
    _write(tmp_path / "cg" / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "proc", "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") == 0.5
    assert usable_cpus(tmp_path / "cg", tmp_path / "proc") == 1


def test_v1_no_quota_is_none(tmp_path: Path) -> None:
    _write(tmp_path / "cg" / "cpu" / "cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "cg" / "cpu" / "cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "proc", "2:cpu:/\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") is None


def test_v1_container_view_falls_back_to_the_mount_root(tmp_path: Path) -> None:
    # inside a container the path in /proc/self/cgroup need not exist under the mount
    _write(tmp_path / "cg" / "cpu,cpuacct" / "cpu.cfs_quota_us", "300000\n")
    _write(tmp_path / "cg" / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    _write(tmp_path / "proc", "3:cpu,cpuacct:/kubepods/burstable/pod9/xyz\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") == 3.0


def test_missing_files_mean_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path / "nothing", tmp_path / "no-proc") is None
    assert usable_cpus(tmp_path / "nothing", tmp_path / "no-proc") == _cores()


def test_garbage_is_ignored(tmp_path: Path) -> None:
    _write(tmp_path / "cg" / "cpu.max", "nonsense\n")
    _write(tmp_path / "proc", "0::/\n")
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "proc") is None


def test_this_machine_agrees_with_its_own_files() -> None:
    limit = cgroup_cpu_limit()
    expected = _cores() if limit is None else min(_cores(), math.ceil(limit))
    assert usable_cpus() == max(1, expected)
