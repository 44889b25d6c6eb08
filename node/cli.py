"""The ``shmgate`` command: a thin layer of subcommands over the node (this package).

    shmgate serve     gateway + supervised workers, one command (the embedded default model)
    shmgate gateway   frontends only: owns the IPC objects; workers attach from elsewhere
    shmgate worker    one model worker (exec of ``python -m shmgate.worker``, the command compose runs)
    shmgate cleanup   remove the IPC objects of dead instances
    shmgate batches   check a Batch API store (``check``), copy it consistently (``backup``): docs/BATCH.md
    shmgate bench     the load generator (bench_client/loadgen.py)

Each command's flags come from its configuration class (node/config.py ``ServeConfig``,
``GatewayConfig``; worker/config.py ``WorkerConfig``): parsed once here into a typed value, checked
against the machine, then handed to node/serve.py. This is the only module that ends the process
with a status (through ``main``'s return code).
"""

from __future__ import annotations

import argparse
import logging
import os
import sqlite3
import sys
import time
from collections.abc import Sequence

from shmgate.node.checks import ConfigError, check_device
from shmgate.node.config import AnyNodeConfig, GatewayConfig, ServeConfig
from shmgate.node.models import NodeConfigError
from shmgate.node.plan import _gpu_count, declared_models, gpu_misfits, visible_gpus
from shmgate.shared.errors import EXIT_USAGE, SetupError
from shmgate.shared.flags import ShmgateParser, origin, version
from shmgate.shared.model_config import ModelConfig
from shmgate.shared.options import add_options, from_args

__all__ = ["build_parser", "main", "parse_config"]

log = logging.getLogger("shmgate")

_SERVE_DESCRIPTION = (
    "Serve a model: HTTP frontends and model workers, supervised, in one command. Every flag "
    "also reads the SHMGATE_* variable shown with it; the flag wins."
)
# The commands whose flags this parser reads, and their configuration class.
CONFIGS: dict[str, type[GatewayConfig] | type[ServeConfig]] = {"serve": ServeConfig, "gateway": GatewayConfig}


def build_parser() -> argparse.ArgumentParser:
    parser = ShmgateParser(prog="shmgate", description="An OpenAI-compatible HTTP gateway for vision models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=ShmgateParser)
    serve = sub.add_parser("serve", help="gateway and workers in one command", description=_SERVE_DESCRIPTION)
    add_options(serve, ServeConfig)
    gateway = sub.add_parser(
        "gateway",
        help="frontends only; workers attach by label",
        description="Frontends only: own the shared memory and queues; workers in other "
        "containers attach by --label (shmgate worker).",
    )
    add_options(gateway, GatewayConfig)
    # Parsed by their own programs (worker/__main__.py, bench_client/loadgen.py): listed here for --help.
    sub.add_parser("worker", help="one model worker (see shmgate worker --help)", add_help=False)
    cleanup = sub.add_parser("cleanup", help="remove IPC objects of dead instances")
    cleanup.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    cleanup.add_argument("--list", action="store_true", help="list the live instances (id, label, pid, model)")
    sub.add_parser("bench", help="load generator (see shmgate bench --help)", add_help=False)
    _add_batches(sub)
    return parser


def _add_batches(sub: argparse._SubParsersAction[ShmgateParser]) -> None:
    """``shmgate batches check|backup``: the Batch API store's check and consistent copy (docs/BATCH.md)."""
    batches = sub.add_parser("batches", help="check or back up a Batch API store (--batch-dir)")
    actions = batches.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=ShmgateParser)
    check = actions.add_parser(
        "check",
        help="is the store sound: one line saying so (exit 0) or what is wrong (exit 1)",
        description="Check a batch store as a frontend does when it opens it (its database against SQLite's "
        "check, its rows against its files); reads only, safe beside a running node.",
    )
    check.add_argument("--full", action="store_true", help="SQLite's integrity_check (slower) instead of quick_check")
    backup = actions.add_parser(
        "backup",
        help="copy the store consistently into a new directory (safe beside a running node)",
        description="Copy the database with SQLite's online backup API, then the files its rows name; the copy is "
        "checked. Restore: stop the node and put the copy in place of --batch-dir (docs/BATCH.md).",
    )
    backup.add_argument("destination", help="a new directory for the copy")
    for action in (check, backup):
        action.add_argument(
            "--batch-dir",
            default=os.environ.get("SHMGATE_BATCH_DIR", ""),
            help="the store's directory (default: $SHMGATE_BATCH_DIR, else the default of shmgate serve's --port)",
        )
        action.add_argument("--port", type=int, default=8000, help="the node's port, for the default directory")


