"""docker/compose.yaml run as local processes, without docker, then driven with docker/loadtest.sh.

tests/compose_util.py resolves what `docker compose up` would start (argv, environment, start order); this
file starts exactly those commands here, as `docker compose up --scale worker=N` would: the gateway first,
the workers once the gateway's compose health check passes (`depends_on: condition: service_healthy`),
`deploy.replicas` copies of each. Then:

- docker/loadtest.sh against the gateway: every request must succeed;
- liveness across "containers": a SIGKILLed worker leaves /ready at 200 while another heartbeats; a
  SIGSTOPped last worker (process present, heartbeat stale) turns it 503 and back to 200 on SIGCONT; /ready
  is 503 once the last worker exits on SIGTERM;
- `docker compose down`: SIGTERM in reverse start order, every process exits 0 and nothing of the instance
  is left in /dev/shm nor among the POSIX message queues.

What a container would add and this cannot: separate PID namespaces (here the gateway could also probe a
worker with kill(pid, 0); shmgate relies on heartbeats, which this still exercises), `shm_size`, the mqueue
sysctls, the `restart:` policy (nothing is restarted here). `ulimits` are applied (as root they can be raised).
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from shmgate.shared.instance import DEAD_AFTER_S
from tests.compose_util import compose_commands, dockerfile_instructions, load_compose
from tests.serving import free_port, shm_entries, shm_entries_created_by, wait_until
from tests.shm_children import leftovers

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker" / "compose.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
LOADTEST = ROOT / "docker" / "loadtest.sh"
IMAGES = ROOT / "tests" / "data" / "images"

HEALTHY_TIMEOUT_S = 30.0  # bounded waits only; none of them is a timing assertion
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
INSTANCE_LOG = re.compile(r"instance ([0-9a-f]{16}) listening on http://([^:]+):(\d+)")
_RLIMITS = {
    "msgqueue": resource.RLIMIT_MSGQUEUE,
    "nofile": resource.RLIMIT_NOFILE,
    "nproc": resource.RLIMIT_NPROC,
    "memlock": resource.RLIMIT_MEMLOCK,
    "core": resource.RLIMIT_CORE,
    "stack": resource.RLIMIT_STACK,
}


def summary_line(n: int) -> re.Pattern[str]:
    return re.compile(rf"^{n} ok, 0 failed, [0-9.]+ req/s, p50 \d+ ms, p90 \d+ ms, p99 \d+ ms$")


def image_env() -> dict[str, str]:
    """ENV of the Dockerfile's last stage (the image both services run), PATH left out (the venv's is used)."""
    env: dict[str, str] = {}
    for instruction, argument in dockerfile_instructions(DOCKERFILE.read_text(encoding="utf-8")):
        if instruction == "FROM":
            env = {}
        elif instruction == "ENV":
            words = shlex.split(argument)
            if words and "=" not in words[0]:  # legacy `ENV KEY value`
                env[words[0]] = " ".join(words[1:])
            else:
                env.update(word.split("=", 1) for word in words)
    env.pop("PATH", None)
    return env


def duration_s(value: str | int | float | None, default: float) -> float:
    """A compose duration ("3s", "1m30s", "500ms") in seconds."""
    if value is None:
        return default
    if isinstance(value, int | float):
        return float(value)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    parts = re.findall(r"([\d.]+)(ms|us|h|m|s)", value)
    assert parts, f"not a compose duration: {value!r}"
    return sum(float(number) * units[unit] for number, unit in parts)


def _limits(ulimits: Mapping[str, object]) -> list[tuple[int, int, int]]:
    out = []
    for name, value in ulimits.items():
        soft, hard = (value["soft"], value["hard"]) if isinstance(value, dict) else (value, value)
        out.append((_RLIMITS[name], int(soft), int(hard)))
    return out


def _set_limits(limits: list[tuple[int, int, int]]) -> None:
    """In the child, before exec: the service's `ulimits`, as far as this user may raise them."""
    for which, soft, hard in limits:
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError):
            _, allowed = resource.getrlimit(which)
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(which, (min(soft, allowed), allowed))


def local_argv(argv: list[str]) -> list[str]:
    """The container's argv as a local command: the image's ENTRYPOINT `shmgate` is the venv's console
    script (next to this interpreter); `python` is this interpreter."""
    head, *rest = argv
    if head == "shmgate":
        script = Path(sys.executable).parent / "shmgate"
        return [str(script), *rest] if script.exists() else [sys.executable, "-m", "shmgate.gateway", *rest]
    if head == "python":
        return [sys.executable, *rest]
    return argv


