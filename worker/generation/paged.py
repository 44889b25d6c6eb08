"""Paged KV: fixed-size blocks in one preallocated pool per layer, a block table per row, and the attention
that reads them.

Why pages: the padded layout (kv.py) concatenates the whole batch's cache on every join and every step and
holds every row at the longest row's length (1.57-1.91x the real positions in the bench's mix). Here a row's
positions live in blocks of ``block_size`` positions; a step writes only its new keys and values into their
slots, and a row holds its real positions plus at most one part-filled block.

How the model reads them: one forward pass per step runs every row's new tokens packed in one sequence
(batch 1). ``install`` registers ``paged_attention`` through transformers' AttentionInterface and sets the
language model's attention implementation to it; the step's ``PagedStep`` travels as the attention mask (a
dict by layer type, which transformers' models pass through unchanged). For each layer the function writes
the step's keys and values at their slots, then each row (a decoding row's one query, a prompt chunk's
queries, causal within the chunk) attends in its own SDPA over a VIEW of its blocks: the pool hands a row
consecutive blocks wherever it can (a new row starts in the middle of the longest free run, a growing row
takes the block after its last), so a row's positions are one strided slice of the pool and nothing is
copied. A row whose blocks are not consecutive (the pool fragmented) reads a gathered copy of its own blocks.
Why not one batched SDPA over every row: it needs the rows' blocks gathered into one padded tensor, a copy of
the whole KV per layer per step (300 positions a row, the 8-layer checkpoint's heads, one CPU thread: at 8 rows
0.57-0.67 ms a layer against 0.32-0.34 ms for the per-row views, at 32 rows 3.5-3.8 against 2.1-2.2 ms;
``python -m bench kernel-costs``). Any other call (the vision tower,
a prompt run through the model's own forward with a dynamic cache) goes to SDPA as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["ATTENTION_NAME", "BlockPool", "PagedStep", "install", "paged_attention"]

ATTENTION_NAME = "shmgate_paged"


class BlockPool:
    """The KV of every row: per layer, keys and values ``[blocks, block_size, kv_heads, head_dim]``; which
    blocks are free. ``capacity`` 0: the pool starts small and doubles when it runs out (a rare copy of the
    pool; CPU workers have no KV budget unless one is set); else it holds ``capacity`` blocks, allocated once."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.limit = capacity  # the most blocks rows may hold (0: no bound); the engine sets it from its KV budget
        blocks = capacity if capacity > 0 else 256
        shape = (blocks, block_size, kv_heads, head_dim)
        # uninitialised: attention reads only a row's first ``length`` positions, each written before it is read
        # (zeroing a GPU budget's pool cost a pass over gigabytes at start-up, a doubling twice the copy)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self._is_free = np.ones(blocks, dtype=bool)
        self._free_count = blocks

    @property
    def blocks(self) -> int:
        return self.keys[0].shape[0]

    @property
    def bounded(self) -> bool:
        return self.limit > 0

    @property
    def free(self) -> int:
        """Blocks rows may still take: within ``limit`` when bounded."""
        return max(0, self.limit - self.used) if self.limit else self._free_count

    @property
    def used(self) -> int:
        return self.blocks - self._free_count

    def bytes_per_block(self) -> int:
        one = self.keys[0][0]
        return 2 * len(self.keys) * one.numel() * one.element_size()

    def grow(self, table: list[int], positions: int) -> None:
        """Give ``table`` the blocks ``positions`` positions need (the caller checked they are free when the
        pool is bounded): the block after its last one when free, so that a row's blocks stay consecutive."""
        need = -(-positions // self.block_size) - len(table)
        if need <= 0:
            return
        if self.limit and need > self.free:
            raise RuntimeError(f"the KV pool has {self.free} free blocks, {need} needed")
        if need > self._free_count:
            self._double(need)
        for _ in range(need):
            after = table[-1] + 1 if table else -1
            block = after if 0 <= after < len(self._is_free) and self._is_free[after] else self._roomiest()
            self._is_free[block] = False
            self._free_count -= 1
            table.append(block)

    def release(self, table: list[int]) -> None:
        self._is_free[table] = True
        self._free_count += len(table)
        table.clear()

    def _roomiest(self) -> int:
        """The middle of the longest run of free blocks: a row that starts there can grow into the run's second
        half, and the row before the run into its first half."""
        edges = np.diff(np.concatenate(([0], self._is_free.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        longest = int(np.argmax(ends - starts))
        start, end = int(starts[longest]), int(ends[longest])
        return start if start == 0 else (start + end) // 2

    def _double(self, need: int) -> None:
        old = self.blocks
        new = max(2 * old, old + need)
        for tensors in (self.keys, self.values):
            for i, pool in enumerate(tensors):
                grown = torch.empty((new, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
                grown[:old] = pool
                tensors[i] = grown
        self._is_free = np.concatenate((self._is_free, np.ones(new - old, dtype=bool)))
        self._free_count += new - old

    def span(self, table: Sequence[int], length: int) -> tuple[int, int] | torch.Tensor:
        """Where a row's first ``length`` positions are: ``(first block, blocks)`` when its blocks are
        consecutive (attention reads a view of the pool), else the blocks' indices (it reads a copy)."""
        blocks = -(-length // self.block_size)
        first = table[0]
        if table[blocks - 1] - first == blocks - 1 and list(table[:blocks]) == list(range(first, first + blocks)):
            return first, blocks
        return torch.tensor(list(table[:blocks]), dtype=torch.long, device=self.keys[0].device)

    def write(self, table: Sequence[int], start: int, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write a row's keys and values (per layer ``[1, kv_heads, n, head_dim]``, a dynamic cache's) at its
        positions ``start:start + n``."""
        n = layers[0][0].shape[-2]
        slots = slot_indices(table, start, start + n, self.block_size, self.keys[0].device)
        for layer, (k, v) in enumerate(layers):
            heads, dim = k.shape[1], k.shape[3]
            self.keys[layer].view(-1, heads, dim).index_copy_(0, slots, k[0].transpose(0, 1).to(self.keys[0].dtype))
            self.values[layer].view(-1, heads, dim).index_copy_(0, slots, v[0].transpose(0, 1).to(self.keys[0].dtype))

    def read(self, table: Sequence[int], length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A row's first ``length`` positions per layer as ``[1, kv_heads, length, head_dim]`` copies."""
        index = torch.tensor(list(table), dtype=torch.long, device=self.keys[0].device)
        out = []
        for k, v in zip(self.keys, self.values):
            heads, dim = k.shape[2], k.shape[3]
            kk = k.index_select(0, index).view(-1, heads, dim)[:length].transpose(0, 1)[None]
            vv = v.index_select(0, index).view(-1, heads, dim)[:length].transpose(0, 1)[None]
            out.append((kk.contiguous(), vv.contiguous()))
        return out


def slot_indices(table: Sequence[int], start: int, end: int, block_size: int, device: torch.device) -> torch.Tensor:
    """The pool slots (block * block_size + offset) of positions ``start:end`` of a row."""
    blocks = torch.tensor(list(table), dtype=torch.long)
    positions = torch.arange(start, end)
    return (blocks[positions // block_size] * block_size + positions % block_size).to(device)


@dataclass
class _Reader:
    """What one row attends to in a step: its queries ``offset:offset + n`` of the packed sequence, its KV
    (``span``: a view's first block and block count, or its blocks' indices) and its positions after this step
    (``length``). ``causal``: a prompt chunk's queries see only the positions up to their own."""

    offset: int
    n: int
    span: tuple[int, int] | torch.Tensor
    length: int
    causal: bool


class PagedStep:
    """One step's layout, built once on the host and read by every layer: where each token's K/V goes, and
    each row's queries and KV (decoding rows first, one token each, then the prompt chunks)."""

    def __init__(self, pool: BlockPool, device: torch.device) -> None:
        self.pool = pool
        self.device = device
        self._decode_slots: list[int] = []  # decoding rows' slots: their tokens come first in the step
        self._slots: list[torch.Tensor] = []  # prompt chunks' slots
        self.readers: list[_Reader] = []
        self.tokens = 0

    def add_decode(self, table: Sequence[int], length: int) -> None:
        """A decoding row: its one token at position ``length - 1`` (``length``: its positions after the step)."""
        size = self.pool.block_size
        where = length - 1
        self._decode_slots.append(table[where // size] * size + where % size)
        self.readers.append(_Reader(self.tokens, 1, self.pool.span(table, length), length, False))
        self.tokens += 1

    def add_chunk(self, table: Sequence[int], start: int, end: int) -> None:
        """A prompt chunk: positions ``start:end`` of a row (chunks follow every decoding row)."""
        self._slots.append(slot_indices(table, start, end, self.pool.block_size, torch.device("cpu")))
        self.readers.append(_Reader(self.tokens, end - start, self.pool.span(table, end), end, True))
        self.tokens += end - start

    def seal(self) -> None:
        """Build the slots' device tensor every layer reads (one host-to-device copy)."""
        slots = [torch.tensor(self._decode_slots, dtype=torch.long)] if self._decode_slots else []
        self.slots = torch.cat([*slots, *self._slots]).to(self.device)


def _row_kv(pool: torch.Tensor, reader: _Reader, heads: int, dim: int) -> torch.Tensor:
    """A row's keys or values ``[1, kv_heads, length, dim]``: a view of the pool when its blocks are
    consecutive, else a copy of its blocks."""
    span = reader.span
    blocks = pool[span[0] : span[0] + span[1]] if isinstance(span, tuple) else pool.index_select(0, span)
    return blocks.view(-1, heads, dim)[: reader.length].transpose(0, 1).unsqueeze(0)


def paged_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function contract (``query [1, heads, tokens, dim]``, keys and values with
    their own heads): write the step's keys and values into the pool, let each row attend over its blocks,
    return ``[1, tokens, heads, dim]``. A call that is not a paged step goes to SDPA."""
    if not isinstance(attention_mask, PagedStep):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    step = attention_mask
    layer = module.layer_idx
    pool_k, pool_v = step.pool.keys[layer], step.pool.values[layer]
    heads, dim = key.shape[1], key.shape[3]
    pool_k.view(-1, heads, dim).index_copy_(0, step.slots, key[0].transpose(0, 1))
    pool_v.view(-1, heads, dim).index_copy_(0, step.slots, value[0].transpose(0, 1))
    q = query[0]  # [q_heads, tokens, dim]
    gqa = q.shape[0] != heads
    out = torch.empty(q.shape[1], q.shape[0], dim, dtype=q.dtype, device=q.device)  # [tokens, q_heads, dim]
    for reader in step.readers:
        kk, vv = _row_kv(pool_k, reader, heads, dim), _row_kv(pool_v, reader, heads, dim)
        qq = q[None, :, reader.offset : reader.offset + reader.n]  # [1, q_heads, n, dim]
        if not reader.causal or reader.n == 1:
            o = F.scaled_dot_product_attention(qq, kk, vv, scale=scaling, enable_gqa=gqa)
        elif reader.length == reader.n:
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            first = reader.length - reader.n
            mask = (
                torch.arange(reader.length, device=q.device)[None, :]
                <= (first + torch.arange(reader.n, device=q.device))[:, None]
            )
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[reader.offset : reader.offset + reader.n] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def install(model: Any) -> None:
    """Register ``paged_attention`` and make the language model use it (the vision tower keeps its own)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)  # a prompt run whole gets SDPA's mask
    text = model.config.get_text_config()
    text._attn_implementation = ATTENTION_NAME
