"""Prometheus metrics kept in the segment, so any frontend can report the whole node.

Each frontend writes only its own row of u64 counters (laid out in shared/stats_layout.py); a
scrape, whichever frontend answers it, sums the rows of all frontends and reads
the worker table (through ``NodeStats``, shared/transport). Counters survive a
frontend restart (the successor keeps adding to the row), as Prometheus expects
of counters. The segment stays the storage: ``NodeCollector`` is a
prometheus_client custom collector that reads it at scrape time, so the client
library writes the text format, or OpenMetrics when the scraper asks for it.
Metric names and label sets are a contract (tests, deploy/k8s prometheus-adapter rules).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import NamedTuple

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from shmgate.gateway.result_cache import ResultCacheStats
from shmgate.gateway.stages import Exemplars, stage_histogram
from shmgate.shared.flags import version
from shmgate.shared.stats_layout import BATCH_BUCKETS, MODEL_SLOTS, REQUEST_BUCKETS_S, STATS_WORDS, Counter
from shmgate.shared.transport.base import NodeStats

# Counter (which word of the row holds what) is defined with the rest of the row's layout in
# shared/stats_layout.py; the gateway's modules import it from here.
log = logging.getLogger("shmgate.metrics")

__all__ = ["BatchCollector", "Counter", "FrontendStats", "ModelGauges", "NodeCollector", "exposition", "render"]


# The model-table row of the request this asyncio task serves (-1: none named yet). A request's outcome is
# counted where its reply is written (gateway/render.py, gateway/embeddings.py, the routes), far from where
# its model was resolved; a context variable carries the model between them without threading an index
# through every counting call. Each request runs in its own task, and the tasks it starts copy it.
_request_model: ContextVar[int] = ContextVar("shmgate_request_model", default=-1)
# An outcome counter and the per-model block that counts the same outcome by model; as a list by word, because
# an IntEnum's hash runs in Python (a dict lookup here cost more than the word it guards).
_OUTCOME_BLOCKS = {
    Counter.REQUESTS_OK: Counter.MODEL_OK,
    Counter.REQUESTS_CLIENT_ERROR: Counter.MODEL_ERROR,
    Counter.REQUESTS_SERVER_ERROR: Counter.MODEL_ERROR,
    Counter.REQUESTS_OVERLOADED: Counter.MODEL_OVERLOADED,
    Counter.CANCELLED: Counter.MODEL_CANCELLED,
}
_BY_MODEL: list[int] = [-1] * STATS_WORDS
for _outcome, _block in _OUTCOME_BLOCKS.items():
    _BY_MODEL[_outcome] = _block


class FrontendStats:
    """The writer side: one frontend's row."""

    def __init__(self, row: np.ndarray) -> None:
        """``row``: this frontend's counter row, from its transport link (``FrontendLink.stats_row``)."""
        self._row = row
        self._result_cache_seen = (0, 0, 0)

    def add(self, counter: Counter, value: int = 1) -> None:
        """Count ``value`` at ``counter``; a request outcome also at its model's row once the request named one
        (``serving_model``)."""
        self._row[counter] += value
        by_model = _BY_MODEL[counter]
        if by_model >= 0 and (model := _request_model.get()) >= 0:
            self._row[by_model + model] += value

    @staticmethod
    def serving_model(model_index: int) -> None:
        """The request of the current task is for model-table row ``model_index``: its outcome is counted by
        model from now on (module-level ``_request_model``: why a context variable)."""
        if 0 <= model_index < MODEL_SLOTS:
            _request_model.set(model_index)

    def set(self, counter: Counter, value: int) -> None:
        self._row[counter] = value

    def add_model(self, base: Counter, model_index: int) -> None:
        """Count one at the model-table row ``model_index`` of a per-model block (MODEL_ADMITTED, ...)."""
        if 0 <= model_index < MODEL_SLOTS:
            self._row[base + model_index] += 1

    def set_result_cache(self, stats: ResultCacheStats, used_bytes: int) -> None:
        """Publish this frontend's result cache counts: added as increments since the last call, so the
        counters keep growing across a frontend restart (whose new cache counts from zero)."""
        last = self._result_cache_seen
        self._row[Counter.RESULT_CACHE_HITS] += stats.hits - last[0]
        self._row[Counter.RESULT_CACHE_MISSES] += stats.misses - last[1]
        self._row[Counter.RESULT_CACHE_EVICTIONS] += stats.evictions - last[2]
        self._row[Counter.RESULT_CACHE_BYTES] = used_bytes
        self._row[Counter.RESULT_CACHE_BOUND_BYTES] = stats.bound_bytes
        self._row[Counter.RESULT_CACHE_ENTRIES] = stats.entries
        self._result_cache_seen = (stats.hits, stats.misses, stats.evictions)

    def observe(self, base: Counter, seconds: float) -> None:
        """Record a latency in the histogram starting at ``base`` (LATENCY_* or TTFT_*)."""
        sum_idx, count_idx, buckets = {
            Counter.LATENCY_BUCKETS: (Counter.LATENCY_SUM_US, Counter.LATENCY_COUNT, Counter.LATENCY_BUCKETS),
            Counter.TTFT_BUCKETS: (Counter.TTFT_SUM_US, Counter.TTFT_COUNT, Counter.TTFT_BUCKETS),
        }[base]
        self._row[sum_idx] += int(seconds * 1e6)
        self._row[count_idx] += 1
        self._row[buckets + bisect.bisect_left(REQUEST_BUCKETS_S, seconds)] += 1


