"""One settings object for every loraplex process, read from ``LORAPLEX_*`` variables.

Field ``foo_bar`` is read from ``LORAPLEX_FOO_BAR``; lists are comma separated. Every field
has an embedded default that runs the whole system on one machine.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

PREFIX = "LORAPLEX_"

DEV_JWT_SECRET = "loraplex-development-secret-change-me-please"
DEV_WORKER_SECRET = "loraplex-internal-secret-change-me"
DEVELOPMENT_SECRETS = {"jwt_secret": DEV_JWT_SECRET, "worker_secret": DEV_WORKER_SECRET}
"""The built-in values of the secret settings: written in this repository, so fit for a laptop only."""


def is_development_secret(name: str, value: str) -> bool:
    """True when setting ``name`` still holds its built-in development value."""
    return name in DEVELOPMENT_SECRETS and value == DEVELOPMENT_SECRETS[name]


def _default_home() -> str:
    return str(Path(os.environ.get("LORAPLEX_HOME", Path.cwd() / ".loraplex")).resolve())


class SettingsError(ValueError):
    """A LORAPLEX_* variable could not be parsed."""


@dataclass(frozen=True)
class Settings:
    # --- where things live -------------------------------------------------------------
    home: str = field(default_factory=_default_home)
    """Working directory for the embedded default (SQLite file, caches, demo model)."""
    database_url: str = ""
    """SQLAlchemy async URL. Empty: ``sqlite+aiosqlite:///{home}/registry.db``."""
    redis_url: str = ""
    """``redis://host:port/db``. Empty: in-process limiter, residency table and fan-out."""
    redis_prefix: str = "loraplex"
    """Namespace for every Redis key and channel (lets several deployments share one Redis)."""
    log_level: str = "INFO"
    """Python logging level of every process (DEBUG, INFO, WARNING, ...)."""
    access_log: str = ""
    """File the gateway appends its access log to: a JSON line per request, what ``loraplex plan`` reads.
    Empty: stderr (``loraplex gateway``, ``serve``), ``{home}/access.log`` (``loraplex demo``)."""

    # --- registry / control plane ------------------------------------------------------
    adapter_root: str = ""
    """Admission refuses adapter paths outside this directory. Empty: ``{home}/adapters``."""
    max_lora_rank: int = 64
    """Highest adapter rank admitted and served (as in vLLM)."""
    max_lora_scale: float = 256.0
    """Highest effective LoRA scale (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA, per module after
    ``alpha_pattern``/``rank_pattern``) admitted and served."""
    max_lora_delta: float = 65504.0
    """Highest possible delta-weight entry (``scale * r * max abs(A) * max abs(B)``) admitted and served;
    the default is float16's largest finite value."""
    max_adapter_bytes: int = 512 * 1024 * 1024
    """Admission refuses adapter files larger than this."""
    allowed_target_modules: tuple[str, ...] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    )
    """Projections an adapter may target; admission refuses others."""
    registry_refresh_s: float = 30.0
    """Safety-net refresh of the reader-side snapshot (changes are pushed sooner); a delta from the
    audit log, so cheap at any registry size."""
    adapter_store: str = ""
    """Where adapter versions are kept, content-addressed by sha256: a local directory, or object storage
    (``s3://bucket/prefix``, ``gs://...``, ``az://...``) with credentials and endpoint from the client's
    standard environment (``AWS_*``). Empty: ``{adapter_root}/store``."""
    adapter_store_timeout_s: float = 30.0
    """Timeout of one store request (a stalled fetch fails only the requests waiting for that adapter)."""
    adapter_store_retries: int = 3
    """Retries of a failed store request (with exponential backoff)."""
    adapter_retention_s: float = 7 * 86400.0
    """``loraplex admin gc`` deletes a version's files once no binding has referenced it for this long."""
    registry_stall_s: float = 15.0
    """A snapshot load fails when the database sends nothing for this long (there is no limit on a
    load that keeps receiving rows: a large registry is never cut off by design)."""
    registry_max_staleness_s: float = 0.0
    """Readiness fails while the held snapshot has not been confirmed current for this long
    (refreshes failing); 0 disables the check. Requests are still served from it."""

    # --- auth ----------------------------------------------------------------------------
    jwt_secret: str = DEV_JWT_SECRET
    """HS256 shared secret. Change it anywhere but a laptop."""
    jwt_public_key_file: str = ""
    """PEM public key for RS256/ES256 tokens."""
    jwt_jwks_file: str = ""
    """JWKS file with public keys (selected by ``kid``)."""
    jwt_algorithms: tuple[str, ...] = ("HS256",)
    """Accepted JWT algorithms (allow-list; ``none`` is never accepted)."""
    jwt_issuer: str = "loraplex"
    """Required ``iss`` claim."""
    jwt_audience: str = "loraplex"
    """Required ``aud`` claim."""
    jwt_leeway_s: float = 5.0
    """Clock skew tolerated on ``exp``/``nbf``/``iat``."""
    jwt_tenant_claim: str = "tenant"
    """Claim that names the caller's tenant."""
    jwt_scope_claim: str = "scope"
    """Claim with space-separated scopes."""
    jwt_admin_scope: str = "loraplex:admin"
    """Scope required by the admin API."""
    allow_dev_secrets: bool = False
    """Let ``gateway``, ``worker``, ``serve`` and ``demo`` listen on a non-loopback address while a secret
    they use is still its built-in development value (never in production)."""

    # --- gateway -------------------------------------------------------------------------
    gateway_host: str = "127.0.0.1"
    """Gateway listen address."""
    gateway_port: int = 8000
    """Gateway listen port."""
    max_body_bytes: int = 1024 * 1024
    """Request bodies larger than this are refused with 413."""
    max_tokens_cap: int = 8192
    """Largest ``max_tokens`` a request may ask for (above: 400)."""
    response_retention_s: int = 30 * 86400
    """How long a stored Response (``POST /v1/responses`` with ``store``) is kept for tenants without a
    retention of their own; expired ones are removed in the background."""
    response_max_retention_s: int = 90 * 86400
    """The longest any tenant's stored Responses are kept."""
    response_max_chain: int = 100
    """Responses one ``previous_response_id`` chain may hold; a longer one is refused (400)."""
    usage_flush_interval_s: float = 10.0
    """How often the gateway writes its usage ledger buckets (per minute, tenant, alias, version, outcome) to the
    registry database. A killed gateway loses at most this much usage; SIGTERM writes it first. 0: no ledger."""
    usage_max_pending_buckets: int = 100_000
    """Ledger buckets a gateway keeps while the database is unreachable; beyond it the oldest are dropped and counted
    (``loraplex_gateway_usage_dropped_buckets``)."""
    usage_minute_retention_days: int = 7
    """Per-minute usage rows are kept this long (once rolled up into hours)."""
    usage_hour_retention_days: int = 90
    """Per-hour usage rows are kept this long (once rolled up into days; days are kept)."""
    default_max_tokens: int = 1024
    """``max_tokens`` filled in (and reserved against the tokens/min limit) when a request omits it,
    capped by the context room and what the tenant's tokens/min allows."""
    registry_snapshot_file: str = ""
    """Static registry snapshot (JSON) served instead of the live registry; for tests and benchmarks."""
    request_timeout_s: float = 300.0
    """Per-request deadline at the gateway (504 when exceeded)."""
    gateway_head_timeout_s: float = 10.0
    """A request head must arrive in full within this (from the connection's start or its first byte; 408)."""
    gateway_body_timeout_s: float = 30.0
    """A request body must arrive in full within this after its head (408)."""
    gateway_shutdown_grace_s: float = 30.0
    """On SIGTERM, running requests get this long to finish; then they are answered 503 (streams: an error event)."""
    gateway_metrics_host: str = "127.0.0.1"
    """Listen address of the internal metrics port (``0.0.0.0`` where Prometheus scrapes from another host)."""
    gateway_metrics_port: int = 9100
    """Internal port serving ``/metrics`` (never the public port). 0: no metrics port."""
    ratelimit_fail_mode: Literal["open", "closed"] = "open"
    """While Redis is unreachable: ``open`` (each replica admits its share, 1/N of each limit, N the gateways it
    last saw in Redis) or ``closed`` (503)."""
    ratelimit_lease_ttl_s: float = 10.0
    """A concurrency slot's lease lapses this long after its gateway last renewed it (every third of it): a
    killed gateway's slots are free again within this. Also how long a gateway counts as live after its last
    heartbeat, and the most a concurrency 429's ``retry-after`` says."""
    route_candidates: int = 3
    """Consistent-hash ring candidates per adapter version (2-3)."""
    route_load_factor: float = 1.5
    """Bounded load: a candidate is skipped above this multiple of the mean load (+1)."""
    worker_report_ttl_s: float = 3.0
    """A worker that has not reported for this long leaves the ring, and is never chosen (checked per request)."""
    worker_first_byte_timeout_s: float = 10.0
    """A worker must send a streamed answer's first chunk within this, plus ``worker_first_byte_per_queued_s`` per
    request it has queued; else the request, which has sent the client nothing yet, goes to the next candidate (at
    once when the worker stops reporting). A whole answer (sent only when done) waits past it while its worker keeps
    reporting (or has no reports: a static URL), and so does the last candidate."""
    worker_first_byte_per_queued_s: float = 0.5
    """Added to ``worker_first_byte_timeout_s`` per request the worker reports queued."""
    worker_stall_timeout_s: float = 20.0
    """A started stream whose worker sends nothing for this long (or stops reporting) ends with an ``upstream_stalled``
    error event. SSE comments count (a worker's ``: progress``: ``worker_progress_interval_s``); a vLLM worker's
    stream, which sends none, ends only when the worker stops reporting."""
    worker_eject_failures: int = 3
    """Consecutive failures (connect errors, worker 5xx, first-byte timeouts, stalls) that eject a worker."""
    worker_eject_base_s: float = 5.0
    """A worker's first ejection lasts this long; each ejection in a row doubles it."""
    worker_eject_max_s: float = 120.0
    """The longest ejection."""
    worker_urls: tuple[str, ...] = ()
    """Static worker list (besides the ones that report themselves)."""
    gateway_mount_admin: bool = True
    """Serve the registry admin API under ``/admin`` on the gateway (the embedded default). Set false
    where ``loraplex admin-api`` serves it in a process of its own, off the request path's loop."""
    admin_api_host: str = "127.0.0.1"
    """Listen address of ``loraplex admin-api``."""
    admin_api_port: int = 8001
    """Listen port of ``loraplex admin-api``."""
    admin_url: str = ""
    """Where ``loraplex admin`` sends requests. Empty: ``http://{gateway_host}:{gateway_port}``."""
    admin_token: str = ""
    """JWT the CLI sends. Empty: the CLI mints an admin token from ``jwt_secret``."""
    usage_query_max_rows: int = 200_000
    """Most results one page of ``GET /admin/usage`` or ``/v1/usage`` may hold (buckets times groups); a
    page that would hold more is refused (400) with what to narrow."""

    # --- engine worker -------------------------------------------------------------------
    model: str = ""
    """HF directory (config.json + safetensors) or a .gguf file. Empty: the demo model."""
    model_name: str = ""
    """Name the base model is served and registered as. Empty: derived from the model."""
    worker_id: str = ""
    """Stable worker id in reports and routing. Empty: derived from host and port."""
    worker_host: str = "127.0.0.1"
    """Worker listen address."""
    worker_port: int = 8100
    """Worker listen port."""
    worker_url: str = ""
    """URL the gateway should use to reach this worker. Empty: from host and port."""
    worker_secret: str = DEV_WORKER_SECRET
    """Shared secret the gateway sends (``x-loraplex-worker-secret``) on every worker request; workers
    refuse every route but ``/health`` and ``/metrics`` without it. Set the same value on gateways and
    workers."""
    worker_progress_interval_s: float = 5.0
    """A worker's stream sends an SSE comment (``: accepted``) once the engine has taken the request, and while
    it has nothing else to send, a ``: progress`` comment after this many quiet seconds if the engine completed
    a step since it last sent anything (a stuck engine sends none). Keep it well under the gateway's
    ``worker_stall_timeout_s``, which such a comment resets."""
    device: str = "auto"
    """``auto`` (CUDA when available), ``cpu`` or ``cuda[:N]``."""
    dtype: str = "auto"
    """``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``, ``bfloat16`` or ``float16``."""
    weights: str = "auto"
    """The base model's projection weights: ``auto`` (under float32 activations on CPU, by CPU as vLLM-CPU's
    default dtype, said in the worker's start-up line and ``/health``: bfloat16 where the CPU multiplies it
    natively (AMX or AVX512-BF16), else float32; elsewhere in ``dtype``), ``float32`` (the float32 path),
    ``bfloat16`` (bfloat16 matrices under
    float32 activations: half the memory and, on CPUs with AVX512-BF16 or AMX, about twice the matmul rate),
    ``int8`` (CPU, float32 activations: 8-bit blocks of 32 with a scale each, llama.cpp's Q8_0, about a
    quarter of float32's bytes; GGUF Q8_0 tensors are used as stored; fastest with AVX512-VNNI) or ``int4``
    (the same with 4-bit blocks of 32 with a scale and an offset each, GGUF Q4_1's form, under a fifth of
    float32's bytes; GGUF Q4_0/Q4_1 tensors are used as stored, Q8_0 ones stay 8-bit; fastest with AVX512-VNNI,
    and on AVX2-only CPUs faster than float32). Either way the LoRA
    math, attention and norms stay float32 and adapters' A/B are held in bfloat16; under ``int8`` and
    ``int4`` the embedding table is not quantized (bfloat16 on CPUs with AVX512-BF16 or AMX, else float32)
    and the LM head reads it, except on CPUs with AVX512-VNNI but no AMX, where it is held in 8 bits (Q8_0)
    too; the KV cache follows ``kv_cache_dtype``."""
    kv_cache_dtype: str = "auto"
    """The KV cache's dtype: ``auto`` (bfloat16 when ``weights`` is bfloat16, int8 or int4 on CPU under float32 activations,
    else ``dtype``), ``float32`` or ``bfloat16`` (K/V rounded to bfloat16 on write, widened to float32 for the
    attention math: half the bytes per token, so twice the tokens in ``kv_cache_bytes`` and half the bytes decode
    attention streams)."""
    threads: int = 0
    """torch intra-op threads (0: torch default)."""
    kv_cache_bytes: int = 0
    """Memory budget of the paged KV cache (sets the number of blocks); 0: sized from the machine, 40% of the
    memory available after the weights up to 4 GiB on CPU, 80% of the device's free memory on CUDA (the start-up
    line says which)."""
    kv_block_size: int = 16
    """Tokens per KV cache block."""
    prefix_cache: bool = True
    """Reuse the KV blocks of earlier prompts with the same prefix, the same adapter version and the same tenant
    cache scope (docs/DESIGN.md, "Prefix cache")."""
    max_num_seqs: int = 32
    """Most sequences running in one batch."""
    max_num_batched_tokens: int = 512
    """Token budget of one engine step (prefill chunks + decode rows)."""
    burst_batched_tokens: int = -1
    """Token budget of a step while the waiting prompts hold more tokens than
    ``max_num_batched_tokens`` (a burst: fewer, larger prefill steps); 0: no wider; -1: by device
    (4096 on CPUs with AMX and on CUDA, where larger matmuls run faster per token; else 0)."""
    idle_gather_ms: float = 5.0
    """Woken from idle by a request, the engine waits until no other request has arrived for
    this long (at most 5 times it in all, and no longer once the waiting prompts fill a step)
    before its first step, so that a burst arriving over a few milliseconds shares a full first
    step instead of waiting behind a step of one prompt; 0: step at once."""
    max_waiting: int = 256
    """Bounded waiting queue; a full queue answers 503."""
    canary_judge_interval_s: float = 1.0
    """How often the canary judge (in every gateway with the admin API; one acts at a time) looks at the
    bindings with a canary policy; 0: this gateway never judges."""
    grammar_compile_threads: int = 1
    """Threads compiling ``response_format`` grammars, at the lowest CPU priority; a tenant compiles one
    schema at a time (``engine.grammar``)."""
    grammar_compile_budget_s: float = 5.0
    """CPU seconds one grammar compile may take; past it the request is refused 400
    ``response_format_too_complex`` and the schema is remembered as too complex."""
    max_model_len: int = 0
    """0: the model's own context length."""
    native_kernels: bool = True
    """CPU float32: decode attention, multi-LoRA, single-row matmuls and fused layer steps in C (``engine/csrc``,
    built on first use with the system compiler into ``~/.cache/loraplex/kernels``); false, or
    no compiler: pure torch."""
    max_loras: int = 8
    """Distinct adapters in one batch (device slots), as in vLLM."""
    max_cpu_loras: int = 64
    """Adapters kept in host memory (LRU), as in vLLM."""
    lora_rank_classes: tuple[int, ...] = (8, 16, 32, 64)
    """Device slot rank classes; an adapter takes the smallest class >= its rank."""
    adapter_cache_dir: str = ""
    """Local disk tier for adapters fetched from URLs. Empty: ``{home}/adapter-cache``."""
    adapter_cache_max_bytes: int = 10 * 1024**3
    """Byte budget of the adapter disk tier: least recently used versions are deleted (and
    fetched again when next needed). 0: unbounded."""
    adapter_sources: tuple[str, ...] = ()
    """URI prefixes a worker may fetch adapters from (``file:///srv/adapters/``, ``https://store.internal/v1/``);
    anything else is refused before it is opened or connected to. Empty: the adapter root only."""
    preload_adapters: tuple[str, ...] = ()
    """Adapters a worker loads at start: ``ID=URI`` or ``ID=URI#sha256`` entries."""
    pin_adapters: tuple[str, ...] = ()
    """Adapters a worker pins at start: entries like ``preload_adapters`` or ids from it."""
    preload_top_n: int = 0
    """With Redis and no ``preload_adapters``: warm the N adapters with most recent traffic."""
    lora_max_wait_steps: int = 64
    """Aging bound: a request waiting this many steps for a cold adapter may evict an idle one."""
    lora_max_wait_s: float = 5.0
    """Aging bound in seconds (whichever of the two comes first)."""
    report_interval_s: float = 1.0
    """How often a worker publishes its residency/load report."""

    # --- derived -------------------------------------------------------------------------
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite+aiosqlite:///{self.home}/registry.db"

    def resolved_adapter_root(self) -> str:
        return self.adapter_root or str(Path(self.home) / "adapters")

    def resolved_adapter_store(self) -> str:
        return self.adapter_store or str(Path(self.resolved_adapter_root()) / "store")

    def resolved_adapter_sources(self) -> tuple[str, ...]:
        if self.adapter_sources:
            return self.adapter_sources
        root = (Path(self.resolved_adapter_root()).resolve().as_uri().rstrip("/") + "/",)
        store = self.resolved_adapter_store()
        store = store.rstrip("/") + "/" if "://" in store else Path(store).resolve().as_uri().rstrip("/") + "/"
        return root if store.startswith(root[0]) else (*root, store)

    def resolved_adapter_cache_dir(self) -> str:
        return self.adapter_cache_dir or str(Path(self.home) / "adapter-cache")

    def resolved_worker_url(self) -> str:
        return self.worker_url or f"http://{self.worker_host}:{self.worker_port}"

    def resolved_admin_url(self) -> str:
        return self.admin_url or f"http://{self.gateway_host}:{self.gateway_port}"

    @property
    def embedded(self) -> bool:
        """True when no Redis is configured: in-process limiter, residency and fan-out."""
        return not self.redis_url

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: typing.Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if environ is None else environ
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            key = PREFIX + f.name.upper()
            if key in env:
                values[f.name] = _parse(key, env[key], hints[f.name])
        values.update(overrides)
        return cls(**values)


def _parse(key: str, raw: str, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    try:
        if hint is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(f"not a boolean: {raw!r}")
        if hint is int:
            return int(raw)
        if hint is float:
            return float(raw)
        if origin is tuple:
            (item, _ellipsis) = typing.get_args(hint)
            parts = [p.strip() for p in raw.split(",") if p.strip()]
            return tuple(_parse(key, p, item) for p in parts)
        if origin is Literal:
            allowed = typing.get_args(hint)
            if raw not in allowed:
                raise ValueError(f"must be one of {', '.join(allowed)}")
            return raw
        if hint is str or isinstance(hint, types.UnionType):
            return raw
    except ValueError as exc:
        raise SettingsError(f"{key}={raw!r}: {exc}") from None
    return raw


def get_settings() -> Settings:
    """Settings from the environment (each process reads them once at start)."""
    return Settings.from_env()
