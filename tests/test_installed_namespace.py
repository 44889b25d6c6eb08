"""The installed package owns one import name, ``shmgate``: its parts (``shmgate.gateway``,
``shmgate.worker``, ``shmgate.shared`` ...) cannot collide with another distribution's top-level
``shared`` or ``worker``.

The wheel is built from this checkout and installed into a clean virtual environment beside two
packages named ``shared`` and ``worker`` that fail loudly when imported; a real ``shmgate serve``
started from outside the repository (so nothing of the checkout is on ``sys.path``) answers a request.
The environment borrows the test environment's dependencies (torch, fastapi ...) through a path entry,
which does not activate the checkout's editable install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx
import pytest

from tests.serving import free_port, image_request, noise_png

REPO = Path(__file__).resolve().parent.parent
IMPOSTOR = "raise ImportError('another distribution named {name} was imported instead of shmgate.{name}')\n"


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


@pytest.fixture(scope="module")
def clean_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    # A copy of the sources, so no build/ directory left in the checkout by an earlier build adds stale modules.
    source = tmp / "source"
    shutil.copytree(
        REPO,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "tests", "docs", "bench", "deploy"),
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp), str(source)],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp.glob("shmgate-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    packages = _site_packages(venv)
    # The wheel unpacked by pip of this environment into the clean one (no pip inside it is needed).
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--target",
            str(packages),
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    (packages / "borrowed-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for name in ("shared", "worker"):
        (packages / name).mkdir()
        (packages / name / "__init__.py").write_text(IMPOSTOR.format(name=name))
    return venv


def test_the_wheel_installs_only_the_shmgate_name(clean_venv: Path) -> None:
    names = {p.name for p in _site_packages(clean_venv).iterdir()}
    assert "shmgate" in names
    assert not names & {"gateway", "supervise", "bench_client", "node"}, names


def test_a_wheel_install_beside_packages_named_shared_and_worker_serves_a_request(
    clean_venv: Path, tmp_path: Path
) -> None:
    python = clean_venv / "bin" / "python"
    probe = subprocess.run(
        [
            str(python),
            "-c",
            "import shmgate.node.cli, shmgate.gateway.app, shmgate.worker.main; print(shmgate.node.cli.__file__)",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    assert str(clean_venv) in probe.stdout  # the installed copy, not the checkout
    port = free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [
                str(python),
                "-m",
                "shmgate",
                "serve",
                "--model",
                "checksum",
                "--port",
                str(port),
                "--frontends",
                "1",
                "--workers",
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            env=env,
        )
    try:
        from tests.serving import Server

        running = Server(server, port, "checksum", log)
        running.wait_ready(120)
        answer = httpx.post(
            running.base_url + "/v1/chat/completions", json=image_request("checksum", noise_png(3)), timeout=60
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
    finally:
        server.terminate()
        assert server.wait(60) == 0, log.read_text()[-3000:]
