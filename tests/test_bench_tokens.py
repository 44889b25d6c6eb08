"""`shmgate bench` against a generative model: a tiny Qwen2-VL served by a real ``shmgate serve --model hf:<dir>``.

The report must add what a token generator is judged by (output tokens/s from ``usage``, and with
``--stream`` TTFT, TPOT and ITL); the values are timings, so only their presence and sanity are checked.
"""

from __future__ import annotations

import json
import re

import pytest

from shmgate.bench_client import loadgen
from tests.serving import IMAGES, Server


@pytest.fixture
def hf_server(tiny_qwen2_vl_server: Server) -> Server:
    """The tiny Qwen2-VL server this file shares with the others of its group (tests/conftest.py)."""
    return tiny_qwen2_vl_server


def _bench(server: Server, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    # One at a time: batches of one, so greedy answers for an image agree bit for bit (no mismatches)
    code = loadgen.main(
        [
            "--base-url",
            server.base_url + "/v1",
            "--images",
            str(IMAGES),
            "-c",
            "1",
            "-n",
            "4",
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            *extra,
        ]
    )
    return code, capsys.readouterr().out


def test_a_streamed_run_reports_tokens_per_second_ttft_tpot_and_itl(
    hf_server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = _bench(hf_server, capsys, "--stream")
    assert code == 0, report
    assert report.startswith(f"shmgate bench  {hf_server.base_url}  model tiny-qwen2-vl  (chat, streamed)")
    tokens = re.search(r"^tokens +(\d+) output tokens, ([\d.]+) tokens/s", report, re.MULTILINE)
    assert tokens and int(tokens[1]) > 0 and float(tokens[2]) > 0, report
    for name in ("ttft", "tpot", "itl"):
        line = re.search(rf"^{name} ms +p50 ([\d.]+)  p90 ([\d.]+)  p99 ([\d.]+)", report, re.MULTILINE)
        assert line, f"no {name} line in:\n{report}"
        assert 0 <= float(line[1]) <= float(line[2]) <= float(line[3])
    assert "errors       0" in report and "mismatches   0" in report  # greedy: one answer per image


def test_a_plain_run_counts_tokens_from_usage_and_says_ttft_needs_streaming(
    hf_server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _bench(hf_server, capsys, "--json")
    result = json.loads(out)
    assert code == 0 and result["generative"] and result["errors"] == 0
    assert 4 <= result["output_tokens"] <= 4 * 6 and result["output_tokens_per_s"] > 0  # max_tokens 6 each
    assert result["tpot_p50_ms"] is None and result["itl_p50_ms"] is None  # nothing streamed: not measurable
    report = loadgen.format_report(result)
    assert "tokens/s" in report and "ttft ms      -  (ttft, tpot and itl need --stream)" in report
