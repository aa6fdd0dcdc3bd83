"""OpenAI request bodies -> validated engine requests; engine results -> OpenAI responses.

Every invalid input raises ``RequestError`` carrying the HTTP status and an OpenAI
error body; nothing here touches the engine's state.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from engine.sequence import SamplingParams
from engine.tokenizer import ChatTemplateError, TextTokenizer
from loraplex.wire import EXT_KEY, WorkerRequestExt, error_body

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_STOP_SEQUENCES = 16
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    # parameter -> the values that mean "off" (anything else is refused, never silently ignored)
    "logprobs": (False, 0), "top_logprobs": (0,), "best_of": (1,), "echo": (False,), "suffix": ("",),
    "tools": ([],), "logit_bias": ({},), "response_format": ({"type": "text"},),
}


class RequestError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type=type, code=code, param=param)


@dataclass
class GenerationRequest:
    kind: str
    """``chat`` or ``completion``."""
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    ext: WorkerRequestExt
    id: str


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(400, f"request body is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                           code="invalid_utf8") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, "
                                f"column {exc.colno})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object", code="invalid_json")
    return body


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float, *,
            lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise RequestError(400, f"'{key}' must be a number", code="invalid_value", param=key)
    if (v <= lo if lo_open else v < lo) or v > hi:
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise RequestError(400, f"'{key}' must be in {bound}, got {v}", code="invalid_value", param=key)
    return float(v)


def _int(body: dict[str, Any], key: str, default: int | None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise RequestError(400, f"'{key}' must be an integer", code="invalid_value", param=key)
    return v


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(400, f"messages[{i}].content: only text parts are supported",
                                   code="invalid_value", param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts",
                       code="invalid_value", param=f"messages[{i}].content")


def _chat_prompt(body: dict[str, Any], tok: TextTokenizer) -> list[int]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, "'messages' must be a non-empty list", code="invalid_value", param="messages")
    clean: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError(400, f"messages[{i}] must be an object", code="invalid_value", param="messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(400, f"messages[{i}].role {role!r} is not one of {', '.join(sorted(CHAT_ROLES))}",
                               code="invalid_value", param=f"messages[{i}].role")
        clean.append({"role": role, "content": _content_text(m.get("content"), i)})
    if all(not m["content"] for m in clean):
        raise RequestError(400, "every message is empty", code="invalid_value", param="messages")
    try:
        return tok.encode_chat(clean, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise RequestError(400, str(exc), code="invalid_value", param="messages") from None


def _completion_prompt(body: dict[str, Any], tok: TextTokenizer) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if not p:
            raise RequestError(400, "'prompt' is empty", code="invalid_value", param="prompt")
        return tok.encode(p, add_special_tokens=True)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        vocab = tok.vocab_size
        if any(t < 0 or t >= vocab for t in p):
            raise RequestError(400, f"'prompt' token ids must be in [0, {vocab})", code="invalid_value",
                               param="prompt")
        return list(p)
    if isinstance(p, list) and len(p) > 1:
        raise RequestError(400, "batched prompts are not supported; send one prompt per request",
                           code="invalid_value", param="prompt")
    raise RequestError(400, "'prompt' must be a non-empty string or a list of token ids",
                       code="invalid_value", param="prompt")


def parse_request(body: dict[str, Any], kind: str, tok: TextTokenizer, max_model_len: int,
                  default_model: str) -> GenerationRequest:
    n = _int(body, "n", 1)
    if n != 1:
        raise RequestError(400, f"'n' must be 1 (got {n}); send separate requests", code="invalid_value",
                           param="n")
    for key, allowed in _UNSUPPORTED.items():
        v = body.get(key)
        if v is not None and v not in allowed:
            raise RequestError(400, f"'{key}' is not supported by this worker", code="unsupported_parameter",
                               param=key)
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, 0.0, -2.0, 2.0) != 0.0:
            raise RequestError(400, f"'{key}' is not supported (must be 0)", code="unsupported_parameter",
                               param=key)
    if _number(body, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True) != 1.0:
        raise RequestError(400, "'repetition_penalty' is not supported (must be 1)", code="unsupported_parameter",
                           param="repetition_penalty")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", -1)
    assert top_k is not None
    if top_k < -1:
        raise RequestError(400, f"'top_k' must be -1 (off), 0 (off) or positive, got {top_k}",
                           code="invalid_value", param="top_k")
    seed = _int(body, "seed", None)
    if seed is not None and not (-(2 ** 63) <= seed < 2 ** 64):
        raise RequestError(400, "'seed' is out of range", code="invalid_value", param="seed")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP_SEQUENCES:
        stops = tuple(s for s in stop if s)
    else:
        raise RequestError(400, f"'stop' must be a string or a list of at most {MAX_STOP_SEQUENCES} strings",
                           code="invalid_value", param="stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise RequestError(400, "'stop_token_ids' must be a list of integers", code="invalid_value",
                           param="stop_token_ids")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean", code="invalid_value", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise RequestError(400, "'stream_options' must be an object", code="invalid_value", param="stream_options")
    include_usage = bool(opts.get("include_usage", False))
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise RequestError(400, "'ignore_eos' must be a boolean", code="invalid_value", param="ignore_eos")
    model = body.get("model") or default_model
    if not isinstance(model, str):
        raise RequestError(400, "'model' must be a string", code="invalid_value", param="model")
    raw_ext = body.get(EXT_KEY)
    if raw_ext is None:
        ext = WorkerRequestExt()
    else:
        try:
            if not isinstance(raw_ext, dict):
                raise TypeError("not an object")
            ext = WorkerRequestExt.from_dict(raw_ext)
        except (TypeError, ValueError, KeyError) as exc:
            raise RequestError(400, f"'{EXT_KEY}' is malformed: {exc}", code="invalid_value",
                               param=EXT_KEY) from None

    prompt_ids = _chat_prompt(body, tok) if kind == "chat" else _completion_prompt(body, tok)
    if not prompt_ids:
        raise RequestError(400, "the prompt encodes to no tokens", code="invalid_value")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise RequestError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt "
                                f"has {len(prompt_ids)} tokens", code="context_length_exceeded",
                           param="messages" if kind == "chat" else "prompt")
    key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _int(body, key, None)
    if max_tokens is None:
        max_tokens = room if kind == "chat" else min(16, room)
    if max_tokens < 1:
        raise RequestError(400, f"'{key}' must be at least 1, got {max_tokens}", code="invalid_value", param=key)
    if max_tokens > room:
        raise RequestError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt "
                                f"has {len(prompt_ids)} tokens and '{key}' asks for {max_tokens} more",
                           code="context_length_exceeded", param=key)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            stop=stops, stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    rid = prefix + (ext.request_id or uuid.uuid4().hex)
    return GenerationRequest(kind, model, prompt_ids, params, stream, include_usage, ext, rid)


# ------------------------------------------------------------------------------ responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(req: GenerationRequest, text: str, finish_reason: str | None, completion_tokens: int,
                  created: int) -> dict[str, Any]:
    if req.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": req.id, "object": obj, "created": created, "model": req.model, "choices": [choice],
            "usage": usage(len(req.prompt_ids), completion_tokens)}


def stream_chunk(req: GenerationRequest, created: int, text: str | None, finish_reason: str | None,
                 first: bool = False) -> dict[str, Any]:
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    chunk: dict[str, Any] = {"id": req.id, "object": obj, "created": created, "model": req.model,
                             "choices": [choice]}
    if req.include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(req: GenerationRequest, created: int, completion_tokens: int) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": req.id, "object": obj, "created": created, "model": req.model, "choices": [],
            "usage": usage(len(req.prompt_ids), completion_tokens)}


def now() -> int:
    return int(time.time())
