"""Cross-process locks on POSIX semaphores, with a holder record and dead-holder repair.

A POSIX semaphore has no owner: if a process dies between ``sem_wait`` and
``sem_post``, the semaphore stays at 0 forever. So every acquirer writes who it
is (kind, slot, epoch, pid) and bumps a progress counter in the lock's record in
the segment header right after acquiring, and clears the record right before
posting. A waiter that times out calls ``try_repair``:

- it takes the *repair* semaphore without waiting (only one repairer at a time,
  so the main semaphore is never posted twice for one death);
- if the record names a holder that ``is_dead`` says is dead, it clears the
  record and posts the main semaphore on the dead holder's behalf;
- if the record is empty while the semaphore is at 0 (the holder died between
  ``sem_wait`` and writing its record) and the progress counter has not moved
  for ``anonymous_stall_s``, it does the same.

What a critical section may do is therefore constrained: every update must be
safe to abandon half way (shared/cache_index.py writes an entry's fields first
and flips its state last). Critical sections are microseconds of metadata work,
never I/O or decoding. The supervisor also calls ``repair_after_death`` when it
reaps a child, so repair happens within one supervisor tick even with no waiter.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import posix_ipc

from shmgate.shared.errors import Overloaded
from shmgate.shared.vocabulary import now_ns

__all__ = ["HolderKind", "Identity", "SharedLock"]


class HolderKind(enum.IntEnum):
    NOBODY = 0
    FRONTEND = 1
    WORKER = 2
    SUPERVISOR = 3
    TOOL = 4  # tests, the cleanup command


Identity = tuple[int, int, int]  # (HolderKind, slot, epoch)
IsDead = Callable[[int, int, int, int], bool]  # (kind, slot, epoch, pid) -> dead?


class SharedLock:
    """One semaphore-guarded section; ``record`` is its row in the segment's lock table."""

    def __init__(
        self,
        sem: posix_ipc.Semaphore,
        record: np.ndarray,
        repair_sem: posix_ipc.Semaphore,
        repair_record: np.ndarray,
        identity: Identity,
        is_dead: IsDead,
        *,
        anonymous_stall_s: float = 5.0,
    ) -> None:
        self._sem = sem
        self._record = record
        self._repair_sem = repair_sem
        self._repair_record = repair_record
        self._identity = identity
        self._is_dead = is_dead
        self._anonymous_stall_s = anonymous_stall_s
        self._stall_seen: tuple[int, float] | None = None  # (count, first time seen) of an anonymous hold

    # -- acquire / release ------------------------------------------------------

    def acquire(self, timeout_s: float) -> bool:
        """Take the lock, repairing a dead holder on the way. False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        step = min(0.05, timeout_s) if timeout_s > 0 else 0
        while True:
            try:
                self._sem.acquire(step)
            except posix_ipc.BusyError:
                if time.monotonic() >= deadline:
                    return False
                self.try_repair()
                continue
            self._write_record(self._record)
            return True

    def release(self) -> None:
        self._record["kind"] = 0  # clear before post: the next holder writes a fresh record
        self._sem.release()

    @contextmanager
    def hold(self, timeout_s: float = 2.0) -> Iterator[None]:
        """Context manager; raises Overloaded when the lock cannot be had in time."""
        if not self.acquire(timeout_s):
            raise Overloaded("the cache index is busy; retry shortly", retry_after_s=1.0)
        try:
            yield
        finally:
            self.release()

    def _write_record(self, record: np.ndarray) -> None:
        kind, slot, epoch = self._identity
        record["slot"] = slot
        record["epoch"] = epoch
        record["pid"] = os.getpid()
        record["acquired_ns"] = now_ns()
        record["count"] = int(record["count"]) + 1
        record["kind"] = kind

    # -- repair -----------------------------------------------------------------

    def holder(self) -> tuple[int, int, int, int] | None:
        r = self._record
        kind = int(r["kind"])
        if kind == HolderKind.NOBODY:
            return None
        return kind, int(r["slot"]), int(r["epoch"]), int(r["pid"])

    def try_repair(self) -> bool:
        """Post the semaphore for a dead holder. True when a repair was made."""
        try:
            self._repair_sem.acquire(0)
        except posix_ipc.BusyError:
            return False  # someone else is repairing
        self._write_record(self._repair_record)
        try:
            return self._repair_locked()
        finally:
            self._repair_record["kind"] = 0
            self._repair_sem.release()

    def _repair_locked(self) -> bool:
        if self._sem.value > 0:
            self._stall_seen = None
            return False
        count = int(self._record["count"])
        holder = self.holder()
        if holder is not None:
            if not self._is_dead(*holder):
                return False
            # The holder may have released (and exited) while we judged it: post only if the
            # record still shows that very hold and the semaphore is still taken, or we would
            # post a second time and let two processes in.
            if int(self._record["count"]) != count or int(self._record["kind"]) != holder[0] or self._sem.value > 0:
                return False
            self._record["kind"] = 0
            self._sem.release()
            return True
        # Nobody recorded but the semaphore is taken: a holder that has not written its
        # record yet (microseconds) or one that died before writing it. Only act once the
        # progress counter has stood still for a long time.
        now = time.monotonic()
        if self._stall_seen is None or self._stall_seen[0] != count:
            self._stall_seen = (count, now)
            return False
        if now - self._stall_seen[1] < self._anonymous_stall_s:
            return False
        self._stall_seen = None
        self._sem.release()
        return True

    def repair_after_death(self) -> bool:
        """Supervisor hook after reaping a child: repair both the repair lock and the main lock."""
        r = self._repair_record
        kind = int(r["kind"])
        if kind and self._repair_sem.value == 0 and self._is_dead(kind, int(r["slot"]), int(r["epoch"]), int(r["pid"])):
            r["kind"] = 0
            self._repair_sem.release()
        return self.try_repair()
