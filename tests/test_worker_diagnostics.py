"""The ``--diag-*`` flags reach the worker as ``DiagnosticOptions``, and ``WorkerOptions`` carries none of them.

What the delays do to a running worker is tested through real processes where it matters:
tests/test_take_window.py (``--diag-claim-delay-ms``) and tests/test_embeddings_hangup.py
(``--diag-batch-delay-ms``).
"""

from dataclasses import fields

from shmgate.worker.__main__ import diagnostics_from, parse_args
from shmgate.worker.diagnostics import DiagnosticOptions
from shmgate.worker.main import WorkerOptions


def test_diag_flags_become_diagnostic_options() -> None:
    args = parse_args(["--model", "checksum", "--diag-batch-delay-ms", "30", "--diag-claim-delay-ms", "5.5"])
    assert diagnostics_from(args) == DiagnosticOptions(batch_delay_ms=30.0, claim_delay_ms=5.5)


def test_a_worker_started_without_diag_flags_has_no_delays() -> None:
    assert diagnostics_from(parse_args(["--model", "checksum"])) == DiagnosticOptions(0.0, 0.0)


def test_production_options_carry_no_diagnostic_knobs() -> None:
    assert not [f.name for f in fields(WorkerOptions) if f.name.startswith("diag")]
