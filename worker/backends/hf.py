"""Worker half of a Hugging Face vision-language model (``hf:<directory>``): streamed generation.

The frontend (gateway/preprocess/hf.py) sends int32 token ids with every image
placeholder already expanded, plus each image's ``pixel_values`` and (Qwen family)
``image_grid_thw``. This module rebuilds the model inputs, prefills once and then
decodes one token at a time with the KV cache, so every token reaches the client as
soon as it exists (no ``generate``, no streamer thread: each step is ours to sample,
seed, stop or cancel).

Continuous batching (worker/backends/base.py's engine contract): ``add`` queues a checked
request, and each ``step`` first drops rows that ended (EOS, stop string, max_tokens,
cancel, a failure of their own), then runs ONE decode forward pass over every running row
(``input_ids [rows, 1]``, a per-row position: prompt length + tokens so far + that row's
RoPE delta, and an attention mask that hides each row's padding), then prefills waiting
requests, oldest first, within ``max_num_batched_tokens`` tokens per step. A prefilled
request samples its first token and joins the running rows: its own KV cache is merged
into theirs, left-padded with zeros to the longer (``_join_cache``), so a request that
arrives while others generate starts at the next step instead of waiting for their
answers. A row that ends is dropped from the shared cache at once, with the padding all
remaining rows share; the last row left has no padding and decodes exactly as it would
alone. Why padding and not pages: transformers' attention takes a dense cache; a paged one
needs its own kernels, and this keeps every family's attention code as transformers has it.

Families whose vision tower runs apart (``ENCODER_APART``: Qwen2-VL, Qwen2.5-VL) build the
prompt's embeddings here (the tower's output per image, from the encoder cache when the
image's content key was seen before), so their prompts are prefilled in chunks of the step's
budget; other families prefill a prompt whole, in a step of its own when it exceeds the budget.

KV memory is a budget in token positions (``kv_budget``: the padded batch counts rows x
length). A request starts its prefill only if the batch, with it, fits one more step; before
a decode step that would overflow, the newest row is preempted: its cache is dropped and it
goes back to the head of the queue, to be prefilled again from its prompt and the tokens it
had generated (recompute; its sampler, detokenizer and counts are kept, so its answer goes
on where it stopped).

Invariants:
1. An item's output depends only on that item: each request samples from its own
   ``torch.Generator`` (seeded by ``seed``), its positions are its own, and padding is
   masked, so a request gives the same text alone or in any batch. Caveat, measured on
   the tiny test model in float32 on CPU: a masked, padded attention sums in another
   order than an unpadded one, so logits differ by ~1e-7 (same-length rows: bitwise
   equal). A greedy pick flips only where two tokens tie to within that; in bfloat16
   the rounding is coarser and such flips are likelier. tests/test_hf.py checks that
   batched answers (greedy and seeded sampling, mixed lengths, rows ending early)
   equal their solo answers.
2. Positions are computed here and passed explicitly. Qwen2-VL's multimodal RoPE needs
   3-D positions for the prefill and an offset (``rope delta``) for every later token;
   the model would otherwise keep that delta in ``model.model.rope_deltas``, one slot
   shared by every request, which interleaved requests would overwrite.
3. Streamed text is exactly the decoded completion, cut before the first stop string:
   pieces are emitted only when they are final (no dangling half of a UTF-8 character,
   no text that may turn out to start a stop string).
4. Every item ends with exactly one event carrying ``finish_reason`` and usage.
   ``completion_tokens`` counts every sampled token, the EOS token included.

Inputs come from our own frontend, but a worker checks them anyway before they touch
the device (an out-of-range id is a device-side assert on CUDA, which kills the
process's CUDA context): a mismatch fails that request alone (an ``error`` event), and so do
logits that are not finite (``guarded_pick``); its step mates go on.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from shmgate.shared.errors import InvalidRequest, ModelError
from shmgate.shared.hf_families import HF_FAMILIES, InputStyle, chat_family  # each family's record
from shmgate.shared.models import model_id_for  # rules: shared/models.py
from shmgate.shared.wire import MAX_LOGPROB_TOKEN_CHARS, MIN_TEMPERATURE, SamplingParams, TokenLogprob
from shmgate.worker.backends.base import BackendEvent, ModelBackend, WorkItem
from shmgate.worker.constraints import GrammarConstraints, RowConstraint
from shmgate.worker.encoder_share import SharedEncoderOutputs  # [shared encoder outputs]
from shmgate.worker.health import is_sticky_device_error
from shmgate.worker.prefix_cache import PrefixCache, cache_layers, prefix_hashes

__all__ = [
    "DTYPES",
    "EncoderCache",
    "EngineStats",
    "HFBackend",
    "IncrementalDetokenizer",
    "StopStringFilter",
    "model_id_for",
    "guarded_pick",
    "pick_token",
    "sample_token",
]

log = logging.getLogger("shmgate.worker.hf")

DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # prompt and decode tokens one step runs (--max-num-batched-tokens)
DEFAULT_ENCODER_CACHE_MB = 256.0  # vision-tower outputs kept by image (--encoder-cache-mb)
DEFAULT_PREFIX_CACHE_MB = 256.0  # prompts' KV kept by prefix (--prefix-cache-mb, worker/prefix_cache.py)
# On CUDA without --kv-cache-tokens: the KV budget is this share of the memory free after the weights
# (the rest is left to activations, the vision tower and the allocator's slack).
KV_SHARE_OF_FREE = 0.7
# Families whose vision tower runs apart from the prompt here (``get_image_features`` gives one output per
# image, scattered into the prompt's embeddings as the model does): their images' outputs are cached by
# content key and their prompts can be prefilled in chunks. Qwen3-VL also feeds deepstack features into
# its first layers, which this path does not carry, so it stays on the model's own path.
ENCODER_APART = ("qwen2_vl", "qwen2_5_vl")
# config.model_type values this backend serves: the families of shared/hf_families.py, each run the
# way its record's ``inputs`` style says (``_InputLayout.from_config``).
SUPPORTED_MODEL_TYPES = tuple(HF_FAMILIES)
# The image tensors this backend passes to the model, by TensorRef name.
IMAGE_TENSORS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "tile_grid",
    "image_sizes",
    "image_token_count",
    "pixel_values_videos",  # video (Qwen2-VL): gateway/preprocess/qwen_video.py
    "video_grid_thw",
    "second_per_grid_ts",
)
# Read on the host (checked and turned into token counts): the worker hands them over there, so
# checking them costs no device round trip per image.
HOST_TENSORS = (
    "image_grid_thw",
    "tile_grid",
    "image_sizes",
    "image_token_count",
    "video_grid_thw",
    "second_per_grid_ts",
)
# --dtype values. "auto": bfloat16 on CUDA, float32 on CPU (CPU half precision is slow and
# poorly supported by the kernels these models use).
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class HFBackend(ModelBackend):
    """Streams generations of a local ``AutoModelForImageTextToText`` checkpoint.

    Supports the Qwen2-VL family (dynamic resolution, multimodal RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL)
    LLaVA-1.5 (fixed-size CLIP images, 1-D positions), LLaVA-NeXT (any-resolution tiles with image_sizes),
    Idefics3 / SmolVLM / SmolVLM2 (tiles with a pixel mask, 1-D positions), Gemma 3 (token_type_ids, sliding-window
    cache layers), PaliGemma (prefix-LM token_type_ids, positions from 1) and InternVL (crops, 1-D positions):
    ``SUPPORTED_MODEL_TYPES``.

    Scheduling: continuous batching, decode first, then prefill within a token budget (module
    docstring); ``run`` drives the same engine over one batch (tests, benchmarks).

    Host syncs: one per prefill and one per decode step (the sampled tokens of all rows come
    back in one ``.tolist()``: the text must be decoded on the host anyway); none per image or
    per row.
    """

    host_tensors = HOST_TENSORS
    # Rows decoding together when --max-batch-size is 0 (the KV budget bounds them too). A row joins a running
    # batch at the next step, so more rows cost the running ones a little per token (measured on the 8-layer
    # CPU model of bench/vlm_serving.py: 8 rows 21 ms a step, 24 rows 29 ms) while too few make arrivals wait
    # for a row to end (the 24-request mix at 2 req/s: TTFT p99 3.2 s with 8 rows, 0.25 s with 32).
    preferred_batch_size = 32
    joins_running = True

    def __init__(
        self,
        model_dir: str,
        device: torch.device,
        *,
        dtype: torch.dtype | None = None,
        name: str | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        threads: int | None = None,
        kv_cache_tokens: int = 0,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        encoder_cache_mb: float = DEFAULT_ENCODER_CACHE_MB,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
    ) -> None:
        """Load the model (fp32 on CPU, bf16 on CUDA unless ``dtype``) and its tokenizer.

        ``kv_cache_tokens``: the KV budget in token positions (0: unbounded on CPU; on CUDA, what
        ``KV_SHARE_OF_FREE`` of the memory free after the weights holds). ``max_num_batched_tokens``: the
        tokens one step runs. ``encoder_cache_mb``: the vision-tower outputs kept (0: none).
        ``prefix_cache_mb``: prompts' KV kept for prompts that start the same (0: none).

        ``name`` defaults to the directory's base name, the id the frontend serves it
        under (gateway/preprocess/hf.py ``model_id_for``). ``threads`` sets torch's
        intra-op threads of this process (a CPU worker owns its process). Raises
        ValueError for an architecture outside ``SUPPORTED_MODEL_TYPES`` (before reading
        any weights).
        """
        from transformers import AutoModelForImageTextToText, AutoTokenizer

        family = chat_family(model_dir)
        if threads is not None:
            torch.set_num_threads(threads)
        self.name = name or model_id_for(model_dir)
        self.device = device
        self.dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.default_max_tokens = default_max_tokens
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=self.dtype, device_map=_device_map(device))
        self.model: Any = model.to(device).eval()  # a no-op when it was loaded there
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
        self._layout = _InputLayout.from_config(self.model.config, family.inputs)
        self.eos_token_ids: frozenset[int] = _eos_ids(self.model, self.tokenizer)
        self._cache_field = _cache_field()
        self._grammars: GrammarConstraints | None = None  # built on the first response_format row
        self.max_num_batched_tokens = max(1, max_num_batched_tokens)
        self.kv_budget = kv_cache_tokens or _kv_budget_from_free_memory(self.model, device, self.dtype)
        # The tower apart from the prompt (and chunked prefill) where the family allows it
        self._chunks = self.model.config.model_type in ENCODER_APART
        self.encoder_cache = EncoderCache(int(encoder_cache_mb * (1 << 20)) if self._chunks else 0)
        # A prefix's KV is reused where a prompt is prefilled in parts (the rest is one more chunk)
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * (1 << 20)) if self._chunks else 0)
        # [shared encoder outputs] set by worker/main.py (--encoder-share-mb): other workers' tower runs
        self.encoder_share: SharedEncoderOutputs | None = None
        self.stats = EngineStats()
        self._out: list[BackendEvent] = []  # events of rows that ended before any step (bad inputs)
        self._waiting: deque[_Row] = deque()  # oldest first; the head may be part way through its prompt
        self._running: list[_Row] = []  # rows that decode together, sharing one left-padded cache
        self._arrivals = 0

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

    # -- the engine contract (worker/backends/base.py) -----------------------------------------------

    def add(self, item: WorkItem) -> None:
        """Check ``item`` and queue it; it joins the running rows at a later step (prefill first)."""
        try:
            inputs = self._layout.check(item, self.device)
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
            self._out += self._finish(row, "length")
            return
        self._arrivals += 1
        row.arrival = self._arrivals
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
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Requests added and not yet running (a preempted row among them)."""
        return len(self._waiting)

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
        self._out, self._running = [], []
        self._waiting.clear()

    def step(self) -> list[BackendEvent]:
        """Rows that ended leave; the running rows decode one token (one forward pass); then waiting rows
        prefill, oldest first, within ``max_num_batched_tokens`` prompt tokens (a long prompt of a family
        that can be chunked goes in chunks), and each one that completes its prompt joins the running
        rows for the next step."""
        started = time.perf_counter()
        events, self._out = self._out, []
        for row in list(self._waiting):
            if row.item.cancelled:
                self._waiting.remove(row)
                events += self._finish(row, "stop")
        for row in self._running:
            if row.item.cancelled and row.finish is None:
                events += self._finish(row, "stop")
        self._compact()
        tokens = 0
        if self._running:
            events += self._make_room()
        if self._running:
            logits = self._decode_step(self._running)
            self.on_step()
            tokens += len(self._running)
            events += self._sample(self._running, logits)
            self._compact()
        budget = max(0, self.max_num_batched_tokens - tokens)
        while self._waiting and (budget > 0 or tokens == 0):
            row = self._waiting[0]
            if row.done_tokens == 0 and self._running and not self._fits(row):
                break  # the KV budget is spent: it waits for rows to leave
            if tokens and not self._chunks and _prompt_length(row) - row.done_tokens > budget:
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
            events += self._sample([row], logits[None])
            if row.finish is None:
                self._join(row)
        self.stats.steps += 1
        self.stats.step_tokens += tokens
        self.stats.step_seconds += time.perf_counter() - started
        return events

    # -- rows joining and leaving -------------------------------------------------------------------

    def _sample(self, rows: Sequence[_Row], logits: torch.Tensor) -> list[BackendEvent]:
        """Pick and take each row's next token (one host sync for them all); a row whose logits are not
        finite ends alone with an error."""
        picks: list[torch.Tensor] = []
        faults: dict[int, Exception] = {}
        for row, row_logits in zip(rows, logits):
            try:
                picks.append(self._pick(row, row_logits))
            except Exception as exc:  # a sampling fault no check foresaw ends that row alone
                faults[row.index] = exc
                picks.append(torch.zeros(2, dtype=torch.long, device=logits.device))
        picked = _to_host(picks)
        events: list[BackendEvent] = []
        for row, (token, ok) in zip(rows, picked):
            if row.index in faults:
                log.warning("row %s: sampling failed: %r", row.index, faults[row.index])
                row.finish, row.cache = "error", None
                events.append(BackendEvent(row.index, error=ModelError(f"sampling failed: {faults[row.index]}")))
                continue
            if not ok:
                row.finish, row.cache = "error", None
                events.append(
                    BackendEvent(row.index, error=ModelError("the model's output for this request was not finite"))
                )
                continue
            try:
                events += self._accept(row, token)
            except ModelError as exc:  # a row's own fault (its grammar refused the token): it ends alone
                row.finish, row.cache = "error", None
                events.append(BackendEvent(row.index, error=exc))
        return events

    def _compact(self) -> None:
        """Drop ended rows from the running batch's cache at once."""
        still = [row for row in self._running if row.finish is None]
        if still and len(still) < len(self._running):
            _select_rows(self._running, still)
        self._running = still

    def _join(self, row: _Row) -> None:
        """A prefilled row enters the running batch: its cache is merged into the batch's, left-padded."""
        if self._running:
            _join_cache(self._running, row)
        self._running.append(row)

    def _kv_used(self) -> int:
        """KV positions held: the running batch's padded cache (rows x length) and prompts being prefilled."""
        used = sum(row.done_tokens for row in self._waiting)
        if self._running:
            used += len(self._running) * _cache_length(self._running[0].cache)
        return used

    def _fits(self, row: _Row) -> bool:
        """May ``row`` start its prefill: after joining, would the padded batch grow by one more step within
        the KV budget?"""
        if not self.kv_budget:
            return True
        length = row.prompt_tokens + len(row.generated)
        if self._running:
            length = max(length, _cache_length(self._running[0].cache))
        return (len(self._running) + 1) * (length + 1) <= self.kv_budget

    def _make_room(self) -> list[BackendEvent]:
        """Before a decode step: while the batch would outgrow the KV budget, preempt the newest row (its
        cache is dropped and recomputed from its prompt and its tokens so far when it is admitted again,
        ahead of new requests). A lone row that cannot grow ends with ``length``."""
        events: list[BackendEvent] = []
        while self.kv_budget and self._running:
            if len(self._running) * (_cache_length(self._running[0].cache) + 1) <= self.kv_budget:
                break
            if len(self._running) == 1:
                events += self._finish(self._running[0], "length")
                self._compact()
                break
            newest = max(self._running, key=lambda row: row.arrival)
            keep = [row for row in self._running if row is not newest]
            _select_rows(self._running, keep)
            self._running = keep
            newest.cache, newest.pad, newest.done_tokens, newest.prefill = None, 0, 0, None
            self._waiting.appendleft(newest)
            self.stats.preemptions += 1
        return events

    def _row(self, index: int, item: WorkItem, inputs: _Inputs) -> _Row:
        prompt_tokens = inputs.input_ids.shape[1]
        params = item.params
        return _Row(
            index=index,
            item=item,
            inputs=inputs,
            prompt_tokens=prompt_tokens,
            limit=_token_budget(params, self.default_max_tokens, self._layout.max_positions - prompt_tokens),
            detok=IncrementalDetokenizer(self.tokenizer),
            stops=StopStringFilter(params.stop),
            generator=_generator(self.device, params.seed),
            bias=_bias_vector(params, self._layout.vocab_size, self.device),
            counts=(
                torch.zeros(self._layout.vocab_size, device=self.device)
                if params.presence_penalty or params.frequency_penalty
                else None
            ),
            constraint=self._constraint(params.grammar) if params.grammar else None,
        )

    def _constraint(self, grammar: str) -> RowConstraint:
        """A row's grammar matcher; the model's compiler is built on its first constrained row."""
        if self._grammars is None:
            self._grammars = GrammarConstraints(self.tokenizer, self._layout.vocab_size)
        return self._grammars.start(grammar)

    def _pick(self, row: _Row, logits: torch.Tensor) -> torch.Tensor:
        """The row's next token and whether its logits were finite, as ``[token, ok]`` on the device (no sync).

        ``logit_bias`` and the penalties act on the logits first, as in OpenAI's definition:
        ``logit[j] += bias[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty``,
        where ``count`` counts the row's generated tokens (not the prompt's). A per-row constraint
        (a grammar's mask) belongs here too, beside the bias.
        """
        params = row.item.params
        if row.bias is not None or row.counts is not None:
            logits = logits.float()
            if row.bias is not None:
                logits = logits + row.bias
            if row.counts is not None:
                logits = (
                    logits - row.counts * params.frequency_penalty - (row.counts > 0).float() * params.presence_penalty
                )
        if row.constraint is not None:  # structured outputs: tokens the grammar refuses go to -inf
            logits = row.constraint.mask(logits)
        if params.logprobs >= 0:
            row.logprobs = torch.log_softmax(logits.float(), dim=-1)
        token, ok = guarded_pick(logits, params.temperature, params.top_p, row.generator)
        return torch.stack([token.reshape(()).long(), ok.long()])

    def _accept(self, row: _Row, token: int) -> list[BackendEvent]:
        """Take the row's sampled ``token``; return its text, and the end if it ended."""
        row.completion_tokens += 1
        row.token = token
        row.generated.append(token)  # a preempted row's prefill recomputes them
        if row.counts is not None:
            row.counts[token] += 1
        first: list[BackendEvent] = []
        if row.logprobs is not None:
            first.append(BackendEvent(row.index, logprob=self._logprob(row.logprobs, token, row.item.params.logprobs)))
            row.logprobs = None
        if row.constraint is not None:
            row.constraint.accept(token)  # raises ModelError if the grammar refused it: _sample fails the row
        if token in self.eos_token_ids or token in row.item.params.stop_token_ids:
            return first + self._finish(row, "stop")
        text = row.stops.push(row.detok.push(token))
        events = first + ([BackendEvent(row.index, text=text)] if text else [])
        if row.stops.stopped or (row.constraint is not None and row.constraint.finished):
            return events + self._finish(row, "stop")
        if row.completion_tokens >= row.limit:  # no forward pass for a token nobody will read
            return events + self._finish(row, "length")
        return events

    def _logprob(self, logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
        """The sampled token's log-probability and the ``top`` likeliest (one host sync, rows asking only).

        The distribution is the model's after ``logit_bias`` and the penalties, before temperature and
        top_p (vLLM's default, "raw" log-probabilities of the processed logits).
        """
        values, ids = torch.topk(logprobs, top) if top else (logprobs[:0], logprobs[:0].long())
        chosen, top_values, top_ids = float(logprobs[token]), values.tolist(), ids.tolist()
        return TokenLogprob(
            self._token_text(token), chosen, tuple((self._token_text(i), v) for i, v in zip(top_ids, top_values))
        )

    def _token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False))[:MAX_LOGPROB_TOKEN_CHARS]

    def _finish(self, row: _Row, reason: str) -> list[BackendEvent]:
        """End the row: release held-back text (unless a stop string cut it) and report usage."""
        row.finish = reason
        row.cache = row.prefill = None
        tail = ""
        if not row.stops.stopped:  # EOS, length or cancel: release what was held back
            tail = row.stops.push(row.detok.flush())
            tail += row.stops.flush()
        events = [BackendEvent(row.index, text=tail)] if tail else []
        usage = {"prompt_tokens": row.prompt_tokens, "completion_tokens": row.completion_tokens}
        events.append(BackendEvent(row.index, finish_reason=reason, **usage))
        return events

    def _prefill_some(self, row: _Row, budget: int) -> tuple[int, torch.Tensor | None]:
        """Run the next part of ``row``'s prompt: all of it, or at most ``budget`` tokens where the family
        is prefilled in chunks. Return the tokens run and, once the prompt is complete, its last logits.

        A preempted row's prompt is its prompt and the tokens it had generated (recompute).
        """
        length = _prompt_length(row)
        # a video's tower output is not scattered by _embed_prompt: a prompt with video runs whole, through
        # the model's own forward (which places the video's features and its positions)
        if not self._chunks or row.inputs.video_grid_thw is not None:
            logits, row.cache, row.delta = self._prefill(row)
            row.done_tokens = length
            return length, logits
        if row.done_tokens == 0 and self.prefix_cache.max_bytes:
            self._reuse_prefix(row, length)
        if row.prefill is None:
            row.prefill = self._embed_prompt(row)
        embeds, positions = row.prefill
        start, end = row.done_tokens, min(length, row.done_tokens + budget)
        kwargs: dict[str, Any] = {
            "inputs_embeds": embeds[:, start:end],
            "position_ids": positions[..., start:end],
            "use_cache": True,
            "logits_to_keep": 1,
        }
        if row.cache is not None:
            kwargs[self._cache_field] = row.cache
        with torch.inference_mode():
            out = self.model(**kwargs)
        row.cache, row.done_tokens = getattr(out, self._cache_field), end
        if end < length:
            return end - start, None
        row.prefill = None  # the embeddings are in the cache now
        if row.prefix:
            layers = cache_layers(row.cache)
            if layers is not None:
                self.prefix_cache.put(row.prefix, layers)
        return end - start, out.logits[0, -1]

    def _reuse_prefix(self, row: _Row, length: int) -> None:
        """Start ``row``'s cache from the longest stored prefix of its prompt (all but its last token at
        most: the prefill must yield the last token's logits), and name its prompt's prefixes for storing."""
        # the prompt's ids from the host (the descriptor's int32s, checked by ``add``), and a preempted row's
        # tokens so far: no device sync
        ids = np.concatenate([np.frombuffer(row.item.inline, dtype=np.int32), np.asarray(row.generated, np.int32)])
        row.prefix = prefix_hashes(ids, self._layout.image_token_id, self._image_cache_keys(row))
        layers, reused = self.prefix_cache.match(row.prefix, length - 1)
        if reused:
            from transformers import DynamicCache

            row.cache = DynamicCache(ddp_cache_data=layers, config=self.model.config.get_text_config())
            row.done_tokens = reused
            self.stats.prefix_hits += 1
            self.stats.prefix_tokens += reused

    def _image_cache_keys(self, row: _Row) -> list[tuple[bytes, tuple[int, ...]] | None]:
        """Each image's (content key, grid), what its tower output and the prefixes holding it are stored by;
        None for an image the frontend sent no key for."""
        grids = [tuple(int(v) for v in g[0].tolist()) for g in row.item.tensors.get("image_grid_thw", [])]
        keys = row.item.image_keys if len(row.item.image_keys) == len(grids) else ()
        return [(keys[i], grids[i]) if keys and keys[i] else None for i in range(len(grids))]

    def _embed_prompt(self, row: _Row) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's input embeddings (images' tower outputs scattered into their slots, as the model
        does) and its 3-D positions; sets the row's RoPE delta. Families of ``ENCODER_APART`` only."""
        ids = _full_ids(row)
        with torch.inference_mode():
            embeds = self.model.get_input_embeddings()(ids)
            if row.inputs.pixel_values is not None:
                features = self._image_features(row)
                mask = (ids == self._layout.image_token_id).unsqueeze(-1).expand_as(embeds)
                embeds = embeds.masked_scatter(mask, features.to(embeds.device, embeds.dtype))
            positions, row.delta = self._mrope_positions(ids, row.inputs.image_grid_thw)
        return embeds, positions

    def _image_features(self, row: _Row) -> torch.Tensor:
        """Every image's vision-tower output, in prompt order: from the encoder cache by the image's content
        key, the others from one tower run over them together."""
        inputs = row.inputs
        assert inputs.pixel_values is not None and inputs.image_grid_thw is not None
        grids = [tuple(int(v) for v in g[0].tolist()) for g in row.item.tensors.get("image_grid_thw", [])]
        cache_keys = self._image_cache_keys(row)
        features: list[torch.Tensor | None] = [
            None if key is None else self.encoder_cache.get(key) for key in cache_keys
        ]
        # [shared encoder outputs] before running the tower: another worker's output (worker/encoder_share.py)
        if self.encoder_share is not None:
            width = self.model.config.get_text_config().hidden_size
            for i, ck in enumerate(cache_keys):
                if features[i] is None and ck is not None:
                    found = self.encoder_share.get(ck[0], ck[1], self.dtype, width)
                    if found is not None:
                        features[i] = found
                        self.encoder_cache.put(ck, found)
        missing = [i for i, f in enumerate(features) if f is None]
        self.stats.encoder_hits += len(grids) - len(missing)
        if missing:
            patches = [t * h * w for t, h, w in grids]
            starts = np.cumsum([0, *patches]).tolist()
            pixels = torch.cat([inputs.pixel_values[starts[i] : starts[i + 1]] for i in missing])
            grid = inputs.image_grid_thw[missing]
            out = self.model.model.get_image_features(pixels, grid, return_dict=True).pooler_output
            self.stats.encoder_runs += 1
            for i, computed in zip(missing, out):
                features[i] = computed
                key = cache_keys[i]
                if key is not None:
                    self.encoder_cache.put(key, computed.clone())
                    if self.encoder_share is not None:  # [shared encoder outputs] for the other workers
                        self.encoder_share.publish(key[0], key[1], computed)
        return torch.cat([f for f in features if f is not None])

    def _prefill(self, row: _Row) -> tuple[torch.Tensor, Any, int]:
        """Run the whole prompt (and images) through the model's own forward; return the last logits, the
        KV cache and the RoPE delta."""
        inputs = row.inputs
        ids = _full_ids(row)
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True, "logits_to_keep": 1}
        if inputs.pixel_values is not None:
            kwargs["pixel_values"] = inputs.pixel_values
        if inputs.image_grid_thw is not None:
            kwargs["image_grid_thw"] = inputs.image_grid_thw
        if inputs.video_grid_thw is not None:  # video
            kwargs["pixel_values_videos"], kwargs["video_grid_thw"] = inputs.pixel_values_videos, inputs.video_grid_thw
        if inputs.pixel_attention_mask is not None:
            kwargs["pixel_attention_mask"] = inputs.pixel_attention_mask
        if inputs.image_sizes is not None:
            kwargs["image_sizes"] = inputs.image_sizes
        if self._layout.token_types:  # Gemma 3: image tokens attend to each other both ways
            kwargs["token_type_ids"] = (ids == self._layout.image_token_id).long()
        if self._layout.prefix_lm:  # PaliGemma: the prompt is the prefix (a recomputed row's tokens are not)
            kwargs["token_type_ids"] = (
                (torch.arange(ids.shape[1], device=ids.device) >= row.prompt_tokens).view(1, -1).long()
            )
        with torch.inference_mode():
            if self._layout.mrope:
                kwargs["position_ids"], delta = self._mrope_positions(
                    ids, inputs.image_grid_thw, inputs.video_grid_thw, inputs.second_per_grid_ts
                )
            else:  # 1-D positions (LLaVA): the prompt's are 0..L-1, and no offset after it; PaliGemma's count from 1
                delta = 1 if self._layout.prefix_lm else 0
                kwargs["position_ids"] = torch.arange(delta, ids.shape[1] + delta, device=ids.device).view(1, -1)
            out = self.model(**kwargs)
        return out.logits[0, -1], getattr(out, self._cache_field), delta

    def _mrope_positions(
        self,
        ids: torch.Tensor,
        grid: torch.Tensor | None,
        video_grid: torch.Tensor | None = None,
        seconds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, int]:
        """3-D positions of the prompt and the offset of the tokens after it (invariant 2)."""
        if grid is None and video_grid is None:
            positions = torch.arange(ids.shape[1], device=ids.device).view(1, 1, -1).expand(3, 1, -1)
            return positions, 0
        mm_token_type_ids = (ids == self._layout.image_token_id).to(torch.int32)
        mm_token_type_ids += 2 * (ids == self._layout.video_token_id).to(torch.int32)  # video tokens are type 2
        positions, deltas = self.model.model.get_rope_index(
            ids,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=grid,
            video_grid_thw=video_grid,
            **({"second_per_grid_ts": seconds} if seconds is not None and self._layout.video_seconds else {}),
        )
        return positions, int(deltas.reshape(-1)[0])

    def _decode_step(self, rows: Sequence[_Row]) -> torch.Tensor:
        """Feed each row's last sampled token in one forward pass; return logits ``[rows, vocab]``.

        The rows share one cache, left-padded to a common length (``_join_cache``); the
        attention mask hides each row's padding and every row gets its own position.
        """
        cache = rows[0].cache
        with torch.inference_mode():
            ids = torch.tensor([[row.token] for row in rows], device=self.device)
            positions = torch.tensor(
                [[row.prompt_tokens + row.completion_tokens - 1 + row.delta] for row in rows], device=self.device
            )
            kwargs: dict[str, Any] = {"input_ids": ids, "position_ids": positions, self._cache_field: cache}
            if any(row.pad for row in rows):
                mask = torch.ones(len(rows), cache.get_seq_length() + 1, dtype=torch.long, device=self.device)
                for i, row in enumerate(rows):
                    mask[i, : row.pad] = 0
                kwargs["attention_mask"] = mask
            out = self.model(**kwargs, use_cache=True)
        return out.logits[:, -1]


