"""A generated answer, whole or streamed, of one choice or n: one collector over the wire events.

Every generation endpoint (chat completions, responses) answers through ``answer``: it waits for
the first event (so a failure before any output is a proper HTTP error, not a 200 stream carrying
an error event), watches the connection while nothing is written to it (a hang-up cancels the
work), then walks the events once with a ``match`` on the wire union, collecting each choice's
text into an ``Outcome``. What the client sees is the endpoint's ``AnswerFormat``: the walk asks
it for the bytes of each stream event, or for the whole body at the end. TTFT, the ``delivered``
stage, Server-Timing, the result cache and the success count are kept here once, for every API and
for n = 1 and n > 1 alike.

What comes out is data, an ``Answer``: a ``Whole`` body or a ``Streamed`` answer's events; a failure
before any output is raised as the client's ShmgateError, a hang-up as ``HungUp``. The HTTP response
is made at the edge (gateway/edge.py); a batch line (gateway/batch_runner.py) takes the body as is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from starlette.types import Receive

from shmgate.gateway.frontend import Frontend, RequestState
from shmgate.gateway.http_errors import count_error, count_ok, failure_error
from shmgate.gateway.sse import logprob_entry
from shmgate.gateway.stages import server_timing
from shmgate.shared.errors import Cancelled, ShmgateError
from shmgate.shared.wire import Delta, Failed, Finished, TokenLogprobs, Vector, failed_reply

__all__ = [
    "Answer",
    "AnswerFormat",
    "ChoiceEvents",
    "HungUp",
    "KeepAnswer",
    "Outcome",
    "Streamed",
    "Whole",
    "answer",
    "cached_answer",
    "cancel_on_hang_up",
]

ChatEvent = Delta | Vector | TokenLogprobs | Finished | Failed
KeepAnswer = Callable[[Finished, str], None]  # stores a finished deterministic answer (the result cache)


@dataclass(frozen=True)
class Whole:
    """A whole answer: its JSON body as data, and the headers it asks for (Server-Timing)."""

    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Streamed:
    """A streamed answer: its server-sent events' bytes as they come (or all of them, known at once)."""

    events: AsyncIterator[bytes] | bytes
    headers: dict[str, str] = field(default_factory=dict)


Answer = Whole | Streamed


class HungUp(Exception):
    """The client hung up before its answer began: the work is cancelled and counted ``cancelled``
    (by ``Frontend.abandon``), and nobody is left to read an answer."""


@dataclass
class Outcome:
    """What a request's events came to: each choice's text and finish reason, and the tokens counted.

    ``logprobs`` holds each choice's entries not yet sent (a stream sends them with their text), or
    None when the request did not ask for them.
    """

    texts: list[str]
    finish_reasons: list[str]
    prompt_tokens: int
    completion_tokens: int  # every choice's, added up
    logprobs: list[list[dict[str, Any]]] | None = None
    tool_calls: list[list[Any]] | None = None  # tools: each choice's calls (gateway/tool_answer.py), texts without them


class AnswerFormat(Protocol):
    """One API's wire format of a generated answer (gateway/sse.py ``ChatFormat``, gateway/responses_format.py).

    The stream methods return the bytes of zero or more server-sent events; ``opening`` is sent once
    the first event is known to be output, ``closing`` after every choice finished, ``failed`` when a
    choice failed mid-stream (the stream ends after it). ``whole`` is the non-streamed body.
    """

    def opening(self, n: int) -> bytes: ...

    def delta(self, index: int, text: str, logprobs: list[dict[str, Any]] | None) -> bytes: ...

    def finished(self, index: int, reason: str, logprobs: list[dict[str, Any]] | None) -> bytes: ...

    def failed(self, error: ShmgateError) -> bytes: ...

    def closing(self, outcome: Outcome) -> bytes: ...

    def whole(self, outcome: Outcome) -> dict[str, Any]: ...


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
    fmt: AnswerFormat,
    started: float,
    *,
    stream: bool,
    logprobs: bool = False,
    keep: KeepAnswer | None = None,
    timing_header: bool = False,
    receive: Receive | None = None,
) -> Answer:
    """Answer a generation request whose ``states`` (one per choice) are submitted, in format ``fmt``.

    ``keep`` stores a one-choice answer in the result cache; ``timing_header`` adds Server-Timing to
    a whole answer (a stream's headers leave before its timing is known); ``receive`` (the request's
    ASGI receive, its body already read) lets a hang-up cancel the work until the first output is
    written (from then on the edge's streaming response listens for the disconnect itself). A failure
    before any output raises the client's error (not a stream carrying an error event), a hang-up
    ``HungUp``.
    """
    events = ChoiceEvents(f, states)
    collect = _Collect(f, states, events, fmt, started, stream=stream, logprobs=logprobs, keep=keep)
    watcher = cancel_on_hang_up(f, states, receive)
    try:
        try:
            first = await events.next()
        except BaseException:
            events.close()
            raise
        if isinstance(first[1], Failed):
            events.close()
            raise failure_raised(first[1])
        if not stream:
            async for _ in collect.walk(first):
                pass
            return collect.whole(timing_header)
    finally:
        if watcher is not None:
            watcher.cancel()
    return Streamed(collect.walk(first))


