"""Typed options that declare their own flag, ``SHMGATE_*`` variable, help and default: configuration built once.

A knob is one field of an options record, declared with ``option``: its name is the flag (``--max-images``)
and the variable (``SHMGATE_MAX_IMAGES``), its default is the text default run through ``type`` (so the
record and the parser cannot disagree), and the record it is declared in says which component reads it
(``GROUP`` is the ``--help`` group)::

    @dataclass(frozen=True, kw_only=True)
    class LimitOptions:
        GROUP: ClassVar[str] = "limits"
        max_images: int = option("images per request; more get 400", default="8", type=flag_types.positive_int)

Records compose, they never inherit: a component's options hold the records of the knobs it reads as
``part`` fields (gateway/config.py ``FrontendOptions`` holds ``LimitOptions``, ...; worker/config.py
``WorkerConfig`` holds ``BatchingOptions``, ``EngineOptions``, ...), and a command's configuration holds
its components' (node/config.py ``ServeConfig``). A flag is the field's name wherever the record sits, so
one declaration reached through two parts (``--log-level``, read by the frontends and the workers) is one
flag; two declarations of one name, or a record that inherits another, raise ``OptionsError`` when the
flags are declared (every command start, and tests/test_options.py for every command).

- ``add_options(parser, ServeConfig)`` declares every flag of it (shared/flags.py ``add_flag``: the
  variable, the typed default, the help suffix) in its group;
- ``from_args(ServeConfig, args)`` builds the typed value, parts and all, from what argparse parsed, once;
- ``encode`` / ``decode`` hand a built value to a child process whole (msgspec JSON in one environment
  variable, ``CHILD_CONFIG_ENV``), so a child never re-parses flags its parent parsed and no flag is
  mapped by hand from one process to the next.

A knob's default is therefore written in exactly one place, its ``option``; code that needs it reads the
record (``EngineOptions().prefix_cache_mb``), and tests/test_knob_defaults.py fails when a literal default
of a declared knob is written anywhere else. Fields without ``option`` (the instance id, the slot, the
resolved models) are configuration a parent computes, not flags.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, TypeVar

import msgspec

from shmgate.shared.flags import add_flag

__all__ = [
    "CHILD_CONFIG_ENV",
    "Flag",
    "OptionsError",
    "Repeatable",
    "add_options",
    "child_config",
    "decode",
    "declared_flags",
    "encode",
    "from_args",
    "knob_values",
    "option",
    "part",
    "with_knobs",
]

T = TypeVar("T")
_FLAG = "shmgate.flag"
_PART = "shmgate.part"
# The variable a supervised child finds its whole configuration in (encode's JSON). In the environment,
# not on the command line: the API key is part of a frontend's configuration, and argv is visible in ps.
CHILD_CONFIG_ENV = "SHMGATE_CHILD_CONFIG"
# The order of the groups in --help; a group not listed comes after them.
GROUP_ORDER = (
    "server",
    "model",
    "workers and batching",
    "limits",
    "image URLs",
    "observability",
    "tracing",
    "attaching",
    "diagnostics",
)


@dataclass(frozen=True)
class Flag:
    """How one field appears on the command line (shared/flags.py ``add_flag`` says what each means)."""

    help: str
    default: str | None  # the text default, run through ``type`` (None: no default)
    type: Callable[[str], Any]
    shown_default: str | None = None
    on_off: bool = False
    metavar: str | None = None
    repeatable: bool = False
    group: str = ""  # "": the declaring class's GROUP
    hidden: bool = False  # a tool's or a test's flag: parsed, left out of --help and the README


def option(
    help: str,
    *,
    default: str | None = None,
    type: Callable[[str], Any] = str,
    shown_default: str | None = None,
    on_off: bool = False,
    metavar: str | None = None,
    repeatable: bool = False,
    group: str = "",
    hidden: bool = False,
) -> Any:
    """A dataclass field that is also a flag. ``repeatable``: the flag may be given several times and
    the field is the tuple of its values (the default alone when it is absent)."""
    spec = Flag(help, default, type, shown_default, on_off, metavar, repeatable, group, hidden)
    value: Any = False if on_off else (None if default is None else type(default))
    if repeatable:
        value = () if value is None else (value,)
    return field(default=value, metadata={_FLAG: spec})


def part(cls: type[T]) -> T:
    """A field holding a whole options record: the record's flags are the command's flags, and the built
    value holds the record, typed, for the component that reads it (composition, never inheritance)."""
    return field(default_factory=cls, metadata={_PART: cls})


class OptionsError(TypeError):
    """Options records that cannot make one command line: a flag declared twice, a record that inherits."""


class Repeatable(argparse.Action):
    """A flag that may be given several times: ``dest`` keeps the first value, ``<dest>_all`` every value
    in order (``from_args`` reads the tuple from there)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest + "_all", None) or []
        if not given:
            setattr(namespace, self.dest, values)
        setattr(namespace, self.dest + "_all", [*given, values])


def _knobs(cls: type, path: str) -> Iterator[tuple[str, str, Any, type]]:
    """(field name, where it sits, its Flag, the record declaring it) for every option of ``cls`` and of its
    parts, depth first in field order."""
    inherited = [b.__qualname__ for b in cls.__mro__[1:] if is_dataclass(b)]
    if inherited:
        raise OptionsError(
            f"{cls.__qualname__} inherits the options record {inherited[0]}: records compose (hold it as a part "
            "field), so that two fields of one name cannot override each other unseen"
        )
    for f in fields(cls):
        sub = f.metadata.get(_PART)
        if sub is not None:
            yield from _knobs(sub, f"{path}.{f.name}")
        elif (spec := f.metadata.get(_FLAG)) is not None:
            yield f.name, f"{path}.{f.name}", spec, cls


