"""The per-step LoRA context the model forward calls: ``batch.apply_many(layer, x, targets)``.

Built once per engine step from the per-token slot ids (``-1`` = base row). It splits
the tokens by rank class, builds one :class:`~engine.lora.plan.SegmentPlan` per class
present, picks the op path per class (on CPU once per step, not per call), and notes
which (layer, projection) pairs no adapter in the batch touches so those calls cost
nothing. Projections that read the same input (q/k/v, gate/up) are applied together:
on the native CPU path that is one kernel call over their stacks, whose argument tables
are built once per storage (``SlotBank.derived``). A batch without LoRA rows
(``batch.empty``) makes every call a no-op. A failing pass raises :class:`LoRAApplyError`
naming the slots it served.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.lora.ops import choose_path, lora_apply, native_max_tokens
from engine.lora.plan import SegmentPlan
from engine.lora.slots import SlotBank
from engine.native_lora import LoRASteps, lora_rows_kernel


class LoRAApplyError(RuntimeError):
    """The LoRA work of one rank class failed; ``slots`` are the global slot ids it served
    (the engine fails the rows of those adapters only)."""

    def __init__(self, slots: tuple[int, ...], message: str) -> None:
        super().__init__(message)
        self.slots = slots


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
                chosen = path  # None on CUDA: lora_apply dispatches per call (Triton where it runs)
                if chosen is None and bank.device.type == "cpu":
                    use_native = native and bank.dtype == torch.float32 and lora_rows_kernel() is not None
                    limit = native_max_tokens(bank.rank_classes[c])  # the bank stores B transposed
                    chosen = choose_path(plan, bank.capacity(c), native=use_native, native_max=limit)
                passes.append(_ClassPass(c, plan, chosen, native, active))
        return cls(bank, slots, passes)

    @property
    def empty(self) -> bool:
        """True when no token of the step uses an adapter."""
        return not self._passes

    @property
    def num_tokens(self) -> int:
        return int(self.token_slots.numel())

    def apply(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[i] += LoRA_slot[i](x[i])`` for the (layer, projection); ``x [T, in]``, ``out [T, out]``."""
        self.apply_many(layer, x, ((proj, out),))

    def apply_many(self, layer: int, x: torch.Tensor, targets: Sequence[tuple[str, torch.Tensor]]) -> None:
        """:meth:`apply` for several projections of the same input ``x``: ``targets`` is
        ``((proj, out), ...)``; on the native path the outputs must be column slices of one
        tensor (as q/k/v of the fused projection are)."""
        for p in self._passes:
            todo = tuple((proj, out) for proj, out in targets if p.active[proj][layer])
            if not todo:
                continue
            try:
                self._run_pass(p, layer, x, todo)
            except Exception as exc:
                raise self._failure(p, f"layer {layer} {'/'.join(t[0] for t in todo)}: {exc}") from exc

    def _failure(self, p: _ClassPass, message: str) -> LoRAApplyError:
        s = self.bank.slots_per_class
        return LoRAApplyError(tuple(p.class_index * s + local for local in p.plan.seg_slots), message)

    def native_steps(self, num_layers: int, inputs: Sequence[Sequence[str]], cols: Mapping[str, int]) -> LoRASteps | None:
        """This step's LoRA as ``engine.native_decoder.DecoderLayers`` applies it inside the layers: per
        layer and input (``inputs``: the projections that read each, in the model's order) the
        stacks :meth:`apply_many` would apply, each projection's output at column ``cols[proj]``
        of its matmul's output. None when some rank class is not on the native path."""
        if not self._passes or any(p.path != "native" for p in self._passes):
            return None
        kernel = lora_rows_kernel()
        steps = LoRASteps([(p.plan.rows, p.plan.row_slots) for p in self._passes], num_layers)
        for k, p in enumerate(self._passes):
            for layer in range(num_layers):
                for inp, projs in enumerate(inputs):
                    todo = tuple(proj for proj in projs if p.active[proj][layer])
                    if todo:
                        table = self._native_table(kernel, p.class_index, layer, todo)
                        steps.set(layer, inp, k, table.call(tuple(cols[proj] for proj in todo)))
        return steps

    def native_failure(self, pass_index: int) -> LoRAApplyError:
        """What :meth:`apply_many` raises when the native LoRA call of pass ``pass_index`` fails."""
        p = self._passes[pass_index]
        return self._failure(p, f"native LoRA kernel failed: rank {self.bank.rank_classes[p.class_index]}")

    def _run_pass(self, p: _ClassPass, layer: int, x: torch.Tensor,
                  todo: tuple[tuple[str, torch.Tensor], ...]) -> None:
        if p.path == "native":
            kernel = lora_rows_kernel()
            assert kernel is not None  # the native path is chosen only where the kernel built
            table = self._native_table(kernel, p.class_index, layer, tuple(proj for proj, _ in todo))
            kernel.run(table, x, [out for _, out in todo], p.plan.rows, p.plan.row_slots)
            return
        for proj, out in todo:
            a, b, scale = self.bank.stacks(p.class_index, layer, proj)
            lora_apply(out, x, a, b, scale, p.plan, path=p.path, native=p.native)

    def _native_table(self, kernel: Any, c: int, layer: int, projs: tuple[str, ...]) -> Any:
        bank = self.bank
        return bank.derived(c, ("native", layer, projs),
                            lambda: kernel.table([bank.stacks(c, layer, proj) for proj in projs]))
