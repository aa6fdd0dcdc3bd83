"""The gateway application: ``create_app(settings, ...) -> GatewayApp`` (a Starlette app).

The two hot routes (``/v1/chat/completions``, ``/v1/completions``) are raw ASGI
handlers (no Request/Response objects), dispatched before Starlette's middleware and
router: auth (cached JWT verification) -> body
(size-capped) -> validation -> resolution -> limits (reserve before admission) ->
routing -> proxy -> settle, one access-log line and metrics. The rest (``/v1/models``,
health, readiness, the registry admin API under ``/admin``) are ordinary Starlette
routes; ``/metrics`` is a separate app (``app.metrics_app``) for the internal metrics port.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from gateway.auth import Authenticator
from gateway.errors import GatewayError, send_error
from gateway.metrics import GatewayMetrics, metrics_app
from gateway.prompt_tokens import PromptCounter, PromptError
from gateway.proxy import StreamResult, Upstream, read_rest, relay_sse, sse_error, usage_of
from gateway.ratelimit import Limiter, Limits, LocalLimiter, RedisLimiter, limit_message
from gateway.resolve import Resolver
from gateway.router import Router
from gateway.traffic import AdapterTraffic
from gateway.transport import H11Transport
from gateway.validate import Reservation, estimate, reserve, validate
from loraplex.residency import RedisResidency, ResidencyStore, process_residency
from loraplex.settings import Settings
from loraplex.wire import EXT_KEY, HDR_ADAPTER, HDR_REQUEST_ID, HDR_WORKER, PRIORITY_CLASSES, error_body
from registry.snapshot import RegistrySnapshot

log = logging.getLogger("loraplex.gateway")
HDR_FALLBACK = "x-loraplex-fallback"
"""Set when a disabled binding was answered by the base model instead of its adapter."""
access_log = logging.getLogger("loraplex.gateway.access")


class SnapshotSource(Protocol):
    @property
    def current(self) -> RegistrySnapshot: ...


class Gateway:
    """Everything the request path needs, built once per app."""

    def __init__(self, settings: Settings, snapshots: SnapshotSource, limiter: Limiter, router: Router,
                 client: httpx.AsyncClient) -> None:
        self.settings = settings
        self.snapshots = snapshots
        self.limiter = limiter
        self.router = router
        self.client = client
        self.auth = Authenticator(settings)
        self.resolver = Resolver()
        self.metrics = GatewayMetrics()
        self.upstream = Upstream(client, router, max_attempts=settings.route_candidates + 1,
                                 on_failure=self.metrics.upstream_failure, worker_secret=settings.worker_secret)
        self.lease_ttl_s = settings.request_timeout_s + 30.0
        self.prompts = PromptCounter(router, client, settings.worker_secret)
        self._limits: dict[tuple[int, int, int], Limits] = {}
        """One ``Limits`` per distinct set of tenant limits (built once, not per request)."""
        self.log_enabled = True
        self.sweeper = _Sweeper()
        self.traffic: AdapterTraffic | None = None
        """Per-adapter request counts for workers' warm start (set when Redis is configured)."""

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

    async def _plan(self, req: Any, base_model: str, tokens_per_min: int) -> Reservation:
        """What to reserve (``gateway.validate.reserve``) with the exact prompt count when the
        base model's tokenizer is known, else the byte-based bound."""
        fields = req.fields
        try:
            counted = await self.prompts.count(base_model, fields)
        except PromptError as exc:
            raise GatewayError(400, exc.message, code="invalid_value", param=exc.param) from None
        s = self.settings
        if counted is None:
            return reserve(fields, estimate(fields), exact=isinstance(fields.prompt, list), max_model_len=None,
                           tokens_per_min=tokens_per_min, default_max_tokens=s.default_max_tokens)
        return reserve(fields, counted[0], exact=True, max_model_len=counted[1], tokens_per_min=tokens_per_min,
                       default_max_tokens=s.default_max_tokens)

    async def completions(self, scope: Any, receive: Any, send: Any, *, chat: bool) -> None:
        t0 = time.perf_counter()
        authorization = None
        declared = None
        request_id = None
        for k, v in scope["headers"]:
            if k == b"authorization":
                authorization = v.decode("latin-1")
            elif k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = None
            elif k == b"x-request-id":
                rid = v.decode("latin-1")
                if 0 < len(rid) <= 128 and rid.isprintable():
                    request_id = rid
        request_id = request_id or _request_id()
        path = "/v1/chat/completions" if chat else "/v1/completions"
        st = _State()
        base_headers = {HDR_REQUEST_ID: request_id}
        tenant_slug = ""
        alias = ""
        label = ""
        lease = None
        plan: Reservation | None = None
        upstream = _NOT_SENT
        streamed: StreamResult | None = None
        usage: dict[str, Any] | None = None
        status = 500
        worker_id = ""
        streaming = False
        guard: _Guard | None = None
        try:
            if scope["method"] != "POST":
                raise GatewayError(405, "use POST", code="method_not_allowed")
            try:
                snapshot = self.snapshots.current
            except Exception:
                raise GatewayError(503, "The registry is not available yet; try again shortly.",
                                   code="registry_unavailable") from None
            tenant = self.auth.tenant(authorization, snapshot)
            tenant_slug = tenant.slug
            raw = await self._read_body(receive, declared)
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise GatewayError(400, "the request body is not valid JSON", code="invalid_json") from None
            s = self.settings
            req = validate(data, chat=chat, max_tokens_cap=s.max_tokens_cap)
            alias = req.model
            streaming = req.stream
            res = self.resolver.resolve(snapshot, tenant, req.model, req.user or request_id)
            label = res.label
            base_headers[HDR_ADAPTER] = res.label
            if res.fallback:
                base_headers[HDR_FALLBACK] = "binding-disabled"
            plan = await self._plan(req, res.base_model, tenant.tokens_per_min)
            body = req.body
            body["max_tokens"] = plan.max_tokens  # the one field every worker reads the same way
            body.pop("max_completion_tokens", None)
            if req.stream:
                body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
            body[EXT_KEY] = {
                "adapter": res.wire, "tenant": tenant.slug,
                "priority": PRIORITY_CLASSES.get(tenant.priority, PRIORITY_CLASSES["normal"]),
                "request_id": request_id,
            }
            try:
                payload = orjson.dumps(body)
            except orjson.JSONEncodeError as exc:
                raise _unencodable(body, exc) from None
            key = (tenant.requests_per_min, tenant.tokens_per_min, tenant.max_concurrent)
            limits = self._limits.get(key)
            if limits is None:
                if len(self._limits) >= 10_000:
                    self._limits.clear()
                limits = self._limits[key] = Limits(*key)
            decision = await self.limiter.acquire(tenant.slug, limits, plan.tokens, self.lease_ttl_s)
            base_headers.update(decision.headers)
            if not decision.allowed:
                self.metrics.limited(tenant.slug, decision.reason)
                if decision.status == 503:
                    raise GatewayError(503, "The rate limiter is unavailable; try again shortly.",
                                       code="ratelimiter_unavailable")
                raise GatewayError(429, limit_message(decision.reason),
                                   code="request_too_large" if decision.reason == "too_large"
                                   else "rate_limit_exceeded")
            lease = decision.lease
            if self.traffic is not None and res.wire is not None:
                self.traffic.record(res.wire)
            router = self.router
            adapter_id = res.adapter.id if res.adapter else None
            workers = None if router.due() else router.choose(res.base_model, adapter_id)
            if not workers:  # due, or none known: route refreshes (at once when none is usable)
                workers = await router.route(res.base_model, adapter_id)
            guard = _Guard(receive, st, s.request_timeout_s, self.sweeper)
            try:
                upstream = _SENT
                try:
                    opened = await self.upstream.open(workers, path, payload, request_id, whole=not req.stream)
                except GatewayError:
                    upstream = _NOT_SENT  # no worker took it
                    raise
                upstream = opened.response.status_code
                worker_id = opened.worker.id
                base_headers[HDR_WORKER] = worker_id
                try:
                    if req.stream and opened.response.status_code == 200:
                        status = 200
                        await send({"type": "http.response.start", "status": 200,
                                    "headers": _headers(base_headers, b"text/event-stream", extra=_SSE)})
                        st.started = True
                        result = streamed = StreamResult()
                        await relay_sse(opened, send, keep_usage=req.include_usage, result=result,
                                        strip_chunk_usage=not req.fields.continuous_usage)
                        usage = result.usage
                        if result.first_token_at is not None:
                            self.metrics.first_token(tenant_slug, label, result.first_token_at - t0)
                        if result.error or result.worker_error:
                            status = 502
                            self.metrics.upstream_failure(worker_id)
                        st.finished = True
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                    else:
                        content = opened.first if opened.chunks is None else await read_rest(opened)
                        status = opened.response.status_code
                        if status == 200:
                            usage = usage_of(content)
                        elif status >= 500:
                            status = 502
                            content = orjson.dumps(error_body("the worker failed to answer", "upstream_error",
                                                              "upstream_error"))
                        resp = opened.response
                        ctype = getattr(resp, "content_type", None) or resp.headers.get("content-type",
                                                                                         "application/json")
                        st.finished = True
                        await send({"type": "http.response.start", "status": status,
                                    "headers": _headers(base_headers, ctype.encode("latin-1"),
                                                        length=len(content))})
                        st.started = True
                        await send({"type": "http.response.body", "body": content})
                finally:
                    await self.upstream.done(opened)
            finally:
                guard.stop()
        except GatewayError as err:
            status = err.status
            if not st.started:
                await send_error(send, err, base_headers)
        except _ClientGone:
            status = 499
        except asyncio.CancelledError:
            # Ours (the deadline passed, the client left) or the server's (its shutdown grace ended).
            task = asyncio.current_task()
            if guard is None or not guard.cancelled or task is None or task.cancelling() == 0:
                status = 503
                log.warning("request %s cut short by the server's shutdown", request_id)
                if st.started and not st.finished:
                    await send({"type": "http.response.body", "body": sse_error(
                        "the gateway is shutting down", "shutting_down"), "more_body": False})
                elif not st.started:
                    await send_error(send, GatewayError(503, "The gateway is shutting down; retry the request.",
                                                        code="shutting_down"), base_headers)
                if task is not None and task.cancelling():
                    task.uncancel()  # answered: the request ends here, like any other
                return
            task.uncancel()
            if guard.expired:
                status = 504
                if st.started and not st.finished:
                    await send({"type": "http.response.body", "body": sse_error("the request deadline passed",
                                                                                "timeout"), "more_body": False})
                elif not st.started:
                    await send_error(send, GatewayError(504, "the request deadline passed", code="timeout"),
                                     base_headers)
            else:
                status = 499
        except Exception:
            log.exception("request %s failed", request_id)
            status = 500
            if not st.started:
                await send_error(send, GatewayError(500, "internal error", code="internal_error"), base_headers)
        finally:
            pt, ct = processed(plan, upstream, usage, streamed, streaming)
            if lease is not None:
                try:
                    self.limiter.settle_nowait(lease, pt + ct)
                except Exception:
                    log.exception("settling the reservation of %s failed", request_id)
            elapsed = time.perf_counter() - t0
            self.metrics.observe(tenant_slug, label, status, elapsed, pt, ct)
            if self.log_enabled and access_log.isEnabledFor(logging.INFO):
                now = time.time()
                _access_records.emit(orjson.dumps({
                    "ts": round(now, 3), "request_id": request_id, "tenant": tenant_slug, "alias": alias,
                    "adapter": label, "worker": worker_id, "prompt_tokens": pt, "completion_tokens": ct,
                    "status": status, "latency_ms": round(elapsed * 1000, 3), "stream": streaming,
                }).decode(), now)


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
      ``max_tokens`` when not streamed (what the worker generated is not known:
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
        return plan.prompt_tokens, plan.max_tokens
    return plan.prompt_tokens, 0 if stream else plan.max_tokens


_SSE = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


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
            add = getattr(handler, "add_line", None)
            if add is not None and not handler.filters and handler.level <= logging.INFO:
                add(line)
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


def _headers(h: dict[str, str], ctype: bytes, *, length: int | None = None,
             extra: list[tuple[bytes, bytes]] | None = None) -> list[tuple[bytes, bytes]]:
    out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in h.items()]
    out.append((b"content-type", ctype))
    if length is not None:
        out.append((b"content-length", str(length).encode()))
    if extra:
        out.extend(extra)
    return out


