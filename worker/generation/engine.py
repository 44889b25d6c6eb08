"""The generation engine: continuous batching of streamed generations, for any model family.

``GenerationEngine`` implements the engine contract (worker/backends/base.py: ``add``, ``abort``,
``step``, ``has_work``, ``room``) once. A request is checked and queued by ``add``; each ``step``
first drops rows that ended (EOS, stop string, max_tokens, cancel, a failure of their own), then runs
ONE decode forward pass over every running row, then prefills waiting requests, oldest first, within
``max_num_batched_tokens`` tokens per step. A prefilled request samples its first token and joins the
running rows: its own KV cache is merged into theirs, left-padded (kv.py), so a request that arrives
while others generate starts at the next step instead of waiting for their answers.

KV memory is a budget in token positions (``kv_budget``: the padded batch counts rows x length). A
request starts its prefill only if the batch, with it, fits one more step; before a decode step that
would overflow, the newest row is preempted (``_make_room``): its cache is dropped and it goes back to
the head of the queue, to be prefilled again from its prompt and the tokens it had generated
(recompute; its sampler, detokenizer and counts are kept, so its answer goes on where it stopped).

The paged layout (``_use_paged``; worker/backends/hf.py turns it on for families whose tower runs apart when
asked): ``_paged_step`` asks the scheduler (scheduler.py) for a plan from small per-row records and the free
KV blocks, applies it (preempted rows free their blocks and go back to the queue's head), and the subclass's
``_execute`` runs every decoding row and prompt chunk of the plan in ONE forward pass over the rows' blocks
(paged.py, runner.py). Sampling, text and usage are the output processor's (output.py) in both layouts.

What a subclass supplies (worker/backends/hf.py ``HFBackend``, which wires a family's input style to
this engine): ``_check`` (an item's model inputs, or InvalidRequest), ``_prefill_some`` (the next part
of a row's prompt through the model) and ``_decode_step`` (one token for every running row). Nothing
here names a model family, and a new family changes nothing here.

Invariants: every item ends with exactly one event carrying ``finish_reason`` and usage
(``completion_tokens`` counts every sampled token, the EOS token included); a row whose inputs,
logits or grammar fail ends alone (an ``error`` event) and its step mates go on.
"""

from __future__ import annotations

import abc
import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from shmgate.shared.common_options import EngineOptions
from shmgate.shared.errors import InvalidRequest, ModelError
from shmgate.worker.backends.base import BackendEvent, ModelBackend, WorkItem
from shmgate.worker.generation.kv import cache_length, join_cache, select_rows
from shmgate.worker.generation.output import OutputProcessor
from shmgate.worker.generation.paged import BlockPool
from shmgate.worker.generation.rows import Row, prompt_length
from shmgate.worker.generation.sampling import bias_vector, make_generator, token_budget
from shmgate.worker.generation.scheduler import Scheduler, Seq
from shmgate.worker.generation.stats import EngineStats
from shmgate.worker.generation.text import IncrementalDetokenizer, StopStringFilter
from shmgate.worker.health import is_sticky_device_error

__all__ = ["DEFAULT_MAX_NUM_BATCHED_TOKENS", "DEFAULT_MAX_TOKENS", "GenerationEngine"]

log = logging.getLogger("shmgate.worker.hf")

DEFAULT_MAX_TOKENS = 256
# prompt and decode tokens one step runs: --max-num-batched-tokens's declared default (shared/common_options.py)
DEFAULT_MAX_NUM_BATCHED_TOKENS = EngineOptions().max_num_batched_tokens


