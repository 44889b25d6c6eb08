"""``python -m shmgate.worker``: the command the supervisor runs for each worker, and docker compose too.

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
# quarter less CPU, in every process start (docs/benchmarks-history.md, "huge pages for the model"; fewer
# TLB misses is the likely reason, not measured).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

from shmgate.shared import flag_types  # noqa: E402
from shmgate.shared.errors import EXIT_USAGE  # noqa: E402
from shmgate.shared.flags import ShmgateParser, add_batching_flags, add_flag, origin, version  # noqa: E402
from shmgate.shared.models import KNOWN_SPECS  # noqa: E402
from shmgate.shared.tracing import add_tracing_flags  # noqa: E402
from shmgate.worker.diagnostics import DiagnosticOptions  # noqa: E402
from shmgate.worker.main import WorkerOptions, run_worker  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = ShmgateParser(
        prog="shmgate worker",
        description="Run one model worker, attached to a running "
        "gateway (shmgate gateway or serve) found by --label or --instance. Every flag also "
        "reads the SHMGATE_* variable shown with it; the flag wins.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    model = parser.add_argument_group("model")
    add_flag(
        model,
        "--model",
        f"what to serve: {KNOWN_SPECS}; the same as the gateway's",
        default="efficientnet-lite0",
        type=flag_types.model_spec,
    )
    add_flag(
        model,
        "--served-model-name",
        "the model id clients send; must match the gateway's",
        shown_default="from --model",
    )
    add_flag(
        model,
        "--device",
        "cpu, cuda or cuda:N",
        shown_default="cuda when a GPU is usable, else cpu",
        type=flag_types.device,
    )
    add_flag(
        model,
        "--threads",
        "torch threads; 0: on CPU the CPUs this process may use, cgroup limit included",
        default="0",
        type=flag_types.non_negative_int,
    )
    batching = parser.add_argument_group("batching")
    add_batching_flags(batching)
    attach = parser.add_argument_group("attaching")
    add_flag(attach, "--instance", "instance id of the gateway to attach to", shown_default="find it by --label")
    add_flag(attach, "--label", "label of the gateway to attach to (its --label)", default="default")
    add_flag(
        attach,
        "--attach-wait-s",
        "how long to wait for a gateway with --label to appear (a container starting first)",
        default="60",
        type=flag_types.non_negative_float,
    )
    add_flag(
        attach,
        "--follow-drain-s",
        "on SIGTERM keep serving while the gateway drains, up to this long; "
        "0: stop at once. For pods, whose containers all get SIGTERM together",
        default="0",
        type=flag_types.non_negative_float,
    )
    seen = parser.add_argument_group("observability and diagnostics")
    add_flag(
        seen, "--log-level", f"one of {', '.join(flag_types.LOG_LEVELS)}", default="info", type=flag_types.log_level
    )
    add_flag(
        seen,
        "--diag-batch-delay-ms",
        "diagnostics and tests: sleep this long before each batch runs (simulates a slow model)",
        default="0",
        type=flag_types.non_negative_float,
    )
    add_flag(
        seen,
        "--diag-claim-delay-ms",
        "diagnostics and tests: sleep this long between taking a request and claiming it",
        default="0",
        type=flag_types.non_negative_float,
    )
    add_tracing_flags(parser.add_argument_group("tracing"))
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
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.device and args.device.startswith("cuda"):
        problem = cuda_problem(args.device, origin(argv, "--device", args.device))
        if problem:
            print(f"shmgate worker: error: {problem}", file=sys.stderr)
            return EXIT_USAGE
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s worker[%(process)d] %(levelname)s %(message)s"
    )
    device = args.device
    if not device:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    threads = args.threads
    if not threads and device.startswith("cpu"):
        from shmgate.shared.cpus import usable_cpus

        threads = usable_cpus()  # torch's own default is the node's cores, not the container's limit
    options = WorkerOptions(
        model=args.model,
        device=device,
        max_batch_size=args.max_batch_size,
        max_batch_wait_ms=args.max_batch_wait_ms,
        batch_policy=args.batch_policy,
        threads=threads or None,
        dtype=args.dtype,
        compile_normalise=args.compile_normalise,
        follow_drain_s=args.follow_drain_s,
        served_model_name=args.served_model_name or "",
        otlp_traces_endpoint=args.otlp_traces_endpoint or "",
    )
    return run_worker(
        options=options,
        instance_id=args.instance,
        label=args.label,
        attach_wait_s=args.attach_wait_s,
        diagnostics=diagnostics_from(args),
    )


def diagnostics_from(args: argparse.Namespace) -> DiagnosticOptions:
    """The ``--diag-*`` flags: kept off ``WorkerOptions``, which says only what production uses."""
    return DiagnosticOptions(batch_delay_ms=args.diag_batch_delay_ms, claim_delay_ms=args.diag_claim_delay_ms)


if __name__ == "__main__":
    sys.exit(main())
