"""The one-call decoder (``engine.native``'s library): a step's decoder layers in one native call,
LoRA rows included, where every projection runs on a native kernel."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from functools import lru_cache

import torch

from engine.kv_cache import KVCache
from engine.native import F32, I64, INT, PTR, library
from engine.native_lora import LoRASteps
from engine.quant import PackedQ4, PackedQ8

log = logging.getLogger("loraplex.engine.native")


class _Weight(ctypes.Structure):
    _fields_ = [("w", PTR), ("d", PTR), ("extra", PTR), ("bias", PTR), ("format", INT), ("n", INT), ("k", INT)]


class _LayerArgs(ctypes.Structure):
    _fields_ = [("input_norm", PTR), ("post_norm", PTR), ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight),
                ("down", _Weight), ("k_pool", PTR), ("v_pool", PTR)]


class _StepArgs(ctypes.Structure):
    _fields_ = [("h", PTR), ("x", PTR), ("qkv", PTR), ("attn", PTR), ("res", PTR), ("mlp", PTR),
                ("gate_up", PTR), ("xb", PTR), ("q", PTR), ("lora", PTR), ("cos", PTR), ("sin", PTR),
                ("head_scale", PTR),
                ("cs_row_stride", I64), ("cs_head_stride", I64), ("slots", PTR), ("row_blocks", PTR),
                ("row_lens", PTR), ("blocks_per_seq", I64), ("pool_slots", I64), ("max_len", INT),
                ("block_size", INT), ("kv_bf16", INT), ("amx", INT), ("act_bf16", INT), ("rows", INT),
                ("hidden", INT), ("heads", INT), ("kv_heads", INT), ("head_dim", INT), ("inter", INT),
                ("eps", F32)]


class NativeWeight:
    """One projection's matrix as :class:`DecoderLayers` reads it: ``tiles`` packed by
    :meth:`TileMatmul.pack` (bfloat16, the bias left to the caller's flow), a
    :class:`engine.quant.PackedQ8` / ``PackedQ4``, or float32 ``panels`` packed by
    :meth:`PanelMatmul.pack` (the bias added by the matmul for these)."""

    TILE, Q8, Q4, PANEL = 0, 1, 2, 3

    def __init__(self, weight: torch.Tensor | PackedQ8 | PackedQ4, bias: torch.Tensor | None,
                 n: int | None = None, single: torch.Tensor | None = None) -> None:
        """``n``: the tiles' or panels' output count (``weight`` then the packed tiles or panels);
        ``single``: with panels, the float32 ``[n, k]`` matrix a single row multiplies on the gemv
        kernel (as :class:`engine.linear.Linear` does), or None (panels for it too)."""
        assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
        self.bias = bias
        # _keep: the tensors behind the C struct's w, d and extra pointers (None, or missing: NULL).
        if isinstance(weight, PackedQ8 | PackedQ4):
            q8 = isinstance(weight, PackedQ8)
            self.format, self.n, self.k = (self.Q8 if q8 else self.Q4), weight.out_features, weight.in_features
            self._keep: tuple[torch.Tensor | None, ...] = (
                weight.q, weight.d, weight.comp if isinstance(weight, PackedQ8) else weight.m)
        elif weight.dtype == torch.float32:
            assert weight.dim() == 3 and weight.shape[2] == 16 and weight.is_contiguous() and n is not None
            assert single is None or (single.shape == (n, weight.shape[1]) and single.dtype == torch.float32
                                      and single.is_contiguous())
            self.format, self.n, self.k = self.PANEL, n, weight.shape[1]
            self._keep = (weight, None, single)
        else:
            assert weight.dtype == torch.bfloat16 and weight.is_contiguous() and n is not None
            self.format, self.n, self.k = self.TILE, n, weight.numel() // n
            self._keep = (weight,)

    def args(self) -> _Weight:
        p = [t.data_ptr() if t is not None else None for t in self._keep] + [None] * (3 - len(self._keep))
        return _Weight(*p, self.bias.data_ptr() if self.bias is not None else None, self.format, self.n, self.k)


class DecoderLayers:
    """A step's decoder layers in one native call (``engine/csrc``, section 10), for a model whose
    matrices all run on native kernels (:class:`NativeWeight`: bfloat16 on the tile kernel, 8- and
    4-bit blocks, or float32 panels), the step's LoRA rows included (:class:`LoRASteps`): per layer the kernels
    the model calls one by one (``engine.model.DecoderModel``), in the same order with the same
    arguments, so the same numbers bit for bit; what it saves is the interpreter between them (240
    ctypes calls a step for a 30-layer model, about 400 with adapters, each with its checks and
    allocations, while the second OpenMP thread spins).

    Built once per model and KV cache with :meth:`layers` (weights and pools stay where they are)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.loraplex_decoder_layers

    @staticmethod
    def layers(weights: Sequence[tuple[torch.Tensor, torch.Tensor, NativeWeight, NativeWeight, NativeWeight,
                                       NativeWeight]], cache: KVCache) -> ctypes.Array:
        """``weights``: per layer ``(input_norm, post_norm, qkv, o, gate_up, down)``, every matrix
        of one kind (tiles, or blocks); the pools are ``cache``'s."""
        assert len(weights) == len(cache.k)
        tiles = weights[0][2].format == NativeWeight.TILE
        arr = (_LayerArgs * len(weights))()
        for i, (in_norm, post_norm, *mats) in enumerate(weights):
            assert in_norm.dtype == post_norm.dtype == torch.float32 and in_norm.is_contiguous()
            assert all((m.format == NativeWeight.TILE) == tiles for m in mats), "tiles and blocks do not mix"
            assert not tiles or all(m.bias is None for m in mats[1:]), "on tiles only q|k|v has a bias"
            k, v = cache.k[i], cache.v[i]
            assert k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype in (torch.float32, torch.bfloat16)
            arr[i] = _LayerArgs(in_norm.data_ptr(), post_norm.data_ptr(), *(m.args() for m in mats), k.data_ptr(),
                                v.data_ptr())
        arr.tiles = tiles  # type: ignore[attr-defined]
        arr.keep = weights  # type: ignore[attr-defined]
        return arr

    def __call__(self, layers: ctypes.Array, h: torch.Tensor, cache: KVCache, cos: torch.Tensor, sin: torch.Tensor,
                 head_scale: torch.Tensor, slots: torch.Tensor, row_blocks: torch.Tensor, row_lens: torch.Tensor,
                 max_len: int, heads: int, inter: int, eps: float, fused_swiglu: bool, amx: bool,
                 lora: LoRASteps | None = None) -> int:
        """Runs every layer over ``h [T, hidden]`` (float32, contiguous; updated in place to the
        residual stream after the last layer). ``cos``/``sin``/``head_scale`` as for
        :meth:`FusedOps.rope_store`, ``row_blocks``/``row_lens``/``max_len`` as for
        :class:`DecodeAttention` (one row per token); ``fused_swiglu``: SwiGLU in the gate|up
        matmul (the tile kernel, or the 8-bit one on AVX512-VNNI; never with ``lora``); ``lora``:
        the step's LoRA rows. Returns -1, or the index of the LoRA pass that failed (the
        caller raises what the model's hook would have)."""
        t, hidden = h.shape
        kv_heads, d = cache.num_kv_heads, cache.head_dim
        assert h.dtype == torch.float32 and h.is_contiguous() and t > 0
        assert cos.dtype == sin.dtype == torch.float32 and cos.stride() == sin.stride() and cos.stride(2) == 1
        assert cos.shape[0] == t and cos.shape[1] in (1, heads + kv_heads) and cos.shape[2] == d
        assert head_scale.dtype == torch.float32 and head_scale.is_contiguous() and head_scale.numel() == heads + kv_heads
        assert slots.dtype == row_blocks.dtype == row_lens.dtype == torch.int64
        assert slots.is_contiguous() and row_blocks.is_contiguous() and row_lens.is_contiguous()
        assert slots.shape[0] == row_blocks.shape[0] == row_lens.shape[0] == t
        assert not (fused_swiglu and lora is not None)
        tiles = layers.tiles  # type: ignore[attr-defined]
        act = torch.bfloat16 if tiles and lora is None else torch.float32
        x, res = torch.empty((t, hidden), dtype=act), torch.empty((t, hidden), dtype=act)
        qkv = torch.empty((t, (heads + 2 * kv_heads) * d), dtype=act)
        q = torch.empty((t, heads * d), dtype=torch.float32)
        attn, mlp = torch.empty((t, heads * d), dtype=act), torch.empty((t, inter), dtype=act)
        gate_up = None if fused_swiglu else torch.empty((t, 2 * inter), dtype=act)
        xb = torch.empty((t, max(hidden, heads * d, inter)), dtype=torch.bfloat16) if tiles and act != torch.bfloat16 else None
        args = _StepArgs(h.data_ptr(), x.data_ptr(), qkv.data_ptr(), attn.data_ptr(), res.data_ptr(), mlp.data_ptr(),
                         gate_up.data_ptr() if gate_up is not None else None, xb.data_ptr() if xb is not None else None,
                         q.data_ptr(), ctypes.addressof(lora.args) if lora is not None else None, cos.data_ptr(),
                         sin.data_ptr(), head_scale.data_ptr(), cos.stride(0), 0 if cos.shape[1] == 1 else cos.stride(1),
                         slots.data_ptr(), row_blocks.data_ptr(), row_lens.data_ptr(), row_blocks.shape[1],
                         cache.k[0].shape[1], max_len, cache.block_size, cache.k[0].dtype == torch.bfloat16, amx,
                         act == torch.bfloat16, t, hidden, heads, kv_heads, d, inter, eps)
        rc = self._fn(ctypes.addressof(layers), len(layers), ctypes.byref(args), torch.get_num_threads())
        if lora is not None and LoRASteps.FAILED <= rc < LoRASteps.FAILED + lora.num_passes:
            return rc - LoRASteps.FAILED
        if rc == 1:
            raise MemoryError("native decoder layers: no memory for the quantized activations")
        if rc != 0:
            raise RuntimeError(f"native decoder layers failed ({rc}): {t} rows, head dim {d}")
        return -1


@lru_cache(maxsize=1)
def decoder_layers_kernel() -> DecoderLayers | None:
    lib = library()
    return DecoderLayers(lib) if lib is not None else None
