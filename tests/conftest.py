from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.hf_fixture import build_tiny_vlm
from tests.serving import Server, start_server, stop_and_check

# The servers the tests start share one uid's POSIX message-queue memory (RLIMIT_MSGQUEUE, 800 KB by
# default, and raising it needs CAP_SYS_RESOURCE, which CI's container lacks). At the default depth of
# 64 one server plans its queues to take nearly all of it, so the next server (another test process
# under pytest-xdist) finds too little and cannot start. Shallow queues by default (a full queue only
# makes a frontend wait for room, up to 10 s, so no test's outcome depends on the depth); a test that
# is about depth or budget passes --queue-depth or sets its own limit.
os.environ.setdefault("SHMGATE_QUEUE_DEPTH", "4")
# Every server keeps its Batch API state under $XDG_STATE_HOME (gateway/batch_store.py
# default_batch_dir): the test run's servers keep theirs in a directory of the run, removed when the
# run ends, not in the home of the user who runs the suite. Set before any test starts a server.
if "XDG_STATE_HOME" not in os.environ:
    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="shmgate-tests-state-")
    atexit.register(shutil.rmtree, os.environ["XDG_STATE_HOME"], True)

# The files that take longest (--durations=0 of a whole run, setup and teardown included), longest first.
# scripts/test.sh hands files to its processes in collection order (--no-loadscope-reorder; pytest-xdist
# would otherwise order them by their number of tests), and a long file handed out last leaves one process
# running it alone at the end while the other idles. Files not named keep their order, after these.
LONGEST_FIRST = (
    "test_selfheal.py",
    "test_chaos.py",
    "test_video.py",
    "test_encoder_share_serve.py",
    "test_batch_api.py",
    "test_embeddings.py",
    "test_efficientnet.py",
    "test_decode_memory.py",
    "test_pod_in_a_box.py",
    "test_faults.py",
    "test_startup_log.py",
    "test_e2e.py",
    "test_fuzz.py",
    "test_hf_families.py",
    "test_hf_serve.py",
    "test_hangups_hf.py",
    "test_responses.py",
    "test_docs_examples.py",
    "test_wedged_hf.py",
    "test_batch_faults.py",
    "test_tools.py",
    "test_schema_corpus.py",
    "test_hostile_inputs.py",
    "test_installed_namespace.py",
    "test_engine.py",
    "test_soak.py",
    "test_compose_local.py",
    "test_image_urls.py",
    "test_model_identity.py",
    "test_scaleout.py",
    "test_api_key.py",
    "test_arena_placement.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


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
    yield from _serve(
        "checksum", tmp_path_factory, "--workers", "1", "--max-workers", "2", "--spare-frontend-slots", "1"
    )
