"""A real Frontend and a real Worker in one process, on the in-memory transport (no ``shmgate serve``).

The same code as in production on both sides of the seam (gateway/frontend.py, worker/main.py,
the checksum backend), with shared/transport/memory.py in place of the POSIX objects: the
worker thread reads the frontend's tensors out of the in-memory arena and answers with their
digests, so an answer proves the bytes crossed. tests/test_e2e.py runs the same over POSIX.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading

from shmgate.gateway.frontend import Frontend, FrontendLimits
from shmgate.gateway.intake import IntakeLimits, parse_chat_request
from shmgate.gateway.preprocess.vision import ChecksumPreprocessor
from shmgate.gateway.request_state import Phase
from shmgate.shared.common_options import BatchingOptions
from shmgate.shared.transport.memory import MemoryFrontendLink, MemoryNode, MemoryWorkerLink
from shmgate.shared.wire import Delta, Failed, Finished
from shmgate.worker.main import Worker, WorkerOptions
from tests.serving import expected_checksum, noise_png


def _chat(image: bytes) -> bytes:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "text", "text": "digest?"}, {"type": "image_url", "image_url": {"url": url}}]
    return json.dumps({"model": "checksum", "messages": [{"role": "user", "content": content}]}).encode()


async def _answer(frontend: Frontend, image: bytes) -> str:
    state = await frontend.submit(parse_chat_request(_chat(image), IntakeLimits()))
    text = ""
    async for event in frontend.events(state):
        if isinstance(event, Delta):
            text += event.text
        elif isinstance(event, Failed):
            raise AssertionError(f"failed: {event}")
        elif isinstance(event, Finished):
            text += event.text
    assert state.phase is Phase.DONE
    return text


def test_a_frontend_and_a_worker_in_one_process_serve_requests_through_the_in_memory_arena() -> None:
    node = MemoryNode()
    worker = Worker(
        MemoryWorkerLink(node),
        WorkerOptions(model="checksum", batching=BatchingOptions(max_batch_size=4, max_batch_wait_ms=1)),
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    images = [noise_png(300 + i) for i in range(6)] + [noise_png(300)]  # the last one: a cache hit

    async def main() -> list[str]:
        link = MemoryFrontendLink(node, slot=0)
        frontend = Frontend(link, ChecksumPreprocessor(), FrontendLimits(request_timeout_s=30))
        await frontend.start()
        try:
            for _ in range(200):  # the worker marks itself READY once its backend is loaded
                if frontend.ready():
                    break
                await asyncio.sleep(0.05)
            answers = list(await asyncio.gather(*(_answer(frontend, image) for image in images[:-1])))
            answers.append(await _answer(frontend, images[-1]))  # after the first one was cached
            assert link.cache.held_bytes == 0 and link.cache.stats.hits == 1
            return answers
        finally:
            await frontend.stop()

    try:
        answers = asyncio.run(main())
    finally:
        worker.stop()
        thread.join(10)
    assert not thread.is_alive()
    for image, answer in zip(images, answers, strict=True):
        assert expected_checksum(image) in answer
    assert sum(node.batches) == len(images)
