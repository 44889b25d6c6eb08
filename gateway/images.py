"""Image resolution and caching for one frontend: request images -> held tensor groups in the arena.

Split out of gateway/frontend.py: the ``Frontend`` dispatches, ``ReplyRouter``
routes replies, this resolves images. It owns the decode pool and talks only to the content
cache its transport link built; it never touches the segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from shmgate.gateway.config import LimitOptions
from shmgate.gateway.decode_budget import DecodeBudget
from shmgate.gateway.intake import LOOP_HASH_MAX_BYTES, EncodedImage, image_bytes, image_digest, key_material
from shmgate.gateway.metrics import Counter, FrontendStats
from shmgate.gateway.preprocess.base import Preprocessor, PromptInputs, options_key
from shmgate.gateway.request_context import INTERACTIVE_REQUEST, RequestContext
from shmgate.gateway.video import DEFAULT_LIMITS, VideoLimits
from shmgate.shared.errors import ArenaFull, ImageTooLarge, ShmgateError
from shmgate.shared.transport.base import TensorCache
from shmgate.shared.vocabulary import AllocateFn, TensorGroup, key_of_digest
from shmgate.shared.wire import GRAMMAR_TENSOR, INLINE_TENSOR

if TYPE_CHECKING:
    from shmgate.gateway.request_spans import RequestSpans

__all__ = ["ImageResolver"]

_DECLARED = LimitOptions()  # the defaults are the flags' (gateway/config.py), written there once


class ImageResolver:
    """Resolves a request's images in its decode pool; ``decode_memory_bytes`` bounds the memory of the
    decodes running at once (gateway/decode_budget.py), ``decode_wait_s`` how long one waits for room,
    ``video`` what a video part may hold (gateway/video.py)."""

    def __init__(
        self,
        cache: TensorCache,
        preprocessor: Preprocessor,
        stats: FrontendStats,
        *,
        max_pixels: int,
        threads: int,
        decode_memory_bytes: int = int(_DECLARED.decode_memory_mb * (1 << 20)),
        decode_wait_s: float = _DECLARED.decode_wait_s,
        video: VideoLimits = DEFAULT_LIMITS,
    ) -> None:
        self.cache = cache
        self.preprocessor = preprocessor
        self.stats = stats
        self.max_pixels = max_pixels
        self.decode_budget = DecodeBudget(decode_memory_bytes, wait_s=decode_wait_s, video=video)
        self.pool = _started_pool(threads, "decode")
        # Batch lines' decodes (the bulk lane, ``RequestContext.bulk``) run in a pool of their own, one thread at a
        # lower CPU priority: an interactive decode never queues behind one, and on busy cores the kernel
        # runs the interactive decode threads first.
        self.bulk_pool = _started_pool(1, "decode-bulk", nice=BULK_NICE)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.bulk_pool.shutdown(wait=False, cancel_futures=True)

    def pool_for(self, bulk: bool) -> ThreadPoolExecutor:
        """The pool of a request: the bulk lane's (a batch line's) or the interactive one."""
        return self.bulk_pool if bulk else self.pool

    def for_preprocessor(self, preprocessor: Preprocessor) -> ImageResolver:
        """This resolver for another model: the same cache, pool and decode budget, its own preprocessing
        (a frontend serving several models keeps one pool and one budget for all of them)."""
        view = copy.copy(self)
        view.preprocessor = preprocessor
        return view

    async def resolve(
        self,
        images: list[bytes | EncodedImage],
        params: list[str],
        groups: list[TensorGroup],
        options: list[dict[str, Any]] | None = None,
        context: RequestContext = INTERACTIVE_REQUEST,
    ) -> None:
        """Append each image's held tensor group to ``groups``, in order. Raises the first failure (a 413
        instead of arena_full when the images cannot fit the partition together: ``_never_fits``).

        Local cache hits are taken on the event loop, where the hit itself only takes a process-local
        mutex. The content key is computed either way: for a data URL it hashes the base64 text, so a
        hit costs no base64 decode at all, and doing it here saves a pool hop for the image and one for
        the prompt (costs: docs/benchmarks-history.md, bench/loop_costs.py). Up to LOOP_HASH_MAX_BYTES
        that is at most ~0.5 ms of loop time; larger images, remote hits and misses (base64 decode
        included) run in the decode pool.

        A request whose images fit the partition together can still find no room when the holes it
        was given are scattered (tensors of different sizes, a cached image it hit in the middle of
        the partition). When nothing else is held, it is placed again from an emptied cache, one image
        after another: first-fit then packs its blocks from the bottom, so it fits. Only space held by
        other requests in flight leaves the 503 arena_full (with Retry-After). With arena shares the
        cache is a model's view (shared/cache.py ``ModelShare``), whose emptying spares what another model
        keeps within its share: a request that fits only without those images gets the 503 too.
        Groups acquired before a failure are still appended, so the caller releases them.
        ``options``: each image's processor arguments (gateway/fields.py), part of its cache key;
        ``context``: the request's lane (its decode pool) and tracing.
        """
        try:
            await self._resolve_all(images, params, groups, options, context, at_once=True)
        except ArenaFull:
            self.release(groups)
            groups.clear()
            if self.cache.held_bytes:
                raise  # other requests hold space: transient, retry later
            await asyncio.get_running_loop().run_in_executor(self.pool, self.cache.clear)
            await self._resolve_all(images, params, groups, options, context, at_once=False)

    async def _resolve_all(
        self,
        images: list[bytes | EncodedImage],
        params: list[str],
        groups: list[TensorGroup],
        options: list[dict[str, Any]] | None,
        context: RequestContext,
        *,
        at_once: bool,
    ) -> None:
        """``resolve``'s one pass: misses decoded concurrently (``at_once``) or one after another,
        each allocated when the one before is placed (the order that packs)."""
        loop = asyncio.get_running_loop()
        spans, pool = context.spans, self.pool_for(context.bulk)
        slots: list[TensorGroup | asyncio.Future[TensorGroup]] = []
        for i, (image, param) in enumerate(zip(images, params, strict=True)):
            group = None
            key = None
            material = key_material(image)
            opts = options[i] if options else {}
            cache_params = self._cache_params(opts)
            if len(material) <= LOOP_HASH_MAX_BYTES:
                key = key_of_digest(image_digest(image), cache_params)
                group = self.cache.try_hit(key)
            if group is not None:
                if spans is not None:
                    spans.image_hit(i)
                slots.append(group)
                continue
            resolve = self._resolve_image if spans is None else spans.image_task(self._resolve_image, i)
            future = loop.run_in_executor(pool, resolve, image, param, key, opts, spans)
            slots.append(future)
            if not at_once:
                await asyncio.gather(future, return_exceptions=True)
                if future.exception() is not None:
                    break
        futures = [s for s in slots if isinstance(s, asyncio.Future)]
        if futures:
            await asyncio.gather(*futures, return_exceptions=True)
        acquired: list[TensorGroup] = []
        failures: list[BaseException] = []
        for slot in slots:
            if isinstance(slot, TensorGroup):
                acquired.append(slot)
            elif (exc := slot.exception()) is None:
                acquired.append(slot.result())
            else:
                failures.append(exc)
        groups.extend(acquired)
        if failures:
            raise self._never_fits(len(images), acquired, failures) or failures[0]

    def _never_fits(
        self, n_images: int, acquired: list[TensorGroup], failures: list[BaseException]
    ) -> ImageTooLarge | None:
        """A 413 for a request whose images cannot fit this frontend's partition together, even empty.

        Why: arena_full is a 503 with Retry-After, which clients retry; when the request's own tensors
        add up to more than the partition, no retry can ever succeed. The sum is a lower bound (an
        image that failed counts only the tensor that did not fit), so the 413 is never wrong; a
        request under the bound that still found no room waits on other requests' holds: 503 it is.
        """
        full = [f for f in failures if isinstance(f, ArenaFull)]
        if not full:
            return None
        unique = {id(g): g for g in acquired}.values()  # an image sent twice is one group, held twice
        own = sum(self.cache.footprint(g) for g in unique) + sum(f.needed_bytes for f in full)
        size = self.cache.size
        if own <= size:
            return None
        return ImageTooLarge(  # short enough to survive the error message cap (gateway/http_errors.py)
            f"the {n_images} images need at least {own:,} bytes of shared memory together, more than this frontend's "
            f"arena partition holds ({size:,} bytes: --arena-size / --frontends); send fewer or smaller images, "
            "or raise --arena-size",
            param="messages",
        )

    def _cache_params(self, options: dict[str, Any]) -> bytes:
        """The content-cache key's processing part: the preprocessor's, plus an image's processor options."""
        if not options:
            return self.preprocessor.cache_params()
        return self.preprocessor.cache_params() + b"|" + options_key(options)

    def _resolve_image(
        self,
        image: bytes | EncodedImage,
        param: str,
        key: bytes | None,
        options: dict[str, Any] | None = None,
        spans: RequestSpans | None = None,
    ) -> TensorGroup:
        """Thread pool: the cached tensors of one image, decoding (base64, then pixels) only on a miss.

        A decode error names ``param``, the request field the image came from (data URL or fetched).
        Raises Overloaded when the decode memory budget has no room for the image within its wait.
        ``spans``: tracing is on; the image's span (``RequestSpans.image_task``) is current, and is told the
        cache's answer.
        """
        if key is None:
            key = key_of_digest(image_digest(image), self._cache_params(options or {}))

        def make(allocate: AllocateFn) -> None:
            data = image_bytes(image)
            self.decode_budget.preprocess(
                self.preprocessor, data, allocate, max_pixels=self.max_pixels, options=options
            )

        try:
            group, kind = self.cache.acquire(key, make)
            if spans is not None:
                spans.cache_result(kind)
        except ShmgateError as exc:
            if exc.param is None:
                exc.param = param  # which image of the request could not be decoded
            raise
        return group

    def inline_group(self, prompt: PromptInputs) -> TensorGroup:
        """Thread pool: a prompt payload too large to ride in the descriptor, as a private arena group."""
        payload = prompt.inline

        def make(allocate: Any) -> None:
            out = allocate(INLINE_TENSOR, "uint8", (len(payload),))
            out[:] = memoryview(payload)

        return self.cache.acquire_private(make)

    def grammar_group(self, grammar: bytes) -> TensorGroup:
        """Thread pool: a grammar too large for the descriptor, as a private arena group (wire.GRAMMAR_TENSOR)."""

        def make(allocate: Any) -> None:
            out = allocate(GRAMMAR_TENSOR, "uint8", (len(grammar),))
            out[:] = memoryview(grammar)

        return self.cache.acquire_private(make)

    def release(self, groups: list[TensorGroup]) -> None:
        for group in groups:
            self.cache.release(group)
        self.sync_stats()

    def sync_stats(self) -> None:
        s = self.cache.stats
        self.stats.set(Counter.CACHE_HITS, s.hits)
        self.stats.set(Counter.CACHE_REMOTE_HITS, s.remote_hits)
        self.stats.set(Counter.CACHE_MISSES, s.misses)
        self.stats.set(Counter.CACHE_EVICTIONS, s.evictions)
        self.stats.set(Counter.ARENA_USED_BYTES, self.cache.used_bytes)
        self.stats.set(Counter.ARENA_HELD_BYTES, self.cache.held_bytes)


