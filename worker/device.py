"""Copying tensors out of the arena onto the worker's device: the one copy a worker makes.

Which device: ``pick_device`` turns the requested ``cpu`` / ``cuda`` / ``cuda:N`` into one
device. ``cuda`` with several GPUs visible (a compose replica granted them all) picks
``cuda:(slot mod GPUs)``, so replicas spread over the GPUs instead of all landing on cuda:0;
``shmgate serve`` gives each worker exactly one visible GPU instead (supervise/placement.py).
``use_device`` makes it the current device of the calling thread: CUDA's current device is per
thread and defaults to 0, so a thread that touches CUDA without it opens a second context on
GPU 0 (the worker's main and prefetch threads both call it).

CPU: each tensor's bytes are copied out of the arena into process memory (``host_copies``);
after that the arena space can be released. The copy is a ``bytearray`` of the mapping's slice, one
memcpy on the calling thread alone, which torch then views (``torch.frombuffer``): torch's
``clone`` of a tensor this size splits the copy over the thread's OpenMP team, and in the prefetch
thread that team is a thread of its own, woken and waited for at a barrier on every request (two of
a worker's ~5 sleeps per request, for a 150 KB memcpy); numpy's ``copyto`` into a ``torch.empty``
is one thread too, but its conversions cost more than the copy (13 against 5 µs here).

CUDA: the whole arena mapping is registered once per process as pinned host memory
(``cudaHostRegister``, ``HostRegistrations``), so each tensor's host-to-device copy is a DMA
straight out of shared memory, issued ``non_blocking`` on a dedicated copy stream, and an event
(``blocking=True``: a waiting thread sleeps instead of spinning a core) is recorded after it. Two
waits follow, by different threads (worker/main.py):
- the prefetch thread waits for the event on the host (``Copy.wait_host``) before the generation
  re-check and the release: until then the DMA may still be reading the arena;
- the compute stream waits for the event on the device (``Copy.hand_to``, ``stream.wait_event``):
  no host sync on the compute path. ``hand_to`` also records the compute stream on each tensor,
  so the caching allocator does not give a tensor's block back to the copy stream while compute
  still reads it.
Small payloads the backend reads on the host (``host_only`` names: the prompt's token ids, image
grid sizes) are cloned on the host and never go to the device: a device copy and a ``.cpu()`` or
``.tolist()`` back would queue behind the running batch and sync the host with it.

Registration failing is not about RLIMIT_MEMLOCK (the NVIDIA driver pins without memlock
accounting): registering faults in every page of the arena (charged to the memory cgroup of the
first process that touches it) and fails where /dev/shm cannot back it, or where the range is
already registered. A failure is cleared from the thread's CUDA error state (worker/cudart.py),
logged with ``cudaGetErrorString`` and the time it took, and copies fall back to pageable memory.

Lifetime: every host view goes through one ``memoryview`` export of the mapping, held by each view
(``torch.frombuffer`` keeps a reference to the object it was given but no buffer export, so a view
of the bare mmap would let ``mmap.close()`` unmap memory a live tensor still points at). With the
export, closing the segment while a view lives raises BufferError (shared/segment.py then leaves
the mapping to the last reference) instead of a use-after-unmap.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from shmgate.shared.wire import TensorRef
from shmgate.worker.cudart import HOST_REGISTER_PORTABLE, SUCCESS, Runtime, load_runtime

log = logging.getLogger("shmgate.worker.device")

__all__ = [
    "HOST_REGISTRATIONS",
    "TORCH_DTYPES",
    "Copy",
    "DeviceCopier",
    "HostRegistrations",
    "check_device",
    "pick_device",
    "use_device",
]

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


def check_device(requested: str) -> torch.device:
    """``requested`` as a device this process can run on. Raises ValueError with the line to print.

    Checked before the worker attaches or loads anything: ``cpu``, ``cuda`` or ``cuda:N``, and for CUDA
    that this torch was built with it, that a GPU is visible and that N is one of them. Without this a
    CPU-only torch fails deep in the first CUDA call (``torch._C`` has no ``_cuda_setDevice``) and a
    typo such as ``gpu`` fails in torch's parser: both on every restart, with a traceback.
    """
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise ValueError(f"--device {requested!r}: expected cpu, cuda or cuda:N")
    if device.type == "cpu":
        return device
    if torch.version.cuda is None:
        raise ValueError(
            f"--device {requested}: this torch ({torch.__version__}) is built without CUDA; "
            "install a CUDA build of torch, or use --device cpu"
        )
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise ValueError(f"--device {requested}: no CUDA GPU is usable here{hint}; use --device cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {requested}: only {count} GPU(s) are visible (cuda:0..cuda:{count - 1})")
    return device


def pick_device(requested: str, slot: int, visible_gpus: int) -> torch.device:
    """The device a worker in ``slot`` runs on. Raises RuntimeError for a device torch does not know.

    ``cuda`` (no index) with several visible GPUs: ``cuda:(slot mod visible_gpus)`` (worker slots
    are claimed lowest first, so N replicas on N GPUs get one each). ``cuda:N`` is kept as asked.
    """
    device = torch.device(requested)
    if device.type != "cuda" or device.index is not None:
        return device
    return torch.device("cuda", slot % visible_gpus if visible_gpus > 1 else 0)


def use_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current CUDA device (no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


@dataclass
class _Registration:
    export: ctypes.Array[ctypes.c_char]  # a buffer export: the mapping cannot be unmapped while registered
    count: int


class HostRegistrations:
    """Which host ranges this process registered with CUDA, and how many users each has.

    Process-wide on purpose: CUDA keeps one registration per range per process, and registering
    a range twice fails (cudaErrorHostMemoryAlreadyRegistered) just like a real failure. Every
    DeviceCopier of a process (tests and benchmarks make several) shares the count; the range is
    unregistered when its last user closes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: dict[tuple[int, int], _Registration] = {}

    def register(self, arena: mmap.mmap, runtime: Runtime) -> int | None:
        """Pin ``arena``'s whole mapping (or count one more user); its address, or None when pinning failed."""
        export = (ctypes.c_char * len(arena)).from_buffer(arena)
        key = (ctypes.addressof(export), len(arena))
        with self._lock:
            known = self._ranges.get(key)
            if known is not None:
                known.count += 1
                return key[0]
            started = time.perf_counter()
            code = runtime.host_register(key[0], key[1], HOST_REGISTER_PORTABLE)
            took_s = time.perf_counter() - started
            if code != SUCCESS:
                runtime.get_last_error()  # clear it, or the next kernel launch reports it
                log.warning(
                    "could not register the arena (%d MiB) as pinned host memory after %.0f ms: %s (cudaError %d); "
                    "host-to-device copies will be pageable. Registering faults in the whole arena: it fails "
                    "where /dev/shm cannot back it (shm_size, emptyDir.sizeLimit); RLIMIT_MEMLOCK is not the cause",
                    key[1] >> 20,
                    took_s * 1e3,
                    runtime.error_string(code),
                    code,
                )
                return None
            self._ranges[key] = _Registration(export, 1)
        log.info(
            "arena registered as pinned host memory: %d MiB in %.0f ms (%.1f GB/s faulted in and pinned)",
            key[1] >> 20,
            took_s * 1e3,
            key[1] / max(took_s, 1e-9) / 1e9,
        )
        return key[0]

    def unregister(self, ptr: int, nbytes: int, runtime: Runtime) -> None:
        """One user fewer; the last one unregisters (the caller made sure no copy still reads it)."""
        with self._lock:
            known = self._ranges.get((ptr, nbytes))
            if known is None:
                return
            known.count -= 1
            if known.count > 0:
                return
            del self._ranges[(ptr, nbytes)]
            code = runtime.host_unregister(ptr)
            if code != SUCCESS:
                runtime.get_last_error()
                log.warning("cudaHostUnregister failed: %s", runtime.error_string(code))

    def users(self, arena: mmap.mmap) -> int:
        """How many copiers of this process share ``arena``'s registration (0: not registered)."""
        export = (ctypes.c_char * len(arena)).from_buffer(arena)
        try:
            with self._lock:
                known = self._ranges.get((ctypes.addressof(export), len(arena)))
                return 0 if known is None else known.count
        finally:
            del export


