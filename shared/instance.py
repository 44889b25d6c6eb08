"""One running shmgate instance's IPC objects: create, attach, unlink, find leftovers.

The gateway's supervisor creates an instance (segment, three semaphores, the
request queue, one reply queue per frontend slot, one control queue per worker
slot) and is the one that unlinks it on shutdown, in a ``finally``. Frontends
and workers attach. Workers in another container find the instance by label
(the newest live arena whose header carries that label), so no PID or file
needs to be shared between containers.

Leftovers: an arena whose supervisor heartbeat has stopped belongs to a dead
instance; ``cleanup_leftovers`` unlinks it and every object named after it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import posix_ipc

from shmgate.shared.cache_index import CacheIndex
from shmgate.shared.channels import Queue, create_queue, open_queue, system_queue_depth, unlink_queue
from shmgate.shared.common_options import LabelOption
from shmgate.shared.errors import SetupError
from shmgate.shared.locks import HolderKind, Identity, SharedLock
from shmgate.shared.mq_budget import QueueSpec, message_queue_budget, plan_queue_depths
from shmgate.shared.names import (
    IPC_MODE,
    SHM_DIR,
    InstanceNames,
    list_arena_instances,
    list_orphan_encoder_ids,
    list_orphan_semaphore_ids,
    new_instance_id,
)
from shmgate.shared.segment import MAX_MODELS, LockId, Segment, own_pidns, peek_header
from shmgate.shared.vocabulary import DEAD_AFTER_S, InstanceState, check_model_id, now_ns
from shmgate.shared.wire import (
    CONTROL_MESSAGE_BYTES,
    MAX_MESSAGE_BYTES,
    REPLY_MESSAGE_BYTES,
    gateway_decoder,
    worker_decoder,
)

# DEAD_AFTER_S is the seam's word (shared/vocabulary.py), importable from here too for the tests.
__all__ = [
    "DEAD_AFTER_S",
    "Instance",
    "LiveInstance",
    "ModelQueue",
    "cleanup_leftovers",
    "find_instance",
    "instance_alive",
    "instance_objects",
    "live_instances",
]

log = logging.getLogger("shmgate.instance")

CONTROL_QUEUE_DEPTH = 8  # cancels for one worker: best effort, a full queue means a busy worker
DEFAULT_LABEL = LabelOption().label  # the label a gateway publishes under when not given one (--label)


@dataclass(frozen=True)
class ModelQueue:
    """One served model as the instance records it: its public id, its request queue's wanted depth and
    its stall timeout (0: the instance's)."""

    model: str
    queue_depth: int = 64
    stall_timeout_s: float = 0.0


@dataclass
class Instance:
    """Handles to one instance's IPC objects, as seen by one process."""

    names: InstanceNames
    segment: Segment
    index_sem: posix_ipc.Semaphore
    repair_sem: posix_ipc.Semaphore
    table_sem: posix_ipc.Semaphore
    owner: bool = False

    # -- construction -------------------------------------------------------------

    @classmethod
    def create(
        cls,
        *,
        arena_size: int,
        n_frontends: int,
        n_workers: int,
        label: str = DEFAULT_LABEL,
        queue_depth: int = 64,
        index_capacity: int = 0,  # 0: sized from the arena (shared/segment.py index_capacity_for)
        instance_id: str | None = None,
        stall_timeout_s: float = 0.0,
        model: str = "",
        models: Sequence[ModelQueue] = (),
    ) -> Instance:
        """``models``: the models the gateway serves, each with its own request queue (its index in the
        list names it); recorded in the segment's model table so that a worker started with a model not
        among them refuses to attach. ``model``: one model, the queue ``queue_depth`` deep (the one-model
        form). Neither: nothing recorded, one request queue, and any worker may attach."""
        declared = list(models) or ([ModelQueue(model, queue_depth)] if model else [])
        for entry in declared:
            check_model_id(entry.model)
        names = InstanceNames(instance_id or new_instance_id())
        segment = Segment.create(
            names,
            arena_size=arena_size,
            n_frontends=n_frontends,
            n_workers=n_workers,
            index_capacity=index_capacity,
            label=label,
            stall_timeout_s=stall_timeout_s,
        )
        try:
            # before the queues exist: no worker can attach yet
            segment.declare_models([(m.model, m.stall_timeout_s) for m in declared])
        except SetupError:
            segment.close()
            posix_ipc.unlink_shared_memory(names.arena)
            raise
        depths = [m.queue_depth for m in declared] or [queue_depth]
        created: list[str] = []
        try:
            sems = []
            for name in names.semaphores():
                sems.append(posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=IPC_MODE, initial_value=1))
                created.append(name)
            _create_queues(names, n_frontends, n_workers, depths, [m.model for m in declared])
        except BaseException:
            _unlink_all(names, n_frontends, n_workers)
            segment.close()
            raise
        return cls(names, segment, sems[0], sems[1], sems[2], owner=True)

    @classmethod
    def attach(cls, instance_id: str) -> Instance:
        names = InstanceNames(instance_id)
        segment = Segment.attach(names)
        try:
            sems = [posix_ipc.Semaphore(name) for name in names.semaphores()]
        except posix_ipc.ExistentialError as exc:
            segment.close()
            raise SetupError("the instance's semaphores are missing; it is shutting down or broken") from exc
        return cls(names, segment, sems[0], sems[1], sems[2])

    # -- parts --------------------------------------------------------------------

    def lock(self, which: LockId, identity: Identity) -> SharedLock:
        sem = {LockId.INDEX: self.index_sem, LockId.TABLE: self.table_sem}[which]
        return SharedLock(
            sem,
            self.segment.locks[int(which)],
            self.repair_sem,
            self.segment.locks[int(LockId.REPAIR)],
            identity,
            self.holder_is_dead,
        )

    def cache_index(self) -> CacheIndex:
        return CacheIndex.in_segment(self.segment)

    def request_queue(self, model_index: int = 0) -> Queue:
        """The request queue of the gateway's ``model_index``-th model (``Segment.model_index``)."""
        return open_queue(self.names.model_request_queue(model_index), worker_decoder)

    def reply_queue(self, frontend_slot: int) -> Queue:
        return open_queue(self.names.reply_queue(frontend_slot), gateway_decoder)

    def control_queue(self, worker_slot: int) -> Queue:
        return open_queue(self.names.control_queue(worker_slot), worker_decoder)

    def holder_is_dead(self, kind: int, slot: int, epoch: int, pid: int) -> bool:
        """Liveness of a lock holder by its identity, from the slot tables (works across containers)."""
        seg = self.segment
        if kind == HolderKind.FRONTEND and slot < seg.layout.n_frontends:
            return not seg.slot_alive(seg.frontends, slot, DEAD_AFTER_S, epoch)
        if kind == HolderKind.WORKER and slot < seg.layout.n_workers:
            return not seg.slot_alive(seg.workers, slot, DEAD_AFTER_S, epoch)
        # supervisor and tools have no slot: only a same-namespace pid check can tell
        if pid and int(seg.header[0]["supervisor_pidns"]) == own_pidns():
            return not _pid_exists(pid)
        return False

    # -- worker slots -------------------------------------------------------------

    def claim_worker_slot(self, model: str) -> tuple[int, int]:
        """Claim a free or dead worker slot for this process. Returns (slot, epoch). Raises SetupError."""
        seg = self.segment
        table_lock = self.lock(LockId.TABLE, (HolderKind.TOOL, 0, 0))
        if not table_lock.acquire(10.0):
            raise SetupError("could not take the slot-table lock")
        try:
            for slot in range(seg.layout.n_workers):
                if not seg.slot_alive(seg.workers, slot, DEAD_AFTER_S):
                    epoch = seg.claim_slot(seg.workers, slot, model=model)
                    return slot, epoch
        finally:
            table_lock.release()
        raise SetupError(f"all {seg.layout.n_workers} worker slots are taken; start the gateway with more")

    # -- life cycle -----------------------------------------------------------------

    def beat_supervisor(self) -> None:
        self.segment.header[0]["supervisor_beat_ns"] = now_ns()

    def mark_state(self, state: InstanceState) -> None:
        self.segment.header[0]["state"] = state

    def close(self) -> None:
        for sem in (self.index_sem, self.repair_sem, self.table_sem):
            with contextlib.suppress(posix_ipc.Error):
                sem.close()
        self.segment.close()

    def unlink(self) -> None:
        """Remove every IPC object of the instance (owner, at shutdown)."""
        layout = self.segment.layout
        _unlink_all(self.names, layout.n_frontends, layout.n_workers)


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def queue_specs(
    n_frontends: int, n_workers: int, queue_depth: int | Sequence[int], models: Sequence[str] = ()
) -> list[QueueSpec]:
    """The message queues of an instance, as the budget planner sees them (shared/mq_budget.py).

    ``queue_depth``: one depth, or one per model (each model's own request queue, role
    ``request <model>`` so the log line says how the budget was split between them).
    """
    depths = [queue_depth] if isinstance(queue_depth, int) else list(queue_depth)
    roles = (
        ["request"]
        if len(depths) == 1
        else [f"request {m or i}" for i, m in enumerate(list(models) or [""] * len(depths))]
    )
    reply_depth = max(depths)
    return [
        *(QueueSpec(role, 1, MAX_MESSAGE_BYTES, depth, min_depth=min(depth, 4)) for role, depth in zip(roles, depths)),
        QueueSpec("reply", n_frontends, REPLY_MESSAGE_BYTES, reply_depth, min_depth=min(reply_depth, 4)),
        QueueSpec("control", n_workers, CONTROL_MESSAGE_BYTES, CONTROL_QUEUE_DEPTH, min_depth=1),
    ]


