"""Request bodies as JSON: one reading for the gateway, the workers and the admin API.

``loads(raw)`` parses with orjson and then checks the nesting once, before any field is used:
a body nested deeper than ``MAX_DEPTH`` (objects and lists, the body itself counted) is refused
with a ``BodyError`` naming its top-level field. Every later use of the value (stdlib
``json.dumps`` while counting prompt tokens, orjson's 254-level encoder when the gateway
forwards it, recursive schema walks) then stays far from Python's recursion limit. No OpenAI
or admin field needs more: OpenAI's structured outputs allow 10 levels of schema nesting.
"""

from __future__ import annotations

from typing import Any

import orjson

MAX_DEPTH = 64
"""Deepest nesting a request body may have (a flat object is 1)."""


class BodyError(ValueError):
    """The body is not JSON, or nests too deeply (the caller answers 400)."""

    def __init__(self, message: str, code: str = "invalid_json", param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


def depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (0 for a scalar, 1 for a flat object); walks
    level by level, never recursing."""
    n, level = 0, [value] if isinstance(value, dict | list) else []
    while level:
        n += 1
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x) if isinstance(v, dict | list)]
    return n


def check_depth(body: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise ``BodyError`` when ``body`` nests deeper than ``max_depth``, naming the first
    top-level field that does."""
    if depth(body) <= max_depth:
        return
    if isinstance(body, dict):
        for name, value in body.items():
            if depth(value) >= max_depth:
                raise BodyError(f"'{name}' is nested {depth(value)} levels deep; a request body may nest at most "
                                f"{max_depth} levels (itself included)", param=str(name))
    raise BodyError(f"the request body is nested {depth(body)} levels deep; at most {max_depth}")


def loads(raw: bytes | str) -> Any:
    """Parse a body; ``BodyError`` (code ``invalid_utf8`` or ``invalid_json``) when it cannot be."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if isinstance(raw, bytes):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as bad:
                raise BodyError(f"the request body is not valid UTF-8 ({bad.reason} at byte {bad.start})",
                                code="invalid_utf8") from None
        raise BodyError(f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
                        ) from None
    check_depth(value)
    return value
