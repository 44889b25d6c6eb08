"""The tail at c = 32 as another closed-loop client sees it: wrk (C, its own connection handling) on cache misses.

    python bench/wrk_tail.py [--server shmgate ...] [--variant NAME=FLAGS ...] [--rounds 3] [--seconds 20]
                             [--connections 32] [--background-cores 1] [--model efficientnet-lite0]

Why: bench/e2e.py's own load generator (bench_client/loadgen.py) opens its connections as its first
requests go out, and its loaded figures (p99/p50 1.1-1.3) did not carry over to a tester's client,
which saw 1.8-3.2 at c = 32 with a core of background load. wrk opens all its connections at once
and keeps them, so this also shows how the frontends share a burst of new connections.
Each request is a miss: the body is the photo's data URL with a per-request nonce appended (8 base64
characters after bytes padded to a multiple of 3, so the pixels and the answer are the same and the
bytes never repeat; bench_client/loadgen.py's ``--unique`` does the same in Python). Servers alternate
per round; ``--background-cores`` spins that many cores while wrk runs (bench/disturb.py). Prints per
run req/s, p50, p99 (wrk's --latency), p99/p50, non-2xx answers, and for shmgate the share of the
busiest frontend in the frontends' CPU (from /proc, as bench/gateway_cost.py does).
Needs wrk (``apt-get install wrk``) and, for LitServe, bench/setup_litserve.sh.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.disturb import Disturbance  # noqa: E402
from bench.e2e import IMAGES, LITSERVE_PYTHON, ServerProcess, free_port  # noqa: E402
from bench.gateway_cost import parse_variant, role_cpu_ticks  # noqa: E402
from shmgate.bench_client import loadgen  # noqa: E402

# The request: one photo, the nonce spliced in as 8 base64 characters (6 bytes after the padded image).
LUA = r"""
local function slurp(path)
  local f = assert(io.open(path, "rb")); local s = f:read("*a"); f:close(); return s
end
local prefix, suffix = slurp("{dir}/prefix"), slurp("{dir}/suffix")
local alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
local counter = 0
local thread_id = 0
local threads = 0
function setup(thread) thread:set("id", threads); threads = threads + 1 end
local base = 0
function init(args) thread_id = tonumber(id) or 0; base = tonumber(args[1]) or 0 end
local function nonce(n)
  local out = {{}}
  for i = 1, 8 do local d = n % 64; out[i] = alphabet:sub(d + 1, d + 1); n = math.floor(n / 64) end
  return table.concat(out)
end
request = function()
  counter = counter + 1
  local body = prefix .. nonce(base + thread_id * 1000000000 + counter) .. suffix
  return wrk.format("POST", "/v1/chat/completions", {{["Content-Type"] = "application/json"{close}}}, body)
end
"""


@dataclass(frozen=True)
class Server:
    command: tuple[str, ...]
    ready_path: str


SHMGATE = ("{bin}/shmgate", "serve", "--host", "127.0.0.1", "--port", "{port}", "--model", "{model}")
SERVERS: dict[str, Server] = {
    "shmgate": Server(SHMGATE, "/ready"),
    "litserve": Server(("{litserve_python}", "{repo}/bench/litserve_server.py", "--port", "{port}"), "/health"),
}


def write_request(folder: Path, model: str) -> None:
    """prefix + nonce + suffix is one chat request for the first photo (JSON as the load generator sends)."""
    image = loadgen.load_images(IMAGES[0].parent)[0]
    template = loadgen.BodyTemplate(model, stream=False, max_tokens=None)
    before, after = template.render(f"data:{image.mime};base64,{image.b64}NONCE___").split(b"NONCE___")
    (folder / "prefix").write_bytes(before)
    (folder / "suffix").write_bytes(after)


def lua_script(folder: Path, *, fresh: bool = False) -> Path:
    # wrk's setup() runs once per thread in the main Lua state, so its counter numbers the threads
    script = LUA.format(dir=folder, close=', ["Connection"] = "close"' if fresh else "")
    path = folder / "misses.lua"
    path.write_text(script)
    return path


def _base() -> str:
    """A random start for a wrk run's nonces, far below 64**8 and far apart from any other run's."""
    return str(random.randrange(1 << 20) << 26)


def parse_wrk(out: str) -> dict[str, float]:
    """req/s, p50 and p99 in ms, and non-2xx answers from wrk --latency's report."""

    def ms(text: str) -> float:
        value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
        return float(value) * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]

    latency = dict(re.findall(r"^\s*(50|99)(?:\.0+)?%\s+([\d.]+(?:us|ms|s|m))\s*$", out, re.M))
    if set(latency) != {"50", "99"}:
        raise RuntimeError(f"no latency distribution in wrk's report:\n{out}")
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {
        "requests_per_s": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
        "p50_ms": ms(latency["50"]),
        "p99_ms": ms(latency["99"]),
        "non_2xx": int(non_2xx.group(1)) if non_2xx else 0,
        "socket_errors": sum(int(x) for x in errors.groups()) if errors else 0,
    }


