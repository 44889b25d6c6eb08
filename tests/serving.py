"""Starting a real ``shmgate serve`` for tests, and the checks every test makes after it stops.

Each server is a real process tree (supervisor, frontends, workers) on a free
port; stopping it sends SIGTERM and waits, and the caller then asserts nothing
of the instance is left in /dev/shm.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

DATA = Path(__file__).parent / "data"
IMAGES = DATA / "images"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_entries() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if "shmgate" in name}


def shm_entries_created_by(pid: int, before: set[str]) -> set[str]:
    """The shmgate entries of /dev/shm new since ``before`` that belong to an instance ``pid`` supervises.

    Tests run side by side (scripts/test.sh), so a diff of all of /dev/shm would count the instances
    neighbouring tests create meanwhile; an arena's header names its supervisor. Entries whose instance
    has no arena (any more) count unless they vanish within 2 s: a neighbour tearing its instance down
    removes its semaphores just after its arena, while leftovers of ``pid``'s would stay.
    """
    from shmgate.shared.names import InstanceNames
    from shmgate.shared.segment import peek_header

    mine: set[str] = set()
    for instance_id in {
        match.group(0) for name in shm_entries() - before if (match := re.search(r"(?<=\.)[0-9a-f]{16}(?=\.|$)", name))
    }:
        peek = peek_header(InstanceNames(instance_id))
        if peek is not None and peek.supervisor_pid != pid:
            continue
        if peek is None:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and any(instance_id in name for name in shm_entries()):
                time.sleep(0.05)
        mine |= {name for name in shm_entries() - before if instance_id in name}
    return mine


def data_url(data: bytes, mime: str = "image/jpeg") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_request(
    model: str, data: bytes, *, mime: str = "image/jpeg", stream: bool = False, text: str = "What is in this image?"
) -> dict[str, object]:
    return {
        "model": model,
        "stream": stream,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": text},
                    {"type": "image_url", "image_url": {"url": data_url(data, mime)}},
                ],
            }
        ],
    }


def noise_png(seed: int, size: int = 96) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (size, size + seed % 7, 3), dtype=np.uint8))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def expected_checksum(data: bytes) -> str:
    """The digest the checksum backend must report for ``data``'s preprocessed pixels."""
    import numpy as np

    from shmgate.gateway.preprocess.vision import ChecksumPreprocessor

    arrays: list[np.ndarray] = []

    def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        arrays.append(np.empty(shape, dtype))
        return arrays[-1]

    ChecksumPreprocessor().preprocess_image(data, allocate, max_pixels=40_000_000)
    return hashlib.blake2b(arrays[0].tobytes(), digest_size=16).hexdigest()


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Poll ``predicate`` until true; returns the seconds it took. A hang guard, not a timing check."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"{what}: not after {timeout_s:.0f} s"
        time.sleep(0.1)
    return time.monotonic() - started


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    model: str
    log_path: Path

    @property
    def instance_id(self) -> str:
        # The summary line, not "removing leftovers of dead instance ..." that may come before it.
        match = re.search(r": instance ([0-9a-f]{16}) \(label ", self.log_path.read_text())
        assert match, "the supervisor did not log its instance id"
        return match.group(1)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def children(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process below the supervisor."""
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid != self.process.pid:
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode()
            except (OSError, ValueError, IndexError):
                continue
            out.append((int(entry), cmd))
        return out

    def pids(self, role: str) -> list[int]:
        marker = "-m shmgate.worker" if role == "worker" else "-m shmgate.gateway frontend"
        return [pid for pid, cmd in self.children() if marker in cmd]

    def frontend_pid(self, slot: int) -> int | None:
        """The pid of the frontend process in ``slot`` (None while it is being restarted)."""
        for pid, cmd in self.children():
            if "-m shmgate.gateway frontend" in cmd and f" --slot {slot} " in cmd:
                return pid
        return None

    def metric(self, name: str) -> float:
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(self.base_url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready:\n{self.log_path.read_text()[-4000:]}")

    def stop(self, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise
        return self.process.returncode


def stop_and_check(server: Server) -> None:
    """SIGTERM the server, then require a clean exit and nothing of the instance left (shm, queues)."""
    from tests.shm_children import leftovers

    code = server.stop()
    leaked = leftovers(server.instance_id, slots=64)
    assert code == 0, server.log_path.read_text()[-3000:]
    assert not leaked, f"left in /dev/shm after shutdown: {leaked}"


def start_server(model: str, tmp_dir: Path, *extra: str) -> Server:
    port = free_port()
    log_path = tmp_dir / f"serve-{model.replace('/', '_').replace(':', '_')}-{port}.log"
    log = open(log_path, "wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shmgate.gateway",
            "serve",
            "--port",
            str(port),
            "--model",
            model,
            "--frontends",
            "2",
            "--arena-size",
            "128MiB",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    server = Server(process, port, model, log_path)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()  # never leave a half-started server behind
        raise
    return server


def raw_post(path: str, body: dict[str, object]) -> bytes:
    """A complete HTTP/1.1 POST of ``body`` as JSON, for tests that write to a socket and hang up."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    return head.encode() + b"Content-Length: %d\r\n\r\n" % len(data) + data


def request_outcomes(server: Server) -> dict[str, float]:
    """``shmgate_requests_total`` by the outcomes the hang-up tests compare."""
    names = ("ok", "cancelled", "client_error", "server_error")
    return {o: server.metric(f'shmgate_requests_total{{outcome="{o}"}}') for o in names}


def server_idle(server: Server) -> bool:
    """Nothing in flight and no arena bytes held: every request's work is over."""
    return server.metric("shmgate_in_flight_requests") == 0 and server.metric("shmgate_arena_held_bytes") == 0
