"""The engine: model + paged KV cache + scheduler + sampler, stepped by one thread.

Start one programmatically::

    engine = Engine.from_settings(settings)   # loads the model (demo model if settings.model == "")
    engine.start()                            # background stepping thread
    seq = engine.add_request(prompt_ids, SamplingParams(max_tokens=32), listener=callback)
    ...
    engine.stop()

or, without a thread (tests, benchmarks): ``engine.generate([ids, ...], params)``.

``add_request`` / ``abort`` may be called from any thread; listeners are called on the
engine thread with a ``SeqEvent`` per sampled token (and one final event).

LoRA plugs in through two attributes: ``engine.lora_runtime`` (an
``engine.lora.runtime.LoRARuntime``, whose ``prepare_batch(ctx)`` sets ``ctx.lora`` before
each forward and whose ``release(seq)`` gives back a leaving sequence's slot) and
``engine.scheduler.policy`` (an ``engine.scheduler.AdmissionPolicy``, adapter-aware, which
must admit adapter sequences through the runtime's ``admit``: that is where a sequence's slot
is taken, and a step fails the rows of a sequence that arrives without one). With
``lora_runtime`` unset the worker API refuses requests naming an adapter.
``Engine.from_settings`` plugs in both (``enable_lora``) unless ``max_loras`` is 0, with
``engine.admission_policy.FairAdmission`` as the policy (priority, tenant fairness, adapter
residency and aging).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.cpu import BURST_TOKENS_AMX, default_burst_tokens, default_weights
from engine.detokenizer import IncrementalDecoder
from engine.grammar import Grammars
from engine.kv_budget import resolve_kv_cache_bytes
from engine.kv_cache import KVCache
from engine.loader import gguf_reader, load_weights
from engine.model import DecoderModel
from engine.native import RowScan
from engine.quant import INT4, QUANTIZED
from engine.sampler import sample, token_logprobs
from engine.scheduler import QueueFullError, Scheduler
from engine.sequence import SamplingParams, SeqEvent, SeqStatus, Sequence, TokenLogprob
from engine.step_batch import BatchContext, build_batch
from engine.stopping import release_text, token_finish
from engine.threads import release_team
from loraplex.prefix import namespace, tenant_scope
from loraplex.settings import Settings
from loraplex.tokenizer import TextTokenizer
from loraplex.wire import PRIORITY_CLASSES, AdapterRef

if TYPE_CHECKING:
    from engine.lora.runtime import LoRARuntime
    from engine.metrics import WorkerMetrics
    from loraplex.modelinfo import ModelInfo

log = logging.getLogger("loraplex.engine")


class PromptTooLongError(ValueError):
    pass


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    dtype: str = "float32"
    weights: str = ""
    """``""`` (the library's default: in the activations' dtype, the exact path); ``auto`` (the worker's:
    this CPU's fastest format, ``engine.cpu.default_weights``), ``float32``, ``bfloat16``, ``int8`` or
    ``int4``: ``resolve_weights``."""
    kv_cache_dtype: str = "auto"
    kv_cache_bytes: int = 256 * 1024 * 1024
    """The KV pool's bytes; 0: sized from the machine (``engine.kv_budget.auto_kv_cache_bytes``)."""
    kv_block_size: int = 16
    prefix_cache: bool = True
    """Keep computed prompt blocks for later requests of the same namespace (``engine.scheduler``)."""
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    burst_batched_tokens: int = 0
    """A step's token budget while a burst of prompts waits (``engine.scheduler``); 0: no wider;
    negative: this device's default (``engine.cpu.default_burst_tokens`` on CPU, 4096 on CUDA)."""
    idle_gather_ms: float = 0.0
    """Woken from idle by a request, the engine thread waits until no other has arrived for this
    long (at most 5 times it in all, and no longer once the waiting prompts fill a step) before
    its first step: see ``Engine._gather_arrivals``. 0: it steps at once."""
    max_waiting: int = 256
    max_model_len: int = 0
    native_kernels: bool = True
    grammar_compile_threads: int = 1
    grammar_compile_budget_s: float = 5.0


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_BLOCK_WEIGHTS = {"int8": torch.int8, "int4": INT4}
"""``weights`` settings whose projections are ``engine.quant`` blocks, and their ``matmul_dtype``."""


_ALLOCATOR_TUNED = False


def tune_cpu_allocator() -> None:
    """Keep large freed blocks in the heap (glibc): a forward pass allocates multi-megabyte
    temporaries every layer, and handing them back to the OS each time costs page faults
    on every reuse. Process-wide and idempotent; a no-op where glibc's ``mallopt`` is missing."""
    global _ALLOCATOR_TUNED
    if _ALLOCATOR_TUNED:
        return
    _ALLOCATOR_TUNED = True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 256 * 1024 * 1024)  # M_MMAP_THRESHOLD: no mmap for temporaries
        libc.mallopt(-1, 1024 * 1024 * 1024)  # M_TRIM_THRESHOLD: do not trim the heap top
    except (OSError, AttributeError):
        pass


