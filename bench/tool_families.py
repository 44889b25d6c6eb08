"""Every chat family's tiny checkpoint writing tool calls: the model itself under the tool grammar, in process.

For each family of tests/hf_fixture.py (random weights at a real config), the conversation is written
in the family's tool format (gateway/tool_prompt.py), the tools' grammar is compiled for its tokenizer
(gateway/tools.py), and the worker's backend generates under it (``tool_choice`` ``required`` twice,
then a named function; one call each, sampled at temperature 1 with a seed); the answer is read back
into calls (gateway/tool_output.py) and each call's arguments are validated against its schema. One
JSON line per family: the finish reasons, the functions called, whether any text was left beside the
calls, and that every call validated (the run stops at the first that does not).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="*", help="default: every family the test fixture builds")
    p.add_argument("--max-tokens", type=int, default=120)
    args = p.parse_args(argv)

    import jsonschema
    import torch

    from shmgate.gateway.preprocess.hf import HFPreprocessor
    from shmgate.gateway.tool_output import split_output
    from shmgate.gateway.tool_prompt import write_tools
    from shmgate.gateway.tools import parse_tools, tool_grammar
    from shmgate.shared.wire import SamplingParams
    from shmgate.worker.backends.base import WorkItem
    from shmgate.worker.backends.hf import HFBackend
    from tests.hf_fixture import FAMILIES, build_tiny_vlm
    from tests.test_hf import SQUARE, answer, preprocess, spec
    from tests.test_tools import SCHEMAS, TOOLS

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    choices: list[Any] = ["required", "required", {"type": "function", "function": {"name": "click"}}]
    for family in args.families or FAMILIES:
        model_dir = build_tiny_vlm(root / family, family)
        pre = HFPreprocessor(model_dir)
        prompt = pre.tool_prompt()
        assert prompt is not None
        backend = HFBackend(str(model_dir), torch.device("cpu"))
        reasons, called, text_left = [], [], False
        for seed, choice in enumerate(choices):
            calling = parse_tools(TOOLS, choice, False)
            assert calling is not None
            question = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Weather in Paris?"}]}]
            messages, template_args = write_tools(question, calling, prompt)
            arrays = [preprocess(pre, SQUARE)]
            built = pre.build_prompt(messages, [spec(a) for a in arrays], **template_args)
            tensors = {name: [torch.from_numpy(a[name]) for a in arrays] for name in arrays[0]}
            grammar = tool_grammar(calling, prompt.format, tags_are_tokens=prompt.tags_are_tokens)
            params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=seed, grammar=grammar)
            text, end = answer(list(backend.run([WorkItem(seed, tensors, params, inline=built.inline)])))
            content, calls = split_output(text, prompt.format)
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            reasons.append(end.finish_reason)
            called.append([call.name for call in calls])
            text_left = text_left or bool(content)
        print(
            json.dumps(
                {
                    "family": family,
                    "format": prompt.format.name,
                    "template_reads_tools": prompt.native,
                    "finish_reasons": reasons,
                    "called": called,
                    "text_beside_calls": text_left,
                    "all_valid": True,
                }
            ),
            flush=True,
        )
    return 0
