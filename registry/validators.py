"""The checks every registry write's values pass: each returns the value as stored, or raises
``Invalid`` (422) naming the parameter; ``match`` is the conditional write's 412.

The patterns they apply are ``registry.records``' (``SLUG``, ``NAME``, ``CACHE_SCOPE``, ``MAX_LIMIT``)."""

from __future__ import annotations

import math
from typing import Any

from loraplex.wire import PRIORITY_CLASSES
from registry.errors import Invalid, PreconditionFailed
from registry.records import CACHE_SCOPE, MAX_LIMIT, NAME, SLUG


def match(row_version: int | None, if_match: int | None, what: str) -> None:
    """A conditional write: refuse (412) unless the row is at the version the caller read
    (``if_match``; None: any). ``row_version`` None: the row does not exist."""
    if if_match is None:
        return
    if isinstance(if_match, bool) or not isinstance(if_match, int):
        raise Invalid(f"row_version must be an integer, got {if_match!r}", param="row_version")
    if row_version != if_match:
        found = "does not exist" if row_version is None else f"is at row_version {row_version}"
        raise PreconditionFailed(f"{what} changed since it was read: it {found}, not {if_match}; read it "
                                 f"again and retry", row_version)


def slug(value: Any, param: str = "tenant") -> str:
    """A tenant's slug (``SLUG``)."""
    if not isinstance(value, str) or not SLUG.match(value):
        raise Invalid(f"{param} must be 1-64 characters of a-z, 0-9, '_' or '-', starting with a letter "
                      f"or digit; got {value!r}", param=param)
    return value


def cache_scope(value: Any) -> str:
    """A shared scope's name, or empty for the tenant's own scope."""
    if value == "":
        return ""
    if not isinstance(value, str) or not CACHE_SCOPE.fullmatch(value):  # no trailing newline
        raise Invalid("cache_scope must be empty (the tenant's own scope) or 1-63 characters of a-z, 0-9, "
                      f"'_', '.' or '-', starting with a letter or digit; got {value!r}",
                      code="invalid_cache_scope", param="cache_scope")
    return value


def name(value: Any, param: str) -> str:
    """An adapter's, a base model's or an alias's name (``NAME``)."""
    if not isinstance(value, str) or not NAME.match(value):
        raise Invalid(f"{param} must be 1-200 characters of letters, digits and . _ : + -; got {value!r}",
                      param=param)
    return value


def limit(value: Any, param: str) -> int:
    """A tenant's limit: an integer in [0, ``MAX_LIMIT``]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LIMIT:
        raise Invalid(f"{param} must be a non-negative integer, got {value!r}", code="invalid_limit", param=param)
    return value


def priority(value: Any) -> str:
    """A tenant's priority class (``loraplex.wire.PRIORITY_CLASSES``)."""
    if value not in PRIORITY_CLASSES:
        raise Invalid(f"priority must be one of {', '.join(PRIORITY_CLASSES)}, got {value!r}",
                      code="invalid_priority", param="priority")
    return str(value)


def percent(value: Any) -> float:
    """A canary's percent: 0 < percent <= 100."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not 0 < value <= 100:
        raise Invalid(f"canary percent must be a number with 0 < percent <= 100, got {value!r}",
                      code="invalid_percent", param="percent")
    return float(value)


def on_disabled(value: Any) -> str:
    """What a disabled binding does: ``base`` (serve the base model) or ``refuse``."""
    if value not in ("base", "refuse"):
        raise Invalid(f"on_disabled must be 'base' or 'refuse', got {value!r}", param="on_disabled")
    return str(value)
