from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.hf_fixture import build_tiny_vlm
from tests.serving import Server, start_server, stop_and_check


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_vlm(family)``: that family's tiny checkpoint (tests/hf_fixture.py FAMILIES), built on first
    use and then shared by every module of the test run (a fixed seed: every build is identical)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        pytest.importorskip("transformers")
        if family not in built:
            name = "tiny-" + family.replace("_", "-")
            built[family] = build_tiny_vlm(tmp_path_factory.mktemp("models") / name, family)
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tiny_vlm: Callable[[str], Path]) -> Path:
    """The tiny Qwen2-VL checkpoint, built once per test run for every module."""
    return tiny_vlm("qwen2_vl")


def _serve(model: str, tmp_path_factory: pytest.TempPathFactory, *extra: str) -> Iterator[Server]:
    server = start_server(model, tmp_path_factory.mktemp("serve"), *extra)
    try:
        yield server
    finally:
        stop_and_check(server)


@pytest.fixture(scope="module")
def checksum_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve("checksum", tmp_path_factory, "--workers", "2", "--max-batch-size", "8")


@pytest.fixture(scope="module")
def efficientnet_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve("efficientnet-lite0", tmp_path_factory)


@pytest.fixture(scope="module")
def spare_slot_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One worker (so its pid identifies it) and one frontend slot no process uses, for a test to attach to."""
    yield from _serve("checksum", tmp_path_factory, "--workers", "1", "--max-workers", "2",
                      "--spare-frontend-slots", "1")
