"""The contract every input style implements, for both halves: ``FamilyStyle``.

An input style is how a family's checkpoints take images: how the frontend lays out each image's
tokens in a prompt and which processor outputs it keeps (the *frontend half*), and how the worker
checks an item's tensors, feeds them to the model and computes its positions (the *worker half*).
Both halves import the same module (shared/families/<style>.py), so they cannot disagree about a
style; gateway/ and worker/ never import each other.

Rules of the style modules:
1. torch and transformers are imported only inside worker-half functions (or under TYPE_CHECKING):
   a frontend imports every style module, and it never loads torch (tests/test_import_rules.py).
2. A style holds no per-checkpoint state: one instance serves every checkpoint of its families.
   What a checkpoint needs beside its config (LLaVA-NeXT's processor, Idefics3's memoised tile
   texts) is made by ``prepare`` and kept by the preprocessor (``PromptContext.style_state``).
3. The frontend half counts image tokens from tensor *shapes* alone (the content cache hands the
   prompt builder shapes, not values); a fact the shapes would not fix is written as one at decode
   time (``outputs``).
4. The worker half distrusts every item: a mismatch between the prompt's image slots and the
   images' tensors raises InvalidRequest, which fails that request alone.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from shmgate.shared.errors import InvalidRequest
from shmgate.shared.wire import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = [
    "PIXEL_VALUES",
    "FamilyStyle",
    "ImageSpec",
    "InputLayout",
    "ItemTensors",
    "ModelInputs",
    "PromptContext",
    "repeat_placeholders",
    "splice_images",
]

PIXEL_VALUES = "pixel_values"

# One image's tensors as the prompt builder sees them: name -> (dtype name, shape).
ImageSpec = Mapping[str, tuple[str, tuple[int, ...]]]


class PromptContext(Protocol):
    """What a frontend half reads of the preprocessor that runs it (gateway/preprocess/hf.py)."""

    image_processor: Any
    tokenizer: Any
    processor_settings: dict[str, Any]  # processor_config.json
    model_config: Any  # the checkpoint's AutoConfig, read where the processor has no setting of its own
    style_state: Any  # what ``prepare`` made for this checkpoint
    image_token_id: int  # the placeholder's id
    max_prompt_tokens: int | None  # the model's context
    added_ids: np.ndarray  # the tokenizer's added tokens' ids, int32
    tokenizer_lock: threading.Lock  # held around tokenizer calls that flip its settings

    def named_token_id(self, attribute: str, default: str) -> int: ...

    def video_tokens(self, spec: ImageSpec) -> int | None: ...

    def with_special_tokens(self, ids: np.ndarray) -> np.ndarray: ...


class ItemTensors(Protocol):
    """What a worker half reads of a request (worker/backends/base.py ``WorkItem``)."""

    @property
    def request_id(self) -> int: ...

    @property
    def inline(self) -> bytes: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def tensors(self) -> Mapping[str, list[torch.Tensor]]: ...


@dataclass
class ModelInputs:
    """An item's model inputs, checked, on the device."""

    input_ids: torch.Tensor  # int64 [1, L] on the device
    pixel_values: torch.Tensor | None  # [sum of t*h*w, patch_dim]
    image_grid_thw: torch.Tensor | None  # int64 [n_images, 3]
    pixel_attention_mask: torch.Tensor | None = None  # Idefics3: bool [1, tiles, S, S]
    image_sizes: torch.Tensor | None = None  # LLaVA-NeXT: int64 [n_images, 2], original (height, width)
    pixel_values_videos: torch.Tensor | None = None  # Qwen2-VL video: [sum of t*h*w, patch_dim]
    video_grid_thw: torch.Tensor | None = None  # int64 [n_videos, 3]
    second_per_grid_ts: torch.Tensor | None = None  # float32 [n_videos]: Qwen2.5-VL's temporal spacing


