"""The console's routes: the shell page, its two static files, and one HTML fragment per view."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response
from starlette.routing import Route

from loraplex.settings import Settings
from loraplex.tokens import Principal, TokenError, Verifier, bearer
from loraplex.wire import WorkerReport
from registry import validators
from registry.canary import DEFAULTS, validate_policy
from registry.console import present, queries, usage_view
from registry.errors import Conflict, Invalid, RegistryError
from registry.service import RegistryService

log = logging.getLogger("loraplex.registry.console")
HERE = Path(__file__).resolve().parent
STATIC = {"console.js": "text/javascript; charset=utf-8", "console.css": "text/css; charset=utf-8"}
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; form-action 'none'; base-uri 'none'; frame-ancestors 'none'",
    "x-frame-options": "DENY", "x-content-type-options": "nosniff", "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
FLEET_PAGE = 50
CHARTED = 8
"""Versions drawn in the live page's charts (the busiest of the page): more lines are unreadable."""
LIVE_WINDOW_S = 300
"""The span of the live page's charts (the live numbers' window, ``gateway.live_stats.WINDOW_S``)."""


class ConsoleSources(Protocol):
    """The fleet and the live numbers, from the process that serves the console (the gateway)."""

    async def workers(self) -> list[WorkerReport]: ...

    async def ejections(self) -> dict[str, Any]:
        """Workers the gateways' outlier detection ejected, by id: each with ``until`` (epoch seconds),
        ``reason`` (the failure that did it) and ``streak`` (ejections in a row)."""
        ...

    async def live(self) -> dict[str, dict[str, Any]]: ...


