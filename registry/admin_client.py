"""``loraplex admin``'s side of the admin API: the HTTP call, its errors and exit codes, and how
answers are shown (tables for people, ``--json`` for scripts)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

EXIT_REFUSED = 1
EXIT_UNREACHABLE = 3

# --- admin: HTTP client and output -------------------------------------------------------------------


class AdminError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.body = body or {}
        """The whole error answer (evidence such as ``adapter`` or ``bindings`` beside ``error``)."""


def admin_request(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None,
                  params: dict[str, Any] | None = None) -> Any:
    """One call of the admin API (``args``: the admin options ``--url``, ``--token``, ``--timeout``;
    ``path`` under ``/admin``; None values of ``body`` and ``params`` left out): its JSON answer,
    or ``AdminError`` (status 0: unreachable)."""
    import httpx

    from loraplex.settings import get_settings
    from loraplex.tokens import mint_admin

    settings = get_settings()
    base = (args.url or settings.resolved_admin_url()).rstrip("/") + "/admin"
    token = args.token or settings.admin_token or mint_admin(settings, subject="cli")
    clean = {k: v for k, v in (params or {}).items() if v is not None}
    payload = {k: v for k, v in body.items() if v is not None} if body is not None else None
    try:
        with httpx.Client(base_url=base, timeout=args.timeout, trust_env=False) as client:
            r = client.request(method, path, json=payload, params=clean,
                               headers={"authorization": f"Bearer {token}"})
    except httpx.HTTPError as exc:
        raise AdminError(0, f"cannot reach the admin API at {base}: {exc}", "unreachable") from None
    return admin_answer(r)


def admin_answer(r: Any) -> Any:
    """The admin API's JSON answer (an ``httpx.Response``), or its error (OpenAI shape) as an ``AdminError``."""
    try:
        data = r.json()
    except ValueError:
        data = None
    if r.status_code >= 400:
        err = (data or {}).get("error") if isinstance(data, dict) else None
        if isinstance(err, dict):
            raise AdminError(r.status_code, str(err.get("message")), err.get("code"), data)
        raise AdminError(r.status_code, r.text[:500] or r.reason_phrase)
    return data


COLUMNS: dict[str, list[tuple[str, Callable[[dict[str, Any]], Any]]]] = {
    "tenant": [("SLUG", lambda t: t["slug"]), ("STATUS", lambda t: t["status"]),
               ("REQ/MIN", lambda t: t["requests_per_min"]), ("TOK/MIN", lambda t: t["tokens_per_min"]),
               ("CONCURRENT", lambda t: t["max_concurrent"]), ("PRIORITY", lambda t: t["priority"]),
               ("CACHE SCOPE", lambda t: t.get("cache_scope") or "(own)")],
    "base_model": [("NAME", lambda m: m["name"]), ("REVISION", lambda m: m["revision"]),
                   ("ARCH", lambda m: m["architecture"]), ("HIDDEN", lambda m: m["hidden_size"]),
                   ("LAYERS", lambda m: m["num_layers"]), ("HEADS", lambda m: f"{m['num_heads']}/{m['num_kv_heads']}"),
                   ("VOCAB", lambda m: m["vocab_size"])],
    "adapter": [("ID", lambda a: a["id"]), ("ADAPTER", lambda a: a["label"]), ("BASE", lambda a: a["base_model"]),
                ("OWNER", lambda a: a["owner_tenant"] or "(shared)"), ("RANK", lambda a: a["rank"]),
                ("ALPHA", lambda a: f"{a['alpha']:g}"), ("STATUS", lambda a: a["status"]),
                ("SHA256", lambda a: a["sha256"][:12])],
    "binding": [("TENANT", lambda b: b["tenant"]), ("ALIAS", lambda b: b["alias"]),
                ("ACTIVE", lambda b: ref_label(b["active"])), ("PREVIOUS", lambda b: ref_label(b["previous"])),
                ("CANARY", lambda b: f"{ref_label(b['canary'])} {b['canary_percent']:g}%" if b["canary"] else "-"),
                ("ENABLED", lambda b: "yes" if b["enabled"] else f"no ({b['on_disabled']})"),
                ("BASE", lambda b: b["base_model"])],
    "audit": [("VERSION", lambda e: e["registry_version"]), ("AT", lambda e: (e["at"] or "")[:19]),
              ("ACTOR", lambda e: e["actor"]), ("ACTION", lambda e: e["action"]), ("TARGET", lambda e: e["target"])],
}


