"""Paged attention over a mixed batch: all decode rows at once, each prefill chunk on its own.

Shapes (``H`` query heads, ``Hk`` KV heads, ``g = H // Hk``, ``d`` head dim):

* decode group: queries ``[B, H, d]``; each layer gathers the group's KV blocks
  (whole ``block_size x d`` tiles, so the copy is a few large memcpys) from the paged
  cache with ONE ``index_select`` into ``[Hk, B, C, d]`` and computes
  ``[Hk, B, g, C]`` scores with batched matmuls (grouped-query attention without
  repeating K/V), masked to each sequence's length;
* prefill chunk: queries ``[L, H, d]`` against the sequence's ``C`` cached keys
  (earlier chunks included) under a causal mask.
"""

from __future__ import annotations

import torch

from engine.batch import BatchContext
from engine.kv_cache import KVCache

NEG_INF = float("-inf")


def _softmax_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                    scale: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores.mul_(scale)
    scores.masked_fill_(~keep, NEG_INF)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v)


def paged_attention(ctx: BatchContext, cache: KVCache, layer: int, q: torch.Tensor,
                    num_kv_heads: int, scale: float) -> torch.Tensor:
    """``q``: ``[T, H, d]`` (already rotated; K/V of this step already written). Returns ``[T, H*d]``."""
    t, h, d = q.shape
    g = h // num_kv_heads
    dec = ctx.decode
    if dec is not None and dec.contiguous:
        out = None
    else:
        out = q.new_empty((t, h * d))
    if dec is not None:
        b = int(dec.rows.shape[0])
        c = dec.valid.shape[1]
        qd = q if dec.contiguous else q.index_select(0, dec.rows)
        qd = qd.view(b, num_kv_heads, g, d).transpose(0, 1)  # [Hk, B, g, d]
        kd, vd = cache.gather(layer, dec.blocks)
        kd = kd.view(num_kv_heads, b, c, d)
        vd = vd.view(num_kv_heads, b, c, d)
        keep = dec.valid.view(1, b, 1, c)
        od = _softmax_attend(qd, kd, vd, keep, scale)  # [Hk, B, g, d]
        od = od.transpose(0, 1).reshape(b, h * d)
        if out is None:
            return od
        out.index_copy_(0, dec.rows, od)
    assert out is not None
    for item in ctx.prefills:
        n = item.end - item.start
        qp = q[item.start:item.end].view(n, num_kv_heads, g, d).permute(1, 2, 0, 3)  # [Hk, g, L, d]
        kp, vp = cache.gather(layer, item.blocks)
        kp = kp.unsqueeze(1)  # [Hk, 1, C, d]
        vp = vp.unsqueeze(1)
        op = _softmax_attend(qp, kp, vp, item.mask, scale)  # [Hk, g, L, d]
        out[item.start:item.end] = op.permute(2, 0, 1, 3).reshape(n, h * d)
    return out
