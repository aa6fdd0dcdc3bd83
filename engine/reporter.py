"""Publish this worker's residency and load (``WorkerReport``) every ``report_interval_s``.

The store is the process-wide in-memory table on the embedded default
(``loraplex.residency.process_residency()``) and Redis otherwise
(``loraplex.residency.RedisResidency``: one key per worker with TTL ``worker_report_ttl_s``).
Adapter residency comes from the LoRA runtime when one is plugged in
(``LoRARuntime.report_fields()``: ``device_adapters`` / ``host_adapters`` / ``disk_adapters``
version ids). The prefix cache's blocks and evictions come from ``Engine.load()``
(``kv_blocks_cached``, ``kv_evictions``). A worker that stops removes its report.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from loraplex.residency import ResidencyStore
from loraplex.settings import Settings
from loraplex.wire import WorkerReport

if TYPE_CHECKING:
    from engine.engine import Engine

log = logging.getLogger("loraplex.engine.reporter")


def build_report(engine: Engine, worker_id: str, url: str, settings: Settings) -> WorkerReport:
    load = engine.load()
    info = engine.info
    report = WorkerReport(
        worker_id=worker_id, url=url,
        base_model=info.name if info else "", base_revision=info.revision if info else "",
        queue_depth=load["queue_depth"], running=load["running"],
        free_kv_blocks=load["kv_blocks_total"] - load["kv_blocks_used"],
        total_kv_blocks=load["kv_blocks_total"], max_num_seqs=engine.config.max_num_seqs,
        max_loras=settings.max_loras, cached_kv_blocks=load["kv_blocks_cached"], kv_evictions=load["kv_evictions"],
    )
    rt = engine.lora_runtime
    if rt is not None:
        for key, value in rt.report_fields().items():
            setattr(report, key, list(value))
    return report


def residency_store(settings: Settings) -> tuple[ResidencyStore, Any]:
    """The store for these settings and a closer (or None)."""
    if settings.embedded:
        from loraplex.residency import process_residency

        return process_residency(), None
    import redis.asyncio as aioredis

    from loraplex.residency import RedisResidency

    client = aioredis.from_url(settings.redis_url)
    return RedisResidency(client, settings.redis_prefix), client


async def report_forever(engine: Engine, store: ResidencyStore, worker_id: str, url: str, settings: Settings) -> None:
    interval = max(0.05, float(settings.report_interval_s))
    ttl = max(settings.worker_report_ttl_s, 3 * interval)
    try:
        while True:
            try:
                await store.publish(build_report(engine, worker_id, url, settings), ttl)
            except Exception as exc:  # a flaky store must not kill the worker
                log.warning("residency report failed: %s", exc)
            await asyncio.sleep(interval)
    finally:
        try:
            await asyncio.shield(store.remove(worker_id))
        except Exception:
            pass
