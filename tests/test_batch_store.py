"""The batch directory's storage and runner lock, without a server (tests/test_batch_api.py runs them in one)."""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from shmgate.gateway.batch_check import backup_store, check_store
from shmgate.gateway.batch_faults import StoreDamaged, StoreFull, StoreUnavailable, fault_of
from shmgate.gateway.batch_runner import BatchRunner
from shmgate.gateway.batch_store import BatchStore, LineResult


def test_a_line_result_is_committed_once_and_every_opener_sees_it(tmp_path: Path) -> None:
    one = BatchStore(tmp_path / "b")
    assert stat.S_IMODE(os.stat(tmp_path / "b").st_mode) == 0o700
    file = one.add_file(b"{}\n", "in.jsonl", "batch")
    batch = one.add_batch("/v1/chat/completions", file["id"], 3600, None, {"m": 2})
    assert one.line_counts() == {"m": (2, 0, 0)}
    one.commit_line(batch["id"], LineResult(0, True, {"custom_id": "a", "first": True}, "m"))
    other = BatchStore(tmp_path / "b")  # another frontend process opens the same directory
    other.commit_line(batch["id"], LineResult(0, False, {"custom_id": "a", "first": False}))
    assert [json.loads(r) for r in other.results(batch["id"], ok=True)] == [{"custom_id": "a", "first": True}]
    assert other.results(batch["id"], ok=False) == []
    assert one.done_lines(batch["id"]) == {0}
    assert one.line_counts() == {"m": (1, 1, 0)}
    assert other.batch(batch["id"])["request_counts"] == {"total": 2, "completed": 1, "failed": 0}  # type: ignore[index]


def test_one_runner_holds_the_lock_until_it_lets_go(tmp_path: Path) -> None:
    store = BatchStore(tmp_path)
    first = BatchRunner(store, None, 1)  # type: ignore[arg-type]  # the lock needs no serving state
    second = BatchRunner(store, None, 1)  # type: ignore[arg-type]
    assert first._try_lock()
    assert not second._try_lock()
    assert first._lock_fd is not None
    os.close(first._lock_fd)  # what the kernel does when the holder dies
    assert second._try_lock()


def test_a_directory_of_the_first_schema_gains_the_model_column(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "batches.sqlite3")
    db.execute(
        "CREATE TABLE lines (batch_id TEXT NOT NULL, idx INTEGER NOT NULL, ok INTEGER NOT NULL,"
        " result TEXT NOT NULL, PRIMARY KEY (batch_id, idx))"
    )
    db.commit()
    db.close()
    store = BatchStore(tmp_path)
    assert store.line_counts() == {}
    store.commit_line("batch-x", LineResult(0, True, {}, "m"))
    assert store.line_counts() == {"m": (0, 1, 0)}


# -- a damaged store, half-written files, a full disk (tests/test_batch_faults.py: through a real serve) ------


def _filled_store(directory: Path, n: int = 40) -> tuple[BatchStore, list[str]]:
    """A store of ``n`` files and a batch with a result per file (enough rows for many pages), closed."""
    store = BatchStore(directory)
    ids = [store.add_file(os.urandom(64) + b"\n", f"{i}.jsonl", "batch")["id"] for i in range(n)]
    batch = store.add_batch("/v1/chat/completions", ids[0], 3600, {"k": "v"}, {"m": n})
    store.commit_lines([(batch["id"], LineResult(i, True, {"custom_id": f"c{i}", "pad": "x" * 300})) for i in range(n)])
    store.close()
    return store, ids


