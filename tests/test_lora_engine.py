"""Model level: the engine's forward with LoRARuntime equals PEFT, each row with its own adapter.

A tiny random Llama (saved as a Hugging Face directory) runs in the engine with a mixed
batch of sequences on four adapters (ranks 8, 16, 64 and an rsLoRA one) and the base model;
every sequence's logits and greedy tokens must equal PEFT's for that adapter alone. A
mix-up between rows would be a cross-tenant leak.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.lora.manager import AdapterManager
from engine.lora.runtime import LoRARuntime
from engine.lora.slots import SlotBank
from loraplex.wire import AdapterRef
from tests.test_lora_peft import ALL, TINY, _peft_model, _tiny_llama

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _save_base(path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    _tiny_llama().save_pretrained(str(path), safe_serialization=True)
    tk = Tokenizer(WordLevel({f"t{i}": i for i in range(TINY.vocab_size)}, unk_token="t0"))
    tk.pre_tokenizer = Whitespace()
    tk.save(str(path / "tokenizer.json"))


@pytest.mark.slow
def test_engine_mixed_batch_matches_peft_per_adapter(tmp_path):
    from engine.sequence import SamplingParams

    specs = {
        "default": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
        "r16": {"r": 16, "lora_alpha": 8, "target_modules": ALL},
        "r64": {"r": 64, "lora_alpha": 32, "target_modules": ALL},
        "rs": {"r": 16, "lora_alpha": 32, "use_rslora": True, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    }
    peft_model, dirs = _peft_model(tmp_path, specs)
    base_dir = tmp_path / "base"
    _save_base(base_dir)
    engine = Engine.from_path(base_dir, EngineConfig(
        kv_cache_bytes=4 * 1024 * 1024, max_model_len=64))
    bank = SlotBank.for_model(TINY, (8, 16, 32, 64), slots_per_class=4)
    rt = LoRARuntime(AdapterManager(TINY, bank, max_loras=8, cache_dir=str(tmp_path / "cache")))
    engine.lora_runtime = rt
    engine.scheduler.policy = rt
    captured: dict[int, list[torch.Tensor]] = {}
    forward = engine.model.forward

    def spy(ctx, cache):
        logits = forward(ctx, cache)
        for row, i in enumerate(ctx.sample_seqs):
            captured.setdefault(ctx.seqs[i].seq_id, []).append(logits[row].detach().clone())
        return logits

    engine.model.forward = spy
    refs = {n: AdapterRef(id=f"id-{n}", name=n, uri=d.as_uri()) for n, d in dirs.items()}
    g = torch.Generator().manual_seed(4)
    plan = [("default", 5), (None, 7), ("r16", 3), ("r64", 9), ("rs", 4), ("default", 6), ("r64", 2)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    seqs = []
    for name, n in plan:
        prompt = torch.randint(1, TINY.vocab_size, (n,), generator=g).tolist()
        seqs.append((name, prompt, engine.add_request(prompt, params, adapter=refs[name] if name else None)))
    deadline = time.monotonic() + 60
    while not all(s.is_finished for _, _, s in seqs):
        assert time.monotonic() < deadline, "engine did not finish"
        if not engine.step():
            time.sleep(0.005)
    assert all(rt.manager.state(r).users == 0 for r in refs.values()), "finished sequences release their slots"

    for name, prompt, seq in seqs:
        ids = list(prompt)
        steps = captured[seq.seq_id]
        assert len(steps) == 4
        for step_logits in steps:
            with torch.no_grad():
                if name is None:
                    with peft_model.disable_adapter():
                        ref = peft_model(input_ids=torch.tensor([ids])).logits[0, -1]
                else:
                    peft_model.set_adapter(name)
                    ref = peft_model(input_ids=torch.tensor([ids])).logits[0, -1]
            err = (step_logits - ref).abs().max() / ref.abs().max()
            assert err < 1e-4, (name, len(ids), float(err))
            ids.append(int(ref.argmax()))
        assert seq.output_ids == ids[len(prompt):], name
    rt.manager.close()


def test_a_cold_burst_loads_adapters_together_and_starts_each_request_when_its_own_is_in(tmp_path):
    """Four cold adapters at once on a running engine: two loads must be in flight together
    (each waits at a barrier for the other), the requests on loaded adapters run to the end
    while a third adapter's load is still held, and the engine gives a core back to the loaders
    while they run."""
    import threading

    from engine.sequence import SamplingParams

    specs = {n: {"r": 8, "lora_alpha": 16, "target_modules": ALL} for n in ("a", "b", "slow", "d")}
    _peft, dirs = _peft_model(tmp_path, specs)
    base_dir = tmp_path / "base"
    _save_base(base_dir)
    engine = Engine.from_path(base_dir, EngineConfig(kv_cache_bytes=4 * 1024 * 1024, max_model_len=64))
    bank = SlotBank.for_model(TINY, (8,), slots_per_class=4)
    manager = AdapterManager(TINY, bank, max_loras=4, cache_dir=str(tmp_path / "cache"), loader_threads=2)
    rt = LoRARuntime(manager)
    engine.lora_runtime = rt
    engine.scheduler.policy = rt
    together = threading.Barrier(2, timeout=30)
    release_slow = threading.Event()
    read_dir = manager._read_dir

    def gated(ref, directory):
        if ref.name in ("a", "b"):
            together.wait()  # BrokenBarrierError (a failed load) unless both loads run at once
        if ref.name == "slow":
            assert release_slow.wait(60)
        return read_dir(ref, directory)

    manager._read_dir = gated
    refs = {n: AdapterRef(id=f"id-{n}", name=n, uri=d.as_uri()) for n, d in dirs.items()}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.start()
    try:
        seqs = {n: engine.add_request([1, 2, 3, 4], params, adapter=refs[n]) for n in ("a", "b", "slow", "d")}
        deadline = time.monotonic() + 60
        while not all(seqs[n].is_finished for n in ("a", "b", "d")):
            assert time.monotonic() < deadline, "requests on loaded adapters did not finish"
            time.sleep(0.01)
        assert all(seqs[n].finish_reason == "length" for n in ("a", "b", "d")), \
            {n: (s.finish_reason, s.error) for n, s in seqs.items()}
        assert not seqs["slow"].is_finished and manager.loading() == 1
        assert engine._team(2) == 1 and engine._team(1) == 1, "one core to the load in flight"
        release_slow.set()
        while not seqs["slow"].is_finished:
            assert time.monotonic() < deadline, "the held adapter's request did not finish once loaded"
            time.sleep(0.01)
        assert seqs["slow"].finish_reason == "length" and len(seqs["slow"].output_ids) == 6
        assert manager.loading() == 0 and engine._team(2) == 2
    finally:
        release_slow.set()
        engine.close()
        manager.close()
