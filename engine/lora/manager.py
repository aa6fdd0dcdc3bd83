"""Adapter tiers: device slots <- host-memory LRU <- local disk cache <- source.

The engine talks to one :class:`AdapterManager`:

* ``prefetch(ref)`` when a request is queued: a loader thread brings the adapter to host
  memory (fetching/downloading, verifying the version digest, reading and validating the PEFT files)
  while the current step runs. Never blocks.
* ``ready(ref)`` / ``state(ref)``: whether ``acquire_slots`` would not wait on IO; a failed
  load reports ``"failed"`` with the reason (only that adapter's requests fail; a later
  ``prefetch`` retries once ``failure_ttl_s`` has passed). A load fails, too, when the
  adapter's scale or weights are not finite in the slots' dtype, and so does a slot write
  that raises (the slot is handed back): neither ever fails an engine step.
* ``acquire_slots(refs)`` when sequences join the running batch (one ref per sequence):
  places the adapters into device slots and returns one slot id per ref; each ref counts
  one user until ``release(refs)``. A slot with users is never evicted, so a slot id stays
  valid for the sequence's life. At most ``max_loras`` distinct adapters are in use at once.
* ``pin(ref)`` / ``unpin(ref)``: pinned adapters are never evicted from host or device.
* ``resident()``: what each tier holds, so the scheduler can prefer adapters already in a
  slot and avoid refilling a slot every step when active adapters outnumber slots.

Everything is keyed by ``AdapterRef.id`` (the registry's version id), never by name.
Eviction order comes from an :class:`EvictionPolicy` (LRU by default), one per tier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from engine.lora.eviction import EvictionPolicy, LRUPolicy
from engine.lora.peft import AdapterFormatError, load_adapter_files
from engine.lora.slots import NonFiniteAdapter, RankTooLarge, SlotBank, SlotImage, check_finite
from engine.lora.sources import (
    AdapterFetchError,
    DiskCache,
    SourceRegistry,
    read_verified,
    sources_from_settings,
)
from engine.threads import single_threaded
from loraplex.modelinfo import ModelInfo
from loraplex.peft_config import ConfigLimits
from loraplex.settings import Settings
from loraplex.wire import AdapterRef

log = logging.getLogger(__name__)

StateName = Literal["absent", "loading", "host", "device", "failed"]


class AdapterLoadError(RuntimeError):
    """An adapter could not be loaded; ``reason`` is safe to show to the requester."""

    def __init__(self, adapter_id: str, reason: str) -> None:
        super().__init__(f"adapter {adapter_id} could not be loaded: {reason}")
        self.adapter_id = adapter_id
        self.reason = reason


class AdapterBusy(RuntimeError):
    """An unload was refused: the adapter is in use or pinned."""


class SlotsExhausted(RuntimeError):
    """No device slot can take the adapter now (all in use or pinned, or max_loras reached)."""


# --- stats --------------------------------------------------------------------------------

@dataclass
class LoRAStats:
    """Counters for metrics. Tiers: ``source`` (download), ``disk`` (disk cache or local path
    read into host memory), ``host`` (host -> device slot copy). Evictions: ``device`` (slot
    given to another adapter), ``host`` (dropped from host memory), ``disk`` (deleted from
    the disk cache)."""

    loads: dict[str, int] = field(default_factory=lambda: {"source": 0, "disk": 0, "host": 0})
    load_seconds: dict[str, float] = field(default_factory=lambda: {"source": 0.0, "disk": 0.0, "host": 0.0})
    hits: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    misses: int = 0
    evictions: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "disk": 0})
    failures: int = 0


@dataclass(frozen=True)
class AdapterState:
    state: StateName
    error: str | None = None
    slot: int | None = None
    users: int = 0
    pinned: bool = False
    in_host: bool = False
    rank: int = 0
    """The adapter's rank once read (0 before)."""


@dataclass
class _Entry:
    ref: AdapterRef
    weights: SlotImage | None = None
    """In host memory, laid out for its slot (built on a loader thread)."""
    future: Future[None] | None = None
    error: str | None = None
    failed_at: float = 0.0
    slot: int | None = None
    users: int = 0
    pinned: bool = False


