"""The Llama-family decoder forward pass over a paged, continuously batched step.

One ``forward(ctx)`` runs every token row of the step (prefill chunks and decode
rows together) through the layers, writes their K/V into the paged cache, and
returns logits only for ``ctx.sample_rows`` (the LM head never sees the rest). It also
sets ``ctx.row_finite`` (per row: the final hidden state is finite), which the engine
reads to stop a sequence whose values went non-finite before they reach anyone else.

LoRA hook contract
------------------
Each decoder layer fuses q|k|v and gate|up into single matmuls but exposes every
projection's output as its own tensor (a view into the fused output). Right after
each (fused) projection, if ``ctx.lora`` is not ``None``, the layer calls::

    ctx.lora.apply_many(layer_idx: int, x: Tensor, targets: tuple[tuple[str, Tensor], ...]) -> None

once per input: ``targets`` is ``((module, out), ...)`` with ``module`` one of
``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`` (q/k/v together, gate/up
together); ``x`` the projections' input ``[T, in_features]`` and each ``out`` its
output ``[T, out_features]`` (``T`` = ``ctx.num_tokens``, rows ordered as ``ctx.input_ids``).
The hook must ADD its delta into ``out`` in place (``out += scale * (x @ A.T) @ B.T``
per row's adapter); ``ctx.token_seq[t]`` gives the sequence index of row ``t`` and
``ctx.seqs[i].adapter`` its ``AdapterRef`` (or ``None``). The q/k/v hooks run before
RoPE (and before the attention scale, which this model folds into the rotated
queries). Inputs per module: q/k/v/gate/up get the normed hidden state
``[T, hidden]``, o_proj gets the attention output ``[T, heads*head_dim]``, down_proj
gets ``silu(gate) * up`` ``[T, intermediate]``. For q/k/v and gate/up, ``out`` is a
non-contiguous column slice of the fused output: update it in place
(``out.add_(delta)``); rebinding the name has no effect.

Where every matrix runs on a native kernel the whole step goes to C in one call
(``engine.native_decoder.DecoderLayers``); the hook is then asked once per step for the same work as
native calls instead (``ctx.lora.native_steps(num_layers, LORA_INPUTS, columns)``, a
``engine.native_lora.LoRASteps`` or None to keep to ``apply_many``; ``ctx.lora.native_failure(i)``
the error for the rank class whose call failed).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.attention import paged_attention, prepare_attention
from engine.config import ModelConfig
from engine.cpu import cpu_has_avx2, cpu_has_bf16_matmul, cpu_has_vnni, march
from engine.fused import TorchOps
from engine.kv_cache import KVCache
from engine.linear import (
    BF16Linear,
    BlockLinear,
    Int8Linear,
    Linear,
    make_linear,
)
from engine.loader import LayerWeights, ModelWeights
from engine.native import (
    BlockMatmul,
    FusedOps,
    Gemv,
    PanelMatmul,
    TileMatmul,
    decode_attention_kernel,
    fused_ops,
    gemv_kernel,
    panel_matmul_kernel,
    q4_matmul_kernel,
    q8_matmul_kernel,
    row_scan_kernel,
    tile_matmul_kernel,
)
from engine.native_decoder import DecoderLayers, NativeWeight, decoder_layers_kernel
from engine.quant import INT4, QUANTIZED, pack_q8, quantize_q8
from engine.rotary import RotaryEmbedding
from engine.step_batch import BatchContext

log = logging.getLogger("loraplex.engine.model")

LORA_INPUTS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
"""The projections that read each input of a layer, in the order the layer applies their LoRA."""


def q8_lm_head(tile: TileMatmul | None) -> bool:
    """Whether 8-bit and 4-bit base weights take the LM head to 8 bits as well: on CPUs with
    AVX512-VNNI but no AMX (on AMX the bfloat16 tile kernel is the faster one)."""
    return cpu_has_vnni() and (tile is None or tile.isa != "amx")


class _LayerLinears:
    def __init__(self, lw: LayerWeights, act: torch.dtype, pack_batch: int, gemv: Gemv | None,
                 q8: BlockMatmul | None, q4: BlockMatmul | None, tile: TileMatmul | None,
                 panel: PanelMatmul | None) -> None:
        self.qkv = make_linear(lw.qkv, lw.qkv_bias, act, pack_batch, gemv, q8, q4, tile, panel)
        self.o = make_linear(lw.o, None, act, pack_batch, gemv, q8, q4, tile, panel)
        self.gate_up = make_linear(lw.gate_up, None, act, pack_batch, gemv, q8, q4, tile, panel)
        self.down = make_linear(lw.down, None, act, pack_batch, gemv, q8, q4, tile, panel)


class DecoderModel:
    def __init__(self, weights: ModelWeights, device: torch.device, dtype: torch.dtype,
                 max_positions: int, pack_batch: int = 32, native_kernels: bool = True,
                 matmul_dtype: torch.dtype | None = None) -> None:
        """``pack_batch`` > 0: on CPU float32, prepack weights for batches of about that size.
        ``native_kernels``: on CPU float32, decode attention (over float32 or bfloat16 K/V pools),
        single-row matmuls and the fused elementwise steps through ``engine.native`` (when it builds). ``matmul_dtype``: the
        projection weights' dtype (default ``dtype``): bfloat16 under float32 activations keeps
        the base's matrices in bfloat16 while everything else, LoRA included, stays float32;
        ``torch.int8`` (CPU, float32 activations) keeps the projections in 8-bit blocks
        (``engine.quant``), the embedding table and LM head in bfloat16 on CPUs with native
        bfloat16 matmuls, else float32 (the LM head in 8 bits where :func:`q8_lm_head`);
        ``engine.quant.INT4`` the same in 4-bit blocks (projections loaded in 8 bits stay 8-bit)."""
        self.cfg: ModelConfig = weights.config
        self.device = device
        self.dtype = dtype
        self.matmul_dtype = matmul_dtype or dtype
        if (self.matmul_dtype == torch.bfloat16 and dtype == torch.float32 and device.type == "cpu"
                and not cpu_has_bf16_matmul()):
            log.warning("bfloat16 weights on a CPU without AVX512-BF16 or AMX: half the memory, but matmuls "
                        "of several rows run slower than float32 here")
        quantized = self.matmul_dtype in QUANTIZED
        name = "int4" if self.matmul_dtype == INT4 else "int8"
        if quantized and not cpu_has_vnni() and not (self.matmul_dtype == INT4 and cpu_has_avx2()):
            log.warning("%s weights on a CPU without AVX512-VNNI%s: a fraction of the memory, but the portable "
                        "kernels run no faster than float32 here", name, "" if name == "int8" else " or AVX2")
        # Under 8-bit or 4-bit projections the embedding table and LM head (tied in small models)
        # are not quantized: bfloat16 where the CPU multiplies it natively (the LM head's float32
        # matmul took a fifth of an 8-bit decode step), else the activations' dtype.
        table = torch.bfloat16 if quantized and dtype == torch.float32 and cpu_has_bf16_matmul() else None
        self.w = weights.to(device, dtype, self.matmul_dtype, table)
        self.rope = RotaryEmbedding(self.cfg, max_positions, device, dtype, weights.rope_freq_factors)
        self.scale = self.cfg.head_dim ** -0.5
        cpu_f32 = device.type == "cpu" and dtype == torch.float32
        gemv = gemv_kernel() if native_kernels and cpu_f32 else None
        q8 = q8_matmul_kernel() if native_kernels and cpu_f32 and quantized else None
        q4 = q4_matmul_kernel() if native_kernels and cpu_f32 and self.matmul_dtype == INT4 else None
        if quantized and q8 is None:
            log.warning("%s weights without the native kernels: their matmuls run in torch, several times slower",
                        name)
        # bfloat16 matrices on AMX or AVX512-BF16: every batch size through the native tile kernel.
        tile = tile_matmul_kernel() if native_kernels and cpu_f32 else None
        # float32 matrices on AVX2 without AVX-512: decode batches through the native panel kernel.
        panel = panel_matmul_kernel() if native_kernels and cpu_f32 else None
        self.layers = [_LayerLinears(lw, dtype, pack_batch, gemv, q8, q4, tile, panel) for lw in self.w.layers]
        self.lm_head: Linear | BF16Linear | Int8Linear
        if quantized and q8 is not None and q8_lm_head(tile):
            # The LM head in 8 bits too (Q8_0 blocks, as llama.cpp's Q8_0 models hold theirs; the
            # table the embedding reads stays as it is): where vpdpbusd outruns the bfloat16
            # kernel, a 32-row decode step's LM head went 5.7-6.2 -> 4.0-4.2 ms on a Zen 4.
            self.lm_head = Int8Linear(pack_q8(quantize_q8(self.w.lm_head.float())), None, q8)
        else:
            self.lm_head = make_linear(self.w.lm_head, None, dtype, pack_batch, gemv, tile=tile, panel=panel)
        self.decode_kernel = decode_attention_kernel() if native_kernels and cpu_f32 else None
        self.ops = (fused_ops() if native_kernels and cpu_f32 else None) or TorchOps()
        self.scan = row_scan_kernel() if native_kernels and device.type == "cpu" else None
        """The logits' per-row argmax and finiteness in one native pass (``engine.native.RowScan``), or None."""
        # bfloat16 matrices under float32 activations with the native elementwise steps: a step
        # without LoRA rows keeps each matmul's bfloat16 output as the next step's input (the
        # norms and SwiGLU read it and write the next matmul's bfloat16 input) instead of widening
        # and rounding it in separate passes: the same numbers (the float32 math of each step
        # is unchanged, its result rounded as the matmul would round it), fewer bytes moved.
        self.bf16_flow = (isinstance(self.ops, FusedOps) and all(
            isinstance(getattr(lin, n), BF16Linear) for lin in self.layers for n in ("qkv", "o", "gate_up", "down"))
            and all(lin.o.bias is None and lin.down.bias is None for lin in self.layers))
        # ... and SwiGLU in the gate|up matmul's epilogue where that runs on the tile kernel.
        self.fused_swiglu = self.bf16_flow and all(lin.gate_up.fuses_swiglu for lin in self.layers)
        # 8-bit weights: SwiGLU in the gate|up matmul's epilogue for steps without LoRA rows (the
        # float32 math of FusedOps.silu_mul on the same sums: the same numbers).
        self.q8_swiglu = isinstance(self.ops, FusedOps) and all(
            isinstance(lin.gate_up, Int8Linear) and lin.gate_up.fuses_swiglu for lin in self.layers)
        # Every layer of a step (LoRA rows included) in one native call where every matrix runs on
        # a native kernel: bfloat16 on the tile kernel (the narrow flow), 8- and 4-bit blocks, or
        # float32 on the panel kernel (AVX2 builds).
        self.decoder: DecoderLayers | None = None
        self._decoder_weights = self._native_weights()
        if self._decoder_weights is not None and self.decode_kernel is not None:
            self.decoder = decoder_layers_kernel()
        self._decoder_args: tuple[KVCache, object] | None = None
        qs, kvs, inter = self.cfg.q_size, self.cfg.kv_size, self.cfg.intermediate_size
        self._lora_cols = {"q_proj": 0, "k_proj": qs, "v_proj": qs + kvs, "o_proj": 0, "gate_proj": 0,
                           "up_proj": inter, "down_proj": 0}
        """Each projection's first column in its (fused) matmul's output."""
        self.head_scale = torch.cat([torch.full((self.cfg.num_heads,), self.scale),
                                     torch.ones(self.cfg.num_kv_heads)]).to(device=device, dtype=dtype)

    @property
    def lora_weights_dtype(self) -> torch.dtype:
        """The adapters' A/B storage in the LoRA slots: bfloat16 when the base's matrices are in a
        narrower dtype than float32 activations (32 distinct rank-16 adapters on every projection
        stream more bytes per decode step than this model's matrices; the LoRA math stays float32),
        else the activations' dtype."""
        if self.dtype == torch.float32 and self.matmul_dtype != torch.float32 and self.device.type == "cpu":
            return torch.bfloat16
        return self.dtype

    @property
    def kernels(self) -> str:
        """What runs the layers, for the start-up log: the native kernels' build and whether a
        step's layers go in one call, or torch."""
        if self.decode_kernel is None:
            return "torch kernels"
        calls = "a step's layers in one call" if self.decoder is not None else "layer by layer"
        return f"native kernels for -march={march()}, {calls}"

    @property
    def weight_bytes(self) -> int:
        head = self.lm_head.weight.nbytes if isinstance(self.lm_head, Int8Linear) else 0
        return self.w.nbytes() + head

    @torch.inference_mode()
    def forward(self, ctx: BatchContext, cache: KVCache) -> torch.Tensor:
        cfg = self.cfg
        h = F.embedding(ctx.input_ids, self.w.embed).to(self.dtype)
        # RoPE for q and k heads together; the query heads also carry the attention scale.
        cos, sin = self.rope.tables(ctx.positions)
        prepare_attention(ctx, cfg.num_kv_heads, self.decode_kernel)
        lora = ctx.lora
        if self.decoder is not None and ctx.row_blocks is not None and not ctx.matmul_prefills:
            steps = lora.native_steps(cfg.num_layers, LORA_INPUTS, self._lora_cols) if lora is not None else None
            if lora is None or steps is not None:
                assert self.decode_kernel is not None
                fused = lora is None and (self.fused_swiglu if self._decoder_tiles else self.q8_swiglu)
                failed = self.decoder(self._decoder_layers(cache), h, cache, cos, sin, self.head_scale,
                                      ctx.slot_mapping, ctx.row_blocks, ctx.row_lens, ctx.row_max_len, cfg.num_heads,
                                      cfg.intermediate_size, cfg.rms_norm_eps, fused, self.decode_kernel.amx, steps)
                if failed >= 0:
                    assert lora is not None
                    raise lora.native_failure(failed)
                return self._head(ctx, h)
        narrow = torch.bfloat16 if self.bf16_flow and lora is None and h.shape[0] > 1 else None
        self._layers(ctx, cache, h, cos, sin, narrow)
        return self._head(ctx, h)

    def _native_weights(self) -> list[tuple[NativeWeight, ...]] | None:
        """Every layer's matrices as :class:`engine.native_decoder.DecoderLayers` reads them, where all run on
        native kernels of one kind with the native elementwise steps: all on the tile kernel (with
        the narrow flow's conditions), all in 8- or 4-bit blocks, or all on the float32 panel
        kernel (AVX2 builds); else None."""
        if not isinstance(self.ops, FusedOps):
            return None
        names = ("qkv", "o", "gate_up", "down")
        if self.bf16_flow and all(getattr(lin, n).tile is not None for lin in self.layers for n in names):
            return [tuple(NativeWeight(getattr(lin, n).tiles, lin.qkv.bias if n == "qkv" else None,
                                       getattr(lin, n).weight.shape[0]) for n in names) for lin in self.layers]
        if all(isinstance(getattr(lin, n), BlockLinear) and getattr(lin, n).kernel is not None
               for lin in self.layers for n in names):
            return [tuple(NativeWeight(getattr(lin, n).weight, getattr(lin, n).bias) for n in names)
                    for lin in self.layers]
        mats = [[getattr(lin, n) for n in names] for lin in self.layers]
        if all(isinstance(m, Linear) and m.panels is not None for layer in mats for m in layer):
            return [tuple(NativeWeight(m.panels, m.bias, m.weight.shape[0], m.weight if m.gemv is not None else None)
                          for m in layer) for layer in mats]
        return None

    @property
    def _decoder_tiles(self) -> bool:
        assert self._decoder_weights is not None
        return self._decoder_weights[0][0].format == NativeWeight.TILE

    def _decoder_layers(self, cache: KVCache) -> object:
        """:class:`engine.native_decoder.DecoderLayers`' per-layer arguments over ``cache``'s pools (built once)."""
        if self._decoder_args is None or self._decoder_args[0] is not cache:
            assert self.decoder is not None and self._decoder_weights is not None
            weights = [(lw.input_norm, lw.post_norm, *mats)
                       for lw, mats in zip(self.w.layers, self._decoder_weights, strict=True)]
            self._decoder_args = (cache, self.decoder.layers(weights, cache))
        return self._decoder_args[1]

    def _layers(self, ctx: BatchContext, cache: KVCache, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                narrow: torch.dtype | None) -> None:
        """Every decoder layer over ``h`` (updated in place to the last layer's residual stream)."""
        cfg = self.cfg
        w = self.w
        lora = ctx.lora
        qs, kvs, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
        nh, nkv = cfg.num_heads, cfg.num_kv_heads
        eps = cfg.rms_norm_eps
        ops = self.ops
        delta = None  # the previous layer's MLP output, added into h by the next norm
        for i, (lw, lin) in enumerate(zip(w.layers, self.layers, strict=True)):
            x = ops.add_rms_norm(h, delta, lw.input_norm, eps, narrow)
            if narrow is not None:  # the bfloat16 sums; the bias goes in with the widening
                qkv, bias = lin.qkv.bf16(x), lin.qkv.bias
            else:
                qkv, bias = lin.qkv(x), None
            if lora is not None:
                q, k, v = qkv[:, :qs], qkv[:, qs:qs + kvs], qkv[:, qs + kvs:]
                lora.apply_many(i, x, (("q_proj", q), ("k_proj", k), ("v_proj", v)))
            q = ops.rope_store(qkv, bias, cos, sin, cache, i, ctx.slot_mapping, nh, self.head_scale)
            a = paged_attention(ctx, cache, i, q, nkv, self.decode_kernel, narrow)
            if narrow is not None:
                x = ops.add_rms_norm(h, lin.o.bf16(a), lw.post_norm, eps, narrow)
                if self.fused_swiglu:
                    m = lin.gate_up.swiglu(x)
                else:
                    m = ops.silu_mul(lin.gate_up.bf16(x), inter, narrow)
                delta = lin.down.bf16(m)
                continue
            o = lin.o(a)
            if lora is not None:
                lora.apply_many(i, a, (("o_proj", o),))
            x = ops.add_rms_norm(h, o, lw.post_norm, eps)
            if lora is None and self.q8_swiglu:
                delta = lin.down(lin.gate_up.swiglu(x))
                continue
            gu = lin.gate_up(x)
            gate, up = gu[:, :inter], gu[:, inter:]
            if lora is not None:
                lora.apply_many(i, x, (("gate_proj", gate), ("up_proj", up)))
            m = ops.silu_mul(gu, inter)
            delta = lin.down(m)
            if lora is not None:
                lora.apply_many(i, m, (("down_proj", delta),))
        h.add_(delta)

    def _head(self, ctx: BatchContext, h: torch.Tensor) -> torch.Tensor:
        """The sampled rows' logits from the final residual stream ``h`` (``ctx.row_finite`` set)."""
        cfg, w, t = self.cfg, self.w, h.shape[0]
        # NaN/Inf anywhere in a row sums to non-finite (float32: a float16 sum could overflow);
        # the engine stops that row's sequence.
        ctx.row_finite = torch.isfinite(h.sum(dim=1, dtype=torch.float32))
        rows = ctx.sample_rows
        if rows.numel() == 0:
            return h.new_empty((0, cfg.vocab_size))
        # One sampled row per sequence, in row order: all rows sampling means rows == 0..T-1.
        hs = h if rows.numel() == t else h.index_select(0, rows)
        hs = self.ops.add_rms_norm(hs, None, w.norm, cfg.rms_norm_eps)
        return self.lm_head(hs).float()
