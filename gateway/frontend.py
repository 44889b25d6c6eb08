"""One frontend's side of the data path: images -> arena -> descriptor -> replies -> client.

Who runs this: every frontend process, one ``Frontend`` per process, on its
event loop. The loop never blocks (invariant 3): decoding, cache look-ups
(which may wait on the index semaphore) and prompt building run in a thread
pool; channels are awaited through their file descriptors.

Three parts, one job each: ``ImageResolver`` (gateway/images.py)
turns images into held tensor groups through the content cache; ``Frontend``
(here) admits and dispatches (in-flight bound, a ready worker, the prompt, the
descriptor onto the request queue); ``ReplyRouter`` (gateway/replies.py) routes
replies to requests and runs the watchdog (retry, cancel, timeout, worker
death). A request's life is one state, ``RequestState.phase``
(gateway/request_state.py):

    admit      in-flight bound, a ready worker, instance not draining   else 429/503
    resolve    each image: cache hit (no decode) or decode into the arena; held
    QUEUED     descriptor on the shared request channel (waits for space, bounded)
    CLAIMED    a worker took it (Claimed): we now know whom to watch
    RELEASED   the worker copied the tensors out (Released)
    STREAMING  Delta* -> the client
    DONE       Finished / Failed -> holds released, state removed

All three reach the segment, the queues and the cache only through the
frontend's transport link (shared/transport): POSIX in production, in memory in
unit tests (tests/test_reply_routing.py).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from shmgate.gateway.config import LimitOptions
from shmgate.gateway.images import ImageResolver
from shmgate.gateway.intake import GenerationRequest
from shmgate.gateway.metrics import Counter, FrontendStats
from shmgate.gateway.preprocess.base import ImageTensorSpec, Preprocessor, PromptInputs
from shmgate.gateway.replies import ReplyRouter
from shmgate.gateway.request_context import INTERACTIVE_REQUEST, RequestContext
from shmgate.gateway.request_state import Phase, RequestState
from shmgate.gateway.stages import StageRecorder
from shmgate.gateway.video import VideoLimits
from shmgate.shared.errors import ChannelFull, Overloaded, UnknownModel
from shmgate.shared.stages import Stage
from shmgate.shared.transport.base import BULK, INTERACTIVE, FrontendLink, TensorCache
from shmgate.shared.vocabulary import SlotState, TensorGroup, now_ns
from shmgate.shared.wire import (
    INLINE_GRAMMAR_BYTES,
    INLINE_MAX_BYTES,
    MAX_SUBMIT_TEXT_CHARS,
    Delta,
    Failed,
    Finished,
    Submit,
    TensorRef,
    TokenLogprobs,
    Vector,
)

__all__ = ["Frontend", "FrontendLimits", "Phase", "RequestState"]

PROGRESS_INTERVAL_S = 0.2  # how often the event loop stamps progress_ns (a loop that cannot, is stalled)


_DECLARED = LimitOptions()  # the defaults are the flags' (gateway/config.py), written there once


@dataclass(frozen=True)
class FrontendLimits:
    max_in_flight: int = _DECLARED.max_in_flight
    request_timeout_s: float = _DECLARED.request_timeout_s
    max_pixels: int = _DECLARED.max_pixels
    decode_threads: int = _DECLARED.decode_threads
    # all of this frontend's decodes at once (gateway/decode_budget.py)
    decode_memory_bytes: int = int(_DECLARED.decode_memory_mb * (1 << 20))
    decode_wait_s: float = _DECLARED.decode_wait_s  # how long a decode waits for room in that budget before a 503
    video: VideoLimits = VideoLimits()  # what one video part may hold (gateway/video.py)


class Frontend:
    """Admission and dispatch; owns the link, the image resolver and the reply router.

    It serves every model of the node (one preprocessor each, routed by the request's ``model``);
    each model's requests go to that model's own request queue (the link routes by ``Submit.model``).
    """

    def __init__(
        self,
        link: FrontendLink,
        preprocessor: Preprocessor | Sequence[Preprocessor],
        limits: FrontendLimits,
        *,
        model_in_flight: Mapping[str, int] | None = None,
        model_failed: Callable[[str], bool] | None = None,
        model_cache: Callable[[int], TensorCache] | None = None,
    ) -> None:
        """``model_in_flight``: a model's own bound on this frontend's requests in flight (beyond it, that
        model's clients get 429 while the others are admitted); ``model_failed``: does the supervisor say
        the model's workers failed beyond their restart budget (shared/segment.py ModelState)?
        ``model_cache``: a model's view of this frontend's cache by its model-table row, for the arena
        shares (a model's images evicted for another's only beyond its share: shared/cache.py
        ``ModelShare``), called once the cache exists; None: every model places into the cache as is."""
        self.link = link
        self.slot = link.slot
        served = [preprocessor] if isinstance(preprocessor, Preprocessor) else list(preprocessor)
        self.preprocessor = served[0]  # the first model: the one a one-model frontend serves
        self.preprocessors = {pre.model: pre for pre in served}
        self._model_index = {pre.model: i for i, pre in enumerate(served)}  # its model-table row
        self.model_in_flight = {
            model: n for model, n in (model_in_flight or {}).items() if n < limits.max_in_flight
        }  # the frontend's own bound covers the rest
        self.model_failed = model_failed or (lambda model: False)
        self.model_cache = model_cache
        self.limits = limits
        self._resolving = 0  # admitted requests still resolving their images (not in flight yet)
        self._resolving_by_model: collections.Counter[str] = collections.Counter()
        self._counter = 0
        self._progress_handle: asyncio.TimerHandle | None = None
        self.epoch = 0

    # -- life cycle ---------------------------------------------------------------

    async def start(self) -> None:
        # Taking over the slot waits on semaphores (a dead predecessor may hold one until it is
        # repaired), so it runs in a thread: the event loop never waits on a semaphore (invariant 3).
        self.epoch = await asyncio.to_thread(self.link.take_over)
        self.stats = FrontendStats(self.link.stats_row())
        self.stages = StageRecorder(self.link.stats_row())
        self.images = ImageResolver(
            self.link.content_cache(),
            self.preprocessor,
            self.stats,
            max_pixels=self.limits.max_pixels,
            threads=self.limits.decode_threads,
            decode_memory_bytes=self.limits.decode_memory_bytes,
            decode_wait_s=self.limits.decode_wait_s,
            video=self.limits.video,
        )
        # one resolver per model over the same cache, pool and decode budget: two models whose
        # preprocessing agrees (equal cache_params) share each decoded image
        self._images_by_model = {
            model: self.images.for_preprocessor(pre) if pre is not self.preprocessor else self.images
            for model, pre in self.preprocessors.items()
        }
        if self.model_cache is not None:  # each model places through its own view: its share counts
            for model, pre in self.preprocessors.items():
                view = self.images.for_preprocessor(pre)
                view.cache = self.model_cache(self._model_index[model])
                self._images_by_model[model] = view
        self.replies = ReplyRouter(self.link, self.images, self.stats, self._next_request_id, self.stages)
        cache = self.images.cache
        self.stats.set(Counter.ARENA_SIZE_BYTES, cache.size)
        self.stats.set(Counter.ARENA_USED_BYTES, 0)
        self.stats.set(Counter.ARENA_HELD_BYTES, 0)  # a dead predecessor's holds died with it
        self.stats.set(Counter.IN_FLIGHT, 0)
        self.stats.set(Counter.INTERACTIVE_IN_FLIGHT, 0)  # a dead predecessor's requests died with it
        self.replies.start()
        self._stamp_progress()
        self.link.mark(SlotState.READY)

    def _stamp_progress(self) -> None:
        """A callback on the event loop itself: it runs only while the loop turns.

        The heartbeat thread says the process exists; this says the loop serving HTTP is not
        blocked (a synchronous call stuck on it stops this stamp, and the supervisor replaces us).
        """
        self.link.stamp_progress()
        self._progress_handle = asyncio.get_running_loop().call_later(PROGRESS_INTERVAL_S, self._stamp_progress)

    async def stop(self) -> None:
        self.link.mark(SlotState.DRAINING)
        if self._progress_handle:
            self._progress_handle.cancel()
        self.replies.stop()
        self.images.close()
        self.link.release()

    # -- readiness ------------------------------------------------------------------

    def draining(self) -> bool:
        return not self.link.instance_running()

    def queue_depth(self) -> int:
        """Descriptors waiting on the shared request channel (for /metrics)."""
        return self.link.queue_depth()

    def ready(self) -> bool:
        """Not draining, and every model has a ready worker."""
        return not self.draining() and all(self.model_ready(model) for model in self.preprocessors)

    def model_ready(self, model: str) -> bool:
        return self.link.has_live_worker(model)

    def ready_workers(self, model: str) -> int:
        """How many workers serve ``model`` now (for /metrics; a scrape, not the request path)."""
        return self.link.live_workers(model)

    def preprocessor_for(self, model: str) -> Preprocessor:
        """The preprocessor of the model a request names; UnknownModel (404) for one not served here."""
        pre = self.preprocessors.get(model)
        if pre is not None:  # the request's outcome is this model's from here on (/metrics by model)
            self.stats.serving_model(self._model_index[model])
        if pre is None:
            ids = list(self.preprocessors)
            send = f"send {ids[0]!r}" if len(ids) == 1 else "send one of " + ", ".join(repr(m) for m in ids)
            raise UnknownModel(
                f"model {model[:100]!r} is not served here; {send} (GET /v1/models lists it)", param="model"
            )
        return pre

    def in_flight_of(self, model: str) -> int:
        """This frontend's requests of ``model`` in flight or still resolving their images."""
        return self._resolving_by_model[model] + sum(
            1 for state in self.replies.states.values() if state.submit.model == model
        )

    # -- the request path ---------------------------------------------------------------

    async def submit(
        self, chat: GenerationRequest, *, first: bool = True, context: RequestContext = INTERACTIVE_REQUEST
    ) -> RequestState:
        """Admit, resolve images, build and send the descriptor. Raises ShmgateError.

        ``first``: this is the client request's first submission, which the per-model ``admitted``
        count counts; the others of one request (a choice of n, an embedding input) are not counted
        again, as the request's outcome is counted once. ``context``: its lane and tracing.
        """
        pre = self.preprocessor_for(chat.model)
        model = pre.model
        self._admit(model)  # a refusal is counted by model with the request's outcome (FrontendStats.add)
        if first:
            self.stats.add_model(Counter.MODEL_ADMITTED, self._model_index[model])
        return await self._dispatch(chat, pre, context)

    def _admit(self, model: str) -> None:
        """Raise Overloaded (429/503, Retry-After) unless ``model`` may take one more request now."""
        if self.draining():
            raise Overloaded("the server is shutting down", retry_after_s=2.0)
        if len(self.replies.states) + self._resolving >= self.limits.max_in_flight:
            raise Overloaded("too many requests in flight; retry shortly", retry_after_s=1.0, status_hint=429)
        bound = self.model_in_flight.get(model)
        if bound is not None and self.in_flight_of(model) >= bound:
            raise Overloaded(
                f"too many requests in flight for model {model!r}; retry shortly", retry_after_s=1.0, status_hint=429
            )
        if not self.link.has_live_worker(model):
            if self.model_failed(model):
                raise Overloaded(
                    f"model {model!r} failed: its workers died beyond their restart budget", retry_after_s=30.0
                )
            raise Overloaded(
                "no model worker is ready yet"
                if len(self.preprocessors) == 1
                else f"no worker of model {model!r} is ready yet",
                retry_after_s=2.0,
            )

    async def _dispatch(self, chat: GenerationRequest, pre: Preprocessor, context: RequestContext) -> RequestState:
        """Resolve the admitted request's images, build its prompt and send its descriptor to its model's queue."""
        model = pre.model
        images = self._images_by_model[model]
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        groups: list[TensorGroup] = []
        self._set_resolving(+1, model)  # admitted: counts against the bound while its images decode
        try:
            await images.resolve(chat.images, chat.image_params, groups, chat.image_options, context)
            specs: list[ImageTensorSpec] = [{r.name: (r.dtype, r.shape) for r in g.refs} for g in groups]
            build: Callable[..., PromptInputs] = pre.build_prompt
            if chat.template_args:  # tools: the template's tools, an operator's tool template
                build = functools.partial(pre.build_prompt, **chat.template_args)
            if pre.prompt_is_cheap:
                prompt = build(chat.messages, specs)
            else:
                prompt = await loop.run_in_executor(self.images.pool_for(context.bulk), build, chat.messages, specs)
            inline = prompt.inline
            image_keys = tuple(group.key or b"" for group in groups)  # before the inline group joins them
            if len(inline) > INLINE_MAX_BYTES:
                groups.append(
                    await loop.run_in_executor(self.images.pool_for(context.bulk), self.images.inline_group, prompt)
                )
                inline = b""
            params = chat.params
            grammar = params.grammar.encode()
            if len(grammar) > INLINE_GRAMMAR_BYTES:  # too large for the descriptor: in the arena (wire.py)
                groups.append(
                    await loop.run_in_executor(self.images.pool_for(context.bulk), self.images.grammar_group, grammar)
                )
                params = msgspec.structs.replace(params, grammar="")
            request_id = self._next_request_id()
            deadline_ns = now_ns() + int(self.limits.request_timeout_s * 1e9)
            spans = context.spans
            trace = None if spans is None else spans.request(self.preprocessor.model)
            refs: list[TensorRef] = [ref for g in groups for ref in g.refs]
            submit = Submit(
                request_id=request_id,
                reply_slot=self.slot,
                model=model,
                tensors=tuple(refs),
                inline=inline,
                params=params,
                deadline_ns=deadline_ns,
                attempt=0,
                text=prompt.text[:MAX_SUBMIT_TEXT_CHARS],
                task=chat.task,
                traceparent="" if trace is None else trace.attempt(request_id, 0),
                image_keys=image_keys,
                bulk=context.bulk,
            )
            state = RequestState(request_id=request_id, submit=submit, groups=groups, started=started, trace=trace)
            if spans is not None:
                state.timing.trace_id = spans.trace_id()
            self.stages.submitted(state.timing, started)
            if spans is not None:
                spans.stage(
                    "preprocess",
                    started,
                    state.timing.spent.get(Stage.PREPROCESS, 0.0),
                    **{"shmgate.images": len(groups), "shmgate.arena_bytes": sum(r.nbytes for r in refs)},
                )
            self.replies.add(state)
        except BaseException:
            self.images.release(groups)
            raise
        finally:
            self._set_resolving(-1, model)  # from here on it is on the request queue (or failed)
        self.replies.sending(state)
        try:
            await self.link.send_request(
                submit, min(10.0, self.limits.request_timeout_s), BULK if submit.bulk else INTERACTIVE
            )
        except ChannelFull:
            self.replies.finish(state)
            raise Overloaded("every worker is busy and the request queue is full", retry_after_s=1.0) from None
        except BaseException:
            self.replies.finish(state)
            raise
        self.replies.sent(state)
        return state

    def _next_request_id(self) -> int:
        self._counter += 1
        return (self.epoch << 40) | self._counter

    def _set_resolving(self, change: int, model: str) -> None:
        """Count admitted requests still decoding, and publish the count in our slot row.

        Workers read it (``Segment.preparing_requests``): a batch waits its window only for
        requests known to be on their way, so a lone request runs at once.
        """
        self._resolving += change
        self._resolving_by_model[model] += change
        self.link.set_preparing(self._resolving)

    async def events(self, state: RequestState) -> AsyncIterator[Delta | Vector | TokenLogprobs | Finished | Failed]:
        """The request's output, ending with exactly one Finished or Failed."""
        while True:
            event = await state.events.get()
            yield event
            if isinstance(event, (Finished, Failed)):
                return

    def abandon(self, state: RequestState) -> None:
        """The client went away before the end: cancel the work, release when the worker is done."""
        self.replies.abandon(state)
