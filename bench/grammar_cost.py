"""What a response_format grammar costs per token: the engine in this process, constrained against free.

The tiny random Qwen2-VL of the tests (or ``--model-dir``, e.g. ``python -m bench vlm-serving --build``'s
8-layer model), ``--rows`` requests decoded together, greedy, every answer run to ``--tokens`` (a JSON
schema of one long bounded string keeps a constrained answer going); rounds alternate free and
constrained (ABBA) and report milliseconds per generated token and the difference, which is the
grammar's cost: llguidance's mask and its copy into the logits, per row per step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def _run(backend, items) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    events = list(backend.run(items))
    tokens = sum(e.completion_tokens for e in events if e.finish_reason)
    return time.perf_counter() - started, tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, help="an hf: checkpoint (default: the tests' tiny Qwen2-VL, built)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)

    import torch

    from shmgate.gateway.preprocess.hf import HFPreprocessor
    from shmgate.gateway.structured import grammar_for
    from shmgate.shared.wire import SamplingParams
    from shmgate.worker.backends.hf import HFBackend
    from tests.hf_fixture import build_tiny_vlm
    from tests.test_hf import SQUARE, work_item

    model_dir = args.model_dir or build_tiny_vlm(Path(tempfile.mkdtemp()) / "tiny")
    torch.set_num_threads(1)
    pre, backend = HFPreprocessor(model_dir), HFBackend(str(model_dir), torch.device("cpu"))
    # one required string at least as long as the answer may be: the constrained rows, like the free ones,
    # run to max_tokens (an optional field would let the grammar close with "{}" at once)
    schema = {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 4 * args.tokens, "maxLength": 8 * args.tokens}},
        "required": ["text"],
    }
    grammar = grammar_for({"type": "json_schema", "json_schema": {"name": "long", "schema": schema}})
    free_params = SamplingParams(max_tokens=args.tokens, temperature=0.0)

    def items(constrained: bool) -> list:  # type: ignore[type-arg]
        params = (
            free_params if not constrained else SamplingParams(max_tokens=args.tokens, temperature=0.0, grammar=grammar)
        )
        return [work_item(pre, f"Row {i}", [SQUARE], params, i) for i in range(args.rows)]

    _run(backend, items(True))  # warm-up: compiles the grammar, loads the kernels
    per_token: dict[str, list[float]] = {"free": [], "constrained": []}
    tokens_seen: dict[str, int] = {}
    for kind in ["free", "constrained", "constrained", "free"] * args.rounds:
        seconds, tokens = _run(backend, items(kind == "constrained"))
        per_token[kind].append(1000 * seconds / max(tokens, 1))
        tokens_seen[kind] = tokens
    free, constrained = (min(per_token[k]) for k in ("free", "constrained"))
    print(
        json.dumps(
            {
                "model": str(model_dir),
                "rows": args.rows,
                "tokens": args.tokens,
                "tokens_generated": tokens_seen,
                "ms_per_token_free": round(free, 3),
                "ms_per_token_constrained": round(constrained, 3),
                "grammar_ms_per_token": round(constrained - free, 3),
                "rounds_ms_per_token": {k: [round(v, 3) for v in vs] for k, vs in per_token.items()},
            }
        )
    )
    return 0
