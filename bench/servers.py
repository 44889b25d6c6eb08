"""Starting and stopping the servers under test: the one place that spells a server's command line.

``shmgate_serve`` is ``shmgate serve`` on a loopback port with a scenario's flags; ``comparison_server``
is one of the servers shmgate is measured against (bench/naive_server.py, floor_server.py,
litserve_server.py, naive_hf_server.py), run as a module of this package. ``ServerProcess`` runs
either in its own session, waits for its readiness path and stops its whole process group.

Invariants: every server is started in a session of its own and stopped as a process group (SIGTERM,
then SIGKILL after a grace period), in a ``finally`` of its caller, so no process a server forked
outlives the run; servers listen on 127.0.0.1 only; every server runs with the repository root as
its working directory, which is how ``python -m bench.<server>`` finds this package in another venv
(LitServe's) and how the base tree of an ABBA run replaces this one.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The 1024 px test photos every image benchmark sends (photo_folder gives the load generator only them).
PHOTOS = sorted((REPO / "tests" / "data" / "images").glob("*_1024.jpg"))
LITSERVE_PYTHON = REPO / "bench" / ".venv-litserve" / "bin" / "python"  # bench/setup_litserve.sh makes it
# An earlier checkout to compare with in the same run, e.g. `git worktree add --detach /tmp/base <commit>`,
# then SHMGATE_BENCH_BASE=/tmp/base: its code runs on this environment's packages.
BASE_TREE = Path(os.environ.get("SHMGATE_BENCH_BASE", "/nonexistent-base-tree"))


# A process started with tree_env's PYTHONPATH imports this first (site.py runs any sitecustomize on the
# path): it maps shmgate.<part> to the tree's own folder ahead of this environment's editable install,
# which maps it to this checkout. Children inherit the environment, so they map the same way.
_TREE_SITECUSTOMIZE = """\
import importlib.machinery, sys

class _TreeParts:
    tree, parts = {tree!r}, {parts!r}

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        top, _, rest = name.removeprefix("shmgate.").partition(".")
        if not name.startswith("shmgate.") or top not in cls.parts:
            return None
        return importlib.machinery.PathFinder.find_spec(name, [cls.tree + "/" + top] if rest else [cls.tree])

sys.meta_path.insert(0, _TreeParts)
"""


def tree_env(tree: Path) -> dict[str, str]:
    """The environment that runs ``tree``'s shmgate instead of this checkout's (for before/after runs).

    A tree whose shmgate/ holds links to its parts needs only to come first on PYTHONPATH; a tree whose
    setup.py maps the parts into shmgate also gets a sitecustomize that maps them to its own folders.
    """
    path = [str(tree)]
    if tree != REPO and (tree / "setup.py").exists() and not (tree / "shmgate" / "gateway").exists():
        parts = tuple(p.parent.name for p in tree.glob("*/__init__.py") if p.parent.name not in ("tests", "bench"))
        site = Path(tempfile.mkdtemp(prefix="shmgate-tree-"))
        (site / "sitecustomize.py").write_text(_TREE_SITECUSTOMIZE.format(tree=str(tree), parts=parts))
        path.insert(0, str(site))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [*path, os.environ.get("PYTHONPATH")]))}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shmgate_serve(port: int, *flags: str) -> list[str]:
    """``shmgate serve --host 127.0.0.1 --port PORT FLAGS``: this environment's console script, or
    ``python -m shmgate.gateway`` where there is none (packages installed with ``pip --target``, as on the GPU
    machine)."""
    script = Path(sys.executable).parent / "shmgate"
    head = [str(script)] if script.exists() else [sys.executable, "-m", "shmgate.gateway"]
    return [*head, "serve", "--host", "127.0.0.1", "--port", str(port), *flags]


def parse_variant(spec: str, taken: Collection[str]) -> tuple[str, tuple[str, ...]]:
    """``--variant NAME=FLAGS`` (shmgate with extra serve flags, e.g. ``fcfs=--batch-policy fcfs``):
    the new server's name and its flags. Raises SystemExit when NAME is missing or ``taken``."""
    name, sep, flags = spec.partition("=")
    if not sep or not name or name in taken:
        raise SystemExit(f"--variant {spec!r}: give NAME=FLAGS with a new NAME")
    return name, tuple(shlex.split(flags))


def comparison_server(module: str, port: int, *flags: str, python: str | Path = sys.executable) -> list[str]:
    """``python -m bench.MODULE --port PORT FLAGS`` (``python``: LitServe's venv for litserve_server)."""
    return [str(python), "-m", f"bench.{module}", "--port", str(port), *flags]


def photo_folder(folder: Path) -> Path:
    """``folder`` holding links to the 1024 px photos only: the load generator takes a folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for photo in PHOTOS:
        (folder / photo.name).symlink_to(photo)
    return folder


@dataclass
class ServerProcess:
    """A server under test, started in its own session so its whole tree can be stopped.

    ``tree``: run it from another checkout (its directory first on PYTHONPATH and as the working
    directory, where ``python -m shmgate.gateway`` of its children looks first), for before/after runs.
    """

    argv: list[str]
    log_path: Path
    tree: Path = REPO
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=tree_env(self.tree),
                cwd=self.tree,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.process is not None, "start() first"
        return self.process.pid

    def log_tail(self, nbytes: int = 3000) -> str:
        return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")

    async def wait_ready(self, url: str, timeout_s: float = 180.0) -> None:
        """Poll ``url`` until it answers 200. Raises RuntimeError if the server exits or times out."""
        import httpx

        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process is None or self.process.poll() is not None:
                    raise RuntimeError(f"server exited before it was ready:\n{self.log_tail()}")
                try:
                    if (await client.get(url)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, wait, then SIGKILL whatever is left of it."""
        if self.process is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(self.process.pid):
                break
            time.sleep(0.5)  # the leader is gone; give its children a moment before the next signal
        self.process.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
