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

On CPU float32 every row instead goes through the native kernel
(``engine.native.DecodeAttention``) in ONE call per layer, which reads the K/V blocks in
place: the gather copy above moves every cached byte three times per layer, the kernel
once. A prefill row is to the kernel what a decode row is: a query at position ``p`` of its
sequence attends to keys ``0..p`` (``row_lens = positions + 1``) through its sequence's
block table, so the causal mask is never built, only the lower triangle is computed, and
positions outside a context are never read. Against the batched matmuls per prefill chunk
(five ops and their thread barriers per chunk and layer) it measured 1.1-1.35x faster on
one thread for 100-512-token chunks and about 2x on two threads of a busy machine.

The one exception on that path: a prefill chunk of at least ``MATMUL_MIN_ROWS`` rows over
``MATMUL_MIN_CONTEXT`` times as many keys (the new turn of a conversation whose history came from
the prefix cache) goes by the batched matmuls, and the kernel attends the step's other rows
(``BatchContext.kernel_rows``). The kernel reads every key once per row; the matmuls read each
key once for the whole chunk, and the causal triangle they compute in vain is small beside the
cached context.

K/V pools narrower than the activations (bfloat16 under float32, see ``engine.kv_cache``)
are widened exactly: by ``KVCache.gather`` on the torch paths, on load in the native kernel.
The math is the same either way, in the activations' dtype.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVCache
from engine.native import DecodeAttention
from engine.step_batch import BatchContext, PrefillItem

NEG_INF = float("-inf")
MATMUL_MIN_ROWS = 128
MATMUL_MIN_CONTEXT = 4


def prepare_attention(ctx: BatchContext, num_kv_heads: int, kernel: DecodeAttention | None = None) -> None:
    """Per-step attention plan shared by every layer: for the native kernel each row's block
    table and length; else the masks (True: outside the context)."""
    if kernel is not None:
        if ctx.row_blocks is None and ctx.kv_tables is not None:
            ctx.matmul_prefills = [item for item in ctx.prefills if by_matmul(item)]
            token_seq, positions = ctx.token_seq, ctx.positions
            if ctx.matmul_prefills:
                keep = torch.ones(ctx.num_tokens, dtype=torch.bool, device=positions.device)
                for item in ctx.matmul_prefills:
                    keep[item.start:item.end] = False
                    item.masked = ~item.mask
                ctx.kernel_rows = keep.nonzero().squeeze(1)
                token_seq, positions = token_seq[ctx.kernel_rows], positions[ctx.kernel_rows]
            ctx.row_blocks = ctx.kv_tables.index_select(0, token_seq)
            ctx.row_lens = positions + 1
            ctx.row_max_len = int(ctx.row_lens.max()) if positions.numel() else 0
        return
    dec = ctx.decode
    if dec is not None and dec.masked is None:
        b, c = dec.valid.shape
        dec.masked = (~dec.valid).unsqueeze(0).expand(num_kv_heads, b, c).reshape(num_kv_heads * b, 1, c)
    for item in ctx.prefills:
        if item.masked is None:
            item.masked = ~item.mask


def paged_attention(ctx: BatchContext, cache: KVCache, layer: int, q: torch.Tensor,
                    num_kv_heads: int, kernel: DecodeAttention | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q``: ``[T, H, d]``, rotated and pre-scaled by ``1/sqrt(d)``; this step's K/V already
    written. Returns ``[T, H*d]`` in ``q``'s dtype, or rounded to ``out_dtype`` where the
    native kernel writes it (bfloat16: the next matmul's input)."""
    t, h, d = q.shape
    g = h // num_kv_heads
    out: torch.Tensor | None  # None: the decode rows' product is the whole output
    if kernel is not None:
        assert ctx.row_blocks is not None and ctx.row_lens is not None, "prepare_attention first"
        out = q.new_empty((t, h * d), dtype=out_dtype or q.dtype)
        if ctx.row_lens.numel():
            kernel(q, cache.k[layer], cache.v[layer], ctx.row_blocks, ctx.row_lens, ctx.row_max_len,
                   cache.block_size, out, rows=ctx.kernel_rows)
        for item in ctx.matmul_prefills:
            _prefill(item, cache, layer, q, num_kv_heads, out)
        return out
    dec = ctx.decode
    out = None if dec is not None and dec.contiguous else q.new_empty((t, h * d))
    if dec is not None:
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
        _prefill(item, cache, layer, q, num_kv_heads, out)
    return out


def by_matmul(item: PrefillItem) -> bool:
    """Whether a prefill chunk on the native kernel's path is attended by matrix products: a
    chunk of at least ``MATMUL_MIN_ROWS`` rows over at least ``MATMUL_MIN_CONTEXT`` times as many
    keys (a chunk after a long cached prefix: a conversation's new turn). The kernel attends each
    row on its own, streaming all its keys past one query at a time; a matrix product reuses each
    key across the chunk's rows, which wins once the keys far outnumber the rows (so that the
    causal triangle it computes and masks is a small part of the work)."""
    rows = item.end - item.start
    return rows >= MATMUL_MIN_ROWS and item.mask.shape[1] >= MATMUL_MIN_CONTEXT * rows


def _prefill(item: PrefillItem, cache: KVCache, layer: int, q: torch.Tensor, num_kv_heads: int,
             out: torch.Tensor) -> None:
    """One prefill chunk's attention by matrix products, into its rows of ``out``: per kv head one
    ``[L*g, d] x [d, C]`` product (the chunk's rows and the head's query heads as one matrix, so
    each key is read once for all of them), masked only in the columns after the chunk's first
    position (every row sees the ones before), then ``[L*g, C] x [C, d]``."""
    assert item.masked is not None
    n = item.end - item.start
    _, h, d = q.shape
    g = h // num_kv_heads
    qp = q[item.start:item.end].reshape(n, num_kv_heads, g, d).transpose(0, 1).reshape(num_kv_heads, n * g, d)
    kp, vp = cache.gather(layer, item.blocks)
    scores = torch.bmm(qp, kp.transpose(1, 2))  # [Hk, L*g, C], row l*g + j: position l, query head j
    c0 = item.first + 1
    scores.view(num_kv_heads, n, g, -1)[..., c0:].masked_fill_(item.masked[:, None, c0:], NEG_INF)
    probs = torch.softmax(scores, dim=-1)
    op = torch.bmm(probs, vp)  # [Hk, L*g, d]
    out[item.start:item.end] = op.view(num_kv_heads, n, h // num_kv_heads * d).transpose(0, 1).reshape(n, h * d)
