"""Batched multi-LoRA on one projection: each token applies its own adapter's delta.

For every token ``i`` with ``slot[i] >= 0`` (``-1`` is a base row, left bit-for-bit unchanged)::

    y[i] += (x[i] @ A[slot[i]].T) @ B[slot[i]].T * scale[slot[i]]

with ``x [T, in]``, ``y [T, out]`` (updated in place), ``A [S, r, in]``, ``B [S, out, r]``,
``scale [S]``; ``A``/``B`` may be stored in bfloat16 under float32 ``x``/``y`` (the math stays
float32: the torch paths widen the slices they use, the native kernel widens on load).
:func:`lora_apply` is the one entry point: Triton on CUDA, else the CPU path
(``segmented``, ``padded``, ``native``; ``reference`` is the definition) that
:func:`choose_path` picks from measured thresholds (docs/DESIGN.md, "Batched LoRA").
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from engine.lora.plan import SegmentPlan
from engine.native_lora import lora_rows_kernel

Path = Literal["segmented", "padded", "native"]

PADDED_MAX_TOKENS_PER_ADAPTER = 16
"""Padded-bmm is considered while the largest segment has at most this many tokens ..."""
PADDED_MIN_ADAPTERS = 2
"""... there are at least this many adapters, and padding at most doubles the rows.

Padded-bmm (one ``bmm`` pair over all adapters of the call, segments padded to the longest)
costs a fixed ~8 torch ops per call instead of ~2-3 per adapter: measured 2-3x faster than
segmented for decode-like batches (8-32 adapters with 1-16 tokens each), slower for one
adapter or long segments (prefill), where segmented's in-place slices win."""


NATIVE_MAX_TOKENS_PER_ADAPTER = 64
"""Where the native kernel goes row by row, it takes batches whose largest segment has at
most this many tokens.

Row by row (an adapter's A/B come from cache for its later rows), measured by
``bench/lora_ops.py`` (demo shapes, rank 16, 2 threads), it beat every torch path from 1 to
128 tokens with 8-32 adapters (4-8x padded for decode batches), and lost only to
segmented's one GEMM pair for a single adapter's 128-token run (prefill). The AVX-512 and
AVX2 builds take every segment in blocks (B stored transposed, as ``SlotBank`` does, and a
rank that is a multiple of 8) and beat segmented at every length measured (30 layers on 2
Zen 5 threads, float32 A/B: 8 adapters x 100 rows 74 against 98 ms, one adapter x 128 rows
10 against 14 ms; bfloat16 A/B 58 against 132 ms and 28 against 39 ms for 400 rows; 2 Zen 3
threads, AVX2, bfloat16 A/B: 96-100 against 271 ms and 46-58 against 78 ms): there
:func:`native_max_tokens` is unbounded."""


def native_max_tokens(rank: int, b_transposed: bool = True) -> int | None:
    """The longest segment the native kernel is chosen for, for stacks of this rank and B
    layout (``B [S, out, r]`` as the transposed view of ``[S, r, out]``); None: any length."""
    kernel = lora_rows_kernel()
    blocked = kernel is not None and kernel.blocked and b_transposed and rank % 8 == 0
    return None if blocked else NATIVE_MAX_TOKENS_PER_ADAPTER


def choose_path(plan: SegmentPlan, capacity: int | None = None, native: bool = False,
                native_max: int | None = NATIVE_MAX_TOKENS_PER_ADAPTER) -> Path:
    """The CPU path for this batch shape (thresholds measured by ``bench/lora_ops.py``).

    ``capacity``: slots in the stack the op reads (decides whether padded-bmm can use the
    whole stack without gathering A/B); None: the plan's largest slot + 1. ``native``: the
    C kernel may be used (CPU float32 and it built), for segments of at most ``native_max``
    tokens (None: any; :func:`native_max_tokens` is this build's for a rank and layout).
    """
    d, n = plan.num_adapters, plan.num_lora_tokens
    if d == 0:
        return "segmented"
    if native and (native_max is None or plan.max_segment <= native_max):
        return "native"
    cap = capacity if capacity is not None else plan.seg_slots[-1] + 1
    m = plan.max_segment
    groups = cap if cap <= 2 * d else d
    if d >= PADDED_MIN_ADAPTERS and m <= PADDED_MAX_TOKENS_PER_ADAPTER and groups * m <= 2 * n:
        return "padded"
    return "segmented"


def lora_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   scale: torch.Tensor, slots: torch.Tensor) -> None:
    """The definition, one row at a time."""
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            y[i] += (x[i] @ a[s].T.to(y.dtype)) @ b[s].T.to(y.dtype) * scale[s]


