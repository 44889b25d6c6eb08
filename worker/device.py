"""Copying tensors out of the arena onto the worker's device: the one copy a worker makes.

CPU: a ``torch.frombuffer`` view of the arena (zero-copy) is cloned into
process memory; after that the arena space can be released.

CUDA: the whole arena mapping is registered once as pinned host memory
(``cudaHostRegister``), so each tensor's host-to-device copy is a DMA straight
out of shared memory, issued ``non_blocking`` on a dedicated copy stream. The
generation re-check and the release happen only after the copy's CUDA event has
completed (before that, the DMA may still be reading the arena). When
registration fails (e.g. RLIMIT_MEMLOCK in a container), copies fall back to
pageable memory and a warning says why.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Sequence

import torch

from shared.wire import TensorRef

log = logging.getLogger("shmgate.worker.device")

__all__ = ["DeviceCopier", "TORCH_DTYPES"]

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

    def copy(self, refs: Sequence[TensorRef]) -> list[torch.Tensor]:
        """Copy each (already validated) tensor to the device. Returns when the copies are complete.

        Raises nothing of its own; the caller re-checks generations afterwards.
        """
        tensors = []
        for ref in refs:
            # zero-copy view of the arena; never written through (workers only read)
            host = torch.frombuffer(self._arena, dtype=torch.uint8, count=ref.nbytes, offset=ref.offset)
            tensors.append(host.view(TORCH_DTYPES[ref.dtype]).reshape(ref.shape))
        if self.device.type != "cuda":
            return [t.clone() for t in tensors]
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            out = [t.to(self.device, non_blocking=self.pinned) for t in tensors]
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()  # the DMA has finished reading the arena
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return out

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._pinned_ptr)
            self.pinned = False
        self._pinned_buf = None