def failure_raised(event: Failed) -> Exception:
    """What a request that failed before its answer began raises: ``HungUp`` when the client hung up
    (counted by abandon), else the client's error (counted where it is answered)."""
    if event.code == Cancelled.code:
        return HungUp()
    return failure_error(event)


class _Collect:
    """One answer's walk over its choices' events, and the outcome it collected."""

    def __init__(
        self,
        f: Frontend,
        states: list[RequestState],
        events: ChoiceEvents,
        fmt: AnswerFormat,
        started: float,
        *,
        stream: bool,
        logprobs: bool,
        keep: KeepAnswer | None,
    ) -> None:
        self.f = f
        self.states = states
        self.events = events
        self.fmt = fmt
        self.started = started
        self.stream = stream
        self.logprobs = logprobs
        self.keep = keep if len(states) == 1 else None
        self.texts: list[list[str]] = [[] for _ in states]
        # logprobs entries not sent yet (streamed: of tokens whose text has not gone out; whole: all)
        self.entries: list[list[dict[str, Any]]] = [[] for _ in states]
        self.finished: dict[int, Finished] = {}
        self.last = 0  # the choice that finished last: the request's time is its time
        self.failed: Failed | None = None
        self.ttft_s: float | None = None
        self.elapsed_s = 0.0

    async def walk(self, first: tuple[int, ChatEvent]) -> AsyncIterator[bytes]:
        """Stream events when streaming (nothing otherwise) until every choice finished or one failed."""
        fmt = self.fmt
        try:
            if self.stream:
                yield fmt.opening(len(self.states))
            index, event = first
            while True:
                match event:
                    case TokenLogprobs(entry=entry):
                        if self.logprobs:
                            self.entries[index].append(logprob_entry(entry))
                    case Delta(text=text):
                        self.texts[index].append(text)
                        if self.stream:
                            if self.ttft_s is None:
                                self.ttft_s = time.monotonic() - self.started
                            yield fmt.delta(index, text, self.entries[index] if self.logprobs else None)
                            self.entries[index] = []
                    case Finished(finish_reason=reason):
                        self.finished[index] = event
                        self.last = index
                        if self.stream:  # entries left: tokens with no text of their own (EOS, a held-back stop)
                            yield fmt.finished(index, reason, self.entries[index] if self.logprobs else None)
                            self.entries[index] = []
                        if len(self.finished) == len(self.states):
                            break
                    case Failed():
                        self.failed = event
                        if self.stream and event.code != Cancelled.code:  # a hang-up is counted by abandon
                            error = failure_error(event)
                            count_error(self.f.stats, error)
                            yield fmt.failed(error)
                        return
                index, event = await self.events.next()
            if self.keep is not None:
                self.keep(self.finished[0], "".join(self.texts[0]))
            if self.stream:
                yield fmt.closing(self.outcome())
            for state in self.states:
                if state.trace is not None:
                    state.trace.delivered(state.timing.done_ns, self.ttft_s)
                self.f.stages.delivered(state.timing)
            self.elapsed_s = time.monotonic() - self.started
            count_ok(self.f.stats, self.elapsed_s, self.ttft_s if self.stream else self.elapsed_s)
        finally:
            self.events.close()  # a choice not done (a failure, a hang-up mid-stream) is abandoned

    def outcome(self) -> Outcome:
        """Every choice reads the same prompt; their outputs add up."""
        n = len(self.states)
        return Outcome(
            texts=["".join(self.texts[i]) for i in range(n)],
            finish_reasons=[self.finished[i].finish_reason for i in range(n)],
            prompt_tokens=self.finished[0].prompt_tokens,
            completion_tokens=sum(e.completion_tokens for e in self.finished.values()),
            logprobs=self.entries if self.logprobs else None,
        )

    def whole(self, timing_header: bool) -> Whole:
        """The whole answer once ``walk`` ended; raises the error it ended with."""
        if self.failed is not None:
            raise failure_raised(self.failed)
        headers = {}
        if timing_header:
            headers["Server-Timing"] = server_timing(self.states[self.last].timing, self.elapsed_s)
        return Whole(self.fmt.whole(self.outcome()), headers)


def cached_answer(
    f: Frontend, fmt: AnswerFormat, stream: bool, cached: bytes, started: float, *, read_s: float | None = None
) -> Answer:
    """A result-cache hit, answered as the model would have (one content event when streaming).

    With ``read_s`` (the body's read, given when Server-Timing is on) the answer's Server-Timing names
    that, the hit, and the total: the hit skipped every other stage.
    """
    text, finish_reason, prompt_tokens, completion_tokens = msgspec.msgpack.decode(cached)
    outcome = Outcome([text], [finish_reason], prompt_tokens, completion_tokens)
    elapsed = time.monotonic() - started
    count_ok(f.stats, elapsed, elapsed)
    headers = {}
    if read_s is not None:
        headers["Server-Timing"] = (
            f"body_read;dur={read_s * 1000:.2f}, result_cache;desc=hit, total;dur={elapsed * 1000:.2f}"
        )
    if not stream:
        return Whole(fmt.whole(outcome), headers)
    body = fmt.opening(1) + fmt.delta(0, text, None) + fmt.finished(0, finish_reason, None) + fmt.closing(outcome)
    return Streamed(body, headers)