@dataclass
class Replica:
    service: str
    index: int
    process: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str]
    expected_code: int = 0  # what it should exit with: 0 after SIGTERM, -9 once the test SIGKILLed it

    def log(self, tail: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def alive(self) -> bool:
        return self.process.poll() is None


@dataclass
class LocalCompose:
    """`docker compose up` / `down` for docker/compose.yaml, as local processes."""

    env: dict[str, str]
    log_dir: Path
    replicas: dict[str, list[Replica]] = field(default_factory=dict)
    shm_before: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.spec = load_compose(COMPOSE, self.env)["services"]
        self.commands = compose_commands(COMPOSE, self.env)
        self.port = int(self.env["SHMGATE_PORT"])
        self.base_url = f"http://127.0.0.1:{self.port}"

    # -- up ---------------------------------------------------------------------------

    def process_env(self, service_env: Mapping[str, str]) -> dict[str, str]:
        # A container sees the image's ENV and the service's `environment:`, nothing of the host's SHMGATE_*
        # settings. The image sets SHMGATE_HOST=0.0.0.0 (in a container the gateway must listen on all
        # interfaces, and compose publishes the port on 127.0.0.1 only); here there is no container around
        # the process, so it is overridden with 127.0.0.1: the test never listens on every interface.
        # Likewise the image's batch directory is a volume mounted in the container: here, a directory of the test's.
        host = {k: v for k, v in os.environ.items() if not k.startswith("SHMGATE_")}
        batches = {"SHMGATE_BATCH_DIR": str(self.log_dir / "batches")}
        return {**host, **image_env(), **service_env, "SHMGATE_HOST": "127.0.0.1", **batches}

    def up(self) -> None:
        self.shm_before = shm_entries()
        for command in self.commands:
            spec = self.spec[command.service]
            self._wait_dependencies(command.service, spec.get("depends_on") or {})
            count = int((spec.get("deploy") or {}).get("replicas", 1))
            assert count >= 1, f"{command.service}: replicas={count}"
            for index in range(count):
                self._start(command.service, index, command.argv, command.environment, spec)

    def _start(self, service: str, index: int, argv: list[str], service_env: dict[str, str], spec: dict) -> None:
        log_path = self.log_dir / f"{service}-{index + 1}.log"
        limits = _limits(spec.get("ulimits") or {})
        env = self.process_env(service_env)
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                local_argv(argv),
                env=env,
                cwd=self.log_dir,  # not the repository: the image has no sources, only the installed package
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a straggler's children can be killed too
                preexec_fn=(lambda: _set_limits(limits)) if limits else None,
            )
        self.replicas.setdefault(service, []).append(Replica(service, index, process, log_path, env))

    def _wait_dependencies(self, service: str, depends_on: Mapping | list) -> None:
        conditions = (
            {name: "service_started" for name in depends_on}
            if isinstance(depends_on, list)
            else {name: (value or {}).get("condition", "service_started") for name, value in depends_on.items()}
        )
        for dependency, condition in conditions.items():
            assert self.replicas.get(dependency), f"{service} depends on {dependency}, which did not start"
            if condition == "service_healthy":
                self.wait_healthy(dependency)
            elif condition == "service_completed_successfully":
                for replica in self.replicas[dependency]:
                    assert replica.process.wait(HEALTHY_TIMEOUT_S) == 0, replica.log()

    def wait_healthy(self, service: str) -> None:
        """Run the service's compose health check (inside its "container": with its environment) until it
        passes, in a bounded time."""
        check = self.spec[service].get("healthcheck") or {}
        assert not check.get("disable"), f"{service} is a dependency with a disabled health check"
        test = check["test"]
        if isinstance(test, str):
            test = ["CMD-SHELL", test]
        kind, *words = test
        argv = ["/bin/sh", "-c", words[0]] if kind == "CMD-SHELL" else local_argv(words)
        assert kind in ("CMD", "CMD-SHELL"), f"unsupported health check {test!r}"
        timeout_s = duration_s(check.get("timeout"), 30.0)
        # Docker gives up after start_period + retries x interval; locally we poll faster, within a bound.
        budget = min(
            HEALTHY_TIMEOUT_S,
            duration_s(check.get("start_period"), 0.0)
            + int(check.get("retries", 3)) * duration_s(check.get("interval"), 30.0),
        )
        deadline = time.monotonic() + budget
        for replica in self.replicas[service]:
            last = ""
            while True:
                assert replica.alive(), f"{service} exited early ({replica.process.returncode}):\n{replica.log()}"
                try:
                    result = subprocess.run(
                        argv, env=replica.env, capture_output=True, text=True, timeout=timeout_s, cwd=self.log_dir
                    )
                    if result.returncode == 0:
                        break
                    last = result.stderr[-500:]
                except subprocess.TimeoutExpired:
                    last = "health check timed out"
                assert time.monotonic() < deadline, f"{service} not healthy in {budget:.0f} s: {last}\n{replica.log()}"
                time.sleep(0.25)

    def ready_status(self) -> int:
        try:
            return httpx.get(self.base_url + "/ready", timeout=2).status_code
        except httpx.HTTPError:
            return 0

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while self.ready_status() != 200:
            for replica in self.all():
                assert replica.alive(), f"{replica.service} exited early:\n{replica.log()}"
            assert time.monotonic() < deadline, f"/ready not 200 within {timeout_s} s:\n{self.logs()}"
            time.sleep(0.2)

    # -- inspecting -------------------------------------------------------------------

    def all(self) -> list[Replica]:
        return [replica for replicas in self.replicas.values() for replica in replicas]

    def logs(self) -> str:
        return "\n".join(f"--- {r.log_path.name} ---\n{r.log(2000)}" for r in self.all())

    def instance_id(self) -> str | None:
        gateway = self.replicas.get("gateway")
        if not gateway:
            return None
        match = INSTANCE_LOG.search(gateway[0].log_path.read_text(errors="replace"))
        return match.group(1) if match else None

    # -- down -------------------------------------------------------------------------

    def down(self) -> None:
        """SIGTERM in reverse start order (workers, then the gateway), wait, SIGKILL stragglers and their
        process groups. Never raises: the caller checks exit codes and leftovers afterwards."""
        for command in reversed(self.commands):
            replicas = self.replicas.get(command.service, [])
            for replica in replicas:
                if replica.alive():
                    with contextlib.suppress(ProcessLookupError):
                        replica.process.send_signal(signal.SIGTERM)
                        replica.process.send_signal(signal.SIGCONT)  # in case a test left it stopped
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for replica in replicas:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    replica.process.wait(max(0.1, deadline - time.monotonic()))
        for replica in self.all():
            # Also whatever the process left in its group (a gateway's frontends), alive or orphaned.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(replica.process.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                replica.process.kill()
            replica.process.wait()

    def leftovers(self) -> set[str]:
        """IPC objects of this instance still present: /dev/shm entries, and message queues (not listable
        without an mqueue mount, so probed by name)."""
        instance_id = self.instance_id()
        if instance_id is None:  # no id logged: what appeared meanwhile under the gateway's pid
            gateway = self.replicas.get("gateway")
            return shm_entries_created_by(gateway[0].process.pid, self.shm_before) if gateway else set()
        return set(leftovers(instance_id, slots=64))


