"""The request path: ``Gateway``, what one OpenAI request goes through in this replica.

``Gateway.completions`` (and ``Gateway.responses``, the Responses API over the same stages) runs
one request as named stages over a ``_Call``: auth -> ``_parse`` (size-capped body, validation) ->
``_resolve`` -> ``_plan`` -> ``_payload`` -> ``_limit`` (reserve before admission) -> route (the
prompt's prefix steering it: ``gateway.prefix_routes``) ->
``_forward`` (``_relay`` or ``_answer``) -> ``_finish`` (settle, one access-log line, metrics). A
``_Guard`` per request watches for the client leaving and for the deadline; the access log is
written in batches (``_AccessRecords``). ``gateway.app`` builds the app around it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from typing import TYPE_CHECKING, Any

import orjson

from gateway import responses_api
from gateway.access_lines import BufferedLines
from gateway.auth import Authenticator
from gateway.canary_samples import MemorySamples, RedisSamples
from gateway.canary_samples import sample as canary_sample
from gateway.errors import (
    ERROR_CODES,
    GatewayError,
    from_registry,
    public_body,
    public_message,
    retry_later,
    send_error,
)
from gateway.live_stats import LiveStats
from gateway.metrics import GatewayMetrics
from gateway.prefix_routes import PrefixQuery
from gateway.prefix_routes import chain as prefix_chain
from gateway.prompt_tokens import PromptCounter, PromptError
from gateway.proxy import (
    Opened,
    StreamResult,
    Upstream,
    cached_tokens,
    finish_of,
    read_rest,
    relay_sse,
    sse_error,
    whole_usage,
)
from gateway.ratelimit import Limiter, Limits, limit_message
from gateway.resolve import Resolution, Resolver
from gateway.router import Router, Worker
from gateway.snapshot_source import RefreshedSnapshots, SnapshotSource
from gateway.traffic import AdapterTraffic
from gateway.usage_ledger import UsageLedger, outcome
from gateway.validate import Reservation, ValidRequest, estimate, reserve, validate
from gateway.vllm_backend import vllm_body
from gateway.worker_client import WorkerClient
from loraplex import json_body
from loraplex.prefix import cache_salt, namespace
from loraplex.settings import Settings
from loraplex.wire import (
    EXT_KEY,
    HDR_ADAPTER,
    HDR_REQUEST_ID,
    HDR_WORKER,
    PRIORITY_CLASSES,
    AdapterRef,
    WorkerRequestExt,
    error_body,
)
from registry.errors import RegistryError
from registry.snapshot import RegistrySnapshot, TenantView

if TYPE_CHECKING:
    from registry.responses import ResponseStore

log = logging.getLogger("loraplex.gateway")
HDR_FALLBACK = "x-loraplex-fallback"
"""Set when a disabled binding was answered by the base model instead of its adapter."""
access_log = logging.getLogger("loraplex.gateway.access")


class Gateway:
    """Everything the request path needs, built once per app."""

    def __init__(self, settings: Settings, snapshots: SnapshotSource, limiter: Limiter, router: Router,
                 client: WorkerClient, *, live: LiveStats | None = None, traffic: AdapterTraffic | None = None,
                 canary: MemorySamples | RedisSamples | None = None, responses_store: ResponseStore | None = None,
                 ledger: UsageLedger | None = None, refreshed: RefreshedSnapshots | None = None) -> None:
        self.settings = settings
        self.snapshots = snapshots
        self.limiter = limiter
        self.router = router
        self.client = client
        self.auth = Authenticator(settings)
        self.resolver = Resolver()
        self.metrics = GatewayMetrics()
        self.live = live if live is not None else LiveStats()
        """Per-version numbers for the console (shared through Redis when ``create_app`` has it)."""
        self.upstream = Upstream(client, router, max_attempts=settings.route_candidates + 1,
                                 on_failure=self.metrics.upstream_failure,
                                 first_byte_s=settings.worker_first_byte_timeout_s,
                                 per_queued_s=settings.worker_first_byte_per_queued_s,
                                 stall_s=settings.worker_stall_timeout_s)
        router.outliers.on_eject = self.metrics.ejected
        router.on_route = self.metrics.routed
        self.metrics.track_ejections(router)
        self.lease_ttl_s = settings.request_timeout_s + 30.0
        self.prompts = PromptCounter(router, client)
        self._limits: dict[tuple[int, int, int], Limits] = {}
        """One ``Limits`` per distinct set of tenant limits (built once, not per request)."""
        self.log_enabled = True
        self.sweeper = _Sweeper()
        self.traffic = traffic
        """Per-adapter request counts for workers' warm start (None: no Redis to keep them)."""
        self.canary = canary
        """Where judged requests leave their samples (None: no canary judge reads them)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self.responses_store = responses_store
        """Where stored Responses are kept (None: no registry database, nothing is stored)."""
        self.ledger = ledger
        """Where settled requests add their usage (``gateway.usage_ledger``; None: no ledger)."""
        if ledger is not None:
            self.metrics.track_usage()
        if refreshed is not None:  # the live registry: its loads, age and failures on /metrics
            self.metrics.observe_snapshots(refreshed)

    async def _read_body(self, receive: Any, declared: int | None) -> bytes:
        limit = self.settings.max_body_bytes
        if declared is not None and declared > limit:
            raise GatewayError(413, f"request body is larger than {limit} bytes", code="body_too_large")
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _ClientGone
            part = msg.get("body", b"")
            if part:
                size += len(part)
                if size > limit:
                    raise GatewayError(413, f"request body is larger than {limit} bytes", code="body_too_large")
                chunks.append(part)
            if not msg.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _plan(self, req: ValidRequest, base_model: str,
                    tokens_per_min: int) -> tuple[Reservation, list[int] | None]:
        """What to reserve (``gateway.validate.reserve``) with the exact prompt count when the
        base model's tokenizer is known, else the byte-based bound; and the prompt's token ids
        (None: no tokenizer yet), whose prefix routing hashes."""
        fields = req.fields
        try:
            counted = await self.prompts.tokens(base_model, fields)
        except PromptError as exc:
            raise GatewayError(400, exc.message, code="invalid_value", param=exc.param) from None
        s = self.settings
        if counted is None:
            return reserve(fields, estimate(fields), exact=isinstance(fields.prompt, list), max_model_len=None,
                           tokens_per_min=tokens_per_min, default_max_tokens=s.default_max_tokens), None
        ids, max_model_len = counted
        return reserve(fields, len(ids), exact=True, max_model_len=max_model_len, tokens_per_min=tokens_per_min,
                       default_max_tokens=s.default_max_tokens), ids

    async def completions(self, scope: Any, receive: Any, send: Any, *, chat: bool) -> None:
        """One completion request: ``_serve`` runs the stages; every way it can end is answered
        here, and ``_finish`` settles and logs it."""
        await self._handle(_Call(scope["headers"], chat), scope, receive, send)

    async def responses(self, scope: Any, receive: Any, send: Any) -> None:
        """``POST /v1/responses``: a chat completion in and out of the Responses shapes
        (``gateway.responses_api``), on the same stages."""
        call = _Call(scope["headers"], True)
        call.route = "responses"
        await self._handle(call, scope, receive, send)

    async def _handle(self, call: _Call, scope: Any, receive: Any, send: Any) -> None:
        try:
            if scope["method"] != "POST":
                raise GatewayError(405, "use POST", code="method_not_allowed")
            await self._serve(call, receive, send)
        except (GatewayError, RegistryError) as exc:
            err = exc if isinstance(exc, GatewayError) else from_registry(exc)
            if isinstance(exc, RegistryError):
                log.warning("request %s: %s (%s)", call.request_id, exc.message, exc.code)
            elif err.detail != err.message:  # the client got the code's fixed sentence
                log.warning("request %s: %s: %s", call.request_id, err.code, err.detail)
            call.status, call.code = err.status, err.code
            if not call.started:
                await send_error(send, err, call.headers)
        except _ClientGone:
            call.status = 499
        except asyncio.CancelledError:
            await self._cancelled(call, send)
        except Exception:
            log.exception("request %s failed", call.request_id)
            call.status, call.code = 500, "internal_error"
            if not call.started:
                await send_error(send, GatewayError(500, "internal error", code="internal_error"), call.headers)
        finally:
            self._finish(call)

    async def _serve(self, call: _Call, receive: Any, send: Any) -> None:
        """The stages in order: auth, read and validate, resolve, plan, limit, route, forward."""
        snapshot = self._snapshot()
        tenant = self.auth.tenant(call.authorization, snapshot)
        call.tenant = tenant.slug
        raw = await self._read_body(receive, call.declared)
        if call.route == "responses":
            s = self.settings
            call.turn, body = await responses_api.begin(raw, tenant.slug, self.responses_store,
                                                        s.response_max_chain, s.max_body_bytes)
            req = validate(body, chat=True, max_tokens_cap=s.max_tokens_cap)
        else:
            req = self._parse(raw, call.chat)
        call.alias = req.model
        call.streaming = req.stream
        res = self._resolve(call, snapshot, tenant, req)
        plan, ids = await self._plan(req, res.base_model, tenant.tokens_per_min)
        call.plan = plan
        payload = self._payload(req, res, tenant, plan, call.request_id)
        await self._limit(call, tenant, plan.tokens)
        if self.traffic is not None and res.wire is not None:
            self.traffic.record(res.wire)
        ns = _namespace(snapshot, res, tenant)
        query = call.prefix = self._prefix_query(call, ns, ids, res.base_model)
        adapter_id = res.adapter.id if res.adapter else None
        workers = (self._route_now(res.base_model, adapter_id, query)
                   or await self.router.route(res.base_model, adapter_id, query))
        await self._forward(call, receive, send, req, workers, payload, res.adapter, cache_salt(ns))

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        """The loop serving requests (asking asyncio for it costs a getpid system call on 3.11)."""
        loop = self._loop
        if loop is None or not loop.is_running():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def _snapshot(self) -> RegistrySnapshot:
        try:
            return self.snapshots.current
        except Exception:
            raise GatewayError(503, "The registry is not available yet; try again shortly.",
                               code="registry_unavailable", headers=retry_later()) from None

    def _parse(self, raw: bytes, chat: bool) -> ValidRequest:
        try:
            data = json_body.loads(raw)
        except json_body.BodyError as exc:
            raise GatewayError(400, exc.message, code=exc.code, param=exc.param) from None
        return validate(data, chat=chat, max_tokens_cap=self.settings.max_tokens_cap)

    def _resolve(self, call: _Call, snapshot: RegistrySnapshot, tenant: TenantView, req: ValidRequest) -> Resolution:
        res = self.resolver.resolve(snapshot, tenant, req.model, req.user or call.request_id)
        call.label = res.label
        call.version = res.adapter.id if res.adapter is not None else ""
        call.headers[HDR_ADAPTER] = res.label
        if res.judged and res.adapter is not None:
            call.judged, call.version = f"{tenant.slug}/{res.alias}", res.adapter.id
            call.labels = req.fields.metadata
        if res.fallback:
            call.headers[HDR_FALLBACK] = "binding-disabled"
        return res

    def _prefix_query(self, call: _Call, ns: bytes, ids: list[int] | None, base_model: str) -> PrefixQuery | None:
        """What routing knows of the request's prefix: its prompt's chunk keys under ``ns`` (when the
        prompt was encoded) and, for a Responses continuation, the worker of the previous turn.
        None while one worker serves the base model: there is nothing to choose, nothing is hashed."""
        if not self.router.several(base_model):
            return None
        turn = call.turn
        after = None
        if turn is not None and turn.previous is not None:
            after = self.router.prefixes.turn_worker(turn.previous.id)
        if not ids and after is None:
            return None
        return PrefixQuery(prefix_chain(ns, ids) if ids else [], after)

    def _payload(self, req: ValidRequest, res: Resolution, tenant: TenantView, plan: Reservation,
                 request_id: str) -> bytes:
        """The body the worker gets: the client's, with the planned ``max_tokens``, usage asked for
        when streamed, and the gateway's ``WorkerRequestExt`` (its ``cache_scope`` the registry's
        ``TenantView.prefix_scope``: the client's own ``loraplex`` object is replaced whole, and
        nothing else it sends names a scope)."""
        body = req.body
        body["max_tokens"] = plan.max_tokens  # the one field every worker reads the same way
        body.pop("max_completion_tokens", None)
        if req.stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        body[EXT_KEY] = WorkerRequestExt(adapter=res.adapter, tenant=tenant.slug, request_id=request_id,
                                         priority=PRIORITY_CLASSES.get(tenant.priority, PRIORITY_CLASSES["normal"]),
                                         cache_scope=tenant.prefix_scope)
        return orjson.dumps(body)  # dataclasses encode natively, as ``to_dict`` has them

    async def _limit(self, call: _Call, tenant: TenantView, tokens: int) -> None:
        """Reserve ``tokens`` and a request slot for the tenant, or refuse with 429 (503: no limiter)."""
        key = (tenant.requests_per_min, tenant.tokens_per_min, tenant.max_concurrent)
        limits = self._limits.get(key)
        if limits is None:
            if len(self._limits) >= 10_000:
                self._limits.clear()
            limits = self._limits[key] = Limits(*key)
        decision = await self.limiter.acquire(tenant.slug, limits, tokens, self.lease_ttl_s)
        call.headers.update(decision.headers)
        ledger = self.ledger
        if not decision.allowed:
            self.metrics.limited(tenant.slug, decision.reason)
            call.reason = decision.reason
            if ledger is not None:
                call.peak = ledger.in_flight(tenant.slug)
            if decision.status == 503:
                raise GatewayError(503, "The rate limiter is unavailable; try again shortly.",
                                   code="ratelimiter_unavailable")
            raise GatewayError(429, limit_message(decision.reason),
                               code="request_too_large" if decision.reason == "too_large" else "rate_limit_exceeded")
        call.lease = decision.lease
        if ledger is not None:
            call.peak = ledger.admit(tenant.slug)

    def _route_now(self, base_model: str, adapter_id: str | None, prefix: PrefixQuery | None) -> list[Worker] | None:
        """Workers to try, best first, from the live set as it is; None when a refresh is due
        or none is known (then ``router.route`` refreshes first)."""
        router = self.router
        return None if router.due() else router.choose(base_model, adapter_id, prefix)

    async def _forward(self, call: _Call, receive: Any, send: Any, req: ValidRequest, workers: list[Worker],
                       payload: bytes, adapter: AdapterRef | None, salt: str) -> None:
        """Send to the first worker that answers and pass its answer on, under the request's guard;
        the worker that took it is remembered as holding the prompt's prefix."""
        guard = call.guard = _Guard(receive, call, self.settings.request_timeout_s, self.sweeper, self._running_loop())
        client = self.client

        def vllm(worker: Worker, reload: bool) -> Any:  # a vLLM worker's body (gateway.vllm_backend)
            return vllm_body(client, req.body, adapter, worker, cache_salt=salt, force=reload)

        try:
            call.upstream = _SENT
            try:
                opened = await self.upstream.open(workers, call.path, payload, call.request_id,
                                                  whole=not req.stream, vllm=vllm)
            except GatewayError:
                call.upstream = _NOT_SENT  # no worker took it
                raise
            call.upstream = opened.response.status
            call.worker = opened.worker.id
            if call.prefix is not None and call.upstream == 200:
                self.router.prefixes.record(call.prefix.chain, call.worker)
            call.cold = opened.response.cache == "cold"
            call.headers[HDR_WORKER] = call.worker
            try:
                if req.stream and opened.response.status == 200:
                    await self._relay(call, send, req, opened)
                else:
                    await self._answer(call, send, opened)
            finally:
                self.upstream.done(opened)
        finally:
            guard.stop()

    async def _relay(self, call: _Call, send: Any, req: ValidRequest, opened: Opened) -> None:
        """A streamed answer, event by event (a Responses turn's as the Responses events, kept before
        it completes); a stream that breaks ends with an error event (502)."""
        call.status = 200
        await send({"type": "http.response.start", "status": 200,
                    "headers": _headers(call.headers, b"text/event-stream", extra=_SSE)})
        call.started = True
        result = call.streamed = StreamResult(watch=bool(call.judged))
        if call.turn is None:
            await relay_sse(opened, send, keep_usage=req.include_usage, result=result,
                            strip_chunk_usage=not req.fields.continuous_usage)
        else:
            await responses_api.relay(call.turn, call.alias, opened, send, result, lambda: self._keep(call))
        call.usage = result.usage
        if result.first_token_at is not None:
            self.metrics.first_token(call.tenant, call.label, result.first_token_at - call.t0)
        if result.error or result.worker_error:
            call.status = 502
            call.code = "upstream_stalled" if result.stalled else "stream_interrupted" if result.error \
                else "upstream_error"
            self.metrics.upstream_failure(call.worker)
            log.warning("request %s: the stream from worker %s failed: %s", call.request_id, call.worker,
                        result.worker_detail or result.error or "an error event")
        call.finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _keep(self, call: _Call) -> str | None:
        """Store a Responses turn's answer; why it could not be (the request then fails: 503, or a
        failed response at the end of a stream)."""
        assert call.turn is not None
        try:
            await responses_api.keep(call.turn, self.responses_store, call.tenant, call.label)
        except RegistryError as exc:  # the database is down: its detail is in the log already
            log.warning("request %s: storing response %s failed: %s", call.request_id, call.turn.id, exc.code)
        except Exception:
            log.exception("request %s: storing response %s failed", call.request_id, call.turn.id)
        else:
            if call.turn.req.store and call.worker:  # its continuation goes back there (gateway.prefix_routes)
                self.router.prefixes.served_turn(call.turn.id, call.worker)
            return None
        call.status, call.code = 503, "store_unavailable"
        return responses_api.NOT_STORED

    async def _answer(self, call: _Call, send: Any, opened: Opened) -> None:
        """A whole answer (or the worker's error): passed on as it is, a worker's 5xx as our 502."""
        content = opened.first if opened.chunks is None else await read_rest(opened)
        status = call.status = opened.response.status
        if status == 200:
            content, call.usage = whole_usage(content)
            if call.judged:
                call.finish = finish_of(content)
            if call.turn is not None:
                content = responses_api.whole(call.turn, call.alias, content)
                problem = await self._keep(call)
                if problem is not None:
                    raise GatewayError(503, problem, code="store_unavailable", headers=retry_later())
        elif status >= 500:
            log.warning("request %s: worker %s answered %d: %s", call.request_id, call.worker, status,
                        content[:300].decode("utf-8", "replace"))
            status = call.status = 502
            call.code = "upstream_error"
            content = orjson.dumps(error_body(public_message("upstream_error", "the worker failed"),
                                              "upstream_error", "upstream_error"))
        else:  # the worker's 4xx, without the servers' insides
            call.code = _worker_code(content)
            content, detail = public_body(content)
            if detail is not None:
                log.warning("request %s: worker %s answered %d: %s", call.request_id, call.worker, status, detail)
        ctype = opened.response.content_type if status == 200 else "application/json"
        call.finished = True
        await send({"type": "http.response.start", "status": status,
                    "headers": _headers(call.headers, ctype.encode("latin-1"), length=len(content))})
        call.started = True
        await send({"type": "http.response.body", "body": content})

    async def _cancelled(self, call: _Call, send: Any) -> None:
        """Cancelled: by the guard (the deadline passed: 504, the client left: 499) or by the
        server (its shutdown grace ended: 503). Answered, the request ends like any other."""
        task = asyncio.current_task()
        guard = call.guard
        if guard is None or not guard.cancelled or task is None or task.cancelling() == 0:
            call.status, call.code = 503, "shutting_down"
            log.warning("request %s cut short by the server's shutdown", call.request_id)
            if call.started and not call.finished:
                await send({"type": "http.response.body", "body": sse_error(
                    "the gateway is shutting down", "shutting_down"), "more_body": False})
            elif not call.started:
                await send_error(send, GatewayError(503, "The gateway is shutting down; retry the request.",
                                                    code="shutting_down"), call.headers)
            if task is not None and task.cancelling():
                task.uncancel()
            return
        task.uncancel()
        if not guard.expired:
            call.status = 499
            return
        call.status, call.code = 504, "timeout"
        if call.started and not call.finished:
            await send({"type": "http.response.body", "body": sse_error("the request deadline passed", "timeout"),
                        "more_body": False})
        elif not call.started:
            await send_error(send, GatewayError(504, "the request deadline passed", code="timeout"), call.headers)

    def _sample(self, call: _Call, elapsed: float, completion_tokens: int) -> None:
        """One sample for the canary judge (``gateway.canary_samples``)."""
        streamed = call.streamed
        if streamed is not None:
            ttft = None if streamed.first_token_at is None else streamed.first_token_at - call.t0
            empty, length = not streamed.text, streamed.length
        else:
            ttft = None
            empty, length = call.finish or (False, False)
        ok = call.status < 500
        assert self.canary is not None
        self.canary.record(call.judged, canary_sample(call.version, ok, elapsed, ttft, completion_tokens,
                                                      ok and empty, length, call.labels))

    def _finish(self, call: _Call) -> None:
        """Settle the reservation with what the request is charged, then metrics and the access log."""
        pt, ct = processed(call.plan, call.upstream, call.usage, call.streamed, call.streaming)
        if call.lease is not None:
            try:
                self.limiter.settle_nowait(call.lease, pt + ct)
            except Exception:
                log.exception("settling the reservation of %s failed", call.request_id)
        cached = min(cached_tokens(call.usage), pt)  # reported, never charged less: pt holds them
        ledger = self.ledger
        if ledger is not None and call.tenant:
            # The numbers just settled; nothing was charged without a lease (refused before admission).
            if call.lease is not None:
                ledger.release(call.tenant)
                ledger.record(call.tenant, call.alias, call.version, outcome(call.status, call.code, call.reason),
                              pt, cached, ct, call.peak)
            else:
                ledger.record(call.tenant, call.alias, call.version, outcome(call.status, call.code, call.reason),
                              0, 0, 0, call.peak)
        elapsed = time.perf_counter() - call.t0
        self.metrics.observe(call.tenant, call.label, call.status, elapsed, pt, ct, cached)
        self.metrics.route(call.route, call.status)
        if call.judged and self.canary is not None and call.status != 499 and (
                call.upstream != _NOT_SENT or call.status >= 500):  # a client's 4xx is not the version's doing
            self._sample(call, elapsed, ct)
        if call.worker:
            streamed = call.streamed
            ttft = None if streamed is None or streamed.first_token_at is None else streamed.first_token_at - call.t0
            self.live.record(call.label, call.status, ttft, call.cold)
        if self.log_enabled and access_log.isEnabledFor(logging.INFO):
            now = time.time()
            _access_records.emit(orjson.dumps({
                "ts": round(now, 3), "request_id": call.request_id, "tenant": call.tenant, "alias": call.alias,
                "adapter": call.label, "worker": call.worker, "prompt_tokens": pt, "cached_tokens": cached,
                "completion_tokens": ct, "status": call.status, "latency_ms": round(elapsed * 1000, 3),
                "stream": call.streaming, "route": call.route,
            }).decode(), now)


