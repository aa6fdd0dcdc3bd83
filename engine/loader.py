"""Load decoder weights from a Hugging Face directory (safetensors) or a GGUF file.

Both paths end in the same ``ModelWeights``: per layer, q|k|v fused into one matrix
(rows ``[q; k; v]``) and gate|up fused into one (rows ``[gate; up]``), so a layer runs
two input matmuls instead of five; the model exposes each projection's slice of the
fused output (see ``engine.model``).

For 8-bit serving (``LORAPLEX_WEIGHTS=int8``) the projections become ``engine.quant`` blocks:
GGUF tensors already in Q8_0 are read as they are (``keep_q8_0``: never widened to float32;
the un-permutation and fusion below act on their int8 rows and scales alike), any other
weight is quantized by :meth:`ModelWeights.to`. For 4-bit serving (``LORAPLEX_WEIGHTS=int4``)
GGUF Q4_0 and Q4_1 tensors are read as they are too (``keep_q4``), Q8_0 ones stay 8-bit, any
other weight is quantized to 4 bits.

GGUF specifics: the file is parsed by ``loraplex.gguf_file`` and its tensors dequantized
there, to exactly ``gguf.quants.dequantize``'s values; llama.cpp's
converter permutes the q and k rows of Llama models (interleaved RoPE pairs), which is
undone here so the Hugging Face ``rotate_half`` rotation applies; a ``rope_freqs``
tensor (Llama-3 scaling as llama.cpp stores it) is returned as frequency factors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.quant import (
    INT4,
    QUANTIZED,
    PackedQ4,
    PackedQ8,
    Q4Weight,
    Q8Weight,
    pack_q4,
    pack_q8,
    q4_from_gguf,
    q8_0_from_gguf,
    quantize_q4,
    quantize_q8,
)
from loraplex.gguf_file import GGUFFile, GGUFTensor, read_gguf
from loraplex.modelinfo import gguf_getter

Matrix = torch.Tensor | Q8Weight | PackedQ8 | Q4Weight | PackedQ4
"""A projection's weight: float, 8-bit or 4-bit as loaded, or packed for the kernels."""


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Matrix
    qkv_bias: torch.Tensor | None
    o: Matrix
    post_norm: torch.Tensor
    gate_up: Matrix
    down: Matrix


_MATMULS = frozenset({"qkv", "o", "gate_up", "down"})


@dataclass
class ModelWeights:
    config: ModelConfig
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor
    rope_freq_factors: torch.Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def to(self, device: torch.device, dtype: torch.dtype, matmul_dtype: torch.dtype | None = None,
           table_dtype: torch.dtype | None = None) -> ModelWeights:
        """``matmul_dtype``: the dtype of the matrices (projections, LM head, embedding table;
        default ``dtype``); norms and biases stay in ``dtype``. ``torch.int8``: the projections in
        8-bit blocks packed for the CPU kernel (``engine.quant``); :data:`INT4`: in 4-bit blocks,
        but those loaded in 8 bits stay 8-bit; either way the embedding table and LM head then in
        ``table_dtype`` (default ``dtype``)."""
        def cv(t: Any, to: torch.dtype = dtype) -> Any:
            if t is None:
                return None
            if to == torch.int8 or (to == INT4 and isinstance(t, Q8Weight)):
                return pack_q8(t if isinstance(t, Q8Weight) else quantize_q8(_dense(t)))
            if to == INT4:
                return pack_q4(t if isinstance(t, Q4Weight) else quantize_q4(t))
            return _dense(t).to(device=device, dtype=to).contiguous()

        mm = matmul_dtype or dtype
        if mm in QUANTIZED and device.type != "cpu":
            raise ValueError("8-bit and 4-bit weights run on CPU only")
        table = (table_dtype or dtype) if mm in QUANTIZED else mm
        embed = cv(self.embed, table)
        lm_head = embed if self.lm_head is self.embed else cv(self.lm_head, table)
        layers = [LayerWeights(*(cv(getattr(lw, f), mm if f in _MATMULS else dtype)
                                 for f in LayerWeights.__dataclass_fields__))
                  for lw in self.layers]
        return ModelWeights(self.config, embed, layers, cv(self.norm), lm_head,
                            self.rope_freq_factors, self.meta)

    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        tensors = [self.embed, self.norm, self.lm_head]
        for lw in self.layers:
            tensors += [getattr(lw, f) for f in LayerWeights.__dataclass_fields__]
        for t in tensors:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                blocks = isinstance(t, Q8Weight | PackedQ8 | Q4Weight | PackedQ4)
                total += t.nbytes if blocks else t.numel() * t.element_size()
        return total


