"""The KV cache in bfloat16 under float32 activations (``LORAPLEX_KV_CACHE_DTYPE``).

K/V are rounded to bfloat16 when written (to nearest, ties to even) and widened back exactly
for the attention math, which stays float32: in the native decode kernel on load, on the
torch paths by ``KVCache.gather``. Checked here: the rounding and the pool operations, the
native kernel against a float64 softmax over the same widened pools, the native and torch
engines against each other, the setting and how ``auto`` resolves, twice the blocks in the
same bytes, cross-tenant isolation and non-finite containment with bfloat16 pools, and
(slow) accuracy against the float32 engine on the demo model.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import ModelConfig
from engine.engine import Engine, EngineConfig, resolve_kv_cache_dtype
from engine.kv_cache import KVCache, block_bytes
from engine.native import DecodeAttention, decode_attention_kernel, library, tile_matmul_kernel
from engine.scoring import agreement, forced_logits
from loraplex.settings import Settings
from tests.engine_fixtures import demo_gguf  # noqa: F401  (fixture)
from tests.lora_fixtures import (
    ISOLATION_SPECS,
    PeftReference,
    attach_runtime,
    model_info,
    peft_adapters,
    refs_for,
    rel_err,
    save_tiny_llama,
    tiny_engine,
)
from tests.test_engine_containment import (
    GREEDY,
    PROMPTS,
    _cache_finite,
    _engine,
    _good_rows,
    _ref,
    _run,
    _tokens,
    world,  # noqa: F401  (fixture)
)
from tests.test_engine_native import _reference
from tests.test_engine_weights import assert_rows_isolated

CPU = torch.device("cpu")
kernel = decode_attention_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="native kernels did not build here")
_tiles = tile_matmul_kernel()
HAS_AMX = _tiles is not None and _tiles.isa == "amx"
PATHS = [pytest.param(False, id="vector"),
         pytest.param(True, id="amx", marks=pytest.mark.skipif(not HAS_AMX, reason="no AMX on this CPU"))]


def _path_kernel(amx: bool) -> DecodeAttention:
    """The decode kernel with its scores on AMX tiles or on the vector path."""
    return DecodeAttention(library(), amx=amx)


def _cfg(layers: int = 2, kv_heads: int = 3, head_dim: int = 8) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=32, hidden_size=kv_heads * head_dim * 2,
                       intermediate_size=16, num_layers=layers, num_heads=kv_heads * 2, num_kv_heads=kv_heads,
                       head_dim=head_dim, context_length=64)


# --- the pool ---------------------------------------------------------------------------------

def test_write_rounds_to_nearest_even_and_gather_widens_exactly():
    cfg = _cfg()
    cache = KVCache(cfg, 6, 4, CPU, torch.bfloat16, torch.float32)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(5, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    v = torch.randn(5, cfg.num_kv_heads, cfg.head_dim, generator=gen)
    # Ties: 1 + 2^-8 lies halfway between two bfloat16 neighbours and rounds to the even one (1.0);
    # 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
    k[0, 0, :2] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8])
    slots = torch.tensor([0, 5, 6, 7, 21])
    cache.write(1, slots, k, v)
    assert cache.k[1].dtype == cache.v[1].dtype == torch.bfloat16
    assert cache.k[1][0, 0, :2].tolist() == [1.0, 1 + 2 ** -6]
    assert torch.equal(cache.k[1][:, slots], k.transpose(0, 1).bfloat16())
    assert torch.equal(cache.v[1][:, slots], v.transpose(0, 1).bfloat16())
    assert not cache.k[0].any(), "other layers untouched"
    kg, vg = cache.gather(1, torch.tensor([1, 5]))  # slots 4..7 and 20..23
    assert kg.dtype == vg.dtype == torch.float32 and kg.shape == (cfg.num_kv_heads, 8, cfg.head_dim)
    assert torch.equal(kg, cache.k[1][:, [*range(4, 8), *range(20, 24)]].float())
    assert torch.equal(vg, cache.v[1][:, [*range(4, 8), *range(20, 24)]].float())


def test_scrub_and_copy_blocks_work_on_bfloat16_pools():
    cfg = _cfg()
    cache = KVCache(cfg, 4, 4, CPU, torch.bfloat16, torch.float32)
    for pool in (*cache.k, *cache.v):
        pool.copy_(torch.randn(pool.shape))
    before = [p.clone() for p in (*cache.k, *cache.v)]
    cache.copy_blocks([(1, 3)])
    for pool, old in zip((*cache.k, *cache.v), before, strict=True):
        assert torch.equal(pool[:, 12:16], old[:, 4:8]) and torch.equal(pool[:, :12], old[:, :12])
    cache.scrub(slots=torch.tensor([2]), blocks=[1])
    for pool in (*cache.k, *cache.v):
        assert not pool[:, 2].any() and not pool[:, 4:8].any()
        assert pool[:, 0].all() and pool[:, 12:16].all()


def test_the_same_bytes_hold_twice_the_blocks_in_bfloat16():
    cfg = _cfg(layers=3, kv_heads=2, head_dim=16)
    assert block_bytes(cfg, 16, torch.float32) == 2 * block_bytes(cfg, 16, torch.bfloat16)
    budget = 10 * block_bytes(cfg, 16, torch.float32) + 1000
    f32 = KVCache.from_bytes(cfg, budget, 16, CPU, torch.float32)
    bf16 = KVCache.from_bytes(cfg, budget, 16, CPU, torch.bfloat16, torch.float32)
    assert (f32.num_blocks, bf16.num_blocks) == (10, 20)
    assert sum(p.nbytes for p in (*bf16.k, *bf16.v)) == sum(p.nbytes for p in (*f32.k, *f32.v))


# --- the native kernel ------------------------------------------------------------------------

@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (8, 4, 64, 16), (16, 4, 64, 8), (8, 8, 32, 4), (16, 2, 128, 16),
                          (4, 1, 80, 8)])
@pytest.mark.parametrize("scattered", [False, True], ids=["rows-0..B", "mixed-rows"])
@pytest.mark.parametrize("amx", PATHS)
def test_bf16_kv_kernel_matches_softmax_over_the_widened_pools(heads, kv_heads, head_dim, block_size, scattered,
                                                                 amx):
    gen = torch.Generator().manual_seed(heads * 17 + head_dim + block_size)
    num_blocks, batch, nb = 64, 5, 5
    k_pool = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).bfloat16()
    v_pool = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).bfloat16()
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 5 * block_size])
    table = torch.randperm(num_blocks, generator=gen)[:batch * nb].view(batch, nb).contiguous()
    for b, length in enumerate(lens.tolist()):
        table[b, -(-length // block_size):] = 0
    t = batch + 3 if scattered else batch
    q = torch.randn(t, heads + 2 * kv_heads, head_dim, generator=gen)[:, :heads] * 2
    rows = torch.tensor([1, 2, 4, 5, 7]) if scattered else torch.arange(batch)
    out = torch.full((t, heads * head_dim), 7.0)
    _path_kernel(amx)(q, k_pool, v_pool, table, lens, int(lens.max()), block_size, out,
                      rows=rows if scattered else None)
    ref = _reference(q, k_pool.float(), v_pool.float(), table, lens, block_size, rows)
    # float32 scores of up to ~60 (q * 2, unscaled) leave ~1e-5 in the softmax. Measured over
    # 30 seeds of these shapes: the float32 kernel over the widened values errs by up to
    # 1.5e-5, this variant (other vector code, other rounding) by up to 2.4e-5.
    torch.testing.assert_close(out[rows].double(), ref[rows], rtol=1e-5, atol=3e-5)
    untouched = torch.ones(t, dtype=torch.bool)
    untouched[rows] = False
    assert bool((out[untouched] == 7.0).all())


@pytest.mark.skipif(not HAS_AMX, reason="no AMX on this CPU")
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(9, 3, 16), (8, 4, 32), (4, 4, 16), (8, 2, 16)])
def test_amx_scores_match_the_vector_path_for_prefill_groups_and_stale_blocks(heads, kv_heads, block_size):
    """The AMX path (queries split into three bfloat16 parts) against the vector path and a float64
    softmax: decode rows, a prefill chunk's rows (one block table, each one key longer: they share
    a pass, up to 16 query columns), both outputs, and non-finite stale keys past every length."""
    gen = torch.Generator().manual_seed(heads * 7 + block_size)
    num_blocks, nb, d = 48, 6, 64
    k_pool = torch.randn(kv_heads, num_blocks * block_size, d, generator=gen).bfloat16()
    v_pool = torch.randn(kv_heads, num_blocks * block_size, d, generator=gen).bfloat16()
    chunk = 11  # prefill rows of one sequence, lengths 70..80
    decode = torch.tensor([1, 17, block_size * 3 + 5])
    lens = torch.cat([decode, torch.arange(70, 70 + chunk)])
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(lens), nb, dtype=torch.int64)
    used = set()
    for b in range(len(decode)):
        n = -(-int(decode[b]) // block_size)
        table[b, :n] = perm[b * nb:b * nb + n]
        used.update(table[b, :n].tolist())
    n = -(-80 // block_size)
    table[len(decode):, :n] = perm[3 * nb:3 * nb + n]
    used.update(perm[3 * nb:3 * nb + n].tolist())
    for blk in used:  # slots past each row's length hold stale non-finite keys and values
        for pool in (k_pool, v_pool):
            seg = pool[:, blk * block_size:(blk + 1) * block_size]
            seg[:, :] = torch.where(torch.rand(seg.shape, generator=gen) < 0.5, seg, float("nan"))
    slots_in_use = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for b, length in enumerate(lens.tolist()):
        pos = torch.arange(length)
        slots_in_use[table[b][pos // block_size] * block_size + pos % block_size] = True
    for pool in (k_pool, v_pool):
        fresh = torch.randn(pool.shape, generator=gen).bfloat16()
        pool[:, slots_in_use] = fresh[:, slots_in_use]
    q = torch.randn(len(lens), heads, d, generator=gen) * 8 / d ** 0.5
    ref = _reference(q, k_pool.float(), v_pool.float(), table, lens, block_size, torch.arange(len(lens)))
    outs = {}
    for amx in (False, True):
        out = torch.empty(len(lens), heads * d)
        _path_kernel(amx)(q, k_pool, v_pool, table, lens, int(lens.max()), block_size, out)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=3e-5)
        low = torch.empty(len(lens), heads * d, dtype=torch.bfloat16)
        _path_kernel(amx)(q, k_pool, v_pool, table, lens, int(lens.max()), block_size, low)
        assert bool(torch.isfinite(low.float()).all())
        outs[amx] = out
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-5, atol=1e-5)


@needs_kernel
def test_engine_kernel_scores_on_amx_where_the_cpu_has_it():
    assert kernel.amx == HAS_AMX


@needs_kernel
def test_kernel_refuses_pools_of_two_dtypes():
    q = torch.randn(1, 1, 4)
    pool = torch.zeros(1, 16, 4)
    with pytest.raises(AssertionError, match="KV pools"):
        kernel(q, pool.bfloat16(), pool, torch.tensor([[0]]), torch.tensor([1]), 1, 16, torch.empty(1, 4))


# --- the setting ------------------------------------------------------------------------------

def test_kv_cache_dtype_resolves_as_documented(monkeypatch):
    f32, bf16 = torch.float32, torch.bfloat16
    cuda = torch.device("cuda")
    assert resolve_kv_cache_dtype("auto", f32, bf16, CPU) == bf16  # bfloat16 weights on CPU
    assert resolve_kv_cache_dtype("", f32, f32, CPU) == f32
    assert resolve_kv_cache_dtype("auto", f32, bf16, cuda) == f32  # the rule is for CPU
    assert resolve_kv_cache_dtype("auto", bf16, bf16, cuda) == bf16
    assert resolve_kv_cache_dtype("float32", f32, bf16, CPU) == f32  # forced
    assert resolve_kv_cache_dtype("bfloat16", f32, f32, CPU) == bf16
    assert resolve_kv_cache_dtype("bf16", bf16, bf16, cuda) == bf16
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        resolve_kv_cache_dtype("fp8", f32, f32, CPU)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        resolve_kv_cache_dtype("float16", torch.float16, torch.float16, cuda)
    with pytest.raises(ValueError, match="activations"):
        resolve_kv_cache_dtype("float32", bf16, bf16, cuda)
    with pytest.raises(ValueError, match="activations"):
        resolve_kv_cache_dtype("bfloat16", torch.float16, torch.float16, cuda)
    monkeypatch.setenv("LORAPLEX_KV_CACHE_DTYPE", "bfloat16")
    assert Settings.from_env().kv_cache_dtype == "bfloat16"


def test_worker_flag_sets_the_kv_cache_dtype():
    import argparse

    from engine.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    assert parser.parse_args(["worker", "--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
    assert parser.parse_args(["worker"]).kv_cache_dtype is None  # the environment's setting stands


@pytest.fixture(scope="module")
def lora_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16-kv")
    base_dir = save_tiny_llama(root / "base")
    model, dirs = peft_adapters(base_dir, root / "adapters", ISOLATION_SPECS)
    return base_dir, dirs, PeftReference(model), refs_for(dirs), root


def test_engines_pick_their_kv_cache_dtype_and_size_it_by_it(lora_world):
    base_dir = lora_world[0]
    f32 = tiny_engine(base_dir)
    auto_bf16 = tiny_engine(base_dir, weights="bfloat16")
    forced = tiny_engine(base_dir, weights="bfloat16", kv_cache_dtype="float32")
    bf16_kv = tiny_engine(base_dir, kv_cache_dtype="bfloat16")
    assert f32.cache.dtype == forced.cache.dtype == f32.cache.k[0].dtype == torch.float32
    assert auto_bf16.cache.dtype == bf16_kv.cache.dtype == bf16_kv.cache.v[-1].dtype == torch.bfloat16
    assert bf16_kv.cache.compute_dtype == torch.float32
    assert bf16_kv.cache.num_blocks == 2 * f32.cache.num_blocks == 2 * forced.cache.num_blocks


# --- engines ----------------------------------------------------------------------------------

def _forced(engine, prompt, total):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 128, (total,), generator=g).tolist()
    ids[:len(prompt)] = prompt
    return forced_logits(engine, ids, len(prompt))


@needs_kernel
def test_native_and_torch_attention_agree_on_bfloat16_pools(lora_world):
    """The same bfloat16 K/V through the native kernel and through gather + torch math."""
    base_dir = lora_world[0]
    native = tiny_engine(base_dir, kv_cache_dtype="bfloat16")
    torch_path = Engine.from_path(base_dir, EngineConfig(kv_cache_bytes=4 << 20, max_model_len=96,
                                                         kv_cache_dtype="bfloat16", native_kernels=False))
    assert native.model.decode_kernel is not None and torch_path.model.decode_kernel is None
    prompt = list(range(3, 40))
    a = _forced(native, prompt, 70)
    b = _forced(torch_path, prompt, 70)
    assert rel_err(a, b) < 1e-4


def test_bfloat16_kv_tracks_the_float32_engine(lora_world):
    """Tiny random model: K/V rounding moves logits by well under a percent of their range."""
    base_dir = lora_world[0]
    f32 = tiny_engine(base_dir)
    bf16 = tiny_engine(base_dir, kv_cache_dtype="bfloat16")
    prompt = list(range(3, 40))
    a = _forced(f32, prompt, 70)
    b = _forced(bf16, prompt, 70)
    err = rel_err(b, a)
    assert 0 < err < 2e-2, err  # not identical: the pools did round
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_mixed_batch_rows_equal_each_request_alone_with_bf16_kv(lora_world):
    """Cross-tenant isolation with bfloat16 pools (float32 weights): each row of a mixed batch
    equals the same request served alone, and is closer to PEFT for its own adapter than to
    any other's. Measured on this tiny random model against PEFT in float32: own adapter's
    error up to 0.062 of the logits' range (bfloat16 weights alone: 0.028), every other
    adapter's at least 13x that."""
    assert_rows_isolated(lora_world, 1e-4, kv_cache_dtype="bfloat16")