def _overwrite_middle_page(db_path: Path) -> None:
    """Random bytes over one page in the middle of the database, as a failing disk or a stray write leaves it."""
    import random

    page = 4096
    pages = db_path.stat().st_size // page
    assert pages >= 8, pages
    with open(db_path, "r+b") as f:
        f.seek((pages // 2) * page)
        f.write(random.Random(7).randbytes(page))


@pytest.mark.parametrize("damage", ["corrupted", "truncated", "cut_in_half", "bytes_missing", "resized"])
def test_a_damaged_store_refuses_every_call_and_is_never_served_as_an_empty_one(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "b"
    _, ids = _filled_store(directory)
    db_path = directory / "batches.sqlite3"
    assert not (directory / "batches.sqlite3-wal").exists()  # the last connection checkpointed it
    expected = {
        "corrupted": "batches.sqlite3",
        "truncated": "is empty (0 bytes) but",
        "cut_in_half": "fails its integrity check",
        "bytes_missing": "files' bytes are missing",
        "resized": "differ in size from their rows",
    }[damage]
    if damage == "corrupted":
        _overwrite_middle_page(db_path)
    elif damage == "truncated":
        db_path.write_bytes(b"")
    elif damage == "cut_in_half":
        os.truncate(db_path, db_path.stat().st_size // 2)
    elif damage == "bytes_missing":
        (directory / "files" / ids[3]).unlink()
    else:
        (directory / "files" / ids[5]).write_bytes(b"{}\n")
    before = db_path.read_bytes()
    report = check_store(directory)
    assert not report.sound and expected in report.line() and str(directory) in report.line(), report.line()
    with caplog.at_level("ERROR", logger="shmgate.batch"):
        store = BatchStore(directory)
    assert store.damage is not None and expected in store.damage
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(logged) == 1 and str(directory) in logged[0] and expected in logged[0], logged
    for call in (
        lambda: store.files(),
        lambda: store.file(ids[0]),
        lambda: store.batches(None, 10),
        lambda: store.add_file(b"{}\n", "x.jsonl", "batch"),
        lambda: store.delete_file(ids[1]),
        lambda: store.read_file(ids[1]),
    ):
        with pytest.raises(StoreDamaged):
            call()
    assert store.health()["status"] == "damaged"
    assert db_path.read_bytes() == before  # nothing was made over it (a truncated one stays 0 bytes)


def test_a_file_without_a_row_is_a_note_not_damage(tmp_path: Path) -> None:
    directory = tmp_path / "b"
    _filled_store(directory, n=3)
    (directory / "files" / "file-orphan").write_bytes(b"left by a crash between the file and its row")
    report = check_store(directory)
    assert report.sound and "1 files in" in report.line() and "file-orphan" in report.line()
    assert BatchStore(directory).damage is None
    assert (directory / "files" / "file-orphan").exists()  # nothing deleted on the strength of it


def test_a_part_file_of_a_dead_writer_is_removed_at_open_and_a_live_ones_kept(tmp_path: Path) -> None:
    directory = tmp_path / "b"
    BatchStore(directory).close()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = directory / "files" / f"file-a.{int(dead.stdout)}.part"
    old_style = directory / "files" / "file-b.part"
    live = directory / "files" / f"file-c.{os.getppid()}.part"
    for part in (stale, old_style, live):
        part.write_bytes(b"half an upload")
    BatchStore(directory)
    assert not stale.exists() and not old_style.exists()
    assert live.exists()


_EFBIG_CHILD = """
import os, resource, signal, sys
from shmgate.gateway.batch_store import BatchStore
from shmgate.gateway.batch_faults import StoreFull
store = BatchStore(sys.argv[1])
kept = store.add_file(b"{}\\n", "small.jsonl", "batch")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
try:
    store.add_file(b"x" * (2 << 20), "big.jsonl", "batch")
except StoreFull as exc:
    print("refused", exc.status_hint, exc.code)
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
print("files", len(store.files()), "kept", store.read_file(kept["id"]) == b"{}\\n")
print("after", store.add_file(b"x" * (2 << 20), "big.jsonl", "batch")["bytes"])
"""


def test_a_write_past_the_file_size_limit_is_a_507_and_leaves_no_part_or_row(tmp_path: Path) -> None:
    """EFBIG (RLIMIT_FSIZE), in a child process of its own: the same path as a full disk without a mount."""
    directory = tmp_path / "b"
    done = subprocess.run([sys.executable, "-c", _EFBIG_CHILD, str(directory)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["refused 507 insufficient_storage", "files 1 kept True", f"after {2 << 20}"]
    assert not [p for p in (directory / "files").iterdir() if p.name.endswith(".part")]


def test_storage_failures_are_errors_with_a_status(tmp_path: Path) -> None:
    assert isinstance(fault_of(OSError(errno.ENOSPC, "full"), None), StoreFull)
    assert isinstance(fault_of(OSError(errno.EDQUOT, "quota"), None), StoreFull)
    unavailable = fault_of(OSError(errno.EIO, "I/O error"), 10 << 30)
    assert isinstance(unavailable, StoreUnavailable) and unavailable.status_hint == 503
    assert StoreFull().status_hint == 507 and StoreDamaged().code == "batch_store_damaged"
    assert fault_of(ValueError("a bug"), None) is None
    store = BatchStore(tmp_path / "b")
    with pytest.raises(sqlite3.OperationalError) as caught:
        with store._db() as db:
            db.execute("SELECT * FROM no_such_table")
    assert fault_of(caught.value, 10 << 30) is None  # a statement SQLite refuses is a bug: it surfaces as one


def test_a_backup_of_a_live_store_is_consistent_and_restores(tmp_path: Path) -> None:
    directory = tmp_path / "b"
    store, ids = _filled_store(directory, n=5)
    live = BatchStore(directory)  # a frontend holds it open meanwhile
    report = backup_store(directory, tmp_path / "copy")
    assert report.sound and report.files == 5 and report.batches == 1, report.line()
    (directory / "batches.sqlite3").write_bytes(b"")  # the original is lost
    assert not check_store(directory).sound
    live.close()
    restored = BatchStore(tmp_path / "copy")
    assert sorted(f["id"] for f in restored.files()) == sorted(ids)
    assert restored.read_file(ids[2]) == (directory / "files" / ids[2]).read_bytes()


def test_a_page_found_damaged_while_serving_makes_the_store_refuse_from_then_on(tmp_path: Path) -> None:
    """The check at open passed; then a leaf page of the lines' table is overwritten (a disk failing under a
    running node): the first call that reads it refuses, and so does every call after it."""
    import random

    directory = tmp_path / "b"
    _filled_store(directory)
    store = BatchStore(directory)
    assert store.damage is None
    batch_id = store.batches(None, 1)[0][0]["id"]
    db = sqlite3.connect(directory / "batches.sqlite3")
    page = db.execute("SELECT pageno FROM dbstat WHERE name = 'lines' AND pagetype = 'leaf' LIMIT 1").fetchone()[0]
    db.close()
    with open(directory / "batches.sqlite3", "r+b") as f:
        f.seek((page - 1) * 4096)
        f.write(random.Random(3).randbytes(4096))
    with pytest.raises(StoreDamaged):
        store.results(batch_id, ok=True)
    assert store.damage is not None and "batches.sqlite3" in store.damage
    with pytest.raises(StoreDamaged):
        store.files()
    assert store.health()["status"] == "damaged"
