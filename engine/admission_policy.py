"""Admission policy: priority, per-tenant fairness (VTC), adapter residency, aging.

The scheduler asks the policy for the ORDER of waiting candidates once per step
(``order(waiting, running)``), then ``admit(seq, batch)`` per candidate, and reports the
tokens each step served (``charge(chunks)``). The order is:

1. **priority class** (``WorkerRequestExt.priority``, lower first);
2. inside a class, **aged** adapter requests first (waited ``max_wait_steps`` steps or
   ``max_wait_s`` seconds) — the starvation bound for a cold adapter;
3. then the tenants interleaved by a **virtual token counter** (VTC, Sheng et al.):
   each tenant's counter grows by the prompt and generated tokens the engine serves it;
   the backlogged tenant with the smallest counter goes next (a tentative charge of the
   request's tokens keeps one step's picks interleaved). A tenant that becomes active
   (was idle last step) is lifted to the smallest counter among the tenants that stayed
   active, so idling never banks credit and a burst cannot starve the others;
4. inside one tenant, requests whose adapter is already in a device slot (or the base
   model) before the others, then arrival order.

``admit`` (LoRA on) delegates to ``LoRARuntime.admit`` with the set of adapters that still
have queued or running work, or had some within the last ``linger_steps`` steps, as
``protect``: their idle slots are not taken for another adapter, so when active adapters
outnumber slots a slot is kept while its adapter has work (and briefly after, for the
gaps of a steady stream) and swapped only when it runs dry — a slot is not refilled every
step, and a waiting adapter's queued requests join together once it is in. An AGED request may evict any idle slot (one with
no running user, protected or not). When even that fails because every slot has running
users, the policy enters drain mode for the aged adapter: new sequences on other adapters
are not admitted (base requests and already-admitted ones are) until a slot frees and the
aged adapter gets it, which bounds its wait by the running sequences' lengths.

Requests whose adapter failed to load are collected in ``take_failed()``; the engine
finishes them with an ``adapter_load_failed`` error.
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.scheduler import AdmissionPolicy
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.lora.runtime import LoRARuntime


class FairAdmission(AdmissionPolicy):
    def __init__(self, runtime: LoRARuntime | None = None, *, max_wait_steps: int = 64, max_wait_s: float = 5.0,
                 linger_steps: int = 8, clock: Callable[[], float] = time.monotonic) -> None:
        self.runtime = runtime
        self.linger_steps = linger_steps
        self._last_busy: dict[str, int] = {}
        self.max_wait_steps = max_wait_steps
        self.max_wait_s = max_wait_s
        self.clock = clock
        self.counters: dict[str, float] = defaultdict(float)
        """Tenant -> tokens served (VTC)."""
        self.step = 0
        self.drain: str | None = None
        """Adapter id an aged request waits for while every slot has running users."""
        self._active: set[str] = set()
        self._busy: set[str] = set()
        self._failed: list[Sequence] = []

    # --- ordering ---------------------------------------------------------------------------
    def _aged(self, seq: Sequence) -> bool:
        if seq.adapter is None:
            return False
        first = seq.extra.setdefault("wait_step", self.step)
        return self.step - first >= self.max_wait_steps or self.clock() - seq.arrival >= self.max_wait_s

    def _lift(self, tenants: set[str]) -> None:
        stayed = self._active & tenants
        if stayed:
            floor = min(self.counters[t] for t in stayed)
            for t in tenants - self._active:
                self.counters[t] = max(self.counters[t], floor)
        self._active = tenants

    def order(self, waiting: list[Sequence], running: list[Sequence]) -> list[Sequence]:
        self.step += 1
        for s in (*waiting, *running):
            if s.adapter is not None:
                self._last_busy[s.adapter.id] = self.step
        horizon = self.step - self.linger_steps
        self._last_busy = {k: v for k, v in self._last_busy.items() if v >= horizon}
        self._busy = set(self._last_busy)
        if self.drain is not None and not any(s.adapter is not None and s.adapter.id == self.drain
                                              for s in waiting):
            self.drain = None
        self._lift({s.tenant for s in waiting} | {s.tenant for s in running})
        device = self._device_ids()
        waiting = self._drop_failed(waiting)
        by_prio: dict[int, list[Sequence]] = defaultdict(list)
        for s in waiting:
            by_prio[s.priority].append(s)
        out: list[Sequence] = []
        for prio in sorted(by_prio):
            group = by_prio[prio]
            aged = [s for s in group if self._aged(s)]
            out.extend(sorted(aged, key=_arrival))
            aged_ids = {id(s) for s in aged}
            out.extend(self._interleave([s for s in group if id(s) not in aged_ids], device))
        return out

    def _interleave(self, seqs: list[Sequence], device: set[str]) -> list[Sequence]:
        queues: dict[str, deque[Sequence]] = {}
        per_tenant: dict[str, list[Sequence]] = defaultdict(list)
        for s in seqs:
            per_tenant[s.tenant].append(s)
        for tenant, lst in per_tenant.items():
            lst.sort(key=lambda s: (0 if s.adapter is None or s.adapter.id in device else 1, _arrival(s)))
            queues[tenant] = deque(lst)
        heap = [(self.counters[t], min(_arrival(s) for s in q), t) for t, q in queues.items()]
        heapq.heapify(heap)
        out: list[Sequence] = []
        while heap:
            vt, first, tenant = heapq.heappop(heap)
            q = queues[tenant]
            s = q.popleft()
            out.append(s)
            if q:
                heapq.heappush(heap, (vt + max(1, s.remaining), first, tenant))
        return out

    def _drop_failed(self, waiting: list[Sequence]) -> list[Sequence]:
        """Report requests whose adapter failed at once, even when no row is free for them."""
        rt = self.runtime
        if rt is None:
            return waiting
        keep = []
        for s in waiting:
            if s.adapter is not None and rt.manager.state(s.adapter).state == "failed":
                rt.admit(s, [], protect=self._busy)  # records the reason, or retries once it expired
                if rt.failure(s) is not None:
                    if s not in self._failed:
                        self._failed.append(s)
                    continue
            keep.append(s)
        return keep

    def _device_ids(self) -> set[str]:
        if self.runtime is None:
            return set()
        return set(self.runtime.manager.resident()["device"])

    # --- admission --------------------------------------------------------------------------
    def admit(self, seq: Sequence, batch: list[Sequence]) -> bool:
        rt = self.runtime
        if seq.adapter is None or rt is None:
            return True
        key = seq.adapter.id
        if seq.seq_id in rt.held():
            return True  # preempted earlier: it kept its slot
        if self.drain is not None and key != self.drain:
            return False
        aged = self._aged(seq)
        protect = () if aged else self._busy - {key}
        if rt.admit(seq, batch, protect=protect):
            if key == self.drain:
                self.drain = None
            return True
        if rt.failure(seq) is not None:
            if seq not in self._failed:
                self._failed.append(seq)
        elif aged and rt.manager.ready(seq.adapter) and self.drain is None:
            self.drain = key
        return False

    def take_failed(self) -> list[tuple[Sequence, str]]:
        """Sequences whose adapter failed to load, with the reason (each reported once)."""
        rt = self.runtime
        if rt is None:
            return []  # without adapters none fails
        out = [(s, rt.failure(s) or "adapter load failed") for s in self._failed]
        self._failed = []
        return out

    # --- accounting -------------------------------------------------------------------------
    def charge(self, chunks: list[tuple[Sequence, int]]) -> None:
        """Add each chunk's newly served tokens to its tenant (recomputation is free)."""
        for seq, n in chunks:
            done = seq.num_computed + n
            charged = seq.extra.get("vtc_charged", 0)
            if done > charged:
                self.counters[seq.tenant] += done - charged
                seq.extra["vtc_charged"] = done


def _arrival(seq: Sequence) -> tuple[float, int]:
    return (seq.arrival, seq.seq_id)
