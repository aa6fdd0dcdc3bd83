"""How much prompt each worker's prefix cache would serve, replayed from a trace.

The engine keeps the full KV blocks of earlier sequences and admits a request from the
longest chain of its prompt's blocks held under the same namespace (base model, adapter
version, tenant cache scope: ``loraplex.prefix``), whole blocks only and short of the last
prompt token, whose logits it must compute. Freed blocks stay until the pool needs them,
least recently used first.

The gateway's log holds no prompt content, so the replay knows only what a record names:
``prefix_id`` and ``prefix_tokens`` (``planner.trace``). A request shares with an earlier one on
the same simulated worker when both name the same prefix under the same adapter and tenant;
a record without a prefix shares nothing (no reuse is assumed, whatever the real traffic
repeats). Per worker the replay holds, in least-recently-used order:

- each named prefix at the longest whole-block length a request has computed of it;
- each request's other blocks (the rest of its prompt and its output), which no later request
  can name but which take room in the pool just the same.

A request is served ``min(held, prefix_tokens, prompt_tokens - 1)`` rounded down to whole
blocks, and then holds its prefix's whole blocks and its own rest; the pool holds
``kv_tokens``, and room is made by trimming the least recently used entry (a chain loses its
tail blocks first, as the engine evicts them). What it leaves out, each erring towards less
reuse or more: a shared tenant scope (tenants are counted apart: less), running sequences'
own blocks (the whole pool is counted as cache: more), an earlier turn's output blocks that a
conversation's next prompt repeats (not matched unless named in ``prefix_tokens``: less).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.trace import Trace

FIRST_SIZE = 4096
"""The smallest pool (tokens per worker) tried when ``--kv-tokens`` is not given."""
MAX_SIZES = 6
"""The most pool sizes tried when ``--kv-tokens`` is not given (x4 steps from ``FIRST_SIZE``)."""


@dataclass(frozen=True)
class PrefixResult:
    workers: int
    kv_tokens: int
    """Tokens one worker's KV pool holds."""
    prompt_tokens: int
    """Every request's prompt tokens (every worker's)."""
    cached_tokens: int
    """Prompt tokens served from the cache."""

    @property
    def hit_ratio(self) -> float:
        """Cached over prompt tokens, as the workers' own hit metric."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prefix_keys(trace: Trace) -> np.ndarray:
    """Per request, a code equal for requests whose prefix is the same (same ``prefix_id``,
    adapter and tenant), -1 for a request that names none."""
    out = np.full(len(trace), -1, np.int64)
    named = trace.prefix >= 0
    if named.any():
        rows = np.stack([trace.prefix[named], trace.adapter[named], trace.tenant[named]]).astype(np.int64)
        out[named] = np.unique(rows, axis=1, return_inverse=True)[1].reshape(-1)
    return out


def default_sizes(trace: Trace, keys: np.ndarray, block: int) -> list[int]:
    """x4 steps from ``FIRST_SIZE`` until one pool holds every named prefix of the trace at its
    longest (``MAX_SIZES`` at most)."""
    named = keys >= 0
    longest = np.zeros(int(keys.max()) + 1 if named.any() else 0, np.int64)
    np.maximum.at(longest, keys[named], trace.prefix_tokens[named] // block * block)
    total, size = int(longest.sum()), FIRST_SIZE
    sizes: list[int] = []
    while len(sizes) < MAX_SIZES:
        sizes.append(size)
        if size >= total:
            break
        size *= 4
    return sizes


def replay_worker(keys: Sequence[int], shared: Sequence[int], prompt: Sequence[int], total: Sequence[int],
                  kv_tokens: int, block: int) -> list[int]:
    """Tokens of each request's prompt one worker's cache of ``kv_tokens`` serves, over its
    arrivals in order: ``keys`` (``prefix_keys``), ``shared`` (``prefix_tokens``), ``prompt``
    (prompt tokens) and ``total`` (prompt plus completion tokens) per request."""
    capacity = kv_tokens // block * block
    held: OrderedDict[int, int] = OrderedDict()  # key -> tokens held, least recently used first
    size = 0
    out = []
    for i, (key, n, p, t) in enumerate(zip(keys, shared, prompt, total, strict=True)):
        prefix = n // block * block if key >= 0 else 0
        have = held.pop(key, 0) if key >= 0 else 0
        out.append(min(have, min(n, p - 1) // block * block) if key >= 0 else 0)
        rest = min(t // block * block - prefix, capacity)
        if rest > 0:  # this request's own blocks, which no later request names: its tail, evicted first
            held[-1 - i] = rest
            size += rest
        if key >= 0:
            keep = min(max(have, prefix), capacity)
            held[key] = keep
            size += keep - have
        while size > capacity:
            oldest, tokens = next(iter(held.items()))
            drop = min(tokens, size - capacity)
            if drop == tokens:
                del held[oldest]
            else:
                held[oldest] = tokens - drop
            size -= drop
    return out
