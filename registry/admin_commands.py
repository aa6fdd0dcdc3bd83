"""``loraplex admin``'s commands: one handler per operation, each one call of the admin API."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Iterator
from typing import Any

from registry.admin_client import (
    EXIT_REFUSED,
    GLOBAL_DEFAULTS,
    AdminError,
    admin_answer,
    admin_request,
    evidence_lines,
    ref_label,
    show_answer,
)

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
    data = admin_request(a, "POST", "/tenants", {"slug": a.slug, **_limits_body(a), "cache_scope": a.cache_scope})
    show_answer(a, "tenant", data, f"created tenant {a.slug}")
    return 0


def tenant_list(a: argparse.Namespace) -> int:
    show_answer(a, "tenant", admin_request(a, "GET", "/tenants", params={"status": a.status}))
    return 0


def tenant_show(a: argparse.Namespace) -> int:
    show_answer(a, "tenant", admin_request(a, "GET", f"/tenants/{a.slug}"))
    return 0


def tenant_disable(a: argparse.Namespace) -> int:
    show_answer(a, "tenant", admin_request(a, "POST", f"/tenants/{a.slug}/disable"), f"disabled tenant {a.slug}")
    return 0


def tenant_enable(a: argparse.Namespace) -> int:
    show_answer(a, "tenant", admin_request(a, "POST", f"/tenants/{a.slug}/enable"), f"enabled tenant {a.slug}")
    return 0


def tenant_limits(a: argparse.Namespace) -> int:
    data = admin_request(a, "PATCH", f"/tenants/{a.slug}/limits", _limits_body(a))
    show_answer(a, "tenant", data, f"updated limits of {a.slug}")
    return 0


def tenant_cache_scope(a: argparse.Namespace) -> int:
    if (a.name is None) == (not a.own):
        print("error: give either a scope NAME or --own", file=sys.stderr)
        return 2
    data = admin_request(a, "PUT", f"/tenants/{a.slug}/cache-scope", {"cache_scope": "" if a.own else a.name})
    scope = data["cache_scope"]
    show_answer(a, "tenant", data, f"{a.slug} now caches prompt prefixes in the shared scope {scope!r}" if scope
          else f"{a.slug} now caches prompt prefixes in its own scope")
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
    data = admin_request(a, "POST", "/base-models", body)
    show_answer(a, "base_model", data, f"registered base model {data['name']} at revision {data['revision']}")
    return 0


def base_model_list(a: argparse.Namespace) -> int:
    show_answer(a, "base_model", admin_request(a, "GET", "/base-models"))
    return 0


def base_model_upgrade(a: argparse.Namespace) -> int:
    data = admin_request(a, "POST", f"/base-models/{a.old}/upgrade", {"to": a.new, "dry_run": a.dry_run})
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
    data = admin_request(a, "POST", "/adapters", {"name": a.name, "uri": a.uri, "base_model": a.base_model,
                                             "version": a.version, "owner": a.owner,
                                             "expected_revision": a.expected_revision})
    show_answer(a, "adapter", data, f"registered {data['label']} (id {data['id']}), status {data['status']}")
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

    def chunks() -> Iterator[bytes]:
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
    data = admin_answer(r)
    show_answer(a, "adapter", data, f"uploaded {data['label']} (id {data['id']}) to {data['uri']}, status {data['status']}")
    return 0


def gc(a: argparse.Namespace) -> int:
    data = admin_request(a, "POST", "/gc", {"apply": a.apply, "retention_s": a.retention})
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
    show_answer(a, "adapter", admin_request(a, "GET", "/adapters", params={"name": a.name, "base_model": a.base_model,
                                                                "owner": a.owner, "status": a.status}))
    return 0


def adapter_show(a: argparse.Namespace) -> int:
    data = admin_request(a, "GET", f"/adapters/{a.adapter}")
    show_answer(a, "adapter", data)
    if not a.json:
        print(f"uri: {data['uri']}\ntarget modules: {', '.join(data['target_modules'])}")
        if data.get("status_reason"):
            print(f"reason: {data['status_reason']}")
        if data.get("verification"):
            print("\n".join(evidence_lines(data["verification"])))
    return 0


ACTIVATE_TIMEOUT_S = 330.0
"""How long ``adapter activate`` waits unless ``--timeout`` says: the activation gate's probes may take
up to 300 s on the worker (``gateway.activation``), far past the 30 s other calls wait (a probe on a
busy laptop's demo took over a minute)."""


def adapter_activate(a: argparse.Namespace) -> int:
    if a.timeout == GLOBAL_DEFAULTS["timeout"]:
        a = argparse.Namespace(**{**vars(a), "timeout": ACTIVATE_TIMEOUT_S})
    data = admin_request(a, "POST", f"/adapters/{a.adapter}/activate", {"verification": a.verification,
                                                                  "eval": a.eval})
    show_answer(a, "adapter", data, f"activated {data['label']}")
    return 0


def adapter_disable(a: argparse.Namespace) -> int:
    data = admin_request(a, "POST", f"/adapters/{a.adapter}/disable", {"reason": a.reason, "force": a.force or None})
    detached = "".join(f"\n  {d['tenant']}/{d['alias']}: "
                       f"{'canary aborted' if d['role'] == 'canary' else 'binding disabled'}"
                       for d in data.get("detached") or [])
    show_answer(a, "adapter", data, f"disabled {data['label']}" + (f"; with it:{detached}" if detached else ""))
    return 0


def adapter_enable(a: argparse.Namespace) -> int:
    data = admin_request(a, "POST", f"/adapters/{a.adapter}/enable")
    show_answer(a, "adapter", data, f"enabled {data['label']} (bindings disabled with it stay disabled: "
          f"`binding enable TENANT ALIAS`)")
    return 0


def adapter_fail(a: argparse.Namespace) -> int:
    data = admin_request(a, "POST", f"/adapters/{a.adapter}/fail", {"reason": a.reason, "verification": a.verification})
    show_answer(a, "adapter", data, f"marked {data['label']} failed")
    return 0


def bind(a: argparse.Namespace) -> int:
    data = admin_request(a, "PUT", _b(a), {"adapter": a.adapter, "on_disabled": a.on_disabled})
    show_answer(a, "binding", data, f"{a.tenant}/{a.alias} -> {ref_label(data['active'])}")
    return 0


def binding_list(a: argparse.Namespace) -> int:
    show_answer(a, "binding", admin_request(a, "GET", "/bindings", params={"tenant": a.tenant}))
    return 0


def binding_show(a: argparse.Namespace) -> int:
    show_answer(a, "binding", admin_request(a, "GET", _b(a)))
    return 0


def binding_delete(a: argparse.Namespace) -> int:
    data = admin_request(a, "DELETE", _b(a))
    print(json.dumps(data) if a.json else f"removed {a.tenant}/{a.alias}")
    return 0


def binding_enable(a: argparse.Namespace) -> int:
    show_answer(a, "binding", admin_request(a, "POST", _b(a, "/enable"), {"on_disabled": a.on_disabled}),
          f"enabled {a.tenant}/{a.alias}")
    return 0


def binding_disable(a: argparse.Namespace) -> int:
    data = admin_request(a, "POST", _b(a, "/disable"), {"on_disabled": a.on_disabled})
    show_answer(a, "binding", data, f"disabled {a.tenant}/{a.alias} (requests: "
          f"{'answered by the base model' if data['on_disabled'] == 'base' else 'refused'})")
    return 0


def rollback(a: argparse.Namespace) -> int:
    data = admin_request(a, "POST", _b(a, "/rollback"))
    show_answer(a, "binding", data, f"rolled {a.tenant}/{a.alias} back to {ref_label(data['active'])}")
    return 0


def canary_start(a: argparse.Namespace) -> int:
    data = admin_request(a, "POST", _b(a, "/canary"), {"adapter": a.adapter, "percent": a.percent})
    show_answer(a, "binding", data, f"canary {ref_label(data['canary'])} at {data['canary_percent']:g}% on {a.tenant}/{a.alias}")
    return 0


CONDITIONAL_TRIES = 10
"""Read-modify-write attempts of a relative change before giving up (each 412 means a concurrent write)."""


def canary_set(a: argparse.Namespace) -> int:
    if (a.percent is None) == (a.by is None):
        print("error: give either PERCENT or --by DELTA", file=sys.stderr)
        return 2
    if a.by is None:
        data = admin_request(a, "PATCH", _b(a, "/canary"), {"percent": a.percent})
    else:  # relative: read, compute, write only if nobody changed it in between (else read again)
        for attempt in range(CONDITIONAL_TRIES):
            cur = admin_request(a, "GET", _b(a, ""))
            if cur["canary"] is None:
                raise AdminError(409, f"{a.tenant}/{a.alias} has no canary", "no_canary")
            percent = min(100.0, max(0.0, cur["canary_percent"] + a.by))
            try:
                data = admin_request(a, "PATCH", _b(a, "/canary"), {"percent": percent, "row_version": cur["row_version"]})
                break
            except AdminError as exc:
                if exc.status != 412 or attempt == CONDITIONAL_TRIES - 1:
                    raise
                time.sleep(random.uniform(0, 0.02 * (attempt + 1)))  # let the other writer finish
    show_answer(a, "binding", data, f"canary of {a.tenant}/{a.alias} now at {data['canary_percent']:g}%")
    return 0


def canary_promote(a: argparse.Namespace) -> int:
    data = admin_request(a, "POST", _b(a, "/canary/promote"))
    show_answer(a, "binding", data, f"promoted {ref_label(data['active'])} on {a.tenant}/{a.alias}")
    return 0


def canary_abort(a: argparse.Namespace) -> int:
    show_answer(a, "binding", admin_request(a, "DELETE", _b(a, "/canary")), f"aborted the canary on {a.tenant}/{a.alias}")
    return 0


def _check_value(r: dict[str, Any], side: str) -> str:
    """One arm's number in a check row: ``x of n`` for a share, ``value (n)`` for samples."""
    events, n, v = r.get(f"{side}_events"), r.get(f"{side}_n"), r.get(side)
    if events is not None and n:
        return f"{events} of {n}"
    if v is None:
        return "-" if n is None else f"- ({n})"
    return f"{v:.4g}" + (f" ({n})" if n is not None else "")


VERDICTS = {"fail": "FAILED", "pass": "ok", "inconclusive": "unsure", "no data": "no data"}


def _checks_table(checks: list[dict[str, Any]], said: str = "") -> list[str]:
    """A judgement's checks as a table, then the failed and unsure ones in words (but what ``said``
    already says)."""
    rows = [("CHECK", "VERDICT", "CANARY", "ACTIVE", "RATIO", "LIMIT", "TEST", "P")]
    words = []
    for r in checks:
        name = f"{r['check']}[{r['segment']}]" if r.get("segment") else r["check"]
        verdict = r.get("verdict") or ("fail" if r.get("failed") else "pass")
        ratio = r.get("ratio")
        rows.append((name, VERDICTS.get(verdict, verdict), _check_value(r, "canary"), _check_value(r, "active"),
                     "-" if ratio is None else ratio if isinstance(ratio, str) else f"{ratio:.3g}",
                     f"{r['threshold']:g}", r.get("test") or "-", "-" if r.get("p") is None else f"{r['p']:.3g}"))
        if verdict in ("fail", "inconclusive") and r.get("reason") and r["reason"] not in said:
            words.append(f"    {name}: {r['reason']}")
    if len(rows) == 1:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["    " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows] + words


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
    segmented = [f"{k} per {v['segment']}" for k, v in d["checks"].items() if isinstance(v, dict)]
    lines.append(f"  policy: steps {'/'.join(f'{x:g}' for x in d['steps'])} %, every {d['interval_s']:g} s, "
                 f"at least {d['min_requests']} requests per arm, abort after {d['max_failures']} failed "
                 f"judgement(s) an interval apart, {d['proportion_test']} / {d['sample_test']} at alpha "
                 f"{d['alpha']:g}" + (f"; {', '.join(segmented)}" if segmented else ""))
    last = d.get("last") or {}
    if last:
        lines.append(f"  last judgement: {last.get('decision')}"
                     + (f", window {last['window_s']:g} s: canary {last['canary_requests']} requests, active "
                        f"{last['active_requests']}" if "window_s" in last else "")
                     + (f", failures {last['failures']} of {last['max_failures']}" if last.get("failures") else ""))
        if last.get("reason"):
            lines.append(f"    {last['reason']}")
        lines += _checks_table(last.get("checks", []), last.get("reason") or "")
    return "\n".join(lines)


def canary_status(a: argparse.Namespace) -> int:
    data = admin_request(a, "GET", _b(a, "/canary/policy"))
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
            value, _, segment = value.partition("@")
            bad = AdminError(400, f"--check takes NAME=THRESHOLD or NAME=THRESHOLD@metadata.KEY, got {item!r}",
                             "invalid_value")
            try:
                threshold = float(value)
            except ValueError:
                raise bad from None
            if not sep:
                raise bad
            checks[name] = {"threshold": threshold, "segment": segment} if segment else threshold
        body["checks"] = checks
    data = admin_request(a, "PUT", _b(a, "/canary/policy"), {k: v for k, v in body.items() if v is not None})
    print(json.dumps(data, indent=2, sort_keys=True) if a.json else _policy_text(data))
    return 0


def canary_pause(a: argparse.Namespace) -> int:
    data = admin_request(a, "POST", _b(a, "/canary/pause"))
    print(json.dumps(data, indent=2, sort_keys=True) if a.json else _policy_text(data))
    return 0


def canary_resume(a: argparse.Namespace) -> int:
    data = admin_request(a, "POST", _b(a, "/canary/resume"))
    print(json.dumps(data, indent=2, sort_keys=True) if a.json else _policy_text(data))
    return 0


def audit(a: argparse.Namespace) -> int:
    data = admin_request(a, "GET", "/audit", params={"actor": a.actor, "action": a.action, "target": a.target,
                                                "since_version": a.since_version, "limit": a.limit})
    show_answer(a, "audit", data)
    return 0


LIMIT_FLAGS = {"requests_per_min": "--requests-per-min", "tokens_per_min": "--tokens-per-min",
               "max_concurrent": "--max-concurrent"}
"""The ``tenant limits`` options that apply a report's suggestion, per dimension."""


def _dim_cell(d: dict[str, Any]) -> str:
    limit = "-" if d["limit"] is None else "unlimited" if d["limit"] == 0 else f"{d['limit']:,}"
    return f"{limit} ({d['p99']:,}/{d['peak']:,})"


def limits_report_text(data: dict[str, Any]) -> str:
    """The limits report for people: a table, then each suggestion with its reason, its before and
    after, and the ``tenant limits`` command that applies it (audited like any limits change)."""
    order = "most throttled first" if data["sort"] == "throttled" else "least headroom first"
    when = "%Y-%m-%d %H:%M UTC"
    low, high = data["keep_band"]
    lines = [f"limits over {data['window']} ({time.strftime(when, time.gmtime(data['start']))} .. "
             f"{time.strftime(when, time.gmtime(data['end']))}), {order}",
             f"per minute: {data['percentile']}; a limit outside {low:g}-{high:g}x its p99 gets the p99 + "
             f"{data['headroom_percent']}% headroom, rounded up to 2 significant figures"]
    if data["note"]:
        lines.append(f"note: {data['note']}")
    rows = [("TENANT", "MINUTES", "THROTTLED", "429s", "REQ/MIN (P99/PEAK)", "TOK/MIN (P99/PEAK)",
             "CONCURRENT (P99/PEAK)", "USED")]
    for r in data["data"]:
        lim = r["limits"]
        rows.append((r["tenant"], f"{r['minutes']:,}", f"{r['throttled_minutes']:,}",
                     ", ".join(f"{k} {n:,}" for k, n in r["refused"].items()) or "-",
                     _dim_cell(lim["requests_per_min"]), _dim_cell(lim["tokens_per_min"]),
                     _dim_cell(lim["max_concurrent"]), "-" if r["used"] is None else f"{r['used']:.0%}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if not data["data"]:
        lines.append("(no tenant had traffic in this window)")
    shown = len(data["data"])
    lines.append(f"{shown} shown of {data['tenants_with_traffic']} tenant(s) with traffic "
                 f"({data['tenants_total']} in the registry)" + ("; --limit shows more" if data["truncated"] else ""))
    for r in data["data"]:
        notes = [(k, d) for k, d in r["limits"].items() if d["suggested"] is not None or d["throttled_minutes"]
                 or not r["enough_data"]]
        if not notes:
            continue
        lines.append(f"\n{r['tenant']}:")
        if not r["enough_data"]:
            lines.append(f"  no suggestion: too little data: {r['minutes']:,} minute(s) with traffic over "
                         f"{data['window']}, {data['min_minutes']} needed for a p99")
            continue
        for k, d in notes:
            change = f"{k} {d['limit']:,} -> {d['suggested']:,}" if d["suggested"] is not None else f"{k} keep"
            lines.append(f"  {change}: {d['reason']}")
        if r["apply"]:
            flags = " ".join(f"{LIMIT_FLAGS[k]} {v}" for k, v in r["apply"].items())
            lines.append(f"  apply: loraplex admin tenant limits {r['tenant']} {flags}")
    return "\n".join(lines)


def limits_report(a: argparse.Namespace) -> int:
    data = admin_request(a, "GET", "/limits/report", params={"window": a.window, "sort": a.sort, "tenant": a.tenant,
                                                        "limit": a.limit, "headroom": a.headroom})
    print(json.dumps(data, indent=2, sort_keys=True) if a.json else limits_report_text(data))
    return 0


def version(a: argparse.Namespace) -> int:
    data = admin_request(a, "GET", "/version")
    print(json.dumps(data) if a.json else f"registry version {data['version']}")
    return 0


