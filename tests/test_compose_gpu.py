"""docker/compose.gpu.yaml, checked without docker or a GPU: placement per replica, and Compose 1.29.

- each worker replica is granted the GPUs and asks for plain ``cuda``, so it picks one by its slot
  (worker/device.py ``pick_device``, tested in tests/test_device.py) instead of all landing on cuda:0;
- nothing Compose 1.29 (Debian 12's docker-compose) rejects: no top-level ``name:``, no
  ``depends_on.<service>.restart``; and, where docker-compose is installed, ``docker-compose config``
  accepts the base file with this override on top (skipped while the base file itself is not valid for it).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.compose_util import load_compose

DOCKER = Path(__file__).resolve().parent.parent / "docker"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_GPU = DOCKER / "compose.gpu.yaml"


def test_worker_replicas_get_the_gpus_and_choose_one_by_slot() -> None:
    worker = load_compose(COMPOSE_GPU)["services"]["worker"]
    assert worker["environment"]["SHMGATE_DEVICE"] == "cuda"  # no index: the replica picks (slot mod GPUs)
    (request,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert request["driver"] == "nvidia" and request["capabilities"] == ["gpu"]
    assert request["count"] == "all" and "device_ids" not in request


def test_nothing_compose_1_29_rejects() -> None:
    document = yaml.safe_load(COMPOSE_GPU.read_text(encoding="utf-8"))
    assert "name" not in document and "version" not in document
    for service in document["services"].values():
        for dependency in (
            (service.get("depends_on") or {}).values() if isinstance(service.get("depends_on"), dict) else ()
        ):
            assert "restart" not in dependency


def _compose_1_29(*files: Path) -> subprocess.CompletedProcess[str]:
    argv = ["docker-compose", "--project-directory", str(DOCKER)]
    for f in files:
        argv += ["-f", str(f)]
    return subprocess.run([*argv, "config", "-q"], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (Compose 1.x) is not installed")
def test_compose_1_29_accepts_the_override_on_the_base_file() -> None:
    base = _compose_1_29(COMPOSE)
    if base.returncode != 0:
        pytest.skip(f"docker/compose.yaml alone is not valid for docker-compose: {base.stderr.strip()[:200]}")
    both = _compose_1_29(COMPOSE, COMPOSE_GPU)
    assert both.returncode == 0, both.stderr
