"""Worker half of a Hugging Face vision-language model (``hf:<directory>``): streamed generation.

The frontend (gateway/preprocess/hf.py) sends int32 token ids with every image
placeholder already expanded, plus each image's ``pixel_values`` and (Qwen family)
``image_grid_thw``. This module loads the checkpoint and wires it to the generation engine
(worker/generation/: scheduling, sampling, detokenizing, stop strings, the padded KV cache):
it rebuilds the model inputs, prefills and then decodes one token at a time with the KV
cache, so every token reaches the client as soon as it exists (no ``generate``, no streamer
thread: each step is ours to sample, seed, stop or cancel).

A decode step runs ONE forward pass over every running row (``input_ids [rows, 1]``, a
per-row position: prompt length + tokens so far + that row's RoPE delta, and an attention
mask that hides each row's padding).

Families whose vision tower runs apart (``HFFamily.encoder_apart``: Qwen2-VL, Qwen2.5-VL) build the
prompt's embeddings here (the tower's output per image, from the encoder cache when the
image's content key was seen before), so their prompts are prefilled in chunks of the step's
budget; other families prefill a prompt whole, in a step of its own when it exceeds the budget.

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

Inputs come from our own frontend, but a worker checks them anyway before they touch
the device (an out-of-range id is a device-side assert on CUDA, which kills the
process's CUDA context): a mismatch fails that request alone (an ``error`` event), and so do
logits that are not finite (``guarded_pick``); its step mates go on.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from shmgate.shared.common_options import EngineOptions
from shmgate.shared.errors import ModelError
from shmgate.shared.families import HOST_TENSORS, ModelInputs, input_layout
from shmgate.shared.hf_families import HF_FAMILIES, chat_family  # each family's record, naming its style
from shmgate.shared.models import model_id_for  # rules: shared/models.py
from shmgate.worker.backends.base import WorkItem
from shmgate.worker.cache_gauges import SizedCache  # [memory gauges]
from shmgate.worker.encoder_share import SharedEncoderOutputs  # [shared encoder outputs]
from shmgate.worker.generation import (
    EncoderCache,
    EngineStats,
    GenerationEngine,
    IncrementalDetokenizer,
    StopStringFilter,
    guarded_pick,
    pick_token,
    sample_token,
)
from shmgate.worker.generation.cpu_linear import can_pack, pack_language_model
from shmgate.worker.generation.decoder_stack import DecoderStack
from shmgate.worker.generation.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_TOKENS
from shmgate.worker.generation.kv import cache_field, kv_budget_from_free_memory
from shmgate.worker.generation.paged import BlockPool, install
from shmgate.worker.generation.prefix_cache import BLOCK_TOKENS, PrefixCache, cache_layers, prefix_hashes
from shmgate.worker.generation.rows import Row, full_ids, prompt_length
from shmgate.worker.generation.runner import ChunkInput, DecodeInput, PagedRunner

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

# The engine knobs' defaults are their declarations' (shared/common_options.py EngineOptions), written there once
_ENGINE_DEFAULTS = EngineOptions()
# config.model_type values this backend serves: the families of shared/hf_families.py, each run the
# way its record's input style says (shared/families/).
SUPPORTED_MODEL_TYPES = tuple(HF_FAMILIES)
# --dtype values. "auto": bfloat16 on CUDA, float32 on CPU (CPU half precision is slow and
# poorly supported by the kernels these models use).
DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class HFBackend(GenerationEngine):
    """Streams generations of a local ``AutoModelForImageTextToText`` checkpoint.

    Supports the families of shared/hf_families.py (``SUPPORTED_MODEL_TYPES``), each through its input
    style's worker half (shared/families/: the item's checks, token types, positions); this class loads
    the checkpoint and runs the model's forward passes (the prefill whole or in chunks, the tower apart
    with the encoder cache, the decode step) for the generation engine (worker/generation/engine.py:
    continuous batching, decode first, then prefill within a token budget). ``run`` drives the same
    engine over one batch (tests, benchmarks).

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

    def __init__(
        self,
        model_dir: str,
        device: torch.device,
        *,
        dtype: torch.dtype | None = None,
        name: str | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        threads: int | None = None,
        kv_cache_tokens: int = _ENGINE_DEFAULTS.kv_cache_tokens,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        encoder_cache_mb: float = _ENGINE_DEFAULTS.encoder_cache_mb,
        prefix_cache_mb: float = _ENGINE_DEFAULTS.prefix_cache_mb,
        kv_layout: str = _ENGINE_DEFAULTS.kv_layout,
    ) -> None:
        """Load the model (fp32 on CPU, bf16 on CUDA unless ``dtype``) and its tokenizer.

        ``kv_cache_tokens``: the KV budget in token positions (0: unbounded on CPU; on CUDA, what
        ``KV_SHARE_OF_FREE`` of the memory free after the weights holds). ``max_num_batched_tokens``: the
        tokens one step runs. ``encoder_cache_mb``: the vision-tower outputs kept (0: none).
        ``prefix_cache_mb``: prompts' KV kept for prompts that start the same (0: none). ``kv_layout``:
        "auto", "paged" or "padded" (--kv-layout); paged serves families whose tower runs apart or whose
        decoder layers decoder_stack.py runs, the others stay padded; auto is paged on CPU only.

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
        self.dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        model: Any = AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=self.dtype, device_map=_device_map(device)
        )
        self.model: Any = model.to(device).eval()  # a no-op when it was loaded there
        if can_pack(device, self.dtype):  # the language model's few-row products through oneDNN (cpu_linear.py)
            pack_language_model(self.model)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._style = family.style  # its input style's worker half (shared/families/)
        self._layout = input_layout(self._style, self.model.config)
        self._cache_field = cache_field()
        # The tower apart from the prompt (and chunked prefill) where the family allows it
        chunks = family.encoder_apart
        self.encoder_apart = chunks  # read by worker/main.py: only such a family shares its tower outputs
        super().__init__(
            tokenizer=tokenizer,
            device=device,
            vocab_size=self._layout.vocab_size,
            max_positions=self._layout.max_positions,
            eos_token_ids=_eos_ids(self.model, tokenizer),
            default_max_tokens=default_max_tokens,
            kv_budget=kv_cache_tokens
            # [memory gauges] the encoder and prefix caches' bounds are not free for KV: they fill later
            or kv_budget_from_free_memory(
                self.model, device, self.dtype, int((encoder_cache_mb + prefix_cache_mb) * (1 << 20)) if chunks else 0
            ),
            max_num_batched_tokens=max_num_batched_tokens,
            chunked_prefill=chunks,
        )
        self.encoder_cache = EncoderCache(int(encoder_cache_mb * (1 << 20)) if self._chunks else 0)
        # A prefix's KV is reused where a prompt is prefilled in parts (the rest is one more chunk)
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * (1 << 20)) if self._chunks else 0)
        # [shared encoder outputs] set by worker/main.py (--encoder-share-mb): other workers' tower runs
        self.encoder_share: SharedEncoderOutputs | None = None
        self._runner: PagedRunner | None = None
        self._stored: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # row -> its stored prefix's KV
        if kv_layout == "paged" or (kv_layout == "auto" and device.type == "cpu"):
            # paged where its plain decoder loop serves the layers (decoder_stack.py) or the prompt is chunked
            # (the model's own forward reads the blocks); the padded layout serves every family
            if chunks or DecoderStack.of(self.model) is not None:
                self._start_paged(kv_cache_tokens)

    def _start_paged(self, kv_cache_tokens: int) -> None:
        """The paged layout: a block pool of the KV budget (or growing, without one), the paged attention, the
        runner. The positions' shape (multimodal RoPE: 3 rows) is the style's, read from a one-token prompt."""
        text = self.model.config.get_text_config()
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        budget = self.kv_budget
        pool = BlockPool(
            text.num_hidden_layers,
            heads,
            head_dim,
            BLOCK_TOKENS,
            -(-budget // BLOCK_TOKENS) if budget else 0,
            self.dtype,
            self.device,
        )
        one = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            probe, _ = self._style.positions(self.model, self._layout, one, ModelInputs(one, None, None))
        install(self.model)
        self._runner = PagedRunner(self.model, pool, self.device, probe.shape[0] if probe.ndim == 3 else 1)
        self._use_paged(pool)
        log.info(
            "KV layout: paged, blocks of %d positions (%d held now, budget %d positions)",
            BLOCK_TOKENS,
            pool.blocks,
            budget,
        )

    # -- the paged layout's step (generation/engine.py ``_paged_step``) ---------------------------------

    def _whole(self, row: Row) -> bool:
        # a family whose tower does not run apart, and a video's prompt, run through the model's own forward
        return not self._chunks or row.inputs.video_grid_thw is not None

    def _reuse(self, row: Row) -> int:
        """Look up ``row``'s longest stored prefix (all but its last token at most); keep its KV for ``_execute``
        to write into the row's blocks."""
        if not self.prefix_cache.max_bytes or self._whole(row):
            return 0
        ids = np.concatenate([np.frombuffer(row.item.inline, dtype=np.int32), np.asarray(row.generated, np.int32)])
        row.prefix = prefix_hashes(ids, self._layout.image_token_id, self._image_cache_keys(row))
        layers, reused = self.prefix_cache.match(row.prefix, prompt_length(row) - 1)
        if reused:
            self._stored[id(row)] = layers
            self.stats.prefix_hits += 1
            self.stats.prefix_tokens += reused
        return reused

    def _execute(self, decode: Sequence[Row], chunks: Sequence[tuple[Row, int, int, bool]]) -> torch.Tensor:
        runner, tables = self._runner, self._tables
        assert runner is not None
        pool = runner.pool
        whole: dict[int, torch.Tensor] = {}
        packed: list[ChunkInput] = []
        for row, start, end, last in chunks:
            table = tables[id(row)]
            stored = self._stored.pop(id(row), None)
            if stored is not None and start > 0:
                pool.write(table, 0, stored)
            if self._whole(row):
                logits, cache, row.delta = self._prefill(row)
                layers = cache_layers(cache)
                if layers is None:
                    raise ModelError("this model's cache cannot be paged")
                pool.write(table, 0, layers)
                whole[id(row)] = logits
                continue
            if row.prefill is None:
                row.prefill = self._embed_prompt(row)
            embeds, positions = row.prefill
            packed.append(ChunkInput(table, start, end, embeds[:, start:end], positions[..., start:end], last))
        inputs = [
            DecodeInput(
                tables[id(row)],
                row.done_tokens + 1,
                row.token,
                row.prompt_tokens + row.completion_tokens - 1 + row.delta,
            )
            for row in decode
        ]
        out = runner.execute(inputs, packed) if inputs or packed else None
        picked: list[torch.Tensor] = [] if out is None else [out[: len(inputs)]]
        at = len(inputs)
        for row, _, _, last in chunks:
            if not last:
                continue
            if id(row) in whole:
                picked.append(whole[id(row)][None])
                continue
            assert out is not None
            picked.append(out[at : at + 1])
            at += 1
            row.prefill = None
            if row.prefix and not self.prefix_cache.holds(row.prefix):
                self.prefix_cache.put(row.prefix, pool.read(tables[id(row)], len(row.prefix) * BLOCK_TOKENS))
        return picked[0] if len(picked) == 1 else torch.cat(picked)

    def caches(self) -> dict[str, SizedCache | None]:  # [memory gauges] worker/cache_gauges.py
        return {"encoder": self.encoder_cache, "prefix": self.prefix_cache, "grammar": self.output.grammars}

    # -- the model's part of a step (generation/engine.py calls these) ----------------------------------

    def _check(self, item: WorkItem) -> ModelInputs:
        return self._layout.check(item, self.device)

    def _prefill_some(self, row: Row, budget: int) -> tuple[int, torch.Tensor | None]:
        """Run the next part of ``row``'s prompt: all of it, or at most ``budget`` tokens where the family
        is prefilled in chunks. Return the tokens run and, once the prompt is complete, its last logits.

        A preempted row's prompt is its prompt and the tokens it had generated (recompute).
        """
        length = prompt_length(row)
        # a video's tower output is not scattered by _embed_prompt: a prompt with video runs whole, through
        # the model's own forward (which places the video's features and its positions)
        if self._whole(row):
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

    def _reuse_prefix(self, row: Row, length: int) -> None:
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

    def _image_cache_keys(self, row: Row) -> list[tuple[bytes, tuple[int, ...]] | None]:
        """Each image's (content key, grid), what its tower output and the prefixes holding it are stored by;
        None for an image the frontend sent no key for."""
        grids = [tuple(int(v) for v in g[0].tolist()) for g in row.item.tensors.get("image_grid_thw", [])]
        keys = row.item.image_keys if len(row.item.image_keys) == len(grids) else ()
        return [(keys[i], grids[i]) if keys and keys[i] else None for i in range(len(grids))]

    def _embed_prompt(self, row: Row) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's input embeddings (images' tower outputs scattered into their slots, as the model
        does) and its positions (the style's: 3-D for the Qwen family); sets the row's RoPE delta. Families
        whose tower runs apart (``HFFamily.encoder_apart``) only."""
        ids = full_ids(row)
        with torch.inference_mode():
            embeds = self.model.get_input_embeddings()(ids)
            if row.inputs.pixel_values is not None:
                features = self._image_features(row)
                mask = (ids == self._layout.image_token_id).unsqueeze(-1).expand_as(embeds)
                embeds = embeds.masked_scatter(mask, features.to(embeds.device, embeds.dtype))
            positions, row.delta = self._style.positions(self.model, self._layout, ids, row.inputs)
        return embeds, positions

    def _image_features(self, row: Row) -> torch.Tensor:
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
            out = self._style.encode_images(self.model, pixels, grid)  # the family's tower, apart from the prompt
            self.stats.encoder_runs += 1
            for i, computed in zip(missing, out):
                features[i] = computed
                key = cache_keys[i]
                if key is not None:
                    self.encoder_cache.put(key, computed.clone())
                    if self.encoder_share is not None:  # [shared encoder outputs] for the other workers
                        self.encoder_share.publish(key[0], key[1], computed)
        return torch.cat([f for f in features if f is not None])

    def _prefill(self, row: Row) -> tuple[torch.Tensor, Any, int]:
        """Run the whole prompt (and images) through the model's own forward; return the last logits, the
        KV cache and the RoPE delta."""
        inputs = row.inputs
        ids = full_ids(row)
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True, "logits_to_keep": 1}
        kwargs.update(self._style.model_inputs(inputs))  # the images' tensors
        kwargs.update(self._style.extra_inputs(self._layout, ids, row.prompt_tokens))  # token types
        with torch.inference_mode():
            kwargs["position_ids"], delta = self._style.positions(self.model, self._layout, ids, inputs)
            out = self.model(**kwargs)
        return out.logits[0, -1], getattr(out, self._cache_field), delta

    def _decode_step(self, rows: Sequence[Row]) -> torch.Tensor:
        """Feed each row's last sampled token in one forward pass; return logits ``[rows, vocab]``.

        The rows share one cache, left-padded to a common length (generation/kv.py ``join_cache``); the
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
