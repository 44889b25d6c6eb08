"""Tiny, randomly initialised CLIP, SigLIP and SigLIP2 checkpoints on disk, for tests only.

Each directory holds the real model class (2 layers, 32 wide), the real image processor of its
family (PIL backend, 32x32 pixels; SigLIP2 at most 16 patches of 8 px) and a tokenizer trained
in-process (no hub access here): a byte-level BPE wrapped as ``CLIPTokenizer`` for CLIP, and a
BPE wrapped as ``GemmaTokenizer`` for SigLIP2 and SigLIP. Real SigLIP checkpoints ship a
SentencePiece ``SiglipTokenizer`` (which needs the sentencepiece package); the server reads
whatever tokenizer the directory names, so the fixture's choice changes nothing on the data path.
Weights come from a fixed seed: two builds produce identical files. Building all three takes a
few seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_tiny_embedder", "reference_features"]

_CORPUS = """
a photo of a cat. a photo of a dog. a cup of coffee on a table. a camera on a tripod.
the quick brown fox jumps over the lazy dog. a red car in a city street at night.
an espresso in a white cup, a lens, a screen, a tree, a house. hello world, thanks.
"""
_WIDTH = 32
_TEXT_TOKENS = 16


def _bpe(special: list[str], *, suffix: str | None, metaspace: bool) -> tuple[dict[str, int], list[tuple[str, str]]]:
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(end_of_word_suffix=suffix) if suffix else models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace() if metaspace else pre_tokenizers.ByteLevel(add_prefix_space=False)
    kwargs: dict[str, Any] = {"end_of_word_suffix": suffix} if suffix else {}
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        min_frequency=1,
        special_tokens=special,
        show_progress=False,
        initial_alphabet=[] if metaspace else pre_tokenizers.ByteLevel.alphabet(),
        **kwargs,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges  # type: ignore[return-value]


def _clip_tokenizer() -> Any:
    from transformers import CLIPTokenizer

    vocab, merges = _bpe(["<|startoftext|>", "<|endoftext|>"], suffix="</w>", metaspace=False)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=_TEXT_TOKENS)


def _gemma_tokenizer() -> Any:
    from transformers import GemmaTokenizer

    vocab, merges = _bpe(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"], suffix=None, metaspace=True)
    return GemmaTokenizer(vocab=vocab, merges=merges, model_max_length=_TEXT_TOKENS)


def _text_config(tokenizer: Any) -> dict[str, Any]:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": _WIDTH,
        "intermediate_size": 2 * _WIDTH,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": _TEXT_TOKENS,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def _vision_config(**extra: Any) -> dict[str, Any]:
    return {
        "hidden_size": _WIDTH,
        "intermediate_size": 2 * _WIDTH,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "patch_size": 8,
        **extra,
    }


def build_tiny_embedder(kind: str, path: Path) -> Path:
    """Write a tiny ``kind`` ("clip", "siglip" or "siglip2") checkpoint with its processor files into ``path``."""
    import torch
    from transformers import (
        CLIPConfig,
        CLIPImageProcessorPil,
        CLIPModel,
        Siglip2Config,
        Siglip2ImageProcessorPil,
        Siglip2Model,
        SiglipConfig,
        SiglipImageProcessorPil,
        SiglipModel,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if kind == "clip":
        tokenizer = _clip_tokenizer()
        processor: Any = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        model: Any = CLIPModel(
            CLIPConfig(
                text_config=_text_config(tokenizer), vision_config=_vision_config(image_size=32), projection_dim=24
            )
        )
    elif kind == "siglip":
        tokenizer = _gemma_tokenizer()
        processor = SiglipImageProcessorPil(size={"height": 32, "width": 32})
        model = SiglipModel(
            SiglipConfig(text_config=_text_config(tokenizer), vision_config=_vision_config(image_size=32))
        )
    elif kind == "siglip2":
        tokenizer = _gemma_tokenizer()
        processor = Siglip2ImageProcessorPil(patch_size=8, max_num_patches=16)
        model = Siglip2Model(
            Siglip2Config(text_config=_text_config(tokenizer), vision_config=_vision_config(num_patches=16))
        )
    else:
        raise ValueError(f"unknown kind {kind!r}")
    tokenizer.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    model.eval().save_pretrained(str(path))
    return path


def reference_features(model_dir: Path, *, images: Sequence[Any] = (), texts: Sequence[str] = ()) -> Any:
    """The model's own unit-normalised features, through transformers' processor parts (the tests' reference).

    Images: ``get_image_features`` on the image processor's output; texts: ``get_text_features`` on
    the tokenizer's output padded to the text tower's length, as the models' processors pad.
    """
    import torch
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(model_dir).eval()
    out = []
    with torch.inference_mode():
        if images:
            inputs = AutoImageProcessor.from_pretrained(model_dir, backend="pil")(
                images=list(images), return_tensors="pt"
            )
            out.append(model.get_image_features(**inputs).pooler_output)
        if texts:
            tok = AutoTokenizer.from_pretrained(model_dir)
            inputs = tok(
                list(texts), padding="max_length", truncation=True, max_length=_TEXT_TOKENS, return_tensors="pt"
            )
            out.append(model.get_text_features(**inputs).pooler_output)
    return torch.nn.functional.normalize(torch.cat(out), dim=-1).numpy()