class ModelGauges(NamedTuple):
    """One declared model's live facts at a scrape, in model-table order."""

    model: str
    queue_depth: int  # descriptors waiting on its own request queue
    workers_ready: int


class NodeCollector:
    """A prometheus_client collector over the node's statistics (read at each scrape)."""

    def __init__(
        self,
        node: NodeStats,
        queue_depth: Callable[[], int],
        models: Callable[[], list[ModelGauges]] | None = None,
        exemplars: Exemplars | None = None,
    ) -> None:
        """``models``: the declared models' gauges; their labels are the model table's ids, so the
        per-model series are bounded by the declared models (at most MODEL_SLOTS). ``exemplars``: the
        answering frontend's traced requests per stage bucket (``StageRecorder.exemplars``)."""
        self.node = node
        self.queue_depth = queue_depth
        self.models = models
        self.exemplars = exemplars

    def collect(self) -> Iterator[Metric]:
        node = self.node
        total = node.frontend_totals()

        def counter(name: str, help_text: str, index: int) -> CounterMetricFamily:
            return CounterMetricFamily(name, help_text, value=int(total[index]))

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, help_text, value=value)

        requests = CounterMetricFamily(
            "shmgate_requests_total", "Chat completion and embedding requests by outcome.", labels=["outcome"]
        )
        for outcome, index in (
            ("ok", Counter.REQUESTS_OK),
            ("client_error", Counter.REQUESTS_CLIENT_ERROR),
            ("server_error", Counter.REQUESTS_SERVER_ERROR),
            ("overloaded", Counter.REQUESTS_OVERLOADED),
            ("cancelled", Counter.CANCELLED),
        ):
            requests.add_metric([outcome], int(total[index]))
        yield requests
        yield _latency_histogram(
            "shmgate_request_duration_seconds",
            "Request latency.",
            total,
            Counter.LATENCY_BUCKETS,
            Counter.LATENCY_SUM_US,
            Counter.LATENCY_COUNT,
        )
        yield _latency_histogram(
            "shmgate_time_to_first_token_seconds",
            "Time to the first streamed content.",
            total,
            Counter.TTFT_BUCKETS,
            Counter.TTFT_SUM_US,
            Counter.TTFT_COUNT,
        )
        yield counter(
            "shmgate_cache_hits_total", "Images found in this frontend's partition (no decode).", Counter.CACHE_HITS
        )
        yield counter(
            "shmgate_cache_remote_hits_total",
            "Images copied from another frontend's partition.",
            Counter.CACHE_REMOTE_HITS,
        )
        yield counter("shmgate_cache_misses_total", "Images decoded and preprocessed.", Counter.CACHE_MISSES)
        yield counter("shmgate_cache_evictions_total", "Cached images evicted to make room.", Counter.CACHE_EVICTIONS)
        yield counter(
            "shmgate_result_cache_hits_total",
            "Answers (embeddings, classifier labels) served from a frontend's result cache.",
            Counter.RESULT_CACHE_HITS,
        )
        yield counter(
            "shmgate_result_cache_misses_total",
            "Answers looked up in a result cache and not found (then computed).",
            Counter.RESULT_CACHE_MISSES,
        )
        yield counter(
            "shmgate_result_cache_evictions_total",
            "Result cache entries evicted to make room.",
            Counter.RESULT_CACHE_EVICTIONS,
        )
        yield gauge(
            "shmgate_result_cache_bytes",
            "Bytes held by the frontends' result caches.",
            int(total[Counter.RESULT_CACHE_BYTES]),
        )
        yield gauge(
            "shmgate_result_cache_bound_bytes",
            "The most the frontends' result caches may hold (--result-cache-mb each; 0 until one was used).",
            int(total[Counter.RESULT_CACHE_BOUND_BYTES]),
        )
        yield gauge(
            "shmgate_result_cache_entries",
            "Answers held by the frontends' result caches.",
            int(total[Counter.RESULT_CACHE_ENTRIES]),
        )
        yield counter("shmgate_retries_total", "Requests resubmitted after their worker died.", Counter.RETRIES)
        yield counter(
            "shmgate_cancelled_tokens_total",
            "Completion tokens generated for requests whose client had hung up (work for nobody).",
            Counter.CANCELLED_TOKENS,
        )
        used = int(total[Counter.ARENA_USED_BYTES])
        size = int(total[Counter.ARENA_SIZE_BYTES])
        yield gauge("shmgate_arena_used_bytes", "Arena bytes allocated.", used)
        yield gauge(
            "shmgate_arena_held_bytes",
            "Arena bytes pinned by requests in flight (cached tensors excluded).",
            int(total[Counter.ARENA_HELD_BYTES]),
        )
        yield gauge("shmgate_arena_free_bytes", "Arena bytes free.", size - used)
        yield gauge("shmgate_in_flight_requests", "Requests being served.", int(total[Counter.IN_FLIGHT]))
        yield gauge(
            "shmgate_interactive_in_flight_requests",
            "Interactive model requests being served (the bulk lane yields to them; docs/BATCH.md).",
            int(total[Counter.INTERACTIVE_IN_FLIGHT]),
        )
        yield gauge("shmgate_request_queue_depth", "Descriptors waiting for a worker.", self.queue_depth())
        workers = node.worker_totals()
        # READY, heartbeating and progressing: a worker killed in another container (no one marks its row
        # DEAD) stops counting once its heartbeat is stale, a wedged one once its progress is (as /ready).
        yield gauge("shmgate_workers_ready", "Workers serving.", node.live_workers())
        yield CounterMetricFamily(
            "shmgate_worker_starts_total", "Worker (re)starts; restarts = starts - workers.", value=workers.starts
        )
        yield CounterMetricFamily(
            "shmgate_worker_stalls_total",
            "Workers declared stalled (alive but no progress for --stall-timeout-s) and replaced.",
            value=workers.stalls,
        )
        yield CounterMetricFamily(
            "shmgate_frontend_stalls_total",
            "Frontends whose event loop stopped turning for --stall-timeout-s, killed and restarted.",
            value=workers.frontend_stalls,
        )
        yield CounterMetricFamily(
            "shmgate_worker_busy_seconds_total", "Time workers spent running batches.", value=workers.busy_ns / 1e9
        )
        batch = HistogramMetricFamily("shmgate_batch_size", "Requests per batch the workers ran.")
        cumulative = np.cumsum(node.batch_histogram())
        batch.add_metric(
            [],
            [(bound, int(c)) for bound, c in zip((*map(str, BATCH_BUCKETS), "+Inf"), cumulative)],
            sum_value=workers.batched_requests,
        )
        yield batch
        yield from _engine_metrics(node.engine_totals())
        yield from _worker_cache_metrics(node.worker_caches())
        yield from _shared_encoder_metrics(node.engine_by_worker())
        yield gauge(
            "shmgate_preparing_requests",
            "Admitted requests still being decoded and preprocessed.",
            node.preparing_requests(),
        )
        yield stage_histogram(total, self.exemplars)
        if self.models is not None:
            yield from _model_metrics(total, self.models())
        build = GaugeMetricFamily("shmgate_build_info", "The shmgate version serving (always 1).", labels=["version"])
        build.add_metric([version()], 1)
        yield build