# --- non-finite containment with bfloat16 pools (see tests/test_engine_containment.py) --------

@pytest.fixture(scope="module", params=[True, False], ids=["native", "torch"])
def native(request) -> bool:
    return request.param


def _bf16_engine(world, native, kv_cache_bytes=1 << 20):  # noqa: F811
    eng = _engine(world, native, kv_cache_bytes, kv_cache_dtype="bfloat16")
    assert eng.cache.dtype == torch.bfloat16
    return eng


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["alpha1e38", "slot_nan"])
def test_poisoned_row_fails_alone_and_leaves_the_bf16_cache_finite(world, native, kind):  # noqa: F811
    from tests.test_engine_containment import _poke_nan_into_slot

    clean = _bf16_engine(world, native)
    try:
        expected = _tokens(_run(clean, _good_rows(world)))
    finally:
        clean.close()
    eng = _bf16_engine(world, native)
    try:
        if kind == "slot_nan":
            bad = _ref(kind, world.good["r8"])
            eng.lora_runtime.manager.prefetch(bad)
            _poke_nan_into_slot(eng, bad, math.nan)
        else:
            bad = _ref(kind, world.poison[kind])
        good = _good_rows(world)
        results = _run(eng, [*good[:2], (bad, PROMPTS[2], GREEDY), *good[2:]])
        bad_seq, bad_events = results.pop(2)
        assert _tokens(results) == expected
        assert bad_seq.finish_reason == "error" and bad_events[-1].error_code == "non_finite_output"
        assert _cache_finite(eng), "a non-finite K/V value stayed in the bfloat16 cache"
        assert _tokens(_run(eng, _good_rows(world))) == expected
    finally:
        eng.close()


