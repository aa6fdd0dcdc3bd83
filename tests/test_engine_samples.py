"""``n`` > 1: samples share their prompt's KV blocks, each draws with its own seed stream and
gives exactly what a separate request with that seed gives."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.engine import Engine, EngineConfig
from engine.sequence import SamplingParams
from tests.engine_fixtures import make_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.from_path(make_tiny_model(tmp_path_factory.mktemp("tiny_n"), "llama"),
                           EngineConfig(kv_cache_bytes=4 << 20, kv_block_size=8, max_num_seqs=16))
    yield eng
    eng.close()


def _run(engine: Engine, prompt: list[int], params: list[SamplingParams]) -> tuple[list[list[int]], int, int]:
    """Outputs (every sample), tokens put through the model, peak KV blocks in use."""
    firsts = [engine.add_request(prompt, p) for p in params]
    seqs = [s for f in firsts for s in (f.samples or [f])]
    tokens = peak = 0
    forward = engine.model.forward

    def counting(ctx, cache):
        nonlocal tokens
        tokens += ctx.num_tokens
        return forward(ctx, cache)

    engine.model.forward = counting
    try:
        while not all(s.is_finished for s in seqs):
            engine.step()
            peak = max(peak, engine.cache.allocator.num_used)
    finally:
        engine.model.forward = forward
    assert engine.cache.allocator.num_used == 0
    return [s.output_ids for s in seqs], tokens, peak


def test_n_samples_equal_separate_seeded_requests_and_share_the_prompt(engine, monkeypatch):
    monkeypatch.setattr(engine.scheduler, "prefix_cache", False)  # else separate requests share through it
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    p = SamplingParams(max_tokens=12, temperature=1.0, seed=40, ignore_eos=True)
    together, tokens_n, peak_n = _run(engine, prompt, [replace(p, n=4)])
    separate, tokens_sep, peak_sep = _run(engine, prompt, [replace(p, seed=40 + i) for i in range(4)])
    assert together == separate
    assert len({tuple(t) for t in together}) > 1  # the seed streams differ
    assert peak_n < peak_sep
    # the prompt goes through the model once, plus its last token once per other sample
    assert tokens_sep - tokens_n == 3 * (len(prompt) - 1)


def test_sample_that_finishes_early_does_not_free_what_others_share(engine):
    prompt = engine.tokenizer.encode("Hello world! How are you today? " * 3)
    # the first sample (whose prompt blocks the others hold too) is aborted mid-way
    first = engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=3, ignore_eos=True))
    engine.step()  # prefill of the first sample
    engine.step()  # the others join on its prompt blocks
    seqs = first.samples
    assert all(s.block_table[0] == first.block_table[0] for s in seqs)
    engine.abort(first)
    while not all(s.is_finished for s in seqs):
        engine.step()
    alone = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=2, ignore_eos=True))[0]
    assert seqs[1].output_ids == alone.output_ids
    assert engine.cache.allocator.num_used == 0
