"""The frontend's request life cycle on the in-memory transport: retry, cancel, timeout, worker death.

No ``shmgate serve``: a real ``Frontend`` (dispatch, image resolution, reply routing) runs on a
``MemoryFrontendLink`` (shared/transport/memory.py) and the test plays the worker, taking
descriptors off the in-memory request queue and answering. The same paths run end to end over
POSIX in tests/test_faults.py and tests/test_take_window.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Awaitable, Callable

import msgspec
import pytest
from PIL import Image

from shmgate.gateway.frontend import Frontend, FrontendLimits
from shmgate.gateway.intake import IntakeLimits, parse_chat_request
from shmgate.gateway.metrics import Counter, exposition, render
from shmgate.gateway.preprocess.vision import ChecksumPreprocessor
from shmgate.gateway.request_state import IllegalTransition, Phase, RequestState
from shmgate.shared.errors import Overloaded
from shmgate.shared.segment import InstanceState, now_ns
from shmgate.shared.transport.memory import MemoryFrontendLink, MemoryNode, MemoryNodeStats
from shmgate.shared.wire import Claimed, Delta, Failed, Finished, Released, Submit


def _png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 40, 90)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


PNG = _png()


def _chat(with_image: bool = True) -> bytes:
    content: list[dict[str, object]] = [{"type": "text", "text": "what is it?"}]
    if with_image:
        content.append({"type": "image_url", "image_url": {"url": PNG}})
    return json.dumps({"model": "checksum", "messages": [{"role": "user", "content": content}]}).encode()


Scenario = Callable[[Frontend, MemoryNode, MemoryFrontendLink], Awaitable[None]]


def run(scenario: Scenario, *, timeout_s: float = 60.0, queue_depth: int = 64, workers: int = 1) -> None:
    async def main() -> None:
        node = MemoryNode(queue_depth=queue_depth)
        for _ in range(workers):
            node.add_worker("checksum")
        link = MemoryFrontendLink(node, slot=0)
        frontend = Frontend(link, ChecksumPreprocessor(), FrontendLimits(request_timeout_s=timeout_s))
        await frontend.start()
        try:
            await scenario(frontend, node, link)
        finally:
            await frontend.stop()

    asyncio.run(main())


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def _submit(frontend: Frontend, with_image: bool = True) -> RequestState:
    return await frontend.submit(parse_chat_request(_chat(with_image), IntakeLimits()))


def _take(node: MemoryNode) -> Submit:
    submit = node.take()
    assert submit is not None, "the request queue is empty"
    return submit


def _drain(state: RequestState) -> list[object]:
    out: list[object] = []
    while not state.events.empty():
        out.append(state.events.get_nowait())
    return out


def test_a_request_runs_claimed_released_streaming_done_and_gives_its_space_back() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        state = await _submit(frontend)
        assert state.phase is Phase.QUEUED and link.cache.held_bytes > 0
        submit = _take(node)
        assert submit.tensors and submit.reply_slot == 0
        for message, phase in (
            (Claimed(submit.request_id, 0, 1), Phase.CLAIMED),
            (Released(submit.request_id), Phase.RELEASED),
            (Delta(submit.request_id, 0, "a "), Phase.STREAMING),
        ):
            node.reply(message)
            await _settle()
            assert state.phase is phase
        node.reply(
            Finished(
                request_id=submit.request_id,
                seq=1,
                finish_reason="stop",
                prompt_tokens=3,
                completion_tokens=2,
                text="cat",
            )
        )
        await _settle()
        assert state.done and link.cache.held_bytes == 0
        events = _drain(state)
        assert [type(e) for e in events] == [Delta, Delta, Finished]
        assert int(link.row[Counter.IN_FLIGHT]) == 0

    run(scenario)


def test_a_worker_that_dies_before_any_output_is_retried_under_a_new_id_then_fails_on_the_second_death() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        node.add_worker("checksum")  # a second worker for the retry
        state = await _submit(frontend)
        first = _take(node)
        node.reply(Claimed(first.request_id, 0, 1))
        node.reply(Released(first.request_id))
        await _settle()
        node.kill_worker(0)
        await frontend.replies.check()
        retried = _take(node)
        assert retried.attempt == 1 and retried.request_id != first.request_id
        assert retried.tensors == first.tensors  # the held tensors go again, no second decode
        assert state.phase is Phase.QUEUED and int(link.row[Counter.RETRIES]) == 1
        node.reply(Delta(first.request_id, 0, "late"))  # the dead (or paused) worker's late answer
        await _settle()
        assert state.events.empty(), "a reply under the old id must not reach the retried request"
        node.reply(Claimed(retried.request_id, 1, 1))
        await _settle()
        node.kill_worker(1)
        await frontend.replies.check()
        [failed] = _drain(state)
        assert isinstance(failed, Failed) and failed.code == "worker_died"
        assert state.done and link.cache.held_bytes == 0 and node.take() is None

    run(scenario)


def test_a_worker_that_dies_after_streaming_output_fails_the_request_in_band_without_retry() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        state = await _submit(frontend)
        submit = _take(node)
        node.reply(Claimed(submit.request_id, 0, 1))
        node.reply(Delta(submit.request_id, 0, "half an answer"))
        await _settle()
        node.kill_worker(0)
        await frontend.replies.check()
        delta, failed = _drain(state)
        assert isinstance(delta, Delta) and isinstance(failed, Failed) and failed.code == "worker_died"
        assert node.take() is None and int(link.row[Counter.RETRIES]) == 0
        assert link.cache.held_bytes == 0

    run(scenario)


def test_output_whose_claimed_was_lost_still_reaches_the_client() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        state = await _submit(frontend)
        submit = _take(node)  # the worker's Claimed was dropped (its channel stayed full)
        node.reply(Delta(submit.request_id, 0, "an "))
        node.reply(
            Finished(
                request_id=submit.request_id,
                seq=1,
                finish_reason="stop",
                prompt_tokens=3,
                completion_tokens=2,
                text="answer",
            )
        )
        await _settle()
        assert [type(e) for e in _drain(state)] == [Delta, Delta, Finished]
        assert state.done and link.cache.held_bytes == 0

    run(scenario)


def test_a_client_that_leaves_before_the_claim_cancels_on_claim_and_holds_until_the_workers_end() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        state = await _submit(frontend)
        submit = _take(node)
        frontend.abandon(state)
        assert state.phase is Phase.ABANDONED and node.cancels == []  # nobody to tell yet
        node.reply(Claimed(submit.request_id, 0, 1))
        await _settle()
        assert [(slot, c.request_id) for slot, c in node.cancels] == [(0, submit.request_id)]
        assert link.cache.held_bytes > 0, "the worker may still read the arena: holds stay"
        node.reply(Released(submit.request_id))
        node.reply(
            Failed(
                request_id=submit.request_id,
                seq=0,
                code="cancelled",
                message="the client cancelled the request",
                status_hint=499,
            )
        )
        await _settle()
        assert state.done and link.cache.held_bytes == 0
        assert int(link.row[Counter.CANCELLED]) == 1

    run(scenario)


def test_a_client_that_leaves_after_the_claim_cancels_at_once_and_a_death_then_is_not_retried() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        node.add_worker("checksum")
        state = await _submit(frontend)
        submit = _take(node)
        node.reply(Claimed(submit.request_id, 0, 1))
        await _settle()
        frontend.abandon(state)
        frontend.abandon(state)  # twice (disconnect and finally): one cancel, one count
        assert len(node.cancels) == 1 and int(link.row[Counter.CANCELLED]) == 1
        node.kill_worker(0)
        await frontend.replies.check()
        assert state.done and node.take() is None and link.cache.held_bytes == 0

    run(scenario)


def test_an_unclaimed_request_past_its_deadline_fails_with_a_timeout() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        state = await _submit(frontend)
        await asyncio.sleep(0.06)
        await frontend.replies.check()
        [failed] = _drain(state)
        assert isinstance(failed, Failed) and failed.code == "timeout"
        assert node.cancels == [] and link.cache.held_bytes == 0

    run(scenario, timeout_s=0.05)


def test_a_claimed_request_gets_its_grace_then_a_cancel_and_a_timeout() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        state = await _submit(frontend)
        submit = _take(node)
        node.reply(Claimed(submit.request_id, 0, 1))
        await asyncio.sleep(0.06)
        await frontend.replies.check()
        assert not state.done, "a claimed request may hold its space GRACE_S past its deadline"
        frontend.replies.grace_ns = 0
        await frontend.replies.check()
        [failed] = _drain(state)
        assert isinstance(failed, Failed) and failed.code == "timeout"
        assert [c.request_id for _, c in node.cancels] == [submit.request_id]

    run(scenario, timeout_s=0.05)


def test_a_request_taken_off_the_queue_but_never_claimed_is_resubmitted() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        frontend.replies.taken_unclaimed_s = 0.0
        state = await _submit(frontend, with_image=False)
        submit = _take(node)  # its taker dies before claiming: nobody says so
        await frontend.replies.check()  # the empty queue proves it left; the clock starts
        assert node.take() is None
        await asyncio.sleep(0.01)
        await frontend.replies.check()
        retried = _take(node)
        assert retried.attempt == 1 and retried.request_id != submit.request_id
        assert state.phase is Phase.QUEUED

    run(scenario)


def _queued(request_id: int) -> RequestState:
    """A request of ours, as ``Frontend.submit`` makes one, with a minute to go."""
    return RequestState(request_id, Submit(request_id, 0, "checksum", deadline_ns=now_ns() + 60 * 10**9), [], 0.0)


def test_a_claim_proves_taken_only_what_was_on_the_queue_before_its_send_began() -> None:
    """Sends that wait side by side may enter the queue in another order than they complete.

    AsyncSender runs each waiting send in a thread of its own; two blocked on a full queue can be let
    in by the kernel in one order and report back in the other. Here A and B wait side by side, the
    queue takes B first, the event loop hears of A first (A gets the lower number), and a worker claims
    B while A is still queued. That claim must not count A as taken: A would be resubmitted after
    ``taken_unclaimed_s`` while its first copy still waits to run. C, whose send began after A's had
    ended, does prove A taken once claimed.
    """

    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        replies = frontend.replies
        replies.taken_unclaimed_s = 0.0
        slot, epoch = 0, node.workers[0].epoch  # the one worker run() added
        a, b = _queued(101), _queued(102)
        for state in (a, b):
            replies.add(state)
            replies.sending(state)  # both begin before either is on the queue
        assert node.requests.try_send(b.submit) and node.requests.try_send(a.submit)  # the queue takes B first
        replies.sent(a)
        replies.sent(b)  # ...but the event loop hears of A first
        assert _take(node).request_id == b.request_id
        replies.on_reply(Claimed(b.request_id, slot, epoch))
        for _ in range(2):
            await replies.check()
            await asyncio.sleep(0.01)
        assert node.requests.current_messages() == 1  # A: still queued, not resent
        assert a.phase is Phase.QUEUED and a.submit.attempt == 0

        c = _queued(103)
        replies.add(c)
        replies.sending(c)  # begins after A's send ended: A is ahead of it
        assert node.requests.try_send(c.submit)
        replies.sent(c)
        assert _take(node).request_id == a.request_id  # A's taker dies before claiming
        assert _take(node).request_id == c.request_id
        replies.on_reply(Claimed(c.request_id, slot, epoch))
        assert node.requests.try_send(Submit(999, 1, "checksum"))  # another frontend's: the queue never empties
        for _ in range(2):
            await replies.check()
            await asyncio.sleep(0.01)
        retried = [m for m in (node.take(), node.take()) if m is not None and m.reply_slot == 0]
        assert len(retried) == 1 and retried[0].attempt == 1 and a.submit.attempt == 1

    run(scenario)


def test_a_claimed_interactive_request_does_not_prove_a_queued_batch_line_taken() -> None:
    """The queue is FIFO within a priority only: an interactive request sent after a batch line overtakes it.

    Its claim must not count the batch line as taken (it would be resubmitted while its first copy still
    waits); a batch line claimed later does prove it taken.
    """

    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        replies = frontend.replies
        replies.taken_unclaimed_s = 0.0
        slot, epoch = 0, node.workers[0].epoch
        line = _queued(201)
        line.submit = msgspec.structs.replace(line.submit, bulk=True)
        replies.add(line)
        replies.sending(line)
        replies.sent(line)  # on the queue, behind every interactive descriptor (not put in the twin's FIFO)
        interactive = _queued(202)
        replies.add(interactive)
        replies.sending(interactive)  # begins after the line's send ended
        assert node.requests.try_send(interactive.submit)
        replies.sent(interactive)
        assert node.requests.try_send(Submit(999, 1, "checksum"))  # another frontend's: the queue never empties
        assert _take(node).request_id == interactive.request_id
        replies.on_reply(Claimed(interactive.request_id, slot, epoch))
        for _ in range(2):
            await replies.check()
            await asyncio.sleep(0.01)
        assert line.phase is Phase.QUEUED and line.submit.attempt == 0  # still queued: not resent

        later = _queued(203)
        later.submit = msgspec.structs.replace(later.submit, bulk=True)
        replies.add(later)
        replies.sending(later)
        replies.sent(later)
        replies.on_reply(Claimed(later.request_id, slot, epoch))  # a later batch line claimed: the first left
        for _ in range(2):
            await replies.check()
            await asyncio.sleep(0.01)
        assert line.submit.attempt == 1 and not line.submit.bulk  # resubmitted, as an interactive request

    run(scenario)


def test_a_full_request_queue_answers_overloaded_and_frees_the_requests_space() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        with pytest.raises(Overloaded):
            await _submit(frontend)
        assert link.cache.held_bytes == 0 and int(link.row[Counter.IN_FLIGHT]) == 0
        assert not frontend.replies.states

    run(scenario, queue_depth=0, timeout_s=0.05)


def test_no_ready_worker_or_a_draining_instance_is_refused_before_any_decode() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        with pytest.raises(Overloaded, match="no model worker"):
            await _submit(frontend)
        node.add_worker("checksum")
        node.state = InstanceState.DRAINING
        with pytest.raises(Overloaded, match="shutting down"):
            await _submit(frontend)
        assert link.cache.stats.misses == 0

    run(scenario, workers=0)


def test_metrics_render_from_the_in_memory_node_stats() -> None:
    async def scenario(frontend: Frontend, node: MemoryNode, link: MemoryFrontendLink) -> None:
        await _submit(frontend)
        text = render(MemoryNodeStats(node), frontend.queue_depth())
        values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line[0] != "#"}
        assert values["shmgate_in_flight_requests"] == 1 and values["shmgate_request_queue_depth"] == 1
        assert values['shmgate_requests_total{outcome="ok"}'] == 0

    run(scenario)


@pytest.mark.parametrize(
    ("path", "illegal"),
    [
        ((), Phase.RELEASED),
        ((Phase.CLAIMED, Phase.STREAMING), Phase.QUEUED),
        ((Phase.ABANDONED,), Phase.STREAMING),
        ((Phase.DONE,), Phase.DONE),
    ],
)
def test_request_state_refuses_an_illegal_transition(path: tuple[Phase, ...], illegal: Phase) -> None:
    state = RequestState(1, Submit(1, 0, "checksum"), [], 0.0)
    for phase in path:
        state.to(phase)
    with pytest.raises(IllegalTransition):
        state.to(illegal)


def test_metrics_speak_openmetrics_when_the_scraper_asks() -> None:
    node = MemoryNode()
    MemoryFrontendLink(node)
    body, content_type = exposition(MemoryNodeStats(node), lambda: 0, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
    body, content_type = exposition(MemoryNodeStats(node), lambda: 0, "text/plain")
    assert content_type.startswith("text/plain; version=0.0.4") and b"# TYPE shmgate_requests_total counter" in body
