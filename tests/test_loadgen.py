"""The load generator behind `shmgate bench`, driven against the naive server in checksum mode.

The naive server runs as a real subprocess on a free loopback port, so these tests cover the HTTP,
SSE and keep-alive paths the benchmarks use. The accounting functions are tested on made-up data.
Whether ``--unique`` defeats a content cache is checked against a real ``shmgate serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway import loadgen

REPO = Path(__file__).resolve().parent.parent
IMAGES = REPO / "tests" / "data" / "images"
RESULT_KEYS = {"requests_per_s", "p50_ms", "p90_ms", "p99_ms", "ttft_p50_ms", "errors", "mismatches",
               "concurrency", "requests", "model", "stream", "cpu_s_per_request"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def naive_server() -> Iterator[tuple[str, int]]:
    """(base URL, pid) of a naive checksum server; stopped (with its process group) afterwards."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, str(REPO / "bench" / "naive_server.py"), "--port", str(port),
                                "--mode", "checksum"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                output = process.stdout.read().decode(errors="replace") if process.stdout else ""
                pytest.fail(f"naive server exited early:\n{output}")
            try:
                if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("naive server did not become ready in 60 s")
            time.sleep(0.2)
        yield base_url, process.pid
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    loadgen.add_arguments(parser)
    return parser.parse_args(list(argv))


def _bench(base_url: str, *extra: str) -> dict[str, Any]:
    args = _args("--base-url", base_url, "--model", "checksum", "--concurrency", "4", "--requests", "12",
                 "--images", str(IMAGES), *extra)
    return asyncio.run(loadgen.run(args))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_bench_reports_every_key_with_no_errors_or_mismatches(naive_server: tuple[str, int], stream: bool) -> None:
    base_url, pid = naive_server
    result = _bench(base_url, "--server-pid", str(pid), *(["--stream"] if stream else []))
    assert RESULT_KEYS <= result.keys()
    assert result["errors"] == 0, result["errors_by_kind"]
    assert result["mismatches"] == 0
    assert result["requests"] == 12 and result["stream"] is stream and result["concurrency"] == 4
    assert result["distinct_answers"] == 6  # six photos, each answered identically every time
    assert result["p50_ms"] <= result["p90_ms"] <= result["p99_ms"]
    assert result["ttft_p50_ms"] is not None and result["cpu_s_per_request"] is not None


def test_unique_bytes_keep_the_pixels_and_so_the_answers(naive_server: tuple[str, int]) -> None:
    result = _bench(naive_server[0], "--unique", "--stream")
    assert result["errors"] == 0 and result["mismatches"] == 0 and result["distinct_answers"] == 6


def test_repeat_one_sends_only_the_first_image(naive_server: tuple[str, int]) -> None:
    result = _bench(naive_server[0], "--repeat-one")
    assert result["errors"] == 0 and result["distinct_answers"] == 1


def test_server_rejections_are_counted_by_status(naive_server: tuple[str, int], tmp_path: Path) -> None:
    (tmp_path / "broken.jpg").write_bytes(b"this is not a JPEG")
    args = _args("--base-url", naive_server[0], "--model", "checksum", "--concurrency", "2", "--requests", "4",
                 "--images", str(tmp_path))
    result = asyncio.run(loadgen.run(args))
    assert result["errors"] == 4 and result["errors_by_kind"] == {"400": 4}
    assert result["p50_ms"] is None  # latencies are of successful requests only


