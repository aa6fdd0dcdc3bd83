"""The native decode-attention kernel against a plain softmax(qK)V per sequence."""

from __future__ import annotations

import pytest
import torch

from engine import native
from engine.native import decode_attention_kernel

kernel = decode_attention_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="native kernels did not build here")


def _reference(q, k_pool, v_pool, table, lens, block_size, rows):
    hk = k_pool.shape[0]
    out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=torch.float64)
    for b, length in enumerate(lens.tolist()):
        pos = torch.arange(length)
        slots = table[b][pos // block_size] * block_size + pos % block_size
        k = k_pool[:, slots].double()  # [Hk, L, d]
        v = v_pool[:, slots].double()
        qb = q[rows[b]].double().view(hk, -1, q.shape[2])  # [Hk, g, d]
        probs = torch.softmax(qb @ k.transpose(1, 2), dim=-1)
        out[rows[b]] = (probs @ v).reshape(-1)
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (8, 4, 64, 16), (16, 4, 64, 8), (4, 4, 64, 16), (8, 8, 32, 4),
                          (16, 2, 128, 16), (4, 1, 80, 8)])
@pytest.mark.parametrize("scattered", [False, True], ids=["rows-0..B", "mixed-rows"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(heads, kv_heads, head_dim, block_size, scattered, kv_dtype):
    gen = torch.Generator().manual_seed(heads * 31 + head_dim + block_size)
    num_blocks, batch = 64, 5
    k_pool = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(kv_dtype)
    v_pool = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(kv_dtype)
    # Lengths on and off block edges, one of a single token; tables padded with block 0.
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 5 * block_size])
    nb = 5
    table = torch.randperm(num_blocks, generator=gen)[:batch * nb].view(batch, nb).contiguous()
    for b, length in enumerate(lens.tolist()):
        table[b, -(-length // block_size):] = 0
    # q as the model passes it: a head slice of a wider [T, heads + 2*kv_heads, d] tensor, the
    # attention scale folded in. Scores of standard deviation 8 make sharp softmaxes; unscaled
    # (std 2 sqrt(d)) the float32 rounding of the scores alone, torch's included, exceeds 1e-5
    # at head dim 128.
    t = batch + 3 if scattered else batch
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim, generator=gen) * 8 / head_dim ** 0.5
    q = qkv[:, :heads]
    rows = torch.tensor([1, 2, 4, 5, 7]) if scattered else torch.arange(batch)
    out = torch.full((t, heads * head_dim), 7.0)
    kernel(q, k_pool, v_pool, table, lens, int(lens.max()), block_size, out, rows=rows if scattered else None)
    ref = _reference(q, k_pool, v_pool, table, lens, block_size, rows)
    torch.testing.assert_close(out[rows].double(), ref[rows], rtol=1e-5, atol=1e-5)
    untouched = torch.ones(t, dtype=torch.bool)
    untouched[rows] = False
    assert bool((out[untouched] == 7.0).all())  # rows not decoding are left alone
    # A bfloat16 out (the o projection's input): the same float32 result, rounded to nearest even.
    out16 = torch.full((t, heads * head_dim), 7.0).bfloat16()
    kernel(q, k_pool, v_pool, table, lens, int(lens.max()), block_size, out16, rows=rows if scattered else None)
    assert torch.equal(out16[rows], out[rows].bfloat16()) and bool((out16[untouched] == 7.0).all())


def test_large_scores_do_not_overflow():
    """Softmax subtracts the row max: logits of +-80 stay finite and exact."""
    k_pool = torch.zeros(1, 32, 4)
    k_pool[0, :3, 0] = torch.tensor([80.0, -80.0, 79.0])
    v_pool = torch.arange(32 * 4, dtype=torch.float32).view(1, 32, 4)
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    out = torch.empty(1, 4)
    kernel(q, k_pool, v_pool, torch.tensor([[0]]), torch.tensor([3]), 3, 16, out)
    ref = _reference(q, k_pool, v_pool, torch.tensor([[0]]), torch.tensor([3]), 16, torch.tensor([0]))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-5)


def test_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = native._build("cpu_kernels")
    assert first.parent == tmp_path / "loraplex" / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert native._build("cpu_kernels") == first and first.stat().st_mtime_ns == mtime


