"""The declared model contract: every registered preprocessor and backend satisfies it, every HF family's
record names a style that implements both halves (shared/families/), and no capability is probed with getattr/hasattr.

gateway/preprocess/base.py ``Preprocessor`` and worker/backends/base.py ``ModelBackend`` declare every
capability the gateway and the worker read, each with a typed default, and the methods a model must have
as abstract; shared/hf_families.py holds one record per HF family. These tests read the classes the
registries build (``preprocessor_class``, ``backend_class``: no checkpoint is loaded), so they take a
fraction of a second; the families themselves run in tests/test_hf_families.py.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, get_type_hints

import pytest

from shmgate.gateway.preprocess import preprocessor_class
from shmgate.gateway.preprocess.base import AllocateFn, ImageTensorSpec, Preprocessor, PromptInputs
from shmgate.shared.errors import InvalidRequest
from shmgate.shared.families import HOST_TENSORS, IMAGE_TENSORS, STYLES, FamilyStyle
from shmgate.shared.hf_families import HF_FAMILIES
from shmgate.shared.models import ModelKind
from shmgate.worker.backends import backend_class
from shmgate.worker.backends.base import DEFAULT_BATCH_SIZE, BackendEvent, ModelBackend, WorkItem, batch_size_for

ROOT = Path(__file__).resolve().parent.parent

# The capabilities each base class declares with a default (the contract's optional part).
PREPROCESSOR_CAPABILITIES = (
    "prompt_is_cheap",
    "serves_chat",
    "embedding_dim",
    "embeds_text",
    "max_prompt_tokens",
    "samples_tokens",
    "vocab_size",
    "tokenizes",
    "deterministic_answers",
)
BACKEND_CAPABILITIES = ("embeds", "host_tensors", "preferred_batch_size", "joins_running", "on_step")


@pytest.mark.parametrize("kind", list(ModelKind))
def test_every_registered_preprocessor_satisfies_the_contract(kind: ModelKind) -> None:
    cls = preprocessor_class(kind)
    assert issubclass(cls, Preprocessor)
    assert not inspect.isabstract(cls), f"{cls.__name__} lacks {sorted(cls.__abstractmethods__)}"
    hints = get_type_hints(Preprocessor)
    for name in PREPROCESSOR_CAPABILITIES:
        assert name in hints and name in vars(Preprocessor), f"{name} is not declared with a default"
    # Every image may carry processor options: the frontend passes them to every model alike.
    options = inspect.signature(cls.preprocess_image).parameters["options"]
    assert options.kind is inspect.Parameter.KEYWORD_ONLY and options.default is None


@pytest.mark.parametrize("kind", list(ModelKind))
def test_every_registered_backend_satisfies_the_contract(kind: ModelKind) -> None:
    cls = backend_class(kind)
    assert issubclass(cls, ModelBackend)
    assert not inspect.isabstract(cls), f"{cls.__name__} lacks {sorted(cls.__abstractmethods__)}"
    for name in BACKEND_CAPABILITIES:
        assert name in vars(ModelBackend), f"{name} has no default"
    assert all(isinstance(name, str) for name in cls.host_tensors)


class _Minimal(Preprocessor):
    """A preprocessor that states only what it must: every capability comes from the defaults."""

    model = "minimal"
    max_images = 1

    def cache_params(self) -> bytes:
        return b"minimal"

    def preprocess_image(
        self, data: bytes, allocate: AllocateFn, *, max_pixels: int, options: dict[str, Any] | None = None
    ) -> None:
        allocate("pixels", "uint8", (1,))

    def build_prompt(self, messages: Sequence[dict[str, Any]], images: Sequence[ImageTensorSpec]) -> PromptInputs:
        return PromptInputs()


def test_a_preprocessor_gets_every_capability_from_the_defaults() -> None:
    pre = _Minimal()
    assert (
        pre.serves_chat,
        pre.embedding_dim,
        pre.embeds_text,
        pre.max_prompt_tokens,
        pre.samples_tokens,
        pre.vocab_size,
        pre.tokenizes,
        pre.deterministic_answers,
    ) == (True, None, False, None, False, None, False, False)
    assert pre.image_options(None, "low") == {}  # one fixed resolution: detail chooses nothing
    with pytest.raises(InvalidRequest) as refused:
        pre.image_options({"max_pixels": 1}, None)
    assert refused.value.param == "mm_processor_kwargs"
    for call in (lambda: pre.prompt_token_ids([], []), lambda: pre.text_token_ids("hi"), lambda: pre.detokenize([1])):
        with pytest.raises(InvalidRequest) as no_tokenizer:
            call()
        assert no_tokenizer.value.param == "model"


def test_a_model_missing_a_required_method_cannot_be_built() -> None:
    class NoPrompt(Preprocessor):
        model = "no-prompt"
        max_images = 1

        def cache_params(self) -> bytes:
            return b""

        def preprocess_image(
            self, data: bytes, allocate: AllocateFn, *, max_pixels: int, options: dict[str, Any] | None = None
        ) -> None:
            return None

    class NoRun(ModelBackend):
        name = "no-run"

    with pytest.raises(TypeError, match="build_prompt"):
        NoPrompt()  # type: ignore[abstract]
    with pytest.raises(TypeError, match="run"):
        NoRun()  # type: ignore[abstract]


def test_a_backend_gets_every_capability_from_the_defaults() -> None:
    class Quiet(ModelBackend):
        name = "quiet"

        def run(self, batch: Sequence[WorkItem]) -> Iterator[BackendEvent]:
            self.on_step()  # the default hook does nothing
            yield from (BackendEvent(i, finish_reason="stop") for i in range(len(batch)))

    backend = Quiet()
    assert (backend.embeds, tuple(backend.host_tensors), backend.preferred_batch_size) == (False, (), None)
    assert batch_size_for(backend, 0) == DEFAULT_BATCH_SIZE
    assert [e.finish_reason for e in backend.run([WorkItem(1, {})])] == ["stop"]
    steps: list[int] = []
    backend.on_step = lambda: steps.append(1)  # what the worker does (worker/main.py)
    list(backend.run([WorkItem(2, {})]))
    assert steps == [1]


def test_every_family_names_a_style_that_implements_the_whole_contract() -> None:
    """Each input style (shared/families/) holds both halves of a family's knowledge; a style lacking a
    method cannot be built, and every style is named by some family (none is dead code)."""
    assert all(key == family.model_type for key, family in HF_FAMILIES.items())
    for name, style in STYLES.items():
        assert isinstance(style, FamilyStyle) and not inspect.isabstract(type(style)), name
        assert style.name == name and style.image_token and style.image_tensors
        assert set(style.host_tensors) <= set(style.image_tensors), name
    assert {id(f.style) for f in HF_FAMILIES.values()} == {id(s) for s in STYLES.values()}
    # every family names the image processors its style was written for
    assert all(
        f.image_processors and all(p.endswith("ImageProcessor") for p in f.image_processors)
        for f in HF_FAMILIES.values()
    )
    # the worker reads on the host, and accepts, what every style declares
    assert set(backend_class(ModelKind.HF_CHAT).host_tensors) == set(HOST_TENSORS) <= set(IMAGE_TENSORS)


def test_a_style_missing_a_half_cannot_be_built() -> None:
    class PromptOnly(FamilyStyle):
        name = "prompt-only"
        image_token = "<image>"
        image_tensors = ("pixel_values",)

        def expand(self, pre: Any, ids: Any, slots: Any, images: Any) -> Any:
            return ids

    with pytest.raises(TypeError, match="check"):
        PromptOnly()  # type: ignore[abstract]


def test_the_frontend_loads_no_torch() -> None:
    """The frontend's app and every style module import without torch (their worker halves import it
    inside functions), so a frontend process never pays for it."""
    probe = (
        "import sys\n"
        "import shmgate.gateway.app, shmgate.gateway.preprocess.hf, shmgate.shared.hf_families\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False"


# A capability probe: getattr/hasattr on a preprocessor or a backend (the contract declares them all).
PROBE = re.compile(r"\b(?:getattr|hasattr)\(\s*(?:[\w.]*\.)?(?:preprocessor|pre|backend)\s*,")


def test_no_capability_is_probed() -> None:
    probes = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for package in ("gateway", "worker")
        for path in sorted((ROOT / package).rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if PROBE.search(line)
    ]
    assert probes == []
    assert PROBE.search('getattr(f.preprocessor, "serves_chat", True)')  # the pattern finds the old probes
    assert PROBE.search('hasattr(self.backend, "on_step")')
