"""The ``shmgate`` command: serve, gateway, worker, cleanup, bench (and the internal frontend).

Settings are parsed here once and each part gets only the values it uses; this
is the only module that calls ``sys.exit`` (through ``main``'s return code).

    shmgate serve     gateway + supervised workers, one command (the embedded default model)
    shmgate gateway   frontends only: owns the IPC objects; workers attach from elsewhere
    shmgate worker    one model worker (exec of ``python -m shmgate.worker``, the command compose runs)
    shmgate cleanup   remove the IPC objects of dead instances
    shmgate bench     the load generator (bench_client/loadgen.py)
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from shmgate.gateway.cli_flags import DEFAULT_STALL_TIMEOUT_S, HF_STALL_TIMEOUT_S, add_gateway_flags, add_worker_flags
from shmgate.gateway.config_checks import ConfigError, check_device
from shmgate.gateway.listen import bind_frontend, bind_supervisor
from shmgate.gateway.node_config import (
    ModelConfig,
    NodeConfigError,
    from_flags,
    load_node_config,
    models_json,
    parse_models_json,
)
from shmgate.shared.cpus import usable_cpus
from shmgate.shared.errors import EXIT_USAGE, SetupError
from shmgate.shared.flags import ShmgateParser, add_batching_flags, forward, origin, version
from shmgate.shared.models import ModelKind, parse_model_spec
from shmgate.shared.tracing import add_tracing_flags
from shmgate.supervise.placement import Placement, gpu_count, worker_placements

if TYPE_CHECKING:
    from shmgate.gateway.startup_log import Summary
    from shmgate.shared.instance import Instance

__all__ = ["main"]

log = logging.getLogger("shmgate")


def stall_timeout_for(model: str, flag: float | None) -> float:
    """The stall timeout to use: the flag (0 turns detection off), else a default for the model."""
    if flag is not None:
        return max(0.0, flag)
    return HF_STALL_TIMEOUT_S if _loads_hf_weights(model) else DEFAULT_STALL_TIMEOUT_S


def _loads_hf_weights(model: str) -> bool:
    """Does the worker load a Hugging Face checkpoint (GBs of weights, slow steps)?

    ``checksum:hf:<dir>`` does not: it only preprocesses the way the checkpoint does. An unknown
    spec counts as not: the children report it as a configuration error.
    """
    try:
        kind = parse_model_spec(model).kind
    except ValueError:
        return False
    return kind in (ModelKind.HF_CHAT, ModelKind.HF_EMBED)


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


def build_parser() -> argparse.ArgumentParser:
    parser = ShmgateParser(prog="shmgate", description="An OpenAI-compatible HTTP gateway for vision models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    # metavar: the usage line lists the commands below, not every name the parser accepts (the frontend).
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=ShmgateParser)
    serve = sub.add_parser("serve", help="gateway and workers in one command", description=_SERVE_DESCRIPTION)
    add_gateway_flags(serve)
    add_worker_flags(serve)
    # Slots with a partition and a reply channel but no HTTP process: a diagnostic tool (or a
    # test forging descriptors) attaches as a frontend there without stealing a real
    # frontend's replies. They take a share of the arena, so the default is none.
    serve.add_argument("--spare-frontend-slots", type=int, default=0, help=argparse.SUPPRESS)
    gateway = sub.add_parser(
        "gateway",
        help="frontends only; workers attach by label",
        description="Frontends only: own the shared memory and queues; workers in other "
        "containers attach by --label (shmgate worker).",
    )
    add_gateway_flags(gateway)
    sub.add_parser("worker", help="one model worker (see shmgate worker --help)", add_help=False)
    cleanup = sub.add_parser("cleanup", help="remove IPC objects of dead instances")
    cleanup.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    cleanup.add_argument("--list", action="store_true", help="list the live instances (id, label, pid, model)")
    sub.add_parser("bench", help="load generator (see shmgate bench --help)", add_help=False)
    # No help=: a subcommand without help is left out of the command list; the supervisor runs it.
    frontend = sub.add_parser("frontend")
    frontend.add_argument("--instance", required=True, help=argparse.SUPPRESS)
    frontend.add_argument("--slot", type=int, required=True, help=argparse.SUPPRESS)
    # The shared listening socket's descriptor (--listen shared); without it the frontend binds its own.
    frontend.add_argument("--fd", type=int, default=None, help=argparse.SUPPRESS)
    add_gateway_flags(frontend)
    return parser


_SERVE_DESCRIPTION = (
    "Serve a model: HTTP frontends and model workers, supervised, in one command. Every flag "
    "also reads the SHMGATE_* variable shown with it; the flag wins."
)


def main(argv: list[str] | None = None) -> int:
    started_at = time.monotonic()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        os.execv(sys.executable, [sys.executable, "-m", "shmgate.worker", *argv[1:]])
    if argv and argv[0] == "bench":
        from shmgate.bench_client.loadgen import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper() if hasattr(args, "log_level") else "INFO",
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
    )
    if args.command in ("serve", "gateway") and any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        log.warning(
            "--api-key on the command line is visible to every user of this machine (ps, /proc); "
            "set SHMGATE_API_KEY in the environment instead"
        )
    if args.command in ("serve", "gateway"):
        try:
            models = declared_models(args)
        except NodeConfigError as exc:
            print(f"shmgate {args.command}: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    if args.command == "serve":
        try:
            check_device(
                args.device, visible_gpus(os.environ, _gpu_count()), given=origin(argv, "--device", args.device)
            )
            for m in models:
                if m.device != args.device:  # its own, from the config file
                    check_device(
                        m.device,
                        visible_gpus(os.environ, _gpu_count()),
                        given=f"{args.config}: model {m.public_id!r}: device {m.device}",
                    )
        except ConfigError as exc:
            print(f"shmgate serve: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        misfit = [] if args.skip_gpu_fit_check else gpu_misfits(args)
        if misfit:
            print(f"shmgate serve: error: {misfit[0]} (--skip-gpu-fit-check starts anyway)", file=sys.stderr)
            return EXIT_USAGE
    try:
        if args.command == "cleanup":
            return _cleanup(args)
        if args.command == "frontend":
            return _run_frontend(args)
        return _run_supervised(args, with_workers=args.command == "serve", started_at=started_at)
    except SetupError as exc:
        log.error("%s", exc)
        return EXIT_USAGE


def _cleanup(args: argparse.Namespace) -> int:
    """``shmgate cleanup [--dry-run] [--list]``: remove (or list) dead instances' IPC objects; list live ones."""
    from shmgate.shared.instance import cleanup_leftovers, instance_objects, live_instances

    if args.list:
        live = live_instances()
        print(f"{len(live)} live instance(s)")
        for inst in live:
            print(f"  {inst.instance_id}  label={inst.label}  pid={inst.supervisor_pid}  model={inst.model or '?'}")
    if args.dry_run:
        dead = cleanup_leftovers(dry_run=True)
        print(f"would remove {len(dead)} dead instance(s)" + (":" if dead else ""))
        for instance_id in dead:
            print(f"  {instance_id}: " + " ".join(instance_objects(instance_id)))
    elif not args.list:
        removed = cleanup_leftovers()
        print(f"removed {len(removed)} dead instance(s)" + (f": {', '.join(removed)}" if removed else ""))
    return 0


