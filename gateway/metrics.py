"""Prometheus metrics kept in the segment, so any frontend can report the whole node.

Each frontend writes only its own row of u64 counters (``Segment.stats``); a
scrape, whichever frontend answers it, sums the rows of all frontends and reads
the worker table. Counters survive a frontend restart (the successor keeps
adding to the row), as Prometheus expects of counters.
"""

from __future__ import annotations

import bisect
import enum

import numpy as np

from gateway.result_cache import ResultCacheStats
from gateway.stages import stage_lines
from shared.instance import DEAD_AFTER_S
from shared.segment import BATCH_BUCKETS, Segment

__all__ = ["Counter", "FrontendStats", "render"]

BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Counter(enum.IntEnum):
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
    LATENCY_BUCKETS = 12  # .. 12 + len(BUCKETS_S) (the last one is +Inf)
    TTFT_SUM_US = 30
    TTFT_COUNT = 31
    TTFT_BUCKETS = 32  # .. 32 + len(BUCKETS_S)
    ARENA_USED_BYTES = 60  # gauges
    ARENA_SIZE_BYTES = 61
    IN_FLIGHT = 62
    ARENA_HELD_BYTES = 63  # arena bytes pinned by requests in flight (0 when idle)
    # The result cache (gateway/result_cache.py); far from the others so that counters
    # added after 63 do not collide.
    RESULT_CACHE_HITS = 100
    RESULT_CACHE_MISSES = 101
    RESULT_CACHE_EVICTIONS = 102
    RESULT_CACHE_BYTES = 103  # gauge


class FrontendStats:
    """The writer side: one frontend's row."""

    def __init__(self, segment: Segment, slot: int) -> None:
        self._row = segment.stats[slot]
        self._result_cache_seen = (0, 0, 0)

    def add(self, counter: Counter, value: int = 1) -> None:
        self._row[counter] += value

    def set(self, counter: Counter, value: int) -> None:
        self._row[counter] = value

    def set_result_cache(self, stats: ResultCacheStats, used_bytes: int) -> None:
        """Publish this frontend's result cache counts: added as increments since the last call, so the
        counters keep growing across a frontend restart (whose new cache counts from zero)."""
        last = self._result_cache_seen
        self._row[Counter.RESULT_CACHE_HITS] += stats.hits - last[0]
        self._row[Counter.RESULT_CACHE_MISSES] += stats.misses - last[1]
        self._row[Counter.RESULT_CACHE_EVICTIONS] += stats.evictions - last[2]
        self._row[Counter.RESULT_CACHE_BYTES] = used_bytes
        self._result_cache_seen = (stats.hits, stats.misses, stats.evictions)

    def observe(self, base: Counter, seconds: float) -> None:
        """Record a latency in the histogram starting at ``base`` (LATENCY_* or TTFT_*)."""
        sum_idx, count_idx, buckets = {
            Counter.LATENCY_BUCKETS: (Counter.LATENCY_SUM_US, Counter.LATENCY_COUNT, Counter.LATENCY_BUCKETS),
            Counter.TTFT_BUCKETS: (Counter.TTFT_SUM_US, Counter.TTFT_COUNT, Counter.TTFT_BUCKETS),
        }[base]
        self._row[sum_idx] += int(seconds * 1e6)
        self._row[count_idx] += 1
        self._row[buckets + bisect.bisect_left(BUCKETS_S, seconds)] += 1


