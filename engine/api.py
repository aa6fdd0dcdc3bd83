"""The worker's HTTP API (Starlette): OpenAI-shaped completions, health, metrics.

A request whose ``"loraplex"`` extension names an adapter is served with it (LoRA on); its
load starts when the request arrives. If the adapter cannot be loaded, only the requests
for it fail: 503 ``adapter_load_failed`` with the reason (a stream that already started
ends with an error event carrying that code). Internal control routes: ``engine.internal_api``.
Every route but ``/health`` and ``/metrics`` needs the gateway's worker secret (``engine.worker_auth``).
A request's final usage (the whole answer's, a stream's usage chunk) says in
``prompt_tokens_details.cached_tokens`` how many prompt tokens the prefix cache supplied, within
the cache scope the gateway named (``WorkerRequestExt.cache_scope``; empty: the tenant's own).

The asyncio side parses and validates requests and streams results; the engine runs
in its own thread (``Engine.start``). Each request registers a listener that hands
engine events to its asyncio queue with ``call_soon_threadsafe``. A client that goes
away (streaming or not) aborts its sequence, which frees its KV blocks at once.

Start one inside another process::

    engine = Engine.from_settings(settings)          # or leave it to the app's lifespan
    app = create_worker_app(settings, engine=engine)  # ASGI app; serve with uvicorn
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.engine import Engine, PromptTooLongError
from engine.grammar import GrammarError
from engine.internal_api import internal_routes
from engine.metrics import WorkerMetrics, adapter_metric_label
from engine.protocol import (
    GenerationRequest,
    RequestError,
    choice,
    full_response,
    logprobs_json,
    now,
    parse_json,
    parse_request,
    stream_chunk,
    usage_chunk,
)
from engine.quant import dtype_name
from engine.request_events import RequestEvents
from engine.scheduler import QueueFullError
from engine.sequence import SeqEvent, Sequence
from engine.threads import single_threaded
from engine.worker_auth import WorkerSecretMiddleware
from loraplex.settings import Settings
from loraplex.tool_calls import parse_output
from loraplex.wire import HDR_ADAPTER, HDR_CACHE, HDR_REQUEST_ID, HDR_WORKER, error_body

log = logging.getLogger("loraplex.engine.api")


def default_worker_id(settings: Settings) -> str:
    return settings.worker_id or f"{socket.gethostname()}-{settings.worker_port}"


class WorkerHeaderMiddleware:
    """Pure ASGI: every response carries ``x-loraplex-worker``."""

    def __init__(self, app: ASGIApp, worker_id: str) -> None:
        self.app = app
        self.value = worker_id.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (HDR_WORKER.encode(), self.value)]
            await send(message)

        await self.app(scope, receive, send_with_header)


def _error(status: int, message: str, code: str | None = None, type: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type=type, code=code), status_code=status, headers=headers)


class WorkerState:
    """What the worker's routes share: settings, the engine (once loaded), metrics, names."""

    def __init__(self, settings: Settings, engine: Engine | None) -> None:
        self.settings = settings
        self.engine = engine
        self.owns_engine = engine is None
        self.worker_id = default_worker_id(settings)
        self.metrics: WorkerMetrics | None = None
        self.model_name = ""
        self.loading_error: str | None = None

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        self.metrics = WorkerMetrics(engine, self.worker_id)
        engine.metrics = self.metrics
        info = engine.info
        self.model_name = self.settings.model_name or (info.name if info else "") or "base"

    def request_done(self, outcome: str) -> None:
        if self.metrics:
            self.metrics.request_done(outcome)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body is larger than {limit} bytes", code="body_too_large")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"request body is larger than {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _sse(obj: Any) -> bytes:
    """One server-sent event: a streamed token's chunk is one of these (orjson: 0.3 against 5.4 us
    for ``json.dumps`` of a completion chunk; the same bytes for the finite floats sent here)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


ACCEPTED = b": accepted\n\n"
"""An SSE comment a stream starts with: the engine has taken the request (the gateway's first-byte
deadline measures that, not the queue before its first token). Clients ignore comments."""
PROGRESS = b": progress\n\n"
"""An SSE comment a quiet stream sends while the engine completes steps (``worker_progress_interval_s``):
the gateway's stall bound counts it as progress and passes no comment on."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class Generation:
    """One generation request inside the engine: answered whole (:meth:`complete`) or as SSE
    (:meth:`stream`). A client that goes away aborts the sequence (its KV blocks free at once)."""

    def __init__(self, state: WorkerState, engine: Engine, req: GenerationRequest, seq: Sequence,
                 events: RequestEvents) -> None:
        self.state, self.engine, self.req, self.seq, self.events = state, engine, req, seq, events
        self.seqs = seq.samples or [seq]
        """The request's samples (``n``), choice ``index`` order."""
        self.created = now()
        self.adapter_label = req.ext.adapter.name if req.ext.adapter else "base"
        self.headers = {HDR_ADAPTER: self.adapter_label, HDR_CACHE: seq.extra.get("cache", "base")}
        self.prompt_counted = False
        if req.ext.request_id:
            self.headers[HDR_REQUEST_ID] = req.ext.request_id

    def streaming_response(self) -> StreamingResponse:
        return StreamingResponse(self.stream(), media_type="text/event-stream",
                                 headers={**self.headers, "Cache-Control": "no-cache"})

    def _note(self, ev: SeqEvent) -> None:
        """Count the prompt once, at the first sample's first token: by then the sample was
        admitted and ``cached_tokens`` (what the prefix cache supplied) is known."""
        if self.prompt_counted or ev.seq_id != self.seq.seq_id or ev.finish_reason == "error":
            return
        self.prompt_counted = True
        if self.state.metrics is not None:
            self.state.metrics.observe_prompt(adapter_metric_label(self.req.ext.adapter), len(self.req.prompt_ids),
                                              self.seq.cached_tokens)

    def _abort(self) -> None:
        for seq in self.seqs:
            self.engine.abort(seq)
        self.state.request_done("client_gone")

    async def _finished(self) -> SeqEvent:
        """The first error event, else the last sample's final event."""
        left = len(self.seqs)
        while True:
            ev = await self.events.next()
            self._note(ev)
            if ev.finished:
                left -= 1
                if ev.finish_reason == "error" or left == 0:
                    return ev

    def _fail(self, ev: SeqEvent) -> None:
        for seq in self.seqs:  # one sample failed: the request fails, the others stop
            self.engine.abort(seq)
        self.state.request_done("error")

    async def complete(self, request: Request) -> Response:
        done = asyncio.ensure_future(self._finished())
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not done.done():
                done.cancel()
                self._abort()
        if not done.done() or done.cancelled():
            return Response(status_code=499)
        ev = done.result()
        if ev.finish_reason == "error":
            self._fail(ev)
            return _error(503, ev.error or "generation failed", code=ev.error_code or "engine_error",
                          type="server_error", headers=self.headers)
        self.state.request_done("ok")
        tok = self.engine.tokenizer
        choices = [choice(self.req, s.index, s.output_text, s.finish_reason, logprobs_json(self.req, s.logprobs, tok))
                   for s in self.seqs]
        body = full_response(self.req, choices, sum(len(s.output_ids) for s in self.seqs), self.created,
                             self.seq.cached_tokens)
        return JSONResponse(body, headers=self.headers)

    async def stream(self) -> AsyncIterator[bytes]:
        req, created = self.req, self.created
        finished = False
        generated = 0
        tok = self.engine.tokenizer
        index = {s.seq_id: s for s in self.seqs}
        pending: dict[int, list] = {s.index: [] for s in self.seqs}  # logprobs whose text is held back
        offset = dict.fromkeys(pending, 0)  # completions: where a choice's next entry's text starts
        left = len(self.seqs)

        def flush(i: int) -> dict[str, Any] | None:
            if not pending[i]:
                return None
            out = logprobs_json(req, pending[i], tok, offset[i])
            if out is not None and req.kind != "chat":
                offset[i] = out["text_offset"][-1] + len(out["tokens"][-1])
            pending[i] = []
            return out

        loop = asyncio.get_running_loop()
        engine = self.engine
        quiet_s = self.state.settings.worker_progress_interval_s
        sent_at = loop.time()
        steps = engine.steps  # the engine's completed steps when this stream last sent something

        def mark(data: bytes) -> bytes:
            nonlocal sent_at, steps
            sent_at, steps = loop.time(), engine.steps
            return data

        def sent(obj: Any) -> bytes:
            return mark(_sse(obj))

        wake: asyncio.TimerHandle | None = None

        try:
            yield mark(ACCEPTED)
            if req.kind == "chat":
                for s in self.seqs:
                    yield sent(stream_chunk(req, created, "", None, first=True, index=s.index))
            wake = self.events.wake_at(sent_at + quiet_s)
            while True:
                ev = await self.events.next_or_wake()
                if ev is None:  # the quiet check: a comment only if the engine stepped since the last send
                    if loop.time() >= sent_at + quiet_s:
                        if engine.steps != steps:
                            yield mark(PROGRESS)
                        else:
                            sent_at = loop.time()  # a stuck engine: nothing; look again in quiet_s
                    wake = self.events.wake_at(sent_at + quiet_s)
                    continue
                generated += len(ev.new_token_ids)
                self._note(ev)
                if ev.finish_reason == "error":
                    yield sent(error_body(ev.error or "generation failed", type="server_error",
                                          code=ev.error_code or "engine_error"))
                    finished = True
                    self._fail(ev)
                    break
                seq = index[ev.seq_id]
                i = seq.index
                if ev.logprobs:
                    pending[i].extend(ev.logprobs)
                if ev.text_delta and req.tools is None:
                    yield sent(stream_chunk(req, created, ev.text_delta, None, completion_tokens=generated,
                                            logprobs=flush(i), index=i))
                if not ev.finished:
                    continue
                reason = ev.finish_reason
                if req.tools is not None:  # the answer is parsed whole: calls or content, then the end
                    content, calls = parse_output(seq.output_text, req.tools)
                    if calls:
                        reason = "tool_calls"
                        yield sent(stream_chunk(req, created, None, None, completion_tokens=generated,
                                                logprobs=flush(i), index=i,
                                                tool_calls=[c.openai(k) for k, c in enumerate(calls)]))
                    if content:
                        yield sent(stream_chunk(req, created, content, None, completion_tokens=generated,
                                                logprobs=flush(i), index=i))
                yield sent(stream_chunk(req, created, None if req.kind == "chat" else "", reason,
                                        completion_tokens=generated, logprobs=flush(i), index=i))
                left -= 1
                if left == 0:
                    finished = True
                    if req.include_usage:
                        yield sent(usage_chunk(req, created, sum(len(s.output_ids) for s in self.seqs),
                                               self.seq.cached_tokens))
                    self.state.request_done("ok")
                    break
            yield b"data: [DONE]\n\n"
        finally:
            if wake is not None:
                wake.cancel()
            if not finished:  # client went away (generator closed or cancelled)
                self._abort()


class WorkerRoutes:
    """The worker's public routes over one :class:`WorkerState`."""

    def __init__(self, state: WorkerState) -> None:
        self.state = state

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, "chat")

    async def generate(self, request: Request, kind: str) -> Response:
        """Parse and check the request, queue it in the engine, answer whole or streamed."""
        eng = self.state.engine
        if eng is None:
            return _error(503, "the worker is still loading its model", code="loading", type="server_error")
        req = await self._parse(request, eng, kind)
        if isinstance(req, Response):
            return req
        gen = self._queue(eng, req)
        if isinstance(gen, Response):
            return gen
        return gen.streaming_response() if req.stream else await gen.complete(request)

    async def _parse(self, request: Request, eng: Engine, kind: str) -> GenerationRequest | Response:
        try:
            body = parse_json(await _read_body(request, self.state.settings.max_body_bytes))
            req = parse_request(body, kind, eng.tokenizer, eng.max_model_len, self.state.model_name)
        except RequestError as exc:
            return JSONResponse(exc.body, status_code=exc.status)
        if req.ext.adapter is not None and eng.lora_runtime is None:
            return _error(400, "this worker has no LoRA support; it serves the base model only",
                          code="adapter_not_supported")
        if req.params.grammar is not None:
            try:  # off the event loop, within the tenant's turn and the CPU budget (engine.grammar)
                req.grammar = await eng.grammars.prepare(req.params.grammar, req.ext.tenant)
            except GrammarError as exc:
                param = "tools" if req.tools is not None and req.tools.forced else "response_format"
                return JSONResponse(error_body(str(exc), code=exc.code, param=param), status_code=400)
            except ImportError:
                return _error(400, "structured outputs need xgrammar on this worker "
                                   "(pip install 'loraplex[engine]')", code="unsupported_parameter")
        return req

    def _queue(self, eng: Engine, req: GenerationRequest) -> Generation | Response:
        events = RequestEvents()
        try:
            seq = eng.add_request(req.prompt_ids, req.params, adapter=req.ext.adapter, tenant=req.ext.tenant,
                                  priority=req.ext.priority, request_id=req.ext.request_id,
                                  listener=events.listener, grammar=req.grammar, cache_scope=req.ext.cache_scope)
        except QueueFullError as exc:
            self.state.request_done("queue_full")
            return _error(503, str(exc), code="queue_full", type="server_error", headers={"Retry-After": "1"})
        except PromptTooLongError as exc:
            return _error(400, str(exc), code="context_length_exceeded")
        except ValueError as exc:
            return _error(400, str(exc), code="invalid_value")
        return Generation(self.state, eng, req, seq, events)

    async def health(self, request: Request) -> Response:
        state = self.state
        eng = state.engine
        if eng is None:
            status = "error" if state.loading_error else "loading"
            return JSONResponse({"status": status, "worker_id": state.worker_id, "error": state.loading_error},
                                status_code=503)
        info = eng.info
        fault = eng.fault
        body: dict[str, Any] = {
            "status": "degraded" if fault else "ok", "worker_id": state.worker_id, "model": state.model_name,
            "revision": info.revision if info else "", "max_model_len": eng.max_model_len,
            "lora": eng.lora_runtime is not None, **eng.load(),
            "weights": {"format": dtype_name(eng.model.matmul_dtype), "why": eng.weights_reason,
                        "activations": dtype_name(eng.model.dtype), "kv_cache": dtype_name(eng.cache.dtype)}}
        if eng.lora_runtime is not None:
            r = eng.lora_runtime.manager.resident()
            body["adapters"] = {"device": len(r["device"]), "host": len(r["host"]),
                                "max_loras": eng.lora_runtime.manager.max_loras}
        if fault:
            body["error"] = fault
        return JSONResponse(body, status_code=503 if fault else 200)

    async def metrics(self, request: Request) -> Response:
        if self.state.metrics is None:
            return Response(b"", media_type="text/plain; version=0.0.4")
        return Response(self.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        state = self.state
        data = [{"id": state.model_name, "object": "model", "owned_by": "loraplex"}] if state.engine else []
        return JSONResponse({"object": "list", "data": data})


class WorkerLifespan:
    """Startup: load the engine (unless given), start its thread, warm start, residency reports.
    Shutdown in reverse; an engine the app loaded itself is closed, one it started is stopped."""

    def __init__(self, state: WorkerState, *, residency: Any, report: bool, warm_start: bool) -> None:
        self.state = state
        self.residency = residency
        self.report = report
        self.warm_start = warm_start

    @contextlib.asynccontextmanager
    async def __call__(self, app: Starlette) -> AsyncIterator[None]:
        eng = await self._load()
        # Blocking work this loop hands to threads (adapter loads, unloads, the warm start) never
        # forms an OpenMP team beside the engine's (engine.threads).
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="loraplex-worker-io", initializer=single_threaded))
        started_here = not eng.running_thread
        eng.start()
        if self.warm_start:
            app.state.warm_start = await self._warm(eng)
        task, closer = self._start_reporter(eng)
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer.aclose()
            if self.state.owns_engine:
                await asyncio.to_thread(eng.close)
            elif started_here:
                await asyncio.to_thread(eng.stop)

    async def _load(self) -> Engine:
        state = self.state
        if state.engine is None:
            try:
                state.attach(await asyncio.to_thread(Engine.from_settings, state.settings))
            except Exception as exc:
                state.loading_error = str(exc)
                raise
        assert state.engine is not None
        return state.engine

    async def _warm(self, eng: Engine) -> Any:
        from engine.warmstart import warm_start as run_warm_start

        try:
            return await run_warm_start(eng, self.state.settings)
        except Exception as exc:  # bad preload entries must not keep the worker down
            log.error("warm start failed: %s", exc)
            return None

    def _start_reporter(self, eng: Engine) -> tuple[asyncio.Task[None] | None, Any]:
        if not self.report:
            return None, None
        from engine.reporter import report_forever, residency_store

        settings = self.state.settings
        store, closer = self.residency, None
        if store is None:
            store, closer = residency_store(settings)
        task = asyncio.create_task(report_forever(eng, store, self.state.worker_id,
                                                  settings.resolved_worker_url(), settings))
        return task, closer


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "not found"
    return _error(status, str(detail), code="not_found" if status == 404 else None)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error in %s", request.url.path)
    return _error(500, "internal worker error", code="internal_error", type="server_error")


def create_worker_app(settings: Settings, engine: Engine | None = None, *, residency: Any = None,
                      report: bool = True, warm_start: bool = True) -> Starlette:
    """The worker ASGI app. Without ``engine`` the lifespan loads one from ``settings``.

    With LoRA on, the lifespan first runs the warm start (``engine.warmstart``:
    ``preload_adapters``/``pin_adapters``, or the top ``preload_top_n`` adapters by traffic).

    The lifespan starts the engine thread (if not running) and the residency reporter
    (``report=False`` to skip it); an engine the app loaded itself is stopped on shutdown.
    """
    state = WorkerState(settings, engine)
    if engine is not None:
        state.attach(engine)
    app = Starlette(routes=[*WorkerRoutes(state).routes(), *internal_routes(state)],
                    lifespan=WorkerLifespan(state, residency=residency, report=report, warm_start=warm_start),
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.worker = state
    app.add_middleware(WorkerHeaderMiddleware, worker_id=state.worker_id)
    app.add_middleware(WorkerSecretMiddleware, secret=settings.worker_secret)  # outermost: first to run
    return app
