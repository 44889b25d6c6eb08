"""The two per-image costs of the embedded model, and the choices they justify.

    .venv/bin/python bench/preprocess_model.py [--rounds N] [--json]

1. Frontend: decode + preprocess of each photo in tests/data/images through the real
   ``EfficientNetPreprocessor`` (writing into a numpy buffer, as into the arena), with JPEG
   ``draft()`` as configured (the default) vs a full decode (``draft_margin=0``).
2. Worker: EfficientNet-Lite0 ms per image at batch 1 and 8, 1 and 2 torch threads, for the
   plain NCHW network vs BatchNorm folded + channels_last (what EfficientNetBackend runs).

Each figure is the median of ``--rounds`` timed runs after a warm-up, measured side by side in
one process, so the ratios compare like with like. The machine may be shared: read ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shmgate.gateway.preprocess.vision import EfficientNetPreprocessor  # noqa: E402
from shmgate.worker.backends.efficientnet import EfficientNetLite0, fold_batchnorms, load_lite0_state_dict  # noqa: E402

IMAGES = Path(__file__).resolve().parent.parent / "tests" / "data" / "images"


def median_ms(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def preprocess_rows(rounds: int) -> list[dict[str, object]]:
    rows = []
    variants = {"draft (default)": EfficientNetPreprocessor(), "full decode": EfficientNetPreprocessor(draft_margin=0)}
    out = np.empty((3, 224, 224), np.uint8)
    for path in sorted(IMAGES.glob("*.jpg")):
        data = path.read_bytes()
        for name, pre in variants.items():
            ms = median_ms(lambda: pre.preprocess_image(data, lambda *_: out, max_pixels=40_000_000), rounds)
            rows.append({"section": "preprocess", "photo": path.name, "variant": name, "ms": round(ms, 2)})
    return rows


def model_rows(rounds: int) -> list[dict[str, object]]:
    state = load_lite0_state_dict()
    plain = EfficientNetLite0()
    plain.load_state_dict(state, strict=True)
    plain.eval()
    folded = EfficientNetLite0()
    folded.load_state_dict(state, strict=True)
    folded.eval()
    fold_batchnorms(folded)
    folded = folded.to(memory_format=torch.channels_last)
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for batch in (1, 8):
            x = torch.randn(batch, 3, 224, 224)
            xl = x.contiguous(memory_format=torch.channels_last)
            with torch.inference_mode():
                for name, model, inp in (("plain NCHW", plain, x), ("BN folded + channels_last", folded, xl)):
                    ms = median_ms(lambda: model(inp), rounds) / batch
                    rows.append(
                        {
                            "section": "model",
                            "variant": name,
                            "threads": threads,
                            "batch": batch,
                            "ms_per_image": round(ms, 2),
                        }
                    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = preprocess_rows(args.rounds) + model_rows(args.rounds)
    for row in rows:
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
