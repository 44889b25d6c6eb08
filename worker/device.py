"""Copying tensors out of the arena onto the worker's device: the one copy a worker makes.

CPU: a ``torch.frombuffer`` view of the arena (zero-copy) is cloned into
process memory; after that the arena space can be released.

CUDA: the whole arena mapping is registered once as pinned host memory
(``cudaHostRegister``), so each tensor's host-to-device copy is a DMA straight
out of shared memory, issued ``non_blocking`` on a dedicated copy stream, and
an event is recorded after it. Two waits follow, by different threads
(worker/main.py):
- the prefetch thread waits for the event on the host (``Copy.wait_host``)
  before the generation re-check and the release: until then the DMA may still
  be reading the arena;
- the compute stream waits for the event on the device (``Copy.hand_to``,
  ``stream.wait_event``): no host sync on the compute path. ``hand_to`` also
  records the compute stream on each tensor, so the caching allocator does not
  give a tensor's block back to the copy stream while compute still reads it.
When registration fails (e.g. RLIMIT_MEMLOCK in a container), copies fall back
to pageable memory and a warning says why.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.wire import TensorRef

log = logging.getLogger("shmgate.worker.device")

__all__ = ["TORCH_DTYPES", "Copy", "DeviceCopier"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "bool": torch.bool,
    "int16": torch.int16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "float32": torch.float32,
    "int64": torch.int64,
    "float64": torch.float64,
}


@dataclass
class Copy:
    """Device tensors whose copy may still be in flight, and the event that says when it is not.

    ``done`` is None on CPU (the clone is complete when ``DeviceCopier.start`` returns).
    """

    tensors: list[torch.Tensor]
    done: torch.cuda.Event | None = None

    def wait_host(self) -> None:
        """Block this thread until the copy has finished reading the arena (prefetch thread only)."""
        if self.done is not None:
            self.done.synchronize()

    def hand_to(self, stream: torch.cuda.Stream | None) -> None:
        """Make ``stream`` (the compute stream) wait for the copy on the device; no host wait."""
        if self.done is None or stream is None:
            return
        stream.wait_event(self.done)
        for t in self.tensors:
            t.record_stream(stream)


class DeviceCopier:
    def __init__(self, device: torch.device, arena: mmap.mmap) -> None:
        self.device = device
        self._arena = arena
        self.pinned = False
        self._stream = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device=device)
            self.pinned = self._register(arena)

    def _register(self, arena: mmap.mmap) -> bool:
        try:
            buf = (ctypes.c_char * len(arena)).from_buffer(arena)
            self._pinned_buf = buf  # keep the export alive while registered
            ptr = ctypes.addressof(buf)
            err = torch.cuda.cudart().cudaHostRegister(ptr, len(arena), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister returned {err}")
            self._pinned_ptr = ptr
            log.info("arena registered as pinned host memory (%d bytes)", len(arena))
            return True
        except Exception as exc:  # registration is an optimisation: fall back, say why
            log.warning("could not pin the arena (%s); host-to-device copies will be pageable", exc)
            return False

    def views(self, refs: Sequence[TensorRef]) -> list[torch.Tensor]:
        """Zero-copy views of (already validated) tensors in the arena; never written through."""
        tensors = []
        for ref in refs:
            host = torch.frombuffer(self._arena, dtype=torch.uint8, count=ref.nbytes, offset=ref.offset)
            tensors.append(host.view(TORCH_DTYPES[ref.dtype]).reshape(ref.shape))
        return tensors

    def start(self, refs: Sequence[TensorRef]) -> Copy:
        """Start copying each (already validated) tensor to the device. Raises nothing of its own.

        The caller must ``wait_host`` before it re-checks generations or releases the arena.
        """
        tensors = self.views(refs)
        if self.device.type != "cuda":
            return Copy([t.clone() for t in tensors])
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            out = [t.to(self.device, non_blocking=self.pinned) for t in tensors]
            done = torch.cuda.Event()
            done.record(self._stream)
        return Copy(out, done)

    def copy(self, refs: Sequence[TensorRef]) -> list[torch.Tensor]:
        """Copy and wait: returns when the copies are complete and usable on the current stream.

        The unpipelined form (bench/gpu.py's ``arena_copier`` row measures it).
        """
        copy = self.start(refs)
        copy.wait_host()  # the DMA has finished reading the arena
        copy.hand_to(self.compute_stream())
        return copy.tensors

    def compute_stream(self) -> torch.cuda.Stream | None:
        """The calling thread's current stream on the device (None on CPU)."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def close(self) -> None:
        """Unregister the arena; waits for copies still in flight (they read the registered range)."""
        if self._stream is not None:
            self._stream.synchronize()
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self.pinned = False
        self._pinned_buf = None
