"""Real-world JSON Schemas rewritten into what the grammar compiler enforces (gateway/schema_rewrite.py),
soundly: every string the grammar lets a model write validates against the schema as the client sent it.

The proof here is a random walk of each grammar with the tiny Qwen2-VL's tokenizer: at every step a
token the grammar allows is picked at random (any of them, not the likely ones a model would pick), so
the walks reach branches a model rarely takes. Each walk that ends is checked by ``jsonschema``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402

from shmgate.gateway.structured import grammar_for  # noqa: E402
from shmgate.shared.errors import InvalidRequest  # noqa: E402
from tests.schema_corpus import corpus, validator  # noqa: E402

# What stays refused, and the keyword and place its 400 names: neither can be enforced by a grammar.
REFUSED = {
    "not_pattern": "not at /properties/username/not",  # "not this regex": no lookaround in the grammar's regexes
    "unique_pairs": "uniqueItems at /uniqueItems",  # two or more distinct items
}
WALKS = 6
WALK_TOKENS = 160


def _format(schema: Any, name: str = "x") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen2_vl_dir: Path) -> Any:
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_qwen2_vl_dir)
    return hf, llguidance.hf.from_tokenizer(hf)


def _walk(grammar: str, tokenizer: Any, rng: random.Random) -> str | None:
    """A random string the grammar allows; None when WALK_TOKENS ran out before it could end."""
    from llguidance import LLMatcher
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    hf, lltok = tokenizer
    matcher = LLMatcher(lltok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    mask = allocate_token_bitmask(1, lltok.vocab_size)
    tokens: list[int] = []
    for _ in range(WALK_TOKENS):
        if matcher.is_stopped():
            break
        fill_next_token_bitmask(matcher, mask)
        allowed = np.flatnonzero(np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[: lltok.vocab_size])
        if lltok.eos_token in allowed and rng.random() < 0.3:
            break  # end where the grammar may end, often: short answers end within the walk
        token = int(rng.choice(list(allowed)))
        if token == lltok.eos_token:
            break
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
    if not (matcher.is_stopped() or matcher.is_accepting()):
        return None
    return str(hf.decode(tokens))


@pytest.mark.parametrize("name", sorted(corpus()))
def test_each_corpus_schema_is_enforced_soundly_or_refused_naming_its_keyword(name: str, tokenizer: Any) -> None:
    schema = corpus()[name]
    if name in REFUSED:
        with pytest.raises(InvalidRequest) as refused:
            grammar_for(_format(schema))
        assert refused.value.param == "response_format" and REFUSED[name] in refused.value.message
        return
    grammar = grammar_for(_format(schema))
    errors_of = validator(schema)
    rng = random.Random(name)
    for _ in range(WALKS):
        text = _walk(grammar, tokenizer, rng)
        if text is not None:
            errors = list(errors_of(json.loads(text)))
            assert not errors, f"{name}: {text!r}: {errors[0].message}"


def test_random_walks_end_often_enough_to_prove_something(tokenizer: Any) -> None:
    ended = 0
    rng = random.Random(7)
    for name, schema in corpus().items():
        if name not in REFUSED:
            ended += sum(_walk(grammar_for(_format(schema)), tokenizer, rng) is not None for _ in range(2))
    assert ended >= 20


def _answers(schema: Any, tokenizer: Any, count: int = 40) -> list[Any]:
    grammar = grammar_for(_format(schema))
    rng = random.Random(1)
    return [json.loads(t) for t in (_walk(grammar, tokenizer, rng) for _ in range(count)) if t is not None]


def test_overlapping_one_of_branches_are_told_apart(tokenizer: Any) -> None:
    either = {
        "type": "object",
        "properties": {"email": {"type": "string", "maxLength": 8}, "phone": {"type": "string", "maxLength": 8}},
        "oneOf": [{"required": ["email"]}, {"required": ["phone"]}],
        "additionalProperties": False,
    }
    answers = _answers(either, tokenizer)
    assert answers and all(("email" in a) != ("phone" in a) for a in answers)  # exactly one, never both


def test_not_and_if_then_else_and_dependencies_hold(tokenizer: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["a", "b"]}, "x": {"type": "integer"}, "y": {"type": "integer"}},
        "required": ["kind"],
        "additionalProperties": False,
        "if": {"properties": {"kind": {"const": "a"}}},
        "then": {"required": ["x"]},
        "else": {"not": {"required": ["x"]}},
        "dependentRequired": {"y": ["x"]},
    }
    answers = _answers(schema, tokenizer)
    assert answers
    for a in answers:
        assert ("x" in a) == (a["kind"] == "a") and ("y" not in a or "x" in a)


def test_a_negated_constant_leaves_every_other_string(tokenizer: Any) -> None:
    odd = ["a b-c.d/é~#&", "x[y]", "q"]
    schema = {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 14, "not": {"enum": odd}}}
    answers = _answers(schema, tokenizer, 60)
    assert answers and not any(s in odd for a in answers for s in a)
    assert any(a for a in answers)  # some strings were written, not only empty arrays


def test_unknown_formats_are_annotations_and_known_ones_are_kept() -> None:
    from shmgate.gateway.schema_rewrite import rewrite

    out = rewrite(
        {"type": "object", "properties": {"a": {"type": "string", "format": "uri-reference"}, "b": {"format": "date"}}},
        lambda name: name == "date",
    )
    assert out["properties"] == {"a": {"type": "string"}, "b": {"format": "date"}}


def test_the_schemas_compiler_options_are_the_servers() -> None:
    lenient = {"x-guidance": {"lenient": True}, "type": "string", "not": {"pattern": "^a"}}
    with pytest.raises(InvalidRequest, match="not at /not"):  # a lenient compiler would drop the "not"
        grammar_for(_format(lenient))
    spaced = {"x-guidance": {"whitespace_flexible": True}, "type": "object", "properties": {"a": {"const": 1}}}
    assert '"whitespace_flexible":false' in grammar_for(_format(spaced)).replace(" ", "")


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"$ref": "https://example.com/other.json"}, "$ref at /$ref"),
        (
            {"type": "array", "items": {"type": "string"}, "contains": {"type": "string"}, "maxContains": 2},
            "maxContains",
        ),
        ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "oneOf at /oneOf"),  # only non-integers
    ],
)
def test_what_cannot_be_enforced_is_refused_with_keyword_and_pointer(schema: Any, needle: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        grammar_for(_format(schema))
    assert needle in refused.value.message and refused.value.param == "response_format"


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "array", "uniqueItems": True, "maxItems": "3"},
        {"type": "object", "properties": {"a": {}}, "minProperties": 1, "required": True},
        {"not": {"minLength": "x"}},
        {"oneOf": [{"type": "strin"}, {"enum": [1]}]},
        {"if": {"$ref": "#/nowhere"}, "then": {"required": ["a"]}},
        {"type": "string", "not": {"const": 12345678901234567891}, "enum": "abc"},
    ],
)
def test_a_malformed_schema_is_a_400_not_a_crash(schema: Any) -> None:
    with pytest.raises(InvalidRequest) as refused:
        grammar_for(_format(schema))
    assert refused.value.param == "response_format"


def test_a_negated_number_constant_is_cut_out_of_its_range(tokenizer: Any) -> None:
    schema = {
        "type": "array",
        "maxItems": 4,
        "items": {"type": "integer", "minimum": 0, "maximum": 3, "not": {"const": 2}},
    }
    answers = _answers(schema, tokenizer, 60)
    values = [v for a in answers for v in a]
    assert values and 2 not in values and set(values) <= {0, 1, 3}
