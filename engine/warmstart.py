"""Warm start: adapters a worker loads (and pins) before it takes traffic.

* ``settings.preload_adapters``: entries ``ID=URI`` or ``ID=URI#sha256`` — loaded into host
  memory at start. The URI must be under ``adapter_sources`` like any other; ``#sha256`` (the
  version digest the registry shows) is checked when given. An entry without it is the
  operator's own configuration on the worker host and is loaded unchecked.
* ``settings.pin_adapters``: entries in the same format, or bare ids from the preload list —
  loaded and pinned (never evicted from host memory or their device slot).
* With Redis configured (``redis_url``) and ``preload_adapters`` empty: the
  ``settings.preload_top_n`` adapters with the most recent traffic, read from two keys the
  gateway maintains:

  - ``{redis_prefix}:adapter-traffic``: sorted set, member = adapter version id,
    score = recent request count;
  - ``{redis_prefix}:adapter-refs``: hash, field = adapter version id, value =
    ``AdapterRef.to_json()`` (refs without a digest are skipped).

A failed load is logged and reported in the outcome; it never stops the worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from loraplex.digest import is_digest
from loraplex.settings import Settings
from loraplex.wire import AdapterRef

log = logging.getLogger("loraplex.engine.warmstart")


class PreloadEntryError(ValueError):
    pass


def parse_entry(entry: str) -> AdapterRef:
    """``ID=URI`` or ``ID=URI#sha256`` -> AdapterRef (name = id)."""
    key, sep, rest = entry.strip().partition("=")
    if not sep or not key.strip() or not rest.strip():
        raise PreloadEntryError(f"adapter entry {entry!r} is not ID=URI or ID=URI#sha256")
    uri, digest = rest.strip(), ""
    if "#" in uri:
        uri, _, digest = uri.rpartition("#")
        if not (len(digest) == 64 and all(c in "0123456789abcdefABCDEF" for c in digest)):
            raise PreloadEntryError(f"adapter entry {entry!r}: the part after '#' must be a sha256 hex digest")
    key = key.strip()
    return AdapterRef(id=key, name=key, uri=uri, sha256=digest.lower() or None)


def plan(settings: Settings) -> tuple[list[AdapterRef], list[AdapterRef]]:
    """(adapters to load, adapters to pin) from the static settings."""
    preload = [parse_entry(e) for e in settings.preload_adapters if e.strip()]
    by_id = {r.id: r for r in preload}
    pins: list[AdapterRef] = []
    for e in settings.pin_adapters:
        e = e.strip()
        if not e:
            continue
        if "=" in e:
            pins.append(parse_entry(e))
        elif e in by_id:
            pins.append(by_id[e])
        else:
            raise PreloadEntryError(f"pin_adapters entry {e!r} is neither ID=URI nor an id from preload_adapters")
    return preload, pins


async def top_adapters(redis: Any, prefix: str, n: int) -> list[AdapterRef]:
    """The ``n`` adapters with most recent traffic that have a stored ref."""
    if n <= 0:
        return []
    ids = await redis.zrevrange(f"{prefix}:adapter-traffic", 0, n - 1)
    ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
    if not ids:
        return []
    raws = await redis.hmget(f"{prefix}:adapter-refs", ids)
    out = []
    for aid, raw in zip(ids, raws, strict=True):
        if raw is None:
            continue
        try:
            ref = AdapterRef.from_json(raw)
        except (ValueError, TypeError) as exc:
            log.warning("skipping adapter %s from traffic: bad ref (%s)", aid, exc)
            continue
        if not is_digest(ref.sha256):
            log.warning("skipping adapter %s from traffic: its ref carries no digest", aid)
            continue
        out.append(ref)
    return out


@dataclass
class WarmStartResult:
    loaded: list[str] = field(default_factory=list)
    pinned: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def warm(manager: Any, preload: list[AdapterRef], pins: list[AdapterRef],
         timeout_s: float = 300.0) -> WarmStartResult:
    """Load (blocking) into host memory and pin; returns what happened."""
    result = WarmStartResult()
    pin_ids = {r.id for r in pins}
    refs = {r.id: r for r in [*preload, *pins]}
    for ref in refs.values():
        if ref.id in pin_ids:
            manager.pin(ref)
        else:
            manager.prefetch(ref)
    for ref in refs.values():
        try:
            st = manager.wait(ref, timeout=timeout_s)
        except Exception as exc:  # timeout
            result.failed[ref.id] = f"{type(exc).__name__}: {exc}"
            continue
        if st.state in ("host", "device"):
            result.loaded.append(ref.id)
            if ref.id in pin_ids:
                result.pinned.append(ref.id)
        else:
            result.failed[ref.id] = st.error or st.state
            log.warning("warm start: adapter %s failed to load: %s", ref.id, result.failed[ref.id])
    return result


async def warm_start(engine: Any, settings: Settings) -> WarmStartResult | None:
    """Run the configured warm start for ``engine`` (None when LoRA is off or nothing to do)."""
    import asyncio

    rt = engine.lora_runtime
    if rt is None:
        return None
    preload, pins = plan(settings)
    if not preload and settings.redis_url and settings.preload_top_n > 0:
        import redis.asyncio as aioredis

        client = aioredis.from_url(settings.redis_url)
        try:
            preload = await top_adapters(client, settings.redis_prefix, settings.preload_top_n)
        except Exception as exc:
            log.warning("warm start: could not read adapter traffic from Redis: %s", exc)
        finally:
            await client.aclose()
    if not preload and not pins:
        return None
    result = await asyncio.to_thread(warm, rt.manager, preload, pins)
    log.info("warm start: loaded %d adapters (%d pinned), %d failed", len(result.loaded), len(result.pinned),
             len(result.failed))
    return result
