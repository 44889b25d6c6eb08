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
("stop"). completion_tokens counts the entries, prompt_tokens is 0. Every piece but the
trickle's is marked ``flush=False``, so the worker sends the whole answer in its Finished message.

Served as ``checksum`` behind the classifier preprocessing, and as ``checksum:<name>``
behind the Hugging Face preprocessing of ``hf:<dir>`` (model spec ``checksum:hf:<dir>``):
the same witness for any frontend pipeline.

Diagnostic trickle (for fault tests that need a request to stay in flight): when the user's
text is exactly ``checksum:trickle <n>`` (1 <= n <= 100000), the item's answer gets ``n``
extra single-space events before the closing ``]}`` (still the same JSON), one every
``TRICKLE_INTERVAL_S``. Trickles of one batch advance together, after every normal item has
finished, so a batch lasts as long as its longest trickle, not their sum. A trickling item
whose client went away (``item.cancelled``) stops at once: the test's witness that a Cancel
reached the worker.

Diagnostic hold: ``checksum:hold <n>`` makes the whole batch wait ``n`` intervals before its
first output, so a test can kill a worker that has claimed requests but produced nothing for
them (they must be retried on another worker, not failed).

Fault diagnostics, honoured only when the worker's environment has ``SHMGATE_CHECKSUM_FAULTS=1``
(the self-healing tests set it; nothing else does, so a served checksum model never obeys a
client's text this way): ``checksum:hang`` blocks the batch forever (a wedged model call, which
the supervisor must detect from the worker's stalled progress), ``checksum:device-assert`` raises
the error a CUDA device-side assert raises (sticky: the worker must restart), ``checksum:crash``
kills the worker process (a request that kills every worker it reaches; it must not get a third).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from shmgate.worker.backends.base import BackendEvent, ModelBackend, WorkItem

__all__ = ["ChecksumBackend", "tensor_digest"]

OPENING = '{"tensors":['
CLOSING = "]}"
TRICKLE_INTERVAL_S = 0.02
_TRICKLE = re.compile(r"checksum:trickle (\d{1,6})")
_HOLD = re.compile(r"checksum:hold (\d{1,4})")
FAULTS_ENV = "SHMGATE_CHECKSUM_FAULTS"
# The exit of a simulated crash: sysexits.h EX_SOFTWARE, a code no real shmgate exit uses, so a
# test that sees it knows the crash was the one it asked for.
SIMULATED_CRASH_EXIT = 70


def _inject_fault(batch: Sequence[WorkItem]) -> None:
    """The fault diagnostics of the module docstring; nothing unless FAULTS_ENV is 1."""
    if os.environ.get(FAULTS_ENV) != "1":
        return
    texts = {item.text.strip() for item in batch}
    if "checksum:crash" in texts:
        os._exit(SIMULATED_CRASH_EXIT)
    if "checksum:device-assert" in texts:
        raise RuntimeError("CUDA error: device-side assert triggered (simulated by the checksum backend)")
    if "checksum:hang" in texts:
        threading.Event().wait()  # forever: only the supervisor's SIGKILL ends it


def trickle_steps(text: str) -> int:
    """The trickle length the user's text asks for (0: an ordinary request)."""
    match = _TRICKLE.fullmatch(text.strip())
    return min(int(match.group(1)), 100_000) if match else 0


def hold_steps(text: str) -> int:
    """How many intervals the user's text asks the batch to wait before any output."""
    match = _HOLD.fullmatch(text.strip())
    return int(match.group(1)) if match else 0


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


class ChecksumBackend(ModelBackend):
    """Digests each item's tensors; never fails on tensor content (any dtype, any shape)."""

    def __init__(self, device: torch.device | None = None, *, name: str = "checksum") -> None:
        self.name = name  # the model id the frontends send: checksum, or checksum:<name> for checksum:hf:<dir>
        self.device = device  # unused: tensors are hashed wherever the worker put them

    def run(self, batch: Sequence[WorkItem]) -> Iterator[BackendEvent]:
        _inject_fault(batch)
        for _ in range(max((hold_steps(item.text) for item in batch), default=0)):
            time.sleep(TRICKLE_INTERVAL_S)
        trickling: dict[int, tuple[int, int]] = {}  # index -> (steps left, entries)
        for i, item in enumerate(batch):
            if item.cancelled:
                yield BackendEvent(i, finish_reason="stop")
                continue
            count = yield from self._entries(i, item)
            steps = trickle_steps(item.text)
            if steps:
                trickling[i] = (steps, count)
                continue
            yield BackendEvent(i, text=_closing(item.inline), flush=False)
            yield BackendEvent(i, finish_reason="stop", prompt_tokens=0, completion_tokens=count)
        yield from self._trickle(batch, trickling)

    def _entries(self, i: int, item: WorkItem) -> Iterator[BackendEvent]:
        """The opening and one event per tensor; returns how many entries were sent."""
        yield BackendEvent(i, text=OPENING, flush=False)  # the whole answer exists: one reply message
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
        return count

    @staticmethod
    def _trickle(batch: Sequence[WorkItem], trickling: dict[int, tuple[int, int]]) -> Iterator[BackendEvent]:
        while trickling:
            time.sleep(TRICKLE_INTERVAL_S)
            for i, (steps, count) in list(trickling.items()):
                if batch[i].cancelled:  # the worker saw a Cancel: stop producing for it
                    del trickling[i]
                    yield BackendEvent(i, finish_reason="stop", prompt_tokens=0, completion_tokens=count)
                    continue
                yield BackendEvent(i, text=" ")
                if steps > 1:
                    trickling[i] = (steps - 1, count)
                    continue
                del trickling[i]
                yield BackendEvent(i, text=_closing(batch[i].inline), flush=False)
                yield BackendEvent(i, finish_reason="stop", prompt_tokens=0, completion_tokens=count)
