"""The few CUDA runtime calls torch does not wrap well enough: host registration and its error state.

Who uses this: worker/device.py, to register the arena as pinned host memory.

Why not just ``torch.cuda.cudart().cudaHostRegister``: a failed ``cudaHostRegister`` leaves its
error in the calling thread's "last error" slot, and torch exposes no ``cudaGetLastError`` to
clear it. torch's own check after the next kernel launch reads that slot, so the worker's first
batch would fail with an unrelated-looking "CUDA error". So the registration goes through the
CUDA runtime library that torch itself loaded (found in /proc/self/maps), where
``cudaGetLastError`` clears the slot right after a failure.

Fallback (no libcudart found, e.g. a build that links it statically): torch's binding, and a
failure is drained by launching one throwaway kernel under ``try`` (torch's launch check reads
and so clears the pending error).

Tests pass their own ``Runtime`` (tests/test_device.py); nothing here needs a GPU to import.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Protocol

import torch

__all__ = ["HOST_REGISTER_PORTABLE", "SUCCESS", "Runtime", "find_libcudart", "load_runtime"]

log = logging.getLogger("shmgate.worker.cudart")

SUCCESS = 0
# cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the current
# one (a process that copies to two devices, e.g. bench/gpu.py or a test, shares one registration).
HOST_REGISTER_PORTABLE = 1


class Runtime(Protocol):
    """The CUDA runtime calls host registration needs; each returns a ``cudaError_t`` as an int."""

    def host_register(self, ptr: int, nbytes: int, flags: int) -> int: ...

    def host_unregister(self, ptr: int) -> int: ...

    def get_last_error(self) -> int:
        """Return and clear this thread's pending error (``cudaGetLastError``)."""
        ...

    def error_string(self, code: int) -> str: ...


class CtypesRuntime:
    """The calls made through the libcudart shared object torch loaded."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostRegister.restype = ctypes.c_int
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaHostUnregister.restype = ctypes.c_int
        lib.cudaGetLastError.argtypes = []
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p

    def host_register(self, ptr: int, nbytes: int, flags: int) -> int:
        return int(self._lib.cudaHostRegister(ptr, nbytes, flags))

    def host_unregister(self, ptr: int) -> int:
        return int(self._lib.cudaHostUnregister(ptr))

    def get_last_error(self) -> int:
        return int(self._lib.cudaGetLastError())

    def error_string(self, code: int) -> str:
        text = self._lib.cudaGetErrorString(code)
        return text.decode(errors="replace") if text else f"cudaError {code}"


class TorchRuntime:
    """Fallback through ``torch.cuda.cudart()``; clears a pending error with a throwaway kernel."""

    def __init__(self, device: torch.device) -> None:
        self._cudart = torch.cuda.cudart()
        self._device = device

    def host_register(self, ptr: int, nbytes: int, flags: int) -> int:
        return int(self._cudart.cudaHostRegister(ptr, nbytes, flags))

    def host_unregister(self, ptr: int) -> int:
        return int(self._cudart.cudaHostUnregister(ptr))

    def get_last_error(self) -> int:
        try:
            torch.empty(1, device=self._device).zero_()  # the launch check reads (and clears) the slot
        except Exception:  # noqa: BLE001 - the stale error surfacing here is the point
            return -1  # some error was pending; its code is not known here
        return SUCCESS

    def error_string(self, code: int) -> str:
        if code < 0:
            return "unknown CUDA error"
        return str(self._cudart.cudaGetErrorString(self._cudart.cudaError(code)))


def find_libcudart(maps_path: str = "/proc/self/maps") -> str | None:
    """Path of the libcudart shared object mapped into this process (torch loads it), or None."""
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "/libcudart.so" in path:
                    return path
    except OSError:
        pass
    return None


def load_runtime(device: torch.device) -> Runtime:
    """The runtime torch uses for ``device``; initialises CUDA first (torch loads libcudart lazily)."""
    torch.cuda.init()
    path = find_libcudart()
    if path is not None:
        try:
            return CtypesRuntime(ctypes.CDLL(path))
        except (OSError, AttributeError) as exc:
            log.warning("cannot use %s (%s); registering through torch's binding", path, exc)
    return TorchRuntime(device)
