"""What ``serve`` and ``gateway`` tell the operator while they run, from the supervisor process only.

- ``summary_lines``: once, after the configuration is valid and before any child starts: version,
  the model id clients must send, device and dtype, frontends x workers x threads, the arena and
  what /dev/shm has free, whether a key is needed, the URL.
- ``ServingLog.tick`` (the supervisor calls it every tick): "listening on" once every frontend
  beats (never before workers exist or before a configuration error), "ready in N.N s" once /ready
  is true (the frontends' condition: a worker serving the model is READY, heartbeating and
  progressing; gateway/frontend.py ``Frontend.ready``), and, when asked, one line of statistics
  every interval from the same node counters /metrics reads (gateway/metrics.py).

Frontends log no banner of their own: N frontends would print it N times.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from shmgate.gateway.metrics import Counter
from shmgate.shared.names import SHM_DIR, format_bytes
from shmgate.shared.transport.base import NodeStats

__all__ = ["ServingLog", "Summary", "plural", "summary_lines"]

log = logging.getLogger("shmgate")


def plural(n: int, word: str) -> str:
    """``1 frontend``, ``2 frontends``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


@dataclass(frozen=True)
class Summary:
    """The facts of one start, each already decided by gateway/cli.py."""

    version: str
    instance_id: str
    label: str
    model_id: str  # what clients send as "model"
    model_spec: str
    url: str
    n_frontends: int
    workers: str  # "2 workers on cpu, 1 torch thread each", or where workers come from
    dtype: str
    arena_bytes: int
    auth: bool
    traces: str = ""  # the OTLP endpoint spans go to (--otlp-traces-endpoint); "": tracing off


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def summary_lines(s: Summary, shm_free: int | None) -> list[str]:
    free = f"{format_bytes(shm_free)} free" if shm_free is not None else "free space unknown"
    return [
        f"shmgate {s.version}: instance {s.instance_id} (label {s.label!r}) starting",
        f'  model     {s.model_spec}: clients send "model": "{s.model_id}"',
        f"  processes {plural(s.n_frontends, 'frontend')}, {s.workers}; dtype {s.dtype}",
        f"  arena     {format_bytes(s.arena_bytes)} in {SHM_DIR} ({free} before it)",
        f"  auth      {'on: clients send Authorization: Bearer <key>' if s.auth else 'off (no API key set)'}",
        f"  url       {s.url} (OpenAI base URL {s.url}/v1)",
        *([f"  traces    OpenTelemetry spans to {s.traces} (docs/OBSERVABILITY.md)"] if s.traces else []),
    ]


@dataclass
class _Snapshot:
    at: float
    ok: int
    errors: int
    total: int


class ServingLog:
    """The supervisor's running log: "listening", "ready in", and the periodic statistics line."""

    def __init__(
        self,
        *,
        node: NodeStats,
        frontend_alive: Callable[[int], bool],
        worker_ready: Callable[[], bool],
        n_frontends: int,
        queue_depth: Callable[[], int],
        instance_id: str,
        url: str,
        started_at: float,
        stats_interval_s: float,
    ) -> None:
        """``worker_ready``: a worker serves the model (the frontends' /ready condition, while not
        draining); ``started_at``: ``time.monotonic()`` when the command began; ``stats_interval_s``
        0: no statistics line."""
        self.node = node
        self.frontend_alive = frontend_alive
        self.worker_ready = worker_ready
        self.n_frontends = n_frontends
        self.queue_depth = queue_depth
        self.instance_id = instance_id
        self.url = url
        self.started_at = started_at
        self.stats_interval_s = stats_interval_s
        self.listening = False
        self.ready = False
        self._last: _Snapshot | None = None

    def tick(self) -> None:
        now = time.monotonic()
        if not self.listening and all(self.frontend_alive(k) for k in range(self.n_frontends)):
            self.listening = True
            log.info(
                "instance %s listening on %s with %s", self.instance_id, self.url, plural(self.n_frontends, "frontend")
            )
        if self.listening and not self.ready and self.worker_ready():
            self.ready = True
            log.info("ready in %.1f s: %s/v1 is serving", now - self.started_at, self.url)
        if self.stats_interval_s > 0 and self.listening:
            self._stats(now)

    def _snapshot(self, now: float) -> _Snapshot:
        total = self.node.frontend_totals()
        ok = int(total[Counter.REQUESTS_OK])
        errors = sum(
            int(total[c])
            for c in (Counter.REQUESTS_CLIENT_ERROR, Counter.REQUESTS_SERVER_ERROR, Counter.REQUESTS_OVERLOADED)
        )
        return _Snapshot(now, ok, errors, ok + errors + int(total[Counter.CANCELLED]))

    def _stats(self, now: float) -> None:
        if self._last is None:
            self._last = self._snapshot(now)
            return
        if now - self._last.at < self.stats_interval_s:
            return
        current = self._snapshot(now)
        last, self._last = self._last, current
        total = self.node.frontend_totals()
        used = int(total[Counter.ARENA_USED_BYTES])
        size = int(total[Counter.ARENA_SIZE_BYTES])
        log.info(
            "stats: %.1f req/s, %d ok, %d errors in the last %g s; %d in flight, %d queued, "
            "arena %s of %s used, %s ready",
            (current.total - last.total) / (now - last.at),
            current.ok - last.ok,
            current.errors - last.errors,
            round(now - last.at, 1),
            int(total[Counter.IN_FLIGHT]),
            self.queue_depth(),
            format_bytes(used),
            format_bytes(size),
            plural(self.node.live_workers(), "worker"),
        )
