"""Draw docs/results_at_a_glance.png: the end-to-end req/s of shmgate, LitServe and the naive server.

The figures are the ones docs/BENCHMARKS.md's "Results at a glance" table quotes (measured by
bench/e2e.py; the dated runs are in docs/benchmarks-history.md): this script only draws them, so the
plot and the table cannot disagree. Needs matplotlib (not a dependency of shmgate):

    python -m venv /tmp/mpl && /tmp/mpl/bin/pip install matplotlib
    /tmp/mpl/bin/python scripts/plot_results.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "docs" / "results_at_a_glance.png"

# req/s, EfficientNet-Lite0, every request a cache miss (1024 px JPEG photos), non-streaming.
CPU_CONCURRENCY = [1, 8, 32]
CPU = {  # 2 vCPUs, quiet machine, 600 requests per point ("End to end", 2026-11-21)
    "shmgate": [39.52, 86.12, 90.23],
    "LitServe": [31.08, 81.34, 85.20],
    "naive FastAPI": [38.86, 58.78, 51.64],
}
GPU_CONCURRENCY = [1, 8, 32, 128]
GPU = {  # one H100, 1 worker, 16 cores, 200 requests per point, two runs: their mean (2026-11-23)
    "shmgate": [(61.8 + 70.1) / 2, (352.9 + 353.3) / 2, (390.0 + 601.4) / 2, (451.7 + 623.5) / 2],
    "LitServe": [(54.3 + 43.9) / 2, (110.2 + 98.1) / 2, (119.2 + 123.4) / 2, (120.9 + 112.0) / 2],
}
STYLE = {"shmgate": "C0", "LitServe": "C1", "naive FastAPI": "C2"}


def main() -> None:
    fig, (cpu, gpu) = plt.subplots(1, 2, figsize=(10, 4))
    for name, values in CPU.items():
        cpu.plot(CPU_CONCURRENCY, values, marker="o", color=STYLE[name], label=name)
    cpu.set_title("CPU: 2 vCPUs, EfficientNet-Lite0")
    for name, values in GPU.items():
        gpu.plot(GPU_CONCURRENCY, values, marker="o", color=STYLE[name], label=name)
    gpu.set_title("GPU: one H100, 1 worker (mean of 2 runs)")
    for ax in (cpu, gpu):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests (closed loop)")
        ax.set_ylabel("requests/s (every image new)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("End to end: shmgate vs LitServe vs a naive FastAPI server (same model code)")
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print(OUT)


if __name__ == "__main__":
    main()
