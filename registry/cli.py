"""``loraplex migrate`` and ``loraplex admin``: schema migrations and registry operations.

``admin`` talks HTTP to the gateway's admin API (``LORAPLEX_ADMIN_URL`` + ``/admin``) with
``LORAPLEX_ADMIN_TOKEN`` or an admin token minted from ``LORAPLEX_JWT_SECRET``; human tables,
or JSON with ``--json``; a refusal prints the reason (and its evidence) and exits 1. Global
options go before or after the subcommand. Heavy modules are imported inside handlers so
``--help`` is fast.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from typing import Any

EXIT_REFUSED = 1
EXIT_UNREACHABLE = 3

# --- migrate ---------------------------------------------------------------------------------------


def _migrate(args: argparse.Namespace) -> int:
    from loraplex.settings import get_settings
    from registry.migrate import downgrade, upgrade

    url = args.database_url or get_settings().resolved_database_url()
    try:
        if args.down:
            downgrade(url, args.revision or "-1")
        else:
            upgrade(url, args.revision or "head")
    except Exception as exc:
        print(f"error: migration failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    direction = "downgraded" if args.down else "upgraded"
    print(f"registry schema {direction} to {args.revision or ('-1' if args.down else 'head')}")
    return 0


# --- admin: HTTP client and output -------------------------------------------------------------------


class AdminError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.body = body or {}
        """The whole error answer (evidence such as ``adapter`` or ``bindings`` beside ``error``)."""


def _request(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None,
             params: dict[str, Any] | None = None) -> Any:
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
    return _answer(r)


def _answer(r: Any) -> Any:
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
               ("CONCURRENT", lambda t: t["max_concurrent"]), ("PRIORITY", lambda t: t["priority"])],
    "base_model": [("NAME", lambda m: m["name"]), ("REVISION", lambda m: m["revision"]),
                   ("ARCH", lambda m: m["architecture"]), ("HIDDEN", lambda m: m["hidden_size"]),
                   ("LAYERS", lambda m: m["num_layers"]), ("HEADS", lambda m: f"{m['num_heads']}/{m['num_kv_heads']}"),
                   ("VOCAB", lambda m: m["vocab_size"])],
    "adapter": [("ID", lambda a: a["id"]), ("ADAPTER", lambda a: a["label"]), ("BASE", lambda a: a["base_model"]),
                ("OWNER", lambda a: a["owner_tenant"] or "(shared)"), ("RANK", lambda a: a["rank"]),
                ("ALPHA", lambda a: f"{a['alpha']:g}"), ("STATUS", lambda a: a["status"]),
                ("SHA256", lambda a: a["sha256"][:12])],
    "binding": [("TENANT", lambda b: b["tenant"]), ("ALIAS", lambda b: b["alias"]),
                ("ACTIVE", lambda b: _label(b["active"])), ("PREVIOUS", lambda b: _label(b["previous"])),
                ("CANARY", lambda b: f"{_label(b['canary'])} {b['canary_percent']:g}%" if b["canary"] else "-"),
                ("ENABLED", lambda b: "yes" if b["enabled"] else f"no ({b['on_disabled']})"),
                ("BASE", lambda b: b["base_model"])],
    "audit": [("VERSION", lambda e: e["registry_version"]), ("AT", lambda e: (e["at"] or "")[:19]),
              ("ACTOR", lambda e: e["actor"]), ("ACTION", lambda e: e["action"]), ("TARGET", lambda e: e["target"])],
}


def _label(ref: dict[str, Any] | None) -> str:
    return ref["label"] if ref else "-"


def _table(kind: str, rows: list[dict[str, Any]]) -> str:
    cols = COLUMNS[kind]
    cells = [[h for h, _ in cols]] + [[str(fn(r)) for _, fn in cols] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines) if rows else "\n".join(lines[:1]) + "\n(none)"


def _show(args: argparse.Namespace, kind: str, data: Any, message: str | None = None) -> None:
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


def _run(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
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
                    print("\n".join(_evidence(adapter["verification"])), file=sys.stderr)
            return EXIT_UNREACHABLE if exc.status == 0 else EXIT_REFUSED
    return handler


def _clip(text: Any, width: int = 100) -> str:
    text = json.dumps(str(text), ensure_ascii=False)
    return text if len(text) <= width else text[:width - 4] + '..."'


def _evidence(v: dict[str, Any]) -> list[str]:
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


def _json_arg(value: str) -> dict[str, Any]:
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


def _percent_arg(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None


# --- admin: handlers ---------------------------------------------------------------------------------

def _limits_body(args: argparse.Namespace) -> dict[str, Any]:
    body = {"requests_per_min": args.requests_per_min, "tokens_per_min": args.tokens_per_min,
            "max_concurrent": args.max_concurrent, "priority": args.priority}
    if getattr(args, "response_retention_s", None) is not None:
        body["response_retention_s"] = args.response_retention_s
    return body


def _b(args: argparse.Namespace, suffix: str = "") -> str:
    return f"/tenants/{args.tenant}/bindings/{args.alias}{suffix}"


def tenant_create(a: argparse.Namespace) -> int:
    data = _request(a, "POST", "/tenants", {"slug": a.slug, **_limits_body(a)})
    _show(a, "tenant", data, f"created tenant {a.slug}")
    return 0


def tenant_list(a: argparse.Namespace) -> int:
    _show(a, "tenant", _request(a, "GET", "/tenants", params={"status": a.status}))
    return 0


def tenant_show(a: argparse.Namespace) -> int:
    _show(a, "tenant", _request(a, "GET", f"/tenants/{a.slug}"))
    return 0


def tenant_disable(a: argparse.Namespace) -> int:
    _show(a, "tenant", _request(a, "POST", f"/tenants/{a.slug}/disable"), f"disabled tenant {a.slug}")
    return 0


def tenant_enable(a: argparse.Namespace) -> int:
    _show(a, "tenant", _request(a, "POST", f"/tenants/{a.slug}/enable"), f"enabled tenant {a.slug}")
    return 0


def tenant_limits(a: argparse.Namespace) -> int:
    data = _request(a, "PATCH", f"/tenants/{a.slug}/limits", _limits_body(a))
    _show(a, "tenant", data, f"updated limits of {a.slug}")
    return 0


def base_model_add(a: argparse.Namespace) -> int:
    if a.from_model:
        from loraplex.modelinfo import describe_model

        try:
            body = describe_model(a.from_model, name=a.name, revision=a.revision).to_dict()
        except (OSError, ValueError, KeyError) as exc:
            print(f"error: cannot describe model {a.from_model}: {exc}", file=sys.stderr)
            return EXIT_REFUSED
    else:
        missing = [f for f in ("name", "revision", "architecture", "hidden_size", "intermediate_size",
                               "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size")
                   if getattr(a, f) is None]
        if missing:
            print("error: give --from-model PATH, or all of: " + ", ".join("--" + m.replace("_", "-")
                                                                           for m in missing), file=sys.stderr)
            return 2
        body = {f: getattr(a, f) for f in ("name", "revision", "architecture", "hidden_size", "intermediate_size",
                                           "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                                           "context_length")}
    data = _request(a, "POST", "/base-models", body)
    _show(a, "base_model", data, f"registered base model {data['name']} at revision {data['revision']}")
    return 0


def base_model_list(a: argparse.Namespace) -> int:
    _show(a, "base_model", _request(a, "GET", "/base-models"))
    return 0


def base_model_upgrade(a: argparse.Namespace) -> int:
    data = _request(a, "POST", f"/base-models/{a.old}/upgrade", {"to": a.new, "dry_run": a.dry_run})
    if a.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"{'plan' if a.dry_run else 'upgrade'}: {data['from']} -> {data['to']}")
    for v in data["versions"]:
        state = "admitted" if v["passed"] is None else ("passes" if v["passed"] else "refused")
        to = f" -> {v['to']['label']}" if v.get("to") else ""
        why = f": {v['reason']}" if v.get("reason") else ""
        print(f"  {v['from']['label']}{to}  {state}{why}  (bindings: {', '.join(v['bindings']) or '-'})")
    for b in data["bindings"]:
        moved = "moves" if b["moves"] else ("would move if its version passes" if b["moves"] is None else "stays")
        print(f"  binding {b['binding']}: {moved}" + (f" ({b['reason']})" if b.get("reason") else ""))
    return 0


def adapter_register(a: argparse.Namespace) -> int:
    data = _request(a, "POST", "/adapters", {"name": a.name, "uri": a.uri, "base_model": a.base_model,
                                             "version": a.version, "owner": a.owner,
                                             "expected_revision": a.expected_revision})
    _show(a, "adapter", data, f"registered {data['label']} (id {data['id']}), status {data['status']}")
    return 0


def adapter_upload(a: argparse.Namespace) -> int:
    """Stream DIR's two PEFT files to the admin API with a progress bar on stderr."""
    import os
    from pathlib import Path

    import httpx

    from loraplex.peft_config import ADAPTER_FILES
    from loraplex.settings import get_settings
    from loraplex.tokens import mint_admin

    paths = [Path(a.dir) / name for name in ADAPTER_FILES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"error: {', '.join(missing)} not found: upload takes a PEFT directory "
              f"({' + '.join(ADAPTER_FILES)})", file=sys.stderr)
        return EXIT_REFUSED
    sizes = [os.path.getsize(p) for p in paths]
    total = sum(sizes)
    show = (not a.json and sys.stderr.isatty()) or a.progress

    def chunks():  # type: ignore[no-untyped-def]
        sent = 0
        for path in paths:
            with open(path, "rb") as fh:
                while block := fh.read(1 << 20):
                    sent += len(block)
                    if show:
                        done = sent * 30 // max(total, 1)
                        print(f"\rupload [{'#' * done}{'.' * (30 - done)}] {sent / 2**20:8.1f}/"
                              f"{total / 2**20:.1f} MiB", end="", file=sys.stderr, flush=True)
                    yield block
        if show:
            print(file=sys.stderr)

    settings = get_settings()
    base = (a.url or settings.resolved_admin_url()).rstrip("/") + "/admin"
    token = a.token or settings.admin_token or mint_admin(settings, subject="cli")
    params = {k: v for k, v in {"name": a.name, "base_model": a.base_model, "owner": a.owner,
                                "version": a.version}.items() if v is not None}
    try:
        with httpx.Client(base_url=base, timeout=a.timeout, trust_env=False) as client:
            r = client.post("/adapters/upload", params=params, content=chunks(),
                            headers={"authorization": f"Bearer {token}", "content-length": str(total),
                                     "x-loraplex-config-bytes": str(sizes[0])})
    except httpx.HTTPError as exc:
        raise AdminError(0, f"cannot reach the admin API at {base}: {exc}", "unreachable") from None
    data = _answer(r)
    _show(a, "adapter", data, f"uploaded {data['label']} (id {data['id']}) to {data['uri']}, status {data['status']}")
    return 0


