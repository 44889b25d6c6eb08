"""Command-line flags: how every flag is declared, and the flags more than one command takes.

``shmgate serve`` and ``python -m shmgate.worker`` (which ``shmgate worker`` execs) both take the worker's
batching flags, and gateway/ and worker/ never import each other, so the definitions live here.

Rules every flag keeps, because every flag is declared with ``add_flag``:
- it reads ``SHMGATE_<NAME>`` as its default, and the flag wins; an empty variable means unset;
- its help ends with its default and its variable (``(default: 8000) [env: SHMGATE_PORT]``),
  written here once, never by hand;
- a default is text run through the flag's ``type`` (shared/flag_types.py) when the flag is absent,
  so a bad variable is refused like a bad flag, and the one line that says so names the variable
  (``SHMGATE_PORT='eighty' ...``), not the flag the user never typed;
- ``ShmgateParser`` reports any usage error as one line and exit status 2, never a traceback.

A parent passes flags to a child with ``forward``, read off the same definitions, never from a
hand-kept list.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import os
from collections.abc import Callable, Collection, Sequence
from typing import Any, NoReturn

from shmgate.shared import flag_types

__all__ = [
    "BATCH_POLICIES",
    "DTYPES",
    "EnvValue",
    "ShmgateParser",
    "add_batching_flags",
    "add_flag",
    "env",
    "forward",
    "origin",
    "version",
]

DTYPES = ("auto", "float32", "bfloat16", "float16")
BATCH_POLICIES = ("fcfs", "held")  # worker/batcher.py: what a worker takes while its model is busy
ENV_PREFIX = "SHMGATE_"


@functools.cache
def version() -> str:
    """The installed package's version (``pip install`` or an editable checkout), read once."""
    try:
        return importlib.metadata.version("shmgate")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def env(name: str, default: str | None = None) -> str | None:
    """``SHMGATE_<name>``, or ``default`` when it is unset or empty."""
    return os.environ.get(ENV_PREFIX + name) or default


class EnvValue(str):
    """A flag's default text that came from the environment, remembering its variable.

    argparse converts a text default through the flag's ``type`` only when the flag is absent,
    so a conversion error on an EnvValue is about the variable, and says so. The converted value
    is a plain str or number: the marker never leaves the parser.
    """

    variable: str

    def __new__(cls, text: str, variable: str) -> EnvValue:
        value = super().__new__(cls, text)
        value.variable = variable
        return value


class EnvValueError(Exception):
    """A variable's value was refused. Not a ValueError, so argparse lets it through to ShmgateParser,
    which reports it without the ``argument --flag:`` prefix of a typed flag's error."""


def origin(argv: Sequence[str], flag: str, value: object) -> str:
    """Where a parsed ``value`` came from, for a message about it: ``--device cuda`` when ``flag`` is
    on the command line ``argv``, else ``SHMGATE_DEVICE='cuda'`` when its variable is set."""
    variable = ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()
    typed = any(arg == flag or arg.startswith(flag + "=") for arg in argv)
    if not typed and os.environ.get(variable):
        return f"{variable}={str(value)!r}"
    return f"{flag} {value}"


def _typed(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """``convert``, with a refused EnvValue reported as its variable's error. The converter gets a
    plain str, so no EnvValue reaches the values a command passes on (wire structs, the segment)."""

    def parse(text: str) -> Any:
        try:
            return convert(str(text))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            if isinstance(text, EnvValue):
                raise EnvValueError(f"{text.variable}: {exc}") from None
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


class OnOff(argparse.Action):
    """An on/off flag: present means on; absent, its variable decides (1/0, true/false, ...)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.pop("nargs", None)
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True)


def add_flag(
    group: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    help: str,
    *,
    default: str | None = None,
    type: Callable[[str], Any] | None = None,
    shown_default: str | None = None,
    on_off: bool = False,
    metavar: str | None = None,
    action: type[argparse.Action] | None = None,
) -> argparse.Action:
    """Declare ``flag`` with its variable, its typed default and its help suffix.

    The variable is named after the flag (``--max-images``: ``SHMGATE_MAX_IMAGES``). ``shown_default``: what the help says when ``default`` alone would not tell
    (None: "none", computed defaults). ``on_off``: a flag without a value, off unless given.
    ``action``: an argparse Action class for the value (a flag that may be repeated, for instance).
    """
    variable = ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()
    raw = os.environ.get(variable) or None
    if on_off:
        default, type = (default or "0"), flag_types.flag_bool
    value: str | None = EnvValue(raw, variable) if raw is not None else default
    shown = shown_default if shown_default is not None else ("off" if on_off else default)
    suffix = f"(default: {shown if shown is not None else 'none'}) [env: {variable}]"
    kwargs: dict[str, Any] = {"default": value, "help": f"{help} {suffix}", "type": _typed(type or str)}
    if metavar is not None:
        kwargs["metavar"] = metavar
    if on_off:
        kwargs["action"] = OnOff
    elif action is not None:
        kwargs["action"] = action
    return group.add_argument(flag, **kwargs)


class ShmgateParser(argparse.ArgumentParser):
    """An ArgumentParser whose every usage error is one line on stderr and exit status 2.

    argparse's own error prints the whole usage first, which buries the one line that matters
    in a terminal and in a container log.
    """

    def parse_known_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        try:
            return super().parse_known_args(args, namespace)
        except EnvValueError as exc:
            self.error(str(exc))

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_batching_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The worker's batching and model flags, the same in ``serve`` and in ``worker``."""
    add_flag(
        p,
        "--max-batch-size",
        "requests per batch; 0: the model's choice (one forward pass for the "
        "classifier on CPU, 2 per torch thread; 8 on CUDA and for other models)",
        default="0",
        type=flag_types.non_negative_int,
    )
    add_flag(
        p,
        "--max-batch-wait-ms",
        "how long a worker waits for a batch to fill once it has a request",
        default="5",
        type=flag_types.non_negative_float,
    )
    add_flag(
        p,
        "--batch-policy",
        "held: a busy worker's next batch gathers while the model runs; fcfs: a "
        "busy worker takes nothing, requests wait in the shared queue for the first free worker "
        "(worker/batcher.py, docs/TUNING.md)",
        default="held",
        type=flag_types.choice(*BATCH_POLICIES),
        metavar="{" + ",".join(BATCH_POLICIES) + "}",
    )
    add_flag(
        p,
        "--dtype",
        "weights of hf: models (auto: bfloat16 on CUDA, float32 on CPU)",
        default="auto",
        type=flag_types.choice(*DTYPES),
        metavar="{" + ",".join(DTYPES) + "}",
    )
    add_flag(
        p,
        "--compile-normalise",
        "efficientnet: compile the input normalisation into one kernel (needs a "
        "C compiler; set TORCHINDUCTOR_CACHE_DIR to a persistent directory; see docs/ARCHITECTURE.md)",
        on_off=True,
    )


def forward(
    args: argparse.Namespace,
    add_flags: Callable[[argparse.ArgumentParser], None],
    *,
    skip: Collection[str] = (),
) -> list[str]:
    """The command-line form of the values in ``args`` of the flags that ``add_flags`` defines.

    Flags whose value is None, or whose dest is in ``skip``, are left out (the child falls back to
    its own default); an on/off flag appears only when on.
    """
    probe = argparse.ArgumentParser(add_help=False)
    add_flags(probe)
    argv: list[str] = []
    for action in probe._actions:
        value = getattr(args, action.dest)
        if action.dest in skip or value is None:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv
