"""README.md's flag tables are the declarations' (node/flag_table.py): a flag added, removed or reworded
without ``python -m shmgate.node.flag_table --write`` fails here."""

from __future__ import annotations

from pathlib import Path

from shmgate.node.flag_table import BEGIN, END, render, replace_in

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_lists_every_declared_flag_as_declared() -> None:
    text = README.read_text()
    assert BEGIN in text and END in text
    assert replace_in(text) == text, "README.md's flag table is stale: run python -m shmgate.node.flag_table --write"


def test_the_table_has_every_flag_of_each_command_once() -> None:
    """What ``--help`` shows for serve, gateway and worker, each flag in one row."""
    import argparse

    from shmgate.node.cli import build_parser
    from shmgate.worker.__main__ import build_parser as worker_parser

    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    table = render()
    for parser in (commands.choices["serve"], commands.choices["gateway"], worker_parser()):
        flags = [
            a.option_strings[0]
            for a in parser._actions
            if a.option_strings and a.help != argparse.SUPPRESS and a.dest not in ("help", "version")
        ]
        assert len(flags) > 10
        for flag in flags:
            assert table.count(f"| `{flag}` |") == 1, flag
