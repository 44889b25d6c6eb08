"""CPU per chat answer of the renderer alone: one choice, whole and streamed, on whichever tree is imported.

Why: the chat answer's rendering (gateway/render.py) is on every request's hot path, and the CPU
per request of a whole ``shmgate bench`` run is too noisy on a shared machine to see a few µs. This
drives only the renderer: a real ``Frontend`` on the in-memory transport, a request whose events
(``--deltas`` Deltas, then Finished) are already queued, the hang-up watcher parked on a receive that
never returns, and (streamed) the SSE body read to its end. Run it with ``PYTHONPATH`` set to each
tree to compare (an older tree renders in gateway/app.py's ``_complete``/``_stream``).

Usage: ``PYTHONPATH=<tree> python bench/render_cost.py [--iters N] [--deltas D] [--rounds R]``.
Prints µs of CPU per answer, each round's and the median.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from shmgate.gateway.frontend import Frontend, FrontendLimits
from shmgate.gateway.preprocess.vision import ChecksumPreprocessor
from shmgate.gateway.request_state import Phase, RequestState
from shmgate.shared.transport.memory import MemoryFrontendLink, MemoryNode
from shmgate.shared.wire import Delta, Finished, SamplingParams, Submit

Render = Callable[[Frontend, RequestState, bool, Any], Awaitable[Any]]


def _renderer() -> tuple[str, Render]:
    try:
        from shmgate.gateway.render import answer
    except ImportError:  # a tree from before gateway/render.py
        from shmgate.gateway import app as old

        async def render_old(f: Frontend, state: RequestState, stream: bool, receive: Any) -> Any:
            if stream:
                return await old._stream(f, state, "checksum", False, time.monotonic(), receive=receive)  # type: ignore[attr-defined]
            return await old._complete(f, state, "checksum", time.monotonic(), receive=receive)  # type: ignore[attr-defined]

        return "gateway/app.py _complete/_stream", render_old

    async def render_new(f: Frontend, state: RequestState, stream: bool, receive: Any) -> Any:
        return await answer(f, [state], "checksum", time.monotonic(), stream=stream, receive=receive)

    return "gateway/render.py answer", render_new


async def _round(f: Frontend, render: Render, stream: bool, iters: int, deltas: int) -> float:
    never = asyncio.Event()

    async def receive() -> dict[str, str]:
        await never.wait()
        return {"type": "http.disconnect"}

    submit = Submit(
        request_id=1,
        reply_slot=0,
        model="checksum",
        tensors=(),
        inline=b"",
        params=SamplingParams(),
        deadline_ns=0,
        attempt=0,
        text="",
    )
    started = time.process_time()
    for i in range(iters):
        state = RequestState(i, submit, [], time.monotonic())
        state.phase = Phase.DONE  # its events are queued by hand: nothing to route, nothing to abandon
        for seq in range(deltas):
            state.events.put_nowait(Delta(i, seq, "word "))
        state.events.put_nowait(
            Finished(
                request_id=i, seq=deltas, finish_reason="stop", prompt_tokens=12, completion_tokens=deltas, text=""
            )
        )
        response = await render(f, state, stream, receive)
        if stream:
            async for _ in response.body_iterator:
                pass
        else:
            assert response.status_code == 200
    return (time.process_time() - started) / iters * 1e6


async def main(args: argparse.Namespace) -> None:
    name, render = _renderer()
    node = MemoryNode()
    frontend = Frontend(MemoryFrontendLink(node, slot=0), ChecksumPreprocessor(), FrontendLimits())
    await frontend.start()
    try:
        for stream in (False, True):
            await _round(frontend, render, stream, 200, args.deltas)  # warm-up
            rounds = [await _round(frontend, render, stream, args.iters, args.deltas) for _ in range(args.rounds)]
            print(
                f"{name}, {'streamed' if stream else 'whole'}, {args.deltas} deltas: "
                f"median {statistics.median(rounds):.1f} µs of CPU per answer "
                f"(rounds: {', '.join(f'{r:.1f}' for r in rounds)})",
                flush=True,
            )
    finally:
        await frontend.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--deltas", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(parser.parse_args()))
