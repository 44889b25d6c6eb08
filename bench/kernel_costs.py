"""``python -m bench kernel-costs``: the two kernels a CPU decode step spends its time in, side by side.

1. A linear layer at the few rows of a decode step: ``nn.Linear`` (MKL's sgemm over the plain weight) against
   oneDNN over a weight packed once (worker/generation/cpu_linear.py). ``--weights`` distinct 512x1376 weights
   are cycled so that they come from memory, as a model's do (40 of them: 113 MB, beyond this machine's L3).
2. Paged decode attention at 300 positions a row (the 8-layer checkpoint's heads: 8 query, 4 KV, 64 wide):
   one SDPA over the rows' blocks gathered into a padded batch (a copy) against one SDPA per row over a view
   of its consecutive blocks (worker/generation/paged.py).

3. The packed linears' memory bandwidth on one torch thread against two (``--threads-compare``): wall clock,
   the two alternated 12 times, the best and the median of each (run it on quiet cores: a second thread
   that another job preempts stalls the first at every operation).

Times of 1 and 2 are this process's CPU time on one torch thread (the work itself, whatever else runs on the
cores); each case runs twice, alternated, and both figures are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any


def _cpu_us(fn: Callable[[], Any], repeats: int, per: int) -> float:
    fn()
    started = time.process_time()
    for _ in range(repeats):
        fn()
    return round((time.process_time() - started) / repeats / per * 1e6, 1)


def linear_costs(weights: int, rows_list: list[int]) -> dict[str, Any]:
    import torch

    from shmgate.worker.generation.cpu_linear import PackedLinear

    plain = [torch.nn.Linear(512, 1376, bias=False) for _ in range(weights)]
    packed = [PackedLinear(layer) for layer in plain]
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for rows in rows_list:
            x = torch.randn(rows, 512)

            def run_plain() -> None:
                for layer in plain:
                    layer(x)

            def run_packed() -> None:
                for layer in packed:
                    layer(x)

            got: dict[str, list[float]] = {"nn.Linear": [], "packed": []}
            for name, fn in (("nn.Linear", run_plain), ("packed", run_packed)) * 2:
                got[name].append(_cpu_us(fn, 10, weights))
            out[f"{rows} rows, us per linear"] = got
    return out


def attention_costs(rows_list: list[int], positions: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    heads, kv_heads, dim, block = 8, 4, 64, 16
    out: dict[str, Any] = {}
    for rows in rows_list:
        blocks = -(-positions // block)
        keys = torch.randn(rows * blocks + 64, block, kv_heads, dim)
        values = torch.randn_like(keys)
        tables = torch.arange(rows * blocks).view(rows, blocks)
        q = torch.randn(rows, heads, 1, dim)
        span = blocks * block
        mask = (torch.arange(span)[None] < positions).view(1, 1, 1, span).expand(rows, 1, 1, span)

        def gathered() -> None:
            kk = keys[tables].view(rows, -1, kv_heads, dim).transpose(1, 2)
            vv = values[tables].view(rows, -1, kv_heads, dim).transpose(1, 2)
            F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=True)

        def views() -> None:
            for r in range(rows):
                first = r * blocks
                kk = keys[first : first + blocks].view(-1, kv_heads, dim)[:positions].transpose(0, 1)[None]
                vv = values[first : first + blocks].view(-1, kv_heads, dim)[:positions].transpose(0, 1)[None]
                F.scaled_dot_product_attention(q[r : r + 1], kk, vv, enable_gqa=True)

        got: dict[str, list[float]] = {"gathered": [], "views": []}
        for name, fn in (("gathered", gathered), ("views", views)) * 2:
            got[name].append(_cpu_us(fn, 20, 1))
        out[f"{rows} rows, us per layer"] = got
    return out


def thread_bandwidth(weights: int, rows_list: list[int]) -> dict[str, Any]:
    import torch

    from shmgate.worker.generation.cpu_linear import PackedLinear

    layers = [PackedLinear(torch.nn.Linear(512, 1376, bias=False)) for _ in range(weights)]
    size = 512 * 1376 * 4
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for rows in rows_list:
            x = torch.randn(rows, 512)
            seen: dict[int, list[float]] = {1: [], 2: []}
            for _ in range(12):
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    started = time.perf_counter()
                    for _ in range(5):
                        for layer in layers:
                            layer(x)
                    seen[threads].append((time.perf_counter() - started) / 5 / weights)
            out[f"{rows} rows, GB/s best / median"] = {
                f"{threads} thread{'s' if threads > 1 else ''}": [
                    round(size / min(times) / 1e9, 1),
                    round(size / sorted(times)[len(times) // 2] / 1e9, 1),
                ]
                for threads, times in seen.items()
            }
    torch.set_num_threads(1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32", help="rows per step, comma-separated")
    p.add_argument("--weights", type=int, default=40, help="distinct weights cycled (40: 113 MB)")
    p.add_argument("--positions", type=int, default=300, help="KV positions per row")
    p.add_argument("--threads-compare", action="store_true", help="only the packed linears on 1 thread against 2")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the worker runs (worker/__main__.py); before torch
    import torch

    torch.set_num_threads(1)
    rows = [int(n) for n in args.rows.split(",")]
    if args.threads_compare:
        print(json.dumps({"clock": "wall", "bandwidth": thread_bandwidth(args.weights, rows)}))
        return 0
    print(
        json.dumps(
            {
                "threads": 1,
                "clock": "process CPU time",
                "linear": linear_costs(args.weights, rows),
                "paged_attention": attention_costs(rows, args.positions),
            }
        )
    )
    return 0
