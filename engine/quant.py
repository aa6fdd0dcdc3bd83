"""8-bit projection weights in blocks of 32 (llama.cpp's Q8_0 idea), for ``LORAPLEX_WEIGHTS=int8``.

A weight ``W [N, K]`` is held as int8 values ``q`` with one float32 scale per block of 32
consecutive inputs of an output row: ``W[n, k] ~= d[n, k // 32] * q[n, k]`` (``d`` = the block's
absmax / 127, about 1.1 bytes per weight instead of 4). A GGUF tensor already in Q8_0 is read
as it is (its float16 scales widened to float32, exactly); float weights are quantized here.

The matmul quantizes each activation row the same way on the fly, so every block's product is
an exact integer dot product, scaled by ``d_w * d_x`` into float32 sums (the native
``loraplex_q8_matmul_f32``, AVX512-VNNI where the CPU has it). :func:`pack_q8` lays the weights
out for that kernel once, at load; :func:`q8_matmul_reference` is the same arithmetic in torch
(the path when the native kernels are off, and the tests' reference).
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
    """A GGUF Q8_0 tensor's raw bytes (``GGUFReader``'s ``tensor.data``, uint8) of logical
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
