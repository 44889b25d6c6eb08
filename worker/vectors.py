"""An embedding vector as reply messages: float32 bytes cut into ``Vector`` pieces that fit the reply channel.

Why pieces rather than float16 or the arena: a reply message is at most 4 KiB
(shared/wire.py REPLY_MESSAGE_BYTES), a 1280-d float32 vector is 5 KiB, and
float16 would change cosines in the fourth decimal. Workers never write to the
arena (its partitions have one writer each: their frontend), so the vector rides
the reply channel like text does, in order, before the Finished.
"""

from __future__ import annotations

import torch

from shmgate.shared.wire import VECTOR_CHUNK_BYTES, Vector

__all__ = ["unit_vectors", "vector_messages"]


def unit_vectors(features: torch.Tensor) -> list[bytes]:
    """Rows of (N, D) features, each scaled to unit L2 norm, as little-endian float32 bytes."""
    rows = torch.nn.functional.normalize(features.float(), dim=-1).cpu().numpy().astype("<f4", copy=False)
    return [row.tobytes() for row in rows]


def vector_messages(request_id: int, data: bytes) -> list[Vector]:
    """``data`` in pieces of at most VECTOR_CHUNK_BYTES, offsets ascending."""
    return [
        Vector(request_id, start, data[start : start + VECTOR_CHUNK_BYTES])
        for start in range(0, max(len(data), 1), VECTOR_CHUNK_BYTES)
    ]
