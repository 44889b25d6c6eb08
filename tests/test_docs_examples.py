"""The docs' client examples run as written, against a real ``shmgate serve`` of the tiny offline models.

Every fenced ``python`` or ``bash`` block of README.md, docs/API.md, docs/MODELS.md and docs/BATCH.md
whose line above is ``<!-- example -->`` is run, in a fresh interpreter or ``bash -e``,
with the files the docs name beside it (``photo.jpg``, ``invoice.jpg``; ``clip.mp4`` and ``clip.webm``
made by the command docs/MODELS.md gives) and the checkout's ``tests/data``. ``<!-- example: continues
-->`` runs a block after the marked block of its language above it, as one pasted session (a second
Python block that uses the first one's ``client``). The only change made to a block is the server's
address (``localhost:8000`` and ``127.0.0.1:8000`` become this test's port).

The server is the one the docs tell a newcomer to start offline: tiny random checkpoints built by
``python -m tests.tiny_models`` into directories named as the docs' models (their served ids), beside
the classifier and the checksum model. A block passes when it exits 0 and prints no OpenAI error object.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.serving import Server, start_server, stop_and_check

pytest.importorskip("llguidance")
pytest.importorskip("av")

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/API.md", "docs/MODELS.md", "docs/BATCH.md")
MARK = re.compile(r"^<!-- example(: continues)? -->\n```(python|bash)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
# the checkpoints the docs' examples name, built tiny under those names (a directory's name is its model id)
MODELS = {"Qwen2.5-VL-3B-Instruct": "qwen2_5_vl", "siglip2-base-patch16-naflex": "siglip2"}


@dataclass(frozen=True)
class Example:
    doc: str
    line: int
    language: str
    code: str  # with the blocks it continues in front

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def examples() -> list[Example]:
    found = []
    for doc in DOCS:
        text = (REPO / doc).read_text()
        before: dict[str, str] = {}
        for match in MARK.finditer(text):
            continues, language, code = match.groups()
            code = before[language] + code if continues else code
            before[language] = code
            found.append(Example(doc, text.count("\n", 0, match.start()) + 1, language, code))
    return found


EXAMPLES = examples()


def test_the_docs_mark_their_client_examples() -> None:
    """A marker lost in an edit would drop its example silently: every doc keeps its runnable blocks."""
    by_doc = {doc: sum(e.doc == doc for e in EXAMPLES) for doc in DOCS}
    assert all(count >= 1 for count in by_doc.values()), by_doc
    kinds = {(e.doc, e.language) for e in EXAMPLES}
    assert {("docs/API.md", "python"), ("docs/API.md", "bash"), ("docs/MODELS.md", "python")} <= kinds


def test_a_wrong_family_name_gets_the_valid_ones_in_one_line(tmp_path: Path) -> None:
    """``TRY_HF_FAMILY`` and ``python -m tests.tiny_models`` name every family they build, not a traceback."""
    env = {**os.environ, "TRY_HF_FAMILY": "clipp", "TMPDIR": str(tmp_path)}
    for command in (["scripts/try_hf.sh"], [sys.executable, "-m", "tests.tiny_models", "clipp", str(tmp_path / "m")]):
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        line = next(line for line in done.stderr.splitlines() if "unknown family 'clipp'" in line)
        assert "qwen2_vl" in line and "internvl" in line and "clip, siglip, siglip2" in line, line
    assert list(tmp_path.iterdir()) == []  # try_hf.sh removed its directory


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    models = tmp_path_factory.mktemp("models")
    builds = [  # the documented command, both at once
        subprocess.Popen([sys.executable, "-m", "tests.tiny_models", family, str(models / name)], cwd=REPO)
        for name, family in MODELS.items()
    ]
    assert [b.wait(timeout=300) for b in builds] == [0] * len(builds)
    server = start_server(
        f"hf:{models / 'Qwen2.5-VL-3B-Instruct'}",
        tmp_path_factory.mktemp("serve"),
        *("--model", f"hf:{models / 'siglip2-base-patch16-naflex'}", "--model", "efficientnet-lite0"),
        *("--model", "checksum", "--workers", "1", "--frontends", "1", "--threads", "1", "--queue-depth", "8"),
    )
    try:
        yield server
    finally:
        stop_and_check(server)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a reader has beside the examples: the files the docs name, made as the docs say."""
    work = tmp_path_factory.mktemp("examples")
    (work / "tests").symlink_to(REPO / "tests")  # README's tests/data/images/...
    images = REPO / "tests" / "data" / "images"
    shutil.copy(images / "chelsea_640.jpg", work / "photo.jpg")
    shutil.copy(images / "coffee_640.jpg", work / "invoice.jpg")
    for video in ("clip.mp4", "clip.webm"):  # docs/MODELS.md "Video": the command that makes one
        subprocess.run([sys.executable, "-m", "tests.video_samples", video], cwd=work, check=True, timeout=60)
    return work


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.id)
def test_the_example_runs_as_written(example: Example, server: Server, workdir: Path) -> None:
    code = re.sub(r"(localhost|127\.0\.0\.1):8000\b", f"127.0.0.1:{server.port}", example.code)
    command = [sys.executable, "-c", code] if example.language == "python" else ["bash", "-e"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        command,
        input=None if example.language == "python" else code,
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, f"{example.id}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert '{"error":{' not in done.stdout.replace(" ", ""), f"{example.id}:\n{done.stdout[-2000:]}"