def declared_models(args: argparse.Namespace) -> list[ModelConfig]:
    """The models ``serve`` / ``gateway`` serve, each with the global flags filled in where it sets nothing:
    from ``--config`` (a TOML file, gateway/node_config.py) or the ``--model`` flags. Kept on ``args``.

    Raises NodeConfigError (one line naming the model and the key) for what can be checked before
    anything starts: the spec, the checkpoint directory, the extra the model needs, repeated ids.
    """
    known: list[ModelConfig] | None = getattr(args, "node_models", None)
    if known is not None:
        return known
    if getattr(args, "config", None):
        if getattr(args, "model_all", None):
            raise NodeConfigError(f"--config {args.config} and --model both declare models; use one of them")
        if getattr(args, "served_model_name_all", None):
            raise NodeConfigError(
                f"--served-model-name with --config {args.config}: give each model's served_model_name in the file"
            )
        configs = load_node_config(args.config)
    else:
        names = getattr(args, "served_model_name_all", None) or (
            [args.served_model_name] if args.served_model_name else []
        )
        configs = from_flags(getattr(args, "model_all", None) or [args.model], names)
    args.node_models = [config.with_globals(args, alone=len(configs) == 1) for config in configs]
    return list(args.node_models)


# Gateway flags a frontend child does not get on its command line: the API key reaches it in its
# environment (argv is visible in ps); the rest are the supervisor's. --host and --port are
# forwarded (the port the supervisor bound, when --port 0): a frontend that listens on its own
# socket (--listen reuseport) binds them; with a shared socket it gets the descriptor (--fd).
_NOT_FORWARDED = frozenset(
    {
        "api_key",
        "frontends",
        "arena_size",
        "max_workers",
        "queue_depth",
        "stall_timeout_s",
        "log_stats_interval_s",
        "config",
    }
)


