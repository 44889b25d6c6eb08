"""Which request fields a model honours: the per-model half of "never silently ignore a field".

gateway/intake.py refuses what no model here does (tools, structured output, logprobs) and parses
the rest into ``SamplingParams``. This module refuses, with a 400 naming the field, what the
served model cannot honour:

- ``hf:`` chat models sample tokens: penalties, ``logit_bias``, ``stop_token_ids``, ``logprobs`` /
  ``top_logprobs``, ``response_format`` (a grammar, worker/constraints.py) and ``n`` (gateway/choices.py) are honoured
  (worker/generation/); token ids must lie inside the model's vocabulary.
- classifiers (``efficientnet-lite0``, ``checksum``, ``checksum:hf:``) answer with labels or digests,
  a pure function of the pixels: token-level fields (penalties, ``logit_bias``, ``stop_token_ids``,
  ``logprobs``, ``response_format``) have nothing to act on and are refused, as is ``n > 1`` (every choice would be equal). ``temperature``, ``top_p``, ``seed`` and
  ``stop`` are accepted with no effect (documented in docs/MODELS.md), because generic OpenAI
  clients and load generators send them by default; ``max_tokens`` bounds the classifier's
  label lines (worker/backends/efficientnet.py) and has no effect on the checksum digests.
"""

from __future__ import annotations

import dataclasses

from shmgate.gateway.intake import GenerationRequest
from shmgate.gateway.preprocess.base import Preprocessor
from shmgate.gateway.video import VIDEO_DETAIL  # a video part's marker (gateway/video.py)
from shmgate.shared.errors import InvalidRequest
from shmgate.shared.wire import SamplingParams

__all__ = ["check_fields_for_model", "with_image_options"]


def check_fields_for_model(params: SamplingParams, preprocessor: Preprocessor, n: int = 1) -> None:
    """Raise InvalidRequest naming the first field of ``params`` (or ``n``) the model cannot honour."""
    vocab = preprocessor.vocab_size if preprocessor.samples_tokens else None
    token_fields = {
        "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        "logit_bias": bool(params.logit_bias),
        "stop_token_ids": bool(params.stop_token_ids),
        "logprobs": params.logprobs >= 0,
        "response_format": bool(params.grammar),
        "n": n > 1,
    }
    if vocab is None:
        for name, used in token_fields.items():
            if used:
                raise InvalidRequest(
                    f"{name} is not supported by {preprocessor.model}: it does not sample tokens", param=name
                )
        return
    if any(token_id >= vocab for token_id, _ in params.logit_bias):
        raise InvalidRequest(f"logit_bias names a token id outside the vocabulary (0..{vocab - 1})", param="logit_bias")
    if any(token_id >= vocab for token_id in params.stop_token_ids):
        raise InvalidRequest(
            f"stop_token_ids names a token id outside the vocabulary (0..{vocab - 1})", param="stop_token_ids"
        )


def with_image_options(chat: GenerationRequest, preprocessor: Preprocessor) -> GenerationRequest:
    """``chat`` with ``image_options`` from each image's ``detail`` and the request's ``mm_processor_kwargs``.

    ``hf:`` models map them to image processor arguments (gateway/preprocess/hf.py ``image_options``);
    a classifier has one fixed input resolution, so ``detail`` has nothing to choose between (accepted,
    documented) and ``mm_processor_kwargs`` is refused. Raises InvalidRequest.
    """
    if not chat.image_details:  # no image to apply them to, but mm_processor_kwargs are checked all the same
        preprocessor.image_options(chat.processor_kwargs, None)
    options = [
        preprocessor.video_options()
        if detail == VIDEO_DETAIL
        else preprocessor.image_options(chat.processor_kwargs, detail)
        for detail in chat.image_details
    ]
    return dataclasses.replace(chat, image_options=options)
