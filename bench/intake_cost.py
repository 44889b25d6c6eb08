"""The frontend's request intake per 1024 px photo, in-process: JSON decode (one pass or two) and base64.

Each pair is timed alternately (A B B A ...) in one process, best of 3 repeats per round, so the
ratio holds on a busy machine. Rows:

* ``parse_chat_request``: the intake as it is, against the old shape (typed decode, then a second
  decode of the keys for the unknown-field warning, on every body);
* base64: ``gateway.intake.strict_b64decode`` (pybase64 when installed) against
  ``binascii.a2b_base64(strict_mode=True)``.

Usage: ``python bench/intake_cost.py [--rounds 6]``.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from shmgate.gateway import intake  # noqa: E402

PHOTO = REPO / "tests" / "data" / "images" / "camera_1024.jpg"


def _body() -> bytes:
    url = "data:image/jpeg;base64," + base64.b64encode(PHOTO.read_bytes()).decode()
    content = [{"type": "text", "text": "What is in this image?"}, {"type": "image_url", "image_url": {"url": url}}]
    return json.dumps({"model": "checksum", "messages": [{"role": "user", "content": content}]}).encode()


def alternated(a: Callable[[], object], b: Callable[[], object], rounds: int, number: int) -> tuple[float, float]:
    """Median µs per call of ``a`` and ``b``, timed A B B A ..."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for r in range(rounds):
        for which in (0, 1) if r % 2 == 0 else (1, 0):
            f = (a, b)[which]
            times[which].append(min(timeit.repeat(f, number=number, repeat=3)) / number * 1e6)
    return statistics.median(times[0]), statistics.median(times[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    body, limits = _body(), intake.IntakeLimits()
    text = intake.parse_chat_request(body, limits).images[0].text  # type: ignore[union-attr]

    def two_passes() -> object:
        chat = intake.chat_request_from(intake.decode_body(intake._decoder, body), limits)
        intake.warn_unknown_fields(body)
        return chat

    rows = [
        (
            "parse_chat_request: one pass / two passes",
            alternated(lambda: intake.parse_chat_request(body, limits), two_passes, args.rounds, 200),
        ),
        (
            "base64 of the photo: strict_b64decode / binascii strict",
            alternated(
                lambda: intake.strict_b64decode(text),
                lambda: binascii.a2b_base64(text, strict_mode=True),
                args.rounds,
                100,
            ),
        ),
    ]
    print(f"pybase64: {'installed' if intake._simd_decode is not None else 'not installed'}; body {len(body):,} bytes")
    print("| what | new µs | old µs | new / old |\n|---|---:|---:|---:|")
    for name, (new, old) in rows:
        print(f"| {name} | {new:.0f} | {old:.0f} | {new / old:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
