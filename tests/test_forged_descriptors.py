"""Forged descriptors on the real request channel of a running worker (DESIGN invariant 7), and IPC hygiene.

The test process attaches to a running ``shmgate serve`` as a frontend in a spare slot
(``--spare-frontend-slots 1``: a slot with its own partition and reply channel that no HTTP
process uses), so the worker's answers to our forgeries come back to us and to nobody else.
It writes one real tensor into its partition, proves the channel with an honest Submit, then
bends one field at a time. Each forgery must be answered Claimed, Released, Failed
("bad_descriptor"), without an IPC name in the message; the worker keeps its pid, and an HTTP
request still completes afterwards. A descriptor that does not even decode (a negative
dimension) still gets a Failed reply when its request id and reply slot can be read (else it is
dropped with a log line). A zero-byte tensor (``torch.frombuffer(count=0)`` raised in the prefetch
thread and killed the worker) fails its request alone.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import numpy as np
import posix_ipc
import pytest

from shmgate.shared.arena import Allocation, Partition
from shmgate.shared.channels import Queue
from shmgate.shared.instance import Instance
from shmgate.shared.segment import SlotState
from shmgate.shared.wire import Claimed, Delta, Failed, Finished, Released, Submit, TensorRef
from tests.serving import Server, expected_checksum, image_request, noise_png, wait_until
from tests.shm_children import claim_frontend

SHAPE = (3, 224, 224)
NBYTES = 3 * 224 * 224
MAX = 2**63 - 1


@dataclass
class FakeFrontend:
    """This test process, attached to the server's instance as the frontend of the spare slot."""

    inst: Instance
    slot: int
    partition: Partition
    requests: Queue
    replies: Queue
    good: TensorRef
    pixels: bytes
    next_id: int = 1 << 62
    kept: list[Allocation] = field(default_factory=list)

    def ref(self, **changes: object) -> TensorRef:
        fields = {f: getattr(self.good, f) for f in TensorRef.__struct_fields__}
        fields.update(changes)
        return TensorRef(**fields)  # type: ignore[arg-type]

    def submit(self, *tensors: TensorRef, reply_slot: int | None = None) -> int:
        self.next_id += 1
        slot = self.slot if reply_slot is None else reply_slot
        self.requests.send(Submit(request_id=self.next_id, reply_slot=slot, model="checksum", tensors=tensors), 10.0)
        return self.next_id

    def answers(self, request_id: int, timeout_s: float = 30.0) -> list[object]:
        """Every reply to ``request_id`` up to its terminal one, or what came before the timeout."""
        out: list[object] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = self.replies.receive(min(0.5, max(0.01, deadline - time.monotonic())))
            if message is None or getattr(message, "request_id", None) != request_id:
                continue
            out.append(message)
            if isinstance(message, (Finished, Failed)):
                break
        return out


@pytest.fixture(scope="module")
def fake(spare_slot_server: Server) -> Iterator[FakeFrontend]:
    inst = Instance.attach(spare_slot_server.instance_id)
    slot = inst.segment.layout.n_frontends - 1  # the spare one: frontends take 0..n-2
    assert not inst.segment.slot_alive(inst.segment.frontends, slot, 3.0)
    _, heartbeat = claim_frontend(inst, slot)
    requests, replies = inst.request_queue(), inst.reply_queue(slot)
    try:
        partition = Partition(inst.segment, slot)
        allocation = partition.allocate(NBYTES)
        assert allocation is not None
        pixels = np.random.default_rng(7).integers(0, 256, SHAPE, dtype=np.uint8)
        partition.array(allocation, "uint8", SHAPE)[:] = pixels
        good = TensorRef(
            offset=allocation.offset,
            nbytes=NBYTES,
            generation=allocation.generation,
            dtype="uint8",
            shape=SHAPE,
            name="pixels",
        )
        yield FakeFrontend(inst, slot, partition, requests, replies, good, pixels.tobytes())
    finally:
        heartbeat.stop()
        inst.segment.frontends[slot]["state"] = SlotState.FREE
        requests.close()
        replies.close()
        inst.close()


