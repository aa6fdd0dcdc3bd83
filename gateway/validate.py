"""Validation of OpenAI request bodies, and the conservative prompt-token estimate.

The gateway refuses what a worker could not serve (wrong types, unknown roles, empty
messages, absurd ``max_tokens``, ``n`` > 1, sampling values out of range) with a 400 in
the OpenAI shape, before any limit is spent. Unknown extra fields pass through.

Prompt tokens are estimated without a tokenizer (the gateway never imports torch): a
byte-level BPE token covers at least one UTF-8 byte, so the byte count of every text
field plus a per-message allowance for the chat template is an upper bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gateway.errors import GatewayError
from loraplex.wire import EXT_KEY

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MESSAGE_OVERHEAD_TOKENS = 8
"""Chat-template tokens per message (role markers, separators), generously counted."""
REQUEST_OVERHEAD_TOKENS = 64
"""Tokens the template adds once per request: the generation prompt and the default system
prompt some chat templates inject (SmolLM2's adds ~30 tokens when none is given)."""


@dataclass(slots=True)
class ValidRequest:
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int
    prompt_tokens: int
    user: str | None

    @property
    def reserve_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens


def _bad(message: str, param: str | None = None, status: int = 400) -> GatewayError:
    return GatewayError(status, message, code="invalid_value" if status == 400 else "invalid_type",
                        param=param)


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(f"'{name}' must be a number", name)
    if not lo <= value <= hi:
        raise _bad(f"'{name}' must be between {lo:g} and {hi:g}", name)


def _int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", name)
    if not lo <= value <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}", name)
    return value


def _text_bytes(content: Any, param: str) -> int:
    if isinstance(content, str):
        return len(content.encode("utf-8", "surrogatepass"))
    if isinstance(content, list):
        total = 0
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad("only text content parts are supported", f"{param}[{i}]")
            total += len(part["text"].encode("utf-8", "surrogatepass"))
        return total
    raise _bad("content must be a string or a list of text parts", param)


def _messages(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _bad("'messages' must be a list", "messages")
    if not messages:
        raise _bad("'messages' must not be empty", "messages")
    total = REQUEST_OVERHEAD_TOKENS
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _bad("each message must be an object", param)
        role = msg.get("role")
        if role not in ROLES:
            raise _bad(f"unknown role {role!r}" if isinstance(role, str) else "message role must be a string",
                       f"{param}.role")
        content = msg.get("content")
        if content is None:
            if role != "assistant":
                raise _bad("message content is required", f"{param}.content")
        else:
            total += _text_bytes(content, f"{param}.content")
        name = msg.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise _bad("'name' must be a string", f"{param}.name")
            total += len(name.encode("utf-8", "surrogatepass"))
        total += MESSAGE_OVERHEAD_TOKENS
    return total


def _prompt(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return REQUEST_OVERHEAD_TOKENS + len(prompt.encode("utf-8", "surrogatepass"))
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return REQUEST_OVERHEAD_TOKENS + len(prompt[0].encode("utf-8", "surrogatepass"))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return REQUEST_OVERHEAD_TOKENS + len(prompt)
    raise _bad("'prompt' must be a string, a list of one string, or a list of token ids", "prompt")


_SAMPLING = frozenset({"temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                       "top_k", "seed", "logprobs", "top_logprobs", "stop"})
"""Optional sampling fields (most requests set none of them, so they are checked only when present)."""


def _sampling(body: dict[str, Any], chat: bool) -> None:
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    if body.get("top_p") == 0:
        raise _bad("'top_p' must be greater than 0", "top_p")
    _number(body, "presence_penalty", -2.0, 2.0)
    _number(body, "frequency_penalty", -2.0, 2.0)
    _number(body, "repetition_penalty", 0.01, 10.0)
    _int(body, "top_k", -1, 1_000_000)
    _int(body, "seed", -(2**63), 2**64 - 1)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool if chat else int):
        raise _bad("'logprobs' has the wrong type", "logprobs")
    _int(body, "top_logprobs", 0, 20)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            pass
        elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
            pass
        else:
            raise _bad("'stop' must be a string or a list of up to 4 non-empty strings", "stop")


def validate(body: Any, *, chat: bool, max_tokens_cap: int, default_max_tokens: int) -> ValidRequest:
    """Check an OpenAI chat/completions body; fill ``max_tokens`` so the reservation bounds usage."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    if EXT_KEY in body:
        raise _bad(f"'{EXT_KEY}' is reserved", EXT_KEY)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' must be a non-empty string", "model")
    prompt_tokens = _messages(body) if chat else _prompt(body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        inc = opts.get("include_usage", False)
        if not isinstance(inc, bool):
            raise _bad("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
        include_usage = inc and stream
    n = _int(body, "n", 1, 1_000_000)
    if n is not None and n != 1:
        raise _bad("only n=1 is supported", "n")
    mt = _int(body, "max_tokens", 1, max_tokens_cap)
    mct = _int(body, "max_completion_tokens", 1, max_tokens_cap)
    max_tokens = mct if mct is not None else mt
    if max_tokens is None:
        max_tokens = default_max_tokens
        body["max_tokens"] = max_tokens
    if not _SAMPLING.isdisjoint(body):
        _sampling(body, chat)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")
    return ValidRequest(body=body, model=model, stream=stream, include_usage=include_usage,
                        max_tokens=max_tokens, prompt_tokens=prompt_tokens, user=user)
