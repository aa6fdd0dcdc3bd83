"""Helpers shared by the engine tests: tiny random models, the demo model, teacher forcing."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thanks.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Continuous batching admits new requests every step.",
    "def add(a, b):\n    return a + b\n",
    "Numbers like 12345 and 3.14159 appear in text.",
] * 20


def train_tokenizer(path: Path, vocab_size: int = 320) -> None:
    """A small byte-level BPE tokenizer + config with a ChatML template, written to ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                          "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS, trainer)
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
    }))


TINY_BASE: dict[str, Any] = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 bos_token_id=1, eos_token_id=2)


def make_tiny_model(path: Path, kind: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random model (``llama`` GQA, ``qwen2`` with q/k/v bias, ``llama3`` rope scaling)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    args = dict(TINY_BASE, **overrides)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**args, tie_word_embeddings=True))
        with torch.no_grad():  # random biases (the default init zeroes them)
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        if kind == "llama3":
            args["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
            args["rope_theta"] = 500000.0
        model = LlamaForCausalLM(LlamaConfig(**args, tie_word_embeddings=False))
    model.eval().save_pretrained(path, safe_serialization=True)
    train_tokenizer(path)
    return path


@lru_cache(maxsize=1)
def _fetched_demo_model() -> Path | str:
    """The demo model's path, or why fetching it failed (kept, so it is tried once per session)."""
    from engine.fetch_demo import demo_model_path, fetch_demo

    found = demo_model_path()
    if found is not None:
        return found
    try:
        return fetch_demo(quiet=True)
    except Exception as exc:  # any failure: every test that needs the model fails with it
        return f"{type(exc).__name__}: {exc}"


def demo_model_file() -> Path:
    """The demo model, fetched on first use; a failed fetch fails the test (never skips it)."""
    got = _fetched_demo_model()
    if isinstance(got, str):
        pytest.fail(f"the demo model could not be fetched (loraplex fetch-demo): {got}", pytrace=False)
    return got


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    return demo_model_file()


@lru_cache(maxsize=1)
def hf_demo_model() -> Any:
    """transformers' model loaded from the same GGUF (float32), cached for the session."""
    from transformers import AutoModelForCausalLM

    path = demo_model_file()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


@lru_cache(maxsize=1)
def hf_demo_tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = demo_model_file()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())
