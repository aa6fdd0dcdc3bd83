"""How the console words what it shows: an audit row's change field by field, a canary
judgement as its checks, and values as short text (adapter references as ``name@version``).

The judgement's record is the canary judge's (``gateway.canary_judge``); it is read generically
(each check's name, verdict, reason and whatever numbers it carries) so that a check or a field
the judge adds shows up without a change here.
"""

from __future__ import annotations

import json
import math
from typing import Any

HIDDEN = ("row_version", "updated_at", "created_at", "id")
"""Fields an audit diff leaves out (bookkeeping, and an adapter's id: its label says which)."""
JUDGEMENT_KEYS = ("judgement",)
CHECK_META = ("check", "name", "segment", "verdict", "failed", "reason", "passed")
LONG = 160
"""Characters of a value shown before it is cut (the whole is in the cell's title)."""


def text(v: Any) -> str:
    """A value as a person reads it: ``—`` for nothing, refs as ``name@version``, lists joined."""
    if v is None:
        return "—"
    if isinstance(v, dict) and "label" in v:
        return str(v["label"])
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isinf(v):
            return "infinite"
        return f"{v:.4g}"
    if isinstance(v, list | tuple):
        return ", ".join(text(x) for x in v) if all(not isinstance(x, dict | list) for x in v) else _json(v)
    if isinstance(v, dict):
        return ", ".join(f"{k} {text(x)}" for k, x in v.items()) if v else "—"
    return str(v)


def _json(v: Any) -> str:
    return json.dumps(v, separators=(", ", ": "), ensure_ascii=False, default=str)


def short(v: Any) -> tuple[str, str]:
    """``(shown, whole)``: the text cut at ``LONG`` characters, and all of it (for a title)."""
    whole = text(v)
    return (whole if len(whole) <= LONG else whole[:LONG - 1] + "…"), whole


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``outer.inner`` fields (adapter refs stay whole: they are one value)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and "label" not in v and not prefix:
            out |= _flat(v, f"{k}.")
        else:
            out[prefix + k] = v
    return out


def changes(before: Any, after: Any) -> list[tuple[str, Any, Any]]:
    """An audit row's fields that changed, ``(field, before, after)``: bookkeeping left out, a
    judgement left to ``judgement`` (it is shown as its checks), nested dicts field by field."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return [("", before, after)]
    b = _flat({k: v for k, v in before.items() if k not in HIDDEN + JUDGEMENT_KEYS})
    a = _flat({k: v for k, v in after.items() if k not in HIDDEN + JUDGEMENT_KEYS})
    keys = list(dict.fromkeys([*b, *a]))
    return [(k, b.get(k), a.get(k)) for k in keys if b.get(k) != a.get(k)]


def judgement(row: Any) -> dict[str, Any] | None:
    """The canary judgement an audit row's ``after`` carries (the judge's decisions), if any."""
    if isinstance(row, dict) and isinstance(row.get("judgement"), dict):
        return row["judgement"]
    return None


def verdict(check: dict[str, Any]) -> str:
    """A check's verdict in one word: the record's own, else from its ``failed``/``passed`` flag."""
    v = check.get("verdict")
    if isinstance(v, str) and v:
        return v
    if "failed" in check:
        return "failed" if check["failed"] else "ok"
    if "passed" in check:
        return "ok" if check["passed"] else "failed"
    return "—"


def failing(v: str) -> bool:
    return v.lower() in ("failed", "fail", "failing", "abort")


def checks(j: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A judgement's checks as rows: ``name`` (with its segment, if judged per segment), ``verdict``, ``failed`` (bool), ``reason`` and
    ``values`` (every other field, as ``(key, text)``), failed checks first."""
    rows = []
    for c in (j or {}).get("checks") or []:
        if not isinstance(c, dict):
            continue
        name = str(c.get("name") or c.get("check") or "?")
        if c.get("segment"):
            name += f" [{c['segment']}]"
        v = verdict(c)
        values = [(k, text(x)) for k, x in _flat({k: x for k, x in c.items() if k not in CHECK_META}).items()]
        rows.append({"name": name, "verdict": v, "failed": failing(v), "reason": c.get("reason"),
                     "values": values})
    return sorted(rows, key=lambda r: not r["failed"])


def summary(j: dict[str, Any] | None) -> list[tuple[str, str]]:
    """A judgement's own fields (decision and checks aside): window, sample sizes, step..."""
    skip = ("checks", "decision", "reason", "failed", "at")
    return [(k, text(v)) for k, v in (j or {}).items() if k not in skip]