async def _flush_access_log(every_s: float = 1.0) -> None:
    """Flush buffered access-log handlers (``loraplex gateway`` buffers the per-request lines)."""
    while True:
        await asyncio.sleep(every_s)
        for handler in access_log.handlers:
            handler.flush()


ENCODE_MAX_DEPTH = 254
"""Deepest nesting (objects and lists, the body itself counted) that ``orjson.dumps`` encodes."""


def _depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (1 for a flat object)."""
    depth, level = 0, [value]
    while level:
        depth += 1
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x)
                 if isinstance(v, dict | list)]
    return depth


def _unencodable(body: dict[str, Any], exc: orjson.JSONEncodeError) -> GatewayError:
    """The 400 for a body that parsed but cannot be forwarded (orjson encodes 254 levels at most)."""
    for name, value in body.items():
        if isinstance(value, dict | list) and _depth(value) >= ENCODE_MAX_DEPTH:
            return GatewayError(400, f"'{name}' is nested {_depth(value)} levels deep; the request body may nest "
                                f"at most {ENCODE_MAX_DEPTH} levels (itself included)", code="invalid_json",
                                param=name)
    return GatewayError(400, f"the request body cannot be forwarded: {exc}", code="invalid_json")


class _ClientGone(Exception):
    """The client disconnected while sending its request."""


class _State:
    __slots__ = ("finished", "started")

    def __init__(self) -> None:
        self.started = False
        self.finished = False


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

    def __init__(self, receive: Any, state: _State, timeout_s: float, sweeper: _Sweeper) -> None:
        self.loop = loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._receive = receive
        self._state = state
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
                if not self._state.finished:
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


_HOT_ROUTES = {"/v1/chat/completions": True, "/v1/completions": False}
"""The two hot routes (path -> chat?)."""


class GatewayApp(Starlette):
    """The gateway's Starlette app; the two hot routes go straight to ``Gateway.completions``
    (a raw ASGI handler that answers every error itself), skipping the middleware stack and
    the router."""

    gateway: Gateway
    metrics_app: Any
    """``/metrics`` for the internal metrics port (``gateway.http_edge.metrics_config``), never this app."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            chat = _HOT_ROUTES.get(scope["path"])
            if chat is not None:
                await self.gateway.completions(scope, receive, send, chat=chat)
                return
        await super().__call__(scope, receive, send)


