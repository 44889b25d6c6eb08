"""The GPU path on a real GPU (every test here is skipped without CUDA; bench/gpu_run.sh runs them).

What the CPU tests with a mocked runtime (tests/test_device.py) cannot show:
- the arena really registers, copies out of it are exact and start from pinned memory, and a second
  copier of the same mapping shares the registration instead of failing;
- a registration that really fails (the range is already registered by someone else) leaves no
  pending CUDA error: the next kernel runs;
- a worker on cuda:N opens no context on GPU 0 (needs two GPUs);
- the prompt's token ids stay host tensors, the image tensors arrive on the device;
- a real Worker (copy stream, prefetch thread, compute stream) classifies the photos correctly;
  under TORCH_CUDA_SANITIZER=1 this is the stream-race check;
- EfficientNet-Lite0 on the GPU matches the CPU reference to 2e-3 (TF32 off, as the backend runs it),
  and an image's answer is the same in whatever batch it lands.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from shmgate.gateway.preprocess.vision import EfficientNetPreprocessor  # noqa: E402
from shmgate.shared.arena import Partition  # noqa: E402
from shmgate.shared.common_options import BatchingOptions  # noqa: E402
from shmgate.shared.instance import Instance  # noqa: E402
from shmgate.shared.wire import INLINE_TENSOR, Delta, Failed, Finished, Submit, TensorRef  # noqa: E402
from shmgate.worker.backends.base import ModelBackend, WorkItem  # noqa: E402
from shmgate.worker.backends.efficientnet import EfficientNetBackend  # noqa: E402
from shmgate.worker.cudart import load_runtime  # noqa: E402
from shmgate.worker.device import DeviceCopier, HostRegistrations  # noqa: E402
from shmgate.worker.main import Worker, WorkerOptions  # noqa: E402
from tests.shm_children import claim_frontend  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
IMAGES = REPO / "tests" / "data" / "images"
LABELS: dict[str, dict[str, Any]] = json.loads((IMAGES / "labels.json").read_text())["images"]
PHOTOS = sorted(LABELS)
HANG_S = 60.0
FP32_TOLERANCE = 2e-3  # TF32 off: cuDNN's algorithms still sum in another order than the CPU's


@pytest.fixture()
def instance() -> Iterator[Instance]:
    inst = Instance.create(arena_size=64 << 20, n_frontends=1, n_workers=2, queue_depth=4)
    _, heartbeat = claim_frontend(inst, 0)
    try:
        yield inst
    finally:
        heartbeat.stop()
        inst.unlink()
        inst.close()


def _place(partition: Partition, array: np.ndarray, name: str) -> TensorRef:
    allocation = partition.allocate(array.nbytes)
    assert allocation is not None
    partition.array(allocation, array.dtype.name, array.shape)[...] = array
    return TensorRef(
        offset=allocation.offset,
        nbytes=array.nbytes,
        generation=allocation.generation,
        dtype=array.dtype.name,
        shape=array.shape,
        name=name,
    )


def _pixels(name: str, draft_margin: int | None = None) -> np.ndarray:
    out: dict[str, np.ndarray] = {}

    def allocate(tensor: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        out[tensor] = np.empty(shape, dtype)
        return out[tensor]

    pre = EfficientNetPreprocessor() if draft_margin is None else EfficientNetPreprocessor(draft_margin=draft_margin)
    pre.preprocess_image((IMAGES / name).read_bytes(), allocate, max_pixels=40_000_000)
    return out["pixels"]


# -- registration ---------------------------------------------------------------------------------------


def test_the_arena_registers_and_copies_from_it_are_exact_and_pinned(instance: Instance) -> None:
    partition = Partition(instance.segment, 0)
    data = np.random.default_rng(0).integers(0, 256, (3, 224, 224), dtype=np.uint8)
    ref = _place(partition, data, "pixels")
    registrations = HostRegistrations()
    first = DeviceCopier(torch.device("cuda", 0), instance.segment.mm, registrations=registrations)
    second = DeviceCopier(torch.device("cuda", 0), instance.segment.mm, registrations=registrations)
    try:
        assert first.pinned and second.pinned and registrations.users(instance.segment.mm) == 2
        view = first.views([ref])[0]
        assert view.is_pinned()  # the DMA reads shared memory directly
        out = first.copy([ref])[0]
        assert out.is_cuda and torch.equal(out.cpu(), torch.from_numpy(data))
        del view
    finally:
        first.close()
        second.close()
    assert registrations.users(instance.segment.mm) == 0


def test_a_registration_that_fails_leaves_no_pending_error(instance: Instance) -> None:
    device = torch.device("cuda", 0)
    holder = HostRegistrations()
    copier = DeviceCopier(device, instance.segment.mm, registrations=holder)
    assert copier.pinned
    try:
        # A second registry does not know the range: it registers again and CUDA refuses (already registered).
        other = HostRegistrations()
        assert other.register(instance.segment.mm, load_runtime(device)) is None
        x = torch.ones(1024, device=device)
        x.add_(1)  # the next kernel: with the error pending this raised "CUDA error: ..."
        torch.cuda.synchronize()
        assert float(x.sum()) == 2048.0
    finally:
        copier.close()


def test_token_ids_stay_on_the_host_and_images_go_to_the_device(instance: Instance) -> None:
    partition = Partition(instance.segment, 0)
    ids = np.arange(2000, dtype=np.int32)  # over the inline limit: it rides in the arena
    refs = [_place(partition, _pixels(PHOTOS[0]), "pixels"), _place(partition, ids.view(np.uint8), INLINE_TENSOR)]
    copier = DeviceCopier(torch.device("cuda", 0), instance.segment.mm)
    try:
        copy = copier.start(refs, host_only=(INLINE_TENSOR,))
        copy.wait_host()
        assert copy.names == ["pixels"] and copy.tensors[0].is_cuda
        assert not copy.host[INLINE_TENSOR][0].is_cuda
        assert copy.host[INLINE_TENSOR][0].numpy().tobytes() == ids.tobytes()
    finally:
        copier.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_copier_on_gpu_1_opens_no_context_on_gpu_0() -> None:
    code = textwrap.dedent("""
        import threading, torch
        from shmgate.shared.instance import Instance
        from shmgate.worker.device import DeviceCopier, use_device
        inst = Instance.create(arena_size=16 << 20, n_frontends=1, n_workers=1, queue_depth=2)
        try:
            device = torch.device("cuda", 1)
            use_device(device)
            copier = DeviceCopier(device, inst.segment.mm)
            assert copier.pinned
            def other_thread():  # the prefetch thread: binds first, as worker/main.py does
                use_device(device)
                copier.copy([])
                torch.cuda.current_stream(device).synchronize()
            t = threading.Thread(target=other_thread); t.start(); t.join()
            copier.close()
            print(int(torch._C._cuda_hasPrimaryContext(0)), int(torch._C._cuda_hasPrimaryContext(1)))
        finally:
            inst.unlink(); inst.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1"]


