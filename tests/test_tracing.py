"""OpenTelemetry tracing (--otlp-traces-endpoint): one trace per request, across the shared-memory hop.

A real ``shmgate serve`` (checksum model) exports over OTLP/HTTP to a receiver this module runs on
127.0.0.1; the receiver decodes the protobuf with opentelemetry-proto (it comes with the exporter),
so what is asserted is what a collector would get.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest

from tests.image_host import ImageHost, Route, serve_images
from tests.serving import (
    IMAGES,
    Server,
    expected_checksum,
    image_request,
    noise_png,
    start_server,
    stop_and_check,
    wait_until,
)

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

# Export every 50 ms instead of every 5 s, so the spans of a request arrive while the test waits.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50", "OTEL_SERVICE_NAME": "shmgate-test"}


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    attributes: dict[str, Any]
    links: list[tuple[str, str]]  # (trace id, span id)
    status: int  # 0 unset, 1 ok, 2 error
    start_ns: int
    end_ns: int
    resource: dict[str, Any]
    events: list[str]
    trace_state: str


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class Collector:
    """A tiny OTLP/HTTP trace receiver: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                request = trace_service.ExportTraceServiceRequest()
                request.ParseFromString(body)
                collector.add(request)
                reply = trace_service.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, request: Any) -> None:
        spans = []
        for rs in request.resource_spans:
            resource = _attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        Span(
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.name,
                            _attributes(s.attributes),
                            [(k.trace_id.hex(), k.span_id.hex()) for k in s.links],
                            s.status.code,
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            resource,
                            [e.name for e in s.events],
                            s.trace_state,
                        )
                    )
        with self.lock:
            self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    c = Collector()
    try:
        yield c
    finally:
        c.close()


def _serve_traced(tmp_dir: Path, endpoint: str, *extra: str) -> Server:
    with mock.patch.dict(os.environ, FAST_EXPORT):
        return start_server(
            "checksum",
            tmp_dir,
            "--workers",
            "1",
            "--max-batch-size",
            "8",
            "--access-log",
            "--otlp-traces-endpoint",
            endpoint,
            *extra,
        )


@pytest.fixture(scope="module")
def image_host() -> Iterator[ImageHost]:
    with serve_images() as host:
        host.routes["/photo.jpg"] = Route(
            body=(IMAGES / "camera_640.jpg").read_bytes(), headers={"Content-Type": "image/jpeg"}
        )
        yield host