def wait_for_backend(model: str, timeout_s: float = 300.0) -> None:
    """The checksum backend module may land after this file; wait for it (bounded) rather than fail."""
    if model != "checksum":
        return
    path = ROOT / "worker" / "backends" / "checksum.py"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"{path} does not exist")
        time.sleep(2)


@contextlib.contextmanager
def compose_up(tmp_path: Path, model: str, workers: int) -> Iterator[LocalCompose]:
    """The deployment up (gateway healthy, `workers` worker replicas, /ready 200), then always down; after
    down: every process exited as expected and nothing of the instance is left."""
    wait_for_backend(model)
    env = {
        "SHMGATE_PORT": str(free_port()),
        "SHMGATE_ARENA_SIZE": "128MiB",
        "SHMGATE_LABEL": "ci-" + secrets.token_hex(6),  # workers find this gateway, not a concurrent test's
        "SHMGATE_FRONTENDS": "2",
        "SHMGATE_MODEL": model,
        "SHMGATE_WORKERS": str(workers),  # deploy.replicas of the worker service: `--scale worker=N`
    }
    stack = LocalCompose(env, tmp_path)
    try:
        stack.up()
        stack.wait_ready()
        yield stack
    finally:
        stack.down()
    problems = [
        f"{r.log_path.stem} exited with {r.process.returncode}, expected {r.expected_code}"
        for r in stack.all()
        if r.process.returncode != r.expected_code
    ]
    if stack.instance_id() is None:
        problems.append("the gateway did not log its instance id")
    leaked = stack.leftovers()
    if leaked:
        problems.append(f"left behind after down: {sorted(leaked)}")
    assert not problems, "\n".join(problems) + "\n" + stack.logs()


def run_loadtest(stack: LocalCompose, model: str, requests: int, concurrency: int) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("SHMGATE_API_KEY", "OPENAI_API_KEY")}
    result = subprocess.run(
        ["bash", str(LOADTEST), stack.base_url, model, str(requests), str(concurrency), str(IMAGES)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**env, "LOADTEST_TIMEOUT_S": "60"},
    )
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{stack.logs()}"
    assert lines and summary_line(requests).match(lines[-1]), result.stdout
    return result.stdout