# -- padded batches ------------------------------------------------------------------


@dataclass
class _Row:
    """One item's generation state; rows decoded together share one left-padded cache."""

    index: int
    item: WorkItem
    inputs: _Inputs
    prompt_tokens: int
    limit: int
    detok: IncrementalDetokenizer
    stops: StopStringFilter
    generator: torch.Generator
    completion_tokens: int = 0
    token: int = -1  # the last sampled token: the next decode step's input
    finish: str | None = None
    cache: Any = None
    delta: int = 0  # multimodal RoPE offset of the tokens after the prompt
    pad: int = 0  # zero positions on the left of this row in the shared cache
    bias: torch.Tensor | None = None  # logit_bias as a dense [vocab] vector on the device
    counts: torch.Tensor | None = None  # [vocab] generated-token counts, kept only when a penalty is set
    logprobs: torch.Tensor | None = None  # the last step's log-probabilities, kept only when asked for
    arrival: int = 0  # admission order: preemption takes the newest first
    done_tokens: int = 0  # prompt tokens in its cache so far (prefill in chunks)
    generated: list[int] = field(default_factory=list)  # sampled tokens: a preempted row recomputes them
    prefill: tuple[torch.Tensor, torch.Tensor] | None = None  # embeddings and positions of a chunked prompt
    prefix: list[bytes] | None = None  # its prompt's block hashes (worker/prefix_cache.py), once computed
    constraint: RowConstraint | None = None  # response_format's grammar (worker/constraints.py)


