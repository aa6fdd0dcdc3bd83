"""Registry errors: each carries the HTTP status, a machine code and a human message."""

from __future__ import annotations

from typing import Any

from loraplex.wire import error_body


class RegistryError(Exception):
    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"

    def __init__(self, message: str, code: str | None = None, param: str | None = None, *,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param
        self.extra = extra or {}
        """Evidence for the operator, next to ``error`` in the body (e.g. the bindings in the way)."""

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, code=self.code, param=self.param) | self.extra


class NotFound(RegistryError):
    status = 404
    type = "not_found_error"
    default_code = "not_found"


class Conflict(RegistryError):
    status = 409
    type = "conflict_error"
    default_code = "conflict"


class Invalid(RegistryError):
    """A well-formed request the registry refuses (bad value, rule violation, admission)."""

    status = 422
    default_code = "invalid_value"


class Unavailable(RegistryError):
    """The registry database cannot be reached; the write did not happen."""

    status = 503
    type = "service_unavailable_error"
    default_code = "registry_unavailable"
