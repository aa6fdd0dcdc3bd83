"""Structured outputs: ``response_format`` grammars with xgrammar, one matcher per row.

``Grammars`` belongs to one engine (one tokenizer). A response format's text
(``loraplex.openai_request.spec_key``) compiles to an xgrammar ``CompiledGrammar``, kept in a
bounded LRU keyed by the text's SHA-256; a schema xgrammar cannot compile raises
``GrammarError`` with xgrammar's reason (the worker answers 400 ``invalid_response_format``).
Each constrained sequence gets its own ``GrammarMatcher``, so rows with different schemas,
different adapters and unconstrained rows share one step. Output is compact JSON (no free
whitespace between tokens: small models otherwise loop on blanks); ``strict: false`` compiles
strict too (no properties beyond the schema's).

Compiling is the one costly part (it grows faster than linearly with the schema: seconds of a
core for thousands of properties), and one tenant's schemas must not take that time from the
others' steps. The worker's requests therefore compile through ``prepare``:

* on a bounded pool (``compile_threads``) of threads at the lowest CPU priority (nice 19), one
  xgrammar thread each, so a compile runs on cycles the engine's threads leave idle;
* one compile at a time per tenant: a tenant's next schema waits until its previous compile
  has ended, even one whose request was refused or went away, so a tenant holds at most one
  pool thread and the others' compiles wait behind one of its compiles at most;
* under a CPU-time budget (``budget_s``, read from the compiling thread's clock, so a busy
  machine does not count against the schema): past it the request is refused with
  ``GrammarTooComplex`` (400 ``response_format_too_complex``), and the schema's digest is
  remembered, so sending it again is refused at once. xgrammar cannot stop a compile, so that
  one runs to its end at nice 19 and its result is dropped;
* the same text compiling for two requests is compiled once.

``compile`` is the synchronous form (offline generation and tests), on the calling thread.

Per step (``StepMask``): the rows that sample and carry a matcher have their next-token bitmask
filled on a helper thread started before the forward pass (a matcher's state depends only on
the tokens it has accepted, known before the forward); after the forward the masks are applied
to those rows' logits (disallowed tokens to -inf) before any sampling transform, and each
sampled token is then accepted by its row's matcher. Filling costs microseconds a row, even
for schemas at the size limit.

xgrammar is imported lazily: the worker only needs it when a request asks for a format.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from engine.threads import single_threaded
from loraplex.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from engine.sequence import Sequence

DEFAULT_CACHE_SIZE = 64
"""Compiled grammars kept (distinct schemas); the least recently used goes first."""
DEFAULT_BUDGET_S = 5.0
"""CPU seconds one compile may take before its request is refused."""
COMPILE_NICE = 19
"""The compile threads' nice value: the lowest priority, below the engine's threads."""
BUDGET_POLL_S = 0.02
"""How often a waiting request reads its compile's CPU clock."""


class GrammarError(ValueError):
    """The response format cannot be compiled to a grammar."""

    code = "invalid_response_format"


class GrammarTooComplex(GrammarError):
    """Compiling the response format took more CPU time than the budget."""

    code = "response_format_too_complex"


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _compile_thread_init() -> None:
    single_threaded()
    try:  # Linux: a thread's nice value is its own (setpriority on the thread id)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except (OSError, AttributeError):
        pass


class _Compile:
    """One compile on the pool: its future, and the CPU clock of the thread running it."""

    __slots__ = ("budget_s", "clock", "cpu0", "future", "over")

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.clock: int | None = None
        self.cpu0 = 0.0
        self.over = False
        self.future: Future[Any]

    def started(self) -> None:
        self.clock = time.pthread_getcpuclockid(threading.get_ident())
        self.cpu0 = time.clock_gettime(self.clock)

    def cpu_s(self) -> float:
        clock = self.clock
        if clock is None or self.future.done():
            return 0.0
        try:
            return time.clock_gettime(clock) - self.cpu0
        except OSError:  # the thread just ended
            return 0.0


