"""The stats row: which u64 word of a frontend's row holds what, every index in one place.

Each frontend owns one row of ``STATS_WORDS`` u64 words (the segment keeps the rows, one per
frontend slot; the in-memory transport keeps one in process memory). Its writers are
gateway/metrics.py (``Counter``) and gateway/stages.py (the stage histograms); /metrics sums the
rows of all frontends, and the supervisor's drain reads ``Counter.IN_FLIGHT``. A word's index is a
contract between processes of one node, so a new counter takes a free word here, never one in
use: ``spans`` lists every entry with its width, and tests/test_stats_layout.py checks that no
two overlap and that the row holds them all.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from shmgate.shared.stages import Stage

__all__ = [
    "BATCH_BUCKETS",
    "ENGINE_FIELDS",
    "ENGINE_GAUGES",
    "MODEL_SLOTS",
    "REQUEST_BUCKETS_S",
    "REQUEST_HISTOGRAM_WORDS",
    "STAGE_BASE",
    "STAGE_BUCKETS_S",
    "STAGE_COUNT",
    "STAGE_SUM_US",
    "STAGE_WORDS",
    "STATS_WORDS",
    "WORKER_CACHES",
    "WORKER_CACHE_FIELDS",
    "WORKER_CACHE_WORDS",
    "Counter",
    "Span",
    "spans",
    "stage_base",
]

STATS_WORDS = 256  # u64 words per frontend row; the segment's layout version changes with it
# Per-model words: one per row of the segment's model table (shared/segment.py MAX_MODELS), so a
# per-model metric's labels are bounded by the declared models.
MODEL_SLOTS = 8

# The request latency and time-to-first-token histograms: their upper bounds, one word each, then +Inf.
REQUEST_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_HISTOGRAM_WORDS = len(REQUEST_BUCKETS_S) + 1


@enum.unique  # two names for one word would be two metrics counting into each other
class Counter(enum.IntEnum):
    """Single words (counters and gauges) and the first words of the request histograms."""

    REQUESTS_OK = 0
    REQUESTS_CLIENT_ERROR = 1
    REQUESTS_SERVER_ERROR = 2
    REQUESTS_OVERLOADED = 3
    CACHE_HITS = 4
    CACHE_REMOTE_HITS = 5
    CACHE_MISSES = 6
    CACHE_EVICTIONS = 7
    RETRIES = 8
    CANCELLED = 9
    LATENCY_SUM_US = 10
    LATENCY_COUNT = 11
    LATENCY_BUCKETS = 12  # REQUEST_HISTOGRAM_WORDS words: 12 .. 24 (the last one is +Inf)
    TTFT_SUM_US = 30
    TTFT_COUNT = 31
    TTFT_BUCKETS = 32  # REQUEST_HISTOGRAM_WORDS words: 32 .. 44
    ARENA_USED_BYTES = 60  # gauges
    ARENA_SIZE_BYTES = 61
    IN_FLIGHT = 62  # requests being served; the supervisor's drain waits for it to reach 0
    ARENA_HELD_BYTES = 63  # arena bytes pinned by requests in flight (0 when idle)
    CANCELLED_TOKENS = 64  # completion tokens workers generated for requests whose client had gone
    MODEL_ADMITTED = 65  # MODEL_SLOTS words: 65 .. 72, requests admitted for model-table row i
    MODEL_OVERLOADED = 73  # MODEL_SLOTS words: 73 .. 80, refused 429/503 (its in-flight bound, no worker, queue full)
    MODEL_OK = 81  # MODEL_SLOTS words: 81 .. 88, answered
    MODEL_ERROR = 89  # MODEL_SLOTS words: 89 .. 96, ended in a 4xx (but 429) or a 5xx (but 503)
    MODEL_CANCELLED = 45  # MODEL_SLOTS words: 45 .. 52, the client went away
    # Gauge: interactive (not bulk-lane) model requests this frontend is serving, from the first byte to the
    # last (gateway/lane.py). Summed over the node it is the interactive demand the bulk lane yields to:
    # the batch runner and the workers read it (docs/BATCH.md, "Fairness").
    INTERACTIVE_IN_FLIGHT = 97
    RESULT_CACHE_BOUND_BYTES = 98  # gauges of the result cache (gateway/result_cache.py), with the words below
    RESULT_CACHE_ENTRIES = 99
    # The result cache (gateway/result_cache.py)
    RESULT_CACHE_HITS = 100
    RESULT_CACHE_MISSES = 101
    RESULT_CACHE_EVICTIONS = 102
    RESULT_CACHE_BYTES = 103  # gauge


_HISTOGRAM_STARTS = (Counter.LATENCY_BUCKETS, Counter.TTFT_BUCKETS)
_MODEL_STARTS = (
    Counter.MODEL_ADMITTED,
    Counter.MODEL_OVERLOADED,
    Counter.MODEL_OK,
    Counter.MODEL_ERROR,
    Counter.MODEL_CANCELLED,
)

# The per-stage latency histograms (gateway/stages.py): one block of STAGE_WORDS per Stage, in
# Stage order from STAGE_BASE. A block holds the buckets, +Inf, the sum in µs and the count.
STAGE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0)
STAGE_SUM_US = len(STAGE_BUCKETS_S) + 1  # offsets inside a stage's block
STAGE_COUNT = len(STAGE_BUCKETS_S) + 2
STAGE_WORDS = len(STAGE_BUCKETS_S) + 3
STAGE_BASE = 104


def stage_base(stage: Stage) -> int:
    """The first word of ``stage``'s histogram block."""
    return STAGE_BASE + stage * STAGE_WORDS