HOST_REGISTRATIONS = HostRegistrations()


@dataclass
class Copy:
    """Device tensors whose copy may still be in flight, and the event that says when it is not.

    ``names[i]`` is the TensorRef name of ``tensors[i]``; ``host`` holds the ``host_only``
    tensors by name, already cloned on the host. ``done`` is None on CPU (the clone is complete when
    ``DeviceCopier.start`` returns).
    """

    tensors: list[torch.Tensor]
    done: torch.cuda.Event | None = None
    names: list[str] = field(default_factory=list)
    host: dict[str, list[torch.Tensor]] = field(default_factory=dict)

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
    """Views of the arena and copies of them onto one device; on CUDA, owns a share of the registration.

    On CUDA, building one makes ``device`` the calling thread's current device (the registration
    and the copy stream must belong to that GPU's context, not GPU 0's). ``runtime`` and
    ``registrations``: tests pass stand-ins; by default the CUDA runtime torch loaded and the
    process-wide ``HOST_REGISTRATIONS``.
    """

    def __init__(
        self,
        device: torch.device,
        arena: mmap.mmap,
        *,
        runtime: Runtime | None = None,
        registrations: HostRegistrations = HOST_REGISTRATIONS,
    ) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._host: memoryview | None = memoryview(arena)
        self._nbytes = len(arena)
        self._registrations = registrations
        self._runtime = runtime
        self._pinned_ptr: int | None = None
        self._stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            use_device(device)  # the registration and the stream belong to this device's context
            self._stream = torch.cuda.Stream(device=device)
            if self._runtime is None:
                self._runtime = load_runtime(device)
            self._pinned_ptr = registrations.register(arena, self._runtime)

    @property
    def pinned(self) -> bool:
        return self._pinned_ptr is not None

    def views(self, refs: Sequence[TensorRef]) -> list[torch.Tensor]:
        """Zero-copy views of (already validated) tensors in the arena; never written through.

        Each keeps the mapping's export alive (module docstring: Lifetime).
        """
        if self._host is None:
            raise RuntimeError("the copier is closed")
        return [
            _typed(torch.frombuffer(self._host, dtype=torch.uint8, count=ref.nbytes, offset=ref.offset), ref)
            for ref in refs
        ]

    def host_copies(self, refs: Sequence[TensorRef]) -> list[torch.Tensor]:
        """Copies of (already validated) tensors in process memory, each one memcpy by this thread alone.

        They refer to nothing in the mapping (module docstring: CPU).
        """
        if self._host is None:
            raise RuntimeError("the copier is closed")
        host = self._host
        return [
            _typed(torch.frombuffer(bytearray(host[ref.offset : ref.offset + ref.nbytes]), dtype=torch.uint8), ref)
            for ref in refs
        ]

    def start(self, refs: Sequence[TensorRef], *, host_only: Collection[str] = ()) -> Copy:
        """Start copying each (already validated) tensor to the device. Raises nothing of its own.

        Tensors named in ``host_only`` are cloned into ``Copy.host`` on the host instead (at
        once). The caller must ``wait_host`` before it re-checks generations or releases the arena.
        """
        host: dict[str, list[torch.Tensor]] = {}
        staying = [ref for ref in refs if ref.name in host_only]
        for ref, copied in zip(staying, self.host_copies(staying)):
            host.setdefault(ref.name, []).append(copied)
        moving = [ref for ref in refs if ref.name not in host_only]
        names = [ref.name for ref in moving]
        if self.device.type != "cuda":
            return Copy(self.host_copies(moving), names=names, host=host)
        tensors = self.views(moving)
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            out = [t.to(self.device, non_blocking=self.pinned) for t in tensors]
            done = torch.cuda.Event(blocking=True)
            done.record(self._stream)
        return Copy(out, done, names=names, host=host)

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
        """Give up this copier's share of the registration; waits for copies still in flight (they read it).

        Drops the copier's export; views still alive keep the mapping until they die.
        """
        if self._stream is not None:
            self._stream.synchronize()
        if self._pinned_ptr is not None:
            assert self._runtime is not None
            self._registrations.unregister(self._pinned_ptr, self._nbytes, self._runtime)
            self._pinned_ptr = None
        self._host = None


def _typed(raw: torch.Tensor, ref: TensorRef) -> torch.Tensor:
    """A tensor's bytes (uint8, 1-D) seen as the dtype and shape its descriptor gives."""
    return raw.view(TORCH_DTYPES[ref.dtype]).reshape(ref.shape)
