"""Helpers for multi-LoRA engine tests: a tiny Llama with PEFT adapters, an engine wired to a
``LoRARuntime``, a recorder of every logits row the engine samples, and a PEFT reference.

The recorder notes, for each sampled row, the exact token prefix the logits continue, so a
row can be checked against the reference whatever the engine did (chunked prefill,
preemption and recompute, waiting for a slot).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loraplex.modelinfo import PROJECTIONS, ModelInfo, describe_model
from loraplex.wire import AdapterRef

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ALL = list(PROJECTIONS)
TINY_DIMS: dict[str, int] = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=128)

# Nine adapters: ranks 8, 16 and 64, different target subsets, two with rsLoRA.
ISOLATION_SPECS: dict[str, dict[str, Any]] = {
    "r8_all": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
    "r16_all": {"r": 16, "lora_alpha": 8, "target_modules": ALL},
    "r64_all": {"r": 64, "lora_alpha": 32, "target_modules": ALL},
    "rs16_qvd": {"r": 16, "lora_alpha": 32, "use_rslora": True, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "r8_attn": {"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "r16_mlp": {"r": 16, "lora_alpha": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "r64_qv": {"r": 64, "lora_alpha": 64, "target_modules": ["q_proj", "v_proj"]},
    "r8_od": {"r": 8, "lora_alpha": 32, "target_modules": ["o_proj", "down_proj"]},
    "rs64_all": {"r": 64, "lora_alpha": 16, "use_rslora": True, "target_modules": ALL},
}


def save_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A tiny random GQA Llama (float32 safetensors) and a word-level tokenizer in ``path``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_DIMS, tie_word_embeddings=False)).float().eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tk = Tokenizer(WordLevel({f"t{i}": i for i in range(TINY_DIMS["vocab_size"])}, unk_token="t0"))
    tk.pre_tokenizer = Whitespace()
    tk.save(str(path / "tokenizer.json"))
    return path


def peft_adapters(base_dir: Path, out_dir: Path, specs: dict[str, dict[str, Any]], *, seed: int = 1,
                  std: float = 0.3) -> tuple[Any, dict[str, Path]]:
    """A PeftModel on ``base_dir`` holding one adapter per spec with strong random A and B
    (so adapters' outputs differ strongly), each saved as a PEFT directory under ``out_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    names = list(specs)
    model = get_peft_model(base, LoraConfig(**specs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, LoraConfig(**specs[name]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ".lora_A." in pname or ".lora_B." in pname:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.eval()
    dirs: dict[str, Path] = {}
    for name in names:
        model.save_pretrained(str(out_dir / name), selected_adapters=[name])
        # PEFT nests non-default adapters one level down.
        d = out_dir / name / name if (out_dir / name / name).is_dir() else out_dir / name
        assert (d / "adapter_model.safetensors").is_file(), d
        dirs[name] = d
    return model, dirs


class PeftReference:
    """Logits of the PEFT model for one adapter alone (``None``: adapters disabled), in float64."""

    def __init__(self, peft_model: Any) -> None:
        self.model = peft_model.double().eval()
        self._memo: dict[tuple[str | None, tuple[int, ...]], torch.Tensor] = {}

    def logits(self, adapter: str | None, prefix: Iterable[int]) -> torch.Tensor:
        key = (adapter, tuple(prefix))
        if key not in self._memo:
            x = torch.tensor([list(key[1])])
            with torch.no_grad():
                if adapter is None:
                    with self.model.disable_adapter():
                        out = self.model(input_ids=x).logits[0, -1]
                else:
                    self.model.set_adapter(adapter)
                    out = self.model(input_ids=x).logits[0, -1]
            self._memo[key] = out.float()
        return self._memo[key]

    def greedy(self, adapter: str | None, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.logits(adapter, ids).argmax()))
        return ids[len(prompt):]


@dataclass
class Recorder:
    """Wraps ``engine.model.forward``: every sampled logits row with its token prefix and
    the adapter ids present in each step."""

    rows: dict[int, list[tuple[tuple[int, ...], torch.Tensor]]] = field(default_factory=dict)
    step_adapters: list[set[str]] = field(default_factory=list)
    step_kinds: list[tuple[int, int]] = field(default_factory=list)  # (prefill chunks, decode rows)

    def install(self, engine: Any) -> None:
        forward = engine.model.forward

        def spy(ctx: Any, cache: Any) -> torch.Tensor:
            logits = forward(ctx, cache)
            self.step_adapters.append({s.adapter.id for s in ctx.seqs if s.adapter is not None})
            self.step_kinds.append((sum(n > 1 for n in ctx.chunk_lens), sum(n == 1 for n in ctx.chunk_lens)))
            for row, i in enumerate(ctx.sample_seqs):
                seq = ctx.seqs[i]
                prefix = tuple(seq.all_token_ids)  # the step has not appended its token yet
                self.rows.setdefault(seq.seq_id, []).append((prefix, logits[row].detach().clone()))
            return logits

        engine.model.forward = spy


def tiny_engine(base_dir: Path, *, kv_cache_bytes: int = 4 << 20, kv_block_size: int = 16,
                max_num_batched_tokens: int = 512, max_num_seqs: int = 32, weights: str = "",
                kv_cache_dtype: str = "auto") -> Any:
    from engine.engine import Engine, EngineConfig

    return Engine.from_path(base_dir, EngineConfig(kv_cache_bytes=kv_cache_bytes, kv_block_size=kv_block_size,
                                                   max_num_batched_tokens=max_num_batched_tokens,
                                                   max_num_seqs=max_num_seqs, max_model_len=96, weights=weights,
                                                   kv_cache_dtype=kv_cache_dtype))


def attach_runtime(engine: Any, info: ModelInfo, cache_dir: Path, *, max_loras: int = 16, slots_per_class: int = 8,
                   rank_classes: tuple[int, ...] = (8, 16, 32, 64), runtime_cls: type | None = None) -> Any:
    """Give ``engine`` a LoRARuntime (admission policy + per-step batch) over a fresh manager."""
    from engine.lora.manager import AdapterManager
    from engine.lora.runtime import LoRARuntime
    from engine.lora.slots import SlotBank

    bank = SlotBank.for_model(info, rank_classes, slots_per_class=slots_per_class,
                              weights_dtype=engine.model.lora_weights_dtype)  # as Engine.enable_lora
    manager = AdapterManager(info, bank, max_loras=max_loras, cache_dir=str(cache_dir))
    rt = (runtime_cls or LoRARuntime)(manager)
    engine.lora_runtime = rt
    engine.scheduler.policy = rt
    return rt


def model_info(base_dir: Path) -> ModelInfo:
    return describe_model(base_dir)


def refs_for(dirs: dict[str, Path]) -> dict[str, AdapterRef]:
    return {n: AdapterRef(id=f"id-{n}", name=n, uri=d.as_uri()) for n, d in dirs.items()}


def run_to_completion(engine: Any, seqs: Iterable[Any], timeout_s: float = 120.0,
                      on_step: Callable[[], None] | None = None) -> None:
    seqs = list(seqs)
    deadline = time.monotonic() + timeout_s
    while not all(s.is_finished for s in seqs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine did not finish: {sum(not s.is_finished for s in seqs)} sequences left")
        if engine.step():
            if on_step is not None:
                on_step()
        else:
            time.sleep(0.002)  # waiting on an adapter load


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())
