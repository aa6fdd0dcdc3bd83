"""End to end, production topology: one tenant never reaches or breaks another.

Real PostgreSQL + Redis, two gateways, two workers on the demo model, configured with a
non-default worker secret as an operator would. The worker port is probed as an attacker on
the internal network would; poisoned adapters are refused at admission and, forced into the
workers through their control API (the operator's path, bypassing the registry), fail only
their own requests; a burst across both gateways never admits more tokens than the limit.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from loraplex.digest import digest_directory
from loraplex.wire import EXT_KEY, HDR_WORKER_SECRET
from tests.e2e_cluster import Cluster
from tests.engine_fixtures import demo_model_file

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DEMO = Path(__file__).resolve().parent.parent / "demo" / "adapters"
WORKER_SECRET = "e2e-worker-secret-" + uuid.uuid4().hex
QUESTIONS = ["What is the capital of Italy?", "Name a large ocean.", "How many legs does a spider have?",
             "What colour is the sky?"]
POISONS = {"alpha-1e38": 1e38, "alpha-1e300": 1e300, "alpha-nan": float("nan")}


@pytest.fixture(scope="module")
def cluster(pg_url, redis_url, tmp_path_factory):
    model = demo_model_file()
    assert model is not None, "the demo model could not be fetched"
    home = tmp_path_factory.mktemp("e2e-iso")
    c = Cluster(home=home, database_url=pg_url, redis_url=redis_url,
                redis_prefix=f"loraplex-e2e-{uuid.uuid4().hex[:8]}", model=str(model),
                extra_env={"LORAPLEX_WORKER_SECRET": WORKER_SECRET},
                # The test hook: workers without the admission bounds, so a poisoned adapter forced in
                # through their control API reaches the engine step (gateways keep the bounds).
                worker_env={"LORAPLEX_MAX_LORA_SCALE": "inf", "LORAPLEX_MAX_LORA_DELTA": "inf"})
    with c.running():
        _seed(c)
        yield c


def _seed(c: Cluster) -> None:
    c.base_name = c.admin("POST", "/base-models", {"path": c.model})["name"]
    for slug in ("acme", "globex"):
        c.admin("POST", "/tenants", {"slug": slug, "requests_per_min": 10_000, "tokens_per_min": 1_000_000,
                                     "max_concurrent": 64})
    for tenant, name in (("acme", "french"), ("globex", "json")):
        dst = c.home / "adapters" / tenant / name
        shutil.copytree(DEMO / name, dst)
        ad = c.admin("POST", "/adapters", {"name": f"{tenant}-{name}", "uri": str(dst), "base_model": c.base_name,
                                           "owner": tenant})
        assert c.admin("POST", f"/adapters/{ad['id']}/activate", {})["status"] == "active"
    c.admin("PUT", "/tenants/acme/bindings/assistant", {"adapter": "acme-french@1"})
    c.admin("PUT", "/tenants/globex/bindings/assistant", {"adapter": "globex-json@1"})
    c.wait_current()


def _poisoned_dir(c: Cluster, name: str, alpha: float) -> Path:
    dst = c.home / "adapters" / "mallory" / name
    if not dst.exists():
        shutil.copytree(DEMO / "terse", dst)
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg["lora_alpha"] = alpha
        (dst / "adapter_config.json").write_text(json.dumps(cfg))  # json writes NaN as NaN, as an attacker would
    return dst


def _ref(vid: str, path: Path | str, *, sha256: str | None = None) -> dict:
    uri = path.as_uri() if isinstance(path, Path) else path
    return {"id": vid, "name": vid, "uri": uri, "sha256": sha256, "rank": 8}


class _Listener:
    """A loopback socket that records every connection made to it (nothing may connect)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)
        self.sock.close()


def _adapter_ids(c: Cluster) -> set[str]:
    ids: set[str] = set()
    for w in c.workers:
        r = httpx.get(w.url + "/internal/adapters", headers={HDR_WORKER_SECRET: WORKER_SECRET}, timeout=10)
        assert r.status_code == 200, r.text
        ids |= {a["id"] for a in r.json()["adapters"]}
    return ids


def test_direct_worker_calls_without_the_gateway_credential_never_reach_an_adapter(cluster):
    target = cluster.home / "adapters" / "acme" / "secret"
    shutil.copytree(DEMO / "terse", target)
    ad = cluster.admin("POST", "/adapters", {"name": "acme-secret", "uri": str(target),
                                             "base_model": cluster.base_name, "owner": "acme"})
    ref = _ref(ad["id"], target, sha256=digest_directory(target))
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            EXT_KEY: {"adapter": ref, "tenant": "acme", "priority": 0}}
    for w in cluster.workers:
        for headers, status in (({}, 401), ({HDR_WORKER_SECRET: "guess"}, 403)):
            for path in ("/v1/chat/completions", "/v1/completions"):
                payload = body if path.endswith("chat/completions") else {**body, "prompt": "hi"}
                r = httpx.post(w.url + path, json=payload, headers=headers, timeout=30)
                assert r.status_code == status, (w.name, path, r.text)
                assert r.json()["error"]["message"]
            r = httpx.post(w.url + "/internal/adapters/load", json={"adapter": ref}, headers=headers, timeout=30)
            assert r.status_code == status, r.text
    assert ad["id"] not in _adapter_ids(cluster)  # never loaded anywhere
    print(f"\nworker door: {len(cluster.workers) * 6} direct calls without the credential refused (401/403)")


