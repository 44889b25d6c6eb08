"""Unit-level checks of the reliability gaps closed with self-healing (docs/RELIABILITY.md, "Known gaps").

Real shared memory (scratch instances); no server. The process-level behaviour is in
tests/test_selfheal.py and tests/test_chaos.py.
"""

from __future__ import annotations

import time

import pytest

from shmgate.shared.arena import Partition
from shmgate.shared.cache import ContentCache
from shmgate.shared.errors import ImageTooLarge
from shmgate.shared.instance import cleanup_leftovers
from shmgate.shared.locks import HolderKind
from shmgate.shared.segment import LAYOUT_VERSION, InstanceState, LockId, SlotState, peek_header
from tests.shm_children import leftovers, scratch_instance

PARTITION = 1 << 20


# serial: cleanup_leftovers removes every dead instance on the machine (another test's too), and once this
# one is STOPPED a serve starting beside the test could remove it first.
@pytest.mark.serial
def test_cleanup_never_removes_a_live_instance_of_another_version() -> None:
    """Before: attach refused the version, and cleanup took that for a dead instance and unlinked it."""
    with scratch_instance(arena_size=2 * PARTITION, n_frontends=2, n_workers=1, queue_depth=2) as inst:
        instance_id = inst.names.instance_id
        header = inst.segment.header[0]
        header["layout_version"] = LAYOUT_VERSION + 7  # what a newer shmgate would write
        header["wire_version"] = 99
        peek = peek_header(inst.names)
        assert peek is not None and peek.magic_ok and peek.layout_version == LAYOUT_VERSION + 7
        assert instance_id not in cleanup_leftovers()  # its supervisor (this process) is alive
        assert leftovers(instance_id)
        header["state"] = InstanceState.STOPPED  # now it is dead: its objects go, queues included
        assert instance_id in cleanup_leftovers()
        assert leftovers(instance_id, slots=4) == []


def test_an_image_larger_than_a_whole_partition_is_413_naming_the_limit() -> None:
    with scratch_instance(arena_size=2 * PARTITION, n_frontends=2, n_workers=1, queue_depth=2) as inst:
        seg = inst.segment
        epoch = seg.claim_slot(seg.frontends, 0)
        lock = inst.lock(LockId.INDEX, (HolderKind.FRONTEND, 0, epoch))
        cache = ContentCache(Partition(seg, 0), inst.cache_index(), lock, epoch)

        def make(allocate) -> None:  # type: ignore[no-untyped-def]
            allocate("pixel_values", "float32", (PARTITION // 4,))  # 1 MiB + the block header: never fits

        with pytest.raises(ImageTooLarge) as caught:
            cache.acquire(b"k" * 32, make)
        assert caught.value.status_hint == 413 and "needs 1,048,640 bytes" in caught.value.message
        assert "partition holds (1,048,576 bytes" in caught.value.message
        assert "--arena-size" in caught.value.message
        assert cache.held_bytes == 0 and cache.partition.used_bytes == 0


def test_a_worker_rows_busy_time_and_stall_count_survive_a_restart_in_its_slot() -> None:
    """Exported as counters: a restart must not make them go backwards."""
    with scratch_instance(arena_size=2 * PARTITION, n_frontends=2, n_workers=1, queue_depth=2) as inst:
        seg = inst.segment
        seg.claim_slot(seg.workers, 0, model="m")
        seg.workers[0]["busy_ns"] = 123
        seg.workers[0]["stalls"] = 2
        seg.workers[0]["state"] = SlotState.DEAD
        seg.claim_slot(seg.workers, 0, model="m" * 128)
        assert int(seg.workers[0]["busy_ns"]) == 123 and int(seg.workers[0]["stalls"]) == 2
        assert bytes(seg.workers[0]["model"]) == b"m" * 128  # a 128-byte model id is kept whole


def test_a_ready_worker_without_progress_is_stalled_and_not_live() -> None:
    with scratch_instance(
        arena_size=2 * PARTITION, n_frontends=2, n_workers=1, queue_depth=2, stall_timeout_s=5.0
    ) as inst:
        seg = inst.segment
        seg.claim_slot(seg.workers, 0, model="m")
        seg.workers[0]["state"] = SlotState.READY
        assert seg.live_workers(3.0, "m") == [0] and not seg.stalled(seg.workers, 0)
        seg.workers[0]["progress_ns"] -= int(6e9)  # the heartbeat is fresh; the model loop is not
        assert seg.stalled(seg.workers, 0) and seg.live_workers(3.0, "m") == []


def test_a_stepping_workers_own_bound_is_tighter_than_the_stall_timeout_only_while_it_has_work() -> None:
    """``step_bound_ns`` (worker/health.py StepClock) replaces the stall timeout when smaller; 0 means none."""
    with scratch_instance(
        arena_size=2 * PARTITION, n_frontends=2, n_workers=1, queue_depth=2, stall_timeout_s=60.0
    ) as inst:
        seg = inst.segment
        seg.claim_slot(seg.workers, 0, model="m")
        row = seg.workers[0]
        row["state"] = SlotState.READY
        row["progress_ns"] -= int(5e9)  # no step for 5 s
        assert not seg.stalled(seg.workers, 0)  # idle (no bound published): the 60 s timeout applies
        row["step_bound_ns"] = int(2e9)  # busy, its steps bound it at 2 s
        assert seg.stalled(seg.workers, 0) and seg.live_workers(3.0, "m") == []
        assert seg.stall_bound_ns(seg.workers, 0) == int(2e9)
        row["step_bound_ns"] = int(120e9)  # a bound beyond the timeout: the timeout still applies
        assert seg.stall_bound_ns(seg.workers, 0) == int(60e9) and not seg.stalled(seg.workers, 0)
        seg.header[0]["stall_timeout_ns"] = 0  # detection off: no bound applies
        row["step_bound_ns"] = int(2e9)
        assert not seg.stalled(seg.workers, 0)
        row["state"] = SlotState.DEAD
        seg.claim_slot(seg.workers, 0, model="m")  # a successor starts with no bound of its own
        assert int(seg.workers[0]["step_bound_ns"]) == 0


def test_the_step_clock_bound_follows_recent_steps_and_is_published_only_when_it_changes() -> None:
    from shmgate.worker.health import StepClock

    published: list[int] = []
    clock = StepClock(published.append, floor_s=2.0, window=32, min_steps=16, slowest_half_life_s=1e9)
    clock.busy()
    assert published == [0]  # too few steps to judge: the stall timeout alone
    for _ in range(16):
        clock.note_step(0.01)
    assert clock.bound_s() == 2.0  # the floor: 20 x 10 ms is less
    clock.busy()
    clock.busy()
    assert published == [0, int(2e9)]  # once per change, not per step
    clock.note_step(1.0)  # one slow step (a large prefill) among them
    assert clock.bound_s() == 20.0  # 20 x the p99, which is that step
    for _ in range(32):
        clock.note_step(0.01)  # it leaves the p99's window ...
    assert clock.bound_s() == pytest.approx(4.0)  # ... not the slowest step's memory (4 x 1 s)
    clock.idle()
    assert published[-1] == 0

    fading = StepClock(published.append, floor_s=0.0, window=1, min_steps=1, slowest_half_life_s=0.05)
    fading.note_step(1.0)
    fading.note_step(0.001)
    time.sleep(0.5)  # ten half-lives: the slow step's weight is spent (a sleep, not a timing assertion)
    assert fading.bound_s() < 0.1