# -- parity with the CPU reference ----------------------------------------------------------------------


@pytest.fixture()
def tf32_off() -> Iterator[None]:
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _worst_deviation(backend: EfficientNetBackend) -> float:
    pixels = [torch.from_numpy(_pixels(name, draft_margin=0)).cuda() for name in PHOTOS]
    probs, labels = backend.classify(pixels)
    worst = 0.0
    for name, p, idx in zip(PHOTOS, probs, labels):
        ours = {backend.class_names[i]: q for i, q in zip(idx, p)}
        assert backend.class_names[idx[0]] in LABELS[name]["accept_top1"], name
        worst = max(worst, *(abs(ours.get(r["label"], 0.0) - float(r["prob"])) for r in LABELS[name]["reference_top5"]))
    return worst


def test_gpu_probabilities_match_the_cpu_reference_with_tf32_off(tf32_off: None) -> None:
    assert _worst_deviation(EfficientNetBackend(torch.device("cuda", 0))) <= FP32_TOLERANCE


def test_an_answer_does_not_depend_on_the_batch_it_lands_in() -> None:
    """With TF32 convolutions (torch's default) 7 of 8 photos' probabilities moved in the 4th decimal
    between batch 1 and batch 8 on an H100, so the same image got different answers under load; the
    backend turns TF32 off and pads passes to shape buckets (worker/backends/efficientnet.py)."""
    saved = torch.backends.cudnn.allow_tf32
    try:
        backend = EfficientNetBackend(torch.device("cuda", 0))
        assert not torch.backends.cudnn.allow_tf32
        photos = [torch.from_numpy(_pixels(name)).cuda() for name in PHOTOS]
        solo = [backend.classify([photo]) for photo in photos]
        for size in (2, 5, 8, 9, 13):
            batch = [photos[i % len(photos)] for i in range(size)]
            probs, labels = backend.classify(batch)
            for i in range(size):
                ref_probs, ref_labels = solo[i % len(photos)]
                assert labels[i] == ref_labels[0], (size, i)
                assert [f"{p:.4f}" for p in probs[i]] == [f"{p:.4f}" for p in ref_probs[0]], (size, i)
    finally:
        torch.backends.cudnn.allow_tf32 = saved


