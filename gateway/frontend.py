"""One frontend's side of the data path: images -> arena -> descriptor -> replies -> client.

Who runs this: every frontend process, one ``Frontend`` per process, on its
event loop. The loop never blocks (invariant 3): decoding, cache look-ups
(which may wait on the index semaphore) and prompt building run in a thread
pool; channels are awaited through their file descriptors.

Life of a request (``RequestState``), every step owned by this class:

    admit      in-flight bound, a ready worker, instance not draining   else 429/503
    resolve    each image: cache hit (no decode) or decode into the arena; held
    submit     descriptor on the shared request channel (waits for space, bounded)
    claimed    a worker took it (Claimed): we now know whom to watch
    released   the worker copied the tensors out (Released)
    streaming  Delta* -> the client
    terminal   Finished / Failed -> holds released, state removed

Nothing is lost silently (invariant 5): the watchdog checks, ten times a
second, that every claimed request's worker is alive. A request whose worker
died before producing output is resubmitted (its tensors are still held); one
that had streamed output ends with an in-band error. A request taken off the
queue but never claimed (its worker died between the two, e.g. a worker
container SIGKILLed) is resubmitted too: see ``_check_taken``. Unclaimed
requests past their deadline fail with a timeout. A client that goes away marks its request
abandoned: a Cancel goes to its worker and the holds are released when the
worker's terminal message (or its death) arrives, never earlier, because the
worker may still be reading the arena.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.intake import LOOP_HASH_MAX_BYTES, ChatRequest, EncodedImage, image_bytes, key_material
from gateway.metrics import Counter, FrontendStats
from gateway.preprocess.base import ImageTensorSpec, Preprocessor, PromptInputs
from gateway.stages import RequestTiming, StageRecorder
from shared.arena import Partition
from shared.cache import AllocateFn, ContentCache, TensorGroup, content_key
from shared.cache_index import CacheIndex
from shared.channels import AsyncQueueReader, AsyncSender, Queue
from shared.errors import ChannelFull, Overloaded, PeerDied, RequestTimeout, ShmgateError, UnknownModel
from shared.instance import DEAD_AFTER_S, Instance
from shared.locks import HolderKind
from shared.segment import Heartbeat, InstanceState, LockId, SlotState, now_ns
from shared.wire import (
    INLINE_MAX_BYTES,
    INLINE_TENSOR,
    MAX_SUBMIT_TEXT_CHARS,
    Cancel,
    Claimed,
    Delta,
    Failed,
    Finished,
    Released,
    Submit,
    TensorRef,
    Vector,
    failed_reply,
)

__all__ = ["Frontend", "FrontendLimits", "RequestState"]

log = logging.getLogger("shmgate.frontend")

# A request whose worker died twice is not tried a third time: a request that kills every
# worker it reaches would otherwise take the node's workers down one after another.
MAX_ATTEMPTS = 2
WATCHDOG_INTERVAL_S = 0.1
PROGRESS_INTERVAL_S = 0.2  # how often the event loop stamps progress_ns (a loop that cannot, is stalled)
GRACE_S = 5.0  # how long past its deadline an unanswered request may hold arena space
# How long a request known to be off the queue may stay unclaimed before its taker counts as dead: a live
# worker claims within microseconds of taking (a starved thread, milliseconds); heartbeats need as long.
TAKEN_UNCLAIMED_S = DEAD_AFTER_S


@dataclass(frozen=True)
class FrontendLimits:
    max_in_flight: int = 256
    request_timeout_s: float = 60.0
    max_pixels: int = 40_000_000
    decode_threads: int = 2


@dataclass(eq=False)
class RequestState:
    request_id: int
    submit: Submit
    groups: list[TensorGroup]
    started: float
    events: asyncio.Queue[Delta | Vector | Finished | Failed] = field(default_factory=asyncio.Queue)
    worker: tuple[int, int] | None = None  # (slot, epoch) of the claiming worker
    produced_output: bool = False
    abandoned: bool = False
    done: bool = False
    released: bool = False
    send_seq: int = 0  # this frontend's count of sends when its descriptor went onto the queue (0: not yet)
    taken_at: float | None = None  # when we learned it left the queue while still unclaimed (monotonic)
    timing: RequestTiming = field(default_factory=RequestTiming)  # per-stage latency (gateway/stages.py)


class Frontend:
    def __init__(self, instance: Instance, slot: int, preprocessor: Preprocessor, limits: FrontendLimits) -> None:
        self.instance = instance
        self.slot = slot
        self.preprocessor = preprocessor
        self.limits = limits
        self.segment = instance.segment
        self._states: dict[int, RequestState] = {}
        self._resolving = 0  # admitted requests still resolving their images (not in _states yet)
        self._counter = 0
        # Our sends in queue order (one event loop sends), and how far that order is known to have left the
        # queue: the request queue is FIFO, so a claimed descriptor proves every one we sent before it was
        # taken too, and an empty queue proves every one sent so far was (``_check_taken``).
        self._send_seq = 0
        self._taken_seq = 0
        self._pool = ThreadPoolExecutor(max_workers=limits.decode_threads, thread_name_prefix="decode")
        self._control: dict[int, Queue] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self._progress_handle: asyncio.TimerHandle | None = None
        self.epoch = 0

    # -- life cycle ---------------------------------------------------------------

    async def start(self) -> None:
        # Both steps wait on semaphores (a dead predecessor may hold one until it is repaired),
        # so they run in a thread: the event loop never waits on a semaphore (invariant 3).
        index = await asyncio.to_thread(self._take_over_slot)
        seg = self.segment
        index_lock = self.instance.lock(LockId.INDEX, (HolderKind.FRONTEND, self.slot, self.epoch))
        self.cache = ContentCache(Partition(seg, self.slot), index, index_lock, self.epoch)
        self.stats = FrontendStats(seg, self.slot)
        self.stages = StageRecorder(seg, self.slot)
        self.stats.set(Counter.ARENA_SIZE_BYTES, self.cache.partition.size)
        self.stats.set(Counter.ARENA_USED_BYTES, 0)
        self.stats.set(Counter.ARENA_HELD_BYTES, 0)  # a dead predecessor's holds died with it
        self.stats.set(Counter.IN_FLIGHT, 0)
        self._requests = self.instance.request_queue()
        self._sender = AsyncSender(self._requests)
        self._replies = self.instance.reply_queue(self.slot)
        while self._replies.try_receive() is not None:
            pass  # answers addressed to our predecessor
        self._reader = AsyncQueueReader(self._replies, self._on_reply, self._on_reply_error)
        self._reader.start()
        self._watchdog = asyncio.create_task(self._watch())
        self._stamp_progress()
        seg.frontends[self.slot]["state"] = SlotState.READY

    def _stamp_progress(self) -> None:
        """A callback on the event loop itself: it runs only while the loop turns.

        The heartbeat thread says the process exists; this says the loop serving HTTP is not
        blocked (a synchronous call stuck on it stops this stamp, and the supervisor replaces us).
        """
        self.segment.frontends[self.slot]["progress_ns"] = now_ns()
        self._progress_handle = asyncio.get_running_loop().call_later(PROGRESS_INTERVAL_S, self._stamp_progress)

    def _take_over_slot(self) -> CacheIndex:
        """Claim our slot (new epoch), start beating, and purge a predecessor's cache entries."""
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
        return index

    async def stop(self) -> None:
        self.segment.frontends[self.slot]["state"] = SlotState.DRAINING
        if self._watchdog:
            self._watchdog.cancel()
        if self._progress_handle:
            self._progress_handle.cancel()
        self._reader.stop()
        self._sender.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._heartbeat.stop()
        if int(self.segment.frontends[self.slot]["epoch"]) == self.epoch:
            self.segment.frontends[self.slot]["state"] = SlotState.FREE

    # -- readiness ------------------------------------------------------------------

    def draining(self) -> bool:
        return int(self.segment.header[0]["state"]) != InstanceState.RUNNING

    def queue_depth(self) -> int:
        """Descriptors waiting on the shared request channel (for /metrics)."""
        return self._requests.current_messages()

    def ready(self) -> bool:
        return not self.draining() and bool(self.segment.live_workers(DEAD_AFTER_S, self.preprocessor.model))

    # -- the request path ---------------------------------------------------------------

    async def submit(self, chat: ChatRequest) -> RequestState:
        """Admit, resolve images, build and send the descriptor. Raises ShmgateError."""
        if chat.model != self.preprocessor.model:
            raise UnknownModel(f"model {chat.model[:100]!r} is not served here; GET /v1/models lists it",
                               param="model")
        if self.draining():
            raise Overloaded("the server is shutting down", retry_after_s=2.0)
        if len(self._states) + self._resolving >= self.limits.max_in_flight:
            raise Overloaded("too many requests in flight; retry shortly", retry_after_s=1.0, status_hint=429)
        if not self.segment.live_workers(DEAD_AFTER_S, self.preprocessor.model):
            raise Overloaded("no model worker is ready yet", retry_after_s=2.0)
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        groups: list[TensorGroup] = []
        self._set_resolving(+1)  # admitted: counts against the bound while its images decode
        try:
            await self._resolve_images(chat.images, chat.image_params, groups)
            specs: list[ImageTensorSpec] = [{r.name: (r.dtype, r.shape) for r in g.refs} for g in groups]
            if self.preprocessor.prompt_is_cheap:
                prompt = self.preprocessor.build_prompt(chat.messages, specs)
            else:
                prompt = await loop.run_in_executor(self._pool, self.preprocessor.build_prompt, chat.messages, specs)
            inline = prompt.inline
            if len(inline) > INLINE_MAX_BYTES:
                groups.append(await loop.run_in_executor(self._pool, self._inline_group, prompt))
                inline = b""
            request_id = self._next_request_id()
            deadline_ns = now_ns() + int(self.limits.request_timeout_s * 1e9)
            refs: list[TensorRef] = [ref for g in groups for ref in g.refs]
            submit = Submit(
                request_id,
                self.slot,
                self.preprocessor.model,
                tuple(refs),
                inline,
                chat.params,
                deadline_ns,
                0,
                prompt.text[:MAX_SUBMIT_TEXT_CHARS],
                task=chat.task,
            )
            state = RequestState(request_id, submit, groups, started)
            self.stages.submitted(state.timing, started)
            self._states[request_id] = state
            self.stats.set(Counter.IN_FLIGHT, len(self._states))
        except BaseException:
            for group in groups:
                self.cache.release(group)
            self._sync_cache_stats()
            raise
        finally:
            self._set_resolving(-1)  # from here on it is on the request queue (or failed)
        try:
            await self._sender.send(submit, min(10.0, self.limits.request_timeout_s))
        except ChannelFull:
            self._finish(state)
            raise Overloaded("every worker is busy and the request queue is full", retry_after_s=1.0) from None
        except BaseException:
            self._finish(state)
            raise
        self._sent(state)
        return state

    def _next_request_id(self) -> int:
        self._counter += 1
        return (self.epoch << 40) | self._counter

    def _sent(self, state: RequestState) -> None:
        """Number a send that just succeeded (no await since): numbers follow our sends' queue order."""
        self._send_seq += 1
        state.send_seq = self._send_seq
        state.taken_at = None

    def _set_resolving(self, change: int) -> None:
        """Count admitted requests still decoding, and publish the count in our slot row.

        Workers read it (``Segment.preparing_requests``): a batch waits its window only for
        requests known to be on their way, so a lone request runs at once.
        """
        self._resolving += change
        self.segment.frontends[self.slot]["preparing"] = self._resolving

    async def _resolve_images(
        self, images: list[bytes | EncodedImage], params: list[str], groups: list[TensorGroup]
    ) -> None:
        """Append each image's held tensor group to ``groups``, in order. Raises the first failure.

        Local cache hits are taken on the event loop, where the hit itself only takes a process-local
        mutex. The content key is computed either way: for a data URL it hashes the base64 text
        (~0.09 ms for a 150 KB photo, ``python bench/loop_costs.py``), so a hit costs no base64
        decode at all, and doing it here saves a pool hop of ~0.1 ms CPU for the image and one for
        the prompt. Up to LOOP_HASH_MAX_BYTES that is at most ~0.5 ms of loop time; larger images,
        remote hits and misses (base64 decode included) run in the decode pool.
        Groups acquired before a failure are still appended, so the caller releases them.
        """
        loop = asyncio.get_running_loop()
        cache_params = self.preprocessor.cache_params()
        slots: list[TensorGroup | asyncio.Future[TensorGroup]] = []
        for image, param in zip(images, params, strict=True):
            group = None
            key = None
            material = key_material(image)
            if len(material) <= LOOP_HASH_MAX_BYTES:
                key = content_key(material, cache_params)
                group = self.cache.try_hit(key)
            if group is None:
                slots.append(loop.run_in_executor(self._pool, self._resolve_image, image, param, key))
            else:
                slots.append(group)
        futures = [s for s in slots if isinstance(s, asyncio.Future)]
        if futures:
            await asyncio.gather(*futures, return_exceptions=True)
        failure: BaseException | None = None
        for slot in slots:
            if isinstance(slot, TensorGroup):
                groups.append(slot)
            elif slot.exception() is None:
                groups.append(slot.result())
            elif failure is None:
                failure = slot.exception()
        if failure is not None:
            raise failure

    def _resolve_image(self, image: bytes | EncodedImage, param: str, key: bytes | None) -> TensorGroup:
        """Thread pool: the cached tensors of one image, decoding (base64, then pixels) only on a miss.

        A decode error names ``param``, the request field the image came from (data URL or fetched).
        """
        if key is None:
            key = content_key(key_material(image), self.preprocessor.cache_params())

        def make(allocate: AllocateFn) -> None:
            self.preprocessor.preprocess_image(image_bytes(image), allocate, max_pixels=self.limits.max_pixels)

        try:
            group, _ = self.cache.acquire(key, make)
        except ShmgateError as exc:
            if exc.param is None:
                exc.param = param  # which image of the request could not be decoded
            raise
        return group

    def _inline_group(self, prompt: PromptInputs) -> TensorGroup:
        payload = prompt.inline

        def make(allocate: Any) -> None:
            out = allocate(INLINE_TENSOR, "uint8", (len(payload),))
            out[:] = memoryview(payload)

        return self.cache.acquire_private(make)

    async def events(self, state: RequestState) -> AsyncIterator[Delta | Vector | Finished | Failed]:
        """The request's output, ending with exactly one Finished or Failed."""
        while True:
            event = await state.events.get()
            yield event
            if isinstance(event, (Finished, Failed)):
                return

    def abandon(self, state: RequestState) -> None:
        """The client went away before the end: cancel the work, release when the worker is done."""
        if state.done:
            return
        state.abandoned = True
        self.stats.add(Counter.CANCELLED)
        if state.worker is not None:
            self._send_cancel(state)

    # -- replies ------------------------------------------------------------------------

    def _on_reply(self, message: object) -> None:
        request_id = getattr(message, "request_id", None)
        state = self._states.get(request_id) if request_id is not None else None
        if state is None or state.done:
            return  # a predecessor's request, or one that already ended
        if isinstance(message, Claimed):
            state.worker = (message.worker_slot, message.worker_epoch)
            self.stages.claimed(state.timing, message)
            self._taken_seq = max(self._taken_seq, state.send_seq)
            if state.abandoned:
                self._send_cancel(state)
        elif isinstance(message, Released):
            state.released = True
        elif isinstance(message, (Delta, Vector)):
            state.produced_output = True
            state.events.put_nowait(message)
        elif isinstance(message, (Finished, Failed)):
            if isinstance(message, Finished):
                self.stages.finished(state.timing, message)
            if isinstance(message, Finished) and message.text:
                state.produced_output = True
                state.events.put_nowait(Delta(message.request_id, message.seq, message.text))
            state.events.put_nowait(message)
            self._finish(state)

    def _on_reply_error(self, exc: BaseException) -> None:
        log.warning("bad message on the reply channel: %r", exc)

    def _finish(self, state: RequestState) -> None:
        if state.done:
            return
        state.done = True
        self._states.pop(state.request_id, None)
        for group in state.groups:
            self.cache.release(group)
        state.groups = []
        self.stats.set(Counter.IN_FLIGHT, len(self._states))
        self._sync_cache_stats()

    def _sync_cache_stats(self) -> None:
        s = self.cache.stats
        self.stats.set(Counter.CACHE_HITS, s.hits)
        self.stats.set(Counter.CACHE_REMOTE_HITS, s.remote_hits)
        self.stats.set(Counter.CACHE_MISSES, s.misses)
        self.stats.set(Counter.CACHE_EVICTIONS, s.evictions)
        self.stats.set(Counter.ARENA_USED_BYTES, self.cache.partition.used_bytes)
        self.stats.set(Counter.ARENA_HELD_BYTES, self.cache.held_bytes)

    def _fail(self, state: RequestState, error: ShmgateError) -> None:
        state.events.put_nowait(failed_reply(state.request_id, 0, error))
        self._finish(state)

    def _send_cancel(self, state: RequestState) -> None:
        assert state.worker is not None
        slot = state.worker[0]
        if slot >= self.segment.layout.n_workers:
            return
        queue = self._control.get(slot)
        if queue is None:
            queue = self._control[slot] = self.instance.control_queue(slot)
        queue.try_send(Cancel(state.request_id, self.slot))  # best effort: a full queue means a busy worker

    # -- watchdog -----------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            try:
                await self._check_requests()
            except Exception:
                log.exception("watchdog pass failed; continuing")

    async def _check_requests(self) -> None:
        if not self._states:
            return
        self._reader.drain()  # answers already queued count before any verdict
        await self._check_taken()
        now = now_ns()
        seg = self.segment
        verdicts: dict[tuple[int, int], bool] = {}
        for state in list(self._states.values()):
            if state.done:
                continue
            if state.worker is not None:
                alive = verdicts.get(state.worker)
                if alive is None:
                    alive = verdicts[state.worker] = seg.slot_alive(seg.workers, state.worker[0], DEAD_AFTER_S,
                                                                    state.worker[1])
                if not alive:
                    await self._retry(state, "lost its worker before any answer",
                                      failure="the model worker died while serving this request")
                    continue
            if now > state.submit.deadline_ns + (int(GRACE_S * 1e9) if state.worker else 0):
                if state.worker is not None:
                    self._send_cancel(state)
                self._fail(state, RequestTimeout("the request timed out before the model answered"))

    async def _check_taken(self) -> None:
        """Resubmit requests that left the queue but were never claimed: their taker died in between.

        A worker claims a request right after taking it off the queue, but a worker killed between the two
        (SIGKILL of its container: nobody marks its slot dead, and it never said which request it held)
        leaves a request that nothing would answer before its deadline. We cannot see into the queue, but
        it is FIFO: a request is known to be off it once one we sent later was claimed, or once the queue
        was seen empty after its send. Known off the queue and still unclaimed after TAKEN_UNCLAIMED_S,
        it is resubmitted under a new request id, so that if its taker was only slow, not dead, its late
        answers go to an id nobody waits for (the arena generation checks keep its reads safe), rather
        than into the retried request's stream.
        """
        unclaimed = [s for s in self._states.values() if s.worker is None and s.send_seq and not s.done]
        if not unclaimed:
            return
        sent_so_far = self._send_seq
        if self._requests.current_messages() == 0:
            self._taken_seq = max(self._taken_seq, sent_so_far)
        now = time.monotonic()
        for state in unclaimed:
            if state.send_seq > self._taken_seq:
                continue  # may still be on the queue
            if state.taken_at is None:
                state.taken_at = now
            elif now - state.taken_at > TAKEN_UNCLAIMED_S and not state.done and state.worker is None:
                await self._retry(state, f"left the queue but no worker claimed it in {TAKEN_UNCLAIMED_S:.0f} s",
                                  failure="the model worker that took this request died before claiming it")

    async def _retry(self, state: RequestState, why: str, *, failure: str) -> None:
        """Send a request whose worker died again, as its next attempt, under a new id; or fail it.

        It fails (``failure``, in-band ``worker_died``) when output already streamed, the client left,
        or this was its last attempt. The new id matters: the worker we gave up on may only be paused
        (SIGSTOP) or slow, and answer later; its replies carry the old id, which no longer matches, so
        it can never add a duplicate answer to the retried request's stream (the arena generation
        checks keep its reads safe).
        """
        if state.produced_output or state.abandoned or state.submit.attempt + 1 >= MAX_ATTEMPTS:
            self._fail(state, PeerDied(failure))
            return
        old_id = state.request_id
        self._states.pop(old_id, None)
        state.request_id = self._next_request_id()
        self._states[state.request_id] = state
        state.submit = msgspec.structs.replace(
            state.submit, request_id=state.request_id, attempt=state.submit.attempt + 1
        )
        state.worker = None
        state.released = False
        state.send_seq = 0
        self.stats.add(Counter.RETRIES)
        log.warning("request %x %s; retrying as %x (attempt %d)", old_id, why, state.request_id,
                    state.submit.attempt)
        try:
            await self._sender.send(state.submit, 5.0)
        except ChannelFull:
            self._fail(state, Overloaded("the request could not be retried: every worker is busy"))
            return
        self._sent(state)
