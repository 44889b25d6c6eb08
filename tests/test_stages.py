"""Per-stage latency: the worker's stamps, the histograms in /metrics, bench's breakdown.

The first tests check the bookkeeping on made-up stamps and an in-memory stats row (no timing).
The last runs a real ``shmgate serve`` (checksum model) and real HTTP requests, then reads
/metrics: every stage is present, its count moved by the number of requests, and the values are
plausible (non-negative, the worker's stages inside the requests' total), with no thresholds.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from shmgate.gateway.stages import (
    METRIC,
    RequestTiming,
    StageRecorder,
    parse_server_timing,
    parse_stage_histograms,
    server_timing,
    stage_breakdown,
    stage_histogram,
)
from shmgate.shared.segment import STATS_WORDS
from shmgate.shared.stages import STAMPS, Stage, Stamp, Stamps, worker_stage_seconds
from shmgate.shared.wire import Claimed, Finished, encoder, gateway_decoder
from tests.serving import Server, expected_checksum, image_request, noise_png, start_server, stop_and_check

STAGE_NAMES = [stage.name.lower() for stage in Stage]


def _recorder() -> tuple[StageRecorder, np.ndarray]:
    stats = np.zeros((1, STATS_WORDS), dtype="<u8")
    return StageRecorder(stats[0]), stats


def stage_lines(total: np.ndarray) -> list[str]:
    """The exposition /metrics serves for these histograms (through prometheus_client, as gateway/metrics.py)."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import CollectorRegistry

    class Collector:
        def collect(self) -> Iterator[Any]:
            yield stage_histogram(total)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())  # type: ignore[arg-type]
    return generate_latest(registry).decode().splitlines()


def test_worker_stamps_turn_into_stage_durations() -> None:
    ms = 1_000_000
    stamps = (110 * ms, 112 * ms, 150 * ms, 170 * ms, 190 * ms)  # cut, copied, started, first, done
    seconds = worker_stage_seconds(100 * ms, stamps)
    assert seconds == pytest.approx(
        {Stage.BATCH_WAIT: 0.048, Stage.DEVICE_COPY: 0.002, Stage.COMPUTE: 0.040, Stage.FIRST_OUTPUT: 0.020}
    )


@pytest.mark.parametrize(
    "claimed, stamps",
    [
        (0, (1, 2, 3, 4, 5)),  # an older worker: no claim stamp
        (1, ()),  # an older worker: no stamps
        (10, (1, 2, 3, 4, 5)),  # out of order: no figures rather than negative ones
        (1, (1, 5, 3, 4, 6)),
    ],
)
def test_missing_or_odd_stamps_give_no_figures(claimed: int, stamps: tuple[int, ...]) -> None:
    assert worker_stage_seconds(claimed, stamps) == {}


def test_stamps_fill_in_order_and_ride_in_finished() -> None:
    stamps = Stamps()
    Stamps.mark_all([stamps], Stamp.CUT)
    stamps.mark(Stamp.COPIED)
    Stamps.mark_all([stamps], Stamp.STARTED)
    values = stamps.done()  # no output event before: the end is the first output too
    assert len(values) == STAMPS and list(values) == sorted(values) and values[Stamp.FIRST] > 0
    finished = Finished(
        request_id=7, seq=0, finish_reason="stop", prompt_tokens=1, completion_tokens=2, text="text", stamps=values
    )
    message = gateway_decoder.decode(encoder.encode(finished))
    assert isinstance(message, Finished) and message.stamps == values
    claimed = gateway_decoder.decode(
        encoder.encode(Claimed(request_id=7, worker_slot=0, worker_epoch=1, claimed_ns=12345))
    )
    assert isinstance(claimed, Claimed) and claimed.claimed_ns == 12345
    old = gateway_decoder.decode(encoder.encode(Claimed(7, 0, 1)))  # what an older worker sends
    assert isinstance(old, Claimed) and old.claimed_ns == 0


def test_recorder_histograms_render_and_parse_back() -> None:
    recorder, stats = _recorder()
    before = "\n".join(stage_lines(stats.sum(axis=0)))
    timing = RequestTiming(submitted_ns=1_000_000_000)
    recorder.claimed(
        timing, Claimed(request_id=1, worker_slot=0, worker_epoch=1, claimed_ns=1_004_000_000)
    )  # 4 ms in the queue
    recorder.observe(Stage.BODY_READ, 0.0003)
    recorder.observe(Stage.BODY_READ, 20.0)  # past the last bucket: +Inf
    after = "\n".join(stage_lines(stats.sum(axis=0)))
    parsed = parse_stage_histograms(after)
    assert sorted(parsed) == sorted(STAGE_NAMES)
    assert parsed["queue"]["count"] == 1 and parsed["queue"]["sum"] == pytest.approx(0.004)
    assert parsed["body_read"]["count"] == 2 and parsed["body_read"]["buckets"][-1] == (float("inf"), 2.0)
    rows = {row["stage"]: row for row in stage_breakdown(before, after)}
    assert set(rows) == {"queue", "body_read"}  # stages nobody went through are left out
    assert rows["queue"]["count"] == 1 and rows["queue"]["mean_ms"] == pytest.approx(4.0)
    assert 2.5 <= rows["queue"]["p50_ms"] <= 5.0  # inside the bucket that holds it
    recorder.claimed(
        timing, Claimed(request_id=1, worker_slot=0, worker_epoch=1, claimed_ns=1_009_000_000)
    )  # a second Claimed (a retry) counts once
    assert parse_stage_histograms("\n".join(stage_lines(stats.sum(axis=0))))["queue"]["count"] == 1


