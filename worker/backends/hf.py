"""Worker half of a Hugging Face vision-language model (``hf:<directory>``): streamed generation.

The frontend (gateway/preprocess/hf.py) sends int32 token ids with every image
placeholder already expanded, plus each image's ``pixel_values`` and (Qwen family)
``image_grid_thw``. This module rebuilds the model inputs, prefills once and then
decodes one token at a time with the KV cache, so every token reaches the client as
soon as it exists (no ``generate``, no streamer thread: each step is ours to sample,
seed, stop or cancel).

Batching (padded decode): each item of a batch is prefilled alone (its prompt length
and images are its own), then the items' KV caches are merged into one, left-padded
with zeros to the longest, and every decode step is ONE forward pass over all live
rows: ``input_ids [rows, 1]``, a per-row position (prompt length + tokens so far +
that row's RoPE delta) and an attention mask that hides each row's padding. A row that
ends (EOS, stop string, max_tokens, cancel) is dropped from the cache at once, with the
padding all remaining rows share; the last row left has no padding and decodes exactly
as it would alone. A batch is fixed when it starts: requests that arrive meanwhile
wait for the next one (no continuous batching).

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
process's CUDA context): a mismatch raises InvalidRequest and fails the batch.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from shmgate.shared.errors import InvalidRequest
from shmgate.shared.hf_families import HF_FAMILIES, InputStyle, chat_family  # each family's record
from shmgate.shared.models import model_id_for  # rules: shared/models.py
from shmgate.shared.wire import MAX_LOGPROB_TOKEN_CHARS, SamplingParams, TokenLogprob
from shmgate.worker.backends.base import BackendEvent, ModelBackend, WorkItem

__all__ = [
    "DTYPES",
    "HFBackend",
    "IncrementalDetokenizer",
    "StopStringFilter",
    "model_id_for",
    "pick_token",
    "sample_token",
]

log = logging.getLogger("shmgate.worker.hf")

DEFAULT_MAX_TOKENS = 256
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

    Batching: prefill per item, then padded batched decode (module docstring). Every
    stream starts after the prefills ahead of it in the batch, then all advance one
    token per forward pass over the whole batch.

    Host syncs: one per prefill and one per decode step (the sampled tokens of all rows come
    back in one ``.tolist()``: the text must be decoded on the host anyway); none per image or
    per row.
    """

    host_tensors = HOST_TENSORS

    def __init__(
        self,
        model_dir: str,
        device: torch.device,
        *,
        dtype: torch.dtype | None = None,
        name: str | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        threads: int | None = None,
    ) -> None:
        """Load the model (fp32 on CPU, bf16 on CUDA unless ``dtype``) and its tokenizer.

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

    def run(self, batch: Sequence[WorkItem]) -> Iterator[BackendEvent]:
        """Generate every item of ``batch``, yielding text as it is decoded.

        All items are checked before any work starts. Raises InvalidRequest when an
        item's token ids or tensors are not what the frontend writes.
        """
        inputs = [self._layout.check(item, self.device) for item in batch]
        rows = [self._row(i, item, x) for i, (item, x) in enumerate(zip(batch, inputs))]
        live: list[_Row] = []
        for row in rows:  # prefill one at a time: every prompt has its own length and images
            if row.limit == 0 or row.item.cancelled:
                yield from self._finish(row, "length" if row.limit == 0 else "stop")
                continue
            logits, row.cache, row.delta = self._prefill(row.inputs)
            self.on_step()
            yield from self._accept(row, _to_host([self._pick(row, logits)])[0])
            if row.finish is None:
                live.append(row)
        if len(live) > 1:
            _merge_caches(live)
        while live:
            for row in live:
                if row.item.cancelled:
                    yield from self._finish(row, "stop")
            still = [row for row in live if row.finish is None]
            if still and len(still) < len(live):  # (two or more rows: they share a merged cache)
                _select_rows(live, still)
            live = still
            if not live:
                break
            logits = self._decode_step(live)
            self.on_step()
            tokens = _to_host([self._pick(row, row_logits) for row, row_logits in zip(live, logits)])
            for row, token in zip(live, tokens):
                yield from self._accept(row, token)

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
        )

    def _pick(self, row: _Row, logits: torch.Tensor) -> torch.Tensor:
        """The row's next token from its ``logits``, left on the device (no sync).

        ``logit_bias`` and the penalties act on the logits first, as in OpenAI's definition:
        ``logit[j] += bias[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty``,
        where ``count`` counts the row's generated tokens (not the prompt's).
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
        if params.logprobs >= 0:
            row.logprobs = torch.log_softmax(logits.float(), dim=-1)
        return pick_token(logits, params.temperature, params.top_p, row.generator)

    def _accept(self, row: _Row, token: int) -> list[BackendEvent]:
        """Take the row's sampled ``token``; return its text, and the end if it ended."""
        row.completion_tokens += 1
        row.token = token
        if row.counts is not None:
            row.counts[token] += 1
        first: list[BackendEvent] = []
        if row.logprobs is not None:
            first.append(BackendEvent(row.index, logprob=self._logprob(row.logprobs, token, row.item.params.logprobs)))
            row.logprobs = None
        if token in self.eos_token_ids or token in row.item.params.stop_token_ids:
            return first + self._finish(row, "stop")
        text = row.stops.push(row.detok.push(token))
        events = first + ([BackendEvent(row.index, text=text)] if text else [])
        if row.stops.stopped:
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
        row.cache = None
        tail = ""
        if not row.stops.stopped:  # EOS, length or cancel: release what was held back
            tail = row.stops.push(row.detok.flush())
            tail += row.stops.flush()
        events = [BackendEvent(row.index, text=tail)] if tail else []
        usage = {"prompt_tokens": row.prompt_tokens, "completion_tokens": row.completion_tokens}
        events.append(BackendEvent(row.index, finish_reason=reason, **usage))
        return events

    def _prefill(self, inputs: _Inputs) -> tuple[torch.Tensor, Any, int]:
        """Run the prompt (and images); return the last logits, the KV cache and the RoPE delta."""
        ids = inputs.input_ids
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
        if self._layout.prefix_lm:  # PaliGemma: the whole prompt is the prefix
            kwargs["token_type_ids"] = torch.zeros_like(ids)
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

        The rows share one cache, left-padded to a common length (``_merge_caches``); the
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


