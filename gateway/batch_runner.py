"""The batch runner: one per node, in whichever frontend holds the batch directory's lock.

Every frontend tries to take an exclusive ``fcntl.flock`` on ``runner.lock`` in the batch directory
every few seconds; the one that holds it runs the batches as an asyncio task. The kernel drops the
lock when its holder dies, so another frontend (or the same slot restarted) takes over and resumes.

Each line runs in process, through its endpoint's codec and the request pipeline of any request
(gateway/pipeline.py: admission, the content and result caches, the errors); no HTTP request is
made. It runs in the bulk lane (gateway/lane.py; ``RequestContext.bulk``): its descriptor at the request queue's lower
priority, its decodes in the bulk pool. Its answer is the data the pipeline returns, or the OpenAI
error object of the ShmgateError it raised, counted as an HTTP request's would be. A line's result
is committed once (gateway/batch_store.py), so after a crash the lines with a stored result are
skipped and the others run again.

Fairness (docs/BATCH.md): at most ``in_flight`` lines are in flight; while the node's frontends have
interactive requests in hand (the stats word that gateway/lane.py keeps), interactive and batch
requests together stay within ``in_flight``, with at most a quarter of it for lines, and one line
every ``TRICKLE_S`` when interactive ones take it all: a line's decode and reply work shares the
frontends' cores with interactive requests. The runner looks at that demand whenever a line ends and every ``RECHECK_S``,
so it ramps back up as soon as the node is quiet. Several batches run side by side, one line of
each in turn (round-robin), and a cancelled one stops launching without holding up the others.

The store's faults (gateway/batch_faults.py): while it cannot write (a full disk, an I/O error) the
runner launches no line, keeps the results it has in memory and stores them when the disk takes writes
again, so a batch resumes by itself and each line is run and stored once; a damaged store runs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shmgate.gateway.batch_faults import StoreDamaged, StoreFull, StoreUnavailable
from shmgate.gateway.batch_store import BatchStore, LineResult, new_id
from shmgate.gateway.endpoints import BY_PATH
from shmgate.gateway.http_errors import count_error, error_body
from shmgate.gateway.pipeline import Arrival
from shmgate.gateway.render import HungUp, Whole
from shmgate.gateway.request_context import RequestContext
from shmgate.gateway.served import Served
from shmgate.shared.errors import Cancelled, ShmgateError

__all__ = ["BatchRunner"]

log = logging.getLogger("shmgate.batch")

POLL_S = 0.5  # how often the runner looks for new batches and cancels
LOCK_RETRY_S = 2.0  # how often a frontend without the lock tries to take it
RETRY_STATUSES = frozenset({429, 503})  # the node is busy: the line waits and is sent again
RECHECK_S = 0.005  # with lines in flight, the runner looks at the interactive demand at least this often
QUIET_S = 0.05  # the node counts as busy this long after its last interactive request in hand
TRICKLE_S = 0.1  # while interactive requests fill the cap, one line at a time this often: a batch never stops
STORE_RETRY_S = 1.0  # while the store cannot write: how often results waiting in memory are tried again


class _Line(msgspec.Struct):
    """What the runner reads of an input line (checked whole at create): its body stays the bytes it was."""

    custom_id: str
    url: str
    body: msgspec.Raw


class _Model(msgspec.Struct):
    model: Any = None


_line_decoder = msgspec.json.Decoder(_Line)
_model_decoder = msgspec.json.Decoder(_Model)


def _model_of(body: bytes) -> str:
    """The model a line's body names (for /metrics), "" when it names none."""
    try:
        model = _model_decoder.decode(body).model
    except msgspec.DecodeError:
        return ""
    return model[:200] if isinstance(model, str) else ""


@dataclass(eq=False)
class _Job:
    """One batch the runner is running: its lines, those left to launch, those in flight."""

    id: str
    expires_at: int
    lines: list[bytes]
    todo: list[int]  # line indexes not launched yet, the next one last
    pending: set[asyncio.Task[LineResult]] = field(default_factory=set)
    committing: int = 0  # lines done whose result is not committed yet (``_Committer``)
    outcome: str = "done"  # or "cancelled", "expired": no more lines are launched

    @property
    def launching(self) -> bool:
        return bool(self.todo) and self.outcome == "done"

    @property
    def ended(self) -> bool:
        """Every line launched has ended and its result is committed."""
        return not self.launching and not self.pending and not self.committing

    def stop(self, outcome: str) -> None:
        if self.outcome == "done":
            self.outcome = outcome
            self.todo.clear()


