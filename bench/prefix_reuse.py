"""What reusing a shared prefix's KV saves a multi-turn chat with an image, in process (CPU figures).

Every turn of a chat resends the image and the whole history. The encoder cache (worker/backends/hf.py)
skips the vision tower for the repeated image; the prefix cache (worker/generation/prefix_cache.py) keeps the
previous turn's prompt KV, so the language model prefills only what is new. This scenario measures, on
the engine itself (no HTTP), the time to the first token of turn N's prompt:

- ``cold``: the image never seen, no prefix kept (vision tower + the whole prompt);
- ``encoder_cache``: the image in the encoder cache, no prefix kept (the whole prompt, no tower);
- ``encoder_and_prefix_cache``: turn N-1 ran just before: only the new tokens are prefilled;
- ``new_tokens_alone``: a text prompt as long as what turn N adds: the floor prefix reuse aims at.

    python -m bench vlm-serving --build /tmp/vlm8
    flock /tmp/bench.lock python -m bench prefix-reuse --model-dir /tmp/vlm8

Prints one JSON line per turn: prompt tokens, tokens shared with the previous turn, and the TTFTs
(median of ``--repeats``, ms).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
IMAGE = REPO / "tests" / "data" / "images" / "camera_640.jpg"
SYSTEM = "You are a careful assistant who describes product photos for an online catalogue. " * 4
QUESTIONS = (
    "What is in this picture? Describe the object, its colours and its condition.",
    "Which details would a buyer ask about first?",
    "Write a two-sentence listing title and description.",
    "Translate the description into French.",
)
ANSWER = "The photo shows a compact camera on a plain background, lit from the left. " * 3


def _messages(turns: int) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]
    for turn in range(turns):
        content: list[dict[str, Any]] = [{"type": "text", "text": QUESTIONS[turn]}]
        if turn == 0:
            content.insert(0, {"type": "image"})
        chat.append({"role": "user", "content": content})
        if turn < turns - 1:
            chat.append({"role": "assistant", "content": [{"type": "text", "text": ANSWER}]})
    return chat


def _text_prompt(pre: Any, tokens: int) -> Any:
    """A text-only prompt of about ``tokens`` tokens, the chat template's own included."""

    def chat(words: int) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "text", "text": " x" * words}]}]

    one, two = (len(pre.prompt_token_ids(chat(w), [])) for w in (1, 2))
    per_word = max(1, two - one)
    return pre.build_prompt(chat(max(1, (tokens - one) // per_word + 1)), [])


def main(argv: list[str] | None = None) -> int:
    import numpy as np
    import torch

    from shmgate.gateway.preprocess.hf import HFPreprocessor
    from shmgate.shared.wire import SamplingParams
    from shmgate.worker.backends.base import WorkItem
    from shmgate.worker.backends.hf import HFBackend

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, required=True, help="python -m bench vlm-serving --build DIR")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch threads (the worker's default on 2 cores)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    pre = HFPreprocessor(args.model_dir)
    engine = HFBackend(str(args.model_dir), torch.device("cpu"))
    prefix_bytes = engine.prefix_cache.max_bytes
    arrays: dict[str, np.ndarray] = {}

    def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        arrays[name] = np.empty(shape, dtype=dtype)
        return arrays[name]

    pre.preprocess_image(IMAGE.read_bytes(), allocate, max_pixels=50_000_000)
    specs = [{name: (a.dtype.name, tuple(a.shape)) for name, a in arrays.items()}]
    key = 0

    def ttft(inline: bytes, image_key: bytes | None) -> float:
        """Seconds from ``add`` to the first token out of ``step``."""
        nonlocal key
        key += 1
        tensors = {name: [torch.from_numpy(a)] for name, a in arrays.items()} if image_key is not None else {}
        item = WorkItem(key, tensors, SamplingParams(max_tokens=1, temperature=0.0), inline=inline)
        item.key, item.image_keys = key, (image_key,) if image_key is not None else ()
        started = time.perf_counter()
        engine.add(item)
        while engine.has_work():
            if any(e.index == key for e in engine.step()):
                first = time.perf_counter() - started
                while engine.has_work():
                    engine.step()
                return first
        raise RuntimeError("no token")

    previous: list[int] = []
    for turns in range(1, len(QUESTIONS) + 1):
        prompt = pre.build_prompt(_messages(turns), specs)
        ids = pre.prompt_token_ids(_messages(turns), specs)
        shared = 0
        while shared < min(len(ids), len(previous)) and ids[shared] == previous[shared]:
            shared += 1
        suffix = _text_prompt(pre, max(1, len(ids) - shared))
        cold, warm, reused, tail = [], [], [], []
        earlier = pre.build_prompt(_messages(turns - 1), specs) if turns > 1 else None
        for repeat in range(args.repeats):
            engine.prefix_cache.clear()
            engine.prefix_cache.max_bytes = 0  # the encoder cache alone
            cold.append(ttft(prompt.inline, f"cold-{turns}-{repeat}".encode()))  # a new key: the tower runs
            warm.append(ttft(prompt.inline, b"warm"))
            tail.append(ttft(suffix.inline, None))
            engine.prefix_cache.max_bytes = prefix_bytes  # and the previous turn's KV kept
            if earlier is not None:
                ttft(earlier.inline, b"warm")
            reused.append(ttft(prompt.inline, b"warm"))
        print(
            json.dumps(
                {
                    "turn": turns,
                    "prompt_tokens": len(ids),
                    "shared_with_previous_turn": shared,
                    "new_tokens": len(ids) - shared,
                    "ttft_ms": {
                        "cold": round(statistics.median(cold) * 1000, 1),
                        "encoder_cache": round(statistics.median(warm) * 1000, 1),
                        "encoder_and_prefix_cache": round(statistics.median(reused) * 1000, 1),
                        "new_tokens_alone": round(statistics.median(tail) * 1000, 1),
                    },
                }
            ),
            flush=True,
        )
        previous = ids
    return 0
