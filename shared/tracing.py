"""OpenTelemetry tracing, the part both sides share: the flag, the exporter, the clock.

Two rules for this file:
1. Importing it imports no OpenTelemetry. Tracing is an optional extra (``pip install shmgate[otel]``)
   and is off by default; a process that is not told ``--otlp-traces-endpoint`` never loads the SDK,
   so the data path pays one ``is None`` test per hook and nothing else (gateway/tracing.py,
   worker/tracing.py hold those hooks' other side).
2. Tracing never fails or slows a request. Spans go to a ``BatchSpanProcessor``: ending a span
   appends it to a bounded in-memory queue, and a background thread exports; a collector that is
   down, slow or absent costs dropped spans and a log line, never a request's time.

Configuration is the flag plus the standard ``OTEL_*`` variables, read by the SDK itself:
``OTEL_SERVICE_NAME`` (default here: ``shmgate``), ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default: parent-based, always on),
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf``; ``grpc``
with the grpc exporter installed), ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, ``OTEL_BSP_*`` (the batch
processor's delay and queue sizes).

The trace context crosses the shared-memory hop as a W3C ``traceparent`` string in
``Submit.traceparent`` (shared/wire.py), never pickled; both processes read the same
CLOCK_MONOTONIC, so the worker's stage stamps (shared/stages.py) become span times through
``epoch_ns``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from shmgate.shared.flags import add_flag

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = ["EXTRA_HINT", "TRACES_PATH", "add_tracing_flags", "epoch_ns", "otlp_endpoint", "start_provider"]

EXTRA_HINT = "pip install shmgate[otel]"
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces, added to an endpoint given without one
# How long one export may take when OTEL_EXPORTER_OTLP_*TIMEOUT does not say. Below the SDK's 10 s:
# at exit the last export runs in the process' shutdown, and a collector that is gone should not
# hold a frontend past its drain.
EXPORT_TIMEOUT_S = 3.0
_PROTOCOLS = ("http/protobuf", "grpc")


def _epoch_offset_ns(reads: int = 9) -> int:
    """wall clock - CLOCK_MONOTONIC, from the tightest of a few bracketed reads.

    The frontend and the worker each take their own offset, and their spans are compared (a worker's
    ``batch_wait`` starts at the very stamp that ends the frontend's ``queue``): a process preempted
    between its two clock reads would shift all its spans by the time it lost, so each wall-clock read
    is bracketed by two monotonic ones and the narrowest bracket wins (well under a microsecond).
    """
    best_width, best_offset = 2**63, 0
    for _ in range(reads):
        before = time.monotonic_ns()
        wall = time.time_ns()
        after = time.monotonic_ns()
        if after - before < best_width:
            best_width, best_offset = after - before, wall - (before + after) // 2
    return best_offset


# CLOCK_MONOTONIC -> the wall clock spans carry, taken once per process. One offset for every
# stamp keeps the durations exact; an NTP step after start shifts a whole trace, never its shape.
_EPOCH_OFFSET_NS = _epoch_offset_ns()


def epoch_ns(monotonic_ns: int) -> int:
    """The wall-clock time (ns since the epoch) of a ``time.monotonic_ns()`` stamp of any process here."""
    return monotonic_ns + _EPOCH_OFFSET_NS


def otlp_endpoint(text: str) -> str:
    """The flag's type: an http(s) URL, and the extra installed. ``""`` (an empty variable): tracing off.

    Checked when the flags are parsed, so a missing extra is one line and exit status 2 before any
    process starts, not a traceback in every child. An endpoint without a path gets /v1/traces.
    """
    if not text:
        return ""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL, e.g. http://otel-collector:4318")
    if (
        importlib.util.find_spec("opentelemetry.sdk") is None
        or importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is None
    ):
        raise argparse.ArgumentTypeError(f"tracing needs the OpenTelemetry SDK and OTLP exporter: {EXTRA_HINT}")
    protocol = _protocol()
    if protocol not in _PROTOCOLS:
        raise argparse.ArgumentTypeError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} is not supported; use one of {', '.join(_PROTOCOLS)}"
        )
    if protocol == "grpc" and importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is None:
        raise argparse.ArgumentTypeError("OTLP over grpc needs pip install opentelemetry-exporter-otlp-proto-grpc")
    if protocol == "http/protobuf" and parts.path in ("", "/"):
        return text.rstrip("/") + TRACES_PATH
    return text


def add_tracing_flags(group: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--otlp-traces-endpoint``, the same for serve, gateway, the frontend child and the worker."""
    add_flag(
        group,
        "--otlp-traces-endpoint",
        "send OpenTelemetry traces (one per request, across the frontend "
        "and the worker) to this OTLP collector URL, e.g. http://otel-collector:4318; needs "
        f"{EXTRA_HINT}; OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER and the other OTEL_* variables apply",
        shown_default="off",
        type=otlp_endpoint,
        metavar="URL",
    )


def _protocol() -> str:
    return (
        (
            os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "http/protobuf"
        )
        .strip()
        .lower()
    )


def _export_timeout_s() -> float:
    text = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or os.environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")
    try:
        return float(text) / 1000 if text else EXPORT_TIMEOUT_S  # the variables are in milliseconds
    except ValueError:
        return EXPORT_TIMEOUT_S


def start_provider(endpoint: str, role: str, attributes: dict[str, str | int]) -> TracerProvider:
    """A tracer provider exporting to ``endpoint`` in the background; imports the SDK (the extra).

    ``role``: ``frontend`` or ``worker`` (the ``shmgate.role`` resource attribute; both processes share
    the service name, so one trace shows both). The sampler comes from ``OTEL_TRACES_SAMPLER``: the
    worker's spans follow the sampling decision the frontend made, carried in the traceparent's flags.
    The provider flushes at interpreter exit (the SDK's atexit hook).
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource_attributes: dict[str, str | int] = {"shmgate.role": role, **attributes}
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        resource_attributes["service.name"] = "shmgate"
    provider = TracerProvider(resource=Resource.create(resource_attributes))
    timeout_s = _export_timeout_s()
    if _protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found]
            OTLPSpanExporter as GrpcExporter,
        )

        provider.add_span_processor(BatchSpanProcessor(GrpcExporter(endpoint=endpoint, timeout=timeout_s)))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s)))
    return provider
