from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

from tests.hf_fixture import SMALL_VIDEO_PROCESSOR, build_tiny_vlm
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

# The files that take longest, longest first (each alone, -p no:xdist, setup and teardown included; a
# SHARED_SERVER_GROUPS group's files together, under its name).
# scripts/test.sh hands files to its processes in collection order (--no-loadscope-reorder; pytest-xdist
# would otherwise order them by their number of tests), and a long file handed out last leaves one process
# running it alone at the end while the other idles. Files not named keep their order, after these.
LONGEST_FIRST = (
    "test_selfheal.py",
    "test_docs_examples.py",
    "checksum-server",
    "test_wedged_hf.py",
    "test_faults.py",
    "test_tools.py",
    "tiny-qwen2-vl-server",
    "test_chaos.py",
    "test_embeddings.py",
    "test_pod_in_a_box.py",
    "test_api_key.py",
    "test_encoder_share_serve.py",
    "spare-slot-server",
    "test_batch_faults.py",
    "test_image_urls.py",
    "test_compose_local.py",
    "test_hf_families.py",
    "test_batch_api.py",
    "test_installed_namespace.py",
    "test_hostile_inputs.py",
    "test_model_identity.py",
    "test_efficientnet.py",
    "test_engine.py",
    "test_scaleout.py",
    "test_arena_placement.py",
)


# Files whose tests ask one server of the same flags (``tiny_qwen2_vl_server``, ``shared_checksum_server``,
# ``spare_slot_server``):
# scripts/test.sh hands each group to one process as one unit (``pytest_xdist_make_scheduler``), one file
# after the other, so the group's files start one server between them instead of one each (an hf: server's
# start and stop cost a process ~15 s, most of it spent importing torch and transformers in each child; a
# checksum server's ~9 s).
# A group is ranked in LONGEST_FIRST by its name, as a file is.
SHARED_SERVER_GROUPS = {
    "tiny-qwen2-vl-server": (
        "test_bench_tokens.py",
        "test_hangups_hf.py",
        "test_hf_serve.py",
        "test_responses.py",
        "test_schema_corpus.py",
        "test_video.py",
    ),
    "checksum-server": (
        "test_contract.py",
        "test_decode_memory.py",
        "test_e2e.py",
        "test_hangups.py",
        "test_loadgen.py",
        "test_soak.py",
        "test_startup_log.py",
    ),
    "spare-slot-server": ("test_forged_descriptors.py", "test_fuzz.py", "test_hostile.py"),
}
_GROUP_OF = {name: group for group, names in SHARED_SERVER_GROUPS.items() for name in names}


def _unit(file_name: str) -> str:
    """The unit a file is handed out in: its shared-server group, or itself."""
    return _GROUP_OF.get(file_name, file_name)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # stable: a file's tests keep their order, and a group's files stay side by side (in name order)
    items.sort(key=lambda item: rank.get(_unit(item.path.name), len(rank)))
    for shared in _SHARED:
        shared.users = {item.path for item in items if shared.fixture in item.fixturenames}
    _write_serial_files(config, items)


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


SHARED_CLASSIFIER = "efficientnet-lite0"  # the second model of the shared tiny VLM server, listed after it


class _SharedServer:
    """A server of this process held while consecutive tests use it (``users``: the files with a test that
    asks for its fixture) and stopped, with the usual checks, as soon as the next test is in another file:
    a server kept for a whole process would hold its share of the uid's message-queue budget and its
    memory through every other file the process runs. Its fixture is module-scoped (a module's tests run
    together, and the server outlives the module while the next one uses it too), so module-scoped
    fixtures may ask for it."""

    def __init__(self, fixture: str) -> None:
        self.fixture = fixture
        self.server: Server | None = None
        self.users: set[Path] = set()

    def get(self, start: Callable[[], Server]) -> Server:
        if self.server is None:
            self.server = start()
        return self.server

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            stop_and_check(server)


_SHARED = (
    _SharedServer("tiny_qwen2_vl_server"),
    _SharedServer("shared_checksum_server"),
    _SharedServer("spare_slot_server"),
)


