"""The options records more than one command takes: ``shmgate serve``/``gateway`` and ``shmgate worker``
(``python -m shmgate.worker``) both hold them, and gateway/, worker/ and node/ all import shared/, so they are
declared here, once.

Each field is a flag, its ``SHMGATE_*`` variable, its help and its one default (shared/options.py
``option``); each record is what one part of a worker reads, handed to it whole: ``BatchingOptions`` the
batcher's, ``LoadOptions`` the backend loader's (worker/backends/__init__.py ``load_backend``),
``EngineOptions`` the generation engine's (worker/backends/hf.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shmgate.shared import flag_types
from shmgate.shared.models import KNOWN_SPECS
from shmgate.shared.options import option

__all__ = [
    "BATCH_POLICIES",
    "DTYPES",
    "BatchingOptions",
    "EngineOptions",
    "LabelOption",
    "LoadOptions",
    "LogOptions",
    "ModelOptions",
    "PlacementOptions",
]

DTYPES = ("auto", "float32", "bfloat16", "float16")
BATCH_POLICIES = ("fcfs", "held")  # worker/batcher.py: what a worker takes while its model is busy


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """What to serve: serve and gateway take several models, a worker one."""

    GROUP: ClassVar[str] = "model"
    model: tuple[str, ...] = option(
        f"what to serve: {KNOWN_SPECS}; repeat it to serve several models (docs/MODELS.md); "
        "a worker serves one, the same as its gateway's",
        default="efficientnet-lite0",
        type=flag_types.model_spec,
        repeatable=True,
    )
    served_model_name: tuple[str, ...] = option(
        "the model id clients send and /v1/models lists; with several --model, one per --model in the "
        "same order; a worker's must match its gateway's",
        shown_default="from --model: the directory's name for hf:DIR, org/name for a hub-cache snapshot",
        repeatable=True,
    )


@dataclass(frozen=True, kw_only=True)
class LabelOption:
    GROUP: ClassVar[str] = "server"
    label: str = option(
        "the gateway's name: workers in other containers attach to the gateway of this label (shmgate worker --label)",
        default="default",
    )


@dataclass(frozen=True, kw_only=True)
class PlacementOptions:
    """Where a worker runs."""

    GROUP: ClassVar[str] = "workers and batching"
    device: str | None = option(
        "cpu, cuda (every visible GPU) or cuda:N (GPU N only)",
        shown_default="cuda when a GPU is visible, else cpu",
        type=flag_types.device,
    )
    threads: int = option(
        "torch threads per CPU worker; 0: the CPUs this process may use (cgroup limit included), "
        "shared among serve's workers, less one left to the frontends when a chat model is served",
        default="0",
        type=flag_types.non_negative_int,
    )


@dataclass(frozen=True, kw_only=True)
class BatchingOptions:
    """How a worker takes requests into batches (worker/batcher.py), the same in ``serve`` and in ``worker``."""

    GROUP: ClassVar[str] = "workers and batching"
    max_batch_size: int = option(
        "requests per batch; 0: the model's choice (one forward pass for the "
        "classifier on CPU, 2 per torch thread; 8 on CUDA and for other models; for hf: chat models the "
        "rows generating together, 32)",
        default="0",
        type=flag_types.non_negative_int,
    )
    max_batch_wait_ms: float = option(
        "how long a worker waits for a batch to fill once it has a request; it waits only while more "
        "requests are queued or still decoding, so a lone request runs at once",
        default="5",
        type=flag_types.non_negative_float,
    )
    batch_policy: str = option(
        "held: a busy worker's next batch gathers while the model runs; fcfs: a "
        "busy worker takes nothing, requests wait in the shared queue for the first free worker "
        "(worker/batcher.py, docs/TUNING.md)",
        default="held",
        type=flag_types.choice(*BATCH_POLICIES),
        metavar="{" + ",".join(BATCH_POLICIES) + "}",
    )


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """The generation engine's budgets and caches (``hf:`` chat models: worker/backends/hf.py)."""

    GROUP: ClassVar[str] = "workers and batching"
    max_num_batched_tokens: int = option(
        "hf: models: tokens one engine step runs (each decoding row's one, then waiting prompts' "
        "tokens; a longer Qwen2-VL prompt is prefilled in chunks of this)",
        default="2048",
        type=flag_types.positive_int,
    )
    kv_cache_tokens: int = option(
        "hf: models: the KV cache budget in token positions; requests wait and the newest running one is "
        "preempted beyond it; 0: unbounded on CPU, 70 percent of the memory free after the weights on CUDA",
        default="0",
        type=flag_types.non_negative_int,
    )
    encoder_cache_mb: float = option(
        "hf: models: vision-tower outputs kept by image content key (Qwen2-VL, Qwen2.5-VL), least "
        "recently used out first; 0: none",
        default="256",
        type=flag_types.non_negative_float,
    )
    prefix_cache_mb: float = option(
        "hf: models: prompts' KV kept by prefix (a chat's next turn, a shared system prompt and image "
        "prefill only what is new; Qwen2-VL, Qwen2.5-VL), least recently used out first; 0: none",
        default="256",
        type=flag_types.non_negative_float,
    )
    kv_layout: str = option(
        "hf: models: how the engine holds KV: paged (fixed-size blocks with a block table per row, one packed "
        "forward pass per step), padded (the running rows share one left-padded cache), or auto: paged on "
        "CPU for the families it serves (Qwen2-VL, Qwen2.5-VL, LLaVA, LLaVA-NeXT, Idefics3, SmolVLM, "
        "InternVL), padded for the others and on GPUs (docs/BENCHMARKS.md)",
        default="auto",
        type=flag_types.choice("auto", "paged", "padded"),
    )
    encoder_share_mb: float = option(
        "hf: models: each worker's shared-memory partition for vision-tower outputs that every worker of "
        "its model reads before running its own tower (Qwen2-VL, Qwen2.5-VL); pays where the tower costs "
        "more than a copy of its output (docs/BENCHMARKS.md); 0: off, each worker encodes for itself",
        default="0",
        type=flag_types.non_negative_float,
    )


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a worker loads its model (worker/backends/__init__.py ``load_backend``)."""

    GROUP: ClassVar[str] = "workers and batching"
    dtype: str = option(
        "weights of hf: models (auto: bfloat16 on CUDA, float32 on CPU)",
        default="auto",
        type=flag_types.choice(*DTYPES),
        metavar="{" + ",".join(DTYPES) + "}",
    )
    compile_normalise: bool = option(
        "efficientnet: compile the input normalisation into one kernel (needs a "
        "C compiler; set TORCHINDUCTOR_CACHE_DIR to a persistent directory; see docs/ARCHITECTURE.md)",
        on_off=True,
    )


@dataclass(frozen=True, kw_only=True)
class LogOptions:
    GROUP: ClassVar[str] = "observability"
    log_level: str = option(f"one of {', '.join(flag_types.LOG_LEVELS)}", default="info", type=flag_types.log_level)
