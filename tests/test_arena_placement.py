"""Placing a request's images in one frontend's partition once earlier requests have filled the cache.

Three layers, each real: the content cache on a real (small) instance, the image resolver on that
cache with a preprocessor whose tensors take the size of the image (as a dynamic-resolution VLM's
do), and a real ``shmgate serve --model checksum`` on a 1 MiB arena.

The rule tested: a request whose images fit the partition together, once unheld cached images are
evicted, is placed; one that cannot fit even in an empty partition gets a 413 naming the sizes and
``--arena-size``; only space held by other requests in flight gives the 503 ``arena_full``.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from shmgate.gateway.images import ImageResolver
from shmgate.gateway.metrics import FrontendStats
from shmgate.gateway.preprocess.base import AllocateFn, ImageTensorSpec, Preprocessor, PromptInputs
from shmgate.shared.arena import Partition
from shmgate.shared.cache import ContentCache, block_bytes
from shmgate.shared.errors import ArenaFull, ImageTooLarge
from shmgate.shared.instance import Instance
from shmgate.shared.locks import HolderKind, SharedLock
from shmgate.shared.segment import LockId, SlotState
from shmgate.shared.stats_layout import STATS_WORDS
from shmgate.shared.vocabulary import TensorGroup
from tests.serving import (
    Server,
    data_url,
    expected_checksum,
    image_request,
    noise_png,
    start_server,
    stop_and_check,
    wait_until,
)

PARTITION = 1 << 20  # the smallest arena an instance accepts, one frontend: one partition


@contextlib.contextmanager
def one_partition() -> Iterator[tuple[ContentCache, SharedLock]]:
    """The content cache of frontend slot 0 of a fresh 1 MiB instance, and its index lock."""
    inst = Instance.create(arena_size=PARTITION, n_frontends=1, n_workers=1, queue_depth=1, index_capacity=256)
    try:
        seg = inst.segment
        epoch = seg.claim_slot(seg.frontends, 0)
        seg.frontends[0]["state"] = SlotState.READY
        lock = inst.lock(LockId.INDEX, (HolderKind.FRONTEND, 0, epoch))
        yield ContentCache(Partition(seg, 0), inst.cache_index(), lock, epoch), lock
    finally:
        inst.unlink()
        inst.close()


# -- the cache: an eviction in progress is not invisible to a sibling thread ---------------------------


def _make(*sizes: int):  # type: ignore[no-untyped-def]
    def make(allocate: AllocateFn) -> None:
        for j, n in enumerate(sizes):
            allocate(f"t{j}", "uint8", (n,))[:] = j + 1

    return make


def test_a_thread_waits_for_a_siblings_eviction_instead_of_failing() -> None:
    """One cached group of two 400 KiB tensors, unheld. Thread A needs 300 KiB and evicts it, but is
    held up removing it from the index (the test holds the index lock). Thread B, needing another
    300 KiB meanwhile, must wait for that eviction: once it is done both fit (1 MiB - 300 KiB)."""
    with one_partition() as (cache, lock):
        old, _ = cache.acquire(b"old".ljust(16, b"."), _make(400 << 10, 400 << 10))
        cache.release(old)
        results: dict[str, object] = {}

        def place(name: str) -> None:
            try:
                results[name] = cache.acquire_private(_make(300 << 10))  # no index lookup before it allocates
            except ArenaFull as exc:
                results[name] = exc

        with lock.hold(5.0):
            a = threading.Thread(target=place, args=("A",))
            a.start()
            wait_until(lambda: cache.evictable_count() == 0, 5.0, "A taking the cached group off the LRU list")
            b = threading.Thread(target=place, args=("B",))
            b.start()
            b.join(0.5)  # before the fix B gave up here at once
        a.join(10)
        b.join(10)
        assert isinstance(results["A"], TensorGroup), results
        assert isinstance(results["B"], TensorGroup), f"B failed while A's eviction made room: {results['B']}"
        assert cache.stats.evictions == 1
        for group in (results["A"], results["B"]):
            assert isinstance(group, TensorGroup)
            cache.release(group)


# -- the resolver: scattered holes, the transient case, a request too large for the partition ----------


class NaturalSize(Preprocessor):
    """Pixels at the image's own size, (h, w, 3) uint8: tensors of different sizes, as a VLM's."""

    model = "natural-size"
    max_images = 8

    def cache_params(self) -> bytes:
        return b"natural-size/1"

    def preprocess_image(
        self, data: bytes, allocate: AllocateFn, *, max_pixels: int, options: dict[str, Any] | None = None
    ) -> None:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        np.copyto(allocate("pixels", "uint8", (image.height, image.width, 3)), np.asarray(image))

    def build_prompt(self, messages: Sequence[dict[str, Any]], images: Sequence[ImageTensorSpec]) -> PromptInputs:
        return PromptInputs()


def _png(seed: int, width: int, height: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", compress_level=0)
    return out.getvalue()


# Tensor sizes: C1 192 KiB, C2 480 KiB, C3 337.5 KiB fill the 1 MiB partition in that order; a request
# of two new 480 KiB images (960 KiB) fits it. Evicting least recently used first puts the first new
# image exactly in C2's hole, and the second then finds two holes of 192 and 352 KiB: nothing else held.
C1, C2, C3 = _png(1, 256, 256), _png(2, 512, 320), _png(3, 480, 240)
A, B, D = _png(10, 512, 320), _png(11, 512, 320), _png(12, 512, 320)


@contextlib.contextmanager
def resolver_on_one_partition() -> Iterator[tuple[ImageResolver, ContentCache]]:
    with one_partition() as (cache, _):
        stats = FrontendStats(np.zeros(STATS_WORDS, np.uint64))
        resolver = ImageResolver(cache, NaturalSize(), stats, max_pixels=40_000_000, threads=2)
        try:
            yield resolver, cache
        finally:
            resolver.close()


def _resolve(resolver: ImageResolver, *images: bytes) -> list[TensorGroup]:
    """The groups of one request, held; on failure they are released (as the frontend does) and it raises."""
    groups: list[TensorGroup] = []
    try:
        asyncio.run(resolver.resolve(list(images), [f"image {i}" for i in range(len(images))], groups))
    except BaseException:
        resolver.release(groups)
        raise
    return groups


def _fill(resolver: ImageResolver) -> None:
    for image in (C1, C2, C3, C1, C3):  # C1 and C3 used again: C2 is the least recently used
        resolver.release(_resolve(resolver, image))


def _pixels(cache: ContentCache, group: TensorGroup) -> np.ndarray:
    ref = group.refs[0]
    return np.frombuffer(cache.partition.segment.mm, np.uint8, ref.nbytes, ref.offset).reshape(ref.shape)


def test_images_that_fit_together_are_placed_though_eviction_left_scattered_holes() -> None:
    with resolver_on_one_partition() as (resolver, cache):
        _fill(resolver)
        assert cache.used_bytes > PARTITION - (16 << 10)  # the cache is full, every entry unheld
        groups = _resolve(resolver, A, B)
        for group, image in zip(groups, (A, B), strict=True):
            assert np.array_equal(_pixels(cache, group), np.asarray(Image.open(io.BytesIO(image)).convert("RGB")))
        resolver.release(groups)
        assert cache.held_bytes == 0


def test_space_held_by_another_request_is_the_transient_503() -> None:
    with resolver_on_one_partition() as (resolver, cache):
        _fill(resolver)
        other = _resolve(resolver, C1)  # a request in flight holds 192 KiB: 960 KiB no longer fit
        with pytest.raises(ArenaFull) as caught:
            _resolve(resolver, A, B)
        assert caught.value.status_hint == 503
        assert cache.held_bytes == _pixels(cache, other[0]).nbytes  # the failed request gave its space back
        resolver.release(other)
        groups = _resolve(resolver, A, B)  # the retry the 503 invited
        resolver.release(groups)


def test_images_larger_together_than_an_empty_partition_get_413_naming_the_flag() -> None:
    with resolver_on_one_partition() as (resolver, cache):
        _fill(resolver)
        with pytest.raises(ImageTooLarge) as caught:
            _resolve(resolver, A, B, D)
        error = caught.value
        assert error.status_hint == 413 and error.code == "image_too_large"
        assert "--arena-size" in error.message and f"{PARTITION:,}" in error.message, error.message
        assert f"{3 * block_bytes(512 * 320 * 3):,}" in error.message, error.message
        assert cache.held_bytes == 0


# -- a real server: checksum on a 1 MiB arena, one frontend -----------------------------------------------

CHECKSUM_IMAGE_BLOCK = block_bytes(3 * 224 * 224)  # every checksum image: one (3, 224, 224) uint8 tensor
FIT = PARTITION // CHECKSUM_IMAGE_BLOCK  # 6 images fit the partition together, 7 do not


@pytest.fixture(scope="module")
def tiny_arena_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        "checksum",
        tmp_path_factory.mktemp("arena"),
        "--frontends",
        "1",
        "--workers",
        "1",
        "--arena-size",
        "1MiB",
        "--max-images",
        "8",
    )
    try:
        yield server
    finally:
        stop_and_check(server)


def _several(images: list[bytes], text: str = "What is in these images?") -> dict[str, object]:
    body = image_request("checksum", images[0], mime="image/png", text=text)
    content = body["messages"][0]["content"]  # type: ignore[index]
    content += [{"type": "image_url", "image_url": {"url": data_url(d, "image/png")}} for d in images[1:]]
    return body


def test_server_places_images_that_fit_together_after_the_cache_filled(tiny_arena_server: Server) -> None:
    url = tiny_arena_server.base_url + "/v1/chat/completions"
    assert FIT == 6
    with httpx.Client(timeout=60) as client:
        for seed in range(100, 100 + FIT):  # earlier requests: the cache is full of unheld images
            response = client.post(url, json=image_request("checksum", noise_png(seed), mime="image/png"))
            assert response.status_code == 200, response.text
        images = [noise_png(seed) for seed in range(200, 200 + FIT)]
        response = client.post(url, json=_several(images))
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]["message"]["content"]
        assert all(expected_checksum(d) in answer for d in images), answer


def test_server_answers_413_for_images_larger_together_than_its_partition(tiny_arena_server: Server) -> None:
    url = tiny_arena_server.base_url + "/v1/chat/completions"
    with httpx.Client(timeout=60) as client:
        response = client.post(url, json=_several([noise_png(seed) for seed in range(300, 301 + FIT)]))
        assert response.status_code == 413, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "image_too_large" and error["type"] == "invalid_request_error", error
        assert "--arena-size" in error["message"] and f"{PARTITION:,}" in error["message"], error
        assert "retry-after" not in response.headers
        one = noise_png(400)  # the frontend gave the space back: an ordinary request is served
        response = client.post(url, json=image_request("checksum", one, mime="image/png"))
        assert response.status_code == 200 and expected_checksum(one) in response.text, response.text
