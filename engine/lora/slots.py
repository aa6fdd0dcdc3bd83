"""Device slots for adapters, one stack per rank class so a rank-8 adapter does not pay for rank 64.

``stacks(c, layer, proj)`` gives ``A [S, r_c, in]``, ``B [S, out, r_c]`` (a view of the stored
``B^T``) and ``scale [S]``, what the batched op takes. Slot ids are global: class ``c`` owns
``[c * S, (c + 1) * S)``. Layout and sizes: docs/DESIGN.md, "Rank classes".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine.lora.peft import LoRAWeights, peak
from loraplex.modelinfo import PROJECTIONS, ModelInfo


class RankTooLarge(ValueError):
    """The adapter's rank exceeds the largest rank class."""


class NonFiniteAdapter(ValueError):
    """The adapter's scale or weights are NaN or Inf once scaled and cast to the serving dtype."""


def check_finite(weights: LoRAWeights, dtype: torch.dtype, *, tensors: bool = True) -> None:
    """Refuse (:class:`NonFiniteAdapter`) an adapter a slot of ``dtype`` cannot hold finitely:
    per module the scale (alpha/r or alpha/sqrt(r), patterns applied), ``A`` and ``scale * B``
    must all be finite in ``dtype`` (each tensor's peak within the dtype's range: a value past
    it would round to Inf). ``tensors=False``: the scales only (no pass over the weights; what a
    slot write needs so that it never overflows half-way)."""
    top = torch.finfo(dtype).max
    name = str(dtype).removeprefix("torch.")
    for (layer, proj), mod in sorted(weights.modules.items()):
        where = f"layers.{layer}.{proj}"
        scale = float(mod.scale)
        if not math.isfinite(scale) or abs(scale) > top:
            raise NonFiniteAdapter(f"{where}: LoRA scale {scale:g} (lora_alpha / r) is not finite in {name}")
        if not tensors:
            continue
        if not peak(mod.a) <= top:  # NaN compares false
            raise NonFiniteAdapter(f"{where}: lora_A holds values that are NaN or Inf in {name}")
        b = peak(mod.b)
        if not b <= top:
            raise NonFiniteAdapter(f"{where}: lora_B holds values that are NaN or Inf in {name}")
        if b * abs(scale) > top:
            raise NonFiniteAdapter(f"{where}: lora_B scaled by {scale:g} (lora_alpha / r) overflows {name}")


@dataclass
class SlotImage:
    """An adapter laid out as a slot of its rank class holds it: per targeted projection ``A``
    ``[L, r_c, in]`` and ``B^T`` ``[L, r_c, out]`` in the bank's weights dtype, zero-padded to
    the class rank, with the per-layer scales and presence. Built by the loader threads
    (:meth:`SlotBank.image`), so that placing an adapter in a slot is a few contiguous copies on
    the engine thread instead of a copy, transpose and conversion per module."""

    rank: int
    class_index: int
    a: dict[str, torch.Tensor]
    bt: dict[str, torch.Tensor]
    scale: dict[str, torch.Tensor]
    present: dict[str, torch.Tensor]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.a, self.bt, self.scale) for t in d.values())

    def pin_memory(self) -> SlotImage:
        """A copy in page-locked memory (host-to-GPU copies can then run asynchronously)."""
        pin = {k: {p: t.pin_memory() for p, t in d.items()} for k, d in
               (("a", self.a), ("bt", self.bt), ("scale", self.scale))}
        return SlotImage(self.rank, self.class_index, pin["a"], pin["bt"], pin["scale"], self.present)


@dataclass
class _ClassStacks:
    a: dict[str, torch.Tensor]       # proj -> [L, S, r, in]
    bt: dict[str, torch.Tensor]      # proj -> [L, S, r, out] (B transposed)
    scale: dict[str, torch.Tensor]   # proj -> [L, S]
    present: dict[str, torch.Tensor]  # proj -> [L, S] bool, on CPU


