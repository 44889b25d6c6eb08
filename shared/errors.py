"""The exception tree of shmgate.

Every error a component raises on purpose is one of these. Each class carries a
``status_hint`` (the HTTP status a server should answer with, as h11 does) and a
``code`` (the OpenAI-style machine-readable code); the mapping to an HTTP
response happens in one place, ``gateway/http_errors.py``.

    ShmgateError
    ├── TransportError            the shared-memory transport failed us
    │   ├── ArenaFull             no space in the arena, even after eviction
    │   ├── ChannelFull           a message queue stayed full past its timeout
    │   ├── PeerDied              the process on the other side is gone
    │   ├── RequestTimeout        no answer within the request's deadline
    │   └── SetupError            IPC objects cannot be created / attached
    ├── DescriptorError           a descriptor failed validation on the reading side
    │   ├── OutOfBounds           offset / size outside the arena or overflowing
    │   ├── InconsistentTensor    dtype x shape does not match nbytes
    │   └── StaleGeneration       the allocation was freed or reused
    ├── RequestError              the client sent something we will not serve
    │   ├── InvalidRequest
    │   ├── UnknownModel
    │   ├── NotFound              no file or batch with that id (404)
    │   ├── Conflict              a call its object's state does not allow (409)
    │   ├── TooManyImages
    │   ├── ImageTooLarge
    │   ├── UndecodableImage
    │   │   └── UndecodableVideo  a video_url part that is not a video this server decodes
    │   ├── InvalidImageURL       an image URL that cannot be fetched (bad URL, HTTP error)
    │   │   ├── ImageURLForbidden a URL whose address may not be fetched (SSRF rules)
    │   │   └── ImageURLTimeout   the fetch did not finish within its time cap
    │   ├── UnsupportedMediaType  a body sent as anything but JSON (415)
    │   ├── HostNotAllowed        a Host header this gateway does not answer for (421)
    │   ├── UnsupportedTransferCoding  a transfer coding other than chunked alone (501)
    │   └── Unauthorized
    ├── ModelError                the model raised, or gave no final answer, on a batch
    ├── Cancelled                 the client went away; the worker dropped the request (never sent to it)
    └── Overloaded                a bound was reached; retry after ``retry_after_s``

Across the reply channel a failure travels as its ``code`` (``shared.wire.Failed``): the sender
builds the Failed from an instance (``shared.wire.failed_reply``), and the receiver turns the code back into its
class with ``error_for_code``, so both ends speak in these classes and no status or code is written
as a literal anywhere else.

Messages are written for the person reading them and never contain the name of
an IPC object (Triton's CVE chain started with a leaked shm name).
"""

from __future__ import annotations

__all__ = [
    "ArenaFull",
    "Cancelled",
    "ChannelFull",
    "Conflict",
    "DescriptorError",
    "HostNotAllowed",
    "ImageTooLarge",
    "ImageURLForbidden",
    "ImageURLTimeout",
    "InconsistentTensor",
    "InvalidImageURL",
    "InvalidRequest",
    "ModelError",
    "NotFound",
    "OutOfBounds",
    "Overloaded",
    "PeerDied",
    "RequestTimeout",
    "RequestError",
    "SetupError",
    "ShmgateError",
    "StaleGeneration",
    "TooManyImages",
    "TransportError",
    "Unauthorized",
    "UnsupportedTransferCoding",
    "UndecodableImage",
    "UndecodableVideo",
    "UnknownModel",
    "UnsupportedMediaType",
    "error_for_code",
]


class ShmgateError(Exception):
    """Base of every deliberate shmgate error."""

    status_hint: int = 500
    code: str = "internal_error"
    error_type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, param={self.param!r})"


# -- transport ---------------------------------------------------------------


class TransportError(ShmgateError):
    """The shared-memory transport could not do what was asked."""

    status_hint = 503
    code = "transport_error"


class ArenaFull(TransportError):
    """Raised by an allocator when the partition has no room even after eviction."""

    status_hint = 503
    code = "arena_full"
    # The partition bytes the tensor that did not fit needs (0: unknown): with the request's other
    # tensors it tells a request that can never fit (413) from one that waits for others' holds.
    needed_bytes: int = 0


class ChannelFull(TransportError):
    """Raised when a message queue stayed full for longer than the caller's timeout."""

    status_hint = 503
    code = "channel_full"


class PeerDied(TransportError):
    """Raised when the process serving a request died before it produced output we could keep."""

    status_hint = 502
    code = "worker_died"


class RequestTimeout(TransportError):
    """The request's deadline passed before its worker answered."""

    status_hint = 504
    code = "timeout"


class SetupError(TransportError):
    """IPC objects could not be created or attached (no space in /dev/shm, version mismatch, ...)."""

    code = "setup_error"


# -- descriptors ---------------------------------------------------------------


class DescriptorError(ShmgateError):
    """A descriptor failed validation in the worker; the request fails, the worker carries on."""

    status_hint = 500
    code = "bad_descriptor"


class OutOfBounds(DescriptorError):
    """Offset or size point outside the arena, outside a partition, or overflow."""


class InconsistentTensor(DescriptorError):
    """dtype x shape does not equal the number of bytes the descriptor claims."""


class StaleGeneration(DescriptorError):
    """The allocation header's generation differs from the descriptor's: freed or reused."""


# -- requests ------------------------------------------------------------------


class RequestError(ShmgateError):
    """The client's request is wrong; answered with a 4xx."""

    status_hint = 400
    code = "invalid_request"
    error_type = "invalid_request_error"


class InvalidRequest(RequestError):
    """Malformed JSON, a missing field, a value out of range."""


