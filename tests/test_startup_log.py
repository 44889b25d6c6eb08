"""What a real ``shmgate serve`` tells its operator: a summary before any child starts, "listening on"
once the frontends are up and "ready in N.N s" once /ready is true (never before), an access log and a
statistics line when asked for, and which version answers (/version, shmgate_build_info)."""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.serving import Server, image_request, noise_png, start_server, stop_and_check, wait_until

VERSION = importlib.metadata.version("shmgate")


@pytest.fixture
def checksum_server(shared_checksum_server: Server) -> Server:
    """The checksum server this file shares with the others of its group (tests/conftest.py): what these tests
    read is the start of its log (the summary, the first lines of each kind) and the absence of access-log
    lines, which no file of the group switches on."""
    return shared_checksum_server


def _lines(server: Server) -> list[str]:
    return server.log_path.read_text().splitlines()


def _index(lines: list[str], pattern: str) -> int:
    found = [i for i, line in enumerate(lines) if re.search(pattern, line)]
    assert found, f"no line matches {pattern!r}:\n" + "\n".join(lines[-40:])
    return found[0]


@pytest.fixture(scope="module")
def logged_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One frontend and one worker (the singular forms), access log and a statistics line every 0.5 s.
    Small queues: message-queue memory is a per-user limit shared with every other test running."""
    server = start_server(
        "checksum",
        tmp_path_factory.mktemp("serve"),
        "--frontends",
        "1",
        "--workers",
        "1",
        "--queue-depth",
        "2",
        "--access-log",
        "--log-stats-interval-s",
        "0.5",
    )
    try:
        yield server
    finally:
        stop_and_check(server)


def test_the_summary_comes_before_any_child_and_says_what_a_client_needs(checksum_server: Server) -> None:
    lines = _lines(checksum_server)
    summary = _index(lines, rf"shmgate {re.escape(VERSION)}: instance [0-9a-f]{{16}} \(label 'default'\) starting")
    assert summary < _index(lines, r"started (frontend|worker) ")
    body = "\n".join(lines[summary : summary + 6])
    assert 'clients send "model": "checksum"' in body
    assert "2 frontends, 2 workers on cpu, 1 torch thread each" in body
    assert re.search(r"arena +128 MiB in /dev/shm \([0-9.]+ [KMG]iB free before it\)", body), body
    assert "auth      off" in body
    assert f"url       {checksum_server.base_url} (OpenAI base URL {checksum_server.base_url}/v1)" in body


def test_ready_in_is_logged_when_ready_is_true_and_listening_not_before_the_children(checksum_server: Server) -> None:
    wait_until(
        lambda: any(re.search(r"ready in \d+\.\d s: ", line) for line in _lines(checksum_server)), 10, "the ready line"
    )
    lines = _lines(checksum_server)
    listening = _index(lines, rf"listening on {re.escape(checksum_server.base_url)} with 2 frontends$")
    assert listening > _index(lines, r"started worker process 1 ")
    ready = _index(lines, rf"ready in \d+\.\d s: {re.escape(checksum_server.base_url)}/v1 is serving")
    assert ready > listening
    assert ready > _index(lines, r"ready in worker slot \d+"), "ready means a worker serves, as /ready says"
    assert httpx.get(checksum_server.base_url + "/ready", timeout=5).status_code == 200


def test_one_frontend_and_one_worker_are_counted_in_the_singular(logged_server: Server) -> None:
    wait_until(lambda: any("listening on" in line for line in _lines(logged_server)), 10, "the listening line")
    text = logged_server.log_path.read_text()
    assert "1 frontend, 1 worker on cpu" in text and "with 1 frontend\n" in text
    assert "1 frontends" not in text and "1 workers" not in text


def test_the_access_log_has_a_line_per_request_when_asked(logged_server: Server, checksum_server: Server) -> None:
    response = httpx.get(logged_server.base_url + "/v1/models", timeout=10)
    assert response.status_code == 200
    wait_until(
        lambda: re.search(r'"GET /v1/models HTTP/1.1" 200', logged_server.log_path.read_text()) is not None,
        10,
        "the access log line",
    )
    httpx.get(checksum_server.base_url + "/v1/models", timeout=10)
    assert "/v1/models HTTP/1.1" not in checksum_server.log_path.read_text(), "off by default"


def test_the_statistics_line_counts_what_was_served(logged_server: Server) -> None:
    for seed in range(3):
        answer = httpx.post(
            logged_server.base_url + "/v1/chat/completions", json=image_request("checksum", noise_png(seed)), timeout=30
        )
        assert answer.status_code == 200, answer.text
    httpx.post(logged_server.base_url + "/v1/chat/completions", json={"model": "nope", "messages": []}, timeout=10)
    pattern = re.compile(
        r"stats: [0-9.]+ req/s, (\d+) ok, (\d+) errors in the last [0-9.]+ s; \d+ in flight, "
        r"\d+ queued, arena .+ of 128 MiB used, 1 worker ready"
    )

    def counted() -> bool:
        seen = [tuple(map(int, m.groups())) for m in pattern.finditer(logged_server.log_path.read_text())]
        return sum(ok for ok, _ in seen) >= 3 and sum(errors for _, errors in seen) >= 1

    wait_until(counted, 10, "the statistics lines adding up to what was served")


def test_version_route_and_build_info_metric_name_the_installed_version(checksum_server: Server) -> None:
    assert httpx.get(checksum_server.base_url + "/version", timeout=10).json() == {"version": VERSION}
    metrics = httpx.get(checksum_server.base_url + "/metrics", timeout=10).text
    assert f'shmgate_build_info{{version="{VERSION}"}} 1.0' in metrics


def test_serve_prints_no_summary_for_a_configuration_it_refuses(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "shmgate.gateway", "serve", "--arena-size", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "starting" not in done.stderr and "listening on" not in done.stderr