@dataclass(frozen=True)
class InputLayout:
    """What a well-formed item looks like for one model, read from its config once (``FamilyStyle.layout``)."""

    style: FamilyStyle
    vocab_size: int
    max_positions: int
    image_token_id: int
    merge: int = 1  # Qwen family: spatial_merge_size ** 2, patches per image token
    patch_dim: int = 0  # Qwen family: channels * temporal_patch_size * patch_size ** 2
    image_size: int = 0  # the vision tower's input side (fixed-size, tiled, crops)
    tokens_per_image: int = 0  # LLaVA: image tokens per image; Idefics3: per tile; InternVL: per crop
    grid_pinpoints: tuple[tuple[int, int], ...] = ()  # LLaVA-NeXT
    video_token_id: int = -1  # Qwen2-VL: the video placeholder (-1: the model takes no video)
    video_seconds: bool = False  # Qwen2.5-VL: temporal positions spaced by each video's second_per_grid_ts
    # The tensor names any style passes to a model (shared/families/__init__.py IMAGE_TENSORS): another
    # name is refused before the style looks at the item.
    accepted: frozenset[str] = field(default=frozenset())

    def check(self, item: ItemTensors, device: torch.device) -> ModelInputs:
        """Validate ``item`` on the host and build its model inputs on ``device``. Raises InvalidRequest."""
        rid = item.request_id
        if not item.inline or len(item.inline) % 4:
            raise InvalidRequest(f"Request {rid}: the token ids are {len(item.inline)} bytes, not int32s.")
        ids = np.frombuffer(item.inline, dtype=np.int32)
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise InvalidRequest(f"Request {rid}: a token id is outside the vocabulary (0..{self.vocab_size - 1}).")
        params = item.params
        if any(not 0 <= t < self.vocab_size for t, _ in params.logit_bias) or any(
            not 0 <= t < self.vocab_size for t in params.stop_token_ids
        ):
            raise InvalidRequest(f"Request {rid}: logit_bias or stop_token_ids name a token outside the vocabulary.")
        unknown = set(item.tensors) - self.accepted
        if unknown:
            raise InvalidRequest(f"Request {rid}: unexpected tensors {sorted(unknown)}.")
        pixels, grids = item.tensors.get("pixel_values", []), item.tensors.get("image_grid_thw", [])
        videos, video_grids = item.tensors.get("pixel_values_videos", []), item.tensors.get("video_grid_thw", [])
        if (videos or video_grids) and self.video_token_id < 0:
            raise InvalidRequest(f"Request {rid}: this model takes no video.")
        return self.style.check(self, item, ids, pixels, grids, device)


