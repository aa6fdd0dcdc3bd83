"""A stub engine worker: a real HTTP server process that answers OpenAI requests instantly.

Used by the gateway tests and ``bench/gateway_overhead.py``. It speaks the worker side
of the wire protocol (OpenAI body + ``"loraplex"`` extension), streams SSE in
``--chunks`` chunks, reports its residency/load every ``--report-interval`` seconds
into Redis (``--redis-url``/``--redis-prefix``), and records what it saw and which
requests were cancelled by their client (``GET /stub/stats``).

Per-request behaviour can be changed through the OpenAI ``metadata`` field:
``stub_delay`` (seconds before answering), ``stub_chunk_delay`` (seconds between
chunks), ``stub_stall_after`` (a stream sends this many chunks, then nothing until the client
leaves), ``stub_mode`` (``ok``, ``503``, ``break`` = drop the connection mid-stream,
``500``, ``400`` = a worker 4xx, ``load-fail`` = the adapter could not be loaded, ``non-finite`` = its
values went NaN/Inf). ``--mode`` sets the
default for every request. ``stub_progress`` (seconds) makes a stream behave like a busy engine's: it
starts with ``: accepted`` before ``stub_delay``, and while it waits out ``stub_delay`` or
``stub_chunk_delay`` it sends a ``: progress`` comment every that many seconds (a stalled one,
``stub_stall_after``, sends none, as a stuck engine).

It generates min(``max_tokens``, ``--chunks``) tokens, one per stream chunk, reading
``max_tokens`` with the shared rule (``loraplex.openai_request``). With ``--tokenizer``
(a model path, or the JSON a worker serves) it counts prompt tokens exactly as the engine does
and serves the tokenizer on ``GET /internal/tokenizer`` (secret-checked), as a worker does;
without it, ``usage.prompt_tokens`` is a rough size. Streams carry the usage so far in every
chunk when asked (``stream_options.continuous_usage_stats``).
Like a real worker it refuses every route but ``/health`` without the worker secret
(``--worker-secret``, default ``LORAPLEX_WORKER_SECRET`` or the development value): 401/403.
``--no-secret-check`` (benchmarks only) accepts requests without it, for clients that send none
(an older gateway, another proxy).

Run: ``python -m tests.stub_worker --port 8101 --worker-id w1 --base-model smol``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, deque
from typing import Any

import orjson

from gateway.snapshot_source import SnapshotSource
from loraplex.openai_request import FieldError
from loraplex.openai_request import parse as parse_fields
from loraplex.settings import DEV_WORKER_SECRET
from loraplex.wire import HDR_WORKER_SECRET

_SECRET_HEADER = HDR_WORKER_SECRET.encode()


def _secret_refusal(given: bytes | None, secret: str) -> tuple[int, dict[str, Any]] | None:
    """(status, body) when ``given`` is not the worker secret, as a worker answers."""
    if not given:
        return 401, {"error": {"message": f"missing {HDR_WORKER_SECRET} header", "type": "authentication_error",
                               "code": "unauthorized", "param": None}}
    if given != secret.encode():
        return 403, {"error": {"message": "wrong worker secret", "type": "permission_error", "code": "forbidden",
                               "param": None}}
    return None


class Stub:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.requests = 0
        self.completed = 0
        self.cancelled = 0
        self.inflight = 0
        self.refused = 0
        self.adapters: Counter[str] = Counter()
        self.exts: deque[dict[str, Any]] = deque(maxlen=200)
        self.device = [a for a in args.device_adapters.split(",") if a]
        self.host = [a for a in args.host_adapters.split(",") if a]
        self._report_task: asyncio.Task[None] | None = None
        self.tokenizer: Any = None
        if args.tokenizer:
            from loraplex.tokenizer import TextTokenizer

            if args.tokenizer.endswith(".json"):  # the served form (``TextTokenizer.to_dict``)
                with open(args.tokenizer) as f:
                    self.tokenizer = TextTokenizer.from_dict(json.load(f))
            else:
                self.tokenizer = TextTokenizer.from_model_path(args.tokenizer)

    # -- residency ------------------------------------------------------------------------------

    async def _report_loop(self) -> None:
        import redis.asyncio as aioredis

        from loraplex.residency import RedisResidency
        from loraplex.wire import WorkerReport

        r = aioredis.from_url(self.args.redis_url)
        store = RedisResidency(r, self.args.redis_prefix)
        url = f"http://127.0.0.1:{self.args.port}"
        try:
            while True:
                report = WorkerReport(worker_id=self.args.worker_id, url=url, base_model=self.args.base_model,
                                      base_revision="stub", device_adapters=self.device,
                                      host_adapters=self.host, running=self.inflight, max_num_seqs=64,
                                      max_loras=8)
                with contextlib.suppress(Exception):
                    await store.publish(report, self.args.report_ttl)
                await asyncio.sleep(self.args.report_interval)
        finally:
            with contextlib.suppress(Exception):
                await store.remove(self.args.worker_id)
            await r.aclose()

    # -- ASGI -----------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path = scope["path"]
        if path == "/stub/stats":
            await self._json(send, 200, self.stats())
            return
        if path in ("/health", "/healthz"):
            await self._json(send, 200, {"status": "ok"})
            return
        refused = None if self.args.no_secret_check else _secret_refusal(
            next((v for k, v in scope["headers"] if k == _SECRET_HEADER), None), self.args.worker_secret)
        if refused is not None:
            self.refused += 1
            await self._json(send, *refused)
            return
        if path == "/internal/tokenizer" and self.tokenizer is not None:
            await self._json(send, 200, {"base_model": self.args.base_model, "base_revision": "stub",
                                         "max_model_len": self.args.max_model_len,
                                         "tokenizer": self.tokenizer.to_dict()})
            return
        if path not in ("/v1/chat/completions", "/v1/completions"):
            await self._json(send, 404, {"error": {"message": "not found"}})
            return
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body = orjson.loads(b"".join(chunks))
        self.requests += 1
        self.inflight += 1
        try:
            await self._complete(body, path, receive, send)
        finally:
            self.inflight -= 1

    async def _complete(self, body: dict[str, Any], path: str, receive: Any, send: Any) -> None:
        ext = body.get("loraplex") or {}
        self.exts.append({"ext": ext, "model": body.get("model"), "stream": body.get("stream", False),
                          "stream_options": body.get("stream_options"), "max_tokens": body.get("max_tokens"),
                          **{k: body[k] for k in ("messages", "tools", "tool_choice", "response_format",
                                                  "temperature") if k in body}})
        adapter = (ext.get("adapter") or {}).get("id") or "base"
        self.adapters[adapter] += 1
        meta = body.get("metadata") or {}
        mode = str(meta.get("stub_mode", self.args.mode))
        delay = float(meta.get("stub_delay", self.args.delay))
        chunk_delay = float(meta.get("stub_chunk_delay", self.args.chunk_delay))
        stall_after = int(meta["stub_stall_after"]) if "stub_stall_after" in meta else None
        progress = float(meta.get("stub_progress", 0)) if body.get("stream") else 0.0
        if mode == "503":
            await self._json(send, 503, {"error": {"message": "overloaded", "type": "overloaded", "code": None}})
            return
        if mode == "load-fail":
            await self._json(send, 503, {"error": {"message": "sha256 mismatch", "type": "server_error",
                                                   "code": "adapter_load_failed"}})
            return
        if mode == "non-finite":
            await self._json(send, 503, {"error": {"message": "adapter x produced non-finite values (NaN/Inf)",
                                                   "type": "server_error", "code": "non_finite_output"}})
            return
        if mode == "500":
            await self._json(send, 500, {"error": {"message": "boom", "type": "server_error", "code": None}})
            return
        if mode == "400":
            await self._json(send, 400, {"error": {"message": "refused", "type": "invalid_request_error",
                                                   "code": "invalid_value"}})
            return
        disconnected = asyncio.Event()

        async def watch() -> None:
            while True:
                m = await receive()
                if m["type"] == "http.disconnect":
                    disconnected.set()
                    return

        watcher = asyncio.create_task(watch()) if (delay or chunk_delay or stall_after is not None) else None

        async def wait(seconds: float) -> bool:
            return await (self._progressing(send, disconnected, seconds, progress) if progress
                          else self._wait(disconnected, seconds))

        try:
            if progress:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream")]})
                await send({"type": "http.response.body", "body": b": accepted\n\n", "more_body": True})
            if delay and await wait(delay):
                self.cancelled += 1
                return
            chat = path.endswith("chat/completions")
            try:
                fields = parse_fields(body, chat=chat)
            except FieldError as exc:
                await self._json(send, 400, {"error": {"message": exc.message, "type": "invalid_request_error",
                                                       "code": exc.code, "param": exc.param}})
                return
            max_tokens = fields.max_tokens or 16
            n_chunks = completion_tokens = min(max_tokens, self.args.chunks)
            prompt_tokens = self._prompt_tokens(fields, body, chat)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens}
            rid = f"cmpl-{self.args.worker_id}-{self.requests}"
            created = int(time.time())
            model = body.get("model", "")
            if not body.get("stream"):
                text = f"ok from {self.args.worker_id}"
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                          if chat else {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None})
                await self._json(send, 200, {
                    "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                    "model": model, "choices": [choice], "usage": usage})
                self.completed += 1
                return
            if not progress:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream")]})
            obj = "chat.completion.chunk" if chat else "text_completion"
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            continuous = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))
            for i in range(n_chunks):
                if chunk_delay and await wait(chunk_delay):
                    self.cancelled += 1
                    return
                if disconnected.is_set():
                    self.cancelled += 1
                    return
                if i == stall_after:  # stalled: sends nothing more, holds the connection open
                    await disconnected.wait()
                    self.cancelled += 1
                    return
                if mode == "break" and i == n_chunks // 2:
                    raise RuntimeError("stub worker: dropping the connection mid-stream")
                piece = f"t{i} "
                last = i == n_chunks - 1
                choice = ({"index": 0, "delta": {"content": piece} if i else {"role": "assistant", "content": piece},
                           "finish_reason": "stop" if last else None}
                          if chat else {"index": 0, "text": piece, "finish_reason": "stop" if last else None,
                                        "logprobs": None})
                chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
                if continuous:
                    chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": i + 1,
                                      "total_tokens": prompt_tokens + i + 1}
                await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(chunk) + b"\n\n",
                            "more_body": True})
            tail = b""
            if include_usage:
                tail += b"data: " + orjson.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                                  "choices": [], "usage": usage}) + b"\n\n"
            tail += b"data: [DONE]\n\n"
            await send({"type": "http.response.body", "body": tail, "more_body": False})
            self.completed += 1
        finally:
            if watcher is not None:
                watcher.cancel()

    def _prompt_tokens(self, fields: Any, body: dict[str, Any], chat: bool) -> int:
        tok = self.tokenizer
        if tok is None:
            return max(1, len(orjson.dumps(body.get("messages") if chat else body.get("prompt"))) // 4)
        if fields.messages is not None:
            return len(tok.encode_chat(fields.messages, add_generation_prompt=True))
        if isinstance(fields.prompt, str):
            return len(tok.encode(fields.prompt))
        return len(fields.prompt)

    @staticmethod
    async def _wait(disconnected: asyncio.Event, seconds: float) -> bool:
        """Sleep; True if the client went away meanwhile."""
        try:
            await asyncio.wait_for(disconnected.wait(), seconds)
            return True
        except TimeoutError:
            return False

    @classmethod
    async def _progressing(cls, send: Any, disconnected: asyncio.Event, seconds: float, every: float) -> bool:
        """Sleep, sending ``: progress`` every ``every`` seconds meanwhile; True if the client went away."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if await cls._wait(disconnected, min(every, left)):
                return True
            if left > every:
                await send({"type": "http.response.body", "body": b": progress\n\n", "more_body": True})
        return False

    async def _json(self, send: Any, status: int, data: Any) -> None:
        raw = orjson.dumps(data)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
        await send({"type": "http.response.body", "body": raw})

    def stats(self) -> dict[str, Any]:
        return {"worker_id": self.args.worker_id, "requests": self.requests, "completed": self.completed,
                "cancelled": self.cancelled, "inflight": self.inflight, "refused": self.refused, "adapters": dict(self.adapters),
                "exts": list(self.exts)}

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                if self.args.redis_url:
                    self._report_task = asyncio.create_task(self._report_loop())
                    await asyncio.sleep(0.05)
                await send({"type": "lifespan.startup.complete"})
                print(f"READY {self.args.port}", flush=True)
            elif msg["type"] == "lifespan.shutdown":
                if self._report_task is not None:
                    self._report_task.cancel()
                    with contextlib.suppress(BaseException):
                        await self._report_task
                await send({"type": "lifespan.shutdown.complete"})
                return


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:

    p = argparse.ArgumentParser(description="stub engine worker for gateway tests and benchmarks")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--worker-id", default="stub")
    p.add_argument("--base-model", default="smol")
    p.add_argument("--redis-url", default="")
    p.add_argument("--redis-prefix", default="loraplex")
    p.add_argument("--device-adapters", default="")
    p.add_argument("--host-adapters", default="")
    p.add_argument("--chunks", type=int, default=5)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--chunk-delay", type=float, default=0.0)
    p.add_argument("--mode", default="ok", choices=["ok", "503", "500", "400", "break", "load-fail", "non-finite"])
    p.add_argument("--tokenizer", default="", help="HF directory, .gguf or served tokenizer .json (exact prompt counts)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--report-interval", type=float, default=0.5)
    p.add_argument("--report-ttl", type=float, default=2.0)
    p.add_argument("--worker-secret", default=os.environ.get("LORAPLEX_WORKER_SECRET", DEV_WORKER_SECRET))
    p.add_argument("--no-secret-check", action="store_true",
                   help="benchmarks only: serve requests without the worker secret (older gateways, other proxies)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    uvicorn.run(Stub(args), host="127.0.0.1", port=args.port, log_level="error", access_log=False,
                lifespan="on", loop="uvloop", http="httptools", timeout_graceful_shutdown=1)