def gc(a: argparse.Namespace) -> int:
    data = _request(a, "POST", "/gc", {"apply": a.apply, "retention_s": a.retention})
    if a.json:
        print(json.dumps(data, indent=2))
        return 0
    verb = "deleted" if a.apply else "would delete"
    rows = data["versions"]
    for v in rows:
        print(f"{v['label']:<40} {v['size_bytes']:>12} bytes  last referenced {v['last_referenced'][:19]}  {v['uri']}")
    print(f"{verb} {len(data['deleted']) if a.apply else len(rows)} version(s) unreferenced since "
          f"{data['cutoff'][:19]} and {len(data['stale_uploads'])} stale upload(s)"
          + ("" if a.apply else "; run with --apply to delete"))
    return 0


def adapter_list(a: argparse.Namespace) -> int:
    _show(a, "adapter", _request(a, "GET", "/adapters", params={"name": a.name, "base_model": a.base_model,
                                                                "owner": a.owner, "status": a.status}))
    return 0


def adapter_show(a: argparse.Namespace) -> int:
    data = _request(a, "GET", f"/adapters/{a.adapter}")
    _show(a, "adapter", data)
    if not a.json:
        print(f"uri: {data['uri']}\ntarget modules: {', '.join(data['target_modules'])}")
        if data.get("status_reason"):
            print(f"reason: {data['status_reason']}")
        if data.get("verification"):
            print("\n".join(_evidence(data["verification"])))
    return 0


