"""Every family, on a checkpoint whose processor settings are unlike the defaults, prompts and answers
as transformers does on the same directory.

tests/hf_fixture.py builds each family with ``unusual=True`` (its UNUSUAL settings: other image sizes,
image_seq_length, tile sizes, pixel bounds, CLS handling, named tokens, a tokenizer that adds BOS
itself). For each, in this one process (the checkpoints are tiny; importing transformers once is most
of the cost): the prompt token ids our frontend builds equal those of transformers' own processor
class, constructed from the directory's files exactly as ``from_pretrained`` would construct it, and
our backend's greedy answer on our own tensors equals ``generate`` on the processor's inputs, token for
token, with the prompt's token count as usage. One family, InternVL, is also served through a real
``shmgate serve``: its stale model-config ``image_seq_length`` once made the first photo a 500.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from gateway.preprocess.hf import HFPreprocessor  # noqa: E402
from shared.cache_index import MAX_NDIM, MAX_TENSORS  # noqa: E402
from shared.wire import SamplingParams  # noqa: E402
from tests.hf_fixture import FAMILIES, build_tiny_vlm  # noqa: E402
from tests.serving import Server, data_url, start_server, stop_and_check  # noqa: E402
from tests.test_hf import SQUARE, WIDE, answer, messages, preprocess, work_item  # noqa: E402
from worker.backends.hf import HFBackend  # noqa: E402

TOKENS = 8
TEXT = "Compare them."


@pytest.fixture(scope="module")
def unusual_vlm(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``unusual_vlm(family)``: that family's checkpoint with UNUSUAL settings, built on first use."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            name = "unusual-" + family.replace("_", "-")
            built[family] = build_tiny_vlm(tmp_path_factory.mktemp("models") / name, family, unusual=True)
        return built[family]

    return get


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model gains nothing from more, and a busy 2-core box loses a lot
    yield
    torch.set_num_threads(threads)


def transformers_processor(directory: Path) -> Any:
    """transformers' own processor class for ``directory``, built as ``from_pretrained`` builds it (the
    processor_config.json settings as arguments, the image processor and the tokenizer from the
    directory), except that no video processor is loaded: it needs torchvision, and images never use it."""
    from unittest import mock

    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.processing_utils import ProcessorMixin

    settings = json.loads((directory / "processor_config.json").read_text())
    name = settings.pop("processor_class")
    if (directory / "chat_template.jinja").is_file():  # a processor's own template wins over the tokenizer's
        settings["chat_template"] = (directory / "chat_template.jinja").read_text()
    if name == "SmolVLMProcessor":  # it needs num2words for video captions; its image prompt is Idefics3's
        name = "Idefics3Processor"
    cls = getattr(transformers, name)
    parts: list[Any] = [AutoImageProcessor.from_pretrained(directory, backend="pil"),
                        AutoTokenizer.from_pretrained(directory)]
    if "video_processor" in cls.get_attributes():
        parts.append(None)
    check = ProcessorMixin.check_argument_for_proper_class
    no_video = mock.patch.object(ProcessorMixin, "check_argument_for_proper_class",
                                 lambda self, arg_name, arg: None if arg is None else check(self, arg_name, arg))
    with no_video:
        return cls(*parts, **settings)


def transformers_inputs(directory: Path, paths: list[Path], text: str) -> dict[str, torch.Tensor]:
    """The processor's inputs for a user turn of ``paths`` then ``text``: its ``apply_chat_template``
    with the checkpoint's chat template, images and all (a checkpoint without a template, as most
    PaliGemma ones: the processor called on the placeholders and the text, as its model card does)."""
    from PIL import Image

    processor = transformers_processor(directory)
    images = [Image.open(p).convert("RGB") for p in paths]
    if processor.chat_template is None and processor.tokenizer.chat_template is None:
        out = processor(text=[processor.image_token * len(paths) + text], images=[images], return_tensors="pt")
    else:
        conversation = messages(text, len(paths))
        for part, image in zip(conversation[0]["content"], images):
            part["image"] = image
        out = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                            return_dict=True, return_tensors="pt",
                                            chat_template=processor.chat_template or processor.tokenizer.chat_template)
    return {k: v for k, v in out.items() if k not in ("attention_mask", "labels")}


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_and_greedy_answer_equal_transformers_on_unusual_settings(
        family: str, unusual_vlm: Callable[[str], Path], one_thread: None) -> None:
    directory = unusual_vlm(family)
    pre, backend = HFPreprocessor(directory), HFBackend(str(directory), torch.device("cpu"))
    item = work_item(pre, TEXT, [SQUARE, WIDE], SamplingParams(max_tokens=TOKENS, temperature=0.0))
    ours = np.frombuffer(item.inline, dtype=np.int32).tolist()
    reference = transformers_inputs(directory, [SQUARE, WIDE], TEXT)
    ids = reference.pop("input_ids")
    assert ours == ids[0].tolist()
    if "image_grid_thw" in reference:  # the Qwen family's multimodal RoPE reads the image token positions
        reference["mm_token_type_ids"] = (ids == backend._layout.image_token_id).to(torch.int32)
    out = backend.model.generate(input_ids=ids, **reference, max_new_tokens=TOKENS, do_sample=False)
    text, finish = answer(list(backend.run([item])))
    assert text == backend.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert (finish.prompt_tokens, finish.completion_tokens) == (ids.shape[1], out.shape[1] - ids.shape[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_fits_the_content_cache(family: str, unusual_vlm: Callable[[str], Path]) -> None:
    """A cached image is at most MAX_TENSORS tensors of at most MAX_NDIM axes (shared/cache_index.py)."""
    arrays = preprocess(HFPreprocessor(unusual_vlm(family)), WIDE)
    assert 0 < len(arrays) <= MAX_TENSORS and all(a.ndim <= MAX_NDIM for a in arrays.values())


@pytest.fixture(scope="module")
def internvl_server(unusual_vlm: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(f"hf:{unusual_vlm('internvl')}", tmp_path_factory.mktemp("serve"), "--threads", "1",
                          "--max-batch-size", "1", "--frontends", "1")
    try:
        yield server
    finally:
        stop_and_check(server)


def test_served_internvl_answers_a_photo_as_transformers_and_caches_it(
        internvl_server: Server, unusual_vlm: Callable[[str], Path], one_thread: None) -> None:
    directory = unusual_vlm("internvl")
    reference = transformers_inputs(directory, [WIDE], TEXT)
    ids = reference.pop("input_ids")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backend = HFBackend(str(directory), torch.device("cpu"))
    out = backend.model.generate(input_ids=ids, **reference, max_new_tokens=TOKENS, do_sample=False)
    body = {"model": directory.name, "max_tokens": TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(WIDE.read_bytes())}}, {"type": "text", "text": TEXT}]}]}
    before = internvl_server.metric("shmgate_cache_hits_total")
    replies = [httpx.post(internvl_server.base_url + "/v1/chat/completions", json=body, timeout=60) for _ in range(2)]
    assert [r.status_code for r in replies] == [200, 200], replies[0].text
    first = replies[0].json()
    assert first["choices"][0]["message"]["content"] == backend.tokenizer.decode(out[0, ids.shape[1]:],
                                                                                 skip_special_tokens=True)
    assert first["usage"]["prompt_tokens"] == ids.shape[1]
    assert replies[1].json()["usage"] == first["usage"]
    assert internvl_server.metric("shmgate_cache_hits_total") >= before + 1
