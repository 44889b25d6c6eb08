"""How every scenario writes its results: a markdown table for people, JSON lines for programs.

A scenario prints its table on stdout, or with ``--json`` one JSON object per result instead, and
writes the table to ``--out FILE`` as well when asked; progress and skipped servers go to stderr, so
stdout holds the results alone. ``add_arguments`` declares the two options, ``publish`` obeys them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="JSON lines on stdout instead of the table")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")


def publish(table: str, results: Sequence[dict[str, Any]], args: argparse.Namespace) -> None:
    """The table on stdout, or ``results`` as JSON lines with ``--json``; the table to ``--out`` too."""
    if args.json:
        for result in results:
            print(json.dumps(result), flush=True)
    else:
        print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


def render_table(columns: Sequence[str], rows: Sequence[Sequence[object]], *, left: int = 1) -> str:
    """A markdown table; the first ``left`` columns are text, the rest right-aligned numbers."""
    align = ["---"] * left + ["---:"] * (len(columns) - left)
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 1) -> str:
    """A number for a table; '-' when it was not measured."""
    return "-" if value is None else f"{value:,.{digits}f}"
