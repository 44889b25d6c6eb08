"""Build a tiny, randomly initialised VLM checkpoint on disk (Qwen2-VL by default; ``FAMILIES``), for tests only.

Why Qwen2-VL: it is the common dynamic-resolution architecture. Its processor
turns each image into a variable number of patches (``pixel_values`` of shape
``[t*h*w, 3*2*14*14]`` plus ``image_grid_thw``) and the prompt holds one
``<|image_pad|>`` per merged patch, so it exercises exactly what the gateway has
to carry: variable-size tensors and a prompt whose length depends on the image.

Everything is built locally (no hub access): a byte-level BPE tokenizer trained
in-process on a small corpus, wrapped as the real ``Qwen2Tokenizer`` class with
Qwen2-VL's special tokens and chat template; the real image processor with small
pixel bounds; and a 2-layer, 64-wide model. Weights come from a fixed seed, so
two builds produce identical files. The output is random text, which is all the
tests need: they check plumbing (shapes, streaming, seeds, stops), not quality.
``unusual=True`` builds a family with processor settings unlike the defaults and a tokenizer laid
out as downloaded ones (``UNUSUAL``), so a frontend that assumes a setting instead of reading it fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "SMALL_VIDEO_PROCESSOR",
    "TINY_MAX_PIXELS",
    "TINY_MIN_PIXELS",
    "UNUSUAL",
    "build_tiny_vlm",
    "reference_processor",
]

# Small resize bounds: a 1024x681 photo becomes 8x12 patches of 14 px (24 image tokens).
TINY_MIN_PIXELS = 28 * 28 * 4
TINY_MAX_PIXELS = 28 * 28 * 32
# A small video setting a checkpoint may carry (video_preprocessor_config.json; the tiny Qwen2-VL of the
# shared test server has it, tests/conftest.py): 2 frames a second, 4 to 8 merged 28 px patches a frame.
SMALL_VIDEO_PROCESSOR: dict[str, Any] = {
    "fps": 2.0,
    "min_frames": 2,
    "max_frames": 16,
    "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 8 * 28 * 28},
}

_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2-VL's own chat template (system prompt by default, one vision block per image).
_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """
The quick brown fox jumps over the lazy dog. A cat sits on the mat and looks at the camera.
What is in this image? Describe the picture in one sentence. There is a cup of coffee on a
table, a camera on a tripod, and a cat near the window. You are a helpful assistant.
Please answer the question about the photo: how many objects are there, what colour are
they, where is the light coming from? The image shows a small animal with stripes, an
espresso in a white cup, a lens, a screen, a dog, a tree, a house, a car, a street, a city.
Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1024 640. Yes, no, maybe, hello, world, thanks, sorry.
Café, naïve, über, 日本語, 東京, 猫, 🙂, 📷, ☕ — unicode text the tokenizer should round-trip.
"""


def _train_tokenizer_files() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE with Qwen2's pre-tokenizer; return (vocab, merges)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=448,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges  # type: ignore[return-value]


# The families this module builds (config.json model_type). The three Qwen ones share Qwen2-VL's image
# processor class, placeholder and multimodal RoPE; Qwen3-VL uses 16 px patches, learned vision position
# embeddings, interleaved RoPE sections and "deepstack" visual features fed into early text layers. The
# others are described beside their constants below; all share the trained tokenizer, each with its own
# special tokens and a chat template written for the test.
FAMILIES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "llava",
    "idefics3",
    "llava_next",
    "gemma3",
    "paligemma",
    "internvl",
    "smolvlm",
)
# LLaVA-1.5: a CLIP vision tower at a fixed 56 x 56 px (4 x 4 patches of 14 px: 16 image tokens, the
# CLS feature dropped as vision_feature_select_strategy "default" does), a Llama text model, and
# LLaVA-1.5's "USER: <image>\n... ASSISTANT:" prompt format.
LLAVA_IMAGE_SIZE = 56
_LLAVA_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% elif message['role'] == 'system' %}{% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<image>\n{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}<|im_end|>{% endif %} "
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


# Idefics3: a 56 px SigLIP-style tower (4 x 4 patches of 14 px, pixel-shuffled by 2: 4 image tokens per
# tile), images resized to at most 112 px and split into 56 px tiles plus a global view, and Idefics3's
# "<|im_start|>User:<image>...<end_of_utterance>\nAssistant:" prompt format.
IDEFICS3_TILE = 56
IDEFICS3_SPECIAL = [
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)],
]
_IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<image>{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


# LLaVA-NeXT: LLaVA-1.5's tiny CLIP tower and template, with any-resolution tiles: the image is fitted to
# the best of these grid resolutions, cut into 56 px tiles, and a 56 px overview comes first.
LLAVA_NEXT_PINPOINTS = [[56, 112], [112, 56], [112, 112]]


# Gemma 3: a 56 px SigLIP tower (4 x 4 patches of 14 px, average-pooled to 2 x 2: 4 image tokens), a
# Gemma 3 text model whose first layer is sliding-window attention over only 16 tokens, so prompts
# (~50 tokens) overflow the window and batching must merge rolled sliding caches.
GEMMA3_SPECIAL = ["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>", "<end_of_turn>"]
GEMMA3_WINDOW = 16
_GEMMA3_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<start_of_image>{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


# PaliGemma: a 56 px SigLIP tower (16 image tokens), a Gemma text model, and no chat template (as the
# real checkpoints: the frontend's built-in PaliGemma prompt applies). "<|endoftext|>" is its BOS.
PALIGEMMA_IMAGE_TOKENS = 16


# InternVL (transformers format): a 56 px InternViT tower (4 x 4 patches, pixel-shuffled by 0.5: 4 tokens
# per 56 px crop), images cut into 1..4 crops plus a thumbnail, a Qwen2 text model, and InternVL's
# "<img>" + "<IMG_CONTEXT>"... + "</img>" markers.
INTERNVL_SPECIAL = ["<img>", "</img>", "<IMG_CONTEXT>"]
_INTERNVL_TEMPLATE = _CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<IMG_CONTEXT>\n")


def _patch(family: str) -> int:
    return 16 if family == "qwen3_vl" else 14


# ``build_tiny_vlm(..., unusual=True)``: the settings each family's processor reads, set unlike both
# transformers' defaults and the plain fixture's, with the model built to match, as in any working
# checkpoint; and the tokenizer laid out as downloaded checkpoints lay it out: the processors' named
# tokens in tokenizer_config.json's ``extra_special_tokens``, and for the families whose real
# checkpoints use a Llama- or Gemma-style tokenizer (BOS_FAMILIES), one that adds BOS itself (Gemma 3's
# template writes BOS, as its real one does). PaliGemma also ships a chat template of its own (its
# processor still adds BOS and "\n" to whatever prompt it gets). One stale copy is kept on purpose, as
# real checkpoints carry it: InternVL's model config keeps image_seq_length at its default (256), which
# its model never reads; its processor's is 1.
BOS_FAMILIES = ("llava", "llava_next", "gemma3", "paligemma")
_PALIGEMMA_TEMPLATE = (
    "{% for message in messages %}{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% endif %}{% endfor %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endfor %}"
)
UNUSUAL: dict[str, dict[str, Any]] = {
    # Qwen family: other pixel bounds (4..12 merged patches) and normalisation.
    **{
        family: {
            "min_pixels": 4 * (2 * _patch(family)) ** 2,
            "max_pixels": 12 * (2 * _patch(family)) ** 2,
            "image_mean": [0.25, 0.5, 0.75],
            "image_std": [0.2, 0.3, 0.4],
        }
        for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
    },
    # LLaVA-1.5: a 42 px tower (3 x 3 patches) that keeps the CLS feature ("full"): 10 tokens an image.
    "llava": {"image_size": 42, "vision_feature_select_strategy": "full"},
    # LLaVA-NeXT: 42 px tiles on other grids (its model drops the CLS feature whatever the setting says).
    "llava_next": {"image_size": 42, "image_grid_pinpoints": [[42, 84], [84, 42], [84, 84], [42, 126]]},
    # Idefics3, SmolVLM2: 56 px tiles of 4 x 4 patches, pixel-shuffled by 4: one token a tile; up to 3 x 3 tiles.
    **{
        family: {"tile": 56, "scale_factor": 4, "image_seq_len": 1, "longest_edge": 168}
        for family in ("idefics3", "smolvlm")
    },
    # Gemma 3: the 4 x 4 patches pooled to one token.
    "gemma3": {"image_seq_length": 1},
    # PaliGemma: a 42 px tower (9 tokens).
    "paligemma": {"image_size": 42, "image_seq_length": 9},
    # InternVL: a 28 px tower (2 x 2 patches, pixel-shuffled by 0.5: one token a crop), 2..6 crops.
    "internvl": {"image_size": 28, "image_seq_length": 1, "min_patches": 2, "max_patches": 6},
}
# The named tokens transformers' processors read from the tokenizer, as downloaded checkpoints name them.
_NAMED_TOKENS: dict[str, dict[str, str]] = {
    "qwen2_vl": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    "qwen2_5_vl": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    "qwen3_vl": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    "llava": {"image_token": "<image>"},
    "llava_next": {"image_token": "<image>"},
    "smolvlm": {
        "image_token": "<image>",
        "fake_image_token": "<fake_token_around_image>",
        "global_image_token": "<global-img>",
        "end_of_utterance_token": "<end_of_utterance>",
    },
    "gemma3": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    "paligemma": {"image_token": "<image>"},
    "internvl": {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<|video_pad|>",
    },
}


def _train_gemma_tokenizer(special: list[str]) -> Any:
    """A Gemma tokenizer (SentencePiece-style BPE with byte fallback, BOS added to every encoding, as
    PaliGemma checkpoints ship it) trained on the corpus, with ``special`` tokens added."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    base = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *(f"<0x{i:02X}>" for i in range(256))]
    tok.train_from_iterator(
        [_CORPUS] * 4,
        trainer=trainers.BpeTrainer(vocab_size=600, min_frequency=1, special_tokens=base, show_progress=False),
    )
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = GemmaTokenizer(vocab=model["vocab"], merges=merges, add_bos_token=True, model_max_length=4096)
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    return tokenizer


