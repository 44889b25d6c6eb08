"""The models one node serves: from repeated ``--model`` flags or a TOML file (``--config``, ``SHMGATE_CONFIG``).

One gateway, one arena, a worker pool and a request queue per model. The command line declares
models without per-model settings (``--model efficientnet-lite0 --model checksum``, each with the
global flags); the file gives each model its own::

    [[models]]
    model = "efficientnet-lite0"
    served_model_name = "classifier"
    workers = 1
    max_in_flight = 64

    [[models]]
    model = "checksum"
    device = "cpu"

A key left out of a model's table takes the global flag's value; flags that are not per model
(port, frontends, arena size, limits on bodies and images) stay global and are not accepted here.
Every mistake in the file is one line that names the file, the model and the key
(``node.toml: models[1] ('checksum'): workers: '0': use auto ...``), raised as ``NodeConfigError``
before anything is started. The keys and their meaning: docs/MODELS.md "Several models".
"""

from __future__ import annotations

import argparse
import json
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from shmgate.shared import flag_types
from shmgate.shared.flags import BATCH_POLICIES, DTYPES
from shmgate.shared.models import ModelKind, parse_model_spec, resolve_model
from shmgate.shared.stats_layout import MODEL_SLOTS as MAX_MODELS  # the model table's rows (shared/segment.py)
from shmgate.shared.vocabulary import check_model_id

__all__ = [
    "MODEL_KEYS",
    "ModelConfig",
    "NodeConfigError",
    "from_flags",
    "load_node_config",
    "models_json",
    "parse_models_json",
]


class NodeConfigError(ValueError):
    """A model declaration that cannot work; the message is the one line the user sees."""


@dataclass(frozen=True)
class ModelConfig:
    """One declared model. None: the global flag's value (``with_globals`` fills them in)."""

    model: str  # the spec (shared/models.py)
    served_model_name: str = ""
    public_id: str = ""  # filled by ``_checked``: what clients send
    workers: int | None = None  # 0: auto
    workers_per_gpu: int | None = None
    device: str | None = None
    dtype: str | None = None
    max_batch_size: int | None = None
    max_batch_wait_ms: float | None = None
    batch_policy: str | None = None
    max_in_flight: int | None = None  # per frontend, for this model; beyond it this model's clients get 429
    queue_depth: int | None = None  # this model's request queue
    stall_timeout_s: float | None = None
    arena_share: float | None = None  # the part of each frontend's arena partition this model keeps (0..1]
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)

    def with_globals(self, args: argparse.Namespace, *, alone: bool = True) -> ModelConfig:
        """This model with every unset key taken from the global flags in ``args``. ``alone``: the only
        model (a global --mm-processor-kwargs then applies to it, and is refused where it cannot)."""

        def pick(key: str) -> Any:
            own = getattr(self, key)
            return own if own is not None else getattr(args, key, None)

        kwargs = self.mm_processor_kwargs
        if not kwargs and (alone or parse_model_spec(self.model).kind in (ModelKind.HF_CHAT, ModelKind.CHECKSUM_HF)):
            # with several models, the global --mm-processor-kwargs reaches those with an HF image processor
            kwargs = json.loads(getattr(args, "mm_processor_kwargs", "{}") or "{}")
        return replace(self, **{key: pick(key) for key in _GLOBAL_KEYS}, mm_processor_kwargs=kwargs)


def _fraction(text: str) -> float:
    value = flag_types.positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction of the arena, more than 0 and at most 1")
    return value


# key -> (the TOML types it may have, the flag type that checks its value)
_CHECKS: dict[str, tuple[tuple[type, ...], Callable[[str], Any]]] = {
    "model": ((str,), flag_types.model_spec),
    "served_model_name": ((str,), str),
    "workers": ((int, str), flag_types.auto_count),
    "workers_per_gpu": ((int,), flag_types.positive_int),
    "device": ((str,), flag_types.device),
    "dtype": ((str,), flag_types.choice(*DTYPES)),
    "max_batch_size": ((int,), flag_types.non_negative_int),
    "max_batch_wait_ms": ((int, float), flag_types.non_negative_float),
    "batch_policy": ((str,), flag_types.choice(*BATCH_POLICIES)),
    "max_in_flight": ((int,), flag_types.positive_int),
    "queue_depth": ((int,), flag_types.positive_int),
    "stall_timeout_s": ((int, float), flag_types.non_negative_float),
    "arena_share": ((int, float), _fraction),
}
MODEL_KEYS = (*_CHECKS, "mm_processor_kwargs")
_GLOBAL_KEYS = (
    "workers",
    "workers_per_gpu",
    "device",
    "dtype",
    "max_batch_size",
    "max_batch_wait_ms",
    "batch_policy",
    "max_in_flight",
    "queue_depth",
    "stall_timeout_s",
)


