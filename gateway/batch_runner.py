"""The batch runner: one per node, in whichever frontend holds the batch directory's lock.

Every frontend tries to take an exclusive ``fcntl.flock`` on ``runner.lock`` in the batch directory
every few seconds; the one that holds it runs the batches as an asyncio task. The kernel drops the
lock when its holder dies, so another frontend (or the same slot restarted) takes over and resumes.

Each line is POSTed to this node's own HTTP port on loopback with ``x-shmgate-lane: bulk``
(gateway/lane.py): it goes through exactly the pipeline of any request (the key, admission, the
content and result caches, the errors), its descriptor at the bulk lane's lower priority. At most
``in_flight`` lines are in flight. A line's result is committed once (gateway/batch_store.py), so
after a crash the lines with a stored result are skipped and the others run again.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from typing import Any

import httpx

from shmgate.gateway.batch_store import BatchStore, LineResult, new_id
from shmgate.gateway.lane import LANE_HEADER

__all__ = ["BatchRunner", "loopback_url"]

log = logging.getLogger("shmgate.batch")

POLL_S = 0.5  # how often the runner looks for new batches and cancels
LOCK_RETRY_S = 2.0  # how often a frontend without the lock tries to take it
CONNECT_TRIES_S = 120.0  # how long a line retries a node it cannot reach before it fails
RETRY_STATUSES = frozenset({429, 503})  # the node is busy: the line waits and is sent again


def loopback_url(host: str, port: int) -> str:
    """This node's own address as seen from the frontend: the listening address, a wildcard's loopback."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _log_failure(task: asyncio.Task[None]) -> None:
    """A line that raised (the database unreachable, say) is logged; it has no result, so it runs again."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("a batch line failed before its result was stored: %r", exc)


class BatchRunner:
    def __init__(self, store: BatchStore, base_url: str, api_key: str | None, in_flight: int) -> None:
        self.store = store
        self.base_url = base_url
        self.headers = {LANE_HEADER: "bulk"}
        if api_key is not None:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.in_flight = max(1, in_flight)
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
        while not self._try_lock():
            await asyncio.sleep(LOCK_RETRY_S)
        log.info("this frontend runs the batches of %s", self.store.dir)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per batch line
        async with httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=None) as client:
            while True:
                try:
                    for batch in await asyncio.to_thread(self.store.unfinished):
                        await self._run_batch(client, batch)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("the batch runner failed; it starts again")
                await asyncio.sleep(POLL_S)

    async def _status(self, batch_id: str) -> str:
        batch = await asyncio.to_thread(self.store.batch, batch_id)
        return "cancelled" if batch is None else str(batch["status"])

    async def _run_batch(self, client: httpx.AsyncClient, batch: dict[str, Any]) -> None:
        batch_id = batch["id"]
        if batch["status"] == "in_progress":
            try:
                data = await asyncio.to_thread(self.store.file_path(batch["input_file_id"]).read_bytes)
            except FileNotFoundError:
                await asyncio.to_thread(
                    self.store.set_status,
                    batch_id,
                    "failed",
                    errors={"object": "list", "data": [{"code": "file_not_found", "message": "input file deleted"}]},
                )
                return
            lines = [raw for raw in data.split(b"\n") if raw.strip()]
            done = await asyncio.to_thread(self.store.done_lines, batch_id)
            todo = [i for i in range(len(lines)) if i not in done]
            outcome = await self._run_lines(client, batch_id, batch["expires_at"], lines, todo)
            if outcome == "cancelled":
                await asyncio.to_thread(self._finish, batch_id, "cancelled")
                return
            if outcome == "expired":
                await asyncio.to_thread(self._finish, batch_id, "expired")
                return
            left = len(lines) - len(await asyncio.to_thread(self.store.done_lines, batch_id))
            if left:  # lines whose run failed before a result was stored: the next round runs them again
                log.warning("batch %s: %d lines have no result yet; running them again", batch_id, left)
                return
            await asyncio.to_thread(self.store.set_status, batch_id, "finalizing", only_from=("in_progress",))
            now = await asyncio.to_thread(self.store.batch, batch_id)
            if now is None:
                return
            batch = now
        if batch["status"] == "cancelling":
            await asyncio.to_thread(self._finish, batch_id, "cancelled")
        elif batch["status"] == "finalizing":
            await asyncio.to_thread(self._finish, batch_id, "completed")

    async def _run_lines(
        self, client: httpx.AsyncClient, batch_id: str, expires_at: int, lines: list[bytes], todo: list[int]
    ) -> str:
        """Run the lines ``todo``, ``in_flight`` at a time; ``done``, ``cancelled`` or ``expired``."""
        pending: set[asyncio.Task[None]] = set()
        try:
            return await self._launch(client, batch_id, expires_at, lines, todo, pending)
        except asyncio.CancelledError:  # the frontend stops: its lines in flight end uncommitted, to run again
            for task in pending:
                task.cancel()
            raise

    async def _launch(
        self,
        client: httpx.AsyncClient,
        batch_id: str,
        expires_at: int,
        lines: list[bytes],
        todo: list[int],
        pending: set[asyncio.Task[None]],
    ) -> str:
        outcome = "done"
        checked = time.monotonic()
        for index in todo:
            while len(pending) >= self.in_flight:
                finished, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                pending -= finished
            if time.monotonic() - checked >= POLL_S:
                checked = time.monotonic()
                if await self._status(batch_id) != "in_progress":
                    outcome = "cancelled"
                    break
            if time.time() >= expires_at:
                outcome = "expired"
                break
            task = asyncio.create_task(self._run_line(client, batch_id, index, lines[index]))
            task.add_done_callback(_log_failure)
            pending.add(task)
        if pending:
            await asyncio.wait(pending)
        if outcome == "done" and await self._status(batch_id) == "cancelling":
            outcome = "cancelled"
        return outcome

    async def _run_line(self, client: httpx.AsyncClient, batch_id: str, index: int, raw: bytes) -> None:
        line = json.loads(raw)  # validated when the batch was created
        custom_id = line["custom_id"]
        record: dict[str, Any] = {"id": new_id("batch_req"), "custom_id": custom_id, "response": None, "error": None}
        ok = False
        delay = 0.2
        give_up = time.monotonic() + CONNECT_TRIES_S
        while True:
            try:
                reply = await client.post(line["url"], json=line["body"])
            except httpx.TransportError as exc:
                if time.monotonic() < give_up:  # the frontends are starting or restarting: wait, then again
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
                    continue
                record["error"] = {"code": "request_failed", "message": f"the request failed: {exc}"}
                break
            if reply.status_code in RETRY_STATUSES:
                await asyncio.sleep(delay)  # the node is full or a worker is restarting: wait, then again
                delay = min(delay * 2, 5.0)
                continue
            try:
                body: Any = reply.json()
            except ValueError:
                body = {"error": {"message": reply.text[:1000], "type": "server_error", "param": None, "code": None}}
            record["response"] = {
                "status_code": reply.status_code,
                "request_id": reply.headers.get("x-request-id") or record["id"],
                "body": body,
            }
            ok = reply.status_code < 400
            break
        model = line["body"].get("model")
        model = model[:200] if isinstance(model, str) else ""
        await asyncio.to_thread(self.store.commit_line, batch_id, LineResult(index, ok, record, model))

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