def _name_tokens(path: Path, family: str) -> None:
    """Write the family's named tokens into tokenizer_config.json, as downloaded checkpoints have them."""
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["extra_special_tokens"] = _NAMED_TOKENS.get(family, {})
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def _build_processor(path: Path, family: str = "qwen2_vl", unusual: bool = False) -> Any:
    """Save tokenizer (with chat template) and image processor; return the tokenizer.

    The parts are saved one by one, not through ``Qwen2VLProcessor``: in
    transformers 5.x that class insists on a video processor, which needs
    torchvision, and a frontend has no use for either. ``processor_config.json``
    still names the processor class, so ``AutoProcessor`` works where torchvision is
    installed, as it does for a real Qwen2-VL checkpoint.
    """
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    extra = {
        "llava": ["<image>"],
        "llava_next": ["<image>"],
        "paligemma": ["<image>"],
        "idefics3": IDEFICS3_SPECIAL,
        "smolvlm": IDEFICS3_SPECIAL,
        "internvl": INTERNVL_SPECIAL,
        "gemma3": GEMMA3_SPECIAL,
    }.get(family, [])
    if unusual and family in BOS_FAMILIES:
        tokenizer = _train_gemma_tokenizer(_SPECIAL_TOKENS + extra)
    else:
        vocab, merges = _train_tokenizer_files()
        tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=4096)
        tokenizer.add_special_tokens({"additional_special_tokens": _SPECIAL_TOKENS[1:] + extra})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = {
        "llava": _LLAVA_TEMPLATE,
        "llava_next": _LLAVA_TEMPLATE,
        "idefics3": _IDEFICS3_TEMPLATE,
        "smolvlm": _IDEFICS3_TEMPLATE,
        "gemma3": _GEMMA3_TEMPLATE,
        "internvl": _INTERNVL_TEMPLATE,
    }.get(family, _CHAT_TEMPLATE)
    if family == "paligemma":
        tokenizer.chat_template = None
        tokenizer.bos_token = "<bos>" if unusual else "<|endoftext|>"
    if unusual and family == "gemma3":
        tokenizer.chat_template = "{{ bos_token }}" + _GEMMA3_TEMPLATE
    tokenizer.save_pretrained(str(path))
    if unusual and family == "paligemma":
        (path / "chat_template.jinja").write_text(_PALIGEMMA_TEMPLATE)
    odd = UNUSUAL[family] if unusual else {}
    if unusual:
        _name_tokens(path, family)
    if family == "llava":
        from transformers import CLIPImageProcessorPil

        size = odd.get("image_size", LLAVA_IMAGE_SIZE)
        CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(
            str(path)
        )
        if unusual:
            (path / "processor_config.json").write_text(
                json.dumps(
                    {
                        "processor_class": "LlavaProcessor",
                        "patch_size": 14,
                        "num_additional_image_tokens": 1,
                        "vision_feature_select_strategy": odd["vision_feature_select_strategy"],
                    }
                )
                + "\n"
            )
        return tokenizer
    if family == "llava_next":
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

        size = odd.get("image_size", LLAVA_IMAGE_SIZE)
        LlavaNextImageProcessorPil(
            size={"shortest_edge": size},
            crop_size={"height": size, "width": size},
            image_grid_pinpoints=odd.get("image_grid_pinpoints", LLAVA_NEXT_PINPOINTS),
        ).save_pretrained(str(path))
        (path / "processor_config.json").write_text(
            json.dumps(
                {
                    "processor_class": "LlavaNextProcessor",
                    "patch_size": 14,
                    "vision_feature_select_strategy": odd.get("vision_feature_select_strategy", "default"),
                    "num_additional_image_tokens": 1,
                }
            )
            + "\n"
        )
        return tokenizer
    if family == "internvl":
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        side = odd.get("image_size", 56)
        GotOcr2ImageProcessorPil(
            size={"height": side, "width": side},
            crop_to_patches=True,
            min_patches=odd.get("min_patches", 1),
            max_patches=odd.get("max_patches", 4),
        ).save_pretrained(str(path))
        (path / "processor_config.json").write_text(
            json.dumps({"processor_class": "InternVLProcessor", "image_seq_length": odd.get("image_seq_length", 4)})
            + "\n"
        )
        return tokenizer
    if family == "paligemma":
        from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

        side = odd.get("image_size", 56)
        siglip = SiglipImageProcessorPil(size={"height": side, "width": side})
        siglip.image_seq_length = odd.get(
            "image_seq_length", PALIGEMMA_IMAGE_TOKENS
        )  # PaliGemmaProcessor reads it, as real checkpoints carry it
        siglip.save_pretrained(str(path))
        (path / "processor_config.json").write_text(json.dumps({"processor_class": "PaliGemmaProcessor"}) + "\n")
        return tokenizer
    if family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(str(path))
        (path / "processor_config.json").write_text(
            json.dumps({"processor_class": "Gemma3Processor", "image_seq_length": odd.get("image_seq_length", 4)})
            + "\n"
        )
        return tokenizer
    if family in ("idefics3", "smolvlm"):  # SmolVLM2: Idefics3's tiles and prompt, its own classes
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        tiles = Idefics3ImageProcessorPil if family == "idefics3" else SmolVLMImageProcessorPil
        tile = odd.get("tile", IDEFICS3_TILE)
        tiles(
            size={"longest_edge": odd.get("longest_edge", 2 * tile)}, max_image_size={"longest_edge": tile}
        ).save_pretrained(str(path))
        processor_class = "Idefics3Processor" if family == "idefics3" else "SmolVLMProcessor"
        (path / "processor_config.json").write_text(
            json.dumps({"processor_class": processor_class, "image_seq_len": odd.get("image_seq_len", 4)}) + "\n"
        )
        return tokenizer
    scale = (_patch(family) / 14) ** 2  # the same token bounds at the family's patch size
    bounds = {"min_pixels": int(TINY_MIN_PIXELS * scale), "max_pixels": int(TINY_MAX_PIXELS * scale)}
    image_processor = Qwen2VLImageProcessorPil(**{**bounds, **odd}, patch_size=_patch(family))
    image_processor.save_pretrained(str(path))
    processor_class = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}.get(
        family, "Qwen2VLProcessor"
    )
    (path / "processor_config.json").write_text(
        json.dumps({"processor_class": processor_class if unusual else "Qwen2VLProcessor"}) + "\n"
    )
    return tokenizer


