"""The load on a server under test: one run of bench_client.loadgen, the code behind ``shmgate bench``.

``options`` turns a scenario's choices into the load generator's own command-line options, so every
scenario drives its servers exactly as ``shmgate bench`` would, and ``run`` runs them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shmgate.bench_client import loadgen


def options(
    base_url: str,
    model: str,
    images: Path,
    *,
    concurrency: int,
    requests: int,
    server_pid: int | None = None,
    flags: Sequence[str] = (),
) -> argparse.Namespace:
    """``shmgate bench --base-url ... --model ... --images ... -c ... -n ... [--server-pid PID] FLAGS``."""
    argv = [*("--base-url", base_url, "--model", model, "--images", str(images)), *flags]
    argv += ["--concurrency", str(concurrency), "--requests", str(requests)]
    if server_pid is not None:
        argv += ["--server-pid", str(server_pid)]
    parser = argparse.ArgumentParser(prog="shmgate bench")
    loadgen.add_arguments(parser)
    return parser.parse_args(argv)


async def run(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """``loadgen.run`` of ``options(*args, **kwargs)``: the run's result (req/s, latencies, CPU, errors)."""
    return await loadgen.run(options(*args, **kwargs))
