"""The model endpoints, in one table: each one's path, its steps (a codec over the pipeline), the models
that serve it, and what the OpenAPI document says of it.

Everything that knows the model endpoints reads ``ENDPOINTS``: the app's routes (gateway/app.py),
the interactive demand the bulk lane counts (gateway/lane.py), the endpoints a batch may name and
the steps its lines run (gateway/batch_routes.py, gateway/batch_runner.py), and the paths of
``/openapi.json`` (gateway/openapi.py). A new endpoint is its codec (a parser and an answer format,
gateway/pipeline.py ``Codec``) and a row here; docs/ARCHITECTURE.md lists the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response

from shmgate.gateway.chat_route import CHAT
from shmgate.gateway.edge import respond
from shmgate.gateway.embeddings import EmbeddingRequest, embed_steps
from shmgate.gateway.intake import ChatCompletionRequest
from shmgate.gateway.pipeline import Steps, generate
from shmgate.gateway.preprocess.base import Preprocessor
from shmgate.gateway.responses import RESPONSES, ResponsesRequest

__all__ = ["BY_PATH", "ENDPOINTS", "MODEL_PATHS", "Endpoint"]


@dataclass(frozen=True, eq=False)
class Endpoint:
    """One model endpoint: ``POST path``."""

    path: str
    steps: Steps  # the body -> the answer (gateway/pipeline.py), over HTTP (``route``) or in a batch line
    serves: Callable[[Preprocessor], bool]  # does a model serve this endpoint
    request_type: type  # the msgspec type its body decodes to: its OpenAPI request schema
    answer: str  # its answer's schema in the OpenAPI document's components (gateway/openapi.py)
    streams: bool  # with stream: true, the answer is server-sent events
    operation_id: str
    summary: str
    answer_description: str

    async def route(self, request: Request) -> Response:
        """The HTTP route: the edge (gateway/edge.py) around the steps."""
        return await respond(request, self.steps)


def _chat(pre: Preprocessor) -> bool:
    return pre.serves_chat


def _embeds(pre: Preprocessor) -> bool:
    return pre.embedding_dim is not None


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint(
        "/v1/chat/completions",
        functools.partial(generate, codec=CHAT),
        _chat,
        ChatCompletionRequest,
        "ChatCompletion",
        True,
        "chat",
        "OpenAI chat completions with images",
        "the answer: one JSON object, or server-sent events when stream is true",
    ),
    Endpoint(
        "/v1/embeddings",
        embed_steps,
        _embeds,
        EmbeddingRequest,
        "Embeddings",
        False,
        "embeddings",
        "OpenAI embeddings of images (and text, for CLIP-class models)",
        "the vectors",
    ),
    Endpoint(
        "/v1/responses",
        functools.partial(generate, codec=RESPONSES),
        _chat,
        ResponsesRequest,
        "Response",
        True,
        "responses",
        "OpenAI Responses API with input_image (no response store: store and previous_response_id are refused)",
        "the response: one JSON object, or server-sent events (response.created ... "
        "response.completed or response.incomplete) when stream is true",
    ),
)
BY_PATH = {endpoint.path: endpoint for endpoint in ENDPOINTS}
MODEL_PATHS = frozenset(BY_PATH)
