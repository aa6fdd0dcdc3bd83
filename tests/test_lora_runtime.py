"""LoRARuntime: admission takes slots, prepare_batch maps token rows to them, release frees them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from engine.lora.manager import AdapterLoadError, AdapterManager
from engine.lora.runtime import LoRARuntime
from engine.lora.slots import SlotBank
from loraplex.wire import AdapterRef
from tests.test_lora_manager import TINY, make_adapter, ref_for


@dataclass
class Seq:
    seq_id: int
    adapter: AdapterRef | None


def runtime(tmp_path, slots=2, max_loras=4, ttl=60.0):
    bank = SlotBank.for_model(TINY, (8, 16), slots_per_class=slots)
    m = AdapterManager(TINY, bank, max_loras=max_loras, cache_dir=str(tmp_path / "cache"), failure_ttl_s=ttl)
    return LoRARuntime(m)


def wait_ready(rt, ref, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not rt.manager.ready(ref):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_admission_prefetches_then_admits(tmp_path):
    rt = runtime(tmp_path)
    a = ref_for(make_adapter(tmp_path / "a", 1), "a")
    seq = Seq(1, a)
    assert rt.admit(Seq(0, None), [])
    assert not rt.admit(seq, []), "not admitted before its adapter is in host memory"
    wait_ready(rt, a)
    assert rt.admit(seq, []) and rt.admit(seq, []), "re-admission (after preemption) keeps the slot"
    assert rt.manager.state(a).users == 1
    rt.release(seq)
    assert rt.manager.state(a).users == 0 and rt.held() == {}
    rt.manager.close()


def test_slots_full_defers_admission_until_release(tmp_path):
    rt = runtime(tmp_path, slots=1)
    a, b = (ref_for(make_adapter(tmp_path / n, i), n) for i, n in enumerate("ab"))
    for r in (a, b):
        rt.manager.prefetch(r)
        wait_ready(rt, r)
    sa, sb = Seq(1, a), Seq(2, b)
    assert rt.admit(sa, [])
    assert not rt.admit(sb, []), "the only rank-8 slot is in use"
    assert rt.admit(Seq(3, a), []), "a sequence on a resident adapter still gets in"
    rt.release(sa)
    rt.release(Seq(3, a))
    assert rt.admit(sb, [])
    rt.manager.close()


def test_failed_adapter_reports_reason(tmp_path):
    rt = runtime(tmp_path)
    bad = AdapterRef(id="bad", name="bad", uri=(tmp_path / "missing").as_uri())
    seq = Seq(1, bad)
    assert not rt.admit(seq, [])
    deadline = time.monotonic() + 10
    while rt.manager.state(bad).state == "loading":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not rt.admit(seq, [])
    assert "does not exist" in rt.failure(seq)
    rt.manager.close()


def test_prepare_batch_maps_rows_to_slots(tmp_path):
    rt = runtime(tmp_path)
    a = ref_for(make_adapter(tmp_path / "a", 1), "a")
    b = ref_for(make_adapter(tmp_path / "b", 2, rank=16), "b")
    seqs = [Seq(1, a), Seq(2, None), Seq(3, b)]
    for s in seqs:
        rt.prefetch(s)
    for r in (a, b):
        wait_ready(rt, r)
    assert all(rt.admit(s, []) for s in seqs)
    ctx = SimpleNamespace(seqs=seqs, token_seq=torch.tensor([0, 0, 0, 1, 2, 2]), lora="unset", seq_slots=None)
    rt.prepare_batch(ctx)
    sa, sb = rt.manager.slot_of(a), rt.manager.slot_of(b)
    assert ctx.seq_slots.tolist() == [sa, -1, sb]
    assert ctx.lora.token_slots.tolist() == [sa, sa, sa, -1, sb, sb]
    x = torch.randn(6, TINY.hidden_size)
    out0 = torch.randn(6, TINY.num_heads * TINY.head_dim)
    out = out0.clone()
    ctx.lora.apply(0, "q_proj", x, out)
    assert torch.equal(out[3], out0[3]) and not torch.equal(out[0], out0[0])
    base_only = SimpleNamespace(seqs=[Seq(4, None)], token_seq=torch.tensor([0, 0]), lora="unset", seq_slots=None)
    rt.prepare_batch(base_only)
    assert base_only.lora is None
    for s in seqs:
        rt.release(s)
    assert rt.manager.state(a).users == 0 and rt.manager.state(b).users == 0
    rt.manager.close()


def test_prepare_batch_never_acquires_a_slot(tmp_path):
    """Admission is the only place a slot is taken: a sequence that skipped it fails (its adapter
    named, so only that adapter's rows fail) and no slot user is added."""
    rt = runtime(tmp_path)
    a = ref_for(make_adapter(tmp_path / "a", 1), "a")
    rt.manager.prefetch(a)
    wait_ready(rt, a)
    ctx = SimpleNamespace(seqs=[Seq(1, None), Seq(2, a)], token_seq=torch.tensor([0, 1]), lora="unset",
                          seq_slots=None)
    with pytest.raises(AdapterLoadError) as err:
        rt.prepare_batch(ctx)
    assert err.value.adapter_id == a.id and "without its adapter slot" in str(err.value)
    assert rt.manager.state(a).users == 0 and rt.held() == {}
    rt.manager.close()


def test_an_abort_during_a_step_keeps_the_adapter_slot_until_the_forward_ends(tmp_path):
    """A client that goes away while its step is between scheduling and the forward (the abort
    comes from the event loop's thread) must not pull its adapter's slot from under the batch:
    the other request on the same adapter in that step finishes normally."""
    from engine.sequence import SamplingParams
    from tests.lora_fixtures import (
        ISOLATION_SPECS,
        attach_runtime,
        model_info,
        peft_adapters,
        refs_for,
        run_to_completion,
        save_tiny_llama,
        tiny_engine,
    )

    base_dir = save_tiny_llama(tmp_path / "base")
    name = next(iter(ISOLATION_SPECS))
    _, dirs = peft_adapters(base_dir, tmp_path / "adapters", {name: ISOLATION_SPECS[name]})
    ref = refs_for(dirs)[name]
    engine = tiny_engine(base_dir)
    rt = attach_runtime(engine, model_info(base_dir), tmp_path / "cache")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    leaving = engine.add_request([5, 6, 7, 8], params, adapter=ref)
    staying = engine.add_request([9, 10, 11], params, adapter=ref)
    prepare = rt.prepare_batch
    aborted = []

    def abort_first(ctx):
        if not aborted and leaving in ctx.seqs:
            aborted.append(leaving)
            engine.abort(leaving)  # as the event loop would, after the step was scheduled
        prepare(ctx)

    rt.prepare_batch = abort_first
    run_to_completion(engine, [leaving, staying])
    assert aborted == [leaving] and leaving.finish_reason == "abort"
    assert staying.finish_reason == "length" and len(staying.output_ids) == 6
    assert rt.manager.state(ref.id).users == 0, "the aborted request's slot is given back after the forward"
    rt.manager.close()


def test_an_abort_between_scheduling_and_the_batch_keeps_the_blocks_until_the_forward_ends(tmp_path):
    """A client that goes away after its step was scheduled, before the batch is built from the
    block tables: its blocks stay with the step (freed when the forward ends), so the step and
    every other request in it go on; none of its tokens is reported after the abort."""
    import engine.engine as engine_module
    from engine.sequence import SamplingParams
    from tests.lora_fixtures import run_to_completion, save_tiny_llama, tiny_engine

    engine = tiny_engine(save_tiny_llama(tmp_path / "base"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    events = []
    leaving = engine.add_request([5, 6, 7, 8, 9], params, listener=events.append)
    staying = [engine.add_request([9, 10, 11 + i], params) for i in range(3)]
    engine.step()  # everyone prefilled; the next step decodes them all
    build = engine_module.build_batch
    aborted = []

    def abort_then_build(chunks, *args):
        if not aborted:
            aborted.append(leaving)
            engine.abort(leaving)  # as the event loop would, after the step was scheduled
            assert leaving.block_table, "the step still holds the aborted sequence's blocks"
        return build(chunks, *args)

    engine_module.build_batch = abort_then_build
    try:
        run_to_completion(engine, staying)
    finally:
        engine_module.build_batch = build
    assert aborted == [leaving] and leaving.finish_reason == "abort" and leaving.block_table == []
    assert all(s.finish_reason == "length" and len(s.output_ids) == 6 for s in staying)
    assert len(events) == 1 and not events[0].finished, "no event after the abort"
    assert engine.cache.allocator.num_used == 0, "every block is back in the pool"
