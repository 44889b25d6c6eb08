"""``python -m shmgate.worker``: the command the supervisor runs for each worker, and docker compose too.

Started by ``shmgate serve``, a worker reads its whole configuration from its environment
(shared/options.py ``child_config``); started by hand or by compose, it parses its flags, each of which
also reads a ``SHMGATE_*`` environment variable (flags win).
"""

from __future__ import annotations

import os

# Before torch is imported: OpenMP threads that spin-wait between parallel regions burn the
# cores the frontends need for decoding (measured: 8 ms of worker CPU per checksum request
# with the default policy). Passive waiting costs a few microseconds of wake-up instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# torch's CPU allocator puts tensors of 2 MiB and more on transparent huge pages only when asked
# (and only where /sys/kernel/mm/transparent_hugepage/enabled is not "never"). With the model's
# weights and activations on 2 MiB pages, EfficientNet-Lite0 ran a pass of 2 images in about a
# quarter less CPU, in every process start (docs/benchmarks-history.md, "huge pages for the model"; fewer
# TLB misses is the likely reason, not measured).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from shmgate.shared.errors import EXIT_USAGE  # noqa: E402
from shmgate.shared.flags import ShmgateParser, origin, version  # noqa: E402
from shmgate.shared.options import add_options, child_config, from_args  # noqa: E402
from shmgate.worker.config import WorkerConfig, worker_options  # noqa: E402
from shmgate.worker.main import run_worker  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = ShmgateParser(
        prog="shmgate worker",
        description="Run one model worker, attached to a running "
        "gateway (shmgate gateway or serve) found by --label or --instance. Every flag also "
        "reads the SHMGATE_* variable shown with it; the flag wins.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    add_options(parser, WorkerConfig)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def cuda_problem(device: str, given: str) -> str | None:
    """Why ``device`` (cuda or cuda:N) cannot run here, or None; ``given``: where the value came from.
    Imports torch: the worker needs it anyway."""
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no usable GPU"
        return f"{given}: CUDA is not available ({build}); use --device cpu"
    _, _, index = device.partition(":")
    if index and int(index) >= torch.cuda.device_count():
        return f"{given}: only {torch.cuda.device_count()} GPU(s) are visible"
    return None


def main(argv: list[str] | None = None) -> int:
    """A worker from its supervisor's configuration (shared/options.py ``child_config``), else from its flags."""
    argv = sys.argv[1:] if argv is None else argv
    config = child_config(WorkerConfig)
    if config is None:
        args = parse_args(argv)
        if len(getattr(args, "model_all", None) or ()) > 1:
            print("shmgate worker: error: --model given more than once; a worker serves one model", file=sys.stderr)
            return EXIT_USAGE
        config = from_args(WorkerConfig, args)
    device = config.placement.device
    if device and device.startswith("cuda"):
        problem = cuda_problem(device, origin(argv, "--device", device))
        if problem:
            print(f"shmgate worker: error: {problem}", file=sys.stderr)
            return EXIT_USAGE
    return run(config)


def run(config: WorkerConfig) -> int:
    logging.basicConfig(
        level=config.log.log_level.upper(), format="%(asctime)s worker[%(process)d] %(levelname)s %(message)s"
    )
    device = config.placement.device
    if not device:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = config.placement.threads
    if not threads and device.startswith("cpu"):
        from shmgate.shared.cpus import usable_cpus

        threads = usable_cpus()  # torch's own default is the node's cores, not the container's limit
    return run_worker(
        options=worker_options(config, device=device, threads=threads or None),
        instance_id=config.attach.instance,
        label=config.label.label,
        attach_wait_s=config.attach.attach_wait_s,
        diagnostics=config.diagnostics,
    )


if __name__ == "__main__":
    sys.exit(main())
