"""The seam over one instance's POSIX objects: the production data path, moved here unchanged.

Every access to a segment record by a frontend or a worker lives in this module (the
frontend's code came from gateway/frontend.py, the worker's from worker/main.py, the
/metrics reads from gateway/metrics.py): same operations, same order, same costs.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shmgate.shared.arena import Partition, recheck, validate
from shmgate.shared.cache import ContentCache
from shmgate.shared.channels import AsyncQueueReader, AsyncSender, Queue, YieldingSender
from shmgate.shared.errors import ChannelFull, Overloaded
from shmgate.shared.instance import Instance, instance_alive
from shmgate.shared.locks import HolderKind
from shmgate.shared.segment import HEARTBEAT_LAPSE_S, Heartbeat, LockId, own_pidns
from shmgate.shared.stats_layout import (
    BATCH_BUCKETS,
    ENGINE_FIELDS,
    ENGINE_GAUGES,
    WORKER_CACHE_FIELDS,
    WORKER_CACHE_WORDS,
    WORKER_CACHES,
    Counter,
)
from shmgate.shared.transport.base import (
    BULK,
    INTERACTIVE,
    FrontendLink,
    NodeStats,
    ReplyHandler,
    Role,
    SupervisorLink,
    WorkerLink,
    WorkerTotals,
)
from shmgate.shared.vocabulary import DEAD_AFTER_S, InstanceState, SlotState, now_ns
from shmgate.shared.wire import Cancel, Submit, TensorRef

__all__ = ["PosixFrontendLink", "PosixNodeStats", "PosixSupervisorLink", "PosixWorkerLink"]


FULL_REPLY_QUEUE_S = 5.0  # how long a worker sends to a reply queue that stayed full without waiting
LIVE_ANSWER_TTL_S = 0.05  # how long a frontend trusts "this model has a live worker" (has_live_worker)


class PosixFrontendLink:
    """A frontend's link to an attached instance (see FrontendLink)."""

    def __init__(self, instance: Instance, slot: int) -> None:
        self.instance = instance
        self.segment = instance.segment
        self.slot = slot
        self.epoch = 0
        self._cache: ContentCache | None = None
        self._heartbeat: Heartbeat | None = None
        # one request queue per declared model (a worker takes only its own model's requests)
        served = self.segment.served_models
        self._model_index = {model: i for i, model in enumerate(served)}
        self._queues = [instance.request_queue(i) for i in range(max(1, len(served)))]
        self._requests = self._queues[0]
        self._senders = [AsyncSender(q) for q in self._queues]
        self._sender = self._senders[0]
        # The bulk lane's own senders: an AsyncSender is first come, first served, so an interactive send
        # sharing one with batch lines would wait behind a bulk send blocked on a full queue; a bulk send
        # never waits in the kernel's line, so a freed place goes to a blocked interactive send first.
        self._bulk_senders = [YieldingSender(q) for q in self._queues]
        self._replies = instance.reply_queue(slot)
        self._reader: AsyncQueueReader | None = None
        self._control: dict[int, Queue] = {}
        self._live_until: dict[str, float] = {}  # model -> until when "it has a live worker" stands

    def take_over(self) -> int:
        seg = self.segment
        table_lock = self.instance.lock(LockId.TABLE, (HolderKind.FRONTEND, self.slot, 0))
        if not table_lock.acquire(10.0):
            raise Overloaded("could not claim a frontend slot")
        try:
            self.epoch = seg.claim_slot(seg.frontends, self.slot)
        finally:
            table_lock.release()
        self._heartbeat = Heartbeat(seg.frontends, self.slot, self.epoch).start()
        index = self.instance.cache_index()
        index_lock = self.instance.lock(LockId.INDEX, (HolderKind.FRONTEND, self.slot, self.epoch))
        with index_lock.hold(10.0):
            index.purge_partition(self.slot)  # its partition starts empty again
        self._cache = ContentCache(Partition(seg, self.slot), index, index_lock, self.epoch)
        return self.epoch

    def content_cache(self) -> ContentCache:
        assert self._cache is not None, "take_over() first"
        return self._cache

    def stats_row(self) -> np.ndarray:
        row: np.ndarray = self.segment.stats[self.slot]
        return row

    def mark(self, state: SlotState) -> None:
        self.segment.frontends[self.slot]["state"] = state

    def release(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if int(self.segment.frontends[self.slot]["epoch"]) == self.epoch:
            self.segment.frontends[self.slot]["state"] = SlotState.FREE

    def stamp_progress(self) -> None:
        self.segment.frontends[self.slot]["progress_ns"] = now_ns()

    def set_preparing(self, count: int) -> None:
        self.segment.frontends[self.slot]["preparing"] = count

    def instance_running(self) -> bool:
        return int(self.segment.header[0]["state"]) == InstanceState.RUNNING

    def has_live_worker(self, model: str) -> bool:
        """Whether ``model`` has a live worker; a yes stands for LIVE_ANSWER_TTL_S.

        Why the memo: every request asks (admission), and the answer scans the worker table with a
        liveness syscall per worker, 18-22 µs with two workers (bench/admission_cost.py; docs/benchmarks-history.md):
        a few per cent of a cache hit's frontend CPU. A yes up to 50 ms old admits a request that a worker's death in those 50 ms leaves
        queued, as a death just after admission always could: it waits there for the next worker (or
        its deadline). A no is never kept: a worker that comes up is served at once.
        """
        now = time.monotonic()
        if self._live_until.get(model, 0.0) > now:
            return True
        live = bool(self.segment.live_workers(DEAD_AFTER_S, model))
        if live:
            self._live_until[model] = now + LIVE_ANSWER_TTL_S
        return live

    def live_workers(self, model: str) -> int:
        return len(self.segment.live_workers(DEAD_AFTER_S, model))

    def worker_alive(self, slot: int, epoch: int) -> bool:
        seg = self.segment
        return seg.slot_alive(seg.workers, slot, DEAD_AFTER_S, epoch)

    async def send_request(self, submit: Submit, timeout_s: float, priority: int = INTERACTIVE) -> None:
        senders = self._bulk_senders if priority == BULK else self._senders
        await senders[self._model_index.get(submit.model, 0)].send(submit, timeout_s, priority)

    def queue_depth(self) -> int:
        return sum(q.current_messages() for q in self._queues)

    def model_queue_depths(self) -> dict[str, int]:
        """Descriptors waiting on each declared model's request queue (for /metrics, by model)."""
        return {model: self._queues[i].current_messages() for model, i in self._model_index.items()}

    def start_replies(self, on_message: ReplyHandler, on_error: Callable[[BaseException], None]) -> None:
        while self._replies.try_receive() is not None:
            pass  # answers addressed to our predecessor
        self._reader = AsyncQueueReader(self._replies, on_message, on_error)
        self._reader.start()

    def drain_replies(self) -> None:
        if self._reader is not None:
            self._reader.drain()

    def stop_replies(self) -> None:
        if self._reader is not None:
            self._reader.stop()
        for sender in self._senders:
            sender.close()  # ends sends still waiting for room (shared/channels.py AsyncSender)
        for bulk in self._bulk_senders:
            bulk.close()

    def send_cancel(self, worker_slot: int, cancel: Cancel) -> None:
        if worker_slot >= self.segment.layout.n_workers:
            return
        queue = self._control.get(worker_slot)
        if queue is None:
            queue = self._control[worker_slot] = self.instance.control_queue(worker_slot)
        queue.try_send(cancel)  # best effort: a full queue means a busy worker


class PosixWorkerLink:
    """A worker's link to an attached instance (see WorkerLink)."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.segment = instance.segment
        self.mm = instance.segment.mm
        self.slot = -1
        self.epoch = 0
        self._heartbeat: Heartbeat | None = None
        self._requests: Queue | None = None
        self._control: Queue | None = None
        self._replies: dict[int, Queue] = {}  # by frontend slot
        self._full_until: dict[int, float] = {}  # frontend slot -> until when its reply queue is not waited on

    def claim(self, model: str) -> tuple[int, int]:
        self.slot, self.epoch = self.instance.claim_worker_slot(model)
        # its own model's request queue: 0 when the gateway declared no models (any worker attaches)
        self._requests = self.instance.request_queue(max(0, self.segment.model_index(model)))
        self._control = self.instance.control_queue(self.slot)
        while self._control.try_receive() is not None:
            pass  # cancels addressed to this slot's previous owner
        # Every frontend slot's reply queue now, not on its first reply: the worker's descriptors are
        # then fixed for its life, whichever frontends its requests came from (the soak benchmark counts them).
        self._replies = {k: self.instance.reply_queue(k) for k in range(self.n_frontends())}
        return self.slot, self.epoch

    def start_heartbeat(self, on_declared_dead: Callable[[], None]) -> None:
        self._heartbeat = Heartbeat(
            self.segment.workers, self.slot, self.epoch, on_declared_dead=on_declared_dead
        ).start()

    def stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def heartbeat_lapse_ns(self) -> int:
        if self._heartbeat is None:
            return 0
        beat = int(self.segment.workers[self.slot]["beat_ns"])
        if now_ns() - beat > HEARTBEAT_LAPSE_S * 1e9:
            return beat  # resumed, and the heartbeat thread has not beaten yet: this lapse began at its last beat
        return self._heartbeat.lapse_started_ns

    def step_bound_stamper(self) -> Callable[[int], None]:
        row = self.segment.workers[self.slot]

        def stamp(ns: int) -> None:
            row["step_bound_ns"] = ns

        return stamp

    def report_caches(self, words: Sequence[int]) -> None:
        row = self.segment.workers["caches"][self.slot].reshape(len(WORKER_CACHES), WORKER_CACHE_WORDS)
        new = np.asarray(words, dtype=np.uint64).reshape(row.shape)
        row[:, :-1] = new[:, :-1]  # gauges
        row[:, -1] += new[:, -1]  # evictions: increments since the last report

    def progress_stamper(self) -> Callable[[int], None]:
        row = self.segment.workers[self.slot]

        def stamp(ns: int) -> None:
            row["progress_ns"] = ns

        return stamp

    def set_model(self, model_id: str) -> None:
        self.segment.workers[self.slot]["model"] = model_id.encode()

    def mark(self, state: SlotState) -> None:
        self.segment.workers[self.slot]["state"] = state

    def release(self) -> None:
        if self.still_ours():
            self.segment.workers[self.slot]["engine"][:ENGINE_GAUGES] = 0  # its rows and KV are gone with it
            self.segment.workers[self.slot]["state"] = SlotState.FREE

    def still_ours(self) -> bool:
        return int(self.segment.workers[self.slot]["epoch"]) == self.epoch

    def declared_dead(self) -> bool:
        row = self.segment.workers[self.slot]
        return int(row["epoch"]) != self.epoch or int(row["state"]) == SlotState.DEAD

    def instance_state(self) -> int:
        return int(self.segment.header[0]["state"])

    def instance_alive(self) -> bool:
        return instance_alive(self.segment, DEAD_AFTER_S)

    def preparing_requests(self) -> int:
        return self.segment.preparing_requests()

    def interactive_in_flight(self) -> int:
        return self.segment.interactive_in_flight()

    def request_queue(self) -> Queue:
        assert self._requests is not None, "claim() first"
        return self._requests

    def put_back(self, submit: Submit, timeout_s: float) -> None:
        self.request_queue().send(submit, timeout_s)

    def try_receive_control(self) -> Any | None:
        assert self._control is not None, "claim() first"
        return self._control.try_receive()

    def n_frontends(self) -> int:
        return self.segment.layout.n_frontends

    def send_reply(self, frontend_slot: int, message: object, timeout_s: float) -> None:
        """Send, waiting up to ``timeout_s`` for room, except to a queue that stayed full for a whole wait in
        the last FULL_REPLY_QUEUE_S: that one is tried once, without waiting (ChannelFull at once).

        Why: a frontend SIGKILLed with its supervisor reads no more, but looks alive until its heartbeat
        ages (its pid may linger as a zombie), so every reply to it waited the full timeout: a worker
        stopping after its supervisor's death sent a few replies per request of its last batches and
        outlived the supervisor by over 10 s under load. A frontend that starts reading again gets its
        replies at once, and waited on again.
        """
        now = time.monotonic()
        if self._full_until.get(frontend_slot, 0.0) > now:
            timeout_s = 0.0
        try:
            self._replies[frontend_slot].send(message, timeout_s)
        except ChannelFull:
            if timeout_s > 0:
                self._full_until[frontend_slot] = now + FULL_REPLY_QUEUE_S
            raise
        self._full_until.pop(frontend_slot, None)

    def frontend_alive(self, frontend_slot: int) -> bool:
        seg = self.segment
        return seg.slot_alive(seg.frontends, frontend_slot, DEAD_AFTER_S)

    def validate(self, ref: TensorRef) -> None:
        validate(self.segment, ref)

    def recheck(self, ref: TensorRef) -> None:
        recheck(self.segment, ref)

    def count_batch(self, n_requests: int, busy_ns: int) -> None:
        workers = self.segment.workers
        workers["busy_ns"][self.slot] += busy_ns
        workers["batches"][self.slot] += 1
        workers["batched_requests"][self.slot] += n_requests
        workers["batch_hist"][self.slot, bisect.bisect_left(BATCH_BUCKETS, n_requests)] += 1

    def report_engine(self, gauges: Sequence[int], added: Sequence[int]) -> None:
        words = self.segment.workers["engine"][self.slot]
        words[:ENGINE_GAUGES] = gauges
        words[ENGINE_GAUGES:] += np.asarray(added, dtype=np.uint64)

    def close(self) -> None:
        """Close this worker's queue descriptors: an unlinked queue's memory counts until the last close."""
        for q in (self._requests, self._control, *self._replies.values()):
            if q is not None:
                q.close()


class PosixNodeStats:
    """/metrics' reads of one segment (see NodeStats)."""

    def __init__(self, instance: Instance) -> None:
        self.segment = instance.segment

    def frontend_totals(self) -> np.ndarray:
        total: np.ndarray = self.segment.stats.sum(axis=0)
        return total

    def live_workers(self) -> int:
        # READY, heartbeating and progressing: a worker killed in another container (no one marks its row
        # DEAD) stops counting once its heartbeat is stale, a wedged one once its progress is (as /ready).
        return len(self.segment.live_workers(DEAD_AFTER_S))

    def worker_totals(self) -> WorkerTotals:
        workers = self.segment.workers
        return WorkerTotals(
            starts=int(workers["epoch"].sum()),
            stalls=int(workers["stalls"].sum()),
            frontend_stalls=int(self.segment.frontends["stalls"].sum()),
            busy_ns=int(workers["busy_ns"].sum()),
            batches=int(workers["batches"].sum()),
            batched_requests=int(workers["batched_requests"].sum()),
        )

    def batch_histogram(self) -> np.ndarray:
        hist: np.ndarray = self.segment.workers["batch_hist"].sum(axis=0)
        return hist

    def worker_caches(self) -> dict[str, dict[str, int]]:
        """Summed over worker rows: each WORKER_CACHES entry's WORKER_CACHE_FIELDS."""
        summed = self.segment.workers["caches"].sum(axis=0).reshape(len(WORKER_CACHES), WORKER_CACHE_WORDS)
        return {
            name: dict(zip(WORKER_CACHE_FIELDS, (int(v) for v in summed[index].tolist())))
            for index, name in enumerate(WORKER_CACHES)
        }

    def engine_totals(self) -> dict[str, int]:
        summed = self.segment.workers["engine"].sum(axis=0).tolist()
        return dict(zip(ENGINE_FIELDS, (int(v) for v in summed)))

    def engine_by_worker(self) -> list[tuple[int, str, dict[str, int]]]:
        workers = self.segment.workers
        return [
            (
                slot,
                bytes(workers[slot]["model"]).decode(errors="replace"),
                dict(zip(ENGINE_FIELDS, (int(v) for v in workers[slot]["engine"].tolist()))),
            )
            for slot in range(len(workers))
            if int(workers[slot]["epoch"])
        ]

    def preparing_requests(self) -> int:
        return self.segment.preparing_requests()

    def interactive_in_flight(self) -> int:
        return self.segment.interactive_in_flight()


class PosixSupervisorLink:
    """The supervisor's link to the instance it created (see SupervisorLink); code moved from
    supervise/supervisor.py unchanged."""

    def __init__(self, instance: Instance) -> None:
        self.instance = instance
        self.segment = instance.segment

    def _table(self, role: Role) -> np.ndarray:
        table: np.ndarray = self.segment.frontends if role == "frontend" else self.segment.workers
        return table

    def beat(self) -> None:
        self.instance.beat_supervisor()

    def mark_instance(self, state: InstanceState) -> None:
        self.instance.mark_state(state)

    def stall_timeout_s(self) -> float:
        return self.segment.stall_timeout_s or 0.0

    def frontend_alive(self, slot: int) -> bool:
        seg = self.segment
        return seg.slot_alive(seg.frontends, slot, DEAD_AFTER_S)

    def has_live_worker(self, model: str) -> bool:
        return bool(self.segment.live_workers(DEAD_AFTER_S, model))

    def slot_of(self, role: Role, pid: int, frontend_slot: int) -> int | None:
        seg = self.segment
        if role == "frontend":
            return frontend_slot if int(seg.frontends[frontend_slot]["pid"]) == pid else None
        pidns = own_pidns()
        for slot in range(len(seg.workers)):
            row = seg.workers[slot]
            if int(row["pid"]) == pid and int(row["pidns"]) == pidns:
                return slot
        return None

    def slot_state(self, role: Role, slot: int) -> int:
        return int(self._table(role)[slot]["state"])

    def stalled(self, role: Role, slot: int) -> bool:
        return self.segment.stalled(self._table(role), slot)

    def stall_bound_s(self, role: Role, slot: int) -> tuple[float, bool]:
        table = self._table(role)
        bound_ns = self.segment.stall_bound_ns(table, slot)
        return bound_ns / 1e9, role == "worker" and bound_ns == int(table[slot]["step_bound_ns"]) > 0

    def count_stall(self, role: Role, slot: int) -> None:
        self._table(role)["stalls"][slot] += 1

    def stalled_foreign_workers(self, our_pids: set[int]) -> list[tuple[int, int]]:
        seg = self.segment
        pidns = own_pidns()
        out = []
        for slot in range(len(seg.workers)):
            row = seg.workers[slot]
            if int(row["pidns"]) == pidns and int(row["pid"]) in our_pids:
                continue
            if seg.stalled(seg.workers, slot):
                out.append((slot, int(row["pid"])))
        return out

    def mark_dead(self, role: Role, slot: int) -> None:
        self._table(role)[slot]["state"] = SlotState.DEAD

    def mark_dead_by_pid(self, role: Role, pid: int) -> None:
        table = self._table(role)
        pidns = own_pidns()
        for slot in range(len(table)):
            row = table[slot]
            if int(row["pid"]) == pid and int(row["pidns"]) == pidns:
                row["state"] = SlotState.DEAD

    def repair_locks(self) -> int:
        repaired = 0
        for which in (LockId.INDEX, LockId.TABLE):
            lock = self.instance.lock(which, (HolderKind.SUPERVISOR, 0, 0))
            if lock.repair_after_death():
                repaired += 1
        return repaired

    def frontend_busy(self, slot: int) -> bool:
        seg = self.segment
        return bool(int(seg.stats[slot][Counter.IN_FLIGHT]) or int(seg.frontends[slot]["preparing"]))


if TYPE_CHECKING:  # mypy checks that each implementation satisfies its Protocol
    _frontend_link: type[FrontendLink] = PosixFrontendLink
    _worker_link: type[WorkerLink] = PosixWorkerLink
    _node_stats: type[NodeStats] = PosixNodeStats
    _supervisor_link: type[SupervisorLink] = PosixSupervisorLink