def _join_cache(running: Sequence[_Row], row: _Row) -> None:
    """Merge ``row``'s own cache (batch 1) into the running rows' shared one, both left-padded with zeros to
    the longer: the running rows' padding grows by what the new row is longer, the new row's is the rest."""
    merged, own = running[0].cache, row.cache
    length, row_length = _cache_length(merged), _cache_length(own)
    longest = max(length, row_length)
    for layer, mine in zip(merged.layers, own.layers):
        kind = type(layer).__name__
        if kind not in ("DynamicLayer", "DynamicSlidingWindowLayer"):
            raise RuntimeError(f"cannot batch a {kind} cache layer")
        # A sliding layer holds each row's last min(n, window - 1) positions: left-padded to the longest
        # held, they are the last positions of the padded sequence, which is what the layer must hold.
        held = max(layer.keys.shape[-2], mine.keys.shape[-2])
        for attr in ("keys", "values"):
            ours, theirs = getattr(layer, attr), getattr(mine, attr)
            setattr(
                layer,
                attr,
                torch.cat(
                    [
                        F.pad(ours, (0, 0, held - ours.shape[-2], 0)),
                        F.pad(theirs, (0, 0, held - theirs.shape[-2], 0)),
                    ]
                ),
            )
        if kind == "DynamicSlidingWindowLayer":
            layer.cumulative_length = longest
    for other in running:
        other.pad += longest - length
    row.cache, row.pad = merged, longest - row_length