def test_no_url_or_path_outside_the_configured_sources_is_fetched(cluster, tmp_path):
    listener = _Listener()
    outside = tmp_path / "outside"
    shutil.copytree(DEMO / "terse", outside)
    escape = cluster.home / "adapters" / "escape"
    escape.symlink_to(outside, target_is_directory=True)  # inside the root by name, outside by target
    uris = [f"http://127.0.0.1:{listener.port}/adapter", f"http://127.0.0.1:{listener.port}/{escape}",
            f"file://{outside}", str(outside), str(escape), str(cluster.home / "adapters" / ".." / "outside"),
            "file:///etc", "/etc"]
    try:
        for i, uri in enumerate(uris):
            # Even with the credential (a compromised or misconfigured gateway), the worker refuses.
            for w in cluster.workers:
                ref = _ref(f"ssrf-{i}-{w.name}", uri, sha256="0" * 64)
                r = httpx.post(w.url + "/internal/adapters/load", json={"adapter": ref},
                               headers={HDR_WORKER_SECRET: WORKER_SECRET}, timeout=30)
                assert r.status_code in (400, 403, 422), (uri, r.text)
                r = httpx.post(w.url + "/v1/chat/completions", headers={HDR_WORKER_SECRET: WORKER_SECRET},
                               json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                     EXT_KEY: {"adapter": ref, "tenant": "acme", "priority": 1}}, timeout=30)
                assert r.status_code >= 400, (uri, r.text)
            # And the registry does not admit it.
            r = httpx.post(cluster.gateways[0].url + "/admin/adapters", timeout=30,
                           headers={"Authorization": f"Bearer {_admin_token(cluster)}"},
                           json={"name": f"ssrf-{i}", "uri": uri, "base_model": cluster.base_name})
            assert r.status_code in (400, 422), (uri, r.text)
        time.sleep(0.5)
        assert listener.accepted == 0
    finally:
        listener.close()
    print(f"\nsources: {len(uris)} outside URIs x {len(cluster.workers)} workers refused, 0 connections made")


def _admin_token(c: Cluster) -> str:
    from loraplex.tokens import mint_admin

    return mint_admin(c.settings)


def test_poisoned_adapters_are_refused_at_admission(cluster):
    before = cluster.admin("GET", "/adapters")
    for name, alpha in POISONS.items():
        path = _poisoned_dir(cluster, name, alpha)
        r = httpx.post(cluster.gateways[1].url + "/admin/adapters", timeout=30,
                       headers={"Authorization": f"Bearer {_admin_token(cluster)}"},
                       json={"name": f"mallory-{name}", "uri": str(path), "base_model": cluster.base_name})
        assert r.status_code == 422, (name, r.text)
        assert r.json()["error"]["message"] and r.json()["error"]["code"], r.text
    assert cluster.admin("GET", "/adapters") == before