class _Call:
    """One request's state as the stages fill it in (what ``_finish`` settles and logs)."""

    __slots__ = ("alias", "authorization", "chat", "code", "cold", "declared", "finish", "finished", "guard", "headers",
                 "judged", "label", "labels", "lease", "path", "peak", "plan", "prefix", "reason", "request_id", "route",
                 "started", "status", "streamed", "streaming", "t0", "tenant", "turn", "upstream", "usage", "version",
                 "worker")

    def __init__(self, raw_headers: list[tuple[bytes, bytes]], chat: bool) -> None:
        self.t0 = time.perf_counter()
        self.chat = chat
        self.path = "/v1/chat/completions" if chat else "/v1/completions"
        """What the worker is sent (a Responses turn goes as a chat completion)."""
        self.route = "chat" if chat else "completions"
        """What the client called: chat, completions or responses (logged and counted)."""
        self.turn: responses_api.Turn | None = None
        self.authorization: str | None = None
        self.declared: int | None = None
        request_id = None
        for k, v in raw_headers:
            if k == b"authorization":
                self.authorization = v.decode("latin-1")
            elif k == b"content-length":
                try:
                    self.declared = int(v)
                except ValueError:
                    self.declared = None
            elif k == b"x-request-id":
                rid = v.decode("latin-1")
                if 0 < len(rid) <= 128 and rid.isprintable():
                    request_id = rid
        self.request_id: str = request_id or _request_id()
        self.headers: dict[str, str] = {HDR_REQUEST_ID: self.request_id}
        """Response headers so far."""
        self.tenant = self.alias = self.label = self.worker = ""
        self.cold = False
        self.lease: Any = None
        self.plan: Reservation | None = None
        self.prefix: PrefixQuery | None = None
        """What routing knew of its prompt's prefix (recorded against the worker that took it)."""
        self.upstream = _NOT_SENT
        self.streamed: StreamResult | None = None
        self.usage: dict[str, Any] | None = None
        self.status = 500
        self.streaming = False
        self.guard: _Guard | None = None
        self.judged = self.version = ""
        """Under a canary: the binding (``tenant/alias``); the adapter version id the request went to
        (``""``: the base model), canary or not."""
        self.code: str | None = None
        """The error code it ended with (``gateway.errors``; a worker's 4xx: the worker's code)."""
        self.reason = ""
        """A 429's limiter reason (requests, tokens, concurrency, too_large)."""
        self.peak = 0
        """The tenant's requests in flight in this gateway at admission (the usage ledger's peak)."""
        self.labels: dict[str, str] | None = None
        """Under a canary: the request's ``metadata`` (what a check segmented by a label splits on)."""
        self.finish: tuple[bool, bool] | None = None
        """A whole answer's (empty, stopped on length), read only for judged requests."""
        self.started = False
        """The response head went out (an error after it can only end the body)."""
        self.finished = False
        """The last body byte is going out (a disconnect after it is no reason to cancel)."""


