"""GPU path benchmark: host-to-device copies out of the shmgate arena, and serving on a GPU.

Why: a GPU worker's one copy is a DMA straight out of the shared-memory arena, which
``worker/device.py`` registers as pinned host memory (``cudaHostRegister``). This script checks
that this really runs at pinned speed (not at pageable speed) and what end-to-end throughput and
GPU busy fraction ``shmgate serve --device cuda`` reaches.

What it measures, in one run:

1. H2D copies for 150,528 B (3x224x224 uint8), 2,408,448 B (3x448x448 float32) and
   12,582,912 B (3x1024x1024 float32), side by side, from
   - ``arena``: a tensor allocated in a real ``Instance``'s 1 GiB arena (Partition of frontend
     slot 0), the whole mapping registered by ``worker.device.DeviceCopier`` itself, copied with
     ``non_blocking=True`` on the copier's side stream;
   - ``arena_copier``: ``DeviceCopier.copy`` (start, host wait for the event, hand-over to the
     current stream: one copy as the worker makes it, without the pipeline), timed by the wall clock;
   - ``pageable``: ``torch.empty(..., pin_memory=False)``;
   - ``pinned``: a staging buffer from ``torch.empty(..., pin_memory=True)``;
   - ``peak``: one 256 MiB pinned buffer, the bus's practical peak.
   GB/s comes from back-to-back copies between two CUDA events (rounds rotate over the sources,
   median of rounds); latency p50/p99 from one copy at a time between CUDA events (wall-clock p50
   alongside). Every source is checked to arrive byte-exact on the device.
2. Copy overlapped with compute (bench/gpu_overlap.py): 8 uint8 3x224x224 images in the arena,
   EfficientNet-Lite0 batches run ``serial`` (copy, wait, compute: the worker before its pipeline)
   and ``pipelined`` (batch k+1's copy on the copy stream while batch k computes, as
   worker/main.py does); per mode batches/s, copy and compute µs (CUDA events) and the share of
   each copy that overlapped compute.
3. End to end (unless ``--skip-serve``): ``shmgate serve --model efficientnet-lite0 --device cuda
   --frontends F --workers-per-gpu W`` for F = 1 and min(8, cores - 2) (or ``--frontends``) and W = 1, 2, 4,
   and with ``--litserve`` bench/litserve_server.py (same model code, ``--accelerator cuda``, W workers on
   the GPU) in the same run, each driven by ``bench_client.loadgen`` with ``--unique`` (every request a cache
   miss) at concurrency 1, 8, 32 and 128 on the 1024 px photos of tests/data/images, after an uncounted
   warm-up run. The GPU busy fraction is sampled every 100 ms during the timed run, from
   ``torch.cuda.utilization()`` (needs pynvml / nvidia-ml-py) or else from
   ``nvidia-smi --query-gpu=utilization.gpu`` run once per tick; the result names which. Servers start in
   their own session and are stopped as a process group (SIGTERM, then SIGKILL); /dev/shm is
   compared before and after.

Without CUDA it prints one line saying so and exits 0. ``--dry-run`` runs everything except CUDA
calls (arena instance, allocation, fill, validation, DeviceCopier's CPU path, unlink; the overlap
loops on the CPU; and, unless ``--skip-serve``, a tiny serve run with ``--device cpu``), so the
script can be smoke-tested anywhere.

Usage: ``python bench/gpu.py [--quick] [--json] [--skip-serve] [--skip-overlap] [--dry-run] [--litserve]
[--workers-per-gpu W ...] [--concurrency C ...] [--frontends F ...] [--out FILE]``; bench/gpu_run.sh runs it
on the GPU machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.e2e import IMAGES, LITSERVE_PYTHON, ServerProcess, fmt, free_port, render_table  # noqa: E402
from bench.gpu_overlap import overlap_rows  # noqa: E402
from shmgate.bench_client import loadgen  # noqa: E402
from shmgate.shared.arena import Allocation, Partition, validate  # noqa: E402
from shmgate.shared.errors import SetupError  # noqa: E402
from shmgate.shared.instance import Instance  # noqa: E402
from shmgate.shared.segment import SlotState  # noqa: E402
from shmgate.shared.wire import TensorRef  # noqa: E402
from shmgate.worker.backends.efficientnet import EfficientNetBackend  # noqa: E402
from shmgate.worker.device import TORCH_DTYPES, DeviceCopier  # noqa: E402

SIZES: list[tuple[str, tuple[int, ...]]] = [
    ("uint8", (3, 224, 224)),  # 150,528 B
    ("float32", (3, 448, 448)),  # 2,408,448 B
    ("float32", (3, 1024, 1024)),  # 12,582,912 B
]
PEAK_BYTES = 256 << 20
OVERLAP_BATCH = 8  # images per batch in the overlap section (the worker's default max batch)
MODEL = "efficientnet-lite0"
NO_CUDA = "bench/gpu.py: these measurements need a CUDA device (torch.cuda.is_available() is false); skipping."


@dataclass(frozen=True)
class Plan:
    """How much to measure: quick or full."""

    latency_iters: int
    batch_bytes: int  # bytes per back-to-back bandwidth batch, per source and size
    rounds: int  # bandwidth batches per source and size (rotating over the sources)
    peak_batch: int
    requests: int
    overlap_batches: int  # model batches per mode in the overlap section


QUICK = Plan(latency_iters=50, batch_bytes=128 << 20, rounds=3, peak_batch=4, requests=160, overlap_batches=30)
FULL = Plan(latency_iters=400, batch_bytes=512 << 20, rounds=5, peak_batch=8, requests=400, overlap_batches=200)
DRY_OVERLAP_BATCHES = 3


# -- output -----------------------------------------------------------------------------------------


def emit(row: dict[str, Any], args: argparse.Namespace) -> None:
    """JSON line on stdout with --json, else a progress line on stderr."""
    if args.json:
        print(json.dumps(row), flush=True)
    else:
        brief = {k: v for k, v in row.items() if k != "section"}
        print(f"  {row['section']}: {brief}", file=sys.stderr, flush=True)


def h2d_table(rows: list[dict[str, Any]]) -> str:
    columns = ["source", "shape, dtype", "timing", "size (bytes)", "GB/s", "x peak", "p50 µs", "p99 µs", "wall p50 µs"]
    return render_table(
        columns,
        [
            [
                r["source"],
                f"{r['shape']}, {r['dtype']}",
                r["timing"],
                f"{r['size_bytes']:,}",
                fmt(r["gb_per_s"], 2),
                fmt(r.get("ratio_to_peak"), 2),
                fmt(r["p50_us"]),
                fmt(r["p99_us"]),
                fmt(r["wall_p50_us"]),
            ]
            for r in rows
        ],
        left=3,
    )


def e2e_table(rows: list[dict[str, Any]]) -> str:
    columns = [
        "server",
        "workers/GPU",
        "busy source",
        "frontends",
        "conc",
        "req/s",
        "p50 ms",
        "p99 ms",
        "errors",
        "mismatches",
        "GPU busy % (mean)",
        "GPU busy % (max)",
        "samples",
    ]
    return render_table(
        columns,
        [
            [
                r["server"],
                r["workers_per_gpu"],
                r["gpu_busy_source"],
                r["frontends"],
                r["concurrency"],
                r["requests_per_s"],
                fmt(r["p50_ms"]),
                fmt(r["p99_ms"]),
                r["errors"],
                r["mismatches"],
                fmt(r["gpu_busy_pct"]),
                fmt(r["gpu_busy_max_pct"], 0),
                r["gpu_busy_samples"],
            ]
            for r in rows
        ],
    )


def percentiles(samples: list[float]) -> tuple[float | None, float | None]:
    return loadgen.percentile(samples, 50), loadgen.percentile(samples, 99)


# -- /dev/shm bookkeeping ------------------------------------------------------------------------


def shm_names() -> set[str]:
    """shmgate's objects in /dev/shm (arenas and semaphores)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(("shmgate.", "sem.shmgate."))}
    except OSError:
        return set()


