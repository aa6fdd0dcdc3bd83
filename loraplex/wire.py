"""Wire types shared by the gateway and the engine workers (docs/DESIGN.md, "The wire contract").

The worker request extension (``WorkerRequestExt``), the residency report (``WorkerReport``),
the OpenAI error body and the headers both sides set: plain JSON-able dataclasses whose
``to_dict``/``from_dict`` are the codec.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any, Self

from loraplex.digest import is_digest

EXT_KEY = "loraplex"
"""Key of the gateway's extension object in the body forwarded to a worker."""

# Response headers.
HDR_REQUEST_ID = "x-request-id"
HDR_ADAPTER = "x-loraplex-adapter"
"""``name@version`` of the adapter that answered, or ``base`` for the base model."""
HDR_WORKER = "x-loraplex-worker"
HDR_CACHE = "x-loraplex-cache"
"""A worker's answer: where the request's adapter was when it arrived: ``warm`` (device or host
memory), ``cold`` (it had to be loaded) or ``base`` (no adapter)."""
HDR_WORKER_SECRET = "x-loraplex-worker-secret"
"""Request header with ``settings.worker_secret``: the gateway sends it on every worker request,
and workers trust the ``"loraplex"`` extension (or serve any route but ``/health``, ``/metrics``)
only with it."""

BACKEND_LORAPLEX = "loraplex"
BACKEND_VLLM = "vllm"
"""``WorkerReport.backend``: the bundled engine, or a vLLM OpenAI server fronted by ``loraplex vllm-agent``."""

PRIORITY_CLASSES: dict[str, int] = {"high": 0, "normal": 1, "low": 2}
"""Tenant priority class -> admission order on the worker (lower is served first)."""


def error_body(message: str, type: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape: ``{"error": {"message", "type", "code", "param"}}``."""
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


class _Codec:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_json(cls, raw: str | bytes) -> Self:
        return cls.from_dict(json.loads(raw))


@dataclass(frozen=True)
class AdapterRef(_Codec):
    """One immutable adapter version, as the worker needs it to load and cache it.

    ``id`` is the registry's stable version id: the engine's cache key and the
    routing key. ``name`` (``alias-or-adapter@version``) is for logs and headers only.
    ``sha256`` is the version digest (``loraplex.digest``) the worker checks before loading;
    a ref from a gateway always carries it.
    """

    id: str
    name: str
    uri: str
    sha256: str | None = None
    rank: int = 0
    base_revision: str = ""
    """The base model revision the version was admitted against; a worker serving another revision
    refuses to load it (empty: not checked)."""


@dataclass(frozen=True)
class WorkerRequestExt(_Codec):
    """What the gateway adds to an OpenAI request body under ``EXT_KEY``."""

    adapter: AdapterRef | None = None
    tenant: str = ""
    priority: int = PRIORITY_CLASSES["normal"]
    request_id: str = ""
    cache_scope: str = ""
    """The tenant's prefix-cache scope (``loraplex.prefix``: ``tenant:<slug>`` or ``shared:<name>``),
    from the registry; empty: the worker scopes by ``tenant``."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerRequestExt:
        adapter = data.get("adapter")
        ref = AdapterRef.from_dict(adapter) if adapter else None
        if ref is not None and not is_digest(ref.sha256):
            raise ValueError("adapter.sha256 must be the adapter version's 64-hex digest")
        return cls(
            adapter=ref,
            tenant=str(data.get("tenant", "")),
            priority=int(data.get("priority", PRIORITY_CLASSES["normal"])),
            request_id=str(data.get("request_id", "")),
            cache_scope=str(data.get("cache_scope", "")),
        )


@dataclass
class WorkerReport(_Codec):
    """Residency and load, published by each worker every ``report_interval_s``."""

    worker_id: str
    url: str
    base_model: str
    base_revision: str
    device_adapters: list[str] = field(default_factory=list)
    """Adapter version ids in device slots (warmest)."""
    host_adapters: list[str] = field(default_factory=list)
    """Adapter version ids in host memory."""
    disk_adapters: list[str] = field(default_factory=list)
    queue_depth: int = 0
    running: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    max_num_seqs: int = 0
    max_loras: int = 0
    cached_kv_blocks: int = 0
    """KV blocks that hold a finished or running request's prefix, reusable by a later one."""
    kv_evictions: int = 0
    """Cached blocks given to other requests since the worker started (a counter)."""
    timestamp: float = field(default_factory=time.time)
    backend: str = BACKEND_LORAPLEX
    """Which server answers at ``url``; reports without the field are from bundled workers."""
    control_url: str = ""
    """Where the control API (``/internal/...``) answers; empty: at ``url``. For a vLLM worker,
    ``url`` is vLLM's (completions) and this is its agent's."""
    served_model: str = ""
    """vLLM's name of the base model: the ``model`` of a request without an adapter."""

    @property
    def load(self) -> int:
        """Requests this worker is busy with (running + queued)."""
        return self.running + self.queue_depth