def _forgeries() -> dict[str, Callable[[FakeFrontend], TensorRef]]:
    def freed(f: FakeFrontend) -> TensorRef:
        allocation = f.partition.allocate(NBYTES)
        assert allocation is not None
        f.partition.free(allocation)
        return f.ref(offset=allocation.offset, generation=allocation.generation)

    def reused(f: FakeFrontend) -> TensorRef:
        old = f.partition.allocate(NBYTES)
        assert old is not None
        f.partition.free(old)
        new = f.partition.allocate(NBYTES)
        assert new is not None and new.offset == old.offset and new.generation != old.generation
        f.kept.append(new)
        return f.ref(offset=old.offset, generation=old.generation)

    def other_partition(f: FakeFrontend) -> TensorRef:
        start, _ = f.inst.segment.partition_bounds(0)  # a real frontend's partition
        return f.ref(offset=start + 64, generation=2**62)

    def across_partitions(f: FakeFrontend) -> TensorRef:
        _, end = f.inst.segment.partition_bounds(0)
        return f.ref(offset=end - 64, nbytes=4096, shape=(4096,))

    def more_than_allocated(f: FakeFrontend) -> TensorRef:
        return f.ref(nbytes=2 * NBYTES, shape=(6, 224, 224))

    def total(f: FakeFrontend) -> int:
        return f.inst.segment.layout.total_size

    return {
        "offset at the end of the arena": lambda f: f.ref(offset=total(f)),
        "offset far past the arena": lambda f: f.ref(offset=total(f) + (1 << 40)),
        "offset 2**63-1": lambda f: f.ref(offset=MAX),
        "offset + nbytes overflows int64": lambda f: f.ref(offset=MAX - 63, nbytes=MAX),
        "nbytes past the end": lambda f: f.ref(
            nbytes=total(f) - f.good.offset + 64, shape=(total(f) - f.good.offset + 64,)
        ),
        "offset in the segment header": lambda f: f.ref(offset=64),
        "misaligned offset": lambda f: f.ref(offset=f.good.offset + 8),
        "another frontend's partition": other_partition,
        "across a partition boundary": across_partitions,
        "freed space": freed,
        "reused space (stale generation)": reused,
        "generation 0": lambda f: f.ref(generation=0),
        "wrong dtype": lambda f: f.ref(dtype="float32"),
        "wrong shape": lambda f: f.ref(shape=(3, 224, 225)),
        "nbytes beyond the allocation": more_than_allocated,
        "huge dims": lambda f: f.ref(shape=(2**40, 2**40)),
        "a zero dim beside a huge one": lambda f: f.ref(nbytes=0, shape=(0, 2**62)),
        "zero bytes": lambda f: f.ref(nbytes=0, shape=(0,)),
        "zero bytes, three dims": lambda f: f.ref(nbytes=0, shape=(3, 0, 224)),
        "nine dims": lambda f: f.ref(nbytes=1, shape=(1,) * 9),
        "unknown dtype": lambda f: f.ref(dtype="complex128"),
        "a 2000-character dtype": lambda f: f.ref(dtype="x" * 2000),
    }


FORGERIES = _forgeries()

# Which check of shared/arena.py:validate must catch each forgery (the start of its message).
OUTSIDE, PAST_END, NOT_A_BLOCK = "tensor offset or size lies outside", "tensor extends past", "tensor offset is not"
STALE, MISMATCH, BAD_SHAPE = "the tensor was freed or reused", "dtype and shape do not match", "tensor shape is not"
CAUGHT_BY = {
    "offset at the end of the arena": OUTSIDE,
    "offset far past the arena": OUTSIDE,
    "offset 2**63-1": OUTSIDE,
    "offset + nbytes overflows int64": OUTSIDE,
    "nbytes past the end": PAST_END,
    "offset in the segment header": NOT_A_BLOCK,
    "misaligned offset": NOT_A_BLOCK,
    "another frontend's partition": STALE,
    "across a partition boundary": "tensor crosses a partition",
    "freed space": STALE,
    "reused space (stale generation)": STALE,
    "generation 0": STALE,
    "wrong dtype": MISMATCH,
    "wrong shape": MISMATCH,
    "nbytes beyond the allocation": "descriptor claims more",
    "huge dims": BAD_SHAPE,
    "a zero dim beside a huge one": BAD_SHAPE,
    "nine dims": BAD_SHAPE,
    "zero bytes": "a tensor of zero bytes",
    "zero bytes, three dims": "a tensor of zero bytes",
    "unknown dtype": "unknown dtype 'complex128'",
    "a 2000-character dtype": "unknown dtype 'xxxxxxxxxxxxxxxx'",
}


def _assert_clean_message(fake: FakeFrontend, failed: Failed) -> None:
    assert "shmgate" not in failed.message and fake.inst.names.instance_id not in failed.message
    assert len(failed.message) < 200


