"""The node's plan, decided once in the supervisor: which models, which workers where, and each child's
configuration.

Pure functions of the parsed configuration (node/config.py) and of the machine's GPUs, so the plan is
tested without starting anything (tests/test_cli_gpus.py, tests/test_several_models.py). Each child gets
its part whole: a frontend its ``FrontendConfig`` (gateway/config.py), a worker its ``WorkerConfig``
(worker/config.py), encoded into its environment by node/serve.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from shmgate.gateway.config import FrontendConfig
from shmgate.node.config import (
    DEFAULT_STALL_TIMEOUT_S,
    HF_STALL_TIMEOUT_S,
    AnyNodeConfig,
    ServeConfig,
    gateway_of,
)
from shmgate.node.models import NodeConfigError, from_flags, load_node_config
from shmgate.node.placement import Placement, gpu_count, worker_placements
from shmgate.shared.cpus import usable_cpus
from shmgate.shared.errors import SetupError
from shmgate.shared.model_config import GLOBAL_KEYS, ModelConfig
from shmgate.shared.models import ModelKind, parse_model_spec
from shmgate.shared.options import knob_values, with_knobs
from shmgate.worker.config import AttachOptions, WorkerConfig

__all__ = [
    "WorkerChild",
    "declared_models",
    "frontend_config",
    "gpu_misfits",
    "model_plans",
    "stall_timeout_for",
    "visible_gpus",
    "worker_children",
    "worker_threads",
]


def stall_timeout_for(model: str, flag: float | None) -> float:
    """The stall timeout to use: the flag (0 turns detection off), else a default for the model."""
    if flag is not None:
        return max(0.0, flag)
    return HF_STALL_TIMEOUT_S if _loads_hf_weights(model) else DEFAULT_STALL_TIMEOUT_S


def _kind(model: str) -> ModelKind | None:
    """The spec's kind; None for an unknown spec (the children report it as a configuration error)."""
    try:
        return parse_model_spec(model).kind
    except ValueError:
        return None


def _serves_chat(model: str) -> bool:
    """Is it a chat model (``hf:<dir>`` of a VLM), whose worker steps and streams every token?"""
    return _kind(model) is ModelKind.HF_CHAT


def _loads_hf_weights(model: str) -> bool:
    """Does the worker load a Hugging Face checkpoint (GBs of weights, slow steps)?

    ``checksum:hf:<dir>`` does not: it only preprocesses the way the checkpoint does.
    """
    return _kind(model) in (ModelKind.HF_CHAT, ModelKind.HF_EMBED)


def _gpu_count() -> int:
    """GPUs of this machine, without importing torch (frontends stay light)."""
    return gpu_count()


