"""What a response_format grammar costs per token: the engine in this process, constrained against free.

The tiny random Qwen2-VL of the tests (or ``--model-dir``, e.g. ``python -m bench vlm-serving --build``'s
8-layer model), ``--rows`` requests decoded together, greedy, every answer run to ``--tokens`` (a JSON
schema of one long bounded string keeps a constrained answer going); rounds alternate free and
constrained (ABBA) and report milliseconds per generated token and the difference, which is the
grammar's cost: llguidance's mask and its copy into the logits, per row per step.

``--grammar tools``: the constrained rows are held to a tool call instead (gateway/tools.py, ``tool_choice``
``required``, the hermes tags of the tiny model's family, one function whose one long bounded string
argument keeps the call going), and the time to compile the grammar of a ``--functions``-function
toolset is measured too: the gateway's compile (lark to llguidance, checked) and the worker's (the
matcher over the model's tokenizer), each the median of ``--compiles`` cold runs.

Beside the end-to-end rounds (whose difference drowns in a loaded machine's noise), the worker's own
per-token work for each grammar is timed alone: worker/constraints.py's ``RowConstraint`` (llguidance's
mask, its unpacking into the logits, the token's acceptance) replayed over an answer the grammar allows,
the best of ``--replays``, for the JSON schema and the tool call alike (interleaved ABBA).
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
    p.add_argument("--grammar", choices=("json", "tools"), default="json", help="what the constrained rows keep to")
    p.add_argument("--functions", type=int, default=20, help="--grammar tools: the toolset whose compile is timed")
    p.add_argument("--compiles", type=int, default=9)
    p.add_argument("--replays", type=int, default=20)
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
    compile_report: dict[str, object] = {}
    if args.grammar == "tools":
        compile_report = {
            **_compile_times(pre, args.functions, args.compiles),
            **_mask_costs(pre, {"json": grammar, "tools": _tool_grammar(schema)}, args.tokens, args.replays),
        }
        grammar = _tool_grammar(schema)
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
                "grammar": args.grammar,
                "rows": args.rows,
                "tokens": args.tokens,
                "tokens_generated": tokens_seen,
                "ms_per_token_free": round(free, 3),
                "ms_per_token_constrained": round(constrained, 3),
                "grammar_ms_per_token": round(constrained - free, 3),
                "rounds_ms_per_token": {k: [round(v, 3) for v in vs] for k, vs in per_token.items()},
                **compile_report,
            }
        )
    )
    return 0


def _tool_grammar(schema: dict) -> str:  # type: ignore[type-arg]
    """A required call of one function whose arguments are ``schema``."""
    from shmgate.gateway.tools import parse_tools, tool_grammar
    from shmgate.shared.families.tool_formats import tool_format

    tools = [{"type": "function", "function": {"name": "write", "parameters": schema}}]
    calling = parse_tools(tools, "required", False)
    assert calling is not None
    return tool_grammar(calling, tool_format("qwen2_vl"))


def toolset(n: int) -> list[dict]:  # type: ignore[type-arg]
    """``n`` functions of a GUI agent's size: a few typed, bounded parameters each."""
    tools = []
    for i in range(n):
        properties = {
            "x": {"type": "integer", "minimum": 0, "maximum": 4096},
            "y": {"type": "integer", "minimum": 0, "maximum": 4096},
            "text": {"type": "string", "maxLength": 200},
            "mode": {"enum": ["left", "right", "double"]},
        }
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": f"action_{i}",
                    "description": f"GUI action number {i}.",
                    "parameters": {"type": "object", "properties": properties, "required": ["x", "y"]},
                },
            }
        )
    return tools


def _compile_times(pre, functions: int, compiles: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The gateway's and the worker's compile of an ``functions``-function toolset's grammar (ms, medians)."""
    import statistics

    import llguidance
    import llguidance.hf

    from shmgate.gateway import tools as tool_module
    from shmgate.shared.families.tool_formats import tool_format

    calling = tool_module.parse_tools(toolset(functions), "auto", None)
    assert calling is not None
    lark = tool_module.tool_lark(calling, tool_format("qwen2_vl"))
    tokenizer = llguidance.hf.from_tokenizer(pre.tokenizer)
    gateway_ms, worker_ms = [], []
    grammar = ""
    for _ in range(compiles):
        tool_module._compiled.cache_clear()
        started = time.perf_counter()
        grammar, problem = tool_module._compiled(lark)
        gateway_ms.append(1000 * (time.perf_counter() - started))
        assert not problem, problem
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        worker_ms.append(1000 * (time.perf_counter() - started))
        assert not matcher.is_error(), matcher.get_error()
    return {
        "toolset_functions": functions,
        "toolset_grammar_bytes": len(grammar.encode()),
        "toolset_compile_ms_gateway": round(statistics.median(gateway_ms), 2),
        "toolset_compile_ms_worker": round(statistics.median(worker_ms), 2),
        "tokenizer_vocab": tokenizer.vocab_size,
    }


def _mask_costs(pre, grammars: dict[str, str], tokens: int, replays: int) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The worker's per-token grammar work (us), each grammar replayed over one answer it allows."""
    import random

    import torch

    from shmgate.worker.constraints import GrammarConstraints

    vocab = int(pre.vocab_size)
    compiler = GrammarConstraints(pre.tokenizer, vocab)
    logits = torch.zeros(vocab)
    answers: dict[str, list[int]] = {}
    for name, grammar in grammars.items():  # an answer: random allowed tokens, as a random model writes
        row, rng, ids = compiler.start(grammar), random.Random(0), []
        while not row.finished and len(ids) < tokens:
            allowed = torch.nonzero(row.mask(logits) > float("-inf")).flatten().tolist()
            ids.append(rng.choice(allowed))
            row.accept(ids[-1])
        answers[name] = ids
    best: dict[str, float] = {name: float("inf") for name in grammars}
    order = list(grammars) + list(reversed(grammars))
    for _ in range(replays):
        for name in order:
            row = compiler.start(grammars[name])
            started = time.perf_counter()
            for token in answers[name]:
                row.mask(logits)
                row.accept(token)
            best[name] = min(best[name], (time.perf_counter() - started) / len(answers[name]))
    return {f"mask_us_per_token_{name}": round(1e6 * v, 1) for name, v in best.items()} | {
        f"mask_tokens_{name}": len(ids) for name, ids in answers.items()
    }
