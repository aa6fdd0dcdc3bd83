"""PEFT adapters through engine.lora: same outputs as PEFT's own modules, refusals with reasons."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.lora.batch import LoRABatch
from engine.lora.peft import AdapterFormatError, load_adapter, parse_config
from engine.lora.slots import SlotBank
from loraplex.modelinfo import PROJECTIONS, ModelInfo

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = ModelInfo(name="tiny", revision="0", architecture="llama", hidden_size=64, intermediate_size=96,
                 num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128, context_length=128)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=TINY.hidden_size, intermediate_size=TINY.intermediate_size,
                      num_hidden_layers=TINY.num_layers, num_attention_heads=TINY.num_heads,
                      num_key_value_heads=TINY.num_kv_heads, head_dim=TINY.head_dim,
                      vocab_size=TINY.vocab_size, max_position_embeddings=TINY.context_length)
    return LlamaForCausalLM(cfg).float().eval()


def _peft_model(tmp: Path, specs: dict[str, dict]):
    """A PeftModel holding one LoRA adapter per spec (strong random A and B), saved under tmp/name."""
    from peft import LoraConfig, get_peft_model

    base = _tiny_llama()
    names = list(specs)
    model = get_peft_model(base, LoraConfig(**specs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, LoraConfig(**specs[name]))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ".lora_A." in pname or ".lora_B." in pname:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.eval()
    for name in names:
        model.save_pretrained(str(tmp / "saved"), selected_adapters=[name])
    dirs = {n: (tmp / "saved" if n == "default" else tmp / "saved" / n) for n in names}
    for d in dirs.values():
        assert (d / "adapter_model.safetensors").is_file()
    return model, dirs


def _check_mixed_batch(model, dirs: dict[str, Path], loaded: dict[str, object] | None = None, tokens: int = 23):
    """Base linear + our op on an interleaved mixed batch == PEFT's module output per row's adapter."""
    from peft.tuners.lora import Linear as LoraLinear

    bank = SlotBank.for_model(TINY, (8, 16, 32, 64), slots_per_class=4)
    slot_of: dict[str, int] = {}
    used = {c: 0 for c in range(len(bank.rank_classes))}
    for name, d in dirs.items():
        w = (loaded or {}).get(name) or load_adapter(d, TINY)
        c = bank.class_of_rank(w.rank)
        slot_of[name] = bank.slot_ids(c)[used[c]]
        used[c] += 1
        bank.write(slot_of[name], w)
    names = list(dirs)
    row_names = [("__base__" if i % (len(names) + 1) == len(names) else names[(i * 7) % len(names)])
                 for i in range(tokens)]
    slots = [slot_of[n] if n != "__base__" else -1 for n in row_names]
    g = torch.Generator().manual_seed(2)
    checked = 0
    for layer in range(TINY.num_layers):
        block = model.base_model.model.model.layers[layer]
        for proj in PROJECTIONS:
            module = getattr(block.self_attn if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp, proj)
            fin, _fout = TINY.projection_shape(proj)
            x = torch.randn(tokens, fin, generator=g)
            with torch.no_grad():
                if isinstance(module, LoraLinear):
                    ref = module(x, adapter_names=row_names)
                    base = module.base_layer(x)
                else:
                    ref = base = module(x)
                ours = base.clone()
                for path in ("segmented", "padded", None):
                    out = base.clone()
                    LoRABatch.build(bank, slots, path=path).apply(layer, proj, x, out)
                    err = (out - ref).abs().max() / ref.abs().max()
                    assert err < 1e-4, (layer, proj, path, float(err))
                    ours = out
            assert torch.equal(ours[torch.tensor(slots) < 0], base[torch.tensor(slots) < 0])
            checked += 1
    return checked


ALL = list(PROJECTIONS)


@pytest.mark.slow
def test_mixed_batch_matches_peft_ranks_8_16_64(tmp_path):
    specs = {
        "default": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
        "r16": {"r": 16, "lora_alpha": 8, "target_modules": ALL},
        "r64": {"r": 64, "lora_alpha": 32, "target_modules": ALL},
        "rs": {"r": 16, "lora_alpha": 32, "use_rslora": True, "target_modules": ALL},
    }
    model, dirs = _peft_model(tmp_path, specs)
    weights = {n: load_adapter(d, TINY) for n, d in dirs.items()}
    assert [weights[n].rank for n in specs] == [8, 16, 64, 16]
    assert weights["rs"].modules[(0, "q_proj")].scale == pytest.approx(32 / math.sqrt(16))
    assert weights["r16"].modules[(0, "q_proj")].scale == pytest.approx(8 / 16)
    assert _check_mixed_batch(model, dirs, weights) == TINY.num_layers * len(PROJECTIONS)


@pytest.mark.slow
def test_patterns_subsets_and_layers_match_peft(tmp_path):
    specs = {
        "default": {"r": 8, "lora_alpha": 8, "target_modules": ALL,
                    "rank_pattern": {"q_proj": 4, "down_proj": 32}, "alpha_pattern": {"v_proj": 64}},
        "qv": {"r": 16, "lora_alpha": 16, "target_modules": r".*\.(q_proj|v_proj)"},
        "l1": {"r": 8, "lora_alpha": 4, "target_modules": ["o_proj", "up_proj"], "layers_to_transform": [1]},
    }
    model, dirs = _peft_model(tmp_path, specs)
    w = load_adapter(dirs["default"], TINY)
    assert w.rank == 32 and w.modules[(0, "q_proj")].rank == 4
    assert w.modules[(1, "v_proj")].scale == pytest.approx(64 / 8)
    assert load_adapter(dirs["qv"], TINY).projections == {"q_proj", "v_proj"}
    assert {k for k in load_adapter(dirs["l1"], TINY).modules} == {(1, "o_proj"), (1, "up_proj")}
    _check_mixed_batch(model, dirs)


@pytest.mark.slow
def test_fan_in_fan_out_transposed_layout(tmp_path):
    """fan_in_fan_out adapters may store A as [in, r] and B as [r, out]; results equal PEFT's."""
    from safetensors.torch import load_file

    model, dirs = _peft_model(tmp_path, {"default": {"r": 8, "lora_alpha": 16, "target_modules": ALL}})
    src = dirs["default"]
    tdir = tmp_path / "transposed"
    tdir.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg["fan_in_fan_out"] = True
    (tdir / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({k: v.t().contiguous() for k, v in load_file(src / "adapter_model.safetensors").items()},
              tdir / "adapter_model.safetensors")
    # PEFT's own layout (fan_in_fan_out has no effect on lora_A/lora_B of nn.Linear) also loads.
    (src / "adapter_config.json").write_text(json.dumps(cfg))
    a, b = load_adapter(tdir, TINY), load_adapter(src, TINY)
    for key, mod in a.modules.items():
        assert torch.equal(mod.a, b.modules[key].a) and torch.equal(mod.b, b.modules[key].b)
    _check_mixed_batch(model, {"default": tdir})
    # Without the flag the transposed layout is a shape error.
    cfg["fan_in_fan_out"] = False
    (tdir / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterFormatError, match="do not match"):
        load_adapter(tdir, TINY)


@pytest.mark.slow
def test_peft_saved_refusals(tmp_path):
    from peft import LoraConfig, get_peft_model

    cases = {
        "dora": ({"use_dora": True}, "DoRA"),
        "mts": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        "bias": ({"bias": "lora_only"}, "bias"),
    }
    for name, (extra, reason) in cases.items():
        m = get_peft_model(_tiny_llama(), LoraConfig(r=8, target_modules=["q_proj"], **extra))
        m.save_pretrained(str(tmp_path / name))
        with pytest.raises(AdapterFormatError, match=reason):
            load_adapter(tmp_path / name, TINY)
    m = get_peft_model(_tiny_llama(), LoraConfig(r=8, target_modules=["q_proj"]))
    m.save_pretrained(str(tmp_path / "pickle"), safe_serialization=False)
    assert (tmp_path / "pickle" / "adapter_model.bin").is_file()
    with pytest.raises(AdapterFormatError, match="pickle"):
        load_adapter(tmp_path / "pickle", TINY)
    m = get_peft_model(_tiny_llama(), LoraConfig(r=8, target_modules=["q_proj", "embed_tokens"]))
    m.save_pretrained(str(tmp_path / "emb"))
    with pytest.raises(AdapterFormatError, match="unsupported"):
        load_adapter(tmp_path / "emb", TINY)


# --- fast refusals on hand-written files ---------------------------------------------------

def _write(d: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, d / "adapter_model.safetensors")
    return d


def _qproj(r=4, fin=64, fout=64, layer=0):
    k = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    return {f"{k}.lora_A.weight": torch.randn(r, fin), f"{k}.lora_B.weight": torch.randn(fout, r)}


CFG = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "bias": "none"}


