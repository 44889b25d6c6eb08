"""Worker start-up with and without the compiled input normalisation, cold and warm compile caches.

    .venv/bin/python bench/startup.py [--device cpu|cuda] [--runs N] [--json]

Why: ``--compile-normalise`` (worker/backends/efficientnet.py) costs every worker start; in a
container the compile caches die with the container unless ``TORCHINDUCTOR_CACHE_DIR`` (and
``TRITON_CACHE_DIR``) point at a volume. This measures what a worker pays, each case in a fresh
interpreter (as a worker starts), from ``python -c`` to a backend ready to serve:
- ``eager``: import torch, load EfficientNet-Lite0 onto the device (the default);
- ``compile, cold cache``: the same plus compiling the normalisation, with empty cache directories
  (a fresh container, or the first worker);
- ``compile, warm cache``: again with the cache directories the cold run filled (a volume kept
  across restarts, or the second worker on the host).
Each figure is the median wall time of ``--runs`` starts (cold: every run gets new empty directories).
The process prints its own phases; the machine may be shared: read ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import time, sys
t0 = time.perf_counter()
import torch
from shmgate.worker.backends.efficientnet import EfficientNetBackend
t1 = time.perf_counter()
backend = EfficientNetBackend(torch.device(sys.argv[1]), compile_normalise=sys.argv[2] == "1")
if sys.argv[1].startswith("cuda"):
    torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {int(getattr(backend.normalise, 'fused', False))}")
"""


def start_once(device: str, compile_normalise: bool, cache: Path | None) -> dict[str, float]:
    # Prepend the repo: the GPU machine finds the carried wheels through PYTHONPATH too (bench/gpu_run.sh).
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=path)
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
        env["TRITON_CACHE_DIR"] = str(cache / "triton")
    began = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, device, "1" if compile_normalise else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the start-up child failed:\n{out.stderr[-3000:]}")
    total = time.perf_counter() - began
    imports_s, backend_s, fused = out.stdout.split()
    return {"total_s": total, "imports_s": float(imports_s), "backend_s": float(backend_s), "fused": int(fused)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="shmgate-startup-") as tmp:
        warm = Path(tmp) / "warm"
        cases: list[tuple[str, bool, object]] = [
            ("eager", False, None),
            ("compile, cold cache", True, "cold"),
            ("compile, warm cache", True, warm),
        ]
        for name, compile_normalise, cache in cases:
            runs = []
            for k in range(args.runs):
                where = Path(tmp) / f"cold{k}" if cache == "cold" else cache
                if k == 0 and cache is warm:
                    start_once(args.device, True, warm)  # fill it (this is a cold start; not counted)
                runs.append(start_once(args.device, compile_normalise, where))  # type: ignore[arg-type]
            row = {
                "case": name,
                "device": args.device,
                "runs": args.runs,
                **{key: round(statistics.median(r[key] for r in runs), 2) for key in runs[0]},
            }
            rows.append(row)
            print(
                json.dumps(row)
                if args.json
                else f"{name:22} total {row['total_s']:6.2f} s  "
                f"(imports {row['imports_s']:.2f} s, backend ready {row['backend_s']:.2f} s, fused {row['fused']})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