class SlotBank:
    def __init__(
        self,
        num_layers: int,
        shapes: Mapping[str, tuple[int, int]],
        rank_classes: Iterable[int] = (8, 16, 32, 64),
        slots_per_class: int = 8,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        weights_dtype: torch.dtype | None = None,
    ) -> None:
        """``dtype``: the activations' (and the scales'); ``weights_dtype``: A's and B's storage
        (default ``dtype``; bfloat16 under float32 halves the bytes every decode step streams)."""
        classes = tuple(sorted({int(r) for r in rank_classes}))
        if not classes or classes[0] <= 0:
            raise ValueError(f"rank classes must be positive, got {tuple(rank_classes)}")
        if slots_per_class <= 0:
            raise ValueError("slots_per_class must be positive")
        self.num_layers = num_layers
        self.shapes = dict(shapes)
        self.projections = tuple(self.shapes)
        self.rank_classes = classes
        self.slots_per_class = slots_per_class
        self.dtype = dtype
        self.weights_dtype = weights_dtype or dtype
        self.device = torch.device(device)
        self._stacks: dict[int, _ClassStacks] = {}
        self._derived: dict[tuple[int, Hashable], Any] = {}

    @classmethod
    def for_model(cls, model: ModelInfo, rank_classes: Iterable[int], slots_per_class: int, *,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  projections: Iterable[str] = PROJECTIONS, weights_dtype: torch.dtype | None = None) -> SlotBank:
        shapes = {p: model.projection_shape(p) for p in projections}
        return cls(model.num_layers, shapes, rank_classes, slots_per_class, dtype=dtype, device=device,
                   weights_dtype=weights_dtype)

    # --- slot ids ------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self.rank_classes) * self.slots_per_class

    def class_of_rank(self, rank: int) -> int:
        """Index of the smallest rank class that holds ``rank``."""
        for c, rc in enumerate(self.rank_classes):
            if rank <= rc:
                return c
        raise RankTooLarge(f"rank {rank} exceeds the largest rank class {self.rank_classes[-1]}")

    def slot_ids(self, class_index: int) -> range:
        s = self.slots_per_class
        return range(class_index * s, (class_index + 1) * s)

    def split(self, slot: int) -> tuple[int, int]:
        """Global slot id -> (class index, slot inside the class)."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        return divmod(slot, self.slots_per_class)

    # --- storage -------------------------------------------------------------------------
    def allocated(self, class_index: int) -> bool:
        return class_index in self._stacks

    def nbytes(self) -> int:
        total = 0
        for st in self._stacks.values():
            for t in (*st.a.values(), *st.bt.values(), *st.scale.values()):
                total += t.numel() * t.element_size()
        return total

    def capacity(self, class_index: int) -> int:
        """Slots of the class allocated so far (storage grows by doubling up to ``slots_per_class``)."""
        st = self._stacks.get(class_index)
        return 0 if st is None else st.scale[self.projections[0]].shape[1]

    def _class(self, c: int, need: int = 1) -> _ClassStacks:
        """The class's stacks with at least ``need`` slots allocated (existing slots kept)."""
        st = self._stacks.get(c)
        have = self.capacity(c)
        if st is not None and need <= have:
            return st
        cap = min(self.slots_per_class, max(need, 2 * have, 1))
        r, L = self.rank_classes[c], self.num_layers
        kw: dict[str, Any] = {"dtype": self.dtype, "device": self.device}
        wkw: dict[str, Any] = {"dtype": self.weights_dtype, "device": self.device}
        new = _ClassStacks(
            a={p: torch.zeros(L, cap, r, fi, **wkw) for p, (fi, _fo) in self.shapes.items()},
            bt={p: torch.zeros(L, cap, r, fo, **wkw) for p, (_fi, fo) in self.shapes.items()},
            scale={p: torch.zeros(L, cap, **kw) for p in self.shapes},
            present={p: torch.zeros(L, cap, dtype=torch.bool) for p in self.shapes},
        )
        if st is not None:
            for p in self.shapes:
                new.a[p][:, :have].copy_(st.a[p])
                new.bt[p][:, :have].copy_(st.bt[p])
                new.scale[p][:, :have].copy_(st.scale[p])
                new.present[p][:, :have].copy_(st.present[p])
        self._stacks[c] = new
        for key in [k for k in self._derived if k[0] == c]:
            del self._derived[key]
        return new

    def derived(self, class_index: int, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``, memoized per class until its storage is reallocated: for things built
        from the stacks' addresses (the native kernel's argument tables)."""
        k = (class_index, key)
        value = self._derived.get(k)
        if value is None:
            value = self._derived[k] = make()
        return value

    def image(self, weights: LoRAWeights, class_index: int | None = None) -> SlotImage:
        """``weights`` laid out for a slot of rank class ``class_index`` (default: the smallest
        that holds them; see :class:`SlotImage`). Shapes and scales are checked here; the
        weights' values are the loader's to check (:func:`check_finite`)."""
        c = self.class_of_rank(weights.rank) if class_index is None else class_index
        rc, L = self.rank_classes[c], self.num_layers
        if weights.rank > rc:
            raise RankTooLarge(f"rank {weights.rank} does not fit rank class {rc}")
        for (layer, proj) in weights.modules:
            if proj not in self.shapes:
                raise ValueError(f"projection {proj!r} has no slot storage (bank holds {self.projections})")
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"layer {layer} out of range for a {self.num_layers}-layer bank")
        check_finite(weights, self.weights_dtype, tensors=False)
        projs = sorted({proj for _, proj in weights.modules})
        wkw: dict[str, Any] = {"dtype": self.weights_dtype}
        img = SlotImage(weights.rank, c,
                        a={p: torch.zeros(L, rc, self.shapes[p][0], **wkw) for p in projs},
                        bt={p: torch.zeros(L, rc, self.shapes[p][1], **wkw) for p in projs},
                        scale={p: torch.zeros(L, dtype=self.dtype) for p in projs},
                        present={p: torch.zeros(L, dtype=torch.bool) for p in projs})
        for (layer, proj), mod in weights.modules.items():
            r = mod.rank
            img.a[proj][layer, :r].copy_(mod.a)
            img.bt[proj][layer, :r].copy_(mod.b.T)
        for p in projs:
            layers = [layer for (layer, proj) in weights.modules if proj == p]
            img.scale[p][layers] = torch.tensor([float(weights.modules[(layer, p)].scale) for layer in layers],
                                                dtype=self.dtype)
            img.present[p][layers] = True
        return img

    def write(self, slot: int, weights: LoRAWeights | SlotImage) -> None:
        """Copy an adapter (or its :meth:`image`) into ``slot``; the projections it does not
        adapt are zeroed. An image is checked when it is made, not here."""
        c, i = self.split(slot)
        img = weights if isinstance(weights, SlotImage) else self.image(weights, c)
        if img.class_index != c:
            raise ValueError(f"an image for rank class {self.rank_classes[img.class_index]} cannot fill slot {slot} "
                             f"(rank class {self.rank_classes[c]})")
        st = self._class(c, need=i + 1)
        non_blocking = self.device.type == "cuda"
        for p in self.shapes:
            if p in img.a:
                st.a[p][:, i].copy_(img.a[p], non_blocking=non_blocking)
                st.bt[p][:, i].copy_(img.bt[p], non_blocking=non_blocking)
                st.scale[p][:, i].copy_(img.scale[p], non_blocking=non_blocking)
                st.present[p][:, i].copy_(img.present[p])
            else:
                st.a[p][:, i].zero_()
                st.bt[p][:, i].zero_()
                st.scale[p][:, i] = 0
                st.present[p][:, i] = False

    def clear(self, slot: int) -> None:
        c, i = self.split(slot)
        if i >= self.capacity(c):
            return
        st = self._stacks[c]
        for p in self.shapes:
            st.a[p][:, i].zero_()
            st.bt[p][:, i].zero_()
            st.scale[p][:, i] = 0
            st.present[p][:, i] = False

    def stacks(self, class_index: int, layer: int, proj: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(A [C, r, in], B [C, out, r], scale [C])`` of one class, layer and projection
        (``C`` = the class's current capacity; take them per call, storage may grow between steps)."""
        st = self._class(class_index)
        return st.a[proj][layer], st.bt[proj][layer].transpose(1, 2), st.scale[proj][layer]

    def layers_with_module(self, class_index: int, proj: str, local_slots: Iterable[int]) -> list[bool]:
        """For each layer: does any of ``local_slots`` adapt ``proj`` there?"""
        st = self._class(class_index)
        idx = torch.as_tensor(list(local_slots), dtype=torch.int64)
        if idx.numel() == 0:
            return [False] * self.num_layers
        return st.present[proj][:, idx].any(dim=1).tolist()
