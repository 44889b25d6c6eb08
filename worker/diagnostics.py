"""Diagnostic delays a worker can be started with: they slow it down on purpose, never in production.

Tests and benchmarks use them to widen a window that is otherwise microseconds wide (a worker killed
between taking a request and claiming it) or to stand in for a slow model (a batch that takes long
enough for a client to hang up). Their record is apart from ``WorkerOptions`` (worker/config.py) so that
the production options say only what production uses; both come from the same command line (``--diag-*``
flags, declared here), and ``serve`` hands its workers the record it parsed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

from shmgate.shared import flag_types
from shmgate.shared.options import option

__all__ = ["DiagnosticOptions"]


@dataclass(frozen=True, kw_only=True)
class DiagnosticOptions:
    """Both zero by default: a worker started without ``--diag-*`` flags never sleeps here."""

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

    def before_claim(self) -> None:
        """Widen the window in which a killed worker holds a request no frontend knows it took."""
        if self.diag_claim_delay_ms > 0:
            time.sleep(self.diag_claim_delay_ms / 1000)

    def before_batch(self) -> None:
        """Make every batch as slow as a model that takes ``diag_batch_delay_ms`` longer."""
        if self.diag_batch_delay_ms > 0:
            time.sleep(self.diag_batch_delay_ms / 1000)
