"""Per-stage latency histograms: where each request's time went (stages: shared/stages.py).

Who uses this: the frontend (``StageRecorder``, a few one-line hooks in gateway/frontend.py,
gateway/chat_route.py and gateway/render.py), /metrics (``stage_histogram``, histogram
``shmgate_stage_duration_seconds`` with a ``stage`` label) and ``shmgate bench``
(``parse_stage_histograms``, ``stage_breakdown``: the breakdown of its own run, from the difference
of two scrapes).

Storage: like every other metric, the counts live in this frontend's stats row (one block of words
per stage, shared/stats_layout.py), so whichever frontend answers a scrape reports the whole node.
The bucket bounds are finer than the request histogram's: most stages take milliseconds.
"""

from __future__ import annotations

import bisect
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client.core import Exemplar, HistogramMetricFamily

from shmgate.shared.stages import Stage, worker_stage_seconds
from shmgate.shared.stats_layout import STAGE_BUCKETS_S, STAGE_COUNT, STAGE_SUM_US, stage_base
from shmgate.shared.vocabulary import now_ns
from shmgate.shared.wire import Claimed, Finished

__all__ = [
    "METRIC",
    "STAGE_BUCKETS_S",
    "RequestTiming",
    "StageRecorder",
    "parse_server_timing",
    "parse_stage_histograms",
    "server_timing",
    "stage_breakdown",
    "stage_histogram",
]

METRIC = "shmgate_stage_duration_seconds"
Exemplars = dict[tuple[Stage, int], tuple[str, float, float]]  # (stage, bucket) -> (trace id, seconds, when)


@dataclass
class RequestTiming:
    """One request's frontend-side moments (``now_ns()``; 0: not reached) and what each stage took.

    ``spent`` is the same figures the histograms get, kept per request for the ``Server-Timing``
    response header (``--server-timing``): a histogram says the p99 is slow, this says why one
    request was.
    """

    submitted_ns: int = 0
    claimed_ns: int = 0  # the worker's stamp
    done_ns: int = 0  # the worker's final event
    spent: dict[Stage, float] = field(default_factory=dict)  # seconds per stage, as observed
    trace_id: str = ""  # its trace (32 hex) when tracing is on: the stage histograms' exemplars


class StageRecorder:
    """The writer side: one frontend's stage histograms, in its stats row."""

    def __init__(self, row: np.ndarray) -> None:
        self._row = row  # this frontend's stats row (FrontendLink.stats_row)
        # (stage, bucket index) -> (trace id, seconds, when): the last traced request counted in each
        # bucket, for /metrics' exemplars (``stage_histogram``); empty when tracing is off
        self.exemplars: Exemplars = {}

    def observe(self, stage: Stage, seconds: float, timing: RequestTiming | None = None) -> None:
        """Count ``seconds`` in ``stage``'s histogram (and in ``timing``, the request's own record)."""
        if timing is not None:
            timing.spent[stage] = seconds
        base = stage_base(stage)
        bucket = bisect.bisect_left(STAGE_BUCKETS_S, seconds)
        self._row[base + bucket] += 1
        if timing is not None and timing.trace_id:  # a traced request (its trace id is set only then)
            self.exemplars[(stage, bucket)] = (timing.trace_id, seconds, time.time())
        self._row[base + STAGE_SUM_US] += int(seconds * 1e6)
        self._row[base + STAGE_COUNT] += 1

    def submitted(self, timing: RequestTiming, started_s: float) -> None:
        """Images resolved and the descriptor built (``started_s``: ``time.monotonic()`` at admission)."""
        timing.submitted_ns = now_ns()
        self.observe(Stage.PREPROCESS, max(0.0, timing.submitted_ns / 1e9 - started_s), timing)

    def claimed(self, timing: RequestTiming, message: Claimed) -> None:
        if message.claimed_ns and timing.submitted_ns and not timing.claimed_ns:
            timing.claimed_ns = message.claimed_ns
            self.observe(Stage.QUEUE, max(0, message.claimed_ns - timing.submitted_ns) / 1e9, timing)

    def finished(self, timing: RequestTiming, message: Finished) -> None:
        for stage, seconds in worker_stage_seconds(timing.claimed_ns, message.stamps).items():
            self.observe(stage, seconds, timing)
        if message.stamps:
            timing.done_ns = message.stamps[-1]

    def delivered(self, timing: RequestTiming) -> None:
        """The response to the client is built: the end of ``delivery``."""
        if timing.done_ns:
            self.observe(Stage.DELIVERY, max(0, now_ns() - timing.done_ns) / 1e9, timing)
            timing.done_ns = 0


