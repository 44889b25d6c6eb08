"""Request fields are honoured or refused, never silently ignored.

Intake: every field no model here implements (tools, structured output, logprobs) is a 400 naming
it; unknown fields are logged once per name. Per model (gateway/fields.py): token-level fields are
refused for classifiers. For ``hf:`` models the honoured fields (``logit_bias``, presence and
frequency penalties, ``stop_token_ids``) are checked against transformers' own ``generate`` on the
tiny Qwen2-VL (tests/hf_fixture.py), token for token, alone and in a batch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from shmgate.gateway.fields import check_fields_for_model, with_image_options  # noqa: E402
from shmgate.gateway.intake import IntakeLimits, parse_chat_request  # noqa: E402
from shmgate.gateway.preprocess.hf import HFPreprocessor  # noqa: E402
from shmgate.gateway.preprocess.vision import ChecksumPreprocessor  # noqa: E402
from shmgate.shared.errors import InvalidRequest  # noqa: E402
from shmgate.shared.wire import SamplingParams  # noqa: E402
from shmgate.worker.backends.base import WorkItem  # noqa: E402
from shmgate.worker.backends.hf import HFBackend  # noqa: E402
from tests.test_hf import SQUARE, WIDE, answer, work_item  # noqa: E402

LIMITS = IntakeLimits()
TOKENS = 12


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tool_choice": "auto"}, "tool_choice"),  # no tools to choose from
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),  # no name
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"n": 17}, "n"),
    ],
)
def test_a_field_no_model_honours_is_a_400_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request(body(**fields), LIMITS)
    assert caught.value.param == param and caught.value.status_hint == 400


def test_the_harmless_forms_are_accepted() -> None:
    chat = parse_chat_request(
        body(
            tool_choice="none",
            response_format={"type": "text"},
            logprobs=False,
            stream=True,
            stream_options={"include_usage": True},
            logit_bias={"7": -100, "3": 2.5},
            presence_penalty=0.5,
            stop_token_ids=[9, 4, 9],
        ),
        LIMITS,
    )
    assert chat.params.logit_bias == ((3, 2.5), (7, -100.0))
    assert chat.params.stop_token_ids == (4, 9) and chat.params.presence_penalty == 0.5


def test_an_unknown_field_is_logged_once_per_name(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="shmgate.gateway.intake"):
        for _ in range(3):
            parse_chat_request(body(made_up_field_x=1, another_made_up_y={"a": [1]}), LIMITS)
    warned = [r.getMessage() for r in caplog.records]
    assert sum("made_up_field_x" in m for m in warned) == 1
    assert sum("another_made_up_y" in m for m in warned) == 1


def test_a_classifier_refuses_token_level_fields() -> None:
    pre = ChecksumPreprocessor()
    check_fields_for_model(SamplingParams(temperature=0.3, seed=1, stop=("x",)), pre)  # accepted, no effect
    for name, params in [
        ("presence_penalty", SamplingParams(presence_penalty=1.0)),
        ("frequency_penalty", SamplingParams(frequency_penalty=1.0)),
        ("logit_bias", SamplingParams(logit_bias=((1, 1.0),))),
        ("stop_token_ids", SamplingParams(stop_token_ids=(1,))),
        ("logprobs", SamplingParams(logprobs=0)),
    ]:
        with pytest.raises(InvalidRequest) as caught:
            check_fields_for_model(params, pre)
        assert caught.value.param == name
    with pytest.raises(InvalidRequest) as caught:
        check_fields_for_model(SamplingParams(), pre, n=2)
    assert caught.value.param == "n"


def test_token_ids_outside_the_vocabulary_are_refused(pre: HFPreprocessor) -> None:
    check_fields_for_model(SamplingParams(logit_bias=((pre.vocab_size - 1, 1.0),)), pre)
    for name, params in [
        ("logit_bias", SamplingParams(logit_bias=((pre.vocab_size, 1.0),))),
        ("stop_token_ids", SamplingParams(stop_token_ids=(pre.vocab_size,))),
    ]:
        with pytest.raises(InvalidRequest) as caught:
            check_fields_for_model(params, pre)
        assert caught.value.param == name


# -- honoured by hf: models, against transformers ------------------------------------------------


@pytest.fixture(scope="module")
def pre(tiny_qwen2_vl_dir: Path) -> HFPreprocessor:
    return HFPreprocessor(tiny_qwen2_vl_dir)


@pytest.fixture(scope="module")
def backend(tiny_qwen2_vl_dir: Path) -> Iterator[HFBackend]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield HFBackend(str(tiny_qwen2_vl_dir), torch.device("cpu"))
    torch.set_num_threads(threads)


class OpenAIPenalties:
    """OpenAI's presence/frequency penalties as a transformers LogitsProcessor: the reference."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def reference(backend: HFBackend, item: WorkItem, **generate: Any) -> tuple[list[int], str]:
    """transformers' greedy ``generate`` on the item's exact inputs: (new token ids, their text)."""
    ids = torch.from_numpy(np.frombuffer(item.inline, dtype=np.int32).astype(np.int64)).view(1, -1)
    out = backend.model.generate(
        input_ids=ids,
        pixel_values=torch.cat(item.tensors["pixel_values"]),
        image_grid_thw=torch.cat(item.tensors["image_grid_thw"]),
        mm_token_type_ids=(ids == backend._layout.image_token_id).to(torch.int32),
        max_new_tokens=TOKENS,
        do_sample=False,
        **generate,
    )
    new = out[0, ids.shape[1] :].tolist()
    return new, backend.tokenizer.decode(new, skip_special_tokens=True)