def adapter_activate(a: argparse.Namespace) -> int:
    data = _request(a, "POST", f"/adapters/{a.adapter}/activate", {"verification": a.verification,
                                                                  "eval": a.eval})
    _show(a, "adapter", data, f"activated {data['label']}")
    return 0


def adapter_disable(a: argparse.Namespace) -> int:
    data = _request(a, "POST", f"/adapters/{a.adapter}/disable", {"reason": a.reason, "force": a.force or None})
    detached = "".join(f"\n  {d['tenant']}/{d['alias']}: "
                       f"{'canary aborted' if d['role'] == 'canary' else 'binding disabled'}"
                       for d in data.get("detached") or [])
    _show(a, "adapter", data, f"disabled {data['label']}" + (f"; with it:{detached}" if detached else ""))
    return 0


def adapter_enable(a: argparse.Namespace) -> int:
    data = _request(a, "POST", f"/adapters/{a.adapter}/enable")
    _show(a, "adapter", data, f"enabled {data['label']} (bindings disabled with it stay disabled: "
          f"`binding enable TENANT ALIAS`)")
    return 0


def adapter_fail(a: argparse.Namespace) -> int:
    data = _request(a, "POST", f"/adapters/{a.adapter}/fail", {"reason": a.reason, "verification": a.verification})
    _show(a, "adapter", data, f"marked {data['label']} failed")
    return 0


def bind(a: argparse.Namespace) -> int:
    data = _request(a, "PUT", _b(a), {"adapter": a.adapter, "on_disabled": a.on_disabled})
    _show(a, "binding", data, f"{a.tenant}/{a.alias} -> {_label(data['active'])}")
    return 0


