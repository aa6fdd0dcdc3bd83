"""The Responses API over the chat path: a ``POST /v1/responses`` body becomes a chat completion
body, the chat answer becomes a Response object, a chat stream becomes the Responses events.

Every worker speaks chat (bundled workers, and vLLM behind ``loraplex vllm-agent``), so the
gateway translates at its edge and the rest of the request path (tenant resolution, exact
token reservation, routing, relaying, settling) is the chat path unchanged.

Input items read (``input`` as a string is one user message): messages (``role`` user, system,
developer or assistant; ``content`` a string or ``input_text`` / ``output_text`` parts),
``function_call`` (an earlier tool call) and ``function_call_output`` (its result). A stored
conversation is the items the model saw (``context``) and what it answered; a continuation
(``previous_response_id``) is that, then the new input, under the new ``instructions`` (the
previous ones are not carried over, as in OpenAI's API).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.errors import GatewayError
from gateway.proxy import cached_tokens

ROLES = frozenset({"user", "system", "developer", "assistant"})
ECHOED = ("instructions", "metadata", "temperature", "top_p", "max_output_tokens", "user",
          "parallel_tool_calls", "previous_response_id")
"""Request fields a Response object repeats as they were sent."""
MAX_METADATA = 16
"""Key-value pairs in ``metadata`` (keys up to 64 characters, values up to 512), as in the API."""
UNSUPPORTED = ("background", "conversation", "prompt", "reasoning", "include", "truncation", "service_tier",
               "top_logprobs", "max_tool_calls", "prompt_cache_key", "safety_identifier")
"""Fields of the API this gateway does not serve: refused by name, not silently ignored (``None``,
``false`` or ``auto`` where the API allows it pass)."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def _bad(message: str, param: str, code: str = "invalid_value") -> GatewayError:
    return GatewayError(400, message, code=code, param=param)


@dataclass
class ResponsesRequest:
    """A validated ``POST /v1/responses`` body."""

    body: dict[str, Any]
    input_items: list[dict[str, Any]]
    """This turn's input, as items with ids (what ``/input_items`` lists)."""
    chat: dict[str, Any]
    """The chat completion body without the conversation (``messages`` is set by :meth:`messages_for`)."""
    store: bool
    stream: bool
    previous_response_id: str | None
    echo: dict[str, Any] = field(default_factory=dict)

    def messages_for(self, context: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages for ``context`` (the earlier items, oldest first, then this input)."""
        out: list[dict[str, Any]] = []
        instructions = self.body.get("instructions")
        if instructions:
            out.append({"role": "system", "content": instructions})
        out.extend(items_to_messages(context))
        return out


def read_request(body: Any) -> ResponsesRequest:
    """Validate a Responses body (400 naming the field) and translate what maps onto chat."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body")
    for name in UNSUPPORTED:
        value = body.get(name)
        if value not in (None, False, "auto", "disabled", [], {}):
            raise _bad(f"'{name}' is not supported by this gateway", name, "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' must be a non-empty string", "model")
    items = input_items(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions")
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not prev or len(prev) > 128):
        raise _bad("'previous_response_id' must be a response id", "previous_response_id")
    store = body.get("store", True)
    stream = body.get("stream", False)
    for name, value in (("store", store), ("stream", stream)):
        if not isinstance(value, bool):
            raise _bad(f"'{name}' must be a boolean", name)
    _metadata(body.get("metadata"))
    chat: dict[str, Any] = {"model": model, "stream": stream}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("user", "user"), ("metadata", "metadata"),
                     ("max_output_tokens", "max_tokens"), ("stop", "stop"), ("seed", "seed"),
                     ("parallel_tool_calls", "parallel_tool_calls")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    echo = {k: body.get(k) for k in ECHOED}
    echo["metadata"] = body.get("metadata") or {}
    echo["parallel_tool_calls"] = body.get("parallel_tool_calls", True)
    echo["tools"] = body.get("tools") or []
    echo["tool_choice"] = body.get("tool_choice", "auto")
    echo["text"] = body.get("text") or {"format": {"type": "text"}}
    return ResponsesRequest(body, items, chat, store, stream, prev, echo)


