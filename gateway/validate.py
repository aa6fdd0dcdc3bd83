"""The gateway's side of a request body: the shared field checks, and the reservation rule.

``validate`` adds to ``loraplex.openai_request`` what only the gateway needs (a ``model`` alias,
the reserved ``"loraplex"`` key); ``estimate`` is the byte-based prompt bound and ``reserve``
the reservation rule (docs/DESIGN.md, "Count and plan").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.errors import GatewayError
from loraplex.openai_request import FieldError, OpenAIRequest, parse
from loraplex.tool_calls import DEFAULT_TOOL_PROMPT
from loraplex.wire import EXT_KEY

MESSAGE_OVERHEAD_TOKENS = 8
"""Chat-template tokens per message (role markers, separators), generously counted."""
REQUEST_OVERHEAD_TOKENS = 64
"""Tokens the template adds once per request: the generation prompt and the default system
prompt some chat templates inject (SmolLM2's adds ~30 tokens when none is given)."""


@dataclass(slots=True)
class ValidRequest:
    body: dict[str, Any]
    fields: OpenAIRequest
    model: str

    @property
    def stream(self) -> bool:
        return self.fields.stream

    @property
    def include_usage(self) -> bool:
        return self.fields.include_usage

    @property
    def user(self) -> str | None:
        return self.fields.user


def validate(body: Any, *, chat: bool, max_tokens_cap: int) -> ValidRequest:
    """Check an OpenAI chat/completions body: 400 in the OpenAI shape when invalid."""
    if isinstance(body, dict) and EXT_KEY in body:
        raise GatewayError(400, f"'{EXT_KEY}' is reserved", code="invalid_value", param=EXT_KEY)
    try:
        fields = parse(body, chat=chat, max_tokens_cap=max_tokens_cap)
    except FieldError as exc:
        raise GatewayError(400, exc.message, code=exc.code, param=exc.param) from None
    if not fields.model:
        raise GatewayError(400, "'model' must be a non-empty string", code="invalid_value", param="model")
    return ValidRequest(body=body, fields=fields, model=fields.model)


def _bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def estimate(fields: OpenAIRequest) -> int:
    """An upper bound of the prompt tokens without a tokenizer."""
    if fields.messages is not None:
        n = REQUEST_OVERHEAD_TOKENS + sum(_bytes(m["content"]) + MESSAGE_OVERHEAD_TOKENS
                                          for m in fields.messages)
        if fields.tools is not None or any(len(m) > 2 for m in fields.messages):  # tool turns, tool list
            n += _bytes(json.dumps([m.get("tool_calls") for m in fields.messages], ensure_ascii=False))
            n += 0 if fields.tools is None else _bytes(DEFAULT_TOOL_PROMPT) + sum(
                _bytes(json.dumps(t.openai(), ensure_ascii=False)) for t in fields.tools.tools)
        return n
    if isinstance(fields.prompt, str):
        return REQUEST_OVERHEAD_TOKENS + _bytes(fields.prompt)
    return len(fields.prompt or ())


@dataclass(slots=True)
class Reservation:
    prompt_tokens: int
    """Exact, or the upper bound (``exact`` False)."""
    exact: bool
    max_tokens: int
    """What the worker is told to generate at most."""
    tokens: int
    """What the limiter reserves."""
    n: int = 1
    """Choices: each may generate ``max_tokens``."""

    @property
    def completion_bound(self) -> int:
        return self.n * self.max_tokens


def reserve(fields: OpenAIRequest, prompt_tokens: int, *, exact: bool, max_model_len: int | None,
            tokens_per_min: int, default_max_tokens: int) -> Reservation:
    """The reservation rule (module docstring); 400 when the request can never be served."""
    param = fields.max_tokens_param
    n = fields.n
    where = "messages" if fields.chat else "prompt"
    room = max_model_len - prompt_tokens if exact and max_model_len else None
    if room is not None and room < 1:
        raise GatewayError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                                f"{prompt_tokens} tokens", code="context_length_exceeded", param=where)
    max_tokens = fields.max_tokens
    if max_tokens is not None:
        if room is not None and max_tokens > room:
            raise GatewayError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt "
                                    f"has {prompt_tokens} tokens and '{param}' asks for {max_tokens} more",
                               code="context_length_exceeded", param=param)
    else:
        max_tokens = default_max_tokens if room is None else min(default_max_tokens, room)
        if tokens_per_min > 0:
            max_tokens = max(1, min(max_tokens, (tokens_per_min - prompt_tokens) // n))
    tokens = prompt_tokens + n * max_tokens  # the prompt is computed once; each choice may run to max_tokens
    if tokens_per_min > 0 and tokens > tokens_per_min:
        if not exact:
            tokens = tokens_per_min  # the estimate is only a bound: never refuse on it
        elif prompt_tokens >= tokens_per_min:
            raise GatewayError(400, f"The prompt has {prompt_tokens} tokens; this tenant's limit is "
                                    f"{tokens_per_min} tokens per minute, so it can never be served. Shorten "
                                    f"the prompt.", code="request_exceeds_token_limit", param=where)
        else:
            each = f" for each of {n} choices" if n > 1 else ""
            raise GatewayError(400, f"The prompt has {prompt_tokens} tokens and '{param}' asks for {max_tokens} "
                                    f"more{each} ({tokens} in all); this tenant's limit is {tokens_per_min} tokens "
                                    f"per minute, so it can never be served. Ask for at most "
                                    f"{(tokens_per_min - prompt_tokens) // n} tokens{each}.",
                               code="request_exceeds_token_limit", param=param)
    return Reservation(prompt_tokens, exact, max_tokens, tokens, n)
