"""Copy overlapped with compute: the worker's pipeline (worker/main.py) measured with CUDA events.

Who calls this: bench/gpu.py (section "overlap"), with a real arena holding ``B`` uint8
3x224x224 images, the worker's own ``DeviceCopier`` and ``EfficientNetBackend``. It runs
``K`` batches of EfficientNet-Lite0 two ways:

- ``serial``: copy batch k, wait for the copy, run the model, read the top-5 back: the
  worker before the pipeline;
- ``pipelined``: as the worker runs now: batch k's model work is queued on the compute
  stream (which waits on the copy's event, no host wait), then batch k+1's copy is issued
  on the copy stream and waited for on the host (the prefetch thread's wait, before
  Released), then batch k's top-5 is read back.

Per batch, timing events around the copy (copy stream) and around normalise + forward +
top-k (compute stream) give copy µs, compute µs and the overlapped share of the copy
issued in that iteration: |copy ∩ compute| / copy. ``serial`` should show ~0 %, and
``pipelined`` near 100 % when a copy is shorter than a batch's compute. batches/s is by the
wall clock over all K. Without CUDA (bench/gpu.py --dry-run) the same loops run on the CPU
by wall clock only (a CPU copy is synchronous; no event columns).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shmgate.shared.wire import TensorRef
from shmgate.worker.backends.efficientnet import EfficientNetBackend
from shmgate.worker.device import Copy, DeviceCopier

__all__ = ["overlap_rows"]

TOP_K = 5


@dataclass
class _Span:
    """Two timing events on one stream (None on CPU)."""

    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None

    @classmethod
    def begin(cls, stream: torch.cuda.Stream | None) -> _Span:
        span = cls()
        if stream is not None:
            span.start = torch.cuda.Event(enable_timing=True)
            span.start.record(stream)
        return span

    def finish(self, stream: torch.cuda.Stream | None) -> None:
        if stream is not None:
            self.end = torch.cuda.Event(enable_timing=True)
            self.end.record(stream)

    def ms_from(self, base: torch.cuda.Event) -> tuple[float, float]:
        assert self.start is not None and self.end is not None
        return base.elapsed_time(self.start), base.elapsed_time(self.end)


def _copy(copier: DeviceCopier, refs: Sequence[TensorRef]) -> tuple[Copy, _Span]:
    stream = copier._stream  # the copier's copy stream (None on CPU)
    span = _Span.begin(stream)
    copy = copier.start(refs)
    span.finish(stream)
    return copy, span


def _forward(backend: EfficientNetBackend, copy: Copy, compute: torch.cuda.Stream | None) -> tuple[torch.Tensor, _Span]:
    """Queue one batch's model work on the compute stream; returns the (device) top-k indices."""
    copy.hand_to(compute)  # the compute stream waits on the copy event; the host does not
    span = _Span.begin(compute)
    with torch.inference_mode():
        x = backend.normalise(torch.stack(copy.tensors))
        top = torch.topk(torch.softmax(backend.model(x), dim=1), TOP_K, dim=1).indices
    span.finish(compute)
    return top, span


def _run(
    mode: str, backend: EfficientNetBackend, copier: DeviceCopier, refs: Sequence[TensorRef], batches: int
) -> tuple[float, list[tuple[_Span, _Span]]]:
    """K batches in ``mode``; returns wall seconds and (copy span, compute span) per batch."""
    compute = copier.compute_stream()
    pairs: list[tuple[_Span, _Span]] = []
    t0 = time.perf_counter()
    if mode == "serial":
        for _ in range(batches):
            copy, copy_span = _copy(copier, refs)
            copy.wait_host()
            top, compute_span = _forward(backend, copy, compute)
            top.cpu()
            pairs.append((copy_span, compute_span))
    else:
        following, following_span = _copy(copier, refs)
        following.wait_host()
        for _ in range(batches):
            current = following
            top, compute_span = _forward(backend, current, compute)
            following, following_span = _copy(copier, refs)  # batch k+1's copy, while batch k computes
            following.wait_host()  # the prefetch thread's wait before Released: the copy only
            top.cpu()  # the backend reads the top-k back: the host waits for batch k here
            pairs.append((following_span, compute_span))
    return time.perf_counter() - t0, pairs


def _overlap_pct(copy: _Span, compute: _Span, base: torch.cuda.Event) -> float:
    c0, c1 = copy.ms_from(base)
    k0, k1 = compute.ms_from(base)
    shared = max(0.0, min(c1, k1) - max(c0, k0))
    return 100.0 * shared / (c1 - c0) if c1 > c0 else 100.0


def overlap_rows(
    backend: EfficientNetBackend, copier: DeviceCopier, refs: Sequence[TensorRef], batches: int
) -> list[dict[str, Any]]:
    """One row per mode (serial, pipelined), after an uncounted warm-up of each."""
    cuda = copier.device.type == "cuda"
    rows = []
    for mode in ("serial", "pipelined"):
        _run(mode, backend, copier, refs, 2)  # warm-up (allocator, cuDNN algorithm choice)
        base = None
        if cuda:
            torch.cuda.synchronize(copier.device)
            base = torch.cuda.Event(enable_timing=True)
            base.record(copier.compute_stream())
        wall_s, pairs = _run(mode, backend, copier, refs, batches)
        row: dict[str, Any] = {
            "section": "overlap",
            "mode": mode,
            "batch": len(refs),
            "batches": batches,
            "batches_per_s": round(batches / wall_s, 1),
            "images_per_s": round(batches * len(refs) / wall_s, 1),
            "copy_us_p50": None,
            "compute_us_p50": None,
            "overlap_pct": None,
        }
        if base is not None:
            torch.cuda.synchronize(copier.device)
            row["copy_us_p50"] = round(statistics.median(c.start.elapsed_time(c.end) * 1e3 for c, _ in pairs), 1)
            row["compute_us_p50"] = round(statistics.median(k.start.elapsed_time(k.end) * 1e3 for _, k in pairs), 1)
            row["overlap_pct"] = round(statistics.fmean(_overlap_pct(c, k, base) for c, k in pairs), 1)
        rows.append(row)
    return rows
