"""Per-request outcomes of bindings under a canary, shared by every gateway replica.

While a binding has a canary, each of its requests that reached a worker (on either arm: the
canary or the active version) leaves one sample: the version, whether it failed (5xx, an
engine error in the stream), its TTFT, tokens/s, completion tokens, whether the completion
was empty or stopped on ``length``, and the request's ``metadata`` labels (what a check
segmented by ``metadata.KEY`` splits on; at most ``MAX_LABELS`` keys, values cut to
``MAX_LABEL_CHARS``). The canary judge (``gateway.canary_judge``) reads the
samples of the current step from every replica at once:

* ``RedisSamples``: one Redis stream per binding, ``{prefix}:canary:{tenant}/{alias}``
  (capped at ``MAX_SAMPLES`` entries, expiring an hour after the last write); replicas buffer
  samples and add them about four times a second;
* ``MemorySamples``: the embedded default's, in the process (one gateway).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import orjson

from gateway.canary_stats import Arm, Labels

log = logging.getLogger("loraplex.gateway.canary")

MAX_SAMPLES = 50_000
"""Samples kept per binding (the newest)."""
TTL_S = 3600
FLUSH_S = 0.25
MAX_LABELS = 16
MAX_LABEL_CHARS = 64

Sample = tuple[float, str, bool, float, float, int, bool, bool, Labels | None]
"""(time, version id, ok, ttft s, tokens/s, completion tokens, empty, length, labels)."""


def _arms(samples: list[Sample], since: float) -> dict[str, Arm]:
    arms: dict[str, Arm] = {}
    for t, version, ok, ttft, tps, ct, empty, length, labels in samples:
        if t >= since:
            arms.setdefault(version, Arm()).add(ok, ttft, tps, ct, empty, length, labels)
    return arms


class MemorySamples:
    def __init__(self) -> None:
        self._samples: dict[str, deque[Sample]] = {}

    def record(self, binding: str, sample: Sample) -> None:
        q = self._samples.get(binding)
        if q is None:
            q = self._samples[binding] = deque(maxlen=MAX_SAMPLES)
        q.append(sample)

    async def read(self, binding: str, since: float) -> dict[str, Arm]:
        """Each version's ``Arm`` of the samples taken at or after ``since`` (epoch seconds)."""
        return _arms(list(self._samples.get(binding, ())), since)

    async def run(self) -> None:
        return None

    async def flush(self) -> None:
        return None


class RedisSamples:
    def __init__(self, redis: Any, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix
        self._pending: list[tuple[str, Sample]] = []

    def _key(self, binding: str) -> str:
        return f"{self.prefix}:canary:{binding}"

    def record(self, binding: str, sample: Sample) -> None:
        self._pending.append((binding, sample))

    async def flush(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                keys = set()
                for binding, (t, v, ok, ttft, tps, ct, empty, length, labels) in pending:
                    key = self._key(binding)
                    keys.add(key)
                    fields = {"t": repr(t), "v": v, "ok": int(ok), "ttft": repr(ttft), "tps": repr(tps),
                              "ct": ct, "e": int(empty), "l": int(length)}
                    if labels:
                        fields["m"] = orjson.dumps(labels)
                    pipe.xadd(key, fields, maxlen=MAX_SAMPLES, approximate=True)
                for key in keys:
                    pipe.expire(key, TTL_S)
                await pipe.execute()
        except Exception as exc:  # Redis down: these samples are lost; the judge waits for more
            log.debug("canary samples flush failed: %s", exc)

    async def read(self, binding: str, since: float) -> dict[str, Arm]:
        # Stream ids are the Redis server's clock: start a little early, then filter on the samples' own time.
        start = f"{max(0, int((since - 30) * 1000))}-0"
        rows = await self.redis.xrange(self._key(binding), min=start, max="+")
        samples: list[Sample] = []
        for _, f in rows:
            g = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                 for k, v in f.items()}
            try:
                labels = orjson.loads(g["m"]) if "m" in g else None
                samples.append((float(g["t"]), g["v"], g["ok"] == "1", float(g["ttft"]), float(g["tps"]),
                                int(g["ct"]), g["e"] == "1", g["l"] == "1", labels))
            except (KeyError, ValueError, orjson.JSONDecodeError):
                continue
        return _arms(samples, since)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            with contextlib.suppress(Exception):
                await self.flush()


def sample(version: str, ok: bool, elapsed_s: float, ttft_s: float | None, completion_tokens: int, empty: bool,
           length: bool, metadata: dict[str, str] | None = None) -> Sample:
    """A whole answer's TTFT is its latency, and it has no decode rate (0: not a tokens/s sample): a
    stream's decode rate is its tokens after the first over the time after the first. ``metadata``:
    the request's labels (module docstring)."""
    ttft = elapsed_s if ttft_s is None else ttft_s
    tps = (completion_tokens - 1) / max(elapsed_s - ttft, 1e-3) if ttft_s is not None and completion_tokens > 1 else 0.0
    labels = None
    if metadata:
        labels = {str(k)[:MAX_LABEL_CHARS]: str(v)[:MAX_LABEL_CHARS]
                  for k, v in list(metadata.items())[:MAX_LABELS] if isinstance(v, str)}
    return (time.time(), version, ok, ttft, tps, completion_tokens, empty, length, labels or None)
