"""shared/options.py: one field declares a flag, its SHMGATE_* variable, its typed default and its help; the
parsed configuration is built once and reaches a child whole, checked field by field."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

import msgspec
import pytest

from shmgate.shared import flag_types
from shmgate.shared.flags import ShmgateParser
from shmgate.shared.options import add_options, declared_flags, decode, encode, from_args, option, project


@dataclass(frozen=True, kw_only=True)
class _Limits:
    GROUP: ClassVar[str] = "limits"
    max_things: int = option("things at once", default="3", type=flag_types.positive_int)
    verbose_things: bool = option("say more", on_off=True)


@dataclass(frozen=True, kw_only=True)
class _Config(_Limits):
    GROUP: ClassVar[str] = "config"
    name: tuple[str, ...] = option("a name; repeat it", default="a", repeatable=True)
    secret: int = option("a tool's knob", default="0", type=flag_types.non_negative_int, hidden=True)
    computed: str = ""  # no option: a parent's decision, not a flag


@dataclass(frozen=True, kw_only=True)
class _Child(_Limits):
    computed: str = ""


def _parse(argv: list[str]) -> _Config:
    parser = ShmgateParser(prog="probe")
    add_options(parser, _Config)
    return from_args(_Config, parser.parse_args(argv), computed="decided")


def test_one_field_is_a_flag_a_variable_a_typed_default_and_help(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _Config() == _Config(max_things=3, verbose_things=False, name=("a",), secret=0)
    assert _parse([]) == _Config(computed="decided")
    assert _parse(["--max-things", "5", "--verbose-things", "--name", "x", "--name", "y"]).name == ("x", "y")
    monkeypatch.setenv("SHMGATE_MAX_THINGS", "7")
    assert _parse([]).max_things == 7 and _parse(["--max-things", "2"]).max_things == 2
    parser = ShmgateParser(prog="probe")
    add_options(parser, _Config)
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert helps["--max-things"] == "things at once (default: 3) [env: SHMGATE_MAX_THINGS]"
    assert helps["--secret"] == argparse.SUPPRESS
    assert [g.title for g in parser._action_groups][-2:] == ["limits", "config"]
    assert [spec.group for _, spec in declared_flags(_Config)] == ["limits", "limits", "config", "config"]


def test_a_child_gets_exactly_its_fields_and_refuses_a_value_of_the_wrong_type() -> None:
    parent = _parse(["--max-things", "9"])
    child = decode(_Child, encode(project(_Child, parent)))
    assert child == _Child(max_things=9, verbose_things=False, computed="decided")
    with pytest.raises(msgspec.ValidationError, match="max_things"):
        decode(_Child, '{"max_things": "nine"}')