class FamilyStyle(abc.ABC):
    """One input style: both halves' code. A subclass that lacks a method cannot be built (mypy and
    tests/test_model_contract.py say which); the defaults are the plain case (1-D positions from 0,
    the processor's outputs kept as they come, no lower detail)."""

    name: str  # the style's name, for errors and docs
    # -- frontend half ---------------------------------------------------------------------------------
    image_token: str  # the placeholder the chat template writes, unless the tokenizer names it
    token_attribute: str = "image_token"  # the tokenizer's attribute naming the placeholder (as the processor reads it)
    call_args: tuple[tuple[str, Any], ...] = ()  # extra image processor arguments
    # -- worker half -----------------------------------------------------------------------------------
    image_tensors: tuple[str, ...]  # the TensorRef names it passes to the model
    host_tensors: tuple[str, ...] = ()  # of those, read on the host (checked, turned into counts)
    first_position: int = 0  # 1-D positions: the prompt's start at this

    # -- frontend half ---------------------------------------------------------------------------------

    def prepare(self, pre: PromptContext) -> Any:
        """What this checkpoint needs beside its config (``pre.style_state``); called once at load."""
        return None

    def chat_template(self) -> str | None:
        """The template used when the checkpoint carries none (None: it must carry one)."""
        return None

    def plan_image(self, pre: PromptContext, width: int, height: int, size: dict[str, Any]) -> int:
        """Before any decode, from the header's ``width`` x ``height`` and the processor's ``size`` (this
        image's options on top): the bytes the processor's own work will take beyond the decode (0 when
        negligible, as for a processor that resizes to a fixed size). Raises InvalidRequest when the image
        alone cannot fit the model's context."""
        return 0

    def low_detail(self, image_processor: Any) -> dict[str, Any]:
        """The processor arguments ``image_url.detail: "low"`` stands for ({}: no lower setting)."""
        return {}

    def outputs(self, pre: PromptContext, out: Mapping[str, Any]) -> dict[str, Any]:
        """The image processor's output turned into the arrays the arena holds."""
        return dict(out)

    def arrange(self, pre: PromptContext, ids: np.ndarray) -> np.ndarray:
        """The template's ids as the family's processor gives them (its special tokens around them)."""
        return pre.with_special_tokens(ids)

    @abc.abstractmethod
    def expand(self, pre: PromptContext, ids: np.ndarray, slots: np.ndarray, images: Sequence[ImageSpec]) -> np.ndarray:
        """``ids`` with the placeholder at each of ``slots`` expanded into ``images``' tokens, int32.
        Raises InvalidRequest for an image whose tensors this style did not make."""

    # -- worker half -----------------------------------------------------------------------------------

    @abc.abstractmethod
    def layout(self, config: Any, common: dict[str, Any]) -> InputLayout:
        """The layout of a model of this style from its config (``common``: the fields every style sets)."""

    @abc.abstractmethod
    def check(
        self,
        layout: InputLayout,
        item: ItemTensors,
        ids: np.ndarray,
        pixels: list[torch.Tensor],
        grids: list[torch.Tensor],
        device: torch.device,
    ) -> ModelInputs:
        """The item's images checked against the prompt's slots, as model inputs. Raises InvalidRequest."""

    def model_inputs(self, inputs: ModelInputs) -> dict[str, Any]:
        """The item's image tensors as the model's forward takes them (those it has)."""
        kwargs: dict[str, Any] = {}
        if inputs.pixel_values is not None:
            kwargs["pixel_values"] = inputs.pixel_values
        if inputs.image_grid_thw is not None:
            kwargs["image_grid_thw"] = inputs.image_grid_thw
        if inputs.video_grid_thw is not None:  # video
            kwargs["pixel_values_videos"], kwargs["video_grid_thw"] = inputs.pixel_values_videos, inputs.video_grid_thw
        if inputs.pixel_attention_mask is not None:
            kwargs["pixel_attention_mask"] = inputs.pixel_attention_mask
        if inputs.image_sizes is not None:
            kwargs["image_sizes"] = inputs.image_sizes
        return kwargs

    def encode_images(self, model: Any, pixels: torch.Tensor, grids: torch.Tensor) -> Sequence[torch.Tensor]:
        """The vision tower's output for each image of ``pixels`` (``grids``: their patch grids), one tensor
        of prompt embeddings per image, as the model scatters them into the prompt's image slots. Only the
        families whose tower runs apart (``HFFamily.encoder_apart``) are asked; run under inference mode."""
        raise NotImplementedError(f"{type(self).__name__} runs its vision tower inside the model's forward")

    def extra_inputs(self, layout: InputLayout, ids: torch.Tensor, prompt_tokens: int) -> dict[str, Any]:
        """Model arguments beside the ids, images and positions for a prefill of ``ids`` (token types)."""
        return {}

    def positions(self, model: Any, layout: InputLayout, ids: torch.Tensor, inputs: ModelInputs) -> tuple[Any, int]:
        """The prompt's positions and the offset of the tokens after it (run under inference mode)."""
        import torch

        delta = self.first_position
        return torch.arange(delta, ids.shape[1] + delta, device=ids.device).view(1, -1), delta


def repeat_placeholders(ids: np.ndarray, slots: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """Each placeholder at ``slots`` repeated its image's count of times."""
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[slots] = counts
    return np.repeat(ids, repeats)


def splice_images(ids: np.ndarray, slots: np.ndarray, expansions: Sequence[Sequence[int]]) -> np.ndarray:
    """Each placeholder at ``slots`` replaced by its image's token ids."""
    parts = np.split(ids, slots)  # each later part starts with its image's placeholder
    pieces = [parts[0]] + [
        np.concatenate([np.asarray(expansion, dtype=np.int32), part[1:]])
        for expansion, part in zip(expansions, parts[1:])
    ]
    return np.concatenate(pieces).astype(np.int32)
