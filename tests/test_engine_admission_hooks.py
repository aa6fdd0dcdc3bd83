"""The scheduler's admission policy interface: ``admit`` is required, the other hooks default to
nothing, and the scheduler calls each hook when its documentation says."""

from __future__ import annotations

import pytest

from engine.kv_cache import BlockAllocator
from engine.scheduler import AdmissionPolicy, AdmitAll, Scheduler
from engine.sequence import SamplingParams, Sequence
from loraplex.wire import PRIORITY_CLASSES


def _sched(policy: AdmissionPolicy | None = None) -> Scheduler:
    return Scheduler(BlockAllocator(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_waiting=16, policy=policy)


def _seq(n: int = 3, priority: int = PRIORITY_CLASSES["normal"]) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=4), priority=priority)


class Recording(AdmissionPolicy):
    """Admits everything, newest first, and records what the scheduler tells it."""

    def __init__(self) -> None:
        self.orders: list[tuple[list[Sequence], list[Sequence]]] = []
        self.charges: list[list[tuple[Sequence, int]]] = []

    def admit(self, seq: Sequence, batch: list[Sequence]) -> bool:
        return True

    def order(self, waiting: list[Sequence], running: list[Sequence]) -> list[Sequence]:
        self.orders.append((list(waiting), list(running)))
        return list(reversed(waiting))

    def charge(self, chunks: list[tuple[Sequence, int]]) -> None:
        self.charges.append(list(chunks))


def test_admit_is_the_one_hook_a_policy_must_define():
    class NoAdmit(AdmissionPolicy):
        pass

    with pytest.raises(TypeError):
        NoAdmit()


def test_the_optional_hooks_default_to_nothing():
    policy = AdmitAll()
    a, b = _seq(), _seq()
    assert policy.order([a, b], [a]) == [a, b], "the queue's own order"
    assert policy.charge([(a, 3)]) is None
    assert policy.take_failed() == []


def test_without_an_order_hook_candidates_join_by_priority_then_arrival():
    s = _sched()
    low, first, high = _seq(priority=PRIORITY_CLASSES["low"]), _seq(), _seq(priority=PRIORITY_CLASSES["high"])
    for q in (low, first, high):
        s.add(q)
    assert [q for q, _ in s.schedule().chunks] == [high, first, low]


def test_the_scheduler_asks_the_order_while_some_wait_and_charges_steps_that_serve():
    policy = Recording()
    s = _sched(policy)
    assert s.schedule().chunks == [] and policy.orders == [] and policy.charges == [], "an empty step: no hook"
    a, b = _seq(), _seq()
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert policy.orders == [([a, b], [])]
    assert [q for q, _ in out.chunks] == [b, a], "the policy's order"
    assert policy.charges == [out.chunks]
    c = _seq()
    s.add(c)
    out = s.schedule()
    assert policy.orders[-1] == ([c], [b, a]), "the running sequences beside the waiting ones"
    assert policy.charges[-1] == out.chunks and len(out.chunks) == 3
    out = s.schedule()
    assert len(policy.orders) == 2, "nothing waits: no order asked"
    assert policy.charges[-1] == out.chunks
