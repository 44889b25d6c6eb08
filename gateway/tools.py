"""Tool calling, request side: ``tools`` and ``tool_choice`` checked, and the grammar that forces the calls.

What a request asks for becomes a ``ToolCalling`` (gateway/intake.py for chat, gateway/responses.py for
the Responses API's flat form), every malformed part a 400 naming it (``tools[1].function.name``,
``tool_choice``). Once the model is known (``with_tools``, one step of the pipeline), the conversation is
written in the family's tool format (gateway/tool_prompt.py), the calls are forced by a grammar on the
worker's per-row masks, and the answer's text is read back into calls (gateway/tool_output.py).

The grammar (llguidance's lark form), in the family's tags (shared/families/tool_formats.py):
- ``required``: one call or more (one when ``parallel_tool_calls`` is false) from the first token;
- a named function: exactly one call of it;
- ``auto``: free text, or text up to the call's opening tag, after which the call is forced (a lazy
  lexeme ends the text at the tag, as vLLM's and SGLang's structural tags do); after the calls only
  more calls or the end;
- ``none``: no tools in the prompt and no grammar.
Each call's arguments are the function's ``parameters`` schema (an inline ``%json``), written with the
separators the models were trained on (``{"city": "Paris"}``), so even a random-weight model's calls
parse and validate.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from shmgate.shared.errors import InvalidRequest
from shmgate.shared.families.tool_formats import ToolFormat
from shmgate.shared.wire import MAX_GRAMMAR_BYTES

__all__ = ["MAX_TOOLS", "Function", "ToolCalling", "history_has_tools", "parse_tools", "tool_grammar", "tool_lark"]

MAX_TOOLS = 128  # OpenAI's bound on the functions of one request
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
# Arguments as Python's json.dumps writes them (the chat templates' ``tojson``): what models were trained on.
_ARGUMENT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Function:
    """One function tool."""

    name: str
    description: str | None
    parameters: dict[str, Any]  # as sent: what the prompt shows the model
    strict: bool | None = None
    # the parameters rewritten into what the grammar compiler enforces (gateway/schema_rewrite.py, as for
    # response_format): the grammar's; None: as sent
    enforced: dict[str, Any] | None = None

    def definition(self) -> dict[str, Any]:
        """OpenAI's chat form, which chat templates read (``{"type": "function", "function": {...}}``)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCalling:
    """What a request allows: its functions, which may be called (``choice``), and how many calls."""

    functions: tuple[Function, ...]
    choice: Literal["auto", "required", "named"]
    named: str | None = None  # the function ``choice == "named"`` forces
    parallel: bool = True
    params: tuple[str, ...] = ()  # each function's place in the request (``tools[0].function``): its errors' param

    def definitions(self) -> list[dict[str, Any]]:
        return [f.definition() for f in self.functions]

    def schema_of(self, name: str) -> dict[str, Any] | None:
        for function in self.functions:
            if function.name == name:
                return function.parameters
        return None


