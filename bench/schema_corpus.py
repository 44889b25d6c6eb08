"""Every schema of tests/data/schemas/ sent as ``response_format`` to a served chat model: accepted or refused?

Each schema goes to ``/v1/chat/completions`` once (a fixed seed, ``--max-tokens`` tokens at most); the
answer is counted as valid, cut (by max_tokens) or invalid (must be 0), a 400 as refused with its
message (which names the keyword and where it is): tests/schema_corpus.py. ``--url`` points at a
running server (e.g. an earlier tree's, for a before/after); without it the tiny random Qwen2-VL of
the tests is built and served here. Also
reported: the time to compile the largest schema's grammar in the frontend (rewrite and llguidance, no
tokenizer) and in a worker (with the model's tokenizer; a worker's first grammar of all costs more,
shown apart).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tests.schema_corpus import corpus, run, totals


def compile_times(model_dir: Path | None) -> dict[str, float]:
    """Milliseconds to compile the corpus's largest schema: frontend (schema to grammar) and worker (matcher)."""
    from shmgate.gateway.structured import grammar_for

    name, schema = max(corpus().items(), key=lambda kv: len(json.dumps(kv[1])))
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    started = time.perf_counter()
    grammar = grammar_for(fmt)
    times = {"schema": name, "schema_bytes": len(json.dumps(schema)), "grammar_bytes": len(grammar.encode())}
    times["frontend_ms"] = (time.perf_counter() - started) * 1000
    if model_dir is not None:
        from transformers import AutoTokenizer

        from shmgate.worker.constraints import GrammarConstraints

        constraints = GrammarConstraints(AutoTokenizer.from_pretrained(model_dir), 0)
        started = time.perf_counter()  # a worker's first grammar also builds llguidance's view of the vocabulary
        constraints.start(grammar_for({"type": "json_object"}))
        times["worker_first_grammar_ms"] = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        constraints.start(grammar)
        times["worker_ms"] = (time.perf_counter() - started) * 1000
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: serve the tests' tiny Qwen2-VL here)")
    p.add_argument("--model", default=None, help="the served model's id (default: the tiny one's)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from tests.hf_fixture import build_tiny_vlm

    model_dir = build_tiny_vlm(Path(tempfile.mkdtemp()) / "tiny-qwen2-vl")
    server = None
    url, model = args.url, args.model or "tiny-qwen2-vl"
    if url is None:
        from tests.serving import start_server, stop_and_check

        server = start_server(f"hf:{model_dir}", Path(tempfile.mkdtemp()), "--workers", "1", "--frontends", "1")
        url = server.base_url
    try:
        outcomes = run(url, model, args.max_tokens, args.seed)
    finally:
        if server is not None:
            stop_and_check(server)
    for o in outcomes:
        print(f"{o.name:32s} {o.kind:8s} {o.detail[:110]}")
    print(json.dumps(totals(outcomes)))
    print(json.dumps(compile_times(model_dir)))
    return 0
