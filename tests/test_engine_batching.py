"""Batch invariance: a sequence yields the same tokens alone and inside a mixed batch,
with chunked prefill and preemption (forced by a tiny KV pool) in play."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.kv_cache import block_bytes
from engine.sequence import SamplingParams
from tests.engine_fixtures import demo_gguf, make_tiny_model  # noqa: F401


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_batch"), "llama", seed=11)


def _engine(path, blocks: int, budget: int = 48, block_size: int = 8, native: bool = True) -> Engine:
    probe = Engine.from_path(path, EngineConfig(kv_cache_bytes=1 << 20, kv_block_size=block_size))
    per_block = block_bytes(probe.model.cfg, block_size, torch.float32)
    return Engine.from_path(path, EngineConfig(kv_cache_bytes=blocks * per_block, kv_block_size=block_size,
                                               max_num_batched_tokens=budget, max_num_seqs=8,
                                               native_kernels=native))


def _alone(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    (seq,) = engine.generate([prompt], params)
    return seq.output_ids


@pytest.mark.parametrize("native", [True, False], ids=["native-decode", "torch-decode"])
def test_tiny_batch_invariance_with_preemption(tiny_dir, native):
    gen = torch.Generator().manual_seed(5)
    lengths = [7, 33, 12, 60, 3, 25]
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in lengths]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=40, ignore_eos=True)
    params = [greedy, seeded, greedy, seeded, greedy, greedy]
    roomy = _engine(tiny_dir, blocks=256, native=native)
    alone = [_alone(roomy, p, sp) for p, sp in zip(prompts, params, strict=True)]
    # 24 blocks x 8 tokens = 192 slots for ~360 tokens of demand: preemption must happen.
    tight = _engine(tiny_dir, blocks=24, native=native)
    seqs = tight.generate(prompts, params)
    assert sum(s.num_preemptions for s in seqs) > 0
    for s, ref in zip(seqs, alone, strict=True):
        assert s.output_ids == ref
    assert tight.cache.allocator.num_used == 0


def test_abort_mid_batch_frees_blocks_and_others_continue(tiny_dir):
    eng = _engine(tiny_dir, blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ref = _alone(eng, list(range(5, 25)), params)
    keep = eng.add_request(list(range(5, 25)), params)
    drop = eng.add_request(list(range(30, 70)), params)
    for _ in range(5):
        eng.step()
    used = eng.cache.allocator.num_used
    eng.abort(drop)
    assert eng.cache.allocator.num_used < used
    while not keep.is_finished:
        eng.step()
    assert keep.output_ids == ref and drop.finish_reason == "abort"
    assert eng.cache.allocator.num_used == 0


def test_stop_strings_stop_ids_and_context_limit(tiny_dir):
    eng = _engine(tiny_dir, blocks=64)
    prompt = list(range(10, 30))
    free = _alone(eng, prompt, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    # Stop at the first occurrence of a later token id.
    (s,) = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                 stop_token_ids=(free[5],)))
    assert s.finish_reason == "stop" and s.output_ids == free[:free.index(free[5]) + 1]
    # A stop string taken from the free-running text ends the output before it.
    text = eng.tokenizer.decode(free)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if stop.strip():
        (s2,) = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                      stop=(stop,)))
        assert s2.finish_reason == "stop" and stop not in s2.output_text
        assert text.startswith(s2.output_text)
    # The context limit ends generation with "length".
    eng.max_model_len = len(prompt) + 4
    (s3,) = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    assert s3.finish_reason == "length" and len(s3.output_ids) == 4


@pytest.mark.slow
def test_demo_batch_invariance_with_preemption(demo_gguf):  # noqa: F811
    roomy = Engine.from_path(demo_gguf, EngineConfig(kv_cache_bytes=1 << 27, max_num_batched_tokens=64))
    tok = roomy.tokenizer
    questions = ["Name a fruit.", "What is 2 plus 2?", "Describe the moon in one sentence.",
                 "Give me a word that rhymes with cat.", "Why is the sky blue?"]
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [_alone(roomy, p, params) for p in prompts]
    per_block = block_bytes(roomy.model.cfg, 16, torch.float32)
    tight = Engine.from_path(demo_gguf, EngineConfig(kv_cache_bytes=12 * per_block, max_num_batched_tokens=64))
    seqs = tight.generate(prompts, params)
    assert sum(s.num_preemptions for s in seqs) > 0
    assert [s.output_ids for s in seqs] == alone


def test_bfloat16_path_runs_and_tracks_float32(tiny_dir):
    """The reduced-precision path CUDA uses, exercised on CPU: same shapes, close logits."""
    from engine.scoring import forced_logits
    from tests.engine_fixtures import rel_err

    ids = list(range(3, 60))
    f32 = Engine.from_path(tiny_dir, EngineConfig(kv_cache_bytes=1 << 20))
    bf16 = Engine.from_path(tiny_dir, EngineConfig(kv_cache_bytes=1 << 20, dtype="bfloat16"))
    assert bf16.cache.k[0].dtype == torch.bfloat16
    a = forced_logits(f32, ids, 40)
    b = forced_logits(bf16, ids, 40)
    assert b.dtype == torch.float32 and rel_err(b, a) < 0.05
    (s,) = bf16.generate([ids], SamplingParams(temperature=0.7, top_k=20, seed=1, max_tokens=8, ignore_eos=True))
    assert len(s.output_ids) == 8