# -- the arena fixture ---------------------------------------------------------------------------


@dataclass
class ArenaTensor:
    """One test tensor in the arena: its allocation, descriptor and a zero-copy torch view."""

    allocation: Allocation
    ref: TensorRef
    view: torch.Tensor  # torch.frombuffer over the arena, exactly as DeviceCopier builds it


@contextmanager
def arena_tensors(
    arena_size: int, seed: int = 0, *, shapes: list[tuple[str, tuple[int, ...]]] = SIZES
) -> Iterator[tuple[Instance, list[ArenaTensor]]]:
    """A real instance with one frontend partition holding one filled tensor per shape; unlinked on exit."""
    inst = Instance.create(arena_size=arena_size, n_frontends=1, n_workers=1, queue_depth=1)
    tensors: list[ArenaTensor] = []
    try:
        seg = inst.segment
        seg.claim_slot(seg.frontends, 0, model="bench-gpu")
        seg.frontends[0]["state"] = SlotState.READY
        partition = Partition(seg, 0)
        rng = np.random.default_rng(seed)
        for dtype, shape in shapes:
            tensors.append(_place(partition, rng, dtype, shape))
        yield inst, tensors
    finally:
        tensors.clear()  # drop the views (exports of the mapping) before closing it
        inst.unlink()
        inst.close()
        if os.path.exists("/dev/shm" + inst.names.arena):
            print(f"warning: the bench arena {inst.names.arena} is still in /dev/shm", file=sys.stderr)


