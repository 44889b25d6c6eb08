"""One model a node serves, as the node declared it (node/models.py reads it from ``--model`` flags or a
``--config`` file) and as its frontends receive it.

Both the supervisor and the frontends read it, so it lives in shared/: the frontends get the models in
their configuration (gateway/config.py ``FrontendConfig.models``) and never read the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from shmgate.shared.models import ModelKind, parse_model_spec

__all__ = ["GLOBAL_KEYS", "ModelConfig"]

GLOBAL_KEYS = (
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


@dataclass(frozen=True)
class ModelConfig:
    """One declared model. None: the global flag's value (``with_globals`` fills them in)."""

    model: str  # the spec (shared/models.py)
    served_model_name: str = ""
    public_id: str = ""  # filled by node/models.py ``_checked``: what clients send
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

    def with_globals(self, flags: Mapping[str, Any], *, alone: bool = True) -> ModelConfig:
        """This model with every unset key taken from the global options ``flags`` (by knob name:
        shared/options.py ``knob_values`` of node/config.py's ``GatewayConfig`` or ``ServeConfig``; a knob
        the command has not is None). ``alone``: the only model (a global --mm-processor-kwargs then
        applies to it, and is refused where it cannot)."""

        def pick(key: str) -> Any:
            own = getattr(self, key)
            return own if own is not None else flags.get(key)

        kwargs = self.mm_processor_kwargs
        if not kwargs and (alone or parse_model_spec(self.model).kind in (ModelKind.HF_CHAT, ModelKind.CHECKSUM_HF)):
            # with several models, the global --mm-processor-kwargs reaches those with an HF image processor
            kwargs = json.loads(flags.get("mm_processor_kwargs") or "{}")
        return replace(self, **{key: pick(key) for key in GLOBAL_KEYS}, mm_processor_kwargs=kwargs)
