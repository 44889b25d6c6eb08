"""Typed options that declare their own flag, ``SHMGATE_*`` variable and help: configuration built once.

An options class is a frozen dataclass whose fields are declared with ``option``; ``GROUP`` is the
``--help`` group its flags appear in::

    @dataclass(frozen=True, kw_only=True)
    class LimitOptions:
        GROUP: ClassVar[str] = "limits"
        max_images: int = option("images per request; more get 400", default="8", type=flag_types.positive_int)

The field's name is the flag (``--max-images``) and the variable (``SHMGATE_MAX_IMAGES``); its default
is the text default run through ``type``, so the dataclass and the parser cannot disagree. A command's
configuration is a dataclass inheriting the options classes it takes (gateway/config.py
``FrontendConfig``, worker/config.py ``WorkerConfig``, node/config.py ``ServeConfig``):

- ``add_options(parser, ServeConfig)`` declares every flag of it (shared/flags.py ``add_flag``: the
  variable, the typed default, the help suffix) in its group;
- ``from_args(ServeConfig, args)`` builds the typed value from what argparse parsed, once;
- ``encode`` / ``decode`` hand a built value to a child process whole (msgspec JSON in one environment
  variable, ``CHILD_CONFIG_ENV``), so a child never re-parses flags its parent parsed and no flag is
  mapped by hand from one process to the next.

A flag is therefore declared in exactly one place, its field. Fields without ``option`` (the instance
id, the slot, the resolved models) are configuration a parent computes, not flags.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

import msgspec

from shmgate.shared.flags import add_flag

__all__ = [
    "CHILD_CONFIG_ENV",
    "Flag",
    "Repeatable",
    "add_options",
    "child_config",
    "decode",
    "declared_flags",
    "encode",
    "from_args",
    "option",
    "project",
]

T = TypeVar("T")
_FLAG = "shmgate.flag"
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


def declared_flags(cls: type) -> Iterator[tuple[str, Flag]]:
    """(flag, its declaration) for every option field of ``cls``, in field order, each with its group."""
    for f in fields(cls):
        spec = f.metadata.get(_FLAG)
        if spec is None:
            continue
        if not spec.group:
            owner = next(c for c in cls.__mro__ if f.name in c.__dict__.get("__annotations__", {}))
            spec = Flag(**{**vars(spec), "group": getattr(owner, "GROUP", "options")})
        yield "--" + f.name.replace("_", "-"), spec


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
    """The ``cls`` value of what argparse parsed: every field the namespace has (a repeatable flag's
    every value), ``computed`` for the fields no flag sets; the rest keep their defaults. A field named
    ``given`` gets the repeatable flags typed on the command line (their ``<dest>_all`` is set)."""
    values: dict[str, Any] = {}
    if any(f.name == "given" for f in fields(cls)):  # type: ignore[arg-type]
        values["given"] = frozenset(k[: -len("_all")] for k, v in vars(args).items() if k.endswith("_all") and v)
    for f in fields(cls):  # type: ignore[arg-type]
        spec = f.metadata.get(_FLAG)
        if spec is not None and spec.repeatable:
            given = getattr(args, f.name + "_all", None)
            first = getattr(args, f.name, None)
            values[f.name] = tuple(given) if given else (() if first is None else (first,))
        elif hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    return cls(**{**values, **computed})


def project(cls: type[T], config: object, **computed: Any) -> T:
    """The ``cls`` part of a wider configuration (the frontend's of serve's): every field of ``cls`` that
    ``config`` has, ``computed`` for the rest. What a child gets is what its class declares, nothing more."""
    values = {f.name: getattr(config, f.name) for f in fields(cls) if hasattr(config, f.name)}  # type: ignore[arg-type]
    return cls(**{**values, **computed})


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
