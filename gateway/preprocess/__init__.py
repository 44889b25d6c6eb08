"""Frontend halves of the models: decode and preprocess into arena tensors, build prompts.

``get_preprocessor`` is an explicit table from model kind (shared/models.py) to class; the
imports sit inside it so a frontend serving one model never imports another's
dependencies (transformers, for instance).
"""

from __future__ import annotations

from typing import Any

from shmgate.gateway.preprocess.base import Preprocessor
from shmgate.shared.models import ModelKind, ModelSpec, parse_model_spec

__all__ = ["get_preprocessor", "preprocessor_class"]


def get_preprocessor(
    model: str,
    *,
    max_images: int = 8,
    processor_kwargs: dict[str, Any] | None = None,
    tool_chat_template: str | None = None,
) -> Preprocessor:
    """The preprocessor for ``model`` (a spec, shared/models.py). Raises ValueError for an unknown model,
    and for ``processor_kwargs`` (--mm-processor-kwargs) given to a model without an HF image processor."""
    spec = parse_model_spec(model)
    if processor_kwargs and spec.kind not in (
        ModelKind.HF_CHAT,
        ModelKind.CHECKSUM_HF,
        ModelKind.EFFICIENTNET,
        ModelKind.CHECKSUM,
    ):
        raise ValueError(f"--mm-processor-kwargs applies to hf: chat and classifier models only, not {model}")
    match spec.kind:
        case ModelKind.EFFICIENTNET:
            from shmgate.gateway.preprocess.vision import EfficientNetPreprocessor, classifier_draft_margins

            margins = classifier_draft_margins(processor_kwargs)
            return EfficientNetPreprocessor(
                max_images=max_images,
                draft_margin=margins["draft_margin"],
                embedding_draft_margin=margins["embedding_draft_margin"],
            )
        case ModelKind.CHECKSUM:
            from shmgate.gateway.preprocess.vision import ChecksumPreprocessor, classifier_draft_margins

            margins = classifier_draft_margins(processor_kwargs)
            return ChecksumPreprocessor(
                max_images=max_images,
                draft_margin=margins["draft_margin"],
                embedding_draft_margin=margins["embedding_draft_margin"],
            )
        case ModelKind.HF_EMBED:
            from shmgate.gateway.preprocess.embed_hf import HFEmbeddingPreprocessor

            return HFEmbeddingPreprocessor(_directory(spec), max_images=max_images)
        case ModelKind.HF_CHAT | ModelKind.CHECKSUM_HF:
            # checksum:hf: is the transport's witness for a real processor: the HF preprocessing
            # feeds a worker that answers with digests (worker/backends/checksum.py).
            from shmgate.gateway.preprocess.hf import HFPreprocessor

            return HFPreprocessor(
                _directory(spec),
                max_images=max_images,
                model_id=spec.public_id,
                samples_tokens=spec.kind is ModelKind.HF_CHAT,
                processor_kwargs=processor_kwargs,
                tool_chat_template=tool_chat_template,
            )


def preprocessor_class(kind: ModelKind) -> type[Preprocessor]:
    """The class ``get_preprocessor`` builds for ``kind``, without building it (no checkpoint needed):
    what a test lists to check every registered preprocessor against the contract."""
    match kind:
        case ModelKind.EFFICIENTNET:
            from shmgate.gateway.preprocess.vision import EfficientNetPreprocessor

            return EfficientNetPreprocessor
        case ModelKind.CHECKSUM:
            from shmgate.gateway.preprocess.vision import ChecksumPreprocessor

            return ChecksumPreprocessor
        case ModelKind.HF_EMBED:
            from shmgate.gateway.preprocess.embed_hf import HFEmbeddingPreprocessor

            return HFEmbeddingPreprocessor
        case ModelKind.HF_CHAT | ModelKind.CHECKSUM_HF:
            from shmgate.gateway.preprocess.hf import HFPreprocessor

            return HFPreprocessor


def _directory(spec: ModelSpec) -> str:
    assert spec.directory is not None, "hf kinds always carry their directory"
    return spec.directory