_NOT_SENT = 0
_SENT = 1
"""``upstream`` before a worker answered: not sent (or no worker took it), or sent and
waiting; after, the worker's status code."""


def processed(plan: Reservation | None, upstream: int, usage: dict[str, Any] | None,
              streamed: StreamResult | None, stream: bool) -> tuple[int, int]:
    """(prompt, completion) tokens a request is charged and logged with, however it ended:

    * the worker's usage when it sent one;
    * nothing when no worker took the request or it answered with an error (4xx/5xx);
    * a stream that ended without usage (client gone, deadline, broken): the prompt (the
      worker's count, else ours) + the completion tokens relayed;
    * a request still waiting for its worker (client gone, deadline): the prompt, plus
      ``n`` x ``max_tokens`` when not streamed (what the worker generated is not known:
      conservatively all of it).
    """
    if usage:
        p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(p, int) and isinstance(c, int):
            return p, c
    if plan is None or upstream == _NOT_SENT or (upstream > _SENT and upstream != 200):
        return 0, 0
    if streamed is not None:
        p = streamed.prompt_tokens
        return (p if p is not None else plan.prompt_tokens), streamed.completion_tokens
    if upstream == 200:  # answered without usage: bound by the reservation
        return plan.prompt_tokens, plan.completion_bound
    return plan.prompt_tokens, 0 if stream else plan.completion_bound