def _cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def _prompt_length(row: _Row) -> int:
    """What a prefill of ``row`` runs: its prompt, and the tokens it generated before a preemption."""
    return row.prompt_tokens + len(row.generated)


def _full_ids(row: _Row) -> torch.Tensor:
    ids = row.inputs.input_ids
    if not row.generated:
        return ids
    return torch.cat([ids, torch.tensor([row.generated], dtype=ids.dtype, device=ids.device)], dim=1)


def _select_rows(rows: Sequence[_Row], keep: Sequence[_Row]) -> None:
    """Drop finished rows from the shared cache, and the padding every kept row has in common.

    When a single row is left, its padding is gone too and it decodes exactly as it would alone.
    """
    cache = keep[0].cache
    index = torch.tensor([rows.index(row) for row in keep], device=cache.layers[0].keys.device)
    trim = min(row.pad for row in keep)
    for layer in cache.layers:
        keep_positions = layer.keys.shape[-2] - trim
        if type(layer).__name__ == "DynamicSlidingWindowLayer":  # it holds the last positions only
            layer.cumulative_length -= trim
            keep_positions = min(layer.keys.shape[-2], layer.cumulative_length)
        start = layer.keys.shape[-2] - keep_positions
        layer.keys = layer.keys.index_select(0, index)[..., start:, :]
        layer.values = layer.values.index_select(0, index)[..., start:, :]
    for row in keep:
        row.pad -= trim


