"""uint8 -> float32 [-1, 1] channels_last input normalisation: which form is fastest on this device.

    .venv/bin/python bench/normalise.py [--rounds N] [--batch 1 8] [--device cpu|cuda] [--threads T] [--json]

Variants, side by side in one process on (N, 3, 224, 224) uint8 tensors already on the device:
- ``eager (served)``: worker/backends/efficientnet.py ``normalise``: reorder the uint8 tensor to
  channels_last, then cast, divide in place, subtract in place;
- ``cast first``: cast, then reorder the float tensor, then the in-place arithmetic;
- ``mul reciprocal``: as served but multiplying by 1/127.5 (not bit-identical: 1 ulp off);
- ``out of place``: the form the compiler gets, run eagerly (allocates per step);
- ``compiled``: ``FusedNormaliser`` (torch.compile, Inductor; on CPU this needs a C++ compiler and
  its compile time is not counted), unless ``--no-compile``.

Each figure is the median of ``--rounds`` timed calls (µs per batch) after a warm-up; on CUDA each
call is timed between CUDA events. The machine may be shared: read ratios, not absolutes.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as worker/__main__.py: before torch is imported

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shmgate.worker.backends.efficientnet import (
    PIXEL_SCALE,
    FusedNormaliser,
    _normalise_out_of_place,
    normalise,
)


def cast_first(pixels: torch.Tensor) -> torch.Tensor:
    return pixels.to(torch.float32).contiguous(memory_format=torch.channels_last).div_(PIXEL_SCALE).sub_(1.0)


def mul_reciprocal(pixels: torch.Tensor) -> torch.Tensor:
    x = pixels.contiguous(memory_format=torch.channels_last)
    return x.to(torch.float32).mul_(1.0 / PIXEL_SCALE).sub_(1.0)


def median_us(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rounds: int) -> float:
    fn(x)
    times = []
    for _ in range(rounds):
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "eager (served)": normalise,
        "cast first": cast_first,
        "mul reciprocal": mul_reciprocal,
        "out of place": _normalise_out_of_place,
    }
    if not args.no_compile:
        fused = FusedNormaliser()
        with torch.inference_mode():
            t0 = time.perf_counter()
            fused.warm_up(device)
            compile_s = time.perf_counter() - t0
        if fused.fused:
            variants["compiled"] = fused
            print(f"compiled in {compile_s:.1f} s", file=sys.stderr)
        else:
            print("compiling failed (see the warning); no 'compiled' row", file=sys.stderr)
    with torch.inference_mode():
        for batch in args.batch:
            x = torch.randint(0, 256, (batch, 3, 224, 224), dtype=torch.uint8, device=device)
            reference = normalise(x)
            for name, fn in variants.items():
                err = (fn(x) - reference).abs().max().item()
                row = {
                    "device": device.type,
                    "batch": batch,
                    "variant": name,
                    "us_per_batch": round(median_us(fn, x, args.rounds), 1),
                    "max_abs_diff": err,
                }
                print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
