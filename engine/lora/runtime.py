"""The engine-facing LoRA runtime: admission, per-step batch context, release.

It implements the engine's hooks (see ``engine.engine`` / ``engine.model``):

* ``admit(seq, batch) -> bool`` (an ``engine.scheduler.AdmissionPolicy`` of its own, admitting in
  arrival order; ``engine.admission_policy.FairAdmission`` orders for it): base-model sequences
  always; an adapter sequence once its adapter is in host memory (a background load is
  started otherwise) and a device slot can hold it. The slot is taken (one user) at
  admission and kept until ``release(seq)``, also across preemption, so a running
  sequence's adapter is never evicted and resident adapters are naturally preferred when
  active adapters outnumber slots. A sequence whose adapter failed to load is not admitted;
  ``failure(seq)`` gives the reason so the engine can finish it with an error.
* ``prepare_batch(ctx)``: sets ``ctx.seq_slots`` (the slots admission took; it never
  acquires one itself) and ``ctx.lora`` (a :class:`~engine.lora.batch.LoRABatch`, or None
  for a base-only step).
* ``release(seq)``: drops the sequence's slot user when it finishes or is aborted.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from engine.lora.batch import LoRABatch
from engine.lora.manager import AdapterLoadError, AdapterManager
from engine.scheduler import AdmissionPolicy
from engine.sequence import Sequence
from engine.step_batch import BatchContext
from loraplex.wire import AdapterRef


class LoRARuntime(AdmissionPolicy):
    def __init__(self, manager: AdapterManager, native: bool = True) -> None:
        """``native``: CPU float32 LoRA steps may use the C kernel (``engine.native``)."""
        self.manager = manager
        self.native = native
        self._held: dict[int, tuple[AdapterRef, int]] = {}  # seq_id -> (adapter, slot)
        self._failed: dict[int, str] = {}
        self._lock = threading.Lock()

    # --- admission -------------------------------------------------------------------------
    def admit(self, seq: Sequence, batch: list[Sequence], protect: Iterable[str] = ()) -> bool:
        """``protect``: adapter ids whose idle slots must not be taken for ``seq``'s adapter."""
        ref = seq.adapter
        if ref is None:
            return True
        with self._lock:
            if seq.seq_id in self._held:
                return True
        try:
            slot = self.manager.try_acquire(ref, protect=protect)
        except AdapterLoadError as exc:
            with self._lock:
                self._failed[seq.seq_id] = exc.reason
            return False
        if slot is None:
            return False
        with self._lock:
            self._held[seq.seq_id] = (ref, slot)
            self._failed.pop(seq.seq_id, None)
        return True

    def prefetch(self, seq: Sequence) -> None:
        """Start loading a queued sequence's adapter (call when the request arrives)."""
        if seq.adapter is not None:
            self.manager.prefetch(seq.adapter)

    def failure(self, seq: Sequence) -> str | None:
        """Why the sequence's adapter cannot be served, if its load failed."""
        with self._lock:
            return self._failed.get(seq.seq_id)

    # --- per step ----------------------------------------------------------------------------
    def slot_of(self, seq: Sequence) -> int:
        """The slot admission gave the sequence (``-1`` for the base model). A sequence on an
        adapter that was not admitted here raises :class:`AdapterLoadError` (naming the
        adapter), which fails that adapter's rows, not the step: slots are taken only by
        :meth:`admit`."""
        ref = seq.adapter
        if ref is None:
            return -1
        with self._lock:
            held = self._held.get(seq.seq_id)
        if held is None:
            raise AdapterLoadError(ref.id, "the sequence joined a batch without its adapter slot "
                                           "(admission did not go through the LoRA runtime)")
        return held[1]

    def prepare_batch(self, ctx: BatchContext) -> None:
        seq_slots = torch.tensor([self.slot_of(s) for s in ctx.seqs], dtype=torch.int64)
        ctx.seq_slots = seq_slots
        token_slots = seq_slots[ctx.token_seq.cpu()] if seq_slots.numel() else seq_slots
        batch = LoRABatch.build(self.manager.bank, token_slots, native=self.native)
        ctx.lora = None if batch.empty else batch

    def release(self, seq: Sequence) -> None:
        with self._lock:
            held = self._held.pop(seq.seq_id, None)
            self._failed.pop(seq.seq_id, None)
        if held is not None:
            self.manager.release([held[0]])

    def report_fields(self) -> dict[str, list[str]]:
        """Adapter ids per tier for ``loraplex.wire.WorkerReport`` (device, host, disk)."""
        r = self.manager.resident()
        disk = self.manager.disk.ids() if self.manager.disk is not None else []
        return {"device_adapters": sorted(r["device"]), "host_adapters": sorted(r["host"]),
                "disk_adapters": disk}

    def held(self) -> dict[int, int]:
        """seq_id -> slot of every sequence holding a slot."""
        with self._lock:
            return {k: v[1] for k, v in self._held.items()}
