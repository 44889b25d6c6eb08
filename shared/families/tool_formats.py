"""How each chat family reads tool definitions and writes tool calls: the tool format of its prompts.

A family whose checkpoint's chat template has a tool section (it reads ``tools``; Qwen3-VL's, the Qwen2.5
text models') renders the tools itself: the frontend passes them to the template. For the others (Qwen2-VL
and Qwen2.5-VL ship templates without one, the other families were not trained on tools) the format here
is written into the conversation before the template runs: the tool definitions in the system message,
earlier calls in the assistant's text, tool results in a user turn. Every family writes its calls in one
format, the hermes-style blocks Qwen2.5 was trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, joined by a newline. The frontend's grammar (gateway/tools.py) forces this shape and
the call's arguments, so a model that never saw the format still writes calls that parse; the gateway
reads them back out of the text (gateway/tool_output.py). Plain Python: both halves may import it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["HERMES", "ToolFormat", "tool_format"]


@dataclass(frozen=True)
class ToolFormat:
    """One way of writing tools into a prompt and calls into an answer."""

    name: str  # what docs/MODELS.md calls it
    call_open: str  # a call's opening tag: once the model writes it, the rest of the call is forced
    call_close: str
    separator: str  # between two calls
    default_system: str  # the system text a conversation without one gets (the template's own default)
    in_system: bool = True  # the tools go in a system message; False: in front of the first user message

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it; ``arguments`` is the JSON text of the arguments object."""
        return f'{self.call_open}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{self.call_close}'

    def call_prefix(self, name: str) -> str:
        """What the model writes of a call before its arguments (``name`` is a plain identifier)."""
        return f'{self.call_open}\n{{"name": "{name}", "arguments": '

    @property
    def call_suffix(self) -> str:
        return "}\n" + self.call_close

    def system_text(self, tools: Sequence[dict[str, Any]], system: str | None) -> str:
        """The system message with the tool definitions (OpenAI's ``{"type": "function", "function": ...}``)."""
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        head = self.default_system if system is None else system
        return (
            f"{head}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{self.call_open}{self.call_close} XML tags:\n"
            f'{self.call_open}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{self.call_close}'
        ).lstrip()

    def results_text(self, results: Sequence[str]) -> str:
        """Consecutive tool results, as one user turn's text."""
        return "\n".join(f"<tool_response>\n{result}\n</tool_response>" for result in results)


HERMES = ToolFormat(
    name="hermes",
    call_open="<tool_call>",
    call_close="</tool_call>",
    separator="\n",
    default_system="",
)
# The Qwen families' templates open a conversation without a system message with this one.
_QWEN = ToolFormat(
    name="hermes",
    call_open="<tool_call>",
    call_close="</tool_call>",
    separator="\n",
    default_system="You are a helpful assistant.",
)

# PaliGemma's prompt is one user message (no roles): the tools go in front of its text.
_PREFIX = dataclasses.replace(HERMES, in_system=False)

# By config.json model_type; a family not listed writes HERMES (a prompt it was not trained on, kept
# to its shape by the grammar).
_FORMATS: dict[str, ToolFormat] = {
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "qwen3_vl": _QWEN,
    "internvl": _QWEN,
    "paligemma": _PREFIX,
}


def tool_format(model_type: str) -> ToolFormat:
    """The tool format of the family ``model_type``."""
    return _FORMATS.get(model_type, HERMES)