# -- the whole worker, on the GPU -----------------------------------------------------------------------


def test_a_cuda_worker_classifies_the_photos_through_its_pipeline(instance: Instance) -> None:
    """Copy stream -> event -> compute stream, with the prefetch thread: the stream-race check's subject."""
    worker = Worker(
        instance,
        WorkerOptions(
            model="efficientnet-lite0",
            device="cuda",
            batching=BatchingOptions(max_batch_size=4, max_batch_wait_ms=2),
        ),
    )
    assert worker.device == torch.device("cuda", 0) and worker.copier.pinned
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    partition = Partition(instance.segment, 0)
    requests, replies = instance.request_queue(), instance.reply_queue(0)

    def send_all() -> None:  # a thread: the queues are shallow, and the replies must be read meanwhile
        for rounds in range(3):  # several batches, so copies of batch k+1 overlap batch k
            for i, name in enumerate(PHOTOS):
                ref = _place(partition, _pixels(name), "pixels")
                requests.send(
                    Submit(request_id=100 * rounds + i, reply_slot=0, model="efficientnet-lite0", tensors=(ref,)),
                    HANG_S,
                )

    sender = threading.Thread(target=send_all, daemon=True)
    try:
        sender.start()
        texts: dict[int, str] = {}
        done: set[int] = set()
        deadline = time.monotonic() + HANG_S
        while len(done) < 3 * len(PHOTOS):
            assert time.monotonic() < deadline, texts
            message = replies.receive(0.5)
            assert not isinstance(message, Failed), message
            if isinstance(message, (Delta, Finished)):
                texts[message.request_id] = texts.get(message.request_id, "") + message.text
            if isinstance(message, Finished):
                done.add(message.request_id)
        for request_id, text in texts.items():
            name = PHOTOS[request_id % 100]
            assert text.split(":")[0] in LABELS[name]["accept_top1"], (name, text)
    finally:
        sender.join(HANG_S)
        worker.stop()
        thread.join(HANG_S)
        requests.close()
        replies.close()
    assert not thread.is_alive()


def test_workitems_reach_the_backend_on_the_device(instance: Instance) -> None:
    seen: list[WorkItem] = []

    class Recorder(ModelBackend):
        name = "checksum"

        def run(self, batch: list[WorkItem]) -> Iterator[Any]:
            from shmgate.worker.backends.base import BackendEvent

            seen.extend(batch)
            for i in range(len(batch)):
                yield BackendEvent(i, finish_reason="stop")

    worker = Worker(instance, WorkerOptions(model="checksum", device="cuda"), backend=Recorder())
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    requests, replies = instance.request_queue(), instance.reply_queue(0)
    try:
        ref = _place(Partition(instance.segment, 0), _pixels(PHOTOS[0]), "pixels")
        requests.send(Submit(request_id=1, reply_slot=0, model="checksum", tensors=(ref,)), HANG_S)
        deadline = time.monotonic() + HANG_S
        while not seen:
            assert time.monotonic() < deadline
            replies.receive(0.2)
        assert seen[0].tensors["pixels"][0].device == torch.device("cuda", 0)
    finally:
        worker.stop()
        thread.join(HANG_S)
        requests.close()
        replies.close()
