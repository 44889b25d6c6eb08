"""worker/device.py without a GPU: device choice, host registration (a mocked CUDA runtime), the
prompt kept on the host, and host views that cannot outlive the mapping.

The CUDA pieces are stand-ins for control flow and call order only (no GPU here); what they cannot
show (a real registration, the DMA, the stream-ordering) is tests/test_gpu.py's, on a GPU.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from shmgate.shared.wire import INLINE_TENSOR, TensorRef
from shmgate.worker.cudart import SUCCESS, find_libcudart
from shmgate.worker.device import DeviceCopier, HostRegistrations, check_device, pick_device

REPO = Path(__file__).resolve().parent.parent
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
INVALID_VALUE = 1


@dataclass
class FakeRuntime:
    """A CUDA runtime with one thread's "last error" slot, as the real one keeps it.

    A failing call leaves its code pending; ``kernel_launch`` plays torch's check after a launch,
    which reads the slot: a pending error there is what poisoned the first batch.
    """

    fail_with: int = SUCCESS
    registered: dict[int, int] = field(default_factory=dict)  # ptr -> nbytes, as the driver sees it
    calls: list[str] = field(default_factory=list)
    pending: int = SUCCESS
    device_at_register: list[object] = field(default_factory=list)

    def host_register(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append("register")
        self.device_at_register.append(getattr(self, "current_device", None))
        code = self.fail_with or (ALREADY_REGISTERED if ptr in self.registered else SUCCESS)
        if code != SUCCESS:
            self.pending = code
            return code
        self.registered[ptr] = nbytes
        return SUCCESS

    def host_unregister(self, ptr: int) -> int:
        self.calls.append("unregister")
        self.registered.pop(ptr)
        return SUCCESS

    def get_last_error(self) -> int:
        self.calls.append("get_last_error")
        code, self.pending = self.pending, SUCCESS
        return code

    def error_string(self, code: int) -> str:
        return {
            INVALID_VALUE: "invalid argument",
            ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
        }.get(code, f"error {code}")

    def kernel_launch(self) -> None:
        if self.get_last_error() != SUCCESS:
            raise RuntimeError("CUDA error: invalid argument")


@pytest.fixture()
def arena() -> mmap.mmap:
    mm = mmap.mmap(-1, 1 << 20)
    yield mm
    try:
        mm.close()
    except BufferError:
        pass


# -- which device --------------------------------------------------------------------------------------


def test_replicas_granted_every_gpu_spread_over_them_by_slot() -> None:
    assert [str(pick_device("cuda", slot, 2)) for slot in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert [str(pick_device("cuda", slot, 1)) for slot in range(3)] == ["cuda:0"] * 3


def test_an_explicit_device_is_kept() -> None:
    assert str(pick_device("cuda:3", 0, 8)) == "cuda:3"
    assert str(pick_device("cpu", 5, 8)) == "cpu"
    with pytest.raises(RuntimeError):
        pick_device("gpu", 0, 1)


# -- registration --------------------------------------------------------------------------------------


def test_a_failed_registration_is_cleared_logged_and_falls_back(
    arena: mmap.mmap, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = FakeRuntime(fail_with=INVALID_VALUE)
    registrations = HostRegistrations()
    with caplog.at_level(logging.WARNING, logger="shmgate.worker.device"):
        assert registrations.register(arena, runtime) is None
    assert runtime.calls == ["register", "get_last_error"]
    runtime.kernel_launch()  # the next batch's first kernel: no stale error
    assert "invalid argument (cudaError 1)" in caplog.text
    assert "RLIMIT_MEMLOCK is not the cause" in caplog.text
    assert registrations.users(arena) == 0


def test_one_registration_per_mapping_however_many_copiers(arena: mmap.mmap) -> None:
    runtime = FakeRuntime()
    registrations = HostRegistrations()
    first = registrations.register(arena, runtime)
    second = registrations.register(arena, runtime)
    assert first is not None and first == second
    assert runtime.calls == ["register"]  # the second would have failed as "already registered"
    assert registrations.users(arena) == 2
    registrations.unregister(first, len(arena), runtime)
    assert runtime.calls == ["register"] and registrations.users(arena) == 1  # still in use
    registrations.unregister(first, len(arena), runtime)
    assert runtime.calls == ["register", "unregister"] and runtime.registered == {}
    assert registrations.register(arena, runtime) == first  # registrable again afterwards
    runtime.kernel_launch()


def test_registration_is_timed_and_logged(arena: mmap.mmap, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="shmgate.worker.device"):
        HostRegistrations().register(arena, FakeRuntime())
    assert "arena registered as pinned host memory: 1 MiB in" in caplog.text


def test_a_registered_mapping_cannot_be_unmapped_until_unregistered(arena: mmap.mmap) -> None:
    runtime = FakeRuntime()
    registrations = HostRegistrations()
    ptr = registrations.register(arena, runtime)
    assert ptr is not None
    with pytest.raises(BufferError):
        arena.close()  # the DMA engine may still read it: unmapping now would be a use-after-free
    registrations.unregister(ptr, len(arena), runtime)
    arena.close()


class _FakeStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        pass


def test_the_copier_registers_on_its_own_device_and_unregisters_at_close(
    arena: mmap.mmap, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = FakeRuntime()

    def set_device(device: torch.device) -> None:
        runtime.current_device = torch.device(device)  # type: ignore[attr-defined]

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    registrations = HostRegistrations()
    copiers = [
        DeviceCopier(torch.device("cuda", 1), arena, runtime=runtime, registrations=registrations) for _ in range(2)
    ]
    assert runtime.device_at_register == [torch.device("cuda", 1)]  # not GPU 0: no stray context there
    assert all(c.pinned for c in copiers) and registrations.users(arena) == 2
    for c in copiers:
        c.close()
    assert runtime.calls == ["register", "unregister"]


def test_a_copier_whose_registration_failed_copies_pageable(arena: mmap.mmap, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = FakeRuntime(fail_with=INVALID_VALUE)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    copier = DeviceCopier(torch.device("cuda", 0), arena, runtime=runtime, registrations=HostRegistrations())
    assert not copier.pinned
    runtime.kernel_launch()
    copier.close()
    assert runtime.calls == ["register", "get_last_error", "get_last_error"]  # (the last: kernel_launch)


def test_libcudart_is_found_in_the_process_maps(tmp_path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/"
        "libcudart.so.12\n"
        "7f04-7f05 rw-p 00000000 00:00 0\n"
    )
    assert find_libcudart(str(maps)) == "/venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert find_libcudart(str(maps)) is None


# -- host payloads and views ---------------------------------------------------------------------------


def _ref(offset: int, nbytes: int, name: str, shape: tuple[int, ...] | None = None) -> TensorRef:
    return TensorRef(offset=offset, nbytes=nbytes, generation=1, dtype="uint8", shape=shape or (nbytes,), name=name)


def test_the_prompt_stays_on_the_host_and_only_tensors_are_copied(arena: mmap.mmap) -> None:
    arena[0:12] = bytes(range(12))
    arena[4096:4100] = b"\x07\x00\x00\x00"
    copier = DeviceCopier(torch.device("cpu"), arena)
    copy = copier.start([_ref(0, 12, "pixels", (3, 2, 2)), _ref(4096, 4, INLINE_TENSOR)], host_only=(INLINE_TENSOR,))
    assert copy.names == ["pixels"] and list(copy.host) == [INLINE_TENSOR]  # only pixels take the device path
    assert copy.host[INLINE_TENSOR][0].numpy().tobytes() == b"\x07\x00\x00\x00"
    arena[4096] = 9  # a clone: released arena bytes may change under it
    assert copy.host[INLINE_TENSOR][0].numpy().tobytes() == b"\x07\x00\x00\x00"
    assert copy.tensors[0].flatten().tolist() == list(range(12))
    copier.close()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bool, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("shape", [(), (3, 4), (3, 64, 64)])
def test_a_host_copy_is_an_equal_tensor_of_its_own(
    arena: mmap.mmap, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    tensor = (torch.rand(shape) * 100).to(dtype)
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    arena[4096 : 4096 + len(data)] = data
    dtype_name = str(dtype).removeprefix("torch.")
    ref = TensorRef(offset=4096, nbytes=len(data), generation=1, dtype=dtype_name, shape=shape, name="pixels")
    copier = DeviceCopier(torch.device("cpu"), arena)
    copy = copier.start([ref]).tensors[0]
    assert copy.dtype == dtype and copy.shape == shape and torch.equal(copy, tensor)
    arena[4096 : 4096 + len(data)] = bytes(len(data))  # released arena bytes may change under it
    assert torch.equal(copy, tensor)
    copier.close()
    arena.close()  # the copy holds no export of the mapping


def _sleeps_while_a_thread_copies(copy: Callable[[], torch.Tensor]) -> int:
    """Voluntary context switches of the process's other threads while a new thread (as the prefetch thread
    is) copies 20 times, 1 ms apart (as requests come): 20 of them are that thread's own sleeps."""
    counts: list[int] = []
    me = threading.get_native_id()

    def switches() -> int:
        total = 0
        for task in Path("/proc/self/task").iterdir():
            if task.name == str(me):
                continue  # the test's thread, waiting for the copier
            with contextlib.suppress(OSError):
                status = (task / "status").read_text()
                total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("voluntary_ctxt"))
        return total

    def body() -> None:
        copy()  # the first call may start an OpenMP team
        time.sleep(0.01)
        before = switches()
        for _ in range(20):
            copy()
            time.sleep(0.001)
        counts.append(switches() - before)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    return counts[0]