@pytest.mark.slow
def test_bf16_blocks_reused_after_a_nan_row_give_fresh_engine_output(world, native):  # noqa: F811
    reuse = [(None, [11] * 20, GREEDY), (_ref("r8", world.good["r8"]), [12] * 5, GREEDY),
             (None, [13] * 3, GREEDY)]
    fresh = _bf16_engine(world, native, kv_cache_bytes=32 << 10)
    try:
        want = _tokens(_run(fresh, reuse))
    finally:
        fresh.close()
    eng = _bf16_engine(world, native, kv_cache_bytes=32 << 10)
    try:
        [(bad_seq, _)] = _run(eng, [(_ref("alpha1e38", world.poison["alpha1e38"]), [9] * 40, GREEDY)])
        assert bad_seq.finish_reason == "error"
        assert _cache_finite(eng)
        assert _tokens(_run(eng, reuse)) == want
    finally:
        eng.close()


@pytest.mark.slow
def test_stale_non_finite_bf16_keys_outside_the_context_are_ignored(world, native):  # noqa: F811
    rows = [(None, [11] * 20, GREEDY), (None, [13] * 3, GREEDY), (None, list(range(30, 70)), GREEDY)]
    clean = _bf16_engine(world, native)
    try:
        want = _tokens(_run(clean, rows))
    finally:
        clean.close()
    eng = _bf16_engine(world, native)
    try:
        for k in eng.cache.k:
            k.fill_(math.nan)  # every block free: all of it stale
        assert _tokens(_run(eng, rows)) == want
    finally:
        eng.close()


