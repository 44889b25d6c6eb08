"""How a request is served, handed down with it: its lane and its tracing.

Nothing on the request path reads ambient state (a context variable, a module global): the edge
(gateway/edge.py) and the batch runner (gateway/batch_runner.py) say how a request is served when they
hand it to the pipeline (gateway/pipeline.py ``Arrival.context``), and the pipeline hands this down
to ``Frontend.submit`` and the image resolver. A request's own trace context is OpenTelemetry's
(the current span, set by the server span's middleware or the batch line's span).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shmgate.gateway.request_spans import RequestSpans

__all__ = ["INTERACTIVE_REQUEST", "RequestContext"]


@dataclass(frozen=True)
class RequestContext:
    """``bulk``: a batch line, served in the bulk lane (gateway/lane.py: its descriptor at the request
    queue's lower priority, its decodes in the bulk pool); ``spans``: this frontend's tracing hooks
    (gateway/request_spans.py), None when tracing is off, which is then a test of this field and no more."""

    bulk: bool = False
    spans: RequestSpans | None = None


INTERACTIVE_REQUEST = RequestContext()  # an interactive request, untraced: the default where none is given
