"""Reply routing for one frontend: worker messages -> request states, and the watchdog.

Split out of gateway/frontend.py. Nothing is lost silently (invariant 5): the
watchdog checks, ten times a second, that every claimed request's worker is alive. A request
whose worker died before producing output is resubmitted (its tensors are still held); one
that had streamed output ends with an in-band error. A request taken off the queue but never
claimed (its worker died between the two, e.g. a worker container SIGKILLed) is resubmitted too:
see ``_check_taken``. Requests past their deadline fail with a timeout. A client that goes away
marks its request abandoned: a Cancel goes to its worker and the holds are released when the
worker's terminal message (or its death) arrives, never earlier, because the worker may still be
reading the arena.

Everything goes through the frontend's transport link (shared/transport): the POSIX one in
production, the in-memory one in tests/test_reply_routing.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec

from shmgate.gateway.images import ImageResolver
from shmgate.gateway.metrics import Counter, FrontendStats
from shmgate.gateway.request_state import Phase, RequestState
from shmgate.gateway.stages import StageRecorder
from shmgate.shared.errors import ChannelFull, Overloaded, PeerDied, RequestTimeout, ShmgateError
from shmgate.shared.transport.base import FrontendLink
from shmgate.shared.vocabulary import DEAD_AFTER_S, now_ns
from shmgate.shared.wire import Cancel, Claimed, Delta, Failed, Finished, Released, TokenLogprobs, Vector, failed_reply

__all__ = ["CANCEL_RESEND_S", "GRACE_S", "MAX_ATTEMPTS", "TAKEN_UNCLAIMED_S", "WATCHDOG_INTERVAL_S", "ReplyRouter"]

log = logging.getLogger("shmgate.frontend")

# A request whose worker died twice is not tried a third time: a request that kills every
# worker it reaches would otherwise take the node's workers down one after another.
MAX_ATTEMPTS = 2
# How long a retried request's send waits for room on a full queue before it looks again at whether the
# model's workers are alive (then they are busy: it fails) or all restarting (it waits on, to its deadline).
RETRY_SEND_S = 5.0
WATCHDOG_INTERVAL_S = 0.1
GRACE_S = 5.0  # how long past its deadline an unanswered request may hold arena space
# How long a request known to be off the queue may stay unclaimed before its taker counts as dead: a live
# worker claims within microseconds of taking (a starved thread, milliseconds); heartbeats need as long.
TAKEN_UNCLAIMED_S = DEAD_AFTER_S
# An abandoned request whose worker has not ended it this long after its Cancel gets the Cancel again
# (the control queue may have been full). A worker ends a cancelled request within a step.
CANCEL_RESEND_S = 0.5


class ReplyRouter:
    """The frontend's requests in flight: routes replies to them, watches their workers, retries or fails."""

    def __init__(
        self,
        link: FrontendLink,
        images: ImageResolver,
        stats: FrontendStats,
        next_request_id: Callable[[], int],
        stages: StageRecorder,
        *,
        taken_unclaimed_s: float = TAKEN_UNCLAIMED_S,
        grace_s: float = GRACE_S,
    ) -> None:
        self.link = link
        self.images = images
        self.stats = stats
        self.stages = stages
        self._next_request_id = next_request_id
        # Both tunable by tests on the in-memory transport (tests/test_reply_routing.py).
        self.taken_unclaimed_s = taken_unclaimed_s
        self.grace_ns = int(grace_s * 1e9)
        self.states: dict[int, RequestState] = {}
        # Our sends numbered as they complete, and how far that numbering is known to have left the queue.
        # The request queue is FIFO, so a claimed descriptor proves taken every one of ours that was on
        # the queue before its send began (``ahead_seq``), and an empty queue proves every completed one
        # was (``_check_taken``). Sends that wait side by side (several sender threads blocked on a full
        # queue) may enter it in another order than they complete, so one claim proves nothing about them.
        # Numbered per lane: the queue is FIFO within a priority only. An interactive claim proves taken
        # the interactive sends ahead of it; a bulk claim those of both lanes (the kernel delivers every
        # interactive descriptor before a bulk one).
        self._send_seq = [0, 0]  # [interactive, bulk]
        self._taken_seq = [0, 0]
        self._watchdog: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.link.start_replies(self.on_reply, self._on_reply_error)
        self._watchdog = asyncio.create_task(self._watch())

    def stop(self) -> None:
        if self._watchdog:
            self._watchdog.cancel()
        self.link.stop_replies()

    def add(self, state: RequestState) -> None:
        self.states[state.request_id] = state
        self.stats.set(Counter.IN_FLIGHT, len(self.states))

    def sending(self, state: RequestState) -> None:
        """A send begins: what we have on the queue now is ahead of it, whatever happens to the sends beside it."""
        state.ahead_seq = self._send_seq[0]
        state.ahead_bulk_seq = self._send_seq[1]

    def sent(self, state: RequestState) -> None:
        """Number a send that just succeeded (no await since): its descriptor is on the queue."""
        lane = int(state.submit.bulk)
        self._send_seq[lane] += 1
        state.send_seq = self._send_seq[lane]
        state.taken_at = None

    def abandon(self, state: RequestState) -> None:
        """The client went away before the end: cancel the work, release when the worker is done."""
        if state.done or state.abandoned:
            return
        state.to(Phase.ABANDONED)
        self.stats.add(Counter.CANCELLED)
        if state.trace is not None:
            state.trace.abandoned()
        if state.worker is not None:
            self._send_cancel(state)

    # -- replies ------------------------------------------------------------------------

    def on_reply(self, message: object) -> None:
        request_id = getattr(message, "request_id", None)
        state = self.states.get(request_id) if request_id is not None else None
        if state is None or state.done:
            return  # a predecessor's request, or one that already ended
        if isinstance(message, Claimed):
            state.worker = (message.worker_slot, message.worker_epoch)
            self.stages.claimed(state.timing, message)
            if state.trace is not None:
                state.trace.claimed(message)
            self._taken_seq[0] = max(self._taken_seq[0], state.ahead_seq)
            if state.submit.bulk:
                self._taken_seq[1] = max(self._taken_seq[1], state.ahead_bulk_seq)
            if state.abandoned:
                self._send_cancel(state)
            else:
                state.to(Phase.CLAIMED)
        elif isinstance(message, Released):
            if state.phase is Phase.CLAIMED:
                state.to(Phase.RELEASED)
        elif isinstance(message, (Delta, Vector, TokenLogprobs)):
            if not state.abandoned:
                state.to(Phase.STREAMING)
            state.events.put_nowait(message)
        elif isinstance(message, (Finished, Failed)):
            if isinstance(message, Finished):
                self.stages.finished(state.timing, message)
                if state.abandoned:  # how far its worker got for nobody: the cost of a late Cancel
                    self.stats.add(Counter.CANCELLED_TOKENS, message.completion_tokens)
            if isinstance(message, Finished) and message.text:
                if not state.abandoned:
                    state.to(Phase.STREAMING)
                state.events.put_nowait(Delta(message.request_id, message.seq, message.text))
            state.events.put_nowait(message)
            if state.trace is not None:
                state.trace.ended(message)
            self.finish(state)

    def _on_reply_error(self, exc: BaseException) -> None:
        log.warning("bad message on the reply channel: %r", exc)

    def finish(self, state: RequestState) -> None:
        if state.done:
            return
        state.to(Phase.DONE)
        if state.trace is not None:
            state.trace.ended(None)  # ended here without a reply (a send that failed): the attempt ends too
        self.states.pop(state.request_id, None)
        groups, state.groups = state.groups, []
        self.stats.set(Counter.IN_FLIGHT, len(self.states))
        self.images.release(groups)

    def fail(self, state: RequestState, error: ShmgateError) -> None:
        message = failed_reply(state.request_id, 0, error)
        state.events.put_nowait(message)
        if state.trace is not None:
            state.trace.ended(message)
        self.finish(state)

    def _send_cancel(self, state: RequestState) -> None:
        assert state.worker is not None
        state.cancel_sent_at = time.monotonic()
        self.link.send_cancel(state.worker[0], Cancel(state.request_id, self.link.slot))

    def _resend_cancel(self, state: RequestState, now: float) -> None:
        """Send an abandoned request's Cancel again while its worker has not ended it.

        A worker's control queue is short (a few messages) and sending is best effort, so a burst
        of hang-ups (a dozen clients leaving at once) can overflow it and lose a Cancel, and the
        request would run for nobody until its deadline. The worker ignores a repeat.
        """
        if state.worker is not None and now - state.cancel_sent_at >= CANCEL_RESEND_S:
            self._send_cancel(state)

    # -- watchdog -----------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            try:
                await self.check()
            except Exception:
                log.exception("watchdog pass failed; continuing")

    async def check(self) -> None:
        """One watchdog pass (tests call it directly)."""
        if not self.states:
            return
        self.link.drain_replies()  # answers already queued count before any verdict
        await self._check_taken()
        now = now_ns()
        now_s = time.monotonic()
        verdicts: dict[tuple[int, int], bool] = {}
        for state in list(self.states.values()):
            if state.done:
                continue
            if state.abandoned:
                self._resend_cancel(state, now_s)
            if state.worker is not None:
                alive = verdicts.get(state.worker)
                if alive is None:
                    alive = verdicts[state.worker] = self.link.worker_alive(*state.worker)
                if not alive:
                    await self._retry(
                        state,
                        "lost its worker before any answer",
                        failure="the model worker died while serving this request",
                    )
                    continue
            if now > state.submit.deadline_ns + (self.grace_ns if state.worker else 0):
                if state.worker is not None:
                    self._send_cancel(state)
                self.fail(state, RequestTimeout("the request timed out before the model answered"))

    async def _check_taken(self) -> None:
        """Resubmit requests that left the queue but were never claimed: their taker died in between.

        A worker claims a request right after taking it off the queue, but a worker killed between the two
        (SIGKILL of its container: nobody marks its slot dead, and it never said which request it held)
        leaves a request that nothing would answer before its deadline. We cannot see into the queue, but
        it is FIFO: a request is known to be off it once one whose send began after its send ended was
        claimed, or once the queue was seen empty after its send. Known off the queue and still unclaimed after TAKEN_UNCLAIMED_S,
        it is resubmitted under a new request id, so that if its taker was only slow, not dead, its late
        answers go to an id nobody waits for (the arena generation checks keep its reads safe), rather
        than into the retried request's stream.
        """
        unclaimed = [s for s in self.states.values() if s.worker is None and s.send_seq and not s.done]
        if not unclaimed:
            return
        if self.link.queue_depth() == 0:
            self._taken_seq = [max(t, s) for t, s in zip(self._taken_seq, self._send_seq)]
        now = time.monotonic()
        for state in unclaimed:
            if state.send_seq > self._taken_seq[int(state.submit.bulk)]:
                continue  # may still be on the queue
            if state.taken_at is None:
                state.taken_at = now
            elif now - state.taken_at > self.taken_unclaimed_s and not state.done and state.worker is None:
                await self._retry(
                    state,
                    f"left the queue but no worker claimed it in {self.taken_unclaimed_s:.0f} s",
                    failure="the model worker that took this request died before claiming it",
                )

    async def _retry(self, state: RequestState, why: str, *, failure: str) -> None:
        """Send a request whose worker died again, as its next attempt, under a new id; or fail it.

        It fails (``failure``, in-band ``worker_died``) when output already streamed, the client left,
        or this was its last attempt. The new id matters: the worker we gave up on may only be paused
        (SIGSTOP) or slow, and answer later; its replies carry the old id, which no longer matches, so
        it can never add a duplicate answer to the retried request's stream (the arena generation
        checks keep its reads safe). A queue that stays full fails it as overloaded while the model has a
        live worker; while it has none (every worker killed, replacements starting) the send waits for them,
        up to the request's deadline, and this watchdog pass with it.
        """
        if not state.retryable or state.submit.attempt + 1 >= MAX_ATTEMPTS:
            self.fail(state, PeerDied(failure))
            return
        old_id = state.request_id
        self.states.pop(old_id, None)
        state.request_id = self._next_request_id()
        self.states[state.request_id] = state
        traceparent = state.submit.traceparent
        if state.trace is not None:
            state.trace.retrying(why)
            traceparent = state.trace.attempt(state.request_id, state.submit.attempt + 1)
        state.submit = msgspec.structs.replace(
            state.submit,
            request_id=state.request_id,
            attempt=state.submit.attempt + 1,
            traceparent=traceparent,
            bulk=False,  # a retry goes back as interactive: its line already waited its turn once
        )
        state.worker = None
        state.to(Phase.QUEUED)
        state.send_seq = 0
        self.stats.add(Counter.RETRIES)
        log.warning("request %x %s; retrying as %x (attempt %d)", old_id, why, state.request_id, state.submit.attempt)
        while True:
            self.sending(state)
            try:
                await self.link.send_request(state.submit, RETRY_SEND_S)
                break
            except ChannelFull:
                # A full queue while the model's workers serve: they are busy, and the client hears so. A
                # full queue with none of them alive: they are being restarted (the kill that sent us here
                # may have taken them all) and will drain it; the request waits for them, up to its deadline.
                if self.link.has_live_worker(state.submit.model) or now_ns() >= state.submit.deadline_ns:
                    self.fail(state, Overloaded("the request could not be retried: every worker is busy"))
                    return
        self.sent(state)
