"""Our forward pass against transformers on the same weights (float32, relative error < 1e-4)."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.engine import Engine, EngineConfig
from engine.scoring import forced_logits
from engine.sequence import SamplingParams
from tests.engine_fixtures import (
    demo_gguf,  # noqa: F401  (fixture)
    hf_demo_model,
    hf_demo_tokenizer,
    make_tiny_model,
    rel_err,
)

pytestmark = pytest.mark.slow

TOL = 1e-4


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("native", [True, False], ids=["native-decode", "torch-decode"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama3"])
def test_tiny_models_match_transformers(tmp_path, kind, native):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path, kind, seed=3)
    cfg = ModelConfig.from_hf_dir(path)
    assert cfg.num_kv_heads < cfg.num_heads  # grouped-query attention
    if kind == "qwen2":
        assert cfg.attention_bias and cfg.tie_word_embeddings
    if kind == "llama3":
        assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = Engine.from_path(path, EngineConfig(kv_cache_bytes=1 << 22, kv_block_size=16, native_kernels=native))
    assert (eng.model.decode_kernel is not None) == native
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (200,), generator=gen).tolist()
    prefill = 150  # beyond the llama3 config's original context (64): scaling matters
    ours = forced_logits(eng, ids, prefill)
    ref = _hf_logits(ref_model, ids)[prefill - 1:]
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < TOL
    assert eng.cache.allocator.num_used == 0


def test_demo_prefill_and_decode_logits_match(demo_gguf):  # noqa: F811
    hf = hf_demo_model()
    eng = Engine.from_path(demo_gguf, EngineConfig(kv_cache_bytes=1 << 26))
    msgs = [{"role": "user", "content": "Write one sentence about the sea."}]
    prompt = eng.tokenizer.encode_chat(msgs)
    with torch.no_grad():
        cont = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    ids = prompt + cont
    ours = forced_logits(eng, ids, len(prompt))
    ref = _hf_logits(hf, ids)[len(prompt) - 1:]
    assert rel_err(ours, ref) < TOL


PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "List three colours."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "Explain gravity to a child in two sentences."}],
]


def test_demo_greedy_generation_equals_transformers(demo_gguf):  # noqa: F811
    hf = hf_demo_model()
    eng = Engine.from_path(demo_gguf, EngineConfig(kv_cache_bytes=1 << 26, max_num_batched_tokens=64))
    prompts = [eng.tokenizer.encode_chat(m) for m in PROMPTS]
    # All prompts in one engine run: mixed lengths, chunked prefill (budget 64), continuous batching.
    seqs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
    for p, s in zip(prompts, seqs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p):].tolist()
        eos = hf.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        if ref and ref[-1] in eos:
            assert s.finish_reason == "stop"
        assert s.output_ids == ref
    tok = hf_demo_tokenizer()
    assert seqs[0].output_text == tok.decode(seqs[0].output_ids, skip_special_tokens=True)