class AdapterManager:
    def __init__(
        self,
        model: ModelInfo,
        bank: SlotBank,
        *,
        max_loras: int = 8,
        max_cpu_loras: int = 64,
        cache_dir: str = "",
        cache_max_bytes: int = 0,
        sources: SourceRegistry | None = None,
        policy: Callable[[], EvictionPolicy[str]] = LRUPolicy,
        loader_threads: int = 2,
        failure_ttl_s: float = 5.0,
        weights_dtype: torch.dtype = torch.float32,
        limits: ConfigLimits | None = None,
    ) -> None:
        self.model = model
        self.bank = bank
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.loader_threads = loader_threads
        self.stats = LoRAStats()
        self.disk = DiskCache(cache_dir, max_bytes=cache_max_bytes,
                              on_evict=self._disk_evicted) if cache_dir else None
        self.sources = sources or SourceRegistry()
        self.failure_ttl_s = failure_ttl_s
        self.weights_dtype = weights_dtype
        self.limits = limits or ConfigLimits()
        """Rank, scale and delta bounds of the shared PEFT config reader."""
        self._host_policy = policy()
        self._device_policy = policy()
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(max_workers=loader_threads, thread_name_prefix="lora-load",
                                        initializer=single_threaded)
        self._fetch_pool = ThreadPoolExecutor(max_workers=loader_threads, thread_name_prefix="lora-fetch",
                                              initializer=single_threaded)
        """Loads that must download first: a stalled store holds these threads, never the ones that
        load adapters already on local disk."""
        self._free = {c: list(bank.slot_ids(c)) for c in range(len(bank.rank_classes))}
        self._pin_host = bank.device.type == "cuda"
        self.on_load: Callable[[str, float], None] | None = None
        """Called with ``(tier, seconds)`` after every load (metrics histograms)."""

    @classmethod
    def from_settings(cls, settings: Settings, model: ModelInfo, *, dtype: torch.dtype = torch.float32,
                      device: torch.device | str = "cpu", slot_weights_dtype: torch.dtype | None = None,
                      **kw: Any) -> AdapterManager:
        """The worker's manager: a slot bank per ``lora_rank_classes`` with ``max_loras`` slots
        per class, the host LRU of ``max_cpu_loras``, the disk cache directory and budget,
        the adapter sources (``adapter_sources``) and the config bounds from settings.
        ``slot_weights_dtype``: the slots' A/B storage (default ``dtype``, see ``SlotBank``)."""
        # Classes above max_lora_rank are dropped: such adapters are refused as in vLLM.
        classes = tuple(c for c in settings.lora_rank_classes if c <= settings.max_lora_rank) or (
            settings.max_lora_rank,)
        bank = SlotBank.for_model(model, classes, settings.max_loras, dtype=dtype, device=device,
                                  weights_dtype=slot_weights_dtype)
        return cls(model, bank, max_loras=settings.max_loras, max_cpu_loras=settings.max_cpu_loras,
                   cache_dir=settings.resolved_adapter_cache_dir(),
                   cache_max_bytes=settings.adapter_cache_max_bytes,
                   sources=kw.pop("sources", None) or sources_from_settings(settings),
                   limits=ConfigLimits.from_settings(settings), **kw)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._fetch_pool.shutdown(wait=True, cancel_futures=True)

    # --- queries ---------------------------------------------------------------------------
    def state(self, ref: AdapterRef | str) -> AdapterState:
        key = ref if isinstance(ref, str) else ref.id
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return AdapterState("absent")
            if e.slot is not None:
                name: StateName = "device"
            elif e.weights is not None:
                name = "host"
            elif e.future is not None:
                name = "loading"
            elif e.error is not None:
                name = "failed"
            else:
                name = "absent"
            rank = e.weights.rank if e.weights is not None else e.ref.rank
            return AdapterState(name, e.error, e.slot, e.users, e.pinned, e.weights is not None, rank)

    def ready(self, ref: AdapterRef | str) -> bool:
        """True when ``acquire_slots`` would not wait on IO for this adapter."""
        return self.state(ref).state in ("host", "device")

    def slot_of(self, ref: AdapterRef | str) -> int | None:
        key = ref if isinstance(ref, str) else ref.id
        with self._lock:
            e = self._entries.get(key)
            return None if e is None else e.slot

    def resident(self) -> dict[str, set[str]]:
        """Adapter ids per tier: ``device`` (in a slot), ``host`` (in host memory)."""
        with self._lock:
            return {
                "device": {k for k, e in self._entries.items() if e.slot is not None},
                "host": {k for k, e in self._entries.items() if e.weights is not None},
            }

    def resident_counts(self) -> dict[str, int]:
        r = self.resident()
        return {"device": len(r["device"]), "host": len(r["host"]),
                "disk": self.disk.count() if self.disk else 0}

    # --- loading ---------------------------------------------------------------------------
    def loading(self) -> int:
        """Loads in flight (read, decoded and checked on the loader threads)."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.future is not None)

    def prefetch(self, ref: AdapterRef) -> None:
        """Start loading ``ref`` into host memory in the background (no-op if present or loading)."""
        with self._lock:
            self._start_load(ref)

    def _start_load(self, ref: AdapterRef) -> _Entry:
        e = self._entries.get(ref.id)
        if e is None:
            e = self._entries[ref.id] = _Entry(ref)
        if e.weights is not None or e.slot is not None or e.future is not None:
            return e
        if e.error is not None and time.monotonic() - e.failed_at < self.failure_ttl_s:
            return e
        e.error = None
        pool = self._fetch_pool if self._needs_download(ref) else self._pool
        e.future = pool.submit(self._load_job, e)
        return e

    def _needs_download(self, ref: AdapterRef) -> bool:
        try:
            source = self.sources.for_uri(ref.uri)
        except AdapterFetchError:
            return False  # refused: the load fails at once
        return source.remote and self.disk is not None and not self.disk.has(ref)

    def _load_job(self, e: _Entry) -> None:
        ref = e.ref
        try:
            weights, tier, seconds = self._read(ref)
        except Exception as exc:
            reason = _reason(exc)
            if not isinstance(exc, AdapterFormatError | AdapterFetchError | RankTooLarge | NonFiniteAdapter | OSError):
                log.exception("unexpected error loading adapter %s (%s)", ref.id, ref.name)
            else:
                log.warning("adapter %s (%s) failed to load: %s", ref.id, ref.name, reason)
            with self._lock:
                e.future = None
                e.error = reason
                e.failed_at = time.monotonic()
                self.stats.failures += 1
            return
        with self._lock:
            e.future = None
            e.weights = weights
            self.stats.loads[tier] += 1
            self.stats.load_seconds[tier] += seconds
            self._host_policy.touch(ref.id)
            self._observe(tier, seconds)
            self._evict_host(keep=ref.id)

    def _read(self, ref: AdapterRef) -> tuple[SlotImage, str, float]:
        t0 = time.perf_counter()
        if ref.base_revision and ref.base_revision != self.model.revision:
            raise AdapterFetchError(f"adapter {ref.name or ref.id} was registered for base revision "
                                    f"{ref.base_revision!r}; this worker serves {self.model.name} at revision "
                                    f"{self.model.revision!r}")
        source = self.sources.for_uri(ref.uri)
        if not source.remote:
            return self._read_dir(ref, source.fetch(ref, None)), "disk", time.perf_counter() - t0
        if self.disk is None:
            raise AdapterFetchError("remote adapters need a disk cache directory (adapter_cache_dir)")
        directory = self.disk.get(ref)
        if directory is not None:
            try:
                return self._read_dir(ref, directory), "disk", time.perf_counter() - t0
            except (AdapterFetchError, AdapterFormatError):
                if directory.is_dir():
                    self.disk.remove(ref)  # a corrupted cache entry is refetched on retry
                    raise
                log.info("adapter %s was evicted from the disk cache while read; fetching it again", ref.id)
        weights = self._read_dir(ref, self.disk.fill(ref, source))
        return weights, "source", time.perf_counter() - t0

    def _read_dir(self, ref: AdapterRef, directory: Path) -> SlotImage:
        contents = read_verified(ref, directory)  # parsed below from exactly the verified bytes
        weights = load_adapter_files(contents, self.model, dtype=self.weights_dtype,
                                     projections=self.bank.projections, limits=self.limits)
        check_finite(weights, self.bank.weights_dtype)  # a slot write can then never overflow
        image = self.bank.image(weights)  # refuses ranks above the largest class
        return image.pin_memory() if self._pin_host else image

    def _disk_evicted(self, name: str, nbytes: int) -> None:
        with self._lock:
            self.stats.evictions["disk"] += 1

    def _evict_host(self, keep: str) -> None:
        held = [k for k, e in self._entries.items() if e.weights is not None]
        excess = len(held) - self.max_cpu_loras
        if excess <= 0:
            return
        candidates = {k for k in held if k != keep and not self._entries[k].pinned}
        for _ in range(min(excess, len(candidates))):
            k = self._host_policy.victim(candidates)
            assert k is not None  # candidates is not empty
            candidates.discard(k)
            e = self._entries[k]
            e.weights = None
            self._host_policy.remove(k)
            self.stats.evictions["host"] += 1
            if e.slot is None and e.future is None:
                del self._entries[k]
        if len(held) - excess > self.max_cpu_loras:
            log.warning("host adapter tier over capacity: %d pinned adapters", len(held) - excess)

    def _wait_loaded(self, ref: AdapterRef, timeout: float | None) -> _Entry:
        with self._lock:
            e = self._entries.get(ref.id)
            if e is not None and (e.slot is not None or e.weights is not None):
                self.stats.hits["device" if e.slot is not None else "host"] += 1
                return e
            self.stats.misses += 1
            e = self._start_load(ref)
            fut = e.future
        if fut is not None:
            fut.result(timeout=timeout)
        with self._lock:
            if e.weights is None and e.slot is None:
                raise AdapterLoadError(ref.id, e.error or "not loaded")
            return e

    # --- device slots ----------------------------------------------------------------------
    def acquire_slots(self, refs: Sequence[AdapterRef], *, timeout: float | None = None,
                      protect: Iterable[str] = ()) -> list[int]:
        """Place each ref's adapter in a device slot; one user per ref until :meth:`release`.

        All or nothing for the users: on :class:`AdapterLoadError` or :class:`SlotsExhausted`
        no user count changes. Waits for loads that are not ready (check :meth:`ready` first to
        avoid stalling a step). Must be called from the thread that runs the model.
        ``protect``: adapter ids whose idle slots must not be taken (they still have queued work).
        """
        distinct: dict[str, AdapterRef] = {}
        for r in refs:
            distinct.setdefault(r.id, r)
        for r in distinct.values():
            self._wait_loaded(r, timeout)
        with self._lock:
            in_use = {k for k, e in self._entries.items() if e.users > 0}
            if len(in_use | set(distinct)) > self.max_loras:
                raise SlotsExhausted(f"max_loras={self.max_loras} distinct adapters already in use")
            for key in distinct:
                e = self._entries.get(key)
                if e is None or (e.slot is None and e.weights is None):
                    raise AdapterLoadError(key, "evicted from host memory before it reached a slot; retry")
                if e.slot is None:
                    self._place(e, protect=set(distinct) | set(protect))
                self._device_policy.touch(key)
                self._host_policy.touch(key)
            for r in refs:
                self._entries[r.id].users += 1
            return [self._entries[r.id].slot for r in refs]  # type: ignore[misc]

    def _place(self, e: _Entry, protect: set[str]) -> None:
        assert e.weights is not None
        c = e.weights.class_index
        if self._free[c]:
            slot = self._free[c].pop(0)
        else:
            on_class = {e2.slot: k for k, e2 in self._entries.items()
                        if e2.slot is not None and self.bank.split(e2.slot)[0] == c}
            candidates = {k for k in on_class.values()
                          if self._entries[k].users == 0 and not self._entries[k].pinned and k not in protect}
            key = self._device_policy.victim(candidates)
            if key is None:
                rc = self.bank.rank_classes[c]
                raise SlotsExhausted(f"all {self.bank.slots_per_class} rank-{rc} slots are in use or pinned")
            victim = self._entries[key]
            assert victim.slot is not None
            slot = victim.slot
            victim.slot = None
            self._device_policy.remove(key)
            self.stats.evictions["device"] += 1
            if victim.weights is None and not victim.pinned:
                del self._entries[key]
        t0 = time.perf_counter()
        try:
            self.bank.write(slot, e.weights)
            if self.bank.device.type == "cuda":
                torch.cuda.current_stream(self.bank.device).synchronize()
        except Exception as exc:  # only this adapter fails: the slot goes back, the load is marked failed
            self._slot_write_failed(e, c, slot, exc)
        seconds = time.perf_counter() - t0
        self.stats.loads["host"] += 1
        self.stats.load_seconds["host"] += seconds
        e.slot = slot
        self._observe("host", seconds)

    def _slot_write_failed(self, e: _Entry, class_index: int, slot: int, exc: Exception) -> None:
        reason = _reason(exc)
        log.warning("adapter %s (%s) could not be placed in slot %d: %s", e.ref.id, e.ref.name, slot, reason)
        try:
            self.bank.clear(slot)
        finally:
            self._free[class_index].insert(0, slot)
            e.weights = None
            e.error = reason
            e.failed_at = time.monotonic()
            self._host_policy.remove(e.ref.id)
            self.stats.failures += 1
        raise AdapterLoadError(e.ref.id, reason) from exc

    def _observe(self, tier: str, seconds: float) -> None:
        if self.on_load is not None:
            try:
                self.on_load(tier, seconds)
            except Exception:  # a metrics hook must never break a load
                log.exception("adapter load observer failed")

    def try_acquire(self, ref: AdapterRef, protect: Iterable[str] = ()) -> int | None:
        """Non-blocking acquire for admission: the slot id (one user), or None when the adapter
        is not in host memory yet (a prefetch is started) or no slot can take it now.
        Raises :class:`AdapterLoadError` when its load failed (within ``failure_ttl_s``)."""
        st = self.state(ref)
        if st.state == "failed" and st.error is not None:
            self.prefetch(ref)  # retries once the failure has expired
            st = self.state(ref)
            if st.state == "failed":
                raise AdapterLoadError(ref.id, st.error or "load failed")
        if st.state not in ("host", "device"):
            self.prefetch(ref)
            return None
        try:
            return self.acquire_slots([ref], protect=protect)[0]
        except SlotsExhausted:
            return None

    def release(self, refs: Iterable[AdapterRef | str]) -> None:
        """One user fewer per ref (a finished or preempted sequence)."""
        with self._lock:
            for r in refs:
                key = r if isinstance(r, str) else r.id
                e = self._entries.get(key)
                if e is None or e.users <= 0:
                    raise ValueError(f"release of adapter {key} without a matching acquire")
                e.users -= 1

    # --- pinning ---------------------------------------------------------------------------
    def pin(self, ref: AdapterRef) -> None:
        """Never evict ``ref`` from host memory or its device slot; starts loading it."""
        with self._lock:
            e = self._start_load(ref)
            e.pinned = True

    def entries(self) -> list[tuple[AdapterRef, AdapterState]]:
        """Every adapter the manager knows (loading, failed, host, device), with its state."""
        with self._lock:
            refs = [e.ref for e in self._entries.values()]
        return [(r, self.state(r)) for r in refs]

    def wait(self, ref: AdapterRef, timeout: float | None = None) -> AdapterState:
        """Block until ``ref`` is no longer loading; its state then (host/device/failed)."""
        with self._lock:
            e = self._entries.get(ref.id)
            fut = None if e is None else e.future
        if fut is not None:
            fut.result(timeout=timeout)
        return self.state(ref)

    def unload(self, ref: AdapterRef | str, *, force: bool = False) -> bool:
        """Drop an adapter from device and host memory. False when unknown.

        Raises :class:`AdapterBusy` while sequences use it, or while pinned unless ``force``
        (which also unpins it). A load in flight finishes and is dropped.
        """
        key = ref if isinstance(ref, str) else ref.id
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return False
            if e.users > 0:
                raise AdapterBusy(f"adapter {key} is used by {e.users} running sequence(s)")
            if e.pinned and not force:
                raise AdapterBusy(f"adapter {key} is pinned (unpin it first, or force)")
            if e.slot is not None:
                self._free[self.bank.split(e.slot)[0]].append(e.slot)
                e.slot = None
                self._device_policy.remove(key)
            e.weights = None
            e.pinned = False
            e.error = None
            self._host_policy.remove(key)
            if e.future is not None:
                e.future.cancel()
            del self._entries[key]
            return True

    def unpin(self, ref: AdapterRef | str) -> None:
        key = ref if isinstance(ref, str) else ref.id
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                e.pinned = False


def _reason(exc: BaseException) -> str:
    if isinstance(exc, AdapterFormatError):
        return f"invalid adapter: {exc}"
    if isinstance(exc, NonFiniteAdapter):
        return f"invalid adapter: non-finite values: {exc}"
    if isinstance(exc, RankTooLarge):
        return f"unsupported rank: {exc}"
    if isinstance(exc, AdapterFetchError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
