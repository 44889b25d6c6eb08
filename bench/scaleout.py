"""Scale-out on one machine: two shmgate units behind nginx, then a rolling restart under load.

Each unit is what one Kubernetes pod runs (deploy/k8s/base): a gateway container and a worker
container in their own IPC and mount namespace with a fresh /dev/shm (bench_client/pods.py), so the two
units share nothing but the machine, as two pods on two nodes would share nothing but the network.
nginx from Debian's packages stands in for the ingress/Service: it spreads requests over both units
and, like an ingress whose endpoint list lags, passes a request that a draining or not-yet-ready unit
turns away (503) or refuses (connection error) to the other unit.

The load is the project's load generator (`shmgate bench`, bench_client/loadgen.py) through the proxy, run
in back-to-back rounds so that it covers the whole restart. Phases:
  1. steady: both units under load (throughput of two units);
  2. rolling restart: for each unit in turn, SIGTERM to its gateway and worker at once (the kubelet's
     way; the worker follows the drain), wait for both to exit, start it again, wait until /ready;
     the load keeps running throughout. The outcome is the number of failed requests (the goal: 0).

    sudo .venv/bin/python -m bench scaleout --model efficientnet-lite0 --steady-s 20 --concurrency 16 --json

Needs root (namespaces) and nginx (`apt-get install nginx`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import load
from bench.servers import REPO, free_port
from shmgate.bench_client import loadgen
from shmgate.bench_client.pods import Container, Pod, gateway_argv, pods_unavailable, terminate_together, worker_argv

IMAGES = REPO / "tests" / "data" / "images"
SHM_BYTES = 80 * 2**20


def ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


@dataclass
class Unit:
    """One pod's worth of shmgate: a gateway and a worker container in a fresh pod, on a fixed port."""

    name: str
    port: int
    model: str
    log_dir: Path
    frontends: int = 1
    worker_threads: int = 1
    pod: Pod | None = None
    gateway: Container | None = None
    worker: Container | None = None
    starts: int = 0
    failed_logs: list[str] = field(default_factory=list)

    def start(self, timeout_s: float = 180) -> float:
        """Start the pod and its two containers; the seconds until /ready."""
        started = time.monotonic()
        self.starts += 1
        self.pod = Pod(f"{self.name}-{self.starts}", SHM_BYTES, self.log_dir).__enter__()
        self.gateway = self.pod.run(
            "gateway",
            gateway_argv(self.port, label=self.name, model=self.model, frontends=self.frontends, drain_timeout_s=30),
        )
        argv = worker_argv(label=self.name, model=self.model, follow_drain_s=40)
        argv[argv.index("--threads") + 1] = str(self.worker_threads)
        self.worker = self.pod.run("worker", argv)
        wait_for(
            lambda: ready(self.port) or not self.gateway.alive() or not self.worker.alive(),
            timeout_s,
            f"{self.name} ready",
        )
        if not ready(self.port):
            raise RuntimeError(f"{self.name} did not start:\n{self.gateway.log()}\n{self.worker.log()}")
        return time.monotonic() - started

    def drain(self, timeout_s: float = 90) -> tuple[int, int, float]:
        """SIGTERM to both containers at once; (gateway exit code, worker exit code, seconds to exit). A
        container that exits other than 0 leaves its log's tail in ``self.failed_logs``."""
        assert self.pod and self.gateway and self.worker
        started = time.monotonic()
        terminate_together(self.gateway, self.worker)
        codes = (self.gateway.wait(timeout_s), self.worker.wait(timeout_s))
        took = time.monotonic() - started
        for container, code in zip((self.gateway, self.worker), codes):
            if code != 0:
                self.failed_logs.append(container.log()[-1500:])
        self.pod.__exit__(None, None, None)
        self.pod = None
        return codes[0], codes[1], took

    def stop(self) -> None:
        if self.pod is not None:
            self.pod.__exit__(None, None, None)
            self.pod = None


NGINX_CONF = """
worker_processes 1;
daemon off;
user root;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    # only answers >= 500 are logged, with every upstream tried and what each said
    map $status $failed {{ ~^5 1; default 0; }}
    log_format tried '$time_iso8601 $status upstreams=$upstream_addr statuses=$upstream_status';
    access_log {dir}/failed.log tried if=$failed;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    client_max_body_size 64m;
    client_body_buffer_size 1m;
    upstream units {{
{servers}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://units;
            proxy_set_header Host $host;  # the client's name (127.0.0.1): units on loopback refuse others (421)
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_read_timeout 120s;
            # A unit that is draining or has no worker yet answers 503 before starting the request, and
            # a stopped one refuses the connection: both are safe to send to the other unit, POST or not.
            proxy_next_upstream error timeout http_502 http_503 non_idempotent;
            proxy_next_upstream_tries 4;
        }}
    }}
}}
"""


