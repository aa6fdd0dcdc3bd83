"""``loraplex export-hf``: the demo GGUF as a Hugging Face directory that other engines read as we do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.engine import Engine, EngineConfig
from engine.export_hf import ExportError, export_hf, hf_config
from engine.loader import LayerWeights, load_gguf, load_hf_dir
from engine.scoring import forced_logits
from loraplex.tokenizer import TextTokenizer
from tests.engine_fixtures import demo_gguf, hf_demo_model, make_tiny_model, rel_err  # noqa: F401

pytestmark = pytest.mark.slow

TEXTS = ["Hello world!", "  leading spaces and\ttabs\n", "Numbers 12345 and ünïcödé, emoji 🙂.",
         "<|im_start|>user\nhi<|im_end|>"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
]


@pytest.fixture(scope="module")
def exported(demo_gguf, tmp_path_factory) -> Path:  # noqa: F811
    return export_hf(demo_gguf, tmp_path_factory.mktemp("hf") / "smollm2", say=lambda _m: None)


def test_exported_weights_read_back_identical(demo_gguf, exported):  # noqa: F811
    ours, back = load_gguf(demo_gguf), load_hf_dir(exported)
    assert back.config == ours.config
    for name in ("embed", "norm", "lm_head"):
        assert torch.equal(getattr(back, name), getattr(ours, name)), name
    for i, (a, b) in enumerate(zip(ours.layers, back.layers, strict=True)):
        for f in LayerWeights.__dataclass_fields__:
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), f"layer {i} {f}"


def test_exported_tokenizer_encodes_and_renders_as_ours(demo_gguf, exported):  # noqa: F811
    from transformers import AutoTokenizer

    ours, back = TextTokenizer.from_gguf(demo_gguf), TextTokenizer.from_hf_dir(exported)
    hf = AutoTokenizer.from_pretrained(str(exported))
    for text in TEXTS:
        assert back.encode(text) == ours.encode(text), text
        assert hf(text)["input_ids"] == ours.encode(text), text
    for msgs in CHATS:
        ids = ours.encode_chat(msgs)
        assert back.encode_chat(msgs) == ids
        assert list(hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)) == ids
    assert hf.eos_token == ours.eos_token


def test_transformers_on_the_export_matches_the_engine(demo_gguf, exported):  # noqa: F811
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    eng = Engine.from_path(demo_gguf, EngineConfig(kv_cache_bytes=1 << 26))
    ids = eng.tokenizer.encode_chat(CHATS[0])
    with torch.no_grad():
        cont = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
        ref = hf(torch.tensor([ids + cont])).logits[0, len(ids) - 1:]
    ours = forced_logits(eng, ids + cont, len(ids))
    assert rel_err(ours, ref) < 1e-4
    # and transformers reading the GGUF itself agrees with it on the same tokens
    with torch.no_grad():
        via_gguf = hf_demo_model()(torch.tensor([ids + cont])).logits[0, len(ids) - 1:]
    assert rel_err(ref, via_gguf) < 1e-5


def test_config_round_trips_for_each_architecture(tmp_path):
    for kind in ("llama", "qwen2", "llama3"):
        src = make_tiny_model(tmp_path / kind, kind=kind)
        cfg = ModelConfig.from_hf_dir(src)
        assert ModelConfig.from_hf_dict(hf_config(cfg, "float32"),
                                        json.loads((src / "generation_config.json").read_text())
                                        if (src / "generation_config.json").is_file() else None) == cfg
        out = export_hf(src, tmp_path / f"{kind}-out", dtype="bfloat16", say=lambda _m: None)
        assert ModelConfig.from_hf_dir(out) == cfg
        back = load_hf_dir(out)
        assert back.layers[0].qkv.shape == load_hf_dir(src).layers[0].qkv.shape


def test_refuses_a_non_empty_destination_and_an_unknown_dtype(tmp_path):
    src = make_tiny_model(tmp_path / "m")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep me")
    with pytest.raises(ExportError, match="not empty"):
        export_hf(src, tmp_path / "busy", say=lambda _m: None)
    assert (tmp_path / "busy" / "x").read_text() == "keep me"
    with pytest.raises(ExportError, match="dtype"):
        export_hf(src, tmp_path / "new", dtype="int3", say=lambda _m: None)


def test_cli_exports_and_reports_errors(tmp_path):
    src = make_tiny_model(tmp_path / "m")
    run = [sys.executable, "-m", "loraplex_cli", "export-hf"]
    ok = subprocess.run([*run, str(src), str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() == str(tmp_path / "out")
    assert "done:" in ok.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
    again = subprocess.run([*run, str(src), str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "not empty" in again.stderr