def _vision_config(family: str) -> dict[str, Any]:
    if family == "qwen2_vl":
        return {
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,  # the merger projects to the text width
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        }
    common = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": _patch(family),
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    if family == "qwen2_5_vl":
        return {**common, "window_size": 56, "fullatt_block_indexes": [0]}
    return {**common, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}


def _build_llava(tokenizer: Any, ids: dict[str, int], family: str = "llava", odd: dict[str, Any] | None = None) -> Any:
    import transformers

    config_class, model_class = {
        "llava": ("LlavaConfig", "LlavaForConditionalGeneration"),
        "llava_next": ("LlavaNextConfig", "LlavaNextForConditionalGeneration"),
    }[family]
    odd = odd or {}
    extra: dict[str, Any] = (
        {"image_grid_pinpoints": odd.get("image_grid_pinpoints", LLAVA_NEXT_PINPOINTS)}
        if family == "llava_next"
        else {}
    )
    config = getattr(transformers, config_class)(
        **extra,
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": odd.get("image_size", LLAVA_IMAGE_SIZE),
            "patch_size": 14,
            "projection_dim": 32,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy=odd.get("vision_feature_select_strategy", "default"),
    )
    return getattr(transformers, model_class)(config).eval()


def _build_idefics3(
    tokenizer: Any, ids: dict[str, int], family: str = "idefics3", odd: dict[str, Any] | None = None
) -> Any:
    import transformers

    config_class, model_class = {
        "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration"),
        "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration"),
    }[family]
    config = getattr(transformers, config_class)(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": (odd or {}).get("tile", IDEFICS3_TILE),
            "patch_size": 14,
        },
        text_config={
            "model_type": "llama",
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=(odd or {}).get("scale_factor", 2),
    )
    return getattr(transformers, model_class)(config).eval()


