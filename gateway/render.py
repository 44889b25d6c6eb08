"""The chat answer, whole or streamed, of one choice or n: one loop over the wire events.

Every chat answer goes through ``answer``: it waits for the first event (so a failure before
any output is a proper HTTP error, not a 200 stream carrying an error event), watches the
connection while nothing is written to it (a hang-up cancels the work), then walks the events
once with a ``match`` on the wire union. The walk yields SSE chunks when streaming and only
collects when not, so TTFT, the ``delivered`` stage, Server-Timing and the success count are
kept in one place for n = 1 and n > 1 alike.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive

from shmgate.gateway.frontend import Frontend, RequestState
from shmgate.gateway.http_errors import count_error, count_ok, error_body, error_response, failure_error
from shmgate.gateway.sse import Completion, logprob_entry
from shmgate.gateway.stages import server_timing
from shmgate.shared.errors import Cancelled
from shmgate.shared.wire import Delta, Failed, Finished, TokenLogprobs, Vector, failed_reply

__all__ = ["ChoiceEvents", "KeepAnswer", "answer", "cached_answer", "cancel_on_hang_up"]

ChatEvent = Delta | Vector | TokenLogprobs | Finished | Failed
KeepAnswer = Callable[[Finished, str], None]  # stores a finished deterministic answer (the result cache)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ChoiceEvents:
    """Every choice's events as ``(choice index, event)``, in arrival order.

    One choice (the hot path) reads its own queue: no task, no second queue. For n choices a
    pump task per choice feeds one queue. ``close`` stops the pumps and abandons every choice
    not done (its work is cancelled, its arena holds go back when its worker ends).
    """

    def __init__(self, f: Frontend, states: list[RequestState]) -> None:
        self.f = f
        self.states = states
        self._merged: asyncio.Queue[tuple[int, ChatEvent]] | None = None
        self._pumps: list[asyncio.Task[None]] = []
        if len(states) > 1:
            self._merged = asyncio.Queue()
            loop = asyncio.get_running_loop()
            self._pumps = [loop.create_task(self._pump(i, state)) for i, state in enumerate(states)]

    async def _pump(self, index: int, state: RequestState) -> None:
        assert self._merged is not None
        async for event in self.f.events(state):
            self._merged.put_nowait((index, event))

    async def next(self) -> tuple[int, ChatEvent]:
        if self._merged is None:
            return 0, await self.states[0].events.get()
        return await self._merged.get()

    def close(self) -> None:
        for pump in self._pumps:
            pump.cancel()
        for state in self.states:
            if not state.done:
                self.f.abandon(state)


def cancel_on_hang_up(f: Frontend, states: list[RequestState], receive: Receive | None) -> asyncio.Task[None] | None:
    """Watch the connection while nothing is written to it: a hang-up cancels the request's work.

    Without this a client that goes away is noticed only when output is written to it, so a
    non-streamed answer (or a stream before its first event) is computed to the end for nobody.
    The body has been read, so the next ASGI message is ``http.disconnect``: uvicorn sends it when
    the connection is lost (or once a response is complete, which is why the caller cancels this
    task before answering). On a hang-up every choice not done is abandoned (counted ``cancelled``;
    a Cancel reaches its worker, which stops at its next step; its arena holds go back when the
    worker's terminal message arrives) and a ``cancelled`` Failed wakes the waiting caller, which
    ends at once without counting it again. One task per request, asleep until the connection closes.
    """
    if receive is None:
        return None

    async def watch() -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a server whose receive cannot be read again: no watch, as before
            return
        for state in states:
            if not state.done:
                f.abandon(state)
                state.events.put_nowait(failed_reply(state.request_id, 0, Cancelled("the client hung up")))

    return asyncio.get_running_loop().create_task(watch())


async def answer(
    f: Frontend,
    states: list[RequestState],
    model: str,
    started: float,
    *,
    stream: bool,
    include_usage: bool = False,
    logprobs: bool = False,
    keep: KeepAnswer | None = None,
    timing_header: bool = False,
    receive: Receive | None = None,
) -> Response:
    """Answer a chat request whose ``states`` (one per choice) are submitted.

    ``keep`` stores a one-choice answer in the result cache; ``timing_header`` adds Server-Timing to
    a whole answer (a stream's headers leave before its timing is known); ``receive`` (the request's
    ASGI receive, its body already read) lets a hang-up cancel the work until the first output is
    written (from then on Starlette's StreamingResponse listens for the disconnect itself).
    """
    events = ChoiceEvents(f, states)
    render = _Render(
        f, states, events, model, started, stream=stream, include_usage=include_usage, logprobs=logprobs, keep=keep
    )
    watcher = cancel_on_hang_up(f, states, receive)
    try:
        try:
            first = await events.next()
        except BaseException:
            events.close()
            raise
        if isinstance(first[1], Failed):
            events.close()
            return failure_response(f, first[1])
        if not stream:
            async for _ in render.walk(first):
                pass
            return render.whole(timing_header)
    finally:
        if watcher is not None:
            watcher.cancel()
    return StreamingResponse(render.walk(first), media_type="text/event-stream", headers=_SSE_HEADERS)


def failure_response(f: Frontend, event: Failed) -> Response:
    """The HTTP error for a request that failed before its answer began; counted here."""
    if event.code == Cancelled.code:  # the client hung up (counted by abandon)
        return Response(status_code=Cancelled.status_hint)  # nobody reads it
    error = failure_error(event)
    count_error(f.stats, error)
    return error_response(error)


class _Render:
    """One answer's walk over its choices' events, and what it collected."""

    def __init__(
        self,
        f: Frontend,
        states: list[RequestState],
        events: ChoiceEvents,
        model: str,
        started: float,
        *,
        stream: bool,
        include_usage: bool,
        logprobs: bool,
        keep: KeepAnswer | None,
    ) -> None:
        self.f = f
        self.states = states
        self.events = events
        self.started = started
        self.stream = stream
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.keep = keep if len(states) == 1 else None
        self.completion = Completion(model)
        self.collect = not stream or self.keep is not None  # whole texts are needed
        self.texts: list[list[str]] = [[] for _ in states]
        # logprobs entries not sent yet (streamed: of tokens whose text has not gone out; whole: all)
        self.entries: list[list[dict[str, Any]]] = [[] for _ in states]
        self.finished: dict[int, Finished] = {}
        self.last = 0  # the choice that finished last: the request's time is its time
        self.failed: Failed | None = None
        self.ttft_s: float | None = None
        self.elapsed_s = 0.0

    async def walk(self, first: tuple[int, ChatEvent]) -> AsyncIterator[bytes]:
        """SSE chunks when streaming (nothing otherwise) until every choice finished or one failed."""
        completion = self.completion
        try:
            if self.stream:
                for i in range(len(self.states)):
                    yield completion.role_chunk(index=i)
            index, event = first
            while True:
                match event:
                    case TokenLogprobs(entry=entry):
                        if self.logprobs:
                            self.entries[index].append(logprob_entry(entry))
                    case Delta(text=text):
                        if self.collect:
                            self.texts[index].append(text)
                        if self.stream:
                            if self.ttft_s is None:
                                self.ttft_s = time.monotonic() - self.started
                            yield completion.content_chunk(
                                text, self.entries[index] if self.logprobs else None, index=index
                            )
                            self.entries[index] = []
                    case Finished(finish_reason=reason):
                        self.finished[index] = event
                        self.last = index
                        if self.stream:
                            if self.entries[index]:  # tokens with no text of their own (EOS, a held-back stop)
                                yield completion.content_chunk("", self.entries[index], index=index)
                            yield completion.finish_chunk(reason, index=index)
                        if len(self.finished) == len(self.states):
                            break
                    case Failed():
                        self.failed = event
                        if self.stream and event.code != Cancelled.code:  # a hang-up is counted by abandon
                            error = failure_error(event)
                            count_error(self.f.stats, error)
                            yield completion.error_event(error_body(error.message, error.error_type, error.code))
                        return
                index, event = await self.events.next()
            if self.keep is not None:
                self.keep(self.finished[0], "".join(self.texts[0]))
            if self.stream:
                if self.include_usage:
                    yield completion.usage_chunk(*self._usage())
                yield completion.done()
            for state in self.states:
                if state.trace is not None:
                    state.trace.delivered(state.timing.done_ns, self.ttft_s)
                self.f.stages.delivered(state.timing)
            self.elapsed_s = time.monotonic() - self.started
            count_ok(self.f.stats, self.elapsed_s, self.ttft_s if self.stream else self.elapsed_s)
        finally:
            self.events.close()  # a choice not done (a failure, a hang-up mid-stream) is abandoned

    def _usage(self) -> tuple[int, int]:
        """(prompt tokens, completion tokens): every choice reads the same prompt; their outputs add up."""
        return self.finished[0].prompt_tokens, sum(e.completion_tokens for e in self.finished.values())

    def whole(self, timing_header: bool) -> Response:
        """The whole answer once ``walk`` ended (or the error it ended with)."""
        if self.failed is not None:
            return failure_response(self.f, self.failed)
        choices = [
            self.completion.choice(
                i, "".join(self.texts[i]), self.finished[i].finish_reason, self.entries[i] if self.logprobs else None
            )
            for i in range(len(self.states))
        ]
        headers = None
        if timing_header:
            headers = {"Server-Timing": server_timing(self.states[self.last].timing, self.elapsed_s)}
        return JSONResponse(self.completion.completion_of(choices, *self._usage()), headers=headers)


def cached_answer(
    f: Frontend, model: str, stream: bool, include_usage: bool, cached: bytes, started: float
) -> Response:
    """A result-cache hit, answered as the model would have (one content chunk when streaming)."""
    text, finish_reason, prompt_tokens, completion_tokens = msgspec.msgpack.decode(cached)
    completion = Completion(model)
    elapsed = time.monotonic() - started
    count_ok(f.stats, elapsed, elapsed)
    if not stream:
        return JSONResponse(completion.completion(text, finish_reason, prompt_tokens, completion_tokens))
    chunks = [completion.role_chunk(), completion.content_chunk(text), completion.finish_chunk(finish_reason)]
    if include_usage:
        chunks.append(completion.usage_chunk(prompt_tokens, completion_tokens))
    chunks.append(completion.done())
    return Response(b"".join(chunks), media_type="text/event-stream", headers=_SSE_HEADERS)
