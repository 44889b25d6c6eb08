"""The batch store's check and backup: is a batch directory sound, and a consistent copy of it.

Every frontend checks its batch directory when it opens it (gateway/batch_store.py), and an operator
runs the same check with ``shmgate batches check`` (node/cli.py). A directory is damaged when:

- its database is missing or empty (0 bytes) while ``files/`` holds files: the index of every file
  and batch is lost, though their bytes are there (a truncated copy, a deleted database);
- the database is not a SQLite database, or fails SQLite's ``PRAGMA quick_check`` (a page overwritten);
- its rows and files disagree: a file's row whose bytes are missing, or whose size differs.

Each problem is one line naming the path and what is wrong. A file on disk without a row is no damage
(an upload or a delete cut short by a crash leaves one; so does a database restored from an older
backup): it is a note, and nothing is deleted on the strength of it.

``backup_store`` copies a live directory with SQLite's online backup API (a consistent snapshot while
frontends write) and then the files its rows name; restoring is copying it back while the node is
stopped (docs/BATCH.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DB_NAME", "FILES_DIR", "CheckReport", "backup_store", "check_store", "is_part_file"]

DB_NAME = "batches.sqlite3"
FILES_DIR = "files"
PART_SUFFIX = ".part"  # a file being written: <file id>.<writer pid>.part (gateway/batch_store.py)
_HEADER = b"SQLite format 3\x00"
_NAMED = 3  # ids named per kind of problem; the rest are counted
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26  # SQLite's result codes for a file it cannot read as a database


@dataclass
class CheckReport:
    """What ``check_store`` found: ``problems`` (damage: the store must not be served), ``notes`` (sound, but
    worth a line), and the counts of a sound store."""

    directory: Path
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: int = 0  # rows in the files table
    batches: int = 0

    @property
    def sound(self) -> bool:
        return not self.problems

    def line(self) -> str:
        """The whole report in one line (the frontend's log line, the CLI's last line)."""
        if self.problems:
            return f"{self.directory}: damaged: " + "; ".join(self.problems)
        return f"{self.directory}: sound ({self.files} files, {self.batches} batches)" + "".join(
            f"; {note}" for note in self.notes
        )


def is_part_file(name: str) -> bool:
    return name.endswith(PART_SUFFIX)


def _named(ids: list[str]) -> str:
    more = f" and {len(ids) - _NAMED} more" if len(ids) > _NAMED else ""
    return ", ".join(ids[:_NAMED]) + more


def _disk_files(files_dir: Path) -> dict[str, int]:
    """The stored files on disk (not those being written) and their sizes."""
    found: dict[str, int] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(files_dir):
            if entry.is_file(follow_symlinks=False) and not is_part_file(entry.name):
                found[entry.name] = entry.stat(follow_symlinks=False).st_size
    return found


def check_store(directory: str | os.PathLike[str], *, full: bool = False) -> CheckReport:
    """Check a batch directory (see the module's docstring); ``full``: SQLite's ``integrity_check`` (every
    index against its table too, slower) instead of ``quick_check``. Reads only. Raises OSError or
    sqlite3.Error when the check cannot run (a full or failing disk): that says nothing of the store."""
    report = CheckReport(Path(directory))
    db_path = report.directory / DB_NAME
    files_dir = report.directory / FILES_DIR
    on_disk = _disk_files(files_dir)
    try:
        size = db_path.stat().st_size
    except FileNotFoundError:
        size = -1
    if size <= 0:
        if on_disk:
            state = "is missing" if size < 0 else "is empty (0 bytes)"
            report.problems.append(
                f"{db_path} {state} but {files_dir} holds {len(on_disk)} files: the index of the files and "
                "batches is lost"
            )
        return report
    with open(db_path, "rb") as f:
        header = f.read(len(_HEADER))
    if header != _HEADER:
        what = "truncated" if len(header) < len(_HEADER) else "its header is overwritten"
        report.problems.append(f"{db_path} is not a SQLite database ({what}, {size} bytes)")
        return report
    try:  # read-write, though nothing is written: a read-only connection cannot recover a crashed writer's WAL
        db = sqlite3.connect(db_path, timeout=30.0)
    except sqlite3.Error as exc:
        _damage_or_raise(exc)
        report.problems.append(f"{db_path} cannot be opened: {exc}")
        return report
    try:
        db.execute("PRAGMA busy_timeout=30000")
        try:
            rows = [r[0] for r in db.execute("PRAGMA integrity_check" if full else "PRAGMA quick_check").fetchall()]
        except sqlite3.DatabaseError as exc:  # a page so broken that the check stops at it
            _damage_or_raise(exc)
            rows = [str(exc)]
        if rows != ["ok"]:
            more = f" (and {len(rows) - 1} more)" if len(rows) > 1 else ""
            first = " ".join(str(rows[0]).split())  # SQLite's first finding may span lines: the report is one
            report.problems.append(f"{db_path} fails its integrity check: {first}{more}")
            return report
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "files" not in tables or "batches" not in tables:
            if on_disk:
                report.problems.append(
                    f"{db_path} has no files or batches table but {files_dir} holds {len(on_disk)} files"
                )
            return report
        rows_files = {r[0]: r[1] for r in db.execute("SELECT id, bytes FROM files")}
        report.files = len(rows_files)
        report.batches = db.execute("SELECT COUNT(*) FROM batches").fetchone()[0]
    except sqlite3.Error as exc:
        _damage_or_raise(exc)
        report.problems.append(f"{db_path} cannot be read: {exc}")
        return report
    finally:
        db.close()
    _compare(report, rows_files, on_disk, files_dir)
    return report


def _damage_or_raise(exc: sqlite3.Error) -> None:
    """Return when SQLite says the file is damaged (SQLITE_CORRUPT, SQLITE_NOTADB); raise ``exc`` when the
    check could not run (a full or failing disk, a lock held too long): that is no finding about the store."""
    if (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF not in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        raise exc


def _compare(report: CheckReport, rows: dict[str, int], on_disk: dict[str, int], files_dir: Path) -> None:
    """Rows against files: a row's missing or resized bytes are damage; a file without a row is a note."""
    missing = sorted(i for i in rows if i not in on_disk)
    resized = sorted(i for i in rows if i in on_disk and on_disk[i] != rows[i])
    orphans = sorted(i for i in on_disk if i not in rows)
    if missing:
        report.problems.append(f"{len(missing)} files' bytes are missing from {files_dir}: {_named(missing)}")
    if resized:
        first = resized[0]
        report.problems.append(
            f"{len(resized)} files in {files_dir} differ in size from their rows: {_named(resized)}"
            f" ({first}: {on_disk[first]} bytes, its row says {rows[first]})"
        )
    if orphans:
        report.notes.append(
            f"{len(orphans)} files in {files_dir} have no row (an upload or a delete cut short, or a database "
            f"older than its files; left in place): {_named(orphans)}"
        )


def backup_store(directory: str | os.PathLike[str], destination: str | os.PathLike[str]) -> CheckReport:
    """Copy a batch directory, live or not, into ``destination`` (created; it must not hold a store yet):
    the database by SQLite's online backup API, then the files its rows name. A file deleted between the
    two loses its row in the copy too, so the copy is consistent. Returns the copy's check."""
    source = Path(directory)
    target = Path(destination)
    if (target / DB_NAME).exists():
        raise FileExistsError(f"{target / DB_NAME} exists: back up into a new directory")
    (target / FILES_DIR).mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(target, 0o700)
    src = sqlite3.connect(source / DB_NAME, timeout=30.0)  # read-write as in ``check_store``; only read
    dst = sqlite3.connect(target / DB_NAME, isolation_level=None)
    try:
        src.backup(dst)
        gone = []
        for (file_id,) in dst.execute("SELECT id FROM files").fetchall():
            try:
                shutil.copyfile(source / FILES_DIR / file_id, target / FILES_DIR / file_id)
            except FileNotFoundError:
                gone.append(file_id)
        dst.executemany("DELETE FROM files WHERE id = ?", [(i,) for i in gone])
        dst.execute("PRAGMA journal_mode=WAL")
    finally:
        dst.close()
        src.close()
    return check_store(target)
