"""A traffic trace from the gateways' access logs, as arrays.

Each gateway writes one JSON line per request (``gateway.request_path``: ``ts`` at the end,
``latency_ms``, ``adapter`` as ``name@version`` or ``base``, ``worker``, tokens, status).
Any file holding such lines will do: a gateway's stderr, a collector's export, several
gateways' logs together; other lines (start-up messages, tracebacks, a log shipper's
prefix before the JSON) are skipped and counted. A request that never reached a worker
(refused by the limiter, a bad request) has no ``worker`` and is not part of the trace.

Requests are ordered by when they started (``ts - latency_ms``), the order the workers
saw them arrive. Big files are read by several processes, each taking a byte range.

A record may also name the prefix its prompt shares with other requests, for the prefix
cache's replay (``planner.prefixes``): ``prefix_id`` (a string: the same string, the same
tokens) and ``prefix_tokens`` (how many of the prompt's first tokens are that prefix's first
tokens; at most ``prompt_tokens``). The gateway's log holds no prompt content, so whatever
writes or enriches the logs adds these (a system prompt's name, a conversation's id with the
prompt's length); a record without them shares nothing. A record with a malformed pair is
skipped like any other malformed line. ``cached_tokens`` (what the serving fleet's prefix caches
supplied, as the gateway logs it) is kept as measured, to set beside the replay's assumption.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

BASE = "base"
"""The ``adapter`` of a request the base model answered."""
_MARK = b'{"ts":'
_CHUNK = 64 << 20


class TraceError(ValueError):
    """The logs hold no usable request (or a window leaves none)."""


@dataclass
class Trace:
    start: np.ndarray
    """Start time of each request (unix seconds, ascending)."""
    adapter: np.ndarray
    """Index into ``adapters`` (int32); -1 for a base-model request."""
    worker: np.ndarray
    """Index into ``workers`` (int32): the worker that served it."""
    tokens: np.ndarray
    """Prompt plus completion tokens (int64)."""
    prompt: np.ndarray
    """Prompt tokens (int64)."""
    tenant: np.ndarray
    """Index into ``tenants`` (int32)."""
    prefix: np.ndarray
    """Index into ``prefixes`` (int32); -1 for a request that names no prefix."""
    prefix_tokens: np.ndarray
    """How many of the prompt's first tokens are its prefix's (int64; 0 without one)."""
    cached: np.ndarray
    """Prompt tokens the serving fleet's prefix cache supplied, as logged (int64; -1: not logged)."""
    adapters: list[str]
    workers: list[str]
    tenants: list[str]
    prefixes: list[str]
    skipped: int = 0
    """Lines that were not access-log records of a request that reached a worker."""

    def __len__(self) -> int:
        return int(self.start.size)

    @property
    def span_s(self) -> float:
        """Seconds from the first request's start to the last one's (at least one)."""
        return max(1.0, float(self.start[-1] - self.start[0])) if len(self) else 1.0

    def window(self, since: float | None = None, until: float | None = None) -> Trace:
        """The requests that started in ``[since, until)``."""
        lo = 0 if since is None else int(np.searchsorted(self.start, since, "left"))
        hi = len(self) if until is None else int(np.searchsorted(self.start, until, "left"))
        return Trace(self.start[lo:hi], self.adapter[lo:hi], self.worker[lo:hi], self.tokens[lo:hi],
                     self.prompt[lo:hi], self.tenant[lo:hi], self.prefix[lo:hi], self.prefix_tokens[lo:hi],
                     self.cached[lo:hi], self.adapters, self.workers, self.tenants, self.prefixes, self.skipped)

    @property
    def names_prefixes(self) -> bool:
        """Whether any request names a prefix (else no prefix reuse can be assumed)."""
        return bool(self.prefixes)


