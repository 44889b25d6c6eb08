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

Families whose vision tower runs apart (``ENCODER_APART``: Qwen2-VL, Qwen2.5-VL) build the
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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from shmgate.shared.errors import InvalidRequest
from shmgate.shared.hf_families import HF_FAMILIES, InputStyle, chat_family  # each family's record
from shmgate.shared.models import model_id_for  # rules: shared/models.py
from shmgate.worker.backends.base import WorkItem
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
from shmgate.worker.generation.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_TOKENS
from shmgate.worker.generation.kv import cache_field, kv_budget_from_free_memory
from shmgate.worker.generation.rows import Row, full_ids, prompt_length

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

DEFAULT_ENCODER_CACHE_MB = 256.0  # vision-tower outputs kept by image (--encoder-cache-mb)
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


class HFBackend(GenerationEngine):
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
    ) -> None:
        """Load the model (fp32 on CPU, bf16 on CUDA unless ``dtype``) and its tokenizer.

        ``kv_cache_tokens``: the KV budget in token positions (0: unbounded on CPU; on CUDA, what
        ``KV_SHARE_OF_FREE`` of the memory free after the weights holds). ``max_num_batched_tokens``: the
        tokens one step runs. ``encoder_cache_mb``: the vision-tower outputs kept (0: none).

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
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=self.dtype, device_map=_device_map(device))
        self.model: Any = model.to(device).eval()  # a no-op when it was loaded there
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._layout = _InputLayout.from_config(self.model.config, family.inputs)
        self._cache_field = cache_field()
        # The tower apart from the prompt (and chunked prefill) where the family allows it
        chunks = self.model.config.model_type in ENCODER_APART
        super().__init__(
            tokenizer=tokenizer,
            device=device,
            vocab_size=self._layout.vocab_size,
            max_positions=self._layout.max_positions,
            eos_token_ids=_eos_ids(self.model, tokenizer),
            default_max_tokens=default_max_tokens,
            kv_budget=kv_cache_tokens or kv_budget_from_free_memory(self.model, device, self.dtype),
            max_num_batched_tokens=max_num_batched_tokens,
            chunked_prefill=chunks,
        )
        self.encoder_cache = EncoderCache(int(encoder_cache_mb * (1 << 20)) if self._chunks else 0)

    # -- the model's part of a step (generation/engine.py calls these) ----------------------------------

    def _check(self, item: WorkItem) -> _Inputs:
        return self._layout.check(item, self.device)

    def _prefill_some(self, row: Row, budget: int) -> tuple[int, torch.Tensor | None]:
        """Run the next part of ``row``'s prompt: all of it, or at most ``budget`` tokens where the family
        is prefilled in chunks. Return the tokens run and, once the prompt is complete, its last logits.

        A preempted row's prompt is its prompt and the tokens it had generated (recompute).
        """
        length = prompt_length(row)
        # a video's tower output is not scattered by _embed_prompt: a prompt with video runs whole, through
        # the model's own forward (which places the video's features and its positions)
        if not self._chunks or row.inputs.video_grid_thw is not None:
            logits, row.cache, row.delta = self._prefill(row)
            row.done_tokens = length
            return length, logits
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
        return end - start, out.logits[0, -1]

    def _embed_prompt(self, row: Row) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's input embeddings (images' tower outputs scattered into their slots, as the model
        does) and its 3-D positions; sets the row's RoPE delta. Families of ``ENCODER_APART`` only."""
        ids = full_ids(row)
        with torch.inference_mode():
            embeds = self.model.get_input_embeddings()(ids)
            if row.inputs.pixel_values is not None:
                features = self._image_features(row)
                mask = (ids == self._layout.image_token_id).unsqueeze(-1).expand_as(embeds)
                embeds = embeds.masked_scatter(mask, features.to(embeds.device, embeds.dtype))
            positions, row.delta = self._mrope_positions(ids, row.inputs.image_grid_thw)
        return embeds, positions

    def _image_features(self, row: Row) -> torch.Tensor:
        """Every image's vision-tower output, in prompt order: from the encoder cache by the image's content
        key, the others from one tower run over them together."""
        inputs = row.inputs
        assert inputs.pixel_values is not None and inputs.image_grid_thw is not None
        grids = [tuple(int(v) for v in g[0].tolist()) for g in row.item.tensors.get("image_grid_thw", [])]
        keys = row.item.image_keys if len(row.item.image_keys) == len(grids) else ()
        cache_keys = [(keys[i], grids[i]) if keys and keys[i] else None for i in range(len(grids))]
        features: list[torch.Tensor | None] = [
            None if key is None else self.encoder_cache.get(key) for key in cache_keys
        ]
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
        return torch.cat([f for f in features if f is not None])

    def _prefill(self, row: Row) -> tuple[torch.Tensor, Any, int]:
        """Run the whole prompt (and images) through the model's own forward; return the last logits, the
        KV cache and the RoPE delta."""
        inputs = row.inputs
        ids = full_ids(row)
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
