"""The OpenAI request fields, read one way by the gateway and by the workers.

``parse(body, chat=...)`` returns an ``OpenAIRequest`` (with the cleaned chat messages fed to
the chat template) or raises ``FieldError`` (message, param, code), which each side turns into
its own 400. On both routes ``max_completion_tokens`` wins over ``max_tokens``.

Logprobs are read into one form for both routes: ``logprobs`` (bool) and ``top_logprobs``
(chat: ``top_logprobs`` 0-20, which needs ``logprobs: true``; completions: ``logprobs`` 0-5
is the number of alternatives). ``logit_bias`` maps token ids (JSON object keys) to a bias
in [-100, 100]; whether an id is in the vocabulary is the worker's check.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from loraplex.tool_calls import ToolError, ToolSpec, clean_tool_message, forced_schema, parse_tools

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_SEQUENCES = 16
"""OpenAI allows 4; more are accepted (as vLLM does)."""
MAX_N = 16
"""Samples per request (``n``)."""
MAX_METADATA = 16
"""Key-value pairs in ``metadata`` (keys up to 64 characters, values up to 512), as in the API."""
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_LOGIT_BIAS = 1024
"""Entries in ``logit_bias``."""
MAX_GRAMMAR_BYTES = 128 * 1024
"""Compact JSON text of the schema an output is constrained to (``response_format``, or the
forced tools): grammar compilation grows faster than linearly with it (1.2-1.5 s of one core for
3,000 required properties, 130 KB, against SmolLM2's 49k-token vocabulary; 20,000 took 16 s on
two). Past it the request is refused ``response_format_too_complex`` before any compiling; the
worker also bounds each compile's CPU time (``grammar_compile_budget_s``), for small schemas
that compile slowly."""


_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FieldError(ValueError):
    """An invalid request field (the caller answers 400)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """``response_format`` of type ``json_object`` or ``json_schema`` (``text`` reads as None)."""

    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    """None for ``json_object`` and for a ``json_schema`` without a schema (any JSON object)."""
    strict: bool | None = None


@dataclass(slots=True)
class OpenAIRequest:
    chat: bool
    model: str | None
    messages: list[dict[str, Any]] | None
    """Chat: ``[{"role", "content"}]`` with text content only (what the chat template renders), plus
    an assistant turn's ``tool_calls`` and a tool turn's ``tool_call_id`` (``loraplex.tool_calls``)."""
    prompt: str | list[int] | None
    """Completions: the text, or the token ids."""
    stream: bool
    include_usage: bool
    continuous_usage: bool
    """``stream_options.continuous_usage_stats``: every chunk carries the usage so far (as vLLM)."""
    max_tokens: int | None
    """The winning field's value (None: neither given)."""
    max_tokens_param: str
    n: int = 1
    """Choices to generate; each may take ``max_tokens`` (the gateway reserves for all)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    """The client's labels: not generated from; a canary check may be judged per label."""
    logprobs: bool = False
    top_logprobs: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    """``(token id, bias)`` pairs, ids ascending."""
    response_format: ResponseFormat | None = None
    tools: ToolSpec | None = None
    """Tools the model may call (None: none, or ``tool_choice: "none"``)."""
    grammar: str | None = None
    """The output's grammar (``spec_key``): the forced tools' schema, or ``response_format``'s."""


def spec_key(kind: str, schema: dict[str, Any] | None) -> str:
    """The compact text of a format: what the worker compiles, and its cache key's preimage.
    Key order is kept: properties are generated in the order the schema declares them."""
    if kind == "json_object":
        return "json_object"
    return "json_schema:" + json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def _grammar(req: OpenAIRequest) -> str | None:
    """``req``'s grammar text, refused ``response_format_too_complex`` past ``MAX_GRAMMAR_BYTES``."""
    if req.tools is not None and req.tools.forced:
        key, param = spec_key("json_schema", forced_schema(req.tools)), "tools"
    elif req.response_format is not None:
        key, param = spec_key(req.response_format.type, req.response_format.schema), "response_format"
    else:
        return None
    size = len(key.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise FieldError(f"the output's JSON schema is {size} bytes as compact JSON; this server compiles schemas "
                         f"of at most {MAX_GRAMMAR_BYTES} bytes", param, code="response_format_too_complex")
    return key


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise FieldError(f"'{key}' must be a number", key)
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise FieldError(f"'{key}' must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}", key)
    return float(v)


def _int(body: dict[str, Any], key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise FieldError(f"'{key}' must be an integer", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise FieldError(f"'{key}' must be {bound}, got {v}", key)
    return v


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in value.items()):
        raise FieldError(f"'metadata' must be an object of at most {MAX_METADATA} string values (keys up to 64 "
                         f"characters, values up to 512)", "metadata")
    return value or None


def _bool(body: dict[str, Any], key: str, param: str | None = None) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise FieldError(f"'{param or key}' must be a boolean", param or key)
    return v


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise FieldError("only text content parts are supported", f"{param}[{i}]")
            parts.append(part["text"])
        return "".join(parts)
    raise FieldError("content must be a string or a list of text parts", param)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise FieldError("'messages' must be a non-empty list", "messages")
    clean: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise FieldError("each message must be an object", param)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise FieldError(f"role {role!r} is not one of {', '.join(sorted(ROLES))}" if isinstance(role, str)
                             else "message role must be a string", f"{param}.role")
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise FieldError("message content is required", f"{param}.content")
            text = ""
        else:
            text = _content(content, f"{param}.content")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise FieldError("'name' must be a string", f"{param}.name")
        cm: dict[str, Any] = {"role": role, "content": text}
        if role == "tool" or "tool_calls" in m:
            clean_tool_message(m, cm, param)
        clean.append(cm)
    if all(not m["content"] and not m.get("tool_calls") for m in clean):
        raise FieldError("every message is empty", "messages")
    return clean


def _ids(p: list[Any]) -> bool:
    return bool(p) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)


def _prompt(body: dict[str, Any]) -> str | list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise FieldError("'prompt' is empty", "prompt")
        return p
    if isinstance(p, list) and _ids(p):
        return p
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, str | list) for x in p):
        raise FieldError("batched prompts are not supported; send one prompt per request", "prompt")
    raise FieldError("'prompt' must be a non-empty string or a list of non-negative token ids", "prompt")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list) and len(stop) <= MAX_STOP_SEQUENCES and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise FieldError(f"'stop' must be a string or a list of up to {MAX_STOP_SEQUENCES} strings", "stop")


