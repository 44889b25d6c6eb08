"""A backend that answers with a digest of every tensor it received: the transport's witness.

It runs no model, so end-to-end tests and benchmarks measure the gateway and the arena
alone, and a test can prove the worker read exactly the bytes the frontend wrote.

Answer format (compact JSON, no spaces, keys in this order), for item i:

    {"tensors":[{"name":"pixels","index":0,"dtype":"uint8","shape":[3,224,224],
                 "blake2b":"<32 hex digits>"}, ...]}

- one entry per tensor, sorted by name, then in list (descriptor) order; ``index`` is the
  position within its name's list;
- ``dtype`` is the torch dtype without "torch." (the shared/wire.py spelling, e.g. "uint8");
- ``blake2b`` is ``hashlib.blake2b(data, digest_size=16).hexdigest()`` where ``data`` is the
  tensor's bytes in C order exactly as the worker holds them
  (``t.contiguous().cpu().numpy().tobytes()``; bfloat16 is hashed through an int16 view of
  the same bytes, since numpy has no bfloat16). For uint8 pixels that is the raw arena bytes.

Streaming: the first event is ``{"tensors":[``, then one event per entry (with its leading
comma after the first), then ``]}``, then a finish event ("stop"). completion_tokens counts
the entries, prompt_tokens is 0.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence

import torch

from worker.backends.base import BackendEvent, WorkItem

__all__ = ["ChecksumBackend", "tensor_digest"]

OPENING = '{"tensors":['
CLOSING = "]}"


def tensor_digest(t: torch.Tensor) -> str:
    """blake2b-128 of the tensor's C-order bytes (see the module docstring)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    data = t.detach().contiguous().cpu().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


class ChecksumBackend:
    """Digests each item's tensors; never fails on tensor content (any dtype, any shape)."""

    name = "checksum"

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device  # unused: tensors are hashed wherever the worker put them

    def run(self, batch: Sequence[WorkItem]) -> Iterator[BackendEvent]:
        for i, item in enumerate(batch):
            if item.cancelled:
                yield BackendEvent(i, finish_reason="stop")
                continue
            yield BackendEvent(i, text=OPENING, flush=False)
            count = 0
            for name in sorted(item.tensors):
                for index, t in enumerate(item.tensors[name]):
                    entry = {
                        "name": name,
                        "index": index,
                        "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape),
                        "blake2b": tensor_digest(t),
                    }
                    prefix = "," if count else ""
                    yield BackendEvent(i, text=prefix + json.dumps(entry, separators=(",", ":")), flush=False)
                    count += 1
            yield BackendEvent(i, text=CLOSING, flush=False)
            yield BackendEvent(i, finish_reason="stop", prompt_tokens=0, completion_tokens=count)