def _create_queues(
    names: InstanceNames, n_frontends: int, n_workers: int, queue_depths: Sequence[int], models: Sequence[str] = ()
) -> None:
    """Create every queue of the instance, as deep as the message-queue memory this uid has allows.

    The plan starts from RLIMIT_MSGQUEUE; other queues of the same uid (another instance, another
    container of this uid on the host) take part of it unseen, so a creation that still fails is retried
    with a smaller plan until even the minimum does not fit (MessageQueueBudgetError names the fixes).
    Several models split the budget: each model's request queue is a role of its own in the plan.
    """
    specs = queue_specs(n_frontends, n_workers, queue_depths, models)
    request_specs = specs[: len(queue_depths)]
    budget = message_queue_budget()
    system_depth = system_queue_depth()
    while True:
        plan = plan_queue_depths(budget, specs, system_max_depth=system_depth)  # raises when nothing fits
        created: list[Queue] = []
        try:
            for i, spec in enumerate(request_specs):
                created.append(
                    create_queue(
                        names.model_request_queue(i), worker_decoder, plan.depths[spec.role], MAX_MESSAGE_BYTES
                    )
                )
            for k in range(n_frontends):
                created.append(
                    create_queue(names.reply_queue(k), gateway_decoder, plan.depths["reply"], REPLY_MESSAGE_BYTES)
                )
            for w in range(n_workers):
                created.append(
                    create_queue(names.control_queue(w), worker_decoder, plan.depths["control"], CONTROL_MESSAGE_BYTES)
                )
        except SetupError as exc:
            for q in created:
                q.close()
            _unlink_queues(names, n_frontends, n_workers)
            if not isinstance(exc.__cause__, OSError):  # EMFILE (budget) is an OSError; a name clash is not
                raise
            budget = plan.total_bytes * 3 // 4  # part of the budget is in use elsewhere: ask for less
            log.warning(
                "could not create the message queues within %s bytes; trying smaller ones", f"{plan.total_bytes:,}"
            )
            continue
        for q in created:
            q.close()
        (log.warning if plan.lowered else log.info)("%s", plan.describe(specs))
        return


