"""Every message that crosses a process boundary, as msgspec Structs.

Two rules for this file:
1. Only descriptors travel: offsets, sizes, dtypes, shapes, generations, ids,
   deadlines and sampling parameters. Pixels stay in the arena; small payloads
   (under ``INLINE_MAX_BYTES``) may ride inline, and the receiver knows which
   path from the descriptor alone (``TensorRef`` vs ``Submit.inline``).
2. The wire is append-only. Each kind has an explicit short tag, so renaming a
   class never changes the bytes; new fields go at the end with a default.
   ``WIRE_VERSION`` is stamped in the segment header and checked on attach.

Messages are msgpack arrays (``array_like=True``): the tag is the first element.
Nothing here is pickled.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
from msgspec import Meta, Struct

from shmgate.shared.errors import ShmgateError

__all__ = [
    "INLINE_MAX_BYTES",
    "GRAMMAR_TENSOR",
    "INLINE_GRAMMAR_BYTES",
    "INLINE_TENSOR",
    "MAX_GRAMMAR_BYTES",
    "MAX_MESSAGE_BYTES",
    "WIRE_VERSION",
    "Cancel",
    "Claimed",
    "Delta",
    "Failed",
    "Finished",
    "Released",
    "SamplingParams",
    "Submit",
    "TensorRef",
    "TokenLogprob",
    "TokenLogprobs",
    "TASK_EMBED",
    "VECTOR_CHUNK_BYTES",
    "Vector",
    "ToGateway",
    "ToWorker",
    "gateway_decoder",
    "encoder",
    "failed_reply",
    "worker_decoder",
]

WIRE_VERSION = 1

# Linux's default mq_msgsize_max is 8 KiB; every message must fit in one. Queue memory
# counts against RLIMIT_MSGQUEUE (800 KiB by default), so each channel uses the smallest
# size its messages need: requests 8 KiB, replies 4 KiB (Delta text is cut to fit), control 256 B.
MAX_MESSAGE_BYTES = 8192
REPLY_MESSAGE_BYTES = 4096
CONTROL_MESSAGE_BYTES = 256
MAX_DELTA_CHARS = 900  # 900 characters are at most 3,600 bytes of UTF-8
MAX_SUBMIT_TEXT_CHARS = 512
# TensorRef.name of a prompt payload too large to ride inline: the worker hands its bytes to the
# backend as WorkItem.inline, exactly as if it had come in Submit.inline.
INLINE_TENSOR = "__inline__"
# Payloads up to this size ride inline in a Submit; larger ones go to the arena.
INLINE_MAX_BYTES = 4096
# A response_format grammar rides in the Submit beside up to INLINE_MAX_BYTES of inline token ids, all
# within one MAX_MESSAGE_BYTES message: what is left, less the rest of the descriptor.
INLINE_GRAMMAR_BYTES = 3072
# A larger grammar (a Kubernetes-sized schema) is data like an image: it travels in the arena, as a
# uint8 tensor of this name, and the worker reads it back into SamplingParams.grammar (worker/main.py).
GRAMMAR_TENSOR = "__grammar__"
# The largest grammar a request may carry (through the arena); what bounds it in practice is its compile.
MAX_GRAMMAR_BYTES = 1 << 20
# Submit.task of an embedding request (""/absent: the model's usual answer, text).
TASK_EMBED = "embed"
# Vector.data carries at most this many bytes: a Vector message stays under REPLY_MESSAGE_BYTES with
# room for its header, so a 1280-d float32 vector (5,120 bytes) travels as two messages.
VECTOR_CHUNK_BYTES = 3072
assert VECTOR_CHUNK_BYTES + 64 <= REPLY_MESSAGE_BYTES, "a Vector piece and its header must fit one reply message"

NonNegative = Annotated[int, Meta(ge=0)]
U64 = Annotated[int, Meta(ge=0, le=2**63 - 1)]  # msgspec bounds must fit in int64

# dtypes a TensorRef may name, with their item sizes. Both sides use this table.
DTYPE_ITEMSIZE: dict[str, int] = {
    "uint8": 1,
    "int8": 1,
    "bool": 1,
    "int16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "float32": 4,
    "int64": 8,
    "float64": 8,
}


class TensorRef(Struct, array_like=True, frozen=True, gc=False):
    """Where a tensor lies in the arena. Distrusted by the worker (shared/arena.py ``validate``/``recheck``)."""

    offset: NonNegative  # absolute byte offset of the tensor's data in the segment
    nbytes: NonNegative
    generation: U64  # must equal the allocation header's generation, before and after reading
    dtype: str
    shape: tuple[NonNegative, ...]
    name: str = ""  # role of the tensor for the backend, e.g. "pixels", "pixel_values", "image_grid_thw"


# Temperatures below this sample greedily, as 0 does (OpenAI's and vLLM's reading of a tiny temperature):
# dividing logits by less overflows float32 to infinity, and a softmax over infinities is NaN. The frontend
# maps them at intake and a worker, distrusting its descriptors, again before sampling.
MIN_TEMPERATURE = 1e-5


class SamplingParams(Struct, array_like=True, frozen=True, gc=False, omit_defaults=True):
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Appended (wire rule 2): OpenAI's penalties on tokens already generated, per-token-id logit
    # biases as sorted (id, bias) pairs, and token ids that end the answer like EOS (vLLM's extension).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = -1  # -1: none; k >= 0: each sampled token's log-probability and the k likeliest (TokenLogprobs)
    # Structured outputs: the grammar every sampled token must keep to (llguidance's grammar JSON, built
    # by gateway/structured.py from response_format; at most INLINE_GRAMMAR_BYTES here, a larger one in the
    # arena as the GRAMMAR_TENSOR tensor); "" for free text.
    grammar: str = ""


class Message(Struct, tag=True, array_like=True, frozen=True):
    """Base of every message; the tag (set per subclass) is the first array element."""


class Submit(Message, tag="s"):
    """Frontend -> any worker: run this request. Shared request channel."""

    request_id: U64
    reply_slot: NonNegative  # which frontend's reply channel answers go to
    model: str
    tensors: tuple[TensorRef, ...] = ()
    inline: bytes = b""  # small payload (e.g. token ids); meaning is the backend's
    params: SamplingParams = SamplingParams()
    deadline_ns: int = 0  # CLOCK_MONOTONIC; 0 = none
    attempt: int = 0  # 0 for the first try, +1 per retry after a worker died
    text: str = ""  # the user's text, when a backend wants it (bounded by INLINE_MAX_BYTES)
    task: str = ""  # "" for the model's text answer, TASK_EMBED for an embedding vector
    # W3C traceparent of this attempt's span (shared/tracing.py), so the worker's spans join the request's
    # trace; "" when tracing is off. 55 characters, never more (the frontend writes it).
    traceparent: str = ""
    # Each image's content key (shared/vocabulary.py key_of_digest; b"" where there is none), in image order:
    # a worker keeps an image's vision-tower output under it (worker/generation/encoder_cache.py).
    image_keys: tuple[Annotated[bytes, Meta(max_length=32)], ...] = ()
    # A batch line (the bulk lane, gateway/lane.py): a worker runs it beside interactive requests, not
    # ahead of them (worker/batcher.py). Its queue priority says the same to the kernel.
    bulk: bool = False


class Cancel(Message, tag="c"):
    """Frontend -> the worker that claimed a request: stop working on it (client went away)."""

    request_id: U64
    reply_slot: NonNegative


class Claimed(Message, tag="a"):
    """Worker -> frontend: this worker took the request off the queue (it now owns the work)."""

    request_id: U64
    worker_slot: NonNegative
    worker_epoch: NonNegative
    claimed_ns: NonNegative = 0  # the worker's now_ns() when it claimed (shared/stages.py); 0: not stamped


class Released(Message, tag="r"):
    """Worker -> frontend: the worker will not read this request's tensors again."""

    request_id: U64


