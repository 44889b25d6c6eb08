"""Which code may import the shared-memory layer, and which package may import which: read from the
source with ``ast``, so it holds for every module, including imports inside functions.

gateway/ and worker/ program against the transport seam (shared/transport/base.py) and its
vocabulary (shared/vocabulary.py, shared/stats_layout.py). Only the composition roots, the places
that build the POSIX transport or own the instance's life, import the POSIX layer: the gateway's
app (its lifespan attaches the instance), the node (node/serve.py creates it, node/cli.py and
node/serve.py clean leftovers), the supervisor (unlinks it at the end) and the worker's main (attaches and builds its link). The transport-neutral
modules of shared/ import none of it (shared/transport/__init__.py loads the POSIX links only when
asked for one), and shared/ has no import cycle.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import shmgate.shared.transport.posix

REPO = Path(__file__).resolve().parent.parent

POSIX_LAYER = frozenset(
    {
        "shmgate.shared.segment",
        "shmgate.shared.cache",
        "shmgate.shared.cache_index",
        "shmgate.shared.instance",
        "shmgate.shared.channels",
        "shmgate.shared.locks",
        "shmgate.shared.allocator",
        "shmgate.shared.arena",
        "shmgate.shared.encoder_store",
        "shmgate.shared.transport.posix",
    }
)
COMPOSITION_ROOTS = frozenset(
    {"gateway/app.py", "node/serve.py", "node/cli.py", "supervise/supervisor.py", "worker/main.py"}
)
NEUTRAL = ("shared/vocabulary.py", "shared/stats_layout.py", "shared/transport/base.py", "shared/transport/memory.py")

# shared/transport/__init__.py re-exports the POSIX links: importing them from the package is
# importing the POSIX layer all the same.
_FROM_POSIX_VIA_PACKAGE = frozenset(shmgate.shared.transport.posix.__all__)


def _module_name(path: Path) -> str:
    parts = ("shmgate", *path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, *, type_only: bool) -> Iterator[str]:
    """Every module ``path`` imports (``from a import b`` yields ``a`` and ``a.b``); imports under
    ``if TYPE_CHECKING:`` only when ``type_only`` (they never run)."""
    name = _module_name(path) if path.is_relative_to(REPO) else path.stem
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def visit(node: ast.AST) -> Iterator[str]:
        if _is_type_checking_block(node) and not type_only:
            return
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            for alias in node.names:
                if base == "shmgate.shared.transport" and alias.name in _FROM_POSIX_VIA_PACKAGE:
                    yield "shmgate.shared.transport.posix"
                yield f"{base}.{alias.name}"
        for child in ast.iter_child_nodes(node):
            yield from visit(child)

    yield from visit(ast.parse(path.read_text(), str(path)))


def _posix_imports(path: Path, *, type_only: bool = True) -> set[str]:
    return set(_imports(path, type_only=type_only)) & POSIX_LAYER


def _sources(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (REPO / top).rglob("*.py"))


def test_only_the_composition_roots_of_gateway_and_worker_import_the_posix_layer() -> None:
    offenders = {
        str(p.relative_to(REPO)): sorted(found)
        for p in _sources("gateway", "worker", "supervise", "bench_client", "node")
        if str(p.relative_to(REPO)) not in COMPOSITION_ROOTS and (found := _posix_imports(p))
    }
    assert offenders == {}, (
        "import these names from shared/vocabulary.py, shared/stats_layout.py or the "
        f"transport's Protocols instead: {offenders}"
    )


def test_every_allowed_root_still_builds_the_posix_transport() -> None:
    """An allowance nobody needs any more is a hole in the rule: drop it from COMPOSITION_ROOTS."""
    for root in sorted(COMPOSITION_ROOTS):
        assert _posix_imports(REPO / root), f"{root} no longer imports the POSIX layer"


def test_the_detector_sees_function_local_and_package_re_exported_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from shmgate.shared.transport import FrontendLink\n"
        "def f():\n    from shmgate.shared.transport import PosixNodeStats\n    import shmgate.shared.locks\n"
    )
    assert _posix_imports(probe) == {"shmgate.shared.transport.posix", "shmgate.shared.locks"}


def test_no_module_but_the_roots_loads_the_posix_layer_when_imported() -> None:
    """What runs, not only what is written: a fresh interpreter imports every module of gateway/ and
    worker/ except the composition roots and the ``__main__`` entry points that run them, and the
    shared-memory layer (posix_ipc included) must still be unloaded."""
    modules = [
        _module_name(p)
        for p in _sources("gateway", "worker", "supervise", "bench_client", "node")
        if str(p.relative_to(REPO)) not in COMPOSITION_ROOTS and p.name != "__main__.py"
    ]
    probe = (
        "import importlib, json, sys\n"
        f"for name in {modules!r}:\n    importlib.import_module(name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO, timeout=120, check=True
    )
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert "shmgate.gateway.frontend" in loaded and "shmgate.worker.batcher" in loaded
    assert sorted(loaded & (POSIX_LAYER | {"posix_ipc"})) == []


def test_the_transport_neutral_modules_import_no_posix_layer_at_run_time() -> None:
    offenders = {name: sorted(found) for name in NEUTRAL if (found := _posix_imports(REPO / name, type_only=False))}
    assert offenders == {}


def test_shared_has_no_import_cycle() -> None:
    """Run-time imports only (``TYPE_CHECKING`` blocks never run), function-local ones included."""
    modules = {_module_name(p): p for p in _sources("shared")}
    graph = {
        name: {m for m in _imports(path, type_only=False) if m in modules and m != name}
        for name, path in modules.items()
    }
    done: set[str] = set()

    def walk(node: str, trail: list[str]) -> None:
        if node in trail:
            cycle = trail[trail.index(node) :] + [node]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if node in done:
            return
        for nxt in sorted(graph[node]):
            walk(nxt, [*trail, node])
        done.add(node)

    for name in sorted(graph):
        walk(name, [])


# Which top-level package may import which: the node (node/) composes the processes and sits above
# them; gateway/ is the HTTP frontend only and worker/ the model process; neither imports the node,
# the supervisor or the load generator, nor each other.
FORBIDDEN = {
    "gateway": {"node", "supervise", "bench_client", "worker"},
    "worker": {"node", "supervise", "bench_client", "gateway"},
    "supervise": {"node", "gateway", "worker", "bench_client"},
    "shared": {"node", "supervise", "bench_client", "gateway", "worker"},
}


def _part(module: str) -> str:
    """The top-level folder a module lives in: ``shmgate.gateway.app`` -> ``gateway``."""
    return module.removeprefix("shmgate.").split(".")[0]


def test_no_package_imports_one_above_it_or_beside_it() -> None:
    offenders = {
        str(p.relative_to(REPO)): found
        for top, forbidden in FORBIDDEN.items()
        for p in _sources(top)
        if (found := sorted({m for m in _imports(p, type_only=True) if _part(m) in forbidden}))
    }
    assert offenders == {}


TOP_LEVEL_PARTS = ("gateway", "worker", "shared", "supervise", "bench_client", "node")


def test_every_import_of_a_part_goes_through_the_shmgate_name() -> None:
    """``import shared`` would find the checkout's folder from the repository root, and another
    distribution's ``shared`` anywhere else: every module and test names ``shmgate.shared``.
    (``bench`` is the benchmark package run from a checkout, not installed, so it keeps its name.)"""
    offenders = {}
    for path in _sources(*TOP_LEVEL_PARTS, "tests", "bench", "shmgate"):
        bare = sorted(name for name in _imports(path, type_only=False) if name.split(".")[0] in TOP_LEVEL_PARTS)
        if bare:
            offenders[str(path.relative_to(REPO))] = bare
    assert offenders == {}