def _latency_histogram(
    name: str, help_text: str, total: np.ndarray, buckets: int, sum_idx: int, count_idx: int
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, help_text)
    cumulative = 0
    points: list[tuple[str, float]] = []
    for i, bound in enumerate(REQUEST_BUCKETS_S):
        cumulative += int(total[buckets + i])
        points.append((f"{bound:g}", cumulative))
    cumulative += int(total[buckets + len(REQUEST_BUCKETS_S)])
    points.append(("+Inf", cumulative))
    family.add_metric([], points, sum_value=int(total[sum_idx]) / 1e6)
    return family


def _model_metrics(total: np.ndarray, models: list[ModelGauges]) -> Iterator[Metric]:
    """The per-model series: requests admitted and their outcomes, queue depth and ready workers, by ``model``."""
    requests = CounterMetricFamily(
        "shmgate_model_requests_total",
        "Requests per model: admitted; and how each that "
        "named the model ended: ok, error (4xx/5xx but 429/503), overloaded (429/503: its "
        "in-flight bound, no worker, its queue full, the arena), cancelled (client gone).",
        labels=["model", "outcome"],
    )
    queue = GaugeMetricFamily(
        "shmgate_model_queue_depth", "Descriptors waiting on the model's request queue.", labels=["model"]
    )
    ready = GaugeMetricFamily("shmgate_model_workers_ready", "The model's workers serving.", labels=["model"])
    for i, m in enumerate(models[:MODEL_SLOTS]):
        requests.add_metric([m.model, "admitted"], int(total[Counter.MODEL_ADMITTED + i]))
        for outcome, base in (
            ("ok", Counter.MODEL_OK),
            ("error", Counter.MODEL_ERROR),
            ("overloaded", Counter.MODEL_OVERLOADED),
            ("cancelled", Counter.MODEL_CANCELLED),
        ):
            requests.add_metric([m.model, outcome], int(total[base + i]))
        queue.add_metric([m.model], m.queue_depth)
        ready.add_metric([m.model], m.workers_ready)
    yield from (requests, queue, ready)


