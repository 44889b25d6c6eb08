"""Which GPUs ``shmgate serve`` hands its workers (CUDA_VISIBLE_DEVICES is a restriction, not a hint),
and how many workers it starts on CPU."""

from __future__ import annotations

from gateway.cli import _default_cpu_workers, visible_gpus


def test_without_cuda_visible_devices_every_gpu_of_the_machine() -> None:
    assert visible_gpus({}, 4) == ["0", "1", "2", "3"]
    assert visible_gpus({}, 0) == []


def test_cuda_visible_devices_restricts_and_keeps_its_ids() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, 4) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": " GPU-1a2b , GPU-3c4d "}, 8) == ["GPU-1a2b", "GPU-3c4d"]


def test_empty_cuda_visible_devices_means_no_gpu() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, 4) == []


def test_cpu_default_is_two_workers_splitting_the_cores_and_one_for_hf_models() -> None:
    assert _default_cpu_workers("efficientnet-lite0", 2) == 2
    assert _default_cpu_workers("checksum", 16) == 2
    assert _default_cpu_workers("checksum:hf:/models/qwen", 16) == 2  # the frontends load the processor only
    assert _default_cpu_workers("hf:/models/qwen", 16) == 1  # weights loaded once
    assert _default_cpu_workers("efficientnet-lite0", 1) == 1