def ref_label(ref: dict[str, Any] | None) -> str:
    """A binding's version reference (``{"id", "label"}``) as shown: its label, or ``-``."""
    return ref["label"] if ref else "-"


def _table(kind: str, rows: list[dict[str, Any]]) -> str:
    cols = COLUMNS[kind]
    cells = [[h for h, _ in cols]] + [[str(fn(r)) for _, fn in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines) if rows else "\n".join(lines[:1]) + "\n(none)"


def show_answer(args: argparse.Namespace, kind: str, data: Any, message: str | None = None) -> None:
    """Print an answer: as JSON with ``--json``, else ``message`` and a table of ``kind``'s ``COLUMNS``."""
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return
    if message:
        print(message)
    if isinstance(data, dict) and data.get("object") == "list":
        print(_table(kind, data["data"]))
    elif isinstance(data, dict):
        print(_table(kind, [data]))


GLOBAL_DEFAULTS: dict[str, Any] = {"json": False, "url": None, "token": None, "timeout": 30.0}
"""The admin options accepted before and after the subcommand; their parsers never set a default
(a subparser's default would overwrite a value given earlier), so it is filled in here."""


def _with_globals(args: argparse.Namespace) -> argparse.Namespace:
    for name, default in GLOBAL_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, default)
    return args


def cli_handler(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A command's handler: the admin options' defaults filled in, an ``AdminError`` printed (JSON
    with ``--json``) and turned into the exit code (``EXIT_UNREACHABLE``, ``EXIT_REFUSED``)."""
    def handler(args: argparse.Namespace) -> int:
        _with_globals(args)
        try:
            return fn(args)
        except AdminError as exc:
            where = f"HTTP {exc.status}" if exc.status else "no response"
            code = f", {exc.code}" if exc.code else ""
            if args.json:
                print(json.dumps(exc.body | {"error": {"message": exc.message, "code": exc.code,
                                                       "status": exc.status}}), file=sys.stderr)
            else:
                print(f"error: {exc.message} ({where}{code})", file=sys.stderr)
                adapter = exc.body.get("adapter")
                if isinstance(adapter, dict) and adapter.get("verification"):
                    print("\n".join(evidence_lines(adapter["verification"])), file=sys.stderr)
            return EXIT_UNREACHABLE if exc.status == 0 else EXIT_REFUSED
    return handler


def _clip(text: Any, width: int = 100) -> str:
    text = json.dumps(str(text), ensure_ascii=False)
    return text if len(text) <= width else text[:width - 4] + '..."'


def evidence_lines(v: dict[str, Any]) -> list[str]:
    """The activation gate's evidence, readable: verdict, probes (base vs adapter), failed eval cases."""
    verdict = "passed" if v.get("passed") else "FAILED" if "passed" in v else "recorded"
    lines = [f"verification: {verdict}" + (f" on worker {v['worker']}" if v.get("worker") else "")
             + (f": {v['reason']}" if v.get("reason") else "")]
    if isinstance(v.get("error"), dict):
        e = v["error"]
        lines.append(f"  worker error: {' '.join(str(x) for x in (e.get('status'), e.get('code')) if x)} "
                     f"{e.get('message') or ''}".rstrip())
    for p in v.get("probes") or []:
        lines.append(f"  probe {_clip(p.get('prompt'), 60)}\n    base:    {_clip(p.get('base'))}\n"
                     f"    adapter: {_clip(p.get('adapter'))}")
    ev = v.get("eval")
    if isinstance(ev, dict):
        lines.append(f"  eval: {ev.get('matched')}/{ev.get('cases')} matched (score {ev.get('score')}, "
                     f"threshold {ev.get('threshold')})")
        for c in ev.get("failed_cases") or []:
            lines.append(f"    failed {_clip(c.get('prompt'), 60)} expects /{c.get('expect')}/\n"
                         f"      adapter: {_clip(c.get('adapter'))}")
    known = {"worker", "passed", "reason", "error", "probes", "eval", "probes_differing", "adapter_load_ms",
             "seconds"}
    if set(v) - known:  # given by the caller (no gate): show it as given
        lines.append(f"  as given: {json.dumps({k: x for k, x in v.items() if k not in known}, sort_keys=True)}")
    return lines


def json_object_arg(value: str) -> dict[str, Any]:
    """A JSON object given inline, or ``@path`` to read it from a file."""
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as fh:
                value = fh.read()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot read {value[1:]}: {exc}") from None
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return parsed


def percent_arg(value: str) -> float:
    """A percent given on the command line (the admin API checks its range)."""
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None


