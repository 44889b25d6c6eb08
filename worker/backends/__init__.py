"""Model backends by kind (shared/models.py). An explicit table: no import-by-string plugins."""

from __future__ import annotations

import torch

from shmgate.shared.common_options import EngineOptions, LoadOptions
from shmgate.shared.models import ModelKind, parse_model_spec
from shmgate.worker.backends.base import ModelBackend

__all__ = ["backend_class", "load_backend"]


def load_backend(
    model: str,
    device: torch.device,
    *,
    threads: int | None = None,
    load: LoadOptions | None = None,
    engine: EngineOptions | None = None,
) -> ModelBackend:
    """Build the backend serving ``model``. Raises ValueError for an unknown model or dtype.

    ``load`` (None: the declared defaults): ``dtype`` (``auto``, ``float32``, ``bfloat16``, ``float16``)
    applies to ``hf:`` models; the classifier runs float32 and the checksum backend has no weights.
    ``compile_normalise`` applies to the classifier (worker/backends/efficientnet.py: why it is opt-in).
    ``engine`` (None: the declared defaults), the generation engine's budgets and caches, applies to
    ``hf:`` chat models.
    """
    load = load or LoadOptions()
    engine = engine or EngineOptions()
    spec = parse_model_spec(model)
    match spec.kind:
        case ModelKind.EFFICIENTNET:
            from shmgate.worker.backends.efficientnet import EfficientNetBackend

            return EfficientNetBackend(device, threads=threads, compile_normalise=load.compile_normalise)
        case ModelKind.CHECKSUM | ModelKind.CHECKSUM_HF:
            # checksum:hf: digests what the HF preprocessor sent, instead of running the model.
            from shmgate.worker.backends.checksum import ChecksumBackend

            return ChecksumBackend(name=spec.public_id)
    from shmgate.worker.backends.hf import DTYPES, HFBackend

    dtype = load.dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    assert spec.directory is not None, "hf kinds always carry their directory"
    if spec.kind is ModelKind.HF_EMBED:  # CLIP / SigLIP / SigLIP2: /v1/embeddings only
        from shmgate.worker.backends.hf_embed import HFEmbeddingBackend

        return HFEmbeddingBackend(spec.directory, device, name=spec.public_id, threads=threads, dtype=DTYPES[dtype])
    return HFBackend(
        spec.directory,
        device,
        name=spec.public_id,
        threads=threads,
        dtype=DTYPES[dtype],
        max_num_batched_tokens=engine.max_num_batched_tokens,
        kv_cache_tokens=engine.kv_cache_tokens,
        encoder_cache_mb=engine.encoder_cache_mb,
        prefix_cache_mb=engine.prefix_cache_mb,
        kv_layout=engine.kv_layout,
    )


def backend_class(kind: ModelKind) -> type[ModelBackend]:
    """The class ``load_backend`` builds for ``kind``, without building it (no weights read): what a
    test lists to check every registered backend against the contract."""
    match kind:
        case ModelKind.EFFICIENTNET:
            from shmgate.worker.backends.efficientnet import EfficientNetBackend

            return EfficientNetBackend
        case ModelKind.CHECKSUM | ModelKind.CHECKSUM_HF:
            from shmgate.worker.backends.checksum import ChecksumBackend

            return ChecksumBackend
        case ModelKind.HF_EMBED:
            from shmgate.worker.backends.hf_embed import HFEmbeddingBackend

            return HFEmbeddingBackend
        case ModelKind.HF_CHAT:
            from shmgate.worker.backends.hf import HFBackend

            return HFBackend
