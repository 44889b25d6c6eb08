"""The configuration of ``shmgate serve`` and ``shmgate gateway``: typed options that generate their flags.

Each field of an options record below is one flag, its ``SHMGATE_*`` variable, its help and its default
(shared/options.py ``option``); a command's configuration holds the records of the components it runs
(composition: ``GatewayConfig.frontend`` is the frontends' ``FrontendOptions``, ``ServeConfig.batching``
the workers' ``BatchingOptions``), parsed once (node/cli.py) and validated when parsed (each field's
``type``, shared/flag_types.py). The frontends' flags are declared in gateway/config.py, the flags a
worker shares with ``serve`` in shared/common_options.py, tracing's in shared/tracing.py; this module
declares those only the supervisor reads (how many frontends, the arena, the queues, the workers' placement).

The supervisor hands each child its records whole (node/plan.py ``frontend_config``, ``worker_children``),
so adding a flag is adding a field to the options record of the component that reads it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

from shmgate.gateway.config import FrontendOptions
from shmgate.shared import flag_types
from shmgate.shared.common_options import (
    BatchingOptions,
    EngineOptions,
    LabelOption,
    LoadOptions,
    ModelOptions,
    PlacementOptions,
)
from shmgate.shared.options import option, part
from shmgate.worker.diagnostics import DiagnosticOptions

__all__ = [
    "DEFAULT_STALL_TIMEOUT_S",
    "HF_STALL_TIMEOUT_S",
    "AnyNodeConfig",
    "GatewayConfig",
    "NodeOptions",
    "ServeConfig",
    "ServeOptions",
    "WorkerPlanOptions",
    "gateway_of",
]

# The longest a work loop may go without progress. The embedded classifier's longest step (a
# batch of 8 on a busy 2-core CPU) is well under a second, so 10 s never fires on a healthy
# worker and still brings a wedged one back within the 30 s the tests allow. A generative model
# stamps per decode step, but its prefill of a full batch of large images is one step: the rule
# is at least 3x the slowest single forward pass under peak load (docs/RELIABILITY.md).
DEFAULT_STALL_TIMEOUT_S = 10.0
HF_STALL_TIMEOUT_S = 60.0


def _arena_size(text: str) -> int:
    value = flag_types.size(text)
    if value < 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r} is too small for an arena: use at least 1MiB (e.g. 1GiB)")
    return value


def _json_object(text: str) -> str:
    """Check --mm-processor-kwargs is a JSON object when the flags are parsed."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return text


@dataclass(frozen=True, kw_only=True)
class NodeOptions:
    """What the supervisor alone reads: the node's processes, shared memory and queues."""

    GROUP: ClassVar[str] = "server"
    frontends: int = option(
        "HTTP frontend processes; auto: the CPUs this process may use (cgroup limit, affinity, cores)",
        default="auto",
        type=flag_types.auto_count,
    )
    stall_timeout_s: float | None = option(
        "replace a frontend or worker whose work loop makes no progress for "
        "this long; 0: never (docs/RELIABILITY.md for slow models)",
        shown_default=f"{DEFAULT_STALL_TIMEOUT_S:g} s, {HF_STALL_TIMEOUT_S:g} s for hf: models",
        type=flag_types.non_negative_float,
    )
    config: str | None = option(
        "a TOML file declaring the models and their own settings (workers, device, "
        'batching, max in flight, queue depth, stall timeout; docs/MODELS.md "Several models"); '
        "instead of --model",
        shown_default="none: --model",
        group="model",
    )
    mm_processor_kwargs: str = option(
        "hf: models: image processor arguments over the checkpoint's, "
        'as JSON, e.g. \'{"max_pixels": 200704}\' (docs/MODELS.md "Processor options"); classifier models: '
        "jpeg_draft_margin and embedding_jpeg_draft_margin (docs/TUNING.md)",
        default="{}",
        type=_json_object,
        group="model",
    )
    arena_size: int = option(
        "shared memory for decoded images, in /dev/shm (e.g. 512MiB, 4GiB)",
        default="1GiB",
        type=_arena_size,
        group="limits",
    )
    max_workers: int = option(
        "worker slots in the shared segment, each with a control queue; 0: serve twice its workers, gateway 16",
        default="0",
        type=flag_types.non_negative_int,
        group="limits",
    )
    queue_depth: int = option(
        "message queue depth (capped by /proc/sys/fs/mqueue/msg_max, 10 by default, and lowered to fit "
        "ulimit -q, logged)",
        default="64",
        type=flag_types.positive_int,
        group="limits",
    )
    log_stats_interval_s: float = option(
        "log a line of serving statistics this often (requests/s, errors, in flight, queue, arena); 0: off",
        default="0",
        type=flag_types.non_negative_float,
        group="observability",
    )


@dataclass(frozen=True, kw_only=True)
class WorkerPlanOptions:
    """How ``serve`` starts and places its workers."""

    GROUP: ClassVar[str] = "workers and batching"
    workers: int = option(
        "worker processes; auto: one per GPU, on CPU two (one for hf: models)",
        default="auto",
        type=flag_types.auto_count,
    )
    workers_per_gpu: int = option("workers sharing each GPU", default="1", type=flag_types.positive_int)
    restart_budget: int = option(
        "with several models: a worker that served and then dies more than "
        "this many times in 5 minutes is not restarted, and its model is failed once none of its workers "
        "is left (the others keep serving); 0: restart for ever (one model always is)",
        default="5",
        type=flag_types.non_negative_int,
    )
    skip_gpu_fit_check: bool = option(
        "start even when the models placed on a GPU are estimated not to fit "
        'in its free memory (docs/MODELS.md "GPU memory at start-up")',
        on_off=True,
    )


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """``shmgate gateway``: frontends only; workers attach from elsewhere by ``--label``."""

    frontend: FrontendOptions = part(FrontendOptions)
    model: ModelOptions = part(ModelOptions)
    label: LabelOption = part(LabelOption)
    node: NodeOptions = part(NodeOptions)
    given: frozenset[str] = frozenset()  # the repeatable flags typed on the command line (--model, ...)


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """What ``serve`` alone takes besides its gateway's and its workers' options."""

    GROUP: ClassVar[str] = "server"
    # Slots with a partition and a reply channel but no HTTP process: a diagnostic tool (or a test
    # forging descriptors) attaches as a frontend there without stealing a real frontend's replies.
    # They take a share of the arena, so the default is none.
    spare_frontend_slots: int = option(
        "frontend slots without a process, for tools and tests",
        default="0",
        type=flag_types.non_negative_int,
        hidden=True,
    )


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """``shmgate serve``: the gateway and its supervised workers, each worker handed the records below."""

    diagnostics: DiagnosticOptions = part(DiagnosticOptions)
    gateway: GatewayConfig = part(GatewayConfig)
    plan: WorkerPlanOptions = part(WorkerPlanOptions)
    placement: PlacementOptions = part(PlacementOptions)
    batching: BatchingOptions = part(BatchingOptions)
    engine: EngineOptions = part(EngineOptions)
    load: LoadOptions = part(LoadOptions)
    serve: ServeOptions = part(ServeOptions)


AnyNodeConfig: TypeAlias = GatewayConfig | ServeConfig


def gateway_of(config: AnyNodeConfig) -> GatewayConfig:
    """The gateway's part of either command's configuration (``serve`` runs a gateway too)."""
    return config.gateway if isinstance(config, ServeConfig) else config
