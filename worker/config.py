"""A worker's configuration: ``WorkerConfig``, every knob one worker reads, and ``WorkerOptions``, what the
running worker (worker/main.py ``Worker``) is handed, made from it once at start.

``shmgate worker`` (``python -m shmgate.worker``, what docker compose runs) parses ``WorkerConfig``'s
flags; a worker that ``shmgate serve`` starts gets its ``WorkerConfig`` whole from the supervisor
(node/plan.py ``worker_children``, shared/options.py ``encode``) and parses nothing. Both hold the same
records (shared/common_options.py: the batcher's, the loader's, the engine's), so a knob reaches the code
that reads it as its declared field, never copied field by field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shmgate.shared import flag_types
from shmgate.shared.common_options import (
    BatchingOptions,
    EngineOptions,
    LabelOption,
    LoadOptions,
    LogOptions,
    ModelOptions,
    PlacementOptions,
)
from shmgate.shared.options import option, part
from shmgate.shared.tracing import TracingOptions
from shmgate.worker.diagnostics import DiagnosticOptions

__all__ = ["AttachOptions", "WorkerConfig", "WorkerOptions", "worker_options"]


@dataclass(frozen=True, kw_only=True)
class AttachOptions:
    """How a worker finds its gateway (serve's workers are told the instance) and follows its drain."""

    GROUP: ClassVar[str] = "attaching"
    instance: str | None = option("instance id of the gateway to attach to", shown_default="find it by --label")
    attach_wait_s: float = option(
        "how long to wait for a gateway with --label to appear (a container starting first)",
        default="60",
        type=flag_types.non_negative_float,
    )
    follow_drain_s: float = option(
        "on SIGTERM keep serving while the gateway drains, up to this long; "
        "0: stop at once. For pods, whose containers all get SIGTERM together",
        default="0",
        type=flag_types.non_negative_float,
    )


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Everything one worker reads, by the part that reads it (the order is ``--help``'s within a group)."""

    model: ModelOptions = part(ModelOptions)
    placement: PlacementOptions = part(PlacementOptions)
    batching: BatchingOptions = part(BatchingOptions)
    engine: EngineOptions = part(EngineOptions)
    load: LoadOptions = part(LoadOptions)
    label: LabelOption = part(LabelOption)
    attach: AttachOptions = part(AttachOptions)
    log: LogOptions = part(LogOptions)
    diagnostics: DiagnosticOptions = part(DiagnosticOptions)
    tracing: TracingOptions = part(TracingOptions)


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """What a running worker serves with: its one model and its device, decided at start, and the parsed
    records of the knobs it reads (each its declared defaults when not given: tests build it by hand)."""

    model: str  # the spec (shared/models.py)
    served_model_name: str = ""  # the id clients send; '': the spec's default (shared/models.py)
    device: str = "cpu"  # cpu, cuda or cuda:N, resolved (worker/device.py picks the GPU of cuda by slot)
    threads: int | None = None  # torch threads; None: torch's choice
    batching: BatchingOptions = part(BatchingOptions)
    engine: EngineOptions = part(EngineOptions)
    load: LoadOptions = part(LoadOptions)
    attach: AttachOptions = part(AttachOptions)  # follow_drain_s (worker/drain.py)
    tracing: TracingOptions = part(TracingOptions)  # '' or None: tracing off (worker/tracing.py)


def worker_options(config: WorkerConfig, *, device: str, threads: int | None) -> WorkerOptions:
    """``config``'s options for the worker it starts, on ``device`` with ``threads`` (decided by the caller:
    torch knows the machine)."""
    return WorkerOptions(
        model=config.model.model[0],
        served_model_name=config.model.served_model_name[0] if config.model.served_model_name else "",
        device=device,
        threads=threads,
        batching=config.batching,
        engine=config.engine,
        load=config.load,
        attach=config.attach,
        tracing=config.tracing,
    )