def binding_list(a: argparse.Namespace) -> int:
    _show(a, "binding", _request(a, "GET", "/bindings", params={"tenant": a.tenant}))
    return 0


def binding_show(a: argparse.Namespace) -> int:
    _show(a, "binding", _request(a, "GET", _b(a)))
    return 0


def binding_delete(a: argparse.Namespace) -> int:
    data = _request(a, "DELETE", _b(a))
    print(json.dumps(data) if a.json else f"removed {a.tenant}/{a.alias}")
    return 0


def binding_enable(a: argparse.Namespace) -> int:
    _show(a, "binding", _request(a, "POST", _b(a, "/enable"), {"on_disabled": a.on_disabled}),
          f"enabled {a.tenant}/{a.alias}")
    return 0


def binding_disable(a: argparse.Namespace) -> int:
    data = _request(a, "POST", _b(a, "/disable"), {"on_disabled": a.on_disabled})
    _show(a, "binding", data, f"disabled {a.tenant}/{a.alias} (requests: "
          f"{'answered by the base model' if data['on_disabled'] == 'base' else 'refused'})")
    return 0


def rollback(a: argparse.Namespace) -> int:
    data = _request(a, "POST", _b(a, "/rollback"))
    _show(a, "binding", data, f"rolled {a.tenant}/{a.alias} back to {_label(data['active'])}")
    return 0


def canary_start(a: argparse.Namespace) -> int:
    data = _request(a, "POST", _b(a, "/canary"), {"adapter": a.adapter, "percent": a.percent})
    _show(a, "binding", data, f"canary {_label(data['canary'])} at {data['canary_percent']:g}% on {a.tenant}/{a.alias}")
    return 0


CONDITIONAL_TRIES = 10
"""Read-modify-write attempts of a relative change before giving up (each 412 means a concurrent write)."""


def canary_set(a: argparse.Namespace) -> int:
    if (a.percent is None) == (a.by is None):
        print("error: give either PERCENT or --by DELTA", file=sys.stderr)
        return 2
    if a.by is None:
        data = _request(a, "PATCH", _b(a, "/canary"), {"percent": a.percent})
    else:  # relative: read, compute, write only if nobody changed it in between (else read again)
        for attempt in range(CONDITIONAL_TRIES):
            cur = _request(a, "GET", _b(a, ""))
            if cur["canary"] is None:
                raise AdminError(409, f"{a.tenant}/{a.alias} has no canary", "no_canary")
            percent = min(100.0, max(0.0, cur["canary_percent"] + a.by))
            try:
                data = _request(a, "PATCH", _b(a, "/canary"), {"percent": percent, "row_version": cur["row_version"]})
                break
            except AdminError as exc:
                if exc.status != 412 or attempt == CONDITIONAL_TRIES - 1:
                    raise
                time.sleep(random.uniform(0, 0.02 * (attempt + 1)))  # let the other writer finish
    _show(a, "binding", data, f"canary of {a.tenant}/{a.alias} now at {data['canary_percent']:g}%")
    return 0


def canary_promote(a: argparse.Namespace) -> int:
    data = _request(a, "POST", _b(a, "/canary/promote"))
    _show(a, "binding", data, f"promoted {_label(data['active'])} on {a.tenant}/{a.alias}")
    return 0


def canary_abort(a: argparse.Namespace) -> int:
    _show(a, "binding", _request(a, "DELETE", _b(a, "/canary")), f"aborted the canary on {a.tenant}/{a.alias}")
    return 0


def _policy_text(d: dict[str, Any]) -> str:
    """The status of a binding's canary, as ``canary status`` prints it."""
    at = f"{d['percent']:g}% (step {d['step'] + 1} of {len(d['steps'])})" if d["percent"] is not None else ""
    if not d["canary"]:
        where = "no canary"
    elif d["status"] in ("promoted", "aborted"):
        where = f"{d['canary']}, judged at {at}" if at else d["canary"]
    else:
        where = f"{d['canary']} at {at}" if at else d["canary"]
    lines = [f"canary of {d['tenant']}/{d['alias']}: {d['status']}, {where}"]
    if d["next_step_at"]:
        lines.append(f"  next step no earlier than {d['next_step_at']}")
    lines.append(f"  policy: steps {'/'.join(f'{x:g}' for x in d['steps'])} %, every {d['interval_s']:g} s, "
                 f"at least {d['min_requests']} requests per arm, abort after {d['max_failures']} failed "
                 f"judgement(s), {d['proportion_test']} / {d['sample_test']} at alpha {d['alpha']:g}")
    last = d.get("last") or {}
    if last:
        lines.append(f"  last judgement: {last.get('decision')}"
                     + (f" ({last['reason']})" if last.get("reason") else "")
                     + (f", window {last['window_s']:g} s: canary {last['canary_requests']} requests, active "
                        f"{last['active_requests']}" if "window_s" in last else ""))
        rows = [("CHECK", "CANARY", "ACTIVE", "RATIO", "LIMIT", "TEST", "P", "")]
        for r in last.get("checks", []):
            rows.append((r["check"], f"{r['canary']:.4g}", f"{r['active']:.4g}",
                         "inf" if r["ratio"] is None else f"{r['ratio']:.3g}", f"{r['threshold']:g}", r["test"],
                         f"{r['p']:.3g}", "FAILED" if r["failed"] else "ok"))
        if len(rows) > 1:
            widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
            lines += ["    " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                      for row in rows]
    return "\n".join(lines)


