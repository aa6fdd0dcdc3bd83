"""Tool calls: the one reading of ``tools``/``tool_choice`` and of tool messages, the prompt
they render to, the grammar that forces a call, and the parse of the model's output.

Torch-free: the gateway validates and counts prompts with it, the worker serves with it.

* ``parse_tools(body)`` reads ``tools``, ``tool_choice`` (``none``/``auto``/``required``/a
  named function) and ``parallel_tool_calls`` into a ``ToolSpec`` (None: no tools in play).
* ``clean_tool_message`` reads an assistant message's ``tool_calls`` and a ``tool`` message's
  ``tool_call_id`` (``loraplex.openai_request`` calls it for every message).
* ``render_prompt(tok, messages, spec)``: a chat template that knows tools (it mentions
  ``tools``) renders them itself, with ``tools=[...]``; otherwise the documented default does:
  a Hermes-style system block listing the functions, calls as ``<tool_call>{json}</tool_call>``
  in assistant turns and results as ``<tool_response>`` user turns.
* ``forced_schema(spec)``: for ``required`` and a named choice, the JSON schema the output is
  constrained to (an array of ``{"name", "arguments"}`` calls whose arguments follow each
  function's ``parameters``): even a small model then returns calls that parse and validate.
  With ``parallel_tool_calls`` a forced answer holds at most one call per offered function.
* ``parse_output(text, spec)``: the calls in an output (``auto``: ``<tool_call>`` blocks, or a
  bare ``{"name", "arguments"}`` object; forced: the JSON array), with ``call_`` ids.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraplex.tokenizer import TextTokenizer

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128

DEFAULT_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)
"""The default tool block (Hermes style), for chat templates that do not render tools."""


class ToolError(ValueError):
    """An invalid tool field (the caller answers 400); same fields as ``FieldError``."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = "invalid_value"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    tools: tuple[Tool, ...]
    choice: str
    """``auto``, ``required`` or ``function`` (then ``name``)."""
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def offered(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if t.name == self.name) if self.choice == "function" else self.tools


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON text (what OpenAI sends)."""
    id: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _tool(raw: Any, i: int) -> Tool:
    param = f"tools[{i}]"
    if not isinstance(raw, dict) or raw.get("type") != "function" or not isinstance(raw.get("function"), dict):
        raise ToolError("each tool must be {\"type\": \"function\", \"function\": {...}}", param)
    fn = raw["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolError("a function name must be 1-64 letters, digits, '_' or '-'", f"{param}.function.name")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ToolError("'description' must be a string", f"{param}.function.description")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ToolError("'parameters' must be a JSON Schema object", f"{param}.function.parameters")
    return Tool(name, desc, params)


def parse_tools(body: dict[str, Any], chat: bool) -> ToolSpec | None:
    """``tools``/``tool_choice``/``parallel_tool_calls``; None when no tool can be called."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not chat:
        raise ToolError("'tools' is a chat field (/v1/chat/completions)", "tools")
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise ToolError(f"'tools' must be a list of at most {MAX_TOOLS} functions", "tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw))
    if len({t.name for t in tools}) != len(tools):
        raise ToolError("function names in 'tools' must be unique", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice is None or choice == "auto":
        return ToolSpec(tools, "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolSpec(tools, "required", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if not any(t.name == name for t in tools):
            raise ToolError(f"'tool_choice' names function {name!r}, which is not in 'tools'", "tool_choice")
        return ToolSpec(tools, "function", name=name, parallel=parallel)
    raise ToolError("'tool_choice' must be 'none', 'auto', 'required' or "
                    "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def clean_tool_message(m: dict[str, Any], clean: dict[str, Any], param: str) -> None:
    """Add an assistant message's ``tool_calls`` (arguments as objects, as templates expect)
    or a tool message's ``tool_call_id`` to its cleaned form ``clean``."""
    role = clean["role"]
    if role == "tool":
        cid = m.get("tool_call_id")
        if not isinstance(cid, str) or not cid:
            raise ToolError("a tool message needs 'tool_call_id'", f"{param}.tool_call_id")
        clean["tool_call_id"] = cid
        return
    calls = m.get("tool_calls")
    if role != "assistant" or calls is None:
        return
    if not isinstance(calls, list):
        raise ToolError("'tool_calls' must be a list", f"{param}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        where = f"{param}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id", ""), str):
            raise ToolError("each tool call needs 'id' and 'function': {'name', 'arguments'}", where)
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            raise ToolError("'arguments' must be a JSON object text", f"{where}.function.arguments") from None
        if not isinstance(parsed, dict):
            raise ToolError("'arguments' must be a JSON object text", f"{where}.function.arguments")
        out.append({"id": c.get("id", ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": parsed}})
    clean["tool_calls"] = out


# ------------------------------------------------------------------------------ prompt
def _native(tok: TextTokenizer) -> bool:
    return "tools" in (tok.chat_template or "")


def _call_text(fn: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False) + \
        "\n</tool_call>"


def default_messages(messages: list[dict[str, Any]], spec: ToolSpec | None) -> list[dict[str, Any]]:
    """The messages in the default tool format, as plain ``{"role", "content"}`` turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            parts = [m["content"]] if m["content"] else []
            parts += [_call_text(c["function"]) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if spec is not None:
        block = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t.openai(), ensure_ascii=False)
                                                         for t in spec.tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def render_prompt(tok: TextTokenizer, messages: list[dict[str, Any]], spec: ToolSpec | None) -> str:
    """The chat prompt text, tools included (the worker encodes it; the gateway counts it)."""
    plain = spec is None and all(len(m) == 2 for m in messages)
    if plain:
        return tok.render_chat(messages, add_generation_prompt=True)
    if _native(tok):
        tools = [t.openai() for t in spec.tools] if spec is not None else None
        return tok.render_chat(messages, add_generation_prompt=True, tools=tools)
    return tok.render_chat(default_messages(messages, spec), add_generation_prompt=True)


# ------------------------------------------------------------------------------ grammar / output
def forced_schema(spec: ToolSpec) -> dict[str, Any]:
    """The JSON schema a ``required``/named answer is constrained to: an array of calls."""
    offered = spec.offered

    def item(t: Tool) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}

    items = item(offered[0]) if len(offered) == 1 else {"anyOf": [item(t) for t in offered]}
    most = len(offered) if spec.parallel and spec.choice == "required" else 1
    return {"type": "array", "items": items, "minItems": 1, "maxItems": most}


_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _call(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), "call_" + uuid.uuid4().hex[:24])


def parse_output(text: str, spec: ToolSpec) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a finished answer; no calls: the text is the content."""
    names = {t.name for t in spec.offered}
    if spec.forced:
        try:
            arr = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut by max_tokens
        calls = [c for c in (_call(o, names) for o in (arr if isinstance(arr, list) else [arr])) if c]
        return (None, calls) if calls else (text, [])
    calls = []
    for m in _BLOCK.finditer(text):
        try:
            c = _call(json.loads(m.group(1)), names)
        except json.JSONDecodeError:
            c = None
        if c is not None:
            calls.append(c)
    if calls:
        rest = _BLOCK.sub("", text).strip()
        return (rest or None), (calls if spec.parallel else calls[:1])
    try:
        c = _call(json.loads(text.strip()), names)
    except json.JSONDecodeError:
        c = None
    return (None, [c]) if c is not None else (text, [])
