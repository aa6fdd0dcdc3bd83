"""The worker's control API (``/internal/...``): one route table over a ``ControlBackend``.

The bundled worker serves it over its engine (``engine.internal_api.BundledControl``) and
``loraplex vllm-agent`` over its vLLM server (``vllm_agent.agent.AgentControl``); both answer
the gateway with the same routes, shapes, secret check and errors. ``control_routes`` reads the
bodies, checks the secret and shapes the answers; a backend does the work.

Every route needs the shared secret ``settings.worker_secret`` in header
``x-loraplex-worker-secret`` (``engine.worker_auth``): missing -> 401, wrong -> 403. Then the
backend may refuse every route while it cannot answer (``ControlBackend.check``). Errors use the
OpenAI error shape (``engine.control.ControlError``). Bodies and answers:

* ``GET /internal/adapters`` -> ``{"adapters": [ADAPTER...], "resident": {"device", "host", "disk"}}``
  with ``ADAPTER = {"id", "name", "uri", "tier", "state", "pinned", "users", "rank", "slot", "error"}``
  (``tier``: ``device``/``host``/``none``; ``state``: ``device``/``host``/``loading``/``failed``/``absent``).
* ``POST /internal/adapters/load`` ``{"adapter": AdapterRef, "pin": false, "reload": false}`` (or the
  AdapterRef fields at top level): waits until the adapter can serve or failed ->
  200 ``{"adapter": ADAPTER, "load_ms"}``, or 422 ``adapter_load_failed`` with the reason.
  ``reload``: the worker's own table may be stale (a vLLM worker answered 404 for the adapter).
* ``POST /internal/adapters/unload`` ``{"id", "force": false}`` -> 200 ``{"unloaded": id}``;
  404 unknown; 409 ``adapter_busy`` while it is in use, or pinned unless ``force``.
* ``POST /internal/adapters/pin`` ``{"adapter": AdapterRef}`` or ``{"id"}`` of a known adapter ->
  200 ``{"adapter": ADAPTER}`` (the bundled worker starts the load and does not wait; the agent
  registers the adapter with vLLM first).
* ``POST /internal/adapters/unpin`` ``{"id"}`` -> 200 ``{"adapter": ADAPTER}``; 404 unknown.
* ``POST /internal/adapters/probe`` ``{"adapter": AdapterRef, "prompts": ["..."], "max_tokens": 32}``:
  each prompt as one user chat message, greedy, with the base model and with the adapter ->
  200 ``{"results": [{"prompt", "base", "adapter"}], "adapter_load_ms"}``; a load failure -> 422
  ``adapter_load_failed`` (the only 422: the activation gate reads it as a verdict on the
  adapter). Malformed bodies -> 400.
* ``GET /internal/tokenizer`` -> ``{"base_model", "base_revision", "max_model_len", "tokenizer"}``
  (``tokenizer``: ``loraplex.tokenizer.TextTokenizer.to_dict()``): the gateway counts prompt
  tokens with it exactly as the worker does.

Torch-free, so the agent serves it from the plain install.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.control import ControlError, id_of, parse_probe, read_json, ref_of
from engine.worker_auth import SecretRefused, check_worker_secret
from loraplex.settings import Settings
from loraplex.wire import HDR_WORKER_SECRET, AdapterRef

Adapter = dict[str, Any]
"""One ``ADAPTER`` of the answers (module docstring)."""


class ControlBackend(ABC):
    """What a worker does for its control API; ``control_routes`` serves it."""

    @abstractmethod
    def check(self, *, adapters: bool) -> None:
        """Raise ``ControlError`` while the worker cannot answer a route (``adapters``: an adapter
        route, not the tokenizer)."""

    @abstractmethod
    def tokenizer(self) -> bytes:
        """The ``GET /internal/tokenizer`` answer, as JSON bytes."""

    @abstractmethod
    def adapters(self) -> list[Adapter]:
        """Every adapter the worker knows, in any order."""

    @abstractmethod
    def resident(self) -> dict[str, int]:
        """Adapters held per tier: ``{"device", "host", "disk"}``."""

    @abstractmethod
    async def load(self, ref: AdapterRef, *, pin: bool, reload: bool) -> tuple[Adapter, float]:
        """Load ``ref`` (pinned if ``pin``) and wait until it can serve: (its entry, ms taken)."""

    @abstractmethod
    async def unload(self, aid: str, *, force: bool) -> None:
        """Unload adapter ``aid`` (404 unknown, 409 busy or pinned unless ``force``)."""

    @abstractmethod
    async def pin(self, ref: AdapterRef) -> Adapter:
        """Pin ``ref``, loading it where it is not."""

    @abstractmethod
    async def pin_known(self, aid: str) -> Adapter:
        """Pin adapter ``aid``, which the worker knows already (404 otherwise)."""

    @abstractmethod
    async def unpin(self, aid: str) -> Adapter:
        """Unpin adapter ``aid`` (404 unknown)."""

    @abstractmethod
    async def probe(self, ref: AdapterRef, prompts: list[str], max_tokens: int) -> tuple[list[tuple[str, str]], float]:
        """Each prompt's greedy answer (base model, adapter), and the ms ``ref``'s load took."""


def control_routes(backend: ControlBackend, settings: Settings) -> list[Route]:
    """The control API's routes over ``backend``."""

    def guarded(handler: Callable[[Request], Awaitable[Response]], *, adapters: bool = True) -> Any:
        """The secret checked and the backend able to answer before ``handler``."""
        async def endpoint(request: Request) -> Response:
            try:
                check_worker_secret(request.headers.get(HDR_WORKER_SECRET), settings.worker_secret)
                backend.check(adapters=adapters)
                return await handler(request)
            except (ControlError, SecretRefused) as exc:
                return exc.response()
        return endpoint

    async def body_of(request: Request) -> dict[str, Any]:
        return await read_json(request, settings.max_body_bytes)

    async def tokenizer(request: Request) -> Response:
        return Response(backend.tokenizer(), media_type="application/json")

    async def list_adapters(request: Request) -> Response:
        adapters = backend.adapters()
        return JSONResponse({"adapters": sorted(adapters, key=lambda a: a["id"]), "resident": backend.resident()})

    async def load(request: Request) -> Response:
        body = await body_of(request)
        adapter, ms = await backend.load(ref_of(body), pin=bool(body.get("pin", False)),
                                         reload=bool(body.get("reload", False)))
        return JSONResponse({"adapter": adapter, "load_ms": round(ms, 3)})

    async def unload(request: Request) -> Response:
        body = await body_of(request)
        aid = id_of(body)
        await backend.unload(aid, force=bool(body.get("force", False)))
        return JSONResponse({"unloaded": aid})

    async def pin(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body.get("adapter"), dict) or "uri" in body:
            adapter = await backend.pin(ref_of(body))
        else:
            adapter = await backend.pin_known(id_of(body))
        return JSONResponse({"adapter": adapter})

    async def unpin(request: Request) -> Response:
        body = await body_of(request)
        return JSONResponse({"adapter": await backend.unpin(id_of(body))})

    async def probe(request: Request) -> Response:
        ref, prompts, max_tokens = parse_probe(await body_of(request))
        answers, load_ms = await backend.probe(ref, prompts, max_tokens)
        results = [{"prompt": p, "base": base, "adapter": tuned} for p, (base, tuned) in zip(prompts, answers,
                                                                                            strict=True)]
        return JSONResponse({"results": results, "adapter_load_ms": round(load_ms, 3)})

    return [
        Route("/internal/tokenizer", guarded(tokenizer, adapters=False), methods=["GET"]),
        Route("/internal/adapters", guarded(list_adapters), methods=["GET"]),
        Route("/internal/adapters/load", guarded(load), methods=["POST"]),
        Route("/internal/adapters/unload", guarded(unload), methods=["POST"]),
        Route("/internal/adapters/pin", guarded(pin), methods=["POST"]),
        Route("/internal/adapters/unpin", guarded(unpin), methods=["POST"]),
        Route("/internal/adapters/probe", guarded(probe), methods=["POST"]),
    ]
