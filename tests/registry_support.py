"""Shared helpers for the registry tests: a tiny base model, PEFT adapter writers, settings
for a registry on PostgreSQL or SQLite, and an empty migrated schema."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from loraplex.modelinfo import ModelInfo
from loraplex.settings import Settings

TINY = ModelInfo(name="tiny", revision="rev-aaaa", architecture="llama", hidden_size=32, intermediate_size=64,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=100, context_length=128)
OTHER = ModelInfo(name="other", revision="rev-bbbb", architecture="llama", hidden_size=48,
                  intermediate_size=96, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=8, vocab_size=100,
                  context_length=128)


def lora_tensors(info: ModelInfo, rank: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj"),
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for layer in range(info.num_layers):
        for module in targets:
            group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            in_f, out_f = info.projection_shape(module)
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            out[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_f, generator=g) * 0.1).to(dtype)
            out[f"{prefix}.lora_B.weight"] = (torch.randn(out_f, rank, generator=g) * 0.1).to(dtype)
    return out


def write_adapter(directory: Path, info: ModelInfo = TINY, *, rank: int = 4, alpha: float = 8,
                  targets: tuple[str, ...] = ("q_proj", "v_proj"), config: dict[str, Any] | None = None,
                  tensors: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
                  seed: int = 0) -> Path:
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) for ``info``."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                           "bias": "none", "base_model_name_or_path": info.name,
                           "base_model_revision": info.revision, "task_type": "CAUSAL_LM"}
    cfg.update(config or {})
    (directory / "adapter_config.json").write_text(json.dumps(cfg))
    t = lora_tensors(info, rank, targets, seed=seed)
    if tensors is not None:
        t = tensors(t)
    save_file(t, str(directory / "adapter_model.safetensors"))
    return directory


def make_settings(tmp_path: Path, url: str, **overrides: Any) -> Settings:
    root = tmp_path / "adapters"
    root.mkdir(parents=True, exist_ok=True)
    values: dict[str, Any] = {"home": str(tmp_path / "home"), "database_url": url, "adapter_root": str(root),
                              "redis_prefix": f"t{abs(hash(str(tmp_path))) % 10**8}"}
    values.update(overrides)
    return Settings(**values)


async def fresh_registry(url: str) -> None:
    """Empty, migrated schema (a PostgreSQL database is shared by one test module)."""
    from registry.db import is_postgres, make_engine
    from registry.migrate import downgrade_async, upgrade_async

    # A lock left by a leaked connection makes DROP TABLE fail loudly instead of waiting forever.
    extra = {"connect_args": {"server_settings": {"lock_timeout": "20s"}}} if is_postgres(url) else {}
    engine = make_engine(url, statement_timeout_s=None, **extra)
    try:
        await downgrade_async(engine)
        await upgrade_async(engine)
    finally:
        await engine.dispose()
