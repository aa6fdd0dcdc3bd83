"""Gateway errors in the OpenAI shape, and the raw-ASGI responses that carry them."""

from __future__ import annotations

from typing import Any

import orjson

from loraplex.wire import error_body
from registry.errors import RegistryError

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


class GatewayError(Exception):
    """Refuse a request with ``status`` and an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        if status == 401:  # RFC 6750: how to authenticate
            self.headers.setdefault("WWW-Authenticate", "Bearer")
        self.type = type or _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")

    def body(self) -> bytes:
        return orjson.dumps(error_body(self.message, self.type, self.code, self.param))


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
