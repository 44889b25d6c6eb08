"""CPU of keying one 1024 px data-URL image on a result-cache miss: its answer's key, then its tensors' key.

With ``--result-cache-mb`` a miss keys each image twice. Runs against whichever checkout is first on
the path, so two commits compare in one sitting (ABBA):

    PYTHONPATH=$PWD python bench/key_cost.py new
    cd BASE && PYTHONPATH=BASE python $OLDPWD/bench/key_cost.py base

Prints the least CPU per miss over 5 batches of 200 freshly parsed requests (a parsed image keeps its
digest, so each batch parses anew).
"""

from __future__ import annotations

import base64
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import shmgate.gateway.images as images
from shmgate.gateway.intake import IntakeLimits, key_material, parse_chat_request
from shmgate.gateway.preprocess.vision import ChecksumPreprocessor
from shmgate.gateway.result_cache import answer_key

PHOTOS = sorted((Path.cwd() / "tests" / "data" / "images").glob("*_1024.jpg"))


def tensor_key_function(params: bytes) -> Callable[[Any], bytes]:
    """The tensor key as this checkout's gateway/images.py forms it."""
    if hasattr(images, "key_of_digest"):
        from shmgate.gateway.intake import image_digest  # type: ignore[attr-defined,unused-ignore]

        return lambda image: images.key_of_digest(image_digest(image), params)
    return lambda image: images.content_key(key_material(image), params)  # type: ignore[attr-defined]


def main() -> None:
    photo = base64.b64encode(PHOTOS[0].read_bytes()).decode()
    body = json.dumps(
        {
            "model": "checksum",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{photo}"}}],
                }
            ],
        }
    ).encode()
    preprocessor = ChecksumPreprocessor()
    tensor_key = tensor_key_function(preprocessor.cache_params())
    best = []
    for _ in range(5):
        chats = [parse_chat_request(body, IntakeLimits()) for _ in range(200)]
        started = time.process_time()
        for chat in chats:
            answer_key(chat, preprocessor)
            tensor_key(chat.images[0])
        best.append((time.process_time() - started) / len(chats))
    label = sys.argv[1] if len(sys.argv) > 1 else "this checkout"
    print(f"{label}: {min(best) * 1e3:.3f} ms per result-cache miss keyed (least of 5 x 200)")


if __name__ == "__main__":
    main()
