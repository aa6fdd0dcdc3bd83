"""Replay a trace through the fleet's routing and each worker's adapter tiers.

Routing: with the fleet's own worker count, each request goes where it went (the log says
which worker served it); for another count, to its adapter's first candidate on the
gateway's own consistent-hash ring (``gateway.router.Router``), the observed workers kept
and new ones added to the ring, as growing the fleet would.

Tiers: every worker keeps ``max_loras`` adapters in device slots and ``max_cpu_loras`` in
host memory, each tier evicting by the engine's own policy (``engine.lora.eviction``,
driven through the same ``touch``/``victim``/``remove`` calls the engine's
``AdapterManager`` makes). A request hits the tier its adapter is in when it arrives; a
host miss is a cold start (a load from disk or the store). The two tiers see the same
arrivals, so each is replayed on its own.

Prefix cache: with ``kv_tokens`` sizes given and a trace whose records name prefixes, each
worker's arrivals also replay through a prefix cache of each size (``planner.prefixes``), and
the peak load counts only the tokens computed, at the smallest size tried.

A long worker stream replays ``WINDOWS`` stretches of it, spread over its whole span, each
after a warm-up of the requests just before it that used at least as many distinct adapters
as the tier holds: an LRU tier holds the last ``capacity`` distinct adapters used, so it then
holds exactly what the full replay would hold when the stretch begins, so only which stretches were taken can make the estimate differ
(well under a point on Zipf traffic; ``tests/test_plan.py``). Where the warm-ups would cost
as much as the whole stream, it replays whole. (Sampling adapters instead, as SHARDS does,
missed by 8 points on Zipf traffic: a few hot adapters in or out of the sample swing it.)
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.lora.eviction import EvictionPolicy, LRUPolicy
from gateway.router import Router
from planner.prefixes import PrefixResult, prefix_keys, replay_worker
from planner.trace import Trace

SAMPLE_BUDGET = 400_000
"""Requests a sampled replay counts (a worker's stream at most this long replays whole)."""
WINDOWS = 40
"""Stretches a sampled replay takes."""


@dataclass(frozen=True)
class TierResult:
    workers: int
    capacity: int
    requests: int
    """Adapter requests (every worker's)."""
    hits: float
    """Requests whose adapter was in the tier (estimated when sampled)."""
    misses_max_worker: float
    """Misses of the worker with the most."""
    sampled: bool
    """Replayed on stretches of a long stream (``windows``), not whole."""

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.requests if self.requests else 1.0


@dataclass(frozen=True)
class Load:
    workers: int
    peak_tokens_per_s: float
    """The busiest worker's tokens/s (prompt + completion) in the trace's busiest ``PEAK_WINDOW_S``."""
    peak_requests_per_s: float
    peak_computed_tokens_per_s: float | None = None
    """``peak_tokens_per_s`` less the prompt tokens the prefix cache serves (its smallest size
    tried); None when no prefix reuse was replayed."""

    @property
    def computed(self) -> float:
        """Tokens/s the busiest worker computes at the busiest minute."""
        return self.peak_tokens_per_s if self.peak_computed_tokens_per_s is None else self.peak_computed_tokens_per_s


@dataclass(frozen=True)
class Replayed:
    device: list[TierResult]
    host: list[TierResult]
    load: list[Load]
    prefix: list[PrefixResult] = field(default_factory=list)
    """Per worker count and pool size, the prompt the prefix caches serve (empty when not replayed)."""


PEAK_WINDOW_S = 60.0


def peak_load(trace: Trace, where: np.ndarray, workers: int, cached: np.ndarray | None = None) -> Load:
    """How busy the busiest worker gets, per ``PEAK_WINDOW_S``, when requests go to ``where``;
    ``cached``: each request's prompt tokens a prefix cache serves (not computed)."""
    window = min(PEAK_WINDOW_S, trace.span_s)
    slot = ((trace.start - trace.start[0]) // window).astype(np.int64)
    cell = where.astype(np.int64) * (int(slot[-1]) + 1) + slot
    tokens = np.bincount(cell, weights=trace.tokens.astype(np.float64))
    computed = None
    if cached is not None:
        computed = round(float(np.bincount(cell, weights=(trace.tokens - cached).astype(np.float64)).max()) / window, 2)
    return Load(workers, round(float(tokens.max()) / window, 2), round(float(np.bincount(cell).max()) / window, 3),
                computed)


def assign(trace: Trace, workers: int) -> np.ndarray:
    """The worker index (``0..workers-1``) of each request with a fleet of ``workers``."""
    if workers == len(trace.workers):
        return trace.worker
    ids = sorted(trace.workers)[:workers]
    ids += [f"planned-{k}" for k in range(1, workers - len(ids) + 1)]
    router = Router(None, candidates=1, static_urls=tuple(ids))
    index = {w: i for i, w in enumerate(ids)}
    of_adapter = np.fromiter((index[router.candidates("", name)[0]] for name in trace.adapters), np.int32,
                             len(trace.adapters))
    base = index[router.candidates("", "base:")[0]]
    if not trace.adapters:  # base-model traffic only
        return np.full(len(trace), base, np.int32)
    return np.where(trace.adapter >= 0, of_adapter[np.maximum(trace.adapter, 0)], base).astype(np.int32)


def replay_tier(keys: Sequence[int], capacity: int, policy: Callable[[], EvictionPolicy[int]] = LRUPolicy,
                skip: int = 0) -> int:
    """Hits of a tier of ``capacity`` adapters over ``keys`` (one per arrival), evicting by
    ``policy``; the first ``skip`` arrivals warm the tier up and are not counted."""
    pol = policy()
    touch, victim, remove = pol.touch, pol.victim, pol.remove
    held: set[int] = set()

    def run(part: Sequence[int]) -> int:
        hits = 0
        for key in part:
            if key in held:
                hits += 1
            else:
                if len(held) >= capacity:
                    out = victim(held)
                    if out is not None:  # None: a tier of no adapters (capacity 0) holds none yet
                        held.discard(out)
                        remove(out)
                held.add(key)
            touch(key)
        return hits

    if skip:
        run(keys[:skip])
    return run(keys[skip:])


def _warmup(keys: np.ndarray, start: int, distinct: int) -> int:
    """How many requests before ``start`` use ``distinct`` adapters (all of them if fewer do)."""
    u = distinct
    while u < start:
        if np.unique(keys[start - u:start]).size >= distinct:
            return u
        u *= 2
    return start


def windows(keys: np.ndarray, capacity: int) -> list[tuple[int, int]] | None:
    """``(warm-up start, counted start)`` of each stretch a sampled replay takes, or None when
    ``keys`` replays whole."""
    n = int(keys.size)
    if n <= SAMPLE_BUDGET:
        return None
    length = SAMPLE_BUDGET // WINDOWS
    out = []
    for start in np.linspace(0, n - length, WINDOWS).astype(np.int64).tolist():
        out.append((start - _warmup(keys, start, capacity), start))
    if sum(s - lo for lo, s in out) + SAMPLE_BUDGET >= n // 2:
        return None
    return out


def hit_ratio(keys: np.ndarray, capacity: int, policy: Callable[[], EvictionPolicy[int]] = LRUPolicy,
              distinct: int | None = None) -> tuple[float, bool]:
    """The tier's hit ratio over ``keys`` (``distinct`` adapters, counted when not given), and
    whether it was replayed on stretches (``windows``)."""
    if not keys.size:
        return 1.0, False
    if distinct is None:
        distinct = int(np.unique(keys).size)
    if capacity >= distinct:  # nothing is ever evicted, whatever the policy: only first uses miss
        return 1.0 - distinct / keys.size, False
    spans = windows(keys, capacity)
    if spans is None:
        return replay_tier(keys.tolist(), capacity, policy) / keys.size, False
    length = SAMPLE_BUDGET // WINDOWS
    hits = sum(replay_tier(keys[lo:start + length].tolist(), capacity, policy, skip=start - lo)
               for lo, start in spans)
    return hits / (length * len(spans)), True


# The replay jobs read the trace's per-worker streams from here: set before the pool forks,
# shared copy-on-write, never pickled.
_STREAMS: dict[int, list[np.ndarray]] = {}
_DISTINCT: dict[int, list[int]] = {}
_PREFIX_STREAMS: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = {}


def _job(args: tuple[int, int, int]) -> tuple[int, int, int, float, float, bool]:
    workers, j, capacity = args
    keys = _STREAMS[workers][j]
    ratio, sampled = hit_ratio(keys, capacity, distinct=_DISTINCT[workers][j])
    return workers, j, capacity, ratio * keys.size, keys.size * (1.0 - ratio), sampled


def _prefix_job(args: tuple[int, int, int, int]) -> tuple[int, int, int, list[int]]:
    workers, j, kv_tokens, block = args
    # lists only here: several times the arrays' memory
    keys, shared, prompt, total = (c.tolist() for c in _PREFIX_STREAMS[workers][j])
    return workers, j, kv_tokens, replay_worker(keys, shared, prompt, total, kv_tokens, block)


def replay(trace: Trace, workers: list[int], capacities: dict[str, list[int]], *, jobs: int | None = None,
           progress: Callable[[int, int], None] | None = None, kv_tokens: list[int] | None = None,
           block: int = 16) -> Replayed:
    """Each tier (``{"device": [max_loras...], "host": [max_cpu_loras...]}``) replayed for each
    worker count, each count's peak load, and where the trace names prefixes and ``kv_tokens``
    sizes are given, each count's prefix caches of each size (``block`` tokens a KV block)."""
    _STREAMS.clear()
    _DISTINCT.clear()
    _PREFIX_STREAMS.clear()
    sizes = sorted(kv_tokens or []) if trace.names_prefixes else []
    pkeys = prefix_keys(trace) if sizes else None
    wheres: dict[int, np.ndarray] = {}
    owned: dict[int, list[np.ndarray]] = {}  # each worker's requests (indices, in arrival order)
    for w in workers:
        where = wheres[w] = assign(trace, w)
        if pkeys is not None:
            order = np.argsort(where, kind="stable")
            bounds = np.searchsorted(where[order], np.arange(w + 1))
            mine = owned[w] = [order[bounds[j]:bounds[j + 1]] for j in range(w)]
            _PREFIX_STREAMS[w] = [(pkeys[m], trace.prefix_tokens[m], trace.prompt[m], trace.tokens[m]) for m in mine]
        mask = trace.adapter >= 0
        keys, owner = trace.adapter[mask], where[mask]
        order = np.argsort(owner, kind="stable")  # stays in arrival order within each worker
        bounds = np.searchsorted(owner[order], np.arange(w + 1))
        ordered = keys[order]
        _STREAMS[w] = [ordered[bounds[j]:bounds[j + 1]] for j in range(w)]
        # Adapters per worker: one bincount, not a sort per replay.
        seen = np.bincount(owner.astype(np.int64) * len(trace.adapters) + keys, minlength=w * len(trace.adapters))
        _DISTINCT[w] = (seen.reshape(w, -1) > 0).sum(axis=1).tolist()
    # A size both tiers try is one replay: the tiers see the same arrivals under the same policy.
    tasks = sorted({(w, j, c) for caps in capacities.values() for w in workers for c in caps
                    for j in range(w)}, key=lambda t: (-_STREAMS[t[0]][t[1]].size, -t[2]))  # longest first
    prefix_tasks = [(w, j, s, block) for w in workers for j in range(w) for s in sizes]
    total = len(tasks) + len(prefix_tasks)
    jobs = max(1, min(jobs or os.cpu_count() or 1, total))
    done: dict[tuple[int, int, int], tuple[float, float, bool]] = {}
    cached: dict[tuple[int, int, int], list[int]] = {}
    try:
        with contextlib.ExitStack() as stack:
            if jobs == 1:
                results: Iterator[tuple[int, int, int, float, float, bool]] = map(_job, tasks)
                prefix_results: Iterator[tuple[int, int, int, list[int]]] = map(_prefix_job, prefix_tasks)
            else:
                pool = stack.enter_context(multiprocessing.get_context("fork").Pool(jobs))
                results = pool.imap_unordered(_job, tasks)
                prefix_results = pool.imap_unordered(_prefix_job, prefix_tasks)
            for i, (w, j, c, hits, misses, sampled) in enumerate(results):
                done[(w, j, c)] = (hits, misses, sampled)
                if progress:
                    progress(i + 1, total)
            for i, (w, j, s, got) in enumerate(prefix_results):
                cached[(w, j, s)] = got
                if progress:
                    progress(len(tasks) + i + 1, total)
    finally:
        streams = dict(_STREAMS)
        _STREAMS.clear()
        _DISTINCT.clear()
        _PREFIX_STREAMS.clear()
    load, prefix = [], []
    for w in workers:
        if not sizes:
            load.append(peak_load(trace, wheres[w], w))
            continue
        per_size = {}
        for s in sizes:
            per = np.zeros(len(trace), np.int64)
            for j, part in enumerate(owned[w]):
                per[part] = cached[(w, j, s)]
            per_size[s] = per
            prefix.append(PrefixResult(w, s, int(trace.prompt.sum()), int(per.sum())))
        load.append(peak_load(trace, wheres[w], w, per_size[sizes[0]]))  # the smallest pool: the least reuse
    out: dict[str, list[TierResult]] = {}
    for tier, caps in capacities.items():
        out[tier] = []
        for w in workers:
            for c in caps:
                runs = [done[(w, j, c)] for j in range(w)]
                out[tier].append(TierResult(w, c, sum(streams[w][j].size for j in range(w)), sum(m[0] for m in runs),
                                            max(m[1] for m in runs), any(m[2] for m in runs)))
    return Replayed(out["device"], out["host"], load, prefix)
