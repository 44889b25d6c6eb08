"""Checks of the configuration that need the machine, run by ``serve`` after its flags parse and before
anything starts.

shared/flag_types.py checks what a value *says* (``cuda:1`` is a device); this module checks what the
machine *has* (is there a GPU 1 here, can this torch use it), so that ``shmgate serve --device cuda`` on
a CPU-only machine ends at once with one line instead of workers crashing and restarting.

Nothing here imports torch: the supervisor and the frontends stay light, and a check must take
milliseconds. Each failure raises ConfigError, whose message names the flag or the SHMGATE_*
variable the value came from (``given``, from shared/flags.py ``origin``) and says what to do.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable

__all__ = ["ConfigError", "check_device", "torch_cuda_build"]


class ConfigError(Exception):
    """The configuration cannot work on this machine; the message is the one line the user sees."""


def torch_cuda_build() -> str | None:
    """The CUDA version the installed torch was built for, read from its ``version.py`` without
    importing torch (seconds, and hundreds of MB); None for a CPU-only build or no torch at all."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    match = re.search(r"^cuda(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return match.group(1) if match else None


def check_device(
    device: str | None,
    gpu_ids: list[str],
    *,
    given: str = "",
    remedy: str = "use --device cpu",
    cuda_build: Callable[[], str | None] = torch_cuda_build,
) -> None:
    """Refuse a CUDA ``device`` this machine cannot run. None (the default: cuda when a GPU is
    visible) and ``cpu`` always pass. ``gpu_ids``: the visible GPUs (node/plan.py ``visible_gpus``);
    ``given``: where the value came from, for the message (default ``--device <device>``); ``remedy``:
    what to change there (a config file's model changes its ``device`` key, not a flag)."""
    if device is None or not device.startswith("cuda"):
        return
    given = given or f"--device {device}"
    if not gpu_ids:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = f"CUDA_VISIBLE_DEVICES={hidden!r} hides them" if hidden is not None else "no NVIDIA GPU was found"
        raise ConfigError(f"{given}: no GPU is visible ({why}); {remedy}")
    _, _, index = device.partition(":")
    if index and int(index) >= len(gpu_ids):
        raise ConfigError(f"{given}: only {len(gpu_ids)} GPU(s) are visible, cuda:0 to cuda:{len(gpu_ids) - 1}")
    if cuda_build() is None:
        raise ConfigError(
            f"{given}: the installed torch is a CPU-only build; install a CUDA build of torch "
            f"(https://pytorch.org/get-started/locally/) or {remedy}"
        )