def settle_after_load() -> int:
    """Once a server process has loaded its model, for good: drop the cached GGUF readers, hand
    the loader's freed temporaries back to the OS (glibc's ``malloc_trim``; the trim threshold
    :func:`tune_cpu_allocator` sets keeps them otherwise), and freeze what is left out of the
    collector's view (``gc.freeze``), so a full collection never walks the model's, tokenizer's
    and modules' objects: on the demo that walk paused the engine and the event loop for about
    200 ms. The process's resident bytes afterwards. Not for processes that load and drop
    engines (tests): frozen objects are never collected."""
    import ctypes
    import gc

    from engine.loader import release_readers

    release_readers()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    gc.freeze()
    return resident_bytes()


def resident_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``; 0 where there is none)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def resolve_device(device: str) -> torch.device:
    if device in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype in ("", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (use float32, bfloat16 or float16)")
    return _DTYPES[dtype]


def burst_tokens(setting: int, device: torch.device) -> int:
    """``burst_batched_tokens`` as the scheduler takes it (a negative setting: the device's default)."""
    if setting >= 0:
        return setting
    return default_burst_tokens() if device.type == "cpu" else BURST_TOKENS_AMX


def resolve_weights(weights: str, dtype: torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """The projection weights' dtype: ``""`` is the activations' ``dtype`` (the exact path);
    ``auto`` is this CPU's fastest format under float32 activations on a CPU ``device``
    (``engine.cpu.default_weights``), else the activations' ``dtype``; ``float32`` the float32 path; ``bfloat16`` also under float32 activations;
    ``int8`` (8-bit blocks, ``engine.quant``) and ``int4`` (4-bit blocks: ``engine.quant.INT4``)
    under float32 activations only (the LoRA branch stays in the activations' dtype)."""
    if weights == "":
        return dtype
    if weights == "auto":
        if device is None or device.type != "cpu" or dtype != torch.float32:
            return dtype
        weights = default_weights()[0]
    if weights in _BLOCK_WEIGHTS:
        if dtype != torch.float32:
            raise ValueError(f"{weights} weights need float32 activations, not {str(dtype).removeprefix('torch.')}")
        return _BLOCK_WEIGHTS[weights]
    if weights not in _DTYPES:
        raise ValueError(f"unknown weights {weights!r} (use auto, bfloat16, int8 or int4)")
    mm = _DTYPES[weights]
    if mm != dtype and not (mm == torch.bfloat16 and dtype == torch.float32):
        raise ValueError(f"weights {weights!r} under {str(dtype).removeprefix('torch.')} activations "
                         "(bfloat16 weights need float32 or bfloat16 activations)")
    return mm


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, matmul_dtype: torch.dtype,
                           device: torch.device) -> torch.dtype:
    """The KV cache's dtype: ``auto`` is bfloat16 where the base's matrices are narrower than
    float32 (bfloat16, int8 or int4) under float32 activations on CPU (half the bytes per cached
    token: twice the tokens in the same memory, half the bytes decode attention streams), else the
    activations' ``dtype``; ``bfloat16`` also under float32 activations (K/V rounded on write,
    widened for the attention math)."""
    if kv_cache_dtype in ("", "auto"):
        narrow = matmul_dtype != torch.float32 and dtype == torch.float32 and device.type == "cpu"
        return torch.bfloat16 if narrow else dtype
    kv = _DTYPES.get(kv_cache_dtype)
    if kv not in (torch.float32, torch.bfloat16):
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r} (use auto, float32 or bfloat16)")
    if kv != dtype and not (kv == torch.bfloat16 and dtype == torch.float32):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} under {str(dtype).removeprefix('torch.')} "
                         "activations (a KV cache is in the activations' dtype or bfloat16 under float32)")
    return kv