def _unlink_queues(names: InstanceNames, n_frontends: int, n_workers: int) -> None:
    for i in range(MAX_MODELS):  # every model's request queue that may exist (unlinking a missing one is a no-op)
        unlink_queue(names.model_request_queue(i))
    for k in range(n_frontends):
        unlink_queue(names.reply_queue(k))
    for w in range(n_workers):
        unlink_queue(names.control_queue(w))


def _unlink_all(names: InstanceNames, n_frontends: int, n_workers: int) -> None:
    _unlink_queues(names, n_frontends, n_workers)
    _unlink_semaphores(names)
    _unlink_encoder_segments(names)
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(names.arena)


def _unlink_semaphores(names: InstanceNames) -> None:
    """The instance's semaphores and its models' encoder-sharing ones (unlinking a missing one is a no-op)."""
    for name in [*names.semaphores(), *(n for i in range(MAX_MODELS) for n in names.encoder_semaphores(i))]:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_semaphore(name)


def _unlink_encoder_segments(names: InstanceNames) -> None:
    """Every model's shared encoder outputs that may exist (shared/encoder_store.py)."""
    for i in range(MAX_MODELS):
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(names.encoder_arena(i))


def instance_alive(segment: Segment, dead_after_s: float = DEAD_AFTER_S) -> bool:
    """Is the instance's supervisor alive and not stopped? (Heartbeat-based: works across containers.)"""
    return _supervisor_alive(segment, dead_after_s)


