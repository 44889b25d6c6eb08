"""A worker's spans: each request's batch wait, device copy and compute, and one span per batch.

Imported only when the worker runs with ``--otlp-traces-endpoint`` (worker/main.py makes
``Worker.spans`` from ``start_batch_spans``; off, it is None and this module is never loaded).

Each request's spans are children of the attempt span whose W3C traceparent came in its Submit
(gateway/request_spans.py), so the trace crosses the shared-memory hop without any pickling:

    attempt                       (frontend)
    ├── batch_wait                claimed -> the batch was cut
    ├── device_copy               cut -> its tensors on the device (Released)
    └── compute                   the batch started on the model -> its final answer
                                  events: first_output, delivery (each streamed Delta sent);
                                  attributes: batch size, slot, cancelled

and one ``batch`` span per batch, in a trace of its own, links to the attempt of every request it
served: a batch of 8 is one span that eight traces point at.

A step engine (continuous batching, worker/generation/engine.py) has no batches: requests join and leave
between steps. There, each request's ``compute`` span has two children, ``prefill`` (added to the
engine -> its first output: waiting for a place, the vision tower, the prompt's chunks) and ``decode``
(first output -> final answer), and counts the steps it was in (``shmgate.steps``). Each engine step
that answered a traced request is a ``step`` span, in a trace of its own like a batch, linking to
the attempts it produced output for, with what the step ran: rows running and waiting, KV positions
held, tokens run, preemptions, encoder-cache hits and tower runs (shared/stats_layout.py
``ENGINE_FIELDS``). A step whose rows are all untraced writes nothing.

All of it is written once per batch, after the batch ran, from the stamps the worker already takes
for the stage histograms (shared/stages.py ``Stamps``, ``CLOCK_MONOTONIC``): the batch itself
gains no clock reads and no calls into the SDK.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shmgate.shared.stages import Stamp, Stamps
from shmgate.shared.stats_layout import ENGINE_FIELDS, ENGINE_GAUGES
from shmgate.shared.tracing import epoch_ns, start_provider
from shmgate.shared.wire import Submit

__all__ = ["BatchSpans", "TracedJob", "start_batch_spans"]

PROPAGATOR = TraceContextTextMapPropagator()
MAX_TRACEPARENT_CHARS = 128
MAX_STEP_LINKS = 64  # a step span links to at most this many of the requests it answered  # a descriptor is not trusted: longer is not a traceparent, so no parent


class TracedJob(Protocol):
    """What the spans read of one of the worker's jobs (worker/main.py ``_Job``)."""

    submit: Submit
    claimed_ns: int
    stamps: Stamps
    done: bool
    deliveries: list[int] | None
    steps: int


def start_batch_spans(endpoint: str, *, slot: int, model: str) -> BatchSpans:
    provider = start_provider(endpoint, "worker", {"shmgate.worker_slot": slot})
    return BatchSpans(provider.get_tracer("shmgate.worker"), slot=slot, model=model)


