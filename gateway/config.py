"""A frontend's configuration: the flags it reads (declared here, once) and what the supervisor adds.

``shmgate serve`` and ``shmgate gateway`` take these flags (node/config.py's configurations hold a
``FrontendOptions``), build the whole configuration once, and hand each frontend its ``FrontendConfig``
(those options and what the supervisor decided) as one encoded value (shared/options.py ``encode``, in the
child's environment: the API key is part of it, and argv is visible in ps). A frontend never parses a flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import ClassVar

from shmgate.gateway.sockets import LISTEN_MODES
from shmgate.shared import flag_types
from shmgate.shared.common_options import LogOptions
from shmgate.shared.model_config import ModelConfig
from shmgate.shared.options import option, part
from shmgate.shared.tracing import TracingOptions

__all__ = [
    "BatchOptions",
    "FrontendConfig",
    "FrontendOptions",
    "ImageUrlOptions",
    "LimitOptions",
    "ObservabilityOptions",
    "ServerOptions",
]


def _allowlist(text: str) -> str:
    """Validate the allow-list when the flags are parsed, so a typo stops ``serve`` at once."""
    from shmgate.gateway.addresses import AllowList

    try:
        AllowList.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _readable_file(text: str) -> str:
    """Check a file flag names a readable file when the flags are parsed."""
    try:
        with open(text, encoding="utf-8") as f:
            f.read(1)
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}: {exc}") from None
    return text


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    GROUP: ClassVar[str] = "server"
    host: str = option("address to listen on (0.0.0.0: every interface)", default="127.0.0.1")
    port: int = option("TCP port to listen on", default="8000", type=flag_types.port)
    listen: str = option(
        "shared: the frontends accept from one listening socket; reuseport: each frontend listens "
        "on its own socket on the same port (SO_REUSEPORT) and the kernel spreads new connections "
        "over the live ones (docs/DEPLOY.md)",
        default="shared",
        type=flag_types.choice(*LISTEN_MODES),
        metavar="{" + ",".join(LISTEN_MODES) + "}",
    )
    api_key: str | None = option(
        "key clients must send as 'Authorization: Bearer KEY' (/health and /ready stay open); prefer the "
        "environment variable: a flag is visible in ps",
        shown_default="none: no key needed",
    )
    allowed_hosts: str = option(
        "comma list of host names the Host header may carry ('*': any); empty: "
        "the loopback names when --host is a loopback address, else any; others get 421 (docs/SECURITY.md)",
        default="",
        shown_default="loopback names for a loopback --host, else *",
    )
    drain_timeout_s: float = option(
        "on SIGTERM, how long requests in flight may take to finish",
        default="30",
        type=flag_types.non_negative_float,
    )
    tool_chat_template: str | None = option(  # tools: read by gateway/tool_prompt.py
        "hf: chat models: a Jinja chat template file for requests with tools, calls or tool results, used "
        "instead of the checkpoint's template (it reads tools; docs/MODELS.md 'Tool calling')",
        shown_default="none: the checkpoint's template if it reads tools, else the family's tool format",
        type=_readable_file,
    )


@dataclass(frozen=True, kw_only=True)
class LimitOptions:
    GROUP: ClassVar[str] = "limits"
    max_images: int = option("images per request; more get 400", default="8", type=flag_types.positive_int)
    max_in_flight: int = option(
        "requests in flight per frontend; beyond it requests get 429", default="256", type=flag_types.positive_int
    )
    request_timeout_s: float = option(
        "a request not answered in this long gets 504", default="60", type=flag_types.positive_float
    )
    max_body_mb: float = option(
        "request body size in MiB; larger gets 413", default="32", type=flag_types.positive_float
    )
    max_pixels: int = option(
        "largest 8-bit RGB image decoded; other modes get the same memory, so "
        "16-bit gray or transparent images get fewer pixels; larger gets 413",
        default="40000000",
        type=flag_types.positive_int,
    )
    max_video_seconds: float = option(
        "longest video (by its container's duration) decoded; longer gets 413",
        default="600",
        type=flag_types.positive_float,
    )
    max_video_frames: int = option(
        "most frames sampled and decoded from one video; more gets 413", default="768", type=flag_types.positive_int
    )
    decode_threads: int = option("image decoding threads per frontend", default="2", type=flag_types.positive_int)
    decode_memory_mb: float = option(
        "memory (MiB) one frontend's concurrent image decodes may use "
        "together; a decode waits for room, then gets a 503; an image that alone needs more gets a 413",
        default="512",
        type=flag_types.positive_float,
    )
    header_timeout_s: float = option(
        "per connection: a request line and headers must arrive within this "
        "many seconds of the connection's start or the previous response's end, else 408 and close",
        default="10",
        type=flag_types.positive_float,
    )
    body_timeout_s: float = option(
        "a request body must arrive within this many seconds, plus one per "
        "--body-min-rate bytes received, else 408 and close",
        default="30",
        type=flag_types.positive_float,
    )
    body_min_rate: float = option(
        "bytes per second of body that extend --body-timeout-s by a second",
        default="500",
        type=flag_types.positive_float,
    )
    max_connections: int = option(
        "per frontend: open connections beyond this get a 503 and are closed (keep it under ulimit -n)",
        default="1000",
        type=flag_types.positive_int,
    )
    decode_wait_s: float = option(
        "how long a decode waits for room in --decode-memory-mb before a 503",
        default="5",
        type=flag_types.non_negative_float,
    )
    result_cache_mb: float = option(
        "per frontend: keep this many MiB of deterministic answers "
        "(embeddings, the classifier's), so a repeated input skips the worker; Cache-Control: no-cache "
        "bypasses it; 0: off (docs/MODELS.md)",
        default="0",
        type=flag_types.non_negative_float,
    )


@dataclass(frozen=True, kw_only=True)
class ImageUrlOptions:
    GROUP: ClassVar[str] = "image URLs"
    allow_image_urls: bool = option("fetch http(s) image URLs (docs/SECURITY.md)", on_off=True)
    image_url_allowlist: str = option(
        "comma list of CIDRs / host names that image URLs may reach besides public addresses",
        default="",
        shown_default="none",
        type=_allowlist,
    )
    image_url_max_bytes: int = option("largest image a URL may return", default="20MiB", type=flag_types.size)
    image_url_timeout_s: float = option(
        "time to fetch one image URL, redirects included", default="10", type=flag_types.positive_float
    )


@dataclass(frozen=True, kw_only=True)
class ObservabilityOptions:
    GROUP: ClassVar[str] = "observability"
    access_log: bool = option("log one line per HTTP request (uvicorn's access log, in each frontend)", on_off=True)
    metrics_need_key: bool = option("/metrics asks for the API key too", on_off=True)
    server_timing: bool = option(
        "add a Server-Timing header (ms per serving stage) to non-streamed "
        "answers; it tells a client how long its image waited and was decoded (docs/SECURITY.md)",
        on_off=True,
    )


@dataclass(frozen=True, kw_only=True)
class BatchOptions:
    GROUP: ClassVar[str] = "batch API"
    batch_dir: str = option(
        "directory of the Batch API's files and batches (SQLite; every frontend opens it, one runs the "
        "batches); created 0700 (docs/BATCH.md)",
        default="",
        shown_default="$XDG_STATE_HOME/shmgate/batches/port-PORT, else ~/.local/state/shmgate/batches/port-PORT",
    )
    batch_max_in_flight: int = option(
        "batch lines in flight on the node at once when it is quiet; beside interactive requests, both "
        "together within it, a quarter of it at most for lines (docs/BATCH.md, 'Fairness')",
        default="4",
        type=flag_types.positive_int,
    )


@dataclass(frozen=True, kw_only=True)
class FrontendOptions:
    """Every flag a frontend reads, by the part of it that reads them (the order is ``--help``'s)."""

    server: ServerOptions = part(ServerOptions)
    limits: LimitOptions = part(LimitOptions)
    image_urls: ImageUrlOptions = part(ImageUrlOptions)
    observability: ObservabilityOptions = part(ObservabilityOptions)
    log: LogOptions = part(LogOptions)
    tracing: TracingOptions = part(TracingOptions)
    batch: BatchOptions = part(BatchOptions)


@dataclass(frozen=True, kw_only=True)
class FrontendConfig:
    """One frontend's whole configuration, built by the supervisor (node/plan.py ``frontend_config``)."""

    options: FrontendOptions = part(FrontendOptions)  # as parsed (--allowed-hosts decided once)
    instance_id: str = ""
    slot: int = 0
    fd: int | None = None  # the shared listening socket (--listen shared); None: bind one's own
    models: tuple[ModelConfig, ...] = ()  # every model the node serves, as the supervisor resolved them
    started_at: int = 0  # when the supervisor started (Unix seconds): /v1/models's ``created``, the same everywhere
