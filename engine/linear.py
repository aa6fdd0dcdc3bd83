"""Projection matmuls, with oneDNN-prepacked weights for CPU float32 batches.

MKL's sgemm repacks the weight matrix on every call, which dominates when the batch
(``M``) is small, as in decode: at ``M = 8..32`` a weight packed once into oneDNN's
blocked layout runs about 1.5-2.5x faster. A single row (one sequence decoding) is a
matrix-vector product: the native ``gemv`` kernel when given (it streams the weights at
close to memory bandwidth; ``F.linear`` reached about a third of it), else ``F.linear``.
Packing is CPU float32 only; elsewhere this is ``F.linear``. On AVX2 CPUs without AVX-512 the
native panel kernel (``engine.native.PanelMatmul``) takes oneDNN's place for every batch.

``BF16Linear`` keeps the weight in bfloat16 under float32 activations (``LORAPLEX_WEIGHTS``):
the input is rounded to bfloat16, the products summed in float32 and the sums rounded to
bfloat16 (on CPUs with AMX or AVX512-BF16 the native tile kernel, ``engine.native.TileMatmul``, for
every batch size; elsewhere oneDNN's bfloat16 matmul, prepacked, and the native bfloat16 ``gemv``
for one row), then widened to float32 for the bias and the rest of the layer. Half the
weight bytes, and on such CPUs twice the multiply-add rate of float32.

``Int8Linear`` keeps the weight in 8 bits, one scale per block of 32 inputs (``engine.quant``,
``LORAPLEX_WEIGHTS=int8``): each input row is quantized the same way on the fly and the blocks'
integer products summed in float32 (the native kernel; AVX512-VNNI where the CPU has it). About
a quarter of float32's weight bytes. ``Int4Linear`` does the same with 4-bit weights (a scale and
an offset per block, GGUF Q4_1's form; ``LORAPLEX_WEIGHTS=int4``): under a fifth of float32's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine.cpu import cpu_has_bf16_matmul
from engine.quant import PackedQ4, PackedQ8, q4_matmul_reference, q8_matmul_reference

if TYPE_CHECKING:
    from engine.native import BlockMatmul, PanelMatmul, TileMatmul


@lru_cache(maxsize=1)
def onednn_packing_available() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(8, 4)
        x = torch.randn(3, 4)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 3)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w), atol=1e-5))
    except (AttributeError, RuntimeError):
        return False


@lru_cache(maxsize=1)
def onednn_bf16_packing_available() -> bool:
    if not (onednn_packing_available() and cpu_has_bf16_matmul()):
        return False
    try:
        w = torch.randn(8, 4).bfloat16()
        x = torch.randn(3, 4).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 3)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y.float(), F.linear(x.float(), w.float()), rtol=1e-2, atol=1e-2))
    except (AttributeError, RuntimeError):
        return False


class Linear:
    """``y = x @ weight.T + bias``; ``weight`` stays available (shapes, LoRA, benchmarks)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack_batch: int = 0,
                 gemv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
                 panel: PanelMatmul | None = None) -> None:
        """``gemv(x, weight, bias)``: single-row products (``engine.native.Gemv``, CPU float32);
        ``panel``: ``engine.native.panel_matmul_kernel()``, for every batch of more than one row
        (the weight packed for it instead of for oneDNN: one more float32 copy of it)."""
        self.weight = weight
        self.bias = bias
        self.gemv = gemv if gemv is not None and weight.is_contiguous() else None
        usable = weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.is_contiguous()
        self.panel = panel if panel is not None and usable else None
        self.panels = self.panel.pack(weight) if self.panel is not None else None
        self.packed: torch.Tensor | None = None
        if (pack_batch > 0 and self.panel is None and weight.device.type == "cpu" and weight.dtype == torch.float32
                and onednn_packing_available()):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, pack_batch)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and self.gemv is not None:
            return self.gemv(x, self.weight, self.bias)
        if self.panel is not None and self.panels is not None and x.dtype == torch.float32:
            return self.panel(x if x.stride(1) == 1 else x.contiguous(), self.panels, self.weight.shape[0], self.bias)
        if self.packed is not None and x.shape[0] > 1:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class BF16Linear:
    """``y = x @ weight.T + bias`` for float32 ``x``, ``bias`` and ``y`` and a bfloat16 ``weight``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack_batch: int = 0,
                 gemv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
                 tile: TileMatmul | None = None) -> None:
        """``gemv``: as for :class:`Linear` (``engine.native.Gemv`` takes bfloat16 weights);
        ``tile``: ``engine.native.tile_matmul_kernel()``, which then runs every batch size (the
        weight packed for it instead of for oneDNN)."""
        assert weight.dtype == torch.bfloat16
        self.weight = weight
        self.bias = bias
        self.tile = tile if tile is not None and weight.device.type == "cpu" and tile.fits(weight) else None
        self.tiles = self.tile.pack(weight) if self.tile is not None else None
        self.gemv = gemv if gemv is not None and weight.is_contiguous() and self.tile is None else None
        self.packed: torch.Tensor | None = None
        if (pack_batch > 0 and self.tile is None and weight.device.type == "cpu"
                and onednn_bf16_packing_available()):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, pack_batch)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` float32, or bfloat16 (already rounded: the same result)."""
        if self.tile is not None and self.tiles is not None:
            return self.tile(x.to(torch.bfloat16), self.tiles, self.weight.shape[0], self.bias, torch.float32)
        if x.shape[0] == 1 and self.gemv is not None and x.dtype == torch.float32:
            return self.gemv(x, self.weight, self.bias)
        y = self.bf16(x).float()
        if self.bias is not None:
            y += self.bias
        return y

    @property
    def fuses_swiglu(self) -> bool:
        """Whether :meth:`swiglu` runs (on the tile kernel, for a weight without bias)."""
        return self.tile is not None and self.bias is None

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """For a fused gate|up weight: ``silu(gate) * up`` in bfloat16 from the rounded sums, what
        ``FusedOps.silu_mul(self.bf16(x), n // 2, torch.bfloat16)`` returns, without the ``[m, n]``
        sums in between (:attr:`fuses_swiglu` only)."""
        assert self.tile is not None and self.tiles is not None and self.bias is None
        return self.tile(x.to(torch.bfloat16), self.tiles, self.weight.shape[0], swiglu=True)

    def bf16(self, x: torch.Tensor) -> torch.Tensor:
        """The bfloat16 sums before the widening and the bias (for a next step that reads
        bfloat16, ``engine.native.FusedOps``): ``x`` float32 or bfloat16."""
        xb = x.to(torch.bfloat16)
        if self.tile is not None and self.tiles is not None:
            return self.tile(xb, self.tiles, self.weight.shape[0])
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(xb.contiguous(), self.packed, None, "none", [], "")
        return F.linear(xb, self.weight)


