"""A frontend's decode memory budget: concurrent decodes together stay under a byte bound.

Why: ``--max-pixels`` bounds one image, but a frontend decodes several at once (its decode threads,
several images per request, several requests). Each decode reserves its predicted peak
(gateway/decode_cost.py) before it starts and gives it back when its tensors are written; a decode
that does not fit waits, for a bounded time, for others to finish, and is then refused with a
503 and Retry-After. Memory stays bounded; the process is never OOM-killed.

Invariants:
1. ``reserved_bytes <= capacity_bytes`` at all times.
2. A reservation larger than the whole budget is refused at once with ImageTooLarge (413): waiting
   could never make it fit.
3. Memory a large decode freed goes back to the OS: when the budget falls idle after a reservation of
   ``TRIM_AFTER_BYTES`` or more, glibc's ``malloc_trim`` returns the freed heap pages. (glibc raises
   its mmap threshold after each large free, so the next large buffers come from the decode threads'
   heaps, which keep their pages. Measured: 12 decodes of a 4000x3000 JPEG on 4 threads through a
   Qwen2-VL processor left a process at 867 MiB resident from 366 MiB; with the trim, at 397 MiB.)
4. Waiting happens in the decode thread (``ImageResolver``'s pool), never on the event loop.
   Whoever fits goes first: a small photo is not held behind a huge image waiting for room.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from shmgate.gateway.imaging import predict
from shmgate.gateway.video import DEFAULT_LIMITS, VideoLimits, is_video
from shmgate.shared.errors import ImageTooLarge, Overloaded
from shmgate.shared.names import format_bytes
from shmgate.shared.vocabulary import AllocateFn

if TYPE_CHECKING:
    from shmgate.gateway.preprocess.base import Preprocessor

__all__ = ["TRIM_AFTER_BYTES", "DecodeBudget"]

TRIM_AFTER_BYTES = 64 << 20


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (another C library: nothing to call)."""
    try:
        return cast("Callable[[int], int]", ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim)
    except (OSError, AttributeError):
        return None


class DecodeBudget:
    """Bytes reserved by the decodes running in one frontend, bounded by ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, *, wait_s: float, video: VideoLimits = DEFAULT_LIMITS) -> None:
        """``video``: what one video part may hold (``--max-video-seconds``, ``--max-video-frames``)."""
        assert capacity_bytes > 0, "a zero budget would refuse every image"
        self.capacity_bytes = capacity_bytes
        self.wait_s = wait_s
        self.video = video
        self.reserved_bytes = 0
        self.refused = 0  # decodes that waited wait_s in vain (for tests and metrics)
        self.trims = 0  # times freed memory was handed back to the OS (invariant 3)
        self._trim = _malloc_trim()
        self._large_since_trim = False
        self._room = threading.Condition()

    def preprocess(
        self,
        pre: Preprocessor,
        data: bytes,
        allocate: AllocateFn,
        *,
        max_pixels: int,
        options: dict[str, Any] | None = None,
    ) -> None:
        """``pre.preprocess_image(data, ...)`` once the memory its decode needs is free: the header says
        how much (``gateway.imaging.predict``), and that much, plus what the processor's work on the
        image will take (``Preprocessor.plan_image``, which also refuses an image too large for the
        model's context from the header alone), is reserved for the decode's length; a video reserves
        what its container's probe predicts (gateway/video.py). The one way every decode of a frontend
        (chat, embeddings, /tokenize) goes through the budget."""
        if is_video(options):
            pre.preprocess_video(data, allocate, self.reserve, self.video)
            return
        cost = predict(data, max_pixels=max_pixels)
        work_bytes = pre.plan_image(cost.width, cost.height, options)  # may refuse: before any decode
        with self.reserve(cost.peak_bytes + work_bytes):
            pre.preprocess_image(data, allocate, max_pixels=max_pixels, options=options)

    @contextmanager
    def reserve(self, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` of the budget for the body of the ``with``.

        Raises:
            ImageTooLarge: ``nbytes`` exceeds the whole budget.
            Overloaded: no room within ``wait_s``; retry after about the time a decode takes.
        """
        if nbytes > self.capacity_bytes:
            raise ImageTooLarge(
                f"Decoding this image needs {format_bytes(nbytes)}, more than the {format_bytes(self.capacity_bytes)} "
                "this server decodes at once. Resize it before sending."
            )
        self._acquire(nbytes)
        try:
            yield
        finally:
            with self._room:
                self.reserved_bytes -= nbytes
                self._large_since_trim |= nbytes >= TRIM_AFTER_BYTES
                idle_after_large = self.reserved_bytes == 0 and self._large_since_trim
                if idle_after_large:
                    self._large_since_trim = False
                self._room.notify_all()
            if idle_after_large and self._trim is not None:  # outside the lock: it walks the heaps (ms)
                self._trim(0)
                self.trims += 1

    def _acquire(self, nbytes: int) -> None:
        deadline = time.monotonic() + self.wait_s
        with self._room:
            while self.reserved_bytes + nbytes > self.capacity_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.refused += 1
                    raise Overloaded(
                        "the server is decoding other large images; retry shortly",
                        retry_after_s=max(1.0, math.ceil(self.wait_s)),
                    )
                self._room.wait(left)
            self.reserved_bytes += nbytes
