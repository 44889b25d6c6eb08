"""Prefix KV reuse: a prompt that starts like an earlier one (a chat's next turn, a shared system prompt
and image) prefills only what is new.

Every turn of a chat resends the image and the whole history. The encoder cache skips the vision tower
for the repeated image, but the language model would still prefill the whole prompt again: on the 8-layer
CPU model of ``python -m bench prefix-reuse``, a fourth turn's 742 tokens take ~270 ms where its 157 new
ones take ~60 (docs/BENCHMARKS.md "Prefix KV reuse").

How a prefix is named: the prompt's token ids in blocks of ``BLOCK_TOKENS``, each block's hash chained to
the one before it (the hash at a block's end names the whole prefix up to it, as vLLM's prefix cache does),
with each image's content key and grid mixed into the block where its tokens start, since an image's
placeholder tokens are the same ids whatever the image. An image without a content key ends what can be
named: nothing from its block on is stored or matched.

What is kept: after a prompt's prefill, its KV for the whole blocks of the prompt (a copy, batch 1, as the
row's own cache held it before joining the running batch), under every block boundary's hash; LRU within
``max_bytes``. A new row looks up its longest named prefix, starts its cache from a copy of that much of
the entry, and prefills the rest (always at least its last token, whose logits it needs). KV at a position
depends only on the tokens up to it (causal attention) and the positions (multimodal RoPE positions of a
prefix depend only on the prefix too), so a reused prefix is the KV a fresh prefill computes, up to
floating-point differences in how the matrix products were split; tests/test_prefix_cache.py checks that
greedy answers are the same.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["BLOCK_TOKENS", "PrefixCache", "prefix_hashes"]

BLOCK_TOKENS = 16  # the granularity of a match: a prefix is reused in whole blocks


def prefix_hashes(
    ids: np.ndarray, image_token_id: int, image_keys: Sequence[tuple[bytes, tuple[int, ...]] | None]
) -> list[bytes]:
    """The hash naming the prefix up to each whole block's end of ``ids`` (int32, one prompt), in order; it
    stops before a block holding the start of an image whose key is None (its content is unknown)."""
    is_image = ids == image_token_id
    run_starts = np.flatnonzero(is_image & ~np.concatenate(([False], is_image[:-1])))
    starts: dict[int, list[tuple[bytes, tuple[int, ...]] | None]] = {}  # block -> keys of images starting in it
    for image, position in enumerate(run_starts.tolist()):
        starts.setdefault(position // BLOCK_TOKENS, []).append(image_keys[image] if image < len(image_keys) else None)
    hashes: list[bytes] = []
    chain = b""
    for block in range(len(ids) // BLOCK_TOKENS):
        keys = starts.get(block, [])
        digest = hashlib.blake2b(chain, digest_size=16)
        digest.update(ids[block * BLOCK_TOKENS : (block + 1) * BLOCK_TOKENS].tobytes())
        for key in keys:
            if key is None:
                return hashes
            digest.update(key[0])
            digest.update(repr(key[1]).encode())
        chain = digest.digest()
        hashes.append(chain)
    return hashes


@dataclass
class _Entry:
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, heads, length, head_dim]
    hashes: list[bytes]  # the boundary hashes it is indexed under, block by block
    nbytes: int


class PrefixCache:
    """Prompts' KV by prefix, bounded by bytes, least recently used first out. One per engine (one thread)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self.evictions = 0  # [memory gauges] entries dropped for room (worker/cache_gauges.py)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[bytes, tuple[int, int]] = {}  # boundary hash -> (entry, tokens up to it)
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, hashes: Sequence[bytes], limit: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """The longest stored prefix among ``hashes`` of at most ``limit`` tokens: its KV per layer (views,
        never written: a cache appends by concatenating) and its length; ([], 0) when none is stored."""
        for block in range(min(len(hashes), limit // BLOCK_TOKENS) - 1, -1, -1):
            found = self._index.get(hashes[block])
            if found is None:
                continue
            entry_id, length = found
            entry = self._entries[entry_id]
            self._entries.move_to_end(entry_id)
            return [(k[..., :length, :], v[..., :length, :]) for k, v in entry.layers], length
        return [], 0

    def holds(self, hashes: Sequence[bytes]) -> bool:
        """Is the prefix ``hashes`` names stored (whole or as the start of a longer one)?"""
        return bool(hashes) and hashes[-1] in self._index

    def put(self, hashes: Sequence[bytes], layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep the KV of the prefix ``hashes`` names (``layers``: the row's own cache, at least that long)."""
        if not hashes or not self.max_bytes:
            return
        known = self._index.get(hashes[-1])
        if known is not None:  # already held, as a whole entry or as the start of a longer one
            self._entries.move_to_end(known[0])
            return
        length = len(hashes) * BLOCK_TOKENS
        kept = [(k[..., :length, :].clone(), v[..., :length, :].clone()) for k, v in layers]
        nbytes = sum(k.nbytes + v.nbytes for k, v in kept)
        if nbytes > self.max_bytes:
            return
        while self.held_bytes + nbytes > self.max_bytes:
            self._evict()
        self._next += 1
        self._entries[self._next] = _Entry(kept, list(hashes), nbytes)
        self.held_bytes += nbytes
        for block, digest in enumerate(hashes):
            self._index[digest] = (self._next, (block + 1) * BLOCK_TOKENS)

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.held_bytes = 0

    def _evict(self) -> None:
        entry_id, entry = self._entries.popitem(last=False)
        self.held_bytes -= entry.nbytes
        self.evictions += 1  # [memory gauges]
        for digest in entry.hashes:
            if self._index.get(digest, (0, 0))[0] == entry_id:
                del self._index[digest]


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """A row's own cache (batch 1) as keys and values per layer; None when a layer is not a plain dynamic one
    (a sliding window holds only its last positions: its prefix cannot be cut from it)."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        return None
    return [(layer.keys, layer.values) for layer in layers]
