"""The model registry: what a ``--model`` spec names, said once for both halves.

A spec is one of ``efficientnet-lite0``, ``checksum``, ``hf:<directory>`` or ``checksum:hf:<directory>``.
``parse_model_spec`` turns it into a ``ModelSpec``: its kind, the public id the model is served under
(the ``model`` field clients send, the worker's name, and the id the frontend stamps on each Submit)
and the checkpoint directory. The public id is ``--served-model-name`` when given, else derived from
the spec (``model_id_for``): clients should not have to know where the weights lie on the server. The frontend picks its preprocessor and the worker its backend by
``kind`` (gateway/preprocess/__init__.py, worker/backends/__init__.py); neither parses the string
itself, so the two halves cannot disagree about a model's id. What an ``hf:`` chat checkpoint's family
(config.json ``model_type``) needs from each half is its record in shared/hf_families.py.
"""

from __future__ import annotations

import enum
import importlib.util
import os
from dataclasses import dataclass

from shmgate.shared.embedding_models import embedding_model_type

__all__ = [
    "KNOWN_SPECS",
    "ModelKind",
    "ModelSpec",
    "check_checkpoint_dir",
    "missing_dependency",
    "model_id_for",
    "parse_model_spec",
    "resolve_model",
]

KNOWN_SPECS = "efficientnet-lite0, checksum, hf:<directory>, checksum:hf:<directory>"


class ModelKind(enum.Enum):
    EFFICIENTNET = "efficientnet"  # the embedded ImageNet classifier
    CHECKSUM = "checksum"  # digests of the received tensors: the transport's witness in tests
    HF_CHAT = "hf"  # a local Hugging Face image-text-to-text checkpoint (/v1/chat/completions)
    HF_EMBED = "hf-embed"  # a CLIP / SigLIP / SigLIP2 checkpoint (/v1/embeddings only)
    CHECKSUM_HF = "checksum-hf"  # the HF preprocessing of a checkpoint, answered with digests


@dataclass(frozen=True)
class ModelSpec:
    kind: ModelKind
    public_id: str  # what clients send as "model" and what the worker answers to
    directory: str | None = None  # the checkpoint, for the hf kinds


def model_id_for(model_dir: str | os.PathLike[str]) -> str:
    """The id a model directory is served under by default: its base name (``/m/Qwen2-VL/`` -> ``Qwen2-VL``).

    A Hugging Face hub-cache snapshot (``.../models--Qwen--Qwen2-VL-2B-Instruct/snapshots/<commit>``)
    is served as its repository id (``Qwen/Qwen2-VL-2B-Instruct``): the base name there is a commit hash,
    which no client would guess.
    """
    path = os.path.normpath(os.path.expanduser(os.fspath(model_dir)))
    parent = os.path.dirname(path)
    repo = os.path.basename(os.path.dirname(parent))
    if os.path.basename(parent) == "snapshots" and repo.startswith("models--") and "--" in repo[8:]:
        return repo[8:].replace("--", "/", 1)
    return os.path.basename(path)


def check_checkpoint_dir(directory: str) -> None:
    """Raise ValueError saying which of the two it is: no such directory, or a directory without config.json.

    The frontend (processor files) and the worker (weights) both need the same directory; a typo in the
    path and a path to the wrong level of a download are different mistakes with different fixes.
    """
    if not os.path.isdir(directory):
        raise ValueError(f"hf:{directory}: no such directory (the path is read on the server, after ~ expansion)")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ValueError(
            f"hf:{directory}: not a checkpoint (no config.json in it); point at the directory that "
            "holds config.json, e.g. a hub-cache .../snapshots/<commit> directory"
        )


def missing_dependency(spec: ModelSpec) -> str | None:
    """What the spec's kind needs that is not installed, as the line to print; None when nothing is missing.

    Checked by ``find_spec`` (no import: a frontend or a supervisor does not load transformers for this).
    """
    if spec.kind in (ModelKind.HF_CHAT, ModelKind.HF_EMBED, ModelKind.CHECKSUM_HF) and (
        importlib.util.find_spec("transformers") is None
    ):
        return "hf:<directory> models need transformers: pip install 'shmgate[hf]'"
    return None


def resolve_model(model: str, served_name: str | None = None) -> ModelSpec:
    """``parse_model_spec`` plus the checks a process makes before it starts anything for the model:
    the checkpoint directory is one, and the extra its kind needs is installed. Raises ValueError."""
    spec = parse_model_spec(model, served_name)
    if spec.directory is not None:
        check_checkpoint_dir(spec.directory)
    missing = missing_dependency(spec)
    if missing:
        raise ValueError(missing)
    return spec


def parse_model_spec(model: str, served_name: str | None = None) -> ModelSpec:
    """The spec ``model`` names. Raises ValueError (naming the known forms) for anything else.

    ``served_name`` (``--served-model-name``) replaces the public id; empty or None keeps the default.
    An ``hf:`` directory whose config.json names an embedding model type is HF_EMBED; the file is
    read here, without transformers (shared/embedding_models.py). ``~`` in a directory is expanded.
    The directory's existence is not checked here (``check_checkpoint_dir`` does, where it is read).
    """
    spec = _parse(model)
    if served_name:
        return ModelSpec(spec.kind, served_name, spec.directory)
    return spec


def _parse(model: str) -> ModelSpec:
    if model == "efficientnet-lite0":
        return ModelSpec(ModelKind.EFFICIENTNET, model)
    if model == "checksum":
        return ModelSpec(ModelKind.CHECKSUM, model)
    if model.startswith("hf:") and model[3:]:
        directory = os.path.expanduser(model[3:])
        kind = ModelKind.HF_EMBED if embedding_model_type(directory) else ModelKind.HF_CHAT
        return ModelSpec(kind, model_id_for(directory), directory)
    if model.startswith("checksum:hf:") and model.removeprefix("checksum:hf:"):
        directory = os.path.expanduser(model.removeprefix("checksum:hf:"))
        return ModelSpec(ModelKind.CHECKSUM_HF, "checksum:" + model_id_for(directory), directory)
    raise ValueError(f"unknown model {model!r}; known: {KNOWN_SPECS}")
