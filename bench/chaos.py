"""Chaos soak: mixed traffic while workers and frontends are SIGKILLed and SIGSTOPped at random.

    python bench/chaos.py                       # 10 minutes against a server it starts
    python bench/chaos.py --duration-s 40       # the short run tests/test_chaos.py makes
    python bench/chaos.py --json                # one JSON summary line at the end

It starts ``shmgate serve --model checksum`` (2 frontends, 2 workers, ``--stall-timeout-s``
short), warms it up, measures every server process at rest, then runs ``--concurrency`` clients
for ``--duration-s`` seconds. Request i is, by ``i % 10``: a cache hit (one of a few fixed
images; 3 in 10), a miss (unique pixels; 2), a bad input (a rotation of malformed bodies that
must get their 4xx OpenAI error; 1), a streamed answer of 10 pieces (2), or a client that opens a
stream of 200 pieces and hangs up after the first piece (2). Every answer is checked: the digest
the checksum backend reports must be the image's, a streamed answer must be exactly one JSON
document (a duplicated or interleaved answer is not).

Meanwhile a chaos loop picks a random worker or frontend, SIGKILLs or SIGSTOPs it (a stopped one
is resumed after a random 1 to 10 s, unless the supervisor killed it first for stalling), waits
until the node is back at full capacity (every worker ready and every frontend answering, none
stopped), records how long that took, sleeps 1 to 3 s and strikes again.

Verdict (exit 1 on any failure): every request ended, before its deadline, in a correct answer,
a well-formed OpenAI error (in-band for a stream that had started), or, for connections held by
a frontend that was SIGKILLed or stopped, a dropped connection (a dead process cannot answer);
no wrong answer and no hang; arena holds back to 0; per role, fds and threads at the end no
higher than at rest before the chaos; the server stops cleanly and leaves nothing in /dev/shm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from shmgate.shared.channels import SENDER_IDLE_S  # noqa: E402
from tests.serving import data_url, expected_checksum, free_port, noise_png  # noqa: E402

MODEL = "checksum"
# A census waits this long after traffic: a frontend's sender threads exit once idle for SENDER_IDLE_S.
AT_REST_S = SENDER_IDLE_S + 1.0
GRACE_S = 15.0  # past the server's request timeout (+ its 5 s hold grace): a request still open is hung

BAD_BODIES: list[tuple[bytes, int]] = [
    (b"{not json", 400),
    (json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404),
    (
        json.dumps(
            {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!!"}}],
                    }
                ],
            }
        ).encode(),
        400,
    ),
    (
        json.dumps(
            {
                "model": MODEL,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 64, "image/png")},
                            }
                        ],
                    }
                ],
            }
        ).encode(),
        400,
    ),
    (json.dumps({"model": MODEL, "max_tokens": -1, "messages": [{"role": "user", "content": "hi"}]}).encode(), 400),
]


def body(data: bytes, text: str = "hi", stream: bool = False) -> dict[str, object]:
    return {
        "model": MODEL,
        "stream": stream,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": text},
                    {"type": "image_url", "image_url": {"url": data_url(data, "image/png")}},
                ],
            }
        ],
    }


# -- the server -----------------------------------------------------------------------------------


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    n_frontends: int
    n_workers: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def children(self) -> dict[int, str]:
        """pid -> role ("frontend <slot>" | "worker") of the supervisor's children."""
        out = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) != self.process.pid:
                    continue
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except (OSError, ValueError, IndexError):
                continue
            if "frontend" in argv and "--slot" in argv:
                out[int(entry)] = f"frontend {argv[argv.index('--slot') + 1]}"
            elif "worker" in argv:
                out[int(entry)] = "worker"
        return out

    def metric(self, name: str) -> float | None:
        try:
            text = httpx.get(self.url + "/metrics", timeout=2).text
        except httpx.HTTPError:
            return None  # a stopped frontend accepted the connection
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name + " ") or line.startswith(name + "{")
        )

    def at_full_capacity(self) -> bool:
        children = self.children()
        if any(_stopped(pid) for pid in children):
            return False
        frontends = sum(role.startswith("frontend") for role in children.values())
        workers = sum(role == "worker" for role in children.values())
        return (
            frontends == self.n_frontends
            and workers == self.n_workers
            and self.metric("shmgate_workers_ready") == self.n_workers
        )


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _counts(pid: int) -> tuple[int, int] | None:
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = int(
            next(
                line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Threads:")
            ).split()[1]
        )
    except (OSError, StopIteration, ValueError):
        return None
    return fds, threads