class BatchCollector:
    """The Batch API's lines per model (gateway/batch_store.py ``line_counts``), read from its database at
    each scrape. Models the node does not serve (a line may name any) count under ``other``, so the
    series stay bounded by the declared models."""

    def __init__(self, counts: Callable[[], dict[str, tuple[int, int, int]]], served: Iterable[str]) -> None:
        self.counts = counts
        self.served = set(served)

    def collect(self) -> Iterator[Metric]:
        by_model: dict[str, list[int]] = {}
        try:
            counts = self.counts()
        except Exception as exc:  # the batch database (a disk, a lock): never the whole scrape's failure
            log.warning("batch line metrics left out: %r", exc)
            return
        for model, numbers in counts.items():
            kept = by_model.setdefault(model if model in self.served else "other", [0, 0, 0])
            for i, n in enumerate(numbers):
                kept[i] += n
        queued = GaugeMetricFamily(
            "shmgate_batch_lines_queued", "Batch lines of unfinished batches not run yet.", labels=["model"]
        )
        done = CounterMetricFamily("shmgate_batch_lines_done", "Batch lines answered with a success.", labels=["model"])
        failed = CounterMetricFamily(
            "shmgate_batch_lines_failed", "Batch lines that ended in an error (the error file's).", labels=["model"]
        )
        for model, (q, d, f) in sorted(by_model.items()):
            queued.add_metric([model], q)
            done.add_metric([model], d)
            failed.add_metric([model], f)
        yield from (queued, done, failed)


def exposition(
    node: NodeStats,
    queue_depth: Callable[[], int],
    accept: str | None,
    models: Callable[[], list[ModelGauges]] | None = None,
    batches: BatchCollector | None = None,
    exemplars: Exemplars | None = None,
) -> tuple[bytes, str]:
    """(body, content type) for a scrape: OpenMetrics when ``accept`` asks for it, else the text format.

    An ``Accept`` header prometheus_client cannot read (``application/openmetrics-text; version=abc``
    makes ``choose_encoder`` raise) gets the text format, which every scraper understands.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(node, queue_depth, models, exemplars))
    if batches is not None:
        registry.register(batches)
    try:
        encoder, content_type = choose_encoder(accept or "")
        return encoder(registry), content_type
    except Exception:  # a parser of client input: whatever it trips on, the text format answers
        encoder, content_type = choose_encoder("")
        return encoder(registry), content_type


def render(node: NodeStats, queue_depth: int) -> str:
    """The Prometheus text exposition for the whole node."""
    body, _ = exposition(node, lambda: queue_depth, None)
    return body.decode()


def _shared_encoder_metrics(rows: list[tuple[int, str, dict[str, int]]]) -> Iterator[Metric]:
    """Per worker: its model's shared vision-tower outputs (worker/encoder_share.py, --encoder-share-mb)."""
    families = [
        ("hits", "Images whose vision-tower output a worker read from its model's shared outputs."),
        ("misses", "Images a worker looked up in its model's shared outputs and did not find (its tower ran)."),
        ("publishes", "Vision-tower outputs a worker published for the other workers of its model."),
    ]
    for word, text in families:
        family = CounterMetricFamily(f"shmgate_encoder_shared_{word}", text, labels=["model", "worker"])
        for slot, model, words in rows:
            family.add_metric([model, str(slot)], words[f"encoder_shared_{word}"])
        yield family