# --- accuracy on the demo model (slow) --------------------------------------------------------

CHATS = ["Write one sentence about the sea.", "Explain gravity to a child.", "Write a haiku about autumn.",
         "How do I sort a list in Python?"]


@pytest.mark.slow
def test_demo_bf16_kv_tracks_float32(demo_gguf, tmp_path):  # noqa: F811
    """Measured on the demo model (SmolLM2-135M), bfloat16 K/V with float32 weights against
    float32 throughout: top-1 agreement 0.99-1.0, KL per token 3e-5..5e-5 mean, 5e-4 max,
    base and adapter alike (a tenth of what bfloat16 weights cost, see
    tests/test_engine_weights.py, whose gate runs bfloat16 weights with bfloat16 K/V). The
    gates leave 10x room for other CPUs' summation order, not for a broken kernel (KL > 0.1)."""
    from tests.test_demo_adapters import ADAPTERS

    f32 = Engine.from_path(demo_gguf, EngineConfig(kv_cache_bytes=1 << 26))
    kv = Engine.from_path(demo_gguf, EngineConfig(kv_cache_bytes=1 << 26, kv_cache_dtype="bfloat16"))
    assert (f32.cache.dtype, kv.cache.dtype) == (torch.float32, torch.bfloat16)
    info = model_info(demo_gguf)
    for eng, sub in ((f32, "a"), (kv, "b")):
        attach_runtime(eng, info, tmp_path / sub)
    french = refs_for({"french": ADAPTERS / "french"})["french"]
    prompts = [f32.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in CHATS]
    for adapter in (None, french):
        got = agreement(f32, kv, prompts, 32, adapter)
        assert got["top1_agreement"] >= 0.95 and got["kl_mean"] <= 5e-4 and got["kl_max"] <= 5e-3, (adapter, got)
    for eng in (f32, kv):
        eng.lora_runtime.manager.close()