class BatchSpans:
    def __init__(self, tracer: trace.Tracer, *, slot: int, model: str) -> None:
        self.tracer = tracer
        self.slot = slot
        self.model = model

    def batch(self, jobs: Sequence[TracedJob], ended_ns: int, cancelled: Sequence[bool]) -> None:
        """Write the spans of a batch that ran (``ended_ns``: when it ended, ``now_ns()``).

        ``cancelled``: per job, whether its client's Cancel reached it. A job with no final stamp
        failed (the model raised, or its deadline passed): its compute span ends with the batch, as
        an error.
        """
        links: list[Link] = []
        starts = [job.stamps.values[Stamp.CUT] for job in jobs if job.stamps.values[Stamp.CUT]]
        attributes: dict[str, int | str] = {
            "shmgate.worker_slot": self.slot,
            "shmgate.batch_size": len(jobs),
            "gen_ai.request.model": self.model,
        }
        for job, was_cancelled in zip(jobs, cancelled, strict=True):
            parent = _parent(job.submit.traceparent)
            if parent is None:
                continue
            ctx = trace.get_current_span(parent).get_span_context()
            if ctx.trace_flags.sampled:
                links.append(Link(ctx, {"shmgate.request_id": f"{job.submit.request_id:x}"}))
            self._request_spans(job, parent, ended_ns, was_cancelled, attributes)
        if links and starts:
            span = self.tracer.start_span(
                "batch", context=Context(), start_time=epoch_ns(min(starts)), links=links, attributes=attributes
            )
            span.end(end_time=epoch_ns(ended_ns))

    def step(
        self,
        started_ns: int,
        ended_ns: int,
        jobs: Sequence[TracedJob],
        gauges: Sequence[int],
        added: Sequence[int],
    ) -> None:
        """Write one engine step's span (``now_ns`` stamps), linking to the sampled attempts it answered.

        ``gauges``: the engine's gauges after the step; ``added``: what its counters added during it.
        """
        links: list[Link] = []
        for job in jobs[:MAX_STEP_LINKS]:
            parent = _parent(job.submit.traceparent)
            if parent is None:
                continue
            ctx = trace.get_current_span(parent).get_span_context()
            if ctx.trace_flags.sampled:
                links.append(Link(ctx, {"shmgate.request_id": f"{job.submit.request_id:x}"}))
        if not links:
            return
        attributes: dict[str, int | str] = {
            "shmgate.worker_slot": self.slot,
            "gen_ai.request.model": self.model,
            "shmgate.step.answered": len(jobs),
        }
        for name, value in zip(ENGINE_FIELDS[:ENGINE_GAUGES], gauges, strict=True):
            attributes[f"shmgate.step.{name}"] = int(value)
        # the engine's own counters come first; the worker's shared-encoder words after them are not a step's
        for name, value in zip(ENGINE_FIELDS[ENGINE_GAUGES:], added, strict=False):
            if name not in ("steps", "step_ns"):  # one step, and the span's own length
                attributes[f"shmgate.step.{name}"] = int(value)
        span = self.tracer.start_span(
            "step", context=Context(), start_time=epoch_ns(started_ns), links=links, attributes=attributes
        )
        span.end(end_time=epoch_ns(ended_ns))

    def _request_spans(
        self, job: TracedJob, parent: Context, ended_ns: int, cancelled: bool, batch: dict[str, int | str]
    ) -> None:
        cut, copied, started, first, done = job.stamps.values
        common = {**batch, "shmgate.attempt": job.submit.attempt}
        self._span("batch_wait", parent, job.claimed_ns, cut, common)
        self._span("device_copy", parent, cut, copied, common)
        if not started:
            return
        compute = self.tracer.start_span("compute", context=parent, start_time=epoch_ns(started), attributes=common)
        if job.steps:  # a step engine: where the request's time in it went
            compute.set_attribute("shmgate.steps", job.steps)
            inside = trace.set_span_in_context(compute, parent)
            self._span("prefill", inside, started, first, common)
            self._span("decode", inside, first, done, common)
        if first:
            compute.add_event("first_output", timestamp=epoch_ns(first))
        for seq, sent_ns in enumerate(job.deliveries or ()):
            compute.add_event("delivery", {"shmgate.seq": seq}, timestamp=epoch_ns(sent_ns))
        if cancelled:
            compute.set_attribute("shmgate.cancelled", True)
            compute.add_event("cancelled", {"reason": "the client hung up"})
        if not done:
            compute.set_status(Status(StatusCode.ERROR, "no final answer: the model failed or the request expired"))
        compute.end(end_time=epoch_ns(done or ended_ns))

    def _span(self, name: str, parent: Context, start_ns: int, end_ns: int, attributes: dict[str, int | str]) -> None:
        if 0 < start_ns <= end_ns:
            span = self.tracer.start_span(name, context=parent, start_time=epoch_ns(start_ns), attributes=attributes)
            span.end(end_time=epoch_ns(end_ns))


def _parent(traceparent: str) -> Context | None:
    """The attempt's context from a Submit's traceparent; None when there is none or it does not parse."""
    if not traceparent or len(traceparent) > MAX_TRACEPARENT_CHARS:
        return None
    parent = PROPAGATOR.extract({"traceparent": traceparent})
    if not trace.get_current_span(parent).get_span_context().is_valid:
        return None
    return parent
