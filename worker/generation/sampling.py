"""Sampling: one row's next token from its logits, with its own generator, bias and budget.

Nothing here knows a model family: the engine (engine.py) calls these for every row alike.
Invariant: a row's pick depends only on its logits, its parameters and its own ``torch.Generator``
(seeded by ``seed``), never on its step mates; and nothing here reads a result back to the host
except ``to_host``, the step's one sync for all its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shmgate.shared.wire import MIN_TEMPERATURE, SamplingParams

__all__ = ["bias_vector", "guarded_pick", "make_generator", "pick_token", "sample_token", "to_host", "token_budget"]


def bias_vector(params: SamplingParams, vocab: int, device: torch.device) -> torch.Tensor | None:
    """``logit_bias`` as a dense vector over the vocabulary (None without one). Ids are checked with the
    item's inputs (shared/families/base.py ``InputLayout.check``)."""
    if not params.logit_bias:
        return None
    bias = torch.zeros(vocab)
    ids, values = zip(*params.logit_bias)
    bias[list(ids)] = torch.tensor(values, dtype=torch.float32)
    return bias.to(device)


def token_budget(params: SamplingParams, default: int, room: int) -> int:
    """How many tokens to sample: ``max_tokens`` (or the default), within the context left."""
    wanted = default if params.max_tokens is None else params.max_tokens
    return max(0, min(wanted, room))


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
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


def to_host(picks: Sequence[torch.Tensor]) -> list[tuple[int, bool]]:
    """Every row's ``[token, ok]`` in one device-to-host copy: the step's only sync."""
    return [(int(token), bool(ok)) for token, ok in torch.stack(list(picks)).tolist()]