async def _others(c: Cluster, client: httpx.AsyncClient, n: int = 16) -> list[str]:
    async def one(i: int) -> str:
        tenant = ("acme", "globex")[i % 2]
        model = "assistant" if i % 4 < 2 else c.base_name
        r = await client.post(c.gateways[i % 2].url + "/v1/chat/completions",
                              headers={"Authorization": f"Bearer {c.token(tenant)}"},
                              json={"model": model, "temperature": 0, "max_tokens": 24,
                                    "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def test_a_forced_poisoned_adapter_fails_only_its_own_requests(cluster):
    refs = {}
    for name, alpha in POISONS.items():
        path = _poisoned_dir(cluster, name, alpha)
        refs[name] = _ref(f"poison-{name}", path, sha256=digest_directory(path))

    async def run() -> tuple[list[str], list[str], list[str], list[tuple[str, int, str]]]:
        async with httpx.AsyncClient(timeout=120.0) as client:
            alone = await _others(cluster, client)

            async def poisoned(name: str, w: int) -> tuple[str, int, str]:
                worker = cluster.workers[w]
                r = await client.post(worker.url + "/v1/chat/completions", headers={HDR_WORKER_SECRET: WORKER_SECRET},
                                      json={"model": "x", "temperature": 0, "max_tokens": 24, "stream": w == 1,
                                            "messages": [{"role": "user", "content": QUESTIONS[0]}],
                                            EXT_KEY: {"adapter": refs[name], "tenant": "mallory", "priority": 0}})
                return name, r.status_code, r.text

            jobs = [poisoned(name, w) for name in refs for w in (0, 1)]
            mixed, *bad = await asyncio.gather(_others(cluster, client), *jobs)
            after = await _others(cluster, client)  # KV blocks the poisoned rows used are reused now
            return alone, mixed, after, bad

    alone, mixed, after, bad = asyncio.run(run())
    codes: dict[str, set[str]] = {}
    for name, status, text in bad:
        served = status == 200 and '"error"' not in text
        assert not served, (name, status, text[:300])
        codes.setdefault(name, set()).update(c for c in ("non_finite_output", "adapter_load_failed") if c in text)
    # 1e38 is finite once stored and goes NaN/Inf in the step (contained per row); 1e300 cannot be
    # held in float32 and NaN is no JSON number: both fail to load.
    assert codes == {"alpha-1e38": {"non_finite_output"}, "alpha-1e300": {"adapter_load_failed"},
                     "alpha-nan": {"adapter_load_failed"}}, codes
    assert mixed == alone
    assert after == alone
    for w in cluster.workers:
        assert httpx.get(w.url + "/health", timeout=10).json()["status"] == "ok"
    print(f"\npoison: {len(bad)} forced poisoned requests failed alone ({codes}); 16 + 16 concurrent requests "
          "of other tenants gave the same tokens as without them")


def test_a_burst_across_both_gateways_never_admits_more_tokens_than_the_limit(cluster):
    limit = 2000
    cluster.admin("POST", "/tenants", {"slug": "bursty", "requests_per_min": 10_000, "tokens_per_min": limit,
                                       "max_concurrent": 64})
    cluster.wait_current()
    token = cluster.token("bursty")

    async def burst() -> tuple[list[int], int, float]:
        used: list[int] = []
        cancelled = 0
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=120.0) as client:
            async def one(i: int) -> None:
                nonlocal cancelled
                gw = cluster.gateways[i % 2].url
                headers = {"Authorization": f"Bearer {token}"}
                chat = i % 2 == 0
                body: dict = {"model": cluster.base_name, "temperature": 0}
                if chat:
                    body["messages"] = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
                else:
                    body["prompt"] = "Count from one to one hundred:"
                if i % 3 == 0:  # the old bypass: the gateway must reserve what the worker generates
                    body.update(max_tokens=300, max_completion_tokens=1)
                else:
                    body["max_tokens"] = 48
                path = "/v1/chat/completions" if chat else "/v1/completions"
                if i % 4 == 1:
                    body["stream"] = True
                    body["stream_options"] = {"include_usage": True}
                    async with client.stream("POST", gw + path, json=body, headers=headers) as r:
                        if r.status_code != 200:
                            return
                        if i % 8 == 1:  # cancelled after the first event
                            async for _ in r.aiter_lines():
                                break
                            cancelled += 1
                            return
                        async for line in r.aiter_lines():
                            if line.startswith("data: {") and '"usage":{' in line:
                                used.append(json.loads(line[6:])["usage"]["total_tokens"])
                    return
                r = await client.post(gw + path, json=body, headers=headers)
                if r.status_code == 200:
                    used.append(r.json()["usage"]["total_tokens"])
                else:
                    assert r.status_code == 429, r.text

            await asyncio.gather(*(one(i) for i in range(64)))
        return used, cancelled, time.monotonic() - t0

    used, cancelled, elapsed = asyncio.run(burst())

    def settled_in_logs() -> int:
        total = 0
        for g in cluster.gateways:
            for line in g.log.read_text(errors="replace").splitlines():
                if line.startswith("{") and '"tenant":"bursty"' in line:
                    rec = json.loads(line)
                    total += rec["prompt_tokens"] + rec["completion_tokens"]
        return total

    # Access-log lines are flushed every second: read until the sum holds still past a flush.
    logged, still_since, deadline = settled_in_logs(), time.monotonic(), time.monotonic() + 20
    while time.monotonic() < deadline and (logged < sum(used) or time.monotonic() - still_since < 1.5):
        time.sleep(0.1)
        if (now := settled_in_logs()) != logged:
            logged, still_since = now, time.monotonic()
    allowed = limit + limit * elapsed / 60.0  # the bucket refills while the burst runs
    assert used
    assert sum(used) <= allowed, (sum(used), allowed)
    assert logged <= allowed, (logged, allowed)
    assert logged >= sum(used)
    print(f"\nburst: 64 requests over both gateways in {elapsed:.1f}s ({cancelled} cancelled): "
          f"{len(used)} completed using {sum(used)} tokens, {logged} tokens settled in the access logs, "
          f"limit {limit}/min (+{allowed - limit:.0f} refilled during the burst)")
