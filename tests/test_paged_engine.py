"""The paged KV layout (worker/generation/paged.py, scheduler.py, runner.py) on the tiny Qwen2-VL.

The engine's, the backend's and the prefix cache's behaviour tests run here again on a paged backend (imported
below, so each is one test with one text): every answer equals the same request alone and transformers'
own ``generate``, rows join, leave, are cancelled and preempted, prompts are prefilled in chunks and from a
stored prefix. The padded layout's two budget tests are not among them: they count positions of a padded
batch (rows x longest), where the paged layout counts whole blocks. What only the paged layout promises is
checked after: one forward pass per step whatever joins, and KV held in real positions plus at most one
block per row.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from shmgate.gateway.preprocess.hf import HFPreprocessor  # noqa: E402
from shmgate.worker.backends.base import BackendEvent  # noqa: E402
from shmgate.worker.backends.hf import HFBackend  # noqa: E402
from shmgate.worker.generation.prefix_cache import BLOCK_TOKENS  # noqa: E402
from shmgate.worker.generation.rows import prompt_length  # noqa: E402
from tests import test_engine  # noqa: E402
from tests.test_engine import (  # noqa: E402, F401  (its tests run again on the paged backend)
    _alone,
    _drain,
    _item,
    test_a_prompt_longer_than_the_step_budget_is_prefilled_in_chunks,
    test_a_prompt_over_the_kv_budget_fails_alone,
    test_a_repeated_image_skips_the_vision_tower,
    test_a_request_added_mid_answer_joins_at_the_next_step_and_answers_as_alone,
    test_a_row_that_ends_leaves_the_batch_at_once,
    test_a_row_whose_prefill_raises_fails_alone_and_the_running_rows_go_on,
    test_abort_ends_a_waiting_and_a_decoding_row_at_the_next_step,
    test_an_interactive_request_starts_before_waiting_batch_lines_and_a_batch_line_is_preempted_first,
    test_through_the_worker_loop_requests_join_leave_cancel_and_are_preempted,
)
from tests.test_hf import (  # noqa: E402, F401
    SQUARE,
    WIDE,
    answer,
    test_a_cancelled_row_leaves_its_batch_mates_intact,
    test_greedy_stream_equals_transformers_generate,
    test_items_of_a_padded_batch_answer_as_when_alone,
    test_max_tokens_ends_with_length_and_counts_usage,
    test_same_seed_gives_the_same_text,
    test_stop_string_truncates_the_answer,
    test_text_only_prompt_runs,
)
from tests.test_prefix_cache import test_a_chats_next_turn_prefills_only_what_is_new_and_answers_as_from_scratch  # noqa: E402, F401

endless = test_engine.endless  # its fixtures too: ``engine`` is the backend below, idle, settings restored
engine = test_engine.engine


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2_vl_dir: Path) -> Path:
    return tiny_qwen2_vl_dir


@pytest.fixture(scope="module")
def pre(tiny_qwen2_vl_dir: Path) -> HFPreprocessor:
    return HFPreprocessor(tiny_qwen2_vl_dir)


@pytest.fixture(scope="module")
def backend(tiny_qwen2_vl_dir: Path) -> Iterator[HFBackend]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield HFBackend(str(tiny_qwen2_vl_dir), torch.device("cpu"), kv_layout="paged")
    torch.set_num_threads(threads)


def test_one_forward_pass_per_step_while_rows_decode_and_prompts_join(
    pre: HFPreprocessor, engine: HFBackend, endless: tuple[tuple[int, float], ...]
) -> None:
    assert engine._pool is not None  # the paged layout is on
    items = [
        _item(pre, f"Request {i}.", [SQUARE if i % 2 else WIDE], i, max_tokens=12, logit_bias=endless) for i in range(4)
    ]
    alone = {item.key: _alone(engine, item) for item in items}
    runner = engine._runner
    assert runner is not None and runner.stack is not None  # Qwen2-VL's layers run in the plain loop
    calls: list[int] = []  # the model's own forward (the runner's fallback) and the runner's passes

    def passes() -> int:
        return len(calls) + runner.passes

    hook = engine.model.register_forward_hook(lambda *_: calls.append(1))
    events: list[BackendEvent] = []
    start = passes()
    try:
        engine.add(items[0])
        events += engine.step()
        for item in items[1:]:  # two prompts join beside a decoding row, then one more
            engine.add(item)
        steps = 0
        while engine.has_work():
            before = passes()
            events += engine.step()
            steps += 1
            assert passes() - before <= 1
    finally:
        hook.remove()
    assert passes() - start == steps + 1  # the first step's prefill, then one each
    for key, text in alone.items():
        assert answer(events, key)[0] == text


def test_kv_held_is_the_real_positions_and_at_most_one_block_per_row(
    pre: HFPreprocessor, engine: HFBackend, endless: tuple[tuple[int, float], ...]
) -> None:
    lengths = (3, 20, 37)
    for key, tokens in enumerate(lengths):
        engine.add(
            _item(pre, "Hold this." * (key + 1), [SQUARE] if key else [], key, max_tokens=tokens, logit_bias=endless)
        )
    while engine.has_work():
        engine.step()
        rows = engine._running
        real = sum(row.done_tokens for row in rows)
        assert real <= engine.kv_used <= real + BLOCK_TOKENS * len(rows)
    assert engine.kv_used == 0


def test_a_block_budget_preempts_the_newest_and_it_answers_as_alone(
    pre: HFPreprocessor, engine: HFBackend, endless: tuple[tuple[int, float], ...]
) -> None:
    old = _item(pre, "The first request.", [SQUARE], 1, max_tokens=40, logit_bias=endless)
    new = _item(pre, "The second one.", [], 2, max_tokens=40, logit_bias=endless)
    alone = {1: _alone(engine, old), 2: _alone(engine, new)}
    engine.add(old)
    engine.add(new)
    events = engine.step()
    held = engine.kv_used
    rows = sorted(engine._running, key=lambda row: row.index)
    # room for both prompts and a block each, not for 40 tokens each; the old one alone fits
    engine.kv_budget = held + 2 * BLOCK_TOKENS
    assert engine.kv_budget >= prompt_length(rows[0]) + 40 + BLOCK_TOKENS
    before = engine.stats.preemptions
    _drain(engine, events)
    assert engine.stats.preemptions > before
    old_end = next(i for i, e in enumerate(events) if e.index == 1 and e.finish_reason)
    new_end = next(i for i, e in enumerate(events) if e.index == 2 and e.finish_reason)
    assert old_end < new_end  # the newest gave way
    for key in (1, 2):
        text, end = answer(events, key)
        assert (text, end.completion_tokens) == (alone[key], 40)


def test_the_pool_keeps_each_growing_rows_blocks_consecutive_and_names_a_scattered_rows_blocks() -> None:
    from shmgate.worker.generation.paged import BlockPool

    pool = BlockPool(1, 1, 4, block_size=4, capacity=0, dtype=torch.float32, device=torch.device("cpu"))
    tables: list[list[int]] = [[], [], []]
    for length in range(1, 60):  # three rows growing a position at a time, interleaved
        for table in tables:
            pool.grow(table, length)
    for table in tables:
        assert table == list(range(table[0], table[0] + len(table)))
        assert pool.span(table, 59) == (table[0], len(table))
    pool.release(tables[1])
    assert pool.used == len(tables[0]) + len(tables[2])
    # a pool with every other block taken: a new row's blocks cannot be consecutive, and it is told so
    full = BlockPool(1, 1, 4, block_size=4, capacity=0, dtype=torch.float32, device=torch.device("cpu"))
    taken = [[] for _ in range(full.blocks)]
    for table in taken:
        full.grow(table, 4)
    for table in taken:
        if table[0] % 2 == 0:
            full.release(table)
    scattered: list[int] = []
    full.grow(scattered, 12)
    span = full.span(scattered, 12)
    assert isinstance(span, torch.Tensor) and span.tolist() == scattered


def test_rows_whose_blocks_are_scattered_answer_as_alone_and_read_only_what_was_written(
    pre: HFPreprocessor, engine: HFBackend, endless: tuple[tuple[int, float], ...]
) -> None:
    pool = engine._pool
    assert pool is not None
    items = [
        _item(pre, f"Scattered {i}.", [SQUARE] if i else [], i, max_tokens=24, logit_bias=endless) for i in range(2)
    ]
    alone = {item.key: _alone(engine, item) for item in items}
    # the pool is not zeroed: attention must read only positions written, so NaN everywhere changes nothing
    for tensor in (*pool.keys, *pool.values):
        tensor.fill_(float("nan"))
    # every block of the pool taken, then every other one freed: new rows get no two consecutive blocks
    holders = [[] for _ in range(pool.blocks)]
    for table in holders:
        pool.grow(table, pool.block_size)
    for table in holders:
        if table[0] % 2 == 0:
            pool.release(table)
    try:
        for item in items:
            engine.add(item)
        events: list[BackendEvent] = []
        scattered = False
        while engine.has_work():
            events += engine.step()
            scattered |= any(
                isinstance(pool.span(engine._tables[id(row)], row.done_tokens), torch.Tensor)
                for row in engine._running
                if row.done_tokens > pool.block_size
            )
        assert scattered
        for key, text in alone.items():
            assert answer(events, key)[0] == text
    finally:
        for table in holders:
            pool.release(table)
