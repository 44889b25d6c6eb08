"""``shmgate serve`` and ``shmgate gateway`` once the configuration is valid: create the instance, start
and supervise the children, log the start-up.

The one place that turns the plan (node/plan.py) into processes: each child is ``python -m shmgate.gateway``
or ``python -m shmgate.worker`` with its whole configuration encoded in its environment (shared/options.py
``CHILD_CONFIG_ENV``), never a command line to re-parse; the words after the module only name the
child in ps (``_title``).
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from shmgate.node.config import AnyNodeConfig, ServeConfig, gateway_of
from shmgate.node.listen import bind_supervisor
from shmgate.node.plan import frontend_config, model_plans, stall_timeout_for, worker_children, worker_threads
from shmgate.shared.cpus import usable_cpus
from shmgate.shared.flags import version
from shmgate.shared.model_config import ModelConfig
from shmgate.shared.models import ModelKind, parse_model_spec
from shmgate.shared.options import CHILD_CONFIG_ENV, encode

if TYPE_CHECKING:
    from shmgate.node.startup_log import Summary
    from shmgate.shared.instance import Instance

__all__ = ["run_supervised", "summary"]

log = logging.getLogger("shmgate")


def _worker_slots(asked: int, n_workers: int, *, with_workers: bool) -> int:
    """Worker slots (one control queue each, counted against RLIMIT_MSGQUEUE) for the workers to come.

    ``serve`` knows its workers: twice their number leaves a slot for each restart that overlaps
    its predecessor's heartbeat. ``gateway`` cannot know how many containers will attach, so it
    keeps 16 unless told (a pod's manifest sets it from its worker containers).
    """
    if with_workers:
        return max(asked, 2 * n_workers, 2)
    return asked or 16


def run_supervised(config: AnyNodeConfig, models: list[ModelConfig], *, started_at: float) -> int:
    """Serve until stopped: frontends for ``models``, and their workers when ``config`` is a ServeConfig."""
    from shmgate.node.startup_log import ServingLog, shm_free_bytes, summary_lines
    from shmgate.shared.instance import Instance, ModelQueue, cleanup_leftovers
    from shmgate.shared.transport import PosixNodeStats, PosixSupervisorLink
    from shmgate.supervise.supervisor import ChildProcess, Supervisor, child_env

    with_workers = isinstance(config, ServeConfig)
    plans = model_plans(models) if isinstance(config, ServeConfig) else []
    removed = cleanup_leftovers()
    if removed:
        log.warning("removed leftovers of %d dead instance(s)", len(removed))
    gateway = gateway_of(config)
    node, server = gateway.node, gateway.frontend.server
    n_frontends = node.frontends or usable_cpus()
    n_workers = sum(len(placements) for _, placements in plans)
    n_worker_slots = _worker_slots(node.max_workers, n_workers, with_workers=with_workers)
    # reuseport: bound, not listening; the frontends listen on sockets of their own (node/listen.py)
    sock, listen = bind_supervisor(server.host, server.port, server.listen)
    port = sock.getsockname()[1]  # the kernel's choice for --port 0
    shared_fd = sock.fileno() if listen == "shared" else None
    instance = Instance.create(
        arena_size=node.arena_size,
        n_frontends=n_frontends + (config.serve.spare_frontend_slots if isinstance(config, ServeConfig) else 0),
        n_workers=n_worker_slots,
        label=gateway.label.label,
        queue_depth=node.queue_depth,
        stall_timeout_s=stall_timeout_for(models[0].model, node.stall_timeout_s),
        models=[
            ModelQueue(m.public_id, m.queue_depth or node.queue_depth, stall_timeout_for(m.model, m.stall_timeout_s))
            for m in models
        ],
    )
    instance_id = instance.names.instance_id
    bound = replace(gateway, frontend=replace(gateway.frontend, server=replace(server, port=port, listen=listen)))
    started = int(time.time())  # /v1/models's "created" for every model, from every frontend
    frontends = [
        ChildProcess(
            "frontend",
            k,
            [sys.executable, "-m", "shmgate.gateway", *_title("frontend", "--slot", str(k))],
            child_env(
                {
                    CHILD_CONFIG_ENV: encode(
                        frontend_config(bound, models, instance_id, k, shared_fd, started_at=started)
                    )
                }
            ),
            pass_fds=(shared_fd,) if shared_fd is not None else (),
        )
        for k in range(n_frontends)
    ]
    workers = [
        ChildProcess(
            "worker",
            i,
            [sys.executable, "-m", "shmgate.worker", *_title("--model", child.config.model.model[0])],
            child_env({**child.env, CHILD_CONFIG_ENV: encode(child.config)}),
            model=child.model,
        )
        for i, child in enumerate(
            worker_children(config, plans, instance_id) if isinstance(config, ServeConfig) else []
        )
    ]
    url = f"http://{f'[{server.host}]' if ':' in server.host else server.host}:{port}"
    for line in summary_lines(summary(config, models, instance_id, url, n_frontends), shm_free_bytes()):
        log.info("%s", line)
    request_queues = [instance.request_queue(i) for i in range(len(models))]
    link = PosixSupervisorLink(instance)
    serving_log = ServingLog(
        node=PosixNodeStats(instance),
        frontend_alive=link.frontend_alive,
        worker_ready=lambda: all(link.has_live_worker(m.public_id) for m in models),
        n_frontends=n_frontends,
        queue_depth=lambda: sum(q.current_messages() for q in request_queues),
        instance_id=instance_id,
        url=url,
        started_at=started_at,
        stats_interval_s=node.log_stats_interval_s,
    )
    try:
        supervisor = Supervisor.for_instance(
            instance, frontends, workers, drain_timeout_s=server.drain_timeout_s, on_tick=serving_log.tick
        )
        if len(models) > 1 and isinstance(config, ServeConfig):  # a model that keeps dying is failed
            supervisor.restart_budget = config.plan.restart_budget
            supervisor.on_model_failed = functools.partial(_mark_failed, instance)
        return supervisor.run()
    finally:
        for queue in request_queues:
            queue.close()
        sock.close()


def _title(*words: str) -> list[str]:
    """Arguments that only name a child in ps, /proc and tools (``-m shmgate.gateway frontend --slot 2``,
    ``-m shmgate.worker --model checksum``): the child reads its configuration, never these."""
    return list(words)


def _mark_failed(instance: Instance, model: str) -> None:
    """The supervisor gave up every worker of ``model``: its row says so to the frontends."""
    from shmgate.shared.segment import ModelState

    index = instance.segment.model_index(model)
    if index >= 0:
        instance.segment.mark_model(index, ModelState.FAILED)


def summary(config: AnyNodeConfig, models: list[ModelConfig], instance_id: str, url: str, n_frontends: int) -> Summary:
    """The startup summary's facts, from the same plan the workers are started with."""
    from shmgate.node.startup_log import Summary, plural

    gateway = gateway_of(config)
    spec = parse_model_spec(models[0].model)
    hf = spec.kind in (ModelKind.HF_CHAT, ModelKind.HF_EMBED)
    model_id = models[0].public_id
    model_spec = models[0].model
    if len(models) > 1:  # "clients send "model": "a" or "b""
        model_id = '" or "'.join(m.public_id for m in models)
        model_spec = ", ".join(m.model for m in models)
    if isinstance(config, ServeConfig):
        placements = [p for _, model_placements in model_plans(models) for p in model_placements]
        threads = worker_threads(config, len(placements), models)
        gpus = sorted({p.visible for p in placements if p.visible is not None})
        where = f"GPU {', '.join(gpus)}" if gpus else ", ".join(sorted({p.device for p in placements}))
        cpu = all(p.device == "cpu" for p in placements)
        workers = f"{plural(len(placements), 'worker')} on {where}"
        workers += f", {plural(threads, 'torch thread')} each" if cpu else ""
        dtype = (
            (("float32" if cpu else "bfloat16") if config.load.dtype == "auto" else config.load.dtype)
            if hf
            else "the model's"
        )
    else:
        workers, dtype = f"workers attach by label {gateway.label.label!r} (shmgate worker)", "chosen by each worker"
    return Summary(
        version=version(),
        instance_id=instance_id,
        label=gateway.label.label,
        model_id=model_id,
        model_spec=model_spec,
        url=url,
        n_frontends=n_frontends,
        workers=workers,
        dtype=dtype,
        arena_bytes=gateway.node.arena_size,
        auth=bool(gateway.frontend.server.api_key),
        traces=gateway.frontend.tracing.otlp_traces_endpoint or "",
    )