class Grammars:
    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, compile_threads: int = 1,
                 budget_s: float = DEFAULT_BUDGET_S) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self.compile_threads = max(1, compile_threads)
        self.budget_s = budget_s
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._too_complex: OrderedDict[str, float] = OrderedDict()
        """Digests whose compile ran past the budget -> the CPU seconds it had taken."""
        self._lock = threading.Lock()
        self._compiler: Any = None
        self.compiles = 0
        self.refused = 0
        """Compiles refused for the budget."""
        self._pool: ThreadPoolExecutor | None = None
        self._compile_pool: ThreadPoolExecutor | None = None
        self._running: dict[str, _Compile] = {}
        self._tenants: dict[str, asyncio.Future[None]] = {}
        """Tenant -> the end of its last compile queued (the next one starts after it)."""

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                tok = self.tokenizer
                n = tok.vocab_size
                vocab = [tok.token_bytes(i) for i in range(n)]
                for i, added in tok.tk.get_added_tokens_decoder().items():
                    if added.special and i < n:
                        vocab[i] = b""  # control tokens spell no text: never allowed inside the format
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=max(self.vocab_size, n),
                                         stop_token_ids=self.stop_token_ids)
                # One thread a compile: its CPU time is the calling thread's, which the budget reads.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _cached(self, digest: str) -> Any:
        """The compiled grammar of ``digest``, None when unknown; ``GrammarTooComplex`` when refused before."""
        with self._lock:
            hit = self._compiled.get(digest)
            if hit is not None:
                self._compiled.move_to_end(digest)
                return hit
            spent = self._too_complex.get(digest)
        if spent is not None:
            raise GrammarTooComplex(self._too_complex_message(spent))
        return None

    def _too_complex_message(self, spent: float) -> str:
        return (f"the JSON schema is too complex: compiling it took over {spent:.1f} s of CPU time, past this "
                f"worker's budget of {self.budget_s:g} s; use fewer properties, alternatives or enum values")

    def _build(self, key: str, run: _Compile | None = None) -> Any:
        """Compile on the calling thread; cache the result (unless ``run`` went past its budget)."""
        compiler = self._get_compiler()
        if run is not None:
            run.started()
        try:  # compact JSON: with free whitespace, small models loop on blanks until max_tokens
            if key == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                        strict_mode=False)
            else:
                compiled = compiler.compile_json_schema(key.split(":", 1)[1], any_whitespace=False,
                                                        strict_mode=True)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with the reason
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise GrammarError(f"the JSON schema cannot be compiled: {reason}") from None
        digest = _digest(key)
        with self._lock:
            self.compiles += 1
            if run is not None and run.over:
                return compiled  # refused already: its request has its answer
            self._compiled[digest] = compiled
            self._compiled.move_to_end(digest)
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return compiled

    def compile(self, key: str) -> Any:
        """The compiled grammar of ``spec_key(...)`` on the calling thread, without a budget
        (offline generation); ``GrammarError`` naming xgrammar's reason."""
        hit = self._cached(_digest(key))
        return hit if hit is not None else self._build(key)

    async def prepare(self, key: str, tenant: str = "") -> Any:
        """The compiled grammar of ``key`` for a request of ``tenant``: from the cache, or compiled
        on the pool after the tenant's previous compile, within the CPU budget (module
        docstring). ``GrammarError``/``GrammarTooComplex`` when it cannot be had."""
        digest = _digest(key)
        hit = self._cached(digest)
        if hit is not None:
            return hit
        loop = asyncio.get_running_loop()
        before = self._tenants.get(tenant)
        mine: asyncio.Future[None] = loop.create_future()
        self._tenants[tenant] = mine
        run: _Compile | None = None
        try:
            if before is not None:
                await asyncio.shield(before)
            hit = self._cached(digest)
            if hit is not None:
                return hit
            run = self._running.get(digest)
            if run is None:
                run = self._submit(key, digest)
            return await self._wait(run, digest)
        finally:
            self._queue_next(tenant, before, mine, run)

    def _submit(self, key: str, digest: str) -> _Compile:
        if self._compile_pool is None:
            self._compile_pool = ThreadPoolExecutor(self.compile_threads, thread_name_prefix="loraplex-compile",
                                                    initializer=_compile_thread_init)
        run = _Compile(self.budget_s)
        run.future = self._compile_pool.submit(self._build, key, run)
        self._running[digest] = run
        run.future.add_done_callback(lambda _: self._running.pop(digest, None))
        return run

    async def _wait(self, run: _Compile, digest: str) -> Any:
        wrapped = asyncio.wrap_future(run.future)
        while True:
            done, _ = await asyncio.wait([wrapped], timeout=BUDGET_POLL_S)
            if done:
                return wrapped.result()
            spent = run.cpu_s()
            if spent > run.budget_s:
                with self._lock:
                    run.over = True
                    self.refused += 1
                    self._too_complex[digest] = spent
                    while len(self._too_complex) > self.cache_size:
                        self._too_complex.popitem(last=False)
                raise GrammarTooComplex(self._too_complex_message(spent))

    def _queue_next(self, tenant: str, before: asyncio.Future[None] | None, mine: asyncio.Future[None],
                    run: _Compile | None) -> None:
        """Let the tenant's next compile start once this one's thread has ended (at once when
        none ran), and forget the tenant when nothing of its is queued."""

        def release(*_: Any) -> None:
            if not mine.done():
                mine.set_result(None)
            if self._tenants.get(tenant) is mine:
                del self._tenants[tenant]

        if run is not None and not run.future.done():
            loop = mine.get_loop()
            run.future.add_done_callback(lambda _: loop.call_soon_threadsafe(release))
        elif before is not None and not before.done():  # went away while waiting: keep the order
            before.add_done_callback(release)
        else:
            release()

    def matcher(self, key: str, compiled: Any = None) -> Any:
        """A matcher of ``key``'s grammar (``compiled``: as ``prepare`` returned it)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled if compiled is not None else self.compile(key))

    def __len__(self) -> int:
        return len(self._compiled)

    def start_masks(self, rows: list[Sequence]) -> StepMask | None:
        """Begin filling the masks of the sampled ``rows`` (``None``: no row is constrained)."""
        constrained = [(j, s.matcher) for j, s in enumerate(rows) if s.matcher is not None]
        if not constrained:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="loraplex-grammar", initializer=single_threaded)
        return StepMask(self._pool, constrained, len(rows), self.vocab_size)

    def close(self) -> None:
        for pool in (self._pool, self._compile_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._compile_pool = None


class StepMask:
    """The bitmasks of one step's constrained rows, filled on the grammar thread."""

    def __init__(self, pool: ThreadPoolExecutor, constrained: list[tuple[int, Any]], n_rows: int,
                 vocab_size: int) -> None:
        import xgrammar as xgr

        self.rows = [j for j, _ in constrained]
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(len(constrained), vocab_size)
        self.fill_s = 0.0
        self._future: Future[None] = pool.submit(self._fill, [m for _, m in constrained])

    def _fill(self, matchers: list[Any]) -> None:
        import time

        t0 = time.perf_counter()
        for k, m in enumerate(matchers):
            m.fill_next_token_bitmask(self.bitmask, k)
        self.fill_s = time.perf_counter() - t0

    def apply(self, logits: torch.Tensor, keep: list[int] | None = None) -> torch.Tensor:
        """Mask ``logits`` (rows in step order, or only the step rows ``keep`` after containment)."""
        import xgrammar as xgr

        self._future.result()
        pos = {j: k for k, j in enumerate(keep)} if keep is not None else None
        rows, masks = [], []
        for k, j in enumerate(self.rows):
            at = j if pos is None else pos.get(j)
            if at is not None:
                rows.append(at)
                masks.append(k)
        if not rows:
            return logits
        bitmask = self.bitmask if len(masks) == len(self.rows) else self.bitmask[masks]
        sub = logits[rows].cpu()  # a copy: the caller's logits stay as the model gave them
        xgr.apply_token_bitmask_inplace(sub, bitmask.contiguous(), vocab_size=min(self.vocab_size, sub.shape[1]))
        logits = logits.clone()
        logits[rows] = sub.to(logits.device)
        return logits

    def wait(self) -> None:
        self._future.result()
