"""``loraplex vllm-agent``: a vLLM OpenAI server as a loraplex worker.

The agent runs beside one vLLM server (started with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``). It publishes that server's ``WorkerReport``
(``backend="vllm"``: ``url`` is vLLM's, ``control_url`` the agent's) built from vLLM's
``/v1/models`` and ``/metrics``, and serves the bundled worker's control API
(``engine.control_api``'s routes over ``AgentControl``): a load fetches the version
through the worker's sources and disk cache (sha256 checked) and registers it with vLLM
under ``lora_name`` = the immutable version id; at most ``max_adapters`` names are
registered, least recently used unloaded first. Restarts: a restarted agent adopts the names
vLLM still holds; when vLLM itself goes (its port refuses connections) the agent withdraws its
report and forgets every name, since a restarted vLLM holds none, and loads on demand again.
Torch-free: it runs from the plain install.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.control import ControlError
from engine.control_api import ControlBackend, control_routes
from engine.lora.sources import (
    AdapterFetchError,
    AdapterSource,
    DiskCache,
    sources_from_settings,
    verify_digest,
)
from loraplex.peft_config import ADAPTER_FILES
from loraplex.residency import ResidencyStore
from loraplex.settings import Settings
from loraplex.wire import BACKEND_VLLM, AdapterRef, WorkerReport

log = logging.getLogger("loraplex.vllm_agent")

VLLM_TIMEOUT_S = 120.0
OBSERVE_TIMEOUT_S = 10.0
LOAD_GRACE_S = 5.0
"""A name handed out by a load is not evicted for this long: the gateway's request for it is on
its way to vLLM (vLLM's unload drops the name at once, answering that request 404, while
requests it has already taken run to the end)."""
MAX_MISSES = 3
"""Looks at vLLM that may time out in a row before the agent withdraws its report (a refused
connection withdraws it at once)."""


@dataclass
class AgentConfig:
    vllm_url: str
    """vLLM's base URL as the gateway reaches it (the report's ``url``)."""
    url: str
    """The agent's own URL as the gateway reaches it (the report's ``control_url``)."""
    worker_id: str
    base_model: str
    """The registry's name of the base model vLLM serves (what the gateway routes by)."""
    base_revision: str = ""
    served_model: str = ""
    """vLLM's name of the base model (default: the first model ``/v1/models`` lists without a parent)."""
    max_adapters: int = 64
    max_num_seqs: int = 0
    tokenizer_path: str = ""
    """The base model's GGUF file or HF directory: ``/internal/tokenizer`` serves its tokenizer."""
    vllm_api_key: str = ""


@dataclass
class _Held:
    ref: AdapterRef
    pinned: bool = False
    error: str | None = None
    since: float = field(default_factory=time.monotonic)
    """When it was registered (an observation that started earlier may not list it yet)."""
    granted: float = 0.0
    """When a load last handed it out (``LOAD_GRACE_S``)."""


@dataclass
class VllmState:
    """What the last look at vLLM showed."""

    up: bool = False
    loaded: list[str] = field(default_factory=list)
    served_model: str = ""
    max_model_len: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks: int = 0
    lora_in_use: set[str] = field(default_factory=set)


class _Copied:
    """A local source whose files are copied into the disk cache entry (vLLM then reads exactly
    the bytes whose digest was checked, whatever later happens to the source directory)."""

    remote = True

    def __init__(self, source: AdapterSource) -> None:
        self.source = source
        self.schemes = source.schemes

    def fetch(self, ref: AdapterRef, dest: Path | None) -> Path:
        assert dest is not None
        src = self.source.fetch(ref, None)
        for name in ADAPTER_FILES:
            if not (src / name).is_file():
                raise AdapterFetchError(f"{name} not found in {src}")
            shutil.copyfile(src / name, dest / name, follow_symlinks=False)
        return dest