@pytest.fixture(scope="module")
def traced_server(
    collector: Collector, image_host: ImageHost, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    server = _serve_traced(
        tmp_path_factory.mktemp("traced"), collector.url, "--allow-image-urls", "--image-url-allowlist", "127.0.0.1"
    )
    try:
        yield server
    finally:
        stop_and_check(server)


def _traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


def _new_ids(seed: int) -> tuple[str, str]:
    return f"{0x5EED0000 + seed:032x}", f"{0xC0FFEE00 + seed:016x}"


def _post(server: Server, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=60)


def _wait_for(collector: Collector, trace_id: str, names: set[str]) -> list[Span]:
    wait_until(lambda: names <= {s.name for s in collector.trace(trace_id)}, 30, f"spans {sorted(names)}")
    return collector.trace(trace_id)


def _one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {len(found)} spans in {[s.name for s in spans]}"
    return found[0]


WORKER_SPANS = {"batch_wait", "device_copy", "compute"}
FRONTEND_SPANS = {
    "POST /v1/chat/completions",
    "body_read",
    "preprocess image",
    "preprocess",
    "attempt",
    "queue",
    "delivery",
}


def test_a_broken_collector_never_fails_or_holds_a_request(tmp_path_factory: pytest.TempPathFactory) -> None:
    """First in the module: its server runs before the module's traced server starts (one server at a time
    keeps within the machine's message-queue budget)."""
    # A collector that accepts connections and never answers (each export waits out its timeout), then
    # none at all (connections refused).
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    server = _serve_traced(tmp_path_factory.mktemp("broken"), f"http://127.0.0.1:{silent.getsockname()[1]}")
    try:
        for k in range(12):
            if k == 6:
                silent.close()
            started = time.monotonic()
            response = _post(server, image_request("checksum", noise_png(200 + k)))
            assert response.status_code == 200, response.text
            # bounded, not timed: an exporter stuck on the collector (3 s per export) must not be in the way
            assert time.monotonic() - started < 10
            time.sleep(0.06)  # an export interval: each request's spans go out while the next one runs
    finally:
        stop_and_check(server)
        silent.close()


def test_a_request_with_a_traceparent_is_one_trace_across_frontend_and_worker(
    traced_server: Server, collector: Collector
) -> None:
    trace_id, caller_span = _new_ids(1)
    image = noise_png(101)
    response = _post(
        traced_server,
        image_request("checksum", image),
        {"traceparent": _traceparent(trace_id, caller_span), "tracestate": "vendor=kept"},
    )
    assert response.status_code == 200, response.text
    spans = _wait_for(collector, trace_id, FRONTEND_SPANS | WORKER_SPANS)

    server = _one(spans, "POST /v1/chat/completions")
    assert server.parent_id == caller_span  # the caller's span is the parent: shmgate sits inside its trace
    assert server.trace_state == "vendor=kept"  # and its tracestate goes on with it
    assert server.attributes["http.response.status_code"] == 200
    for name in ("body_read", "preprocess image", "preprocess", "attempt", "delivery"):
        assert _one(spans, name).parent_id == server.span_id, name
    image_span = _one(spans, "preprocess image")
    assert _one(spans, "preprocess").attributes["shmgate.arena_bytes"] > 0
    assert image_span.attributes["shmgate.cache"] == "miss"
    attempt = _one(spans, "attempt")
    assert attempt.attributes["shmgate.attempt"] == 0
    assert attempt.attributes["gen_ai.request.model"] == "checksum"
    assert attempt.attributes["gen_ai.usage.output_tokens"] >= 1
    assert _one(spans, "queue").parent_id == attempt.span_id

    # Across the hop: the worker's spans, exported by another process, are children of the attempt.
    for name in WORKER_SPANS:
        span = _one(spans, name)
        assert span.parent_id == attempt.span_id, name
        assert span.resource["shmgate.role"] == "worker"
        assert span.resource["service.name"] == "shmgate-test"
    assert server.resource["shmgate.role"] == "frontend"
    assert _one(spans, "compute").attributes["shmgate.batch_size"] >= 1
    # Every span lies within the server span, whichever process's clock stamped it.
    for span in spans:
        assert server.start_ns <= span.start_ns <= span.end_ns <= server.end_ns, span.name
    queue, batch_wait, compute = _one(spans, "queue"), _one(spans, "batch_wait"), _one(spans, "compute")
    assert queue.end_ns <= batch_wait.end_ns <= compute.start_ns  # claimed, then cut, then run

    # The same image again: a cache hit, no decode (remote: the other frontend took it and copied the tensors).
    trace_id2, caller2 = _new_ids(2)
    assert (
        _post(
            traced_server, image_request("checksum", image), {"traceparent": _traceparent(trace_id2, caller2)}
        ).status_code
        == 200
    )
    again = _wait_for(collector, trace_id2, {"preprocess image", "compute"})
    assert _one(again, "preprocess image").attributes["shmgate.cache"] in ("hit", "remote")

    # The startup summary names the collector; the access log line carries the trace id.
    assert "traces    OpenTelemetry spans to http://127.0.0.1:" in traced_server.log_path.read_text()
    wait_until(lambda: f"trace_id={trace_id}" in traced_server.log_path.read_text(), 10, "access log trace id")


def test_stage_histograms_carry_trace_exemplars_in_openmetrics(traced_server: Server, collector: Collector) -> None:
    trace_id, caller = _new_ids(7)
    assert (
        _post(
            traced_server, image_request("checksum", noise_png(105)), {"traceparent": _traceparent(trace_id, caller)}
        ).status_code
        == 200
    )
    exemplar = f'# {{trace_id="{trace_id}"}}'

    def scraped() -> bool:  # the exemplars are the answering frontend's: a scrape may reach the other one
        text = httpx.get(
            traced_server.base_url + "/metrics",
            timeout=10,
            headers={"Accept": "application/openmetrics-text; version=1.0.0"},
        ).text
        return any(
            line.startswith("shmgate_stage_duration_seconds_bucket{") and 'stage="compute"' in line and exemplar in line
            for line in text.splitlines()
        )

    wait_until(scraped, 30, "a compute bucket with the request's exemplar")


def test_a_streamed_request_with_an_image_url_traces_the_fetch_and_the_first_token(
    traced_server: Server, collector: Collector, image_host: ImageHost
) -> None:
    trace_id, caller = _new_ids(8)
    body = {
        "model": "checksum",
        "stream": True,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": image_host.url("/photo.jpg")}},
                ],
            }
        ],
    }
    with httpx.stream(
        "POST",
        traced_server.base_url + "/v1/chat/completions",
        json=body,
        timeout=60,
        headers={"traceparent": _traceparent(trace_id, caller)},
    ) as response:
        assert response.status_code == 200
        assert "[DONE]" in response.read().decode()
    spans = _wait_for(collector, trace_id, {"image_url_fetch", "preprocess image", "compute", "delivery"})
    server = _one(spans, "POST /v1/chat/completions")
    fetch = _one(spans, "image_url_fetch")
    assert fetch.parent_id == server.span_id and fetch.attributes["shmgate.image_urls"] == 1
    assert fetch.end_ns <= _one(spans, "preprocess").start_ns  # fetched, then decoded
    assert 0 < server.attributes["gen_ai.server.time_to_first_token"] < 60


