"""Forwarding to engine workers over the gateway's one ``WorkerClient``.

``Upstream.open`` tries the routed workers in order until one answers: a worker that cannot
be reached, a 503, a 401/403 (the worker refused this gateway's worker secret: logged, never
passed to the client), or a response that breaks before its first byte moves on to the next
candidate (connection failures also mark the worker failed in the router). So does a
worker, other than the last candidate, that sends no first byte within its deadline (``first_byte_s`` plus ``per_queued_s``
per request it has waiting; a whole answer's worker, which sends nothing until it is done,
keeps its request past the deadline while its report stays fresh, or while it has none: a
static URL): the attempt is cancelled
and its connection closed. Nothing has reached the client at that point, so a retry is
invisible to it. A 503 that blames the adapter itself is not retried: another worker would
fail the same way. Every attempt's outcome feeds the router's outlier detection
(``gateway.outliers``).

``relay_sse`` passes a worker's SSE stream through event by event without buffering
the response; it picks the usage chunk out (and drops it when the client did not ask
for ``stream_options.include_usage``; one without ``prompt_tokens_details.cached_tokens``,
a vLLM's, gets it as 0, as a whole answer does in ``whole_usage``), keeps count of the
tokens relayed from the per-chunk usage, and ends a stream that breaks mid-way with an SSE error event, never
silently: ``stream_interrupted``, or ``upstream_stalled`` when the worker sent nothing for
``stall_s`` (or stopped reporting). Anything the worker sends counts as progress, its SSE
comments too: the bundled worker starts a stream with ``: accepted`` once its engine took the
request (the first byte) and sends ``: progress`` while a stream is quiet and its engine keeps
stepping (``engine.api``). Comments are never passed to the client. A vLLM worker sends no such
comments, so its stream is patient: silence alone never ends it, only its stopping reporting.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway import outliers
from gateway.backends import VllmBody, backend_of
from gateway.errors import GatewayError, public_event, public_message
from gateway.router import Router, Worker
from gateway.worker_client import WorkerBroke, WorkerClient, WorkerResponse, WorkerUnreachable
from loraplex.wire import error_body

log = logging.getLogger("loraplex.gateway.proxy")


@dataclass(slots=True)
class Opened:
    worker: Worker
    response: WorkerResponse
    first: bytes
    """First body chunk (already read, so a failure before it could still be retried), or
    the whole body when it was opened with ``whole``."""
    chunks: AsyncIterator[bytes] | None
    """The rest of the body (None: ``first`` is all of it)."""
    stall_s: float = 0.0
    """A stream whose worker sends nothing for this long is ended (``relay_sse``; 0: never)."""
    alive: Callable[[], bool] | None = None
    """Whether the worker still reports (``Upstream.alive``): a stream waiting on one that stopped ends sooner."""
    check_s: float = 1.0
    """How often ``alive`` is asked while the stream waits."""
    patient: bool = False
    """Silence alone does not end the stream, only the worker's stopping reporting (a vLLM worker, which
    sends nothing while a request waits in its queue or before its first token)."""
    outcome: str | None = None
    """How the worker did: ``ok``, a failure (``gateway.outliers.REASONS``), or None when the
    request ended before that was known (the client left); ``Upstream.done`` records it."""


class Watchdog:
    """Cancels the task that made it (``fired``) when its worker has kept it waiting ``seconds``,
    or sooner when ``alive`` (asked every ``every`` seconds while it waits) says the worker stopped
    (it no longer reports: hung). ``patient``: past ``seconds`` it waits on while the worker is
    alive (a whole answer, sent only when done). ``waiting`` is False while the task does something
    else (sends to the client): that time does not count. One timer, re-armed when it goes off."""

    __slots__ = ("_handle", "_loop", "_task", "alive", "due", "every", "fired", "patient", "quiet", "seconds",
                 "waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float, alive: Callable[[], bool] | None = None,
                 every: float = 1.0, patient: bool = False) -> None:
        self._loop = loop
        self._task = asyncio.current_task(loop)
        self.seconds = seconds
        self.alive = alive
        self.every = every if alive is not None else seconds
        self.patient = patient and alive is not None
        self.fired = False
        self.quiet = False
        """It fired because the worker stopped reporting (not on the deadline)."""
        self.waiting = True
        now = loop.time()
        self.due = now + seconds
        self._handle: asyncio.TimerHandle | None = loop.call_at(min(self.due, now + self.every), self._check)

    def wait(self) -> None:
        """The task waits for its worker again: ``seconds`` from now."""
        self.waiting = True
        self.due = self._loop.time() + self.seconds

    def _check(self) -> None:
        now = self._loop.time()
        self._handle = None
        if self.waiting:
            if self.alive is not None and not self.alive():
                self.quiet = True
                self._fire()
                return
            if now >= self.due and not self.patient:
                self._fire()
                return
        at = now + self.every if self.patient and now >= self.due else min(max(self.due, now), now + self.every)
        self._handle = self._loop.call_at(at if at > now else now + self.every, self._check)

    def _fire(self) -> None:
        task = self._task
        if task is not None and not task.done():
            self.fired = True
            task.cancel()

    def caught(self) -> bool:
        """In an ``except CancelledError``: whether this watchdog's cancellation (alone) is the cause."""
        task = self._task
        return self.fired and task is not None and task.uncancel() == 0

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class Upstream:
    def __init__(self, client: WorkerClient, router: Router, max_attempts: int = 4,
                 on_failure: Callable[[str], None] | None = None, *, first_byte_s: float = 10.0,
                 per_queued_s: float = 0.5, stall_s: float = 20.0) -> None:
        self.client = client
        self.on_failure = on_failure
        self.router = router
        self.max_attempts = max_attempts
        self.first_byte_s = first_byte_s
        self.per_queued_s = per_queued_s
        self.stall_s = stall_s

    def first_byte_deadline(self, worker: Worker) -> float:
        """Seconds ``worker`` has to send its first byte: the base, plus an allowance per request
        ahead of this one."""
        return self.first_byte_s + self.per_queued_s * worker.waiting

    def _failed(self, worker: Worker, reason: str) -> None:
        self.router.outliers.failure(worker.id, reason)
        if self.on_failure is not None:
            self.on_failure(worker.id)

    def alive(self, worker: Worker) -> Callable[[], bool]:
        """``Watchdog.alive`` for ``worker``: False once it stopped reporting (a refresh after its
        report TTL found no newer report); always True for a static URL, which has none."""
        router = self.router

        def alive() -> bool:
            router.refresh_soon()
            return not router.gone_quiet(worker)

        return alive

    def check_every(self) -> float:
        """How often a waiting request asks whether its worker still reports."""
        return max(0.1, min(1.0, self.router.report_ttl_s / 3))

    async def open(self, workers: list[Worker], path: str, payload: bytes, request_id: str, *,
                   whole: bool = False, vllm: VllmBody | None = None) -> Opened:
        """The first worker that answers, with the first chunk of its body read (``whole``: all
        of it, for answers that are not streamed). The worker counts as loaded (``router.acquire``)
        until ``done``. Each worker's backend (``gateway.backends``) gives its body: ``payload``,
        or for a vLLM worker ``vllm(worker, reload)``'s. An answer that says the worker lost the
        adapter (``WorkerBackend.lost_adapter``: vLLM's 404, the adapter unloaded since its
        report) is retried once on it with the adapter loaded again, and a second one moves on
        to the next candidate (vLLM's answer, which names the version, never reaches the client)."""
        if not workers:
            raise GatewayError(503, "No worker is available for this model right now.", code="no_worker",
                               headers={"retry-after": "1"})
        last = "no worker answered"
        load_failure = None
        router = self.router
        tries = workers[: self.max_attempts]
        reloaded: set[str] = set()
        loop = asyncio.get_running_loop()
        while tries:
            worker = tries.pop(0)
            router.acquire(worker)
            resp: WorkerResponse | None = None
            watch: Watchdog | None = None
            backend = backend_of(worker)
            try:
                body = await backend.body(worker, payload, vllm, worker.id in reloaded)
                # A whole answer is sent only when done: past its deadline it waits on while the worker
                # reports. The last candidate has no deadline of its own (nowhere else to go), but
                # is given up on too once it stops reporting.
                watch = Watchdog(loop, self.first_byte_deadline(worker), self.alive(worker), self.check_every(),
                                 patient=whole or not tries)
                resp = await self.client.post(worker.url + path, body, request_id)
                status = resp.status
                if backend.lost_adapter(status):
                    await resp.read()
                    resp.close()
                    resp = None
                    router.release(worker)
                    if worker.id not in reloaded:
                        reloaded.add(worker.id)
                        tries.insert(0, worker)
                    else:
                        last = f"worker {worker.id} lost the adapter again after loading it"
                    continue
                if status == 503 or status == 401 or status == 403:
                    body = await resp.read()
                    resp.close()
                    resp = None
                    router.release(worker)
                    if status != 503:
                        # Not the client's fault: this gateway's worker secret is not the worker's.
                        log.error("worker %s refused the worker secret (set the same LORAPLEX_WORKER_SECRET "
                                  "on gateways and workers)", worker.id)
                        last = f"worker {worker.id} refused the worker secret"
                        continue
                    load_failure = _adapter_failure(body)
                    if load_failure is not None:
                        break  # the adapter itself failed: another worker would fail the same way
                    last = f"worker {worker.id} is overloaded"
                    self._failed(worker, outliers.STATUS_5XX)
                    continue
                if whole:
                    content = await resp.read()
                    if watch is not None:
                        watch.stop()
                    return Opened(worker, resp, content, None, outcome="ok" if status < 500 else outliers.STATUS_5XX)
                chunks = resp.chunks()
                first = b""
                async for chunk in chunks:
                    if chunk:
                        first = chunk
                        break
                if watch is not None:
                    watch.stop()
                # ``first`` may be only a comment (the worker took the request): it counts as the first
                # byte; relay_sse passes no comment on.
                return Opened(worker, resp, first, chunks, stall_s=self.stall_s, alive=self.alive(worker),
                              check_s=self.check_every(), patient=backend.patient)
            except (WorkerUnreachable, WorkerBroke) as exc:
                router.release(worker)
                if resp is not None:
                    resp.close()
                last = f"worker {worker.id}: {exc}"
                router.mark_failed(worker)
                self._failed(worker, outliers.CONNECT if isinstance(exc, WorkerUnreachable) else outliers.BROKE)
            except asyncio.CancelledError:
                router.release(worker)
                if resp is not None:
                    resp.close()
                if watch is None or not watch.caught():
                    raise
                last = (f"worker {worker.id} stopped reporting" if watch.quiet
                        else f"worker {worker.id} sent nothing within {watch.seconds:g} s")
                log.warning("request %s: %s; trying the next candidate", request_id, last)
                self._failed(worker, outliers.QUIET if watch.quiet else outliers.FIRST_BYTE)
            except BaseException:
                router.release(worker)
                if resp is not None:
                    resp.close()
                raise
            finally:
                if watch is not None:
                    watch.stop()
        if load_failure is not None:
            code, message = load_failure
            what = "could not be loaded" if code == "adapter_load_failed" else "failed on this request"
            raise GatewayError(503, f"The adapter {what}: {message}", code=code)
        log.warning("request %s: every candidate failed (%s)", request_id, last)
        raise GatewayError(503, "No worker could serve this request right now.", code="no_worker",
                           headers={"retry-after": "1"})

    def done(self, opened: Opened) -> None:
        """The request is over: the worker's load drops, the connection is released, and how
        the worker did goes to outlier detection (a 5xx of its own or a broken or stalled
        stream: a failure; an answer to its end: a success; a request the client left: neither)."""
        self.router.release(opened.worker)
        opened.response.close()
        status = opened.response.status
        outcome = outliers.STATUS_5XX if status >= 500 else opened.outcome
        if outcome is None and status != 200:
            outcome = "ok"  # a 4xx: the worker answered
        if outcome == "ok":
            self.router.outliers.success(opened.worker.id)
        elif outcome is not None:
            self.router.outliers.failure(opened.worker.id, outcome)