def _dense(t: Any) -> torch.Tensor:
    """A weight as a float tensor (blocks dequantized to float32)."""
    return t.dequantize() if isinstance(t, Q8Weight | Q4Weight) else t


def _cat_rows(parts: list[Any]) -> Any:
    """Row-stacked matrices in the widest format among the parts: when any part is 8-bit, all
    are (the others quantized to 8 bits); else when any is 4-bit, all are; else float."""
    if any(isinstance(p, Q8Weight) for p in parts):
        return Q8Weight.cat([p if isinstance(p, Q8Weight) else quantize_q8(_dense(p)) for p in parts])
    if any(isinstance(p, Q4Weight) for p in parts):
        return Q4Weight.cat([p if isinstance(p, Q4Weight) else quantize_q4(p) for p in parts])
    return torch.cat(parts, dim=0)


def _fuse_layer(get: Any, i: int, cfg: ModelConfig) -> LayerWeights:
    q, k, v = get(i, "q_proj"), get(i, "k_proj"), get(i, "v_proj")
    bias = None
    if cfg.attention_bias:
        bias = torch.cat([get(i, "q_bias"), get(i, "k_bias"), get(i, "v_bias")])
    return LayerWeights(
        input_norm=get(i, "input_norm"),
        qkv=_cat_rows([q, k, v]),
        qkv_bias=bias,
        o=get(i, "o_proj"),
        post_norm=get(i, "post_norm"),
        gate_up=_cat_rows([get(i, "gate_proj"), get(i, "up_proj")]),
        down=get(i, "down_proj"),
    )


# ---------------------------------------------------------------------------------------- HF
_HF_NAMES = {
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}


def load_hf_dir(path: str | Path) -> ModelWeights:
    from safetensors import safe_open

    p = Path(path)
    cfg = ModelConfig.from_hf_dir(p)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {p} (pickle checkpoints are not loaded)")
    index: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                index[name] = f
    handles: dict[Path, Any] = {}

    def tensor(name: str) -> torch.Tensor:
        f = index.get(name)
        if f is None:
            raise KeyError(f"tensor {name!r} missing from {p}")
        if f not in handles:
            handles[f] = safe_open(str(f), framework="pt")
        return handles[f].get_tensor(name).float()

    def get(i: int, key: str) -> torch.Tensor:
        return tensor(f"model.layers.{i}.{_HF_NAMES[key]}")

    embed = tensor("model.embed_tokens.weight")
    layers = [_fuse_layer(get, i, cfg) for i in range(cfg.num_layers)]
    if "lm_head.weight" in index and not cfg.tie_word_embeddings:
        lm_head = tensor("lm_head.weight")
    else:
        lm_head = embed
    handles.clear()
    return ModelWeights(cfg, embed, layers, tensor("model.norm.weight"), lm_head)


