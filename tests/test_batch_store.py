"""The batch directory's storage and runner lock, without a server (tests/test_batch_api.py runs them in one)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

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
    import sqlite3

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