def server_timing(timing: RequestTiming, total_s: float) -> str:
    """The ``Server-Timing`` header value (W3C Server Timing: durations in ms) of one answered request.

    Stages in the order a request meets them, then ``total`` (admission to the response, as the
    frontend saw it; the client's latency adds the network and its own queueing). Only stages the
    request went through are named: a cache hit has no ``queue``.
    """
    parts = [f"{stage.name.lower()};dur={seconds * 1000:.2f}" for stage, seconds in sorted(timing.spent.items())]
    parts.append(f"total;dur={total_s * 1000:.2f}")
    return ", ".join(parts)


_TIMING_ENTRY = re.compile(r"^\s*([\w-]+)\s*(?:;.*?\bdur=([0-9.]+))?")


def parse_server_timing(value: str) -> dict[str, float]:
    """{name: ms} from a ``Server-Timing`` header value (entries without ``dur`` are left out)."""
    out: dict[str, float] = {}
    for entry in value.split(","):
        match = _TIMING_ENTRY.match(entry)
        if match and match.group(2):
            try:
                out[match.group(1)] = float(match.group(2))
            except ValueError:
                continue
    return out


def stage_histogram(total: np.ndarray, exemplars: Exemplars | None = None) -> HistogramMetricFamily:
    """The stage histograms for /metrics' collector (``total``: the summed stats rows; ``exemplars``: the
    answering frontend's, ``StageRecorder.exemplars``)."""
    family = HistogramMetricFamily(
        METRIC, "Time requests spent in each stage of serving (see shared/stages.py).", labels=["stage"]
    )
    for stage in Stage:
        base = stage_base(stage)
        cumulative = 0
        points: list[tuple[str, float]] = []
        for i, bound in enumerate((*STAGE_BUCKETS_S, None)):
            cumulative += int(total[base + i])
            points.append(("+Inf" if bound is None else f"{bound:g}", cumulative))
        if exemplars:
            points = _with_exemplars(stage, points, exemplars)
        family.add_metric([stage.name.lower()], points, sum_value=int(total[base + STAGE_SUM_US]) / 1e6)
    return family


def _with_exemplars(stage: Stage, points: list[tuple[str, float]], exemplars: Exemplars) -> list[Any]:
    """Each bucket with the last traced request this frontend counted in it (OpenMetrics shows them).

    The counts are the whole node's, the exemplars only this frontend's: an exemplar is a sample that
    leads to a trace, not a statistic, so whichever frontend answers the scrape has good ones.
    """
    out: list[Any] = []
    for i, (le, count) in enumerate(points):
        found = exemplars.get((stage, i))
        if found is None or count <= 0:
            out.append((le, count))
        else:
            trace_id, seconds, at = found
            out.append((le, count, Exemplar({"trace_id": trace_id}, seconds, at)))
    return out


_SAMPLE = re.compile(rf"^{METRIC}_(bucket|sum|count)\{{([^}}]*)\}} (\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_stage_histograms(text: str) -> dict[str, dict[str, Any]]:
    """{stage: {"buckets": [(le, cumulative count)...], "sum": s, "count": n}} from a /metrics text."""
    stages: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        kind, labels, value = match.groups()
        label = dict(_LABEL.findall(labels))  # any label order (prometheus_client writes le first)
        stage, le = label.get("stage"), label.get("le")
        if stage is None:
            continue
        entry = stages.setdefault(stage, {"buckets": [], "sum": 0.0, "count": 0})
        if kind == "bucket":
            if le is not None:
                entry["buckets"].append((float("inf") if le == "+Inf" else float(le), float(value)))
        elif kind == "sum":
            entry["sum"] = float(value)
        else:
            entry["count"] = int(float(value))
    return stages


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket that holds the q-th observation."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if upper == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (upper - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = upper, cumulative
    return lower


def stage_breakdown(before: str, after: str) -> list[dict[str, Any]]:
    """Per stage, the count, mean, p50 and p99 (ms) of what happened between two /metrics scrapes.

    Quantiles come from the histogram buckets (interpolated, so as coarse as the buckets); the mean
    is exact. Stages nobody went through in between are left out.
    """
    first, second = parse_stage_histograms(before), parse_stage_histograms(after)
    rows = []
    for stage in Stage:
        name = stage.name.lower()
        if name not in second:
            continue
        old = first.get(name, {"buckets": [], "sum": 0.0, "count": 0})
        old_counts = dict(old["buckets"])
        buckets = [(le, count - old_counts.get(le, 0.0)) for le, count in second[name]["buckets"]]
        count = second[name]["count"] - old["count"]
        if count <= 0:
            continue
        total_s = second[name]["sum"] - old["sum"]
        p50, p99 = _quantile(buckets, 0.5), _quantile(buckets, 0.99)
        rows.append(
            {
                "stage": name,
                "count": count,
                "mean_ms": round(total_s / count * 1000, 3),
                "p50_ms": None if p50 is None else round(p50 * 1000, 3),
                "p99_ms": None if p99 is None else round(p99 * 1000, 3),
            }
        )
    return rows