class Engine:
    def __init__(self, model: DecoderModel, tokenizer: TextTokenizer, config: EngineConfig,
                 model_path: str | Path | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model_path = str(model_path) if model_path else ""
        cfg = model.cfg
        limit = cfg.context_length
        self.max_model_len = min(config.max_model_len, limit) if config.max_model_len > 0 else limit
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, model.dtype, model.matmul_dtype, model.device)
        self.kv_cache_bytes, self.kv_reason = resolve_kv_cache_bytes(config.kv_cache_bytes, model.device)
        self.cache = KVCache.from_bytes(cfg, self.kv_cache_bytes, config.kv_block_size, model.device,
                                        kv_dtype, model.dtype)
        self.scheduler = Scheduler(self.cache.allocator, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   burst_batched_tokens=burst_tokens(config.burst_batched_tokens, model.device),
                                   max_waiting=config.max_waiting, prefix_cache=config.prefix_cache)
        eos = set(cfg.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.grammars = Grammars(tokenizer, cfg.vocab_size, sorted(eos), compile_threads=config.grammar_compile_threads,
                                 budget_s=config.grammar_compile_budget_s)
        self.mask_s = 0.0
        """Seconds spent filling grammar masks (on the grammar thread, beside the forward)."""
        self.lora_runtime: LoRARuntime | None = None
        self.metrics: WorkerMetrics | None = None
        """The worker's metrics, once its API attaches them."""
        self.info: ModelInfo | None = None
        """The base model's description (from settings, or once LoRA is enabled)."""
        self.weights_reason = ""
        """Why the base weights are in their format (``weights=auto``: the CPU's fastest; else as set)."""
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._arrivals = 0
        """Requests queued so far (``_gather_arrivals`` watches it move)."""
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._in_forward: frozenset[int] = frozenset()
        """Sequences of the step whose forward is running (their adapter slots must stay)."""
        self._release_after_forward: list[Sequence] = []
        self.steps = 0
        """Steps completed, only ever growing: a quiet stream's progress comments follow it (``engine.api``)."""
        self.last_step_s = 0.0
        self.fault: str | None = None
        """Set while base-model rows come out non-finite (the worker itself is unwell)."""

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_path(cls, path: str | Path, config: EngineConfig | None = None) -> Engine:
        config = config or EngineConfig()
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        if device.type == "cpu":
            tune_cpu_allocator()
        matmul_dtype = resolve_weights(config.weights, dtype, device)
        weights = load_weights(path, keep_q8_0=matmul_dtype in QUANTIZED, keep_q4=matmul_dtype == INT4)
        cfg = weights.config
        limit = cfg.context_length
        max_len = min(config.max_model_len, limit) if config.max_model_len > 0 else limit
        model = DecoderModel(weights, device, dtype, max_len, pack_batch=config.max_num_seqs,
                             native_kernels=config.native_kernels, matmul_dtype=matmul_dtype)
        reader = gguf_reader(path) if str(path).endswith(".gguf") else None  # shared with the weights
        tok = TextTokenizer.from_model_path(path, reader)
        engine = cls(model, tok, config, model_path=path)
        if config.weights == "auto":
            engine.weights_reason = f"auto: {default_weights()[1]}" \
                if device.type == "cpu" and dtype == torch.float32 else f"auto: the activations' dtype on {device.type}"
        else:
            engine.weights_reason = f"weights={config.weights}" if config.weights else "the activations' dtype"
        release_team()  # loading ran parallel ops here: this thread's team would slow the engine's
        return engine

    @classmethod
    def from_settings(cls, settings: Settings) -> Engine:
        """Load the model ``settings.model`` names (the demo model when empty)."""
        from engine.fetch_demo import fetch_demo
        from loraplex.modelinfo import describe_model

        if settings.threads > 0:
            torch.set_num_threads(settings.threads)
        path = settings.model or str(fetch_demo(settings))
        config = EngineConfig(
            device=settings.device, dtype=settings.dtype, weights=settings.weights,
            kv_cache_dtype=settings.kv_cache_dtype, kv_cache_bytes=settings.kv_cache_bytes,
            kv_block_size=settings.kv_block_size, prefix_cache=settings.prefix_cache,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            burst_batched_tokens=settings.burst_batched_tokens, idle_gather_ms=settings.idle_gather_ms,
            max_waiting=settings.max_waiting,
            max_model_len=settings.max_model_len, native_kernels=settings.native_kernels,
            grammar_compile_threads=settings.grammar_compile_threads,
            grammar_compile_budget_s=settings.grammar_compile_budget_s)
        engine = cls.from_path(path, config)
        engine.info = describe_model(path, name=settings.model_name or None, shape=engine.model.cfg)
        if settings.max_loras > 0:
            engine.enable_lora(settings)
        else:
            from engine.admission_policy import FairAdmission

            engine.scheduler.policy = FairAdmission(None)
        release_team()
        return engine

    def enable_lora(self, settings: Settings, **manager_kw: Any) -> None:
        """Build the adapter manager + runtime from settings and plug them in."""
        from engine.admission_policy import FairAdmission
        from engine.lora.manager import AdapterManager
        from engine.lora.runtime import LoRARuntime
        from loraplex.modelinfo import describe_model

        if self.info is None:
            self.info = describe_model(self.model_path, name=settings.model_name or None, shape=self.model.cfg)
        manager = AdapterManager.from_settings(settings, self.info, dtype=self.model.dtype, device=self.model.device,
                                               slot_weights_dtype=self.model.lora_weights_dtype, **manager_kw)
        self.lora_runtime = LoRARuntime(manager, native=self.config.native_kernels)
        self.scheduler.policy = FairAdmission(self.lora_runtime, max_wait_steps=settings.lora_max_wait_steps,
                                              max_wait_s=settings.lora_max_wait_s)

    def close(self) -> None:
        """Stop the thread, the grammar thread and the adapter loaders."""
        self.stop()
        self.grammars.close()
        rt = self.lora_runtime
        if rt is not None:
            rt.manager.close()

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, adapter: AdapterRef | None = None,
                    tenant: str = "", priority: int = PRIORITY_CLASSES["normal"], request_id: str = "",
                    listener: Callable[[SeqEvent], None] | None = None, grammar: Any = None,
                    cache_scope: str = "") -> Sequence:
        """Queue a request. Raises ``PromptTooLongError`` or ``scheduler.QueueFullError``.

        With ``params.n`` > 1 the request is ``n`` sequences (the samples, ``index`` 0..n-1, sample
        ``i`` seeded ``seed + i``), listed in the returned first sample's ``samples``; the others
        start from its prompt KV blocks (``engine.scheduler``). Abort each of them to stop it.

        ``grammar``: ``params.grammar`` compiled (``Grammars.prepare``); without it the grammar
        is compiled here, on the calling thread.

        ``cache_scope``: whose cached prompt blocks the request may reuse and add to
        (``loraplex.prefix``; the gateway's, from the registry); empty: the tenant's own."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise PromptTooLongError(f"prompt has {len(prompt_ids)} tokens; this model's context is "
                                     f"{self.max_model_len} tokens")
        root = self._cache_root(adapter, cache_scope or tenant_scope(tenant)) if self.config.prefix_cache else None
        seqs: list[Sequence] = []
        for i in range(max(1, params.n)):  # sample i draws with seed + i
            p = params if i == 0 or params.seed is None else replace(params, seed=params.seed + i)
            s = Sequence(list(prompt_ids), p, adapter=adapter, tenant=tenant, priority=priority,
                         request_id=request_id, listener=listener, index=i, cache_root=root)
            s.max_total_len = self.max_model_len
            if params.grammar is not None:
                s.matcher = self.grammars.matcher(params.grammar, grammar)  # GrammarError (a ValueError)
            if i:
                s.share_from = seqs[0]
            seqs.append(s)
        seq = seqs[0]
        if len(seqs) > 1:
            seq.samples = seqs
        rt = self.lora_runtime
        tier = None
        if adapter is None or rt is None:
            seq.extra["cache"] = "base"
        else:
            tier = rt.manager.state(adapter).state
            seq.extra["cache"] = "warm" if tier in ("host", "device") else "cold"
            tier = "absent" if tier == "failed" else tier
            rt.prefetch(seq)  # load while earlier requests run
        if self.metrics is not None:
            self.metrics.observe_arrival(seq.extra["cache"], tier)
        with self._wake:
            sched = self.scheduler
            if len(seqs) > 1 and sched.num_waiting + len(seqs) > sched.max_waiting:
                raise QueueFullError(f"the worker's waiting queue has no room for {len(seqs)} samples "
                                     f"({sched.max_waiting} requests at most)")
            for s in seqs:
                s.extra["cache"] = seq.extra["cache"]
                sched.add(s)
            self._arrivals += 1
            self._wake.notify()
        return seq

    def _cache_root(self, adapter: AdapterRef | None, scope: str) -> bytes:
        """The request's prefix namespace: this base model, the adapter's content digest (its
        registry id only where a caller sent no digest) and the scope."""
        identity = None if adapter is None else adapter.sha256 or f"id:{adapter.id}"
        return namespace(self.info.revision if self.info is not None else "", identity, scope)

    def abort(self, seq: Sequence) -> None:
        """Stop a sequence (client went away); frees its KV blocks. No further events."""
        with self._lock:
            if seq.is_finished:
                return
            seq.aborted = True
            seq.finish_reason = "abort"
            self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        """Take a sequence out of the scheduler and give back its KV blocks and adapter slot
        (under the lock). A sequence of the step whose forward is running keeps both until that
        forward ends: an abort from another thread between scheduling and the forward would
        otherwise pull its block table from under the batch being built (failing the whole
        step) and its slot from under the other requests of that adapter in it."""
        if seq.seq_id in self._in_forward:
            self.scheduler.finish(seq, free_blocks=False)
            self._release_after_forward.append(seq)
            return
        self.scheduler.finish(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Give back the sequence's adapter slot (under the lock)."""
        rt = self.lora_runtime
        if rt is not None:
            rt.release(seq)

    def _end_forward(self) -> None:
        with self._lock:
            self._in_forward = frozenset()
            deferred, self._release_after_forward = self._release_after_forward, []
            for seq in deferred:
                self.scheduler.free_blocks(seq)
                self._release(seq)

    # ------------------------------------------------------------------ stepping
    def step(self) -> bool:
        """Run one scheduled step. Returns False when there was nothing to run.

        Containment: a sequence whose values go non-finite is stopped with a
        ``non_finite_output`` error and its fresh K/V zeroed; an exception in the forward
        fails only the rows it can be pinned on (an adapter's), else the step's rows; the
        other rows continue exactly as if the failed ones had not been there.
        """
        t0 = time.perf_counter()
        with self._lock:
            out = self.scheduler.schedule()
            for seq in out.failed:
                self._finish(seq, "error", error="the request does not fit in this worker's KV cache")
            for seq, exc in out.errors:
                self._finish(seq, "error", *self._describe(exc, seq))
            for seq, reason in self.scheduler.policy.take_failed():
                if not seq.is_finished:
                    name = seq.adapter.name if seq.adapter is not None else "?"
                    self._finish(seq, "error", error=f"adapter {name} could not be loaded: {reason}",
                                 code="adapter_load_failed")
            if out.chunks:
                self._in_forward = frozenset(seq.seq_id for seq, _ in out.chunks)
        if not out.chunks:
            return False
        try:
            if out.copies:
                self.cache.copy_blocks(out.copies)
            ctx = build_batch(out.chunks, self.cache.block_size, self.model.device)
            sampling = [ctx.seqs[i] for i in ctx.sample_seqs]
            masks = self.grammars.start_masks(sampling)  # filled while the forward runs
            try:
                if self.lora_runtime is not None:
                    self.lora_runtime.prepare_batch(ctx)
                logits = self.model.forward(ctx, self.cache)
            except Exception as exc:
                if masks is not None:
                    masks.wait()
                self._contain_exception(ctx, exc)
                return True
        finally:
            self._end_forward()
        bad = self._non_finite(ctx, logits, self.model.scan)
        keep = None
        if bad:
            keep = [j for j, i in enumerate(ctx.sample_seqs) if i not in bad]
            logits = logits[keep]
            sampling = [sampling[j] for j in keep]
        raw = logits
        if masks is not None:
            logits = masks.apply(logits, keep)
            self.mask_s += masks.fill_s
        tokens = sample(logits, sampling, self.model.scan)
        logprobs = token_logprobs(raw, sampling, tokens)
        now = time.monotonic()
        with self._lock:
            if bad:
                self._contain_rows(ctx, bad)
            for seq, n in out.chunks:
                if not seq.is_finished:
                    seq.num_computed += n
                    self.scheduler.cache_computed(seq)
            for seq, tok, lp in zip(sampling, tokens, logprobs, strict=True):
                if not seq.is_finished:
                    self._append_token(seq, tok, now, lp)
            if self.fault is not None and any(s.adapter is None for s in sampling):
                self.fault = None  # the base model answers finitely again
        self.steps += 1
        self.last_step_s = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.observe_step(self.last_step_s, out.num_tokens)
        return True

    # ------------------------------------------------------------------ containment
    @staticmethod
    def _non_finite(ctx: BatchContext, logits: torch.Tensor, scan: RowScan | None = None) -> set[int]:
        """Indices (into ``ctx.seqs``) of sequences with a non-finite hidden row or logits row."""
        row_ok = ctx.row_finite
        if scan is not None and scan.fits(logits):
            logit_ok = scan.finite(logits)
        else:
            logit_ok = torch.isfinite(logits.sum(dim=1))  # NaN/Inf anywhere makes the row sum non-finite
        if bool(logit_ok.all()) and (row_ok is None or bool(row_ok.all())):
            return set()
        bad = {ctx.sample_seqs[j] for j in (~logit_ok).nonzero().flatten().tolist()}
        if row_ok is not None:
            bad.update(ctx.token_seq[~row_ok].tolist())
        return bad

    def _contain_rows(self, ctx: BatchContext, bad: set[int]) -> None:
        """Stop sequences whose values went non-finite; zero what they wrote (call under the lock)."""
        idx = torch.tensor(sorted(bad), dtype=torch.long, device=ctx.token_seq.device)
        slots = ctx.slot_mapping[torch.isin(ctx.token_seq, idx)]
        alloc = self.cache.allocator  # blocks shared with other samples hold their good prompt KV
        for i in bad:  # nothing a failed row touched is found again, even blocks it only read
            alloc.uncache(ctx.seqs[i].block_table)
        blocks = [b for i in bad for b in ctx.seqs[i].block_table if alloc.holders(b) == 1]
        self.cache.scrub(slots, blocks)
        for i in sorted(bad):
            seq = ctx.seqs[i]
            if seq.adapter is None:
                what = "the base model"
                self.fault = "the base model produced non-finite values (NaN/Inf); the worker may be corrupted"
            else:
                what = f"adapter {seq.adapter.name}"
            log.warning("sequence %d (%s) produced non-finite values; stopped", seq.seq_id, what)
            if not seq.is_finished:
                self._finish(seq, "error", f"{what} produced non-finite values (NaN/Inf) for this request",
                             "non_finite_output")

    def _describe(self, exc: BaseException, seq: Sequence) -> tuple[str, str]:
        """(message, code) for a request failed by ``exc``."""
        from engine.lora.batch import LoRAApplyError
        from engine.lora.manager import AdapterLoadError

        if isinstance(exc, AdapterLoadError):
            name = seq.adapter.name if seq.adapter is not None else exc.adapter_id
            return f"adapter {name} could not be loaded: {exc.reason}", "adapter_load_failed"
        if isinstance(exc, LoRAApplyError) and seq.adapter is not None:
            return f"applying adapter {seq.adapter.name} failed in this worker", "adapter_error"
        return "internal engine error", "engine_error"

    def _contain_exception(self, ctx: BatchContext, exc: Exception) -> None:
        """The forward failed: fail the rows it can be pinned on (one adapter's), else all of the
        step's rows. The rest are recomputed next step; what the step wrote is zeroed."""
        from engine.lora.batch import LoRAApplyError
        from engine.lora.manager import AdapterLoadError

        targets: list[Sequence] = []
        if isinstance(exc, AdapterLoadError):
            targets = [s for s in ctx.seqs if s.adapter is not None and s.adapter.id == exc.adapter_id]
        elif isinstance(exc, LoRAApplyError) and ctx.seq_slots is not None:
            hit = set(exc.slots)
            targets = [s for s, slot in zip(ctx.seqs, ctx.seq_slots.tolist(), strict=True) if slot in hit]
        if targets:
            log.warning("engine step: %s; failing %d request(s) of that adapter", exc, len(targets))
        else:
            log.exception("engine step failed; failing its %d request(s)", len(ctx.seqs))
            targets = list(ctx.seqs)
        with self._lock:
            self.cache.scrub(ctx.slot_mapping)
            for seq in targets:
                if not seq.is_finished:
                    self._finish(seq, "error", *self._describe(exc, seq))

    def _append_token(self, seq: Sequence, tok: int, now: float, lp: TokenLogprob | None = None) -> None:
        p = seq.params
        seq.output_ids.append(tok)
        if seq.first_token_time is None:
            seq.first_token_time = now
            if self.metrics is not None:
                self.metrics.observe_first_token(now - seq.arrival, len(seq.prompt_ids),
                                                 seq.extra.get("cache", "base"))
        if self.metrics is not None:
            self.metrics.add_generated(1)
        # the matcher takes the token: the format is complete once it refuses it or none can follow
        grammar_ended = seq.matcher is not None and (not seq.matcher.accept_token(tok)
                                                     or seq.matcher.is_terminated())
        fin = token_finish(tok, p, self.eos_token_ids, grammar_ended=grammar_ended, generated=len(seq.output_ids),
                           total=seq.num_tokens, max_total_len=seq.max_total_len)
        text_ids = seq.output_ids
        if fin.hide:
            text_ids = seq.output_ids[:-1]
            lp = None
        if seq.decoder is None:
            seq.decoder = IncrementalDecoder(self.tokenizer)
        seen = len(seq.decoder.stable)  # text no later token changes: searched for stops already
        out = release_text(seq.decoder.text(text_ids), p.stop, searched=seen, sent=seq.sent_text_len,
                           finishing=fin.reason is not None)
        reason = "stop" if out.stopped else fin.reason
        delta = out.delta
        seq.sent_text_len = out.sent
        seq.output_text = out.text
        if reason is not None:
            seq.finish_reason = reason
            self._retire(seq)
        lps = None
        if lp is not None:
            seq.logprobs.append(lp)
            lps = [lp]
        if seq.listener is not None:
            seq.listener(SeqEvent(seq.seq_id, [tok], delta, reason is not None, reason, logprobs=lps))

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, code: str | None = None) -> None:
        seq.finish_reason = reason
        if not seq.is_finished:
            self._retire(seq)
        elif seq.seq_id not in self._in_forward:  # else _end_forward releases it
            self._release(seq)
        seq.status = SeqStatus.FINISHED
        if seq.listener is not None:
            seq.listener(SeqEvent(seq.seq_id, [], "", True, reason, error, code))

    def fail_all(self, error: str) -> None:
        with self._lock:
            for seq in list(self.scheduler.running) + [e[2] for e in self.scheduler.waiting]:
                self._finish(seq, "error", error)

    def _fail_running(self, error: str) -> None:
        """After an unexpected step error: fail the running requests (all, if none runs, so a
        request that breaks scheduling cannot wedge the loop); the engine keeps serving."""
        with self._lock:
            if not self.scheduler.running:
                self.fail_all(error)
                return
            for seq in list(self.scheduler.running):
                self._finish(seq, "error", error)

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        if self._thread is not None:
            return
        release_team()  # the caller's OpenMP team would slow the engine thread's (engine.threads)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def running_thread(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _team(self, threads: int) -> int:
        """Compute threads for the next step: ``threads`` less one per adapter load in flight
        (up to the loader threads) on CPU. The loaders then run on cores of their own instead of
        beside a full OpenMP team, where a descheduled team thread holds the others at every
        barrier: a burst of cold adapters loads about twice as fast, and its first tokens come
        sooner, for slower steps only while loads run."""
        rt = self.lora_runtime
        if rt is None or threads <= 1 or self.model.device.type != "cpu":
            return threads
        return threads - min(rt.manager.loading(), rt.manager.loader_threads, threads - 1)

    def _gather_arrivals(self) -> None:
        """Woken from idle (under ``_wake``): wait while requests keep arriving, until none has come
        for ``idle_gather_ms``, 5 times that has passed, or the waiting prompts fill a step.

        Requests that a client sends together reach the engine over a few milliseconds (over
        HTTP, one handler after another on the event loop: 32 prompts in 27 ms on a 2-core
        Zen 3). Stepping at the first one makes a step of one prompt (0.2 s of float32 prefill
        for 100 tokens there) that every other one of the burst then waits behind: the burst's
        last first token came 0.3-0.4 s later served than in-process. A request alone pays one
        quiet gap."""
        gap = self.config.idle_gather_ms / 1000.0
        if gap <= 0:
            return
        deadline = time.monotonic() + 5 * gap
        while not self._stopping and not self.scheduler.fills_a_step():
            seen, left = self._arrivals, deadline - time.monotonic()
            if left <= 0:
                return
            self._wake.wait(min(gap, left))
            if self._arrivals == seen:
                return

    def _loop(self) -> None:
        threads = torch.get_num_threads()
        while True:
            with self._wake:
                idle = False
                while not self._stopping and not self.scheduler.has_work():
                    idle = True
                    self._wake.wait(0.5)
                if idle:
                    self._gather_arrivals()
                if self._stopping:
                    return
            team = self._team(threads)
            if team != torch.get_num_threads():
                torch.set_num_threads(team)
            try:
                progressed = self.step()
            except Exception:
                log.exception("engine step failed; failing the running requests")
                self._fail_running("internal engine error")
                progressed = True
            if not progressed:  # work waits on an adapter load: do not spin
                with self._wake:
                    self._wake.wait(0.005)

    # ------------------------------------------------------------------ sync helper
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 max_steps: int = 1_000_000) -> list[Sequence]:
        """Run prompts to completion on the calling thread (the engine thread must not run)."""
        if self.running_thread:
            raise RuntimeError("generate() cannot be used while the engine thread runs")
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        for _ in range(max_steps):
            if all(s.is_finished for s in seqs):
                break
            self.step()
        return seqs

    # ------------------------------------------------------------------ load
    def load(self) -> dict[str, int]:
        with self._lock:
            alloc = self.cache.allocator
            return {"queue_depth": self.scheduler.num_waiting, "running": self.scheduler.num_running,
                    "kv_blocks_used": alloc.num_used, "kv_blocks_total": alloc.num_blocks,
                    "kv_blocks_cached": alloc.num_cached, "kv_evictions": alloc.evictions}
