"""How one step's LoRA tokens are grouped by adapter slot: built once per step and rank class,
read by every layer's op on every path (``engine.lora.ops`` on CPU, ``engine.lora.triton_ops``
on CUDA)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PaddedLayout:
    """Where each LoRA token sits in a ``[groups, m]`` padded batch (see :func:`lora_padded`)."""

    groups: int
    m: int
    pad_rows: torch.Tensor
    """[groups * m] token row feeding each padded position (padding repeats a real row)."""
    take: torch.Tensor | None
    """[n] padded position of each sorted LoRA row; None when it is the identity."""
    full_stack: bool
    """True: group g is slot g of the whole stack (no A/B gather); else group k is segment k."""


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
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def max_segment(self) -> int:
        return max(self.seg_lens, default=0)

    def padded_layout(self, capacity: int) -> PaddedLayout:
        """Padded layout for a stack of ``capacity`` slots (cached: built once per step)."""
        key = ("padded", capacity)
        lay = self._cache.get(key)
        if lay is None:
            lay = self._cache[key] = self._build_padded(capacity)
        return lay

    def _build_padded(self, capacity: int) -> PaddedLayout:
        m, d, n = self.max_segment, self.num_adapters, self.num_lora_tokens
        full = capacity <= 2 * d
        groups = capacity if full else d
        rows = self.rows.cpu()
        pad = torch.full((groups, m), int(rows[0]), dtype=torch.int64)
        take = torch.empty(n, dtype=torch.int64)
        for k, (st, ln, slot) in enumerate(zip(self.seg_starts, self.seg_lens, self.seg_slots, strict=True)):
            g = slot if full else k
            pad[g, :ln] = rows[st:st + ln]
            pad[g, ln:] = rows[st]
            take[st:st + ln] = torch.arange(g * m, g * m + ln)
        identity = groups * m == n and bool(torch.equal(take, torch.arange(n)))
        dev = self.rows.device
        return PaddedLayout(groups, m, pad.flatten().to(dev), None if identity else take.to(dev), full)

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
        spans: list[tuple[int, int, int]] = []
        runs: tuple[tuple[int, int, int], ...] | None = None
        for slot, start, n in zip(uniq.tolist(), starts, seg_lens, strict=True):
            first = int(rows[start])
            if int(rows[start + n - 1]) - first != n - 1:
                break
            spans.append((first, first + n, int(slot)))
        else:
            runs = tuple(sorted(spans))
        device = slots.device
        return cls(
            num_tokens=num_tokens,
            rows=rows.to(device),
            row_slots=row_slots.to(device),
            seg_slots=tuple(int(u) for u in uniq.tolist()),
            seg_starts=tuple(starts),
            seg_lens=seg_lens,
            runs=runs,
            seg_table=torch.tensor([starts, list(seg_lens), uniq.tolist()], dtype=torch.int32).to(device),
        )