def greedy(**fields: Any) -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0.0, **fields)


def test_logit_bias_equals_transformers_sequence_bias(pre: HFPreprocessor, backend: HFBackend) -> None:
    plain, _ = reference(backend, work_item(pre, "Describe.", [SQUARE], greedy()))
    bias = ((plain[0], -100.0), (plain[1], 4.0), (17, 3.0))  # ban the first greedy token, favour others
    item = work_item(pre, "Describe.", [SQUARE], greedy(logit_bias=bias))
    ref_ids, ref_text = reference(backend, item, sequence_bias={(t,): b for t, b in bias})
    assert ref_ids[0] != plain[0]
    text, finish = answer(list(backend.run([item])))
    assert text == ref_text and finish.completion_tokens == len(ref_ids)


def test_penalties_equal_the_openai_formula_in_transformers(pre: HFPreprocessor, backend: HFBackend) -> None:
    item = work_item(pre, "Say it again.", [WIDE], greedy(presence_penalty=1.5, frequency_penalty=0.7))
    prompt_len = len(item.inline) // 4
    _, plain_text = reference(backend, item)
    ref_ids, ref_text = reference(backend, item, logits_processor=[OpenAIPenalties(prompt_len, 1.5, 0.7)])
    assert ref_text != plain_text, "the penalties must change this answer, or the test proves nothing"
    text, finish = answer(list(backend.run([item])))
    assert text == ref_text and finish.completion_tokens == len(ref_ids)


def test_stop_token_ids_end_like_eos(pre: HFPreprocessor, backend: HFBackend) -> None:
    plain, _ = reference(backend, work_item(pre, "Go on.", [SQUARE], greedy()))
    stop = plain[4]
    item = work_item(pre, "Go on.", [SQUARE], greedy(stop_token_ids=(stop,)))
    ref_ids, _ = reference(backend, item, eos_token_id=[stop])
    text, finish = answer(list(backend.run([item])))
    assert ref_ids[-1] == stop and len(ref_ids) <= 5
    # Like EOS, the stop token is counted but its text is not part of the answer (vLLM does the same).
    assert text == backend.tokenizer.decode(ref_ids[:-1], skip_special_tokens=True)
    assert finish.finish_reason == "stop" and finish.completion_tokens == len(ref_ids)


