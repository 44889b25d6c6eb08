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

from shmgate.bench_client import loadgen
from shmgate.shared.rawhttp import RawClient
from tests.serving import Server


@pytest.fixture
def checksum_server(shared_checksum_server: Server) -> Server:
    """The checksum server this file shares with the others of its group (tests/conftest.py)."""
    return shared_checksum_server


REPO = Path(__file__).resolve().parent.parent
IMAGES = REPO / "tests" / "data" / "images"
RESULT_KEYS = {
    "requests_per_s",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "ttft_p50_ms",
    "errors",
    "mismatches",
    "concurrency",
    "requests",
    "model",
    "stream",
    "cpu_s_per_request",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def naive_server() -> Iterator[tuple[str, int]]:
    """(base URL, pid) of a naive checksum server; stopped (with its process group) afterwards."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "naive_server.py"), "--port", str(port), "--mode", "checksum"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
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
    args = _args(
        "--base-url",
        base_url,
        "--model",
        "checksum",
        "--concurrency",
        "4",
        "--requests",
        "12",
        "--images",
        str(IMAGES),
        *extra,
    )
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


def test_server_rejections_are_counted_by_status_and_code_and_not_as_throughput(
    naive_server: tuple[str, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken.jpg").write_bytes(b"this is not a JPEG")
    argv = [
        "--base-url",
        naive_server[0],
        "--model",
        "checksum",
        "--concurrency",
        "2",
        "--requests",
        "4",
        "--images",
        str(tmp_path),
        "--warmup",
        "0",
    ]
    result = asyncio.run(loadgen.run(_args(*argv)))
    assert result["errors"] == 4 and result["errors_by_kind"] == {"400 invalid_request": 4}
    assert result["p50_ms"] is None  # latencies are of successful requests only
    assert result["requests_per_s"] == 0  # and so is throughput
    assert result["first_error"].startswith("400 ") and '"code":"invalid_request"' in result["first_error"]

    assert loadgen.main(argv) == 1
    report = capsys.readouterr().out
    assert "errors       4 (400 invalid_request: 4)" in report and "first error  400 {" in report
    assert loadgen.main([*argv, "--allow-errors"]) == 0


def test_a_warm_up_the_server_refuses_stops_the_run(naive_server: tuple[str, int], tmp_path: Path) -> None:
    (tmp_path / "broken.jpg").write_bytes(b"this is not a JPEG")
    args = _args("--base-url", naive_server[0], "--model", "checksum", "-c", "2", "-n", "4", "--images", str(tmp_path))
    with pytest.raises(loadgen.BenchAborted, match=r"2 of 2 warm-up requests failed: 400 invalid_request: 2"):
        asyncio.run(loadgen.run(args))


def test_no_server_exits_1_at_the_warm_up_saying_nothing_listens(capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    code = loadgen.main(
        ["--base-url", f"http://127.0.0.1:{port}", "--model", "m", "-c", "2", "-n", "50", "--images", str(IMAGES)]
    )
    out, err = capsys.readouterr()
    assert code == 1 and out == ""  # no report, so no throughput of failures
    assert f"http://127.0.0.1:{port}/v1/chat/completions" in err
    assert f"nothing listening on 127.0.0.1:{port} (connection refused)" in err


def test_no_server_and_no_model_says_the_model_list_is_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    code = loadgen.main(["--base-url", f"http://127.0.0.1:{port}/v1", "-n", "5", "--images", str(IMAGES)])
    err = capsys.readouterr().err
    assert code == 1
    assert f"cannot list the served models at http://127.0.0.1:{port}/v1/models" in err and "nothing listening" in err


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
def test_a_base_url_ending_in_v1_is_the_same_server(naive_server: tuple[str, int], suffix: str) -> None:
    result = _bench(naive_server[0] + suffix)
    assert result["errors"] == 0 and result["requests"] == 12, result["errors_by_kind"]
    assert result["base_url"] == naive_server[0]


def test_without_model_the_first_listed_one_is_benched(
    naive_server: tuple[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    code = loadgen.main(["--base-url", naive_server[0], "-c", "3", "-n", "7", "--images", str(IMAGES)])
    report = capsys.readouterr().out
    header, load = report.splitlines()[:2]
    assert code == 0
    assert header.startswith(f"shmgate bench  {naive_server[0]}  model checksum  (chat)")
    assert load.startswith("load         concurrency 3  requests 7 (+3 warm-up)")
    assert "tokens/s" not in report and "tpot" not in report  # not a generative model: no token lines


def test_main_prints_one_json_object_and_exits_zero(
    naive_server: tuple[str, int], capsys: pytest.CaptureFixture[str]
) -> None:
    code = loadgen.main(
        [
            "--base-url",
            naive_server[0],
            "--model",
            "checksum",
            "-c",
            "2",
            "-n",
            "4",
            "--images",
            str(IMAGES),
            "--json",
            "--warmup",
            "0",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["requests"] == 4 and result["warmup"] == 0


def test_unreachable_server_without_warm_up_is_a_transport_error_per_request(tmp_path: Path) -> None:
    args = _args(
        "--base-url",
        f"http://127.0.0.1:{_free_port()}",
        "--model",
        "m",
        "-c",
        "1",
        "-n",
        "2",
        "--images",
        str(IMAGES),
        "--warmup",
        "0",
        "--timeout",
        "2",
    )
    result = asyncio.run(loadgen.run(args))
    assert result["errors"] == 2 and list(result["errors_by_kind"]) == ["transport:ConnectError"]
    assert "nothing listening on 127.0.0.1" in result["first_error"]


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
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass\ntime.sleep(30)",
        ]
    )
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


def test_a_wrong_model_shows_the_servers_404_and_exits_1(
    checksum_server,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = loadgen.main(
        [
            "--base-url",
            checksum_server.base_url,
            "--model",
            "no-such-model",
            "-c",
            "2",
            "-n",
            "20",
            "--images",
            str(IMAGES),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert f"{checksum_server.base_url}/v1/chat/completions with model 'no-such-model'" in err
    assert "(the server serves 'checksum')" in err
    assert '404 {"error":{"message":"model \'no-such-model\' is not served here' in err
    assert "2 of 2 warm-up requests failed: 404 model_not_found: 2" in err


def test_a_run_reports_the_servers_cache_hits_and_misses(
    checksum_server,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Six photos, 2 + 12 requests: the second round of the six repeats bytes the server has cached."""
    code = loadgen.main(
        ["--base-url", checksum_server.base_url + "/v1", "-c", "2", "-n", "12", "--images", str(IMAGES), "--json"]
    )
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["errors"] == 0 and result["mismatches"] == 0
    assert result["model"] == "checksum" and result["distinct_images"] == 6
    cache = result["cache"]
    assert cache["hits"] + cache["remote_hits"] + cache["misses"] == 12  # one image lookup per timed request
    assert cache["hits"] + cache["remote_hits"] >= 6 and 0.5 <= cache["hit_ratio"] <= 1
    report = loadgen.format_report(result)
    assert "images       6 distinct of 14 sent: all but the first 6 repeat bytes" in report
    assert f"cache        hit ratio {cache['hit_ratio'] * 100:.1f}% this run" in report
    assert "errors       0" in report


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


def _outcome(**fields: Any) -> loadgen.Outcome:
    base: dict[str, Any] = {
        "image": "a.jpg",
        "latency_s": 1.0,
        "ttft_s": 0.2,
        "status": 200,
        "text": "x",
        "error": None,
    }
    return loadgen.Outcome(**{**base, **fields})


def test_a_warm_up_goes_on_through_overload_but_not_through_refusals_or_total_failure() -> None:
    ok, overloaded = _outcome(), _outcome(status=429, error="429 overloaded", detail="429 {}")
    refused = _outcome(status=404, error="404 model_not_found", detail="404 {...}")
    assert loadgen.warmup_failure([ok, overloaded, ok]) is None
    assert loadgen.warmup_failure([]) is None
    assert "first error: 404 {...}" in (loadgen.warmup_failure([ok, overloaded, refused]) or "")
    assert (loadgen.warmup_failure([overloaded, overloaded]) or "").startswith(
        "2 of 2 warm-up requests failed: 429 overloaded: 2"
    )


def test_tpot_and_itl_follow_vllm_bench_serve() -> None:
    """TPOT = (latency - ttft) / (tokens - 1) per request of 2+ tokens; ITL = every gap between content chunks."""
    outcomes = [
        _outcome(latency_s=1.0, ttft_s=0.2, output_tokens=5, itl_s=(0.2, 0.3, 0.3)),
        _outcome(latency_s=0.5, ttft_s=0.5, output_tokens=1),  # one token: no TPOT
        _outcome(status=503, error="503 overloaded", output_tokens=None, ttft_s=None),
    ]
    args = _args("--model", "m", "--images", str(IMAGES), "--stream")
    result = loadgen.summarize(args, outcomes, 2.0, [], 0.0, None)
    assert result["tpot_p50_ms"] == pytest.approx(200.0) and result["tpot_p99_ms"] == pytest.approx(200.0)
    assert result["itl_p50_ms"] == pytest.approx(300.0) and result["itl_p90_ms"] == pytest.approx(300.0)
    assert result["output_tokens"] == 6 and result["output_tokens_per_s"] == pytest.approx(3.0)
    assert result["requests_per_s"] == pytest.approx(1.0)  # two of three succeeded, in 2 s
    assert result["errors_by_kind"] == {"503 overloaded": 1}


@pytest.mark.parametrize("embeddings", [False, True], ids=["classifier", "embeddings"])
def test_a_ttft_line_only_where_a_first_token_means_something(embeddings: bool) -> None:
    args = _args("--model", "m", "--images", str(IMAGES), *(["--embeddings"] if embeddings else []))
    result = loadgen.summarize(args, [_outcome(output_tokens=3)], 1.0, [], 0.0, None)
    result["other_load_cores"] = None
    report = loadgen.format_report(result)
    assert ("ttft ms" in report) is not embeddings
    assert "tokens/s" not in report and "tpot" not in report


def _sse_reply(*events: str) -> bytes:
    body = "".join(f"{event}\n\n" for event in events).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def _stream_once(reply: bytes) -> loadgen.Outcome:
    """One streamed request to a loopback server that answers ``reply`` (made-up SSE, real sockets)."""

    async def main() -> loadgen.Outcome:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
            writer.write(reply)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = RawClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            return await loadgen.send_one(client, b"{}", "a.jpg", stream=True)
        finally:
            await client.aclose()
            server.close()

    return asyncio.run(main())


def test_a_stream_gives_ttft_chunk_gaps_and_the_usage_token_count() -> None:
    outcome = _stream_once(
        _sse_reply(
            'data: {"choices":[{"delta":{"role":"assistant"}}]}',
            'data: {"choices":[{"delta":{"content":"a"}}]}',
            'data: {"choices":[{"delta":{"content":"b c"}}]}',
            'data: {"choices":[],"usage":{"completion_tokens":3}}',
            "data: [DONE]",
        )
    )
    assert outcome.error is None and outcome.text == "ab c" and outcome.output_tokens == 3
    assert outcome.ttft_s is not None and len(outcome.itl_s) == 1  # two content chunks: one gap


def test_an_error_event_mid_stream_is_a_failure_named_by_its_code() -> None:
    outcome = _stream_once(
        _sse_reply(
            'data: {"choices":[{"delta":{"content":"a"}}]}',
            'event: error\ndata: {"error":{"message":"the worker died","type":"server_error","param":null,'
            '"code":"worker_died"}}',
        )
    )
    assert outcome.error == "stream worker_died" and "the worker died" in (outcome.detail or "")


def test_shmgate_bench_runs_the_load_generator_from_the_command_line(naive_server: tuple[str, int]) -> None:
    """``shmgate bench`` (here ``python -m shmgate.gateway bench``) is node/cli.py handing over to bench_client."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmgate.gateway",
            "bench",
            "--base-url",
            naive_server[0],
            "--model",
            "checksum",
            "-c",
            "2",
            "-n",
            "4",
            "--images",
            str(IMAGES),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["requests"] == 4 and result["errors"] == 0 and result["mismatches"] == 0
