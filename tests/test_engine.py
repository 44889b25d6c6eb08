"""The generation engine's step contract on the tiny Qwen2-VL: rows join, leave, are aborted, preempted and
prefilled in chunks, and a repeated image skips the vision tower.

Every check is on events and counts, never on timing: "joins at the next step" means the newcomer's
first token comes out of a step while the long answer is still running. Greedy answers are compared with
the same request run alone (tests/test_hf.py documents the tolerance of padded rows).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from shmgate.gateway.preprocess.hf import HFPreprocessor  # noqa: E402
from shmgate.shared.wire import SamplingParams  # noqa: E402
from shmgate.worker.backends.base import BackendEvent, WorkItem  # noqa: E402
from shmgate.worker.backends.hf import HFBackend  # noqa: E402
from tests.hf_fixture import no_eos_bias  # noqa: E402
from tests.test_hf import SQUARE, WIDE, answer, work_item  # noqa: E402


@pytest.fixture(scope="module")
def pre(tiny_qwen2_vl_dir: Path) -> HFPreprocessor:
    return HFPreprocessor(tiny_qwen2_vl_dir)


@pytest.fixture(scope="module")
def backend(tiny_qwen2_vl_dir: Path) -> Iterator[HFBackend]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield HFBackend(str(tiny_qwen2_vl_dir), torch.device("cpu"), kv_layout="padded")
    torch.set_num_threads(threads)


@pytest.fixture()
def engine(backend: HFBackend) -> Iterator[HFBackend]:
    """The shared backend, idle, with its settings restored after the test."""
    saved = (backend.kv_budget, backend.max_num_batched_tokens, backend.encoder_cache.max_bytes)
    prefix_bytes = backend.prefix_cache.max_bytes
    backend.clear()
    backend.prefix_cache.clear()
    yield backend
    backend.clear()
    backend.prefix_cache.clear()
    backend.kv_budget, backend.max_num_batched_tokens, backend.encoder_cache.max_bytes = saved
    backend.prefix_cache.max_bytes = prefix_bytes


@pytest.fixture(scope="module")
def endless(tiny_qwen2_vl_dir: Path) -> tuple[tuple[int, float], ...]:
    """A logit_bias that keeps the tiny model from ending its answer before max_tokens."""
    return tuple(sorted((int(k), v) for k, v in no_eos_bias(tiny_qwen2_vl_dir).items()))


def _item(pre: HFPreprocessor, text: str, images: list[Path], key: int, **params: object) -> WorkItem:
    item = work_item(pre, text, images, SamplingParams(temperature=0.0, **params), request_id=key)  # type: ignore[arg-type]
    item.key = key
    return item


def _drain(engine: HFBackend, events: list[BackendEvent]) -> None:
    while engine.has_work():
        events += engine.step()


def _alone(engine: HFBackend, item: WorkItem) -> str:
    key, item.key = item.key, 0
    try:
        return answer(list(engine.run([item])))[0]
    finally:
        item.key = key


def _ended(events: list[BackendEvent], key: int) -> bool:
    return any(e.index == key and (e.finish_reason or e.error) for e in events)


def test_a_request_added_mid_answer_joins_at_the_next_step_and_answers_as_alone(
    pre: HFPreprocessor, engine: HFBackend, endless: tuple[tuple[int, float], ...]
) -> None:
    long = _item(pre, "Tell me everything.", [WIDE], 1, max_tokens=40, logit_bias=endless)
    short = _item(pre, "Short one.", [SQUARE], 2, max_tokens=6)
    long_alone, short_alone = _alone(engine, long), _alone(engine, short)
    events: list[BackendEvent] = []
    engine.add(long)
    for _ in range(5):  # the long answer is under way
        events += engine.step()
    assert engine.running == 1
    engine.add(short)
    events += engine.step()  # the newcomer's prefill: its first token comes out of this step
    assert any(e.index == 2 and e.text for e in events) or engine.running == 2
    assert engine.running == 2 and not _ended(events, 1)
    _drain(engine, events)
    short_end = next(i for i, e in enumerate(events) if e.index == 2 and e.finish_reason)
    long_end = next(i for i, e in enumerate(events) if e.index == 1 and e.finish_reason)
    assert short_end < long_end  # it never waited for the long answer
    assert answer(events, 2)[0] == short_alone and answer(events, 1)[0] == long_alone


def test_a_row_that_ends_leaves_the_batch_at_once(
    pre: HFPreprocessor, engine: HFBackend, endless: tuple[tuple[int, float], ...]
) -> None:
    engine.add(_item(pre, "Two words.", [], 1, max_tokens=2, logit_bias=endless))
    engine.add(_item(pre, "Many words.", [SQUARE], 2, max_tokens=12, logit_bias=endless))
    events = engine.step()  # both prefilled: one token each
    assert engine.running == 2
    events += engine.step()  # the first row's second token ends it
    assert _ended(events, 1) and engine.running == 1
    _drain(engine, events)
    assert answer(events, 2)[1].completion_tokens == 12


def test_abort_ends_a_waiting_and_a_decoding_row_at_the_next_step(
    pre: HFPreprocessor, engine: HFBackend, endless: tuple[tuple[int, float], ...]
) -> None:
    engine.add(_item(pre, "Decoding.", [], 1, max_tokens=50, logit_bias=endless))
    events = engine.step()
    engine.max_num_batched_tokens = 1  # the decoding row takes the whole step: the newcomer waits
    engine.add(_item(pre, "Waiting.", [SQUARE], 2, max_tokens=50, logit_bias=endless))
    events += engine.step()
    assert engine.running == 1 and engine.waiting == 1
    engine.abort(1)
    engine.abort(2)
    events += engine.step()
    assert not engine.has_work()
    for key in (1, 2):
        assert answer(events, key)[1].finish_reason == "stop"
    assert answer(events, 1)[1].completion_tokens == 2 and answer(events, 2)[1].completion_tokens == 0


def test_the_newest_row_is_preempted_when_the_kv_budget_would_overflow_and_recomputed(
    pre: HFPreprocessor, engine: HFBackend, endless: tuple[tuple[int, float], ...]
) -> None:
    old = _item(pre, "The first request.", [SQUARE], 1, max_tokens=20, logit_bias=endless)
    new = _item(pre, "The second one.", [], 2, max_tokens=20, logit_bias=endless)
    alone = {1: _alone(engine, old), 2: _alone(engine, new)}
    longest = len(old.inline) // 4
    # Both fit at first, but not for 20 tokens each; the old one alone does.
    engine.kv_budget = 2 * (longest + 6)
    assert engine.kv_budget >= longest + 21
    before = engine.stats.preemptions
    engine.add(old)
    engine.add(new)
    events: list[BackendEvent] = []
    _drain(engine, events)
    assert engine.stats.preemptions - before >= 1
    old_end = next(i for i, e in enumerate(events) if e.index == 1 and e.finish_reason)
    new_end = next(i for i, e in enumerate(events) if e.index == 2 and e.finish_reason)
    assert old_end < new_end  # the newest gave way
    for key in (1, 2):
        text, end = answer(events, key)
        assert (text, end.completion_tokens) == (alone[key], 20)


def test_an_interactive_request_starts_before_waiting_batch_lines_and_a_batch_line_is_preempted_first(
    pre: HFPreprocessor, engine: HFBackend, endless: tuple[tuple[int, float], ...]
) -> None:
    lines = [_item(pre, f"Batch line {i}.", [SQUARE], 10 + i, max_tokens=3) for i in range(2)]
    for line in lines:
        line.bulk = True
    user = _item(pre, "Interactive.", [SQUARE], 20, max_tokens=3)
    engine.max_num_batched_tokens = 1  # one prompt a step: the order of the prefills shows
    for line in lines:
        engine.add(line)
    engine.add(user)
    events: list[BackendEvent] = []
    _drain(engine, events)
    firsts = [next(i for i, e in enumerate(events) if e.index == key) for key in (20, 10, 11)]
    assert firsts == sorted(firsts)  # the interactive request first, then the lines in their order

    # The KV budget: a batch line gives way, though the interactive request is the newest row
    line = _item(pre, "A batch line.", [SQUARE], 30, max_tokens=20, logit_bias=endless)
    line.bulk = True
    user = _item(pre, "A user.", [SQUARE], 31, max_tokens=20, logit_bias=endless)
    engine.max_num_batched_tokens = 2048
    engine.kv_budget = 2 * (max(len(line.inline), len(user.inline)) // 4 + 6)
    before = engine.stats.preemptions
    engine.add(line)
    engine.step()  # the line prefills first and runs
    engine.add(user)
    events = []
    _drain(engine, events)
    assert engine.stats.preemptions - before >= 1
    user_end = next(i for i, e in enumerate(events) if e.index == 31 and e.finish_reason)
    line_end = next(i for i, e in enumerate(events) if e.index == 30 and e.finish_reason)
    assert user_end < line_end and answer(events, 31)[1].completion_tokens == 20


def test_admission_stops_while_the_kv_budget_is_spent_and_a_lone_row_ends_at_it(
    pre: HFPreprocessor, engine: HFBackend, endless: tuple[tuple[int, float], ...]
) -> None:
    item = _item(pre, "Fill it.", [SQUARE], 1, max_tokens=30, logit_bias=endless)
    engine.kv_budget = len(item.inline) // 4 + 1  # the prompt and one more position
    engine.add(item)
    events = engine.step()  # the prefill: the prompt's positions, the first token
    assert engine.room(8) == 7
    events += engine.step()  # the first token's position fills the budget
    assert engine.room(8) == 0 and engine.kv_used == engine.kv_budget
    events += engine.step()  # nothing to preempt for it: the lone row ends where the budget does
    assert not engine.has_work() and engine.room(8) == 8
    end = answer(events, 1)[1]
    assert (end.finish_reason, end.completion_tokens) == ("length", 2)


def test_a_prompt_over_the_kv_budget_fails_alone(pre: HFPreprocessor, engine: HFBackend) -> None:
    big = _item(pre, "Too long.", [WIDE], 1, max_tokens=4)
    small = _item(pre, "Fine.", [], 2, max_tokens=4)
    engine.kv_budget = len(small.inline) // 4 + 8
    engine.add(big)
    engine.add(small)
    events: list[BackendEvent] = []
    _drain(engine, events)
    assert [e.index for e in events if e.error is not None] == [1]
    assert "KV cache" in str(next(e.error for e in events if e.error is not None))
    assert answer(events, 2)[1].completion_tokens == 4


def test_a_prompt_longer_than_the_step_budget_is_prefilled_in_chunks(
    pre: HFPreprocessor, engine: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.prefix_cache.max_bytes = 0  # the same prompt twice: the second would start from the first's KV
    item = _item(pre, "Two pictures, in chunks.", [SQUARE, WIDE], 1, max_tokens=12)
    whole = _alone(engine, item)
    forwards: list[int] = []
    monkeypatch.setattr(engine, "on_step", lambda: forwards.append(1))
    engine.max_num_batched_tokens = 16
    events: list[BackendEvent] = []
    engine.add(item)
    _drain(engine, events)
    text, end = answer(events, 1)
    prompt = len(item.inline) // 4
    assert len(forwards) == -(-prompt // 16) + end.completion_tokens - 1  # chunks, then one per later token
    assert text == whole


def test_a_repeated_image_skips_the_vision_tower(pre: HFPreprocessor, engine: HFBackend) -> None:
    runs: list[int] = []
    hook = engine.model.model.visual.register_forward_hook(lambda *_: runs.append(1))
    try:
        first = _item(pre, "What is it?", [WIDE], 1, max_tokens=8)
        plain = _alone(engine, first)
        assert len(runs) == 1  # no content key: nothing cached
        first.image_keys = (b"k" * 16,)
        again = _item(pre, "What is it?", [WIDE], 2, max_tokens=8)
        again.image_keys = (b"k" * 16,)
        hits = engine.stats.encoder_hits
        assert _alone(engine, first) == plain and len(runs) == 2
        assert _alone(engine, again) == plain and len(runs) == 2  # the second turn reuses the first's output
        assert engine.stats.encoder_hits == hits + 1
        two = _item(pre, "And these?", [WIDE, SQUARE], 3, max_tokens=8)
        two.image_keys = (b"k" * 16, b"s" * 16)
        _alone(engine, two)
        assert len(runs) == 3 and engine.stats.encoder_hits == hits + 2  # only the new image ran
        engine.encoder_cache.max_bytes = 0  # bounded: nothing fits, nothing is kept
        engine.encoder_cache.put((b"x" * 16, (1, 2, 2)), torch.zeros(4))
        assert engine.encoder_cache.get((b"x" * 16, (1, 2, 2))) is None
    finally:
        hook.remove()


def test_the_encoder_cache_forgets_the_least_recently_used_first() -> None:
    from shmgate.worker.backends.hf import EncoderCache

    cache = EncoderCache(max_bytes=3 * 16)  # three 4-float entries
    for name in (b"a", b"b", b"c"):
        cache.put((name, (1, 1, 1)), torch.zeros(4))
    assert cache.get((b"a", (1, 1, 1))) is not None  # a is the most recent now
    cache.put((b"d", (1, 1, 1)), torch.zeros(4))
    assert cache.get((b"b", (1, 1, 1))) is None and cache.get((b"a", (1, 1, 1))) is not None
    assert len(cache) == 3 and cache.held_bytes == 48


# -- the same engine behind a real worker loop, on the in-memory transport ----------------------------


def _chat(text: str, max_tokens: int, bias: tuple[tuple[int, float], ...]) -> bytes:
    import base64
    import json

    url = "data:image/jpeg;base64," + base64.b64encode(SQUARE.read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    body = {
        "model": "tiny-qwen2-vl",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": {str(k): v for k, v in bias},
    }
    return json.dumps(body).encode()


def test_through_the_worker_loop_requests_join_leave_cancel_and_are_preempted(
    tiny_qwen2_vl_dir: Path, backend: HFBackend, endless: tuple[tuple[int, float], ...]
) -> None:
    import asyncio
    import threading

    from shmgate.gateway.frontend import Frontend, FrontendLimits
    from shmgate.gateway.intake import IntakeLimits, parse_chat_request
    from shmgate.shared.stats_layout import Counter
    from shmgate.shared.transport.memory import MemoryFrontendLink, MemoryNode, MemoryNodeStats, MemoryWorkerLink
    from shmgate.shared.wire import Delta, Finished
    from shmgate.worker.main import Worker, WorkerOptions

    backend.clear()
    node = MemoryNode()
    worker = Worker(MemoryWorkerLink(node), WorkerOptions(model=f"hf:{tiny_qwen2_vl_dir}"), backend=backend)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    order: list[str] = []

    async def main() -> None:
        link = MemoryFrontendLink(node, slot=0)
        frontend = Frontend(link, HFPreprocessor(tiny_qwen2_vl_dir), FrontendLimits(request_timeout_s=60))
        await frontend.start()
        try:
            for _ in range(400):
                if frontend.ready():
                    break
                await asyncio.sleep(0.05)
            limits = IntakeLimits()

            async def run(name: str, body: bytes, *, cancel_after: int = 0) -> tuple[str, int, int]:
                state = await frontend.submit(parse_chat_request(body, limits))
                deltas, text = 0, ""
                async for event in frontend.events(state):
                    if isinstance(event, Delta):
                        deltas += 1
                        text += event.text
                        if deltas == 1:
                            order.append(f"{name} first")
                        if deltas == cancel_after:
                            frontend.abandon(state)
                            order.append(f"{name} cancelled")
                            break
                    elif isinstance(event, Finished):
                        order.append(f"{name} done")
                        return text + event.text, event.prompt_tokens, event.completion_tokens
                return text, 0, 0

            long = asyncio.create_task(run("long", _chat("Tell me everything.", 200, endless)))
            while "long first" not in order:
                await asyncio.sleep(0.01)
            await run("short", _chat("Short one.", 4, endless))
            await run("gone", _chat("Leave early.", 200, endless), cancel_after=2)
            await long
            # Preemption: two requests that fit the KV budget together at first but not for 20 tokens each
            bodies = [_chat("The first request.", 20, endless), _chat("The second.", 20, endless)]
            alone = [await run(f"alone {i}", body) for i, body in enumerate(bodies)]
            backend.kv_budget = 2 * (max(prompt for _, prompt, _ in alone) + 6)
            together = await asyncio.gather(*(run(f"together {i}", body) for i, body in enumerate(bodies)))
            assert together == alone  # each answers as alone, its 20 tokens, the preempted one recomputed
        finally:
            await frontend.stop()

    try:
        asyncio.run(main())
        # the cancelled row left the engine at a step boundary while the long answer ran on
        assert order.index("short done") < order.index("long done")
        assert order.index("gone cancelled") < order.index("long done")
        assert node.engine["steps"] > 0 and node.engine["step_tokens"] > node.engine["steps"]
        assert node.engine["preemptions"] >= 1  # reported by the worker, as /metrics reads it
        # The abandoned row's Finished says how far it got: a few tokens, not its 200 (the long one's run on).
        assert 2 <= MemoryNodeStats(node).frontend_totals()[Counter.CANCELLED_TOKENS] < 50
    finally:
        worker.stop()
        thread.join(30)
        backend.clear()
        backend.kv_budget = 0
    assert not thread.is_alive()


def test_a_row_whose_prefill_raises_fails_alone_and_the_running_rows_go_on(
    pre: HFPreprocessor, engine: HFBackend, monkeypatch: pytest.MonkeyPatch, endless: tuple[tuple[int, float], ...]
) -> None:
    running = _item(pre, "Keep going.", [], 1, max_tokens=10, logit_bias=endless)
    alone = _alone(engine, running)
    real = engine._image_features

    def tower(row: object) -> torch.Tensor:  # a fault in one request's images (injected)
        if getattr(row, "index", None) == 2:
            raise RuntimeError("the tower failed on this image")
        return real(row)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "_image_features", tower)
    engine.add(running)
    events = engine.step()
    engine.add(_item(pre, "Broken image.", [SQUARE], 2, max_tokens=10))
    _drain(engine, events)
    failed = [e for e in events if e.error is not None]
    assert [e.index for e in failed] == [2] and "RuntimeError" in str(failed[0].error)
    assert answer(events, 1)[0] == alone