class VllmAgent:
    """The adapter table, vLLM's state and the calls to vLLM."""

    def __init__(self, config: AgentConfig, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.sources = sources_from_settings(settings)
        self.disk = DiskCache(Path(settings.resolved_adapter_cache_dir()) / "vllm",
                              max_bytes=settings.adapter_cache_max_bytes)
        self.held: OrderedDict[str, _Held] = OrderedDict()
        """Version ids registered with vLLM, least recently used first."""
        self.failed: dict[str, str] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._room = asyncio.Lock()
        self.vllm = VllmState()
        self.misses = 0
        headers = {"authorization": f"Bearer {config.vllm_api_key}"} if config.vllm_api_key else {}
        self.http = httpx.AsyncClient(base_url=config.vllm_url.rstrip("/"), timeout=VLLM_TIMEOUT_S,
                                      headers=headers, trust_env=False)
        self._tokenizer: bytes | None = None
        self.loads = 0
        """Versions registered with vLLM since start (``/health`` says; benches count loads with it)."""
        self.unloads = 0

    async def close(self) -> None:
        await self.http.aclose()

    # -- vLLM's state ---------------------------------------------------------------------------

    async def observe(self) -> VllmState:
        """Read ``/v1/models`` and ``/metrics``; adopt names vLLM holds that this agent does not
        know (registered before an agent restart) and forget those it lost (a vLLM restart)."""
        state = VllmState()
        started = time.monotonic()
        try:
            models = (await self.http.get("/v1/models", timeout=OBSERVE_TIMEOUT_S)).raise_for_status().json()["data"]
            metrics = (await self.http.get("/metrics", timeout=OBSERVE_TIMEOUT_S)).raise_for_status().text
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            self.misses += 1
            # Refused: vLLM is gone. Slow: busy, so the last state stands a few looks more.
            refused = isinstance(exc, httpx.ConnectError)
            if refused or self.misses >= MAX_MISSES:
                if self.vllm.up:
                    log.warning("vLLM at %s does not answer: %s: %s", self.config.vllm_url, type(exc).__name__, exc)
                self.vllm = state
            if refused:
                self._forget_all()
            return self.vllm
        self.misses = 0
        state.up = True
        for m in models:
            if m.get("parent"):
                state.loaded.append(str(m["id"]))
            elif not state.served_model:
                state.served_model = str(m["id"])
                state.max_model_len = int(m.get("max_model_len") or 0)
        state.served_model = self.config.served_model or state.served_model
        _read_metrics(metrics, state)
        loaded = set(state.loaded)
        for aid in [a for a, h in self.held.items() if a not in loaded and h.since < started and not self._busy(a)]:
            del self.held[aid]
        for aid in state.loaded:
            if aid not in self.held:
                self.held[aid] = _Held(AdapterRef(id=aid, name=aid, uri=""))
        for aid in state.lora_in_use & loaded:
            self.held.move_to_end(aid)  # requests vLLM runs with it: recently used
        self.vllm = state
        return state

    def _forget_all(self) -> None:
        """vLLM refuses connections: its process is gone, and whatever starts on its port holds no
        adapter. Its names (pins included) are forgotten now, so a load asked for during the outage
        fails as one (503) instead of answering from a stale table, and one asked for after the
        restart registers the version again."""
        for aid in [a for a in self.held if not self._busy(a)]:
            del self.held[aid]

    def _busy(self, aid: str) -> bool:
        lock = self._locks.get(aid)
        return lock is not None and lock.locked()

    def report(self) -> WorkerReport:
        s, c = self.vllm, self.config
        total = s.kv_blocks
        return WorkerReport(
            worker_id=c.worker_id, url=c.vllm_url.rstrip("/"), base_model=c.base_model,
            base_revision=c.base_revision, device_adapters=list(s.loaded), queue_depth=s.waiting,
            running=s.running, free_kv_blocks=int(total * (1.0 - s.kv_usage)), total_kv_blocks=total,
            max_num_seqs=c.max_num_seqs, max_loras=c.max_adapters, backend=BACKEND_VLLM,
            control_url=c.url.rstrip("/"), served_model=s.served_model)

    # -- adapters -------------------------------------------------------------------------------

    def describe(self, held: _Held) -> dict[str, Any]:
        ref = held.ref
        loaded = ref.id in self.held
        return {"id": ref.id, "name": ref.name, "uri": ref.uri, "tier": "device" if loaded else "none",
                "state": "device" if loaded else ("failed" if held.error else "absent"), "pinned": held.pinned,
                "users": 0, "rank": ref.rank, "slot": None, "error": held.error}

    async def load(self, ref: AdapterRef, *, pin: bool = False, again: bool = False) -> tuple[_Held, float]:
        """Register ``ref`` with vLLM (fetched and verified first) unless it is; ``again``: even when
        the table has it (vLLM answered a request for it 404, so the table is stale). (entry, ms)"""
        t0 = time.perf_counter()
        if ref.base_revision and self.config.base_revision and ref.base_revision != self.config.base_revision:
            raise ControlError(422, f"adapter {ref.name} could not be loaded: it was registered for base revision "
                               f"{ref.base_revision!r}; this worker serves {self.config.base_revision!r}",
                               "adapter_load_failed")
        lock = self._locks.setdefault(ref.id, asyncio.Lock())
        async with lock:
            held = self.held.get(ref.id)
            if held is None or again:
                try:
                    path = await asyncio.to_thread(self._fetch, ref)
                except (AdapterFetchError, OSError) as exc:
                    self.failed[ref.id] = str(exc)
                    raise ControlError(422, f"adapter {ref.name} could not be loaded: {exc}",
                                       "adapter_load_failed") from None
                if held is None:
                    await self._make_room()
                registered = await self._register(ref, path)
                self.loads += registered  # not ``+= await``: that reads the count before the wait
                held = self.held.setdefault(ref.id, _Held(ref))
                self.failed.pop(ref.id, None)
            if not held.ref.uri and ref.uri:
                held.ref = ref  # adopted from vLLM: now with its registry fields
            self.held.move_to_end(ref.id)
            held.pinned = held.pinned or pin
            held.granted = time.monotonic()
        return held, (time.perf_counter() - t0) * 1000.0

    def _fetch(self, ref: AdapterRef) -> Path:
        source = self.sources.for_uri(ref.uri)
        cached = self.disk.get(ref)
        if cached is not None:
            try:
                verify_digest(ref, cached)
                return cached
            except AdapterFetchError:
                self.disk.remove(ref)  # corrupted: fetched again below
        return self.disk.fill(ref, source if source.remote else _Copied(source))

    async def _register(self, ref: AdapterRef, path: Path) -> bool:
        """Register ``ref`` under its version id: True, or False when vLLM already had the name."""
        try:
            r = await self.http.post("/v1/load_lora_adapter", json={"lora_name": ref.id, "lora_path": str(path)})
        except httpx.HTTPError as exc:
            raise ControlError(503, f"vLLM did not answer the load: {type(exc).__name__}: {exc}", "vllm_unavailable",
                               "server_error") from None
        if r.status_code == 200 or (r.status_code == 400 and "already" in r.text):
            return r.status_code == 200
        message = _vllm_message(r)
        if r.status_code >= 500:
            raise ControlError(503, f"vLLM failed to load adapter {ref.name}: {message}", "vllm_unavailable",
                               "server_error")
        self.failed[ref.id] = message
        raise ControlError(422, f"adapter {ref.name} could not be loaded: vLLM refused it: {message}",
                           "adapter_load_failed")

    async def _make_room(self) -> None:
        """Unload least recently used unpinned names until one more fits in ``max_adapters``; names
        handed out in the last ``LOAD_GRACE_S`` are waited for, not evicted."""
        async with self._room:
            while len(self.held) >= self.config.max_adapters:
                now = time.monotonic()
                free = [(a, h) for a, h in self.held.items() if not h.pinned and not self._busy(a)]
                if not free:
                    raise ControlError(503, f"all {len(self.held)} adapter names on this worker are pinned or "
                                       "loading", "adapters_full", "server_error")
                victim = next((a for a, h in free if now - h.granted >= LOAD_GRACE_S), None)
                if victim is None:  # every one is about to be used: the oldest grace ends first
                    await asyncio.sleep(min(0.25, LOAD_GRACE_S - now + min(h.granted for _, h in free)))
                    continue
                await self._unregister(victim)

    async def _unregister(self, aid: str) -> bool:
        try:
            r = await self.http.post("/v1/unload_lora_adapter", json={"lora_name": aid})
        except httpx.HTTPError as exc:
            raise ControlError(503, f"vLLM did not answer the unload: {type(exc).__name__}: {exc}",
                               "vllm_unavailable", "server_error") from None
        self.held.pop(aid, None)
        self.unloads += 1
        if r.status_code >= 500:
            raise ControlError(503, f"vLLM failed to unload {aid}: {_vllm_message(r)}", "vllm_unavailable",
                               "server_error")
        return r.status_code == 200

    async def unload(self, aid: str, *, force: bool) -> None:
        held = self.held.get(aid)
        if held is None:
            raise ControlError(404, f"adapter {aid} is not loaded on this worker", "not_found")
        if held.pinned and not force:
            raise ControlError(409, f"adapter {aid} is pinned (unload with force)", "adapter_busy")
        await self._unregister(aid)

    async def complete_text(self, model: str, prompt: str, max_tokens: int) -> str:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0.0}
        try:
            r = await self.http.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            raise ControlError(503, f"vLLM did not answer: {type(exc).__name__}: {exc}", "vllm_unavailable",
                               "server_error") from None
        if r.status_code == 400:
            raise ControlError(400, _vllm_message(r), "invalid_value")
        if r.status_code != 200:
            raise ControlError(503, f"vLLM answered HTTP {r.status_code}: {_vllm_message(r)}", "engine_error",
                               "server_error")
        return str(r.json()["choices"][0]["message"]["content"] or "")

    def tokenizer_body(self) -> bytes:
        if self._tokenizer is None:
            import json

            from loraplex.tokenizer import TextTokenizer

            tok = TextTokenizer.from_model_path(self.config.tokenizer_path)
            data = {"base_model": self.config.base_model, "base_revision": self.config.base_revision,
                    "max_model_len": self.vllm.max_model_len, "tokenizer": tok.to_dict()}
            self._tokenizer = json.dumps(data, separators=(",", ":")).encode()
        return self._tokenizer


