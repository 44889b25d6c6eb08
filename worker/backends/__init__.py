"""Model backends by name. An explicit table: no import-by-string plugins."""

from __future__ import annotations

import torch

from worker.backends.base import ModelBackend

__all__ = ["load_backend"]


def load_backend(model: str, device: torch.device, *, threads: int | None = None) -> ModelBackend:
    """Build the backend serving ``model``. Raises ValueError for an unknown model."""
    if model == "efficientnet-lite0":
        from worker.backends.efficientnet import EfficientNetBackend

        return EfficientNetBackend(device, threads=threads)
    if model == "checksum":
        from worker.backends.checksum import ChecksumBackend

        return ChecksumBackend()
    if model.startswith("hf:"):
        from worker.backends.hf import HFBackend

        return HFBackend(model[3:], device)
    raise ValueError(f"unknown model {model!r}; known: efficientnet-lite0, checksum, hf:<directory>")
