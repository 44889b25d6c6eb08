"""Which GPUs ``shmgate serve`` hands its workers (CUDA_VISIBLE_DEVICES is a restriction, not a hint),
which GPU each worker runs on (node/placement.py: one visible GPU per worker, ``cuda:N`` = GPU N only),
and how many workers it starts on CPU. No GPU needed: the workers' configurations are built, not run."""

from __future__ import annotations

import pytest

from shmgate.node import plan
from shmgate.node.cli import parse_config
from shmgate.node.config import ServeConfig
from shmgate.node.placement import gpu_count
from shmgate.node.plan import _default_cpu_workers, visible_gpus
from shmgate.node.serve import summary
from shmgate.shared.errors import SetupError


def _serve(flags: list[str]) -> ServeConfig:
    config = parse_config(["serve", *flags])
    assert isinstance(config, ServeConfig)
    return config


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


# --- placement: which GPU each worker of `shmgate serve` runs on ------------------------------------------


def _serve_workers(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], *, gpus: int, visible: str | None = None
) -> list[tuple[str, str | None]]:
    """(--device, CUDA_VISIBLE_DEVICES) of each worker `shmgate serve FLAGS` starts on a machine with ``gpus``."""
    monkeypatch.setattr(plan, "_gpu_count", lambda: gpus)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    config = _serve(["--model", "efficientnet-lite0", *flags])
    children = plan.worker_children(config, plan.model_plans(plan.declared_models(config)), "0123456789abcdef")
    return [(child.config.placement.device or "", child.env.get("CUDA_VISIBLE_DEVICES")) for child in children]


def test_each_cuda_worker_sees_exactly_its_own_gpu_and_each_gpu_gets_workers_per_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workers = _serve_workers(monkeypatch, ["--device", "cuda", "--workers-per-gpu", "2"], gpus=4)
    assert len(workers) == 8
    assert {device for device, _ in workers} == {"cuda:0"}  # GPU 0 of what it sees: its own
    assert sorted(visible for _, visible in workers) == ["0", "0", "1", "1", "2", "2", "3", "3"]


def test_the_default_device_on_a_gpu_machine_is_one_worker_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _serve_workers(monkeypatch, [], gpus=2) == [("cuda:0", "0"), ("cuda:0", "1")]
    assert _serve_workers(monkeypatch, [], gpus=1) == [("cuda:0", "0")]


def test_cuda_n_means_gpu_n_only_with_its_workers_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _serve_workers(monkeypatch, ["--device", "cuda:2", "--workers-per-gpu", "2"], gpus=4) == [
        ("cuda:0", "2"),
        ("cuda:0", "2"),
    ]
    assert _serve_workers(monkeypatch, ["--device", "cuda:1", "--workers", "3"], gpus=2) == [("cuda:0", "1")] * 3


def test_cuda_n_counts_within_cuda_visible_devices_as_cuda_does(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _serve_workers(monkeypatch, ["--device", "cuda:1"], gpus=8, visible="5,7") == [("cuda:0", "7")]
    assert _serve_workers(monkeypatch, ["--device", "cuda"], gpus=8, visible="5,7") == [
        ("cuda:0", "5"),
        ("cuda:0", "7"),
    ]


def test_cuda_n_past_the_visible_gpus_is_a_setup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SetupError, match="only 2 GPU"):
        _serve_workers(monkeypatch, ["--device", "cuda:2"], gpus=2)
    with pytest.raises(SystemExit):  # refused when the flags are parsed (tests/test_cli_flags.py)
        _serve_workers(monkeypatch, ["--device", "cuda:x"], gpus=2)


def test_gpus_not_countable_here_leave_the_choice_to_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    # No /proc/driver/nvidia (some containers): the device as asked, visibility inherited.
    assert _serve_workers(monkeypatch, ["--device", "cuda", "--workers-per-gpu", "2"], gpus=0) == [
        ("cuda", None),
        ("cuda", None),
    ]
    assert _serve_workers(monkeypatch, ["--device", "cuda:1"], gpus=0) == [("cuda:1", None)]


def test_cpu_workers_get_no_gpu_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    workers = _serve_workers(monkeypatch, ["--device", "cpu", "--workers", "3"], gpus=2)
    assert workers == [("cpu", None)] * 3


def test_gpus_are_counted_from_the_driver_or_else_from_the_device_nodes(tmp_path) -> None:
    proc, dev = tmp_path / "gpus", tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia3", "nvidiactl", "nvidia-uvm", "nvidia-caps", "null"):
        (dev / name).touch()
    assert gpu_count(str(proc), str(dev)) == 2  # no /proc entries (gVisor, some runtimes): the nodes
    proc.mkdir()
    for bus in ("0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0"):
        (proc / bus).mkdir()
    assert gpu_count(str(proc), str(dev)) == 3
    assert gpu_count(str(tmp_path / "none"), str(tmp_path / "none")) == 0


def test_only_a_served_hugging_face_checkpoint_gets_the_long_stall_timeout() -> None:
    from shmgate.node.config import DEFAULT_STALL_TIMEOUT_S, HF_STALL_TIMEOUT_S
    from shmgate.node.plan import stall_timeout_for

    assert stall_timeout_for("hf:/models/qwen", None) == HF_STALL_TIMEOUT_S
    assert stall_timeout_for("checksum:hf:/models/qwen", None) == DEFAULT_STALL_TIMEOUT_S  # no weights loaded
    assert stall_timeout_for("checksum", None) == DEFAULT_STALL_TIMEOUT_S
    assert stall_timeout_for("hf:/models/qwen", 0.0) == 0.0


def test_the_startup_summary_names_the_gpus_the_workers_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan, "_gpu_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    config = _serve(["--device", "cuda", "--dtype", "float16"])
    facts = summary(config, plan.declared_models(config), "0123456789abcdef", "http://127.0.0.1:8000", 2)
    assert facts.workers == "2 workers on GPU 2, 3"
    monkeypatch.setattr(plan, "_gpu_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    config = _serve(["--device", "cuda", "--workers-per-gpu", "2"])
    assert summary(config, plan.declared_models(config), "0123456789abcdef", "http://h:1", 1).workers == (
        "2 workers on GPU 0"
    )