class GenerationEngine(ModelBackend):
    """Continuous batching over a model a subclass runs: rows, their sampling, text and KV budget."""

    joins_running = True

    def __init__(
        self,
        *,
        tokenizer: Any,
        device: torch.device,
        vocab_size: int,
        max_positions: int,
        eos_token_ids: frozenset[int],
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        kv_budget: int = 0,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        chunked_prefill: bool = False,
    ) -> None:
        """``kv_budget``: KV positions the batch may hold (0: unbounded). ``chunked_prefill``: a long prompt
        may run over several steps' budgets (``_prefill_some`` takes part of it); else it runs whole, in a
        step of its own when it exceeds the budget."""
        self.tokenizer: Any = tokenizer
        self.device = device
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.default_max_tokens = default_max_tokens
        self.kv_budget = kv_budget
        self.max_num_batched_tokens = max(1, max_num_batched_tokens)
        self._chunks = chunked_prefill
        self.output = OutputProcessor(tokenizer, vocab_size, eos_token_ids)  # sampling, text, stop strings, usage
        self.stats = EngineStats()
        self._out: list[BackendEvent] = []  # events of rows that ended before any step (bad inputs)
        self._waiting: deque[Row] = deque()  # oldest first; the head may be part way through its prompt
        self._running: list[Row] = []  # rows that decode together, sharing one left-padded cache
        self._arrivals = 0
        # the paged KV layout (``_use_paged``): the block pool, the planner, each row's block table
        self._pool: BlockPool | None = None
        self._scheduler: Scheduler | None = None
        self._tables: dict[int, list[int]] = {}

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end an answer (the output processor's)."""
        return self.output.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.output.eos_token_ids = ids

    # -- what a subclass runs ---------------------------------------------------------------------------

    @abc.abstractmethod
    def _check(self, item: WorkItem) -> Any:
        """``item``'s model inputs on the device (``input_ids`` [1, L] first). Raises InvalidRequest."""

    @abc.abstractmethod
    def _prefill_some(self, row: Row, budget: int) -> tuple[int, torch.Tensor | None]:
        """Run the next part of ``row``'s prompt (all of it unless prefilled in chunks, then at most
        ``budget`` tokens) into ``row.cache``; return the tokens run and, once the prompt is complete,
        its last logits. A preempted row's prompt is its prompt and the tokens it had generated."""

    @abc.abstractmethod
    def _decode_step(self, rows: Sequence[Row]) -> torch.Tensor:
        """Feed each row's last sampled token in one forward pass; return logits ``[rows, vocab]``."""

    def _use_paged(self, pool: BlockPool) -> None:
        """Step through the scheduler and one packed forward per step over ``pool`` (``_execute``) instead of
        the padded cache; the KV budget becomes the pool's blocks."""
        self._pool = pool
        self._scheduler = Scheduler(pool.block_size, self.max_num_batched_tokens)

    def _execute(self, decode: Sequence[Row], chunks: Sequence[tuple[Row, int, int, bool]]) -> torch.Tensor:
        """The paged layout's step: feed each decoding row's last token and run each prompt chunk (row, start,
        end, whether it ends the prompt) in ONE forward pass over the rows' blocks (``self._tables``); return
        the logits of the decoding rows, then of the chunks that end their prompt."""
        raise NotImplementedError

    def _reuse(self, row: Row) -> int:
        """Paged layout: before a row's first chunk, the positions of its prompt whose KV is already known
        (a stored prefix), written into its blocks by ``_adopt``; 0 when none."""
        return 0

    def run(self, batch: Sequence[WorkItem]) -> Iterator[BackendEvent]:
        """Generate every item of ``batch`` through the engine, yielding text as it is decoded.

        Events' ``index`` is the item's position in ``batch``. An item whose token ids or tensors are
        not what the frontend writes ends alone with an ``error`` event (InvalidRequest).
        """
        if self.has_work():
            raise RuntimeError("run() needs an idle engine")
        keys = {id(item): index for index, item in enumerate(batch)}
        saved = [item.key for item in batch]
        try:
            for item in batch:
                item.key = keys[id(item)]
                self.add(item)
            while self.has_work():
                yield from self.step()
        finally:
            for item, key in zip(batch, saved):
                item.key = key
            self.clear()

    # -- the engine contract (worker/backends/base.py) -------------------------------------------------

    def add(self, item: WorkItem) -> None:
        """Check ``item`` and queue it; it joins the running rows at a later step (prefill first)."""
        try:
            inputs = self._check(item)
            row = self._row(item.key, item, inputs)
        except (InvalidRequest, ModelError) as exc:  # this request's inputs (or its grammar): it fails alone
            self._out.append(BackendEvent(item.key, error=exc))
            return
        needed = row.prompt_tokens + 1
        if self.kv_budget and needed > self.kv_budget:
            self._out.append(
                BackendEvent(
                    item.key,
                    error=InvalidRequest(
                        f"the prompt needs {needed} tokens of KV cache; this worker holds {self.kv_budget} "
                        "(--kv-cache-tokens)"
                    ),
                )
            )
            return
        if row.limit == 0:  # no room in the context (or max_tokens 0): no forward pass for it
            self._out += self.output.finish(row, "length")
            return
        self._arrivals += 1
        row.arrival = self._arrivals
        if not item.bulk:  # the bulk lane: an interactive request starts before the batch lines not started yet
            for place, waiting in enumerate(self._waiting):
                if waiting.item.bulk and waiting.done_tokens == 0 and not waiting.generated:
                    self._waiting.insert(place, row)
                    return
        self._waiting.append(row)

    def abort(self, key: int) -> None:
        for row in (*self._waiting, *self._running):
            if row.index == key:
                row.item.cancelled = True  # it leaves at the next step, prefilling or decoding

    def has_work(self) -> bool:
        return bool(self._out or self._waiting or self._running)

    def engine_report(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        stats = self.stats
        return (self.running, self.waiting, self.kv_used, self.kv_budget), (
            stats.steps,
            int(stats.step_seconds * 1e9),
            stats.step_tokens,
            stats.preemptions,
            stats.encoder_hits,
            stats.encoder_runs,
            stats.prefix_hits,
            stats.prefix_tokens,
        )

    @property
    def running(self) -> int:
        """Rows decoding together."""
        return len(self._running) - self._partial()

    @property
    def waiting(self) -> int:
        """Requests added and not yet running (a preempted row among them)."""
        return len(self._waiting) + self._partial()

    def _partial(self) -> int:
        """Paged layout: rows part way through their prompt (they hold blocks, among ``_running``)."""
        if self._pool is None:
            return 0
        return sum(1 for row in self._running if row.token < 0 or row.done_tokens < prompt_length(row) - 1)

    @property
    def kv_used(self) -> int:
        """KV cache positions held now (the padded batch's rows x length, and prompts part way in)."""
        return self._kv_used()

    def room(self, batch_size: int) -> int:
        """Rows to add now: up to ``batch_size`` running and waiting, none while the KV budget is spent."""
        if self.kv_budget and self._kv_used() >= self.kv_budget:
            return 0
        return max(0, batch_size - len(self._running) - len(self._waiting))

    def clear(self) -> None:
        if self._pool is not None:
            for table in self._tables.values():
                self._pool.release(table)
            self._tables.clear()
        self._out, self._running = [], []
        self._waiting.clear()

    def step(self) -> list[BackendEvent]:
        """Rows that ended leave; the running rows decode one token (one forward pass); then waiting rows
        prefill, oldest first, within ``max_num_batched_tokens`` prompt tokens (a long prompt of a family
        that can be chunked goes in chunks), and each one that completes its prompt joins the running
        rows for the next step."""
        if self._pool is not None:
            return self._paged_step()
        started = time.perf_counter()
        events, self._out = self._out, []
        events += self._end_cancelled()
        self._compact()
        tokens = 0
        if self._running:
            events += self._make_room()
        if self._running:
            decoded = self._decode_step(self._running)
            self.on_step()
            tokens += len(self._running)
            events += self.output.sample(self._running, decoded)
            self._compact()
        budget = max(0, self.max_num_batched_tokens - tokens)
        while self._waiting and (budget > 0 or tokens == 0):
            row = self._waiting[0]
            if row.done_tokens == 0 and self._running and not self._fits(row):
                break  # the KV budget is spent: it waits for rows to leave
            if tokens and not self._chunks and prompt_length(row) - row.done_tokens > budget:
                break  # a whole prompt that does not fit this step's budget waits for the next step
            try:
                used, logits = self._prefill_some(row, max(budget, 1))
            except Exception as exc:  # this request's prompt or images: it fails alone, the batch goes on
                if is_sticky_device_error(exc):
                    raise  # the device is gone for every row: the worker fails them all and restarts
                log.warning("request %x: its prefill failed: %r", row.item.request_id, exc)
                self._waiting.popleft()
                row.finish, row.cache, row.prefill = "error", None, None
                error = (
                    exc if isinstance(exc, InvalidRequest) else ModelError(f"the model failed: {type(exc).__name__}")
                )
                events.append(BackendEvent(row.index, error=error))
                continue
            self.on_step()
            tokens += used
            budget -= used
            if logits is None:
                break  # its prompt goes on in the next step's budget
            self._waiting.popleft()
            events += self.output.sample([row], logits[None])
            if row.finish is None:
                self._join(row)
        self.stats.steps += 1
        self.stats.step_tokens += tokens
        self.stats.step_seconds += time.perf_counter() - started
        return events

    def _end_cancelled(self) -> list[BackendEvent]:
        """Rows whose requests were cancelled or aborted end before the step runs: a waiting row leaves the
        queue, a running one is finished (the step's compaction or ``_leave`` drops it)."""
        events: list[BackendEvent] = []
        for row in list(self._waiting):
            if row.item.cancelled:
                self._waiting.remove(row)
                events += self.output.finish(row, "stop")
        for row in self._running:
            if row.item.cancelled and row.finish is None:
                events += self.output.finish(row, "stop")
        return events

    def _paged_step(self) -> list[BackendEvent]:
        """One step of the paged layout: the scheduler plans (decode first, then prompt chunks within the token
        budget and the free blocks, preempting by lane and age), one forward pass runs the plan, each row that
        got logits samples. ``_running``: rows holding blocks; ``_waiting``: rows holding none, in queue order."""
        assert self._pool is not None and self._scheduler is not None
        started = time.perf_counter()
        events, self._out = self._out, []
        events += self._end_cancelled()
        self._leave()
        pool = self._pool
        seqs = {id(row): row for row in (*self._running, *self._waiting)}
        running = [self._seq(row) for row in self._running]
        waiting = [self._seq(row) for row in self._waiting]
        self._scheduler.max_num_batched_tokens = max(1, self.max_num_batched_tokens)
        # the budget in blocks, rounded up: a prompt within the budget in positions fits in blocks
        self._pool.limit = -(-self.kv_budget // self._pool.block_size)
        plan = self._scheduler.plan(running, waiting, pool.free if pool.bounded else None)
        for key in plan.out_of_room:
            events += self.output.finish(seqs[key], "length")
        if not (plan.tokens or plan.preempted or plan.out_of_room) and (self._running or self._waiting):
            stuck = (self._running or list(self._waiting))[0]  # no block for it and none to free: it cannot grow
            events += self.output.finish(stuck, "length")
            if stuck in self._waiting:
                self._waiting.remove(stuck)
        back = [seqs[key] for key in plan.preempted]
        for row in sorted(back, key=lambda row: row.arrival, reverse=True):
            pool.release(self._tables.pop(id(row), []))
            self._running.remove(row)
            row.done_tokens, row.prefill, row.prefix, row.reused = 0, None, None, -1
            self._waiting.appendleft(row)
            self.stats.preemptions += 1
        decode = [seqs[key] for key in plan.decode]
        chunks: list[tuple[Row, int, int, bool]] = []
        for part in plan.prefill:
            row = seqs[part.key]
            table = self._tables.setdefault(id(row), [])
            pool.grow(table, part.end)
            if row in self._waiting:
                self._waiting.remove(row)
                self._running.append(row)
            chunks.append((row, part.start, part.end, part.last))
        for row in decode:
            pool.grow(self._tables[id(row)], row.done_tokens + 1)
        tokens = plan.tokens
        if decode or chunks:
            try:
                logits = self._execute(decode, chunks)
            except Exception as exc:
                if is_sticky_device_error(exc) or not chunks:
                    raise
                return events + self._fail_prefills(chunks, exc)
            self.on_step()
            for row in decode:
                row.done_tokens += 1
            for row, _, end, _ in chunks:
                row.done_tokens = end
            sampled = [*decode, *(row for row, _, _, last in chunks if last)]
            if sampled:
                events += self.output.sample(sampled, logits)
            self._leave()
        self.stats.steps += 1
        self.stats.step_tokens += tokens
        self.stats.step_seconds += time.perf_counter() - started
        return events

    def _seq(self, row: Row) -> Seq:
        """The scheduler's record of ``row`` (a waiting row's stored prefix counts as computed)."""
        held = len(self._tables.get(id(row), ()))
        if not held and row.reused < 0:
            row.reused = self._reuse(row)
        computed = row.done_tokens if held else max(row.reused, 0)
        chunkable = self._chunks and not self._whole(row)
        return Seq(id(row), row.arrival, prompt_length(row), computed, held, row.item.bulk, chunkable, row.token >= 0)

    def _whole(self, row: Row) -> bool:
        """Its prompt cannot be chunked (the paged layout runs it through the model's own forward)."""
        return False

    def _fail_prefills(self, chunks: Sequence[tuple[Row, int, int, bool]], exc: Exception) -> list[BackendEvent]:
        """A step with prompt chunks failed: the chunks' rows fail alone, the running rows retry next step."""
        events: list[BackendEvent] = []
        for row, _, _, _ in chunks:
            log.warning("request %x: its prefill failed: %r", row.item.request_id, exc)
            row.finish, row.prefill = "error", None
            error = exc if isinstance(exc, InvalidRequest) else ModelError(f"the model failed: {type(exc).__name__}")
            events.append(BackendEvent(row.index, error=error))
        self._leave()
        return events

    def _leave(self) -> None:
        """Paged layout: rows that ended free their blocks and leave."""
        assert self._pool is not None
        for row in [*self._running, *self._waiting]:
            if row.finish is not None:
                self._pool.release(self._tables.pop(id(row), []))
        self._running = [row for row in self._running if row.finish is None]

    # -- rows joining and leaving -------------------------------------------------------------------

    def _compact(self) -> None:
        """Drop ended rows from the running batch's cache at once."""
        still = [row for row in self._running if row.finish is None]
        if still and len(still) < len(self._running):
            select_rows(self._running, still)
        self._running = still

    def _join(self, row: Row) -> None:
        """A prefilled row enters the running batch: its cache is merged into the batch's, left-padded."""
        if self._running:
            join_cache(self._running, row)
        self._running.append(row)

    def _kv_used(self) -> int:
        """KV positions held: the running batch's padded cache (rows x length) and prompts being prefilled."""
        if self._pool is not None:
            return self._pool.used * self._pool.block_size
        used = sum(row.done_tokens for row in self._waiting)
        if self._running:
            used += len(self._running) * cache_length(self._running[0].cache)
        return used

    def _fits(self, row: Row) -> bool:
        """May ``row`` start its prefill: after joining, would the padded batch grow by one more step within
        the KV budget?"""
        if not self.kv_budget:
            return True
        length = row.prompt_tokens + len(row.generated)
        if self._running:
            length = max(length, cache_length(self._running[0].cache))
        return (len(self._running) + 1) * (length + 1) <= self.kv_budget

    def _make_room(self) -> list[BackendEvent]:
        """Before a decode step: while the batch would outgrow the KV budget, preempt the newest row, the
        newest batch line first (its cache is dropped and recomputed from its prompt and its tokens so far
        when it is admitted again, ahead of new requests). A lone row that cannot grow ends with ``length``."""
        events: list[BackendEvent] = []
        while self.kv_budget and self._running:
            if len(self._running) * (cache_length(self._running[0].cache) + 1) <= self.kv_budget:
                break
            if len(self._running) == 1:
                events += self.output.finish(self._running[0], "length")
                self._compact()
                break
            newest = max(self._running, key=lambda row: (row.item.bulk, row.arrival))
            keep = [row for row in self._running if row is not newest]
            select_rows(self._running, keep)
            self._running = keep
            newest.cache, newest.pad, newest.done_tokens, newest.prefill = None, 0, 0, None
            self._waiting.appendleft(newest)
            self.stats.preemptions += 1
        return events

    def _row(self, index: int, item: WorkItem, inputs: Any) -> Row:
        prompt_tokens = inputs.input_ids.shape[1]
        params = item.params
        return Row(
            index=index,
            item=item,
            inputs=inputs,
            prompt_tokens=prompt_tokens,
            limit=token_budget(params, self.default_max_tokens, self.max_positions - prompt_tokens),
            detok=IncrementalDetokenizer(self.tokenizer),
            stops=StopStringFilter(params.stop),
            generator=make_generator(self.device, params.seed),
            bias=bias_vector(params, self.vocab_size, self.device),
            counts=(
                torch.zeros(self.vocab_size, device=self.device)
                if params.presence_penalty or params.frequency_penalty
                else None
            ),
            constraint=self.output.constraint(params.grammar) if params.grammar else None,
        )