def test_fields_in_a_batch_answer_as_alone(pre: HFPreprocessor, backend: HFBackend) -> None:
    cases = [
        ("Describe.", [SQUARE], greedy(logit_bias=((5, 6.0),))),
        ("Say it again.", [WIDE], greedy(presence_penalty=1.0, frequency_penalty=1.0)),
        ("Hi", [], greedy()),
        ("Go on.", [SQUARE], SamplingParams(max_tokens=TOKENS, temperature=0.9, seed=3, frequency_penalty=2.0)),
    ]
    items = [work_item(pre, text, images, params, request_id=i) for i, (text, images, params) in enumerate(cases)]
    alone = [answer(list(backend.run([item])))[0] for item in items]
    events = list(backend.run(items))
    assert [answer(events, i)[0] for i in range(len(items))] == alone


def test_logprobs_equal_transformers_scores(pre: HFPreprocessor, backend: HFBackend) -> None:
    """Each sampled token's log-probability and the top 5, against ``generate(output_logits=True)``."""
    item = work_item(pre, "Describe.", [WIDE], greedy(logprobs=5, logit_bias=((11, 2.0),)))
    ids = torch.from_numpy(np.frombuffer(item.inline, dtype=np.int32).astype(np.int64)).view(1, -1)
    out = backend.model.generate(
        input_ids=ids,
        pixel_values=torch.cat(item.tensors["pixel_values"]),
        image_grid_thw=torch.cat(item.tensors["image_grid_thw"]),
        mm_token_type_ids=(ids == backend._layout.image_token_id).to(torch.int32),
        max_new_tokens=TOKENS,
        do_sample=False,
        sequence_bias={(11,): 2.0},
        output_scores=True,
        return_dict_in_generate=True,
    )
    events = list(backend.run([item]))
    entries = [e.logprob for e in events if e.logprob is not None]
    new = out.sequences[0, ids.shape[1] :].tolist()
    assert len(entries) == len(new) == answer(events)[1].completion_tokens
    for entry, token, scores in zip(entries, new, out.scores):
        reference = torch.log_softmax(scores[0].float(), dim=-1)  # after the bias, as ours
        assert entry is not None
        assert entry.token == backend.tokenizer.decode([token])[:32]
        assert abs(entry.logprob - float(reference[token])) < 1e-4
        top = torch.topk(reference, 5)
        assert [t for t, _ in entry.top] == [backend.tokenizer.decode([i])[:32] for i in top.indices.tolist()]
        np.testing.assert_allclose([v for _, v in entry.top], top.values.tolist(), atol=1e-4)


# -- processor options ------------------------------------------------------------------------

BIG = 28 * 28 * 400  # a max_pixels above LOW_DETAIL_TOKENS' 256 tokens, so "low" has something to lower