# How much nicer the bulk lane's decode thread is. Modest on purpose: it may hold the cache index's
# semaphore for its few microseconds of metadata work, and a thread starved of CPU there would hold up
# every frontend (nice 5 leaves it about a quarter of a contended core's time against a nice-0 thread).
BULK_NICE = 5


def _lower_priority(nice: int) -> None:
    """Make the calling thread ``nice`` steps nicer (Linux: a thread's nice value is its own)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)


def _started_pool(threads: int, name: str, nice: int = 0) -> ThreadPoolExecutor:
    """A thread pool whose threads all run from the start (``nice``: that many steps nicer than the process).

    ThreadPoolExecutor starts a thread only when a task finds none idle, so a frontend's thread count
    would depend on the most decodes it ever ran at once; bench/soak.py could not tell that growth
    from a leak. Starting them now also keeps thread start off the first concurrent requests.
    """
    if nice:
        pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix=name, initializer=_lower_priority, initargs=(nice,)
        )
    else:
        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
    all_running = threading.Barrier(threads + 1)
    for _ in range(threads):  # each task holds its thread until all are running, so each gets a new one
        pool.submit(all_running.wait, 5.0)
    with contextlib.suppress(threading.BrokenBarrierError):  # a machine too busy to start them in 5 s: lazily then
        all_running.wait(5.0)
    return pool