_SSE = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


def _namespace(snapshot: RegistrySnapshot, res: Resolution, tenant: TenantView) -> bytes:
    """The request's prefix-cache namespace (``loraplex.prefix.namespace``): the base model's
    revision, the adapter version's digest (its id should a ref lack one: never ``base``), and
    the tenant's scope from the registry."""
    base = snapshot.base_models.get(res.base_model)
    adapter = res.adapter
    digest = (adapter.sha256 or adapter.id) if adapter is not None else None
    return namespace(base.revision if base is not None else "", digest, tenant.prefix_scope)


def _worker_code(content: bytes) -> str:
    """A worker's 4xx as a gateway error code: its own when it is one (``gateway.errors``), else
    ``upstream_error``."""
    try:
        code = orjson.loads(content)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "upstream_error"
    return code if isinstance(code, str) and code in ERROR_CODES else "upstream_error"


def _request_id() -> str:
    """A random 128-bit hex id (no system call: the generator was seeded from the OS at start)."""
    return f"{random.getrandbits(128):032x}"


class _AccessRecords:
    """Access-log records as copies of one template with the line and the time set:
    ``Logger.info`` looks up the caller's frame, thread and process for every record,
    which costs more than the rest of the line (the template is made by the first request,
    in the thread that serves requests)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._template: dict[str, Any] | None = None

    def emit(self, line: str, now: float) -> None:
        logger = self.logger
        handlers = logger.handlers
        if len(handlers) == 1 and not logger.propagate and not logger.filters:
            # The logger's only handler takes plain lines (``loraplex gateway``'s buffered
            # access log): hand it the line, no record needed.
            handler = handlers[0]
            if isinstance(handler, BufferedLines) and not handler.filters and handler.level <= logging.INFO:
                handler.add_line(line)
                return
        template = self._template
        if template is None:
            template = self._template = logging.LogRecord(
                self.logger.name, logging.INFO, __file__, 0, "", None, None, "completions").__dict__
        record = logging.LogRecord.__new__(logging.LogRecord)
        record.__dict__.update(template)
        record.msg = line
        record.created = now
        record.msecs = int((now - int(now)) * 1000) + 0.0
        record.relativeCreated = template["relativeCreated"] + (now - template["created"]) * 1000.0
        self.logger.handle(record)


_access_records = _AccessRecords(access_log)


_HEADER_NAMES: dict[str, bytes] = {}
"""Response header names, encoded once (a few dozen: ours and the limiter's)."""


def _header_name(name: str) -> bytes:
    raw = name.encode("latin-1")
    if len(_HEADER_NAMES) < 1024:
        _HEADER_NAMES[name] = raw
    return raw


def _headers(h: dict[str, str], ctype: bytes, *, length: int | None = None,
             extra: list[tuple[bytes, bytes]] | None = None) -> list[tuple[bytes, bytes]]:
    names = _HEADER_NAMES
    out = [(names.get(k) or _header_name(k), v.encode("latin-1")) for k, v in h.items()]
    out.append((b"content-type", ctype))
    if length is not None:
        out.append((b"content-length", str(length).encode()))
    if extra:
        out.extend(extra)
    return out


async def flush_access_log(every_s: float = 1.0) -> None:
    """Flush buffered access-log handlers (``loraplex gateway`` buffers the per-request lines)."""
    while True:
        await asyncio.sleep(every_s)
        for handler in access_log.handlers:
            handler.flush()


class _ClientGone(Exception):
    """The client disconnected while sending its request."""


WATCH_AFTER_S = 0.02
"""A request starts watching its deadline and its client's disconnect after running this long."""
SWEEP_S = 0.01
"""How often the requests that ran past ``WATCH_AFTER_S`` are looked for."""


class _Guard:
    """Cancels the request task when its deadline passes (``expired``) or its client
    disconnects, so the upstream call is cancelled too; ``cancelled`` says it did.

    Both need a timer, and watching the client needs a task: for the common case of a
    request answered within ``WATCH_AFTER_S`` that is wasted, so a guard starts both only
    when a ``_Sweeper`` finds it still running after that long (a disconnect before then is
    noticed that much later). A deadline shorter than that is armed at once."""

    __slots__ = ("_deadline", "_receive", "_state", "_task", "_timer", "_watch", "cancelled", "expired", "loop",
                 "started", "stopped")

    def __init__(self, receive: Any, state: _Call, timeout_s: float, sweeper: _Sweeper,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._task = asyncio.current_task(loop)
        self._receive = receive
        self._state: _Call | None = state
        """The request's call; None once stopped (the guard lets go of it)."""
        self.started = loop.time()
        self._deadline = self.started + timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._watch: asyncio.Task[None] | None = None
        self.cancelled = False
        self.expired = False
        self.stopped = False
        if timeout_s > WATCH_AFTER_S:
            sweeper.add(self)
        else:
            self._timer = loop.call_at(self._deadline, self._expire)

    def arm(self) -> None:
        self._timer = self.loop.call_at(self._deadline, self._expire)
        self._watch = self.loop.create_task(self._run())

    def _cancel(self) -> None:
        if not self.cancelled and self._task is not None and not self._task.done():
            self.cancelled = True
            self._task.cancel()

    def _expire(self) -> None:
        self._timer = None
        if not self.cancelled:
            self.expired = True
            self._cancel()

    async def _run(self) -> None:
        while True:
            msg = await self._receive()
            if msg["type"] == "http.disconnect":
                # After the last byte went out, the server reports a disconnect too: ignore it.
                if self._state is not None and not self._state.finished:
                    self._cancel()
                return

    def stop(self) -> None:
        self.stopped = True
        # The sweeper may hold this guard a while longer: let go of the request now.
        self._task = self._receive = self._state = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watch is not None and not self._watch.done():
            self._watch.cancel()


class _Sweeper:
    """Arms the guards of requests still running after ``WATCH_AFTER_S``: guards queue up in
    start order, and one timer every ``SWEEP_S`` (only while any are queued) takes the old
    ones off the front, instead of a timer per request."""

    def __init__(self) -> None:
        self._queue: collections.deque[_Guard] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, guard: _Guard) -> None:
        self._queue.append(guard)
        if self._loop is not guard.loop:
            self._loop = guard.loop
            guard.loop.call_later(SWEEP_S, self._sweep, guard.loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:
            return
        queue = self._queue
        old = loop.time() - WATCH_AFTER_S
        while queue and queue[0].started <= old:
            guard = queue.popleft()
            if not guard.stopped and guard.loop is loop:
                guard.arm()
        if queue:
            loop.call_later(SWEEP_S, self._sweep, loop)
        else:
            self._loop = None