def _sleeps_per_copier(arena: mmap.mmap) -> dict[str, int]:
    copier = DeviceCopier(torch.device("cpu"), arena)
    ref = _ref(0, 3 * 224 * 224, "pixels", (3, 224, 224))
    view = copier.views([ref])[0]
    counts = {"clone": _sleeps_while_a_thread_copies(view.clone)}
    counts["host_copies"] = _sleeps_while_a_thread_copies(lambda: copier.host_copies([ref])[0])
    del view
    copier.close()
    return counts


def test_a_host_copy_in_a_thread_wakes_no_other_thread() -> None:
    """torch's clone of a photo-sized tensor splits over the calling thread's OpenMP team: in the worker's
    prefetch thread, a team of its own, woken on every copy. The host copy is one thread's memcpy.

    In a process with the worker's OpenMP settings (worker/__main__.py: passive waits), two intra-op threads.
    """
    script = (
        "import json, mmap; from tests.test_device import _sleeps_per_copier; "
        "print(json.dumps(_sleeps_per_copier(mmap.mmap(-1, 1 << 20))))"
    )
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["clone"] >= 30, counts  # the control: torch's clone wakes a thread per copy here
    assert counts["host_copies"] <= 23, counts  # the copying thread's own 20 sleeps, and rarely another thread's