def _vllm_message(r: httpx.Response) -> str:
    try:
        data = r.json()
        err = data.get("error", data) if isinstance(data, dict) else data
        return str(err.get("message", err) if isinstance(err, dict) else err)[:500]
    except ValueError:
        return r.text[:500] or f"HTTP {r.status_code}"


def _read_metrics(text: str, state: VllmState) -> None:
    """vLLM's Prometheus gauges: requests running/waiting, KV usage and blocks, LoRAs in use."""
    from prometheus_client.parser import text_string_to_metric_families

    latest = -1.0  # vLLM keeps every lora_requests_info series it set; the value is when
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            if name == "vllm:num_requests_running":
                state.running += int(s.value)
            elif name == "vllm:num_requests_waiting":
                state.waiting += int(s.value)
            elif name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                state.kv_usage = float(s.value)
            elif name == "vllm:cache_config_info":
                blocks = s.labels.get("num_gpu_blocks") or s.labels.get("num_cpu_blocks") or "0"
                state.kv_blocks = int(blocks) if blocks.isdigit() else 0
            elif name == "vllm:lora_requests_info" and s.value > latest:
                latest = s.value
                state.lora_in_use = {a for key in ("running_lora_adapters", "waiting_lora_adapters")
                                     for a in s.labels.get(key, "").split(",") if a}


