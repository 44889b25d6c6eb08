"""How every scenario writes its results: markdown tables for people, JSON for programs.

A scenario prints its table to stdout (or, with ``--json``, one JSON document per result line) and
writes the table to ``--out`` when given; progress and skipped servers go to stderr, so stdout stays
the result alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def render_table(columns: Sequence[str], rows: Sequence[Sequence[object]], *, left: int = 1) -> str:
    """A markdown table; the first ``left`` columns are text, the rest right-aligned numbers."""
    align = ["---"] * left + ["---:"] * (len(columns) - left)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 1) -> str:
    """A number for a table; '-' when it was not measured."""
    return "-" if value is None else f"{value:,.{digits}f}"


def publish(table: str, results: list[dict[str, Any]], *, as_json: bool, out: str | Path | None) -> None:
    """The table on stdout, or ``results`` as JSON lines with ``as_json``; the table to ``out`` too."""
    if as_json:
        for result in results:
            print(json.dumps(result), flush=True)
    else:
        print(table)
    if out:
        Path(out).write_text(table + "\n")
