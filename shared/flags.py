"""Command-line flags that more than one command takes, each defined once.

``shmgate serve`` and ``python -m worker`` (which ``shmgate worker`` execs) both take the worker's
batching flags, and gateway/ and worker/ never import each other, so the definitions live here. Every
flag reads a ``SHMGATE_*`` environment variable as its default; the flag wins.

Two rules: a default is the environment's *string* (argparse runs a string default through the
flag's ``type``, so SHMGATE_MAX_BATCH_SIZE=eight is a usage error naming the flag, not a traceback);
and a parent passes flags to a child with ``forward``, read off the same definitions, never from a
hand-kept list.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Collection

__all__ = ["BATCH_POLICIES", "DTYPES", "add_batching_flags", "env", "forward"]

DTYPES = ("auto", "float32", "bfloat16", "float16")
BATCH_POLICIES = ("fcfs", "held")  # worker/batcher.py: what a worker takes while its model is busy


def env(name: str, default: str | None = None) -> str | None:
    """``SHMGATE_<name>``, or ``default`` when it is unset or empty."""
    return os.environ.get(f"SHMGATE_{name}") or default


def add_batching_flags(p: argparse.ArgumentParser) -> None:
    """The worker's batching and model flags, the same in ``serve`` and in ``worker``."""
    p.add_argument("--max-batch-size", type=int, default=env("MAX_BATCH_SIZE", "0"),
                   help="requests per batch (default 0: the model's choice: one forward pass for the classifier "
                        "on CPU, 2 per torch thread; 8 on CUDA and for other models)")
    p.add_argument("--max-batch-wait-ms", type=float, default=env("MAX_BATCH_WAIT_MS", "5"))
    p.add_argument("--batch-policy", default=env("BATCH_POLICY", "held"), choices=BATCH_POLICIES,
                   help="held: a busy worker's next batch gathers while the model runs; fcfs: a busy worker "
                        "takes nothing, requests wait in the shared queue for the first free worker (issue 16; "
                        "see worker/batcher.py and docs/BENCHMARKS.md)")
    p.add_argument("--dtype", default=env("DTYPE", "auto"), choices=DTYPES,
                   help="weights of hf: models (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--compile-normalise", action="store_true", default=env("COMPILE_NORMALISE") == "1",
                   help="efficientnet: compile the input normalisation into one kernel (needs a C compiler; "
                        "set TORCHINDUCTOR_CACHE_DIR to a persistent directory; see docs/ARCHITECTURE.md)")


def forward(
    args: argparse.Namespace, add_flags: Callable[[argparse.ArgumentParser], None], *, skip: Collection[str] = ()
) -> list[str]:
    """The command-line form of the values in ``args`` of the flags that ``add_flags`` defines.

    Flags whose value is None, or whose dest is in ``skip``, are left out (the child falls back to
    its own default); a store_true flag appears only when set.
    """
    probe = argparse.ArgumentParser(add_help=False)
    add_flags(probe)
    argv: list[str] = []
    for action in probe._actions:
        value = getattr(args, action.dest)
        if action.dest in skip or value is None:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv
