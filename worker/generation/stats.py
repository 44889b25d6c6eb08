"""The generation engine's counters (published by the worker for /metrics: shared/stats_layout.py)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    """The generation engine's counters since it started (the worker publishes them for /metrics)."""

    steps: int = 0
    step_tokens: int = 0  # tokens run by all steps (one per decoding row, a prompt's per prefilled token)
    step_seconds: float = 0.0
    preemptions: int = 0
    encoder_hits: int = 0  # images whose tower output came from the encoder cache
    encoder_runs: int = 0  # vision-tower runs (one per prompt with images not cached)
    prefix_hits: int = 0  # prompts that started from a stored prefix's KV (prefix_cache.py)
    prefix_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