# -- helpers for tests and the benchmark -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StubProcess:
    """Start ``python -m tests.stub_worker`` as a real process and wait until it listens."""

    def __init__(self, worker_id: str, *, redis_url: str = "", redis_prefix: str = "loraplex",
                 base_model: str = "smol", device: tuple[str, ...] = (), host: tuple[str, ...] = (),
                 extra: tuple[str, ...] = (), port: int | None = None) -> None:
        self.worker_id = worker_id
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "tests.stub_worker", "--port", str(self.port), "--worker-id", worker_id,
                    "--base-model", base_model, "--redis-url", redis_url, "--redis-prefix", redis_prefix,
                    "--device-adapters", ",".join(device), "--host-adapters", ",".join(host), *extra]
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout: float = 20.0) -> StubProcess:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(self.cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("READY"):
                break
            if not line and self.proc.poll() is not None:
                break
        # READY comes from the lifespan startup, just before uvicorn binds: wait for the port.
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"stub worker {self.worker_id} did not start")

    def stats(self) -> dict[str, Any]:
        import urllib.request

        with urllib.request.urlopen(self.url + "/stub/stats", timeout=5) as r:
            return json.loads(r.read())

    def kill(self) -> None:
        """Die abruptly (no residency removal), like a crashed worker."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def pause(self) -> None:
        """Hang (``SIGSTOP``): connections are still accepted, nothing is answered, no report is sent."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> StubProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    main()