def _supervisor_alive(segment: Segment, dead_after_s: float) -> bool:
    h = segment.header[0]
    return _alive(
        int(h["state"]),
        int(h["supervisor_pid"]),
        int(h["supervisor_pidns"]),
        int(h["supervisor_beat_ns"]),
        dead_after_s,
    )


def _alive(state: int, pid: int, pidns: int, beat_ns: int, dead_after_s: float) -> bool:
    if state == InstanceState.STOPPED:
        return False
    if pid and pidns == own_pidns():
        return _pid_exists(pid)  # same PID namespace: the kernel knows better than a heartbeat
    return now_ns() - beat_ns <= int(dead_after_s * 1e9)


def find_instance(label: str = DEFAULT_LABEL, *, wait_s: float = 0.0) -> str:
    """The id of the newest live instance published under ``label``. Raises SetupError.

    Waits up to ``wait_s`` for one to appear (a worker container starting before the gateway).
    """
    deadline = time.monotonic() + wait_s
    while True:
        best: tuple[int, str] | None = None
        for instance_id in list_arena_instances():
            try:
                segment = Segment.attach(InstanceNames(instance_id))
            except SetupError:
                continue
            try:
                if segment.label == label and _supervisor_alive(segment, DEAD_AFTER_S):
                    created = int(segment.header[0]["created_ns"])
                    if best is None or created > best[0]:
                        best = (created, instance_id)
            finally:
                segment.close()
        if best is not None:
            return best[1]
        if time.monotonic() >= deadline:
            raise SetupError(f"no running shmgate gateway with label {label!r} in this IPC namespace")
        time.sleep(0.25)


# An arena without a valid magic number is a creator that died mid-initialisation, or one
# initialising right now (the magic is written last): only remove it once it is this old.
HALF_CREATED_GRACE_S = 60.0


@dataclass(frozen=True)
class LiveInstance:
    """A running instance as ``shmgate cleanup --list`` shows it."""

    instance_id: str
    label: str
    supervisor_pid: int
    model: (
        str  # '' when the gateway did not record it, or the instance is of another layout version; several: comma list
    )


