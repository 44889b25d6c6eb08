"""Prefix KV reuse (worker/generation/prefix_cache.py): a chat's next turn prefills only what is new, answers as it
would from scratch, and a prompt that differs (another image behind the same placeholder tokens) never
borrows a KV it does not share.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from shmgate.gateway.preprocess.hf import HFPreprocessor  # noqa: E402
from shmgate.shared.wire import SamplingParams  # noqa: E402
from shmgate.worker.backends.base import BackendEvent, WorkItem  # noqa: E402
from shmgate.worker.backends.hf import HFBackend  # noqa: E402
from shmgate.worker.generation.prefix_cache import BLOCK_TOKENS, PrefixCache, prefix_hashes  # noqa: E402
from tests.test_hf import SQUARE, WIDE, answer, preprocess, spec  # noqa: E402

IMAGE_TOKEN = 7


def test_a_prefix_is_named_by_its_tokens_and_by_the_images_behind_its_placeholders() -> None:
    ids = np.arange(100, 100 + 4 * BLOCK_TOKENS, dtype=np.int32)
    ids[BLOCK_TOKENS + 3 : BLOCK_TOKENS + 9] = IMAGE_TOKEN  # an image starts in the second block
    cat, dog = (b"cat" * 6, (1, 2, 2)), (b"dog" * 6, (1, 2, 2))
    a = prefix_hashes(ids, IMAGE_TOKEN, [cat])
    assert len(a) == 4 and a == prefix_hashes(ids.copy(), IMAGE_TOKEN, [cat])
    b = prefix_hashes(ids, IMAGE_TOKEN, [dog])
    assert a[0] == b[0] and not set(a[1:]) & set(b[1:])  # same tokens, other image: shared up to its block
    assert prefix_hashes(ids, IMAGE_TOKEN, [None]) == a[:1]  # an image without a key ends what can be named
    other = ids.copy()
    other[-1] += 1
    assert prefix_hashes(other, IMAGE_TOKEN, [cat])[:3] == a[:3] and prefix_hashes(other, IMAGE_TOKEN, [cat])[3] != a[3]
    assert prefix_hashes(ids[: 2 * BLOCK_TOKENS - 1], IMAGE_TOKEN, [cat]) == a[:1]  # whole blocks only


def _kv(length: int, fill: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 2, length, 4), fill), torch.full((1, 2, length, 4), -fill)) for _ in range(2)]


def test_the_longest_stored_prefix_within_the_limit_is_matched_and_the_least_recent_leaves_first() -> None:
    ids = np.arange(6 * BLOCK_TOKENS, dtype=np.int32) + 100
    hashes = prefix_hashes(ids, IMAGE_TOKEN, [])
    one_entry = sum(k.nbytes + v.nbytes for k, v in _kv(4 * BLOCK_TOKENS, 0.0))
    cache = PrefixCache(max_bytes=one_entry + one_entry // 2)
    cache.put(hashes[:4], _kv(5 * BLOCK_TOKENS, 1.0))
    layers, length = cache.match(hashes, limit=6 * BLOCK_TOKENS - 1)
    assert length == 4 * BLOCK_TOKENS and layers[0][0].shape[-2] == length and float(layers[1][1][0, 0, 0, 0]) == -1.0
    assert cache.match(hashes, limit=2 * BLOCK_TOKENS + 3)[1] == 2 * BLOCK_TOKENS  # its start is a prefix too
    assert cache.match(prefix_hashes(ids + 1, IMAGE_TOKEN, []), limit=10**6) == ([], 0)
    cache.put(hashes[:2], _kv(2 * BLOCK_TOKENS, 2.0))  # held already, as the start of the longer entry
    assert len(cache) == 1
    other = prefix_hashes(ids + 1000, IMAGE_TOKEN, [])
    cache.put(other[:4], _kv(4 * BLOCK_TOKENS, 3.0))  # over the bound: the older entry leaves
    assert len(cache) == 1 and cache.held_bytes == one_entry
    assert cache.match(hashes, limit=10**6) == ([], 0) and cache.match(other, limit=10**6)[1] == 4 * BLOCK_TOKENS


# -- on the engine, with the tiny Qwen2-VL -----------------------------------------------------------


@pytest.fixture(scope="module")
def pre(tiny_qwen2_vl_dir: Path) -> HFPreprocessor:
    return HFPreprocessor(tiny_qwen2_vl_dir)


@pytest.fixture(scope="module")
def engine(tiny_qwen2_vl_dir: Path) -> Iterator[HFBackend]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield HFBackend(str(tiny_qwen2_vl_dir), torch.device("cpu"))
    torch.set_num_threads(threads)


def _turns(n: int, image_first: bool = True) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = [{"role": "system", "content": [{"type": "text", "text": "Describe photos. " * 6}]}]
    for turn in range(n):
        content: list[dict[str, Any]] = [{"type": "text", "text": f"Question number {turn}: what else is there?"}]
        if turn == 0 and image_first:
            content.insert(0, {"type": "image"})
        chat.append({"role": "user", "content": content})
        if turn < n - 1:
            chat.append({"role": "assistant", "content": [{"type": "text", "text": "A camera on a table. " * 3}]})
    return chat


def _item(pre: HFPreprocessor, chat: list[dict[str, Any]], image: Path, key: bytes, index: int) -> WorkItem:
    arrays = preprocess(pre, image)
    prompt = pre.build_prompt(chat, [spec(arrays)])
    tensors = {name: [torch.from_numpy(a)] for name, a in arrays.items()}
    item = WorkItem(index, tensors, SamplingParams(max_tokens=10, temperature=0.0), inline=prompt.inline)
    item.key, item.image_keys = index, (key,)
    return item


def _answer(engine: HFBackend, item: WorkItem) -> str:
    events: list[BackendEvent] = []
    engine.add(item)
    while engine.has_work():
        events += engine.step()
    return answer(events, item.key)[0]


def test_a_chats_next_turn_prefills_only_what_is_new_and_answers_as_from_scratch(
    pre: HFPreprocessor, engine: HFBackend
) -> None:
    size = engine.prefix_cache.max_bytes
    try:
        engine.prefix_cache.max_bytes = 0
        scratch = _answer(engine, _item(pre, _turns(3), SQUARE, b"q" * 16, 1))
        engine.prefix_cache.max_bytes = size
        engine.prefix_cache.clear()
        _answer(engine, _item(pre, _turns(2), SQUARE, b"q" * 16, 2))  # the earlier turn, stored
        hits, reused, steps = engine.stats.prefix_hits, engine.stats.prefix_tokens, engine.stats.step_tokens
        third = _item(pre, _turns(3), SQUARE, b"q" * 16, 3)
        prompt = len(third.inline) // 4
        assert _answer(engine, third) == scratch
        assert engine.stats.prefix_hits == hits + 1
        shared = engine.stats.prefix_tokens - reused
        assert shared > prompt // 2 and shared % BLOCK_TOKENS == 0  # most of the prompt, in whole blocks
        assert engine.stats.step_tokens - steps == prompt - shared + 9  # the rest, then one per later token

        # The same words with another image: nothing from the image's block on is borrowed
        before = engine.stats.prefix_tokens
        engine.prefix_cache.max_bytes = 0
        alone = _answer(engine, _item(pre, _turns(3), WIDE, b"w" * 16, 4))
        engine.prefix_cache.max_bytes = size
        other = _item(pre, _turns(3), WIDE, b"w" * 16, 5)
        ids = np.frombuffer(other.inline, dtype=np.int32)
        first_image = int(np.flatnonzero(ids == engine._layout.image_token_id)[0])
        assert _answer(engine, other) == alone
        assert engine.stats.prefix_tokens - before <= first_image  # the system prompt at most
    finally:
        engine.prefix_cache.max_bytes = size
        engine.prefix_cache.clear()
        engine.clear()
