"""The worker's internal control endpoints (``/internal/adapters...``), for the internal network.

Every route needs the shared secret ``settings.worker_secret`` in header
``x-loraplex-worker-secret`` (``engine.worker_auth``): missing -> 401, wrong -> 403.
Errors use the OpenAI error shape. Bodies and answers:

* ``GET /internal/adapters`` -> ``{"adapters": [ADAPTER...], "resident": {"device", "host", "disk"}}``
  with ``ADAPTER = {"id", "name", "uri", "tier", "state", "pinned", "users", "rank", "slot", "error"}``
  (``tier``: ``device``/``host``/``none``; ``state``: ``device``/``host``/``loading``/``failed``/``absent``).
* ``POST /internal/adapters/load`` ``{"adapter": AdapterRef, "pin": false}`` (or the AdapterRef
  fields at top level): waits until the adapter is in host memory or failed ->
  200 ``{"adapter": ADAPTER, "load_ms"}``, or 422 ``adapter_load_failed`` with the reason.
* ``POST /internal/adapters/unload`` ``{"id", "force": false}`` -> 200 ``{"unloaded": id}``;
  404 unknown; 409 ``adapter_busy`` while running sequences use it, or pinned unless ``force``.
* ``POST /internal/adapters/pin`` ``{"adapter": AdapterRef}`` or ``{"id"}`` of a known adapter ->
  200 ``{"adapter": ADAPTER}`` (pinning starts a load; it does not wait).
* ``POST /internal/adapters/unpin`` ``{"id"}`` -> 200 ``{"adapter": ADAPTER}``; 404 unknown.
* ``POST /internal/adapters/probe`` ``{"adapter": AdapterRef, "prompts": ["..."], "max_tokens": 32}``:
  each prompt as one user chat message (chat template), greedy, with the base model and with
  the adapter, all through the normal engine path (one batch) -> 200
  ``{"results": [{"prompt", "base", "adapter"}], "adapter_load_ms"}``; a load failure -> 422
  ``adapter_load_failed`` (the only 422: the activation gate reads it as a verdict on the
  adapter). Malformed bodies -> 400.

* ``GET /internal/tokenizer`` -> ``{"base_model", "base_revision", "max_model_len", "tokenizer"}``
  (``tokenizer``: ``loraplex.tokenizer.TextTokenizer.to_dict()``): the gateway counts prompt
  tokens with it exactly as this worker does.

Without LoRA (``max_loras`` 0) every adapter route answers 404 ``lora_disabled`` after the auth check.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.control import ControlError, id_of, parse_probe, read_json, ref_of
from engine.engine import PromptTooLongError
from engine.request_events import RequestEvents
from engine.scheduler import QueueFullError
from engine.sequence import SamplingParams
from engine.worker_auth import SecretRefused, check_worker_secret
from loraplex.wire import HDR_WORKER_SECRET, PRIORITY_CLASSES, AdapterRef

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


def internal_routes(state: Any) -> list[Route]:
    settings = state.settings

    def guarded(handler: Any, *, lora: bool = True) -> Any:
        """The secret checked and the engine loaded (and LoRA on, for ``lora`` routes) before ``handler``."""
        async def endpoint(request: Request) -> Response:
            try:
                check_worker_secret(request.headers.get(HDR_WORKER_SECRET), settings.worker_secret)
                eng = state.engine
                if eng is None:
                    raise ControlError(503, "the worker is still loading its model", "loading", "server_error")
                if lora and eng.lora_runtime is None:
                    raise ControlError(404, "LoRA is disabled on this worker (max_loras=0)", "lora_disabled")
                return await handler(request, eng, eng.lora_runtime.manager if lora else None)
            except (ControlError, SecretRefused) as exc:
                return exc.response()
        return endpoint

    served: list[bytes] = []
    """The tokenizer answer, built once (a few MB of JSON)."""

    async def tokenizer(request: Request, eng: Any, manager: Any) -> Response:
        if not served:
            info = eng.info
            data = {"base_model": info.name if info else state.model_name,
                    "base_revision": info.revision if info else "", "max_model_len": eng.max_model_len,
                    "tokenizer": eng.tokenizer.to_dict()}
            served.append(json.dumps(data, separators=(",", ":")).encode())
        return Response(served[0], media_type="application/json")

    async def list_adapters(request: Request, eng: Any, manager: Any) -> Response:
        adapters = [describe(ref, st) for ref, st in manager.entries()]
        return JSONResponse({"adapters": sorted(adapters, key=lambda a: a["id"]),
                             "resident": manager.resident_counts()})

    async def load(request: Request, eng: Any, manager: Any) -> Response:
        body = await read_json(request, settings.max_body_bytes)
        ref = ref_of(body)
        _, ms = await load_and_wait(manager, ref, pin=bool(body.get("pin", False)))
        return JSONResponse({"adapter": describe(ref, manager.state(ref)), "load_ms": round(ms, 3)})

    async def unload(request: Request, eng: Any, manager: Any) -> Response:
        from engine.lora.manager import AdapterBusy

        body = await read_json(request, settings.max_body_bytes)
        aid = id_of(body)
        try:
            found = await asyncio.to_thread(_locked, eng, manager.unload, aid, force=bool(body.get("force", False)))
        except AdapterBusy as exc:
            raise ControlError(409, str(exc), "adapter_busy") from None
        if not found:
            raise ControlError(404, f"adapter {aid} is not loaded on this worker", "not_found")
        return JSONResponse({"unloaded": aid})

    def _known(manager: Any, aid: str) -> AdapterRef:
        for ref, _ in manager.entries():
            if ref.id == aid:
                return ref
        raise ControlError(404, f"adapter {aid} is not known to this worker", "not_found")

    async def pin(request: Request, eng: Any, manager: Any) -> Response:
        body = await read_json(request, settings.max_body_bytes)
        ref = ref_of(body) if isinstance(body.get("adapter"), dict) or "uri" in body else _known(
            manager, id_of(body))
        manager.pin(ref)
        return JSONResponse({"adapter": describe(ref, manager.state(ref))})

    async def unpin(request: Request, eng: Any, manager: Any) -> Response:
        body = await read_json(request, settings.max_body_bytes)
        ref = _known(manager, id_of(body))
        manager.unpin(ref)
        return JSONResponse({"adapter": describe(ref, manager.state(ref))})

    async def probe(request: Request, eng: Any, manager: Any) -> Response:
        body = await read_json(request, settings.max_body_bytes)
        ref, prompts, max_tokens = parse_probe(body)
        try:
            encoded = [eng.tokenizer.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True)
                       for p in prompts]
        except Exception as exc:
            raise ControlError(400, f"cannot apply the chat template: {exc}", "invalid_value") from None
        _, load_ms = await load_and_wait(manager, ref)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        try:
            texts = await asyncio.gather(*(run_to_text(eng, ids, params, a)
                                           for ids in encoded for a in (None, ref)))
        except PromptTooLongError as exc:
            raise ControlError(400, str(exc), "context_length_exceeded") from None
        except QueueFullError as exc:
            raise ControlError(503, str(exc), "queue_full", "server_error") from None
        results = [{"prompt": p, "base": texts[2 * i], "adapter": texts[2 * i + 1]} for i, p in enumerate(prompts)]
        return JSONResponse({"results": results, "adapter_load_ms": round(load_ms, 3)})

    return [
        Route("/internal/tokenizer", guarded(tokenizer, lora=False), methods=["GET"]),
        Route("/internal/adapters", guarded(list_adapters), methods=["GET"]),
        Route("/internal/adapters/load", guarded(load), methods=["POST"]),
        Route("/internal/adapters/unload", guarded(unload), methods=["POST"]),
        Route("/internal/adapters/pin", guarded(pin), methods=["POST"]),
        Route("/internal/adapters/unpin", guarded(unpin), methods=["POST"]),
        Route("/internal/adapters/probe", guarded(probe), methods=["POST"]),
    ]


def _locked(engine: Any, fn: Any, *args: Any, **kw: Any) -> Any:
    """Run ``fn`` under the engine lock (no step in flight touches the slots meanwhile)."""
    with engine._lock:
        return fn(*args, **kw)