def parse_config(argv: Sequence[str]) -> AnyNodeConfig:
    """``shmgate serve ...`` or ``shmgate gateway ...`` as its typed configuration (tests, tools)."""
    args = build_parser().parse_args(list(argv))
    return from_args(CONFIGS[args.command], args)


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
    if args.command == "cleanup":
        try:
            return _cleanup(args)
        except SetupError as exc:
            log.error("%s", exc)
            return EXIT_USAGE
    if args.command == "batches":
        return _batches(args)
    config: AnyNodeConfig = from_args(CONFIGS[args.command], args)
    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        log.warning(
            "--api-key on the command line is visible to every user of this machine (ps, /proc); "
            "set SHMGATE_API_KEY in the environment instead"
        )
    try:
        models = declared_models(config)
    except NodeConfigError as exc:
        print(f"shmgate {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(config, ServeConfig):
        refusal = _machine_refusal(config, models, argv)
        if refusal:
            print(f"shmgate serve: error: {refusal}", file=sys.stderr)
            return EXIT_USAGE
    try:
        from shmgate.node.serve import run_supervised

        return run_supervised(config, models, started_at=started_at)
    except SetupError as exc:
        log.error("%s", exc)
        return EXIT_USAGE


def _machine_refusal(config: ServeConfig, models: list[ModelConfig], argv: Sequence[str]) -> str | None:
    """Why this machine cannot run ``config`` (a GPU it lacks, models that do not fit), or None."""
    gpus = visible_gpus(os.environ, _gpu_count())
    try:
        device, config_file = config.placement.device, config.gateway.node.config
        check_device(device, gpus, given=origin(argv, "--device", device))
        for m in models:
            if m.device != device:  # its own, from the config file: the file's key is what to change
                check_device(
                    m.device,
                    gpus,
                    given=f"{config_file}: model {m.public_id!r}: device {m.device}",
                    remedy=f'set device = "cpu" for this model in {config_file}',
                )
    except ConfigError as exc:
        return str(exc)
    misfit = [] if config.plan.skip_gpu_fit_check else gpu_misfits(config, models)
    if misfit:
        return f"{misfit[0]} (--skip-gpu-fit-check starts anyway)"
    return None


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


def _batches(args: argparse.Namespace) -> int:
    """``shmgate batches check|backup``: 0 sound (the copy too), 1 damaged, 2 no store there."""
    from shmgate.gateway.batch_check import DB_NAME, backup_store, check_store
    from shmgate.gateway.batch_store import default_batch_dir

    directory = args.batch_dir or default_batch_dir(args.port)
    if not os.path.isdir(directory):
        print(f"shmgate batches: error: {directory} is not a directory (set --batch-dir)", file=sys.stderr)
        return EXIT_USAGE
    if args.action == "check":
        report = check_store(directory, full=args.full)
    else:
        if not os.path.exists(os.path.join(directory, DB_NAME)):
            print(f"shmgate batches: error: {directory} holds no {DB_NAME}", file=sys.stderr)
            return EXIT_USAGE
        try:
            report = backup_store(directory, args.destination)
        except (OSError, sqlite3.Error) as exc:
            print(f"shmgate batches backup: error: {exc}", file=sys.stderr)
            return 1
    print(report.line())
    return 0 if report.sound else 1
