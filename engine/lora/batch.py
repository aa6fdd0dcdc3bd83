"""The per-step LoRA context the model forward calls: ``batch.apply(layer, proj, x, out)``.

Built once per engine step from the per-token slot ids (``-1`` = base row). It splits
the tokens by rank class, builds one :class:`~engine.lora.ops.SegmentPlan` per class
present, picks the op path per class, and notes which (layer, projection) pairs no
adapter in the batch touches so those calls cost nothing. A batch without LoRA rows
(``batch.empty``) makes every ``apply`` a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.lora.ops import SegmentPlan, lora_apply
from engine.lora.slots import SlotBank


@dataclass(frozen=True)
class _ClassPass:
    class_index: int
    plan: SegmentPlan
    path: str | None
    native: bool
    active: dict[str, list[bool]]  # proj -> per layer: any adapter of this pass touches it


class LoRABatch:
    """Per-step multi-LoRA context for one forward pass over ``num_tokens`` tokens."""

    def __init__(self, bank: SlotBank, token_slots: torch.Tensor, passes: list[_ClassPass]) -> None:
        self.bank = bank
        self.token_slots = token_slots
        self._passes = passes

    @classmethod
    def build(cls, bank: SlotBank, token_slots: torch.Tensor | Sequence[int], *,
              path: str | None = None, native: bool = True) -> LoRABatch:
        """``token_slots``: one global slot id per token of the step, ``-1`` for base rows.

        ``path`` forces an op path for every class (tests, benchmarks); None dispatches
        (``native=False``: never to the C kernel).
        """
        slots = torch.as_tensor(token_slots, dtype=torch.int64).flatten().cpu()
        if slots.numel() and int(slots.max()) >= bank.num_slots:
            raise IndexError(f"slot {int(slots.max())} out of range [0, {bank.num_slots})")
        passes: list[_ClassPass] = []
        if bool((slots >= 0).any()):
            s = bank.slots_per_class
            cls_of = torch.where(slots >= 0, torch.div(slots, s, rounding_mode="floor"), -1)
            for c in sorted(set(cls_of.tolist()) - {-1}):
                local = torch.where(cls_of == c, slots - c * s, -1)
                plan = SegmentPlan.build(local.to(bank.device))
                active = {p: bank.layers_with_module(c, p, plan.seg_slots) for p in bank.projections}
                chosen = path  # None: lora_apply dispatches per call (Triton on CUDA, else choose_path)
                passes.append(_ClassPass(c, plan, chosen, native, active))
        return cls(bank, slots, passes)

    @classmethod
    def for_sequences(cls, bank: SlotBank, seq_slots: Sequence[int], seq_tokens: Sequence[int], *,
                      path: str | None = None) -> LoRABatch:
        """Per-sequence slot ids (``-1``: base model) and token counts, in batch token order."""
        if len(seq_slots) != len(seq_tokens):
            raise ValueError("seq_slots and seq_tokens differ in length")
        slots = torch.repeat_interleave(torch.as_tensor(list(seq_slots), dtype=torch.int64),
                                        torch.as_tensor(list(seq_tokens), dtype=torch.int64))
        return cls.build(bank, slots, path=path)

    @property
    def empty(self) -> bool:
        """True when no token of the step uses an adapter."""
        return not self._passes

    @property
    def num_tokens(self) -> int:
        return int(self.token_slots.numel())

    def apply(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i] += LoRA_slot[i](x[i])`` for the (layer, projection); ``x [T, in]``, ``out [T, out]``."""
        for p in self._passes:
            if not p.active[proj][layer]:
                continue
            a, b, scale = self.bank.stacks(p.class_index, layer, proj)
            lora_apply(out, x, a, b, scale, p.plan, path=p.path, native=p.native)
