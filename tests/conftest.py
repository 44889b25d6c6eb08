from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hf_fixture import build_tiny_vlm
from tests.serving import Server, start_server, stop_and_check


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2-VL checkpoint (tests/hf_fixture.py), built once per test run for every module."""
    pytest.importorskip("transformers")
    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-qwen2-vl")


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
