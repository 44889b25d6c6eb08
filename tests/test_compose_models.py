"""docker/compose.models.yaml, the two-model override, checked without starting containers.

- it validates against the compose specification's schema, as written and interpolated;
- the gateway declares the models (parsed by shmgate's own command line, so a flag it no longer takes
  fails here), and every declared model has a worker service naming it, every worker service names a
  declared model, and all of them share the gateway's IPC namespace and label;
- where Compose binaries are installed, `config` accepts the base file with this override.
docker/smoke.sh starts it for real (its "two models" step).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shmgate.gateway.cli import build_parser, declared_models
from tests.compose_util import load_compose
from tests.test_compose import compose_validator  # noqa: F401  (the fixture, shared with the base files' test)
from tests.test_compose_hf import _compose_binaries, _config

DOCKER = Path(__file__).resolve().parent.parent / "docker"
COMPOSE = DOCKER / "compose.yaml"
COMPOSE_MODELS = DOCKER / "compose.models.yaml"


def _merged() -> dict[str, dict]:
    """The base file with the override laid over it, service by service (what Compose does for these keys)."""
    base = load_compose(COMPOSE, {})["services"]
    over = load_compose(COMPOSE_MODELS, {})["services"]
    return {name: {**base.get(name, {}), **over.get(name, {})} for name in base.keys() | over.keys()}


def _worker_model(service: dict) -> str:
    command = service["command"]
    assert command[0] == "worker", command
    return command[command.index("--model") + 1]


@pytest.mark.parametrize("interpolated", [False, True], ids=["as-written", "interpolated"])
def test_matches_the_compose_spec(compose_validator, interpolated: bool) -> None:  # noqa: F811
    document = load_compose(COMPOSE_MODELS, {}) if interpolated else yaml.safe_load(COMPOSE_MODELS.read_text())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_validator.iter_errors(document)]
    assert errors == []


def test_every_declared_model_has_its_own_worker_service() -> None:
    services = _merged()
    command = services["gateway"]["command"]
    assert command[0] == "gateway"
    args = build_parser().parse_args(command)
    declared = [config.public_id for config in declared_models(args)]
    assert declared == ["efficientnet-lite0", "checksum"]
    workers = {name: _worker_model(spec) for name, spec in services.items() if name != "gateway"}
    assert sorted(workers.values()) == sorted(declared), workers
    label = services["gateway"]["environment"]["SHMGATE_LABEL"]
    for name, spec in services.items():
        if name == "gateway":
            continue
        assert spec["ipc"] == "service:gateway", name
        assert spec["environment"]["SHMGATE_LABEL"] == label, name
        assert spec["depends_on"]["gateway"]["condition"] == "service_healthy", name


@pytest.mark.parametrize(
    "binary",
    _compose_binaries() or [pytest.param([], marks=pytest.mark.skip("no Compose"))],
    ids=lambda b: " ".join(b) or "none",
)
def test_compose_accepts_the_override(binary: list[str]) -> None:
    ok = _config(binary, COMPOSE, COMPOSE_MODELS, env={}, fmt=["-q"])
    assert ok.returncode == 0, ok.stderr
