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
the step's keys and values at their slots, then computes attention: decoding rows (one query each) in one
SDPA over a gathered, padded view of their blocks with a length mask, and each prompt chunk in its own SDPA
(causal within the chunk, over the row's earlier positions). Any other call (the vision tower, a prompt run
through the model's own forward with a dynamic cache) goes to SDPA as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self._free = list(range(blocks - 1, -1, -1))

    @property
    def blocks(self) -> int:
        return self.keys[0].shape[0]

    @property
    def bounded(self) -> bool:
        return self.limit > 0

    @property
    def free(self) -> int:
        """Blocks rows may still take: within ``limit`` when bounded."""
        return max(0, self.limit - self.used) if self.limit else len(self._free)

    @property
    def used(self) -> int:
        return self.blocks - len(self._free)

    def bytes_per_block(self) -> int:
        one = self.keys[0][0]
        return 2 * len(self.keys) * one.numel() * one.element_size()

    def grow(self, table: list[int], positions: int) -> None:
        """Give ``table`` the blocks ``positions`` positions need (the caller checked they are free when the
        pool is bounded)."""
        need = -(-positions // self.block_size) - len(table)
        if need <= 0:
            return
        if self.limit and need > self.free:
            raise RuntimeError(f"the KV pool has {self.free} free blocks, {need} needed")
        if need > len(self._free):
            self._double(need)
        for _ in range(need):
            table.append(self._free.pop())

    def release(self, table: list[int]) -> None:
        self._free.extend(reversed(table))
        table.clear()

    def _double(self, need: int) -> None:
        old = self.blocks
        new = max(2 * old, old + need)
        for tensors in (self.keys, self.values):
            for i, pool in enumerate(tensors):
                grown = torch.zeros((new, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
                grown[:old] = pool
                tensors[i] = grown
        self._free = list(range(new - 1, old - 1, -1)) + self._free

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
class _Chunk:
    """A prompt chunk in the packed step: tokens ``offset:offset + n`` of the sequence, the row's blocks, and
    the row's positions in KV after this step (``length``)."""

    offset: int
    n: int
    blocks: torch.Tensor
    length: int


class PagedStep:
    """One step's layout, built once on the host and read by every layer: where each token's K/V goes, which
    packed tokens are decoding rows' and the blocks they read, and each prompt chunk."""

    def __init__(self, pool: BlockPool, device: torch.device) -> None:
        self.pool = pool
        self.device = device
        self._slots: list[torch.Tensor] = []  # prompt chunks' slots
        self._decode_slots: list[int] = []  # decoding rows' slots: their tokens come first in the step
        self._decode_tables: list[Sequence[int]] = []
        self._decode_lengths: list[int] = []
        self.chunks: list[_Chunk] = []
        self.tokens = 0

    def add_decode(self, table: Sequence[int], length: int) -> None:
        """A decoding row: its one token at position ``length - 1`` (``length``: its positions after the step).
        Host integers only: the step's tensors are built once, in ``seal``."""
        size = self.pool.block_size
        where = length - 1
        self._decode_slots.append(table[where // size] * size + where % size)
        self._decode_tables.append(table[: -(-length // size)])
        self._decode_lengths.append(length)
        self.tokens += 1

    def add_chunk(self, table: Sequence[int], start: int, end: int) -> None:
        """A prompt chunk: positions ``start:end`` of a row (chunks follow every decoding row)."""
        self._slots.append(slot_indices(table, start, end, self.pool.block_size, torch.device("cpu")))
        blocks = torch.tensor(list(table[: -(-end // self.pool.block_size)]), dtype=torch.long, device=self.device)
        self.chunks.append(_Chunk(self.tokens, end - start, blocks, end))
        self.tokens += end - start

    def seal(self) -> None:
        """Build the device tensors every layer reads (one host-to-device copy of each)."""
        rows = len(self._decode_slots)
        slots = [torch.tensor(self._decode_slots, dtype=torch.long)] if rows else []
        self.slots = torch.cat([*slots, *self._slots]).to(self.device)
        self.decode_rows = rows
        if rows:
            width = max(len(table) for table in self._decode_tables)
            tables = [list(table) + [0] * (width - len(table)) for table in self._decode_tables]
            span = width * self.pool.block_size
            lengths = torch.tensor(self._decode_lengths)
            self.decode_tables = torch.tensor(tables, dtype=torch.long, device=self.device)
            self.decode_mask = (torch.arange(span)[None, :] < lengths[:, None]).view(rows, 1, 1, span).to(self.device)


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
    their own heads): write the step's keys and values into the pool, attend over each row's blocks, return
    ``[1, tokens, heads, dim]``. A call that is not a paged step goes to SDPA."""
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
    rows = step.decode_rows
    if rows:  # decoding rows' tokens are the step's first ``rows``
        kk = pool_k[step.decode_tables].view(rows, -1, heads, dim).transpose(1, 2)
        vv = pool_v[step.decode_tables].view(rows, -1, heads, dim).transpose(1, 2)
        qq = q[:, :rows].transpose(0, 1).unsqueeze(2)  # [rows, q_heads, 1, dim]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=step.decode_mask, scale=scaling, enable_gqa=gqa)
        out[:rows] = o[:, :, 0]
    for chunk in step.chunks:
        kk = pool_k[chunk.blocks].view(-1, heads, dim)[: chunk.length].transpose(0, 1)
        vv = pool_v[chunk.blocks].view(-1, heads, dim)[: chunk.length].transpose(0, 1)
        qq = q[:, chunk.offset : chunk.offset + chunk.n]
        if chunk.length == chunk.n:
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            first = chunk.length - chunk.n
            mask = (
                torch.arange(chunk.length, device=q.device)[None, :]
                <= (first + torch.arange(chunk.n, device=q.device))[:, None]
            )
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[chunk.offset : chunk.offset + chunk.n] = o.transpose(0, 1)
    return out.unsqueeze(0), None


def install(model: Any) -> None:
    """Register ``paged_attention`` and make the language model use it (the vision tower keeps its own)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)  # a prompt run whole gets SDPA's mask
    text = model.config.get_text_config()
    text._attn_implementation = ATTENTION_NAME
