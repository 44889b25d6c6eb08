"""The ``shmgate`` command: serve, gateway, worker, cleanup, bench (and the internal frontend).

Settings are parsed here once and each part gets only the values it uses; this
is the only module that calls ``sys.exit`` (through ``main``'s return code).

    shmgate serve     gateway + supervised workers, one command (the embedded default model)
    shmgate gateway   frontends only: owns the IPC objects; workers attach from elsewhere
    shmgate worker    one model worker (exec of ``python -m worker``, the command compose runs)
    shmgate cleanup   remove the IPC objects of dead instances
    shmgate bench     the load generator (gateway/loadgen.py)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping

from gateway.placement import Placement, gpu_count, worker_placements
from shared.cpus import usable_cpus
from shared.errors import SetupError
from shared.flags import add_batching_flags, env, forward
from shared.models import ModelKind, parse_model_spec
from shared.names import parse_size

__all__ = ["main"]

log = logging.getLogger("shmgate")


# The longest a work loop may go without progress. The embedded classifier's longest step (a
# batch of 8 on a busy 2-core CPU) is well under a second, so 10 s never fires on a healthy
# worker and still brings a wedged one back within the 30 s the tests allow. A generative model
# stamps per decode step, but its prefill of a full batch of large images is one step: the rule
# is at least 3x the slowest single forward pass under peak load (docs/RELIABILITY.md).
DEFAULT_STALL_TIMEOUT_S = 10.0
HF_STALL_TIMEOUT_S = 60.0


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


def _add_gateway_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env("PORT", "8000"))
    p.add_argument("--frontends", type=int, default=env("FRONTENDS", "0"),
                   help="frontend processes (default: the CPUs this process may use: cgroup limit, affinity, cores)")
    p.add_argument("--model", default=env("MODEL", "efficientnet-lite0"))
    p.add_argument("--served-model-name", default=env("SERVED_MODEL_NAME"),
                   help="the model id clients send and /v1/models lists (default: from --model; the directory's "
                        "name for hf:<dir>, org/name for a hub-cache snapshot)")
    p.add_argument("--arena-size", default=env("ARENA_SIZE", "1GiB"))
    p.add_argument("--api-key", default=env("API_KEY"),
                   help="prefer the SHMGATE_API_KEY environment variable: a flag is visible in ps")
    p.add_argument("--metrics-need-key", action="store_true", default=env("METRICS_NEED_KEY") == "1")
    p.add_argument("--label", default=env("LABEL", "default"))
    p.add_argument("--max-images", type=int, default=env("MAX_IMAGES", "8"))
    p.add_argument("--max-in-flight", type=int, default=env("MAX_IN_FLIGHT", "256"),
                   help="per frontend; beyond it requests get 429")
    p.add_argument("--request-timeout-s", type=float, default=env("REQUEST_TIMEOUT_S", "60"))
    p.add_argument("--max-body-mb", type=float, default=env("MAX_BODY_MB", "32"))
    p.add_argument("--max-pixels", type=int, default=env("MAX_PIXELS", "40000000"))
    p.add_argument("--decode-threads", type=int, default=env("DECODE_THREADS", "2"))
    p.add_argument("--max-workers", type=int, default=env("MAX_WORKERS", "0"),
                   help="worker slots in the segment, each with a control queue (default: serve twice its "
                   "workers, gateway 16)")
    p.add_argument("--queue-depth", type=int, default=env("QUEUE_DEPTH", "64"),
                   help="message queue depth (capped by /proc/sys/fs/mqueue/msg_max)")
    p.add_argument("--drain-timeout-s", type=float, default=env("DRAIN_TIMEOUT_S", "30"))
    p.add_argument("--stall-timeout-s", type=float, default=env("STALL_TIMEOUT_S"),
                   help="replace a frontend or worker whose work loop makes no progress for this long "
                        f"(default {DEFAULT_STALL_TIMEOUT_S:g} s, {HF_STALL_TIMEOUT_S:g} s for hf: models; 0: never); "
                        "see docs/RELIABILITY.md for slow models")
    p.add_argument("--log-level", default=env("LOG_LEVEL", "info"))
    p.add_argument("--allow-image-urls", action="store_true", default=env("ALLOW_IMAGE_URLS") == "1",
                   help="fetch http(s) image URLs (off by default; see docs/SECURITY.md)")
    p.add_argument("--image-url-allowlist", type=_allowlist, default=env("IMAGE_URL_ALLOWLIST", ""),
                   help="comma list of CIDRs / host names that image URLs may reach besides public addresses")
    p.add_argument("--image-url-max-bytes", type=parse_size, default=env("IMAGE_URL_MAX_BYTES", "20MiB"))
    p.add_argument("--image-url-timeout-s", type=float, default=env("IMAGE_URL_TIMEOUT_S", "10"))
    p.add_argument("--mm-processor-kwargs", type=_json_object, default=env("MM_PROCESSOR_KWARGS", "{}"),
                   help='hf: models: image processor arguments over the checkpoint\'s, as JSON, e.g. '
                        '\'{"max_pixels": 200704}\' (docs/MODELS.md "Processor options")')
    p.add_argument("--result-cache-mb", type=float, default=env("RESULT_CACHE_MB", "0"),
                   help="per frontend: keep this many MiB of deterministic answers (embeddings, the classifier's); "
                        "0: off (docs/MODELS.md)")
    p.add_argument("--server-timing", action="store_true", default=env("SERVER_TIMING") == "1",
                   help="add a Server-Timing header (ms per serving stage) to non-streamed answers; off by "
                        "default: it tells a client how long its image waited and was decoded (docs/SECURITY.md)")


def _json_object(text: str) -> str:
    """Check --mm-processor-kwargs is a JSON object when the flags are parsed (the frontends parse it again)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return text


