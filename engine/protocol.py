"""OpenAI request bodies -> validated engine requests; engine results -> OpenAI responses.

The fields are read by ``loraplex.openai_request`` (the gateway reads them the same way);
here is only what is the engine's: supported parameters, tokenizing, context length.

Every invalid input raises ``RequestError`` carrying the HTTP status and an OpenAI
error body; nothing here touches the engine's state.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from engine.sequence import SamplingParams, TokenLogprob
from loraplex import json_body
from loraplex.openai_request import FieldError, OpenAIRequest
from loraplex.openai_request import parse as parse_fields
from loraplex.tokenizer import ChatTemplateError, TextTokenizer
from loraplex.tool_calls import ToolSpec, parse_output, render_prompt
from loraplex.wire import EXT_KEY, WorkerRequestExt, error_body

_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    # parameter -> the values that mean "off" (anything else is refused, never silently ignored)
    "best_of": (1,), "echo": (False,), "suffix": ("",),
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
    continuous_usage: bool = False
    """Every stream chunk carries the usage so far (``stream_options.continuous_usage_stats``)."""
    tools: ToolSpec | None = None
    """Chat with callable tools: the answer is parsed for calls (``loraplex.tool_calls``)."""
    grammar: Any = None
    """``params.grammar`` compiled (``engine.grammar.Grammars.prepare``), once the worker has it."""


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json_body.loads(raw)
    except json_body.BodyError as exc:
        raise RequestError(400, exc.message, code=exc.code, param=exc.param) from None
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object", code="invalid_json")
    return body


def _chat_prompt(messages: list[dict[str, Any]], tools: ToolSpec | None, tok: TextTokenizer) -> list[int]:
    try:
        return tok.encode(render_prompt(tok, messages, tools), add_special_tokens=False)
    except ChatTemplateError as exc:
        raise RequestError(400, str(exc), code="invalid_value", param="messages") from None


def _completion_prompt(prompt: str | list[int], tok: TextTokenizer) -> list[int]:
    if isinstance(prompt, str):
        return tok.encode(prompt, add_special_tokens=True)
    vocab = tok.vocab_size
    if any(t >= vocab for t in prompt):
        raise RequestError(400, f"'prompt' token ids must be in [0, {vocab})", code="invalid_value", param="prompt")
    return list(prompt)


def _ext(body: dict[str, Any]) -> WorkerRequestExt:
    raw_ext = body.get(EXT_KEY)
    if raw_ext is None:
        return WorkerRequestExt()
    try:
        if not isinstance(raw_ext, dict):
            raise TypeError("not an object")
        return WorkerRequestExt.from_dict(raw_ext)
    except (TypeError, ValueError, KeyError) as exc:
        raise RequestError(400, f"'{EXT_KEY}' is malformed: {exc}", code="invalid_value", param=EXT_KEY) from None


def _supported(body: dict[str, Any], fields: OpenAIRequest, tok: TextTokenizer) -> None:
    """Refuse what this engine does not implement (never silently ignored)."""
    for key, allowed in _UNSUPPORTED.items():
        v = body.get(key)
        if v is not None and v not in allowed:
            raise RequestError(400, f"'{key}' is not supported by this worker", code="unsupported_parameter",
                               param=key)
    vocab = tok.vocab_size
    for t, _ in fields.logit_bias:
        if t >= vocab:
            raise RequestError(400, f"'logit_bias' names token {t}; this model's token ids are in [0, {vocab})",
                               code="invalid_value", param="logit_bias")


def parse_request(body: dict[str, Any], kind: str, tok: TextTokenizer, max_model_len: int,
                  default_model: str) -> GenerationRequest:
    """The shared reading of the fields (``loraplex.openai_request``), then what is this
    engine's: supported parameters, tokenizing, the context length, defaults."""
    try:
        fields = parse_fields(body, chat=kind == "chat")
    except FieldError as exc:
        raise RequestError(400, exc.message, code=exc.code, param=exc.param) from None
    _supported(body, fields, tok)
    ext = _ext(body)
    if fields.messages is not None:
        prompt_ids = _chat_prompt(fields.messages, fields.tools, tok)
    else:
        assert fields.prompt is not None
        prompt_ids = _completion_prompt(fields.prompt, tok)
    if not prompt_ids:
        raise RequestError(400, "the prompt encodes to no tokens", code="invalid_value")
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise RequestError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt "
                                f"has {len(prompt_ids)} tokens", code="context_length_exceeded",
                           param="messages" if kind == "chat" else "prompt")
    key = fields.max_tokens_param
    max_tokens = fields.max_tokens
    if max_tokens is None:
        max_tokens = room if kind == "chat" else min(16, room)
    if max_tokens > room:
        raise RequestError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt "
                                f"has {len(prompt_ids)} tokens and '{key}' asks for {max_tokens} more",
                           code="context_length_exceeded", param=key)
    params = SamplingParams(max_tokens=max_tokens, temperature=fields.temperature, top_p=fields.top_p,
                            top_k=fields.top_k, seed=fields.seed, stop=fields.stop,
                            stop_token_ids=fields.stop_token_ids, ignore_eos=fields.ignore_eos,
                            presence_penalty=fields.presence_penalty, frequency_penalty=fields.frequency_penalty,
                            repetition_penalty=fields.repetition_penalty, logit_bias=fields.logit_bias,
                            logprobs=fields.logprobs, top_logprobs=fields.top_logprobs,
                            grammar=fields.grammar, n=fields.n)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    rid = prefix + (ext.request_id or uuid.uuid4().hex)
    return GenerationRequest(kind, fields.model or default_model, prompt_ids, params, fields.stream,
                             fields.include_usage, ext, rid, fields.continuous_usage, fields.tools)


