"""Triton kernels for the batched LoRA op (CUDA), same semantics as :mod:`engine.lora.ops`:
SGMV for segments (prefill), BGMV for single tokens (decode).

Triton is imported on first use, so this module imports without it; with ``TRITON_INTERPRET=1``
the kernels also run on CPU tensors (tests).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Any

import torch

from engine.lora.plan import SegmentPlan

BLOCK_M = 16
BLOCK_K = 32
BLOCK_N = 64


def available() -> bool:
    """Triton imports and can run here (a CUDA device, or the interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernels() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def sgmv_shrink(x_ptr, a_ptr, t_ptr, scale_ptr, rows_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                    K, R, sxm, sxk, sas, sar, sak, stm,
                    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                    PREC: tl.constexpr):
        seg = tl.program_id(0)
        mblk = tl.program_id(1)
        start = tl.load(seg_start_ptr + seg)
        n = tl.load(seg_len_ptr + seg)
        slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = offs_m < n
        rows = tl.load(rows_ptr + start + offs_m, mask=mmask, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        rmask = offs_r < R
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < K
            xb = tl.load(x_ptr + rows[:, None] * sxm + offs_k[None, :] * sxk,
                         mask=mmask[:, None] & kmask[None, :], other=0.0)
            ab = tl.load(a_ptr + slot * sas + offs_r[None, :] * sar + offs_k[:, None] * sak,
                         mask=rmask[None, :] & kmask[:, None], other=0.0)
            acc += tl.dot(xb, ab, input_precision=PREC)
        acc = acc * tl.load(scale_ptr + slot).to(tl.float32)
        tl.store(t_ptr + (start + offs_m)[:, None] * stm + offs_r[None, :], acc,
                 mask=mmask[:, None] & rmask[None, :])

    @triton.jit
    def sgmv_expand(t_ptr, b_ptr, y_ptr, rows_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
                    N, R, stm, sbs, sbn, sbr, sym, syn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                    PREC: tl.constexpr):
        seg = tl.program_id(0)
        mblk = tl.program_id(1)
        nblk = tl.program_id(2)
        start = tl.load(seg_start_ptr + seg)
        n = tl.load(seg_len_ptr + seg)
        slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = offs_m < n
        rows = tl.load(rows_ptr + start + offs_m, mask=mmask, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        rmask = offs_r < R
        offs_n = nblk * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        tb = tl.load(t_ptr + (start + offs_m)[:, None] * stm + offs_r[None, :],
                     mask=mmask[:, None] & rmask[None, :], other=0.0)
        bb = tl.load(b_ptr + slot * sbs + offs_n[None, :] * sbn + offs_r[:, None] * sbr,
                     mask=rmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(tb.to(bb.dtype), bb, input_precision=PREC)
        yp = y_ptr + rows[:, None] * sym + offs_n[None, :] * syn
        ymask = mmask[:, None] & nmask[None, :]
        y = tl.load(yp, mask=ymask, other=0.0)
        tl.store(yp, (y.to(tl.float32) + acc).to(y.dtype), mask=ymask)

    @triton.jit
    def bgmv_shrink(x_ptr, a_ptr, t_ptr, scale_ptr, rows_ptr, row_slots_ptr,
                    K, R, sxm, sxk, sas, sar, sak, stm,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        i = tl.program_id(0)
        row = tl.load(rows_ptr + i).to(tl.int64)
        slot = tl.load(row_slots_ptr + i).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        rmask = offs_r < R
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < K
            xv = tl.load(x_ptr + row * sxm + offs_k * sxk, mask=kmask, other=0.0).to(tl.float32)
            ab = tl.load(a_ptr + slot * sas + offs_r[:, None] * sar + offs_k[None, :] * sak,
                         mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(ab * xv[None, :], axis=1)
        acc = acc * tl.load(scale_ptr + slot).to(tl.float32)
        tl.store(t_ptr + i * stm + offs_r, acc, mask=rmask)

    @triton.jit
    def bgmv_expand(t_ptr, b_ptr, y_ptr, rows_ptr, row_slots_ptr,
                    N, R, stm, sbs, sbn, sbr, sym, syn,
                    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        i = tl.program_id(0)
        nblk = tl.program_id(1)
        row = tl.load(rows_ptr + i).to(tl.int64)
        slot = tl.load(row_slots_ptr + i).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        rmask = offs_r < R
        offs_n = nblk * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        tv = tl.load(t_ptr + i * stm + offs_r, mask=rmask, other=0.0)
        bb = tl.load(b_ptr + slot * sbs + offs_n[:, None] * sbn + offs_r[None, :] * sbr,
                     mask=nmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
        acc = tl.sum(bb * tv[None, :], axis=1)
        yp = y_ptr + row * sym + offs_n * syn
        y = tl.load(yp, mask=nmask, other=0.0)
        tl.store(yp, (y.to(tl.float32) + acc).to(y.dtype), mask=nmask)

    return SimpleNamespace(sgmv_shrink=sgmv_shrink, sgmv_expand=sgmv_expand,
                           bgmv_shrink=bgmv_shrink, bgmv_expand=bgmv_expand, cdiv=triton.cdiv)


def _pow2_at_least(n: int, floor: int) -> int:
    p = floor
    while p < n:
        p *= 2
    return p


def choose_kernel(plan: SegmentPlan) -> str:
    """BGMV while adapters average under 4 tokens each (decode), SGMV otherwise (prefill)."""
    return "bgmv" if plan.num_lora_tokens < 4 * plan.num_adapters else "sgmv"


def lora_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                plan: SegmentPlan, kernel: str | None = None) -> None:
    """``y[i] += (x[i] @ A[s].T) @ B[s].T * scale[s]`` for LoRA tokens, with Triton kernels."""
    n = plan.num_lora_tokens
    if n == 0:
        return
    k = _kernels()
    _num_slots, rank, fan_in = a.shape
    fan_out = b.shape[1]
    block_r = _pow2_at_least(rank, 16)
    t = torch.empty(n, rank, dtype=torch.float32, device=x.device)
    rows, row_slots = plan.rows.to(x.device), plan.row_slots.to(x.device)
    kernel = kernel or choose_kernel(plan)
    if kernel == "bgmv":
        k.bgmv_shrink[(n,)](x, a, t, scale, rows, row_slots, fan_in, rank,
                            x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), t.stride(0),
                            BLOCK_R=block_r, BLOCK_K=BLOCK_K)
        k.bgmv_expand[(n, k.cdiv(fan_out, BLOCK_N))](t, b, y, rows, row_slots, fan_out, rank, t.stride(0),
                                                     b.stride(0), b.stride(1), b.stride(2),
                                                     y.stride(0), y.stride(1),
                                                     BLOCK_N=BLOCK_N, BLOCK_R=block_r)
        return
    if kernel != "sgmv":
        raise ValueError(f"unknown Triton LoRA kernel {kernel!r}")
    seg = plan.seg_table.to(x.device)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    mblocks = k.cdiv(max(plan.seg_lens), BLOCK_M)
    nseg = plan.num_adapters
    k.sgmv_shrink[(nseg, mblocks)](x, a, t, scale, rows, seg[0], seg[1], seg[2], fan_in, rank,
                                   x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), t.stride(0),
                                   BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K, PREC=prec)
    k.sgmv_expand[(nseg, mblocks, k.cdiv(fan_out, BLOCK_N))](
        t, b, y, rows, seg[0], seg[1], seg[2], fan_out, rank, t.stride(0),
        b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=block_r, PREC=prec)