def wait_status(stack: LocalCompose, expected: int, timeout_s: float, after: str) -> None:
    deadline = time.monotonic() + timeout_s
    while (status := stack.ready_status()) != expected:
        assert time.monotonic() < deadline, f"/ready is {status}, not {expected}, {timeout_s} s after {after}"
        time.sleep(0.2)


# --- the tests ------------------------------------------------------------------------------------------


def test_compose_file_starts_as_local_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the tests below start: the gateway, then the worker; both on this interpreter's console script."""
    commands = compose_commands(COMPOSE, {"SHMGATE_LABEL": "x", "SHMGATE_MODEL": "checksum"})
    assert [(c.service, c.argv) for c in commands] == [
        ("gateway", ["shmgate", "gateway"]),
        ("worker", ["shmgate", "worker"]),
    ]
    assert all(c.environment["SHMGATE_LABEL"] == "x" for c in commands)
    assert local_argv(["shmgate", "worker"])[1:] in (["worker"], ["-m", "shmgate.gateway", "worker"])
    monkeypatch.setenv("SHMGATE_HOST", "0.0.0.0")
    monkeypatch.setenv("SHMGATE_INSTANCE", "0123456789abcdef")
    stack = LocalCompose({"SHMGATE_PORT": "1"}, Path("."))
    env = stack.process_env(commands[1].environment)
    assert env["SHMGATE_HOST"] == "127.0.0.1" and "SHMGATE_INSTANCE" not in env
    assert env["HF_HUB_OFFLINE"] == "1" and env["SHMGATE_MODEL"] == "checksum"


def test_compose_services_pass_the_load_test_survive_a_dead_worker_and_leave_nothing(tmp_path: Path) -> None:
    # One deployment for both parts (starting one costs several seconds of the file's budget).
    with compose_up(tmp_path, "checksum", workers=2) as stack:
        assert len(stack.replicas["worker"]) == 2 and len(stack.replicas["gateway"]) == 1
        match = INSTANCE_LOG.search(stack.replicas["gateway"][0].log())
        assert match and match.group(2) == "127.0.0.1" and int(match.group(3)) == stack.port, stack.logs()
        run_loadtest(stack, "checksum", 24, 4)

        # Liveness across "containers". Both replicas attached first: /ready needs only one, and on a busy
        # machine the second may still be starting (its log empty) when the first is killed.
        wait_until(
            lambda: all(
                "ready in worker slot" in r.log_path.read_text(errors="replace") for r in stack.replicas["worker"]
            ),
            READY_TIMEOUT_S,
            "both workers ready",
        )
        killed, survivor = stack.replicas["worker"]
        killed.process.send_signal(signal.SIGKILL)
        killed.process.wait(10)
        killed.expected_code = -signal.SIGKILL
        # Past the point where the dead worker counts as dead (here kill(pid, 0) tells at once; across
        # containers its heartbeat does, after DEAD_AFTER_S): still ready, and still serving, on the other.
        until = time.monotonic() + DEAD_AFTER_S + 1.0
        while time.monotonic() < until:
            assert stack.ready_status() == 200, stack.logs()
            time.sleep(0.25)
        run_loadtest(stack, "checksum", 8, 2)
        # A worker whose process exists but does not run (SIGSTOP: kill(pid, 0) still succeeds, as it would
        # for a hung container) is seen through its heartbeat only: /ready turns 503 once it is stale...
        survivor.process.send_signal(signal.SIGSTOP)
        try:
            wait_status(stack, 503, DEAD_AFTER_S + 3.0, "the last worker was stopped (SIGSTOP)")
        finally:
            survivor.process.send_signal(signal.SIGCONT)
        # ... and back to 200 once it beats again (nothing reclaimed its slot meanwhile).
        wait_status(stack, 200, 5.0, "the worker was continued (SIGCONT)")
        # The last worker stops: /ready turns 503 (its slot is freed, or its heartbeat goes stale).
        survivor.process.send_signal(signal.SIGTERM)
        assert survivor.process.wait(STOP_TIMEOUT_S) == 0, survivor.log()
        wait_status(stack, 503, 5.0, "the last worker exited (SIGTERM)")
        assert stack.replicas["gateway"][0].alive()


def test_compose_services_serve_efficientnet(tmp_path: Path) -> None:
    # SHMGATE_WORKERS=1: the compose default of one replica.
    with compose_up(tmp_path, "efficientnet-lite0", workers=1) as stack:
        run_loadtest(stack, "efficientnet-lite0", 6, 2)
