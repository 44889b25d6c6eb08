"""The OpenAI Batch API against a real ``shmgate serve``: the client's whole flow, lines that fail alone, and
a SIGKILL of the whole server mid-batch that loses and duplicates nothing after a restart on the same directory.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.serving import (
    Server,
    data_url,
    expected_checksum,
    free_port,
    image_request,
    noise_png,
    stop_and_check,
    wait_until,
)

HANG_S = 120.0
KEY = "batch-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _start(tmp: Path, batch_dir: Path, *extra: str) -> Server:
    """A checksum server in its own process group (so a test can SIGKILL all of it) on ``batch_dir``."""
    port = free_port()
    log_path = tmp / f"serve-{port}.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "shmgate.gateway", "serve", "--port", str(port), "--model", "checksum"]
        + ["--frontends", "2", "--arena-size", "64MiB", "--batch-dir", str(batch_dir), *extra],
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = Server(process, port, "checksum", log_path)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


# Every line takes its own 60 ms model pass, two in flight: slow enough to kill the server mid-batch and to
# watch several batches share the runner, fast enough for the module's other batches (a few lines each).
SLOW = ("--workers", "1", "--max-batch-size", "1", "--diag-batch-delay-ms", "60", "--batch-max-in-flight", "2")
KILLED_IDS = [f"k-{i}" for i in range(40)]


@dataclass
class Restarted:
    """The module's server: started on a batch directory where a server was SIGKILLed mid-batch."""

    server: Server
    killed_batch: str  # the batch that was running when the first server died


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Restarted]:
    """A server SIGKILLed (supervisor, frontends and workers at once) a few lines into a batch, then a new one on
    the same directory: it finishes that batch, and serves every other test of the module."""
    tmp = tmp_path_factory.mktemp("batch")
    batch_dir = tmp / "batches"
    server = _start(tmp, batch_dir, *SLOW, "--api-key", KEY)
    try:
        client = _client(server)
        uploaded = client.files.create(
            file=("k.jsonl", io.BytesIO(_jsonl([_line(c, 300 + i) for i, c in enumerate(KILLED_IDS)]))),
            purpose="batch",
        )
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

        def some_done() -> bool:
            counts = client.batches.retrieve(batch.id).request_counts
            return counts is not None and counts.completed >= 5

        wait_until(some_done, HANG_S, "a few lines done")
    finally:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait()
    server = _start(tmp, batch_dir, *SLOW, "--api-key", KEY)
    try:
        yield Restarted(server, batch.id)
    finally:
        stop_and_check(server)


@pytest.fixture(scope="module")
def batch_server(restarted: Restarted) -> Server:
    return restarted.server


def _line(custom_id: str, seed: int) -> dict[str, object]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": image_request("checksum", noise_png(seed, 24)),
    }


def _jsonl(lines: list[dict[str, object]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _client(server: Server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)


def _wait_done(client: openai.OpenAI, batch_id: str) -> openai.types.Batch:
    done = ("completed", "failed", "expired", "cancelled")
    wait_until(lambda: client.batches.retrieve(batch_id).status in done, HANG_S, f"batch {batch_id} to end")
    return client.batches.retrieve(batch_id)


def test_the_openai_client_runs_a_batch_end_to_end(batch_server: Server) -> None:
    client = _client(batch_server)
    lines = [_line(f"req-{i}", i) for i in range(6)]
    lines[3] = {**lines[3], "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}}
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "e2e"},
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "e2e"}
    batch = _wait_done(client, batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (6, 5, 1)
    assert batch.output_file_id and batch.error_file_id
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == ["req-0", "req-1", "req-2", "req-4", "req-5"]
    for o in output:
        seed = int(o["custom_id"].split("-")[1])
        assert o["response"]["status_code"] == 200 and o["error"] is None
        content = o["response"]["body"]["choices"][0]["message"]["content"]
        assert expected_checksum(noise_png(seed, 24)) in content
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in errors] == ["req-3"]  # the invalid line failed alone
    assert errors[0]["response"]["status_code"] == 404
    assert errors[0]["response"]["body"]["error"]["code"] == "model_not_found"

    assert batch_server.metric('shmgate_batch_lines_done_total{model="checksum"}') >= 5
    assert batch_server.metric('shmgate_batch_lines_failed_total{model="other"}') >= 1  # the unknown model's line
    listed = client.batches.list(limit=100)
    assert batch.id in [b.id for b in listed.data]
    assert uploaded.id in [f.id for f in client.files.list().data]
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_a_batch_of_responses_runs_through_the_responses_api(batch_server: Server) -> None:
    client = _client(batch_server)
    images = [noise_png(40 + i, 24) for i in range(2)]
    lines = [
        {
            "custom_id": f"resp-{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": "checksum",
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": data_url(image, "image/png")}]}
                ],
            },
        }
        for i, image in enumerate(images)
    ]
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h")
    batch = _wait_done(client, batch.id)
    assert batch.status == "completed" and batch.output_file_id, batch
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in output] == ["resp-0", "resp-1"]
    for o, image in zip(output, images):
        body = o["response"]["body"]
        assert body["object"] == "response" and body["status"] == "completed"
        assert expected_checksum(image) in body["output"][0]["content"][0]["text"]