def parse_tools(
    tools: list[Any] | None, tool_choice: Any, parallel: bool | None, *, flat: bool = False
) -> ToolCalling | None:
    """The request's tools, or None when none may be called (absent, empty, or ``tool_choice`` ``none``).

    ``flat``: the Responses API's form (``{"type": "function", "name", "parameters", ...}`` and
    ``{"type": "function", "name"}`` as a named choice) instead of chat's (``"function": {...}``).
    Raises InvalidRequest naming the field. Tools are checked even when ``tool_choice`` is ``none``.
    """
    functions, params = _functions(tools or [], flat)
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    named: str | None = None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequest(
                f'tool_choice must be "none", "auto", "required" or a function, not {tool_choice[:40]!r}',
                param="tool_choice",
            )
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        inner = tool_choice if flat else tool_choice.get("function")
        named = inner.get("name") if isinstance(inner, dict) else None
        if not isinstance(named, str):
            where = '{"type": "function", "name": ...}' if flat else '{"type": "function", "function": {"name": ...}}'
            raise InvalidRequest(f"a named tool_choice is {where}", param="tool_choice")
        if all(f.name != named for f in functions):
            raise InvalidRequest(
                f"tool_choice names {named[:64]!r}, which is not one of the tools", param="tool_choice"
            )
    else:
        raise InvalidRequest(
            'tool_choice must be "none", "auto", "required" or {"type": "function", ...}', param="tool_choice"
        )
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tool_choice == "none":
        return None
    if not functions:
        raise InvalidRequest(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
    if named is not None:
        return ToolCalling(functions, "named", named, parallel=False, params=params)
    choice: Literal["auto", "required"] = "required" if tool_choice == "required" else "auto"
    return ToolCalling(functions, choice, parallel=parallel is not False, params=params)


def _functions(tools: list[Any], flat: bool) -> tuple[tuple[Function, ...], tuple[str, ...]]:
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", param="tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools are accepted", param="tools")
    functions: list[Function] = []
    params: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise InvalidRequest("a tool must be an object", param=where)
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequest(f"only function tools are supported, not {str(kind)[:40]!r}", param=f"{where}.type")
        spec: Any = tool
        if not flat:
            spec = tool.get("function")
            where += ".function"
            if not isinstance(spec, dict):
                raise InvalidRequest("a function tool needs its function object", param=where)
        function = _function(spec, where)
        if any(f.name == function.name for f in functions):
            raise InvalidRequest(f"two tools are named {function.name!r}", param=f"{where}.name")
        functions.append(function)
        params.append(where)
    return tuple(functions), tuple(params)


def _function(spec: dict[str, Any], where: str) -> Function:
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequest("a function name is 1-64 letters, digits, underscores or dashes", param=f"{where}.name")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest("a function description must be a string", param=f"{where}.description")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest("strict must be a boolean", param=f"{where}.strict")
    parameters = spec.get("parameters")
    if parameters is None:
        parameters = _EMPTY_OBJECT
    if not isinstance(parameters, dict):
        raise InvalidRequest("parameters must be a JSON Schema object", param=f"{where}.parameters")
    kind = parameters.get("type", "object")
    if kind != "object":
        raise InvalidRequest(
            f"parameters must describe an object (type: object), not {str(kind)[:40]!r}",
            param=f"{where}.parameters",
        )
    return Function(name, description, parameters, strict, _enforceable(parameters, f"{where}.parameters"))


def _enforceable(parameters: dict[str, Any], param: str) -> dict[str, Any]:
    """``parameters`` rewritten soundly into what the compiler enforces (``oneOf``, ``not``, unknown
    formats, ...), as response_format's schemas are; a 400 naming the keyword and its pointer if not."""
    try:
        from shmgate.gateway.schema_rewrite import Unsupported, rewrite
        from shmgate.gateway.structured import _known_format
    except ImportError:  # no compiler (the hf extra): tool_grammar says so
        return parameters
    try:
        return rewrite(parameters, _known_format)
    except Unsupported as exc:
        raise InvalidRequest(
            f"the parameters cannot be enforced: {exc.keyword} at {exc.pointer}: {exc.why}"[:500], param=param
        ) from None
    except RecursionError:
        raise InvalidRequest("the parameters are nested too deeply", param=param) from None
    except Exception as exc:  # a malformed schema (a bound that is not a number, required that is not a list...)
        raise InvalidRequest(
            f"the parameters are not a valid JSON Schema ({type(exc).__name__}: {str(exc)[:200]})", param=param
        ) from None


def tool_grammar(calling: ToolCalling, fmt: ToolFormat, *, tags_are_tokens: bool = False, param: str = "tools") -> str:
    """The grammar of the answer ``calling`` allows, in the calls of ``fmt``.

    ``tags_are_tokens``: the tokenizer has the call's tags as tokens of their own (Qwen2.5's
    ``<tool_call>``), and the grammar names those tokens: llguidance reads an added token as a special
    one, which a string in a grammar never matches. Raises InvalidRequest naming the function whose
    parameters the compiler refuses (``tools[i].function.parameters``), a grammar over
    MAX_GRAMMAR_BYTES (``param``), or a server without llguidance.
    """
    try:
        import llguidance  # noqa: F401
    except ImportError:  # a server without the hf extra serves no model that could call tools
        raise InvalidRequest(
            "tool calling needs the grammar compiler of shmgate's hf extra (llguidance)", param=param
        ) from None
    grammar, problem = _compiled(tool_lark(calling, fmt, tags_are_tokens=tags_are_tokens))
    if problem:
        raise InvalidRequest(_which_function(calling, problem, param), param=_which_param(calling, param))
    size = len(grammar.encode())
    if size > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(
            f"the tools are too large: {size} bytes as a grammar, at most {MAX_GRAMMAR_BYTES}; "
            "send fewer functions or smaller parameter schemas",
            param=param,
        )
    return grammar


@functools.lru_cache(maxsize=64)
def _compiled(lark: str) -> tuple[str, str]:
    """(the grammar, the compiler's objection or ""), kept: clients send the same tools again and again."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_lark(lark)
        return grammar, LLMatcher.validate_grammar(grammar, None) or ""
    except (ValueError, TypeError, RuntimeError) as exc:
        return "", str(exc) or type(exc).__name__


def tool_lark(calling: ToolCalling, fmt: ToolFormat, *, tags_are_tokens: bool = False) -> str:
    """The lark text ``tool_grammar`` compiles."""
    functions = [f for f in calling.functions if calling.choice != "named" or f.name == calling.named]
    more = f" ({_lark_string(fmt.separator)} call)*" if calling.parallel else ""
    call_open = fmt.call_open if tags_are_tokens else _lark_string(fmt.call_open)
    close = f'"}}\\n" {fmt.call_close}' if tags_are_tokens else _lark_string(fmt.call_suffix)
    lines = ["%llguidance {}"]
    if calling.choice != "auto":
        lines.append(f"start: call{more}")
    elif tags_are_tokens:  # TEXT never holds a special token: the tag's token ends it
        lines += [f"start: TEXT | TEXT call{more}", "TEXT: /(.|\\n)*/"]
    else:  # TEXT up to the opening tag (a lazy lexeme: it ends at the tag), then the call
        lines += [f"start: TEXT | head body{more}", "TEXT: /(.|\\n)*/", f"head[lazy]: TEXT {call_open}"]
    lines.append(f"call: {call_open} body")
    lines.append("body: " + " | ".join(f"f{i} {close}" for i in range(len(functions))))
    for i, function in enumerate(functions):
        head = fmt.call_prefix(function.name).removeprefix(fmt.call_open)
        schema = function.parameters if function.enforced is None else function.enforced
        lines.append(f"f{i}: {_lark_string(head)} %json {_argument_schema(schema)}")
    return "\n".join(lines) + "\n"


def _argument_schema(parameters: dict[str, Any]) -> str:
    schema = {"x-guidance": _ARGUMENT_JSON, **{k: v for k, v in parameters.items() if k != "x-guidance"}}
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _which_param(calling: ToolCalling, param: str) -> str:
    bad = _refused_function(calling)
    return param if bad is None or not calling.params else f"{calling.params[bad]}.parameters"


def _which_function(calling: ToolCalling, problem: str, param: str) -> str:
    bad = _refused_function(calling)
    if bad is None:
        return f"the tools are not usable: {problem[:300]}"
    return f"the parameters of {calling.functions[bad].name!r} are not a usable JSON Schema: {problem[:300]}"


def _refused_function(calling: ToolCalling) -> int | None:
    """The index of the first function whose parameters the compiler refuses alone (the error path only)."""
    for i, function in enumerate(calling.functions):
        schema = function.parameters if function.enforced is None else function.enforced
        if _compiled(f"start: %json {_argument_schema(schema)}\n")[1]:
            return i
    return None


def history_has_tools(messages: Sequence[dict[str, Any]]) -> bool:
    """Whether a conversation carries earlier calls or tool results (they are rendered as tools are)."""
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
