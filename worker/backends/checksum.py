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

When the item carries an inline payload (the token ids of ``checksum:hf:<dir>``, whether
they rode in the descriptor or in the arena as ``__inline__``), the answer also has

    "inline":{"nbytes":<int>,"blake2b":"<32 hex digits>"}

after the tensor list, hashed the same way over the exact payload bytes. Without one the
key is absent, so the classifier pipeline's answers are unchanged.

Streaming: the first event is ``{"tensors":[``, then one event per entry (with its leading
comma after the first), then ``]}`` (or ``],"inline":{...}}``), then a finish event
("stop"). completion_tokens counts the entries, prompt_tokens is 0.

Served as ``checksum`` behind the classifier preprocessing, and as ``checksum:<name>``
behind the Hugging Face preprocessing of ``hf:<dir>`` (model spec ``checksum:hf:<dir>``):
the same witness for any frontend pipeline.
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


def _closing(inline: bytes) -> str:
    """The end of the answer: the tensor list's bracket, and the inline payload's digest if any."""
    if not inline:
        return CLOSING
    digest = {"nbytes": len(inline), "blake2b": hashlib.blake2b(inline, digest_size=16).hexdigest()}
    return '],"inline":' + json.dumps(digest, separators=(",", ":")) + "}"


class ChecksumBackend:
    """Digests each item's tensors; never fails on tensor content (any dtype, any shape)."""

    def __init__(self, device: torch.device | None = None, *, name: str = "checksum") -> None:
        self.name = name  # the model id the frontends send: checksum, or checksum:<name> for checksum:hf:<dir>
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
            yield BackendEvent(i, text=_closing(item.inline), flush=False)
            yield BackendEvent(i, finish_reason="stop", prompt_tokens=0, completion_tokens=count)
