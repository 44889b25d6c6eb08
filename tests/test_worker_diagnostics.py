"""The ``--diag-*`` flags reach the worker as its ``DiagnosticOptions``, and ``WorkerOptions`` carries none of them.

What the delays do to a running worker is tested through real processes where it matters:
tests/test_take_window.py (``--diag-claim-delay-ms``) and tests/test_embeddings_hangup.py
(``--diag-batch-delay-ms``).
"""

from shmgate.shared.options import from_args, knob_values
from shmgate.worker.__main__ import parse_args
from shmgate.worker.config import WorkerConfig, WorkerOptions
from shmgate.worker.diagnostics import DiagnosticOptions


def _diagnostics(argv: list[str]) -> DiagnosticOptions:
    return from_args(WorkerConfig, parse_args(argv)).diagnostics


def test_diag_flags_become_diagnostic_options() -> None:
    argv = ["--model", "checksum", "--diag-batch-delay-ms", "30", "--diag-claim-delay-ms", "5.5"]
    assert _diagnostics(argv) == DiagnosticOptions(diag_batch_delay_ms=30.0, diag_claim_delay_ms=5.5)


def test_a_worker_started_without_diag_flags_has_no_delays() -> None:
    assert _diagnostics(["--model", "checksum"]) == DiagnosticOptions(diag_batch_delay_ms=0.0, diag_claim_delay_ms=0.0)


def test_production_options_carry_no_diagnostic_knobs() -> None:
    assert not [name for name in knob_values(WorkerOptions(model="checksum")) if name.startswith("diag")]
