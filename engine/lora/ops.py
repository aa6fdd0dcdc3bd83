"""Batched multi-LoRA on one projection: each token applies its own adapter's delta.

Semantics, for every token ``i`` with ``slot[i] >= 0`` (``-1`` is a base row, no work)::

    y[i] += (x[i] @ A[slot[i]].T) @ B[slot[i]].T * scale[slot[i]]

with ``x [T, in]``, ``y [T, out]`` (updated in place), ``A [S, r, in]``, ``B [S, out, r]``,
``scale [S]``. Rows with ``slot == -1`` are never written (bit-for-bit unchanged).

Plain-torch paths (CPU, and the correctness oracle for the Triton kernels):

* ``gather``: gather each LoRA token's A and B, two ``bmm``. One fixed cost per call,
  memory traffic ``tokens x r x (in + out)`` (the BGMV pattern; on CPU it lost everywhere).
* ``segmented``: tokens grouped by slot once per step (:class:`SegmentPlan`), then one
  ``mm`` pair per adapter; contiguous runs (a prefill sequence) are processed in place
  through slices, without gather/scatter; otherwise one gather and one scatter per call.
  Fastest on CPU at every measured shape.
* ``reference``: a per-row loop, the literal definition (tests and benchmark baseline).

:func:`lora_apply` is the one public entry point: Triton on CUDA when it imports,
otherwise the torch path that :func:`choose_path` picks from the measured heuristic
(``bench/lora_ops.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

Path = Literal["gather", "segmented"]

GATHER_MAX_TOKENS_PER_ADAPTER = 0.0
"""CPU dispatch threshold: gather while LoRA tokens per distinct adapter stay at or below this.

Measured by ``bench/lora_ops.py`` (demo shapes, rank 16, float32, tokens 1-128, 1-32
adapters, interleaved and contiguous): segmented was faster at every shape, by 1.3x
(1 token) to 20x+ (128 tokens, 1 adapter). Gathering copies ``r x (in + out)`` weights
per token, while segmented reads each adapter's weights once in place and the per-adapter
launch cost (~30 us) stays below the per-token gather cost (~50 us). So 0: the CPU always
runs segmented; ``path="gather"`` stays available (and mirrors the BGMV kernel)."""


@dataclass(frozen=True)
class SegmentPlan:
    """Per-step grouping of the LoRA tokens of one rank class (built once, used by every layer)."""

    num_tokens: int
    rows: torch.Tensor
    """[n] token indices with a slot, sorted by slot (stable: original order inside a slot)."""
    row_slots: torch.Tensor
    """[n] the slot of each entry of ``rows``."""
    seg_slots: tuple[int, ...]
    """Distinct slots, ascending; segment ``k`` is ``rows[seg_starts[k]:seg_starts[k] + seg_lens[k]]``."""
    seg_starts: tuple[int, ...]
    seg_lens: tuple[int, ...]
    runs: tuple[tuple[int, int, int], ...] | None
    """``(start, end, slot)`` token ranges when every slot's tokens are one contiguous range."""
    seg_table: torch.Tensor
    """[3, num_adapters] int32 on the slots' device: starts, lengths, slots (for kernels)."""

    @property
    def num_lora_tokens(self) -> int:
        return int(self.rows.numel())

    @property
    def num_adapters(self) -> int:
        return len(self.seg_slots)

    @classmethod
    def build(cls, slots: torch.Tensor) -> SegmentPlan:
        """``slots``: [T] int (``-1`` = base row). Runs on CPU once per step."""
        s = slots.detach().to("cpu", torch.int64)
        num_tokens = int(s.numel())
        lora_rows = torch.nonzero(s >= 0).flatten()
        row_slots = s[lora_rows]
        order = torch.argsort(row_slots, stable=True)
        rows, row_slots = lora_rows[order], row_slots[order]
        uniq, counts = torch.unique_consecutive(row_slots, return_counts=True)
        seg_lens = tuple(int(c) for c in counts)
        starts, acc = [], 0
        for n in seg_lens:
            starts.append(acc)
            acc += n
        runs: list[tuple[int, int, int]] | None = []
        for slot, start, n in zip(uniq.tolist(), starts, seg_lens, strict=True):
            first = int(rows[start])
            if int(rows[start + n - 1]) - first != n - 1:
                runs = None
                break
            runs.append((first, first + n, int(slot)))
        device = slots.device
        return cls(
            num_tokens=num_tokens,
            rows=rows.to(device),
            row_slots=row_slots.to(device),
            seg_slots=tuple(int(u) for u in uniq.tolist()),
            seg_starts=tuple(starts),
            seg_lens=seg_lens,
            runs=tuple(sorted(runs)) if runs is not None else None,
            seg_table=torch.tensor([starts, list(seg_lens), uniq.tolist()], dtype=torch.int32).to(device),
        )


