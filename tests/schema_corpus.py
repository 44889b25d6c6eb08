"""The real-world JSON Schema corpus (tests/data/schemas/) and how an answer to one is judged.

Used by tests/test_schema_corpus.py and ``python -m bench schema-corpus``. An answer is **valid** (it
parses and validates against the schema as sent, by the ``jsonschema`` package), **cut**
(``finish_reason: length``), or **invalid** (it ended but does not validate: never acceptable); a 400
is **refused**. ``multipleOf`` is checked in decimal: JSON carries decimals, and ``9134888.04`` is a
multiple of ``0.01`` though ``9134888.04 / 0.01`` is not a whole number in binary floating point.
"""

from __future__ import annotations

import decimal
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CORPUS", "Outcome", "corpus", "judge", "run", "totals", "validator"]

CORPUS = Path(__file__).resolve().parent / "data" / "schemas"


@dataclass
class Outcome:
    name: str
    kind: str  # "valid" | "cut" | "invalid" | "refused" | "error"
    detail: str = ""


def corpus() -> dict[str, dict[str, Any]]:
    """The schemas, by file stem."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(CORPUS.glob("*.json"))}


def validator(schema: dict[str, Any]) -> Callable[[Any], Iterator[Any]]:
    """The schema's errors for an instance (the draft its ``$schema`` names; 2020-12 by default)."""
    import jsonschema

    base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)

    def multiple_of(check: Any, divisor: Any, instance: Any, schema: Any) -> Iterator[Any]:
        if isinstance(instance, (int, float)) and not isinstance(instance, bool):
            quotient = decimal.Decimal(repr(instance)) / decimal.Decimal(repr(divisor))
            if quotient != quotient.to_integral_value():
                yield jsonschema.ValidationError(f"{instance!r} is not a multiple of {divisor!r}")

    cls = jsonschema.validators.extend(base, {"multipleOf": multiple_of})
    return cls(schema).iter_errors


def judge(name: str, schema: dict[str, Any], status: int, body: dict[str, Any]) -> Outcome:
    """What one answer (or refusal) counts as."""
    if status == 400:
        return Outcome(name, "refused", body["error"]["message"])
    if status != 200:
        return Outcome(name, "error", f"{status}: {json.dumps(body)[:200]}")
    choice = body["choices"][0]
    text = choice["message"]["content"]
    if choice["finish_reason"] == "length":
        return Outcome(name, "cut", text[:80])
    try:
        errors = list(validator(schema)(json.loads(text)))
    except ValueError as exc:
        return Outcome(name, "invalid", f"not JSON ({exc}): {text[:200]}")
    if errors:
        return Outcome(name, "invalid", f"{errors[0].message[:200]}: {text[:200]}")
    return Outcome(name, "valid", text[:80])


def run(base_url: str, model: str, max_tokens: int, seed: int = 0, concurrency: int = 4) -> list[Outcome]:
    """Send every schema of the corpus and judge each answer."""
    import httpx

    schemas = corpus()

    def one(name: str) -> Outcome:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Write a {name} document as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": name[:64], "schema": schemas[name]}},
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": seed,
        }
        reply = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
        return judge(name, schemas[name], reply.status_code, reply.json())

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, schemas))


def totals(outcomes: list[Outcome]) -> dict[str, int]:
    counts = {kind: 0 for kind in ("valid", "cut", "invalid", "refused", "error")}
    for o in outcomes:
        counts[o.kind] += 1
    return {"schemas": len(outcomes), "accepted": len(outcomes) - counts["refused"] - counts["error"], **counts}
