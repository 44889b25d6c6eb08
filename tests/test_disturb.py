"""bench_client/disturb.py: the background load of the shared-machine benchmarks starts and stops its processes.

Real processes: they are seen alive (and spinning in their own session) inside the ``with``, and
gone after it, also when the block raises. No CPU figure is asserted (that is timing).
"""

from __future__ import annotations

import os

import pytest

from shmgate.bench_client.disturb import Disturbance, duties


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_cores_split_into_whole_spinners_and_one_duty_cycle() -> None:
    assert duties(0) == []
    assert duties(1) == [1.0]
    assert duties(1.5) == [1.0, 0.5]
    assert duties(0.25) == [0.25]
    with pytest.raises(ValueError):
        duties(-1)


def test_the_spinners_run_inside_the_block_and_are_gone_after_it() -> None:
    with Disturbance(1.5, max_seconds=60) as load:
        pids = load.pids
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        assert all(os.getpgid(pid) == pid for pid in pids)  # each in its own session, stopped as a group
    assert not any(_alive(pid) for pid in pids)


def test_the_spinners_stop_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError):
        with Disturbance(1, max_seconds=60) as load:
            pids = load.pids
            raise RuntimeError("the benchmark failed")
    assert pids and not any(_alive(pid) for pid in pids)


def test_no_cores_start_nothing() -> None:
    with Disturbance(0) as load:
        assert load.pids == []
