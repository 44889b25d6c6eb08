"""The step planner of the paged engine: which rows decode, which prompt ranges prefill, who is preempted.

The scheduler only plans. It reads one small record per row (``Seq``: its lane, arrival, the tokens known and
the tokens whose KV is written, the KV blocks it holds) and the step's limits (free KV blocks, the token
budget), and returns a ``Plan``; the engine (worker/generation/engine.py) applies it and the model runner
(worker/generation/runner.py) executes it in one forward pass. Nothing here imports torch or knows a model,
so its tests (tests/test_scheduler.py) run in microseconds.

Policy (vLLM v1's, with shmgate's lanes):
1. Decode first: every running row whose prompt is in its KV runs one token, interactive rows before bulk
   ones. A row that needs a new block when none is free takes one from the newest row holding blocks (the
   bulk lane's newest first), which is preempted: its blocks are freed and it is recomputed from its prompt
   and the tokens it had generated when it is admitted again. A lone row that cannot grow is out of room.
2. Then prompts, within what is left of the token budget: rows part way through their prompt first (they
   hold blocks), then waiting rows, interactive before bulk, oldest first. A chunkable prompt runs as much
   as the budget and the free blocks allow (chunked prefill); a prompt that cannot be chunked runs whole,
   alone in a step when it exceeds the budget. Prompts never preempt anyone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Plan", "Prefill", "Scheduler", "Seq", "blocks_for"]


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks that hold ``tokens`` positions."""
    return -(-tokens // block_size)


@dataclass
class Seq:
    """What the scheduler reads of one row."""

    key: int
    arrival: int  # admission order: the newest is preempted first
    known: int  # tokens known: the prompt and the tokens sampled so far
    computed: int = 0  # positions whose KV is written
    blocks: int = 0  # KV blocks it holds
    bulk: bool = False  # the batch lane: after interactive rows, preempted first
    chunkable: bool = True  # its prompt may run over several steps
    sampled: bool = True  # its last known token was sampled (a prompt's last token is prefilled, never decoded)

    @property
    def decoding(self) -> bool:
        """All but its last sampled token is in its KV: it runs one token a step."""
        return self.sampled and self.known - self.computed == 1 and self.computed > 0


@dataclass(frozen=True)
class Prefill:
    """Prompt positions ``start:end`` of row ``key`` run this step; ``last``: they end its prompt."""

    key: int
    start: int
    end: int
    last: bool


@dataclass
class Plan:
    """One step: rows that decode, prompt ranges that prefill, rows preempted (their blocks freed, back to
    the queue's head) and rows that ran out of room (a lone row that cannot grow: it ends with ``length``)."""

    decode: list[int] = field(default_factory=list)
    prefill: list[Prefill] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    out_of_room: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(p.end - p.start for p in self.prefill)


def _lane_order(seq: Seq) -> tuple[bool, int]:
    return seq.bulk, seq.arrival


class Scheduler:
    """Plans steps for a paged KV of ``block_size`` positions per block."""

    def __init__(self, block_size: int, max_num_batched_tokens: int) -> None:
        self.block_size = block_size
        self.max_num_batched_tokens = max(1, max_num_batched_tokens)

    def plan(self, running: Sequence[Seq], waiting: Sequence[Seq], free_blocks: int | None) -> Plan:
        """The next step. ``running``: rows holding KV (decoding or part way through a prompt); ``waiting``:
        rows holding none, in queue order; ``free_blocks``: None when the pool grows on demand."""
        plan = Plan()
        free = free_blocks
        held = {seq.key: seq.blocks for seq in running}
        victims = sorted(running, key=_lane_order)  # the newest of the lane taken last is at the end
        gone: set[int] = set()
        for seq in sorted((s for s in running if s.decoding), key=_lane_order):
            if seq.key in gone:
                continue
            need = blocks_for(seq.computed + 1, self.block_size) - held[seq.key]
            while free is not None and need > free:
                victim = next(v for v in reversed(victims) if v.key not in gone)
                gone.add(victim.key)
                if victim is seq and len(gone) == len(victims):
                    plan.out_of_room.append(seq.key)
                    break
                plan.preempted.append(victim.key)
                free += held[victim.key]
                if victim is seq:
                    break
            if seq.key in gone:
                continue
            if free is not None:
                free -= need
            held[seq.key] += need
            plan.decode.append(seq.key)
        # a preempted row that was decoding when planned earlier in this loop leaves the decode list
        plan.decode = [key for key in plan.decode if key not in gone]
        budget = self.max_num_batched_tokens - len(plan.decode)
        partial = [s for s in running if not s.decoding and s.key not in gone]
        for seq in (*sorted(partial, key=_lane_order), *waiting):
            if budget <= 0 and plan.tokens:
                break
            remaining = seq.known - seq.computed
            room = None if free is None else free * self.block_size + held.get(seq.key, 0) * self.block_size
            room = None if room is None else room - seq.computed
            if seq.chunkable:
                run = min(remaining, max(budget, 1))
                if room is not None:
                    run = min(run, room)
                if run <= 0:
                    break
            else:
                if plan.tokens and remaining > budget:
                    break  # a whole prompt that does not fit this step's budget waits for the next step
                if room is not None and remaining > room:
                    break
                run = remaining
            need = blocks_for(seq.computed + run, self.block_size) - held.get(seq.key, 0)
            if free is not None:
                free -= need
            held[seq.key] = held.get(seq.key, 0) + need
            plan.prefill.append(Prefill(seq.key, seq.computed, seq.computed + run, seq.computed + run == seq.known))
            budget -= run
            if not plan.prefill[-1].last:
                break  # its prompt goes on in the next step's budget
        return plan
