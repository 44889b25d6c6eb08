"""The wire format is positional (msgpack arrays), so naming the fields at a construction must not move a byte.

These pin the encoding of each message the frontend and worker build with keywords: the same bytes as the
positional construction, and the array layout (tag first, fields in declaration order) spelled out.
"""

import msgspec

from shmgate.shared.errors import InvalidRequest
from shmgate.shared.wire import (
    Claimed,
    Failed,
    Finished,
    SamplingParams,
    Submit,
    TensorRef,
    encoder,
    failed_reply,
    gateway_decoder,
    worker_decoder,
)

REF_ARGS = (4096, 602_112, 7, "float32", (3, 224, 224), "pixels")
PARAMS = SamplingParams(max_tokens=16, temperature=0.0)


def test_submit_by_keyword_encodes_as_by_position() -> None:
    ref = TensorRef(*REF_ARGS)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    key = bytes(range(16))
    positional = Submit(9, 2, "checksum", (ref,), b"\x01", PARAMS, 123, 0, "a cat", "", parent, (key,), True)
    named = Submit(
        request_id=9,
        reply_slot=2,
        model="checksum",
        tensors=(ref,),
        inline=b"\x01",
        params=PARAMS,
        deadline_ns=123,
        attempt=0,
        text="a cat",
        task="",
        traceparent=parent,
        image_keys=(key,),
        bulk=True,
    )
    assert encoder.encode(named) == encoder.encode(positional)
    layout = msgspec.msgpack.decode(encoder.encode(named))
    assert layout[:4] == ["s", 9, 2, "checksum"] and layout[7:] == [123, 0, "a cat", "", parent, [key], True]
    assert worker_decoder.decode(encoder.encode(named)) == positional


def test_tensor_ref_by_keyword_encodes_as_by_position() -> None:
    named = TensorRef(offset=4096, nbytes=602_112, generation=7, dtype="float32", shape=(3, 224, 224), name="pixels")
    assert encoder.encode(named) == encoder.encode(TensorRef(*REF_ARGS))
    assert msgspec.msgpack.decode(encoder.encode(named)) == [4096, 602_112, 7, "float32", [3, 224, 224], "pixels"]


def test_replies_by_keyword_encode_as_by_position() -> None:
    finished = Finished(
        request_id=5, seq=3, finish_reason="length", prompt_tokens=11, completion_tokens=4, text="end", stamps=(1, 2)
    )
    assert encoder.encode(finished) == encoder.encode(Finished(5, 3, "length", 11, 4, "end", (1, 2)))
    assert msgspec.msgpack.decode(encoder.encode(finished)) == ["f", 5, 3, "length", 11, 4, "end", [1, 2]]
    claimed = Claimed(request_id=5, worker_slot=1, worker_epoch=2, claimed_ns=99)
    assert encoder.encode(claimed) == encoder.encode(Claimed(5, 1, 2, 99))
    failed = failed_reply(5, 0, InvalidRequest("bad"))
    assert encoder.encode(failed) == encoder.encode(Failed(5, 0, failed.code, "bad", failed.status_hint))
    assert gateway_decoder.decode(encoder.encode(failed)) == failed
