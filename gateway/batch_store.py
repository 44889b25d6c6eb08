"""The Batch API's storage: uploaded files on disk, files' and batches' state and each line's result in SQLite.

Every frontend process opens the same directory (``--batch-dir``): the database is the standard
library's SQLite in WAL mode with a busy timeout, so the processes read and write it side by side,
and each operation opens its own short connection (a frontend's threads and the runner never share
one). A line's result is committed once: its primary key is (batch id, line index) and a second
commit of the same line is ignored, so a runner that restarts after a crash skips the lines whose
result is already stored and never writes one twice.

Layout of the directory (created 0700): ``batches.sqlite3`` (+ its WAL), ``files/<file id>`` the
files' bytes (``files/<file id>.<pid>.part`` while one is written), ``runner.lock`` the lock whose holder
runs the batches (gateway/batch_runner.py), ``reserve`` the space kept for deletes on a full disk.

A store users can trust with their files (docs/BATCH.md, "When the disk fails"):

- Checked when opened (gateway/batch_check.py): a damaged directory (a database that fails SQLite's
  check, an empty one beside stored files, rows and files that disagree) is reported in one log line
  naming the path and what is wrong, and every call refuses (``StoreDamaged``, 503) until the
  operator restores it: never served as an empty store. The frontend serves everything else.
- Disk failures are errors with a status, never a 500 (gateway/batch_faults.py): no space is 507
  ``insufficient_storage``, an I/O error 503; a file is written to ``.part``, synced and renamed, and
  its row committed after, so a failure leaves neither half a file nor a row without its bytes (a
  ``.part`` left by a crash is removed when a frontend next opens the store).
- Reads and deletes work on a full disk: each frontend keeps one idle connection open, so the WAL's
  index (which SQLite would otherwise create, 32 KiB, at the next open) stays; a delete that finds no
  room for its WAL frames frees the reserve (``RESERVE_BYTES``) and goes again. The reserve is put back
  once space returns, and the store writes again by itself: nothing to restart.
- ``health()`` says whether the store can write now (/ready reports it; the runner waits while it cannot).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shmgate.gateway.batch_check import DB_NAME, FILES_DIR, PART_SUFFIX, check_store, is_part_file
from shmgate.gateway.batch_faults import LOW_SPACE_BYTES, StoreDamaged, StoreFull, StoreUnavailable, fault_of
from shmgate.shared.errors import ShmgateError

__all__ = ["TERMINAL", "BatchStore", "LineResult", "default_batch_dir", "new_id"]

log = logging.getLogger("shmgate.batch")

RESERVE_NAME = "reserve"
RESERVE_BYTES = 256 << 10  # room for the WAL frames of many deletes (a few 4 KiB pages each)
FULL_BELOW_BYTES = 256 << 10  # less free space than this: the store cannot write (health); a write may still fail above
HEALTH_TTL_S = 0.25  # how long a look at the filesystem's free space is reused (the runner asks per turn)

# statuses after which nothing changes any more
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    times TEXT NOT NULL DEFAULT '{}',
    metadata TEXT,
    errors TEXT,
    output_file_id TEXT,
    error_file_id TEXT,
    total INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS batch_models (
    batch_id TEXT NOT NULL,
    model TEXT NOT NULL,
    total INTEGER NOT NULL,
    PRIMARY KEY (batch_id, model)
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    model TEXT NOT NULL DEFAULT '',
    ok INTEGER NOT NULL,
    result TEXT NOT NULL,
    PRIMARY KEY (batch_id, idx)
);
"""


