"""Qwen2.5-VL, Qwen3-VL, LLaVA-1.5, Idefics3, LLaVA-NeXT, Gemma 3, PaliGemma, InternVL and SmolVLM2, end to end on tiny random checkpoints.

Per family (tests/hf_fixture.py builds each once per run): through a real ``shmgate serve`` with
``--max-batch-size 1``, a streamed greedy answer to a two-image prompt equals transformers' own
``generate`` on the same directory token for token, with exact usage (Idefics3, LLaVA-NeXT,
Gemma 3, PaliGemma, InternVL, SmolVLM2: on the inputs of transformers' own processor, whose ids must equal ours); a repeated image is a
content-cache hit; and in the worker, a padded batch answers as its items alone. Qwen2-VL itself is
covered by tests/test_hf.py and tests/test_hf_serve.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from gateway.preprocess.hf import HFPreprocessor  # noqa: E402
from shared.wire import SamplingParams  # noqa: E402
from tests.serving import Server, data_url, start_server  # noqa: E402
from tests.shm_children import leftovers  # noqa: E402
from tests.test_hf import SQUARE, WIDE, answer, work_item  # noqa: E402
from worker.backends.hf import HFBackend  # noqa: E402

FAMILIES = ["qwen2_5_vl", "qwen3_vl", "llava", "idefics3", "llava_next", "gemma3", "paligemma", "internvl", "smolvlm"]
TOKENS = 10


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, tiny_vlm: Callable[[str], Path]) -> Path:
    return tiny_vlm(request.param)


@pytest.fixture(scope="module")
def family_server(family_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(f"hf:{family_dir}", tmp_path_factory.mktemp("serve"), "--threads", "1",
                          "--max-batch-size", "1", "--frontends", "1")
    try:
        yield server
    finally:
        assert server.stop() == 0
        assert not leftovers(server.instance_id, slots=64)


@pytest.fixture(scope="module")
def family_backend(family_dir: Path) -> Iterator[tuple[HFPreprocessor, HFBackend]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield HFPreprocessor(family_dir), HFBackend(str(family_dir), torch.device("cpu"))
    torch.set_num_threads(threads)


def test_streamed_greedy_answer_equals_transformers_generate(
        family_server: Server, family_backend: tuple[HFPreprocessor, HFBackend]) -> None:
    pre, backend = family_backend
    item = work_item(pre, "Compare them.", [SQUARE, WIDE], SamplingParams(max_tokens=TOKENS, temperature=0.0))
    ids = torch.from_numpy(np.frombuffer(item.inline, dtype=np.int32).astype(np.int64)).view(1, -1)
    images: dict[str, torch.Tensor] = {"pixel_values": torch.cat(item.tensors["pixel_values"])}
    if "tile_grid" in item.tensors:  # Idefics3, SmolVLM2: the inputs of transformers' own processor, tiles and all
        reference = _processor_reference(backend, [SQUARE, WIDE], "Compare them.")
        assert reference.pop("input_ids")[0].tolist() == ids[0].tolist()
        images = dict(reference)
    elif backend.model.config.model_type in ("gemma3", "llava_next", "paligemma", "internvl"):  # likewise
        reference = _processor_reference(backend, [SQUARE, WIDE], "Compare them.")
        assert reference.pop("input_ids")[0].tolist() == ids[0].tolist()
        images = dict(reference)
    elif "image_grid_thw" in item.tensors:  # the Qwen family's
        images["image_grid_thw"] = torch.cat(item.tensors["image_grid_thw"])
        images["mm_token_type_ids"] = (ids == backend._layout.image_token_id).to(torch.int32)
    out = backend.model.generate(input_ids=ids, **images, max_new_tokens=TOKENS, do_sample=False)
    expected = backend.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    client = openai.OpenAI(base_url=family_server.base_url + "/v1", api_key="unused")
    content = [{"type": "image_url", "image_url": {"url": data_url(p.read_bytes())}} for p in (SQUARE, WIDE)]
    chunks = list(client.chat.completions.create(  # type: ignore[call-overload]
        model=family_server.model.removeprefix("hf:").rsplit("/", 1)[-1],
        messages=[{"role": "user", "content": [*content, {"type": "text", "text": "Compare them."}]}],
        max_tokens=TOKENS, temperature=0, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 2 and "".join(pieces) == expected
    assert chunks[-1].usage.prompt_tokens == ids.shape[1]
    assert chunks[-1].usage.completion_tokens == out.shape[1] - ids.shape[1]


def _processor_reference(backend: HFBackend, paths: list[Path], text: str) -> dict[str, torch.Tensor]:
    """transformers' own processor (Idefics3, SmolVLM2, LLaVA-NeXT, Gemma 3, PaliGemma, InternVL) on the images and the rendered
    template: the ids and every image input the model takes."""
    from unittest import mock

    from PIL import Image
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        Gemma3Processor,
        Idefics3Processor,
        InternVLProcessor,
        LlavaNextProcessor,
        PaliGemmaProcessor,
    )
    from transformers.processing_utils import ProcessorMixin

    directory = backend.model.name_or_path
    image_processor = AutoImageProcessor.from_pretrained(directory, backend="pil")
    images: list[Any] = [Image.open(p).convert("RGB") for p in paths]
    check = ProcessorMixin.check_argument_for_proper_class
    no_video = mock.patch.object(  # InternVL's and SmolVLM's want a video processor (torchvision): None for images
        ProcessorMixin, "check_argument_for_proper_class",
        lambda self, name, arg: None if name == "video_processor" else check(self, name, arg))
    if backend.model.config.model_type == "idefics3":
        processor: Any = Idefics3Processor(image_processor, backend.tokenizer,
                                           image_seq_len=backend._layout.tokens_per_image)
        images, names = [images], ("pixel_values", "pixel_attention_mask")
    elif backend.model.config.model_type == "smolvlm":
        # SmolVLMProcessor needs num2words (for video frame captions); its image prompt is the same
        # function as Idefics3Processor's, so that one runs, over SmolVLM's own image processor.
        with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *args: None):
            processor = Idefics3Processor(image_processor, backend.tokenizer,
                                          image_seq_len=backend._layout.tokens_per_image)
        images, names = [images], ("pixel_values", "pixel_attention_mask")
    elif backend.model.config.model_type == "gemma3":
        tokenizer = backend.tokenizer  # Gemma3Processor reads these tokenizer attributes (real Gemma tokenizers have them)
        tokenizer.boi_token, tokenizer.eoi_token, tokenizer.image_token = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
        tokenizer.boi_token_id, tokenizer.image_token_id = (tokenizer.convert_tokens_to_ids(t) for t in (
            "<start_of_image>", "<image_soft_token>"))
        processor = Gemma3Processor(image_processor, tokenizer, image_seq_length=backend._layout.tokens_per_image)
        images, names = [images], ("pixel_values", "token_type_ids")
    elif backend.model.config.model_type == "internvl":  # it reads these tokenizer attributes, and wants a video
        tokenizer = AutoTokenizer.from_pretrained(directory)  # processor (torchvision): None is fine for images
        for name, token in (("start_image_token", "<img>"), ("end_image_token", "</img>"),
                            ("context_image_token", "<IMG_CONTEXT>"), ("video_token", "<|video_pad|>")):
            setattr(tokenizer, name, token)
            setattr(tokenizer, name + "_id", tokenizer.convert_tokens_to_ids(token))
        with no_video:
            processor = InternVLProcessor(image_processor, tokenizer, None,
                                          image_seq_length=backend._layout.tokens_per_image)
        names = ("pixel_values",)
    elif backend.model.config.model_type == "paligemma":  # it adds tokens: on a tokenizer of its own
        processor = PaliGemmaProcessor(image_processor, AutoTokenizer.from_pretrained(directory))
        out = processor(text=[text], images=[images], return_tensors="pt")
        return {k: out[k] for k in ("input_ids", "pixel_values", "token_type_ids")}
    else:
        processor = LlavaNextProcessor(image_processor, backend.tokenizer, patch_size=14,
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1)
        names = ("pixel_values", "image_sizes")
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in paths), {"type": "text", "text": text}]}]
    prompt = backend.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[prompt], images=images, return_tensors="pt")
    return {k: out[k] for k in ("input_ids", *names)}


def test_a_repeated_image_is_a_cache_hit(family_server: Server) -> None:
    model = family_server.model.removeprefix("hf:").rsplit("/", 1)[-1]
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url((SQUARE.parent / "coffee_640.jpg").read_bytes())}},
        {"type": "text", "text": "Hi"}]}]}
    before = family_server.metric("shmgate_cache_hits_total")
    first = httpx.post(family_server.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    second = httpx.post(family_server.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert family_server.metric("shmgate_cache_hits_total") >= before + 1
    assert first["usage"] == second["usage"]


def test_a_padded_batch_answers_as_its_items_alone(family_backend: tuple[HFPreprocessor, HFBackend]) -> None:
    pre, backend = family_backend
    cases = [("Describe.", [WIDE], SamplingParams(max_tokens=TOKENS, temperature=0.0)),
             ("Hi", [], SamplingParams(max_tokens=4, temperature=0.0)),
             ("Two?", [SQUARE, WIDE], SamplingParams(max_tokens=TOKENS, temperature=0.8, seed=5))]
    items = [work_item(pre, text, images, params, request_id=i) for i, (text, images, params) in enumerate(cases)]
    alone = [answer(list(backend.run([item])))[0] for item in items]
    events = list(backend.run(items))
    assert [answer(events, i)[0] for i in range(len(items))] == alone


@pytest.mark.parametrize("model_type", ["mllama", "gemma3n", "llava_onevision"])
def test_an_unsupported_architecture_is_a_startup_error_naming_it(
        model_type: str, tiny_qwen2_vl_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    directory = tmp_path / model_type
    shutil.copytree(tiny_qwen2_vl_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    for load in (lambda: HFPreprocessor(directory), lambda: HFBackend(str(directory), torch.device("cpu"))):
        with pytest.raises(ValueError, match=f"model_type '{model_type}' is not supported.*qwen2_vl, qwen2_5_vl, qwen3_vl, llava, idefics3, llava_next, gemma3, paligemma, internvl, smolvlm"):
            load()


def test_gemma3_newlines_beside_images_tokenize_as_its_processor(tiny_vlm: Callable[[str], Path]) -> None:
    """Gemma 3 wraps each image in "\\n\\n" as text, which merges with the user's newlines beside it; a
    "<start_of_image>" the user types stays text."""
    from PIL import Image
    from transformers import AutoImageProcessor, Gemma3Processor

    directory = tiny_vlm("gemma3")
    pre = HFPreprocessor(directory)
    tokenizer = pre.tokenizer
    tokenizer.boi_token, tokenizer.eoi_token, tokenizer.image_token = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
    tokenizer.boi_token_id, tokenizer.image_token_id = (tokenizer.convert_tokens_to_ids(t) for t in (
        "<start_of_image>", "<image_soft_token>"))
    processor = Gemma3Processor(AutoImageProcessor.from_pretrained(directory, backend="pil"), tokenizer,
                                image_seq_length=4)
    spec = {"pixel_values": ("float32", (1, 3, 56, 56))}

    def conversation(tail: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [
            {"type": "text", "text": "Look:\n"}, {"type": "image"}, {"type": "text", "text": "\n\nand\n"},
            {"type": "image"}, {"type": "image"}, {"type": "text", "text": tail}]}]

    prompt = tokenizer.apply_chat_template(conversation("\nthis"), add_generation_prompt=True, tokenize=False)
    image = Image.open(SQUARE).convert("RGB")
    theirs = processor(text=[prompt], images=[[image] * 3])["input_ids"][0]
    assert pre.prompt_token_ids(conversation("\nthis"), [spec] * 3) == list(theirs)
    forged = pre.prompt_token_ids(conversation("\nthis <start_of_image>"), [spec] * 3)
    assert forged.count(tokenizer.convert_tokens_to_ids("<start_of_image>")) == 3


def test_llava_next_images_of_different_tile_counts_answer_as_transformers(
        tiny_vlm: Callable[[str], Path], tmp_path: Path) -> None:
    """A small wide image is fitted to a 56 x 112 grid (2 tiles + overview), a photo to 112 x 112 (4 + 1):
    the worker pads the first with empty tiles, as LlavaNextProcessor pads a prompt's images."""
    from PIL import Image

    directory = tiny_vlm("llava_next")
    small = tmp_path / "small.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (24, 60, 3), dtype=np.uint8)).save(small)
    pre, backend = HFPreprocessor(directory), HFBackend(str(directory), torch.device("cpu"))
    item = work_item(pre, "Compare them.", [small, SQUARE], SamplingParams(max_tokens=TOKENS, temperature=0.0))
    assert [p.shape[0] for p in item.tensors["pixel_values"]] == [3, 5]
    ids = torch.from_numpy(np.frombuffer(item.inline, dtype=np.int32).astype(np.int64)).view(1, -1)
    reference = _processor_reference(backend, [small, SQUARE], "Compare them.")
    assert reference.pop("input_ids")[0].tolist() == ids[0].tolist()
    out = backend.model.generate(input_ids=ids, **reference, max_new_tokens=TOKENS, do_sample=False)
    expected = backend.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert answer(list(backend.run([item])))[0] == expected
