"""What the Batch API's store answers when its disk or database fails: an OpenAI error with a fitting status.

The store (gateway/batch_store.py) turns every storage failure into one of three errors, so a route
never answers a 500 for a disk's state:

- ``StoreFull`` (507 ``insufficient_storage``, Retry-After): no space (ENOSPC, EDQUOT, EFBIG, SQLite's
  SQLITE_FULL). Reads and deletes go on working (the store keeps a reserve for deletes: batch_store.py);
  the store writes again by itself once space is freed.
- ``StoreUnavailable`` (503 ``batch_store_unavailable``, Retry-After): the disk failed a read or write
  (EIO, a read-only filesystem) or the database stayed locked; another try may succeed.
- ``StoreDamaged`` (503 ``batch_store_damaged``): the store failed its check at start, or SQLite found a
  page it cannot read; every Batch API call is refused until an operator restores it (docs/BATCH.md).
  Refusing is the point: a damaged store is never served as an empty one.

``fault_of`` classifies an OSError or sqlite3.Error; anything else (a bug) is left to surface as one.
The messages a client sees name no path: the operator's log line does (batch_store.py).
"""

from __future__ import annotations

import errno
import sqlite3

from shmgate.shared.errors import Overloaded, ShmgateError

__all__ = ["StoreDamaged", "StoreFull", "StoreUnavailable", "fault_of"]

_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# SQLite's primary result codes (the low byte of ``sqlite_errorcode``)
_SQLITE_ERROR, _SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_IOERR, _SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_NOTADB = (
    1,
    5,
    6,
    10,
    11,
    13,
    26,
)
# What SQLite reports for an I/O failure: with this little space left, it was the space (a WAL or its index
# that could not grow reports SQLITE_IOERR, not SQLITE_FULL).
LOW_SPACE_BYTES = 1 << 20


class StoreFull(Overloaded):
    """No space left where the batch store writes: retry once space is freed (deleting files frees it)."""

    code = "insufficient_storage"
    error_type = "server_error"

    def __init__(self, message: str = "") -> None:
        super().__init__(
            message
            or "the Batch API's storage is full: nothing can be stored until space is freed (deleting files "
            "you no longer need frees it); reads and deletes still work",
            retry_after_s=30.0,
            status_hint=507,
        )


class StoreUnavailable(ShmgateError):
    """The batch store's disk failed a read or write, or its database stayed locked: retry later."""

    status_hint = 503
    code = "batch_store_unavailable"
    error_type = "server_error"
    retry_after_s = 5.0

    def __init__(self, message: str = "") -> None:
        super().__init__(
            message
            or "the Batch API's storage failed a read or write (an I/O error); retry later, and tell the "
            "operator if it lasts"
        )


class StoreDamaged(ShmgateError):
    """The batch store failed its integrity check: the Batch API refuses until the operator restores it."""

    status_hint = 503
    code = "batch_store_damaged"
    error_type = "server_error"
    retry_after_s = 60.0

    def __init__(self, message: str = "") -> None:
        super().__init__(
            message
            or "the Batch API is off: its store is damaged and must be restored by the operator "
            "(shmgate batches check; docs/BATCH.md); other endpoints are served"
        )


def fault_of(exc: BaseException, free_bytes: int | None) -> ShmgateError | None:
    """The store error ``exc`` stands for, or None when it is no storage failure (a bug: let it surface).

    ``free_bytes``: the space left on the store's filesystem (None: unknown), which tells an I/O error of a
    full disk from another.
    """
    if isinstance(exc, OSError):
        if exc.errno in _NO_SPACE:
            return StoreFull()
        return StoreUnavailable()
    if not isinstance(exc, sqlite3.DatabaseError) or isinstance(
        exc, (sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.InterfaceError)
    ):
        return None
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    if code == _SQLITE_ERROR:  # a statement SQLite refuses (no such table, a syntax error): a bug, not the disk
        return None
    if code == _SQLITE_FULL or (code == _SQLITE_IOERR and free_bytes is not None and free_bytes < LOW_SPACE_BYTES):
        return StoreFull()
    if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return StoreDamaged()
    if code in (_SQLITE_IOERR, _SQLITE_BUSY, _SQLITE_LOCKED) or isinstance(exc, sqlite3.OperationalError):
        return StoreUnavailable()
    return StoreDamaged()  # a DatabaseError of another code: SQLite could not read what the file holds