def census(server: Server) -> dict[str, tuple[int, int]]:
    """Per role, the most fds and threads any of its processes has (the supervisor's own too)."""
    out: dict[str, tuple[int, int]] = {}
    pids = {server.process.pid: "supervisor", **server.children()}
    for pid, role in pids.items():
        counts = _counts(pid)
        if counts is None:
            continue
        role = "frontend" if role.startswith("frontend") else role
        old = out.get(role, (0, 0))
        out[role] = (max(old[0], counts[0]), max(old[1], counts[1]))
    return out


def start_server(args: argparse.Namespace, log_dir: Path) -> Server:
    port = free_port()
    log_path = log_dir / f"chaos-serve-{port}.log"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shmgate.gateway",
            "serve",
            "--port",
            str(port),
            "--model",
            MODEL,
            "--frontends",
            str(args.frontends),
            "--workers",
            str(args.workers),
            "--arena-size",
            args.arena_size,
            "--stall-timeout-s",
            str(args.stall_timeout_s),
            "--request-timeout-s",
            str(args.request_timeout_s),
        ],
        stdout=open(log_path, "wb"),
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    server = Server(process, port, log_path, args.frontends, args.workers)
    deadline = time.monotonic() + 180
    while not server.at_full_capacity():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the server did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.3)
    return server


# -- traffic ------------------------------------------------------------------------------------------


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    slowest_s: float = 0.0


def _error_code(response: httpx.Response) -> str | None:
    try:
        error = response.json()["error"]
        return str(error["code"]) if {"message", "type", "param", "code"} <= set(error) else None
    except (ValueError, KeyError, TypeError):
        return None


async def _one(client: httpx.AsyncClient, i: int, hits: list[bytes], deadline_s: float, tally: Tally) -> None:
    kind = ("hit", "hit", "hit", "miss", "miss", "bad", "stream", "stream", "hangup", "hangup")[i % 10]
    started = time.monotonic()
    try:
        outcome = await asyncio.wait_for(_request(client, kind, i, hits), deadline_s)
    except TimeoutError:
        outcome = "FAIL:hung"
    except httpx.TransportError as exc:
        outcome = f"dropped:{type(exc).__name__}"
    took = time.monotonic() - started
    tally.slowest_s = max(tally.slowest_s, took)
    tally.outcomes[f"{kind}:{outcome}"] += 1
    if outcome.startswith("FAIL"):
        tally.failures.append(f"{kind} #{i}: {outcome} after {took:.1f} s")


