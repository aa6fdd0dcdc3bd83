"""8-bit and 4-bit projection weights in blocks of 32 (llama.cpp's Q8_0 and Q4_1 ideas), for
``LORAPLEX_WEIGHTS=int8`` and ``int4``.

A weight ``W [N, K]`` is held as int8 values ``q`` with one float32 scale per block of 32
consecutive inputs of an output row: ``W[n, k] ~= d[n, k // 32] * q[n, k]`` (``d`` = the block's
absmax / 127, about 1.1 bytes per weight instead of 4). A GGUF tensor already in Q8_0 is read
as it is (its float16 scales widened to float32, exactly); float weights are quantized here.

The matmul quantizes each activation row the same way on the fly, so every block's product is
an exact integer dot product, scaled by ``d_w * d_x`` into float32 sums (the native
``loraplex_q8_matmul_f32``, AVX512-VNNI where the CPU has it). :func:`pack_q8` lays the weights
out for that kernel once, at load; :func:`q8_matmul_reference` is the same arithmetic in torch
(the path when the native kernels are off, and the tests' reference).

The 4-bit format (:class:`Q4Weight`, section below) adds an offset per block, as GGUF Q4_1 does,
and has the same three pieces: :func:`pack_q4`, ``loraplex_q4_matmul_f32`` and
:func:`q4_matmul_reference`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
"""Inputs per scale."""
TILE = 16
"""Output rows per packed tile (one 512-bit register of int32 sums)."""
Q8_0_BYTES = 2 + BLOCK
"""A GGUF Q8_0 block: a float16 scale, then 32 int8 values."""


@dataclass
class Q8Weight:
    """``q`` int8 ``[N, ceil(K / 32) * 32]`` (inputs past ``in_features`` are zero), ``d`` float32
    ``[N, ceil(K / 32)]``: the matrix ``d[n, k // 32] * q[n, k]`` of shape ``[N, in_features]``."""

    q: torch.Tensor
    d: torch.Tensor
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.d.numel() * self.d.element_size()

    def dequantize(self) -> torch.Tensor:
        n, kp = self.q.shape
        w = self.q.float().view(n, kp // BLOCK, BLOCK) * self.d.unsqueeze(-1)
        return w.view(n, kp)[:, :self.in_features].contiguous()

    def rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> Q8Weight:
        """The same rows reordered by ``fn`` (a function of a row-major array, e.g. the loader's
        q/k un-permutation), applied to the values and their scales alike."""
        return Q8Weight(torch.from_numpy(np.ascontiguousarray(fn(self.q.numpy()))),
                        torch.from_numpy(np.ascontiguousarray(fn(self.d.numpy()))), self.in_features)

    @staticmethod
    def cat(parts: list[Q8Weight]) -> Q8Weight:
        """The parts' rows stacked (as ``torch.cat(dim=0)``), e.g. q|k|v fused."""
        assert len({p.in_features for p in parts}) == 1
        return Q8Weight(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), parts[0].in_features)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of float ``x [M, K]`` to blocks of 32: ``(q int8 [M, Kp], d float32 [M, Kp / 32])`` with
    ``d`` = absmax / 127 and ``q = round(x / d)`` (to nearest even; ``x * (1 / d)`` in float32, as
    the native kernel rounds the activations). ``Kp`` is ``K`` padded with zeros to whole blocks."""
    x = x.float()
    m, k = x.shape
    kp = -(-k // BLOCK) * BLOCK
    if kp != k:
        x = torch.nn.functional.pad(x, (0, kp - k))
    xb = x.reshape(m, kp // BLOCK, BLOCK)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int8)
    return q.reshape(m, kp), d


def quantize_q8(w: torch.Tensor) -> Q8Weight:
    """A float matrix ``[N, K]`` in 8 bits."""
    q, d = quantize_blocks(w)
    return Q8Weight(q, d, w.shape[1])


def q8_0_from_gguf(raw: np.ndarray, shape: tuple[int, int]) -> Q8Weight:
    """A GGUF Q8_0 tensor's raw bytes (``loraplex.gguf_file.GGUFTensor.data``, uint8) of logical
    ``shape`` ``[N, K]``, read as they are: no dequantize, no requantization."""
    n, k = shape
    if k % BLOCK:
        raise ValueError(f"a Q8_0 tensor's rows hold whole blocks of {BLOCK}, not {k}")
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n * (k // BLOCK), Q8_0_BYTES)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(n, k // BLOCK)
    q = blocks[:, 2:].copy().view(np.int8).reshape(n, k)
    return Q8Weight(torch.from_numpy(q), torch.from_numpy(d), k)


@dataclass
class PackedQ8:
    """:class:`Q8Weight` laid out for ``loraplex_q8_matmul_f32``: per tile of 16 output rows (the
    last padded with zero rows) and block, ``q`` as 8 groups x 16 rows x 4 inputs, ``d`` the 16
    rows' scales, ``comp`` 128 x the sum of each row's block of ``q`` (the kernel feeds the
    activations + 128 to an unsigned x signed byte product and subtracts this)."""

    q: torch.Tensor
    d: torch.Tensor
    comp: torch.Tensor
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.comp))

    def unpack(self) -> Q8Weight:
        """The row-major :class:`Q8Weight` this was packed from."""
        tiles, nb, groups, tile, four = self.q.shape
        n = self.out_features
        q = self.q.permute(0, 3, 1, 2, 4).reshape(tiles * tile, nb * groups * four)[:n]
        d = self.d.permute(0, 2, 1).reshape(tiles * tile, nb)[:n]
        return Q8Weight(q.contiguous(), d.contiguous(), self.in_features)


def pack_q8(w: Q8Weight) -> PackedQ8:
    """``w`` in the native kernel's tiles (a copy; :meth:`PackedQ8.unpack` inverts it)."""
    n, kp = w.q.shape
    nb = kp // BLOCK
    pad = -n % TILE
    q, d = w.q, w.d
    if pad:
        q = torch.cat([q, q.new_zeros(pad, kp)])
        d = torch.cat([d, d.new_zeros(pad, nb)])
    tiles = (n + pad) // TILE
    qp = q.view(tiles, TILE, nb, BLOCK // 4, 4).permute(0, 2, 3, 1, 4).contiguous()
    dp = d.view(tiles, TILE, nb).permute(0, 2, 1).contiguous()
    comp = (q.view(tiles, TILE, nb, BLOCK).sum(-1, dtype=torch.int32) * 128).permute(0, 2, 1).contiguous()
    return PackedQ8(qp, dp.float(), comp.to(torch.int32), n, w.in_features)


def q8_matmul_reference(x: torch.Tensor, w: Q8Weight, bias: torch.Tensor | None = None,
                        chunk: int = 64) -> torch.Tensor:
    """``x [M, K]`` float32 times ``w``'s transpose with the activations quantized per row and
    block of 32, as the native kernel computes it (blockwise exact integer products, float32
    scales); ``chunk`` rows at a time to bound the ``[rows, N, blocks]`` intermediate."""
    n, kp = w.q.shape
    nb = kp // BLOCK
    wq = w.q.float().view(n, nb, BLOCK)
    out = []
    for x_rows in x.split(chunk):
        xq, xd = quantize_blocks(x_rows)
        dots = torch.einsum("mbk,nbk->mnb", xq.float().view(-1, nb, BLOCK), wq)  # exact integers
        out.append((dots * (xd.unsqueeze(1) * w.d.unsqueeze(0))).sum(-1))
    y = torch.cat(out) if out else x.new_empty((0, n))
    return y + bias if bias is not None else y


# --- 4 bits -------------------------------------------------------------------------------------
# ``LORAPLEX_WEIGHTS=int4``: ``W[n, k] = d[n, k // 32] * q[n, k] + m[n, k // 32]`` with q in
# 0..15 and a float32 scale ``d`` and offset ``m`` per block of 32 inputs of an output row. GGUF
# Q4_1 (float16 d and m) and Q4_0 (float16 d, ``W = d * (q - 8)``: m = -8d) map onto it exactly;
# float weights are quantized Q4_1-style (d = (max - min) / 15, m = min). The matmul quantizes
# the activations as the 8-bit one does and keeps each block's ``dx * sum(xq)``, so a block adds
# ``d_w * dx * dot(q, xq) + m_w * dx * sum(xq)``: one exact integer dot product and the offset.

INT4 = torch.uint4  # type: ignore[attr-defined]  # torch's stubs leave the sub-byte dtypes out
"""The ``matmul_dtype`` that stands for ``LORAPLEX_WEIGHTS=int4`` (projections in these blocks)."""
QUANTIZED = (torch.int8, INT4)
"""The ``matmul_dtype`` values whose projections are blocks of this module (8 or 4 bits)."""


def dtype_name(dtype: torch.dtype) -> str:
    """A ``matmul_dtype`` (or any dtype) as the settings spell it: ``int4`` for ``INT4``, ``float32``..."""
    return "int4" if dtype == INT4 else str(dtype).removeprefix("torch.")
Q4_0_BYTES = 2 + BLOCK // 2
"""A GGUF Q4_0 block: a float16 scale, then 16 bytes of nibbles."""
Q4_1_BYTES = 4 + BLOCK // 2
"""A GGUF Q4_1 block: float16 scale and offset, then 16 bytes of nibbles."""


@dataclass
class Q4Weight:
    """``q`` uint8 ``[N, ceil(K / 32) * 32]`` holding 0..15 (one value a byte while loading;
    inputs past ``in_features`` are zero), ``d`` and ``m`` float32 ``[N, ceil(K / 32)]``: the
    matrix ``d[n, k // 32] * q[n, k] + m[n, k // 32]`` of shape ``[N, in_features]``."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        return self.q.numel() + (self.d.numel() + self.m.numel()) * 4

    def dequantize(self) -> torch.Tensor:
        """In float32, ``d * q + m`` (exact for GGUF's float16 ``d``: a product of at most
        15 significant bits, then one rounding, as gguf's own dequantize computes it)."""
        n, kp = self.q.shape
        w = self.q.float().view(n, kp // BLOCK, BLOCK) * self.d.unsqueeze(-1) + self.m.unsqueeze(-1)
        return w.view(n, kp)[:, :self.in_features].contiguous()

    def rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> Q4Weight:
        """The same rows reordered by ``fn`` (as :meth:`Q8Weight.rows`), on q, d and m alike."""
        def f(t: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(fn(t.numpy())))
        return Q4Weight(f(self.q), f(self.d), f(self.m), self.in_features)

    @staticmethod
    def cat(parts: list[Q4Weight]) -> Q4Weight:
        """The parts' rows stacked (as ``torch.cat(dim=0)``), e.g. gate|up fused."""
        assert len({p.in_features for p in parts}) == 1
        return Q4Weight(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]),
                        torch.cat([p.m for p in parts]), parts[0].in_features)


def quantize_q4(w: torch.Tensor) -> Q4Weight:
    """A float matrix ``[N, K]`` in 4 bits, Q4_1-style: per block of 32 inputs ``m`` = its
    minimum, ``d = (max - min) / 15``, ``q = round((w - m) / d)`` (the nearest of the 16 levels;
    a constant block is ``m`` exactly). Padding past ``K`` takes no part in min and max."""
    w = w.float()
    n, k = w.shape
    kp = -(-k // BLOCK) * BLOCK
    wb = torch.nn.functional.pad(w, (0, kp - k)).view(n, kp // BLOCK, BLOCK)
    real = (torch.arange(kp) < k).view(1, kp // BLOCK, BLOCK)
    lo = torch.where(real, wb, torch.inf).amin(-1)
    hi = torch.where(real, wb, -torch.inf).amax(-1)
    d = (hi - lo) / 15.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((wb - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp_(0, 15)
    q = torch.where(real, q, 0.0).to(torch.uint8)
    return Q4Weight(q.view(n, kp), d, lo, k)


def q4_from_gguf(raw: np.ndarray, shape: tuple[int, int], offset: bool) -> Q4Weight:
    """A GGUF Q4_1 (``offset``) or Q4_0 tensor's raw bytes (``GGUFTensor.data``)
    of logical ``shape`` ``[N, K]``, read as they are: float16 ``d`` (and ``m``; Q4_0's is
    ``-8 d``) widened to float32, the nibbles unpacked (low = inputs 0..15 of a block, high =
    16..31), nothing dequantized or requantized."""
    n, k = shape
    if k % BLOCK:
        raise ValueError(f"a Q4 tensor's rows hold whole blocks of {BLOCK}, not {k}")
    size = Q4_1_BYTES if offset else Q4_0_BYTES
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(n * (k // BLOCK), size)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(n, k // BLOCK)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(n, k // BLOCK) if offset else -8.0 * d
    nib = blocks[:, size - BLOCK // 2:]
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=1).reshape(n, k)
    return Q4Weight(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(np.ascontiguousarray(m)), k)


@dataclass
class PackedQ4:
    """:class:`Q4Weight` laid out for ``loraplex_q4_matmul_f32``: per tile of 16 output rows (the
    last padded with zero rows) and block, ``q`` as 4 pairs x 16 rows x 4 bytes, byte ``t`` of
    row ``j`` in pair ``p`` holding input ``4p + t`` in its low nibble and ``16 + 4p + t`` in its
    high one (a 64-byte load gives two groups of 4 inputs for 16 rows by and/shift); then the
    16 rows' ``d`` and ``m``. Half a byte per weight plus 8 bytes per block of 32."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    out_features: int
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m))

    def unpack(self) -> Q4Weight:
        """The row-major :class:`Q4Weight` this was packed from."""
        tiles, nb, _, tile, _ = self.q.shape
        n = self.out_features
        q = torch.stack([self.q & 0x0F, self.q >> 4], dim=2)  # [tiles, nb, half, pair, row, 4]
        q = q.permute(0, 4, 1, 2, 3, 5).reshape(tiles * tile, nb * BLOCK)[:n]
        d = self.d.permute(0, 2, 1).reshape(tiles * tile, nb)[:n]
        m = self.m.permute(0, 2, 1).reshape(tiles * tile, nb)[:n]
        return Q4Weight(q.contiguous(), d.contiguous(), m.contiguous(), self.in_features)


def pack_q4(w: Q4Weight) -> PackedQ4:
    """``w`` in the native kernel's tiles (a copy; :meth:`PackedQ4.unpack` inverts it)."""
    n, kp = w.q.shape
    nb = kp // BLOCK
    pad = -n % TILE
    q, d, m = w.q, w.d, w.m
    if pad:
        q = torch.cat([q, q.new_zeros(pad, kp)])
        d = torch.cat([d, d.new_zeros(pad, nb)])
        m = torch.cat([m, m.new_zeros(pad, nb)])
    tiles = (n + pad) // TILE
    # [tiles, row, block, half, pair, 4] -> [tiles, block, pair, row, 4] per half.
    qv = q.view(tiles, TILE, nb, 2, BLOCK // 8, 4).permute(0, 2, 3, 4, 1, 5)
    qp = (qv[:, :, 0] | (qv[:, :, 1] << 4)).contiguous()
    dp = d.view(tiles, TILE, nb).permute(0, 2, 1).contiguous()
    mp = m.view(tiles, TILE, nb).permute(0, 2, 1).contiguous()
    return PackedQ4(qp, dp.float(), mp.float(), n, w.in_features)


def q4_matmul_reference(x: torch.Tensor, w: Q4Weight, bias: torch.Tensor | None = None,
                        chunk: int = 64) -> torch.Tensor:
    """``x [M, K]`` float32 times ``w``'s transpose as the native kernel computes it: the
    activations quantized per row and block of 32 (:func:`quantize_blocks`), each block adding
    ``dot(q, xq) * (d_w * dx) + m_w * (dx * sum(xq))`` (exact integer dot and sum, float32
    scales); ``chunk`` rows at a time to bound the ``[rows, N, blocks]`` intermediate."""
    n, kp = w.q.shape
    nb = kp // BLOCK
    wq = w.q.float().view(n, nb, BLOCK)
    out = []
    for x_rows in x.split(chunk):
        xq, xd = quantize_blocks(x_rows)
        xb = xq.float().view(-1, nb, BLOCK)
        xs = xd * xb.sum(-1)  # dx * sum(xq): the sum is an exact integer
        dots = torch.einsum("mbk,nbk->mnb", xb, wq)  # exact integers
        out.append((dots * (xd.unsqueeze(1) * w.d.unsqueeze(0)) + w.m.unsqueeze(0) * xs.unsqueeze(1)).sum(-1))
    y = torch.cat(out) if out else x.new_empty((0, n))
    return y + bias if bias is not None else y
