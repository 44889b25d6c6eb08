"""One frontend process: its configuration in, uvicorn serving the app out.

The supervisor starts it as ``python -m shmgate.gateway`` with its ``FrontendConfig`` encoded in its
environment (gateway/config.py, shared/options.py ``child_config``); nothing here parses a flag.
"""

from __future__ import annotations

import logging
import signal
import socket
from typing import TYPE_CHECKING

from shmgate.gateway.config import FrontendConfig

if TYPE_CHECKING:
    from shmgate.gateway.served import AppOptions

__all__ = ["app_options", "run_frontend"]


def app_options(config: FrontendConfig) -> AppOptions:
    """The app's options (gateway/served.py ``AppOptions``) from the frontend's configuration."""
    from shmgate.gateway.addresses import AllowList
    from shmgate.gateway.batch_store import default_batch_dir
    from shmgate.gateway.fetch import FetchPolicy
    from shmgate.gateway.frontend import FrontendLimits
    from shmgate.gateway.guards import default_allowed_hosts, parse_allowed_hosts
    from shmgate.gateway.intake import IntakeLimits
    from shmgate.gateway.served import AppOptions
    from shmgate.gateway.video import VideoLimits

    first = config.models[0]
    server, limits, image_urls, batch = (
        config.options.server,
        config.options.limits,
        config.options.image_urls,
        config.options.batch,
    )
    return AppOptions(
        instance_id=config.instance_id,
        slot=config.slot,
        model=first.model,
        served_model_name=first.served_model_name,
        api_key=server.api_key,
        metrics_need_key=config.options.observability.metrics_need_key,
        max_body_bytes=int(limits.max_body_mb * (1 << 20)),
        intake=IntakeLimits(max_images=limits.max_images, allow_image_urls=image_urls.allow_image_urls),
        limits=FrontendLimits(
            max_in_flight=limits.max_in_flight,
            request_timeout_s=limits.request_timeout_s,
            max_pixels=limits.max_pixels,
            decode_threads=limits.decode_threads,
            decode_memory_bytes=int(limits.decode_memory_mb * (1 << 20)),
            decode_wait_s=limits.decode_wait_s,
            video=VideoLimits(max_seconds=limits.max_video_seconds, max_frames=limits.max_video_frames),
        ),
        result_cache_bytes=int(limits.result_cache_mb * (1 << 20)),
        server_timing=config.options.observability.server_timing,
        allowed_hosts=parse_allowed_hosts(server.allowed_hosts) or default_allowed_hosts(server.host),
        processor_kwargs=dict(first.mm_processor_kwargs) or None,
        tool_chat_template=_text_of(server.tool_chat_template),  # tools
        models=config.models,
        created=config.started_at,
        batch_dir=batch.batch_dir or default_batch_dir(server.port),
        batch_dir_given=bool(batch.batch_dir),
        batch_max_in_flight=batch.batch_max_in_flight,
        image_urls=FetchPolicy(
            allowlist=AllowList.parse(image_urls.image_url_allowlist),
            max_bytes=image_urls.image_url_max_bytes,
            timeout_s=image_urls.image_url_timeout_s,
        ),
    )


def _text_of(path: str | None) -> str | None:
    """A file flag's text (checked readable when the flags were parsed), None without one."""
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def run_frontend(config: FrontendConfig) -> int:
    from shmgate.shared.parent_death import follow_supervisor

    # SIGKILL, not SIGTERM: shared/parent_death.py says why. Before the slow imports, so a
    # supervisor gone meanwhile is noticed at once.
    follow_supervisor(signal.SIGKILL)
    import uvicorn

    from shmgate.gateway.app import create_app

    options = config.options
    from shmgate.gateway.http_limits import ConnectionLimits, http_protocol
    from shmgate.gateway.sockets import bind_frontend

    logging.basicConfig(
        level=options.log.log_level.upper(), format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s"
    )
    # uvicorn's own fd= support wraps the descriptor as AF_UNIX, so accepted connections
    # would miss asyncio's TCP_NODELAY and keep-alive clients would hit Nagle + delayed-ACK
    # stalls of 40 ms. Wrapping it with its real family avoids that. Without an fd the frontend
    # binds a socket of its own (--listen reuseport), which uvicorn listens on after the
    # lifespan's start-up: a frontend still starting takes no connection.
    sock = (
        socket.socket(fileno=config.fd)
        if config.fd is not None
        else bind_frontend(options.server.host, options.server.port)
    )
    spans = None
    if options.tracing.otlp_traces_endpoint:  # this frontend's span hooks, handed to the app (no global)
        from shmgate.gateway.tracing import start_tracing

        spans = start_tracing(options.tracing.otlp_traces_endpoint, slot=config.slot)
    uv_config = uvicorn.Config(
        create_app(app_options(config), spans=spans),
        # a bounded request head, slow clients cut, a cap on connections (gateway/http_limits.py)
        http=http_protocol(
            ConnectionLimits(
                header_timeout_s=options.limits.header_timeout_s,
                body_timeout_s=options.limits.body_timeout_s,
                body_min_rate=options.limits.body_min_rate,
                max_connections=options.limits.max_connections,
            )
        ),
        log_level=options.log.log_level.lower() if options.log.log_level.lower() != "info" else "warning",
        timeout_graceful_shutdown=int(options.server.drain_timeout_s),
        access_log=options.observability.access_log,
        lifespan="on",
    )
    if options.observability.access_log:  # uvicorn set its access logger to --log-level, WARNING when "info" (above)
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    if spans is not None:  # after uvicorn's logging setup: the access log gains the trace id
        from shmgate.gateway.tracing import traced_app

        uv_config.app = traced_app(uv_config.app, spans, access_log=options.observability.access_log)
    uvicorn.Server(uv_config).run(sockets=[sock])
    return 0
