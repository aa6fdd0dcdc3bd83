"""Rotary position embeddings (RoPE), with Llama-3 and linear scaling.

The rotation uses the Hugging Face convention (``rotate_half``: the first and second
halves of each head are the pair), which is why GGUF q/k rows are un-permuted on load.
``RotaryEmbedding`` precomputes one cos/sin table for every position up to the
engine's context length; a step looks its rows up by position.
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig


def inv_frequencies(cfg: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if freq_factors is not None:  # GGUF's rope_freqs tensor (llama.cpp's form of Llama-3 scaling)
        return inv / freq_factors.float()
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen = old_ctx / low
        high_wavelen = old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "linear":
        return inv / float(scaling["factor"])
    return inv


class RotaryEmbedding:
    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype,
                 freq_factors: torch.Tensor | None = None) -> None:
        inv = inv_frequencies(cfg, freq_factors)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        # rotate_half's sign folded in once: the first half negated
        half = cfg.head_dim // 2
        sin = emb.sin()
        self.sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows for the step's positions, ``[T, 1, head_dim]`` (one row for every
        head; ``engine.fused``'s ``rope_store`` takes a per-head factor beside them).

        The sign of ``rotate_half`` is folded into ``sin`` (first half negated).
        """
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