@pytest.fixture(scope="module")
def tiny_qwen2_vl_server(tiny_qwen2_vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    """``shmgate serve`` of the tiny Qwen2-VL (with a video setting of its own, SMALL_VIDEO_PROCESSOR) and the
    classifier (1 frontend, 1 worker each, 1 thread, a result cache, Server-Timing on), shared by the files
    of its SHARED_SERVER_GROUPS group one after the other. Their tests compare metric deltas, never totals,
    and send images no other file sends where a cache's hit or miss is the point."""

    def start() -> Server:
        model_dir = tmp_path_factory.mktemp("shared-model") / tiny_qwen2_vl_dir.name  # the same served id
        shutil.copytree(tiny_qwen2_vl_dir, model_dir)
        (model_dir / "video_preprocessor_config.json").write_text(json.dumps(SMALL_VIDEO_PROCESSOR))
        return start_server(
            f"hf:{model_dir}",
            tmp_path_factory.mktemp("serve"),
            *("--model", SHARED_CLASSIFIER, "--workers", "1", "--frontends", "1", "--threads", "1"),
            *("--queue-depth", "8", "--result-cache-mb", "8", "--server-timing"),
        )

    return _SHARED[0].get(start)


@pytest.fixture(scope="module")
def shared_checksum_server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    """The ``checksum_server`` (2 workers, batches of up to 8) of the files of its SHARED_SERVER_GROUPS group,
    one after the other (each overrides ``checksum_server`` with it). Their tests compare metric and log
    deltas, and wait for the server to be idle before counting."""
    return _SHARED[1].get(
        lambda: start_server("checksum", tmp_path_factory.mktemp("serve"), "--workers", "2", "--max-batch-size", "8")
    )


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the test's own teardown: stop a shared server unless the next test's file uses it too (a failed
    check is this test's teardown error)."""
    _stop_all(shared for shared in _SHARED if nextitem is None or nextitem.path not in shared.users)


def pytest_sessionfinish() -> None:
    _stop_all(_SHARED)  # an interrupted run: never leave a server behind


def _stop_all(servers: Iterable[_SharedServer]) -> None:
    """Stop each (a failed check of one does not leave the others running); re-raise the first failure."""
    failure: BaseException | None = None
    for shared in servers:
        try:
            shared.stop()
        except BaseException as exc:  # noqa: BLE001 (an assertion of stop_and_check, or an interrupt)
            failure = failure or exc
    if failure is not None:
        raise failure


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile``, with each SHARED_SERVER_GROUPS group handed out as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class GroupedFiles(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _GROUP_OF.get(path.rsplit("/", 1)[-1], path)

    return GroupedFiles(config, log)


def _write_serial_files(config: pytest.Config, items: list[pytest.Item]) -> None:
    """SHMGATE_SERIAL_FILES_OUT names a file: write there the test files that hold a test marked serial,
    one a line (scripts/test.sh's second phase collects only those; every process of the first phase
    collects the same, so one of them writes it)."""
    out = os.environ.get("SHMGATE_SERIAL_FILES_OUT")
    worker = getattr(config, "workerinput", {}).get("workerid", "gw0")
    if not out or worker != "gw0":
        return
    files = sorted({str(item.path) for item in items if item.get_closest_marker("serial")})
    with open(out + ".tmp", "w") as f:
        f.write("".join(name + "\n" for name in files))
    os.replace(out + ".tmp", out)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """SHMGATE_COLLECT_ONLY names a file written by _write_serial_files: test files not listed there are not
    collected (importing all of them costs ~14 s of CPU a process)."""
    listed = os.environ.get("SHMGATE_COLLECT_ONLY")
    if not listed or not collection_path.name.startswith("test_") or collection_path.suffix != ".py":
        return None
    with open(listed) as f:
        return str(collection_path) not in f.read().splitlines() or None


@pytest.fixture(scope="module")
def checksum_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve("checksum", tmp_path_factory, "--workers", "2", "--max-batch-size", "8")


@pytest.fixture(scope="module")
def efficientnet_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _serve("efficientnet-lite0", tmp_path_factory)


@pytest.fixture(scope="module")
def spare_slot_server(tmp_path_factory: pytest.TempPathFactory) -> Server:
    """One worker (so its pid identifies it) and one frontend slot no process uses, for a test to attach to;
    shared by the files of its SHARED_SERVER_GROUPS group one after the other (a test that attaches detaches
    again; a check of a count compares deltas, or a total that must stay 0)."""
    return _SHARED[2].get(
        lambda: start_server(
            "checksum",
            tmp_path_factory.mktemp("serve"),
            *("--workers", "1", "--max-workers", "2", "--spare-frontend-slots", "1"),
        )
    )
