"""The stats row's layout (shared/stats_layout.py): every entry in its own words, all inside the row.

The row is a contract between processes (a frontend writes it, any frontend's /metrics and the
supervisor's drain read it), so a counter placed on a word already in use would silently mix two
metrics. These checks read the one table of entries, then drive the real writers (FrontendStats,
StageRecorder) and the real readers (the POSIX node statistics and supervisor link over a scratch
instance) against it.
"""

from __future__ import annotations

import numpy as np
import pytest

from shmgate.gateway.metrics import FrontendStats
from shmgate.gateway.stages import StageRecorder
from shmgate.shared.stages import Stage
from shmgate.shared.stats_layout import (
    REQUEST_HISTOGRAM_WORDS,
    STAGE_WORDS,
    STATS_WORDS,
    Counter,
    Span,
    spans,
    stage_base,
)
from shmgate.shared.transport import PosixNodeStats, PosixSupervisorLink
from tests.shm_children import scratch_instance


def test_no_two_entries_overlap_and_the_row_holds_them_all() -> None:
    entries = spans()
    assert entries[0].first >= 0
    for before, after in zip(entries, entries[1:]):
        assert before.first + before.words <= after.first, f"{before} overlaps {after}"
    last = entries[-1]
    assert last.first + last.words <= STATS_WORDS, f"{last} runs past the {STATS_WORDS}-word row"


def test_every_counter_and_every_stage_is_an_entry() -> None:
    names = {span.name for span in spans()}
    assert set(Counter.__members__) <= names
    assert {f"stage {stage.name}" for stage in Stage} <= names


def _span(name: str) -> Span:
    return next(span for span in spans() if span.name == name)


def _written(row: np.ndarray) -> set[int]:
    return {int(i) for i in np.nonzero(row)[0]}


@pytest.mark.parametrize("counter", [c for c in Counter if c not in (Counter.LATENCY_BUCKETS, Counter.TTFT_BUCKETS)])
def test_a_counter_writes_its_own_word_only(counter: Counter) -> None:
    row = np.zeros(STATS_WORDS, dtype="<u8")
    FrontendStats(row).add(counter, 3)
    assert _written(row) == {_span(counter.name).first}


@pytest.mark.parametrize("base", [Counter.LATENCY_BUCKETS, Counter.TTFT_BUCKETS])
def test_a_request_histogram_stays_in_its_span_and_its_sum_and_count_words(base: Counter) -> None:
    row = np.zeros(STATS_WORDS, dtype="<u8")
    stats = FrontendStats(row)
    for seconds in (0.0, 0.007, 3.0, 1e6):  # the first bucket ... +Inf
        stats.observe(base, seconds)
    prefix = base.name.removesuffix("_BUCKETS")
    buckets = set(range(int(base), int(base) + REQUEST_HISTOGRAM_WORDS))
    assert int(base) in _written(row) and int(base) + REQUEST_HISTOGRAM_WORDS - 1 in _written(row)
    assert _written(row) <= buckets | {Counter[f"{prefix}_SUM_US"], Counter[f"{prefix}_COUNT"]}


@pytest.mark.parametrize("stage", list(Stage))
def test_a_stage_histogram_stays_in_its_block(stage: Stage) -> None:
    row = np.zeros(STATS_WORDS, dtype="<u8")
    recorder = StageRecorder(row)
    for seconds in (0.0, 0.02, 1e6):  # the first bucket, one inside, +Inf
        recorder.observe(stage, seconds)
    block = _span(f"stage {stage.name}")
    assert block.first == stage_base(stage) and block.words == STAGE_WORDS
    written = _written(row)
    assert written <= set(range(block.first, block.first + block.words))
    assert block.first + block.words - 1 in written  # the count, the block's last word


def test_the_in_flight_gauge_a_frontend_writes_is_what_the_supervisor_and_metrics_read() -> None:
    """The writer (gateway/metrics.py) and the readers (shared/transport/posix.py) once named this
    word in two files; now both take it from the layout, through a real segment's stats rows."""
    with scratch_instance(arena_size=2 << 20, n_frontends=2, n_workers=1, queue_depth=2) as inst:
        supervisor, node = PosixSupervisorLink(inst), PosixNodeStats(inst)
        assert not supervisor.frontend_busy(1)
        FrontendStats(inst.segment.stats[1]).set(Counter.IN_FLIGHT, 2)
        assert supervisor.frontend_busy(1) and not supervisor.frontend_busy(0)
        assert int(node.frontend_totals()[Counter.IN_FLIGHT]) == 2
        FrontendStats(inst.segment.stats[1]).set(Counter.IN_FLIGHT, 0)
        assert not supervisor.frontend_busy(1)