def test_missing_compiler_falls_back_to_torch(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native.library.cache_clear()
    native.decode_attention_kernel.cache_clear()
    try:
        assert native.decode_attention_kernel() is None
        assert "native CPU kernels unavailable" in caplog.text
    finally:
        native.library.cache_clear()
        native.decode_attention_kernel.cache_clear()


def test_fused_ops_match_torch_definitions():
    from engine.fused import TorchOps
    from engine.native import fused_ops

    nat, ref = fused_ops(), TorchOps()
    gen = torch.Generator().manual_seed(3)
    # Residual add + RMSNorm on a row-strided h (as a slice of a wider buffer), and without delta.
    wide = torch.randn(7, 100, generator=gen) * 3
    delta = torch.randn(7, 96, generator=gen)
    weight = torch.randn(96, generator=gen)
    h_nat, h_ref = wide.clone()[:, :96], wide.clone()[:, :96]
    out = nat.add_rms_norm(h_nat, delta, weight, 1e-5)
    expect = ref.add_rms_norm(h_ref, delta, weight, 1e-5)
    torch.testing.assert_close(h_nat, h_ref, rtol=0, atol=0)  # the add itself is exact
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nat.add_rms_norm(h_nat, None, weight, 1e-5),
                               ref.add_rms_norm(h_ref, None, weight, 1e-5), rtol=1e-5, atol=1e-5)
    # SwiGLU over the whole float range that matters, extreme gates included (no overflow).
    gu = torch.randn(33, 2 * 80, generator=gen) * 6
    gu[0, :4] = torch.tensor([-120.0, -88.0, 88.0, 120.0])
    torch.testing.assert_close(nat.silu_mul(gu, 80), ref.silu_mul(gu, 80), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_rope_store_matches_torch_definition(qkv_dtype, kv_dtype):
    """Bias, RoPE (per-head and broadcast tables, with and without a per-head factor) and the K/V
    store at scattered slots of a fused q|k|v output, float32 or bfloat16 sums, into float32 or
    bfloat16 pools: q as torch computes it, k and v stored where torch stores them, every other
    slot untouched."""
    from engine.config import ModelConfig
    from engine.fused import TorchOps
    from engine.kv_cache import KVCache
    from engine.native import fused_ops

    nat, ref = fused_ops(), TorchOps()
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d, t = 4, 2, 32, 9
    cfg = ModelConfig(architecture="llama", hidden_size=heads * d, intermediate_size=8, num_layers=2,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=d, vocab_size=16, context_length=64)
    slots = torch.randperm(64, generator=gen)[:t]
    for per_head in (True, False):
        for with_bias in (True, False):
            wide = torch.randn(t, (heads + 2 * kv_heads) * d + 8, generator=gen) * 3
            qkv = wide.to(qkv_dtype)[:, :(heads + 2 * kv_heads) * d]  # row-strided, as a matmul slice
            bias = torch.randn((heads + 2 * kv_heads) * d, generator=gen) if with_bias else None
            cos = torch.randn(t, heads + kv_heads if per_head else 1, d, generator=gen)
            sin = torch.randn(t, heads + kv_heads if per_head else 1, d, generator=gen)
            scale = torch.rand(heads + kv_heads, generator=gen) + 0.1 if with_bias else None
            caches = [KVCache(cfg, 4, 16, torch.device("cpu"), kv_dtype, torch.float32) for _ in range(2)]
            got = nat.rope_store(qkv, bias, cos, sin, caches[0], 1, slots, heads, scale)
            expect = ref.rope_store(qkv, bias, cos, sin, caches[1], 1, slots, heads, scale)
            torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
            if scale is not None:  # the same numbers as the tables with the factor folded in
                plain = nat.rope_store(qkv, bias, cos * scale.view(1, -1, 1), sin * scale.view(1, -1, 1),
                                       KVCache(cfg, 4, 16, torch.device("cpu"), kv_dtype, torch.float32), 1, slots,
                                       heads)
                assert torch.equal(got, plain) and not torch.allclose(got, ref.rope_store(
                    qkv, bias, cos, sin, KVCache(cfg, 4, 16, torch.device("cpu"), kv_dtype, torch.float32), 1, slots,
                    heads))
            tol = dict(rtol=1e-5, atol=1e-5) if kv_dtype == torch.float32 else dict(rtol=8e-3, atol=1e-2)
            for pool in ("k", "v"):
                a, b = getattr(caches[0], pool), getattr(caches[1], pool)
                torch.testing.assert_close(a[1].float(), b[1].float(), **tol)
                assert a[1][:, slots].abs().sum() > 0 and torch.equal(a[0], torch.zeros_like(a[0]))
                untouched = torch.ones(64, dtype=torch.bool)
                untouched[slots] = False
                assert torch.equal(a[1][:, untouched], torch.zeros_like(a[1][:, untouched]))


@pytest.mark.parametrize("rows", [1, 7, 70])
def test_fused_ops_read_and_write_bfloat16_as_widening_and_rounding(rows):
    """The bfloat16 variants (a bfloat16 matmul output in, the next matmul's bfloat16 input out)
    are exactly the float32 steps on the widened input, rounded to nearest even: the four
    norm variants share one summation order, so none can round a value differently."""
    from engine.fused import TorchOps
    from engine.native import fused_ops

    nat, ref = fused_ops(), TorchOps()
    gen = torch.Generator().manual_seed(rows)
    h = torch.randn(rows, 576, generator=gen) * 4
    weight = torch.randn(576, generator=gen)
    delta = (torch.randn(rows, 576, generator=gen) * 2).bfloat16()
    for d in (delta, None):
        h32, h16 = h.clone(), h.clone()
        expect = nat.add_rms_norm(h32, d.float() if d is not None else None, weight, 1e-5)
        got = nat.add_rms_norm(h16, d, weight, 1e-5, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(h16, h32)
        assert torch.equal(got, expect.bfloat16())
        assert torch.equal(nat.add_rms_norm(h.clone(), d, weight, 1e-5), expect)
        torch.testing.assert_close(ref.add_rms_norm(h.clone(), d, weight, 1e-5, torch.bfloat16).float(),
                                   got.float(), rtol=1e-2, atol=1e-2)
    gu = (torch.randn(rows, 2 * 1536, generator=gen) * 6).bfloat16()
    gu[0, :3] = torch.tensor([-120.0, 88.0, float("nan")])
    expect = nat.silu_mul(gu.float(), 1536)
    exact = {"rtol": 0, "atol": 0, "equal_nan": True}
    torch.testing.assert_close(nat.silu_mul(gu, 1536, torch.float32), expect, **exact)
    got = nat.silu_mul(gu, 1536, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expect.bfloat16(), **exact)
    assert torch.isnan(got[0, 2]), "NaN stays NaN (the engine's non-finite check sees it)"
    torch.testing.assert_close(ref.silu_mul(gu, 1536, torch.bfloat16).float(), got.float(), rtol=1e-2, atol=1e-5,
                               equal_nan=True)


@pytest.mark.parametrize(("n_out", "n_in", "bias"), [(576, 576, False), (963, 577, True), (3, 40, True), (1, 1, False)])
def test_gemv_matches_linear(n_out, n_in, bias):
    """Single-row matmul vs float64; output sizes off the kernel's four-row blocks."""
    gen = torch.Generator().manual_seed(n_out + n_in)
    w = torch.randn(n_out, n_in, generator=gen)
    b = torch.randn(n_out, generator=gen) if bias else None
    x = torch.randn(1, n_in, generator=gen)
    y = native.gemv_kernel()(x, w, b)
    expect = x.double() @ w.double().T + (b.double() if bias else 0)
    torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-4)


def test_linear_sends_single_rows_to_gemv():
    from engine.linear import Linear

    w = torch.randn(16, 8)
    calls: list[int] = []
    gemv = native.gemv_kernel()
    lin = Linear(w, None, pack_batch=4, gemv=lambda *a: (calls.append(1), gemv(*a))[1])
    x = torch.randn(3, 8)
    torch.testing.assert_close(lin(x[:1]), x[:1] @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x), x @ w.T, rtol=1e-5, atol=1e-5)
    assert calls == [1], "only the one-row call goes to gemv"
    assert Linear(w.T.contiguous().T, None, gemv=gemv).gemv is None, "non-contiguous weights stay on F.linear"