def lora_segmented(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   scale: torch.Tensor, plan: SegmentPlan) -> None:
    """One shrink/expand ``mm`` pair per adapter (the scale folded into the expand's ``alpha``).

    Contiguous runs update ``y`` in place through slices; otherwise the LoRA rows are gathered
    once in sorted order, each segment expands into its slice of one buffer, and one
    ``index_add_`` scatters the buffer back.
    """
    scales = scale.tolist() if plan.num_adapters else []
    if plan.runs is not None:
        for start, end, s in plan.runs:
            y[start:end].addmm_(torch.mm(x[start:end], a[s].T.to(y.dtype)), b[s].T.to(y.dtype), alpha=scales[s])
        return
    xs = x.index_select(0, plan.rows)
    d = torch.empty(plan.num_lora_tokens, y.shape[1], dtype=y.dtype, device=y.device)
    for s, st, n in zip(plan.seg_slots, plan.seg_starts, plan.seg_lens, strict=True):
        seg = d[st:st + n]
        torch.addmm(seg, torch.mm(xs[st:st + n], a[s].T.to(y.dtype)), b[s].T.to(y.dtype), beta=0, alpha=scales[s],
                    out=seg)
    y.index_add_(0, plan.rows, d)


def lora_padded(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                scale: torch.Tensor, plan: SegmentPlan) -> None:
    """All adapters of the call in one ``bmm`` pair: segments padded to the longest one.

    With most of the stack's slots in the batch the whole stack is used as is (no A/B copy;
    padded groups of absent slots are computed and dropped); otherwise the present slots'
    A/B are gathered once per call (per adapter, not per token).
    """
    if plan.num_lora_tokens == 0:
        return
    lay = plan.padded_layout(a.shape[0])
    if lay.full_stack:
        a_g, b_g, s_g = a, b, scale
    else:
        idx = plan.seg_table[2].to(torch.int64)
        a_g, b_g, s_g = a.index_select(0, idx), b.index_select(0, idx), scale.index_select(0, idx)
    a_g, b_g = a_g.to(y.dtype), b_g.to(y.dtype)
    xp = x.index_select(0, lay.pad_rows).view(lay.groups, lay.m, x.shape[1])
    t = torch.bmm(xp, a_g.transpose(1, 2))
    t.mul_(s_g.view(-1, 1, 1))
    d = torch.bmm(t, b_g.transpose(1, 2)).view(lay.groups * lay.m, b.shape[1])
    if lay.take is not None:
        d = d.index_select(0, lay.take)
    y.index_add_(0, plan.rows, d)


def lora_native(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                scale: torch.Tensor, plan: SegmentPlan) -> None:
    """The C kernel (``engine.native_lora.LoRARows``) over the plan's rows, sorted by slot."""
    kernel = lora_rows_kernel()
    if kernel is None:
        raise RuntimeError("the native LoRA kernel is not available here")
    kernel(y, x, a, b, scale, plan.rows, plan.row_slots)


def native_usable(y: torch.Tensor) -> bool:
    return y.device.type == "cpu" and y.dtype == torch.float32 and lora_rows_kernel() is not None


@functools.cache
def _triton_available() -> bool:
    try:
        from engine.lora import triton_ops
    except ImportError:
        return False
    return triton_ops.available()


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               scale: torch.Tensor, plan: SegmentPlan, path: str | None = None, native: bool = True) -> None:
    """``y[i] += (x[i] @ A[s].T) @ B[s].T * scale[s]`` for ``s = slot[i] >= 0``, in place.

    ``path`` forces ``"segmented"``, ``"padded"``, ``"native"``, ``"triton"`` or
    ``"reference"``; None dispatches: CUDA tensors with Triton -> Triton; otherwise
    :func:`choose_path` (``native=False`` keeps it off the C kernel).
    """
    if plan.num_lora_tokens == 0:
        return
    if path is None:
        if y.is_cuda and _triton_available():
            path = "triton"
        else:
            limit = native_max_tokens(a.shape[1], b.transpose(1, 2).is_contiguous())
            path = choose_path(plan, a.shape[0], native=native and native_usable(y), native_max=limit)
    if path == "native":
        lora_native(y, x, a, b, scale, plan)
    elif path == "padded":
        lora_padded(y, x, a, b, scale, plan)
    elif path == "segmented":
        lora_segmented(y, x, a, b, scale, plan)
    elif path == "triton":
        from engine.lora import triton_ops

        triton_ops.lora_triton(y, x, a, b, scale, plan)
    elif path == "reference":
        slots = torch.full((plan.num_tokens,), -1, dtype=torch.int64)
        slots[plan.rows.cpu()] = plan.row_slots.cpu()
        lora_reference(y, x, a, b, scale, slots)
    else:
        raise ValueError(f"unknown LoRA op path {path!r}")
