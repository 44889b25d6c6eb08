"""Vision-tower outputs kept by image content key, so a repeated image is encoded once.

The key is the frontend's content key of the image (``WorkItem.image_keys``) with the image's grid:
the same bytes processed the same way give the same tower input. Least recently used out first,
within a byte budget (--encoder-cache-mb); a family whose tower runs apart from its prompt reads and
fills it (worker/backends/hf.py ``_image_features``).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["EncoderCache"]


class EncoderCache:
    """Vision-tower outputs by (image content key, grid), least recently used out first, within ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held_bytes = 0
        self.evictions = 0  # [memory gauges] entries dropped for room (worker/cache_gauges.py)
        self._entries: OrderedDict[tuple[bytes, tuple[int, ...]], torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[bytes, tuple[int, ...]]) -> torch.Tensor | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def put(self, key: tuple[bytes, tuple[int, ...]], features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.max_bytes or key in self._entries:
            return
        while self.held_bytes + size > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.held_bytes -= old.numel() * old.element_size()
            self.evictions += 1  # [memory gauges]
        self._entries[key] = features
        self.held_bytes += size
