"""Structured outputs: ``response_format`` grammars with xgrammar, one matcher per row.

``Grammars`` belongs to one engine (one tokenizer). ``compile(spec)`` turns a response format
(``loraplex.openai_request.ResponseFormat``) into an xgrammar ``CompiledGrammar``, kept in a
bounded LRU keyed by the hash of the canonical schema text; a schema xgrammar cannot compile
raises ``GrammarError`` with xgrammar's reason (the worker answers 400
``invalid_response_format``). Each constrained sequence gets its own ``GrammarMatcher``, so rows
with different schemas, different adapters and unconstrained rows share one step. Output is
compact JSON (no free whitespace between tokens: small models otherwise loop on blanks);
``strict: false`` compiles strict too (no properties beyond the schema's).

Per step (``StepMask``): the rows that sample and carry a matcher have their next-token bitmask
filled on a helper thread started before the forward pass (a matcher's state depends only on
the tokens it has accepted, known before the forward); after the forward the masks are applied
to those rows' logits (disallowed tokens to -inf) before any sampling transform, and each
sampled token is then accepted by its row's matcher.

xgrammar is imported lazily: the worker only needs it when a request asks for a format.
"""

from __future__ import annotations

import hashlib
import json
import threading
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


class GrammarError(ValueError):
    """The response format cannot be compiled to a grammar."""


def spec_key(kind: str, schema: dict[str, Any] | None) -> str:
    """The compact text of a format: the cache key's preimage and the SamplingParams field.
    Key order is kept: properties are generated in the order the schema declares them."""
    if kind == "json_object":
        return "json_object"
    return "json_schema:" + json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


class Grammars:
    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: Any = None
        self.compiles = 0
        self._pool: ThreadPoolExecutor | None = None

    def _get_compiler(self) -> Any:
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
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler

    def compile(self, key: str) -> Any:
        """The compiled grammar of ``spec_key(...)``; ``GrammarError`` naming xgrammar's reason."""
        digest = hashlib.sha256(key.encode()).hexdigest()
        with self._lock:
            hit = self._compiled.get(digest)
            if hit is not None:
                self._compiled.move_to_end(digest)
                return hit
            compiler = self._get_compiler()
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
        with self._lock:
            self.compiles += 1
            self._compiled[digest] = compiled
            self._compiled.move_to_end(digest)
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, key: str) -> Any:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(key))

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
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


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
