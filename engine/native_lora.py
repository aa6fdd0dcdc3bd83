"""The native multi-LoRA kernels (``engine.native``'s library): a step's LoRA rows per projection
(``LoRARows``), and the step's passes as the one-call decoder applies them (``LoRASteps``)."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from functools import lru_cache

import torch

from engine.native import INT, PTR, library

log = logging.getLogger("loraplex.engine.native")


class _LoraCall(ctypes.Structure):
    _fields_ = [("y_cols", PTR), ("out_dims", PTR), ("a_ptrs", PTR), ("b_ptrs", PTR), ("scale_ptrs", PTR),
                ("num_targets", INT), ("b_transposed", INT), ("in_dim", INT), ("rank", INT),
                ("weights_bf16", INT)]


class _LoraPass(ctypes.Structure):
    _fields_ = [("rows", PTR), ("row_slots", PTR), ("num_rows", INT)]


class _Lora(ctypes.Structure):
    _fields_ = [("passes", PTR), ("calls", PTR), ("num_passes", INT)]


class LoRASteps:
    """A step's LoRA rows as :class:`DecoderLayers` applies them: per rank class (pass) its rows
    sorted by slot, and per layer, input (q|k|v, o, gate|up, down) and pass the stacks to apply
    (:meth:`LoRATable.call`) or none."""

    INPUTS = 4
    FAILED = 1000
    """The decoder's return code for a failed LoRA call: this plus the index of its pass."""

    def __init__(self, passes: Sequence[tuple[torch.Tensor, torch.Tensor]], num_layers: int) -> None:
        """``passes``: per pass ``(rows, row_slots)``, int64 contiguous; fill the calls with :meth:`set`."""
        self.num_passes = len(passes)
        for rows, row_slots in passes:
            assert rows.dtype == row_slots.dtype == torch.int64 and rows.is_contiguous() and row_slots.is_contiguous()
        self._passes = (_LoraPass * self.num_passes)(*(_LoraPass(r.data_ptr(), rs.data_ptr(), int(r.numel()))
                                                       for r, rs in passes))
        self._calls = (ctypes.c_void_p * (num_layers * self.INPUTS * self.num_passes))()
        self._keep: list[object] = [passes]
        self.args = _Lora(ctypes.addressof(self._passes), ctypes.addressof(self._calls), self.num_passes)

    def set(self, layer: int, inp: int, pass_index: int, call: _LoraCall) -> None:
        self._calls[(layer * self.INPUTS + inp) * self.num_passes + pass_index] = ctypes.addressof(call)
        self._keep.append(call)


