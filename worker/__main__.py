"""``python -m worker``: the command the supervisor runs for each worker, and docker compose too.

Every flag also reads a ``SHMGATE_*`` environment variable; flags win.
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
# quarter less CPU, in every process start (docs/BENCHMARKS.md, "huge pages for the model"; fewer
# TLB misses is the likely reason, not measured).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from shared.flags import add_batching_flags, env  # noqa: E402
from worker.main import WorkerOptions, run_worker  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="shmgate worker", description="Run one model worker.")
    parser.add_argument("--model", default=env("MODEL", "efficientnet-lite0"))
    parser.add_argument("--served-model-name", default=env("SERVED_MODEL_NAME", ""),
                        help="the model id clients send (default: from --model); must match the gateway's")
    parser.add_argument("--device", default=env("DEVICE"), help="cpu, cuda or cuda:N (default: cuda when present)")
    parser.add_argument("--threads", type=int, default=env("THREADS", "0"),
                        help="torch threads (0: on CPU the CPUs this process may use, cgroup limit included)")
    add_batching_flags(parser)
    parser.add_argument("--diag-batch-delay-ms", type=float, default=env("DIAG_BATCH_DELAY_MS", "0"),
                        help="diagnostics and tests: sleep this long before each batch runs (simulates a slow model)")
    parser.add_argument("--diag-claim-delay-ms", type=float, default=env("DIAG_CLAIM_DELAY_MS", "0"),
                        help="diagnostics and tests: sleep this long between taking a request and claiming it")
    parser.add_argument("--instance", default=env("INSTANCE"), help="instance id (default: find by --label)")
    parser.add_argument("--label", default=env("LABEL", "default"))
    parser.add_argument("--attach-wait-s", type=float, default=env("ATTACH_WAIT_S", "60"),
                        help="how long to wait for a gateway with --label to appear (a container starting first)")
    parser.add_argument("--follow-drain-s", type=float, default=env("FOLLOW_DRAIN_S", "0"),
                        help="on SIGTERM keep serving while the gateway drains, up to this long (0: stop at once). "
                        "For pods, whose containers all get SIGTERM together")
    parser.add_argument("--log-level", default=env("LOG_LEVEL", "info"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s worker[%(process)d] %(levelname)s %(message)s"
    )
    device = args.device
    if not device:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = args.threads
    if not threads and device.startswith("cpu"):
        from shared.cpus import usable_cpus

        threads = usable_cpus()  # torch's own default is the node's cores, not the container's limit
    options = WorkerOptions(
        model=args.model,
        device=device,
        max_batch_size=args.max_batch_size,
        max_batch_wait_ms=args.max_batch_wait_ms,
        batch_policy=args.batch_policy,
        threads=threads or None,
        dtype=args.dtype,
        diag_batch_delay_ms=args.diag_batch_delay_ms,
        diag_claim_delay_ms=args.diag_claim_delay_ms,
        compile_normalise=args.compile_normalise,
        follow_drain_s=args.follow_drain_s,
        served_model_name=args.served_model_name,
    )
    return run_worker(options=options, instance_id=args.instance, label=args.label, attach_wait_s=args.attach_wait_s)


if __name__ == "__main__":
    sys.exit(main())
