"""Where a request's time went: the stages both sides agree on, and the worker's stamps.

Why this exists: a slow request's latency is the sum of several waits in two processes (the
frontend decoding, the request queue, a batch held open behind a running one, the model, the
reply channel). Each side stamps the moments it sees with ``now_ns()`` (CLOCK_MONOTONIC, one
clock for every process of a node, containers included), the worker's stamps ride back in its
reply messages (``Claimed.claimed_ns``, ``Finished.stamps``: optional fields, empty from an
older worker), and the frontend turns them into durations (gateway/stages.py).

Stages, in the order a request meets them:

    body_read     the HTTP body arriving (frontend)
    preprocess    base64 + decode + preprocessing, cache look-up included (frontend)
    queue         submitted on the request channel -> a worker claimed it
    batch_wait    claimed -> its batch starts on the model, minus the device copy
                  (a prepared batch held open behind a running one shows up here)
    device_copy   the batch was cut -> this request's tensors are on the device (Released)
    compute       the batch starts on the model -> this request's final answer
    first_output  the batch starts on the model -> this request's first output
    delivery      the worker's final answer -> the frontend's response built
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable

__all__ = ["STAMPS", "Stage", "Stamp", "Stamps", "worker_stage_seconds"]


class Stage(enum.IntEnum):
    BODY_READ = 0
    PREPROCESS = 1
    QUEUE = 2
    BATCH_WAIT = 3
    DEVICE_COPY = 4
    COMPUTE = 5
    FIRST_OUTPUT = 6
    DELIVERY = 7


class Stamp(enum.IntEnum):
    """Positions in ``Finished.stamps`` (worker-side moments, ``now_ns()``)."""

    CUT = 0  # the batch stopped gathering
    COPIED = 1  # this request's copy finished (it was Released)
    STARTED = 2  # the batch started on the model
    FIRST = 3  # this request's first output event
    DONE = 4  # its final event (the Finished is sent right after)


STAMPS = len(Stamp)


def worker_stage_seconds(claimed_ns: int, stamps: tuple[int, ...]) -> dict[Stage, float]:
    """The worker-side stage durations of one request; empty when the stamps are missing or odd.

    Odd stamps (out of order, from an older or a confused worker) give no figures rather than
    negative ones: a metric must never be fed nonsense it cannot tell from a measurement.
    """
    if claimed_ns <= 0 or len(stamps) < STAMPS:
        return {}
    cut, copied, started, first, done = stamps[:STAMPS]
    if not (claimed_ns <= cut <= copied <= started <= first <= done):
        return {}
    copy = copied - cut
    return {
        Stage.BATCH_WAIT: (started - claimed_ns - copy) / 1e9,
        Stage.DEVICE_COPY: copy / 1e9,
        Stage.COMPUTE: (done - started) / 1e9,
        Stage.FIRST_OUTPUT: (first - started) / 1e9,
    }


class Stamps:
    """The worker's moments for one request, filled in as it goes (worker/main.py)."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values = [0] * STAMPS

    def mark(self, stamp: Stamp) -> None:
        self.values[stamp] = time.monotonic_ns()

    @staticmethod
    def mark_all(many: Iterable[Stamps], stamp: Stamp) -> None:
        """One moment for a whole batch (it was cut, or it started, at once)."""
        now = time.monotonic_ns()
        for stamps in many:
            stamps.values[stamp] = now

    def output(self) -> None:
        """An output event: the first one is this request's first output."""
        if not self.values[Stamp.FIRST]:
            self.values[Stamp.FIRST] = time.monotonic_ns()

    def done(self) -> tuple[int, ...]:
        """Stamp the end and return what ``Finished.stamps`` carries."""
        self.output()
        self.values[Stamp.DONE] = time.monotonic_ns()
        return tuple(self.values)