def visible_gpus(environ: Mapping[str, str], machine_gpus: int) -> list[str]:
    """The GPUs workers may use: ``CUDA_VISIBLE_DEVICES`` when it is set (indices or UUIDs, as
    CUDA takes them; empty means none), else every GPU of the machine.

    Without this, ``CUDA_VISIBLE_DEVICES=2,3 shmgate serve`` on a 4-GPU machine would start four
    workers and hand them GPUs 0..3, overriding the restriction the user asked for.
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(machine_gpus)]
    return [part.strip() for part in visible.split(",") if part.strip()]


def declared_models(config: AnyNodeConfig) -> list[ModelConfig]:
    """The models ``serve`` / ``gateway`` serve, each with the global options filled in where it sets
    nothing: from ``--config`` (a TOML file, node/models.py) or the ``--model`` flags.

    Raises NodeConfigError (one line naming the model and the key) for what can be checked before
    anything starts: the spec, the checkpoint directory, the extra the model needs, repeated ids.
    """
    gateway = gateway_of(config)
    config_file, given = gateway.node.config, gateway.given
    if config_file:
        if "model" in given:
            raise NodeConfigError(f"--config {config_file} and --model both declare models; use one of them")
        if "served_model_name" in given:
            raise NodeConfigError(
                f"--served-model-name with --config {config_file}: give each model's served_model_name in the file"
            )
        configs = load_node_config(config_file)
    else:
        configs = from_flags(gateway.model.model, gateway.model.served_model_name)
    flags = knob_values(config)
    return [model.with_globals(flags, alone=len(configs) == 1) for model in configs]


def _default_cpu_workers(model: str, cores: int) -> int:
    """Two workers splitting the cores, for models small enough to load twice; else one.

    Two processes of cores/2 torch threads beat one of all cores for EfficientNet-Lite0 on
    2 cores (docs/benchmarks-history.md, end to end: the shmgate-efficientnet rows against -1w, e.g.
    80.9 vs 59.6 req/s at concurrency 8): one runs a batch while the other's batch forms and
    its Python overhead runs, where one process leaves cores idle between batches. A Hugging
    Face VLM's weights (GBs) are loaded once.
    """
    if _loads_hf_weights(model) or cores < 2:
        return 1
    return 2


def model_plans(models: list[ModelConfig]) -> list[tuple[ModelConfig, list[Placement]]]:
    """Each declared model with its workers' placements (its own device and worker count, else the flags').

    One model alone keeps the machine's default (two CPU workers for a small model); with several, a
    model whose count is auto gets one CPU worker, so that two models do not start four processes on two cores.
    """
    gpu_ids = visible_gpus(os.environ, _gpu_count())
    plans = []
    for model in models:
        device = model.device or ("cuda" if gpu_ids else "cpu")
        cpu_workers = _default_cpu_workers(model.model, usable_cpus()) if len(models) == 1 else 1
        plans.append(
            (
                model,
                worker_placements(
                    device,
                    workers=model.workers or 0,
                    workers_per_gpu=model.workers_per_gpu or 1,
                    gpu_ids=gpu_ids,
                    cpu_workers=cpu_workers,
                ),
            )
        )
    return plans


def worker_threads(config: ServeConfig, n_workers: int, models: list[ModelConfig] | None = None) -> int:
    """Torch threads per worker: the flag, else the usable CPUs shared among the workers. When a chat model
    is served on CPU, one core is left to the frontends first (vLLM's CPU engine does the same): they
    stream every token while the worker steps, and a team of torch threads that all cores' other work
    preempts waits on its slowest member at every operation. On the 2-core machine, the 12-layer 1024-wide
    checkpoint with other jobs on the cores: the worker's two threads got 0.50 + 0.33 of a core and served
    146-171 tokens/s where vLLM's one-core worker got 0.95 and served 180-198; on quiet cores one thread
    streams the packed weights at least as fast as two (17.7-24.0 against 16.8-19.4 GB/s), since a decode step is bound by
    memory, not arithmetic (docs/BENCHMARKS.md, "The engine against vLLM's CPU engine, round 2")."""
    if config.placement.threads:
        return int(config.placement.threads)
    cpus = usable_cpus()
    chat = any(_serves_chat(model.model) for model in models or ())
    if chat and cpus > 1:
        cpus -= 1
    return max(1, cpus // max(1, n_workers))


def gpu_misfits(
    config: ServeConfig, models: list[ModelConfig] | None = None, free: Mapping[str, int] | None = None
) -> list[str]:
    """The GPUs whose declared models are estimated not to fit in their free memory (node/gpu_fit.py),
    one line each; none without a GPU placement. ``free``: each GPU's free bytes (None: asked of CUDA)."""
    from shmgate.node.gpu_fit import PlacedModel, cuda_free_bytes, misfits, placed_needs

    try:
        plans = model_plans(declared_models(config) if models is None else models)
    except SetupError:
        return []  # a placement that cannot work: node/serve.py says so
    placed = [
        PlacedModel(
            m.public_id,
            m.model,
            m.dtype or "auto",
            m.max_batch_size or 0,
            tuple(p.visible for p in placements),
            _max_pixels(m.mm_processor_kwargs),
            int((config.engine.encoder_cache_mb + config.engine.prefix_cache_mb) * (1 << 20)),
        )
        for m, placements in plans
        if any(p.visible is not None for p in placements)
    ]
    if not placed:
        return []
    needs = placed_needs(placed)
    if free is None:
        free = cuda_free_bytes(visible_gpus(os.environ, _gpu_count()))
    return misfits(needs, free)


def _max_pixels(kwargs: Mapping[str, object]) -> int | None:
    """The pixel budget a model's processor kwargs set, where they set one as a number."""
    value = kwargs.get("max_pixels")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def frontend_config(
    config: AnyNodeConfig,
    models: list[ModelConfig],
    instance_id: str,
    slot: int,
    fd: int | None,
    *,
    started_at: int = 0,
) -> FrontendConfig:
    """Frontend ``slot``'s whole configuration: the frontend options of ``config`` (gateway/config.py
    ``FrontendOptions``, nothing else), the resolved models, and ``--allowed-hosts`` decided once for
    ``--host``. ``fd``: the shared listening socket; None, the frontend binds its own."""
    from shmgate.gateway.guards import default_allowed_hosts

    frontend = gateway_of(config).frontend
    server = frontend.server
    allowed = server.allowed_hosts or ",".join(default_allowed_hosts(server.host))
    return FrontendConfig(
        options=replace(frontend, server=replace(server, allowed_hosts=allowed)),
        instance_id=instance_id,
        slot=slot,
        fd=fd,
        models=tuple(models),
        started_at=started_at,
    )


# A model's own settings (a --config file's keys, else the flags') that a worker reads: the device is
# set per placement below.
_PER_MODEL_WORKER_KEYS = tuple(key for key in GLOBAL_KEYS if key in knob_values(WorkerConfig()) and key != "device")


@dataclass(frozen=True)
class WorkerChild:
    """One worker to start: its configuration, its environment (its GPU), the model it serves."""

    config: WorkerConfig
    env: dict[str, str]
    model: str  # the public id, for the supervisor's per-model restart budget


def worker_children(
    config: ServeConfig, plans: list[tuple[ModelConfig, list[Placement]]], instance_id: str
) -> list[WorkerChild]:
    """Every worker of every model: the records of serve's options a worker reads, with each model's own
    batching and each placement's device, and one GPU visible to each CUDA worker."""
    threads = worker_threads(config, sum(len(placements) for _, placements in plans), [model for model, _ in plans])
    gateway = config.gateway
    base = WorkerConfig(
        model=gateway.model,
        placement=replace(config.placement, threads=threads),
        batching=config.batching,
        engine=config.engine,
        load=config.load,
        label=gateway.label,
        attach=AttachOptions(instance=instance_id),
        log=gateway.frontend.log,
        diagnostics=config.diagnostics,
        tracing=gateway.frontend.tracing,
    )
    children = []
    for model, placements in plans:
        own = replace(
            with_knobs(
                base, {key: value for key in _PER_MODEL_WORKER_KEYS if (value := getattr(model, key)) is not None}
            ),
            model=replace(
                base.model,
                model=(model.model,),
                served_model_name=(model.served_model_name,) if model.served_model_name else (),
            ),
        )
        for placement in placements:
            env = {} if placement.visible is None else {"CUDA_VISIBLE_DEVICES": placement.visible}
            config_here = replace(own, placement=replace(own.placement, device=placement.device))
            children.append(WorkerChild(config_here, env, model.public_id))
    return children