class LoRATable:
    """Kernel arguments for the LoRA stacks of projections that read the same input
    (validated once; build with :meth:`LoRARows.table`, keep while the stacks live)."""

    __slots__ = ("_calls", "_keep", "a_ptrs", "b_ptrs", "bf16", "in_dim", "n", "out_dims", "rank", "scale_ptrs",
                 "transposed")

    def __init__(self, stacks: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        if not stacks:
            raise ValueError("no LoRA stacks")
        a0 = stacks[0][0]
        _, self.rank, self.in_dim = a0.shape
        self.transposed = stacks[0][1].transpose(1, 2).is_contiguous()
        self.bf16 = a0.dtype == torch.bfloat16
        for a, b, scale in stacks:
            s, r, n_in = a.shape
            assert (r, n_in) == (self.rank, self.in_dim), "stacks of one call share rank and input size"
            assert a.dtype == b.dtype == a0.dtype and a.dtype in (torch.float32, torch.bfloat16)
            assert scale.dtype == torch.float32 and a.device.type == "cpu"
            assert a.is_contiguous() and scale.is_contiguous() and b.shape == (s, b.shape[1], r)
            assert scale.shape == (s,)
            assert b.transpose(1, 2).is_contiguous() if self.transposed else b.is_contiguous()
        self.n = len(stacks)
        arr = ctypes.c_int64 * self.n
        self.out_dims = arr(*(b.shape[1] for _, b, _ in stacks))
        self.a_ptrs = arr(*(a.data_ptr() for a, _, _ in stacks))
        self.b_ptrs = arr(*(b.data_ptr() for _, b, _ in stacks))
        self.scale_ptrs = arr(*(sc.data_ptr() for _, _, sc in stacks))
        self._keep = tuple(stacks)
        self._calls: dict[tuple[int, ...], _LoraCall] = {}

    def call(self, cols: tuple[int, ...]) -> _LoraCall:
        """These stacks as one LoRA call of :class:`DecoderLayers`, their outputs at columns
        ``cols`` of the matmul's output (built once per ``cols``, kept with the table)."""
        c = self._calls.get(cols)
        if c is None:
            assert len(cols) == self.n
            y_cols = (ctypes.c_int64 * self.n)(*cols)
            c = self._calls[cols] = _LoraCall(ctypes.addressof(y_cols), ctypes.addressof(self.out_dims),
                                              ctypes.addressof(self.a_ptrs), ctypes.addressof(self.b_ptrs),
                                              ctypes.addressof(self.scale_ptrs), self.n, int(self.transposed),
                                              self.in_dim, self.rank, int(self.bf16))
            c.keep = (y_cols, self)  # the column offsets, and the arrays the other pointers name
        return c


class LoRARows:
    """``out_p[rows[n]] += scale_p[s] * B_p[s] @ (A_p[s] @ x[rows[n]])`` with ``s = row_slots[n]``,
    for one or several projections ``p`` of the same input (see ``engine/csrc/cpu_kernels.c``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.loraplex_lora_rows_f32
        # The AVX-512 and AVX2 builds take each segment of one adapter in blocks (B transposed,
        # rank a multiple of 8): prefill too (engine.lora.ops.native_max_tokens).
        self.blocked = bool(lib.loraplex_lora_rows_blocked())

    @staticmethod
    def table(stacks: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> LoRATable:
        """``stacks``: per projection ``(A [S, r, in] contiguous, B [S, out, r] contiguous or the
        transposed view of a contiguous [S, r, out] (as ``SlotBank`` stores it: the faster
        expand), scale [S])`` on CPU, one rank and input size; A and B float32 or bfloat16 (the
        math stays float32), the scales float32."""
        return LoRATable(stacks)

    def run(self, table: LoRATable, x: torch.Tensor, outs: Sequence[torch.Tensor], rows: torch.Tensor,
            row_slots: torch.Tensor) -> None:
        """``x``: ``[T, in]``; ``outs``: one ``[T, out_p]`` per stack of the table, column slices of
        one float32 tensor (e.g. q/k/v of a fused projection's output; rows may be strided,
        columns contiguous); ``rows``/``row_slots``: ``[n]`` int64 contiguous, best sorted by slot."""
        y = outs[0]
        stride = y.stride(0)
        assert len(outs) == table.n and x.dtype == y.dtype == torch.float32
        assert x.stride(1) == 1 and x.shape[1] == table.in_dim
        base = y.data_ptr()
        cols = (ctypes.c_int64 * table.n)()
        for p, o in enumerate(outs):
            assert o.stride(1) == 1 and o.stride(0) == stride and o.shape == (y.shape[0], table.out_dims[p])
            assert o.dtype == torch.float32
            cols[p] = (o.data_ptr() - base) // 4
        assert rows.dtype == row_slots.dtype == torch.int64 and rows.is_contiguous() and row_slots.is_contiguous()
        rc = self._fn(x.data_ptr(), x.stride(0), base, stride, table.n, cols, table.out_dims, table.a_ptrs,
                      table.b_ptrs, table.scale_ptrs, int(table.transposed), rows.data_ptr(), row_slots.data_ptr(),
                      int(rows.numel()), table.in_dim, table.rank, int(table.bf16), torch.get_num_threads())
        if rc == 1:
            raise MemoryError("native LoRA kernel: no memory for the shrunk rows")
        if rc != 0:
            raise RuntimeError(f"native LoRA kernel failed ({rc}): rank {table.rank}")

    def __call__(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                 rows: torch.Tensor, row_slots: torch.Tensor) -> None:
        """One projection: ``y [T, out]``, ``x [T, in]``, stacks as in :meth:`table`."""
        self.run(self.table([(a, b, scale)]), x, [y], rows, row_slots)


@lru_cache(maxsize=1)
def lora_rows_kernel() -> LoRARows | None:
    lib = library()
    return LoRARows(lib) if lib is not None else None
