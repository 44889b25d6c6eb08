"""The latency an ideal scheduler would give at an offered load: a first-come first-served queue in front of c servers.

Why this exists: the latency target is p99 <= 2x p50 in an open loop at 80 % of measured capacity. Part of
any open-loop tail is not the server's doing: Poisson arrivals bunch, and a request that arrives in a
bunch waits for the ones before it, however well they are scheduled. This script says how much of the
tail that is, by simulating the best case for the hardware's measured speed (an M/D/c queue: Poisson
arrivals, c servers, every request served in the same time D, strictly first come first served, no
server idle while a request waits) and comparing it with what a server measured at the same offered
load. A measured tail close to the model's is queueing; the gap above it is the scheduler's.

Where the numbers come from: ``--servers`` is how many requests the machine runs at once (the
shmgate default on 2 cores: 2 workers of one torch thread). D is ``servers / capacity``, where capacity
is the closed-loop req/s the same server measured at high concurrency: at 100 % offered load the model
is exactly as busy as the server was. ``--floor-ms`` is latency a lone request has beyond D (the
network, the hand-offs), added to every request: the c=1 p50 minus D.

Usage:
    python -m bench queue-model --servers 2 --capacity 95 --floor-ms 8 --load 50 80 95
    python -m bench queue-model --servers 2 --floor-ms 8 --from-e2e open.jsonl   # python -m bench e2e --json output

With ``--from-e2e`` every open-loop row of the file is compared with the model at its own offered rate
and the capacity of the closed-loop row before it (same scenario and round).
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
from pathlib import Path
from typing import Any

ARRIVALS = 200_000  # simulated requests per point: quantiles of the model, not of one short run


def ideal_latencies(
    rate: float, servers: int, service_s: float, floor_s: float, *, count: int = ARRIVALS, seed: int = 1
) -> list[float]:
    """Sorted latencies (s) of ``count`` Poisson arrivals at ``rate``/s through an FCFS M/D/``servers`` queue."""
    rng = random.Random(seed)
    free_at = [0.0] * servers  # when each server is next free (a heap)
    now, latencies = 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        start = max(now, heapq.heappop(free_at))
        heapq.heappush(free_at, start + service_s)
        latencies.append(start + service_s - now + floor_s)
    latencies.sort()
    return latencies


def quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def model_point(rate: float, servers: int, capacity: float, floor_ms: float) -> dict[str, float]:
    """p50 / p99 (ms) of the ideal queue at ``rate`` req/s for a machine of ``capacity`` req/s."""
    service_s = servers / capacity
    latencies = ideal_latencies(rate, servers, service_s, floor_ms / 1000)
    p50, p99 = quantile(latencies, 0.50) * 1000, quantile(latencies, 0.99) * 1000
    return {
        "rate": round(rate, 2),
        "load_pct": round(100 * rate / capacity, 1),
        "service_ms": round(service_s * 1000, 2),
        "ideal_p50_ms": round(p50, 1),
        "ideal_p99_ms": round(p99, 1),
        "ideal_ratio": round(p99 / p50, 2),
    }


def from_e2e(path: Path, servers: int, floor_ms: float) -> list[dict[str, Any]]:
    """The model beside every open-loop row of a ``bench/e2e.py --json`` output."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    capacity: dict[tuple[str, int], float] = {}
    out = []
    for row in rows:
        key = (row.get("scenario", "?"), row.get("round", 0))
        if row.get("offered_rate") is None:
            capacity[key] = row["requests_per_s"]
            continue
        if key not in capacity or not row.get("p50_ms"):
            continue
        point = model_point(row["offered_rate"], servers, capacity[key], floor_ms)
        out.append(
            {
                "scenario": key[0],
                "round": key[1],
                **point,
                "p50_ms": row["p50_ms"],
                "p99_ms": row["p99_ms"],
                "ratio": round(row["p99_ms"] / row["p50_ms"], 2),
                "p99_over_ideal": round(row["p99_ms"] / point["ideal_p99_ms"], 2),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=2, help="requests the machine runs at once")
    parser.add_argument("--capacity", type=float, help="closed-loop req/s the server measured")
    parser.add_argument("--floor-ms", type=float, default=0.0, help="a lone request's latency beyond its service")
    parser.add_argument(
        "--load", type=float, nargs="+", default=[50.0, 80.0, 95.0], help="offered load, %% of capacity"
    )
    parser.add_argument(
        "--from-e2e", type=Path, help="compare with the open-loop rows of a python -m bench e2e --json output"
    )
    args = parser.parse_args(argv)
    if args.from_e2e is not None:
        rows = from_e2e(args.from_e2e, args.servers, args.floor_ms)
        print(
            "| scenario | round | offered req/s | load % | ideal p50 / p99 ms | ideal p99/p50 | measured p50 / p99 ms "
            "| measured p99/p50 | measured p99 / ideal p99 |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['scenario']} | {r['round'] + 1} | {r['rate']} | {r['load_pct']} | {r['ideal_p50_ms']} / "
                f"{r['ideal_p99_ms']} | {r['ideal_ratio']} | {r['p50_ms']:.1f} / {r['p99_ms']:.1f} | {r['ratio']} | "
                f"{r['p99_over_ideal']} |"
            )
        return 0
    if args.capacity is None:
        parser.error("--capacity or --from-e2e is needed")
    print("| load % | offered req/s | service ms | ideal p50 ms | ideal p99 ms | p99/p50 |")
    print("|---:|---:|---:|---:|---:|---:|")
    for pct in args.load:
        p = model_point(args.capacity * pct / 100, args.servers, args.capacity, args.floor_ms)
        print(
            f"| {pct:g} | {p['rate']} | {p['service_ms']} | {p['ideal_p50_ms']} | {p['ideal_p99_ms']} | {p['ideal_ratio']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
