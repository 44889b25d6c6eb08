"""A request's image processor options (``mm_processor_kwargs``), checked and bounded before any image work.

The operator bounds the pixel budget (the checkpoint's processor config, overridden by
``--mm-processor-kwargs``); a request may lower it, never raise it: every ``size`` value a request
sends (and ``min_pixels`` / ``max_pixels``, the Qwen2-VL family's names for ``size``'s
``shortest_edge`` / ``longest_edge``) is at most the configured one, so one request cannot buy
16 times the tokens, time and memory of the operator's setting.

Types and ranges are checked here, each failure a 400 naming ``mm_processor_kwargs``, because the
processor's own failures are a mixed bag: transformers' strict dataclass validation raises an
exception class of huggingface_hub (a 500 before), and its ValueErrors read as if the image were at
fault. Values that would make pixels non-finite (a zero ``image_std``, a huge ``rescale_factor``)
are refused: NaN pixels reach the model as NaN logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from shmgate.shared.errors import InvalidRequest

__all__ = ["PIXEL_KEYS", "bounded_options"]

PARAM = "mm_processor_kwargs"
# The Qwen2-VL family's pixel budget, as its processor maps it onto ``size``.
PIXEL_KEYS = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}
_RESAMPLE_FILTERS = range(6)  # PIL: NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING
_CHANNELS = 3


def _refuse(key: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"mm_processor_kwargs: {key} must be {what}", param=PARAM)


def _number(key: str, value: object, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise _refuse(key, f"a number between {low:g} and {high:g}")
    return float(value)


def _per_channel(key: str, value: object, low: float, high: float) -> float | list[float]:
    """One number, or one per colour channel (ints are taken as floats, as the processor's config has them)."""
    if isinstance(value, list):
        if len(value) != _CHANNELS:
            raise _refuse(key, f"one number or a list of {_CHANNELS} (one per channel)")
        return [_number(key, v, low, high) for v in value]
    return _number(key, value, low, high)


def _resample(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in _RESAMPLE_FILTERS:
        raise _refuse(key, "a PIL resampling filter, 0 to 5")
    return value


def _positive_int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refuse(key, "a positive integer")
    return value


# Checked (and normalised) per key; a key not listed is passed on for the processor to judge.
_CHECKS: dict[str, Callable[[str, object], object]] = {
    "rescale_factor": lambda k, v: _number(k, v, 1e-6, 1.0),
    "image_mean": lambda k, v: _per_channel(k, v, -1.0, 2.0),
    "image_std": lambda k, v: _per_channel(k, v, 1e-3, 1e3),
    "resample": _resample,
}


def bounded_options(
    requested: Mapping[str, Any], configured_size: Mapping[str, Any], annotations: Mapping[str, Any]
) -> dict[str, Any]:
    """``requested`` checked, with its pixel budget inside ``configured_size`` (the processor's ``size``).

    ``annotations`` are the processor's declared argument types: a key declared ``bool`` must be a bool.
    Returns the options to call the processor with (``min_pixels``/``max_pixels`` folded into ``size``).
    Raises InvalidRequest naming ``mm_processor_kwargs``.
    """
    options: dict[str, Any] = {}
    size_request: dict[str, int] = {}
    for key, value in requested.items():
        if key in PIXEL_KEYS:
            size_request[PIXEL_KEYS[key]] = _positive_int(key, value)
        elif key == "size":
            if not isinstance(value, dict):
                raise _refuse(key, "an object of positive integers")
            size_request.update({f"size.{k}": _positive_int(f"size.{k}", v) for k, v in value.items()})
        elif key in _CHECKS:
            options[key] = _CHECKS[key](key, value)
        elif str(annotations.get(key, "")).replace("typing.Optional[bool]", "bool | None") == "bool | None":
            if not isinstance(value, bool):
                raise _refuse(key, "true or false")
            options[key] = value
        else:
            options[key] = value
    if size_request:
        options["size"] = _bounded_size(size_request, configured_size)
    return options


def _bounded_size(request: dict[str, int], configured: Mapping[str, Any]) -> dict[str, int]:
    """The configured size with the request's values, none above its bound (a pixel budget's minimum is
    bounded by its maximum: raising the minimum up to the operator's maximum costs no more than it)."""
    bounds = {k: int(v) for k, v in configured.items() if isinstance(v, int) and not isinstance(v, bool)}
    size = dict(bounds)
    for name, value in request.items():
        key = name.removeprefix("size.")
        if key not in bounds:
            raise _refuse(name, f"one of this processor's size keys: {sorted(bounds)}")
        size[key] = value
    for key, value in size.items():
        bound = bounds["longest_edge"] if key == "shortest_edge" and "longest_edge" in bounds else bounds[key]
        if value > bound:
            shown = {v: k for k, v in PIXEL_KEYS.items()}.get(key, f"size.{key}") if "longest_edge" in bounds else key
            raise InvalidRequest(
                f"mm_processor_kwargs: {shown} may lower this server's image budget, not raise it "
                f"(at most {bound}, got {value})",
                param=PARAM,
            )
    if size.get("shortest_edge", 0) > size.get("longest_edge", math.inf):
        if "shortest_edge" in request or "size.shortest_edge" in request:
            raise _refuse("min_pixels", "at most max_pixels")
        size["shortest_edge"] = size["longest_edge"]  # a maximum lowered below the configured minimum
    return size