@pytest.mark.parametrize(("n_out", "n_in", "bias"), [(576, 576, False), (963, 577, True), (3, 40, True)])
def test_bf16_gemv_rounds_like_a_bfloat16_matmul(n_out, n_in, bias):
    """bfloat16 weights: x rounded to bfloat16, float32 sums rounded to bfloat16, float32 bias."""
    gen = torch.Generator().manual_seed(n_out + n_in)
    w = torch.randn(n_out, n_in, generator=gen).bfloat16()
    b = torch.randn(n_out, generator=gen) if bias else None
    x = torch.randn(1, n_in, generator=gen)
    y = native.gemv_kernel()(x, w, b)
    exact = x.bfloat16().double() @ w.double().T
    expect = exact.bfloat16().double() + (b.double() if bias else 0)
    assert y.dtype == torch.float32
    # one bfloat16 step of the sum's magnitude at most (the float32 sums differ in order only)
    ulp = exact.abs().clamp_min(1e-30) * 2.0 ** -7
    assert ((y.double() - expect).abs() <= ulp + 1e-6).all()
    assert not torch.equal(y.double(), x.double() @ w.double().T), "the rounding is part of the contract"


def _paged_cache(seed: int, num_blocks: int):
    """One layer of a float32 cache (9 heads over 3 kv heads, head dim 64, 4-token blocks) filled
    with noise, and ``seq(total, computed)``: a sequence stand-in whose blocks are drawn at random."""
    from types import SimpleNamespace

    from engine.kv_cache import KVCache

    gen = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(num_kv_heads=3, head_dim=64, num_layers=1)
    cache = KVCache(cfg, num_blocks, 4, torch.device("cpu"), torch.float32)
    cache.k[0].normal_(generator=gen)
    cache.v[0].normal_(generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()

    def seq(total: int, computed: int):
        nb = -(-total // 4)
        table, perm[:] = perm[:nb], perm[nb:]
        return SimpleNamespace(all_token_ids=list(range(total)), num_computed=computed, block_table=table)

    return gen, cache, seq


def test_one_kernel_call_attends_prefill_and_decode_rows_as_the_torch_path():
    """A mixed step (a fresh prompt, a prompt's second chunk, decode rows) attended by the native
    kernel in one call per layer == the masked batched-matmul path on the same cache."""
    from engine.attention import paged_attention, prepare_attention
    from engine.step_batch import build_batch

    gen, cache, seq = _paged_cache(5, 40)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 4

    chunks = [(seq(13, 12), 1), (seq(11, 0), 11), (seq(30, 9), 14), (seq(6, 5), 1), (seq(2, 0), 2)]
    ctx = build_batch(chunks, bs, torch.device("cpu"))
    q = torch.randn(ctx.num_tokens, heads, head_dim, generator=gen)
    prepare_attention(ctx, kv_heads, kernel)
    got = paged_attention(ctx, cache, 0, q, kv_heads, kernel)
    prepare_attention(ctx, kv_heads, None)
    want = paged_attention(ctx, cache, 0, q, kv_heads, None)
    assert got.shape == want.shape == (ctx.num_tokens, heads * head_dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_kernel_rows", [True, False])
def test_long_context_chunks_by_matmul_beside_kernel_rows_match_reference(with_kernel_rows):
    """A prefill chunk over a long cached context (a conversation's new turn) is attended by
    matrix products, the step's other rows by the kernel (or none: every row by matmul); every
    row equals a float64 reference over its own keys."""
    from engine.attention import MATMUL_MIN_CONTEXT, MATMUL_MIN_ROWS, paged_attention, prepare_attention
    from engine.step_batch import build_batch

    gen, cache, seq = _paged_cache(11, 200)
    heads, kv_heads, head_dim, bs = 9, 3, 64, 4

    rows = MATMUL_MIN_ROWS + 5
    context = MATMUL_MIN_CONTEXT * rows + 30
    long_chunk = (seq(context, context - rows), rows)
    chunks = [(seq(13, 12), 1), long_chunk, (seq(40, 0), 40), (seq(6, 5), 1)] if with_kernel_rows else [long_chunk]
    ctx = build_batch(chunks, bs, torch.device("cpu"))
    q = torch.randn(ctx.num_tokens, heads, head_dim, generator=gen) / head_dim ** 0.5
    prepare_attention(ctx, kv_heads, kernel)
    assert [(i.start, i.end) for i in ctx.matmul_prefills] == [(1, 1 + rows) if with_kernel_rows else (0, rows)]
    assert ctx.kernel_rows is not None and ctx.kernel_rows.numel() == ctx.num_tokens - rows
    got = paged_attention(ctx, cache, 0, q, kv_heads, kernel)
    assert ctx.kv_tables is not None
    want = _reference(q, cache.k[0], cache.v[0], ctx.kv_tables.index_select(0, ctx.token_seq), ctx.positions + 1, bs,
                      torch.arange(ctx.num_tokens))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    prepare_attention(ctx, kv_heads, None)  # the torch path's chunks: the same products
    torch.testing.assert_close(paged_attention(ctx, cache, 0, q, kv_heads, None).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_kernel_prefill_chunks_match_reference(kv_dtype):
    """Rows of prefill chunks (one block table, consecutive lengths: grouped so a group's keys are
    widened once) beside decode rows, a chunk longer than a group, and a row of another
    sequence whose length continues the chunk before it: each row attends to its own keys only."""
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(23)
    num_blocks, nb = 64, 4
    k_pool = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(kv_dtype)
    v_pool = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(kv_dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    seq_tables = [perm[i * nb:(i + 1) * nb] for i in range(4)]
    # (sequence, lengths): a decode row, a 37-row chunk from the start, two rows of another
    # sequence at lengths 38 and 39, a decode row of the second sequence, then a 3-row chunk.
    plan = [(0, [50]), (1, list(range(1, 38))), (2, [38, 39]), (1, [38]), (3, [7, 8, 9])]
    tables, lens = [], []
    for s_i, ls in plan:
        for n in ls:
            tables.append(seq_tables[s_i])
            lens.append(n)
    table = torch.stack(tables).contiguous()
    lens_t = torch.tensor(lens)
    t = len(lens)
    q = torch.randn(t, heads, head_dim, generator=gen) * 8 / head_dim ** 0.5  # scaled as above
    out = torch.empty(t, heads * head_dim)
    kernel(q, k_pool, v_pool, table, lens_t, int(lens_t.max()), block_size, out)
    ref = _reference(q, k_pool, v_pool, table, lens_t, block_size, torch.arange(t))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 8])
def test_kernel_row_alone_is_the_same_bits_as_in_a_batch(kv_dtype, block_size):
    """A row attended alone (a group of one: its bfloat16 keys read in place where the kernel's
    joint pass runs) and the same row inside a prefill chunk (the chunk's keys widened once for
    all its rows) or beside other decode rows: the same bits, for lengths on and off 16-key runs."""
    heads, kv_heads, head_dim = 9, 3, 64
    gen = torch.Generator().manual_seed(29 + block_size)
    num_blocks, nb = 96, 80 // block_size + 1
    k_pool = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(kv_dtype)
    v_pool = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(kv_dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = [perm[i * nb:(i + 1) * nb] for i in range(3)]
    plan = [(0, n) for n in range(40, 80)] + [(1, 5), (2, 33), (1, 64), (2, 17)]  # a chunk, then decode rows
    table = torch.stack([tables[s_i] for s_i, _ in plan]).contiguous()
    lens = torch.tensor([n for _, n in plan])
    q = torch.randn(len(plan), heads, head_dim, generator=gen) * 8 / head_dim ** 0.5
    out = torch.empty(len(plan), heads * head_dim)
    kernel(q, k_pool, v_pool, table, lens, int(lens.max()), block_size, out)
    for i in range(len(plan)):
        alone = torch.empty(1, heads * head_dim)
        kernel(q[i:i + 1].contiguous(), k_pool, v_pool, table[i:i + 1].contiguous(), lens[i:i + 1].contiguous(),
               int(lens[i]), block_size, alone)
        assert torch.equal(alone[0], out[i]), (i, plan[i])


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 33, 100, 301])
@pytest.mark.parametrize(("n_out", "n_in"), [(64, 32), (96, 576), (576, 1536)])
def test_tile_matmul_rounds_like_onednn(rows, n_out, n_in):
    """The native bfloat16 tile kernel (AMX or AVX512-BF16): every batch size (partial row blocks
    of either build, several column chunks, rows split between threads from 256 rows on 2),
    bfloat16 out as oneDNN's bfloat16 matmul writes it, float32 out as that widened plus the bias."""
    from engine.cpu import cpu_has_bf16_matmul

    if not cpu_has_bf16_matmul():
        pytest.skip("this CPU has neither AMX-BF16 nor AVX512-BF16")
    tk = native.tile_matmul_kernel()
    assert tk is not None, "AMX-BF16 or AVX512-BF16 CPU: the native kernel must build and run"
    gen = torch.Generator().manual_seed(rows * 7 + n_out)
    w = torch.randn(n_out, n_in, generator=gen).bfloat16()
    b = torch.randn(n_out, generator=gen)
    wide = torch.randn(rows, n_in + 32, generator=gen).bfloat16()
    x = wide[:, :n_in]  # row-strided, as a slice of a wider buffer
    tiles = tk.pack(w)
    y16 = tk(x, tiles, n_out)
    expect = torch.nn.functional.linear(x, w)  # oneDNN's bfloat16 matmul
    exact = x.double() @ w.double().T
    assert y16.dtype == torch.bfloat16 and y16.shape == (rows, n_out)
    assert ((y16.double() - exact).abs() <= exact.abs() * 2.0 ** -7 + 1e-5).all()
    assert (y16 == expect).float().mean() > 0.99  # the same sums, rounded the same way
    y32 = tk(x, tiles, n_out, b, torch.float32)
    assert torch.equal(y32, y16.float() + b)




@pytest.mark.parametrize("rows", [1, 5, 12, 13, 31, 48, 301])
def test_tile_matmul_fma_sums_are_vdpbf16ps_sums(rows):
    """The AVX512-BF16 build's two ways to sum a tile (``vdpbf16ps``, or float32 FMAs on the
    widened bfloat16 where the core runs those faster): the same bits in every out dtype, bias and
    SwiGLU epilogue, every row block size and column chunking."""
    tk = native.tile_matmul_kernel()
    if tk is None or tk.isa != "avx512_bf16":
        pytest.skip("not the AVX512-BF16 build (AMX tiles, or no native bfloat16)")
    chosen = tk.by_fma
    gen = torch.Generator().manual_seed(rows)
    try:
        for n_out, n_in in ((64, 32), (96, 576), (576, 1536), (3072, 576)):
            w = torch.randn(n_out, n_in, generator=gen).bfloat16()
            b = torch.randn(n_out, generator=gen)
            x = torch.randn(rows, n_in + 32, generator=gen).bfloat16()[:, :n_in]
            tiles = tk.pack(w)
            for kw in ({}, {"bias": b, "out_dtype": torch.float32}, {"swiglu": True},
                       {"swiglu": True, "out_dtype": torch.float32}):
                tk.by_fma = False
                assert not tk.by_fma
                dp = tk(x, tiles, n_out, **kw)
                tk.by_fma = True
                assert tk.by_fma
                assert torch.equal(tk(x, tiles, n_out, **kw), dp), (n_out, n_in, kw)
    finally:
        tk.by_fma = chosen

@pytest.mark.parametrize("rows", [1, 7, 17, 32, 45, 100, 301])
@pytest.mark.parametrize(("inter", "n_in"), [(16, 32), (48, 96), (1536, 576)])
def test_tile_swiglu_epilogue_matches_matmul_then_silu_mul(rows, inter, n_in):
    """SwiGLU in the tile kernel's epilogue (gate block p with up block p + n/32): bit for bit what
    the bfloat16 gate|up matmul followed by ``FusedOps.silu_mul`` computes, in both out dtypes;
    and the model's gate|up linear fuses it."""
    from engine.cpu import cpu_has_bf16_matmul
    from engine.linear import BF16Linear

    if not cpu_has_bf16_matmul():
        pytest.skip("this CPU has neither AMX-BF16 nor AVX512-BF16")
    tk, ops = native.tile_matmul_kernel(), native.fused_ops()
    assert tk is not None and ops is not None
    gen = torch.Generator().manual_seed(rows + inter)
    w = (torch.randn(2 * inter, n_in, generator=gen) * 0.2).bfloat16()
    x = torch.randn(rows, n_in + 32, generator=gen).bfloat16()[:, :n_in]
    tiles = tk.pack(w)
    sums = tk(x, tiles, 2 * inter)
    for dt in (torch.bfloat16, torch.float32):
        got = tk(x, tiles, 2 * inter, out_dtype=dt, swiglu=True)
        assert got.shape == (rows, inter) and got.dtype == dt
        assert torch.equal(got, ops.silu_mul(sums, inter, dt))
    lin = BF16Linear(w, None, tile=tk)
    assert lin.fuses_swiglu and not BF16Linear(w, torch.zeros(2 * inter), tile=tk).fuses_swiglu
    assert torch.equal(lin.swiglu(x), ops.silu_mul(lin.bf16(x), inter, torch.bfloat16))
    reference = torch.nn.functional.silu(sums[:, :inter].float()) * sums[:, inter:].float()
    torch.testing.assert_close(lin.swiglu(x).float(), reference, rtol=2 ** -7, atol=1e-3)

def test_bf16_linear_runs_every_batch_size_on_the_tile_kernel():
    from engine.cpu import cpu_has_bf16_matmul
    from engine.linear import BF16Linear

    if not cpu_has_bf16_matmul():
        pytest.skip("this CPU has neither AMX-BF16 nor AVX512-BF16")
    w = torch.randn(64, 96).bfloat16()
    lin = BF16Linear(w, torch.randn(64), pack_batch=32, gemv=native.gemv_kernel(), tile=native.tile_matmul_kernel())
    assert lin.tile is not None and lin.packed is None and lin.gemv is None  # one packed copy, not two
    odd = BF16Linear(torch.randn(48, 96).bfloat16(), None, tile=native.tile_matmul_kernel())
    assert odd.tile is None  # 48 outputs: not a multiple of 32, oneDNN's path
    for rows in (1, 5, 40):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(lin(x), (x.bfloat16().float() @ w.float().T) + lin.bias, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows,n_out,n_in", [(2, 16, 8), (5, 40, 64), (6, 48, 576), (7, 960, 576), (13, 33, 1536),
                                              (31, 1000, 97), (32, 3072, 576), (256, 24, 17)])
def test_panel_matmul_matches_linear(rows, n_out, n_in):
    """The float32 panel kernel (AVX2 CPUs without AVX-512): even row blocks of up to 6, partial
    16-column panels, a bias or none, row-strided input; and Linear routes every batch through it."""
    from engine.cpu import cpu_flags
    from engine.linear import Linear

    flags = cpu_flags()
    if "avx512f" in flags or not {"avx2", "fma"} <= flags:
        pytest.skip("the panel kernel is built for AVX2 + FMA CPUs without AVX-512")
    panel = native.panel_matmul_kernel()
    assert panel is not None, "AVX2 CPU: the native panel kernel must build and run"
    gen = torch.Generator().manual_seed(rows * 31 + n_out)
    w = torch.randn(n_out, n_in, generator=gen)
    b = torch.randn(n_out, generator=gen)
    wide = torch.randn(rows, n_in + 8, generator=gen)
    x = wide[:, :n_in]
    panels = panel.pack(w)
    exact = x.double() @ w.double().T
    tol = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
    for bias in (None, b):
        y = panel(x, panels, n_out, bias)
        want = exact + (0 if bias is None else bias.double())
        assert y.shape == (rows, n_out) and ((y.double() - want).abs() <= tol).all()
    lin = Linear(w, b, pack_batch=32, panel=panel)
    assert lin.panels is not None and lin.packed is None, "the panels replace oneDNN's copy"
    assert ((lin(x).double() - exact - b.double()).abs() <= tol).all()
    big = torch.randn(1100, n_in, generator=gen)  # a prefill: three chunks of rows
    assert ((lin(big).double() - big.double() @ w.double().T - b.double()).abs() <= 1e-5 * (
        big.double().abs() @ w.double().abs().T) + 1e-6).all()


@pytest.mark.parametrize("cols", [1, 5, 16, 17, 100, 49152])
def test_row_scan_matches_torch_max_and_isfinite(cols):
    """The logits' argmax (first maximum; a NaN counts as the largest) and per-row finiteness in
    one pass: ties inside and across the 16 lanes and in the tail, NaN and infinite rows, an
    all -inf row, rows strided as a slice of a wider tensor."""
    scan = native.row_scan_kernel()
    assert scan is not None
    gen = torch.Generator().manual_seed(cols)
    wide = torch.randn(12, cols + 7, generator=gen)
    x = wide[:, :cols]
    x[1] = x[1].round()  # many ties
    x[2, -1] = x[2].max() + 1  # the maximum in the tail
    x[3] = 2.0  # all equal: index 0
    x[4, cols // 2] = float("nan")
    x[5, cols - 1] = float("inf")
    x[6] = float("-inf")
    x[7, cols // 3] = float("-inf")
    x[8, 0] = float("nan")
    x[8, cols - 1] = float("nan")
    x[9, cols - 1] = x[9].max()  # a tie with an earlier maximum: the earlier one wins
    assert torch.equal(scan.argmax(x), x.max(dim=-1).indices)
    assert torch.equal(scan.finite(x), torch.isfinite(x).all(dim=-1))
    assert scan.fits(x) and not scan.fits(x.double()) and not scan.fits(x.t())