async def _request(client: httpx.AsyncClient, kind: str, i: int, hits: list[bytes]) -> str:
    if kind == "bad":
        payload, status = BAD_BODIES[i // 10 % len(BAD_BODIES)]
        response = await client.post(
            "/v1/chat/completions", content=payload, headers={"content-type": "application/json"}
        )
        if response.status_code == status and _error_code(response):
            return "ok"
        return _clean_or_fail(response)
    data = hits[i % len(hits)] if kind == "hit" else noise_png(1_000_000 + i, size=64)
    if kind in ("hit", "miss"):
        response = await client.post("/v1/chat/completions", json=body(data))
        if response.status_code == 200:
            content = response.json()["choices"][0]["message"]["content"]
            return "ok" if expected_checksum(data) in content else "FAIL:wrong answer"
        return _clean_or_fail(response)
    steps = 10 if kind == "stream" else 200
    async with client.stream(
        "POST", "/v1/chat/completions", json=body(data, f"checksum:trickle {steps}", stream=True)
    ) as response:
        if response.status_code != 200:
            await response.aread()
            return _clean_or_fail(response)
        text = ""
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return f"in-band:{chunk['error'].get('code')}"
            text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
            if kind == "hangup" and text:
                return "ok"  # leaving the block closes the connection mid-stream
    try:
        answer = json.loads(text)
    except ValueError:
        return "FAIL:not one JSON answer (duplicated or cut)"
    return "ok" if answer["tensors"][0]["blake2b"] == expected_checksum(data) else "FAIL:wrong answer"


def _clean_or_fail(response: httpx.Response) -> str:
    code = _error_code(response)
    return f"error:{response.status_code}:{code}" if code else f"FAIL:unclean {response.status_code}"


async def traffic(
    server: Server, concurrency: int, stop: asyncio.Event, deadline_s: float, tally: Tally, hits: list[bytes]
) -> None:
    counter = iter(range(10**9))

    async def client_loop() -> None:
        while not stop.is_set():
            async with httpx.AsyncClient(base_url=server.url, timeout=deadline_s + 5) as client:
                for _ in range(random.randint(1, 20)):  # new connections now and then: new frontends get traffic
                    if stop.is_set():
                        return
                    await _one(client, next(counter), hits, deadline_s, tally)

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))


# -- chaos -------------------------------------------------------------------------------------------------


@dataclass
class Fault:
    at_s: float
    target: str
    action: str
    back_s: float


