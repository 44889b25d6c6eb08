"""What each kind of command-line value accepts: the ``type=`` of every flag of serve, gateway and worker.

Each converter takes the text as typed (or as found in a ``SHMGATE_*`` variable) and returns the
value, or raises ``argparse.ArgumentTypeError`` with a message that says what was expected, so
that a bad value stops the command when its flags are parsed, before any process, queue or
shared-memory object exists. shared/flags.py prefixes the message with the flag or the variable
the value came from; the messages here therefore never name a flag.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TypeVar

from shmgate.shared.models import parse_model_spec
from shmgate.shared.names import parse_size

__all__ = [
    "AUTO",
    "LOG_LEVELS",
    "auto_count",
    "choice",
    "device",
    "flag_bool",
    "log_level",
    "model_spec",
    "non_negative_float",
    "non_negative_int",
    "port",
    "positive_float",
    "positive_int",
    "size",
]

AUTO = 0  # what auto_count returns for "auto": the caller picks the count
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


N = TypeVar("N", int, float)


def _at_least(convert: Callable[[str], N], low: N, inclusive: bool, rule: str) -> Callable[[str], N]:
    """A flag type: ``convert`` the text, then refuse a value under ``low`` (or equal, when not inclusive)."""

    def check(text: str) -> N:
        value = convert(text)
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"{text!r} must be {rule}")
        return value

    return check


positive_int = _at_least(_int, 1, True, "1 or more")
non_negative_int = _at_least(_int, 0, True, "0 or more")
positive_float = _at_least(_float, 0.0, False, "more than 0")
non_negative_float = _at_least(_float, 0.0, True, "0 or more")


def auto_count(text: str) -> int:
    """``auto`` (returned as ``AUTO``, 0) or a count of 1 or more.

    0 is refused rather than read as "auto": a user who types 0 may mean "none", and the
    command cannot run with no frontends or no workers.
    """
    if text.strip().lower() == "auto":
        return AUTO
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use auto for the default, or a count of 1 or more")
    return value


def port(text: str) -> int:
    value = _int(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: use 1 to 65535")
    return value


def size(text: str) -> int:
    """A byte count: ``512MiB``, ``1GiB``, ``64M``, ``1000000``."""
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use e.g. 512MiB or 1GiB") from None


def log_level(text: str) -> str:
    value = text.strip().lower()
    if value not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level: use one of {', '.join(LOG_LEVELS)}")
    return value


def flag_bool(text: str) -> bool:
    """The value of an on/off flag's variable: 1/true/yes/on or 0/false/no/off (empty: off)."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not on or off: use 1 or 0")


def choice(*values: str) -> Callable[[str], str]:
    """One of ``values`` (argparse checks ``choices=`` only for a typed flag, never for a default)."""

    def convert(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(values)}")
        return text

    convert.__name__ = "choice"
    return convert


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``: the spelling only; gateway/config_checks.py asks the machine."""
    head, colon, tail = text.partition(":")
    if text == "cpu" or text == "cuda" or (head == "cuda" and colon and tail.isdigit()):
        return text
    hint = " (a GPU is cuda)" if text.lower() in ("gpu", "nvidia") else ""
    raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda or cuda:N{hint}")


def model_spec(text: str) -> str:
    """A model spec that names something servable: a known name, or an ``hf:`` checkpoint directory
    that exists and has a config.json (shared/models.py says which forms exist)."""
    try:
        spec = parse_model_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if spec.directory is not None:
        if not os.path.isdir(spec.directory):
            raise argparse.ArgumentTypeError(
                f"{spec.directory}: no such directory (an hf: model is a local checkpoint directory; download it first)"
            )
        if not os.path.isfile(os.path.join(spec.directory, "config.json")):
            raise argparse.ArgumentTypeError(f"{spec.directory}: not a Hugging Face checkpoint (no config.json)")
    return text
