"""The padded KV cache the running rows share, and its budget in token positions.

Rows decoded together share one cache, left-padded with zeros to a common length: a prefilled row's
own cache is merged in (``join_cache``), ended rows are dropped from it with the padding every kept
row has in common (``select_rows``), and the last row left has no padding and decodes exactly as it
would alone. Why padding and not pages: transformers' attention takes a dense cache; a paged one
needs its own kernels, and this keeps every family's attention code as transformers has it.

The budget (``kv_budget_from_free_memory``) counts the padded batch as rows x length. Nothing here
knows a model family: it reads transformers' dynamic cache layers (full and sliding-window).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from shmgate.worker.generation.rows import Row

__all__ = [
    "KV_SHARE_OF_FREE",
    "cache_field",
    "cache_length",
    "join_cache",
    "kv_budget_from_free_memory",
    "select_rows",
]

# On CUDA without --kv-cache-tokens: the KV budget is this share of the memory free after the weights
# (the rest is left to activations, the vision tower and the allocator's slack).
KV_SHARE_OF_FREE = 0.7


def join_cache(running: Sequence[Row], row: Row) -> None:
    """Merge ``row``'s own cache (batch 1) into the running rows' shared one, both left-padded with zeros to
    the longer: the running rows' padding grows by what the new row is longer, the new row's is the rest."""
    merged, own = running[0].cache, row.cache
    length, row_length = cache_length(merged), cache_length(own)
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


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def select_rows(rows: Sequence[Row], keep: Sequence[Row]) -> None:
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


def cache_field() -> str:
    """The name of the KV cache, as a model's argument and as its output's field: ``cache`` where
    transformers has it (it deprecates ``past_key_values``, with a FutureWarning on every forward
    call, and announces its removal), else ``past_key_values``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"


def kv_budget_from_free_memory(model: Any, device: torch.device, dtype: torch.dtype, reserved: int = 0) -> int:
    """On CUDA: the token positions ``KV_SHARE_OF_FREE`` of the memory free after the weights holds; 0 (no
    budget) elsewhere. ``reserved``: bytes the worker's caches may fill later (their bounds), not free for KV."""
    if device.type != "cuda":
        return 0
    text = model.config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    free, _ = torch.cuda.mem_get_info(device)
    free = max(0, free - reserved)  # [memory gauges] the caches' bounds
    return max(1, int(free * KV_SHARE_OF_FREE) // per_token)
