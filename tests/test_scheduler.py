"""The paged engine's step planner alone: no model, no torch (worker/generation/scheduler.py)."""

from __future__ import annotations

from shmgate.worker.generation.scheduler import Prefill, Scheduler, Seq, blocks_for


def _decoding(key: int, length: int, *, arrival: int | None = None, bulk: bool = False, bs: int = 4) -> Seq:
    """A row with ``length`` positions in its KV and one sampled token to feed."""
    return Seq(
        key,
        arrival if arrival is not None else key,
        known=length + 1,
        computed=length,
        blocks=blocks_for(length, bs),
        bulk=bulk,
    )


def test_running_rows_decode_and_waiting_prompts_fill_the_rest_of_the_budget_in_chunks() -> None:
    plan = Scheduler(block_size=4, max_num_batched_tokens=10).plan(
        [_decoding(1, 5), _decoding(2, 8)], [Seq(3, 3, known=20), Seq(4, 4, known=3)], free_blocks=100
    )
    assert plan.decode == [1, 2]
    assert plan.prefill == [Prefill(3, 0, 8, last=False)]  # 10 - 2 decode tokens; its prompt goes on next step
    assert not plan.preempted and plan.tokens == 10


def test_a_prompt_part_way_in_goes_on_before_new_ones_and_short_prompts_share_a_step() -> None:
    partial = Seq(3, 3, known=20, computed=8, blocks=2)
    plan = Scheduler(4, 64).plan([_decoding(1, 5), partial], [Seq(4, 4, known=3), Seq(5, 5, known=2)], None)
    assert plan.decode == [1]
    assert plan.prefill == [Prefill(3, 8, 20, True), Prefill(4, 0, 3, True), Prefill(5, 0, 2, True)]


def test_a_prompt_that_cannot_be_chunked_runs_whole_alone_when_over_the_budget() -> None:
    scheduler = Scheduler(4, 8)
    whole = Seq(3, 3, known=30, chunkable=False)
    assert scheduler.plan([_decoding(1, 5)], [whole], None).prefill == []
    assert scheduler.plan([], [whole], None).prefill == [Prefill(3, 0, 30, True)]


def test_interactive_rows_decode_first_and_the_newest_bulk_row_is_preempted_for_a_block() -> None:
    # every row sits at a block boundary: each needs a new block, one is free
    rows = [_decoding(1, 8, bulk=True), _decoding(2, 8), _decoding(3, 8, bulk=True), _decoding(4, 8)]
    plan = Scheduler(4, 64).plan(rows, [], free_blocks=1)
    assert plan.preempted == [3]  # the bulk lane's newest; its two blocks serve row 4 and row 1
    assert plan.decode == [2, 4, 1]
    plan = Scheduler(4, 64).plan(rows, [], free_blocks=0)
    assert plan.preempted == [3, 1] and plan.decode == [2, 4]
    assert not plan.out_of_room


def test_a_lone_row_that_cannot_grow_is_out_of_room_and_prompts_never_preempt() -> None:
    scheduler = Scheduler(4, 64)
    plan = scheduler.plan([_decoding(1, 8)], [Seq(2, 2, known=3)], free_blocks=0)
    assert plan.out_of_room == [1] and plan.decode == [] and plan.prefill == []
    plan = scheduler.plan([_decoding(1, 7)], [Seq(2, 2, known=9)], free_blocks=1)
    assert plan.decode == [1] and not plan.preempted
    assert plan.prefill == [Prefill(2, 0, 4, False)]  # the one free block's worth, the rest later


def test_a_preempted_row_is_recomputed_from_its_prompt_and_tokens_when_it_returns() -> None:
    back = Seq(7, 1, known=13)  # 10 prompt tokens and 3 generated, nothing in KV
    plan = Scheduler(4, 64).plan([], [back], free_blocks=4)
    assert plan.prefill == [Prefill(7, 0, 13, True)]


def test_a_prompt_one_token_short_of_its_end_is_prefilled_not_decoded() -> None:
    partial = Seq(3, 3, known=9, computed=8, blocks=2, sampled=False)
    plan = Scheduler(4, 64).plan([partial], [], None)
    assert plan.decode == [] and plan.prefill == [Prefill(3, 8, 9, True)]