def image_tokens(pre: HFPreprocessor, path: Path, options: dict[str, Any] | None = None) -> tuple[int, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}

    def allocate(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        arrays[name] = np.empty(shape, dtype=dtype)
        return arrays[name]

    pre.preprocess_image(path.read_bytes(), allocate, max_pixels=50_000_000, options=options)
    return int(np.prod(arrays["image_grid_thw"][0])) // 4, arrays["pixel_values"]


def test_processor_options_equal_the_processor_configured_alike(tiny_qwen2_vl_dir: Path) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor

    big = HFPreprocessor(tiny_qwen2_vl_dir, processor_kwargs={"max_pixels": BIG})  # --mm-processor-kwargs
    image = np.asarray(Image.open(WIDE).convert("RGB"))
    for options, reference_kwargs in [
        ({}, {"max_pixels": BIG}),
        ({"size": {"longest_edge": 28 * 28 * 8, "shortest_edge": 3136}}, {"max_pixels": 28 * 28 * 8}),
        (big.image_options(None, "low"), {"max_pixels": 256 * 28 * 28}),
    ]:
        tokens, pixels = image_tokens(big, WIDE, options)
        reference = AutoImageProcessor.from_pretrained(tiny_qwen2_vl_dir, backend="pil", **reference_kwargs)
        expected = reference(images=[image], return_tensors="np", input_data_format="channels_last")
        np.testing.assert_array_equal(pixels, expected["pixel_values"])
    assert image_tokens(big, WIDE)[0] > 256 >= image_tokens(big, WIDE, big.image_options(None, "low"))[0]
    assert big.image_options(None, "high") == big.image_options(None, "auto") == big.image_options(None, None) == {}
    assert big.cache_params() != HFPreprocessor(tiny_qwen2_vl_dir).cache_params()


def test_processor_options_the_processor_does_not_take_are_refused(
    pre: HFPreprocessor, tiny_qwen2_vl_dir: Path
) -> None:
    for bad in [{"no_such_option": 1}, {"patch_size": 16}, {"merge_size": 1}]:
        with pytest.raises(InvalidRequest) as caught:
            pre.image_options(bad, None)
        assert caught.value.param == "mm_processor_kwargs"
    with pytest.raises(ValueError, match="no_such_option"):
        HFPreprocessor(tiny_qwen2_vl_dir, processor_kwargs={"no_such_option": 1})
    chat = parse_chat_request(body(mm_processor_kwargs={"max_pixels": 1000}), LIMITS)
    with pytest.raises(InvalidRequest) as caught:
        with_image_options(chat, ChecksumPreprocessor())
    assert caught.value.param == "mm_processor_kwargs"
    # A text-only request's mm_processor_kwargs are checked against the processor all the same.
    text_only = parse_chat_request(body(mm_processor_kwargs={"no_such_option": 1}), LIMITS)
    with pytest.raises(InvalidRequest) as caught:
        with_image_options(text_only, pre)
    assert caught.value.param == "mm_processor_kwargs"
    bad_detail = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "medium"}}
                ],
            }
        ],
    }
    with pytest.raises(InvalidRequest) as caught:
        parse_chat_request(json.dumps(bad_detail).encode(), LIMITS)
    assert caught.value.param == "messages[0].content[0].image_url.detail"


def test_a_parsed_request_is_a_value_the_later_steps_copy() -> None:
    """Image options (and fetched URLs, gateway/fetch.py) give a new GenerationRequest; the parsed one is unchanged."""
    chat = parse_chat_request(body(mm_processor_kwargs=None), LIMITS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chat.n = 2  # type: ignore[misc]
    optioned = with_image_options(chat, ChecksumPreprocessor())
    assert optioned is not chat and chat.image_options == [] and len(optioned.image_options) == len(chat.images)


def test_tokenize_decodes_its_images_within_the_decode_memory_budget(pre: HFPreprocessor) -> None:
    """/tokenize decodes each image to count its tokens: under the same budget as the chat path, so an
    image the frontend may not decode at once is a 413 naming it there too, and one that fits is counted."""
    import asyncio
    import base64

    from shmgate.gateway.decode_budget import DecodeBudget
    from shmgate.gateway.fetch import FetchPolicy
    from shmgate.gateway.tokenize import tokenize
    from shmgate.shared.errors import ImageTooLarge

    photo = (Path(__file__).parent / "data" / "images" / "chelsea_1024.jpg").read_bytes()
    url = "data:image/jpeg;base64," + base64.b64encode(photo).decode()
    content = [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]
    body = json.dumps({"model": pre.model, "messages": [{"role": "user", "content": content}]}).encode()

    def count(budget: DecodeBudget) -> dict[str, Any]:
        return asyncio.run(tokenize(lambda _model: pre, body, LIMITS, FetchPolicy(), 64 << 20, budget))

    small = DecodeBudget(256 << 10, wait_s=0.1)  # 256 KiB: less than the photo's decode needs
    with pytest.raises(ImageTooLarge) as refused:
        count(small)
    assert refused.value.param == "messages[0].content[1].image_url" and small.reserved_bytes == 0
    roomy = DecodeBudget(512 << 20, wait_s=0.1)
    assert count(roomy)["count"] > 0 and roomy.reserved_bytes == 0