class AgentControl(ControlBackend):
    """The control API (``engine.control_api``) over the agent's name table and its vLLM."""

    def __init__(self, agent: VllmAgent) -> None:
        self.agent = agent

    def check(self, *, adapters: bool) -> None:
        """Always answers: a call that needs vLLM fails on its own (503 ``vllm_unavailable``)."""

    def tokenizer(self) -> bytes:
        if not self.agent.config.tokenizer_path:
            raise ControlError(404, "this agent was started without the base model's tokenizer (--model)", "not_found")
        return self.agent.tokenizer_body()

    def adapters(self) -> list[dict[str, Any]]:
        agent = self.agent
        return [agent.describe(h) for h in agent.held.values()]

    def resident(self) -> dict[str, int]:
        return {"device": len(self.agent.held), "host": 0, "disk": self.agent.disk.count()}

    async def load(self, ref: AdapterRef, *, pin: bool, reload: bool) -> tuple[dict[str, Any], float]:
        held, ms = await self.agent.load(ref, pin=pin, again=reload)
        return self.agent.describe(held), ms

    async def unload(self, aid: str, *, force: bool) -> None:
        await self.agent.unload(aid, force=force)

    def _known(self, aid: str) -> _Held:
        held = self.agent.held.get(aid)
        if held is None:
            raise ControlError(404, f"adapter {aid} is not known to this worker", "not_found")
        return held

    async def pin(self, ref: AdapterRef) -> dict[str, Any]:
        held, _ = await self.agent.load(ref, pin=True)
        return self.agent.describe(held)

    async def pin_known(self, aid: str) -> dict[str, Any]:
        held = self._known(aid)
        held.pinned = True
        return self.agent.describe(held)

    async def unpin(self, aid: str) -> dict[str, Any]:
        held = self._known(aid)
        held.pinned = False
        return self.agent.describe(held)

    async def probe(self, ref: AdapterRef, prompts: list[str], max_tokens: int) -> tuple[list[tuple[str, str]], float]:
        """Through vLLM's chat route: the base model by vLLM's name, the adapter by its version id."""
        agent = self.agent
        _, load_ms = await agent.load(ref)
        base = agent.vllm.served_model or agent.config.served_model
        if not base:
            raise ControlError(503, "vLLM has not been reached yet", "loading", "server_error")
        texts = await asyncio.gather(*(agent.complete_text(m, p, max_tokens) for p in prompts for m in (base, ref.id)))
        return [(texts[2 * i], texts[2 * i + 1]) for i in range(len(prompts))], load_ms


