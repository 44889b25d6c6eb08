"""A knob's default is written once, in its declaration (shared/options.py ``option``).

Everything else that needs it reads the record (``EngineOptions().prefix_cache_mb``) or is handed the parsed
record. This test reads the product's source and fails where a declared knob's default is written again as
a literal: a parameter, a field or a variable named after the knob (or ``DEFAULT_<KNOB>``) whose literal
default equals the declared one. Such a copy is how a knob came to have one default on the command line
and another in the code that ran when the flag was left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shmgate.node.flag_table import COMMANDS
from shmgate.shared.options import declared_flags
from shmgate.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "worker", "shared", "node", "supervise")
# Frontend and node knobs whose default the frontend's and the supervisor's own classes still write again
# (their records are not yet handed to the code that reads them). The list only shrinks: an entry that is
# gone fails too, so that it is taken off. A worker knob is never listed here.
STILL_WRITTEN_TWICE = {
    ("gateway/intake.py", "max_images"),
    ("gateway/preprocess/__init__.py", "max_images"),
    ("gateway/preprocess/embed_hf.py", "max_images"),
    ("gateway/preprocess/hf.py", "max_images"),
    ("gateway/preprocess/vision.py", "max_images"),
    ("gateway/served.py", "batch_dir"),
    ("gateway/served.py", "batch_max_in_flight"),
    ("shared/instance.py", "queue_depth"),
    ("shared/transport/memory.py", "queue_depth"),
    ("supervise/supervisor.py", "drain_timeout_s"),
}


def _declared_defaults(config: type) -> dict[str, Any]:
    """Each knob of ``config`` and its declared default, as the parser makes it (None: none declared; an
    on/off flag declares none either: it is off unless given, by construction)."""
    out: dict[str, Any] = {}
    for flag, spec in declared_flags(config):
        value: Any = None if spec.default is None or spec.on_off else spec.type(spec.default)
        if spec.repeatable and value is not None:
            value = (value,)
        out[flag[2:].replace("-", "_")] = value
    return out


KNOBS = {name: value for _, config in COMMANDS for name, value in _declared_defaults(config).items()}
WORKER_KNOBS = set(_declared_defaults(WorkerConfig))


def _named_values(tree: ast.Module) -> Iterator[tuple[str, ast.expr]]:
    """(name, the expression given to it) for every parameter default, and every field or variable of a
    class or module body (an assignment inside a function is a computation, not a default)."""
    bodies: list[list[ast.stmt]] = [tree.body]
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            positional = args.posonlyargs + args.args
            yield from ((a.arg, d) for a, d in zip(positional[len(positional) - len(args.defaults) :], args.defaults))
            yield from ((a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None)
        elif isinstance(node, ast.ClassDef):
            bodies.append(node.body)
    for body in bodies:
        for stmt in body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                yield stmt.target.id, stmt.value
            elif isinstance(stmt, ast.Assign):
                yield from ((t.id, stmt.value) for t in stmt.targets if isinstance(t, ast.Name))


def _same(written: Any, declared: Any) -> bool:
    return type(written) is type(declared) or {type(written), type(declared)} == {int, float}


def written_twice(root: Path = ROOT) -> Iterator[tuple[str, str, int, Any]]:
    """(file, knob, line, the literal) for each literal copy of a declared knob's default under ``root``."""
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for name, value in _named_values(ast.parse(path.read_text(), str(path))):
                knob = name.lower().removeprefix("default_")
                declared = KNOBS.get(knob)
                if declared is None:
                    continue
                try:
                    literal = ast.literal_eval(value)
                except ValueError:
                    continue  # not a literal: a read of the record, a computation
                if literal == declared and _same(literal, declared):
                    yield str(path.relative_to(root)), knob, value.lineno, literal


def test_no_worker_knob_default_is_written_outside_its_declaration() -> None:
    found = [
        f"{file}:{line}: {knob} = {literal!r}" for file, knob, line, literal in written_twice() if knob in WORKER_KNOBS
    ]
    assert not found, "a worker knob's default written again (read it from its record instead):\n" + "\n".join(found)


def test_the_other_knobs_written_twice_are_only_those_listed_and_each_still_is() -> None:
    found = {(file, knob) for file, knob, _, _ in written_twice() if knob not in WORKER_KNOBS}
    assert found - STILL_WRITTEN_TWICE == set(), "a knob's default written again: read it from its record"
    assert STILL_WRITTEN_TWICE - found == set(), "no longer written twice: take it off STILL_WRITTEN_TWICE"


def test_the_scan_sees_a_default_written_twice(tmp_path: Path) -> None:
    """The scan itself: the shape the worker's options had (a dataclass re-listing the knobs) is caught."""
    source = (
        "class Options:\n    prefix_cache_mb: float = 256.0\n    kv_cache_tokens: int = 1\n\n"
        "def load(*, dtype: str = 'auto', threads: int = THREADS) -> None: ...\n"
        "DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048\n"
    )
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "options.py").write_text(source)
    found = {(knob, line) for _, knob, line, _ in written_twice(tmp_path)}
    assert found == {("prefix_cache_mb", 2), ("dtype", 5), ("max_num_batched_tokens", 6)}
