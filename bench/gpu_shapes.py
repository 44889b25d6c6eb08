"""What a new batch size costs on a GPU, and whether an image's answer depends on its batch.

    python bench/gpu_shapes.py [--device cuda] [--max-batch 16] [--json]

Two questions the first GPU run raised (docs/benchmarks-history.md, "GPU"): end to end, both shmgate and
LitServe showed multi-second p99s with a median of tens of ms, and the same photo got answers that
differed in the fourth decimal from one request to the next. Suspects: the first forward pass at each
new batch size loads or compiles kernels (cuDNN, lazy CUDA modules), and the convolution algorithm
(and TF32) that cuDNN picks per batch size changes the numerics.

For each numerics setting (torch's defaults, TF32 off), in a fresh process each, this runs the
embedded model through ``EfficientNetBackend.classify`` at every batch size 1..max (each batch is the
test photos repeated), timing the first and the second pass at each size, and counts the images
whose top-5 text (what the server sends, 4 decimals) differs from the same photo's answer at batch 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SETTINGS = ("default", "tf32-off", "padded")


def probe(device_name: str, max_batch: int, setting: str) -> list[dict[str, object]]:
    """Runs in its own process, so every setting starts with cold kernels."""
    import numpy as np
    import torch

    from shmgate.gateway.preprocess.vision import EfficientNetPreprocessor
    from shmgate.worker.backends.efficientnet import EfficientNetBackend

    if setting == "tf32-off":
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device(device_name)
    backend = EfficientNetBackend(device)
    pre = EfficientNetPreprocessor()
    photos = []
    for path in sorted((REPO / "tests" / "data" / "images").glob("*.jpg")):
        out = np.empty((3, 224, 224), np.uint8)
        pre.preprocess_image(path.read_bytes(), lambda *_, out=out: out, max_pixels=40_000_000)
        photos.append(torch.from_numpy(out))

    def answers(batch: list[torch.Tensor]) -> tuple[list[str], float]:
        if setting == "padded":  # always a pass of max_batch images: one shape, one algorithm
            batch = batch + [batch[0]] * (max_batch - len(batch))
        start = time.perf_counter()
        probs, labels = backend.classify(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        text = [" ".join(f"{label}:{p:.4f}" for p, label in zip(ps, ls)) for ps, ls in zip(probs, labels)]
        return text, ms

    solo = [answers([photo])[0][0] for photo in photos]
    rows = []
    for size in range(1, max_batch + 1):
        batch = [photos[i % len(photos)] for i in range(size)]
        text, first_ms = answers(batch)
        _, second_ms = answers(batch)
        differ = sum(t != solo[i % len(photos)] for i, t in enumerate(text[:size]))
        rows.append(
            {
                "setting": setting,
                "batch": size,
                "first_ms": round(first_ms, 2),
                "second_ms": round(second_ms, 2),
                "differ_from_batch1": differ,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(probe(args.device, args.max_batch, args.child)))
        return 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for setting in SETTINGS:
        out = subprocess.run(
            [sys.executable, __file__, "--device", args.device, "--max-batch", str(args.max_batch), "--child", setting],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if out.returncode != 0:
            print(f"{setting}: failed\n{out.stderr[-3000:]}", file=sys.stderr)
            return 1
        for row in json.loads(out.stdout.splitlines()[-1]):
            print(
                json.dumps(row)
                if args.json
                else f"{row['setting']:9} batch {row['batch']:3}  first {row['first_ms']:9.2f} ms  "
                f"second {row['second_ms']:8.2f} ms  answers differing from batch 1: {row['differ_from_batch1']}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
