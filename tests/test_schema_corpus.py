"""Every schema of the real-world corpus (tests/data/schemas/) as ``response_format`` on a real serve of the
tiny random Qwen2-VL: accepted (and answered with JSON that validates, or cut by max_tokens) or refused
with the keyword and where it is. A Kubernetes-sized schema's grammar, larger than a descriptor
carries, travels through the arena (shared/wire.py GRAMMAR_TENSOR) and is enforced all the same.
"""

from __future__ import annotations

import httpx
import pytest

from tests.schema_corpus import corpus, run, totals
from tests.serving import Server

pytest.importorskip("llguidance")

MODEL = "tiny-qwen2-vl"
REFUSED = {"not_pattern": "not at /properties/username/not", "unique_pairs": "uniqueItems at /uniqueItems"}


@pytest.fixture
def server(tiny_qwen2_vl_server: Server) -> Server:
    """The tiny Qwen2-VL server this file shares with the others of its group (tests/conftest.py)."""
    return tiny_qwen2_vl_server


def test_every_schema_is_answered_validly_or_refused_naming_its_keyword(server: Server) -> None:
    outcomes = {o.name: o for o in run(server.base_url, MODEL, max_tokens=24)}
    counts = totals(list(outcomes.values()))
    assert counts["invalid"] == 0 and counts["error"] == 0, [
        o for o in outcomes.values() if o.kind in ("invalid", "error")
    ]
    assert {name for name, o in outcomes.items() if o.kind == "refused"} == set(REFUSED)
    for name, needle in REFUSED.items():
        assert needle in outcomes[name].detail
    assert counts["valid"] + counts["cut"] == len(corpus()) - len(REFUSED)


def test_a_grammar_larger_than_a_descriptor_rides_in_the_arena(server: Server) -> None:
    from shmgate.gateway.structured import grammar_for
    from shmgate.shared.wire import INLINE_GRAMMAR_BYTES

    schema = corpus()["k8s_deployment"]
    fmt = {"type": "json_schema", "json_schema": {"name": "deployment", "schema": schema}}
    assert len(grammar_for(fmt).encode()) > 2 * INLINE_GRAMMAR_BYTES
    body = {"model": MODEL, "messages": [{"role": "user", "content": "A deployment."}], "max_tokens": 60}
    reply = httpx.post(server.base_url + "/v1/chat/completions", json={**body, "response_format": fmt}, timeout=120)
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["message"]["content"]
    # the bytes the grammar forces first (the model's random weights would never write them): it reached the worker
    assert text.startswith('{"apiVersion":"apps/v1","kind":"Deployment"'), text
    used = server.metric("shmgate_arena_used_bytes")
    assert used < 64 << 20  # the grammar's arena bytes went back with the request (a leak would grow this)


def test_the_responses_api_names_text_format_for_a_refused_schema(server: Server) -> None:
    body = {
        "model": MODEL,
        "input": "hi",
        "text": {"format": {"type": "json_schema", "name": "u", "schema": corpus()["unique_pairs"]}},
    }
    reply = httpx.post(server.base_url + "/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "text.format" and "uniqueItems at /uniqueItems" in error["message"]