def choose_path(plan: SegmentPlan) -> Path:
    """The torch path for this batch shape (see ``GATHER_MAX_TOKENS_PER_ADAPTER``)."""
    if plan.num_adapters and plan.num_lora_tokens <= GATHER_MAX_TOKENS_PER_ADAPTER * plan.num_adapters:
        return "gather"
    return "segmented"


def lora_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   scale: torch.Tensor, slots: torch.Tensor) -> None:
    """The definition, one row at a time."""
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            y[i] += (x[i] @ a[s].T) @ b[s].T * scale[s]


def lora_gather(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                scale: torch.Tensor, plan: SegmentPlan) -> None:
    """Gather A/B per LoRA token, shrink and expand with ``bmm``, scatter-add into ``y``."""
    if plan.num_lora_tokens == 0:
        return
    rows, sl = plan.rows, plan.row_slots
    xs = x.index_select(0, rows).unsqueeze(2)                             # [n, in, 1]
    t = torch.bmm(a.index_select(0, sl), xs)                              # [n, r, 1]
    t = t * scale.index_select(0, sl).view(-1, 1, 1)
    d = torch.bmm(b.index_select(0, sl), t).squeeze(2)                    # [n, out]
    if plan.num_lora_tokens == plan.num_tokens and plan.runs is not None and len(plan.runs) == 1:
        y.add_(d)  # every token, one adapter: rows == arange(T)
    else:
        y.index_add_(0, rows, d)


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
            y[start:end].addmm_(torch.mm(x[start:end], a[s].T), b[s].T, alpha=scales[s])
        return
    xs = x.index_select(0, plan.rows)
    d = torch.empty(plan.num_lora_tokens, y.shape[1], dtype=y.dtype, device=y.device)
    for s, st, n in zip(plan.seg_slots, plan.seg_starts, plan.seg_lens, strict=True):
        seg = d[st:st + n]
        torch.addmm(seg, torch.mm(xs[st:st + n], a[s].T), b[s].T, beta=0, alpha=scales[s], out=seg)
    y.index_add_(0, plan.rows, d)


@functools.cache
def _triton_available() -> bool:
    try:
        from engine.lora import triton_ops
    except ImportError:
        return False
    return triton_ops.available()


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               scale: torch.Tensor, plan: SegmentPlan, path: str | None = None) -> None:
    """``y[i] += (x[i] @ A[s].T) @ B[s].T * scale[s]`` for ``s = slot[i] >= 0``, in place.

    ``path`` forces ``"gather"``, ``"segmented"``, ``"triton"`` or ``"reference"``;
    None dispatches: CUDA tensors with Triton -> Triton; otherwise :func:`choose_path`.
    """
    if plan.num_lora_tokens == 0:
        return
    if path is None:
        path = "triton" if (y.is_cuda and _triton_available()) else choose_path(plan)
    if path == "gather":
        lora_gather(y, x, a, b, scale, plan)
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