class Delta(Message, tag="d"):
    """Worker -> frontend: a piece of streamed output. ``seq`` counts from 0 per request."""

    request_id: U64
    seq: NonNegative
    text: str


class Finished(Message, tag="f"):
    """Worker -> frontend: the request completed normally (terminal).

    ``text`` is the last piece of output (at most MAX_DELTA_CHARS), folded in here so that an
    answer produced all at once costs one reply message instead of a Delta plus a Finished.
    """

    request_id: U64
    seq: NonNegative
    finish_reason: str  # "stop" | "length"
    prompt_tokens: NonNegative = 0
    completion_tokens: NonNegative = 0
    text: str = ""
    stamps: tuple[NonNegative, ...] = ()  # the worker's moments for this request (shared/stages.py Stamp)


class Failed(Message, tag="x"):
    """Worker -> frontend: the request failed (terminal). ``code`` is an errors.py code."""

    request_id: U64
    seq: NonNegative
    code: str
    message: str
    status_hint: int = 500


def failed_reply(request_id: int, seq: int, error: ShmgateError) -> Failed:
    """The Failed that carries ``error`` (its code, message and status); the receiver rebuilds the class
    with ``shared.errors.error_for_code``. The message is cut to fit one reply message."""
    return Failed(
        request_id=request_id,
        seq=seq,
        code=error.code,
        message=error.message[:MAX_DELTA_CHARS],
        status_hint=error.status_hint,
    )


class Vector(Message, tag="v"):
    """Worker -> frontend: a piece of an embedding, little-endian float32 bytes at ``offset``.

    An embedding is output like a Delta: its pieces come in order (offset 0 first), then one Finished.
    Why pieces: a reply message holds at most REPLY_MESSAGE_BYTES (4 KiB), and a 1280-d float32
    vector is 5 KiB; float16 would fit but loses precision that callers comparing cosines rely on.
    """

    request_id: U64
    offset: NonNegative
    data: bytes


MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_LOGPROB_TOKEN_CHARS = 32  # a token's text is cut to this, so 1 + 20 entries always fit one reply message


class TokenLogprob(Struct, array_like=True, frozen=True, gc=False):
    """One sampled token's text and log-probability, and its ``top`` alternatives as (text, logprob)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


class TokenLogprobs(Message, tag="l"):
    """Worker -> frontend: the log-probabilities of one sampled token (``SamplingParams.logprobs >= 0``).

    Sent before the Delta (or Finished) that carries the token's text, one message per token:
    with 20 alternatives of at most MAX_LOGPROB_TOKEN_CHARS characters it stays under 4 KiB.
    """

    request_id: U64
    entry: TokenLogprob


ToWorker = Union[Submit, Cancel]
ToGateway = Union[Claimed, Released, Delta, Finished, Failed, Vector, TokenLogprobs]

# Built once and reused (msgspec perf tips). Encoders and decoders are stateless.
encoder = msgspec.msgpack.Encoder()
worker_decoder: msgspec.msgpack.Decoder[ToWorker] = msgspec.msgpack.Decoder(ToWorker)
gateway_decoder: msgspec.msgpack.Decoder[ToGateway] = msgspec.msgpack.Decoder(ToGateway)