# Not in the row: the worker slot rows' batch-size histogram (``NodeStats.batch_histogram``), one
# word per upper bound, then one for larger batches.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class Span(NamedTuple):
    """One entry of the row: ``words`` words from ``first``."""

    name: str
    first: int
    words: int


def spans() -> tuple[Span, ...]:
    """Every entry of the row with the words it takes, in index order."""
    entries = [
        Span(
            name,
            int(c),
            REQUEST_HISTOGRAM_WORDS if c in _HISTOGRAM_STARTS else MODEL_SLOTS if c in _MODEL_STARTS else 1,
        )
        for name, c in Counter.__members__.items()
    ]  # aliases included: each is an entry
    entries += [Span(f"stage {s.name}", stage_base(s), STAGE_WORDS) for s in Stage]
    return tuple(sorted(entries, key=lambda span: span.first))


# The words of a worker row's ``engine`` column: the first ENGINE_GAUGES are gauges, the rest counters.
ENGINE_FIELDS = (
    "running",  # rows decoding together
    "waiting",  # requests added, not running yet
    "kv_used",  # KV cache token positions held
    "kv_budget",  # the KV budget in token positions (0: unbounded)
    "steps",
    "step_ns",
    "step_tokens",
    "preemptions",
    "encoder_hits",
    "encoder_runs",
    "prefix_hits",
    "prefix_tokens",
    "encoder_shared_hits",  # images whose tower output came from the model's shared outputs (worker/encoder_share.py)
    "encoder_shared_misses",  # images looked up there and not found (or found stale): the tower ran
    "encoder_shared_publishes",  # tower outputs this worker published there
)
ENGINE_GAUGES = 4


# The worker row's ``caches`` column: for each cache a worker keeps in its own memory (bounded in bytes,
# counted against its device's memory budget: node/gpu_fit.py), WORKER_CACHE_WORDS words in
# WORKER_CACHE_FIELDS order, set by the worker (worker/cache_gauges.py) and summed by /metrics.
WORKER_CACHES = (
    "encoder",  # vision-tower outputs by image (worker/generation/encoder_cache.py)
    "prefix",  # prompts' KV by prefix (worker/generation/prefix_cache.py)
    "grammar",  # compiled response_format grammars (worker/constraints.py)
)
WORKER_CACHE_FIELDS = (
    "bytes",  # gauge: bytes held now
    "bound_bytes",  # gauge: the most it may hold (its flag)
    "entries",  # gauge: entries held now
    "evictions",  # counter: entries dropped to make room, since the worker started
)
WORKER_CACHE_WORDS = len(WORKER_CACHE_FIELDS)