class BlockLinear:
    """``y = x @ W.T + bias`` for float32 ``x``, ``bias`` and ``y`` and a block-quantized ``W``
    (packed by ``engine.quant``) through ``kernel``; without a kernel, the same arithmetic in
    torch on the unpacked rows (slow: for CPUs where the native kernels do not build)."""

    reference: Callable[..., torch.Tensor]
    """The torch arithmetic of the format (``engine.quant``)."""

    def __init__(self, weight: PackedQ8 | PackedQ4, bias: torch.Tensor | None = None,
                 kernel: BlockMatmul | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self.kernel = kernel
        self.rows = weight.unpack() if kernel is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows is not None:
            return type(self).reference(x, self.rows, self.bias)
        return self.kernel(x, self.weight, self.bias)  # type: ignore[misc]


class Int8Linear(BlockLinear):
    """8-bit ``W`` (:class:`engine.quant.PackedQ8`); ``kernel``: ``engine.native.q8_matmul_kernel()``."""

    reference = staticmethod(q8_matmul_reference)
    weight: PackedQ8

    @property
    def fuses_swiglu(self) -> bool:
        """Whether :meth:`swiglu` runs (the native kernel's fused SwiGLU, for a weight without bias)."""
        return self.kernel is not None and self.bias is None and self.kernel.fuses_swiglu(self.weight)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """For a fused gate|up weight: ``silu(gate) * up``, what ``FusedOps.silu_mul(self(x), n // 2)``
        returns, without the ``[m, n]`` sums in between (:attr:`fuses_swiglu` only: the kernel checks)."""
        return self.kernel.swiglu(x, self.weight)  # type: ignore[union-attr]


class Int4Linear(BlockLinear):
    """4-bit ``W`` (:class:`engine.quant.PackedQ4`); ``kernel``: ``engine.native.q4_matmul_kernel()``."""

    reference = staticmethod(q4_matmul_reference)


def make_linear(weight: torch.Tensor | PackedQ8 | PackedQ4, bias: torch.Tensor | None, activations: torch.dtype,
                pack_batch: int = 0,
                gemv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
                q8_kernel: BlockMatmul | None = None,
                q4_kernel: BlockMatmul | None = None,
                tile: TileMatmul | None = None,
                panel: PanelMatmul | None = None) -> Linear | BF16Linear | BlockLinear:
    """The projection for ``weight`` under activations of dtype ``activations`` (``q8_kernel``:
    ``engine.native.q8_matmul_kernel()`` for an 8-bit ``weight``, ``q4_kernel``: ``engine.native.q4_matmul_kernel()``
    for a 4-bit one, ``tile``: ``engine.native.tile_matmul_kernel()`` for a bfloat16 one, ``panel``:
    ``engine.native.panel_matmul_kernel()`` for a float32 one)."""
    if isinstance(weight, PackedQ8 | PackedQ4):
        if activations != torch.float32 or weight.q.device.type != "cpu":
            raise ValueError("8-bit and 4-bit weights run on CPU under float32 activations")
        if isinstance(weight, PackedQ4):
            return Int4Linear(weight, bias, q4_kernel)
        return Int8Linear(weight, bias, q8_kernel)
    if weight.dtype == torch.bfloat16 and activations == torch.float32:
        return BF16Linear(weight, bias, pack_batch, gemv, tile)
    return Linear(weight, bias, pack_batch, gemv, panel)
