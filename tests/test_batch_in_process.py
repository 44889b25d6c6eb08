"""A batch line runs in process: the runner calls its endpoint's codec and the pipeline, no HTTP request.

A real ``Frontend`` on the in-memory transport (shared/transport/memory.py), a real batch store on
disk, and no HTTP server anywhere: the test plays the worker. Opening a connection of any kind during
the run is recorded, so a runner that sent its lines over HTTP (or any socket) fails here twice: it
finds no server, and the connection is seen.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from shmgate.gateway.batch_runner import BatchRunner
from shmgate.gateway.batch_store import BatchStore
from shmgate.gateway.frontend import Frontend, FrontendLimits
from shmgate.gateway.metrics import Counter
from shmgate.gateway.preprocess.vision import ChecksumPreprocessor
from shmgate.gateway.served import AppOptions, Served
from shmgate.shared.transport.memory import MemoryFrontendLink, MemoryNode, MemoryNodeStats
from shmgate.shared.wire import Claimed, Finished, Submit


def _png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (32, 24), (20, 140, 90)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _line(custom_id: str, model: str, **extra: Any) -> bytes:
    content = [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": _png()}}]
    body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    return json.dumps(line).encode() + b"\n"


def test_a_batch_runs_in_process_with_no_http_request_its_lines_in_the_bulk_lane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    connections: list[object] = []
    real_connect = socket.socket.connect

    def connect(self: socket.socket, address: Any) -> None:
        connections.append(address)
        real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", lambda self, address: connections.append(address) or 111)

    async def main() -> tuple[dict[str, Any], list[Submit], list[dict[str, Any]], list[dict[str, Any]], int]:
        node = MemoryNode()
        node.add_worker("checksum")
        link = MemoryFrontendLink(node, slot=0)
        frontend = Frontend(link, ChecksumPreprocessor(), FrontendLimits())
        await frontend.start()
        store = BatchStore(tmp_path)
        served = Served(AppOptions("in-memory", 0, "checksum"), frontend, MemoryNodeStats(node), None)
        data = _line("a", "checksum") + _line("b", "no-such-model") + _line("c", "checksum", stream=True)
        uploaded = store.add_file(data, "in.jsonl", "batch")
        batch = store.add_batch("/v1/chat/completions", uploaded["id"], 3600, None, {"checksum": 2, "no-such-model": 1})
        runner = BatchRunner(store, served, 4)
        runner.start()
        submits: list[Submit] = []
        try:
            deadline = time.monotonic() + 30
            while (found := store.batch(batch["id"])) is not None and found["status"] != "completed":
                assert time.monotonic() < deadline, f"the batch is still {found['status']}"
                submit = node.take()
                if submit is None:
                    await asyncio.sleep(0.01)
                    continue
                submits.append(submit)
                node.reply(Claimed(submit.request_id, 0, 1))
                node.reply(Finished(submit.request_id, 0, "stop", 7, 2, text="a cat"))
        finally:
            await runner.stop()
            await frontend.stop()
        assert found is not None
        output = [json.loads(line) for line in store.file_path(found["output_file_id"]).read_text().splitlines()]
        errors = [json.loads(line) for line in store.file_path(found["error_file_id"]).read_text().splitlines()]
        return found, submits, output, errors, int(link.row[Counter.REQUESTS_CLIENT_ERROR])

    found, submits, output, errors, client_errors = asyncio.run(main())
    assert connections == []  # no HTTP request, nor any other connection
    assert found["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert len(submits) == 1 and submits[0].bulk  # the one good line, in the bulk lane
    [ok] = output
    assert ok["custom_id"] == "a" and ok["response"]["status_code"] == 200
    assert ok["response"]["body"]["choices"][0]["message"]["content"] == "a cat"
    assert ok["response"]["body"]["usage"]["prompt_tokens"] == 7
    by_id = {e["custom_id"]: e["response"] for e in errors}
    assert by_id["b"]["status_code"] == 404 and by_id["b"]["body"]["error"]["param"] == "model"
    assert by_id["c"]["status_code"] == 400 and by_id["c"]["body"]["error"]["param"] == "stream"
    assert client_errors == 2  # each failed line counted as its HTTP request would have been