def load_node_config(path: str) -> list[ModelConfig]:
    """The models a TOML file declares. Raises NodeConfigError naming the file, the model and the key."""
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except OSError as exc:
        raise NodeConfigError(f"{path}: cannot read it: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise NodeConfigError(f"{path}: not TOML: {exc}") from None
    unknown = sorted(set(document) - {"models"})
    if unknown:
        raise NodeConfigError(
            f"{path}: unknown key {unknown[0]!r}: the file declares [[models]] tables only "
            "(the other settings are flags)"
        )
    tables = document.get("models")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise NodeConfigError(f"{path}: declare at least one model as a [[models]] table with a model key")
    return _checked([_model_from_table(path, i, table) for i, table in enumerate(tables)], source=path)


def _model_from_table(path: str, index: int, table: dict[str, Any]) -> ModelConfig:
    spec = table.get("model")
    where = f"{path}: models[{index}]" + (f" ({spec!r})" if isinstance(spec, str) else "")
    if "model" not in table:
        raise NodeConfigError(f'{where}: model: missing; name what to serve (e.g. model = "efficientnet-lite0")')
    values: dict[str, Any] = {}
    for key, raw in table.items():
        if key == "mm_processor_kwargs":
            if not isinstance(raw, dict):
                raise NodeConfigError(f"{where}: mm_processor_kwargs: must be a table of processor arguments")
            values[key] = raw
            continue
        if key not in _CHECKS:
            raise NodeConfigError(f"{where}: unknown key {key!r}; a model takes {', '.join(MODEL_KEYS)}")
        types, convert = _CHECKS[key]
        if isinstance(raw, bool) or not isinstance(raw, types):
            wanted = " or ".join("a number" if t in (int, float) else "a string" for t in types)
            raise NodeConfigError(f"{where}: {key}: {raw!r} must be {wanted}")
        try:
            values[key] = convert(str(raw))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise NodeConfigError(f"{where}: {key}: {exc}") from None
    return ModelConfig(**values)


def from_flags(models: Sequence[str], served_names: Sequence[str]) -> list[ModelConfig]:
    """The models of repeated ``--model`` flags, each ``--served-model-name`` in the same order (one name for
    one model; none: each model's default id). Raises NodeConfigError."""
    if served_names and len(served_names) != len(models):
        raise NodeConfigError(
            f"--served-model-name given {len(served_names)} times for {len(models)} --model; "
            "give one per --model, in the same order, or use --config"
        )
    names = list(served_names) or [""] * len(models)
    return _checked([ModelConfig(model, served) for model, served in zip(models, names)], source="--model")


def _checked(configs: list[ModelConfig], *, source: str) -> list[ModelConfig]:
    """Each model with its public id, after the checks that need nothing started; ids must differ."""
    if len(configs) > MAX_MODELS:
        raise NodeConfigError(f"{source}: {len(configs)} models; one gateway serves at most {MAX_MODELS}")
    out: list[ModelConfig] = []
    seen: dict[str, int] = {}
    for i, config in enumerate(configs):
        where = f"{source} {config.model}" if source == "--model" else f"{source}: models[{i}] ({config.model!r})"
        try:
            public_id = resolve_model(config.model, config.served_model_name or None).public_id
            check_model_id(public_id)
        except ValueError as exc:
            key = "" if source == "--model" else "model: "
            raise NodeConfigError(f"{where}: {key}{exc}") from None
        if public_id in seen:
            key = "" if source == "--model" else "served_model_name: "
            raise NodeConfigError(
                f"{where}: {key}the id {public_id!r} is served by models[{seen[public_id]}] "
                "already; give one of them another served_model_name"
            )
        seen[public_id] = i
        out.append(replace(config, public_id=public_id))
    shares = sum(c.arena_share or 0.0 for c in out)
    if shares > 1.0 + 1e-9:
        raise NodeConfigError(
            f"{source}: arena_share: the models' shares add up to {shares:g}, more than the whole arena (1)"
        )
    return out


def models_json(configs: Sequence[ModelConfig]) -> str:
    """What each frontend needs of the models, for its command line (the frontends never read the file)."""
    return json.dumps(
        [
            {
                "model": c.model,
                "served_model_name": c.served_model_name,
                "public_id": c.public_id,
                "max_in_flight": c.max_in_flight,
                "arena_share": c.arena_share,
                "mm_processor_kwargs": c.mm_processor_kwargs,
            }
            for c in configs
        ]
    )


def parse_models_json(text: str) -> list[ModelConfig]:
    """``models_json``'s inverse, in the frontend."""
    return [
        ModelConfig(
            model=d["model"],
            served_model_name=d["served_model_name"],
            public_id=d["public_id"],
            max_in_flight=d["max_in_flight"],
            arena_share=d["arena_share"],
            mm_processor_kwargs=d["mm_processor_kwargs"],
        )
        for d in json.loads(text)
    ]
