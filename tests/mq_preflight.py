"""Before the suite: is this user's POSIX message-queue budget free enough for the servers the tests start?

Every message queue is charged to its creator's uid against ``RLIMIT_MSGQUEUE`` (``ulimit -q``, 800 KiB
by default; shared/mq_budget.py). The tests start real servers, several at a time, and the serial tests
fill the budget on purpose; another shmgate instance of the same user (a server left running in a
terminal, a benchmark, a dead instance's leftovers) takes part of it, and the suite then fails in many
places with the same start-up error. scripts/test.sh runs this first and stops with one message that
says so, naming the instances that hold the budget.

    python -m tests.mq_preflight    exit 0 when the budget is free enough, else 3 and one message
"""

from __future__ import annotations

import os
import sys

NOT_ENOUGH = 3
PROBE_DEPTH, PROBE_BYTES = 10, 8192  # one probe queue, as deep and wide as /proc/sys/fs/mqueue allows by default


def _msg_max() -> int:
    try:
        with open("/proc/sys/fs/mqueue/msg_max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 10


def needed_bytes(processes: int) -> int:
    """What ``processes`` test servers at once take (tests/serving.py: 2 frontends, 2 workers, so 4 worker
    slots), at the depths the kernel lets them have."""
    from shmgate.shared.instance import queue_specs
    from shmgate.shared.mq_budget import queue_bytes

    cap = _msg_max()
    one = sum(s.count * queue_bytes(min(s.wanted_depth, cap), s.message_bytes) for s in queue_specs(2, 4, 64))
    return max(1, processes) * one


def free_bytes(up_to: int) -> int:
    """Message-queue memory this uid can still take, measured by creating probe queues (removed at once)
    until one is refused or ``up_to`` is reached."""
    import posix_ipc

    from shmgate.shared.mq_budget import message_queue_budget, queue_bytes

    message_queue_budget()  # the soft limit raised to the hard one, as a server does
    depth = min(PROBE_DEPTH, _msg_max())
    each = queue_bytes(depth, PROBE_BYTES)
    made: list[posix_ipc.MessageQueue] = []
    try:
        while len(made) * each < up_to:
            name = f"/shmgate-preflight.{os.getpid()}.{len(made)}"
            try:
                made.append(
                    posix_ipc.MessageQueue(
                        name, posix_ipc.O_CREX, max_messages=depth, max_message_size=PROBE_BYTES, read=False
                    )
                )
            except (posix_ipc.Error, OSError):  # the kernel says EMFILE (posix_ipc: "maximum number of files")
                break
    finally:
        for queue in made:
            queue.close()
            queue.unlink()
    return len(made) * each


def holders() -> tuple[list[str], int]:
    """(the live shmgate instances of this user, one line each; how many dead ones of this user are left)."""
    from shmgate.shared.instance import live_instances
    from shmgate.shared.names import SHM_DIR, InstanceNames, list_arena_instances

    def mine(instance_id: str) -> bool:
        try:
            arena = os.path.join(SHM_DIR, InstanceNames(instance_id).arena.lstrip("/"))
            return os.stat(arena).st_uid == os.getuid()
        except OSError:
            return False

    ours = {i for i in list_arena_instances() if mine(i)}
    live = [i for i in live_instances() if i.instance_id in ours]
    lines = [f"{i.instance_id} (label {i.label}, pid {i.supervisor_pid}, model {i.model or '?'})" for i in live]
    return lines, len(ours) - len(live)


def main() -> int:
    processes = int(os.environ.get("SHMGATE_TEST_PROCESSES", "3") or 3)
    need = needed_bytes(processes)
    free = free_bytes(need)
    if free >= need:
        return 0
    live, dead = holders()
    held = []
    if live:
        held.append(f"{len(live)} live shmgate instance(s) of this user hold part of it: " + "; ".join(live))
    if dead:
        held.append(f"{dead} dead instance(s) left queues behind (`shmgate cleanup` removes them)")
    if not held:
        held.append("other message queues of this user take it (ls -l /dev/mqueue, where it is mounted)")
    print(
        f"scripts/test.sh: the tests start up to {processes} servers at once and need about {need:,} bytes of "
        f"POSIX message-queue memory (RLIMIT_MSGQUEUE, `ulimit -q`) free for this user; {free:,} are free. "
        + ". ".join(held)
        + ". Stop them (`shmgate cleanup --list` lists the live ones), raise `ulimit -q`, or run the suite "
        "as another user; SHMGATE_SKIP_MQ_CHECK=1 runs it anyway.",
        file=sys.stderr,
    )
    return NOT_ENOUGH


if __name__ == "__main__":
    sys.exit(main())
