"""EfficientNet-Lite0 on CPU: milliseconds per image against the forward pass size.

    .venv/bin/python bench/cpu_passes.py [--seconds S] [--passes 1 2 4 8] [--json]

Each point runs 8 images through ``EfficientNetBackend.classify`` in passes of P images, in one
process and in two processes side by side (the default CPU layout: two workers of one torch
thread), for S seconds, and reports ms per image. This is what ``CPU_PASS_IMAGES_PER_THREAD`` in
worker/backends/efficientnet.py was chosen from: on a 2-core machine, passes of 8 cost ~40 %
more per image than passes of 2 (activations outgrow the caches).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
IMAGES_PER_ROUND = 8


def backend_and_pixels(images: int) -> tuple[Any, list[Any]]:
    """The served model on one torch thread, and ``images`` fixed random 224x224 images (seed 0).

    Shared with bench/huge_pages.py: both measure the CPU worker's pass on the same inputs.
    """
    import torch

    from shmgate.worker.backends.efficientnet import EfficientNetBackend

    backend = EfficientNetBackend(torch.device("cpu"), threads=1)
    generator = torch.Generator().manual_seed(0)
    return backend, [
        torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8, generator=generator) for _ in range(images)
    ]


def children_side_by_side(
    script: str, child_args: list[str], processes: int, env: dict[str, str] | None = None
) -> list[str]:
    """The output of ``processes`` fresh ``script --child ...`` processes started together.

    Side by side, as the default CPU layout runs two workers of one torch thread.
    """
    argv = [sys.executable, script, "--child", *child_args]
    children = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env) for _ in range(processes)]
    return [child.communicate()[0] for child in children]


def measure(pass_images: int, seconds: float) -> float:
    """ms per image for this process, running rounds of 8 images in passes of ``pass_images``."""
    backend, pixels = backend_and_pixels(IMAGES_PER_ROUND)
    backend.pass_images = pass_images
    backend.classify(pixels)  # warm-up
    images = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        backend.classify(pixels)
        images += IMAGES_PER_ROUND
    return (time.perf_counter() - started) / images * 1000


def side_by_side(pass_images: int, processes: int, seconds: float) -> list[float]:
    """ms per image of each of ``processes`` processes measuring at the same time."""
    return [
        float(out) for out in children_side_by_side(__file__, [str(pass_images), "--seconds", str(seconds)], processes)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--passes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(REPO))
        print(measure(args.child, args.seconds))
        return
    rows = []
    for pass_images in args.passes:
        for processes in (1, 2):
            ms = side_by_side(pass_images, processes, args.seconds)
            mean_ms = round(sum(ms) / len(ms), 1)
            rows.append({"pass_images": pass_images, "processes": processes, "ms_per_image": mean_ms})
            if args.json:
                print(json.dumps(rows[-1]), flush=True)
    if not args.json:
        print("| pass images | ms/image, 1 process | ms/image, 2 processes side by side |")
        print("|---:|---:|---:|")
        for pass_images in args.passes:
            one, two = (r["ms_per_image"] for r in rows if r["pass_images"] == pass_images)
            print(f"| {pass_images} | {one} | {two} |")


if __name__ == "__main__":
    main()