def test_an_honest_descriptor_on_the_same_channel_is_served(fake: FakeFrontend) -> None:
    replies = fake.answers(fake.submit(fake.good))
    assert [type(m) for m in replies[:2]] == [Claimed, Released] and isinstance(replies[-1], Finished)
    text = "".join(m.text for m in replies if isinstance(m, (Delta, Finished)))  # the last piece rides in Finished
    assert hashlib.blake2b(fake.pixels, digest_size=16).hexdigest() in text


@pytest.mark.parametrize("name", list(FORGERIES))
def test_a_forged_descriptor_fails_its_request_and_the_worker_carries_on(
    spare_slot_server: Server, fake: FakeFrontend, name: str
) -> None:
    [worker] = spare_slot_server.pids("worker")
    replies = fake.answers(fake.submit(FORGERIES[name](fake)))
    assert [type(m) for m in replies] == [Claimed, Released, Failed], replies
    failed = replies[-1]
    assert isinstance(failed, Failed) and failed.code == "bad_descriptor" and failed.seq == 0
    assert failed.message.startswith(CAUGHT_BY[name])
    _assert_clean_message(fake, failed)
    assert spare_slot_server.pids("worker") == [worker]


def test_one_forged_tensor_fails_the_whole_request(fake: FakeFrontend) -> None:
    replies = fake.answers(fake.submit(fake.good, fake.ref(offset=MAX)))
    assert isinstance(replies[-1], Failed) and replies[-1].code == "bad_descriptor"


def test_an_undecodable_descriptor_gets_an_error_reply_and_the_next_one_is_served(
    spare_slot_server: Server, fake: FakeFrontend
) -> None:
    [worker] = spare_slot_server.pids("worker")
    undecodable = fake.submit(fake.ref(shape=(-3, 224, 224)))  # NonNegative on the wire: fails to decode
    answers = fake.answers(undecodable)
    assert [type(m) for m in answers] == [Failed], answers
    assert answers[0].code == "bad_descriptor" and "could not be decoded" in answers[0].message
    _assert_clean_message(fake, answers[0])
    replies = fake.answers(fake.submit(fake.good))
    assert isinstance(replies[-1], Finished)
    # the worker logs it after its reply; on a loaded machine the line can reach the log a little later
    wait_until(
        lambda: "dropped an invalid message on the request channel" in spare_slot_server.log_path.read_text(),
        10,
        "the worker's log line",
    )
    assert spare_slot_server.pids("worker") == [worker]


def test_a_forged_reply_slot_gets_no_answer_and_harms_nothing(spare_slot_server: Server, fake: FakeFrontend) -> None:
    [worker] = spare_slot_server.pids("worker")
    fake.submit(fake.ref(offset=MAX), reply_slot=10_000)
    assert isinstance(fake.answers(fake.submit(fake.good))[-1], Finished)
    assert spare_slot_server.pids("worker") == [worker]


def test_http_requests_still_complete_after_the_forgeries(spare_slot_server: Server, fake: FakeFrontend) -> None:
    for seed in range(3):
        image = noise_png(900 + seed, size=64)
        response = httpx.post(
            spare_slot_server.base_url + "/v1/chat/completions",
            json=image_request("checksum", image, mime="image/png"),
            timeout=60,
        )
        assert response.status_code == 200
        assert expected_checksum(image) in response.json()["choices"][0]["message"]["content"]


# -- IPC hygiene (DESIGN invariant 8) -----------------------------------------------------------------------


def test_ipc_objects_are_0600_and_named_with_the_random_instance_id(spare_slot_server: Server) -> None:
    instance_id = spare_slot_server.instance_id
    assert re.fullmatch(r"[0-9a-f]{16}", instance_id)
    entries = [e for e in os.listdir("/dev/shm") if instance_id in e]
    assert sorted(e.rsplit(".", 1)[1] for e in entries) == ["arena", "index", "repair", "table"]
    for entry in entries:
        assert re.fullmatch(rf"(sem\.)?shmgate\.{instance_id}\.\w+", entry)
        assert stat.S_IMODE(os.stat(f"/dev/shm/{entry}").st_mode) == 0o600, entry
    inst = Instance.attach(instance_id)
    try:
        names = inst.names
        layout = inst.segment.layout
        queues = [names.request_queue] + [names.reply_queue(k) for k in range(layout.n_frontends)]
        queues += [names.control_queue(w) for w in range(layout.n_workers)]
        for name in queues:
            assert instance_id in name
            mq = posix_ipc.MessageQueue(name)
            try:
                assert stat.S_IMODE(os.fstat(mq.mqd).st_mode) == 0o600, name  # Linux: an mqd is an fd
            finally:
                mq.close()
    finally:
        inst.close()
