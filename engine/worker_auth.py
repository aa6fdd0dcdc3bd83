"""The worker's door: every route but ``/health`` and ``/metrics`` needs the gateway's secret.

Only a gateway may choose the adapter, tenant and priority of a request, so the worker
trusts a request only when header ``x-loraplex-worker-secret`` (``loraplex.wire.HDR_WORKER_SECRET``)
equals ``settings.worker_secret`` (constant-time compare): missing -> 401, wrong -> 403, in
the OpenAI error shape. ``WorkerSecretMiddleware`` checks it before routing, before the body
is read, so a refused request never reaches the engine or an adapter. ``/health`` (probes;
load figures only) and ``/metrics`` stay open: the worker port belongs on the internal network.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex.wire import HDR_WORKER_SECRET, error_body

OPEN_PATHS = frozenset({"/health", "/metrics"})
_HEADER = HDR_WORKER_SECRET.encode()


class SecretRefused(Exception):
    def __init__(self, status: int, message: str, code: str, type: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.type = status, message, code, type

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, type=self.type, code=self.code), status_code=self.status)


def check_worker_secret(given: str | bytes | None, secret: str) -> None:
    """Raise ``SecretRefused`` unless ``given`` (the header value) is ``secret``."""
    if not given:
        raise SecretRefused(401, f"missing {HDR_WORKER_SECRET} header", "unauthorized", "authentication_error")
    raw = given.encode("latin-1") if isinstance(given, str) else given  # header bytes as they came
    if not secret or not hmac.compare_digest(raw, secret.encode()):
        raise SecretRefused(403, "wrong worker secret", "forbidden", "permission_error")


class WorkerSecretMiddleware:
    """Pure ASGI: refuse every HTTP request outside ``OPEN_PATHS`` without the worker secret."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app = app
        self.secret = secret

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == _HEADER), None)
            try:
                check_worker_secret(given, self.secret)
            except SecretRefused as exc:
                await exc.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
