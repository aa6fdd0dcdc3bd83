"""The decoder's hyper-parameters, read from a Hugging Face ``config.json`` or GGUF metadata.

One dataclass covers the Llama family this engine runs: Llama (incl. Llama-3 RoPE
scaling), Mistral, Qwen2 (q/k/v bias) and SmolLM. Grouped-query attention is
expressed by ``num_kv_heads < num_heads``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.modelinfo import ModelShape, gguf_shape, hf_shape

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """The model is not a Llama-family decoder this engine can run."""


@dataclass(frozen=True)
class ModelConfig(ModelShape):
    """The shared :class:`~loraplex.modelinfo.ModelShape` plus what running the model needs."""

    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path)
        cfg = json.loads((p / "config.json").read_text())
        gen_path = p / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_hf_dict(cfg, gen)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], gen: dict[str, Any] | None = None) -> ModelConfig:
        shape = hf_shape(cfg)
        arch = shape["architecture"]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(f"model_type {arch!r} is not supported "
                                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported")
        eos: list[int] = []
        for src in (gen or {}, cfg):
            val = src.get("eos_token_id")
            if isinstance(val, int):
                val = [val]
            for v in val or []:
                if v not in eos:
                    eos.append(int(v))
        scaling = cfg.get("rope_scaling")
        theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters")
        if isinstance(rope_params, dict):  # transformers 5 style
            theta = rope_params.get("rope_theta", theta)
            if rope_params.get("rope_type", "default") != "default":
                scaling = rope_params
        if scaling is not None:
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            if rtype == "default":
                scaling = None
            elif rtype not in ("llama3", "linear"):
                raise UnsupportedModelError(f"rope scaling {rtype!r} is not supported")
        return cls(
            **shape,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=dict(scaling) if scaling else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            hidden_act="silu",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos),
        )

    @classmethod
    def from_gguf_fields(cls, get: Any, tensor_names: set[str]) -> ModelConfig:
        """``get(key, default)`` reads one GGUF metadata value (``loraplex.modelinfo.gguf_getter``)."""
        arch = str(get("general.architecture"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported")
        eos = get("tokenizer.ggml.eos_token_id")
        eot = get("tokenizer.ggml.eot_token_id")
        eos_ids = tuple(int(x) for x in (eos, eot) if x is not None)
        return cls(
            **gguf_shape(get),
            rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(get, arch),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        )


def _gguf_rope_scaling(get: Any, arch: str) -> dict[str, Any] | None:
    """Linear scaling is metadata; Llama-3 scaling arrives as the ``rope_freqs`` tensor instead."""
    kind = get(f"{arch}.rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get(f"{arch}.rope.scaling.factor", 1.0))}
    if kind not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported")
    return None