ADAPTER_FAILURES = (b"adapter_load_failed", b"non_finite_output", b"adapter_error")
"""Worker error codes that blame the adapter itself: such an answer is not retried elsewhere."""


def _adapter_failure(body: bytes) -> tuple[str, str] | None:
    """(code, message) of a worker's 503 that blames the adapter, else None (overloaded)."""
    for code in ADAPTER_FAILURES:
        if code in body:
            return code.decode(), _message(body)
    return None


def _message(body: bytes) -> str:
    try:
        return str(orjson.loads(body)["error"]["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return "unknown reason"


async def read_rest(opened: Opened) -> bytes:
    if opened.chunks is None:
        return opened.first
    parts = [opened.first]
    async for chunk in opened.chunks:
        parts.append(chunk)
    return b"".join(parts)


def cached_tokens(usage: dict[str, Any] | None) -> int:
    """``usage.prompt_tokens_details.cached_tokens``: the prompt tokens a worker's prefix cache
    supplied; 0 where it said nothing (vLLM reports them only when started with
    ``--enable-prompt-tokens-details``, and only when there was a hit)."""
    details = usage.get("prompt_tokens_details") if usage else None
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if type(n) is int and n >= 0 else 0


def fill_cached(usage: dict[str, Any]) -> bool:
    """Give ``usage`` its ``prompt_tokens_details.cached_tokens`` (0) where the worker sent none,
    so every client reads the field the same way whichever worker answered; True if it changed."""
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and type(details.get("cached_tokens")) is int:
        return False
    usage["prompt_tokens_details"] = {**(details if isinstance(details, dict) else {}),
                                      "cached_tokens": cached_tokens(usage)}
    return True


def whole_usage(body: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """A whole answer's usage, and the body to relay: the worker's own bytes, or re-encoded with
    ``prompt_tokens_details.cached_tokens`` filled in where the worker sent none (``fill_cached``)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body, None
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return body, None
    if fill_cached(usage):
        body = orjson.dumps(data)
    return body, usage


_TEXT = re.compile(rb'"(?:content|text|arguments)":"[^"]')
_LENGTH = b'"finish_reason":"length"'


def finish_of(body: bytes) -> tuple[bool, bool]:
    """A whole answer's (empty: no choice has text or tool calls, stopped on ``length``)."""
    try:
        data = orjson.loads(body)
        choices = data["choices"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False, False
    empty, length = True, False
    for c in choices if isinstance(choices, list) else ():
        if not isinstance(c, dict):
            continue
        msg = c.get("message")
        msg = msg if isinstance(msg, dict) else {}
        if c.get("text") or msg.get("content") or msg.get("tool_calls"):
            empty = False
        length = length or c.get("finish_reason") == "length"
    return empty, length


def sse_error(message: str, code: str = "stream_interrupted") -> bytes:
    """An error event (``code``'s fixed sentence where it has one: ``gateway.errors.ERROR_CODES``)."""
    return b"data: " + orjson.dumps(error_body(public_message(code, message), "upstream_error", code)) + b"\n\n"


@dataclass(slots=True)
class StreamResult:
    usage: dict[str, Any] | None = None
    """The final usage chunk's usage (None when the stream ended without one)."""
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    """From the per-chunk usage of the last event relayed: what the client got so far."""
    done: bool = False
    error: str | None = None
    """Why the stream broke (the gateway then ends it with an error event)."""
    stalled: bool = False
    """It broke because the worker sent nothing for the stall bound (``upstream_stalled``)."""
    worker_error: bool = False
    worker_detail: str | None = None
    """The worker's own text of its in-stream error, when the client got a fixed sentence (for the log)."""
    sent_bytes: int = 0
    first_token_at: float | None = None
    """``time.perf_counter()`` when the first event went to the client."""
    watch: bool = False
    """Note ``text`` and ``length`` (the canary judge's samples need them; other streams skip the search)."""
    text: bool = False
    """Some event carried non-empty text (``content`` or ``text``, tool-call arguments included)."""
    length: bool = False
    """A choice finished on ``length``."""


_CHUNK_USAGE = re.compile(rb'(?<!"choices":\[\]),"usage":\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}')
"""The per-chunk usage (``continuous_usage_stats``: the last key of a content chunk), flat or
with its ``prompt_tokens_details`` object (some vLLM builds send it in every chunk)."""
_COMPLETION_TOKENS = b'"completion_tokens":'
_PROMPT_TOKENS = b'"prompt_tokens":'


def _int_at(buf: bytes, i: int) -> int | None:
    j = i
    while j < len(buf) and 48 <= buf[j] <= 57:
        j += 1
    return int(buf[i:j]) if j > i else None


def without_comments(events: bytes) -> bytes:
    """Complete SSE events less their comment lines (``: ...``); an event of comments only goes."""
    kept = []
    for event in events.split(b"\n\n"):
        lines = [line for line in event.split(b"\n") if not line.startswith(b":")]
        if any(lines):
            kept.append(b"\n".join(lines) + b"\n\n")
    return b"".join(kept)


async def relay_sse(opened: Opened, send: Callable[[dict[str, Any]], Awaitable[None]], *,
                    keep_usage: bool, strip_chunk_usage: bool = False,
                    result: StreamResult | None = None) -> StreamResult:
    """Pass SSE events through to ``send``; returns the usage seen and how the stream ended.

    The worker is asked for usage in every chunk (vLLM's ``continuous_usage_stats``): the
    counts of the last event relayed are what the client got (``result`` has them even when
    the relay is cancelled). ``strip_chunk_usage``: the client did not ask for them, so
    they are taken out (``"usage": null`` when it asked for ``include_usage``)."""
    result = result if result is not None else StreamResult()
    # Every chunk, a comment too, re-arms the watchdog (``watch.wait``): comments are the worker's progress.
    watch = Watchdog(asyncio.get_running_loop(), opened.stall_s, opened.alive, opened.check_s,
                     patient=opened.patient) if opened.stall_s > 0 else None
    buf = b""
    chunk_usage = b',"usage":null' if keep_usage else b""

    async def push(data: bytes) -> None:
        nonlocal buf
        buf += data
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            return
        complete, buf = buf[: cut + 2], buf[cut + 2:]
        if complete[:1] == b":" or b"\n:" in complete:  # JSON escapes newlines: a line-leading ':' is a comment
            complete = without_comments(complete)
            if not complete:
                return
        out = complete
        if result.watch:
            if not result.text and _TEXT.search(complete):
                result.text = True
            if not result.length and _LENGTH in complete:
                result.length = True
        i = complete.rfind(_COMPLETION_TOKENS)
        if i >= 0:
            n = _int_at(complete, i + len(_COMPLETION_TOKENS))
            if n is not None:
                result.completion_tokens = n
            j = complete.rfind(_PROMPT_TOKENS, 0, i)
            if j >= 0:
                result.prompt_tokens = _int_at(complete, j + len(_PROMPT_TOKENS))
        if b'"choices":[]' in complete or b"[DONE]" in complete or b'{"error"' in complete:
            kept = []
            for event in complete.split(b"\n\n"):
                if not event:
                    continue
                if b"[DONE]" in event:
                    result.done = True
                elif event.startswith(b'data: {"error"'):
                    result.worker_error = True  # the worker reported a failure in-stream
                    event, result.worker_detail = public_event(event)
                elif b'"choices":[]' in event and b'"usage"' in event and event.startswith(b"data:"):
                    try:
                        obj = orjson.loads(event[5:])
                    except orjson.JSONDecodeError:
                        obj = None
                    if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                        result.usage = obj["usage"]
                        if not keep_usage:
                            continue
                        if fill_cached(result.usage):
                            event = b"data: " + orjson.dumps(obj)
                kept.append(event)
            out = b"".join(e + b"\n\n" for e in kept)
        if strip_chunk_usage and i >= 0:
            out = _CHUNK_USAGE.sub(chunk_usage, out)
        if out:
            if result.first_token_at is None:
                result.first_token_at = time.perf_counter()
            result.sent_bytes += len(out)
            await send({"type": "http.response.body", "body": out, "more_body": True})

    code = "stream_interrupted"
    try:
        if watch is not None:
            watch.waiting = False
        if opened.first:
            await push(opened.first)
        if opened.chunks is not None:
            if watch is not None:
                watch.wait()
            async for chunk in opened.chunks:
                if watch is not None:
                    watch.waiting = False
                await push(chunk)
                if watch is not None:
                    watch.wait()
    except WorkerBroke as exc:
        result.error = f"the worker stream broke: {exc}"
        opened.outcome = outliers.BROKE
    except asyncio.CancelledError:
        if watch is None or not watch.caught():
            raise
        result.error = ("the worker stopped responding" if watch.quiet
                        else f"the worker sent nothing for {opened.stall_s:g} s")
        result.stalled = True
        code = "upstream_stalled"
        opened.outcome = outliers.STALL
    finally:
        if watch is not None:
            watch.stop()
    if result.error is None and not result.done:
        result.error = "the worker stream ended early"
        opened.outcome = outliers.BROKE
    elif result.error is None:
        opened.outcome = "ok"
    if result.error is not None:
        await send({"type": "http.response.body", "body": sse_error(result.error, code), "more_body": True})
    return result
