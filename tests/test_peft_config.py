"""The shared PEFT config reader: strict parsing, PEFT's defaults, patterns and scales, bounds,
and admission and the engine reading the same files the same way."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.lora.peft import AdapterFormatError, load_adapter
from loraplex.peft_config import (
    ConfigLimits,
    PeftConfigError,
    check_delta,
    loads,
    parse_config,
    read_config,
)
from loraplex.settings import Settings
from registry.admission import AdmissionError, admit
from tests.registry_support import TINY, write_adapter

BASE = {"peft_type": "LORA", "target_modules": ["q_proj", "v_proj"]}


def test_defaults_are_peft_defaults():
    from peft import LoraConfig as PeftLoraConfig

    cfg = parse_config(BASE)
    want = PeftLoraConfig()
    assert (cfg.r, cfg.lora_alpha, cfg.use_rslora) == (want.r, want.lora_alpha, want.use_rslora)
    assert cfg.rank_and_scale("model.layers.0.self_attn.q_proj") == (8, 1.0)


@pytest.mark.parametrize("text", [
    '{"r": 4, "lora_alpha": NaN, "target_modules": ["q_proj"]}',
    '{"r": 4, "lora_alpha": Infinity, "target_modules": ["q_proj"]}',
    '{"r": 4, "lora_alpha": -Infinity, "target_modules": ["q_proj"]}',
    '{"r": 4, "lora_alpha": 1e999, "target_modules": ["q_proj"]}',
    '{"r": 4, "lora_alpha": 8, "lora_alpha": 1e30, "target_modules": ["q_proj"]}',
    '[1, 2]',
    '{not json',
    '\xff',
])
def test_strict_json(text):
    with pytest.raises(PeftConfigError) as exc:
        loads(text.encode("latin-1"))
    assert exc.value.code == "bad_config" and exc.value.message


@pytest.mark.parametrize(("change", "code"), [
    ({"lora_alpha": 0}, "bad_config"),
    ({"lora_alpha": -1}, "bad_config"),
    ({"lora_alpha": True}, "bad_config"),
    ({"lora_alpha": 10**400}, "bad_config"),
    ({"r": 0}, "bad_config"),
    ({"r": 4.0}, "bad_config"),
    ({"r": 128}, "rank_too_large"),
    ({"rank_pattern": {"q_proj": 128}}, "rank_too_large"),
    ({"alpha_pattern": {"q_proj": float("nan")}}, "bad_config"),
    ({"alpha_pattern": {"(": 8}}, "bad_config"),
    ({"use_rslora": "yes"}, "bad_config"),
    ({"lora_alpha": 1e38}, "scale_too_large"),
    ({"r": 1, "lora_alpha": 257}, "scale_too_large"),
    ({"use_dora": True}, "unsupported_feature"),
    ({"target_modules": []}, "bad_config"),
    ({"base_model_name_or_path": 3}, "bad_config"),
])
def test_refusals(change, code):
    with pytest.raises(PeftConfigError) as exc:
        parse_config({**BASE, **change})
    assert exc.value.code == code, exc.value.message


def test_patterns_rslora_and_the_scale_cap_per_module():
    cfg = parse_config({**BASE, "r": 8, "lora_alpha": 16, "use_rslora": True,
                        "rank_pattern": {"q_proj": 4}, "alpha_pattern": {"v_proj": 2048}})
    assert cfg.rank_and_scale("model.layers.0.self_attn.q_proj") == (4, 16 / math.sqrt(4))
    assert cfg.rank_and_scale("model.layers.0.self_attn.k_proj") == (8, 16 / math.sqrt(8))
    with pytest.raises(PeftConfigError) as exc:  # 2048 / sqrt(8) > 256, only where the pattern applies
        cfg.rank_and_scale("model.layers.1.self_attn.v_proj")
    assert exc.value.code == "scale_too_large" and "v_proj" in exc.value.message
    loose = parse_config(cfg.raw, ConfigLimits(max_scale=1000.0))
    assert loose.rank_and_scale("model.layers.1.self_attn.v_proj")[1] == pytest.approx(2048 / math.sqrt(8))


def test_delta_bound():
    limits = ConfigLimits()
    check_delta("m", 2.0, 8, 40.0, 100.0, limits)  # 64000 <= 65504
    with pytest.raises(PeftConfigError) as exc:
        check_delta("m", 2.0, 8, 41.0, 100.0, limits)
    assert exc.value.code == "delta_too_large"
    with pytest.raises(PeftConfigError):
        check_delta("m", 1e30, 8, 1e30, 1e300, limits)  # overflows to inf


@pytest.mark.parametrize(("declared", "registered", "same"), [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", True),
    ("smollm2-135m-instruct", "SmolLM2-135M-Instruct", True),
    ("/models/SmolLM2-135M-Instruct/", "SmolLM2-135M-Instruct", True),
    ("", "SmolLM2-135M-Instruct", True),
    ("meta-llama/Llama-3.1-8B", "SmolLM2-135M-Instruct", False),
    ("HuggingFaceTB/SmolLM2-360M-Instruct", "SmolLM2-135M-Instruct", False),
])
def test_base_model_name_forms(declared, registered, same):
    assert parse_config({**BASE, "base_model_name_or_path": declared}).names_base(registered) is same


@pytest.mark.parametrize(("declared", "local"), [
    ("/home/me/train/base", True), ("./base", True), ("../base/", True), ("~/m", True), ("C:\\m\\base", True),
    ("runs/3/base", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", False), ("SmolLM2-135M-Instruct", False),
    ("", False),
])
def test_a_local_training_path_is_told_from_a_hub_id(declared, local):
    assert parse_config({**BASE, "base_model_name_or_path": declared}).local_base is local


def test_settings_give_the_limits():
    s = Settings.from_env({"LORAPLEX_MAX_LORA_SCALE": "32", "LORAPLEX_MAX_LORA_DELTA": "1000",
                           "LORAPLEX_MAX_LORA_RANK": "16"})
    assert ConfigLimits.from_settings(s) == ConfigLimits(max_rank=16, max_scale=32.0, max_delta=1000.0)
    assert ConfigLimits.from_settings(Settings()) == ConfigLimits()


# --- admission and the engine agree -------------------------------------------------------------------

def _grow_q(rank: int):
    """q_proj tensors at ``rank`` (for a rank_pattern), others unchanged."""
    def apply(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for k, v in t.items():
            if "q_proj.lora_A" in k:
                v = torch.full((rank, v.shape[1]), 0.05)
            elif "q_proj.lora_B" in k:
                v = torch.full((v.shape[0], rank), 0.05)
            out[k] = v
        return out
    return apply


AGREE = {
    "plain": {},
    "no_alpha": {"config": {"lora_alpha": None}},
    "rslora": {"config": {"use_rslora": True}, "alpha": 64},
    "rank_pattern": {"config": {"rank_pattern": {"q_proj": 8}}, "tensors": _grow_q(8)},
    "unused_rank_pattern": {"config": {"rank_pattern": {"k_proj": 16}}},
    "alpha_pattern": {"config": {"alpha_pattern": {"v_proj": 64}}},
    "exclude_v": {"config": {"exclude_modules": ["v_proj"], "target_modules": ["q_proj", "v_proj"]}},
    "regex": {"config": {"target_modules": r".*\.(q_proj|v_proj)"}},
    "alpha_1e38": {"alpha": 1e38},
    "alpha_pattern_over_cap": {"config": {"alpha_pattern": {"q_proj": 5000}}},
    "rank_pattern_mismatch": {"config": {"rank_pattern": {"q_proj": 8}}},
    "delta_over_float16": {"tensors": lambda t: {k: v.fill_(100.0) for k, v in t.items()}},
    "layers_outside": {"config": {"layers_to_transform": [0]}},
    "fan_in_fan_out": {"config": {"fan_in_fan_out": True}},
    "fan_in_fan_out_transposed": {"config": {"fan_in_fan_out": True},
                                  "tensors": lambda t: {k: v.t().contiguous() for k, v in t.items()}},
    "transposed_without_the_flag": {"tensors": lambda t: {k: v.t().contiguous() for k, v in t.items()}},
}
ACCEPTED = {"plain", "no_alpha", "rslora", "rank_pattern", "unused_rank_pattern", "alpha_pattern", "regex",
            "fan_in_fan_out",
            "fan_in_fan_out_transposed"}


@pytest.mark.parametrize("case", sorted(AGREE))
def test_admission_and_engine_read_the_same_config_the_same_way(tmp_path, case):
    kwargs = dict(AGREE[case])
    config = kwargs.pop("config", {})
    d = write_adapter(tmp_path / "adapters" / case, TINY, config=config, **kwargs)
    if config.get("lora_alpha", 0) is None:  # a config without the key: both take PEFT's default
        raw = json.loads((d / "adapter_config.json").read_text())
        del raw["lora_alpha"]
        (d / "adapter_config.json").write_text(json.dumps(raw))
    settings = Settings(home=str(tmp_path / "home"), adapter_root=str(tmp_path / "adapters"))
    try:
        admitted = admit(case, TINY, settings)
    except AdmissionError as exc:
        admitted, refusal = None, exc
    try:
        weights = load_adapter(d, TINY, limits=ConfigLimits.from_settings(settings))
    except AdapterFormatError as exc:
        weights, engine_refusal = None, exc
    assert (admitted is None) == (weights is None), case
    assert (admitted is not None) == (case in ACCEPTED), case
    if admitted is None:
        assert str(engine_refusal) and refusal.message
        return
    assert admitted.rank == weights.rank and admitted.alpha == read_config(
        (Path(d) / "adapter_config.json").read_bytes()).lora_alpha
    cfg = read_config((Path(d) / "adapter_config.json").read_bytes())
    for (layer, proj), mod in weights.modules.items():
        group = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        assert cfg.rank_and_scale(f"model.layers.{layer}.{group}.{proj}") == (mod.rank, mod.scale)
    assert set(admitted.target_modules) == weights.projections
