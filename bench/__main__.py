"""``python -m bench <scenario> [options]``: run one scenario of the benchmark suite.

Run it from the repository root (bench/ is not installed). ``python -m bench`` lists the scenarios,
``python -m bench <scenario> --help`` gives a scenario's options. Each scenario is a module with a
``main(argv) -> int``; ``SCENARIOS`` below is the whole list, and a module is imported only when its
scenario runs, so one scenario's dependencies (torch, CUDA) never load for another.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Callable
from typing import cast

# scenario -> (module, what it measures). docs/BENCHMARKS.md has the command and figures of each.
SCENARIOS: dict[str, tuple[str, str]] = {
    "handoff": (
        "bench.handoff",
        "one tensor between two processes: the descriptor path against a pickled queue and memcpy",
    ),
    "e2e": ("bench.e2e", "shmgate against a naive app and LitServe, end to end: req/s, latency, server CPU"),
    "vlm-serving": ("bench.vlm_serving", "a VLM's TTFT idle, behind a long answer and in a Poisson mix (who waits)"),
    "kernel-costs": (
        "bench.kernel_costs",
        "a CPU decode step's two kernels: packed oneDNN linears and per-row paged attention against the plain ones",
    ),
    "prefix-reuse": (
        "bench.prefix_reuse",
        "a multi-turn chat's TTFT with and without its earlier turn's prompt KV, in process",
    ),
    "encoder-share": (
        "bench.encoder_share",
        "a vision tower's time per image against sharing its output between workers",
    ),
    "grammar-cost": ("bench.grammar_cost", "a response_format or tool grammar's cost per generated token, in process"),
    "tool-families": ("bench.tool_families", "every chat family's tiny model writing tool calls under the grammar"),
    "schema-corpus": (
        "bench.schema_corpus",
        "real-world JSON Schemas as response_format: accepted, refused, valid, cut; the largest's compile time",
    ),
    "gateway-cost": ("bench.gateway_cost", "shmgate's own CPU per request against floor servers and LitServe"),
    "hf-processing": ("bench.hf_processing", "a tiny VLM: shmgate against a naive transformers server"),
    "preprocess-model": ("bench.preprocess_model", "the frontends' decode and the model's CPU per image"),
    "startup": ("bench.startup", "a worker's start-up time, from a fresh interpreter to a ready backend"),
    "fidelity": ("bench.fidelity", "the classifier's fast preprocessing paths against a reference"),
    "queue-model": ("shmgate.bench_client.queue_model", "the ideal M/D/c queue's latency beside open-loop results"),
    "video": ("bench.video", "videos/s and TTFT: shmgate's frontends against the processor in one request path"),
    "batch-lane": ("bench.batch_lane", "interactive p50/p99 idle and with a Batch API batch running (the bulk lane)"),
    "chaos": ("bench.chaos", "mixed traffic while workers and frontends are killed and stopped"),
    "soak": ("bench.soak", "many hits, misses and bad inputs, then proof that nothing accumulated"),
    "scaleout": ("bench.scaleout", "two units in pods behind nginx, a rolling restart under load (root)"),
    "gpu": ("bench.gpu", "H2D copies out of the arena, and serving on a GPU (bench/gpu_run.sh runs it)"),
}


def usage() -> str:
    width = max(map(len, SCENARIOS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in SCENARIOS.items()]
    return "usage: python -m bench <scenario> [options]   (from the repository root)\n\nscenarios:\n" + "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SCENARIOS:
        close = difflib.get_close_matches(name, SCENARIOS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"unknown scenario {name!r}{hint}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv[0] = f"python -m bench {name}"  # argparse's usage line names the command people type
    run = cast(Callable[[list[str]], "int | None"], importlib.import_module(SCENARIOS[name][0]).main)
    return run(rest) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