def test_main_prints_one_json_object_and_exits_zero(naive_server: tuple[str, int],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    code = loadgen.main(["--base-url", naive_server[0], "--model", "checksum", "-c", "2", "-n", "4",
                         "--images", str(IMAGES), "--json", "--warmup", "0"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["requests"] == 4 and result["warmup"] == 0


def test_unreachable_server_is_a_transport_error(tmp_path: Path) -> None:
    args = _args("--base-url", f"http://127.0.0.1:{_free_port()}", "--model", "m", "-c", "1", "-n", "2",
                 "--images", str(IMAGES), "--warmup", "0", "--timeout", "2")
    result = asyncio.run(loadgen.run(args))
    assert result["errors"] == 2 and list(result["errors_by_kind"]) == ["transport:ConnectError"]


def test_mismatches_count_answers_that_differ_from_the_first_for_that_image() -> None:
    answers = [("a.jpg", "x"), ("b.jpg", "y"), ("a.jpg", "x"), ("a.jpg", "y"), ("b.jpg", "x"), ("b.jpg", "y")]
    assert loadgen.count_mismatches(answers) == 2
    assert loadgen.count_mismatches([("a.jpg", "x")] * 5) == 0
    assert loadgen.count_mismatches([]) == 0


def test_percentile_interpolates_like_numpy() -> None:
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert loadgen.percentile(values, 50) == 3.0
    assert loadgen.percentile(values, 90) == pytest.approx(4.6)
    assert loadgen.percentile(values, 100) == 5.0
    assert loadgen.percentile([], 50) is None


def test_server_pids_accept_repeats_and_comma_lists() -> None:
    assert loadgen.parse_pids(["1", "2,3", " 4 ,"]) == [1, 2, 3, 4]


def test_tree_cpu_includes_live_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.process_time()\n"
                              "while time.process_time()-t<0.3: pass\ntime.sleep(30)"])
    try:
        time.sleep(1.0)
        assert loadgen.tree_cpu_seconds([os.getpid()]) >= time.process_time() + 0.2
    finally:
        child.kill()
        child.wait()


def test_missing_server_pid_is_refused() -> None:
    args = _args("--model", "m", "--images", str(IMAGES), "--server-pid", "999999999")
    with pytest.raises(ValueError, match="no process"):
        asyncio.run(loadgen.run(args))


@pytest.mark.parametrize("stream,max_tokens", [(False, None), (True, 7)])
def test_body_template_gives_the_bytes_json_dumps_would(stream: bool, max_tokens: int | None) -> None:
    image = loadgen.load_images(IMAGES)[0]
    template = loadgen.BodyTemplate("checksum", stream=stream, max_tokens=max_tokens)
    for nonce in (None, 12345):
        url = image.data_url(nonce)
        expected = json.dumps(loadgen.build_body("checksum", url, stream=stream, max_tokens=max_tokens)).encode()
        assert template.render(url) == expected


def test_unique_runs_never_repeat_bytes_an_earlier_run_sent(checksum_server) -> None:  # type: ignore[no-untyped-def]
    """Two --unique runs against one server: every request is a cache miss (a warmed server must not hit)."""
    def cache(kind: str) -> float:
        return checksum_server.metric(f"shmgate_cache_{kind}_total")

    hits, misses = cache("hits") + cache("remote_hits"), cache("misses")
    sent = 0
    for _ in range(2):
        result = _bench(checksum_server.base_url, "--unique")
        assert result["errors"] == 0 and result["mismatches"] == 0
        sent += result["requests"] + result["warmup"]
    assert cache("misses") - misses == sent
    assert cache("hits") + cache("remote_hits") == hits


def test_arrival_schedule_is_seeded_ordered_and_bounded() -> None:
    """--rate: the same seed gives the same Poisson schedule; it has exactly N increasing times."""
    first = loadgen.arrival_times(50.0, 200, seed=7)
    assert first == loadgen.arrival_times(50.0, 200, seed=7)
    assert first != loadgen.arrival_times(50.0, 200, seed=8)
    assert len(first) == 200 and all(a < b for a, b in zip(first, first[1:])) and first[0] > 0
    # exponential gaps of mean 1/rate: over many arrivals the mean gap is close to it (statistics, not timing)
    many = loadgen.arrival_times(50.0, 20_000, seed=1)
    assert many[-1] / len(many) == pytest.approx(1 / 50.0, rel=0.05)
    with pytest.raises(ValueError, match="rate"):
        loadgen.arrival_times(0.0, 10, seed=1)


def test_open_loop_sends_every_request_and_reports_the_offered_rate(naive_server: tuple[str, int]) -> None:
    result = _bench(naive_server[0], "--rate", "200", "--seed", "3", "--unique")
    assert result["offered_rate"] == 200.0
    assert result["requests"] == 12 and result["errors"] == 0 and result["mismatches"] == 0
    assert result["stages"] == []  # the naive server has no /metrics: no breakdown, no failure
    assert "open loop 200.0 req/s offered" in loadgen.format_report(result)