def _place(partition: Partition, rng: np.random.Generator, dtype: str, shape: tuple[int, ...]) -> ArenaTensor:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    allocation = partition.allocate(nbytes)
    if allocation is None:
        raise SetupError(f"the arena has no room for {nbytes} bytes")
    array = partition.array(allocation, dtype, shape)
    array[...] = rng.integers(0, 256, shape, dtype=np.uint8) if dtype == "uint8" else rng.random(shape, np.float32)
    ref = TensorRef(
        offset=allocation.offset,
        nbytes=nbytes,
        generation=allocation.generation,
        dtype=dtype,
        shape=shape,
        name="pixels",
    )
    validate(partition.segment, ref)  # a descriptor a worker would accept
    # Through a memoryview: the view then holds an export, so the mapping cannot be unmapped under it
    # (worker/device.py, "Lifetime"); arena_tensors drops the views before it closes the instance.
    view = torch.frombuffer(memoryview(partition.segment.mm), dtype=torch.uint8, count=nbytes, offset=ref.offset)
    return ArenaTensor(allocation, ref, view.view(TORCH_DTYPES[dtype]).reshape(shape))


# -- timing ----------------------------------------------------------------------------------------


def event_latencies_us(
    dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream, iters: int
) -> tuple[list[float], list[float]]:
    """One copy at a time: (CUDA-event µs, wall µs) per copy."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    events, wall = [], []
    with torch.cuda.stream(stream):
        for _ in range(iters):
            t0 = time.perf_counter()
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            wall.append((time.perf_counter() - t0) * 1e6)
            events.append(start.elapsed_time(end) * 1e3)
    return events, wall


def batch_gb_per_s(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream, count: int) -> float:
    """``count`` copies back to back between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        for _ in range(count):
            dst.copy_(src, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return count * src.nbytes / (start.elapsed_time(end) * 1e6)


def copier_latencies_us(copier: DeviceCopier, ref: TensorRef, iters: int) -> list[float]:
    """Wall-clock µs of ``DeviceCopier.copy`` (returns once the copy is complete)."""
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        copier.copy([ref])
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def h2d_row(
    source: str,
    src: torch.Tensor,
    gbps: float | None,
    events: list[float],
    wall: list[float],
    timing: str,
    **extra: Any,
) -> dict[str, Any]:
    p50, p99 = percentiles(events)
    return {
        "section": "h2d",
        "source": source,
        "size_bytes": src.nbytes,
        "shape": "x".join(map(str, src.shape)),
        "dtype": str(src.dtype).removeprefix("torch."),
        "gb_per_s": None if gbps is None else round(gbps, 3),
        "p50_us": None if p50 is None else round(p50, 1),
        "p99_us": None if p99 is None else round(p99, 1),
        "wall_p50_us": None if not wall else round(statistics.median(wall), 1),
        "timing": timing,
        **extra,
    }


# -- H2D section -------------------------------------------------------------------------------------


def measure_peak(plan: Plan, stream: torch.cuda.Stream, device: torch.device) -> dict[str, Any]:
    src = torch.empty(PEAK_BYTES, dtype=torch.uint8, pin_memory=True).random_(0, 256)
    dst = torch.empty(PEAK_BYTES, dtype=torch.uint8, device=device)
    batch_gb_per_s(dst, src, stream, 2)  # warm-up
    gbps = statistics.median(batch_gb_per_s(dst, src, stream, plan.peak_batch) for _ in range(plan.rounds))
    events, wall = event_latencies_us(dst, src, stream, max(5, plan.latency_iters // 10))
    exact = bool(torch.equal(dst.cpu(), src))
    row = h2d_row("peak", src, gbps, events, wall, "cuda_events", ratio_to_peak=1.0, exact=exact)
    del src, dst
    return row


def measure_size(item: ArenaTensor, copier: DeviceCopier, plan: Plan, device: torch.device) -> list[dict[str, Any]]:
    """All sources for one size, side by side: bandwidth rounds rotate over the sources."""
    assert copier._stream is not None
    stream = copier._stream  # the copier's own side stream, as in the worker
    arena = item.view
    sources = {
        "arena": arena,
        "pinned": torch.empty(arena.shape, dtype=arena.dtype, pin_memory=True).copy_(arena),
        "pageable": torch.empty(arena.shape, dtype=arena.dtype, pin_memory=False).copy_(arena),
    }
    dst = torch.empty(arena.shape, dtype=arena.dtype, device=device)
    count = max(8, min(4000, plan.batch_bytes // arena.nbytes))
    gbps: dict[str, list[float]] = {name: [] for name in sources}
    for src in sources.values():
        batch_gb_per_s(dst, src, stream, 3)  # warm-up
    for _ in range(plan.rounds):
        for name, src in sources.items():
            gbps[name].append(batch_gb_per_s(dst, src, stream, count))
    rows = []
    for name, src in sources.items():
        events, wall = event_latencies_us(dst, src, stream, plan.latency_iters)
        exact = bool(torch.equal(dst.cpu(), arena))
        extra = {"is_pinned": bool(src.is_pinned()), "exact": exact}
        rows.append(h2d_row(name, src, statistics.median(gbps[name]), events, wall, "cuda_events", **extra))
    rows.append(copier_row(item, copier, plan))
    return rows


def copier_row(item: ArenaTensor, copier: DeviceCopier, plan: Plan) -> dict[str, Any]:
    copier.copy([item.ref])  # warm-up
    t0 = time.perf_counter()
    wall = copier_latencies_us(copier, item.ref, plan.latency_iters)
    gbps = plan.latency_iters * item.ref.nbytes / ((time.perf_counter() - t0) * 1e9)
    exact = bool(torch.equal(copier.copy([item.ref])[0].cpu(), item.view))
    return h2d_row(
        "arena_copier",
        item.view,
        gbps,
        wall,
        wall,
        "wall (DeviceCopier.copy, 1 in flight)",
        is_pinned=copier.pinned,
        exact=exact,
    )


def run_h2d(args: argparse.Namespace, plan: Plan) -> list[dict[str, Any]]:
    device = torch.device("cuda", torch.cuda.current_device())
    rows: list[dict[str, Any]] = []
    with arena_tensors(args.arena_size) as (inst, items):
        t0 = time.perf_counter()
        copier = DeviceCopier(device, inst.segment.mm)
        register_ms = (time.perf_counter() - t0) * 1e3
        try:
            emit(meta_row(device, copier, register_ms, inst, items), args)
            if not copier.pinned:
                print(
                    "warning: the arena could not be registered; 'arena' rows measure pageable copies", file=sys.stderr
                )
            peak = measure_peak(plan, copier._stream, device)  # type: ignore[arg-type]
            emit(peak, args)
            rows.append(peak)
            for item in items:
                for row in measure_size(item, copier, plan, device):
                    row["ratio_to_peak"] = round(row["gb_per_s"] / peak["gb_per_s"], 3)
                    emit(row, args)
                    rows.append(row)
        finally:
            torch.cuda.synchronize()
            copier.close()  # unregister before the mapping goes away
            torch.cuda.empty_cache()
            if hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()
    return rows


def meta_row(
    device: torch.device, copier: DeviceCopier, register_ms: float, inst: Instance, items: list[ArenaTensor]
) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(device)
    return {
        "section": "meta",
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "arena_bytes": len(inst.segment.mm),
        "arena_registered": copier.pinned,
        "arena_view_is_pinned": bool(items[0].view.is_pinned()),
        "register_ms": round(register_ms, 1),
    }


def dry_run_h2d(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The CPU side of the H2D section: instance, allocation, fill, validate, DeviceCopier (CPU path), unlink."""
    rows = []
    with arena_tensors(args.arena_size) as (inst, items):
        copier = DeviceCopier(torch.device("cpu"), inst.segment.mm)
        for item in items:
            out = copier.copy([item.ref])[0]
            pageable = torch.empty(item.view.shape, dtype=item.view.dtype, pin_memory=False).copy_(item.view)
            exact = bool(torch.equal(out, item.view) and torch.equal(pageable, out))
            row = h2d_row("arena (dry run)", item.view, None, [], [], "none", exact=exact)
            emit(row, args)
            rows.append(row)
        copier.close()
    return rows


# -- copy overlapped with compute --------------------------------------------------------------------


def run_overlap(args: argparse.Namespace, plan: Plan) -> list[dict[str, Any]]:
    """bench/gpu_overlap.py on this device (the CPU in a dry run): serial vs pipelined batches."""
    cuda = not args.dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    backend = EfficientNetBackend(device)
    pixels = [("uint8", (3, 224, 224))] * OVERLAP_BATCH
    with arena_tensors(args.arena_size, seed=1, shapes=pixels) as (inst, items):
        copier = DeviceCopier(device, inst.segment.mm)
        try:
            rows = overlap_rows(
                backend, copier, [item.ref for item in items], plan.overlap_batches if cuda else DRY_OVERLAP_BATCHES
            )
        finally:
            if cuda:
                torch.cuda.synchronize()
            copier.close()  # unregister before the mapping goes away
    for row in rows:
        emit(row, args)
    return rows


def overlap_table(rows: list[dict[str, Any]]) -> str:
    columns = [
        "mode",
        "batch",
        "batches",
        "batches/s",
        "images/s",
        "copy µs p50",
        "compute µs p50",
        "copy overlapped %",
    ]
    return render_table(
        columns,
        [
            [
                r["mode"],
                r["batch"],
                r["batches"],
                fmt(r["batches_per_s"]),
                fmt(r["images_per_s"]),
                fmt(r["copy_us_p50"]),
                fmt(r["compute_us_p50"]),
                fmt(r["overlap_pct"]),
            ]
            for r in rows
        ],
    )


# -- GPU busy sampling ---------------------------------------------------------------------------


@dataclass
class GpuSampler:
    """Samples the GPU's busy percentage every ``interval_s`` in a thread while a run goes on.

    Source: ``torch.cuda.utilization()`` when pynvml imports, else one
    ``nvidia-smi --query-gpu=utilization.gpu`` call per tick (a short process each time, so it
    costs the machine a little CPU; nvidia-smi's own loop mode is avoided because its output may
    sit in a pipe buffer). Either way the figure is NVML's: the share of the driver's last sample
    period (1/6 s to 1 s) in which a kernel was running.
    """

    interval_s: float = 0.1
    source: str = "none"
    samples: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @classmethod
    def probe(cls, enabled: bool) -> GpuSampler:
        sampler = cls()
        if not enabled:
            return sampler
        try:
            torch.cuda.utilization()
            sampler.source = "torch.cuda.utilization (pynvml)"
        except Exception:
            if shutil.which("nvidia-smi") and _smi_sample() is not None:
                sampler.source = "nvidia-smi (polled)"
        return sampler

    def start(self) -> None:
        self.samples, self._stop = [], threading.Event()
        read = _torch_sample if self.source.startswith("torch") else _smi_sample
        if self.source != "none":
            self._thread = threading.Thread(target=self._poll, args=(read,), daemon=True)
            self._thread.start()

    def _poll(self, read: Callable[[], float | None]) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            value = read()
            if value is not None:
                self.samples.append(value)
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        s = self.samples
        return {
            "gpu_busy_pct": round(statistics.fmean(s), 1) if s else None,
            "gpu_busy_max_pct": max(s) if s else None,
            "gpu_busy_samples": len(s),
            "gpu_busy_source": self.source,
        }


def _torch_sample() -> float | None:
    try:
        return float(torch.cuda.utilization())
    except Exception:
        return None


def _smi_sample() -> float | None:
    argv = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", _nvml_index()]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=5, check=True).stdout
        return float(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _nvml_index() -> str:
    """The GPU torch calls cuda:0, as nvidia-smi's -i wants it (first entry of CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


# -- end to end --------------------------------------------------------------------------------------


def serve_argv(port: str, frontends: int, workers_per_gpu: int, args: argparse.Namespace) -> list[str]:
    exe = Path(sys.executable).parent / "shmgate"
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "shmgate.gateway"]
    # On CPU (dry run) --workers-per-gpu means nothing: the same count as --workers.
    workers = (
        ["--workers", str(workers_per_gpu)]
        if args.serve_device == "cpu"
        else ["--workers-per-gpu", str(workers_per_gpu)]
    )
    return [
        *head,
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "--model",
        MODEL,
        "--device",
        args.serve_device,
        "--frontends",
        str(frontends),
        *workers,
        *args.serve_arg,
    ]


def litserve_argv(port: str, workers: int, args: argparse.Namespace) -> list[str]:
    """bench/litserve_server.py with the same model code on the same device, ``workers`` processes on it."""
    accelerator = "cpu" if args.serve_device == "cpu" else "cuda"
    return [
        args.litserve_python,
        str(REPO / "bench" / "litserve_server.py"),
        "--port",
        port,
        "--accelerator",
        accelerator,
        "--workers",
        str(workers),
        "--threads",
        "1",
        "--max-batch-size",
        str(args.litserve_max_batch),
        "--api-servers",
        str(args.litserve_api_servers),
    ]


async def load(base_url: str, pid: int, images: Path, concurrency: int, requests: int) -> dict[str, Any]:
    argv = [
        "--base-url",
        base_url,
        "--model",
        MODEL,
        "--concurrency",
        str(concurrency),
        "--requests",
        str(requests),
        "--images",
        str(images),
        "--server-pid",
        str(pid),
        "--unique",
        "--warmup",
        "0",
    ]
    parser = argparse.ArgumentParser()
    loadgen.add_arguments(parser)
    return await loadgen.run(parser.parse_args(argv))


async def bench_server(
    label: dict[str, Any],
    argv: list[str],
    ready_path: str,
    args: argparse.Namespace,
    images: Path,
    log_dir: Path,
    sampler: GpuSampler,
) -> list[dict[str, Any]]:
    """Start one server (``{port}`` in ``argv`` becomes a free port), warm it up, load it at each
    concurrency while sampling the GPU, stop it."""
    port = free_port()
    argv = [str(port) if a == "{port}" else a for a in argv]
    name = f"{label['server']}-f{label['frontends']}-w{label['workers_per_gpu']}"
    server = ServerProcess(argv, log_dir / f"{name}.log")
    base_url = f"http://127.0.0.1:{port}"
    print(f"{name}: {' '.join(server.argv)}", file=sys.stderr, flush=True)
    rows = []
    started = time.monotonic()
    server.start()
    try:
        await server.wait_ready(base_url + ready_path, 300.0)
        startup_s = round(time.monotonic() - started, 1)
        for concurrency in args.concurrency:
            await load(base_url, server.pid, images, concurrency, max(concurrency, 16))  # warm-up, not reported
            sampler.start()
            try:
                result = await load(base_url, server.pid, images, concurrency, max(args.requests, 2 * concurrency))
            finally:
                busy = sampler.stop()
            row = {"section": "e2e", **label, "device": args.serve_device, "startup_s": startup_s, **result, **busy}
            emit(row, args)
            rows.append(row)
    finally:
        server.stop()
    return rows


async def run_e2e(args: argparse.Namespace) -> list[dict[str, Any]]:
    sampler = GpuSampler.probe(enabled=not args.dry_run)
    print(f"GPU busy source: {sampler.source}", file=sys.stderr, flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="shmgate-gpu-") as tmp:
        images = Path(tmp) / "images"
        images.mkdir()
        for image in IMAGES:
            (images / image.name).symlink_to(image)
        log_dir = Path(args.log_dir) if args.log_dir else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        runs: list[tuple[dict[str, Any], list[str], str]] = []
        for workers_per_gpu in args.workers_per_gpu:
            for frontends in args.frontends:
                label = {"server": "shmgate", "frontends": frontends, "workers_per_gpu": workers_per_gpu}
                runs.append((label, serve_argv("{port}", frontends, workers_per_gpu, args), "/ready"))
            if args.litserve_python:
                label = {
                    "server": "litserve",
                    "frontends": args.litserve_api_servers,
                    "workers_per_gpu": workers_per_gpu,
                }
                runs.append((label, litserve_argv("{port}", workers_per_gpu, args), "/health"))
        for label, argv, ready_path in runs:
            try:
                rows += await bench_server(label, argv, ready_path, args, images, log_dir, sampler)
            except RuntimeError as exc:
                print(f"{label} failed: {exc}", file=sys.stderr)
                rows.append({"section": "e2e", **label, "failed": str(exc)[:2000]})
    return rows


def find_litserve_python(wanted: bool) -> str | None:
    """An interpreter that imports litserve: this one (the GPU machine's, with the carried wheels), else the
    bench venv of bench/setup_litserve.sh; None (and a note) when neither does."""
    if not wanted:
        return None
    for python in (sys.executable, str(LITSERVE_PYTHON)):
        if (
            Path(python).exists()
            and subprocess.run([python, "-c", "import litserve"], capture_output=True, timeout=120).returncode == 0
        ):
            return python
    print(
        "LitServe is not importable here (bench/setup_litserve.sh, or the carried wheels): no LitServe rows",
        file=sys.stderr,
    )
    return None


# -- main --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations and 160 requests per point")
    parser.add_argument("--json", action="store_true", help="JSON lines on stdout instead of markdown tables")
    parser.add_argument("--skip-serve", action="store_true", help="no end-to-end section")
    parser.add_argument("--skip-overlap", action="store_true", help="no copy/compute overlap section")
    parser.add_argument("--skip-h2d", action="store_true", help="no H2D copy section")
    parser.add_argument("--dry-run", action="store_true", help="everything except CUDA calls (serve on --device cpu)")
    parser.add_argument("--arena-size", type=int, default=1 << 30, help="bytes (default 1 GiB)")
    parser.add_argument(
        "--frontends",
        type=int,
        nargs="+",
        default=None,
        help="frontend counts to serve with (default: 1 and min(8, cores - 2))",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="default: 1 8 32 128")
    parser.add_argument("--workers-per-gpu", type=int, nargs="+", default=None, help="default: 1 2 4 (dry run: 1)")
    parser.add_argument(
        "--litserve",
        action="store_true",
        help="also LitServe (bench/litserve_server.py) with the same model, workers and loads",
    )
    parser.add_argument("--litserve-api-servers", type=int, default=2, help="LitServe's HTTP processes")
    parser.add_argument("--litserve-max-batch", type=int, default=8)
    parser.add_argument("--requests", type=int, default=None, help="timed requests per point (default 400, quick 160)")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `shmgate serve` argument (repeat)")
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    parser.add_argument("--out", default=None, help="also write the markdown tables to this file")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    cores = os.cpu_count() or 1
    if args.dry_run:  # a smoke test of the orchestration on a small CPU machine
        args.serve_device = "cpu"
        args.frontends = args.frontends or [1, 2]
        args.concurrency = args.concurrency or [4]
        args.requests = args.requests or 8
        args.workers_per_gpu = args.workers_per_gpu or [1]
    else:
        args.serve_device = "cuda"
        args.frontends = args.frontends or sorted({1, max(1, min(8, cores - 2))})
        args.concurrency = args.concurrency or [1, 8, 32, 128]
        args.requests = args.requests or plan.requests
        args.workers_per_gpu = args.workers_per_gpu or [1, 2, 4]
    args.litserve_python = find_litserve_python(args.litserve)
    args.plan = plan
    return args


def report(
    h2d: list[dict[str, Any]], overlap: list[dict[str, Any]], e2e: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    parts = []
    if h2d:
        parts.append("### H2D copies\n\n" + h2d_table(h2d))
    if overlap:
        parts.append("### Copy overlapped with compute\n\n" + overlap_table(overlap))
    done = [r for r in e2e if "failed" not in r]
    if done:
        parts.append("### End to end\n\n" + e2e_table(done))
    text = "\n\n".join(parts)
    if not args.json and text:
        print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(json.dumps({"skipped": NO_CUDA}) if args.json else NO_CUDA, flush=True)
        return 0
    before = shm_names()
    try:
        h2d = [] if args.skip_h2d else dry_run_h2d(args) if args.dry_run else run_h2d(args, args.plan)
        overlap = [] if args.skip_overlap else run_overlap(args, args.plan)
        e2e = [] if args.skip_serve else asyncio.run(run_e2e(args))
    except SetupError as exc:
        print(f"bench/gpu.py: {exc}", file=sys.stderr)
        return 2
    report(h2d, overlap, e2e, args)
    return finish(before, h2d, e2e)


def finish(before: set[str], h2d: list[dict[str, Any]], e2e: list[dict[str, Any]]) -> int:
    """Exit status 1 if a copy was not exact, a server failed or a request failed.

    New shmgate names in /dev/shm only warn: other processes of the machine may own them.
    """
    time.sleep(1.0)
    left = sorted(shm_names() - before)
    if left:
        print(f"warning: new in /dev/shm since the start (ours, or another process's): {left}", file=sys.stderr)
    bad_copy = any(r.get("exact") is False for r in h2d)
    bad_e2e = any("failed" in r or r["errors"] or r["mismatches"] for r in e2e)
    return 1 if bad_copy or bad_e2e else 0


if __name__ == "__main__":
    sys.exit(main())
