"""Diagnostic delays a worker can be started with: they slow it down on purpose, never in production.

Tests and benchmarks use them to widen a window that is otherwise microseconds wide (a worker killed
between taking a request and claiming it) or to stand in for a slow model (a batch that takes long
enough for a client to hang up). They live apart from ``WorkerOptions`` so that the production
options say only what production uses; both come from the same command line (``--diag-*`` flags).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["DiagnosticOptions"]


@dataclass(frozen=True)
class DiagnosticOptions:
    """Both zero by default: a worker started without ``--diag-*`` flags never sleeps here."""

    batch_delay_ms: float = 0.0  # sleep this long before each batch runs (a slow model)
    claim_delay_ms: float = 0.0  # sleep this long between taking a request off the queue and claiming it

    def before_claim(self) -> None:
        """Widen the window in which a killed worker holds a request no frontend knows it took."""
        if self.claim_delay_ms > 0:
            time.sleep(self.claim_delay_ms / 1000)

    def before_batch(self) -> None:
        """Make every batch as slow as a model that takes ``batch_delay_ms`` longer."""
        if self.batch_delay_ms > 0:
            time.sleep(self.batch_delay_ms / 1000)