def test_a_request_keeps_its_own_stage_figures_for_server_timing() -> None:
    recorder, _ = _recorder()
    timing = RequestTiming(submitted_ns=1_000_000_000)
    recorder.observe(Stage.BODY_READ, 0.0005, timing)
    recorder.claimed(timing, Claimed(request_id=1, worker_slot=0, worker_epoch=1, claimed_ns=1_004_000_000))
    recorder.observe(Stage.PREPROCESS, 0.012, timing)
    header = server_timing(timing, 0.0301)
    assert header == "body_read;dur=0.50, preprocess;dur=12.00, queue;dur=4.00, total;dur=30.10"  # stage order
    assert parse_server_timing(header) == {"body_read": 0.5, "preprocess": 12.0, "queue": 4.0, "total": 30.1}
    # other servers' syntax: descriptions, no dur, odd spacing
    assert parse_server_timing('db;desc="x";dur=2.5,  cache;desc=hit , app ;dur=1') == {"db": 2.5, "app": 1.0}


def test_bench_explains_the_slowest_requests_from_server_timing() -> None:
    from shmgate.bench_client.loadgen import Outcome, tail_breakdown

    def outcome(latency_ms: float, queue_ms: float) -> Outcome:
        return Outcome(
            "a.png",
            latency_ms / 1000,
            None,
            200,
            "x",
            None,
            {"queue": queue_ms, "compute": 10.0, "total": latency_ms - 1.0},
        )

    ok = [outcome(20.0, 9.0) for _ in range(99)] + [outcome(120.0, 109.0)]
    rows = {row["stage"]: row for row in tail_breakdown(ok)}
    assert rows["queue"]["tail_count"] == 1 and rows["queue"]["tail_mean_ms"] == pytest.approx(109.0)
    assert rows["queue"]["all_mean_ms"] == pytest.approx(10.0)
    assert rows["client"]["all_mean_ms"] == pytest.approx(1.0)  # what the server did not see
    assert rows["latency"]["tail_mean_ms"] == pytest.approx(120.0)
    assert tail_breakdown([Outcome("a.png", 0.02, None, 200, "x", None)]) == []  # no header: nothing to say


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server("checksum", tmp_path_factory.mktemp("stages"), "--workers", "1", "--server-timing")
    try:
        yield server
    finally:
        stop_and_check(server)


def _scrape(server: Server) -> str:
    return httpx.get(server.base_url + "/metrics", timeout=10).text


def test_metrics_have_every_stage_and_the_counts_move(server: Server) -> None:
    before = _scrape(server)
    assert f"# TYPE {METRIC} histogram" in before
    images = [noise_png(300 + i) for i in range(6)]

    def ask(image: bytes) -> str:
        r = httpx.post(server.base_url + "/v1/chat/completions", json=image_request("checksum", image), timeout=60)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(ask, images))
    for image, answer in zip(images, answers):
        assert expected_checksum(image) in answer
    after = _scrape(server)
    rows = {row["stage"]: row for row in stage_breakdown(before, after)}
    assert sorted(rows) == sorted(STAGE_NAMES)
    for name, row in rows.items():
        assert row["count"] == len(images), name
        assert row["mean_ms"] >= 0 and row["p50_ms"] is not None and row["p99_ms"] is not None, name
    # Plausible: the worker's stages of a request happen inside the request, so their means add up to
    # no more than the mean request duration the frontends measured.
    total = _sum(after, "shmgate_request_duration_seconds_sum") - _sum(before, "shmgate_request_duration_seconds_sum")
    inside = sum(rows[name]["mean_ms"] for name in ("queue", "batch_wait", "device_copy", "compute"))
    assert inside <= total / len(images) * 1000 + 1.0  # 1 ms: the histograms' sums are kept in whole µs
    assert rows["first_output"]["mean_ms"] <= rows["compute"]["mean_ms"]


def test_server_timing_header_names_each_stage_of_one_request(server: Server) -> None:
    """--server-timing: a non-streamed answer says where its own time went; a streamed one cannot (headers first)."""
    r = httpx.post(server.base_url + "/v1/chat/completions", json=image_request("checksum", noise_png(350)), timeout=60)
    assert r.status_code == 200, r.text
    spent = parse_server_timing(r.headers["server-timing"])
    assert set(spent) == set(STAGE_NAMES) | {"total"}
    assert all(value >= 0 for value in spent.values())
    inside = sum(
        spent[name] for name in ("body_read", "preprocess", "queue", "batch_wait", "device_copy", "compute", "delivery")
    )
    assert inside <= spent["total"] + 0.1  # each figure is rounded to 0.01 ms
    streamed = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={**image_request("checksum", noise_png(351)), "stream": True},
        timeout=60,
    )
    assert streamed.status_code == 200 and "server-timing" not in streamed.headers


def _sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))


def test_bench_prints_the_stage_breakdown_of_its_run(server: Server, tmp_path: Path) -> None:
    import argparse
    import asyncio

    from shmgate.bench_client import loadgen

    (tmp_path / "a.png").write_bytes(noise_png(400))
    parser = argparse.ArgumentParser()
    loadgen.add_arguments(parser)
    args = parser.parse_args(
        [
            "--base-url",
            server.base_url,
            "--model",
            "checksum",
            "--images",
            str(tmp_path),
            "-c",
            "2",
            "-n",
            "6",
            "--unique",
        ]
    )
    result = asyncio.run(loadgen.run(args))
    assert result["errors"] == 0
    assert {row["stage"] for row in result["stages"]} == set(STAGE_NAMES)
    assert all(row["count"] == 6 for row in result["stages"])  # this run's requests only, not the warm-up
    assert result["workers_busy"] is not None and 0 <= result["workers_busy"]  # one worker: at most ~1
    report = loadgen.format_report(result)
    assert all(f"  {name} " in report for name in STAGE_NAMES)
