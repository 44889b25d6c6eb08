"""The seam's vocabulary: the clock, states, timeouts and cache words every side of the transport shares.

Why a module of its own: the gateway, the worker and each transport (shared/transport/posix.py over
the segment, memory.py in one process) speak these words, but none of them is a POSIX object. Kept
here, apart from the segment, the arena and the queues, a module in gateway/ or worker/ reaches them
without importing the shared-memory layer; only the composition roots that build the POSIX transport
do that (tests/test_import_rules.py holds the line). The segment stores these states and stamps in
its rows; the meaning is defined here.
"""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from blake3 import blake3

from shmgate.shared.wire import TensorRef

if TYPE_CHECKING:
    from shmgate.shared.arena import Allocation  # only the POSIX cache fills ``TensorGroup.allocations``


__all__ = [
    "DEAD_AFTER_S",
    "HEARTBEAT_INTERVAL_S",
    "MODEL_NAME_BYTES",
    "AllocateFn",
    "CacheStats",
    "InstanceState",
    "SlotState",
    "TensorGroup",
    "check_model_id",
    "content_key",
    "key_of_digest",
    "material_digest",
    "now_ns",
]

# -- the clock and the timeouts ---------------------------------------------------------------


def now_ns() -> int:
    """CLOCK_MONOTONIC in ns: the clock of every heartbeat and deadline.

    Every container on one kernel shares it, so stamps from different processes compare.
    """
    return time.monotonic_ns()


HEARTBEAT_INTERVAL_S = 0.2  # how often a process stamps its slot row's heartbeat
DEAD_AFTER_S = 3.0  # a process whose heartbeat is older than this (15 missed beats) is dead


# -- states ---------------------------------------------------------------------------------


class SlotState(enum.IntEnum):
    """The life of one frontend or worker slot."""

    FREE = 0  # never claimed, or released cleanly
    STARTING = 1  # claimed; loading (a worker loading its model)
    READY = 2  # serving
    DRAINING = 3  # finishing in-flight work, takes nothing new
    DEAD = 4  # marked dead by the supervisor (faster than waiting for the heartbeat to age)


class InstanceState(enum.IntEnum):
    """The life of the whole instance, as its supervisor announces it."""

    RUNNING = 1
    DRAINING = 2  # new requests get 503; requests in flight finish
    STOPPED = 3
    DRAINED = 4  # still draining, and no request is in flight any more: workers following the drain exit


# -- model ids --------------------------------------------------------------------------------

MODEL_NAME_BYTES = 128  # a worker refuses to start with a longer model id (it could never match)


def check_model_id(model_id: str) -> None:
    """Refuse a model id the slot rows cannot hold whole: cut, it would never match (ValueError)."""
    if len(model_id.encode()) > MODEL_NAME_BYTES:
        raise ValueError(
            f"the model id {model_id[:60]!r}... is longer than {MODEL_NAME_BYTES} bytes; "
            "serve it from a directory with a shorter name"
        )


# -- the content cache's words ------------------------------------------------------------------

AllocateFn = Callable[[str, str, tuple[int, ...]], np.ndarray]


def material_digest(data: bytes | str) -> bytes:
    """BLAKE3 of an image's bytes or of its data URL's base64 text: the costly half of its keys.

    A str is the base64 text of a data URL, keyed as text so a repeated image is never decoded
    (gateway.intake.EncodedImage); the two kinds are hashed apart, so the same image sent both
    ways is two entries, never a confusion. A cache key must resist collisions crafted by a client,
    so the hash is a cryptographic one: BLAKE3 (the blake3 package) hashes the 220 KB text of a
    1024 px photo in ~45 µs here, SHA-256 with the SHA extensions in ~135 µs, hashlib's BLAKE2b in
    ~250 µs (``python bench/key_cost.py``). A dependency, not optional: every frontend of an
    instance must key alike.
    Split from ``content_key`` so that an image keyed twice (its answer's key, then its tensors')
    is hashed once: the digest is kept with the image (``EncodedImage.digest``).
    """
    h = blake3()
    if isinstance(data, str):
        h.update(b"b64:")
        h.update(data.encode("utf-8", "surrogatepass"))
    else:
        h.update(b"raw:")
        h.update(data)
    return h.digest()


def key_of_digest(digest: bytes, params: bytes) -> bytes:
    """16-byte key of an image from its ``material_digest`` and the preprocessing parameters (~1 µs)."""
    h = hashlib.sha256()
    h.update(len(params).to_bytes(4, "little"))
    h.update(params)
    h.update(digest)
    return h.digest()[:16]


def content_key(data: bytes | str, params: bytes) -> bytes:
    """16-byte key of an image: its bytes (or its data URL's base64 text) plus the preprocessing parameters.

    ``key_of_digest(material_digest(data), params)``; a caller that keys one image several times
    computes the digest once and calls ``key_of_digest``.
    """
    return key_of_digest(material_digest(data), params)


@dataclass(eq=False)
class TensorGroup:
    """The tensors of one image, in this frontend's part of the arena.

    ``refs`` are what travels in a descriptor; ``allocations`` are the owner's blocks behind them
    (shared/cache.py fills them; a transport without blocks leaves them empty).
    """

    key: bytes | None
    allocations: list[Allocation] = field(default_factory=list)
    refs: list[TensorRef] = field(default_factory=list)
    holds: int = 0
    indexed: bool = False


@dataclass
class CacheStats:
    """A content cache's counts since it started (the frontend publishes them as counters)."""

    hits: int = 0
    remote_hits: int = 0
    misses: int = 0
    evictions: int = 0