def default_batch_dir(port: int) -> str:
    """A per-user, per-port directory: ``$XDG_STATE_HOME/shmgate/batches/port-PORT``, else
    ``~/.local/state/shmgate/batches/port-PORT``. Per port because the runner sends a batch's lines to
    the node's own port: two servers of one user on two ports must not run each other's batches, and a
    server restarted on its port finds its own again."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "shmgate", "batches", f"port-{port}")


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


@dataclass(frozen=True)
class LineResult:
    """One line's outcome: ``ok`` lines go to the output file, the others to the error file."""

    index: int
    ok: bool
    record: dict[str, Any]  # the output or error file's line: id, custom_id, response, error
    model: str = ""  # the model its body named (for /metrics)


WAL_TRIES_S = 10.0  # how long a frontend starting beside another retries the switch to WAL mode


def _to_wal(db: sqlite3.Connection) -> None:
    """Switch a database to WAL mode. Two frontends doing it at once on a new file: the switch needs the
    database alone and answers "database is locked" at once (the busy timeout does not cover it), so the
    second one tries again."""
    deadline = time.monotonic() + WAL_TRIES_S
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


class BatchStore:
    """One batch directory, opened by every frontend of the node."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        """Open (or make) the store in ``directory``; a damaged one opens refusing every call (``damage``).
        Raises OSError when the directory cannot be made or read (permissions, not a directory)."""
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.files_dir = self.dir / FILES_DIR
        self.files_dir.mkdir(mode=0o700, exist_ok=True)
        self.db_path = self.dir / DB_NAME
        self.lock_path = self.dir / "runner.lock"
        self.reserve_path = self.dir / RESERVE_NAME
        self.damage: str | None = None  # what is wrong, in one line naming the path; None: sound
        self._keeper: sqlite3.Connection | None = None
        self._opened = False
        self._open_lock = threading.Lock()
        self._health: tuple[float, dict[str, str]] = (0.0, {})
        self._unavailable: str | None = None  # the last I/O failure's message, until a write succeeds
        self._failing: ShmgateError | None = None  # the fault writes met since the last one that worked
        self._checked = False
        try:
            self._open()
        except (StoreFull, StoreUnavailable) as exc:  # a full or failing disk: opened when it can be (``_db``)
            log.warning("batch store %s: not opened yet: %s", self.dir, exc.message)

    def _damaged(self, what: str) -> None:
        """From now on every call refuses: logged once, in one line naming the path and what is wrong."""
        if self.damage is None:
            self.damage = what
            log.error(
                "batch store %s is damaged: %s; the Batch API refuses every call until the operator restores it "
                "(shmgate batches check --batch-dir %s; docs/BATCH.md); other endpoints are served",
                self.dir,
                what,
                self.dir,
            )

    def _open(self) -> None:
        """Check the store (once), make the tables (once per directory), keep the idle connection, put the
        reserve in place. A damaged store stays closed (``damage``); a full or failing disk raises."""
        with self._open_lock:
            if self._opened or self.damage is not None:
                return
            if not self._checked:
                try:
                    report = check_store(self.dir)
                except (OSError, sqlite3.Error) as exc:
                    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.ENOTDIR):
                        raise  # the directory itself: a configuration error (an explicit --batch-dir stops)
                    raise self._fault(exc) from exc
                self._checked = True
                if not report.sound:
                    self._damaged("; ".join(report.problems))
                    return
                for note in report.notes:
                    log.warning("batch store %s: %s", self.dir, note)
                self._remove_stale_parts()
            try:
                db = sqlite3.connect(self.db_path, timeout=30.0, isolation_level=None)
                try:  # every frontend runs this at start: WAL mode is kept in the file, the tables are made once
                    db.execute("PRAGMA busy_timeout=30000")
                    _to_wal(db)
                    db.executescript(_SCHEMA)
                    columns = {row[1] for row in db.execute("PRAGMA table_info(lines)")}
                    if "model" not in columns:  # a directory of the first version, before lines named their model
                        with contextlib.suppress(sqlite3.OperationalError):  # another frontend added it meanwhile
                            db.execute("ALTER TABLE lines ADD COLUMN model TEXT NOT NULL DEFAULT ''")
                finally:
                    db.close()
                keeper = sqlite3.connect(self.db_path, timeout=30.0, isolation_level=None, check_same_thread=False)
                keeper.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # maps the WAL index: it stays
            except (OSError, sqlite3.Error) as exc:
                raise self._fault(exc) from exc
            self._keeper = keeper
            self._opened = True
        self._restock()

    def close(self) -> None:
        """Close the idle connection (the process's last connection then checkpoints the WAL)."""
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None

    # faults and health

    def free_bytes(self) -> int | None:
        """The space left on the store's filesystem for this user (None: it cannot be read)."""
        try:
            stat = os.statvfs(self.dir)
        except OSError:
            return None
        return stat.f_bavail * stat.f_frsize

    def _fault(self, exc: BaseException) -> ShmgateError:
        """The store error for ``exc`` (gateway/batch_faults.py), noted for ``health``; ``exc`` itself when it
        is no storage failure (a bug)."""
        fault = fault_of(exc, self.free_bytes())
        if fault is None:
            raise exc
        if isinstance(fault, StoreDamaged):
            self._damaged(f"{self.db_path}: {exc}")
        else:
            if self._failing is None:  # one line when writes start failing, one when they work again
                log.warning("batch store %s: %r: calls that write get %d", self.dir, exc, fault.status_hint)
            self._failing = fault
            if isinstance(fault, StoreUnavailable):
                self._unavailable = fault.message
        self._health = (0.0, {})
        return fault

    def _check_open(self) -> None:
        if not self._opened:
            self._open()
        if self.damage is not None:
            raise StoreDamaged()

    def health(self) -> dict[str, str]:
        """Can the store write now: ``{"status": "ok"}``, or ``full``, ``unavailable``, ``damaged`` with the
        error's ``code`` and ``message`` (/ready reports it; the runner waits while it is not ok)."""
        if self.damage is not None:
            fault: ShmgateError | None = StoreDamaged()
        else:
            at, health = self._health
            if health and time.monotonic() - at < HEALTH_TTL_S:
                return health
            free = self.free_bytes()
            if free is not None and free < FULL_BELOW_BYTES:
                fault = StoreFull()
            elif self._unavailable is not None and not self._probe():
                fault = StoreUnavailable(self._unavailable)
            else:
                fault = None
                self._restock()
        if fault is None:
            health = {"status": "ok"}
        else:
            status = {StoreFull: "full", StoreUnavailable: "unavailable"}.get(type(fault), "damaged")
            health = {"status": status, "code": fault.code, "message": fault.message}
        self._health = (time.monotonic(), health)
        return health

    def _probe(self) -> bool:
        """After an I/O failure: does the disk take a write again (a small file written, synced, removed) and
        does the store open? Nobody else may write meanwhile (the runner waits), so health looks itself."""
        probe = self._part_path("probe")  # where files are written; a crash leaves a .part the next open removes
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, b"\0" * 4096)
                os.fsync(fd)
            finally:
                os.close(fd)
                with contextlib.suppress(OSError):
                    probe.unlink()
            self._check_open()
        except (OSError, ShmgateError):
            return False
        log.warning("batch store %s: writes work again", self.dir)
        self._failing = self._unavailable = None
        return True

    def writable(self) -> bool:
        return self.health()["status"] == "ok"

    def _restock(self) -> None:
        """Put the reserve back when it is gone (freed for a delete) and there is room for it again."""
        if self.reserve_path.exists():
            return
        free = self.free_bytes()
        if free is None or free < RESERVE_BYTES + LOW_SPACE_BYTES:
            return
        try:
            fd = os.open(self.reserve_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:  # another frontend made it meanwhile, or the disk refuses: the next look tries again
            return
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        except OSError:
            with contextlib.suppress(OSError):
                self.reserve_path.unlink()
        finally:
            os.close(fd)

    def _free_reserve(self) -> bool:
        """Give the reserve's space back (a delete needs it); False when there was none."""
        try:
            self.reserve_path.unlink()
        except FileNotFoundError:
            return False
        log.warning("batch store %s: the disk is full; its reserve was freed for a delete", self.dir)
        return True

    def _remove_stale_parts(self) -> None:
        """Remove the ``.part`` files of writers that are gone (a crash mid-upload): their bytes are not a file."""
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.files_dir):
                if is_part_file(entry.name) and not _writer_alive(entry.name):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                    log.warning("batch store %s: removed %s, left by an upload cut short", self.dir, entry.name)

    @contextlib.contextmanager
    def _db(self, write: bool = True) -> Iterator[sqlite3.Connection]:
        """A short connection: committed when the block ends without an error, closed in every case. A
        reader (``write`` False) takes no write lock: WAL lets it read beside the writer. A storage failure
        comes out as the store's error (gateway/batch_faults.py)."""
        self._check_open()
        try:
            db = sqlite3.connect(self.db_path, timeout=30.0, isolation_level=None)
        except sqlite3.Error as exc:
            raise self._fault(exc) from exc
        db.row_factory = sqlite3.Row
        try:
            db.execute("PRAGMA busy_timeout=30000")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield db
            except BaseException:
                with contextlib.suppress(sqlite3.Error):  # a failed write may have rolled back already
                    db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            raise self._fault(exc) from exc
        finally:
            db.close()
        if write and self._failing is not None:  # the disk took a write again
            log.warning("batch store %s: writes work again", self.dir)
            self._failing = self._unavailable = None
            self._health = (0.0, {})

    # files

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def _part_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.{os.getpid()}{PART_SUFFIX}"

    def add_file(self, data: bytes, filename: str, purpose: str, file_id: str | None = None) -> dict[str, Any]:
        """Store ``data`` (written and synced before its row exists); ``file_id`` given: replace that file.

        A failure leaves no ``.part`` and no row without its bytes: a new file whose row cannot be
        committed is removed again (StoreFull, StoreUnavailable)."""
        self._check_open()
        new = file_id is None
        file_id = file_id or new_id("file")
        path = self.file_path(file_id)
        tmp = self._part_path(file_id)
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
            _sync_dir(self.files_dir)
        except OSError as exc:
            raise self._fault(exc) from exc
        try:
            with self._db() as db:
                db.execute(
                    "INSERT OR REPLACE INTO files (id, filename, purpose, bytes, created_at) VALUES (?, ?, ?, ?, ?)",
                    (file_id, filename, purpose, len(data), int(time.time())),
                )
        except BaseException:
            if new:
                with contextlib.suppress(OSError):
                    path.unlink()
            raise
        return self.file(file_id) or {}

    def file(self, file_id: str) -> dict[str, Any] | None:
        with self._db(write=False) as db:
            row = db.execute("SELECT * FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else _file_object(row)

    def read_file(self, file_id: str) -> bytes | None:
        """A stored file's bytes; None when it has no row or its bytes are gone (deleted meanwhile)."""
        if self.file(file_id) is None:
            return None
        try:
            return self.file_path(file_id).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._fault(exc) from exc

    def files(self, purpose: str | None = None) -> list[dict[str, Any]]:
        with self._db(write=False) as db:
            if purpose:
                rows = db.execute("SELECT * FROM files WHERE purpose = ? ORDER BY created_at DESC", (purpose,))
            else:
                rows = db.execute("SELECT * FROM files ORDER BY created_at DESC")
            return [_file_object(r) for r in rows.fetchall()]

    def delete_file(self, file_id: str) -> bool:
        """Remove a file's row, then its bytes. On a full disk the row's removal may find no room for its WAL
        frames: the reserve is freed and it goes again, so deleting is how space is freed."""
        try:
            gone = self._delete_row(file_id)
        except StoreFull:
            if not self._free_reserve():
                raise
            gone = self._delete_row(file_id)
        if gone:
            try:
                self.file_path(file_id).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:  # the row is gone: its bytes are an orphan the check notes, not damage
                log.warning("batch store %s: the bytes of deleted file %s stay: %r", self.dir, file_id, exc)
            self._health = (0.0, {})
        return gone

    def _delete_row(self, file_id: str) -> bool:
        with self._db() as db:
            return bool(db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0)

    # batches

    def add_batch(
        self,
        endpoint: str,
        input_file_id: str,
        window_s: int,
        metadata: dict[str, str] | None,
        models: dict[str, int],
    ) -> dict[str, Any]:
        """A new batch of ``sum(models.values())`` lines, ``models`` counting them by the model they name."""
        total = sum(models.values())
        batch_id = new_id("batch")
        now = int(time.time())
        with self._db() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            db.execute(
                "INSERT INTO batches (id, seq, endpoint, input_file_id, completion_window, status, created_at,"
                " expires_at, times, metadata, total) VALUES (?, ?, ?, ?, '24h', 'in_progress', ?, ?, ?, ?, ?)",
                (
                    batch_id,
                    seq,
                    endpoint,
                    input_file_id,
                    now,
                    now + window_s,
                    json.dumps({"in_progress_at": now}),
                    None if metadata is None else json.dumps(metadata),
                    total,
                ),
            )
            db.executemany(
                "INSERT INTO batch_models (batch_id, model, total) VALUES (?, ?, ?)",
                [(batch_id, model, n) for model, n in models.items()],
            )
        batch = self.batch(batch_id)
        assert batch is not None
        return batch

    def batch(self, batch_id: str) -> dict[str, Any] | None:
        with self._db(write=False) as db:
            row = db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
            return None if row is None else _batch_object(db, row)

    def batches(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Newest first, from just after batch ``after``; and whether more follow."""
        with self._db(write=False) as db:
            start = None
            if after is not None:
                found = db.execute("SELECT seq FROM batches WHERE id = ?", (after,)).fetchone()
                start = found[0] if found is not None else None
            if start is None:
                rows = db.execute("SELECT * FROM batches ORDER BY seq DESC LIMIT ?", (limit + 1,)).fetchall()
            else:
                rows = db.execute(
                    "SELECT * FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?", (start, limit + 1)
                ).fetchall()
            return [_batch_object(db, r) for r in rows[:limit]], len(rows) > limit

    def unfinished(self) -> list[dict[str, Any]]:
        """The batches a runner has work for, oldest first."""
        with self._db(write=False) as db:
            rows = db.execute(
                "SELECT * FROM batches WHERE status IN ('in_progress', 'cancelling', 'finalizing') ORDER BY seq"
            ).fetchall()
            return [_batch_object(db, r) for r in rows]

    def set_status(self, batch_id: str, status: str, *, only_from: tuple[str, ...] = (), **fields: Any) -> bool:
        """Move a batch to ``status`` (stamping ``<status>_at``), only from ``only_from`` when given."""
        now = int(time.time())
        with self._db() as db:
            row = db.execute("SELECT status, times FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None or (only_from and row["status"] not in only_from):
                return False
            times = json.loads(row["times"])
            times[f"{status}_at"] = now
            sets = ["status = ?", "times = ?"]
            values: list[Any] = [status, json.dumps(times)]
            for name, value in fields.items():
                sets.append(f"{name} = ?")
                values.append(json.dumps(value) if name == "errors" else value)
            db.execute(f"UPDATE batches SET {', '.join(sets)} WHERE id = ?", (*values, batch_id))
        return True

    # lines

    def commit_line(self, batch_id: str, result: LineResult) -> None:
        """Store a line's result; a second result for the same line is ignored (the first one stands)."""
        self.commit_lines([(batch_id, result)])

    def commit_lines(self, results: Sequence[tuple[str, LineResult]]) -> None:
        """Store lines' results (batch id, result) in one transaction, each as ``commit_line`` does.

        Why in groups: a connection's commit and close (a WAL checkpoint when it was the last one) cost
        ~17 ms of wall time here, which a line committed alone spent holding its place in flight.
        """
        with self._db() as db:
            db.executemany(
                "INSERT OR IGNORE INTO lines (batch_id, idx, model, ok, result) VALUES (?, ?, ?, ?, ?)",
                [
                    (batch_id, r.index, r.model, int(r.ok), json.dumps(r.record, separators=(",", ":")))
                    for batch_id, r in results
                ],
            )

    def done_lines(self, batch_id: str) -> set[int]:
        with self._db(write=False) as db:
            return {r[0] for r in db.execute("SELECT idx FROM lines WHERE batch_id = ?", (batch_id,))}

    def line_counts(self) -> dict[str, tuple[int, int, int]]:
        """Per model: (lines waiting in unfinished batches, lines done, lines failed), every batch's."""
        counts: dict[str, list[int]] = {}
        with self._db(write=False) as db:
            for model, total in db.execute(
                "SELECT m.model, SUM(m.total) FROM batch_models m JOIN batches b ON b.id = m.batch_id"
                " WHERE b.status IN ('in_progress', 'cancelling', 'finalizing', 'validating') GROUP BY m.model"
            ):
                counts.setdefault(model, [0, 0, 0])[0] += total
            for model, n in db.execute(
                "SELECT l.model, COUNT(*) FROM lines l JOIN batches b ON b.id = l.batch_id"
                " WHERE b.status IN ('in_progress', 'cancelling', 'finalizing', 'validating') GROUP BY l.model"
            ):
                counts.setdefault(model, [0, 0, 0])[0] -= n
            for model, ok, n in db.execute("SELECT model, ok, COUNT(*) FROM lines GROUP BY model, ok"):
                counts.setdefault(model, [0, 0, 0])[1 if ok else 2] += n
        return {model: (max(0, c[0]), c[1], c[2]) for model, c in counts.items()}

    def results(self, batch_id: str, ok: bool) -> list[str]:
        """The stored lines of one kind, in input order, as JSON text."""
        with self._db(write=False) as db:
            rows = db.execute(
                "SELECT result FROM lines WHERE batch_id = ? AND ok = ? ORDER BY idx", (batch_id, int(ok))
            ).fetchall()
        return [r[0] for r in rows]


def _writer_alive(part_name: str) -> bool:
    """Is the process writing ``<file id>.<pid>.part`` alive (and not this one, which writes none yet)?"""
    pid_text = part_name[: -len(PART_SUFFIX)].rpartition(".")[2]
    if not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a crash after the row's commit must not lose the file's name)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # a filesystem that cannot sync a directory: nothing to do
            raise
    finally:
        os.close(fd)


def _file_object(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def _batch_object(db: sqlite3.Connection, row: sqlite3.Row) -> dict[str, Any]:
    counts = dict(db.execute("SELECT ok, COUNT(*) FROM lines WHERE batch_id = ? GROUP BY ok", (row["id"],)).fetchall())
    times = json.loads(row["times"])
    batch: dict[str, Any] = {
        "id": row["id"],
        "object": "batch",
        "endpoint": row["endpoint"],
        "errors": None if row["errors"] is None else json.loads(row["errors"]),
        "input_file_id": row["input_file_id"],
        "completion_window": row["completion_window"],
        "status": row["status"],
        "output_file_id": row["output_file_id"],
        "error_file_id": row["error_file_id"],
        "created_at": row["created_at"],
        "expires_at": row["expires_at"],
        "metadata": None if row["metadata"] is None else json.loads(row["metadata"]),
        "request_counts": {
            "total": row["total"],
            "completed": counts.get(1, 0),
            "failed": counts.get(0, 0),
        },
    }
    for name in (
        "in_progress_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
    ):
        batch[name] = times.get(name)
    return batch
