"""A bounded cache of deterministic answers (embedding vectors, the classifier's labels), per frontend process.

Why: an embedding is a pure function of (model, preprocessing, input), and so is the answer of a
model whose preprocessor says ``deterministic_answers`` (the classifier: its top labels ignore the
sampling parameters; they are part of the key all the same). A repeated image already
skips its decode through the tensor cache in the arena; with this cache it also skips the worker:
no descriptor, no batch slot, no forward pass. It is off unless ``--result-cache-mb`` is set, keyed
by the content key of the input (shared.cache.content_key over the image's base64 text or bytes,
or the text) together with the model id and the preprocessing parameters, and bounded in bytes
with least-recently-used eviction.

Each frontend keeps its own, in process memory: it is not a mirror of anything (no entry refers to
another process's state), so it cannot drift the way vLLM's mirrored key cache did (docs/
ARCHITECTURE.md); the cost is that N frontends may each hold a copy of a popular vector. Clients
bypass it per request with ``Cache-Control: no-cache`` (the answer is computed afresh and stored).
Sampling never reaches it: a chat answer is cached only for models that declare deterministic answers
(never for ``hf:`` generators, whatever the temperature).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from shmgate.gateway.intake import LOOP_HASH_MAX_BYTES, GenerationRequest, image_digest
from shmgate.gateway.preprocess.base import Preprocessor
from shmgate.shared.vocabulary import content_key

__all__ = ["ResultCache", "ResultCacheStats", "answer_key", "keyed_off_the_loop", "result_key"]

T = TypeVar("T")

ENTRY_OVERHEAD_BYTES = 200  # the OrderedDict node, the key and the bytes object's header, roughly


def result_key(material: bytes | str, model: str, params: bytes, kind: str) -> bytes:
    """The cache key of one input: ``kind`` ("image"/"text") keeps an image's text and a text apart."""
    return content_key(material, b"%s|%s|" % (kind.encode(), model.encode()) + params)


def answer_key(chat: GenerationRequest, preprocessor: Preprocessor) -> bytes | None:
    """The key of a chat answer that is a pure function of the request, or None when the model's is not.

    Covers every image's content, the user's text and the sampling parameters.
    """
    if not preprocessor.deterministic_answers:
        return None
    h = hashlib.sha256()
    for image in chat.images:
        h.update(image_digest(image))  # kept with the image: its tensor key on a miss hashes it no more
    h.update(msgspec.msgpack.encode(chat.params))
    h.update(chat.text.encode())
    return result_key(h.digest(), chat.model, preprocessor.cache_params(), "chat")


async def keyed_off_the_loop(hashed_bytes: int, make_key: Callable[[], T]) -> T:
    """Compute a key by hashing ``hashed_bytes`` of input: on the loop when small, else in a thread.

    The frontend's rule for content keys (``LOOP_HASH_MAX_BYTES``): a few hundred µs of hashing on the
    loop is cheaper than a thread hop, a 32 MB body's tens of ms would stall every other request.
    """
    if hashed_bytes <= LOOP_HASH_MAX_BYTES:
        return make_key()
    return await asyncio.get_running_loop().run_in_executor(None, make_key)


@dataclass
class ResultCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0  # gauges, for /metrics (gateway/metrics.py FrontendStats.set_result_cache)
    bound_bytes: int = 0


class ResultCache:
    """LRU over ``key -> bytes`` holding at most ``max_bytes`` (values plus a per-entry overhead)."""

    def __init__(self, max_bytes: int) -> None:
        assert max_bytes > 0, "a result cache needs room; leave it out (None) to disable it"
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self.stats = ResultCacheStats(bound_bytes=max_bytes)
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()

    def get(self, key: bytes) -> bytes | None:
        value = self._entries.get(key)
        if value is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return value

    def put(self, key: bytes, value: bytes) -> None:
        size = len(value) + ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= len(old) + ENTRY_OVERHEAD_BYTES
        self._entries[key] = value
        self.used_bytes += size
        while self.used_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.used_bytes -= len(evicted) + ENTRY_OVERHEAD_BYTES
            self.stats.evictions += 1
        self.stats.entries = len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