def _error(status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None) -> Response:
    err = GatewayError(status, message, code=code)
    return Response(err.body(), status_code=status, media_type="application/json", headers=headers)


def _redis_client(settings: Settings) -> Any:
    """The replica's one Redis client (limiter, residency, adapter traffic)."""
    import redis.asyncio as aioredis
    from redis.utils import HIREDIS_AVAILABLE

    if not HIREDIS_AVAILABLE:
        log.warning("hiredis is not installed: Redis replies are parsed in Python (slower)")
    return aioredis.from_url(settings.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5,
                             health_check_interval=0, max_connections=256)


def _default_snapshots(settings: Settings) -> Any:
    if settings.registry_snapshot_file:
        from gateway.snapshot_file import FileSnapshotSource

        return FileSnapshotSource(settings.registry_snapshot_file)
    from registry.cache import SnapshotCache  # the live registry (lazy: keeps startup light)

    factory = getattr(SnapshotCache, "from_settings", None)
    return factory(settings) if factory else SnapshotCache(settings)


def _admin_app(settings: Settings, router: Router,
               client: httpx.AsyncClient) -> tuple[Any, Any] | tuple[None, None]:
    """The registry admin API (``registry.admin_api``) behind the activation gate, and its service."""
    try:
        from registry.admin_api import admin_app
        from registry.service import RegistryService
    except ImportError:
        log.info("registry admin API not available; /admin is not mounted")
        return None, None
    from gateway.activation import ActivationGate

    service = RegistryService(settings)
    return admin_app(service, settings, gate=ActivationGate(settings, router, client)), service