def frontend_ticks(root: int) -> dict[int, int]:
    """Each frontend of the server's tree: its CPU ticks so far."""
    return {pid: ticks for pid, (role, ticks) in role_cpu_ticks(root).items() if role == "frontend"}


async def run_one(name: str, server: Server, args: argparse.Namespace, folder: Path, script: Path) -> dict:
    port = free_port()
    fields = {
        "bin": str(Path(sys.executable).parent),
        "port": str(port),
        "model": args.model,
        "repo": str(REPO),
        "litserve_python": str(args.litserve_python),
    }
    argv = [part.format(**fields) for part in server.command]
    process = ServerProcess(argv, folder / f"{name}.log")
    process.start()
    try:
        await process.wait_ready(f"http://127.0.0.1:{port}{server.ready_path}", 240.0)
        url = f"http://127.0.0.1:{port}"
        # every wrk run numbers its requests from a base of its own: a nonce sent before would be a cache hit
        warm = ["wrk", "-t2", f"-c{args.connections}", "-d3s", "-s", str(script), url, "--", _base()]
        subprocess.run(warm, capture_output=True, text=True, check=True)  # warm-up: its own connections
        before = frontend_ticks(process.pid)
        with Disturbance(args.background_cores):
            command = [
                "wrk",
                "-t2",
                f"-c{args.connections}",
                f"-d{args.seconds}s",
                "--timeout",
                "30s",
                "--latency",
                "-s",
                str(script),
                url,
                "--",
                _base(),
            ]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        after = frontend_ticks(process.pid)
        result = {"server": name, **parse_wrk(out)}
        deltas = [after[pid] - before.get(pid, 0) for pid in after]
        if len(deltas) > 1 and sum(deltas):
            result["busiest_frontend_share"] = round(max(deltas) / sum(deltas), 2)
        return result
    finally:
        process.stop()


def add_variant(spec: str) -> str:
    name, flags = parse_variant(spec, SERVERS)
    SERVERS[name] = Server(SHMGATE + flags, "/ready")
    return name


async def main_async(args: argparse.Namespace) -> int:
    names = list(args.server or ["shmgate", "litserve"]) + [add_variant(v) for v in args.variant]
    if "litserve" in names and not args.litserve_python.exists():
        print(f"skipping litserve: {args.litserve_python} is missing (bench/setup_litserve.sh)", file=sys.stderr)
        names.remove("litserve")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="shmgate-wrk-") as tmp:
        folder = Path(tmp)
        write_request(folder, args.model)
        script = lua_script(folder, fresh=args.fresh_connections)
        for round_index in range(args.rounds):
            order = names if round_index % 2 == 0 else names[::-1]
            for name in order:
                row = {"round": round_index + 1, **await run_one(name, SERVERS[name], args, folder, script)}
                row["load"] = round(os.getloadavg()[0], 2)
                rows.append(row)
                print(
                    f"  round {row['round']} {name:<16} {row['requests_per_s']:7.1f} req/s  p50 {row['p50_ms']:7.1f}"
                    f"  p99 {row['p99_ms']:7.1f} ms  p99/p50 {row['p99_ms'] / row['p50_ms']:.2f}"
                    f"  non-2xx {row['non_2xx']}  busiest frontend {row.get('busiest_frontend_share', '-')}",
                    flush=True,
                )
    print("\n| server | round | req/s | p50 ms | p99 ms | p99/p50 | non-2xx | busiest frontend's CPU share |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['server']} | {row['round']} | {row['requests_per_s']:.1f} | {row['p50_ms']:.0f} | {row['p99_ms']:.0f}"
            f" | {row['p99_ms'] / row['p50_ms']:.2f} | {row['non_2xx']} | {row.get('busiest_frontend_share', '-')} |"
        )
    for name in names:
        ratios = [r["p99_ms"] / r["p50_ms"] for r in rows if r["server"] == name]
        print(f"{name}: p99/p50 median {statistics.median(ratios):.2f}, worst {max(ratios):.2f}", file=sys.stderr)
    return 1 if any(r["non_2xx"] or r["socket_errors"] for r in rows) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", action="append", help="shmgate, litserve (default both), or a --variant's NAME")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS", help="shmgate with FLAGS")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--background-cores", type=float, default=1.0)
    parser.add_argument("--model", default="efficientnet-lite0")
    parser.add_argument(
        "--fresh-connections",
        action="store_true",
        help="every request on a new connection (Connection: close): how the frontends share accepts",
    )
    parser.add_argument("--litserve-python", type=Path, default=LITSERVE_PYTHON)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed: apt-get install wrk")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
