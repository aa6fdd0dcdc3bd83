"""Gateway errors in the OpenAI shape, and the raw-ASGI responses that carry them.

Errors say nothing of the servers' insides: ``ERROR_CODES`` lists every code the gateway sends,
with the fixed sentence a client gets for the codes whose cause lies inside the servers (a
worker's adapter or engine, a broken stream). A ``GatewayError`` with such a code carries that
sentence and keeps the original text as ``detail`` for the log (written with the request id);
a worker's error body or in-stream error event is rewritten the same way (``public_body``,
``public_event``) before it is relayed.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from loraplex.wire import error_body
from registry.errors import RETRY_AFTER_S, RegistryError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


_LOGGED = "the server's log has the details under this request's x-request-id"
ERROR_CODES: dict[str, str | None] = {
    # Fixed sentences: the cause is inside the servers (the text it came with goes to the log).
    "adapter_load_failed": f"The adapter for this model could not be loaded; {_LOGGED}. Retry later, or ask "
                           f"the operators to check the adapter.",
    "adapter_error": f"The adapter for this model failed while serving this request; {_LOGGED}.",
    "non_finite_output": f"The adapter for this model produced invalid values (NaN or infinity) for this "
                         f"request; {_LOGGED}.",
    "engine_error": f"The worker failed while generating the answer; retry the request ({_LOGGED}).",
    "internal_error": f"Internal error; {_LOGGED}.",
    "upstream_error": "The worker failed to answer; retry the request.",
    "stream_interrupted": "The worker's stream broke off before the answer was complete; retry the request.",
    # The gateway's own sentences (fixed, or built from the request's own values).
    "upstream_stalled": None, "body_too_large": None, "chain_too_long": None, "context_length_exceeded": None,
    "input_too_large": None, "invalid_value": None, "method_not_allowed": None, "model_disabled": None,
    "model_not_found": None, "no_tenant": None, "no_worker": None, "no_worker_on_revision": None,
    "previous_response_not_found": None, "ratelimiter_unavailable": None, "rate_limit_exceeded": None,
    "registry_unavailable": None,
    "request_exceeds_token_limit": None, "request_too_large": None, "response_not_found": None,
    "shutting_down": None, "store_unavailable": None, "tenant_disabled": None, "timeout": None,
    "unknown_tenant": None, "unsupported_path": None, "verifier_refused": None, "worker_busy": None,
    "invalid_token": None, "missing_token": None, "unsupported_parameter": None,
    "unsupported_item_type": None, "unsupported_content": None, "unsupported_tool": None, "invalid_json": None,
}
"""Every code the gateway sends -> the fixed sentence a client gets (None: the message as written,
which never carries the servers' insides). tests/test_error_leaks.py finds the codes in the source
and sends each one it can."""
STREAM_FAILED = f"The worker failed while generating the answer; {_LOGGED}."
"""An in-stream error event whose text names the servers' insides."""
WORKER_REFUSED = "The worker refused this request; check its parameters."
"""A worker's 4xx whose text names the servers' insides (a path, a host, an exception)."""
_INSIDES = re.compile(
    r"(?<![\w.])/(?!v1/)[\w.-]+/|[\w-]+/[\w-]+/|\.py\b|Traceback|\b\w+(?:Error|Exception)\(|"
    r"\b(?:\d{1,3}\.){3}\d{1,3}\b|\blocalhost\b|\w:\d{2,5}\b")
"""Path-, host- and exception-like text (the API's own ``/v1/...`` paths are no secret)."""


def public_message(code: str | None, message: str, fallback: str = WORKER_REFUSED) -> str:
    """What a client is told of a worker's error ``code``: its fixed sentence, else ``message``
    unless it names the servers' insides (then ``fallback``)."""
    fixed = ERROR_CODES.get(code) if code else None
    if fixed is not None:
        return fixed
    return fallback if _INSIDES.search(message.replace("/v1/", " ")) else message


def public_body(content: bytes, fallback: str = WORKER_REFUSED) -> tuple[bytes, str | None]:
    """A worker's error body as the client gets it, and the worker's text when it was replaced (for
    the log)."""
    try:
        data = orjson.loads(content)
        err = data["error"]
        message = str(err.get("message") or "")
        code = err.get("code")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        text = content[:300].decode("utf-8", "replace")
        return orjson.dumps(error_body(fallback, "upstream_error", "upstream_error")), text
    public = public_message(code if isinstance(code, str) else None, message, fallback)
    if public == message:
        return content, None
    return orjson.dumps(data | {"error": err | {"message": public}}), message


def public_event(event: bytes) -> tuple[bytes, str | None]:
    """A worker's in-stream error event (``data: {"error": ...}``) as the client gets it, and the
    worker's text when it was replaced."""
    body, detail = public_body(event[5:].strip(), STREAM_FAILED)
    return (event, None) if detail is None else (b"data: " + body, detail)


class GatewayError(Exception):
    """Refuse a request with ``status`` and an OpenAI-shaped body. A code of ``ERROR_CODES`` with a
    fixed sentence answers that sentence; ``detail`` keeps ``message`` for the log."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = message
        self.message = (ERROR_CODES.get(code) if code else None) or message
        self.code = code
        self.param = param
        self.headers = headers or {}
        if status == 401:  # RFC 6750: how to authenticate
            self.headers.setdefault("WWW-Authenticate", "Bearer")
        self.type = type or _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")

    def body(self) -> bytes:
        return orjson.dumps(error_body(self.message, self.type, self.code, self.param))


def retry_later() -> dict[str, str]:
    """The ``retry-after`` of a 503 for an outage of the registry or its database."""
    return {"retry-after": str(RETRY_AFTER_S)}


def from_registry(err: RegistryError) -> GatewayError:
    """The registry's refusal (``registry.errors``: a 503 ``store_unavailable`` or
    ``registry_unavailable`` with its ``retry-after``) as the gateway answers it."""
    return GatewayError(err.status, err.message, code=err.code, param=err.param, headers=dict(err.headers),
                        type=err.type)


def raw_headers(headers: dict[str, str], content_type: bytes = b"application/json") -> list[tuple[bytes, bytes]]:
    out = [(b"content-type", content_type)]
    out.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())
    return out


async def send_error(send: Any, err: GatewayError, extra: dict[str, str] | None = None) -> None:
    body = err.body()
    headers = dict(extra or {})
    headers.update(err.headers)
    hdrs = raw_headers(headers)
    hdrs.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": err.status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})