# -- inputs ----------------------------------------------------------------------


@dataclass
class _Inputs:
    input_ids: torch.Tensor  # int64 [1, L] on the device
    pixel_values: torch.Tensor | None  # [sum of t*h*w, patch_dim]
    image_grid_thw: torch.Tensor | None  # int64 [n_images, 3]
    pixel_attention_mask: torch.Tensor | None = None  # Idefics3: bool [1, tiles, S, S]
    image_sizes: torch.Tensor | None = None  # LLaVA-NeXT: int64 [n_images, 2], original (height, width)
    pixel_values_videos: torch.Tensor | None = None  # Qwen2-VL video: [sum of t*h*w, patch_dim]
    video_grid_thw: torch.Tensor | None = None  # int64 [n_videos, 3]
    second_per_grid_ts: torch.Tensor | None = None  # float32 [n_videos]: Qwen2.5-VL's temporal spacing


@dataclass(frozen=True)
class _InputLayout:
    """What a well-formed item looks like for this model, read from its config once."""

    vocab_size: int
    max_positions: int
    image_token_id: int
    merge: int  # Qwen family: spatial_merge_size ** 2, patches per image token
    patch_dim: int  # Qwen family: channels * temporal_patch_size * patch_size ** 2
    mrope: bool = True  # the Qwen family's 3-D positions; False: LLaVA's fixed-size CLIP images, 1-D positions
    image_size: int = 0  # LLaVA: the CLIP tower's input side
    tokens_per_image: int = 0  # LLaVA: image tokens per image; Idefics3: per tile
    tiled: bool = False  # Idefics3: each image is (1 + rows * cols) tiles of image_size px, a tile_grid beside
    any_resolution: bool = False  # LLaVA-NeXT: tiles fitted to grid_pinpoints, image_sizes and a token count beside
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    token_types: bool = (
        False  # Gemma 3: token_type_ids (1 on image tokens) at prefill, for bidirectional image attention
    )
    crops: bool = False  # InternVL: each image is (n, 3, S, S) crops of tokens_per_image tokens each
    prefix_lm: bool = (
        False  # PaliGemma: token_type_ids 0 over the whole prompt (it attends both ways), positions from 1
    )
    video_token_id: int = -1  # Qwen2-VL: the video placeholder (-1: the model takes no video)
    video_seconds: bool = False  # Qwen2.5-VL: temporal positions spaced by each video's second_per_grid_ts

    @classmethod
    def from_config(cls, config: Any, style: InputStyle) -> _InputLayout:
        """The layout of a model of ``style`` (its family's record, shared/hf_families.py) from its config."""
        text, vision = config.get_text_config(), config.vision_config
        patch = vision.patch_size
        common = {
            "vocab_size": text.vocab_size,
            "max_positions": text.max_position_embeddings,
            "image_token_id": config.image_token_id,
        }
        match style:
            case InputStyle.TILED:
                side = vision.image_size // patch
                return cls(
                    **common,
                    merge=1,
                    patch_dim=0,
                    mrope=False,
                    tiled=True,
                    image_size=vision.image_size,
                    tokens_per_image=side * side // config.scale_factor**2,
                )
            case InputStyle.CROPS:
                # Tokens per crop from the tower's geometry, as the model computes its features: the config's
                # image_seq_length is a copy of the processor's setting that the model never reads (stale in
                # checkpoints whose processor was changed).
                side = int(vision.image_size if isinstance(vision.image_size, int) else vision.image_size[0])
                patch_side = int(patch if isinstance(patch, int) else patch[0])
                return cls(
                    **common,
                    merge=1,
                    patch_dim=0,
                    mrope=False,
                    crops=True,
                    image_size=side,
                    tokens_per_image=int((side // patch_side) ** 2 * config.downsample_ratio**2),
                )
            case InputStyle.PREFIX_LM:
                side = vision.image_size // patch
                return cls(
                    **common,
                    merge=1,
                    patch_dim=0,
                    mrope=False,
                    prefix_lm=True,
                    image_size=vision.image_size,
                    tokens_per_image=side * side,
                )
            case InputStyle.TOKEN_TYPES:
                return cls(
                    **common,
                    merge=1,
                    patch_dim=0,
                    mrope=False,
                    token_types=True,
                    image_size=vision.image_size,
                    tokens_per_image=config.mm_tokens_per_image,
                )
            case InputStyle.ANY_RESOLUTION:
                return cls(
                    **common,
                    merge=1,
                    patch_dim=0,
                    mrope=False,
                    any_resolution=True,
                    image_size=vision.image_size,
                    grid_pinpoints=tuple((int(h), int(w)) for h, w in config.image_grid_pinpoints),
                )
            case InputStyle.FIXED_SIZE:
                side = vision.image_size // patch
                extra = 0 if config.vision_feature_select_strategy == "default" else 1  # the CLS feature
                return cls(
                    **common,
                    merge=1,
                    patch_dim=0,
                    mrope=False,
                    image_size=vision.image_size,
                    tokens_per_image=side * side + extra,
                )
            case InputStyle.MROPE:
                return cls(
                    **common,
                    merge=vision.spatial_merge_size**2,
                    patch_dim=vision.in_channels * vision.temporal_patch_size * patch * patch,
                    # video: Qwen2-VL only (gateway/preprocess/qwen_video.py)
                    video_token_id=int(getattr(config, "video_token_id", -1) or -1)
                    if config.model_type in ("qwen2_vl", "qwen2_5_vl")
                    else -1,
                    video_seconds=config.model_type == "qwen2_5_vl",
                )

    def check(self, item: WorkItem, device: torch.device) -> _Inputs:
        """Validate ``item`` on the host and build its model inputs on ``device``. Raises InvalidRequest."""
        rid = item.request_id
        if not item.inline or len(item.inline) % 4:
            raise InvalidRequest(f"Request {rid}: the token ids are {len(item.inline)} bytes, not int32s.")
        ids = np.frombuffer(item.inline, dtype=np.int32)
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise InvalidRequest(f"Request {rid}: a token id is outside the vocabulary (0..{self.vocab_size - 1}).")
        params = item.params
        if any(not 0 <= t < self.vocab_size for t, _ in params.logit_bias) or any(
            not 0 <= t < self.vocab_size for t in params.stop_token_ids
        ):
            raise InvalidRequest(f"Request {rid}: logit_bias or stop_token_ids name a token outside the vocabulary.")
        unknown = set(item.tensors) - set(IMAGE_TENSORS)
        if unknown:
            raise InvalidRequest(f"Request {rid}: unexpected tensors {sorted(unknown)}.")
        pixels, grids = item.tensors.get("pixel_values", []), item.tensors.get("image_grid_thw", [])
        videos, video_grids = item.tensors.get("pixel_values_videos", []), item.tensors.get("video_grid_thw", [])
        if (videos or video_grids) and self.video_token_id < 0:
            raise InvalidRequest(f"Request {rid}: this model takes no video.")
        if self.tiled:
            return self._check_tiled(item, ids, pixels, device)
        if self.any_resolution:
            return self._check_any_resolution(item, ids, pixels, device)
        if self.crops:
            return self._check_crops(item, ids, pixels, grids, device)
        if not self.mrope:
            return self._check_fixed_size(item, ids, pixels, grids, device)
        if len(pixels) != len(grids):
            raise InvalidRequest(f"Request {rid}: {len(pixels)} pixel_values but {len(grids)} image_grid_thw.")
        image_tokens = 0
        for p, g in zip(pixels, grids):
            image_tokens += self._check_image(rid, p, g)
        if int((ids == self.image_token_id).sum()) != image_tokens:
            raise InvalidRequest(f"Request {rid}: the prompt's image slots do not match its images' patches.")
        if len(videos) != len(video_grids):
            raise InvalidRequest(
                f"Request {rid}: {len(videos)} pixel_values_videos, {len(video_grids)} video_grid_thw."
            )
        video_tokens = sum(self._check_image(rid, p, g) for p, g in zip(videos, video_grids))
        if int((ids == self.video_token_id).sum()) != video_tokens:
            raise InvalidRequest(f"Request {rid}: the prompt's video slots do not match its videos' patches.")
        input_ids = torch.from_numpy(ids.astype(np.int64)).view(1, -1).to(device)
        inputs = _Inputs(input_ids, None, None)
        if pixels:
            inputs = _Inputs(input_ids, torch.cat(pixels).to(device), torch.cat(grids).to(device))
        if videos:
            seconds = item.tensors.get("second_per_grid_ts", [])
            if len(seconds) != len(videos) or any(
                s.dtype != torch.float32 or tuple(s.shape) != (1,) or not 0 < float(s[0]) < 1e4 for s in seconds
            ):
                raise InvalidRequest(f"Request {rid}: each video needs one positive float32 second_per_grid_ts.")
            inputs.pixel_values_videos = torch.cat(videos).to(device)
            inputs.video_grid_thw = torch.cat(video_grids).to(device)
            inputs.second_per_grid_ts = torch.cat(seconds).to(device)
        return inputs

    def _check_crops(
        self,
        item: WorkItem,
        ids: np.ndarray,
        pixels: list[torch.Tensor],
        grids: list[torch.Tensor],
        device: torch.device,
    ) -> _Inputs:
        """InternVL: each image is float (n, 3, S, S) crops of the tower's side S, ``tokens_per_image`` each."""
        rid = item.request_id
        side = self.image_size
        if grids or any(
            not p.is_floating_point() or p.dim() != 4 or p.shape[0] == 0 or tuple(p.shape[1:]) != (3, side, side)
            for p in pixels
        ):
            raise InvalidRequest(
                f"Request {rid}: each image must be float pixel_values of shape (n, 3, {side}, {side})."
            )
        if int((ids == self.image_token_id).sum()) != sum(p.shape[0] for p in pixels) * self.tokens_per_image:
            raise InvalidRequest(f"Request {rid}: the prompt's image slots do not match its images' crops.")
        input_ids = torch.from_numpy(ids.astype(np.int64)).view(1, -1).to(device)
        return _Inputs(input_ids, torch.cat(pixels).to(device) if pixels else None, None)

    def _check_fixed_size(
        self,
        item: WorkItem,
        ids: np.ndarray,
        pixels: list[torch.Tensor],
        grids: list[torch.Tensor],
        device: torch.device,
    ) -> _Inputs:
        """LLaVA: each image is one float (1, 3, S, S) tensor of the tower's size S, worth ``tokens_per_image``."""
        rid = item.request_id
        shape = (1, 3, self.image_size, self.image_size)
        if grids or any(not p.is_floating_point() or tuple(p.shape) != shape for p in pixels):
            raise InvalidRequest(f"Request {rid}: each image must be one float pixel_values tensor of shape {shape}.")
        if int((ids == self.image_token_id).sum()) != len(pixels) * self.tokens_per_image:
            raise InvalidRequest(f"Request {rid}: the prompt's image slots do not match its images.")
        input_ids = torch.from_numpy(ids.astype(np.int64)).view(1, -1).to(device)
        return _Inputs(input_ids, torch.cat(pixels).to(device) if pixels else None, None)

    def _check_tiled(
        self, item: WorkItem, ids: np.ndarray, pixels: list[torch.Tensor], device: torch.device
    ) -> _Inputs:
        """Idefics3: per image, float pixel_values (n, 3, h, w) with h, w <= the tower's side, a bool
        pixel_attention_mask (n, h, w) and a tile_grid of shape (rows + 1, cols + 1), n = 1 + rows * cols
        (1 when unsplit). The images' tiles are padded to the tower's side (mask False there, as the
        processor pads a batch) and joined along the tile axis under one batch axis, as the processor
        does for one prompt."""
        rid = item.request_id
        masks, grids = item.tensors.get("pixel_attention_mask", []), item.tensors.get("tile_grid", [])
        if not len(pixels) == len(masks) == len(grids) or "image_grid_thw" in item.tensors:
            raise InvalidRequest(f"Request {rid}: each image needs pixel_values, pixel_attention_mask and tile_grid.")
        side, tiles = self.image_size, 0
        padded_pixels, padded_masks = [], []
        for p, m, g in zip(pixels, masks, grids):
            rows, cols = (g.shape[0] - 1, g.shape[1] - 1) if g.dim() == 2 else (-1, -1)
            n = 1 + rows * cols if rows > 0 and cols > 0 else 1
            if (
                rows < 0
                or (rows == 0) != (cols == 0)
                or p.dim() != 4
                or not p.is_floating_point()
                or tuple(p.shape[:2]) != (n, 3)
                or max(p.shape[2:]) > side
                or m.dtype != torch.bool
                or tuple(m.shape) != (n, *p.shape[2:])
            ):
                raise InvalidRequest(
                    f"Request {rid}: an image's tiles are not (1 + rows * cols, 3, <= {side}, "
                    f"<= {side}) with a matching pixel_attention_mask and tile_grid."
                )
            pad = (0, side - p.shape[3], 0, side - p.shape[2])
            padded_pixels.append(F.pad(p, pad))
            padded_masks.append(F.pad(m, pad))
            tiles += n
        if int((ids == self.image_token_id).sum()) != tiles * self.tokens_per_image:
            raise InvalidRequest(f"Request {rid}: the prompt's image slots do not match its images' tiles.")
        input_ids = torch.from_numpy(ids.astype(np.int64)).view(1, -1).to(device)
        if not pixels:
            return _Inputs(input_ids, None, None)
        return _Inputs(
            input_ids, torch.cat(padded_pixels)[None].to(device), None, torch.cat(padded_masks)[None].to(device)
        )

    def _check_any_resolution(
        self, item: WorkItem, ids: np.ndarray, pixels: list[torch.Tensor], device: torch.device
    ) -> _Inputs:
        """LLaVA-NeXT: per image, float pixel_values (n, 3, S, S) with n the tiles its image_sizes (int64
        (1, 2)) asks for, and an image_token_count of shape (tokens,). Images are stacked, padded with
        empty tiles to the most tiles (as the processor pads a batch; the model drops them by image_sizes)."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        rid = item.request_id
        sizes, counts = item.tensors.get("image_sizes", []), item.tensors.get("image_token_count", [])
        if not len(pixels) == len(sizes) == len(counts) or "image_grid_thw" in item.tensors:
            raise InvalidRequest(f"Request {rid}: each image needs pixel_values, image_sizes and image_token_count.")
        side = self.image_size
        for p, size in zip(pixels, sizes):
            if size.dtype != torch.int64 or tuple(size.shape) != (1, 2) or int(size.min()) <= 0:
                raise InvalidRequest(f"Request {rid}: image_sizes must be positive int64 (1, 2).")
            n = image_size_to_num_patches(size[0].tolist(), [list(g) for g in self.grid_pinpoints], side)
            if not p.is_floating_point() or tuple(p.shape) != (n, 3, side, side):
                raise InvalidRequest(
                    f"Request {rid}: pixel_values must be float ({n}, 3, {side}, {side}) for "
                    f"an image of {tuple(size[0].tolist())}, got {p.dtype} {tuple(p.shape)}."
                )
        if int((ids == self.image_token_id).sum()) != sum(c.shape[0] for c in counts):
            raise InvalidRequest(f"Request {rid}: the prompt's image slots do not match its images.")
        input_ids = torch.from_numpy(ids.astype(np.int64)).view(1, -1).to(device)
        if not pixels:
            return _Inputs(input_ids, None, None)
        most = max(p.shape[0] for p in pixels)
        stacked = torch.stack([F.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[0])) for p in pixels])
        return _Inputs(input_ids, stacked.to(device), None, image_sizes=torch.cat(sizes).to(device))

    def _check_image(self, rid: int, pixels: torch.Tensor, grid: torch.Tensor) -> int:
        """Check one image's pair of tensors; return its number of image tokens."""
        if grid.dtype != torch.int64 or tuple(grid.shape) != (1, 3):
            raise InvalidRequest(
                f"Request {rid}: image_grid_thw must be int64 (1, 3), got {grid.dtype} {tuple(grid.shape)}."
            )
        t, h, w = (int(v) for v in grid[0].tolist())  # a host tensor (HOST_TENSORS): no device sync
        patches = t * h * w
        if min(t, h, w) <= 0 or patches % self.merge:
            raise InvalidRequest(f"Request {rid}: bad image grid {(t, h, w)}.")
        if not pixels.is_floating_point() or tuple(pixels.shape) != (patches, self.patch_dim):
            raise InvalidRequest(
                f"Request {rid}: pixel_values must be float ({patches}, {self.patch_dim}), "
                f"got {pixels.dtype} {tuple(pixels.shape)}."
            )
        return patches // self.merge


def _cache_field() -> str:
    """The name of the KV cache, as a model's argument and as its output's field: ``cache`` where
    transformers has it (it deprecates ``past_key_values``, with a FutureWarning on every forward
    call, and announces its removal), else ``past_key_values``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def _device_map(device: torch.device) -> str | None:
    """Load the weights straight onto a GPU when transformers can (it needs ``accelerate`` for any
    device_map): otherwise the whole model sits in host memory first (16 GB per worker for a 7B
    model in bfloat16) and is then copied over. None: load on the host (CPU workers, no accelerate).
    """
    if device.type != "cuda":
        return None
    if importlib.util.find_spec("accelerate") is None:
        log.info(
            "loading the weights into host memory first; `pip install accelerate` loads them straight to %s", device
        )
        return None
    return str(device)


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the generation config (an int or a list) and the tokenizer."""
    found: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        found.add(configured)
    elif configured:
        found.update(int(t) for t in configured)
    if tokenizer.eos_token_id is not None:
        found.add(int(tokenizer.eos_token_id))
    return frozenset(found)


def _bias_vector(params: SamplingParams, vocab: int, device: torch.device) -> torch.Tensor | None:
    """``logit_bias`` as a dense vector over the vocabulary (None without one). Ids are checked in ``check``."""
    if not params.logit_bias:
        return None
    bias = torch.zeros(vocab)
    ids, values = zip(*params.logit_bias)
    bias[list(ids)] = torch.tensor(values, dtype=torch.float32)
    return bias.to(device)


def _token_budget(params: SamplingParams, default: int, room: int) -> int:
    """How many tokens to sample: ``max_tokens`` (or the default), within the context left."""
    wanted = default if params.max_tokens is None else params.max_tokens
    return max(0, min(wanted, room))


# -- sampling --------------------------------------------------------------------


def _generator(device: torch.device, seed: int | None) -> torch.Generator:
    """A generator owned by one request: seeded when asked, else from OS entropy."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)  # any JSON int; torch wants 64 bits
    return generator


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Pick the next token from 1-D ``logits``: greedy at temperature 0, else nucleus sampling.

    ``top_p`` keeps the smallest set of most likely tokens whose mass reaches it (the
    most likely token always stays). Ties in greedy mode go to the lowest id.
    """
    return int(pick_token(logits, temperature, top_p, generator))


def pick_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """``sample_token`` without reading the result: a 0-d tensor on ``logits``' device (no host sync)."""
    return guarded_pick(logits, temperature, top_p, generator)[0]


def guarded_pick(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pick_token`` and a 0-d bool tensor saying whether the logits and the distribution were finite.

    A distribution that is not (NaN or infinite logits, or a temperature so small that dividing by it
    overflows) never reaches ``torch.multinomial``, which raises on it on the CPU and asserts on the
    device on CUDA: a uniform one is drawn from instead, and the caller fails the row by the flag.
    """
    # -inf is a token ruled out (a grammar's mask, a logit_bias of -100 taken to the limit); NaN, +inf or
    # nothing left to pick from is a distribution that is not finite
    ok = ~torch.isnan(logits).any() & ~torch.isposinf(logits).any() & torch.isfinite(logits).any()
    if temperature < MIN_TEMPERATURE:  # 0, or so small that dividing by it overflows: greedy, as OpenAI treats 0
        return torch.argmax(logits), ok
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    ok = ok & torch.isfinite(probs).all()
    probs = torch.where(ok, probs, torch.ones_like(probs))
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator)[0], ok
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep = mass_before < top_p
    keep[0] = True
    choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)
    return order[choice][0], ok


def _to_host(picks: Sequence[torch.Tensor]) -> list[tuple[int, bool]]:
    """Every row's ``[token, ok]`` in one device-to-host copy: the step's only sync."""
    return [(int(token), bool(ok)) for token, ok in torch.stack(list(picks)).tolist()]


class EncoderCache:
    """Vision-tower outputs by (image content key, grid), least recently used out first, within ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self._entries: OrderedDict[tuple[bytes, tuple[int, ...]], torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[bytes, tuple[int, ...]]) -> torch.Tensor | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: tuple[bytes, tuple[int, ...]], features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.max_bytes or key in self._entries:
            return
        while self.held_bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.held_bytes -= old.numel() * old.element_size()
        self._entries[key] = features
        self.held_bytes += size


@dataclass
class EngineStats:
    """The generation engine's counters since it started (the worker publishes them for /metrics)."""

    steps: int = 0
    step_tokens: int = 0  # tokens run by all steps (one per decoding row, a prompt's per prefilled token)
    step_seconds: float = 0.0
    preemptions: int = 0
    encoder_hits: int = 0  # images whose tower output came from the encoder cache
    encoder_runs: int = 0  # vision-tower runs (one per prompt with images not cached)
    prefix_hits: int = 0  # prompts that started from a stored prefix's KV
    prefix_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


def _kv_budget_from_free_memory(model: Any, device: torch.device, dtype: torch.dtype) -> int:
    """On CUDA: the token positions ``KV_SHARE_OF_FREE`` of the memory free after the weights holds; 0 (no
    budget) elsewhere."""
    if device.type != "cuda":
        return 0
    text = model.config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, int(free * KV_SHARE_OF_FREE) // per_token)


# -- text ------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns token ids into text pieces as they arrive, each final when emitted.

    Decoding one token at a time is wrong for byte-level BPE (a character may span
    tokens) and for SentencePiece (a token's leading space depends on its left
    neighbour). So a short window is decoded twice, with and without the new tokens,
    and only the difference is emitted, once it no longer ends in a half character
    (U+FFFD). The window restarts at the last emitted boundary, so the cost per token
    stays constant. The concatenated pieces equal ``decode(all ids)``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the window: one piece behind, for context
        self._read = 0  # end of what has been emitted

    def push(self, token: int) -> str:
        """Add ``token``; return the text it completes (often "", sometimes several characters)."""
        self._ids.append(token)
        return self._take(final=False)

    def flush(self) -> str:
        """Return whatever is left, half characters included (the generation is over)."""
        return self._take(final=True)

    def _take(self, *, final: bool) -> str:
        seen = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(seen) and not final:
            return ""
        if text.endswith("\ufffd") and not final:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen) :]

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))


class StopStringFilter:
    """Cuts the streamed text before the first stop string and holds back possible starts of one.

    Text that could be the beginning of a stop string is held until the next piece
    shows whether it is; the rest is released at once. ``stopped`` turns true when a
    stop string has been seen; nothing from it onwards is ever released.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add decoded ``text``; return what may be streamed now."""
        if self.stopped:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[: min(hits)]
        keep = max((_overlap(buffer, s) for s in self._stops), default=0)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release the held text (the generation ended without completing a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