def _parse(path: str, lo: int, hi: int) -> Trace:
    """The records of the lines that begin in ``[lo, hi)`` of ``path``, in file order."""
    adapters: dict[str, int] = {BASE: -1}
    workers: dict[str, int] = {}
    tenants: dict[str, int] = {}
    prefixes: dict[str, int] = {}
    start: list[float] = []
    adapter: list[int] = []
    worker: list[int] = []
    tokens: list[int] = []
    prompt: list[int] = []
    tenant: list[int] = []
    prefix: list[int] = []
    prefix_tokens: list[int] = []
    cached: list[int] = []
    skipped = 0
    with open(path, "rb") as fh:
        if lo:
            fh.seek(lo - 1)
            fh.readline()  # the line that crosses ``lo`` belongs to the range before
        data = fh.read(max(0, hi - fh.tell()))
        if data and not data.endswith(b"\n"):
            data += fh.readline()
    loads = orjson.loads
    for line in data.split(b"\n"):
        if line[:6] != _MARK:
            at = line.find(_MARK)
            if at < 0:
                skipped += bool(line)
                continue
            line = line[at:]
        try:
            rec = loads(line)
            w = rec["worker"]
            if not w:
                raise ValueError("not sent to a worker")
            t = rec["ts"] - rec["latency_ms"] / 1000.0
            a = rec["adapter"]
            p = rec["prompt_tokens"]
            n = p + rec["completion_tokens"]
            pid, shared = _prefix(rec, p)
            c = rec.get("cached_tokens", -1)
            if not isinstance(c, int) or isinstance(c, bool) or c < -1:
                raise ValueError("cached_tokens must be a whole number >= 0")
            a_code = adapters.get(a)
            if a_code is None:
                a_code = adapters[a] = len(adapters) - 1
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            skipped += 1
            continue
        start.append(t)
        adapter.append(a_code)
        worker.append(workers.setdefault(w, len(workers)))
        tokens.append(n)
        prompt.append(p)
        tenant.append(tenants.setdefault(str(rec.get("tenant") or ""), len(tenants)))
        prefix.append(-1 if pid is None else prefixes.setdefault(pid, len(prefixes)))
        prefix_tokens.append(shared)
        cached.append(c)
    return Trace(np.asarray(start, np.float64), np.asarray(adapter, np.int32), np.asarray(worker, np.int32),
                 np.asarray(tokens, np.int64), np.asarray(prompt, np.int64), np.asarray(tenant, np.int32),
                 np.asarray(prefix, np.int32), np.asarray(prefix_tokens, np.int64), np.asarray(cached, np.int64),
                 list(adapters)[1:],
                 list(workers), list(tenants), list(prefixes), skipped)


def _prefix(rec: dict, prompt: int) -> tuple[str | None, int]:
    """A record's ``(prefix_id, prefix_tokens)`` (the tokens at most the prompt's), or
    ``(None, 0)`` when it names none; a malformed pair is a ValueError (the line is skipped)."""
    pid = rec.get("prefix_id")
    if pid is None:
        return None, 0
    n = rec.get("prefix_tokens")
    if not isinstance(pid, str) or not pid or not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError("prefix_id must be a non-empty string and prefix_tokens a whole number >= 0")
    if not isinstance(prompt, int) or prompt < 0:
        raise ValueError("prompt_tokens must be a whole number >= 0")
    return pid, min(n, prompt)


def _ranges(paths: Sequence[str | Path]) -> list[tuple[str, int, int]]:
    out = []
    for p in paths:
        size = os.path.getsize(p)
        n = max(1, math.ceil(size / _CHUNK))
        step = math.ceil(size / n) if size else 1
        out += [(str(p), i * step, min(size, (i + 1) * step)) for i in range(n)]
    return out


def _codes(local: list[str], index: dict[str, int], names: list[str]) -> np.ndarray:
    """Where each of a part's names sits in the merged list (added when new), as an array."""
    out = np.empty(len(local) + 1, np.int32)
    for i, name in enumerate(local):
        code = index.get(name)
        if code is None:
            code = index[name] = len(names)
            names.append(name)
        out[i] = code
    out[-1] = -1  # local -1 (base) maps to -1
    return out


def read_trace(paths: Sequence[str | Path], *, jobs: int | None = None) -> Trace:
    """Every request in ``paths`` that reached a worker, ordered by start time."""
    ranges = _ranges(paths)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(ranges)))
    if jobs == 1:
        parts = [_parse(*r) for r in ranges]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            parts = list(pool.map(_parse, *zip(*ranges, strict=True)))
    adapters: list[str] = []
    workers: list[str] = []
    tenants: list[str] = []
    prefixes: list[str] = []
    a_index: dict[str, int] = {}
    w_index: dict[str, int] = {}
    t_index: dict[str, int] = {}
    p_index: dict[str, int] = {}
    a_cols, w_cols, t_cols, p_cols = [], [], [], []
    for part in parts:
        a_cols.append(_codes(part.adapters, a_index, adapters)[part.adapter])
        w_cols.append(_codes(part.workers, w_index, workers)[part.worker])
        t_cols.append(_codes(part.tenants, t_index, tenants)[part.tenant])
        p_cols.append(_codes(part.prefixes, p_index, prefixes)[part.prefix])
    start = np.concatenate([p.start for p in parts]) if parts else np.empty(0)
    if not start.size:
        raise TraceError("no access-log records of requests that reached a worker in "
                         + ", ".join(str(p) for p in paths))
    order = np.argsort(start, kind="stable")
    return Trace(start[order], np.concatenate(a_cols)[order], np.concatenate(w_cols)[order],
                 np.concatenate([p.tokens for p in parts])[order], np.concatenate([p.prompt for p in parts])[order],
                 np.concatenate(t_cols)[order], np.concatenate(p_cols)[order],
                 np.concatenate([p.prefix_tokens for p in parts])[order], np.concatenate([p.cached for p in parts])[order],
                 adapters, workers, tenants, prefixes,
                 sum(p.skipped for p in parts))