async def report_forever(agent: VllmAgent, store: ResidencyStore, settings: Settings) -> None:
    """Publish the report every interval while vLLM answers; withdraw it when vLLM stops answering.

    The report is the agent's heartbeat, which the gateway reads to tell a live worker from a hung
    one (``Router.gone_quiet``): it goes out every interval, whatever a look at vLLM takes. vLLM
    busy with a full batch can take seconds to answer ``/v1/models`` and ``/metrics``, longer than
    the report TTL; the last state then stands until the look ends, and ``observe`` withdraws it
    only after ``MAX_MISSES`` slow looks in a row (a refused connection at once)."""
    interval = max(0.05, float(settings.report_interval_s))
    ttl = max(settings.worker_report_ttl_s, 3 * interval)
    published = False
    look: asyncio.Task[VllmState] | None = None
    try:
        while True:
            if look is None or look.done():
                if look is not None and not look.cancelled() and look.exception() is not None:
                    log.warning("looking at vLLM failed: %s", look.exception())
                look = asyncio.create_task(agent.observe(), name="vllm-agent-observe")
            done, _ = await asyncio.wait({look}, timeout=interval)
            try:
                if agent.vllm.up:
                    await store.publish(agent.report(), ttl)
                    published = True
                elif published:
                    await store.remove(agent.config.worker_id)
                    published = False
            except Exception as exc:  # a flaky store must not stop the agent
                log.warning("residency report failed: %s", exc)
            if done:
                await asyncio.sleep(interval)
    finally:
        if look is not None:
            look.cancel()
        with contextlib.suppress(Exception):
            await asyncio.shield(store.remove(agent.config.worker_id))


def create_agent_app(config: AgentConfig, settings: Settings, store: ResidencyStore | None = None) -> Starlette:
    """The agent's app: the control API, ``/health`` (vLLM reached) and the report loop."""
    agent = VllmAgent(config, settings)

    async def health(request: Request) -> Response:
        s = agent.vllm
        return JSONResponse({"status": "ok" if s.up else "vllm_down", "worker_id": config.worker_id,
                             "vllm_url": config.vllm_url, "adapters": len(agent.held), "loads": agent.loads,
                             "unloads": agent.unloads},
                            status_code=200 if s.up else 503)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        nonlocal store
        closer = None
        if store is None:
            from engine.reporter import residency_store

            store, closer = residency_store(settings)
        await agent.observe()
        task = asyncio.create_task(report_forever(agent, store, settings), name="vllm-agent-report")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await agent.close()
            if closer is not None:
                await closer.aclose()

    app = Starlette(routes=[Route("/health", health, methods=["GET"]), *control_routes(AgentControl(agent), settings)], lifespan=lifespan)
    app.state.agent = agent
    return app