_SAMPLING = frozenset({"temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                       "top_k", "seed", "logprobs", "top_logprobs", "stop", "stop_token_ids", "ignore_eos",
                       "logit_bias", "response_format"})
"""Optional fields most requests leave out (checked only when one is present)."""


def _logprobs(body: dict[str, Any], req: OpenAIRequest) -> None:
    logprobs = body.get("logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if req.chat:
        if logprobs is not None and not isinstance(logprobs, bool):
            raise FieldError("'logprobs' must be a boolean", "logprobs")
        if top and not logprobs:
            raise FieldError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        req.logprobs = bool(logprobs)
        req.top_logprobs = top or 0
        return
    if top is not None:
        raise FieldError("'top_logprobs' is a chat field; completions take 'logprobs': <int>", "top_logprobs")
    if logprobs is None:
        return
    if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise FieldError(f"'logprobs' must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]", "logprobs")
    req.logprobs = True
    req.top_logprobs = logprobs


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise FieldError("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise FieldError(f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
    out: dict[int, float] = {}
    for key, v in bias.items():
        if not isinstance(key, str) or not key.isascii() or not key.isdigit():
            raise FieldError(f"'logit_bias' key {key!r} is not a token id", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not -100 <= v <= 100:
            raise FieldError(f"'logit_bias' value for token {key} must be a number in [-100, 100]", "logit_bias")
        out[int(key)] = float(v)
    return tuple(sorted(out.items()))


def _response_format(body: dict[str, Any]) -> ResponseFormat | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise FieldError("'response_format' must be an object", "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise FieldError(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                         "response_format.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise FieldError("'response_format.json_schema' must be an object with 'name' and 'schema'",
                         "response_format.json_schema")
    name = js.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise FieldError("'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-'",
                         "response_format.json_schema.name")
    schema = js.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise FieldError("'response_format.json_schema.schema' must be a JSON Schema object",
                         "response_format.json_schema.schema")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise FieldError("'response_format.json_schema.strict' must be a boolean",
                         "response_format.json_schema.strict")
    if not schema:
        return ResponseFormat("json_object", name=name, strict=strict)
    return ResponseFormat("json_schema", name=name, schema=schema, strict=strict)


def _sampling(body: dict[str, Any], req: OpenAIRequest) -> None:
    req.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    req.top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    req.presence_penalty = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    req.frequency_penalty = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    req.repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True)
    top_k = _int(body, "top_k", -1)
    req.top_k = -1 if top_k is None else top_k
    req.seed = _int(body, "seed", -(2**63), 2**64 - 1)
    _logprobs(body, req)
    req.stop = _stop(body)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise FieldError("'stop_token_ids' must be a list of integers", "stop_token_ids")
        req.stop_token_ids = tuple(ids)
    req.ignore_eos = _bool(body, "ignore_eos")
    req.logit_bias = _logit_bias(body)
    req.response_format = _response_format(body)


def parse(body: Any, *, chat: bool, max_tokens_cap: int | None = None) -> OpenAIRequest:
    """Check an OpenAI body (``chat``: /v1/chat/completions, else /v1/completions)."""
    try:
        return _parse(body, chat=chat, max_tokens_cap=max_tokens_cap)
    except ToolError as exc:
        raise FieldError(exc.message, exc.param, exc.code) from None


def _parse(body: Any, *, chat: bool, max_tokens_cap: int | None) -> OpenAIRequest:
    if not isinstance(body, dict):
        raise FieldError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise FieldError("'model' must be a string", "model")
    messages = _messages(body) if chat else None
    prompt = None if chat else _prompt(body)
    stream = _bool(body, "stream")
    include_usage = continuous = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise FieldError("'stream_options' must be an object", "stream_options")
        include_usage = _bool(opts, "include_usage", "stream_options.include_usage") and stream
        continuous = _bool(opts, "continuous_usage_stats", "stream_options.continuous_usage_stats") and stream
    n = _int(body, "n", 1, MAX_N) or 1
    mt = _int(body, "max_tokens", 1, max_tokens_cap)
    mct = _int(body, "max_completion_tokens", 1, max_tokens_cap)
    param = "max_completion_tokens" if mct is not None else "max_tokens"
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise FieldError("'user' must be a string", "user")
    req = OpenAIRequest(chat=chat, model=model, messages=messages, prompt=prompt, stream=stream,
                        include_usage=include_usage, continuous_usage=continuous,
                        max_tokens=mct if mct is not None else mt, max_tokens_param=param, user=user, n=n,
                        metadata=_metadata(body.get("metadata")))
    if not _SAMPLING.isdisjoint(body):
        _sampling(body, req)
    if "tools" in body or "tool_choice" in body:
        req.tools = parse_tools(body, chat)
        if req.tools is not None and req.tools.forced and req.response_format is not None:
            raise FieldError("'response_format' cannot be combined with a forced 'tool_choice'", "response_format")
    req.grammar = _grammar(req)
    return req
