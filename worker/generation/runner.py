"""The model runner of the paged engine: one planned step, ONE forward pass.

Every decoding row's last token and every prompt chunk the plan names are packed into one sequence (batch
1) with each token's own position (3 rows for multimodal RoPE), and run once through the model with the
step's ``PagedStep`` as the attention mask (paged.py): each layer writes the new keys and values into the
rows' blocks and attends over them. Only the logits the step samples from are computed (each decoding row's
and the last token of each prompt that ends this step). Nothing here names a model family: the family's
style supplies prompts' embeddings and positions (worker/backends/hf.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shmgate.worker.generation.decoder_stack import DecoderStack
from shmgate.worker.generation.paged import BlockPool, PagedStep

__all__ = ["ChunkInput", "DecodeInput", "PagedRunner"]


@dataclass(frozen=True)
class DecodeInput:
    """A decoding row: its blocks, its positions after this step, its last token and that token's position."""

    table: Sequence[int]
    length: int
    token: int
    position: int


@dataclass(frozen=True)
class ChunkInput:
    """Prompt positions ``start:end`` of a row: their embeddings ``[1, n, hidden]`` and positions
    ``[rope_rows, 1, n]``; ``logits``: the step samples from its last token."""

    table: Sequence[int]
    start: int
    end: int
    embeds: torch.Tensor
    positions: torch.Tensor
    logits: bool


class PagedRunner:
    """Runs packed steps of ``model`` over ``pool``."""

    def __init__(self, model: Any, pool: BlockPool, device: torch.device, rope_rows: int) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.rope_rows = rope_rows  # 3: multimodal RoPE (positions [3, 1, tokens]); 1: [1, tokens]
        self._embed = model.get_input_embeddings()
        # the decoder layers in a plain loop where their shape allows (decoder_stack.py), else the model's forward
        self.stack = DecoderStack.of(model)
        self.passes = 0  # forward passes run: one per step

    def execute(self, decode: Sequence[DecodeInput], chunks: Sequence[ChunkInput]) -> torch.Tensor:
        """Run one step; return the logits ``[len(decode) + chunks sampling, vocab]``, decoding rows first
        (in order), then the chunks whose last token is sampled."""
        step = PagedStep(self.pool, self.device)
        embeds: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        keep: list[int] = []
        with torch.inference_mode():
            if decode:
                for row in decode:
                    step.add_decode(row.table, row.length)
                ids = torch.tensor([[row.token for row in decode]], device=self.device)
                embeds.append(self._embed(ids))
                where = torch.tensor([row.position for row in decode], device=self.device)
                positions.append(where.view(1, 1, -1).expand(self.rope_rows, 1, -1))
                keep.extend(range(len(decode)))
            for chunk in chunks:
                step.add_chunk(chunk.table, chunk.start, chunk.end)
                embeds.append(chunk.embeds)
                positions.append(chunk.positions.reshape(self.rope_rows, 1, -1))
                if chunk.logits:
                    keep.append(step.tokens - 1)
            step.seal()
            packed = embeds[0] if len(embeds) == 1 else torch.cat(embeds, dim=1)
            where_all = positions[0] if len(positions) == 1 else torch.cat(positions, dim=-1)
            if self.rope_rows == 1:
                where_all = where_all[0]
            return self.forward(packed, where_all, step, torch.tensor(keep, dtype=torch.long, device=self.device))

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, step: PagedStep, keep: torch.Tensor
    ) -> torch.Tensor:
        """The step's one forward pass: the logits of the packed tokens ``keep`` names."""
        self.passes += 1
        if self.stack is not None:
            return self.stack(embeds, positions, step, keep)
        out = self.model(
            inputs_embeds=embeds,
            position_ids=positions,
            attention_mask={"full_attention": step},
            use_cache=False,
            logits_to_keep=keep,
        )
        logits: torch.Tensor = out.logits[0]
        return logits
