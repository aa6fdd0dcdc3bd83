"""SIGTERM drains the usage ledger: a real ``loraplex gateway`` process on the PostgreSQL registry,
in front of a stub worker, with a flush interval far longer than the test. Its ledger holds
every request when it is stopped; after the signal the database has them all, exactly the
usage its clients received."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from loraplex.tokens import mint
from registry.service import RegistryService
from registry.usage import totals
from tests.e2e_cluster import Proc, free_port
from tests.registry_support import TINY, fresh_registry, make_settings, write_adapter
from tests.stub_worker import StubProcess

pytestmark = pytest.mark.e2e  # real processes on loopback

BIN = Path(sys.executable).parent / "loraplex"


async def _seed(settings) -> str:
    svc = RegistryService(settings)
    try:
        await svc.register_base_model(TINY)
        await svc.create_tenant("acme", requests_per_min=100_000, tokens_per_min=10_000_000)
        await svc.create_tenant("globex", requests_per_min=100_000, tokens_per_min=10_000_000)
        d = write_adapter(Path(settings.resolved_adapter_root()) / "support-1", TINY, seed=1)
        a = await svc.register_adapter("support", str(d), TINY.name, owner="acme")
        version = (await svc.activate_adapter(a.id, verification={"probe": "ok"})).id
        await svc.bind("acme", "support", version)
        return version
    finally:
        await svc.close()


def _usage(r: httpx.Response, stream: bool) -> dict:
    if not stream:
        return r.json()["usage"]
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    return events[-1]["usage"]


def test_sigterm_writes_every_request_of_the_ledger(pg_url, tmp_path):
    settings = make_settings(tmp_path, pg_url)
    asyncio.run(fresh_registry(pg_url))
    version = asyncio.run(_seed(settings))
    with StubProcess("w1", base_model=TINY.name, extra=("--chunks", "4000")) as stub:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")} | {
            "LORAPLEX_HOME": settings.home, "LORAPLEX_DATABASE_URL": pg_url,
            "LORAPLEX_ADAPTER_ROOT": settings.resolved_adapter_root(), "LORAPLEX_WORKER_URLS": stub.url,
            "LORAPLEX_GATEWAY_PORT": str(port), "LORAPLEX_GATEWAY_METRICS_PORT": str(free_port()),
            "LORAPLEX_USAGE_FLUSH_INTERVAL_S": "3600", "LORAPLEX_LOG_LEVEL": "WARNING"}
        gw = Proc("gateway", [str(BIN), "gateway"], env, tmp_path / "gateway.log", f"http://127.0.0.1:{port}")
        gw.start()
        try:
            deadline = time.monotonic() + 60
            while True:
                assert gw.alive(), gw.tail()
                try:
                    if httpx.get(gw.url + "/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, gw.tail()
                time.sleep(0.2)
            received = {"acme": [0, 0], "globex": [0, 0]}
            with httpx.Client(base_url=gw.url, timeout=30) as c:
                for i in range(12):
                    tenant = "acme" if i % 3 else "globex"
                    model = "support" if tenant == "acme" else TINY.name
                    stream = i % 2 == 0
                    body = {"model": model, "messages": [{"role": "user", "content": f"hello {i}"}],
                            "max_tokens": 3 + i, "stream": stream}
                    if stream:
                        body["stream_options"] = {"include_usage": True}
                    r = c.post("/v1/chat/completions", json=body,
                               headers={"authorization": f"Bearer {mint(settings, 'u', tenant=tenant)}"})
                    assert r.status_code == 200, r.text
                    usage = _usage(r, stream)
                    received[tenant][0] += 1
                    received[tenant][1] += usage["prompt_tokens"] + usage["completion_tokens"]
            gw.send_signal(signal.SIGTERM)
            # uvicorn re-raises the signal once it has shut down: -SIGTERM is its clean exit.
            assert gw.popen is not None and gw.popen.wait(timeout=60) in (0, -signal.SIGTERM), gw.tail()
        finally:
            gw.kill()

    got = asyncio.run(totals(pg_url, by=("tenant", "version")))
    assert {k: [v.requests, v.prompt_tokens + v.completion_tokens] for k, v in got.items()} == {
        ("acme", version): received["acme"], ("globex", ""): received["globex"]}