def canary_status(a: argparse.Namespace) -> int:
    data = _request(a, "GET", _b(a, "/canary/policy"))
    print(json.dumps(data, indent=2, sort_keys=True) if a.json else _policy_text(data))
    return 0


def canary_set_policy(a: argparse.Namespace) -> int:
    body: dict[str, Any] = {"interval_s": a.interval, "min_requests": a.min_requests,
                            "max_failures": a.max_failures, "proportion_test": a.proportion_test,
                            "sample_test": a.sample_test, "alpha": a.alpha}
    if a.steps:
        body["steps"] = [float(x) for x in a.steps.split(",") if x.strip()]
    if a.check:
        checks = {}
        for item in a.check:
            name, sep, value = item.partition("=")
            try:
                checks[name] = float(value)
            except ValueError:
                raise AdminError(400, f"--check takes NAME=THRESHOLD, got {item!r}", "invalid_value") from None
            if not sep:
                raise AdminError(400, f"--check takes NAME=THRESHOLD, got {item!r}", "invalid_value")
        body["checks"] = checks
    data = _request(a, "PUT", _b(a, "/canary/policy"), {k: v for k, v in body.items() if v is not None})
    print(json.dumps(data, indent=2, sort_keys=True) if a.json else _policy_text(data))
    return 0


def canary_pause(a: argparse.Namespace) -> int:
    data = _request(a, "POST", _b(a, "/canary/pause"))
    print(json.dumps(data, indent=2, sort_keys=True) if a.json else _policy_text(data))
    return 0


def canary_resume(a: argparse.Namespace) -> int:
    data = _request(a, "POST", _b(a, "/canary/resume"))
    print(json.dumps(data, indent=2, sort_keys=True) if a.json else _policy_text(data))
    return 0


def audit(a: argparse.Namespace) -> int:
    data = _request(a, "GET", "/audit", params={"actor": a.actor, "action": a.action, "target": a.target,
                                                "since_version": a.since_version, "limit": a.limit})
    _show(a, "audit", data)
    return 0


def version(a: argparse.Namespace) -> int:
    data = _request(a, "GET", "/version")
    print(json.dumps(data) if a.json else f"registry version {data['version']}")
    return 0


# --- parsers -----------------------------------------------------------------------------------------