def render(segment: Segment, queue_depth: int) -> str:
    """The Prometheus text exposition for the whole node."""
    total = segment.stats.sum(axis=0)
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{labels} {value:g}" if isinstance(value, float) else f"{name}{labels} {value}")

    metric(
        "shmgate_requests_total",
        "counter",
        "Chat completion and embedding requests by outcome.",
        [
            ('{outcome="ok"}', int(total[Counter.REQUESTS_OK])),
            ('{outcome="client_error"}', int(total[Counter.REQUESTS_CLIENT_ERROR])),
            ('{outcome="server_error"}', int(total[Counter.REQUESTS_SERVER_ERROR])),
            ('{outcome="overloaded"}', int(total[Counter.REQUESTS_OVERLOADED])),
            ('{outcome="cancelled"}', int(total[Counter.CANCELLED])),
        ],
    )
    _histogram(lines, "shmgate_request_duration_seconds", "Request latency.", total, Counter.LATENCY_BUCKETS,
               Counter.LATENCY_SUM_US, Counter.LATENCY_COUNT)
    _histogram(lines, "shmgate_time_to_first_token_seconds", "Time to the first streamed content.", total,
               Counter.TTFT_BUCKETS, Counter.TTFT_SUM_US, Counter.TTFT_COUNT)
    metric("shmgate_cache_hits_total", "counter", "Images found in this frontend's partition (no decode).",
           [("", int(total[Counter.CACHE_HITS]))])
    metric("shmgate_cache_remote_hits_total", "counter", "Images copied from another frontend's partition.",
           [("", int(total[Counter.CACHE_REMOTE_HITS]))])
    metric("shmgate_cache_misses_total", "counter", "Images decoded and preprocessed.",
           [("", int(total[Counter.CACHE_MISSES]))])
    metric("shmgate_cache_evictions_total", "counter", "Cached images evicted to make room.",
           [("", int(total[Counter.CACHE_EVICTIONS]))])
    metric("shmgate_result_cache_hits_total", "counter",
           "Answers (embeddings, classifier labels) served from a frontend's result cache.",
           [("", int(total[Counter.RESULT_CACHE_HITS]))])
    metric("shmgate_result_cache_misses_total", "counter",
           "Answers looked up in a result cache and not found (then computed).",
           [("", int(total[Counter.RESULT_CACHE_MISSES]))])
    metric("shmgate_result_cache_evictions_total", "counter", "Result cache entries evicted to make room.",
           [("", int(total[Counter.RESULT_CACHE_EVICTIONS]))])
    metric("shmgate_result_cache_bytes", "gauge", "Bytes held by the frontends' result caches.",
           [("", int(total[Counter.RESULT_CACHE_BYTES]))])
    metric("shmgate_retries_total", "counter", "Requests resubmitted after their worker died.",
           [("", int(total[Counter.RETRIES]))])
    used = int(total[Counter.ARENA_USED_BYTES])
    size = int(total[Counter.ARENA_SIZE_BYTES])
    metric("shmgate_arena_used_bytes", "gauge", "Arena bytes allocated.", [("", used)])
    metric("shmgate_arena_held_bytes", "gauge", "Arena bytes pinned by requests in flight (cached tensors excluded).",
           [("", int(total[Counter.ARENA_HELD_BYTES]))])
    metric("shmgate_arena_free_bytes", "gauge", "Arena bytes free.", [("", size - used)])
    metric("shmgate_in_flight_requests", "gauge", "Requests being served.", [("", int(total[Counter.IN_FLIGHT]))])
    metric("shmgate_request_queue_depth", "gauge", "Descriptors waiting for a worker.", [("", queue_depth)])
    workers = segment.workers
    # READY, heartbeating and progressing: a worker killed in another container (no one marks its row
    # DEAD) stops counting once its heartbeat is stale, a wedged one once its progress is (as /ready).
    ready = len(segment.live_workers(DEAD_AFTER_S))
    starts = int(workers["epoch"].sum())
    metric("shmgate_workers_ready", "gauge", "Workers serving.", [("", ready)])
    metric("shmgate_worker_starts_total", "counter", "Worker (re)starts; restarts = starts - workers.", [("", starts)])
    metric("shmgate_worker_stalls_total", "counter",
           "Workers declared stalled (alive but no progress for --stall-timeout-s) and replaced.",
           [("", int(workers["stalls"].sum()))])
    metric("shmgate_frontend_stalls_total", "counter",
           "Frontends whose event loop stopped turning for --stall-timeout-s, killed and restarted.",
           [("", int(segment.frontends["stalls"].sum()))])
    busy = float(workers["busy_ns"].sum()) / 1e9
    metric("shmgate_worker_busy_seconds_total", "counter", "Time workers spent running batches.", [("", busy)])
    lines.append("# HELP shmgate_batch_size Requests per batch the workers ran.")
    lines.append("# TYPE shmgate_batch_size histogram")
    per_bucket = workers["batch_hist"].sum(axis=0)
    for bound, cumulative in zip((*map(str, BATCH_BUCKETS), "+Inf"), np.cumsum(per_bucket)):
        lines.append(f'shmgate_batch_size_bucket{{le="{bound}"}} {int(cumulative)}')
    lines.append(f"shmgate_batch_size_sum {int(workers['batched_requests'].sum())}")
    lines.append(f"shmgate_batch_size_count {int(workers['batches'].sum())}")
    metric("shmgate_preparing_requests", "gauge", "Admitted requests still being decoded and preprocessed.",
           [("", segment.preparing_requests())])
    lines += stage_lines(total)
    return "\n".join(lines) + "\n"


def _histogram(lines: list[str], name: str, help_text: str, total: np.ndarray, buckets: int, sum_idx: int,
               count_idx: int) -> None:
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} histogram")
    cumulative = 0
    for i, bound in enumerate(BUCKETS_S):
        cumulative += int(total[buckets + i])
        lines.append(f'{name}_bucket{{le="{bound:g}"}} {cumulative}')
    cumulative += int(total[buckets + len(BUCKETS_S)])
    lines.append(f'{name}_bucket{{le="+Inf"}} {cumulative}')
    lines.append(f"{name}_sum {int(total[sum_idx]) / 1e6:g}")
    lines.append(f"{name}_count {int(total[count_idx])}")