# ------------------------------------------------------------------------------ responses
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's ``usage``; with ``cached_tokens`` (a request's final usage) also
    ``prompt_tokens_details.cached_tokens``: the prompt tokens whose KV came from the prefix
    cache. They still count in ``prompt_tokens`` (what token limits charge). A stream's per-chunk
    usage has no details, as vLLM's: the gateway strips that flat object (``gateway.proxy``)."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def _chat_entry(tok: TextTokenizer, token: int, logprob: float) -> dict[str, Any]:
    raw = tok.token_bytes(token)
    return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}


def logprobs_json(req: GenerationRequest, entries: list[TokenLogprob] | None, tok: TextTokenizer,
                  text_offset: int = 0) -> dict[str, Any] | None:
    """The ``logprobs`` of a choice (or of a stream chunk) in the route's OpenAI shape;
    ``text_offset``: where the first entry's text starts in the choice's text (completions)."""
    if not req.params.logprobs or entries is None:
        return None
    if req.kind == "chat":
        return {"content": [{**_chat_entry(tok, e.token, e.logprob),
                             "top_logprobs": [_chat_entry(tok, t, lp) for t, lp in e.top]} for e in entries],
                "refusal": None}
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(tok.token_text(e.token))
    return {"tokens": [tok.token_text(e.token) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{tok.token_text(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def choice(req: GenerationRequest, index: int, text: str, finish_reason: str | None,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One finished choice (``message`` for chat, ``text`` for completions); with tools, the
    answer is parsed for calls (then ``finish_reason`` is ``tool_calls``)."""
    if req.kind != "chat":
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if req.tools is not None and finish_reason != "error":
        content, calls = parse_output(text, req.tools)
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}
            finish_reason = "tool_calls"
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def full_response(req: GenerationRequest, choices: list[dict[str, Any]], completion_tokens: int,
                  created: int, cached_tokens: int) -> dict[str, Any]:
    """``completion_tokens``: over all choices (the prompt counts once, as OpenAI counts ``n``);
    ``cached_tokens``: prompt tokens the prefix cache supplied."""
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {"id": req.id, "object": obj, "created": created, "model": req.model, "choices": choices,
            "usage": usage(len(req.prompt_ids), completion_tokens, cached_tokens)}


def stream_chunk(req: GenerationRequest, created: int, text: str | None, finish_reason: str | None,
                 first: bool = False, completion_tokens: int = 0,
                 logprobs: dict[str, Any] | None = None,
                 tool_calls: list[dict[str, Any]] | None = None, index: int = 0) -> dict[str, Any]:
    """One chunk of choice ``index``; ``completion_tokens``: generated so far (continuous usage)."""
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    chunk: dict[str, Any] = {"id": req.id, "object": obj, "created": created, "model": req.model,
                             "choices": [choice]}
    if req.continuous_usage:
        chunk["usage"] = usage(len(req.prompt_ids), completion_tokens)  # last key (the gateway strips it)
    elif req.include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(req: GenerationRequest, created: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The stream's last chunk (``include_usage``): the whole request's usage, details included."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": req.id, "object": obj, "created": created, "model": req.model, "choices": [],
            "usage": usage(len(req.prompt_ids), completion_tokens, cached_tokens)}


def now() -> int:
    return int(time.time())