def _build_gemma3(tokenizer: Any, ids: dict[str, int], odd: dict[str, Any]) -> Any:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 56,
            "patch_size": 14,
        },
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "max_position_embeddings": 4096,
            "sliding_window": GEMMA3_WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        mm_tokens_per_image=odd.get("image_seq_length", 4),
        boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"),
        image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
    )
    return Gemma3ForConditionalGeneration(config).eval()


def _build_paligemma(tokenizer: Any, ids: dict[str, int], odd: dict[str, Any]) -> Any:
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    config = PaliGemmaConfig(
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": odd.get("image_size", 56),
            "patch_size": 14,
            "projection_dim": 64,
        },
        text_config={
            "model_type": "gemma",
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        projection_dim=64,
        hidden_size=64,
        vocab_size=len(tokenizer),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
    )
    return PaliGemmaForConditionalGeneration(config).eval()


def _build_internvl(tokenizer: Any, ids: dict[str, int], odd: dict[str, Any]) -> Any:
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    config = InternVLConfig(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": [odd.get("image_size", 56)] * 2,
            "patch_size": [14, 14],
        },
        text_config={
            "model_type": "qwen2",
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
        downsample_ratio=0.5,
        **({} if odd else {"image_seq_length": 4}),  # unusual: the default (256) stays, as in real checkpoints
    )
    return InternVLForConditionalGeneration(config).eval()


