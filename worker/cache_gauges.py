"""The worker's caches in /metrics: bytes held, their bound, entries and evictions, per cache.

Why: a worker's caches (vision-tower outputs, prompts' KV by prefix, compiled grammars) fill up to their
bounds under varied traffic, so a worker's memory grows for minutes and then levels off. Without their
gauges an operator cannot tell a full cache from a leak, nor size the bounds against the device's memory.

How they travel: a backend names its caches (``ModelBackend.caches``, by shared/stats_layout.py
WORKER_CACHES); each is a ``SizedCache``. The worker reads them with its engine report (worker/main.py
``_report_engine``: every ENGINE_REPORT_S while busy, and when it goes idle) into its slot row's
``caches`` words (gauges set, evictions added), and /metrics sums the rows over workers
(gateway/metrics.py ``shmgate_worker_cache_*``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from shmgate.shared.stats_layout import WORKER_CACHE_WORDS, WORKER_CACHES

__all__ = ["CacheGauges", "SizedCache"]


class SizedCache(Protocol):
    """What a cache exposes to be measured: bytes held and their bound, entries, evictions since it began."""

    held_bytes: int
    max_bytes: int
    evictions: int

    def __len__(self) -> int: ...


class CacheGauges:
    """Turns a backend's caches into the slot row's words: gauges as they are, evictions as increments."""

    def __init__(self) -> None:
        self._evictions_seen = [0] * len(WORKER_CACHES)

    def words(self, caches: Mapping[str, SizedCache | None]) -> list[int]:
        """WORKER_CACHE_WORDS words per WORKER_CACHES entry (bytes, bound, entries, evictions added since the
        last call); a cache the backend does not keep reads as zeros."""
        out: list[int] = []
        for index, name in enumerate(WORKER_CACHES):
            cache = caches.get(name)
            if cache is None:
                out += [0] * WORKER_CACHE_WORDS
                continue
            evictions = cache.evictions
            out += [cache.held_bytes, cache.max_bytes, len(cache), max(0, evictions - self._evictions_seen[index])]
            self._evictions_seen[index] = evictions
        return out