class UnknownModel(RequestError):
    status_hint = 404
    code = "model_not_found"


class NotFound(RequestError):
    """No file or batch with the id the client named (gateway/batch_routes.py)."""

    status_hint = 404
    code = "not_found"


class Conflict(RequestError):
    """The thing named is in a state that does not allow the call (a finished batch cancelled)."""

    status_hint = 409
    code = "invalid_state"


class TooManyImages(RequestError):
    code = "too_many_images"


class ImageTooLarge(RequestError):
    """The image (encoded bytes or decoded pixels) exceeds the configured bound."""

    status_hint = 413
    code = "image_too_large"


class RequestTooLarge(RequestError):
    """The request body exceeds ``--max-body-mb`` (whatever it holds: images are checked on their own)."""

    status_hint = 413
    code = "request_too_large"


class UndecodableImage(RequestError):
    """Not an image, a truncated one, or a format we do not accept."""

    code = "invalid_image"


class UndecodableVideo(UndecodableImage):
    """A video part's bytes are not a container this server reads, hold no stream it decodes, or are corrupt.

    A subclass of UndecodableImage: whatever refuses an undecodable input refuses this one too; only the
    code (and the message) say which kind of input it was."""

    code = "invalid_video"


class InvalidImageURL(RequestError):
    """An http(s) image URL that is malformed, unreachable, or answered with a non-2xx status."""

    code = "invalid_image_url"


class ImageURLForbidden(InvalidImageURL):
    """The URL's scheme, userinfo or resolved address is refused by the fetch rules (gateway/fetch.py)."""

    code = "image_url_forbidden"


class ImageURLTimeout(InvalidImageURL):
    """Fetching the image took longer than its cap. A 400, not a 504: the slow party is the
    server the client chose, and retrying against us will not help."""

    code = "image_url_timeout"


class UnsupportedMediaType(RequestError):
    """The body's Content-Type is not JSON."""

    status_hint = 415
    code = "unsupported_media_type"


class HostNotAllowed(RequestError):
    """The ``Host`` header names a host this gateway is not configured to answer for."""

    status_hint = 421
    code = "host_not_allowed"


class UnsupportedTransferCoding(RequestError):
    """A Transfer-Encoding other than ``chunked`` alone (RFC 9112 sec. 6.1: a server answers 501)."""

    status_hint = 501
    code = "unsupported_transfer_coding"


class Unauthorized(RequestError):
    status_hint = 401
    code = "invalid_api_key"
    error_type = "authentication_error"


# -- worker-side outcomes -------------------------------------------------------


class ModelError(ShmgateError):
    """The model raised on a batch, or finished it without a final answer for this request."""

    code = "model_error"


class Cancelled(ShmgateError):
    """The client cancelled (disconnected); the worker answers so the frontend can free the request.

    499 is nginx's "client closed request": no client ever reads it, it only tells the counters.
    """

    status_hint = 499
    code = "cancelled"
    error_type = "invalid_request_error"


# -- overload ------------------------------------------------------------------


class Overloaded(ShmgateError):
    """A bound was reached (in-flight requests, arena, queue); the client should retry later."""

    status_hint = 503
    code = "overloaded"
    error_type = "server_error"

    def __init__(self, message: str, *, retry_after_s: float = 1.0, status_hint: int = 503) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status_hint = status_hint


# -- the code registry -----------------------------------------------------------

# Each code names one class: where subclasses share a code (DescriptorError's), the base is listed.
_BY_CODE: dict[str, type[ShmgateError]] = {
    cls.code: cls
    for cls in (
        ShmgateError,
        TransportError,
        ArenaFull,
        ChannelFull,
        PeerDied,
        RequestTimeout,
        SetupError,
        DescriptorError,
        InvalidRequest,
        UnknownModel,
        NotFound,
        Conflict,
        TooManyImages,
        ImageTooLarge,
        RequestTooLarge,
        UndecodableImage,
        InvalidImageURL,
        ImageURLForbidden,
        ImageURLTimeout,
        Unauthorized,
        UnsupportedMediaType,
        HostNotAllowed,
        UnsupportedTransferCoding,
        ModelError,
        Cancelled,
        Overloaded,
    )
}


def error_for_code(code: str, message: str) -> ShmgateError:
    """The error a Failed reply's ``code`` stands for, with the sender's message.

    A code this side does not know (a newer peer) still gives a ShmgateError carrying that code,
    so the client sees what the worker said.
    """
    cls = _BY_CODE.get(code)
    if cls is None:
        error = ShmgateError(message)
        error.code = code
        return error
    return cls(message)


# -- process exit codes the supervisor acts on -----------------------------------

# A failure at run time with no more specific code below: the process was serving and had to
# stop (the gateway instance it served vanished, its supervisor died). Restarting it may help.
EXIT_FAILURE = 1
# The command could not start: a bad flag value, or a setup failure before anything was served
# (no IPC resources, no gateway to attach to). argparse exits with 2 on a usage error, so every
# "this start cannot work as asked" exit of shmgate's commands reads the same.
EXIT_USAGE = 2
# A child that exits with EXIT_CONFIG failed on its configuration (an unknown model, a missing
# model directory, a model id too long): restarting it cannot help, so ``shmgate serve`` stops
# with the reason instead of restarting it forever (sysexits.h EX_CONFIG).
EXIT_CONFIG = 78
# A worker that found itself declared dead (slot marked DEAD or taken over) exits with this.
EXIT_DECLARED_DEAD = 75
# A worker whose device hit a sticky error (a device-side assert poisons the CUDA context).
EXIT_DEVICE_ERROR = 76