def test_a_batch_span_links_to_every_request_it_served(traced_server: Server, collector: Collector) -> None:
    ids = [_new_ids(10 + k) for k in range(6)]
    results: list[int] = []

    def send(k: int) -> None:
        trace_id, caller = ids[k]
        body = image_request("checksum", (IMAGES / "coffee_640.jpg").read_bytes())
        results.append(_post(traced_server, body, {"traceparent": _traceparent(trace_id, caller)}).status_code)

    threads = [threading.Thread(target=send, args=(k,)) for k in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [200] * len(ids)
    attempts = {}
    for trace_id, _ in ids:
        attempt = _one(_wait_for(collector, trace_id, {"attempt", "compute"}), "attempt")
        attempts[(trace_id, attempt.span_id)] = attempt

    def batches() -> list[Span]:
        with collector.lock:
            return [s for s in collector.spans if s.name == "batch" and set(s.links) & set(attempts)]

    wait_until(lambda: sum(len(set(b.links) & set(attempts)) for b in batches()) >= len(attempts), 30, "batch links")
    linked: list[tuple[str, str]] = []
    for batch in batches():
        assert batch.trace_id not in {t for t, _ in ids}  # a batch is a trace of its own, pointing at requests
        assert batch.attributes["shmgate.batch_size"] == len(batch.links)
        linked += batch.links
    assert sorted(set(linked) & set(attempts)) == sorted(attempts)  # each request's attempt: from one batch
    assert len(linked) == len(set(linked))


def test_requests_without_a_traceparent_start_their_own_trace(traced_server: Server, collector: Collector) -> None:
    response = _post(traced_server, image_request("checksum", noise_png(102)))
    assert response.status_code == 200

    def roots() -> list[Span]:
        with collector.lock:
            return [s for s in collector.spans if s.name == "POST /v1/chat/completions" and not s.parent_id]

    wait_until(lambda: bool(roots()), 30, "a root server span")
    trace_id = roots()[-1].trace_id
    spans = _wait_for(collector, trace_id, {"attempt", "compute"})
    assert _one(spans, "compute").parent_id == _one(spans, "attempt").span_id


def test_an_error_answer_is_a_failed_server_span_and_untraced_paths_make_no_spans(
    traced_server: Server, collector: Collector
) -> None:
    trace_id, caller = _new_ids(3)
    bad = _post(
        traced_server, {"model": "checksum", "messages": "not a list"}, {"traceparent": _traceparent(trace_id, caller)}
    )
    assert bad.status_code == 400
    server = _one(_wait_for(collector, trace_id, {"POST /v1/chat/completions"}), "POST /v1/chat/completions")
    assert server.attributes["http.response.status_code"] == 400
    trace_id, caller = _new_ids(4)
    assert (
        httpx.get(
            traced_server.base_url + "/health", headers={"traceparent": _traceparent(trace_id, caller)}, timeout=10
        ).status_code
        == 200
    )
    time.sleep(0.5)  # several export intervals: a span would have arrived
    assert collector.trace(trace_id) == []


def test_tracing_off_loads_no_sdk_and_no_span_module() -> None:
    """Off (the default), the data path's hooks are a None test: the SDK and our span modules stay unloaded."""
    code = (
        "import sys, node.cli, gateway.app, gateway.process, worker.main; "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk') or m.startswith('opentelemetry.exporter')"
        " or m in ('shmgate.gateway.request_spans', 'shmgate.worker.tracing')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_tracing_without_the_extra_is_a_one_line_config_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from shmgate.node.cli import build_parser

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("opentelemetry.") else real_find_spec(name, *a),
    )
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["serve", "--otlp-traces-endpoint", "http://collector:4318"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install shmgate[otel]" in err and "--otlp-traces-endpoint" in err


def test_the_endpoint_gets_the_traces_path_and_must_be_a_url() -> None:
    import argparse

    from shmgate.shared.tracing import otlp_endpoint

    assert otlp_endpoint("http://collector:4318") == "http://collector:4318/v1/traces"
    assert otlp_endpoint("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"
    assert otlp_endpoint("") == ""
    with pytest.raises(argparse.ArgumentTypeError, match="not an http"):
        otlp_endpoint("collector:4318")


def test_a_client_that_hangs_up_leaves_a_trace_that_says_cancelled(traced_server: Server, collector: Collector) -> None:
    trace_id, caller = _new_ids(5)
    body = image_request("checksum", noise_png(103), stream=True, text="checksum:trickle 90000")  # ~30 min
    with httpx.stream(
        "POST",
        traced_server.base_url + "/v1/chat/completions",
        json=body,
        timeout=30,
        headers={"traceparent": _traceparent(trace_id, caller)},
    ) as response:
        assert response.status_code == 200
        for n, _ in enumerate(response.iter_lines()):
            if n >= 4:
                break  # leaving the block closes the connection mid-stream
    spans = _wait_for(collector, trace_id, {"attempt", "compute", "POST /v1/chat/completions"})
    attempt, compute = _one(spans, "attempt"), _one(spans, "compute")
    assert attempt.attributes["shmgate.cancelled"] is True and "cancelled" in attempt.events
    assert compute.attributes["shmgate.cancelled"] is True  # the worker saw the Cancel and stopped
    assert "delivery" in compute.events  # each streamed Delta the worker sent before it is an event
    assert _one(spans, "POST /v1/chat/completions").attributes["shmgate.cancelled"] is True


def test_a_retried_request_shows_both_attempts(traced_server: Server, collector: Collector) -> None:
    """It kills the server's worker, and waits for the supervisor's replacement before it ends."""
    server = traced_server
    trace_id, caller = _new_ids(6)
    image = noise_png(104)
    body = image_request("checksum", image, text="checksum:hold 100")  # 2 s before any output: a kill lands first
    answers: list[httpx.Response] = []
    sender = threading.Thread(
        target=lambda: answers.append(_post(server, body, {"traceparent": _traceparent(trace_id, caller)}))
    )
    sender.start()
    wait_until(lambda: "queue" in {s.name for s in collector.trace(trace_id)}, 30, "the request claimed")
    for pid in server.pids("worker"):
        os.kill(pid, signal.SIGKILL)
    sender.join(90)
    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert expected_checksum(image) in answers[0].json()["choices"][0]["message"]["content"]

    wait_until(
        lambda: (
            len([s for s in collector.trace(trace_id) if s.name == "attempt"]) == 2
            and "compute" in {s.name for s in collector.trace(trace_id)}
        ),
        30,
        "both attempts",
    )
    spans = collector.trace(trace_id)
    first, second = sorted((s for s in spans if s.name == "attempt"), key=lambda s: s.attributes["shmgate.attempt"])
    server_span = _one(spans, "POST /v1/chat/completions")
    assert first.parent_id == second.parent_id == server_span.span_id
    assert (first.attributes["shmgate.attempt"], second.attributes["shmgate.attempt"]) == (0, 1)
    assert first.status == 2 and second.status != 2  # the first failed (its worker died), the second answered
    assert first.end_ns <= second.start_ns
    assert _one(spans, "compute").parent_id == second.span_id  # the work that answered is under the retry
    wait_until(lambda: server.metric("shmgate_workers_ready") == 1, 60, "the worker restarted")


def test_an_unsampled_caller_is_not_traced_and_a_malformed_traceparent_starts_a_new_trace(
    traced_server: Server, collector: Collector
) -> None:
    trace_id, caller = _new_ids(9)
    unsampled = f"00-{trace_id}-{caller}-00"  # the caller decided not to sample: neither process records it
    assert (
        _post(traced_server, image_request("checksum", noise_png(106)), {"traceparent": unsampled}).status_code == 200
    )
    with collector.lock:
        before = len(collector.spans)
    assert (
        _post(
            traced_server, image_request("checksum", noise_png(107)), {"traceparent": "00-not-a-trace-context"}
        ).status_code
        == 200
    )

    def new_roots() -> list[Span]:
        with collector.lock:
            return [s for s in collector.spans[before:] if s.name == "POST /v1/chat/completions" and not s.parent_id]

    wait_until(lambda: bool(new_roots()), 30, "the malformed request's own trace")
    assert _wait_for(collector, new_roots()[0].trace_id, {"compute"})
    assert collector.trace(trace_id) == []  # by now its spans, had there been any, would have arrived


def test_each_batch_line_is_a_trace_naming_its_batch_and_custom_id(traced_server: Server, collector: Collector) -> None:
    lines = [
        {
            "custom_id": f"traced-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": image_request("checksum", noise_png(700 + i)),
        }
        for i in range(2)
    ]
    base = traced_server.base_url
    uploaded = httpx.post(
        base + "/v1/files",
        files={"file": ("in.jsonl", b"".join(json.dumps(line).encode() + b"\n" for line in lines))},
        data={"purpose": "batch"},
    ).json()
    batch = httpx.post(
        base + "/v1/batches",
        json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).json()
    wait_until(
        lambda: httpx.get(f"{base}/v1/batches/{batch['id']}").json()["status"] == "completed", 60, "the batch done"
    )

    def line_spans() -> list[Span]:
        with collector.lock:
            return [
                s
                for s in collector.spans
                if s.name == "batch line" and s.attributes.get("shmgate.batch.id") == batch["id"]
            ]

    wait_until(lambda: len(line_spans()) == 2, 30, "both lines' spans")
    assert sorted(s.attributes["shmgate.batch.custom_id"] for s in line_spans()) == ["traced-0", "traced-1"]
    for line in line_spans():
        assert line.parent_id == ""  # each line is a trace of its own
        assert line.attributes["http.response.status_code"] == 200
        spans = _wait_for(collector, line.trace_id, {"preprocess", "attempt"} | WORKER_SPANS)
        assert not [s for s in spans if s.name.startswith("POST ")]  # run in process: no HTTP request
        for name in ("preprocess", "attempt"):  # the line's request, and the worker's spans under it
            assert _one(spans, name).parent_id == line.span_id
            assert _one(spans, name).resource["shmgate.role"] == "frontend"
        assert {s.resource["shmgate.role"] for s in spans if s.name in WORKER_SPANS} == {"worker"}
