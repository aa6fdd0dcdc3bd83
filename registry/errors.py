"""Registry errors: each carries the HTTP status, a machine code and a human message."""

from __future__ import annotations

import logging
from typing import Any

from loraplex.wire import error_body

log = logging.getLogger("loraplex.registry")


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

    @property
    def headers(self) -> dict[str, str]:
        """HTTP headers the answer carries (``Retry-After``, ``ETag``)."""
        return {}


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


class PreconditionFailed(RegistryError):
    """A conditional write (``If-Match`` / ``row_version``) found the row at another version."""

    status = 412
    default_code = "precondition_failed"

    def __init__(self, message: str, row_version: int | None) -> None:
        super().__init__(message, param="row_version", extra={"row_version": row_version})
        self.row_version = row_version

    @property
    def headers(self) -> dict[str, str]:
        return {"etag": etag(self.row_version)} if self.row_version is not None else {}


RETRY_AFTER_S = 2
"""The ``retry-after`` of a registry outage's 503 (the database is usually back, or failed over, in seconds)."""


class Unavailable(RegistryError):
    """The registry database cannot be reached (or is busy); the write did not happen."""

    status = 503
    type = "service_unavailable_error"
    default_code = "registry_unavailable"

    def __init__(self, message: str, code: str | None = None, *, retry_after: int = RETRY_AFTER_S) -> None:
        super().__init__(message, code)
        self.retry_after = retry_after

    @property
    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after)}


def database_unavailable(exc: BaseException, tail: str = "try again", *,
                         code: str | None = None) -> Unavailable | None:
    """The 503 a client gets for a failure of the registry database that is not about its request
    (the database down or unreachable, a connection lost or timed out, the pool exhausted, the
    schema missing), or None when ``exc`` is no such failure (a bug: let it be a 500).

    The one mapping from SQLAlchemy, asyncpg, socket and timeout errors onto the registry's own
    error, for the admin API and the stored Responses alike: the message is a fixed sentence and
    ``tail`` (what the caller should know: "nothing was changed"); the exception's text (hosts,
    ports, SQL) goes to the log only. ``code`` replaces the code (``store_unavailable`` for the
    stored Responses)."""
    from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, ProgrammingError
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    if isinstance(exc, PoolTimeout):
        log.warning("registry connection pool exhausted: %s", _short(exc))
        return Unavailable(f"the registry is busy (all database connections in use); {tail}",
                           code=code or "registry_busy", retry_after=1)
    if not isinstance(exc, DBAPIError | OSError | ConnectionError | TimeoutError) and not _asyncpg_failure(exc):
        return None
    text = _short(exc).lower()
    if isinstance(exc, ProgrammingError | OperationalError) and (
            "no such table" in text or ("does not exist" in text and "relation" in text)):
        log.error("registry schema missing: %s", _short(exc))
        return Unavailable(f"the registry schema is missing or outdated (run `loraplex migrate`); {tail}",
                           code=code or "registry_schema_missing")
    if isinstance(exc, DBAPIError) and not isinstance(exc, OperationalError | InterfaceError) \
            and not exc.connection_invalidated:
        log.error("registry database error: %s", _short(exc))
        return Unavailable(f"the registry database failed the operation; {tail}", code=code or "registry_error")
    log.warning("registry database unavailable: %s", _short(exc))
    return Unavailable(f"the registry database is unavailable; {tail}", code=code)


def _asyncpg_failure(exc: BaseException) -> bool:
    """An asyncpg connection failure that reached us unwrapped (outside a SQLAlchemy call)."""
    try:
        from asyncpg.exceptions import InterfaceError, PostgresConnectionError
    except ImportError:
        return False
    return isinstance(exc, PostgresConnectionError | InterfaceError)


def _short(exc: BaseException) -> str:
    """The first line of a database error (for the log)."""
    text = str(getattr(exc, "orig", None) or exc)
    return text.splitlines()[0][:300] if text else type(exc).__name__


def etag(row_version: int) -> str:
    """A row's ``ETag``: its ``row_version`` as a strong entity tag."""
    return f'"{row_version}"'


def parse_if_match(value: str) -> int | None:
    """``If-Match: "7"`` (or ``7``) -> 7; ``*`` -> None (any existing row). If-Match compares
    strongly (RFC 9110, 13.1.1): a weak tag (``W/"7"``) matches no row, so it is refused with 412."""
    tags = [t.strip() for t in value.split(",") if t.strip()]
    if tags == ["*"]:
        return None
    if len(tags) != 1:
        raise Invalid("If-Match takes one row_version (the ETag of the row as read)", code="invalid_if_match",
                      param="If-Match")
    if tags[0].startswith("W/"):
        raise PreconditionFailed(f"If-Match compares entity tags strongly: the weak tag {tags[0]!r} matches no "
                                 f"row; send the row's ETag as given", None)
    tag = tags[0].strip('"')
    if not tag.isdigit():
        raise Invalid(f"If-Match must be a row_version ETag such as '\"3\"', got {value!r}",
                      code="invalid_if_match", param="If-Match")
    return int(tag)


class unavailable_on_database_failure:
    """Inside it (``with`` or ``async with``), a failure of the registry database becomes
    ``database_unavailable``'s 503: the driver's exception never reaches the caller; the registry's
    own errors and bugs pass as they are."""

    def __init__(self, tail: str = "try again", *, code: str | None = None) -> None:
        self.tail, self.code = tail, code

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is None or isinstance(exc, RegistryError) or not isinstance(exc, Exception):
            return
        err = database_unavailable(exc, self.tail, code=self.code)
        if err is not None:
            raise err from None

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(kind, exc, tb)


def database_refusal(exc: BaseException) -> RegistryError | None:
    """What a write the database refused means to the client, or None when ``exc`` is no refusal:
    a row changed by a concurrent writer (409 ``concurrent_update``), a constraint (409) or a
    value the schema cannot hold (422). The database's text (constraint and row values) goes to
    the log only."""
    from sqlalchemy.exc import DataError, IntegrityError
    from sqlalchemy.orm.exc import StaleDataError

    if isinstance(exc, StaleDataError):
        return Conflict("the row changed concurrently; retry", code="concurrent_update")
    if isinstance(exc, IntegrityError):
        log.warning("registry write refused by a constraint: %s", _short(exc))
        return Conflict("the change conflicts with existing registry rows; nothing was changed")
    if isinstance(exc, DataError):
        log.warning("registry write refused by the schema: %s", _short(exc))
        return Invalid("a value does not fit the registry schema; nothing was changed")
    return None


class refused_or_unavailable_on_database_failure(unavailable_on_database_failure):
    """For a write transaction: a refusal by the database becomes ``database_refusal``'s 409 or
    422; any other failure of the database is ``unavailable_on_database_failure``'s 503."""

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is not None and isinstance(exc, Exception) and not isinstance(exc, RegistryError):
            refusal = database_refusal(exc)
            if refusal is not None:
                raise refusal from None
        super().__exit__(kind, exc, tb)