def test_a_cancelled_batch_ends_cancelled_and_list_pages(batch_server: Server) -> None:
    client = _client(batch_server)
    uploaded = client.files.create(
        file=("c.jsonl", io.BytesIO(_jsonl([_line(f"c-{i}", 100 + i) for i in range(200)]))), purpose="batch"
    )
    first = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    second = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert client.batches.cancel(second.id).status in ("cancelling", "cancelled")
    client.batches.cancel(first.id)
    for batch in (first, second):
        cancelled = _wait_done(client, batch.id)
        assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
        assert cancelled.request_counts is not None and cancelled.request_counts.completed < 200
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more
    after = client.batches.list(limit=1, after=second.id)
    assert [b.id for b in after.data] == [first.id]


def test_files_list_pages_with_first_and_last_ids(batch_server: Server) -> None:
    client = _client(batch_server)
    # the module's earlier batches end first: a batch that finishes writes its output and error files, which
    # would land between this test's listings (the server is shared by the file's tests)
    for batch in client.batches.list(limit=100).data:
        _wait_done(client, batch.id)
    made = {client.files.create(file=(f"p{i}.jsonl", io.BytesIO(b"{}\n")), purpose="batch").id for i in range(3)}
    every = client.files.list().data
    assert made <= {f.id for f in every}
    raw = httpx.get(batch_server.base_url + "/v1/files?limit=2", headers=AUTH, timeout=10).json()
    assert [f["id"] for f in raw["data"]] == [f.id for f in every[:2]]
    assert (raw["first_id"], raw["last_id"], raw["has_more"]) == (every[0].id, every[1].id, len(every) > 2)
    rest = client.files.list(limit=100, after=raw["last_id"])
    assert [f.id for f in rest.data] == [f.id for f in every[2:]] and not rest.has_more
    oldest = client.files.list(order="asc", limit=1)
    assert [f.id for f in oldest.data] == [every[-1].id]
    paged = [f.id for f in client.files.list(limit=1)]  # the SDK follows after=last_id while has_more
    assert paged == [f.id for f in every]
    for bad in ("limit=0", "order=sideways", "after=file-nope"):
        reply = httpx.get(batch_server.base_url + "/v1/files?" + bad, headers=AUTH, timeout=10)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == bad.split("=")[0]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\nnot json\n', "line 2"),
        (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n',
            "line 2: custom_id 'a' is not unique",
        ),
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}\n', "line 1: url"),
        (b'{"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}\n', "line 1: method"),
    ],
)
def test_an_invalid_input_file_is_refused_at_create_with_its_line(
    batch_server: Server, content: bytes, needle: str
) -> None:
    client = _client(batch_server)
    uploaded = client.files.create(file=("bad.jsonl", io.BytesIO(content)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert needle in str(refused.value)


def test_the_api_key_guards_every_batch_route(batch_server: Server) -> None:
    wrong = _client(batch_server, key="wrong")
    with pytest.raises(openai.AuthenticationError):
        wrong.files.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.batches.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    with pytest.raises(openai.AuthenticationError):
        wrong.batches.create(input_file_id="file-x", endpoint="/v1/chat/completions", completion_window="24h")


def test_bad_calls_get_openai_errors(batch_server: Server) -> None:
    base = batch_server.base_url
    assert httpx.get(base + "/v1/batches/batch-nope", headers=AUTH, timeout=10).status_code == 404
    assert httpx.get(base + "/v1/files/file-nope/content", headers=AUTH, timeout=10).status_code == 404
    reply = httpx.post(
        base + "/v1/files", files={"file": ("x", b"{}")}, data={"purpose": "fine-tune"}, headers=AUTH, timeout=10
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "purpose"
    reply = httpx.post(
        base + "/v1/batches",
        json={"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        headers=AUTH,
        timeout=10,
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input_file_id"
    assert httpx.get(base + "/v1/batches?limit=0", headers=AUTH, timeout=10).status_code == 400


def test_a_sigkill_mid_batch_and_a_restart_lose_and_duplicate_nothing(restarted: Restarted) -> None:
    client = _client(restarted.server)
    done = _wait_done(client, restarted.killed_batch)
    assert done.status == "completed" and done.output_file_id
    assert done.request_counts is not None and done.request_counts.completed == len(KILLED_IDS)
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(KILLED_IDS)  # each once: none lost, none twice


def test_batches_run_side_by_side_and_cancelling_one_leaves_the_others_running(restarted: Restarted) -> None:
    """The runner takes a line of each unfinished batch in turn: a batch created just after another is not
    queued behind all of its lines; a cancelled one stops without holding the others up."""
    client = _client(restarted.server)
    _wait_done(client, restarted.killed_batch)  # the restart's own batch first: it would share the runner too
    n = 30
    files = [
        client.files.create(
            file=(f"{name}.jsonl", io.BytesIO(_jsonl([_line(f"{name}-{i}", seed + i) for i in range(n)]))),
            purpose="batch",
        )
        for name, seed in (("a", 2000), ("b", 3000), ("c", 4000))
    ]
    a, b, c = (
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        for f in files
    )

    def done(batch_id: str) -> int:
        counts = client.batches.retrieve(batch_id).request_counts
        return 0 if counts is None else counts.completed + counts.failed

    wait_until(lambda: done(b.id) > 0, HANG_S, "batch b under way")
    client.batches.cancel(b.id)
    seen: list[tuple[int, int]] = []

    def one_finished() -> bool:
        seen.append((done(a.id), done(c.id)))
        return max(seen[-1]) >= n

    wait_until(one_finished, HANG_S, "batch a or c done")
    assert min(seen[-1]) >= 5, seen  # one after another, the other would not have started
    assert _wait_done(client, b.id).status == "cancelled"
    for batch in (a, c):
        finished = _wait_done(client, batch.id)
        assert finished.status == "completed" and finished.request_counts is not None
        assert finished.request_counts.completed == n