# -- registry snapshots and an in-thread gateway server for tests ----------------------------------


def make_snapshot(tenants: dict[str, dict[str, Any]], *, version: int = 1, base_model: str = "smol"):  # type: ignore[no-untyped-def]
    """A ``RegistrySnapshot`` from a compact description (see ``gateway.snapshot_file``).

    ``tenants``: slug -> {"bindings": {alias: {"active": (name, version), "canary": ..., ...}}, limits...}
    """
    from gateway.snapshot_file import snapshot_from_dict

    adapters: dict[str, Any] = {}
    out: dict[str, Any] = {}
    for slug, t in tenants.items():
        tb = {}
        for alias, b in t.get("bindings", {}).items():
            d = dict(b)
            for role in ("active", "canary"):
                ref = d.get(role)
                if ref:
                    name, ver = ref
                    vid = f"{name}-v{ver}"
                    adapters[vid] = {"name": name, "version": ver, "base_model": base_model,
                                     "uri": f"file:///adapters/{name}/{ver}", "sha256": "0" * 64, "rank": 8,
                                     "alpha": 16, "status": "ready"}
                    d[role] = vid
            tb[alias] = d
        out[slug] = {k: v for k, v in t.items() if k != "bindings"} | {"bindings": tb}
    return snapshot_from_dict({"version": version, "base_models": {base_model: {"revision": "r1"}},
                               "adapters": adapters, "tenants": out})


