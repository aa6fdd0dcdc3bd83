"""Write a base model as a Hugging Face directory: ``config.json``, ``model.safetensors``, tokenizer files.

Engines that only read Hugging Face directories (vLLM, transformers, PEFT training) can then run the
model this engine runs from a GGUF file, with no model hub involved. The weights are the ones
``engine.loader`` builds (GGUF quantized tensors dequantized, llama.cpp's q/k row permutation undone),
split back into Hugging Face's per-projection tensors; the tokenizer is the one
``loraplex.tokenizer.TextTokenizer`` encodes with, chat template included. Reading the directory back
with ``engine.loader.load_hf_dir`` gives the same tensors (tested).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.loader import ModelWeights, load_weights
from loraplex.tokenizer import TextTokenizer

HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """The model cannot be written as a Hugging Face directory (the reason says why)."""


def hf_config(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
    """The ``config.json`` that ``ModelConfig.from_hf_dict`` reads back as ``cfg``."""
    out: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[cfg.architecture]],
        "model_type": cfg.architecture,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.context_length,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": cfg.hidden_act,
        "torch_dtype": dtype,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
    }
    if cfg.architecture != "qwen2":  # Qwen2 always has q/k/v biases and has no such key
        out["attention_bias"] = cfg.attention_bias
        out["mlp_bias"] = False
    return out


def hf_tensors(weights: ModelWeights, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hugging Face's tensor names and layout, the fused q|k|v and gate|up split back apart."""
    cfg = weights.config
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size

    def own(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype).contiguous().clone()

    out = {"model.embed_tokens.weight": own(weights.embed), "model.norm.weight": own(weights.norm)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = own(weights.lm_head)
    for i, lw in enumerate(weights.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = own(lw.input_norm)
        out[p + "post_attention_layernorm.weight"] = own(lw.post_norm)
        for name, part in zip(("q_proj", "k_proj", "v_proj"), lw.qkv.split([q, kv, kv]), strict=True):
            out[p + f"self_attn.{name}.weight"] = own(part)
        if lw.qkv_bias is not None:
            for name, part in zip(("q_proj", "k_proj", "v_proj"), lw.qkv_bias.split([q, kv, kv]), strict=True):
                out[p + f"self_attn.{name}.bias"] = own(part)
        out[p + "self_attn.o_proj.weight"] = own(lw.o)
        gate, up = lw.gate_up.split([inter, inter])
        out[p + "mlp.gate_proj.weight"] = own(gate)
        out[p + "mlp.up_proj.weight"] = own(up)
        out[p + "mlp.down_proj.weight"] = own(lw.down)
    return out


def write_tokenizer(tok: TextTokenizer, out: Path, context_length: int) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json``; BOS, when the model wants one, goes into the
    post-processor so every reader of ``tokenizer.json`` adds it the way this engine does."""
    from tokenizers import Tokenizer, processors

    tk = Tokenizer.from_str(tok.tk.to_str())
    if tok.add_bos and tok.bos_token is not None:
        bos = tok.bos_token
        template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                 special_tokens=[(bos, tk.token_to_id(bos))])
        tk.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), template])
    tk.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "add_bos_token": False,  # the post-processor adds it (above)
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    config.update({k: v for k, v in tok.extra_special.items() if v is not None})
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if config.get(k)}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def export_hf(model: str | Path, out: str | Path, dtype: str = "float32",
              say: Callable[[str], None] = _say) -> Path:
    """Write ``model`` (a ``.gguf`` file or a Hugging Face directory) to the new directory ``out``."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    dest = Path(out)
    if dest.exists() and any(dest.iterdir()):
        raise ExportError(f"{dest} exists and is not empty")
    say(f"reading {model} ...")
    weights = load_weights(model)
    if weights.rope_freq_factors is not None:
        raise ExportError("the model carries per-frequency RoPE factors (a GGUF rope_freqs tensor), whose "
                          "Llama-3 scaling parameters a config.json needs are not in the file")
    tok = TextTokenizer.from_model_path(model)
    dest.mkdir(parents=True, exist_ok=True)
    cfg = weights.config
    say(f"writing {cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}, {dtype} -> {dest}")
    tensors = hf_tensors(weights, DTYPES[dtype])
    del weights
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
    (dest / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer(tok, dest, cfg.context_length)
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    say(f"done: {len(tensors)} tensors, {size / 2**20:.0f} MiB")
    return dest
