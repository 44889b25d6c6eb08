"""Message-queue depths planned to fit RLIMIT_MSGQUEUE (shared/mq_budget.py), and an instance created under a
limit too small for the default depths: real queues, a real rlimit, in a child process so the limit stays there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from shmgate.shared.errors import SetupError
from shmgate.shared.mq_budget import MessageQueueBudgetError, QueueSpec, plan_queue_depths, queue_bytes

SPECS = [
    QueueSpec("request", 1, 8192, 64, min_depth=4),
    QueueSpec("reply", 2, 4096, 64, min_depth=4),
    QueueSpec("control", 16, 256, 8, min_depth=1),
]


def test_kernel_accounting_matches_the_measured_cost_of_a_queue() -> None:
    # 3 queues of 10 x 8 KiB fit in exactly 248,640 bytes and not in one byte less (measured on Linux 6.x)
    assert 3 * queue_bytes(10, 8192) == 248_640


def test_everything_wanted_fits_under_a_large_budget() -> None:
    plan = plan_queue_depths(1 << 30, SPECS)
    assert plan.depths == {"request": 64, "reply": 64, "control": 8}
    assert not plan.lowered
    assert plan.total_bytes == sum(s.bytes_at(plan.depths[s.role]) for s in SPECS)


def test_msg_max_caps_depth_without_counting_as_lowered() -> None:
    plan = plan_queue_depths(1 << 30, SPECS, system_max_depth=10)
    assert plan.depths == {"request": 10, "reply": 10, "control": 8}
    assert not plan.lowered


def test_the_default_limit_lowers_the_deep_queues_first_and_fits() -> None:
    plan = plan_queue_depths(819_200, SPECS, system_max_depth=64)
    assert plan.lowered
    assert plan.total_bytes <= 819_200
    assert plan.depths["control"] == 8
    assert 4 <= plan.depths["request"] == plan.depths["reply"] < 64
    one_deeper = {**plan.depths, "request": plan.depths["request"] + 1, "reply": plan.depths["reply"] + 1}
    assert sum(s.bytes_at(one_deeper[s.role]) for s in SPECS) > 819_200  # the largest depth that fits
    assert "lowered" in plan.describe(SPECS)


def test_shallow_queues_are_lowered_only_once_the_deep_ones_reach_their_size() -> None:
    minimum = sum(s.bytes_at(s.min_depth) for s in SPECS)
    plan = plan_queue_depths(minimum, SPECS)
    assert plan.depths == {"request": 4, "reply": 4, "control": 1}


def test_below_the_minimum_the_error_names_the_fixes() -> None:
    minimum = sum(s.bytes_at(s.min_depth) for s in SPECS)
    with pytest.raises(MessageQueueBudgetError) as info:
        plan_queue_depths(minimum - 1, SPECS)
    message = str(info.value)
    assert isinstance(info.value, SetupError)
    for fix in ("ulimit -q", "msgqueue", "--frontends", "--max-workers"):
        assert fix in message


_CHILD = textwrap.dedent(
    """
    import logging, resource, sys
    from shmgate.shared.instance import Instance
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    import os
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (limit, limit))
    # A uid of its own, once everything is imported: RLIMIT_MSGQUEUE is charged per uid, so the queues of
    # other processes of ours (tests running beside this one) would otherwise eat into the limit under test.
    uid = 50_000 + os.getpid() % 10_000
    os.setgid(uid)
    os.setuid(uid)
    try:
        inst = Instance.create(arena_size=4 << 20, n_frontends=2, n_workers=4, queue_depth=64)
    except Exception as exc:
        print("ERROR", type(exc).__name__, exc)
        sys.exit(3)
    try:
        print("DEPTH", inst.request_queue().depth, inst.reply_queue(1).depth, inst.control_queue(3).depth)
    finally:
        inst.unlink()
        inst.close()
    """
)


def _create_under(limit: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CHILD, str(limit)], capture_output=True, text=True, timeout=60)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the child under a uid of its own")


@needs_root
def test_an_instance_fits_its_queues_into_a_small_rlimit_and_says_so() -> None:
    # 120,000 bytes: below even 10-deep queues (msg_max's default), still enough for depth 4 and more
    done = _create_under(120_000)
    assert done.returncode == 0, done.stdout + done.stderr
    depth = next(line for line in done.stdout.splitlines() if line.startswith("DEPTH")).split()[1:]
    request, reply, control = map(int, depth)
    assert 4 <= request and request == reply
    assert request < 10
    assert queue_bytes(request, 8192) + 2 * queue_bytes(reply, 4096) + 4 * queue_bytes(control, 256) <= 120_000
    assert "message queues:" in done.stdout and "lowered" in done.stdout


@needs_root
def test_an_instance_refuses_to_start_when_even_the_minimum_does_not_fit() -> None:
    done = _create_under(20_000)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "MessageQueueBudgetError" in done.stdout and "ulimit -q" in done.stdout