def create_app(settings: Settings, *, snapshots: Any = None, limiter: Limiter | None = None,
               residency: ResidencyStore | None = None, http_client: httpx.AsyncClient | None = None,
               mount_admin: bool = True) -> GatewayApp:
    """The gateway app. Anything not passed is built from ``settings``:

    * ``snapshots``: ``registry.cache.SnapshotCache`` over the registry database (or a
      ``FileSnapshotSource`` when ``registry_snapshot_file`` is set);
    * ``limiter``: ``RedisLimiter`` (with a local fallback) when ``redis_url`` is set,
      else the in-process ``LocalLimiter``;
    * ``residency``: ``RedisResidency`` when ``redis_url`` is set, else the process table;
    * ``http_client``: one pooled ``httpx.AsyncClient`` for every upstream call (over the lean
      keep-alive ``H11Transport``).

    Components passed in are started/stopped by their owner, except the snapshot source,
    whose optional ``start()``/``stop()`` the app calls in its lifespan.
    """
    redis = _redis_client(settings) if settings.redis_url else None
    if snapshots is None:
        snapshots = _default_snapshots(settings)
    own_limiter = limiter is None
    if limiter is None:
        limiter = RedisLimiter(redis, settings.redis_prefix, fail_mode=settings.ratelimit_fail_mode) \
            if redis is not None else LocalLimiter()
    if residency is None:
        residency = RedisResidency(redis, settings.redis_prefix) if redis is not None else process_residency()
    own_client = http_client is None
    if http_client is None:
        http_client = httpx.AsyncClient(
            transport=H11Transport(connect_timeout=2.0, keepalive_expiry=30.0),
            timeout=httpx.Timeout(settings.request_timeout_s, connect=2.0), trust_env=False,
        )
    router = Router(residency, candidates=settings.route_candidates, load_factor=settings.route_load_factor,
                    static_urls=settings.worker_urls,
                    cooldown_s=max(2.0, settings.worker_report_ttl_s))
    gw = Gateway(settings, snapshots, limiter, router, http_client)
    if redis is not None:
        gw.traffic = AdapterTraffic(redis, settings.redis_prefix)

    async def models(request: Request) -> Response:
        try:
            snapshot = gw.snapshots.current
            tenant = gw.auth.tenant(request.headers.get("authorization"), snapshot)
        except GatewayError as err:
            return Response(err.body(), status_code=err.status, media_type="application/json")
        data = [{"id": name, "object": "model", "created": 0, "owned_by": tenant.slug if name in tenant.bindings
                 else "loraplex"} for name in gw.resolver.models(snapshot, tenant)]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        """Ready = this replica can serve its API (a registry snapshot is loaded). Workers are
        reported, not required: during a worker outage the admin API stays in the Service."""
        snap = None
        try:
            snap = gw.snapshots.current
            problem = None if snap is not None else "no registry snapshot yet"
        except Exception as exc:
            problem = f"registry snapshot unavailable: {type(exc).__name__}"
        if problem:
            return JSONResponse({"status": "not ready", "problems": [problem]}, status_code=503)
        await router.refresh()
        workers = len(router.workers())
        body: dict[str, Any] = {"status": "ready", "registry_version": getattr(snap, "version", None),
                                "workers": workers}
        if not workers:
            body["warnings"] = ["no live worker: completions answer 503 no_worker until one reports"]
        return JSONResponse(body)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return _error(status, "not found" if status == 404 else str(getattr(exc, "detail", "error")))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return _error(500, "internal error", "internal_error")

    admin, admin_service = _admin_app(settings, router, http_client) if mount_admin else (None, None)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        start = getattr(snapshots, "start", None)
        if start is not None:
            await start()
        await router.refresh()
        flusher = asyncio.create_task(_flush_access_log(), name="access-log-flush")
        traffic = asyncio.create_task(gw.traffic.run(), name="adapter-traffic") if gw.traffic else None
        try:
            yield
        finally:
            flusher.cancel()
            if traffic is not None and gw.traffic is not None:
                traffic.cancel()
                with contextlib.suppress(Exception):
                    await gw.traffic.flush()
            for handler in access_log.handlers:
                handler.flush()
            await gw.prompts.close()
            stop = getattr(snapshots, "stop", None)
            if stop is not None:
                await stop()
            if own_client:
                await http_client.aclose()
            if own_limiter:
                await limiter.close()
            if redis is not None:
                await redis.aclose()
            if admin_service is not None:
                await admin_service.close()

    from starlette.exceptions import HTTPException

    routes: list[Any] = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
    ]
    if admin is not None:
        routes.append(Mount("/admin", app=admin))
    app = GatewayApp(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: not_found, Exception: server_error})
    app.gateway = gw
    app.state.gateway = gw

    def refresh_gauges() -> None:
        gw.metrics.inflight.set(sum(w.inflight for w in router.workers()))

    app.metrics_app = metrics_app(gw.metrics, refresh_gauges)
    return app
