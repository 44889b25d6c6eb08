"""Vision-tower outputs shared by every worker of a model on the node, as tensors.

The engine (worker/backends/hf.py) asks ``get`` before it runs the vision tower for an image it has not
cached itself, and hands every output it computed to ``publish``. Underneath is a store in shared memory
(shared/encoder_store.py, built by worker/main.py): one partition per worker, a shared index, reads
checked by generation before and after the copy. This module only turns tensors into bytes and back,
and says which outputs may be used:

- The key is the image's content key (image bytes and preprocessing, from the frontend), its grid, and
  what makes the tower's output differ between workers of one model: the model's id, the dtype and the
  device type. A bfloat16 CUDA worker never serves a float32 CPU worker.
- A found output is used only if its dtype and shape are exactly what this image's tower would give
  (tokens = t*h*w / merge**2, the model's output width); anything else is a miss, and so is every stale
  or busy read in the store. A miss costs one tower run, as without sharing.

Why only where it wins: a copy costs a few bytes per token per read (and one per publish), while the
tower costs its depth times its width per patch. docs/BENCHMARKS.md ("Shared encoder outputs") has the
measured crossover; the flag is off by default.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

__all__ = ["EncoderStoreLike", "SharedEncoderOutputs", "SharedEncoderStats"]

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


class EncoderStoreLike(Protocol):
    """What this module needs of the store (shared/encoder_store.py ``EncoderStore``)."""

    def get(self, key: bytes, out_for: Callable[[str, tuple[int, ...]], np.ndarray | None]) -> bool: ...

    def put(self, key: bytes, dtype: str, shape: tuple[int, ...], write: Callable[[np.ndarray], None]) -> bool: ...


@dataclass
class SharedEncoderStats:
    """This worker's shared-encoder counts (its /metrics words: shared/stats_layout.py ENGINE_FIELDS)."""

    hits: int = 0  # images whose tower output another worker (or this one, earlier) published
    misses: int = 0  # images looked up and not found (or found stale): the tower ran for them
    publishes: int = 0  # outputs this worker published


class SharedEncoderOutputs:
    """One worker's door to its model's shared encoder outputs."""

    def __init__(self, store: EncoderStoreLike, *, model: str, device: torch.device, merge_size: int) -> None:
        self.store = store
        self.model = model
        self.device = device
        self.merge_size = merge_size
        self.stats = SharedEncoderStats()

    def key(self, content_key: bytes, grid: tuple[int, ...], dtype: torch.dtype) -> bytes:
        """16 bytes naming one image's tower output of this model, dtype and device type."""
        h = hashlib.blake2b(digest_size=16)
        for part in (self.model, _DTYPE_NAMES.get(dtype, str(dtype)), self.device.type, repr(tuple(grid))):
            h.update(part.encode())
            h.update(b"\0")
        h.update(content_key)
        return h.digest()

    def get(self, content_key: bytes, grid: tuple[int, ...], dtype: torch.dtype, width: int) -> torch.Tensor | None:
        """The published output of this image on this worker's device, or None (the tower must run)."""
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            return None
        tokens = int(np.prod(grid)) // (self.merge_size**2)
        host: list[torch.Tensor] = []

        def out_for(found_dtype: str, shape: tuple[int, ...]) -> np.ndarray | None:
            if found_dtype != name or tuple(shape) != (tokens, width):
                return None  # not what this image's tower gives: never used
            tensor = torch.empty((tokens, width), dtype=dtype)
            host.append(tensor)
            return tensor.view(torch.uint8).numpy().reshape(-1)

        if not self.store.get(self.key(content_key, grid, dtype), out_for):
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return host[0].to(self.device)

    def publish(self, content_key: bytes, grid: tuple[int, ...], features: torch.Tensor) -> None:
        """Offer one image's tower output to the model's other workers (a no-op if it is there already)."""
        name = _DTYPE_NAMES.get(features.dtype)
        if name is None or features.dim() != 2:
            return
        host = features.detach().to("cpu").contiguous()

        def write(out: np.ndarray) -> None:
            np.copyto(out, host.view(torch.uint8).numpy().reshape(-1))

        if self.store.put(self.key(content_key, grid, features.dtype), name, tuple(host.shape), write):
            self.stats.publishes += 1

    def counters(self) -> tuple[int, int, int]:
        """(hits, misses, publishes) so far."""
        return self.stats.hits, self.stats.misses, self.stats.publishes
