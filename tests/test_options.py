"""shared/options.py: one field declares a flag, its SHMGATE_* variable, its typed default and its help;
records compose (never inherit), a flag declared twice fails loudly, and the parsed configuration is built
once and reaches a child whole, checked field by field."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

import msgspec
import pytest

from shmgate.node.flag_table import COMMANDS
from shmgate.shared import flag_types
from shmgate.shared.flags import ShmgateParser
from shmgate.shared.options import (
    OptionsError,
    add_options,
    declared_flags,
    decode,
    encode,
    from_args,
    knob_values,
    option,
    part,
    with_knobs,
)


@dataclass(frozen=True, kw_only=True)
class _Limits:
    GROUP: ClassVar[str] = "limits"
    max_things: int = option("things at once", default="3", type=flag_types.positive_int)
    verbose_things: bool = option("say more", on_off=True)


@dataclass(frozen=True, kw_only=True)
class _Names:
    GROUP: ClassVar[str] = "config"
    name: tuple[str, ...] = option("a name; repeat it", default="a", repeatable=True)
    secret: int = option("a tool's knob", default="0", type=flag_types.non_negative_int, hidden=True)


@dataclass(frozen=True, kw_only=True)
class _Child:
    limits: _Limits = part(_Limits)
    computed: str = ""  # no option: a parent's decision, not a flag


@dataclass(frozen=True, kw_only=True)
class _Config:
    child: _Child = part(_Child)  # a part of a part
    limits: _Limits = part(_Limits)  # the same record again: the same flags, one each
    names: _Names = part(_Names)
    given: frozenset[str] = frozenset()


def _parse(argv: list[str]) -> _Config:
    parser = ShmgateParser(prog="probe")
    add_options(parser, _Config)
    return from_args(_Config, parser.parse_args(argv))


def test_one_field_is_a_flag_a_variable_a_typed_default_and_help(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _Config() == _Config(
        child=_Child(limits=_Limits(max_things=3)), limits=_Limits(verbose_things=False), names=_Names(name=("a",))
    )
    assert _parse([]) == _Config()
    parsed = _parse(["--max-things", "5", "--verbose-things", "--name", "x", "--name", "y"])
    assert parsed.names.name == ("x", "y") and parsed.given == frozenset({"name"})
    assert parsed.child.limits == parsed.limits == _Limits(max_things=5, verbose_things=True)
    monkeypatch.setenv("SHMGATE_MAX_THINGS", "7")
    assert _parse([]).limits.max_things == 7 and _parse(["--max-things", "2"]).child.limits.max_things == 2
    parser = ShmgateParser(prog="probe")
    add_options(parser, _Config)
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert helps["--max-things"] == "things at once (default: 3) [env: SHMGATE_MAX_THINGS]"
    assert helps["--secret"] == argparse.SUPPRESS
    assert [g.title for g in parser._action_groups][-2:] == ["limits", "config"]
    assert [(flag, spec.group) for flag, spec in declared_flags(_Config)] == [
        ("--max-things", "limits"),
        ("--verbose-things", "limits"),
        ("--name", "config"),
        ("--secret", "config"),
    ]


def test_a_child_gets_its_record_whole_and_refuses_a_value_of_the_wrong_type() -> None:
    parent = _parse(["--max-things", "9"])
    assert decode(_Child, encode(parent.child)) == _Child(limits=_Limits(max_things=9))
    with pytest.raises(msgspec.ValidationError, match="max_things"):
        decode(_Child, '{"limits": {"max_things": "nine"}}')


def test_knobs_read_and_replaced_by_name_wherever_their_record_sits() -> None:
    config = _parse(["--max-things", "4"])
    assert knob_values(config) == {"max_things": 4, "verbose_things": False, "name": ("a",), "secret": 0}
    changed = with_knobs(config, {"max_things": 6})
    assert changed.limits.max_things == changed.child.limits.max_things == 6 and changed.names == config.names
    with pytest.raises(KeyError, match="no knob 'max_thing'"):
        with_knobs(config, {"max_thing": 6})


@dataclass(frozen=True, kw_only=True)
class _OtherLimits:
    GROUP: ClassVar[str] = "limits"
    max_things: int = option("things at once, said again", default="3", type=flag_types.positive_int)


@dataclass(frozen=True, kw_only=True)
class _Colliding:
    limits: _Limits = part(_Limits)
    other: _OtherLimits = part(_OtherLimits)


@dataclass(frozen=True, kw_only=True)
class _Inheriting(_Limits):
    more: int = option("more", default="1", type=flag_types.positive_int)


def test_one_flag_declared_twice_or_a_record_that_inherits_fails_loudly() -> None:
    with pytest.raises(OptionsError, match=r"--max-things is declared twice, at _Colliding\.limits\.max_things and "):
        add_options(ShmgateParser(prog="probe"), _Colliding)
    with pytest.raises(OptionsError, match="_Inheriting inherits the options record _Limits"):
        list(declared_flags(_Inheriting))


@pytest.mark.parametrize(("command", "config"), COMMANDS, ids=[c for c, _ in COMMANDS])
def test_every_command_declares_each_flag_once_from_composed_records(command: str, config: type) -> None:
    flags = [flag for flag, _ in declared_flags(config)]  # raises OptionsError on a collision or inheritance
    assert len(flags) == len(set(flags)) > 10