def declared_flags(cls: type) -> Iterator[tuple[str, Flag]]:
    """(flag, its declaration) for every option field of ``cls`` and its parts, in field order, each with its
    group; a declaration reached through two parts once. Raises OptionsError for a flag declared twice."""
    seen: dict[str, tuple[Flag, str]] = {}
    for name, where, spec, owner in _knobs(cls, cls.__qualname__):
        flag = "--" + name.replace("_", "-")
        if flag in seen:
            if seen[flag][0] is spec:
                continue  # one declaration read by two components (--log-level: the frontends' and the workers')
            raise OptionsError(
                f"{flag} is declared twice, at {seen[flag][1]} and {where}: a knob has one declaration "
                "(hold its record as a part where another component reads it)"
            )
        seen[flag] = (spec, where)
        if not spec.group:
            spec = replace(spec, group=getattr(owner, "GROUP", "options"))
        yield flag, spec


def add_options(parser: argparse.ArgumentParser, cls: type, *, skip: Sequence[str] = ()) -> None:
    """Declare every flag of the options dataclass ``cls`` on ``parser``, each in its group."""
    # in --help's group order, so that the usage line follows the groups (a stable sort: field order within)
    declared = sorted(
        ((flag, spec) for flag, spec in declared_flags(cls) if flag not in skip), key=lambda d: _group_rank(d[1].group)
    )
    titles = sorted({spec.group for _, spec in declared}, key=_group_rank)
    groups = {g.title: g for g in parser._action_groups}
    for title in titles:
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
    for flag, spec in declared:
        action = add_flag(
            groups[spec.group],
            flag,
            spec.help,
            default=spec.default,
            type=None if spec.on_off else spec.type,
            shown_default=spec.shown_default,
            on_off=spec.on_off,
            metavar=spec.metavar,
            action=Repeatable if spec.repeatable else None,
        )
        if spec.hidden:
            action.help = argparse.SUPPRESS


def _group_rank(title: str) -> tuple[int, str]:
    return (GROUP_ORDER.index(title) if title in GROUP_ORDER else len(GROUP_ORDER), title)


def from_args(cls: type[T], args: argparse.Namespace, **computed: Any) -> T:
    """The ``cls`` value of what argparse parsed: every option field the namespace has (a repeatable flag's
    every value), each part built the same way, ``computed`` for the top-level fields no flag sets; the rest
    keep their defaults. A field named ``given`` gets the repeatable flags typed on the command line (their
    ``<dest>_all`` is set)."""
    return cls(**{**_parsed(cls, args), **computed})


def _parsed(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for f in fields(cls):
        sub = f.metadata.get(_PART)
        spec = f.metadata.get(_FLAG)
        if sub is not None:
            values[f.name] = sub(**_parsed(sub, args))
        elif f.name == "given":
            values["given"] = frozenset(k[: -len("_all")] for k, v in vars(args).items() if k.endswith("_all") and v)
        elif spec is not None and spec.repeatable:
            given = getattr(args, f.name + "_all", None)
            first = getattr(args, f.name, None)
            values[f.name] = tuple(given) if given else (() if first is None else (first,))
        elif spec is not None and hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return values


def knob_values(config: object) -> dict[str, Any]:
    """Every knob of ``config`` and its parts by its field name, flat: for what names knobs as data (a
    ``--config`` file's per-model keys, shared/model_config.py ``with_globals``), not for typed code."""
    values: dict[str, Any] = {}
    for f in fields(config):  # type: ignore[arg-type]
        if f.metadata.get(_PART) is not None:
            values.update(knob_values(getattr(config, f.name)))
        elif f.metadata.get(_FLAG) is not None:
            values[f.name] = getattr(config, f.name)
    return values


def with_knobs(config: T, values: Mapping[str, Any]) -> T:
    """``config`` with the knobs named in ``values`` replaced wherever its parts hold them (a model's own
    batching from a ``--config`` file, over the flags'). Raises KeyError for a name ``config`` has no knob of."""
    unknown = set(values) - set(knob_values(config))
    if unknown:
        raise KeyError(f"{type(config).__qualname__} has no knob {sorted(unknown)[0]!r}")
    return _with(config, values)


def _with(config: T, values: Mapping[str, Any]) -> T:
    changes: dict[str, Any] = {}
    for f in fields(config):  # type: ignore[arg-type]
        if f.metadata.get(_PART) is not None:
            inner = getattr(config, f.name)
            if set(values) & set(knob_values(inner)):
                changes[f.name] = _with(inner, values)
        elif f.metadata.get(_FLAG) is not None and f.name in values:
            changes[f.name] = values[f.name]
    return replace(config, **changes)  # type: ignore[type-var]


def encode(config: object) -> str:
    """``config`` (an options dataclass) as one JSON text, for a child's ``CHILD_CONFIG_ENV``."""
    assert is_dataclass(config)
    return msgspec.json.encode(config).decode()


def decode(cls: type[T], text: str) -> T:
    """``encode``'s inverse: the child's typed configuration, checked field by field."""
    return msgspec.json.decode(text, type=cls)


def child_config(cls: type[T]) -> T | None:
    """The configuration a supervisor handed this process (``CHILD_CONFIG_ENV``), or None when it was
    started by hand (then it parses its flags)."""
    text = os.environ.pop(CHILD_CONFIG_ENV, None)
    return decode(cls, text) if text else None