class MutableSnapshots(SnapshotSource):
    """The seam between the gateway and the registry in tests: swap ``current`` at will (the other
    hooks are the interface's no-op defaults)."""

    current: Any = None

    def __init__(self, snapshot: Any) -> None:
        self.current = snapshot


class ThreadServer:
    """A real uvicorn server for ``app`` on a loopback port, in a background thread, configured
    as ``loraplex gateway`` serves its public port (``gateway.http_edge``)."""

    def __init__(self, app: Any, port: int | None = None, settings: Any = None) -> None:
        import threading

        import uvicorn

        from gateway.http_edge import gateway_config
        from loraplex.settings import Settings

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = (settings or Settings(gateway_shutdown_grace_s=1.0)).replace(gateway_host="127.0.0.1",
                                                                              gateway_port=self.port)
        self.server = uvicorn.Server(gateway_config(app, settings, log_level="error", loop="asyncio"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gateway server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def mock_worker_transport(record: list[dict[str, Any]] | None = None, *, chunks: int = 5,
                          secret: str = DEV_WORKER_SECRET) -> Any:
    """An ``httpx.MockTransport`` answering like the stub worker, for in-process app tests.

    Each forwarded body is appended to ``record``; a request without ``secret`` gets 401/403.
    """
    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        refused = _secret_refusal(request.headers.get(HDR_WORKER_SECRET, "").encode("latin-1") or None, secret)
        if refused is not None:
            return httpx.Response(refused[0], json=refused[1])
        body = orjson.loads(request.content)
        if record is not None:
            record.append(body)
        chat = request.url.path.endswith("chat/completions")
        ext = body.get("loraplex") or {}
        usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
                      if chat else {"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None})
            return httpx.Response(200, json={"id": "x", "object": "chat.completion", "created": 0,
                                             "model": body.get("model"), "choices": [choice], "usage": usage,
                                             "adapter": (ext.get("adapter") or {}).get("id")})
        out = b""
        for i in range(chunks):
            delta = {"index": 0, "delta": {"content": f"t{i}"}, "finish_reason": None}
            out += b"data: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "created": 0,
                                             "model": body.get("model"), "choices": [delta]}) + b"\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            out += b"data: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "created": 0,
                                             "model": body.get("model"), "choices": [], "usage": usage}) + b"\n\n"
        out += b"data: [DONE]\n\n"
        return httpx.Response(200, content=out, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)
