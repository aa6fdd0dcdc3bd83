"""Paged attention over a mixed batch: all decode rows at once, each prefill chunk on its own.

Shapes (``H`` query heads, ``Hk`` KV heads, ``g = H // Hk``, ``d`` head dim):

* decode group: queries ``[B, H, d]``; each layer gathers the group's KV blocks
  (whole ``block_size x d`` tiles, so the copy is a few large memcpys) from the paged
  cache with ONE ``index_select`` into ``[Hk, B, C, d]`` and computes
  ``[Hk, B, g, C]`` scores with batched matmuls (grouped-query attention without
  repeating K/V), masked to each sequence's length;
* prefill chunk: queries ``[L, H, d]`` against the sequence's ``C`` cached keys
  (earlier chunks included) under a causal mask.

Positions outside a context (the tail of a sequence's last block, padding) are masked by
``masked_fill`` to ``-inf`` rather than by adding ``-inf``: a stale NaN/Inf key there
cannot turn a score into NaN, and its weight is exactly 0 (see ``engine.kv_cache`` for
why the stale values are finite).

On CPU float32 the decode group instead goes through the native kernel
(``engine.native.DecodeAttention``), which reads the K/V blocks in place: the gather
copy above moves every cached byte three times per layer, the kernel once.

K/V pools narrower than the activations (bfloat16 under float32, see ``engine.kv_cache``)
are widened exactly: by ``KVCache.gather`` on the torch paths, on load in the native kernel.
The math is the same either way, in the activations' dtype.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVCache
from engine.native import DecodeAttention
from engine.step_batch import BatchContext

NEG_INF = float("-inf")


def prepare_attention(ctx: BatchContext, num_kv_heads: int, kernel: DecodeAttention | None = None) -> None:
    """Per-step masks (True: outside the context), shared by every layer (the native decode
    kernel needs none: it reads only positions inside each context)."""
    dec = ctx.decode
    if dec is not None and dec.masked is None and kernel is None:
        b, c = dec.valid.shape
        dec.masked = (~dec.valid).unsqueeze(0).expand(num_kv_heads, b, c).reshape(num_kv_heads * b, 1, c)
    for item in ctx.prefills:
        if item.masked is None:
            item.masked = ~item.mask


def paged_attention(ctx: BatchContext, cache: KVCache, layer: int, q: torch.Tensor,
                    num_kv_heads: int, kernel: DecodeAttention | None = None) -> torch.Tensor:
    """``q``: ``[T, H, d]``, rotated and pre-scaled by ``1/sqrt(d)``; this step's K/V already
    written. Returns ``[T, H*d]``."""
    t, h, d = q.shape
    g = h // num_kv_heads
    dec = ctx.decode
    out = None if dec is not None and dec.contiguous else q.new_empty((t, h * d))
    if dec is not None and kernel is not None:
        b = int(dec.rows.shape[0])
        if out is None:
            out = q.new_empty((b, h * d))
        kernel(q, cache.k[layer], cache.v[layer], dec.blocks.view(b, -1), dec.lens, dec.valid.shape[1],
               cache.block_size, out, rows=None if dec.contiguous else dec.rows)
    elif dec is not None:
        assert dec.masked is not None
        b = int(dec.rows.shape[0])
        c = dec.valid.shape[1]
        qd = q if dec.contiguous else q.index_select(0, dec.rows)
        qd = qd.reshape(b, num_kv_heads, g, d).transpose(0, 1).reshape(num_kv_heads * b, g, d)
        kd, vd = cache.gather(layer, dec.blocks)
        kd = kd.view(num_kv_heads * b, c, d)
        vd = vd.view(num_kv_heads * b, c, d)
        scores = torch.bmm(qd, kd.transpose(1, 2)).masked_fill_(dec.masked, NEG_INF)  # [Hk*B, g, C]
        probs = torch.softmax(scores, dim=-1)
        od = torch.bmm(probs, vd).view(num_kv_heads, b, g, d).transpose(0, 1).reshape(b, h * d)
        if out is None:
            return od
        out.index_copy_(0, dec.rows, od)
    assert out is not None
    for item in ctx.prefills:
        n = item.end - item.start
        qp = q[item.start:item.end].reshape(n, num_kv_heads, g, d).permute(1, 2, 0, 3)  # [Hk, g, L, d]
        kp, vp = cache.gather(layer, item.blocks)
        scores = torch.matmul(qp, kp.unsqueeze(1).transpose(-1, -2))  # [Hk, g, L, C]
        scores.masked_fill_(item.masked, NEG_INF)
        probs = torch.softmax(scores, dim=-1)
        op = torch.matmul(probs, vp.unsqueeze(1))  # [Hk, g, L, d]
        out[item.start:item.end] = op.permute(2, 0, 1, 3).reshape(n, h * d)
    return out
