"""The Batch API's store under disk faults, against a real ``shmgate serve``: a full disk (a small tmpfs under
``--batch-dir``) and a damaged store (a page overwritten, a database truncated to 0 bytes beside its files).

What must hold (docs/BATCH.md, "When the disk fails"): a full disk is a 507 ``insufficient_storage`` with
Retry-After, never a 500, and leaves no ``.part``; reads and deletes work on it; /ready's ``batches`` says
the store cannot write; once space returns the store writes again by itself and a batch that was running
finishes with every line exactly once. A damaged store is reported in one log line naming the path and
what is wrong, the Batch API refuses with 503 ``batch_store_damaged``, interactive requests are served,
and ``shmgate batches check`` says so until a backup is restored.

The full disk needs a tmpfs mount (root with CAP_SYS_ADMIN); without one the test is skipped and
tests/test_batch_store.py's EFBIG test covers the same write path in-process.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from shmgate.gateway.batch_faults import StoreFull, StoreUnavailable
from shmgate.gateway.batch_store import BatchStore, LineResult
from tests.serving import Server, image_request, noise_png, start_server, stop_and_check, wait_until

HANG_S = 120.0
TMPFS_BYTES = 8 << 20
LINES = 60


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _jsonl(ids: list[str], seed: int) -> bytes:
    lines = [
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": image_request("checksum", noise_png(seed + i, 24)),
        }
        for i, custom_id in enumerate(ids)
    ]
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _parts(batch_dir: Path) -> list[str]:
    return [p.name for p in (batch_dir / "files").iterdir() if p.name.endswith(".part")]


def _batches_health(server: Server) -> dict[str, str]:
    ready = httpx.get(server.base_url + "/ready", timeout=10)
    assert ready.status_code == 200, ready.text  # a store's state never makes the node unready
    health: dict[str, str] = ready.json()["batches"]
    return health


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A filesystem of TMPFS_BYTES, mounted for this test and unmounted after it."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the EFBIG test in test_batch_store.py runs instead)")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the EFBIG test covers the write path")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(path: Path) -> None:
    """Write ``path`` until the filesystem is full (another program's file filling the disk)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        chunk = b"\0" * (64 << 10)
        while True:
            try:
                os.write(fd, chunk)
            except OSError:
                if len(chunk) == 4096:
                    break
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(fd)


def test_a_full_disk_is_a_507_reads_and_deletes_work_and_the_batch_finishes_once_space_returns(tmpfs: Path) -> None:
    batch_dir = tmpfs / "batches"
    server = start_server(
        "checksum",
        tmpfs.parent,
        *("--batch-dir", str(batch_dir), "--workers", "1", "--max-batch-size", "1"),
        *("--diag-batch-delay-ms", "40", "--batch-max-in-flight", "1"),
    )
    try:
        client = _client(server)
        kept = client.files.create(file=("kept.jsonl", io.BytesIO(_jsonl(["k"], 1))), purpose="batch")
        spare = client.files.create(file=("spare.jsonl", io.BytesIO(b"x" * (300 << 10))), purpose="batch")
        ids = [f"line-{i}" for i in range(LINES)]
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(ids, 100))), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert _batches_health(server)["status"] == "ok"

        def done() -> int:
            counts = client.batches.retrieve(batch.id).request_counts
            return 0 if counts is None else counts.completed + counts.failed

        wait_until(lambda: done() >= 3, HANG_S, "a few lines done")
        filler = tmpfs / "filler"
        _fill(filler)  # the disk is full, the batch still running

        upload = httpx.post(
            server.base_url + "/v1/files",
            files={"file": ("big.jsonl", b"y" * (1 << 20))},
            data={"purpose": "batch"},
            timeout=30,
        )
        assert upload.status_code == 507, upload.text
        assert upload.json()["error"]["code"] == "insufficient_storage"
        assert int(upload.headers["retry-after"]) >= 1
        assert _parts(batch_dir) == []
        health = _batches_health(server)
        assert health["status"] == "full" and health["code"] == "insufficient_storage", health

        # reads work on the full disk, and so does a delete (it frees space)
        assert client.files.retrieve(kept.id).id == kept.id
        assert client.files.content(kept.id).content == _jsonl(["k"], 1)
        assert batch.id in [b.id for b in client.batches.list(limit=100).data]
        assert client.batches.retrieve(batch.id).status == "in_progress"
        assert client.files.delete(spare.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(spare.id)

        filler.unlink()  # space returns: the store writes again by itself
        wait_until(lambda: _batches_health(server)["status"] == "ok", HANG_S, "the store writable again")
        wait_until(lambda: client.batches.retrieve(batch.id).status == "completed", HANG_S, "the batch to finish")
        finished = client.batches.retrieve(batch.id)
        assert finished.request_counts is not None and finished.request_counts.completed == LINES
        assert finished.output_file_id is not None
        output = [json.loads(x) for x in client.files.content(finished.output_file_id).text.splitlines()]
        assert sorted(o["custom_id"] for o in output) == sorted(ids)  # each line once: none lost, none twice
        again = client.files.create(file=("again.jsonl", io.BytesIO(b"z" * (1 << 20))), purpose="batch")
        assert again.bytes == 1 << 20 and _parts(batch_dir) == []
        assert (batch_dir / "reserve").exists()  # put back for the next full disk
        log = server.log_path.read_text()
        assert "Traceback" not in log, log[-3000:]
    finally:
        with contextlib.suppress(FileNotFoundError):
            (tmpfs / "filler").unlink()
        stop_and_check(server)


def _build_store(batch_dir: Path) -> tuple[str, str]:
    """A store with files and a finished batch, written as a node would: (a file id, the batch id)."""
    store = BatchStore(batch_dir)
    files = [store.add_file(_jsonl([f"s{i}"], 500 + i), f"{i}.jsonl", "batch")["id"] for i in range(40)]
    batch = store.add_batch("/v1/chat/completions", files[0], 3600, None, {"checksum": 1})
    store.commit_line(batch["id"], LineResult(0, True, {"custom_id": "s0"}))
    for i in range(1, 30):  # enough pages that one in the middle holds rows
        store.commit_line(f"batch-other{i}", LineResult(0, True, {"custom_id": f"o{i}", "pad": "p" * 2000}))
    store.set_status(batch["id"], "completed")
    store.close()
    return files[3], batch["id"]


def _shmgate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmgate.node", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("damage", ["corrupted", "truncated"])
def test_a_damaged_store_is_reported_refused_and_restored_while_the_node_serves(tmp_path: Path, damage: str) -> None:
    batch_dir = tmp_path / "batches"
    file_id, batch_id = _build_store(batch_dir)
    backup = _shmgate("batches", "backup", "--batch-dir", str(batch_dir), str(tmp_path / "backup"))
    assert backup.returncode == 0 and "sound (40 files, 1 batches)" in backup.stdout, backup
    db = batch_dir / "batches.sqlite3"
    if damage == "truncated":
        db.write_bytes(b"")
        what = "is empty (0 bytes) but"
    else:
        page, size = 4096, db.stat().st_size
        with open(db, "r+b") as f:
            f.seek((size // page // 2) * page)
            f.write(random.Random(11).randbytes(page))
        what = "fails its integrity check"
    damaged = db.read_bytes()
    checked = _shmgate("batches", "check", "--batch-dir", str(batch_dir))
    assert checked.returncode == 1 and what in checked.stdout and str(db) in checked.stdout, checked

    server = start_server("checksum", tmp_path, "--batch-dir", str(batch_dir), "--workers", "1")
    try:
        chat = httpx.post(
            server.base_url + "/v1/chat/completions", json=image_request("checksum", noise_png(1, 24)), timeout=60
        )
        assert chat.status_code == 200, chat.text  # interactive traffic is served
        for method, path in (
            ("GET", "/v1/files"),
            ("GET", f"/v1/files/{file_id}"),
            ("GET", f"/v1/files/{file_id}/content"),
            ("DELETE", f"/v1/files/{file_id}"),
            ("GET", "/v1/batches"),
            ("GET", f"/v1/batches/{batch_id}"),
        ):
            refused = httpx.request(method, server.base_url + path, timeout=10)
            assert refused.status_code == 503, (path, refused.text)
            assert refused.json()["error"]["code"] == "batch_store_damaged", refused.text
        upload = httpx.post(
            server.base_url + "/v1/files", files={"file": ("x.jsonl", b"{}")}, data={"purpose": "batch"}, timeout=10
        )
        assert upload.status_code == 503 and upload.json()["error"]["code"] == "batch_store_damaged"
        assert _batches_health(server)["status"] == "damaged"
    finally:
        stop_and_check(server)
    lines = [line for line in server.log_path.read_text().splitlines() if "the Batch API refuses" in line]
    assert lines and all(str(db) in line and what in line for line in lines), lines  # one line per frontend
    assert db.read_bytes() == damaged  # never made over as an empty store

    # the operator restores the backup (the node stopped), and the store is whole again
    shutil.rmtree(batch_dir)
    shutil.copytree(tmp_path / "backup", batch_dir)
    assert _shmgate("batches", "check", "--batch-dir", str(batch_dir)).returncode == 0
    if damage != "truncated":
        return  # served again: once is enough
    server = start_server("checksum", tmp_path, "--batch-dir", str(batch_dir), "--workers", "1")
    try:
        client = _client(server)
        assert client.batches.retrieve(batch_id).status == "completed"
        assert client.files.content(file_id).content == (tmp_path / "backup" / "files" / file_id).read_bytes()
    finally:
        stop_and_check(server)


def test_a_store_opened_on_a_full_disk_is_not_taken_for_damaged_and_opens_once_space_returns(tmpfs: Path) -> None:
    """The check at open needs SQLite's WAL index (32 KiB), which a full disk cannot give: that is a full
    disk (507), not a finding about the store, and the store opens by itself at the next call with room."""
    directory = tmpfs / "batches"
    first = BatchStore(directory)
    kept = first.add_file(b"{}\n", "kept.jsonl", "batch")
    first.close()  # the last connection: the WAL and its index are gone
    assert not (directory / "batches.sqlite3-shm").exists()
    filler = tmpfs / "filler"
    _fill(filler)
    store = BatchStore(directory)
    assert store.damage is None
    assert store.health()["status"] == "full"
    with pytest.raises(StoreFull):
        store.files()
    filler.unlink()
    assert [f["id"] for f in store.files()] == [kept["id"]]
    assert store.health()["status"] == "ok" and store.damage is None
    store.close()


def test_a_disk_that_refuses_writes_is_a_503_and_the_store_writes_again_by_itself(tmpfs: Path) -> None:
    """``files/`` made read-only under the store (a read-only bind mount: what a filesystem remounted
    read-only after I/O errors answers): 503 with the store's code, nothing half-written; health says
    unavailable and finds by itself that writes work again once the mount is gone."""
    store = BatchStore(tmpfs / "batches")
    kept = store.add_file(b"{}\n", "kept.jsonl", "batch")
    files = tmpfs / "batches" / "files"
    subprocess.run(["mount", "--bind", str(files), str(files)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(files)], check=True)
        with pytest.raises(StoreUnavailable) as refused:
            store.add_file(b"[]\n", "new.jsonl", "batch")
        assert refused.value.status_hint == 503 and refused.value.code == "batch_store_unavailable"
        assert store.health()["status"] == "unavailable"
        assert [f["id"] for f in store.files()] == [kept["id"]]  # reads work; the refused upload left nothing
    finally:
        subprocess.run(["umount", str(files)], check=True)
    wait_until(lambda: store.health()["status"] == "ok", HANG_S, "the store writable again")
    assert _parts(tmpfs / "batches") == []
    assert store.add_file(b"[]\n", "new.jsonl", "batch")["bytes"] == 3
    store.close()