@dataclass
class Proxy:
    """nginx in the foreground, spreading requests over the units' ports."""

    port: int
    upstream_ports: list[int]
    work_dir: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        nginx = shutil.which("nginx") or "/usr/sbin/nginx"
        # max_fails=0: never mark a unit down for a while. A unit that was turned away while it restarted
        # would otherwise still be "down" when the next one drains, and with both down nginx answers 502.
        # Kubernetes' readiness-driven endpoints do not have that lag; trying each unit in turn is closer.
        servers = "\n".join(f"        server 127.0.0.1:{p} max_fails=0;" for p in self.upstream_ports)
        conf = self.work_dir / "nginx.conf"
        conf.write_text(NGINX_CONF.format(dir=self.work_dir, servers=servers, port=self.port))
        self.process = subprocess.Popen(
            [nginx, "-c", str(conf), "-p", str(self.work_dir)],
            stdout=subprocess.DEVNULL,
            stderr=open(self.work_dir / "stderr.log", "wb"),
        )
        wait_for(lambda: self._listening() or self.process.poll() is not None, 20, "nginx listening")
        if self.process.poll() is not None:
            raise RuntimeError("nginx did not start: " + (self.work_dir / "stderr.log").read_text())

    def _listening(self) -> bool:
        try:
            httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1)
            return True
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


@dataclass
class LoadLoop:
    """`shmgate bench` rounds through the proxy, back to back, until stopped; results per round."""

    base_url: str
    model: str
    concurrency: int
    requests: int
    rounds: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> LoadLoop:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.rounds.append(self.round())

    def round(self) -> dict[str, Any]:
        """One `shmgate bench` run (bench_client/loadgen.py, in this process so rounds follow each other
        without an interpreter start between them; no warm-up: every request counts)."""
        started = time.monotonic()
        every_request = ("--warmup", "0", "--timeout", "120")
        args = load.options(
            self.base_url, self.model, IMAGES, concurrency=self.concurrency, requests=self.requests, flags=every_request
        )
        try:
            result = asyncio.run(loadgen.run(args))
        except Exception as exc:  # a load generator that broke is a failed run, never a silent one
            self.failures.append(f"{type(exc).__name__}: {exc}")
            result = {"requests": 0, "errors": 0, "errors_by_kind": {}, "mismatches": 0, "duration_s": 0.0}
        result["started_at"], result["ended_at"] = started, time.monotonic()
        return result

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(660)


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    requests = sum(r["requests"] for r in rounds)
    wall = sum(r["duration_s"] for r in rounds)
    errors: Counter[str] = Counter()
    for r in rounds:
        errors.update(r["errors_by_kind"])
    return {
        "rounds": len(rounds),
        "requests": requests,
        "errors": sum(errors.values()),
        "errors_by_kind": dict(errors),
        "mismatches": sum(r["mismatches"] for r in rounds),
        "requests_per_s": round(requests / wall, 1) if wall else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    reason = pods_unavailable()
    if reason:
        raise SystemExit(f"scaleout: {reason}")
    with ExitStack() as stack:
        if args.work_dir:
            work = Path(args.work_dir)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="shmgate-scaleout-")))
        units = [
            Unit(
                f"unit{i}", free_port(), args.model, work, frontends=args.frontends, worker_threads=args.worker_threads
            )
            for i in range(2)
        ]
        for unit in units:
            stack.callback(unit.stop)
            unit.start()
        proxy = Proxy(free_port(), [u.port for u in units], work)
        stack.callback(proxy.stop)
        proxy.start()
        base_url = f"http://127.0.0.1:{proxy.port}"
        traffic = LoadLoop(base_url, args.model, args.concurrency, args.requests)
        traffic.round()  # warm-up: models, caches, keep-alive connections; not counted
        traffic.start()
        stack.callback(traffic.stop)
        time.sleep(args.steady_s)
        steady = list(traffic.rounds)
        restarts = []
        began = time.monotonic()
        for unit in units:
            gateway_code, worker_code, drain_s = unit.drain()
            ready_s = unit.start()
            restarts.append(
                {
                    "unit": unit.name,
                    "gateway_exit": gateway_code,
                    "worker_exit": worker_code,
                    "drain_s": round(drain_s, 2),
                    "ready_s": round(ready_s, 2),
                    **({"failed_logs": unit.failed_logs} if unit.failed_logs else {}),
                }
            )
            time.sleep(args.settle_s)
        ended = time.monotonic()
        traffic.stop()
        during = traffic.rounds[len(steady) :]
        # the traffic covered the whole restart: a round was running when it began, and one after it ended
        covered = bool(during) and during[0]["started_at"] <= began and during[-1]["ended_at"] >= ended
        return {
            "model": args.model,
            "units": 2,
            "frontends_per_unit": args.frontends,
            "worker_threads": args.worker_threads,
            "concurrency": args.concurrency,
            "proxy": "nginx",
            "steady": summarize(steady),
            "rolling_restart": {
                "restarts": restarts,
                "duration_s": round(ended - began, 2),
                "load_covered_it": covered,
                **summarize(during),
            },
            "bench_failures": traffic.failures,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checksum", help="checksum (test model) or efficientnet-lite0")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=200, help="requests per `shmgate bench` round")
    parser.add_argument("--steady-s", type=float, default=10.0, help="load before the rolling restart")
    parser.add_argument("--settle-s", type=float, default=2.0, help="load between and after the restarts")
    parser.add_argument("--frontends", type=int, default=1, help="frontends per unit")
    parser.add_argument("--worker-threads", type=int, default=1, help="torch threads of each unit's worker")
    parser.add_argument("--work-dir", help="keep the logs (units, nginx) here instead of a temporary folder")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    ok = result["rolling_restart"]["errors"] == 0 and result["steady"]["errors"] == 0 and not result["bench_failures"]
    return 0 if ok else 1
