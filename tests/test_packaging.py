"""The wheel holds every package of the source tree.

The editable install the tests run from finds any package, so a subpackage missing from
pyproject's list only shows in a real install: the container image once failed to import
shared.transport that way. This compares the list with the directories that are packages.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_package_directory_is_in_the_wheel() -> None:
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(REPO).parts)
        for top in ("gateway", "worker", "shared")
        for init in (REPO / top).rglob("__init__.py")
    }
    assert found == listed
