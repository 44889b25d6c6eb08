"""Tools in the prompt: the checkpoint's own template when it reads ``tools``, else the family's tool format.

A chat template with a tool section (one that reads the ``tools`` variable, as Qwen3-VL's and the Qwen2.5
text models' do) gets the definitions as ``apply_chat_template(tools=...)`` and the conversation's calls and
results in Hugging Face's message form (``tool_calls`` on assistant messages, ``tool`` messages). A
template without one (Qwen2-VL's, Qwen2.5-VL's, every other family's here) would drop them silently, so
the conversation is rewritten in the family's tool format (shared/families/tool_formats.py) before it
runs: the definitions join the system message, earlier calls become the assistant's text, consecutive
tool results one user turn. An operator's template file (``--tool-chat-template``) replaces the
checkpoint's for every request that carries tools, calls or results; it reads ``tools`` as a checkpoint's
tool section does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shmgate.gateway.tools import ToolCalling
from shmgate.shared.families.tool_formats import ToolFormat, tool_format

__all__ = ["ToolPrompt", "reads_tools", "tool_prompt_of", "write_tools"]


@dataclass(frozen=True)
class ToolPrompt:
    """How one model's prompts carry tools."""

    format: ToolFormat  # the family's: how calls are written (and, unless ``native``, the tools too)
    native: bool  # the template renders tools itself (``tools=``)
    template: str | None = None  # the operator's template, used instead of the checkpoint's
    tags_are_tokens: bool = False  # the tokenizer has the call's tags as tokens (gateway/tools.py ``tool_grammar``)


def reads_tools(template: Any) -> bool:
    """Whether a chat template has a tool section: it reads the ``tools`` variable."""
    if not isinstance(template, str):
        return False
    import jinja2
    import jinja2.meta

    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateError:
        return False


@functools.cache
def tool_prompt_of(tokenizer: Any, model_type: str, template: str | None = None) -> ToolPrompt:
    """The ToolPrompt of a checkpoint with this tokenizer (its chat template, its added tokens) of the
    family ``model_type``; ``template``: the operator's (kept: a template is parsed once per model)."""
    fmt = tool_format(model_type)
    added = tokenizer.get_added_vocab()
    tokens = fmt.call_open in added and fmt.call_close in added
    if template is not None:
        return ToolPrompt(fmt, native=True, template=template, tags_are_tokens=tokens)
    return ToolPrompt(fmt, native=reads_tools(tokenizer.chat_template), tags_are_tokens=tokens)


def write_tools(
    messages: Sequence[dict[str, Any]], calling: ToolCalling | None, prompt: ToolPrompt
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The conversation to render and the template's extra arguments (``tools``, ``chat_template``)."""
    if prompt.native:
        args: dict[str, Any] = {}
        if calling is not None:
            args["tools"] = calling.definitions()
        if prompt.template is not None:
            args["chat_template"] = prompt.template
        return list(messages), args
    return _rewritten(messages, calling, prompt.format), {}


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str) or content is None:
        return content or ""
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def _text_message(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": [{"type": "text", "text": text}]}


def _rewritten(
    messages: Sequence[dict[str, Any]], calling: ToolCalling | None, fmt: ToolFormat
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    results: list[str] = []
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "tool":
            results.append(_text(message))
            continue
        if results:
            out.append(_text_message("user", fmt.results_text(results)))
            results = []
        if i == 0 and role == "system" and calling is not None:
            images = [p for p in message.get("content") or [] if isinstance(p, dict) and p.get("type") != "text"]
            system = _text_message("system", fmt.system_text(calling.definitions(), _text(message)))
            system["content"] += images
            out.append(system)
        elif role == "assistant" and message.get("tool_calls"):
            calls = [
                fmt.call_text(c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
                for c in message["tool_calls"]
            ]
            text = _text(message)
            out.append(_text_message("assistant", (text + "\n" if text else "") + fmt.separator.join(calls)))
        else:
            out.append(dict(message))
    if results:
        out.append(_text_message("user", fmt.results_text(results)))
    if calling is not None and (not messages or messages[0]["role"] != "system"):
        tools = fmt.system_text(calling.definitions(), None)
        user = next((m for m in out if m["role"] == "user"), None)
        if fmt.in_system or user is None:
            out.insert(0, _text_message("system", tools))
        else:  # a prompt without roles: in front of the user's text
            user["content"] = [{"type": "text", "text": tools + "\n\n"}, *user["content"]]
    return out
