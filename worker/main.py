"""The worker loop: receive -> copy to the device -> add to the engine -> step -> stream replies.

One worker is one process with one model on one device. Two threads share the
work (worker/prefetch.py): a prefetch thread takes requests off the shared
queue (worker/batcher.py), claims each, validates its descriptors, copies its
tensors to the device (CUDA: on the copy stream, then waits for the copy's
event), re-checks the generations and sends Released at once, per request;
the main thread runs the engine loop: admit what the prefetch side has ready
(as much as the backend has ``room`` for: a generative backend's free rows and
KV budget, a batch backend's next batch once the last one ended), ``step`` the
backend, route each event to its request, read cancels between steps (an
aborted request leaves at the next step boundary; one that still waits in a
held or prepared batch is answered by the prefetch thread at once and never runs). The compute stream waits
for each copy's event (no host sync on the compute path). The backend contract
(``add``, ``abort``, ``step``, ``has_work``) is worker/backends/base.py's.

Per request the worker sends, in order: Claimed (as soon as it takes the
descriptor), Released (after its tensors were copied to the device and the
generation re-checked; never before the copy finished reading the arena, and
never later than that), then Delta* and exactly one terminal Finished or
Failed. A bad descriptor, an expired deadline or a request's own failure
(bad inputs, non-finite logits: an ``error`` event) fails that request alone;
a step that raises fails what the engine holds; the worker carries on. Only
SIGTERM/SIGINT stops it, after what the engine holds and the prepared batch
(both were claimed: they run, nothing is dropped).

Liveness: a heartbeat thread stamps the worker's slot row ("the process
exists"); ``progress_ns`` is stamped only by the main loop, per turn (at most
every ``LOOK_EVERY_S``), per engine step and per forward pass
(worker/health.py), so the supervisor can tell a turning loop from a stuck one
and replace the stuck one; a generation engine with work also publishes a bound
from its recent step times (``StepClock``), so a wedged one goes in seconds. A
worker whose heartbeat lapsed long enough for the frontends to give up on it
(SIGSTOP) drops what it had claimed before the lapse, unstepped, when it resumes. A worker that finds its slot marked DEAD or taken
over exits at once (from the heartbeat thread, whatever the main thread is
stuck in): in another container, where the supervisor cannot signal it, that is
how a wedged worker is replaced.

One request's data never kills the worker: a descriptor that does not decode,
does not validate, or makes the copy raise fails that request alone. A sticky
device error (a device-side assert) takes the worker out of the ready set and
makes it exit at once (``EXIT_DEVICE_ERROR``) so the supervisor restarts it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import torch

from shmgate.shared.encoder_store import EncoderStore
from shmgate.shared.errors import (
    EXIT_CONFIG,
    EXIT_DECLARED_DEAD,
    EXIT_DEVICE_ERROR,
    EXIT_FAILURE,
    EXIT_USAGE,
    Cancelled,
    ChannelFull,
    DescriptorError,
    InvalidRequest,
    ModelError,
    Overloaded,
    PeerDied,
    RequestTimeout,
    SetupError,
    ShmgateError,
    UnknownModel,
)
from shmgate.shared.instance import Instance
from shmgate.shared.locks import HolderKind
from shmgate.shared.models import parse_model_spec, resolve_model
from shmgate.shared.parent_death import follow_supervisor
from shmgate.shared.stages import Stamp, Stamps
from shmgate.shared.transport import PosixWorkerLink, WorkerLink
from shmgate.shared.vocabulary import DEAD_AFTER_S, SlotState, check_model_id, now_ns
from shmgate.shared.wire import (
    GRAMMAR_TENSOR,
    INLINE_TENSOR,
    MAX_DELTA_CHARS,
    TASK_EMBED,
    Cancel,
    Claimed,
    Delta,
    Finished,
    Released,
    Submit,
    TokenLogprobs,
    failed_reply,
)
from shmgate.worker.backends import load_backend
from shmgate.worker.backends.base import BackendEvent, ModelBackend, WorkItem, batch_size_for
from shmgate.worker.batcher import Batcher
from shmgate.worker.cache_gauges import CacheGauges
from shmgate.worker.config import WorkerOptions  # the worker's options are declared there (once)
from shmgate.worker.device import Copy, DeviceCopier, check_device, pick_device, use_device
from shmgate.worker.diagnostics import DiagnosticOptions
from shmgate.worker.drain import StopRequest
from shmgate.worker.encoder_share import SharedEncoderOutputs
from shmgate.worker.health import Progress, StepClock, is_sticky_device_error
from shmgate.worker.prefetch import Prefetcher
from shmgate.worker.vectors import vector_messages

if TYPE_CHECKING:
    from shmgate.worker.tracing import BatchSpans

__all__ = ["Worker", "WorkerOptions"]

log = logging.getLogger("shmgate.worker")

REPLY_TIMEOUT_S = 2.0
# Between a batch's events, cancels are read at most this often: each read is a syscall (and an
# exception when empty), and a fast backend emits events microseconds apart (10% of a checksum
# worker's CPU went there). A generating model's token steps are slower than this anyway.
CANCEL_POLL_S = 0.002
NO_DIAGNOSTICS = DiagnosticOptions()  # production: no deliberate delays
# The main loop's turns: an idle one waits this long for a batch; the instance's state, the slot and the
# supervisor are looked at (and an idle turn stamped) at most this often, not per batch (~5 µs a look).
GET_TIMEOUT_S = 0.25
LOOK_EVERY_S = 0.1
# How long a worker that saw its gateway stop waits for a SIGTERM sent at the same moment (a pod's containers
# are stopped together): with one, its exit is a clean 0; without, 1, for a restart policy to start another
STOP_SIGNAL_GRACE_S = 1.0
PREFETCH_JOIN_S = 10.0  # at stop: how long to wait for the prefetch thread's current batch
# A generation engine's gauges and counters reach the worker's row (and /metrics) at most this often,
# and when it runs dry.
ENGINE_REPORT_S = 0.05
# Tracing: a long stream's Deltas past this many are not recorded (the SDK keeps 128 events per span anyway).
MAX_DELIVERY_EVENTS = 128
# Interactive demand (the bulk lane, worker/batcher.py) counts as present this long after it was last seen.
DEMAND_GRACE_S = 0.02


def _no_demand() -> bool:
    return False


@dataclass
class _Job:
    submit: Submit
    item: WorkItem | None = None
    copy: Copy | None = None
    seq: int = 0
    done: bool = False
    pending: list[str] = field(default_factory=list)  # text not sent yet (see BackendEvent.flush)
    stamps: Stamps = field(default_factory=Stamps)  # per-stage latency, back in Finished (shared/stages.py)
    claimed_ns: int = 0  # when it was claimed (Claimed.claimed_ns): where its batch wait begins
    deliveries: list[int] | None = None  # tracing on: when each streamed Delta went out (worker/tracing.py)
    steps: int = 0  # tracing on, a step engine: the engine steps it was in (worker/tracing.py)


class Worker:
    def __init__(
        self,
        instance: Instance | WorkerLink,
        options: WorkerOptions,
        backend: ModelBackend | None = None,
        diagnostics: DiagnosticOptions = NO_DIAGNOSTICS,
    ) -> None:
        """``instance``: an attached instance (its POSIX link is made here) or a ready transport link.

        ``backend``: a ready backend to serve instead of loading ``options.model`` (embedding, tests).
        ``diagnostics``: deliberate delays for tests and benchmarks (worker/diagnostics.py); none by default.
        """
        link: WorkerLink = PosixWorkerLink(instance) if isinstance(instance, Instance) else instance
        self.link = link
        self.options = options
        self.diagnostics = diagnostics
        torch.device(options.device)  # a bad device name raises (RuntimeError) before a slot is claimed
        self._stop = threading.Event()
        self._stop_request = StopRequest(options.attach.follow_drain_s)
        self.exit_code = 0
        # (reply slot, request id): ids are unique per frontend only (each frontend numbers its own)
        self._cancelled: set[tuple[int, int]] = set()
        self._cancels_read_at = 0.0
        self._cancel_lock = threading.Lock()
        # Taken and copied by the prefetch thread, not admitted yet (a held or prepared batch), by the same key:
        # a Cancel for one of them is answered at once and the request never runs (``_drop_held``).
        self._held: dict[tuple[int, int], _Job] = {}
        self._jobs: dict[int, _Job] = {}  # what the engine holds, by WorkItem.key
        self._next_key = 0
        self._batch_started_ns = 0  # when the engine last went from idle to busy (0: idle)
        self._batch_requests = 0  # requests added since then
        self._batch_ended: list[_Job] = []  # tracing a batch backend: its batch's requests, traced when it ends
        self._engine_reported_at = 0.0
        self._engine_counters: tuple[int, ...] = ()  # the counters' totals at the last report
        self._device_error: BaseException | None = None
        # Claimed under the public id: the gateway's model table maps it to this model's request queue.
        self.slot, self.epoch = link.claim(_public_id(options))
        # After the slot: with several GPUs visible, the slot picks one (worker/device.py pick_device).
        self.device = pick_device(options.device, self.slot, _visible_gpus(options.device))
        use_device(self.device)  # this thread's CUDA calls (model load, compute) go to that GPU only
        self._prefetch_bound = False
        self.progress = Progress(link.progress_stamper())
        link.start_heartbeat(self._declared_dead)
        self.backend: ModelBackend = backend or load_backend(
            options.model,
            self.device,
            threads=options.threads,
            load=options.load,
            engine=options.engine,
        )
        if options.served_model_name:
            self.backend.name = options.served_model_name
        # the public model id (hf:<dir> is served under the directory's name): what frontends match
        check_model_id(self.backend.name)
        link.set_model(self.backend.name)
        self.backend.on_step = self.progress.step  # generative backends: progress per forward pass
        # A stepping engine's stall bound from its recent step times (worker/health.py): a wedged one is
        # replaced seconds after its last step. A batch backend's one long call per batch has no such rhythm.
        self.step_clock: StepClock | None = StepClock(link.step_bound_stamper()) if self.backend.joins_running else None
        self._cache_gauges = CacheGauges()  # the backend's caches in /metrics (worker/cache_gauges.py)
        self._loop_thread = 0  # the engine loop's thread (run): only its blocking sends pause the step clock
        self.encoder_store: EncoderStore | None = None
        self.encoder_share: SharedEncoderOutputs | None = None
        if options.engine.encoder_share_mb > 0 and isinstance(instance, Instance):
            self._share_encoder(instance, options.engine.encoder_share_mb)
        self._batch_size = batch_size_for(self.backend, options.batching.max_batch_size)
        self._room = self._batch_size  # the engine's room after the last turn (read by the prefetch thread)
        self._interactive_seen = 0.0  # when the prefetch thread last saw interactive demand (time.monotonic)
        self.copier = DeviceCopier(self.device, link.mm)
        self._host_only = frozenset((INLINE_TENSOR, GRAMMAR_TENSOR, *self.backend.host_tensors))
        self._prefetcher: Prefetcher[list[_Job]] = Prefetcher(
            self._prepare, name=f"prefetch-{self.slot}", waiting=self._watch_held
        )
        self.spans: BatchSpans | None = None  # tracing off: never imported
        if options.tracing.otlp_traces_endpoint:
            from shmgate.worker.tracing import start_batch_spans

            self.spans = start_batch_spans(
                options.tracing.otlp_traces_endpoint, slot=self.slot, model=self.backend.name
            )
        self.batcher: Batcher[_Job] = Batcher(
            link.request_queue(),
            max_batch_size=self._batch_size,
            max_batch_wait_s=options.batching.max_batch_wait_ms / 1000,
            on_take=self._take,
            on_invalid=self._invalid_message,
            more_coming=lambda: link.preparing_requests() > 0,
            wake_fd=self._prefetcher.wake_fd,
            policy=options.batching.batch_policy,
        )

    def _share_encoder(self, instance: Instance, partition_mb: float) -> None:
        """Give a Qwen2-VL-style engine its model's shared vision-tower outputs (worker/encoder_share.py), in
        a partition of ``partition_mb`` of its own; another backend, or no room, leaves it to itself."""
        from shmgate.worker.backends.hf import HFBackend

        backend = self.backend
        if not isinstance(backend, HFBackend) or not backend.encoder_apart:
            log.warning("--encoder-share-mb applies to Qwen2-VL and Qwen2.5-VL models only; ignored")
            return
        segment = instance.segment
        try:
            self.encoder_store = EncoderStore.open(
                instance.names,
                max(0, segment.model_index(backend.name)),
                slot=self.slot,
                n_slots=segment.layout.n_workers,
                partition_bytes=int(partition_mb * (1 << 20)),
                identity=(HolderKind.WORKER, self.slot, self.epoch),
                is_dead=instance.holder_is_dead,
            )
        except (SetupError, Overloaded) as exc:
            log.warning("shared encoder outputs are off for this worker: %s", exc)
            return
        self.encoder_share = SharedEncoderOutputs(
            self.encoder_store,
            model=backend.name,
            device=self.device,
            merge_size=int(backend.model.config.vision_config.spatial_merge_size),
        )
        backend.encoder_share = self.encoder_share

    def close(self) -> None:
        """Unmap what the worker opened besides the instance (the shared encoder outputs)."""
        if self.encoder_store is not None:
            self.encoder_store.close()
            self.encoder_store = None

    # -- life cycle -----------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    def _declared_dead(self) -> None:
        """Heartbeat thread: our slot was marked DEAD or taken over. Exit now, answering nothing more.

        The frontends have retried or failed what we claimed; a reply from us now could only
        duplicate an answer. os._exit: the main thread may be stuck in the model for good.
        """
        log.error("this worker was declared dead (stalled, or its slot was taken over); exiting")
        logging.shutdown()
        os._exit(EXIT_DECLARED_DEAD)

    def request_stop(self) -> None:
        """SIGTERM/SIGINT: stop now, or once the gateway's drain is over (``follow_drain_s``).

        The signal handler: it only notes the request (plain attribute writes, no lock, no logging);
        the loop acts on it within ``LOOK_EVERY_S``. A handler runs on the main thread between any two
        bytecodes, so one that took a lock (``Event.set``) could interrupt the main thread, or itself on
        a second signal, while that lock was held, and wait for it forever: a worker sent two SIGTERMs
        in a row hung that way, orphaned, holding its segments.
        """
        self._stop_request.signal()

    def run(self) -> None:
        link = self.link
        self._loop_thread = threading.get_ident()
        self.progress.step()  # before READY: loading the model was not a stall
        self._report_engine()  # its KV budget, from the start
        link.mark(SlotState.READY)
        # "slot" is the segment's worker slot; the supervisor logs which of its workers holds it (by pid)
        log.info(
            "ready in worker slot %d: model %s (served as %s) on %s, batches of up to %d",
            self.slot,
            self.options.model,
            self.backend.name,
            self.device,
            self._batch_size,
        )
        prefetcher = self._prefetcher.start()
        next_look = 0.0  # when the loop next looks at the instance and its slot (monotonic)
        try:
            while not self._stop.is_set():
                if (now := time.monotonic()) >= next_look:
                    next_look = now + LOOK_EVERY_S
                    if self._stop_request.due(link.instance_state()):
                        self._stop.set()
                        break
                    if not link.still_ours():
                        log.error("this worker's slot was taken over (declared dead); exiting")
                        self.exit_code = EXIT_FAILURE
                        return
                    if not link.instance_alive():
                        # the gateway is gone or stopping: exit so the supervisor (or compose's restart
                        # policy) starts a worker that attaches to the new instance. A SIGTERM sent with the
                        # gateway's (a pod's containers stop together) may land a moment after its death is
                        # seen: wait for it briefly, so that a stop asked for exits cleanly.
                        log.warning("the gateway instance stopped; exiting")
                        waited_until = time.monotonic() + STOP_SIGNAL_GRACE_S
                        while not self._stop_request.asked and time.monotonic() < waited_until:
                            time.sleep(0.02)
                        self.exit_code = 0 if self._stop.is_set() or self._stop_request.asked else EXIT_FAILURE
                        return
                    self.progress.idle_turn()
                self._turn()
                if self._device_error is not None:
                    # Out of the ready set at once; the finally frees the slot, so the frontends
                    # retry what we claimed on another worker, and the supervisor restarts us.
                    log.error("sticky device error (%s); leaving the ready set and exiting", self._device_error)
                    self.exit_code = EXIT_DEVICE_ERROR
                    return
            # Stopping: what the engine holds and the prepared batch were claimed and released; finish
            # them rather than drop them.
            for jobs in prefetcher.drain(PREFETCH_JOIN_S):
                self._admit(jobs)
            while self.backend.has_work() and self._device_error is None:
                self._step()
        finally:
            left = prefetcher.drain(PREFETCH_JOIN_S)  # the thread must be done before the copier closes
            if left:  # only when the slot or the instance is gone: the frontends' watchdogs retry these
                log.warning("dropped %d prepared requests on exit", sum(len(jobs) for jobs in left))
            prefetcher.close()
            link.release()
            link.stop_heartbeat()
            self.copier.close()
            link.close()  # its queue descriptors: an unlinked queue's memory counts until the last close

    def _turn(self) -> None:
        """One turn of the engine loop: admit what the prefetch side has ready (if the engine has room), step.

        An idle engine waits for work (``GET_TIMEOUT_S``); a busy one only looks, so a request that arrives
        while others generate joins them at the next step (a generative backend's ``room``), or waits for
        the running batch to end (a batch backend's: 0 while one runs).
        """
        backend = self.backend
        busy = backend.has_work()
        if backend.room(self._batch_size) > 0:
            jobs = self._prefetcher.get(timeout_s=0.0 if busy else GET_TIMEOUT_S)
            if jobs:
                self._admit(jobs)
        if backend.has_work():
            self._step()
        self._room = backend.room(self._batch_size)  # what the prefetch thread may take next (one int)

    # -- one batch --------------------------------------------------------------------

    def _take(self, submit: Submit) -> _Job | None:
        """Claim a request the batcher took and start its device copy. None when it was answered already."""
        self.diagnostics.before_claim()
        if self.link.declared_dead():
            # Declared dead, and the heartbeat thread has not exited us yet (it looks every 0.2 s):
            # a claim now would cost the request an attempt on a worker that will never run it.
            try:
                self.link.put_back(submit, 1.0)  # back to the queue, for a live worker
            except ChannelFull:
                log.error("could not put request %x back on the queue; its deadline will end it", submit.request_id)
            self._declared_dead()
        claimed = Claimed(
            request_id=submit.request_id, worker_slot=self.slot, worker_epoch=self.epoch, claimed_ns=now_ns()
        )
        self._reply(submit, claimed)
        if submit.model != self.backend.name:
            self._fail(submit, 0, UnknownModel(f"this worker serves {self.backend.name}"))
            return None
        if submit.task == TASK_EMBED and not self.backend.embeds:
            self._fail(submit, 0, InvalidRequest(f"{self.backend.name} does not produce embeddings"))
            return None
        if self._expired(submit):
            return None
        job = _Job(submit, claimed_ns=claimed.claimed_ns)
        job.stamps.mark(Stamp.CUT)
        self.progress.blocked_since_ns = now_ns()
        try:
            job.copy = self._start_copy(submit)
            if job.copy is None:
                return None
            # Released as soon as its tensors are copied, not when its batch is cut or its answer ends:
            # the arena is the frontends' to reuse from here on.
            job.item = self._finish_copy(submit, job.copy)
        except Exception as exc:  # this request's data (e.g. a view torch refuses): fail it, not the worker
            self._fail_unreadable(submit, exc)
            return None
        finally:
            self.progress.blocked_since_ns = 0
        if job.item is None:
            return None
        job.stamps.mark(Stamp.COPIED)
        return job if self._hold(job) else None

    def _expired(self, submit: Submit) -> bool:
        """Fail a request whose deadline passed before it could start; True when it did."""
        if submit.deadline_ns and now_ns() > submit.deadline_ns:
            self._fail(submit, 0, RequestTimeout("the request expired before a worker could start it"))
            return True
        return False

    # -- the prefetch thread: the next batch, up to Released ----------------------------------

    def _prepare(self) -> list[_Job] | None:
        """Collect the next batch of taken requests (each copied and released when it was taken, ``_take``).

        Runs in the prefetch thread while the main thread steps the engine. None when nothing arrived.
        """
        if not self._prefetch_bound:  # a new thread's current CUDA device is 0, whatever the main thread's
            use_device(self.device)
            self._prefetch_bound = True
        limit = self._room if self.backend.joins_running else None
        # A backend that runs a batch as a whole holds batch lines back for an interactive request to ride
        # with (worker/batcher.py); a stepping engine's batch lines join its running rows at once.
        yield_bulk = _no_demand if self.backend.joins_running else self._interactive_waits
        jobs = self.batcher.collect(
            idle_timeout_s=0.25,
            hold_open=self._model_busy,
            limit=limit,
            yield_bulk=yield_bulk,
            on_held=self._watch_held,
        )
        return jobs or None

    def _interactive_waits(self) -> bool:
        """Interactive requests in hand on the node now, or a moment ago (closed-loop clients leave gaps of a
        fraction of a millisecond between one answer and their next request)."""
        now = time.monotonic()
        if self.link.interactive_in_flight() > 0:
            self._interactive_seen = now
            return True
        return now - self._interactive_seen < DEMAND_GRACE_S

    def _model_busy(self) -> bool:
        return not self._stop.is_set() and self._prefetcher.consumer_busy

    def _start_copy(self, submit: Submit) -> Copy | None:
        """Validate a request's descriptors and start its device copy. None when it failed (answered)."""
        with self._cancel_lock:
            key = (submit.reply_slot, submit.request_id)
            cancelled = key in self._cancelled
            self._cancelled.discard(key)
        if cancelled:
            self._reply(submit, Released(submit.request_id))
            self._fail(submit, 0, Cancelled("the client cancelled the request"))
            return None
        try:
            for ref in submit.tensors:
                self.link.validate(ref)
        except DescriptorError as exc:
            self._reply(submit, Released(submit.request_id))
            self._fail(submit, 0, exc)
            return None
        # The prompt's token ids (and what the backend reads on the host) stay there (worker/device.py).
        return self.copier.start(submit.tensors, host_only=self._host_only)

    def _finish_copy(self, submit: Submit, copy: Copy) -> WorkItem | None:
        """Wait for the copy, re-check the generations, send Released. None when it failed (answered)."""
        copy.wait_host()  # the DMA has finished reading the arena: only now may the owner reuse it
        try:
            for ref in submit.tensors:
                self.link.recheck(ref)  # seqlock: still the same allocation after the copy
        except DescriptorError as exc:
            self._reply(submit, Released(submit.request_id))
            self._fail(submit, 0, exc)
            return None
        self._reply(submit, Released(submit.request_id))
        by_name: dict[str, list[torch.Tensor]] = {}
        for name, tensor in zip(copy.names, copy.tensors):
            by_name.setdefault(name, []).append(tensor)
        inline = submit.inline
        params = submit.params
        for name, tensors in copy.host.items():
            if name == INLINE_TENSOR:
                inline = b"".join(t.numpy().tobytes() for t in tensors)
            elif name == GRAMMAR_TENSOR:  # a grammar too large for the descriptor (shared/wire.py)
                try:
                    grammar = b"".join(t.numpy().tobytes() for t in tensors).decode()
                except UnicodeDecodeError:
                    self._fail(submit, 0, DescriptorError("the request's grammar is not UTF-8"))
                    return None
                params = msgspec.structs.replace(params, grammar=grammar)
            else:
                by_name.setdefault(name, []).extend(tensors)  # on the host: the backend asked for that
        return WorkItem(
            submit.request_id,
            by_name,
            params,
            inline,
            submit.text,
            task=submit.task,
            image_keys=submit.image_keys,
            bulk=submit.bulk,
        )

    # -- the main thread: run a prepared batch ------------------------------------------------

    def _admit(self, prepared: Sequence[_Job]) -> None:
        """Add prepared requests to the engine (each under a key of its own); they start at the next step."""
        if self.step_clock is not None:
            self.step_clock.idle()  # ``add`` is not a step (a new grammar compiles here): the stall timeout applies
        self._drop_given_up([*prepared, *self._jobs.values()])
        compute = self.copier.compute_stream()
        added = 0
        for job in sorted(prepared, key=lambda job: job.submit.bulk):  # interactive requests first, then batch lines
            assert job.copy is not None and job.item is not None
            with self._cancel_lock:
                if self._held.pop((job.submit.reply_slot, job.submit.request_id), None) is None:
                    continue  # its client hung up while it waited, and it was answered then (``_drop_held``)
            if job.item.cancelled:  # given up while this worker was paused (_drop_given_up)
                continue
            job.copy.hand_to(compute)  # the compute stream waits for the copy's event; the host does not
            if self._expired(job.submit):  # it may have waited for room since it was claimed
                continue
            self._next_key += 1
            job.item.key = self._next_key
            self._jobs[job.item.key] = job
            job.stamps.mark(Stamp.STARTED)
            self.backend.add(job.item)
            added += 1
        if not added:
            return
        if self._batch_started_ns == 0:
            self._batch_started_ns, self._batch_requests = now_ns(), 0
        self._batch_requests += added
        self._drain_cancels()  # cancels that arrived while they were prepared
        self.diagnostics.before_batch()

    def _step(self) -> None:
        """One engine step: route its events; fail everything the engine holds if the step raised.

        Before it: requests that ended while the worker could not look (cancels, and everything its frontends
        gave up on while it was paused) are aborted, so the step drops their rows instead of running them.
        """
        self._drop_given_up(self._jobs.values())
        if self._jobs and time.monotonic() - self._cancels_read_at >= CANCEL_POLL_S:
            self._drain_cancels()
        self.progress.step()
        clock = self.step_clock
        if clock is not None:
            clock.busy()
        started = now_ns()
        # Tracing on, a step engine: the engine's counters around the step make its span (worker/tracing.py).
        traced_step = self.spans is not None and self.backend.joins_running
        before = self.backend.engine_report() if traced_step else None
        try:
            events = self.backend.step()
        except Exception as exc:
            log.exception("the model failed a step of %d requests", len(self._jobs))
            if is_sticky_device_error(exc):
                self._device_error = exc
                self.link.mark(SlotState.DRAINING)  # not ready from now on
            self.backend.clear()
            for job in list(self._jobs.values()):
                self._end(job, failed=ModelError(f"the model failed: {type(exc).__name__}"))
            events = []
        self.progress.step()
        if clock is not None:
            clock.note_step((now_ns() - started) / 1e9)
        if traced_step and before is not None:
            self._trace_step(started, before, events)
        for event in events:
            routed = self._jobs.get(event.index)
            if routed is not None:
                self._route(routed, event)
        idle = not self.backend.has_work()
        if idle and clock is not None:
            clock.idle()
        if idle or time.monotonic() - self._engine_reported_at >= ENGINE_REPORT_S:
            self._report_engine()
        if self._engine_counters:
            # A generation engine: a batch is a step, its size the requests that step produced for.
            if events:
                self.link.count_batch(len({event.index for event in events}), now_ns() - started)
            self._batch_started_ns = 0
        elif idle and self._batch_started_ns:
            # A batch backend ran dry: count the batch it served (busy time, requests), and trace it.
            ended = now_ns()
            self.link.count_batch(self._batch_requests, ended - self._batch_started_ns)
            self._batch_started_ns = 0
            if self.spans is not None and self._batch_ended:
                done = self._batch_ended
                self._batch_ended = []
                self.spans.batch(done, ended, [job.item is not None and job.item.cancelled for job in done])

    def _drop_given_up(self, jobs: Iterable[_Job]) -> None:
        """After a heartbeat lapse (a SIGSTOP, a starved process), end what was claimed before the frontends
        judged this worker dead, unstepped.

        The frontends judged it dead ``DEAD_AFTER_S`` into the lapse (its last beat that old) and retried what
        it had claimed by then under new ids, or failed it to its clients (gateway/replies.py): stepping those
        now would only delay the requests that still wait, for output nobody reads. Each is aborted (its row
        leaves before the next step) and answered with an error, in case a frontend did not give up after all.
        The cut is that judgement, not the lapse's start: a request claimed after the last beat before a
        SIGSTOP (beats are ``HEARTBEAT_INTERVAL_S`` apart, and a stop often follows a claim closely) was given
        up on all the same. A lapse is only noted once it outlasted the judgement (shared/segment.py
        ``HEARTBEAT_LAPSE_S``), so a request claimed after the resume is never taken for one of them.
        """
        lapse = self.link.heartbeat_lapse_ns()
        if not lapse:
            return
        judged_dead_ns = lapse + int(DEAD_AFTER_S * 1e9)
        ended = 0
        for job in list(jobs):
            item = job.item
            if item is None or item.cancelled or job.claimed_ns >= judged_dead_ns:
                continue
            item.cancelled = True
            if self._jobs.pop(item.key, None) is not None:
                self.backend.abort(item.key)  # its row leaves at the next step, before any forward pass
            self._fail(job.submit, job.seq, PeerDied("this worker was paused long enough to be judged dead"))
            ended += 1
        if ended:
            log.warning(
                "this worker was paused long enough for its frontends to give up on it: dropped %d requests it "
                "had claimed before, without another step",
                ended,
            )

    def _trace_step(
        self, started: int, before: tuple[tuple[int, ...], tuple[int, ...]], events: Sequence[BackendEvent]
    ) -> None:
        """Write one engine step's span: what it ran (the engine's counters across it) and whom it answered."""
        assert self.spans is not None
        after = self.backend.engine_report()
        if after is None:
            return
        for job in self._jobs.values():
            job.steps += 1
        answered = {event.index for event in events}
        jobs = [self._jobs[key] for key in answered if key in self._jobs]
        gauges, counters = after
        added = tuple(now - then for now, then in zip(counters, before[1], strict=True))
        self.spans.step(started, now_ns(), jobs, gauges, added)

    def _report_engine(self) -> None:
        """Publish the engine's gauges and what its counters added since the last report, and its caches'."""
        self._engine_reported_at = time.monotonic()
        caches = self.backend.caches()
        if caches:
            self.link.report_caches(self._cache_gauges.words(caches))
        report = self.backend.engine_report()
        if report is None:
            return
        gauges, counters = report
        shared = self.encoder_share.counters() if self.encoder_share is not None else (0, 0, 0)
        counters = (*counters, *shared)  # ENGINE_FIELDS' last words: the shared encoder outputs'
        last = self._engine_counters or (0,) * len(counters)
        self.link.report_engine(gauges, [now - before for now, before in zip(counters, last)])
        self._engine_counters = counters

    def _route(self, job: _Job, event: BackendEvent) -> None:
        """Send one event of ``job``'s output on, ending the job on its finish or error."""
        job.stamps.output()
        if event.error is not None:
            self._end(job, failed=event.error)
            return
        if event.logprob is not None:  # before the token's text: flush what is held first
            self._flush_text(job)
            self._reply(job.submit, TokenLogprobs(job.submit.request_id, event.logprob))
        if event.text:
            job.pending.append(event.text)
        if event.vector is not None:
            for message in vector_messages(job.submit.request_id, event.vector):
                self._reply(job.submit, message)
        if event.finish_reason is not None:
            last = self._flush_text(job, keep_last=True)
            self._reply(
                job.submit,
                Finished(
                    request_id=job.submit.request_id,
                    seq=job.seq,
                    finish_reason=event.finish_reason,
                    prompt_tokens=event.prompt_tokens,
                    completion_tokens=event.completion_tokens,
                    text=last,
                    stamps=job.stamps.done(),
                ),
            )
            self._end(job)
        elif event.flush:
            self._flush_text(job)

    def _end(self, job: _Job, failed: ShmgateError | None = None) -> None:
        """The job left the engine: answer its error if it failed, forget it, trace it."""
        assert job.item is not None
        self._jobs.pop(job.item.key, None)
        if failed is not None:
            self._fail(job.submit, job.seq, failed)
        if self.spans is not None:
            if self.backend.joins_running:  # requests come and go between steps: each is traced as it ends
                self.spans.batch([job], now_ns(), [job.item.cancelled])
            else:
                self._batch_ended.append(job)  # one batch span linking them all, when the batch ends

    # -- replies ----------------------------------------------------------------------

    def _flush_text(self, job: _Job, *, keep_last: bool = False) -> str:
        """Send the job's held text as Deltas, each within the reply channel's message size.

        With ``keep_last`` the final piece is returned instead of sent, to ride in the Finished.
        """
        text = "".join(job.pending)
        job.pending.clear()
        pieces = [text[start : start + MAX_DELTA_CHARS] for start in range(0, len(text), MAX_DELTA_CHARS)]
        last = pieces.pop() if keep_last and pieces else ""
        for piece in pieces:
            self._reply(job.submit, Delta(job.submit.request_id, job.seq, piece))
            job.seq += 1
            if self.spans is not None:
                if job.deliveries is None:
                    job.deliveries = []
                if len(job.deliveries) < MAX_DELIVERY_EVENTS:
                    job.deliveries.append(time.monotonic_ns())
        return last

    def _fail(self, submit: Submit, seq: int, error: ShmgateError) -> None:
        self._reply(submit, failed_reply(submit.request_id, seq, error))

    def _fail_unreadable(self, submit: Submit, exc: Exception) -> None:
        """One request's tensors raised while being copied or prepared: release and fail that request alone."""
        log.warning("request %x: its tensors could not be read: %r", submit.request_id, exc)
        self._reply(submit, Released(submit.request_id))
        self._fail(submit, 0, DescriptorError(f"the request's tensors could not be read: {type(exc).__name__}"))

    def _invalid_message(self, what: object) -> None:
        """A message on the request channel that is not a valid Submit: answer it if we can tell whom.

        A descriptor that fails to decode (e.g. a negative dimension) still usually carries its
        request id and reply slot in its first fields; the frontend then gets an error at once
        instead of waiting for the request's deadline.
        """
        data = getattr(what, "data", None)
        log.warning("dropped an invalid message on the request channel: %r", what)
        if not isinstance(data, bytes):
            return
        try:
            fields = msgspec.msgpack.decode(data)
        except Exception:
            return
        if not (isinstance(fields, list) and len(fields) >= 3 and fields[0] == "s"):
            return
        request_id, reply_slot = fields[1], fields[2]
        if not (isinstance(request_id, int) and isinstance(reply_slot, int)):
            return
        if not (0 <= request_id < 2**63 and 0 <= reply_slot < self.link.n_frontends()):
            return
        message = failed_reply(request_id, 0, DescriptorError("the request's descriptor could not be decoded"))
        self._reply_to(reply_slot, message)

    def _reply(self, submit: Submit, message: object) -> None:
        self._reply_to(submit.reply_slot, message)

    def _reply_to(self, slot: int, message: object) -> None:
        link = self.link
        if slot >= link.n_frontends():
            return  # a forged or corrupt descriptor: nobody to answer
        if self.step_clock is not None and threading.get_ident() == self._loop_thread:
            try:
                link.send_reply(slot, message, 0.0)
                return
            except ChannelFull:  # a wait for a slow reader is not a step: the stall timeout applies
                self.step_clock.idle()
        for _ in range(3):
            try:
                link.send_reply(slot, message, REPLY_TIMEOUT_S)
                return
            except ChannelFull:
                if not link.frontend_alive(slot):
                    return  # the frontend is gone; its successor ignores old request ids anyway
        log.warning("dropped a reply: frontend %d is alive but not reading its channel", slot)

    def _drain_cancels(self) -> None:
        self._cancels_read_at = time.monotonic()
        self._read_cancels()
        self._drop_held()
        with self._cancel_lock:
            if self._cancelled and self._jobs:
                for job in self._jobs.values():
                    item = job.item
                    if item is not None and not item.cancelled:
                        if (job.submit.reply_slot, item.request_id) in self._cancelled:
                            item.cancelled = True
                            self.backend.abort(item.key)  # it ends at the next step boundary
            if len(self._cancelled) > 10_000:
                self._cancelled.clear()  # cancels of requests that finished before they arrived

    def _read_cancels(self) -> None:
        """Take every Cancel off the control queue into ``_cancelled`` (either thread: the set is locked)."""
        while True:
            try:
                message = self.link.try_receive_control()
            except msgspec.DecodeError:
                continue  # a malformed message was taken off the queue: the next one may be fine
            except Exception:
                log.exception("reading the control queue failed; cancels are read again at the next step")
                break  # a queue that fails to read would fail again: never spin here
            if message is None:
                break
            if isinstance(message, Cancel):
                with self._cancel_lock:
                    self._cancelled.add((message.reply_slot, message.request_id))

    def _hold(self, job: _Job) -> bool:
        """Note a job the prefetch thread took as waiting for admission; False (answered) when its Cancel came
        already, between the claim's look (``_start_copy``) and now."""
        key = (job.submit.reply_slot, job.submit.request_id)
        with self._cancel_lock:
            if key not in self._cancelled:
                self._held[key] = job
                return True
            self._cancelled.discard(key)
        self._fail(job.submit, 0, Cancelled("the client cancelled the request"))
        return False

    def _drop_held(self) -> None:
        """Answer at once the waiting jobs (taken, not admitted) whose client hung up; they are never admitted."""
        with self._cancel_lock:
            if not (self._cancelled and self._held):
                return
            keys = self._cancelled & self._held.keys()
            dropped = [self._held.pop(key) for key in keys]
            self._cancelled -= keys
        for job in dropped:
            self._fail(job.submit, 0, Cancelled("the client cancelled the request"))

    def _watch_held(self) -> None:
        """The prefetch thread, while its batch waits for the model (held open in the batcher, or prepared in
        the hand-off): read cancels and drop the waiting jobs they name. The main thread reads cancels only
        between steps, and a backend that runs a batch whole makes one step of it: a request whose client
        hung up while it waited behind a long batch was answered only when that batch ended."""
        self._read_cancels()
        self._drop_held()


def _public_id(options: WorkerOptions) -> str:
    """The id this worker serves under, known before its backend loads (the spec's, or the served name)."""
    try:
        return parse_model_spec(options.model, options.served_model_name).public_id
    except ValueError:
        return options.model  # load_backend reports the unknown spec as the configuration error it is


def _visible_gpus(device: str) -> int:
    """GPUs this process sees, counted only when a GPU was asked for (CPU workers never touch CUDA)."""
    return torch.cuda.device_count() if device.startswith("cuda") else 0


def run_worker(
    *,
    options: WorkerOptions,
    instance_id: str | None,
    label: str,
    attach_wait_s: float,
    diagnostics: DiagnosticOptions = NO_DIAGNOSTICS,
) -> int:
    """Entry point of ``python -m shmgate.worker`` / ``shmgate worker``. Returns an exit code.

    The configuration (device, model spec, the model's extra, the gateway's model) is checked before
    a slot is claimed or weights are loaded: each mistake is one line and ``EXIT_CONFIG``, which
    ``shmgate serve`` turns into a stop with that line instead of a restart loop.
    """
    from shmgate.shared.instance import find_instance

    follow_supervisor()
    try:
        check_device(options.device)
        spec = resolve_model(options.model, options.served_model_name)
    except ValueError as exc:
        return _configuration_error(str(exc))
    try:
        if instance_id is None:
            instance_id = find_instance(label, wait_s=attach_wait_s)
        instance = Instance.attach(instance_id)
    except SetupError as exc:
        log.error("%s", exc)
        return EXIT_USAGE
    gateway_models = instance.segment.served_models
    if gateway_models and spec.public_id not in gateway_models:
        instance.segment.note_refused_worker(spec.public_id)  # the gateway logs it too
        instance.close()
        served = ", ".join(repr(m) for m in gateway_models)
        return _configuration_error(
            f"this worker serves {spec.public_id!r} (--model {options.model}) but the gateway it attaches to "
            f"(instance {instance_id}) serves {served}; start it with one of the gateway's --model "
            "(and --served-model-name), or attach it to another gateway with --label"
        )
    try:
        worker = Worker(instance, options, diagnostics=diagnostics)
    except SetupError as exc:
        log.error("%s", exc)
        instance.close()
        return EXIT_USAGE
    except (ValueError, OSError, ImportError) as exc:
        # An unknown model or dtype, a missing model directory or extra, a model id too long:
        # restarting cannot help.
        instance.close()
        return _configuration_error(str(exc))
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop())
    signal.signal(signal.SIGINT, lambda *_: worker.request_stop())
    try:
        worker.run()
    finally:
        worker.close()
        instance.close()
    return worker.exit_code


def _configuration_error(message: str) -> int:
    """Say what is wrong in one line on stderr (the supervisor quotes it) and return ``EXIT_CONFIG``."""
    print(f"shmgate worker: configuration error: {message}", file=sys.stderr, flush=True)
    return EXIT_CONFIG