def test_a_host_view_keeps_the_mapping_alive(arena: mmap.mmap) -> None:
    arena[0:4] = b"abcd"
    copier = DeviceCopier(torch.device("cpu"), arena)
    view = copier.views([_ref(0, 4, "pixels")])[0]
    copier.close()
    with pytest.raises(BufferError):  # a bare torch.frombuffer view would let this unmap under it
        arena.close()
    assert bytes(view.numpy()) == b"abcd"
    del view
    arena.close()


def test_a_closed_copier_hands_out_no_views(arena: mmap.mmap) -> None:
    copier = DeviceCopier(torch.device("cpu"), arena)
    copier.close()
    with pytest.raises(RuntimeError, match="closed"):
        copier.views([_ref(0, 4, "pixels")])


def test_on_cuda_the_prompt_is_cloned_on_the_host_and_the_copy_event_blocks(
    arena: mmap.mmap, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Control flow of the CUDA branch with stand-ins: the token ids never reach a device copy, and the
    # event the prefetch thread waits on is a blocking one (a waiting thread sleeps, it does not spin).
    events: list[dict[str, object]] = []

    class FakeEvent:
        def __init__(self, **kwargs: object) -> None:
            events.append(dict(kwargs))

        def record(self, stream: object) -> None:
            events[-1]["recorded_on"] = stream

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    arena[0:4] = b"\x01\x00\x00\x00"
    copier = DeviceCopier(torch.device("cuda", 0), arena, runtime=FakeRuntime(), registrations=HostRegistrations())
    copy = copier.start([_ref(0, 4, INLINE_TENSOR)], host_only=(INLINE_TENSOR,))
    assert copy.tensors == [] and copy.host[INLINE_TENSOR][0].device.type == "cpu"
    assert events == [{"blocking": True, "recorded_on": copier._stream}]
    copier.close()


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "mps", "cpu:1", ""])
def test_a_device_that_is_not_cpu_cuda_or_cuda_n_is_refused_naming_the_forms(device: str) -> None:
    with pytest.raises(ValueError, match="expected cpu, cuda or cuda:N"):
        check_device(device)


def test_cuda_is_refused_in_one_line_where_it_cannot_run() -> None:
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        assert check_device("cuda:0") == torch.device("cuda", 0)
        with pytest.raises(ValueError, match=f"only {count} GPU"):
            check_device(f"cuda:{count}")
        return
    with pytest.raises(ValueError, match="built without CUDA|no CUDA GPU is usable") as caught:
        check_device("cuda")
    assert "--device cpu" in str(caught.value) and "\n" not in str(caught.value)
    assert check_device("cpu") == torch.device("cpu")
