"""Which model a gateway serves, said once and held to by every part: ``--served-model-name``, the model
card, the refusal of a worker started for another model, and the instances ``shmgate cleanup`` lists.

Real processes throughout: one ``shmgate serve`` for the module, a real ``python -m shmgate.worker`` that tries
to attach to it, and a real instance left behind by a SIGKILLed creator for ``cleanup --dry-run``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from shmgate.shared.errors import EXIT_CONFIG
from shmgate.shared.instance import Instance
from shmgate.shared.segment import SlotState, now_ns
from tests.serving import (
    Server,
    expected_checksum,
    free_port,
    image_request,
    noise_png,
    start_server,
    stop_and_check,
    wait_until,
)

SERVED = "team/checksum-v2"  # a slash on purpose: hub ids are org/name, and the card route must take them


@pytest.fixture(scope="module")
def named_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server("checksum", tmp_path_factory.mktemp("named"), "--workers", "1", "--served-model-name", SERVED)
    try:
        yield server
    finally:
        stop_and_check(server)


def test_clients_send_the_served_name_and_it_is_the_only_id(named_server: Server) -> None:
    url = named_server.base_url
    assert [card["id"] for card in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == [SERVED]
    # "created": when the node started serving, the same from every frontend (never 0)
    created = {httpx.get(url + "/v1/models/" + SERVED, timeout=10).json()["created"] for _ in range(6)}
    assert len(created) == 1 and time.time() - 3600 < created.pop() <= time.time(), created
    image = noise_png(3)
    ok = httpx.post(url + "/v1/chat/completions", json=image_request(SERVED, image), timeout=30)
    assert ok.status_code == 200, ok.text
    assert ok.json()["model"] == SERVED and expected_checksum(image) in ok.text
    other = httpx.post(url + "/v1/chat/completions", json=image_request("checksum", image), timeout=30)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert f"send {SERVED!r}" in other.json()["error"]["message"]  # the 404 says which id to send
    assert f'clients send "model": "{SERVED}"' in named_server.log_path.read_text()


def test_the_model_card_is_retrievable_by_id_and_another_id_is_an_openai_404(named_server: Server) -> None:
    url = named_server.base_url
    card = httpx.get(f"{url}/v1/models/{SERVED}", timeout=10)
    assert card.status_code == 200, card.text
    assert card.json() == httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
    missing = httpx.get(url + "/v1/models/checksum", timeout=10)
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    assert f"send {SERVED!r}" in error["message"]


def test_the_openai_client_retrieves_the_card_and_gets_not_found_for_another_id(named_server: Server) -> None:
    client = openai.OpenAI(base_url=named_server.base_url + "/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(SERVED).id == SERVED
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("checksum")


def test_a_worker_for_another_model_refuses_to_attach_naming_both(named_server: Server) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shmgate.worker",
            "--instance",
            named_server.instance_id,
            "--model",
            "checksum",
            "--device",
            "cpu",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == EXIT_CONFIG, done.stderr[-2000:]
    assert "'checksum'" in done.stderr and repr(SERVED) in done.stderr, done.stderr[-2000:]
    assert named_server.metric("shmgate_workers_ready") == 1  # the refused worker never counted
    wait_until(
        lambda: "a worker serving 'checksum' refused to attach" in named_server.log_path.read_text(),
        10,
        "the gateway's own log says a worker was refused",
    )


def test_the_gateway_warns_of_a_ready_worker_that_serves_another_model(named_server: Server) -> None:
    """A worker that does not check (another version, another container's image) is seen and named.

    The test plays that worker: it claims a slot and stamps the row as a worker's loop does.
    """
    instance = Instance.attach(named_server.instance_id)
    try:
        slot, _ = instance.claim_worker_slot("someone-elses-model")
        row = instance.segment.workers[slot]
        row["state"] = SlotState.READY
        deadline = time.monotonic() + 30
        while "serves 'someone-elses-model'" not in named_server.log_path.read_text():
            assert time.monotonic() < deadline, "the supervisor never warned"
            row["beat_ns"] = row["progress_ns"] = now_ns()
            time.sleep(0.1)
        row["state"] = SlotState.FREE
    finally:
        instance.close()
    assert f"not this gateway's {SERVED!r}" in named_server.log_path.read_text()


# serial: a dead instance of its own must survive until `shmgate cleanup` removes it, and that cleanup removes
# every dead instance on the machine (another test's too); a serve starting beside it would remove it first.
@pytest.mark.serial
def test_cleanup_lists_live_instances_and_a_dry_run_removes_nothing(named_server: Server, tmp_path: Path) -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "shmgate.gateway", "cleanup", "--list"], capture_output=True, text=True, timeout=60
    )
    assert listed.returncode == 0, listed.stderr
    line = next(line for line in listed.stdout.splitlines() if named_server.instance_id in line)
    assert f"pid={named_server.process.pid}" in line and f"model={SERVED}" in line and "label=default" in line
    # A dead instance: its creator was SIGKILLed, so nobody unlinked its objects.
    creator = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; from shared.instance import Instance; "
            "i = Instance.create(arena_size=8 << 20, n_frontends=1, n_workers=1, label='dead'); "
            "print(i.names.instance_id, flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert creator.stdout is not None and creator.stderr is not None
        dead_id = creator.stdout.readline().strip()
    finally:
        os.kill(creator.pid, signal.SIGKILL)
        creator.wait()
    # An empty id would match every name below (e.g. when the uid's queue budget is spent and the creator failed)
    assert re.fullmatch(r"[0-9a-f]{16}", dead_id), f"the creator made no instance: {creator.stderr.read()[-2000:]}"
    objects = {name for name in os.listdir("/dev/shm") if dead_id in name}
    assert objects
    dry = subprocess.run(
        [sys.executable, "-m", "shmgate.gateway", "cleanup", "--dry-run"], capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0, dry.stderr
    assert dead_id in dry.stdout and named_server.instance_id not in dry.stdout
    assert "would remove" in dry.stdout
    assert {name for name in os.listdir("/dev/shm") if dead_id in name} == objects  # nothing removed
    real = subprocess.run(
        [sys.executable, "-m", "shmgate.gateway", "cleanup"], capture_output=True, text=True, timeout=60
    )
    assert dead_id in real.stdout
    wait_until(lambda: not any(dead_id in name for name in os.listdir("/dev/shm")), 5, "cleanup removed it")
    assert httpx.get(named_server.base_url + "/ready", timeout=10).status_code == 200  # the live one is untouched


def test_a_missing_transformers_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    """A site-packages without transformers (every other entry linked in, the editable install's .pth
    mapping of shmgate included), so the import really fails."""
    site = Path(httpx.__file__).parent.parent
    without = tmp_path / "site"
    without.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith("transformers"):
            (without / entry.name).symlink_to(entry)
    model = tmp_path / "tiny-vlm"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2_vl"}')
    # -S: no site-packages of the environment; addsitedir reads the copy's .pth files (shmgate's mapping)
    start = f"import runpy, site, sys; site.addsitedir({str(without)!r}); sys.argv[0] = 'shmgate'; "
    done = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            start + "runpy.run_module('shmgate.node', run_name='__main__', alter_sys=True)",
            "serve",
            "--port",
            str(free_port()),
            "--model",
            f"hf:{model}",
            "--frontends",
            "2",
            "--workers",
            "1",
            "--arena-size",
            "64MiB",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "need transformers" in line]
    assert len(lines) == 1 and lines[0].endswith("pip install 'shmgate[hf]'"), done.stderr[-2000:]
    assert "started frontend" not in done.stderr


def test_the_supervisor_and_the_worker_name_the_same_worker_slot(named_server: Server) -> None:
    """The supervisor numbers the workers it starts ("worker process 0"); the worker claims a segment slot.
    The supervisor's log ties the two by pid, and the slot it names is the one the worker's own log gives."""
    import re

    def tied() -> re.Match[str] | None:
        return re.search(
            r"worker process 0 \(pid (\d+)\) is ready in worker slot (\d+)", named_server.log_path.read_text()
        )

    wait_until(lambda: tied() is not None, 10, "the supervisor logs which slot its worker got")
    match = tied()
    assert match is not None
    pid, slot = match.groups()
    log = named_server.log_path.read_text()
    assert f"started worker process 0 (pid {pid})" in log
    assert re.search(rf"worker\[{pid}\] INFO ready in worker slot {slot}: model checksum \(served as {SERVED}\)", log)