def _merge_caches(rows: Sequence[_Row]) -> None:
    """Turn the rows' own caches (batch 1 each) into one, left-padded with zeros to the longest."""
    caches = [row.cache for row in rows]
    lengths = [cache.get_seq_length() for cache in caches]
    longest = max(lengths)
    merged = caches[0]
    for i, layer in enumerate(merged.layers):
        kind = type(layer).__name__
        if kind not in ("DynamicLayer", "DynamicSlidingWindowLayer"):
            raise RuntimeError(f"cannot batch a {kind} cache layer")
        # A sliding layer holds each row's last min(n, window - 1) positions: left-padded to the longest
        # held, they are the last positions of the padded sequence, which is what the layer must hold.
        held = max(cache.layers[i].keys.shape[-2] for cache in caches)
        for attr in ("keys", "values"):
            parts = [
                F.pad(getattr(cache.layers[i], attr), (0, 0, held - getattr(cache.layers[i], attr).shape[-2], 0))
                for cache in caches
            ]
            setattr(layer, attr, torch.cat(parts))
        if kind == "DynamicSlidingWindowLayer":
            layer.cumulative_length = longest
    for row, n in zip(rows, lengths):
        row.cache, row.pad = merged, longest - n


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
    if temperature <= 0.0:
        return torch.argmax(logits)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator)[0]
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep = mass_before < top_p
    keep[0] = True
    choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)
    return order[choice][0]


def _to_host(tokens: Sequence[torch.Tensor]) -> list[int]:
    """Every row's token in one device-to-host copy: the step's only sync."""
    return [int(t) for t in torch.stack(list(tokens)).tolist()]


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