class _Committer:
    """Commits finished lines' results in groups, apart from launching: one transaction for all the
    lines that ended while the previous one was written (``BatchStore.commit_lines``). A line's place
    in flight is free once its answer came; its batch ends only when its result is committed. A crash
    before the commit loses only that: the line has no result, so it runs again."""

    def __init__(self, store: BatchStore) -> None:
        self.store = store
        self._waiting: list[tuple[_Job, LineResult]] = []
        self._more = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False  # stopping: a group the store refuses is dropped (its lines run again after)

    def add(self, job: _Job, result: LineResult) -> None:
        job.committing += 1
        self._waiting.append((job, result))
        self._more.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="batch-commits")

    async def _run(self) -> None:
        while self._waiting:
            group, self._waiting = self._waiting, []
            self._more.clear()
            try:
                while True:
                    try:
                        await asyncio.to_thread(self.store.commit_lines, [(job.id, result) for job, result in group])
                        _warned.clear()
                        break
                    except (StoreFull, StoreUnavailable) as exc:  # kept, and stored once the disk takes writes
                        if self._closing:
                            raise
                        _warn_once(f"{len(group)} batch lines' results wait to be stored: {exc.message}")
                        await asyncio.sleep(STORE_RETRY_S)
            except Exception as exc:  # the database unreachable: these lines have no result and run again
                log.error("%d batch lines' results could not be stored: %r", len(group), exc)
            finally:
                for job, _ in group:
                    job.committing -= 1

    async def stop(self) -> None:
        """Wait for the commits under way (a cancelled runner keeps what it already has)."""
        self._closing = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task


async def _abandon(jobs: dict[str, _Job]) -> None:
    """Cancel every line in flight (they have no result: they run again) and forget the batches."""
    tasks = [task for job in jobs.values() for task in job.pending]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    jobs.clear()


_warned: list[str] = []  # the last store warning logged: one line per outage, not per try


def _warn_once(message: str) -> None:
    if not _warned or _warned[-1] != message:
        _warned[:] = [message]
        log.warning("%s", message)


