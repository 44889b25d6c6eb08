"""What every route of one frontend process reads: its options, its frontend, the request's key and body.

The routes are plain module-level functions (gateway/app.py, gateway/chat_route.py,
gateway/embeddings.py); the process's state is one ``Served`` on ``app.state``, set by the
lifespan once the frontend is attached, so no route closes over a cell that fills in later.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect, Request

from shmgate.gateway.fetch import FetchPolicy
from shmgate.gateway.frontend import Frontend, FrontendLimits
from shmgate.gateway.guards import require_json
from shmgate.gateway.http_limits import read_capped
from shmgate.gateway.intake import IntakeLimits
from shmgate.gateway.result_cache import ResultCache
from shmgate.shared.errors import Cancelled, InvalidRequest, RequestTooLarge, Unauthorized
from shmgate.shared.model_config import ModelConfig
from shmgate.shared.transport import NodeStats

if TYPE_CHECKING:
    from shmgate.gateway.request_spans import RequestSpans

__all__ = ["AppOptions", "Served", "bypass_cache", "read_body", "served"]


@dataclass(frozen=True)
class AppOptions:
    instance_id: str
    slot: int
    model: str
    served_model_name: str = ""  # --served-model-name: the id clients send, over the spec's default
    api_key: str | None = None
    metrics_need_key: bool = False
    max_body_bytes: int = 32 << 20
    intake: IntakeLimits = IntakeLimits()
    limits: FrontendLimits = FrontendLimits()
    image_urls: FetchPolicy = field(default_factory=FetchPolicy)  # used only when intake.allow_image_urls is set
    result_cache_bytes: int = 0  # deterministic answers kept per frontend (gateway/result_cache.py); 0: off
    processor_kwargs: dict[str, Any] | None = None  # --mm-processor-kwargs (hf: models)
    tool_chat_template: str | None = None  # tools: --tool-chat-template's text (gateway/tool_prompt.py)
    server_timing: bool = False  # --server-timing: per-stage durations in a Server-Timing header
    allowed_hosts: tuple[str, ...] = ("*",)  # --allowed-hosts: Host header names answered (gateway/guards.py)
    # every model the node serves, as the supervisor resolved them (node/models.py); empty: ``model``
    # alone, with ``served_model_name`` and ``processor_kwargs``
    models: tuple[ModelConfig, ...] = ()
    created: int = 0  # when the node started serving (Unix seconds; /v1/models); 0: this process's start
    batch_dir: str = ""  # --batch-dir (gateway/batch_store.py); empty: the Batch API is off (an app built alone)
    batch_dir_given: bool = False  # --batch-dir was set: a directory that cannot be opened stops the frontend
    batch_max_in_flight: int = 4  # --batch-max-in-flight (gateway/batch_runner.py)


@dataclass(frozen=True)
class Served:
    """One frontend process's serving state, built by the lifespan."""

    options: AppOptions
    frontend: Frontend
    node: NodeStats  # the whole node's counters, for /metrics
    results: ResultCache | None  # deterministic answers (--result-cache-mb); None: off
    spans: RequestSpans | None = None  # this frontend's tracing hooks (gateway/tracing.py); None: off

    def check_key(self, request: Request) -> None:
        """Raise Unauthorized unless the request carries the API key (when one is set)."""
        if self.options.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.options.api_key.encode()):
            raise Unauthorized("missing or invalid API key; send 'Authorization: Bearer <key>'")


def served(request: Request) -> Served:
    """The serving state of the process answering ``request``."""
    state: Served = request.app.state.served
    return state


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most ``limit`` bytes.

    Raises RequestTooLarge, InvalidRequest (empty), and Cancelled when the client closed the
    connection before the whole body arrived: that is a hang-up, answered (to nobody) and counted
    like any other error instead of escaping to uvicorn, which would log a traceback for each one.
    """
    require_json(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    try:
        body = await read_capped(declared, request.stream(), limit, "the request body", RequestTooLarge)
    except ClientDisconnect:
        raise Cancelled("the client closed the connection before sending the whole body") from None
    if not body:
        raise InvalidRequest("the request body is empty; send a JSON chat completion request")
    return body


def bypass_cache(request: Request) -> bool:
    """``Cache-Control: no-cache``: compute the answer afresh (it is still stored)."""
    return "no-cache" in request.headers.get("cache-control", "").lower()