def _env() -> Environment:
    env = Environment(loader=FileSystemLoader(str(HERE / "templates")), autoescape=select_autoescape(default=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["q"] = lambda v: quote(str(v), safe="")
    env.filters["pct"] = lambda v: "" if v is None else f"{100 * v:.1f}%"
    env.filters["ms"] = lambda v: "" if v is None else f"{1000 * v:.0f} ms"
    env.filters["tojson_attr"] = lambda v: json.dumps(v, separators=(",", ":"))
    env.filters["plural"] = lambda n, noun: f"{n:,} {noun}{'' if n == 1 else 's'}"
    env.filters["text"] = present.text
    env.filters["short"] = present.short
    env.globals.update(changes=present.changes, judgement=present.judgement, checks=present.checks,
                       summary=present.summary)
    return env


class Refused(Exception):
    def __init__(self, status: int, title: str, detail: str) -> None:
        self.status, self.title, self.detail = status, title, detail


def console_routes(service: RegistryService, settings: Settings, verifier: Verifier,
                   sources: ConsoleSources | None) -> list[Route]:
    env = _env()

    def render(template: str, code: int = 200, **ctx: Any) -> Response:
        return HTMLResponse(env.get_template(template).render(**ctx), status_code=code, headers=SECURITY_HEADERS)

    def principal(request: Request) -> Principal:
        try:
            p = verifier.verify(bearer(request.headers.get("authorization")))
        except TokenError as exc:
            if "expired" in exc.message:
                raise Refused(401, "Your token has expired", "Mint a new admin token (loraplex token --admin) "
                                                              "and sign in again.") from None
            raise Refused(401, "This token is not valid here", f"The token was refused: {exc.message}. "
                                                               "Sign in with an admin token of this deployment.") from None
        if not p.has_scope(settings.jwt_admin_scope):
            who = f"tenant {p.tenant!r}" if p.tenant else (p.subject or "this subject")
            raise Refused(403, "This token is not an admin token",
                          f"It belongs to {who} and lacks the {settings.jwt_admin_scope!r} scope: the console needs "
                          "an admin token (loraplex token --admin).")
        return p

    async def shell(request: Request) -> Response:
        return render("shell.html")

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return Response("not found", status_code=404, headers=SECURITY_HEADERS)
        return FileResponse(HERE / "static" / name, media_type=STATIC[name],
                            headers={**SECURITY_HEADERS, "cache-control": "no-cache"})

    async def view(request: Request) -> Response:
        t0 = time.perf_counter()
        page = request.path_params["page"]
        handler = VIEWS.get(page)
        try:
            who = principal(request)
            if handler is None:
                raise Refused(404, "No such page", f"The console has no page {page!r}.")
            resp = await handler(request, who)
        except Refused as r:
            resp = render("refused.html", r.status, title=r.title, detail=r.detail, signed_out=r.status in (401, 403))
        except RegistryError as exc:
            resp = render("refused.html", exc.status, title="The registry refused", detail=exc.message,
                          signed_out=False)
            resp.headers.update(exc.headers)  # a 503's retry-after
        except Exception:
            log.exception("console view %s failed", page)
            resp = render("refused.html", 500, title="This page failed",
                          detail="The console could not build this page; the server's log has the details.",
                          signed_out=False)
        resp.headers["server-timing"] = f"view;dur={1000 * (time.perf_counter() - t0):.1f}"
        return resp

    def arg(request: Request, name: str, limit: int = 200) -> str:
        return request.query_params.get(name, "").strip()[:limit]

    async def whoami(request: Request, who: Principal) -> Response:
        return render("whoami.html", subject=who.subject or "admin")

    async def tenants(request: Request, who: Principal) -> Response:
        q, status, after = arg(request, "q"), arg(request, "status"), arg(request, "after")
        page = await queries.tenants(service, q=q, status=status, after=after)
        return render("tenants.html", page=page, q=q, status=status, after=after)

    async def tenant(request: Request, who: Principal) -> Response:
        slug = arg(request, "slug")
        data = await queries.tenant(service, slug)
        return render("tenant.html", **data, priorities=("high", "normal", "low"),
                      bindable=await queries.bindable(service, slug), defaults=DEFAULTS)

    async def adapters(request: Request, who: Principal) -> Response:
        q, status, after = arg(request, "q"), arg(request, "status"), arg(request, "after")
        page = await queries.adapters(service, q=q, status=status, after=after)
        bases = [b.name for b in await service.list_base_models()]
        return render("adapters.html", page=page, q=q, status=status, after=after, bases=bases)

    async def adapter(request: Request, who: Principal) -> Response:
        a = await service.get_adapter(arg(request, "ref"))
        return render("adapter.html", a=a.to_json(), v=a.verification or {})

    async def fleet(request: Request, who: Principal) -> Response:
        if sources is None:
            return render("unavailable.html", what="the fleet")
        q = arg(request, "q")
        start = int(arg(request, "start") or 0) if arg(request, "start").isdigit() else 0
        reports = sorted(await sources.workers(), key=lambda r: r.worker_id)
        ids = {a for r in reports for a in (*r.device_adapters, *r.host_adapters)}
        names = await queries.labels(service, ids)
        ejected = await sources.ejections()
        rows = []
        now = time.time()
        for r in reports:
            device = sorted(names.get(a, a) for a in r.device_adapters)
            host = sorted(names.get(a, a) for a in set(r.host_adapters) - set(r.device_adapters))
            if q and not (r.worker_id.startswith(q) or any(label.startswith(q) for label in (*device, *host))):
                continue
            used = 1 - r.free_kv_blocks / r.total_kv_blocks if r.total_kv_blocks else None
            e = ejected.get(r.worker_id)
            ejection = None if e is None else {
                "until": time.strftime("%H:%M:%S", time.gmtime(e.until)), "left_s": max(0.0, e.until - now),
                "reason": e.reason.replace("_", " "), "streak": e.streak}
            rows.append({"r": r, "device": device, "host": host, "kv_used": used, "age_s": max(0.0, now - r.timestamp),
                         "ejected": ejection})
        return render("fleet.html", rows=rows[start:start + FLEET_PAGE], total=len(rows), start=start, q=q,
                      page=FLEET_PAGE)

    async def live(request: Request, who: Principal) -> Response:
        if sources is None:
            return render("unavailable.html", what="live numbers")
        q = arg(request, "q")
        start = int(arg(request, "start")) if arg(request, "start").isdigit() else 0
        stats = await sources.live()
        rows = sorted(((v, s) for v, s in stats.items() if not q or v.startswith(q)),
                      key=lambda vs: (-vs[1]["requests"], vs[0]))
        shown = rows[start:start + FLEET_PAGE]
        charted = {v: s.get("series", []) for v, s in shown[:CHARTED]}
        return render("live.html", rows=shown, total=len(rows), start=start, q=q, page=FLEET_PAGE,
                      charted={v: c for v, c in charted.items() if c}, window_s=LIVE_WINDOW_S, now=int(time.time()))

    async def audit(request: Request, who: Principal) -> Response:
        f = {k: arg(request, k) for k in ("actor", "action", "target")}
        before = arg(request, "before")
        page = await queries.audit(service, actor=f["actor"], action=f["action"], target=f["target"],
                                   before=int(before) if before.isdigit() else None)
        return render("audit.html", page=page, f=f)

    async def confirm(request: Request, who: Principal) -> Response:
        return render("confirm.html", **await _confirm(service, request))

    async def limits(request: Request, who: Principal) -> Response:
        """The limits report (``registry.limits_report``); each suggestion's Apply is the limits confirm step."""
        from registry.limits_report import DEFAULT_WINDOW, UNITS, limits_report

        window, sort = arg(request, "window", 8) or DEFAULT_WINDOW, arg(request, "sort", 16) or "throttled"
        report = await limits_report(service, window=window, sort=sort)
        return render("limits.html", r=report, window=window, sort=sort, dims=list(UNITS.items()))

    async def usage(request: Request, who: Principal) -> Response:
        """The fleet's usage (``usage_view``): charts per bucket and the top tenants."""
        window = arg(request, "window", 8)
        return render("usage.html", **await usage_view.fleet_usage(
            service, window if window in usage_view.WINDOWS else usage_view.DEFAULT_WINDOW))

    async def tenant_usage(request: Request, who: Principal) -> Response:
        """A tenant's usage: charts, by alias and version, outcomes."""
        window = arg(request, "window", 8)
        return render("tenant_usage.html", **await usage_view.tenant_usage(
            service, arg(request, "slug"), window if window in usage_view.WINDOWS else usage_view.DEFAULT_WINDOW))

    VIEWS: dict[str, Callable[[Request, Principal], Awaitable[Response]]] = {
        "whoami": whoami, "tenants": tenants, "tenant": tenant, "adapters": adapters, "adapter": adapter,
        "fleet": fleet,
        "live": live, "audit": audit, "confirm": confirm, "limits": limits,
        "usage": usage, "tenant_usage": tenant_usage,
    }
    return [Route("/console", shell, methods=["GET"]), Route("/console/static/{name}", static, methods=["GET"]),
            Route("/console/view/{page}", view, methods=["GET"])]


_LIMITS = ("requests_per_min", "tokens_per_min", "max_concurrent", "priority")


async def _confirm(service: RegistryService, request: Request) -> dict[str, Any]:
    """What an action would change: ``rows`` of (field, before, after), and the admin API call."""
    q = request.query_params
    action, slug, alias = q.get("action", ""), q.get("slug", ""), q.get("alias", "")
    t_path = f"{request.scope.get('root_path', '')}/tenants/{quote(slug, safe='')}"
    b_path = f"{t_path}/bindings/{quote(alias, safe='')}"
    back = f"#tenant?slug={quote(slug, safe='')}"
    if action == "limits":
        if q.get("back", "").startswith("#limits?"):  # applied from the limits report: back to it
            back = q["back"]
        t = (await queries.tenant(service, slug))["tenant"]
        body: dict[str, Any] = {}
        for k in _LIMITS:
            v = q.get(k, "").strip()
            if v == "" or v == str(t[k]):
                continue
            body[k] = v if k == "priority" else _int(v, k)
        rows = [(k, t[k], body[k]) for k in body]
        return _call(f"Change the limits of {slug}", rows, "PATCH", f"{t_path}/limits", body, t["row_version"], back)
    if action == "cache_scope":
        t = (await queries.tenant(service, slug))["tenant"]
        scope = validators.cache_scope(q.get("cache_scope", "").strip())  # the refusal here, before anything is called
        rows = [("cache_scope", _scope_text(t["cache_scope"]), _scope_text(scope))] if scope != t["cache_scope"] else []
        return _call(f"Change the prefix cache scope of {slug}", rows, "PUT", f"{t_path}/cache-scope",
                     {"cache_scope": scope}, t["row_version"], back, note=_SCOPE_NOTE if scope else None)
    if action in ("enable", "disable"):
        t = (await queries.tenant(service, slug))["tenant"]
        after = "active" if action == "enable" else "disabled"
        return _call(f"{action.capitalize()} tenant {slug}", [("status", t["status"], after)], "POST",
                     f"{t_path}/{action}", None, None, back)
    if action == "activate":
        return await _activate(service, q.get("ref", ""), request.scope.get("root_path", ""))
    if action == "bind":
        return await _bind(service, slug, alias, q.get("adapter", "").strip(), b_path, back)
    if action == "canary":
        return await _canary(service, slug, alias, q, b_path, back)
    b = await queries.binding(service, slug, alias)
    label = {k: (b[k] or {}).get("label") for k in ("active", "previous", "canary")}
    if action == "percent":
        pct = _number(q.get("percent", ""), "percent")
        return _call(f"Move the canary of {slug}/{alias}", [("canary", label["canary"], label["canary"]),
                                                             ("canary_percent", b["canary_percent"], pct)],
                     "PATCH", f"{b_path}/canary", {"percent": pct}, b["row_version"], back)
    if action == "rollback":
        if not label["previous"]:
            raise Conflict(f"{slug}/{alias} has no previous version to roll back to", "no_previous")
        return _call(f"Roll back {slug}/{alias}", [("active", label["active"], label["previous"]),
                                                   ("previous", label["previous"], label["active"])],
                     "POST", f"{b_path}/rollback", None, b["row_version"], back)
    if action == "promote":
        return _call(f"Promote the canary of {slug}/{alias}",
                     [("active", label["active"], label["canary"]), ("previous", label["previous"], label["active"]),
                      ("canary", label["canary"], None), ("canary_percent", b["canary_percent"], 0.0)],
                     "POST", f"{b_path}/canary/promote", None, b["row_version"], back)
    if action == "abort":
        return _call(f"Abort the canary of {slug}/{alias}",
                     [("canary", label["canary"], None), ("canary_percent", b["canary_percent"], 0.0)],
                     "DELETE", f"{b_path}/canary", None, b["row_version"], back)
    raise Invalid(f"unknown action {action!r}", "unknown_action")


_SCOPE_NOTE = ("Its requests will reuse the cached prompt prefixes of every tenant in this scope, and theirs its "
               "own: each of them can tell from response times whether another sent a prompt.")


def _scope_text(scope: str) -> str:
    return f"shared: {scope}" if scope else "its own"


def _call(title: str, rows: list[tuple[str, Any, Any]], method: str, path: str, body: dict[str, Any] | None,
          row_version: int | None, back: str, **extra: Any) -> dict[str, Any]:
    return _calls(title, rows, [(method, path, body, row_version)], back, **extra)


def _calls(title: str, rows: list[tuple[str, Any, Any]], calls: list[tuple[str, str, Any, int | None]], back: str,
           **extra: Any) -> dict[str, Any]:
    """A confirm step: its rows and the admin API calls it makes, in order (each one audited)."""
    return {"title": title, "rows": rows, "back": back, "note": None, "evidence": None, **extra,
            "calls": [{"method": m, "path": p, "body": b, "if_match": v} for m, p, b, v in calls]}


async def _activate(service: RegistryService, ref: str, root: str) -> dict[str, Any]:
    a = await service.get_adapter(ref)
    path = f"{root}/adapters/{quote(a.label, safe='')}"
    back = f"#adapter?ref={quote(a.label, safe='')}"
    if a.status == "active":
        return _calls(f"Activate {a.label}", [], [], back)
    note = ("The activation gate runs first: a worker of its base model loads the version and answers probe "
            "prompts with and without it. The version becomes active only if its answers differ from the base "
            "model's and are answers (not empty, not one text for every prompt); otherwise it is marked failed "
            "with the evidence. Either way the evidence is recorded on the version and in the audit log. The probe takes "
            "a few seconds to a minute, depending on the worker's load.")
    return _call(f"Activate {a.label}", [("status", a.status, "active (if the gate passes)")], "POST",
                 f"{path}/activate", {}, a.row_version, back, note=note, evidence=a.verification)


async def _bind(service: RegistryService, slug: str, alias: str, adapter: str, b_path: str,
                back: str) -> dict[str, Any]:
    if not alias:
        raise Invalid("give the alias to bind", param="alias")
    if not adapter:
        raise Invalid("choose the adapter version to bind", param="adapter")
    a = await service.get_adapter(adapter)
    if a.status != "active":
        raise Conflict(f"{a.label} is {a.status}: activate it first (the activation gate)", "adapter_not_active")
    b = await queries.binding_or_none(service, slug, alias)
    if b is None:
        return _call(f"Bind a new alias {slug}/{alias}", [("active", None, a.label)], "PUT", b_path,
                     {"adapter": a.label}, None, back)
    cur = (b["active"] or {}).get("label")
    prev = (b["previous"] or {}).get("label")
    rows = [("active", cur, a.label), ("previous", prev, cur if cur != a.label else prev)]
    return _call(f"Bind {slug}/{alias} to {a.label}", [r for r in rows if r[1] != r[2]], "PUT", b_path,
                 {"adapter": a.label}, b["row_version"], back)


POLICY_FIELDS = ("steps", "interval_s", "min_requests", "max_failures")
"""The policy fields the console's canary form sets (the rest keep their values or defaults)."""


async def _canary(service: RegistryService, slug: str, alias: str, q: Any, b_path: str, back: str) -> dict[str, Any]:
    """Start a canary judged by a policy: set the policy (where it changes), then start at its first step."""
    adapter = q.get("adapter", "").strip()
    if not adapter:
        raise Invalid("choose the adapter version to canary", param="adapter")
    a = await service.get_adapter(adapter)
    b = await queries.binding(service, slug, alias)
    if a.status != "active":
        raise Conflict(f"{a.label} is {a.status}: activate it first (the activation gate)", "adapter_not_active")
    if a.label == (b["active"] or {}).get("label"):
        raise Invalid(f"{a.label} is already the active version of {slug}/{alias}", "canary_is_active",
                      param="adapter")
    if b["canary"] and b["canary"]["label"] != a.label:
        raise Conflict(f"{slug}/{alias} already has a canary ({b['canary']['label']}); promote or abort it first",
                       "canary_in_progress")
    old = await queries.policy(service, slug, alias)
    base = {k: old[k] for k in DEFAULTS} if old else None
    given: dict[str, Any] = {}
    raw_steps = q.get("steps", "").strip()
    if raw_steps:
        given["steps"] = [_number(x.strip().rstrip("%"), "steps") for x in raw_steps.split(",") if x.strip()]
    for k in ("interval_s",):
        if q.get(k, "").strip():
            given[k] = _number(q[k].strip(), k)
    for k in ("min_requests", "max_failures"):
        if q.get(k, "").strip():
            given[k] = _int(q[k].strip(), k)
    config = validate_policy(given, base)  # the refusal here, before anything is called
    first = config["steps"][0]
    rows: list[tuple[str, Any, Any]] = [("canary", (b["canary"] or {}).get("label"), a.label),
                                        ("canary_percent", b["canary_percent"], first)]
    rows += [(f"policy {k}", present.text(old[k]) if old else None, present.text(config[k])) for k in POLICY_FIELDS
             if not old or old[k] != config[k]]
    calls: list[tuple[str, str, Any, int | None]] = []
    if not old or any(old[k] != config[k] for k in POLICY_FIELDS):
        calls.append(("PUT", f"{b_path}/canary/policy", {k: config[k] for k in POLICY_FIELDS}, None))
    calls.append(("POST", f"{b_path}/canary", {"adapter": a.label, "percent": first}, b["row_version"]))
    note = (f"The canary judge then steps it through {'/'.join(f'{s:g}' for s in config['steps'])} %, at least "
            f"{config['interval_s']:g} s a step, judging on at least {config['min_requests']} requests per arm; "
            f"{config['max_failures']} failed judgements abort it, and after the last step it is promoted.")
    return _calls(f"Start a canary of {a.label} on {slug}/{alias}", rows, calls, back, note=note)


def _int(v: str, name: str) -> int:
    if not v.lstrip("-").isdigit():
        raise Invalid(f"{name} must be a whole number, not {v!r}", param=name)
    return int(v)


def _number(v: str, name: str) -> float:
    try:
        return float(v)
    except ValueError:
        raise Invalid(f"{name} must be a number, not {v!r}", param=name) from None