def _help_of(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    def show(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2
    return show


def register(subparsers: Any) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    m = subparsers.add_parser(
        "migrate", help="apply the registry schema migrations (alembic upgrade head)", formatter_class=fmt,
        description="Apply the registry schema migrations to LORAPLEX_DATABASE_URL (default: the embedded "
                    "SQLite file under LORAPLEX_HOME).\n\nexamples:\n  loraplex migrate\n"
                    "  loraplex migrate --revision 0001\n  loraplex migrate --down --revision base")
    m.add_argument("--revision", help="target revision (default: head; with --down: one step back)")
    m.add_argument("--down", action="store_true", help="downgrade instead of upgrade")
    m.add_argument("--database-url", help="override LORAPLEX_DATABASE_URL")
    m.set_defaults(handler=_migrate)

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print JSON instead of a table (for scripts)")
    common.add_argument("--url", default=argparse.SUPPRESS,
                        help="gateway base URL (default: LORAPLEX_ADMIN_URL or the gateway host/port)")
    common.add_argument("--token", default=argparse.SUPPRESS,
                        help="admin JWT (default: LORAPLEX_ADMIN_TOKEN, else minted from LORAPLEX_JWT_SECRET)")
    common.add_argument("--timeout", type=float, default=argparse.SUPPRESS, help="HTTP timeout in seconds")

    admin = subparsers.add_parser(
        "admin", help="operate the registry: tenants, adapters, bindings, canaries, limits, audit",
        parents=[common], formatter_class=fmt,
        description="Operate the registry through the gateway's admin API.\n\n"
                    "typical flow:\n"
                    "  loraplex admin tenant create acme --tokens-per-min 50000\n"
                    "  loraplex admin base-model add --from-model ./SmolLM2-135M-Instruct\n"
                    "  loraplex admin adapter register support-bot support-v1 --base-model SmolLM2-135M-Instruct "
                    "--owner acme\n"
                    "  loraplex admin adapter activate support-bot@1\n"
                    "  loraplex admin bind acme support support-bot@1\n"
                    "  loraplex admin canary start acme support support-bot@2 --percent 10\n"
                    "  loraplex admin canary promote acme support\n"
                    "  loraplex admin rollback acme support\n"
                    "  loraplex admin audit --target 'binding:acme/*'\n\n"
                    "Adapters are named by id (uuid) or NAME@VERSION. --url, --token, --json and --timeout "
                    "go before or after the subcommand. Exit status: 0 ok, 1 refused, 2 usage, 3 admin API "
                    "unreachable.")
    admin.set_defaults(handler=_help_of(admin))
    groups = admin.add_subparsers(dest="admin_command", metavar="COMMAND")

    def leaf(parent: Any, name: str, fn: Callable[[argparse.Namespace], int], help_text: str,
             description: str | None = None) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help_text, description=description or help_text, parents=[common],
                              formatter_class=fmt)
        p.set_defaults(handler=_run(fn))
        return p

    def group(name: str, help_text: str) -> Any:
        g = groups.add_parser(name, help=help_text, description=help_text, parents=[common])
        g.set_defaults(handler=_help_of(g))
        return g.add_subparsers(metavar="COMMAND")

    def limit_args(p: argparse.ArgumentParser, defaults: bool) -> None:
        p.add_argument("--requests-per-min", type=int, default=600 if defaults else None,
                       help="requests per minute" + (" (default 600)" if defaults else ""))
        p.add_argument("--tokens-per-min", type=int, default=100_000 if defaults else None,
                       help="prompt + completion tokens per minute" + (" (default 100000)" if defaults else ""))
        p.add_argument("--max-concurrent", type=int, default=16 if defaults else None,
                       help="requests in flight at once" + (" (default 16)" if defaults else ""))
        p.add_argument("--priority", choices=["high", "normal", "low"], default="normal" if defaults else None,
                       help="scheduling class on the workers" + (" (default normal)" if defaults else ""))

    t = group("tenant", "create, list, disable, enable tenants and set their limits")
    p = leaf(t, "create", tenant_create, "create a tenant")
    p.add_argument("slug", help="tenant id (a-z, 0-9, '-', '_'); the JWT tenant claim")
    limit_args(p, True)
    p = leaf(t, "list", tenant_list, "list tenants")
    p.add_argument("--status", choices=["active", "disabled"], help="only tenants in this status")
    p = leaf(t, "show", tenant_show, "show one tenant")
    p.add_argument("slug")
    p = leaf(t, "disable", tenant_disable, "disable a tenant: its requests are refused")
    p.add_argument("slug")
    p = leaf(t, "enable", tenant_enable, "enable a tenant again")
    p.add_argument("slug")
    p = leaf(t, "limits", tenant_limits, "change a tenant's limits or priority (only the options given)")
    p.add_argument("slug")
    limit_args(p, False)
    p.add_argument("--response-retention-s", type=int, help="seconds the tenant's stored Responses are kept "
                   "(default: LORAPLEX_RESPONSE_RETENTION_S; at most LORAPLEX_RESPONSE_MAX_RETENTION_S)")

    bm = group("base-model", "register and list base models")
    p = leaf(bm, "add", base_model_add, "register a base model",
             "Register a base model. With --from-model the dimensions and the content revision are read "
             "from a local HF directory (config.json + *.safetensors) or a .gguf file; otherwise give them "
             "all as options.")
    p.add_argument("--from-model", metavar="PATH", help="HF model directory or .gguf file to describe")
    p.add_argument("--name", help="registered name (default: derived from the path)")
    p.add_argument("--revision", help="content revision (default: hash of the model files)")
    p.add_argument("--architecture")
    for dim in ("hidden-size", "intermediate-size", "num-layers", "num-heads", "num-kv-heads", "head-dim",
                "vocab-size", "context-length"):
        p.add_argument(f"--{dim}", type=int)
    leaf(bm, "list", base_model_list, "list base models")
    p = leaf(bm, "upgrade", base_model_upgrade, "carry adapter versions and bindings from OLD to NEW",
             "List every active adapter version on base model OLD, re-admit each against NEW, register it as a "
             "new version tied to NEW and run the activation gate on it with the eval set it was activated "
             "with; then move the bindings whose versions pass, in one audited transaction (the others stay "
             "on OLD, with the reason). --dry-run prints the plan and changes nothing. The gate probes each version on a "
             "worker: give a --timeout that covers them all.")
    p.add_argument("old", help="the base model the adapters were trained on")
    p.add_argument("new", help="the new base model (register it first with base-model add)")
    p.add_argument("--dry-run", action="store_true", help="print the plan only")

    ad = group("adapter", "register, list, activate, disable adapter versions")
    p = leaf(ad, "register", adapter_register, "register a new adapter version (admission checks run; "
             "the version starts pending)",
             "Register an adapter version. The artifact must be a PEFT directory (adapter_config.json + "
             "adapter_model.safetensors) under the adapter root; the registry checks shapes against the base "
             "model, rank cap, target modules, NaN/Inf, base revision and pickle files, and refuses with "
             "the reason.")
    p.add_argument("name", help="adapter name (versions are numbered per name)")
    p.add_argument("uri", help="file:// URI or path (absolute, or relative to LORAPLEX_ADAPTER_ROOT) of the "
                   "PEFT directory, as the gateway host sees it")
    p.add_argument("--base-model", required=True, help="base model name the adapter was trained on")
    p.add_argument("--version", type=int, help="version number (default: the next one)")
    p.add_argument("--owner", help="owning tenant (default: shared by all tenants)")
    p.add_argument("--expected-revision", help="refuse unless the registry's base model has this revision")
    p = leaf(ad, "upload", adapter_upload, "upload a PEFT directory into the adapter store and register it",
             "Stream DIR's adapter_config.json and adapter_model.safetensors to the gateway (size-capped by "
             "LORAPLEX_MAX_ADAPTER_BYTES), which runs admission on the uploaded bytes, stores them "
             "content-addressed (sha256) in the adapter store (LORAPLEX_ADAPTER_STORE) and registers the "
             "version as pending, with one audit row. A refusal leaves nothing behind.")
    p.add_argument("dir", help="local PEFT directory")
    p.add_argument("name", help="adapter name (versions are numbered per name)")
    p.add_argument("--base-model", required=True, help="base model name the adapter was trained on")
    p.add_argument("--owner", help="owning tenant (default: shared by all tenants)")
    p.add_argument("--version", type=int, help="version number (default: the next one)")
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stderr is no terminal")
    p = leaf(ad, "list", adapter_list, "list adapter versions")
    p.add_argument("--name")
    p.add_argument("--base-model")
    p.add_argument("--owner")
    p.add_argument("--status", choices=["pending", "active", "disabled", "failed"])
    p = leaf(ad, "show", adapter_show, "show one adapter version")
    p.add_argument("adapter", help="id or NAME@VERSION")
    p = leaf(ad, "activate", adapter_activate, "activate an adapter version (it can then be bound)",
             "Activate an adapter version. On a gateway with the activation gate, a worker first probes "
             "the version (its answers must not be empty or one same text for every prompt, must differ "
             "from the base model's; with --eval, the share of answers matching each case's regex must "
             "reach the threshold); a refusal marks it failed and prints the evidence (probe outputs, "
             "failed eval cases). Activating a failed (or disabled) version runs the gate again.")
    p.add_argument("adapter", help="id or NAME@VERSION")
    p.add_argument("--eval", type=_json_arg, metavar="JSON|@FILE",
                   help='evaluation set for the gateway\'s activation gate: {"cases": [{"prompt": ..., '
                        '"expect": REGEX}], "threshold": 0.8}')
    p.add_argument("--verification", type=_json_arg,
                   help="JSON object of results to record (only where the gateway runs no activation gate)")
    p = leaf(ad, "disable", adapter_disable, "disable an adapter version (refused while bindings use it, "
             "unless --force)",
             "Disable an adapter version. While bindings route to it (as active version or canary) this is "
             "refused and the bindings are named; with --force their canaries on it are aborted and the "
             "bindings active on it disabled (each audited, listed in the answer).")
    p.add_argument("adapter", help="id or NAME@VERSION")
    p.add_argument("--reason", help="why (recorded with the version and in the audit log)")
    p.add_argument("--force", action="store_true", help="also disable the bindings that use it")
    p = leaf(ad, "enable", adapter_enable, "re-enable a disabled adapter version that had been active "
             "(bindings disabled with it stay disabled)")
    p.add_argument("adapter", help="id or NAME@VERSION")
    p = leaf(ad, "fail", adapter_fail, "mark a pending adapter version failed")
    p.add_argument("adapter", help="id or NAME@VERSION")
    p.add_argument("--reason", required=True)
    p.add_argument("--verification", type=_json_arg, help="JSON object of probe/eval results")

    p = leaf(groups, "bind", bind, "bind a tenant's alias to an active adapter version (the current one "
             "becomes previous)")
    p.add_argument("tenant")
    p.add_argument("alias", help="the model name the tenant's backend sends")
    p.add_argument("adapter", help="id or NAME@VERSION")
    p.add_argument("--on-disabled", choices=["base", "refuse"],
                   help="when the binding is disabled with its adapter version (adapter disable --force): "
                        "answer with the base model or refuse (default refuse); `binding disable` takes "
                        "its own --on-disabled")
    p = leaf(groups, "rollback", rollback, "roll an alias back to its previous version (one step; run "
             "again to roll forward)")
    p.add_argument("tenant")
    p.add_argument("alias")

    c = group("canary", "send a share of an alias's traffic to a new version, then promote or abort")
    p = leaf(c, "start", canary_start, "start a canary")
    p.add_argument("tenant")
    p.add_argument("alias")
    p.add_argument("adapter", help="id or NAME@VERSION (active, same base model)")
    p.add_argument("--percent", type=_percent_arg, required=True, help="share of requests, 0 < P <= 100")
    p = leaf(c, "set", canary_set, "change the canary percent (to PERCENT, or --by a signed step)")
    p.add_argument("tenant")
    p.add_argument("alias")
    p.add_argument("percent", type=_percent_arg, nargs="?", help="share of requests, 0 < P <= 100")
    p.add_argument("--by", type=_percent_arg, help="change the current percent by this much (e.g. +5 or -10); "
                   "a conditional write, retried when another write came in between")
    for name, fn, text in (("promote", canary_promote, "make the canary the active version"),
                           ("abort", canary_abort, "stop the canary"),
                           ("status", canary_status, "the canary policy, the step, the last judgement's numbers"),
                           ("pause", canary_pause, "stop the judge from deciding (the canary keeps its percent)"),
                           ("resume", canary_resume, "let the judge decide again")):
        p = leaf(c, name, fn, text)
        p.add_argument("tenant")
        p.add_argument("alias")
    p = leaf(c, "set-policy", canary_set_policy, "how the judge steps up, promotes or aborts this alias's "
             "canaries (fields not given keep their current or default value)")
    p.add_argument("tenant")
    p.add_argument("alias")
    p.add_argument("--steps", help="comma-separated percents, e.g. 5,10,25,50,100 (default)")
    p.add_argument("--interval", type=float, help="least seconds on a step (default 60)")
    p.add_argument("--min-requests", type=int, help="no judgement on fewer requests per arm (default 50)")
    p.add_argument("--max-failures", type=int, help="failed judgements in a row that abort (default 2)")
    p.add_argument("--check", action="append", metavar="NAME=THRESHOLD",
                   help="replaces the checks: error_rate, empty_share, length_share, ttft_p99 (ratio above), "
                        "tokens_per_s (ratio below), completion_length (ratio outside [1/t, t]); repeat")
    p.add_argument("--proportion-test", choices=["two-proportion-z", "fisher-exact"])
    p.add_argument("--sample-test", choices=["mann-whitney-u"])
    p.add_argument("--alpha", type=float, help="significance level (default 0.05)")

    bg = group("binding", "list, show, enable, disable and delete bindings")
    p = leaf(bg, "list", binding_list, "list bindings")
    p.add_argument("--tenant")
    for name, fn, text in (("show", binding_show, "show one binding"),
                           ("enable", binding_enable, "enable a binding"),
                           ("disable", binding_disable, "disable a binding"),
                           ("delete", binding_delete, "remove an alias (its requests get 404)")):
        p = leaf(bg, name, fn, text)
        p.add_argument("tenant")
        p.add_argument("alias")
        if name == "enable":
            p.add_argument("--on-disabled", choices=["base", "refuse"],
                           help="what it falls back to if disabled with its adapter version (adapter "
                                "disable --force): base model or refuse")
        if name == "disable":
            p.add_argument("--on-disabled", choices=["base", "refuse"], default="refuse",
                           help="while disabled: answer with the base model or refuse (default refuse; "
                                "applies to this disable only, whatever was chosen before)")

    p = leaf(groups, "gc", gc, "retention: delete versions no binding has used for a while from the store "
             "(dry run unless --apply)",
             "List the adapter versions in the store that no binding (active, previous or canary) has "
             "referenced for the retention period (LORAPLEX_ADAPTER_RETENTION_S); with --apply, retire them "
             "(disabled, one audit row each) and delete their files. A version in use is never touched.")
    p.add_argument("--apply", action="store_true", help="delete (default: only print the plan)")
    p.add_argument("--retention", type=float, metavar="SECONDS", help="override the retention period")
    p = leaf(groups, "audit", audit, "show the audit trail, newest first")
    p.add_argument("--actor")
    p.add_argument("--action", help="e.g. binding.rollback, tenant.limits")
    p.add_argument("--target", help="e.g. tenant:acme, binding:acme/support, or a prefix ending in *")
    p.add_argument("--since-version", type=int, help="only changes after this registry version")
    p.add_argument("--limit", type=int, default=50, help="at most this many entries (1-1000, default 50)")
    leaf(groups, "version", version, "print the registry version")