def live_instances(dead_after_s: float = DEAD_AFTER_S) -> list[LiveInstance]:
    """The instances of this IPC namespace whose supervisor is alive, oldest first.

    Label and model are read only from instances this version can attach; others show as '?'.
    """
    found: list[tuple[int, LiveInstance]] = []
    for instance_id in list_arena_instances():
        names = InstanceNames(instance_id)
        peek = peek_header(names)
        if peek is None or not peek.magic_ok:
            continue
        if not _alive(peek.state, peek.supervisor_pid, peek.supervisor_pidns, peek.supervisor_beat_ns, dead_after_s):
            continue
        label, model = "?", ""
        try:
            segment = Segment.attach(names)
        except SetupError:
            pass
        else:
            label, model = segment.label, ",".join(segment.served_models)
            segment.close()
        found.append((peek.created_ns, LiveInstance(instance_id, label, peek.supervisor_pid, model)))
    return [live for _, live in sorted(found, key=lambda pair: pair[0])]


def cleanup_leftovers(dead_after_s: float = DEAD_AFTER_S, *, dry_run: bool = False) -> list[str]:
    """Unlink the IPC objects of every dead instance. Returns the instance ids removed.

    Liveness is read from the header's version-independent prefix (``peek_header``), so a live
    instance of another shmgate version (which ``Segment.attach`` refuses) is never removed.
    ``dry_run``: unlink nothing; return the ids that would be removed.
    """
    if dry_run:
        return _dead_instance_ids(dead_after_s)
    removed = []
    for instance_id in list_arena_instances():
        names = InstanceNames(instance_id)
        peek = peek_header(names)
        if peek is None:
            continue  # gone meanwhile, or not ours to read
        if not peek.magic_ok:
            if _age_s(names.arena) < HALF_CREATED_GRACE_S:
                continue  # possibly being created right now
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(names.arena)
            removed.append(instance_id)
            continue
        if _alive(peek.state, peek.supervisor_pid, peek.supervisor_pidns, peek.supervisor_beat_ns, dead_after_s):
            continue
        log.warning("removing leftovers of dead instance %s", instance_id)
        _unlink_all(names, peek.n_frontends, peek.n_workers)
        removed.append(instance_id)
    for instance_id in list_orphan_semaphore_ids():
        _unlink_semaphores(InstanceNames(instance_id))
        removed.append(instance_id)
    for instance_id in list_orphan_encoder_ids():
        _unlink_encoder_segments(InstanceNames(instance_id))
        if instance_id not in removed:
            removed.append(instance_id)
    return removed


def _dead_instance_ids(dead_after_s: float) -> list[str]:
    """The ids ``cleanup_leftovers`` would remove now, by the same rules, removing nothing."""
    dead = []
    for instance_id in list_arena_instances():
        names = InstanceNames(instance_id)
        peek = peek_header(names)
        if peek is None:
            continue
        if not peek.magic_ok:
            if _age_s(names.arena) >= HALF_CREATED_GRACE_S:
                dead.append(instance_id)
            continue
        if not _alive(peek.state, peek.supervisor_pid, peek.supervisor_pidns, peek.supervisor_beat_ns, dead_after_s):
            dead.append(instance_id)
    dead.extend(list_orphan_semaphore_ids())
    dead.extend(i for i in list_orphan_encoder_ids() if i not in dead)
    return dead


def instance_objects(instance_id: str) -> list[str]:
    """Paths of the IPC objects named after ``instance_id`` that exist now (/dev/shm, /dev/mqueue)."""
    found: list[str] = []
    for directory in (SHM_DIR, "/dev/mqueue"):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        found.extend(os.path.join(directory, name) for name in sorted(names) if instance_id in name)
    return found


def _age_s(shm_name: str) -> float:
    try:
        return time.time() - os.stat(os.path.join(SHM_DIR, shm_name.lstrip("/"))).st_mtime
    except OSError:
        return 0.0
