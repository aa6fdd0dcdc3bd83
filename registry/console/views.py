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
from registry.console import queries
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


class ConsoleSources(Protocol):
    """The fleet and the live numbers, from the process that serves the console (the gateway)."""

    async def workers(self) -> list[WorkerReport]: ...

    async def live(self) -> dict[str, dict[str, Any]]: ...


def _env() -> Environment:
    env = Environment(loader=FileSystemLoader(str(HERE / "templates")), autoescape=select_autoescape(default=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["q"] = lambda v: quote(str(v), safe="")
    env.filters["pct"] = lambda v: "" if v is None else f"{100 * v:.1f}%"
    env.filters["ms"] = lambda v: "" if v is None else f"{1000 * v:.0f} ms"
    env.filters["tojson_attr"] = lambda v: json.dumps(v, separators=(",", ":"))
    env.filters["plural"] = lambda n, noun: f"{n:,} {noun}{'' if n == 1 else 's'}"
    env.globals["changes"] = changes
    return env


def _short(v: Any) -> Any:
    if isinstance(v, dict) and "label" in v:
        return v["label"]  # an adapter reference: its name@version
    return v


def changes(before: Any, after: Any) -> list[tuple[str, Any, Any]]:
    """An audit row's fields that changed, ``(field, before, after)`` (row versions and times left out)."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return [("", before, after)]
    keys = [k for k in {**before, **after} if k not in ("row_version", "updated_at", "created_at")]
    return [(k, _short(before.get(k)), _short(after.get(k))) for k in keys if before.get(k) != after.get(k)]


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
        data = await queries.tenant(service, arg(request, "slug"))
        return render("tenant.html", **data, priorities=("high", "normal", "low"))

    async def adapters(request: Request, who: Principal) -> Response:
        q, status, after = arg(request, "q"), arg(request, "status"), arg(request, "after")
        page = await queries.adapters(service, q=q, status=status, after=after)
        bases = [b["name"] for b in await service.list_base_models()]
        return render("adapters.html", page=page, q=q, status=status, after=after, bases=bases)

    async def fleet(request: Request, who: Principal) -> Response:
        if sources is None:
            return render("unavailable.html", what="the fleet")
        q = arg(request, "q")
        start = int(arg(request, "start") or 0) if arg(request, "start").isdigit() else 0
        reports = sorted(await sources.workers(), key=lambda r: r.worker_id)
        ids = {a for r in reports for a in (*r.device_adapters, *r.host_adapters)}
        names = await queries.version_labels(service, ids)
        rows = []
        now = time.time()
        for r in reports:
            device = sorted(names.get(a, a) for a in r.device_adapters)
            host = sorted(names.get(a, a) for a in set(r.host_adapters) - set(r.device_adapters))
            if q and not (r.worker_id.startswith(q) or any(label.startswith(q) for label in (*device, *host))):
                continue
            used = 1 - r.free_kv_blocks / r.total_kv_blocks if r.total_kv_blocks else None
            rows.append({"r": r, "device": device, "host": host, "kv_used": used, "age_s": max(0.0, now - r.timestamp)})
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
        return render("live.html", rows=rows[start:start + FLEET_PAGE], total=len(rows), start=start, q=q,
                      page=FLEET_PAGE)

    async def audit(request: Request, who: Principal) -> Response:
        f = {k: arg(request, k) for k in ("actor", "action", "target")}
        before = arg(request, "before")
        page = await queries.audit(service, **f, before=int(before) if before.isdigit() else None)
        return render("audit.html", page=page, f=f)

    async def confirm(request: Request, who: Principal) -> Response:
        return render("confirm.html", **await _confirm(service, request))

    VIEWS: dict[str, Callable[[Request, Principal], Awaitable[Response]]] = {
        "whoami": whoami, "tenants": tenants, "tenant": tenant, "adapters": adapters, "fleet": fleet,
        "live": live, "audit": audit, "confirm": confirm,
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
        t = (await queries.tenant(service, slug))["tenant"]
        body: dict[str, Any] = {}
        for k in _LIMITS:
            v = q.get(k, "").strip()
            if v == "" or v == str(t[k]):
                continue
            body[k] = v if k == "priority" else _int(v, k)
        rows = [(k, t[k], body[k]) for k in body]
        return _call(f"Change the limits of {slug}", rows, "PATCH", f"{t_path}/limits", body, t["row_version"], back)
    if action in ("enable", "disable"):
        t = (await queries.tenant(service, slug))["tenant"]
        after = "active" if action == "enable" else "disabled"
        return _call(f"{action.capitalize()} tenant {slug}", [("status", t["status"], after)], "POST",
                     f"{t_path}/{action}", None, None, back)
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


def _call(title: str, rows: list[tuple[str, Any, Any]], method: str, path: str, body: dict[str, Any] | None,
          row_version: int | None, back: str) -> dict[str, Any]:
    return {"title": title, "rows": rows, "method": method, "path": path, "body": body,
            "row_version": row_version, "back": back}


def _int(v: str, name: str) -> int:
    if not v.lstrip("-").isdigit():
        raise Invalid(f"{name} must be a whole number, not {v!r}", param=name)
    return int(v)


def _number(v: str, name: str) -> float:
    try:
        return float(v)
    except ValueError:
        raise Invalid(f"{name} must be a number, not {v!r}", param=name) from None