def _build_model(path: Path, tokenizer: Any, family: str = "qwen2_vl", odd: dict[str, Any] | None = None) -> None:
    import torch
    import transformers

    if family in ("llava", "llava_next", "idefics3", "smolvlm", "gemma3", "paligemma", "internvl"):
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _SPECIAL_TOKENS}
        extra = {
            "idefics3": IDEFICS3_SPECIAL,
            "smolvlm": IDEFICS3_SPECIAL,
            "gemma3": GEMMA3_SPECIAL,
            "internvl": INTERNVL_SPECIAL,
        }.get(family, ["<image>"])
        torch.manual_seed(0)
        builders = {"gemma3": _build_gemma3, "paligemma": _build_paligemma, "internvl": _build_internvl}
        if family in ("idefics3", "smolvlm"):
            model = _build_idefics3(tokenizer, ids, family, odd)
        elif family in builders:
            model = builders[family](tokenizer, ids, odd or {})
        else:
            model = _build_llava(tokenizer, ids, family, odd)
        _finish_model(model, path, [*ids.values(), *tokenizer.convert_tokens_to_ids(extra)], ids)
        return

    config_class, model_class = {
        "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
        "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
        "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    }[family]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _SPECIAL_TOKENS}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    if family == "qwen3_vl":
        rope["mrope_interleaved"] = True
    config = getattr(transformers, config_class)(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "head_dim": 16,
            "rope_parameters": rope,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config=_vision_config(family),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    _finish_model(model, path, list(ids.values()), ids)


def _finish_model(model: Any, path: Path, control: list[int], ids: dict[str, int]) -> None:
    import torch
    from transformers import GenerationConfig

    with torch.no_grad():
        # Random logits are nearly uniform; silence the control tokens so greedy
        # decoding never ends on its first step and tests see long streams.
        model.lm_head.weight[control] = 0.0
    model.generation_config = GenerationConfig(
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
    )
    model.save_pretrained(str(path))


def build_tiny_vlm(path: Path, family: str = "qwen2_vl", *, unusual: bool = False) -> Path:
    """Write a tiny model of ``family`` (FAMILIES) and its processor into ``path`` (created if needed);
    ``unusual``: with the family's UNUSUAL processor settings and a tokenizer laid out as downloaded.

    Deterministic and fast (a couple of seconds on CPU). The directory loads with
    ``AutoImageProcessor``, ``AutoTokenizer`` and ``AutoModelForImageTextToText`` (and
    ``AutoProcessor`` where torchvision is installed).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_processor(path, family, unusual)
    _build_model(path, tokenizer, family, UNUSUAL[family] if unusual else None)
    return path


def reference_processor(model_dir: Path) -> Any:
    """transformers' own ``Qwen2VLProcessor`` built from ``model_dir``: the tests' reference.

    In transformers 5.x its constructor insists on a video processor, which needs
    torchvision; the type check is skipped for that one argument (images never use it).
    """
    from unittest import mock

    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def check_except_video(self: Any, name: str, arg: Any) -> Any:
        return None if name == "video_processor" and arg is None else check(self, name, arg)

    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", check_except_video):
        return Qwen2VLProcessor(image_processor, tokenizer, None, chat_template=tokenizer.chat_template)


def no_eos_bias(model_dir: Path) -> dict[str, float]:
    """A ``logit_bias`` that keeps the tiny Qwen2-VL from ever ending its answer (long generations on purpose)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return {str(i): -100.0 for i in ids}
