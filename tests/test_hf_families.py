"""The ten chat families, each on a tiny checkpoint whose processor settings are unlike the defaults.

tests/hf_fixture.py builds each family with ``unusual=True`` (its UNUSUAL settings: other image sizes,
image_seq_length, tile sizes, pixel bounds, CLS handling, named tokens, a tokenizer that adds BOS
itself). For each, in this one process (the checkpoints are tiny; importing transformers once is most
of the cost, so no server per family): the prompt token ids our frontend builds equal those of
transformers' own processor class built from the directory's files as ``from_pretrained`` builds it;
our backend's greedy answer on our own tensors equals ``generate`` on the processor's inputs, token for
token, with the prompt's token count as usage; an image fits the content cache; a padded batch answers
as its items alone. One family, InternVL, is also served through a real ``shmgate serve`` (its model
config's stale ``image_seq_length`` once made the first photo a 500), a photo twice: the answer equals
transformers', the second is a cache hit. The served path itself is covered on Qwen2-VL by
tests/test_hf_serve.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from shmgate.gateway.preprocess.hf import HFPreprocessor  # noqa: E402
from shmgate.shared.cache_index import MAX_NDIM, MAX_TENSORS  # noqa: E402
from shmgate.shared.wire import SamplingParams  # noqa: E402
from shmgate.worker.backends.hf import HFBackend  # noqa: E402
from tests.hf_fixture import FAMILIES, build_tiny_vlm  # noqa: E402
from tests.serving import Server, data_url, start_server, stop_and_check  # noqa: E402
from tests.test_hf import SQUARE, WIDE, answer, messages, preprocess, work_item  # noqa: E402

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
    parts: list[Any] = [
        AutoImageProcessor.from_pretrained(directory, backend="pil"),
        AutoTokenizer.from_pretrained(directory),
    ]
    if "video_processor" in cls.get_attributes():
        parts.append(None)
    check = ProcessorMixin.check_argument_for_proper_class
    no_video = mock.patch.object(
        ProcessorMixin,
        "check_argument_for_proper_class",
        lambda self, arg_name, arg: None if arg is None else check(self, arg_name, arg),
    )
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
        out = processor.apply_chat_template(
            conversation,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            chat_template=processor.chat_template or processor.tokenizer.chat_template,
        )
    return {k: v for k, v in out.items() if k not in ("attention_mask", "labels")}


@pytest.fixture(scope="module", params=FAMILIES)
def family_backend(
    request: pytest.FixtureRequest, unusual_vlm: Callable[[str], Path], one_thread: None
) -> tuple[HFPreprocessor, HFBackend]:
    directory = unusual_vlm(request.param)
    return HFPreprocessor(directory), HFBackend(str(directory), torch.device("cpu"))


def test_prompt_and_greedy_answer_equal_transformers(family_backend: tuple[HFPreprocessor, HFBackend]) -> None:
    pre, backend = family_backend
    directory = Path(backend.model.name_or_path)
    item = work_item(pre, TEXT, [SQUARE, WIDE], SamplingParams(max_tokens=TOKENS, temperature=0.0))
    reference = transformers_inputs(directory, [SQUARE, WIDE], TEXT)
    ids = reference.pop("input_ids")
    assert np.frombuffer(item.inline, dtype=np.int32).tolist() == ids[0].tolist()
    ours = backend._layout.check(item, torch.device("cpu"))  # the model inputs our worker builds
    for name in ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes"):
        theirs = reference.get(name)
        assert (getattr(ours, name) is None) == (theirs is None), name
        assert theirs is None or torch.equal(getattr(ours, name), theirs.to(getattr(ours, name).dtype)), name
    if "image_grid_thw" in reference:  # the Qwen family's multimodal RoPE reads the image token positions
        reference["mm_token_type_ids"] = (ids == backend._layout.image_token_id).to(torch.int32)
    out = backend.model.generate(input_ids=ids, **reference, max_new_tokens=TOKENS, do_sample=False)
    text, finish = answer(list(backend.run([item])))
    assert text == backend.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert (finish.prompt_tokens, finish.completion_tokens) == (ids.shape[1], out.shape[1] - ids.shape[1])


# docs/MODELS.md's list: on CPU these families' KV is paged and their decoder layers run in the plain loop
PAGED_ON_CPU = {"qwen2_vl", "qwen2_5_vl", "llava", "idefics3", "llava_next", "internvl", "smolvlm"}


def test_on_cpu_the_kv_is_paged_for_the_families_the_plain_decoder_loop_serves(
    family_backend: tuple[HFPreprocessor, HFBackend],
) -> None:
    backend = family_backend[1]
    paged = backend._pool is not None
    assert paged == (backend.model.config.model_type in PAGED_ON_CPU)
    assert not paged or (backend._runner is not None and backend._runner.stack is not None)


def test_an_image_fits_the_content_cache(family_backend: tuple[HFPreprocessor, HFBackend]) -> None:
    """A cached image is at most MAX_TENSORS tensors of at most MAX_NDIM axes (shared/cache_index.py)."""
    arrays = preprocess(family_backend[0], WIDE)
    assert 0 < len(arrays) <= MAX_TENSORS and all(a.ndim <= MAX_NDIM for a in arrays.values())


def test_a_padded_batch_answers_as_its_items_alone(family_backend: tuple[HFPreprocessor, HFBackend]) -> None:
    pre, backend = family_backend
    cases = [
        ("Describe.", [WIDE], SamplingParams(max_tokens=TOKENS, temperature=0.0)),
        ("Hi", [], SamplingParams(max_tokens=4, temperature=0.0)),
        ("Two?", [SQUARE, WIDE], SamplingParams(max_tokens=TOKENS, temperature=0.8, seed=5)),
    ]
    items = [work_item(pre, text, images, params, request_id=i) for i, (text, images, params) in enumerate(cases)]
    alone = [answer(list(backend.run([item])))[0] for item in items]
    events = list(backend.run(items))
    assert [answer(events, i)[0] for i in range(len(items))] == alone


def test_paligemma_user_written_control_tokens_stay_text(unusual_vlm: Callable[[str], Path]) -> None:
    """PaliGemma's BOS goes after the last *real* image placeholder: an "<image>" or "<bos>" the user
    types is text, and the trailing "\n" still merges with the text before it."""
    pre = HFPreprocessor(unusual_vlm("paligemma"))
    spec = {"pixel_values": ("float32", (1, 3, 42, 42))}
    ids = pre.prompt_token_ids(messages("look <image> here <bos>.", 1), [spec])
    bos, image = pre.tokenizer.bos_token_id, pre.named_token_id("image_token", "<image>")
    assert ids[:10] == [image] * 9 + [bos] and ids.count(bos) == 1 and ids.count(image) == 9
    text = pre.tokenizer.decode(ids[10:])
    assert text == "look <image> here <bos>.\n"
    assert ids[10:] == pre.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


@pytest.fixture(scope="module")
def internvl_server(unusual_vlm: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        f"hf:{unusual_vlm('internvl')}",
        tmp_path_factory.mktemp("serve"),
        "--threads",
        "1",
        "--max-batch-size",
        "1",
        "--frontends",
        "1",
    )
    try:
        yield server
    finally:
        stop_and_check(server)


def test_served_internvl_answers_a_photo_as_transformers_and_caches_it(
    internvl_server: Server, unusual_vlm: Callable[[str], Path], one_thread: None
) -> None:
    directory = unusual_vlm("internvl")
    reference = transformers_inputs(directory, [WIDE], TEXT)
    ids = reference.pop("input_ids")
    backend = HFBackend(str(directory), torch.device("cpu"))
    out = backend.model.generate(input_ids=ids, **reference, max_new_tokens=TOKENS, do_sample=False)
    body = {
        "model": directory.name,
        "max_tokens": TOKENS,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(WIDE.read_bytes())}},
                    {"type": "text", "text": TEXT},
                ],
            }
        ],
    }
    before = internvl_server.metric("shmgate_cache_hits_total")
    replies = [httpx.post(internvl_server.base_url + "/v1/chat/completions", json=body, timeout=60) for _ in range(2)]
    assert [r.status_code for r in replies] == [200, 200], replies[0].text
    first = replies[0].json()
    assert first["choices"][0]["message"]["content"] == backend.tokenizer.decode(
        out[0, ids.shape[1] :], skip_special_tokens=True
    )
    assert first["usage"]["prompt_tokens"] == ids.shape[1]
    assert replies[1].json()["usage"] == first["usage"]
    assert internvl_server.metric("shmgate_cache_hits_total") >= before + 1


@pytest.mark.parametrize("model_type", ["mllama", "gemma3n", "llava_onevision"])
def test_an_unsupported_architecture_is_a_startup_error_naming_it(
    model_type: str, tiny_qwen2_vl_dir: Path, tmp_path: Path
) -> None:
    import json
    import shutil

    directory = tmp_path / model_type
    shutil.copytree(tiny_qwen2_vl_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    for load in (lambda: HFPreprocessor(directory), lambda: HFBackend(str(directory), torch.device("cpu"))):
        with pytest.raises(
            ValueError,
            match=f"model_type '{model_type}' is not supported.*qwen2_vl, qwen2_5_vl, qwen3_vl, llava, idefics3, llava_next, gemma3, paligemma, internvl, smolvlm",
        ):
            load()


def test_gemma3_newlines_beside_images_tokenize_as_its_processor(tiny_vlm: Callable[[str], Path]) -> None:
    """Gemma 3 wraps each image in "\\n\\n" as text, which merges with the user's newlines beside it; a
    "<start_of_image>" the user types stays text."""
    from PIL import Image
    from transformers import AutoImageProcessor, Gemma3Processor

    directory = tiny_vlm("gemma3")
    pre = HFPreprocessor(directory)
    tokenizer = pre.tokenizer
    tokenizer.boi_token, tokenizer.eoi_token, tokenizer.image_token = (
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
    )
    tokenizer.boi_token_id, tokenizer.image_token_id = (
        tokenizer.convert_tokens_to_ids(t) for t in ("<start_of_image>", "<image_soft_token>")
    )
    processor = Gemma3Processor(
        AutoImageProcessor.from_pretrained(directory, backend="pil"), tokenizer, image_seq_length=4
    )
    spec = {"pixel_values": ("float32", (1, 3, 56, 56))}

    def conversation(tail: str) -> list[dict[str, Any]]:
        return [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:\n"},
                    {"type": "image"},
                    {"type": "text", "text": "\n\nand\n"},
                    {"type": "image"},
                    {"type": "image"},
                    {"type": "text", "text": tail},
                ],
            }
        ]

    prompt = tokenizer.apply_chat_template(conversation("\nthis"), add_generation_prompt=True, tokenize=False)
    image = Image.open(SQUARE).convert("RGB")
    theirs = processor(text=[prompt], images=[[image] * 3])["input_ids"][0]
    assert pre.prompt_token_ids(conversation("\nthis"), [spec] * 3) == list(theirs)
    forged = pre.prompt_token_ids(conversation("\nthis <start_of_image>"), [spec] * 3)
    assert forged.count(tokenizer.convert_tokens_to_ids("<start_of_image>")) == 3


def test_llava_next_images_of_different_tile_counts_answer_as_transformers(
    tiny_vlm: Callable[[str], Path], tmp_path: Path
) -> None:
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
    reference = transformers_inputs(directory, [small, SQUARE], "Compare them.")
    assert reference.pop("input_ids")[0].tolist() == ids[0].tolist()
    out = backend.model.generate(input_ids=ids, **reference, max_new_tokens=TOKENS, do_sample=False)
    expected = backend.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert answer(list(backend.run([item])))[0] == expected