# -------------------------------------------------------------------------------------- GGUF
_GGUF_NAMES = {
    "input_norm": "attn_norm.weight",
    "post_norm": "ffn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
}


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``permute`` of q/k rows (interleaved pairs -> rotate_half halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return read_gguf(path)


def gguf_reader(path: str | Path) -> GGUFFile:
    """The parsed GGUF file (weights and tokenizer share one parse of its metadata)."""
    st = Path(path).stat()
    return _cached_reader(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


def release_readers() -> None:
    """Drop the cached readers: one holds its file's metadata (the demo's vocabulary and merges
    are about 100k strings) and keeps the file mapped, long after the weights were copied out."""
    _cached_reader.cache_clear()


_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def load_gguf(path: str | Path, keep_q8_0: bool = False, keep_q4: bool = False) -> ModelWeights:
    """``keep_q8_0``: projections stored as Q8_0 come back as ``engine.quant.Q8Weight`` (their
    blocks as they are in the file) instead of float32; ``keep_q4``: those stored as Q4_0 or
    Q4_1 as ``engine.quant.Q4Weight``."""
    from gguf import GGMLQuantizationType

    reader = gguf_reader(path)
    tensors = reader.tensors
    get_meta = gguf_getter(reader)
    cfg = ModelConfig.from_gguf_fields(get_meta, set(tensors))

    def tensor(name: str) -> np.ndarray:
        t = tensors.get(name)
        if t is None:
            raise KeyError(f"tensor {name!r} missing from {path}")
        return t.dequantized()

    permute = cfg.architecture == "llama"

    def matrix_shape(t: GGUFTensor) -> tuple[int, int]:
        """A 2-D tensor's logical ``[N, K]``."""
        n, k = t.logical_shape
        return n, k

    def as_stored(t: GGUFTensor) -> Q8Weight | Q4Weight | None:
        """A projection's blocks as the file holds them, when kept in that format."""
        if keep_q8_0 and t.tensor_type == GGMLQuantizationType.Q8_0:
            return q8_0_from_gguf(t.data, matrix_shape(t))
        if keep_q4 and t.tensor_type in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
            return q4_from_gguf(t.data, matrix_shape(t), offset=t.tensor_type == GGMLQuantizationType.Q4_1)
        return None

    def get(i: int, key: str) -> torch.Tensor | Q8Weight | Q4Weight:
        name = f"blk.{i}.{_GGUF_NAMES[key]}"
        t = tensors.get(name)
        w = as_stored(t) if key in _PROJECTIONS and t is not None else None
        if w is not None:
            if permute and key in ("q_proj", "k_proj"):
                heads = cfg.num_heads if key == "q_proj" else cfg.num_kv_heads
                w = w.rows(lambda a: unpermute_rope_rows(a, heads))
            return w
        arr = tensor(name)
        if permute and key in ("q_proj", "q_bias"):
            arr = unpermute_rope_rows(arr, cfg.num_heads)
        elif permute and key in ("k_proj", "k_bias"):
            arr = unpermute_rope_rows(arr, cfg.num_kv_heads)
        return torch.from_numpy(np.ascontiguousarray(arr))

    embed = torch.from_numpy(tensor("token_embd.weight"))
    layers = [_fuse_layer(get, i, cfg) for i in range(cfg.num_layers)]
    lm_head = embed if cfg.tie_word_embeddings else torch.from_numpy(tensor("output.weight"))
    freq = torch.from_numpy(tensor("rope_freqs.weight")) if "rope_freqs.weight" in tensors else None
    norm = torch.from_numpy(tensor("output_norm.weight"))
    return ModelWeights(cfg, embed, layers, norm, lm_head, rope_freq_factors=freq)


def load_weights(path: str | Path, keep_q8_0: bool = False, keep_q4: bool = False) -> ModelWeights:
    """``keep_q8_0``, ``keep_q4``: as for :func:`load_gguf` (a Hugging Face directory loads as
    float32)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p, keep_q8_0, keep_q4)
    if p.is_dir() and (p / "config.json").is_file():
        return load_hf_dir(p)
    raise FileNotFoundError(f"{p} is neither a .gguf file nor a Hugging Face directory with config.json")