def test_hand_written_adapter_loads(tmp_path):
    w = load_adapter(_write(tmp_path / "ok", CFG, _qproj()), TINY)
    assert w.rank == 4 and w.modules[(0, "q_proj")].scale == 2.0
    assert w.modules[(0, "q_proj")].a.dtype == torch.float32


@pytest.mark.parametrize(("cfg", "tensors", "reason"), [
    ({**CFG, "use_dora": True}, _qproj(), "DoRA"),
    ({**CFG, "modules_to_save": ["lm_head"]}, _qproj(), "modules_to_save"),
    ({**CFG, "bias": "all"}, _qproj(), "bias"),
    ({**CFG, "peft_type": "IA3"}, _qproj(), "peft_type"),
    (CFG, _qproj(fin=32), "do not match"),
    (CFG, _qproj(r=8), "do not match"),
    (CFG, _qproj(layer=2), "layer 2 does not exist"),
    ({**CFG, "target_modules": ["v_proj"]}, _qproj(), "not covered by target_modules"),
    ({**CFG, "layers_to_transform": [1]}, _qproj(), "layers_to_transform"),
    (CFG, {k: v for k, v in _qproj().items() if "lora_A" in k}, "lora_B is missing"),
    (CFG, {**_qproj(), "base_model.model.lm_head.lora_A.weight": torch.randn(4, 64)}, "unsupported tensor"),
    (CFG, {k: v.fill_(float("nan")) for k, v in _qproj().items()}, "NaN"),
    (CFG, {}, "no LoRA weights"),
])
def test_refusals(tmp_path, cfg, tensors, reason):
    d = tmp_path / "a"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors:
        save_file(tensors, d / "adapter_model.safetensors")
    else:
        save_file({"other": torch.zeros(1)}, d / "adapter_model.safetensors")
        reason = "unsupported tensor"
    with pytest.raises(AdapterFormatError, match=reason):
        load_adapter(d, TINY)


def test_file_level_refusals(tmp_path):
    d = _write(tmp_path / "t", CFG, _qproj())
    data = (d / "adapter_model.safetensors").read_bytes()
    (d / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterFormatError, match="safetensors"):
        load_adapter(d, TINY)
    (d / "adapter_model.safetensors").unlink()
    torch.save(_qproj(), d / "adapter_model.bin")
    with pytest.raises(AdapterFormatError, match="pickle"):
        load_adapter(d, TINY)
    (d / "adapter_model.bin").unlink()
    save_file(_qproj(), d / "adapter_model.safetensors")
    (d / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterFormatError, match="JSON"):
        load_adapter(d, TINY)
    with pytest.raises(AdapterFormatError, match="not found"):
        load_adapter(tmp_path / "missing", TINY)
    with pytest.raises(AdapterFormatError, match="regular expression"):
        parse_config({**CFG, "target_modules": "(unclosed"})
