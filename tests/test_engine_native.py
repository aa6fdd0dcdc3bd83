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
                         [(9, 3, 64, 16), (8, 8, 32, 4), (16, 2, 128, 16), (4, 1, 80, 8)])
@pytest.mark.parametrize("scattered", [False, True], ids=["rows-0..B", "mixed-rows"])
def test_kernel_matches_reference(heads, kv_heads, head_dim, block_size, scattered):
    gen = torch.Generator().manual_seed(heads * 31 + head_dim + block_size)
    num_blocks, batch = 64, 5
    k_pool = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen)
    v_pool = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen)
    # Lengths on and off block edges, one of a single token; tables padded with block 0.
    lens = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 5 * block_size])
    nb = 5
    table = torch.randperm(num_blocks, generator=gen)[:batch * nb].view(batch, nb).contiguous()
    for b, length in enumerate(lens.tolist()):
        table[b, -(-length // block_size):] = 0
    # q as the model passes it: a head slice of a wider [T, heads + 2*kv_heads, d] tensor.
    t = batch + 3 if scattered else batch
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim, generator=gen) * 2
    q = qkv[:, :heads]
    rows = torch.tensor([1, 2, 4, 5, 7]) if scattered else torch.arange(batch)
    out = torch.full((t, heads * head_dim), 7.0)
    kernel(q, k_pool, v_pool, table, lens, int(lens.max()), block_size, out, rows=rows if scattered else None)
    ref = _reference(q, k_pool, v_pool, table, lens, block_size, rows)
    torch.testing.assert_close(out[rows].double(), ref[rows], rtol=1e-5, atol=1e-5)
    untouched = torch.ones(t, dtype=torch.bool)
    untouched[rows] = False
    assert bool((out[untouched] == 7.0).all())  # rows not decoding are left alone


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
    native._library.cache_clear()
    native.decode_attention_kernel.cache_clear()
    try:
        assert native.decode_attention_kernel() is None
        assert "native CPU kernels unavailable" in caplog.text
    finally:
        native._library.cache_clear()
        native.decode_attention_kernel.cache_clear()