def fill_allowed_hosts(args: argparse.Namespace) -> None:
    """Set ``--allowed-hosts``, when not given, to the default for ``--host``: decided once, in the
    supervisor, and forwarded to the frontends with the other flags."""
    if not args.allowed_hosts:
        from shmgate.gateway.guards import default_allowed_hosts

        args.allowed_hosts = ",".join(default_allowed_hosts(args.host))


def _frontend_argv(args: argparse.Namespace, instance_id: str, slot: int, fd: int | None) -> list[str]:
    """The frontend child's command: every gateway flag but _NOT_FORWARDED, read off the parser, so a
    new flag reaches the frontends without a second list to keep in step. ``fd``: the shared
    listening socket; None, the frontend binds its own (``--listen reuseport``)."""
    return [
        sys.executable,
        "-m",
        "shmgate.gateway",
        "frontend",
        "--instance",
        instance_id,
        "--slot",
        str(slot),
        *(["--fd", str(fd)] if fd is not None else []),
        *forward(args, add_gateway_flags, skip=_NOT_FORWARDED),
    ]


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


def _worker_plan(args: argparse.Namespace) -> tuple[list[Placement], int]:
    """(each worker's device and visible GPU, torch threads per worker), every model's workers together."""
    plans = _model_plans(args)
    placements = [p for _, model_placements in plans for p in model_placements]
    return placements, _threads(args, len(placements))


def _model_plans(args: argparse.Namespace) -> list[tuple[ModelConfig, list[Placement]]]:
    """Each declared model with its workers' placements (its own device and worker count, else the flags').

    One model alone keeps the machine's default (two CPU workers for a small model); with several, a
    model whose count is auto gets one CPU worker, so that two models do not start four processes on two cores.
    """
    gpu_ids = visible_gpus(os.environ, _gpu_count())
    models = declared_models(args)
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


