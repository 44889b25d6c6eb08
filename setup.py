"""The one installed name: each top-level folder of the repository is a subpackage of ``shmgate``.

The design keeps the parts as top-level folders (gateway/, worker/, shared/, ...). setuptools maps each
into the installed ``shmgate`` package (``package_dir``), for the wheel and for editable installs alike,
so every file has one import name (``shmgate.gateway.app``) and one path (gateway/app.py). Subpackages
are found here, not listed by hand. Everything else about the package is in pyproject.toml.
"""

from setuptools import find_packages, setup

PARTS = ("gateway", "worker", "shared", "supervise", "bench_client", "node")

setup(
    package_dir={"shmgate": "shmgate", **{f"shmgate.{part}": part for part in PARTS}},
    packages=[
        "shmgate",
        *(f"shmgate.{part}{'.' + sub if sub else ''}" for part in PARTS for sub in ("", *find_packages(part))),
    ],
)
