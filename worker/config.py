"""A worker's configuration: the flags only a worker reads, and ``WorkerConfig``, everything it reads.

``shmgate worker`` (``python -m shmgate.worker``, what docker compose runs) parses these flags; a worker that
``shmgate serve`` starts gets its ``WorkerConfig`` whole from the supervisor (node/plan.py
``worker_configs``, shared/options.py ``encode``) and parses nothing. The flags a worker shares with
``serve`` are declared in shared/common_options.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shmgate.shared import flag_types
from shmgate.shared.common_options import BatchingOptions, LabelOption, LogOptions, ModelOptions, PlacementOptions
from shmgate.shared.options import option
from shmgate.shared.tracing import TracingOptions

__all__ = ["AttachOptions", "DiagnosticFlags", "WorkerConfig"]


@dataclass(frozen=True, kw_only=True)
class AttachOptions:
    """How a worker finds its gateway (serve's workers are told the instance)."""

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
class DiagnosticFlags:
    """Deliberate delays for tests and benchmarks (worker/diagnostics.py); serve passes them to its workers."""

    GROUP: ClassVar[str] = "diagnostics"
    diag_batch_delay_ms: float = option(
        "diagnostics and tests: sleep this long before each batch runs (simulates a slow model)",
        default="0",
        type=flag_types.non_negative_float,
    )
    diag_claim_delay_ms: float = option(
        "diagnostics and tests: sleep this long between taking a request and claiming it",
        default="0",
        type=flag_types.non_negative_float,
    )


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(
    TracingOptions,
    DiagnosticFlags,
    LogOptions,
    AttachOptions,
    LabelOption,
    BatchingOptions,
    PlacementOptions,
    ModelOptions,
):
    """Everything one worker reads (bases listed last group first: a dataclass puts its last base's fields first)."""
