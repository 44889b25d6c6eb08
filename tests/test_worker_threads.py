"""How many torch threads ``shmgate serve`` gives each CPU worker (node/plan.py ``worker_threads``): the usable
CPUs shared among the workers, less one left to the frontends when a chat model is served; ``--threads`` wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from shmgate.node import plan
from shmgate.node.cli import parse_config
from shmgate.node.config import ServeConfig


def _threads(argv: list[str]) -> int:
    config = parse_config(["serve", "--device", "cpu", *argv])
    assert isinstance(config, ServeConfig)
    models = plan.declared_models(config)
    placements = [p for _, model_placements in plan.model_plans(models) for p in model_placements]
    return plan.worker_threads(config, len(placements), models)


@pytest.mark.parametrize(("cpus", "chat", "classifier"), [(1, 1, 1), (2, 1, 1), (4, 3, 2), (16, 15, 8)])
def test_a_chat_model_leaves_one_core_to_the_frontends(
    monkeypatch: pytest.MonkeyPatch, tiny_qwen2_vl_dir: Path, cpus: int, chat: int, classifier: int
) -> None:
    monkeypatch.setattr(plan, "usable_cpus", lambda: cpus)
    assert _threads(["--model", f"hf:{tiny_qwen2_vl_dir}"]) == chat  # one worker: a VLM's weights load once
    assert _threads(["--model", "efficientnet-lite0"]) == classifier  # two workers from 2 cores, no reserve
    assert _threads(["--model", f"hf:{tiny_qwen2_vl_dir}", "--threads", "2"]) == 2