def _allowlist(text: str) -> str:
    """Validate the allow-list when the flags are parsed, so a typo stops ``serve`` at once."""
    from gateway.addresses import AllowList

    try:
        AllowList.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=env("WORKERS", "0"),
                   help="worker processes (default: one per GPU; on CPU two, one for hf: models)")
    p.add_argument("--workers-per-gpu", type=int, default=env("WORKERS_PER_GPU", "1"))
    p.add_argument("--device", default=env("DEVICE"),
                   help="cpu, cuda (every GPU) or cuda:N (GPU N only) (default: cuda when a GPU is present)")
    p.add_argument("--threads", type=int, default=env("THREADS", "0"),
                   help="torch threads per CPU worker (default: usable CPUs / workers; see --frontends)")
    add_batching_flags(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shmgate", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="gateway and workers in one command")
    _add_gateway_flags(serve)
    _add_worker_flags(serve)
    # Slots with a partition and a reply channel but no HTTP process: a diagnostic tool (or a
    # test forging descriptors) attaches as a frontend there without stealing a real
    # frontend's replies. They take a share of the arena, so the default is none.
    serve.add_argument("--spare-frontend-slots", type=int, default=0, help=argparse.SUPPRESS)
    gateway = sub.add_parser("gateway", help="frontends only; workers attach by label")
    _add_gateway_flags(gateway)
    sub.add_parser("worker", help="one model worker (see shmgate worker --help)", add_help=False)
    cleanup = sub.add_parser("cleanup", help="remove IPC objects of dead instances")
    cleanup.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    cleanup.add_argument("--list", action="store_true", help="list the live instances (id, label, pid, model)")
    sub.add_parser("bench", help="load generator (see shmgate bench --help)", add_help=False)
    frontend = sub.add_parser("frontend", help=argparse.SUPPRESS)
    frontend.add_argument("--instance", required=True)
    frontend.add_argument("--slot", type=int, required=True)
    frontend.add_argument("--fd", type=int, required=True)
    _add_gateway_flags(frontend)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "worker":
        os.execv(sys.executable, [sys.executable, "-m", "worker", *argv[1:]])
    if argv and argv[0] == "bench":
        from gateway.loadgen import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper() if hasattr(args, "log_level") else "INFO",
                        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s")
    if args.command in ("serve", "gateway") and any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        log.warning("--api-key on the command line is visible to every user of this machine (ps, /proc); "
                    "set SHMGATE_API_KEY in the environment instead")
    try:
        if args.command == "cleanup":
            return _cleanup(args)
        if args.command == "frontend":
            return _run_frontend(args)
        return _run_supervised(args, with_workers=args.command == "serve")
    except SetupError as exc:
        log.error("%s", exc)
        return 2


def _cleanup(args: argparse.Namespace) -> int:
    """``shmgate cleanup [--dry-run] [--list]``: remove (or list) dead instances' IPC objects; list live ones."""
    from shared.instance import cleanup_leftovers, instance_objects, live_instances

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


def _served_model(args: argparse.Namespace) -> str:
    """The public id of ``--model`` (or ``--served-model-name``), after the checks that need nothing started:
    the spec, the checkpoint directory, the extra the model needs. Raises SetupError with the one line."""
    from shared.models import resolve_model
    from shared.segment import check_model_id

    try:
        public_id = resolve_model(args.model, args.served_model_name).public_id
        check_model_id(public_id)
    except ValueError as exc:
        raise SetupError(f"--model {args.model}: {exc}") from None
    return public_id


# Gateway flags a frontend child does not get on its command line: the API key reaches it in its
# environment (argv is visible in ps); the rest are the supervisor's (the socket is passed as --fd).
_NOT_FORWARDED = frozenset(
    {"api_key", "host", "port", "frontends", "arena_size", "max_workers", "queue_depth", "stall_timeout_s"}
)


def _frontend_argv(args: argparse.Namespace, instance_id: str, slot: int, fd: int) -> list[str]:
    """The frontend child's command: every gateway flag but _NOT_FORWARDED, read off the parser, so a
    new flag reaches the frontends without a second list to keep in step."""
    return [sys.executable, "-m", "gateway", "frontend", "--instance", instance_id, "--slot", str(slot),
            "--fd", str(fd), *forward(args, _add_gateway_flags, skip=_NOT_FORWARDED)]


def _default_cpu_workers(model: str, cores: int) -> int:
    """Two workers splitting the cores, for models small enough to load twice; else one.

    Two processes of cores/2 torch threads beat one of all cores for EfficientNet-Lite0 on
    2 cores (docs/BENCHMARKS.md, end to end: the shmgate-efficientnet rows against -1w, e.g.
    80.9 vs 59.6 req/s at concurrency 8): one runs a batch while the other's batch forms and
    its Python overhead runs, where one process leaves cores idle between batches. A Hugging
    Face VLM's weights (GBs) are loaded once.
    """
    if _loads_hf_weights(model) or cores < 2:
        return 1
    return 2


def _worker_plan(args: argparse.Namespace) -> tuple[list[Placement], int]:
    """(each worker's device and visible GPU, torch threads per worker) from the flags and the machine."""
    gpu_ids = visible_gpus(os.environ, _gpu_count())
    device = args.device or ("cuda" if gpu_ids else "cpu")
    placements = worker_placements(
        device, workers=args.workers, workers_per_gpu=args.workers_per_gpu, gpu_ids=gpu_ids,
        cpu_workers=_default_cpu_workers(args.model, usable_cpus()),
    )
    threads = args.threads or max(1, usable_cpus() // len(placements))
    return placements, threads


def _worker_children(args: argparse.Namespace, instance_id: str) -> list[tuple[list[str], dict[str, str]]]:
    placements, threads = _worker_plan(args)
    children = []
    for placement in placements:
        env = {} if placement.visible is None else {"CUDA_VISIBLE_DEVICES": placement.visible}
        argv = [
            sys.executable, "-m", "worker", "--instance", instance_id, "--model", args.model,
            "--device", placement.device, "--threads", str(threads), "--log-level", args.log_level,
            *forward(args, add_batching_flags),
        ]
        if args.served_model_name:
            argv += ["--served-model-name", args.served_model_name]
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


def _run_supervised(args: argparse.Namespace, *, with_workers: bool) -> int:
    from gateway.supervisor import ChildProcess, Supervisor, child_env
    from shared.instance import Instance, cleanup_leftovers

    model_id = _served_model(args)
    removed = cleanup_leftovers()
    if removed:
        log.warning("removed leftovers of %d dead instance(s)", len(removed))
    n_frontends = args.frontends or usable_cpus()
    n_workers = len(_worker_plan(args)[0]) if with_workers else 0
    n_worker_slots = _worker_slots(args.max_workers, n_workers, with_workers=with_workers)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        raise SetupError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    instance = Instance.create(
        arena_size=parse_size(args.arena_size),
        n_frontends=n_frontends + getattr(args, "spare_frontend_slots", 0),
        n_workers=n_worker_slots,
        label=args.label,
        queue_depth=args.queue_depth,
        stall_timeout_s=stall_timeout_for(args.model, args.stall_timeout_s),
        model=model_id,
    )
    instance_id = instance.names.instance_id
    secrets_env = {"SHMGATE_API_KEY": args.api_key} if args.api_key else {}
    frontends = [
        ChildProcess("frontend", k, _frontend_argv(args, instance_id, k, sock.fileno()), child_env(secrets_env),
                     pass_fds=(sock.fileno(),))
        for k in range(n_frontends)
    ]
    workers = [
        ChildProcess("worker", i, argv, child_env(env))
        for i, (argv, env) in enumerate(_worker_children(args, instance_id) if with_workers else [])
    ]
    log.info("instance %s listening on http://%s:%d with %d frontends and %d workers (model %s)", instance_id,
             args.host, args.port, n_frontends, len(workers), args.model)
    log.info("clients send \"model\": %s", json.dumps(model_id))
    try:
        return Supervisor(instance, frontends, workers, drain_timeout_s=args.drain_timeout_s).run()
    finally:
        sock.close()


def _run_frontend(args: argparse.Namespace) -> int:
    from shared.parent_death import follow_supervisor

    # SIGKILL, not SIGTERM: shared/parent_death.py says why. Before the slow imports, so a
    # supervisor gone meanwhile is noticed at once.
    follow_supervisor(signal.SIGKILL)
    import uvicorn

    from gateway.addresses import AllowList
    from gateway.app import AppOptions, create_app
    from gateway.fetch import FetchPolicy
    from gateway.frontend import FrontendLimits
    from gateway.http_limits import http_protocol
    from gateway.intake import IntakeLimits

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
        ),
        result_cache_bytes=int(args.result_cache_mb * (1 << 20)),
        server_timing=args.server_timing,
        processor_kwargs=json.loads(args.mm_processor_kwargs) or None,
        image_urls=FetchPolicy(
            allowlist=AllowList.parse(args.image_url_allowlist),
            max_bytes=args.image_url_max_bytes,
            timeout_s=args.image_url_timeout_s,
        ),
    )
    # uvicorn's own fd= support wraps the descriptor as AF_UNIX, so accepted connections
    # would miss asyncio's TCP_NODELAY and keep-alive clients would hit Nagle + delayed-ACK
    # stalls of 40 ms. Wrapping it with its real family avoids that.
    sock = socket.socket(fileno=args.fd)
    config = uvicorn.Config(
        create_app(options),
        http=http_protocol(),  # a bounded request head (gateway/http_limits.py)
        log_level=args.log_level.lower() if args.log_level.lower() != "info" else "warning",
        timeout_graceful_shutdown=int(args.drain_timeout_s),
        access_log=False,
        lifespan="on",
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0