async def chaos(
    server: Server,
    stop: asyncio.Event,
    started: float,
    faults: list[Fault],
    rng: random.Random,
    frontend_faults: list[float],
) -> None:
    while not stop.is_set():
        await asyncio.sleep(rng.uniform(1.0, 3.0))
        if stop.is_set():
            return
        children = server.children()
        if not children:
            continue
        pid, role = rng.choice(sorted(children.items()))
        action = rng.choice(("SIGKILL", "SIGSTOP"))
        struck = time.monotonic()
        if role.startswith("frontend"):
            frontend_faults.append(struck)
        try:
            os.kill(pid, signal.SIGKILL if action == "SIGKILL" else signal.SIGSTOP)
        except ProcessLookupError:
            continue
        resume = None
        if action == "SIGSTOP":
            resume = asyncio.get_running_loop().call_later(rng.uniform(1.0, 10.0), _resume, pid)
        await asyncio.to_thread(_wait_full_capacity, server, 120.0)
        back = time.monotonic() - struck
        if resume is not None and _stopped(pid):
            resume.cancel()
            _resume(pid)
        faults.append(Fault(struck - started, role, action, back))


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _wait_full_capacity(server: Server, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not server.at_full_capacity():
        if time.monotonic() > deadline:
            raise RuntimeError("the node did not come back to full capacity")
        time.sleep(0.1)


# -- main -----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--frontends", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--arena-size", default="128MiB")
    parser.add_argument("--stall-timeout-s", type=float, default=4.0)
    parser.add_argument("--request-timeout-s", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(seed)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="shmgate-chaos-"))
    deadline_s = args.request_timeout_s + GRACE_S
    hits = [noise_png(500 + k, size=96) for k in range(4)]

    server = start_server(args, log_dir)
    # Only this server's objects: another instance (a test beside this one) may come and go meanwhile.
    instance = re.search(r": instance ([0-9a-f]{16}) \(label ", server.log_path.read_text())
    ours = (
        (f"shmgate.{instance.group(1)}.", f"sem.shmgate.{instance.group(1)}.")
        if instance
        else ("shmgate.", "sem.shmgate.")
    )
    instance_files_before = {e for e in os.listdir("/dev/shm") if e.startswith(ours)}
    failures: list[str] = []
    tally = Tally()
    faults: list[Fault] = []
    frontend_faults: list[float] = []
    before: dict[str, tuple[int, int]] = {}
    after: dict[str, tuple[int, int]] = {}
    elapsed = 0.0
    try:

        async def calm_round(tally_of_round: Tally) -> None:
            """3 s of traffic without faults: warms the servers' lazy pools, so census() compares like with like."""
            stop = asyncio.Event()
            asyncio.get_running_loop().call_later(3.0, stop.set)
            await traffic(server, args.concurrency, stop, deadline_s, tally_of_round, hits)

        asyncio.run(calm_round(Tally()))
        time.sleep(AT_REST_S)
        before = census(server)

        async def run() -> None:
            stop = asyncio.Event()
            started = time.monotonic()
            asyncio.get_running_loop().call_later(args.duration_s, stop.set)
            await asyncio.gather(
                traffic(server, args.concurrency, stop, deadline_s, tally, hits),
                chaos(server, stop, started, faults, rng, frontend_faults),
            )

        run_started = time.monotonic()
        asyncio.run(run())
        elapsed = time.monotonic() - run_started
        for pid in server.children():
            _resume(pid)
        _wait_full_capacity(server, 120.0)
        settle = time.monotonic() + 30
        while (server.metric("shmgate_in_flight_requests"), server.metric("shmgate_arena_held_bytes")) != (0, 0):
            if time.monotonic() > settle:
                failures.append("arena holds or in-flight requests not back to 0 after the chaos")
                break
            time.sleep(0.2)
        # after a short calm round, so replacements have opened their lazy pools as the originals had
        calm = Tally()
        asyncio.run(calm_round(calm))
        time.sleep(AT_REST_S)
        after = census(server)
        for role, (fds, threads) in after.items():
            fds0, threads0 = before.get(role, (0, 0))
            if fds > fds0 or threads > threads0:
                failures.append(f"{role}: fds {fds0} -> {fds}, threads {threads0} -> {threads}")
        failures += [f"calm round: {f}" for f in calm.failures]
    finally:
        for pid in server.children():
            _resume(pid)
        server.process.send_signal(signal.SIGTERM)
        try:
            code = server.process.wait(90)
        except subprocess.TimeoutExpired:
            server.process.kill()
            code = -9
    if code != 0:
        failures.append(f"the server exited with {code} on SIGTERM")
    left = {e for e in os.listdir("/dev/shm") if e.startswith(("shmgate.", "sem.shmgate."))} & instance_files_before
    if left:
        failures.append(f"left in /dev/shm: {sorted(left)}")
    failures += tally.failures
    dropped = sum(n for k, n in tally.outcomes.items() if ":dropped:" in k)
    if dropped and not frontend_faults:
        failures.append(f"{dropped} dropped connections, yet no frontend was struck")

    summary = {
        "seed": seed,
        "duration_s": round(elapsed, 1),
        "requests": sum(tally.outcomes.values()),
        "outcomes": dict(sorted(tally.outcomes.items())),
        "slowest_request_s": round(tally.slowest_s, 1),
        "faults": len(faults),
        "faults_by_kind": dict(Counter(f"{f.target.split()[0]} {f.action}" for f in faults)),
        "back_to_full_capacity_s": {
            "median": round(sorted(f.back_s for f in faults)[len(faults) // 2], 1) if faults else None,
            "max": round(max((f.back_s for f in faults), default=0.0), 1),
        },
        "fds_threads_before": before,
        "fds_threads_after": after,
        "failures": failures,
        "log": str(server.log_path),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"chaos: {summary['requests']} requests in {summary['duration_s']} s, {len(faults)} faults "
            f"{summary['faults_by_kind']} (seed {seed})"
        )
        print(f"outcomes {summary['outcomes']}")
        print(
            f"back to full capacity after each fault: median {summary['back_to_full_capacity_s']['median']} s, "
            f"max {summary['back_to_full_capacity_s']['max']} s; slowest request {summary['slowest_request_s']} s"
        )
        print(f"fds/threads per role before {summary['fds_threads_before']} after {summary['fds_threads_after']}")
        print("OK" if not failures else "FAILED:\n  " + "\n  ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
