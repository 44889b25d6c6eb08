"""Structured outputs: OpenAI's ``response_format`` turned into the grammar a worker enforces.

``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` and ``{"type": "json_object"}``
become a grammar (llguidance's JSON form) that rides in ``SamplingParams.grammar``; the worker masks
every sampled token with it (worker/constraints.py), so the answer parses and validates even when the
model alone would not produce JSON. The schema is compiled here, once per request, so a schema the
compiler refuses is a 400 naming ``response_format`` before anything is queued. The JSON is compact
(no whitespace between tokens: with free whitespace a weak model pads spaces until max_tokens).
``strict`` is accepted either way: the grammar always enforces the whole schema.

The schema is first rewritten into the keywords the compiler enforces (gateway/schema_rewrite.py:
``oneOf``, ``not``, dependencies, conditionals, unknown formats...), soundly: the grammar accepts only
answers valid against the schema as sent. What cannot be rewritten so is a 400 naming the keyword and
its JSON pointer. The compiler's own options (``x-guidance``) are the server's, never the client's: a
lenient compiler would accept answers the schema does not. A grammar over INLINE_GRAMMAR_BYTES rides in
the shared-memory arena beside the request's tensors (gateway/frontend.py), up to MAX_GRAMMAR_BYTES.
"""

from __future__ import annotations

import collections
import functools
import json
import re
import threading
from typing import Any

from shmgate.gateway.schema_rewrite import Unsupported, rewrite
from shmgate.shared.errors import InvalidRequest
from shmgate.shared.wire import MAX_GRAMMAR_BYTES

__all__ = ["grammar_for"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def grammar_for(response_format: dict[str, Any] | None) -> str:
    """The grammar ``response_format`` asks for; "" for free text (absent, null or ``{"type": "text"}``).

    Raises InvalidRequest (param ``response_format``) for an unknown type, a malformed ``json_schema``,
    a schema the grammar compiler refuses, a grammar over MAX_GRAMMAR_BYTES, or a server without the
    compiler (the ``hf`` extra).
    """
    if response_format is None:
        return ""
    kind = response_format.get("type", "text")
    if kind == "text":
        return ""
    if kind == "json_object":
        return _compile(_ANY_OBJECT)
    if kind != "json_schema":
        raise InvalidRequest(
            f"response_format type must be text, json_object or json_schema, not {str(kind)[:40]!r}",
            param="response_format",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(
            "response_format json_schema must be an object with name and schema", param="response_format"
        )
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequest(
            "response_format json_schema.name must be 1-64 letters, digits, underscores or dashes",
            param="response_format",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest("response_format json_schema.strict must be a boolean", param="response_format")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format json_schema.schema must be a JSON Schema object", param="response_format")
    return _compile(schema)


# The compiler's options, whatever the schema's "x-guidance" says: compact JSON, and nothing approximated.
_OPTIONS: Any = {"whitespace_flexible": False, "coerce_one_of": False, "lenient": False}
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')


# Grammars compiled lately, by their schema's JSON: clients send the same few schemas again and again, and
# a large one takes the event loop tens of milliseconds to rewrite and compile (docs/BENCHMARKS.md).
# Bounded in characters (schema and grammar) per frontend process, least recently used out first.
COMPILED_CHARS = 8 << 20
_compiled: collections.OrderedDict[str, str] = collections.OrderedDict()
_compiled_chars = 0
_compiled_lock = threading.Lock()


def _compile(schema: dict[str, Any]) -> str:
    global _compiled_chars
    key = json.dumps(schema, sort_keys=True, separators=(",", ":"))
    with _compiled_lock:
        grammar = _compiled.get(key)
        if grammar is not None:
            _compiled.move_to_end(key)
            return grammar
    grammar = _compile_now(schema)
    size = len(key) + len(grammar)
    if size <= COMPILED_CHARS // 4:
        with _compiled_lock:
            if key not in _compiled:
                _compiled[key] = grammar
                _compiled_chars += size
            while _compiled_chars > COMPILED_CHARS:
                old_key, old = _compiled.popitem(last=False)
                _compiled_chars -= len(old_key) + len(old)
    return grammar


def _compile_now(schema: dict[str, Any]) -> str:
    try:
        from llguidance import LLMatcher
    except ImportError:  # a server installed without the hf extra serves no model that could use it
        raise InvalidRequest(
            "structured outputs need the grammar compiler of shmgate's hf extra (llguidance), "
            "which this server does not have",
            param="response_format",
        ) from None
    try:
        enforceable = rewrite(schema, _known_format)
    except Unsupported as exc:
        raise InvalidRequest(
            f"response_format schema cannot be enforced: {exc.keyword} at {exc.pointer}: {exc.why}"[:500],
            param="response_format",
        ) from None
    except RecursionError:
        raise InvalidRequest("response_format schema is nested too deeply", param="response_format") from None
    except Exception as exc:  # a malformed schema (a bound that is not a number, required that is not a list...)
        raise InvalidRequest(
            f"response_format schema is not a valid JSON Schema ({type(exc).__name__}: {str(exc)[:200]})",
            param="response_format",
        ) from None
    text = json.dumps(enforceable, separators=(",", ":"))
    if len(text.encode()) > MAX_GRAMMAR_BYTES:  # the grammar holds the schema: refused before compiling it
        raise InvalidRequest(
            f"response_format schema is too large: {len(text.encode())} bytes, at most {MAX_GRAMMAR_BYTES}",
            param="response_format",
        )
    try:
        grammar = LLMatcher.grammar_from_json_schema(text, overrides=_OPTIONS)
        problem = LLMatcher.validate_grammar(grammar, None)
    except (ValueError, TypeError, RuntimeError) as exc:
        problem = str(exc)
    if problem:
        raise InvalidRequest(
            f"response_format schema is not usable: {problem[:300]}{_where(problem, enforceable)}",
            param="response_format",
        )
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(
            f"response_format schema is too large: {len(grammar.encode())} bytes as a grammar, "
            f"at most {MAX_GRAMMAR_BYTES}",
            param="response_format",
        )
    return grammar


@functools.lru_cache(maxsize=128)
def _known_format(name: str) -> bool:
    """Whether the compiler enforces string format ``name`` (the others are annotations, dropped)."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema({"type": "string", "format": name}, overrides=_OPTIONS)
        return not LLMatcher.validate_grammar(grammar, None)
    except (ValueError, TypeError, RuntimeError):
        return False


def _where(problem: str, schema: Any) -> str:
    """ " (at <pointer>)" of the first place holding the keyword the compiler named, if it named one."""
    match = _UNIMPLEMENTED.search(problem)
    if match is None:
        return ""
    pointer = _find(schema, match.group(1), "")
    return "" if pointer is None else f" (at {pointer})"


def _find(node: Any, key: str, at: str) -> str | None:
    if isinstance(node, dict):
        if key in node:
            return f"{at}/{key}"
        items = [(k.replace("~", "~0").replace("/", "~1"), v) for k, v in node.items()]
    elif isinstance(node, list):
        items = [(str(i), v) for i, v in enumerate(node)]
    else:
        return None
    for name, value in items:
        found = _find(value, key, f"{at}/{name}")
        if found is not None:
            return found
    return None
