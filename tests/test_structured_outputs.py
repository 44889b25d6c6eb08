"""Structured outputs: ``response_format`` becomes a grammar (gateway/structured.py) and every token of a
constrained row keeps to it (worker/constraints.py through worker/backends/hf.py), on the tiny random
Qwen2-VL, whose weights alone never write JSON: only the grammar can make the answers parse."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

pytest.importorskip("transformers")
pytest.importorskip("llguidance")

import torch  # noqa: E402

from shmgate.gateway.preprocess.hf import HFPreprocessor  # noqa: E402
from shmgate.gateway.structured import grammar_for  # noqa: E402
from shmgate.shared.errors import InvalidRequest  # noqa: E402
from shmgate.shared.wire import INLINE_GRAMMAR_BYTES, MAX_GRAMMAR_BYTES, SamplingParams  # noqa: E402
from shmgate.worker.backends.hf import HFBackend  # noqa: E402
from tests.test_hf import SQUARE, WIDE, answer, work_item  # noqa: E402

# Bounded strings and numbers: a random model inside an unbounded string may never close it.
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog", "bird"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}


def json_schema_format(schema: dict[str, object] = PET) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def pre(tiny_qwen2_vl_dir: Path) -> HFPreprocessor:
    return HFPreprocessor(tiny_qwen2_vl_dir)


@pytest.fixture(scope="module")
def backend(tiny_qwen2_vl_dir: Path) -> Iterator[HFBackend]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield HFBackend(str(tiny_qwen2_vl_dir), torch.device("cpu"))
    torch.set_num_threads(threads)


def test_text_and_absent_formats_are_free_text() -> None:
    assert grammar_for(None) == grammar_for({"type": "text"}) == ""
    assert grammar_for({"type": "json_object"}) and grammar_for(json_schema_format())


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": PET}},  # no name
        {"type": "json_schema", "json_schema": {"name": "a b", "schema": PET}},
        {"type": "json_schema", "json_schema": {"name": "pet", "schema": {"type": "strin"}}},
        {"type": "json_schema", "json_schema": {"name": "pet", "schema": {"$ref": "#/nowhere"}}},
        {"type": "json_schema", "json_schema": {"name": "pet", "schema": [1]}},
        {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": "yes"}},
    ],
)
def test_a_format_the_compiler_cannot_use_is_a_400_naming_response_format(response_format: dict) -> None:
    with pytest.raises(InvalidRequest) as refused:
        grammar_for(response_format)
    assert refused.value.param == "response_format"


def test_a_schema_past_the_grammar_bound_is_refused_and_one_past_the_descriptor_is_not() -> None:
    wide = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(400)}}
    assert len(grammar_for(json_schema_format(wide)).encode()) > INLINE_GRAMMAR_BYTES  # rides in the arena
    huge = {"type": "string", "description": "x" * MAX_GRAMMAR_BYTES}
    with pytest.raises(InvalidRequest, match=f"at most {MAX_GRAMMAR_BYTES}"):
        grammar_for(json_schema_format(huge))


def test_constrained_rows_write_valid_json_beside_a_free_row_that_answers_as_alone(
    pre: HFPreprocessor, backend: HFBackend
) -> None:
    grammar = grammar_for(json_schema_format())
    free = work_item(pre, "Keep going.", [WIDE], SamplingParams(max_tokens=12, temperature=0.0), 1)
    alone, _ = answer(list(backend.run([free])))
    greedy = work_item(pre, "Describe", [SQUARE], SamplingParams(max_tokens=80, temperature=0.0, grammar=grammar), 2)
    sampled = work_item(
        pre, "Describe", [SQUARE], SamplingParams(max_tokens=80, temperature=1.0, seed=4, grammar=grammar), 3
    )
    events = list(backend.run([greedy, free, sampled]))
    assert answer(events, 1)[0] == alone  # the mask is per row
    for index in (0, 2):
        text, end = answer(events, index)
        assert end.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PET)


def test_max_tokens_cuts_the_json_short_with_finish_reason_length(pre: HFPreprocessor, backend: HFBackend) -> None:
    grammar = grammar_for(json_schema_format())
    cut = work_item(pre, "Describe", [SQUARE], SamplingParams(max_tokens=3, temperature=0.0, grammar=grammar), 1)
    text, end = answer(list(backend.run([cut])))
    assert end.finish_reason == "length" and text.startswith("{")


def test_json_object_answers_are_objects(pre: HFPreprocessor, backend: HFBackend) -> None:
    grammar = grammar_for({"type": "json_object"})
    items = [
        work_item(
            pre, "Describe", [SQUARE], SamplingParams(max_tokens=200, temperature=1.0, seed=s, grammar=grammar), s
        )
        for s in range(3)
    ]
    events = list(backend.run(items))
    for index in range(3):
        text, end = answer(events, index)
        if end.finish_reason == "stop":  # an object the model closed within max_tokens
            assert isinstance(json.loads(text), dict)
        else:
            assert end.finish_reason == "length" and text.startswith("{")


def test_a_model_that_samples_no_tokens_refuses_response_format() -> None:
    from shmgate.gateway.fields import check_fields_for_model
    from shmgate.gateway.preprocess.vision import ChecksumPreprocessor

    with pytest.raises(InvalidRequest) as refused:
        check_fields_for_model(SamplingParams(grammar=grammar_for({"type": "json_object"})), ChecksumPreprocessor())
    assert refused.value.param == "response_format"


def test_a_schema_sent_again_reuses_its_compiled_grammar() -> None:
    from shmgate.gateway import structured

    first = grammar_for(json_schema_format())
    assert grammar_for(json_schema_format()) is first  # not compiled twice: the same string object
    key = json.dumps(PET, sort_keys=True, separators=(",", ":"))
    assert structured._compiled[key] is first and structured._compiled_chars <= structured.COMPILED_CHARS
