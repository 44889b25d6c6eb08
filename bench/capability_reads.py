"""What a frontend pays per request to read its model's declared capabilities.

Why: every chat request reads the preprocessor's capabilities in gateway/fields.py
(``check_fields_for_model``: samples_tokens, vocab_size; ``with_image_options``: image_options). They are declared attributes and
methods of ``Preprocessor`` (gateway/preprocess/base.py) rather than ``getattr`` probes with defaults;
this measures the per-request cost of those reads for the two classifiers (one image, no options), the
best of 5 runs, so a before/after pair can be compared on one machine. Run it from each checkout:
``PYTHONPATH=<checkout> python bench/capability_reads.py`` (the script itself may come from either).

Usage: ``python bench/capability_reads.py [--iters N]``. Prints microseconds per request.
"""

from __future__ import annotations

import argparse
import time

from shmgate.gateway.fields import check_fields_for_model, with_image_options
from shmgate.gateway.intake import ChatRequest
from shmgate.gateway.preprocess.vision import ChecksumPreprocessor, EfficientNetPreprocessor, FixedSizePreprocessor
from shmgate.shared.wire import SamplingParams


def per_request_us(pre: FixedSizePreprocessor, iters: int) -> float:
    """Best-of-5 µs of one request's capability reads: the token fields' check and the image options."""
    params = SamplingParams()
    chat = ChatRequest(pre.model, [], [], [], params, False, False)
    chat.image_details = [None]  # one image, no image_url.detail
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            check_fields_for_model(params, pre)
            with_image_options(chat, pre)
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200_000)
    args = parser.parse_args()
    for pre in (ChecksumPreprocessor(), EfficientNetPreprocessor()):
        print(f"{pre.model}: {per_request_us(pre, args.iters):.3f} us/request")


if __name__ == "__main__":
    main()