def gpu_misfits(args: argparse.Namespace, free: Mapping[str, int] | None = None) -> list[str]:
    """The GPUs whose declared models are estimated not to fit in their free memory (gateway/gpu_fit.py),
    one line each; none without a GPU placement. ``free``: each GPU's free bytes (None: asked of CUDA)."""
    from shmgate.gateway.gpu_fit import PlacedModel, cuda_free_bytes, misfits, placed_needs

    try:
        plans = _model_plans(args)
    except SetupError:
        return []  # a placement that cannot work: _run_supervised says so
    placed = [
        PlacedModel(
            m.public_id,
            m.model,
            m.dtype or "auto",
            m.max_batch_size or 0,
            tuple(p.visible for p in placements),
            _max_pixels(m.mm_processor_kwargs),
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


def _threads(args: argparse.Namespace, n_workers: int) -> int:
    return int(args.threads or max(1, usable_cpus() // max(1, n_workers)))


def _worker_children(args: argparse.Namespace, instance_id: str) -> list[tuple[list[str], dict[str, str]]]:
    plans = _model_plans(args)
    threads = _threads(args, sum(len(placements) for _, placements in plans))
    children = []
    for model, placements in plans:
        batching = argparse.Namespace(
            **{
                **vars(args),
                **{
                    key: getattr(model, key) for key in ("max_batch_size", "max_batch_wait_ms", "batch_policy", "dtype")
                },
            }
        )
        for placement in placements:
            env = {} if placement.visible is None else {"CUDA_VISIBLE_DEVICES": placement.visible}
            argv = [
                sys.executable,
                "-m",
                "shmgate.worker",
                "--instance",
                instance_id,
                "--model",
                model.model,
                "--device",
                placement.device,
                "--threads",
                str(threads),
                "--log-level",
                args.log_level,
                *forward(batching, add_batching_flags),
                *forward(args, add_tracing_flags),
            ]
            if model.served_model_name:
                argv += ["--served-model-name", model.served_model_name]
            children.append((argv, env))
    return children


def _worker_slots(asked: int, n_workers: int, *, with_workers: bool) -> int:
    """Worker slots (one control queue each, counted against RLIMIT_MSGQUEUE) for the workers to come.

    ``serve`` knows its workers: twice their number leaves a slot for each restart that overlaps
    its predecessor's heartbeat. ``gateway`` cannot know how many containers will attach, so it
    keeps 16 unless told (a pod's manifest sets it from its worker containers).
    """
    if with_workers:
        return max(asked, 2 * n_workers, 2)
    return asked or 16


def _run_supervised(args: argparse.Namespace, *, with_workers: bool, started_at: float) -> int:
    from shmgate.gateway.startup_log import ServingLog, shm_free_bytes, summary_lines
    from shmgate.shared.instance import Instance, ModelQueue, cleanup_leftovers
    from shmgate.shared.transport import PosixNodeStats, PosixSupervisorLink
    from shmgate.supervise.supervisor import ChildProcess, Supervisor, child_env

    models = declared_models(args)
    model_id = models[0].public_id
    removed = cleanup_leftovers()
    if removed:
        log.warning("removed leftovers of %d dead instance(s)", len(removed))
    n_frontends = args.frontends or usable_cpus()
    n_workers = len(_worker_plan(args)[0]) if with_workers else 0
    n_worker_slots = _worker_slots(args.max_workers, n_workers, with_workers=with_workers)
    # reuseport: bound, not listening; the frontends listen on sockets of their own (gateway/listen.py)
    sock, args.listen = bind_supervisor(args.host, args.port, args.listen)
    args.port = sock.getsockname()[1]  # the kernel's choice for --port 0
    shared_fd = sock.fileno() if args.listen == "shared" else None
    instance = Instance.create(
        arena_size=args.arena_size,
        n_frontends=n_frontends + getattr(args, "spare_frontend_slots", 0),
        n_workers=n_worker_slots,
        label=args.label,
        queue_depth=args.queue_depth,
        stall_timeout_s=stall_timeout_for(models[0].model, args.stall_timeout_s),
        models=[
            ModelQueue(m.public_id, m.queue_depth or args.queue_depth, stall_timeout_for(m.model, m.stall_timeout_s))
            for m in models
        ],
    )
    instance_id = instance.names.instance_id
    fill_allowed_hosts(args)
    args.models_json = models_json(models)  # the frontends serve every model, each with its own limits
    secrets_env = {"SHMGATE_API_KEY": args.api_key} if args.api_key else {}
    frontends = [
        ChildProcess(
            "frontend",
            k,
            _frontend_argv(args, instance_id, k, shared_fd),
            child_env(secrets_env),
            pass_fds=(shared_fd,) if shared_fd is not None else (),
        )
        for k in range(n_frontends)
    ]
    worker_models = [m.public_id for m, placements in _model_plans(args) for _ in placements] if with_workers else []
    workers = [
        ChildProcess("worker", i, argv, child_env(env), model=model)
        for i, ((argv, env), model) in enumerate(
            zip(_worker_children(args, instance_id) if with_workers else [], worker_models)
        )
    ]
    url = f"http://{f'[{args.host}]' if ':' in args.host else args.host}:{args.port}"
    for line in summary_lines(
        _summary(args, instance_id, url, n_frontends, with_workers, model_id=model_id), shm_free_bytes()
    ):
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
        stats_interval_s=args.log_stats_interval_s,
    )
    try:
        supervisor = Supervisor.for_instance(
            instance, frontends, workers, drain_timeout_s=args.drain_timeout_s, on_tick=serving_log.tick
        )
        if len(models) > 1 and with_workers:  # a model that keeps dying is failed; the others keep serving
            supervisor.restart_budget = args.restart_budget
            supervisor.on_model_failed = functools.partial(_mark_failed, instance)
        return supervisor.run()
    finally:
        for queue in request_queues:
            queue.close()
        sock.close()


def _mark_failed(instance: Instance, model: str) -> None:
    """The supervisor gave up every worker of ``model``: its row says so to the frontends."""
    from shmgate.shared.segment import ModelState

    index = instance.segment.model_index(model)
    if index >= 0:
        instance.segment.mark_model(index, ModelState.FAILED)


def _summary(
    args: argparse.Namespace,
    instance_id: str,
    url: str,
    n_frontends: int,
    with_workers: bool,
    model_id: str | None = None,
) -> Summary:
    """The startup summary's facts, from the same plan the workers are started with."""
    from shmgate.gateway.startup_log import Summary, plural

    models = declared_models(args)
    spec = parse_model_spec(models[0].model)
    hf = spec.kind in (ModelKind.HF_CHAT, ModelKind.HF_EMBED)
    model_spec = args.model
    if len(models) > 1:  # "clients send "model": "a" or "b""
        model_id = '" or "'.join(m.public_id for m in models)
        model_spec = ", ".join(m.model for m in models)
    if with_workers:
        placements, threads = _worker_plan(args)
        gpus = sorted({p.visible for p in placements if p.visible is not None})
        where = f"GPU {', '.join(gpus)}" if gpus else ", ".join(sorted({p.device for p in placements}))
        cpu = all(p.device == "cpu" for p in placements)
        workers = f"{plural(len(placements), 'worker')} on {where}"
        workers += f", {plural(threads, 'torch thread')} each" if cpu else ""
        dtype = (("float32" if cpu else "bfloat16") if args.dtype == "auto" else args.dtype) if hf else "the model's"
    else:
        workers, dtype = f"workers attach by label {args.label!r} (shmgate worker)", "chosen by each worker"
    return Summary(
        version=version(),
        instance_id=instance_id,
        label=args.label,
        model_id=model_id or spec.public_id,
        model_spec=model_spec,
        url=url,
        n_frontends=n_frontends,
        workers=workers,
        dtype=dtype,
        arena_bytes=args.arena_size,
        auth=bool(args.api_key),
        traces=args.otlp_traces_endpoint or "",
    )


def _run_frontend(args: argparse.Namespace) -> int:
    from shmgate.shared.parent_death import follow_supervisor

    # SIGKILL, not SIGTERM: shared/parent_death.py says why. Before the slow imports, so a
    # supervisor gone meanwhile is noticed at once.
    follow_supervisor(signal.SIGKILL)
    import uvicorn

    from shmgate.gateway.addresses import AllowList
    from shmgate.gateway.app import AppOptions, create_app
    from shmgate.gateway.fetch import FetchPolicy
    from shmgate.gateway.frontend import FrontendLimits
    from shmgate.gateway.guards import default_allowed_hosts, parse_allowed_hosts
    from shmgate.gateway.http_limits import ConnectionLimits, http_protocol
    from shmgate.gateway.intake import IntakeLimits
    from shmgate.gateway.video import VideoLimits, configure

    configure(VideoLimits(max_seconds=args.max_video_seconds, max_frames=args.max_video_frames))
    options = AppOptions(
        instance_id=args.instance,
        slot=args.slot,
        model=args.model,
        served_model_name=args.served_model_name or "",
        api_key=args.api_key,
        metrics_need_key=args.metrics_need_key,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        intake=IntakeLimits(max_images=args.max_images, allow_image_urls=args.allow_image_urls),
        limits=FrontendLimits(
            max_in_flight=args.max_in_flight,
            request_timeout_s=args.request_timeout_s,
            max_pixels=args.max_pixels,
            decode_threads=args.decode_threads,
            decode_memory_bytes=int(args.decode_memory_mb * (1 << 20)),
            decode_wait_s=args.decode_wait_s,
        ),
        result_cache_bytes=int(args.result_cache_mb * (1 << 20)),
        server_timing=args.server_timing,
        allowed_hosts=parse_allowed_hosts(args.allowed_hosts) or default_allowed_hosts(args.host),
        processor_kwargs=json.loads(args.mm_processor_kwargs) or None,
        models=tuple(parse_models_json(args.models_json)) if args.models_json else (),
        image_urls=FetchPolicy(
            allowlist=AllowList.parse(args.image_url_allowlist),
            max_bytes=args.image_url_max_bytes,
            timeout_s=args.image_url_timeout_s,
        ),
    )
    # uvicorn's own fd= support wraps the descriptor as AF_UNIX, so accepted connections
    # would miss asyncio's TCP_NODELAY and keep-alive clients would hit Nagle + delayed-ACK
    # stalls of 40 ms. Wrapping it with its real family avoids that. Without --fd the frontend
    # binds a socket of its own (--listen reuseport), which uvicorn listens on after the
    # lifespan's start-up: a frontend still starting takes no connection.
    sock = socket.socket(fileno=args.fd) if args.fd is not None else bind_frontend(args.host, args.port)
    config = uvicorn.Config(
        create_app(options),
        # a bounded request head, slow clients cut, a cap on connections (gateway/http_limits.py)
        http=http_protocol(
            ConnectionLimits(
                header_timeout_s=args.header_timeout_s,
                body_timeout_s=args.body_timeout_s,
                body_min_rate=args.body_min_rate,
                max_connections=args.max_connections,
            )
        ),
        log_level=args.log_level.lower() if args.log_level.lower() != "info" else "warning",
        timeout_graceful_shutdown=int(args.drain_timeout_s),
        access_log=args.access_log,
        lifespan="on",
    )
    if args.access_log:  # uvicorn set its access logger to --log-level, WARNING when "info" (above)
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    if args.otlp_traces_endpoint:  # after uvicorn's logging setup: the access log gains the trace id
        from shmgate.gateway.tracing import enable_tracing

        config.app = enable_tracing(config.app, args.otlp_traces_endpoint, slot=args.slot, access_log=args.access_log)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
