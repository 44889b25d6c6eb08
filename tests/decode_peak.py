"""Measure the peak memory of decoding images, in a fresh process: ``python -m tests.decode_peak MAX_PIXELS FILE...``.

Why a process of its own and RSS: Pillow and the codecs allocate pixels with plain malloc, which
tracemalloc does not see; the kernel's high-water mark (VmHWM) sees everything. The mark is reset
(``/proc/self/clear_refs`` 5) after the imports, a warm-up decode per format and ``malloc_trim``
(so memory a previous decode freed is not silently reused), so it counts one decode only.

Prints one JSON object per file: ``peak_bytes`` (high-water mark above the resident size before the decode),
``predicted_bytes`` (gateway/decode_cost.py's ``peak_bytes``, or null when the decode is refused),
``held_bytes`` (resident growth while the result is still referenced, after the decode returned),
``rgb_bytes`` (width x height x 3 of the result) and ``seconds``.
"""

from __future__ import annotations

import ctypes
import io
import json
import sys
import time
from pathlib import Path

from PIL import Image

from shmgate.gateway import imaging
from shmgate.shared.errors import ImageTooLarge


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def warm_up() -> None:
    """Decode a tiny image of each format: maps the codecs' code, so its pages are not counted."""
    for fmt in ("JPEG", "PNG", "WEBP"):
        warm = io.BytesIO()
        Image.new("RGB", (8, 8)).save(warm, fmt)
        imaging.decode(warm.getvalue(), max_pixels=64)


def measure(data: bytes, max_pixels: int) -> dict[str, object]:
    """One decode's peak; call ``warm_up`` first."""
    predicted: int | None = None
    predict = getattr(imaging, "predict", None)  # absent from older code, which bench/ compares with
    if predict is not None:
        try:
            predicted = predict(data, max_pixels=max_pixels).peak_bytes
        except ImageTooLarge:
            pass
    _LIBC.malloc_trim(0)  # give back what earlier decodes freed: reusing it would hide this one's peak
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    try:
        image = imaging.decode(data, max_pixels=max_pixels).image
        width, height = image.size
        refused = None
        _LIBC.malloc_trim(0)
        held = _status_kib("VmRSS") - before  # what the result keeps alive while it is resized
        del image
    except ImageTooLarge as exc:
        width = height = held = 0
        refused = str(exc)
    seconds = time.perf_counter() - started
    peak = _status_kib("VmHWM") - before
    return {
        "peak_bytes": peak * 1024,
        "held_bytes": held * 1024,
        "predicted_bytes": predicted,
        "rgb_bytes": width * height * 3,
        "seconds": seconds,
        "refused": refused,
    }


_LIBC = ctypes.CDLL("libc.so.6")

if __name__ == "__main__":
    warm_up()
    for path in sys.argv[2:]:
        print(json.dumps(measure(Path(path).read_bytes(), int(sys.argv[1]))), flush=True)