def _log_failure(task: asyncio.Task[LineResult]) -> None:
    """A line that raised (the database unreachable, say) is logged; it has no result, so it runs again."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("a batch line failed before its result was stored: %r", exc)


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        served: Served,
        in_flight: int,
        interactive: Callable[[], int] = lambda: 0,
    ) -> None:
        """``served``: this frontend's serving state, whose pipeline runs the lines; ``in_flight``: lines in
        flight at most; ``interactive()``: the node's interactive requests in hand
        (``NodeStats.interactive_in_flight``), while which only a quarter of that many run (at least one)."""
        self.store = store
        self.served = served
        self.interactive = interactive
        self.in_flight = max(1, in_flight)
        self.busy_in_flight = max(1, self.in_flight // 4)
        self._commits = _Committer(store)
        self._interactive_seen = -QUIET_S  # when the node last had interactive requests in hand (time.monotonic)
        self._interactive_last = 0  # how many it had then
        self._launched_at = 0.0  # when the last line was launched (time.monotonic)
        self._task: asyncio.Task[None] | None = None
        self._lock_fd: int | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batch-runner")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None

    def _try_lock(self) -> bool:
        fd = os.open(self.store.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    async def _run(self) -> None:
        if self.store.damage is not None:
            return  # every call refuses until the store is restored (logged when it was opened)
        while not self._try_lock():
            await asyncio.sleep(LOCK_RETRY_S)
        log.info("this frontend runs the batches of %s", self.store.dir)
        jobs: dict[str, _Job] = {}
        try:
            while True:
                try:
                    await self._serve(jobs)
                except asyncio.CancelledError:
                    raise
                except StoreDamaged:
                    await _abandon(jobs)
                    return  # logged by the store, once: nothing runs until it is restored
                except (StoreFull, StoreUnavailable) as exc:  # a batch's files or status: tried again
                    _warn_once(f"the batch runner waits for the store: {exc.message}")
                    await _abandon(jobs)
                    await asyncio.sleep(STORE_RETRY_S)
                except Exception:
                    log.exception("the batch runner failed; it starts again")
                    await _abandon(jobs)
                await asyncio.sleep(POLL_S)
        except asyncio.CancelledError:  # the frontend stops: its lines in flight end uncommitted, to run again
            await _abandon(jobs)
            await self._commits.stop()
            raise

    def _cap(self, in_flight_now: int) -> int:
        """Lines in flight allowed now (``in_flight_now`` are): ``in_flight`` while the node is quiet; while it
        has interactive requests in hand (and for ``QUIET_S`` after: a closed-loop client's next request comes
        a moment after its answer) what they leave of ``in_flight``, at most ``busy_in_flight``, and one line
        every ``TRICKLE_S`` when they leave nothing, so that a batch never stops."""
        now = time.monotonic()
        interactive = self.interactive()
        if interactive > 0:
            self._interactive_seen = now
            self._interactive_last = interactive
        elif now - self._interactive_seen >= QUIET_S:
            return self.in_flight
        cap = min(self.busy_in_flight, self.in_flight - self._interactive_last)
        if cap <= 0 and in_flight_now == 0 and now - self._launched_at >= TRICKLE_S:
            return 1
        return cap

    async def _serve(self, jobs: dict[str, _Job]) -> None:
        """Run the unfinished batches' lines, a line from each batch in turn, until none is left."""
        looked = 0.0
        turn = 0  # where the round-robin goes on
        while True:
            if time.monotonic() - looked >= POLL_S:
                looked = time.monotonic()
                await self._look(jobs)
                if not jobs:
                    return
            running = [job for job in jobs.values() if job.launching]
            in_flight = sum(len(job.pending) for job in jobs.values())
            # a store that cannot write takes no new line: those in flight end and their results wait
            cap = self._cap(in_flight) if self.store.writable() else 0
            while running and in_flight < cap:
                in_flight += 1
                self._launched_at = time.monotonic()
                turn %= len(running)
                job = running[turn]
                index = job.todo.pop()
                task = asyncio.create_task(self._run_line(job.id, index, job.lines[index]))
                task.add_done_callback(_log_failure)
                job.pending.add(task)
                if not job.todo:
                    running.remove(job)  # the next batch is now at ``turn``
                else:
                    turn += 1
            for job in list(jobs.values()):
                if job.ended:
                    del jobs[job.id]
                    await self._end(job)
            pending = [task for job in jobs.values() for task in job.pending]
            if pending:  # a line ends, or the interactive demand may have changed: look again soon
                await asyncio.wait(pending, timeout=RECHECK_S, return_when=asyncio.FIRST_COMPLETED)
            elif jobs:
                await asyncio.sleep(RECHECK_S)
            for job in jobs.values():
                for task in [task for task in job.pending if task.done()]:
                    job.pending.discard(task)
                    if not task.cancelled() and task.exception() is None:
                        self._commits.add(job, task.result())

    async def _look(self, jobs: dict[str, _Job]) -> None:
        """Take up new batches; stop launching the lines of a batch cancelled or expired meanwhile."""
        unfinished = {batch["id"]: batch for batch in await asyncio.to_thread(self.store.unfinished)}
        now = time.time()
        for batch_id, job in jobs.items():
            batch = unfinished.get(batch_id)
            if batch is None or batch["status"] != "in_progress":
                job.stop("cancelled")
            elif now >= job.expires_at:
                job.stop("expired")
        for batch_id, batch in unfinished.items():
            if batch_id in jobs:
                continue
            if batch["status"] == "cancelling":
                await asyncio.to_thread(self._finish, batch_id, "cancelled")
            elif batch["status"] == "finalizing":
                await asyncio.to_thread(self._finish, batch_id, "completed")
            elif (started := await self._start(batch)) is not None:
                jobs[batch_id] = started

    async def _start(self, batch: dict[str, Any]) -> _Job | None:
        """A batch's lines without a result yet; None when its input file is gone (the batch failed)."""
        batch_id = batch["id"]
        try:
            data = await asyncio.to_thread(self.store.file_path(batch["input_file_id"]).read_bytes)
        except FileNotFoundError:
            await asyncio.to_thread(
                self.store.set_status,
                batch_id,
                "failed",
                errors={"object": "list", "data": [{"code": "file_not_found", "message": "input file deleted"}]},
            )
            return None
        lines = [raw for raw in data.split(b"\n") if raw.strip()]
        done = await asyncio.to_thread(self.store.done_lines, batch_id)
        todo = [i for i in reversed(range(len(lines))) if i not in done]  # popped from the end: in order
        return _Job(batch_id, int(batch["expires_at"]), lines, todo)

    async def _end(self, job: _Job) -> None:
        """Every line launched has ended: finish the batch (its files, its final status)."""
        if job.outcome in ("cancelled", "expired"):
            now = await asyncio.to_thread(self.store.batch, job.id)
            if now is None:
                return
            await asyncio.to_thread(self._finish, job.id, job.outcome)
            return
        left = len(job.lines) - len(await asyncio.to_thread(self.store.done_lines, job.id))
        if left:  # lines whose run failed before a result was stored: the next round runs them again
            log.warning("batch %s: %d lines have no result yet; running them again", job.id, left)
            return
        if await asyncio.to_thread(self.store.set_status, job.id, "finalizing", only_from=("in_progress",)):
            await asyncio.to_thread(self._finish, job.id, "completed")
        # else: cancelled meanwhile (``cancelling``): the next look finishes it as cancelled

    async def _run_line(self, batch_id: str, index: int, raw: bytes) -> LineResult:
        """Run one line until the pipeline answers it (a 429 or 503 waits and goes again): its result."""
        line = _line_decoder.decode(raw)  # validated when the batch was created; the body stays bytes
        record: dict[str, Any] = {
            "id": new_id("batch_req"),
            "custom_id": line.custom_id,
            "response": None,
            "error": None,
        }
        spans = self.served.spans
        trace = None if spans is None else spans.batch_line(batch_id, line.custom_id, index)
        try:
            with contextlib.nullcontext() if trace is None else trace.current():
                status, body = await self._answer(line, record["id"])
        except BaseException as exc:
            if trace is not None:
                trace.ended(None, type(exc).__name__)
            raise
        record["response"] = {"status_code": status, "request_id": record["id"], "body": body}
        if trace is not None:
            trace.ended(status, body["error"]["message"] if status >= 400 else None)
        return LineResult(index, status < 400, record, _model_of(line.body))

    async def _answer(self, line: _Line, request_id: str) -> tuple[int, dict[str, Any]]:
        """The line's answer through its endpoint's steps, in process: its HTTP status and JSON body, as an
        HTTP client of the node would have had them. Busy (429, 503): waits, then again."""
        steps = BY_PATH[line.url].steps  # the batch's endpoint (gateway/endpoints.py): checked at create
        s = self.served
        context = RequestContext(bulk=True, spans=s.spans)  # the bulk lane
        delay = 0.2
        while True:
            error: ShmgateError
            try:
                answer = await steps(s, Arrival(bytes(line.body), time.monotonic(), whole=True, context=context))
            except HungUp:  # no connection to hang up: only a cancel from elsewhere
                error = Cancelled("the line's request was cancelled")
            except ShmgateError as exc:
                error = exc
            except Exception:  # a bug: answered as the catch-all answers one over HTTP (gateway/guards.py)
                log.exception("batch line %r failed with an unexpected exception", line.custom_id)
                error = ShmgateError(f"internal error; quote batch request id {request_id} when reporting it")
            else:
                if isinstance(answer, Whole):
                    return 200, answer.body
                error = ShmgateError("a batch line's answer cannot be a stream")
            count_error(s.frontend.stats, error)
            if error.status_hint in RETRY_STATUSES:
                await asyncio.sleep(delay)  # the node is full or a worker is restarting: wait, then again
                delay = min(delay * 2, 5.0)
                continue
            return error.status_hint, error_body(error.message, error.error_type, error.code, error.param)

    def _finish(self, batch_id: str, status: str) -> None:
        """Write the output and error files of the lines done, then move the batch to ``status``.

        The files' ids are fixed by the batch's, so finishing again after a crash rewrites the same files.
        """
        fields: dict[str, Any] = {}
        for ok, kind in ((True, "output"), (False, "error")):
            results = self.store.results(batch_id, ok)
            if results:
                file_id = f"file-{batch_id.removeprefix('batch-')}-{kind}"
                data = ("\n".join(results) + "\n").encode()
                self.store.add_file(data, f"{batch_id}_{kind}.jsonl", "batch_output", file_id=file_id)
                fields[f"{kind}_file_id"] = file_id
        self.store.set_status(batch_id, status, **fields)
