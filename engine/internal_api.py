"""The bundled worker's side of the control API (``engine.control_api``): ``BundledControl``.

The routes, their bodies, answers, secret and errors are ``engine.control_api``'s, shared with
``loraplex vllm-agent``. Here they act on the engine's adapter manager: a load waits until the
adapter is in host memory or failed; a pin starts a load and does not wait; an unload refuses
while running sequences use the adapter; the probe runs through the normal engine path (one
batch). Without LoRA (``max_loras`` 0) every adapter route answers 404 ``lora_disabled`` after
the auth check; before the model is loaded every route answers 503 ``loading``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.routing import Route

from engine.control import ControlError
from engine.control_api import ControlBackend, control_routes
from engine.engine import PromptTooLongError
from engine.request_events import RequestEvents
from engine.scheduler import QueueFullError
from engine.sequence import SamplingParams
from loraplex.wire import PRIORITY_CLASSES, AdapterRef

LOAD_TIMEOUT_S = 300.0


def describe(ref: AdapterRef, st: Any) -> dict[str, Any]:
    tier = "device" if st.slot is not None else ("host" if st.in_host else "none")
    return {"id": ref.id, "name": ref.name, "uri": ref.uri, "tier": tier, "state": st.state,
            "pinned": st.pinned, "users": st.users, "rank": st.rank, "slot": st.slot, "error": st.error}


async def load_and_wait(manager: Any, ref: AdapterRef, *, pin: bool = False) -> tuple[Any, float]:
    """Start loading (pinning if asked) and wait until in host memory or failed."""
    t0 = time.perf_counter()
    if pin:
        manager.pin(ref)
    else:
        manager.prefetch(ref)
    try:
        st = await asyncio.to_thread(manager.wait, ref, LOAD_TIMEOUT_S)
    except TimeoutError:
        raise ControlError(504, f"adapter {ref.id} did not load within {LOAD_TIMEOUT_S:.0f} s",
                           "adapter_load_timeout", "server_error") from None
    ms = (time.perf_counter() - t0) * 1000.0
    if st.state not in ("host", "device"):
        raise ControlError(422, f"adapter {ref.name} could not be loaded: {st.error or st.state}",
                           "adapter_load_failed")
    return st, ms


async def run_to_text(engine: Any, prompt_ids: list[int], params: SamplingParams,
                      adapter: AdapterRef | None) -> str:
    """One request through the engine; its text (raises ControlError on an engine error)."""
    events = RequestEvents()
    seq = engine.add_request(prompt_ids, params, adapter=adapter, tenant="_probe",
                             priority=PRIORITY_CLASSES["normal"], listener=events.listener)
    try:
        ev = await events.finished()
    except asyncio.CancelledError:
        engine.abort(seq)
        raise
    if ev.finish_reason == "error":
        status = 422 if ev.error_code == "adapter_load_failed" else 503
        raise ControlError(status, ev.error or "generation failed", ev.error_code or "engine_error",
                           "server_error" if status == 503 else "invalid_request_error")
    return seq.output_text


class BundledControl(ControlBackend):
    """The control API over the worker's engine and its adapter manager (``state.engine``, once
    loaded: until then every route answers 503 ``loading``)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self._tokenizer: bytes | None = None
        """The tokenizer answer, built once (a few MB of JSON)."""

    @property
    def engine(self) -> Any:
        return self.state.engine

    @property
    def manager(self) -> Any:
        return self.state.engine.lora_runtime.manager

    def check(self, *, adapters: bool) -> None:
        eng = self.state.engine
        if eng is None:
            raise ControlError(503, "the worker is still loading its model", "loading", "server_error")
        if adapters and eng.lora_runtime is None:
            raise ControlError(404, "LoRA is disabled on this worker (max_loras=0)", "lora_disabled")

    def tokenizer(self) -> bytes:
        if self._tokenizer is None:
            eng = self.engine
            info = eng.info
            data = {"base_model": info.name if info else self.state.model_name,
                    "base_revision": info.revision if info else "", "max_model_len": eng.max_model_len,
                    "tokenizer": eng.tokenizer.to_dict()}
            self._tokenizer = json.dumps(data, separators=(",", ":")).encode()
        return self._tokenizer

    def adapters(self) -> list[dict[str, Any]]:
        return [describe(ref, st) for ref, st in self.manager.entries()]

    def resident(self) -> dict[str, int]:
        return self.manager.resident_counts()

    async def load(self, ref: AdapterRef, *, pin: bool, reload: bool) -> tuple[dict[str, Any], float]:
        """``reload`` changes nothing: the manager's table is the engine's own, never stale."""
        manager = self.manager
        _, ms = await load_and_wait(manager, ref, pin=pin)
        return describe(ref, manager.state(ref)), ms

    async def unload(self, aid: str, *, force: bool) -> None:
        from engine.lora.manager import AdapterBusy

        try:
            found = await asyncio.to_thread(_locked, self.engine, self.manager.unload, aid, force=force)
        except AdapterBusy as exc:
            raise ControlError(409, str(exc), "adapter_busy") from None
        if not found:
            raise ControlError(404, f"adapter {aid} is not loaded on this worker", "not_found")

    def _known(self, aid: str) -> AdapterRef:
        for ref, _ in self.manager.entries():
            if ref.id == aid:
                return ref
        raise ControlError(404, f"adapter {aid} is not known to this worker", "not_found")

    async def pin(self, ref: AdapterRef) -> dict[str, Any]:
        manager = self.manager
        manager.pin(ref)
        return describe(ref, manager.state(ref))

    async def pin_known(self, aid: str) -> dict[str, Any]:
        return await self.pin(self._known(aid))

    async def unpin(self, aid: str) -> dict[str, Any]:
        manager = self.manager
        ref = self._known(aid)
        manager.unpin(ref)
        return describe(ref, manager.state(ref))

    async def probe(self, ref: AdapterRef, prompts: list[str], max_tokens: int) -> tuple[list[tuple[str, str]], float]:
        """Through the normal engine path, in one batch: the prompts are encoded (chat template)
        before the adapter loads."""
        eng = self.engine
        try:
            encoded = [eng.tokenizer.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True)
                       for p in prompts]
        except Exception as exc:
            raise ControlError(400, f"cannot apply the chat template: {exc}", "invalid_value") from None
        _, load_ms = await load_and_wait(self.manager, ref)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        try:
            texts = await asyncio.gather(*(run_to_text(eng, ids, params, a)
                                           for ids in encoded for a in (None, ref)))
        except PromptTooLongError as exc:
            raise ControlError(400, str(exc), "context_length_exceeded") from None
        except QueueFullError as exc:
            raise ControlError(503, str(exc), "queue_full", "server_error") from None
        return [(texts[2 * i], texts[2 * i + 1]) for i in range(len(prompts))], load_ms


def internal_routes(state: Any) -> list[Route]:
    """The control API (``engine.control_api``) over this worker's engine."""
    return control_routes(BundledControl(state), state.settings)


def _locked(engine: Any, fn: Any, *args: Any, **kw: Any) -> Any:
    """Run ``fn`` under the engine lock (no step in flight touches the slots meanwhile)."""
    with engine._lock:
        return fn(*args, **kw)
