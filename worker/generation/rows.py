"""One request's generation state as the engine holds it: a row."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shmgate.worker.backends.base import WorkItem
from shmgate.worker.constraints import RowConstraint
from shmgate.worker.generation.text import IncrementalDetokenizer, StopStringFilter

__all__ = ["Row", "full_ids", "prompt_length"]


@dataclass
class Row:
    """One item's generation state; rows decoded together share one left-padded cache."""

    index: int
    item: WorkItem
    inputs: Any  # the family's model inputs (shared/families/base.py ModelInputs): input_ids [1, L] first
    prompt_tokens: int
    limit: int
    detok: IncrementalDetokenizer
    stops: StopStringFilter
    generator: torch.Generator
    completion_tokens: int = 0
    token: int = -1  # the last sampled token: the next decode step's input
    finish: str | None = None
    cache: Any = None
    delta: int = 0  # position offset of the tokens after the prompt (its input style computes it)
    pad: int = 0  # zero positions on the left of this row in the shared cache
    bias: torch.Tensor | None = None  # logit_bias as a dense [vocab] vector on the device
    counts: torch.Tensor | None = None  # [vocab] generated-token counts, kept only when a penalty is set
    logprobs: torch.Tensor | None = None  # the last step's log-probabilities, kept only when asked for
    arrival: int = 0  # admission order: preemption takes the newest first
    done_tokens: int = 0  # prompt tokens in its cache so far (prefill in chunks)
    generated: list[int] = field(default_factory=list)  # sampled tokens: a preempted row recomputes them
    prefill: tuple[torch.Tensor, torch.Tensor] | None = None  # embeddings and positions of a chunked prompt
    prefix: list[bytes] | None = None  # its prompt's block hashes (prefix_cache.py), once computed
    constraint: RowConstraint | None = None  # response_format's grammar (worker/constraints.py)
    reused: int = -1  # paged layout: prompt positions a stored prefix supplies (-1: not looked up yet)


def prompt_length(row: Row) -> int:
    """What a prefill of ``row`` runs: its prompt, and the tokens it generated before a preemption."""
    return row.prompt_tokens + len(row.generated)


def full_ids(row: Row) -> torch.Tensor:
    ids = row.inputs.input_ids
    if not row.generated:
        return ids
    return torch.cat([ids, torch.tensor([row.generated], dtype=ids.dtype, device=ids.device)], dim=1)