def _metadata(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        raise _bad(f"'metadata' must be an object of at most {MAX_METADATA} string values (keys up to 64 "
                   f"characters, values up to 512)", "metadata")


def input_items(value: Any) -> list[dict[str, Any]]:
    """``input`` as items with ids: a string is one user message."""
    if isinstance(value, str):
        return [{"type": "message", "id": new_id("msg"), "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list) or not value:
        raise _bad("'input' must be a string or a non-empty array of input items", "input")
    return [_item(x, f"input[{i}]") for i, x in enumerate(value)]


def _item(x: Any, where: str) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise _bad(f"'{where}' must be an object", where)
    kind = x.get("type", "message")
    if kind == "message":
        role = x.get("role")
        if role not in ROLES:
            raise _bad(f"'{where}.role' must be one of {', '.join(sorted(ROLES))}", f"{where}.role")
        return {"type": "message", "id": x.get("id") or new_id("msg"), "role": role, "status": "completed",
                "content": _parts(x.get("content"), f"{where}.content", role)}
    if kind == "function_call":
        for k in ("call_id", "name", "arguments"):
            if not isinstance(x.get(k), str) or (k != "arguments" and not x[k]):
                raise _bad(f"'{where}.{k}' must be a string", f"{where}.{k}")
        return {"type": "function_call", "id": x.get("id") or new_id("fc"), "call_id": x["call_id"],
                "name": x["name"], "arguments": x["arguments"], "status": "completed"}
    if kind == "function_call_output":
        if not isinstance(x.get("call_id"), str) or not x["call_id"]:
            raise _bad(f"'{where}.call_id' must be a string", f"{where}.call_id")
        if not isinstance(x.get("output"), str):
            raise _bad(f"'{where}.output' must be a string", f"{where}.output")
        return {"type": "function_call_output", "id": x.get("id") or new_id("fco"), "call_id": x["call_id"],
                "output": x["output"], "status": "completed"}
    raise _bad(f"'{where}.type' {kind!r} is not supported (message, function_call, function_call_output)",
               f"{where}.type", "unsupported_item_type")


def _parts(content: Any, where: str, role: str) -> list[dict[str, Any]]:
    text_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [{"type": text_type, "text": content}]
    if not isinstance(content, list):
        raise _bad(f"'{where}' must be a string or an array of text parts", where)
    out = []
    for i, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(p.get("text"), str):
            raise _bad(f"'{where}[{i}]' must be a text part ({{\"type\": \"input_text\", \"text\": ...}}); "
                       f"images and files are not supported", f"{where}[{i}]", "unsupported_content")
        out.append({"type": text_type, "text": p["text"]})
    return out


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad("'tools' must be an array", "tools")
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _bad(f"'tools[{i}]' must be a function tool (built-in tools are not supported)", f"tools[{i}]",
                       "unsupported_tool")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if value is None or value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise _bad("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}",
               "tool_choice")


def _format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("'text' must be an object", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("'text.format' must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad("'text.format.type' must be 'text', 'json_object' or 'json_schema'", "text.format.type")


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for input and output items (consecutive function calls make one assistant turn)."""
    out: list[dict[str, Any]] = []
    for it in items:
        kind = it["type"]
        if kind == "message":
            text = "".join(p["text"] for p in it["content"])
            out.append({"role": it["role"], "content": text})
        elif kind == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return out


# --- answers ---------------------------------------------------------------------------------

def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A Responses ``usage`` from the worker's chat usage: ``input_tokens_details.cached_tokens``
    is its ``prompt_tokens_details.cached_tokens`` (a continued conversation's earlier turns are
    the prompt's prefix, so the worker that served them has their KV cached)."""
    if not chat_usage:
        return None
    pt, ct = int(chat_usage.get("prompt_tokens") or 0), int(chat_usage.get("completion_tokens") or 0)
    return {"input_tokens": pt, "input_tokens_details": {"cached_tokens": min(cached_tokens(chat_usage), pt)},
            "output_tokens": ct, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": pt + ct}


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_object(req: ResponsesRequest, response_id: str, created_at: float, model: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None, finish: str | None,
                    status: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Response object (``status`` from ``finish``: ``length`` is ``incomplete``)."""
    incomplete = finish == "length"
    st = status or ("incomplete" if incomplete else "completed")
    return {"id": response_id, "object": "response", "created_at": int(created_at), "status": st,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if incomplete and st != "failed"
            else None, "model": model, "output": output, "usage": usage, "store": req.store,
            **req.echo}


def answer(req: ResponsesRequest, response_id: str, created_at: float, model: str,
           chat: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion answer as a Response object."""
    choice = (chat.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    output = []
    if msg.get("content"):
        output.append(message_item(msg["content"]))
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") or {}
        output.append(call_item(call.get("id") or new_id("call"), fn.get("name", ""), fn.get("arguments", "")))
    if not output:
        output.append(message_item(""))
    return response_object(req, response_id, created_at, model, output, usage_of(chat.get("usage")),
                           choice.get("finish_reason"))


def _event(kind: str, seq: int, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, "sequence_number": seq,
                                                                     **fields}) + b"\n\n"


class StreamTranslator:
    """Chat completion chunks in, Responses events out (``feed`` takes complete SSE events, as
    ``gateway.proxy.relay_sse`` passes them on; ``finish`` ends the stream)."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.req = req
        self.id = response_id
        self.model = model
        self.created_at = time.time()
        self.seq = 0
        self.text: list[str] = []
        self.msg_id: str | None = None
        self.calls: dict[int, dict[str, Any]] = {}
        """Tool call index -> its item (arguments growing)."""
        self.order: list[tuple[str, Any]] = []
        """Output items in the order they opened: ("message", None) or ("call", index)."""
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.error: dict[str, Any] | None = None

    def _next(self, kind: str, **fields: Any) -> bytes:
        out = _event(kind, self.seq, **fields)
        self.seq += 1
        return out

    def start(self) -> bytes:
        shell = response_object(self.req, self.id, self.created_at, self.model, [], None, None, status="in_progress")
        return self._next("response.created", response=shell) + self._next("response.in_progress", response=shell)

    def feed(self, events: bytes) -> bytes:
        out = []
        for event in events.split(b"\n\n"):
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            try:
                chunk = orjson.loads(event[6:])
            except orjson.JSONDecodeError:
                continue
            if not isinstance(chunk, dict):
                continue
            if "error" in chunk:
                self.error = {"code": (chunk["error"] or {}).get("code") or "server_error",
                              "message": (chunk["error"] or {}).get("message") or "the worker failed"}
                continue
            if isinstance(chunk.get("usage"), dict) and not chunk.get("choices"):
                self.usage = usage_of(chunk["usage"])
            for choice in chunk.get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue
                out.extend(self._delta(choice.get("delta") or {}))
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]
        return b"".join(out)

    def _delta(self, delta: dict[str, Any]) -> list[bytes]:
        out = []
        content = delta.get("content")
        if content:
            if self.msg_id is None:
                self.msg_id = new_id("msg")
                self.order.append(("message", None))
                out.append(self._next("response.output_item.added", output_index=len(self.order) - 1,
                                      item=message_item("", self.msg_id, "in_progress") | {"content": []}))
                out.append(self._next("response.content_part.added", item_id=self.msg_id,
                                      output_index=len(self.order) - 1, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
            self.text.append(content)
            out.append(self._next("response.output_text.delta", item_id=self.msg_id, output_index=self._index(None),
                                  content_index=0, delta=content, logprobs=[]))
        for call in delta.get("tool_calls") or []:
            i = call.get("index", 0)
            fn = call.get("function") or {}
            item = self.calls.get(i)
            if item is None:
                item = self.calls[i] = call_item(call.get("id") or new_id("call"), fn.get("name") or "", "",
                                                 status="in_progress")
                self.order.append(("call", i))
                out.append(self._next("response.output_item.added", output_index=len(self.order) - 1,
                                      item=dict(item)))
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                out.append(self._next("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._index(i), delta=fn["arguments"]))
        return out

    def _index(self, call: int | None) -> int:
        return self.order.index(("message", None) if call is None else ("call", call))

    def output(self) -> list[dict[str, Any]]:
        items = []
        for kind, i in self.order:
            if kind == "message":
                items.append(message_item("".join(self.text), self.msg_id))
            else:
                items.append(dict(self.calls[i], status="completed"))
        return items

    def result(self) -> dict[str, Any]:
        """The final Response object: ``completed`` (``incomplete`` on ``length``), or ``failed``
        when the stream broke."""
        if self.error is not None:
            return response_object(self.req, self.id, self.created_at, self.model, self.output(), self.usage,
                                   None, status="failed", error=self.error)
        return response_object(self.req, self.id, self.created_at, self.model, self.output(), self.usage,
                               self.finish_reason)

    def finish(self) -> bytes:
        """The closing events: each item done, then the :meth:`result` as ``response.completed``,
        ``response.incomplete`` or ``response.failed``."""
        out = []
        for n, (kind, i) in enumerate(self.order):
            if kind == "message":
                text = "".join(self.text)
                out.append(self._next("response.output_text.done", item_id=self.msg_id, output_index=n,
                                      content_index=0, text=text, logprobs=[]))
                out.append(self._next("response.content_part.done", item_id=self.msg_id, output_index=n,
                                      content_index=0, part={"type": "output_text", "text": text,
                                                             "annotations": [], "logprobs": []}))
                out.append(self._next("response.output_item.done", output_index=n,
                                      item=message_item(text, self.msg_id)))
            else:
                item = dict(self.calls[i], status="completed")
                out.append(self._next("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=n, arguments=item["arguments"]))
                out.append(self._next("response.output_item.done", output_index=n, item=item))
        final = self.result()
        out.append(self._next(f"response.{final['status']}", response=final))
        return b"".join(out)