def _worker_cache_metrics(caches: dict[str, dict[str, int]]) -> Iterator[Metric]:
    """The workers' own caches (worker/cache_gauges.py), summed over workers, by cache: a cache whose bytes
    sit at its bound with evictions rising is full, not leaking."""
    families: tuple[GaugeMetricFamily | CounterMetricFamily, ...] = (
        GaugeMetricFamily(
            "shmgate_worker_cache_bytes", "Bytes a worker cache holds, summed over workers.", labels=["cache"]
        ),
        GaugeMetricFamily(
            "shmgate_worker_cache_bound_bytes",
            "The most a worker cache may hold (its flag, e.g. --encoder-cache-mb), summed over workers.",
            labels=["cache"],
        ),
        GaugeMetricFamily(
            "shmgate_worker_cache_entries", "Entries a worker cache holds, summed over workers.", labels=["cache"]
        ),
        CounterMetricFamily(
            "shmgate_worker_cache_evictions",
            "Entries dropped from a worker cache to stay within its bound.",
            labels=["cache"],
        ),
    )
    for name, words in caches.items():
        for family, field in zip(families, ("bytes", "bound_bytes", "entries", "evictions")):
            family.add_metric([name], words[field])
    yield from families


def _engine_metrics(words: dict[str, int]) -> Iterator[Metric]:
    """The generation engines' gauges and counters (worker/generation/), summed over workers.

    Mean step time is ``rate(step_seconds) / rate(steps)``, tokens per step ``rate(step_tokens) /
    rate(steps)``.
    """
    yield GaugeMetricFamily(
        "shmgate_engine_running_requests", "Requests decoding in the generation engines.", value=words["running"]
    )
    yield GaugeMetricFamily(
        "shmgate_engine_waiting_requests",
        "Requests added to a generation engine, not running yet.",
        value=words["waiting"],
    )
    yield GaugeMetricFamily(
        "shmgate_kv_cache_used_tokens", "KV cache token positions the engines hold.", value=words["kv_used"]
    )
    yield GaugeMetricFamily(
        "shmgate_kv_cache_budget_tokens",
        "The engines' KV budgets in token positions (0: unbounded).",
        value=words["kv_budget"],
    )
    yield CounterMetricFamily("shmgate_engine_steps_total", "Generation engine steps.", value=words["steps"])
    yield CounterMetricFamily(
        "shmgate_engine_step_seconds_total", "Time the engines' steps took.", value=words["step_ns"] / 1e9
    )
    yield CounterMetricFamily(
        "shmgate_engine_step_tokens_total",
        "Tokens the engines' steps ran (one per decoding row, one per prefilled prompt token).",
        value=words["step_tokens"],
    )
    yield CounterMetricFamily(
        "shmgate_engine_preemptions_total",
        "Running requests preempted (their KV cache dropped and recomputed later) to stay within the KV budget.",
        value=words["preemptions"],
    )
    yield CounterMetricFamily(
        "shmgate_encoder_cache_hits_total",
        "Images whose vision-tower output came from a worker's encoder cache.",
        value=words["encoder_hits"],
    )
    yield CounterMetricFamily(
        "shmgate_vision_tower_runs_total",
        "Vision-tower runs over images not in the encoder cache.",
        value=words["encoder_runs"],
    )
    yield CounterMetricFamily(
        "shmgate_prefix_cache_hits_total",
        "Prompts that started from a stored prefix's KV (a chat's earlier turn, a shared system prompt and image).",
        value=words["prefix_hits"],
    )
    yield CounterMetricFamily(
        "shmgate_prefix_cache_reused_tokens_total",
        "Prompt tokens whose KV came from the prefix cache instead of a prefill.",
        value=words["prefix_tokens"],
    )
