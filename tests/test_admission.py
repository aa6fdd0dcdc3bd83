"""Adapter admission: a good PEFT adapter is admitted; each kind of bad adapter is refused
with its reason code, and a refusal through the service leaves the registry unchanged."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from loraplex.digest import digest_directory
from loraplex.settings import Settings
from registry.admission import AdmissionError, admit, read_safetensors_header
from registry.errors import Invalid
from registry.service import RegistryService
from tests.registry_support import OTHER, TINY, fresh_registry, make_settings, write_adapter

W = "adapter_model.safetensors"
C = "adapter_config.json"


@pytest.fixture
def settings(tmp_path) -> Settings:
    return make_settings(tmp_path, f"sqlite+aiosqlite:///{tmp_path}/r.db", max_lora_rank=16)


def root(settings: Settings) -> Path:
    return Path(settings.resolved_adapter_root())


def test_good_adapter_is_admitted(settings):
    d = write_adapter(root(settings) / "good", TINY, rank=8, alpha=16, targets=("q_proj", "o_proj", "down_proj"))
    a = admit("good", TINY, settings)
    assert (a.rank, a.alpha, a.target_modules) == (8, 16.0, ["q_proj", "o_proj", "down_proj"])
    assert a.sha256 == digest_directory(d) != hashlib.sha256((d / W).read_bytes()).hexdigest()
    assert a.uri == d.resolve().as_uri() and a.num_tensors == 2 * 3 * TINY.num_layers
    assert admit(d.resolve().as_uri(), TINY, settings).sha256 == a.sha256  # file:// URI
    assert admit(str(d), TINY, settings, expected_revision=TINY.revision).path == d.resolve()
    # bf16 / f16 weights are fine too
    write_adapter(root(settings) / "half", TINY, tensors=lambda t: {k: v.to(torch.bfloat16) for k, v in t.items()})
    assert admit("half", TINY, settings).rank == 4


def _mutate_tensor(name_part: str, fn: Callable[[torch.Tensor], torch.Tensor]):
    def apply(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        key = next(k for k in t if name_part in k)
        return {**t, key: fn(t[key].clone())}
    return apply


def _nan(x: torch.Tensor) -> torch.Tensor:
    x[0, 0] = float("nan")
    return x


def _inf(x: torch.Tensor) -> torch.Tensor:
    x[-1, -1] = float("inf")
    return x


def _truncate(d: Path) -> None:
    data = (d / W).read_bytes()
    (d / W).write_bytes(data[:-10])


def _truncate_header(d: Path) -> None:
    data = (d / W).read_bytes()
    (d / W).write_bytes(data[:20])


def _huge_header_len(d: Path) -> None:
    data = (d / W).read_bytes()
    (d / W).write_bytes(struct.pack("<Q", 10**12) + data[8:])


def _garbage_header(d: Path) -> None:
    data = (d / W).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    (d / W).write_bytes(data[:8] + b"{" * n + data[8 + n:])


def _duplicate_tensor_name(d: Path) -> None:
    data = (d / W).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    first = next(k for k in header if k != "__metadata__")
    raw = json.dumps(header)
    entry = json.dumps({first: header[first]})[1:-1]
    text = raw[:-1] + ", " + entry + "}"  # the first tensor's entry once more, at the end
    body = text.encode().ljust(n + len(entry) + 2 + (8 - (n + len(entry) + 2) % 8) % 8)
    (d / W).write_bytes(struct.pack("<Q", len(body)) + body + data[8 + n:])


def _symlink_inside(d: Path) -> None:
    (d / W).rename(d / "real.safetensors")
    os.symlink(d / "real.safetensors", d / W)


def _hard_link_from_outside(d: Path) -> None:
    outside = d.parent.parent / f"outside-{d.name}.safetensors"  # next to the adapter root
    (d / W).rename(outside)
    os.link(outside, d / W)


def _config_text(old: str, new: str) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        text = (d / C).read_text()
        assert old in text
        (d / C).write_text(text.replace(old, new))
    return apply


def _large(x: torch.Tensor) -> torch.Tensor:
    return x.fill_(100.0)


# name -> (writer kwargs, post-write hook, uri override, expected code)
CASES: dict[str, tuple[dict, Callable[[Path], None] | None, str | None, str]] = {
    "pickle_bin": ({}, lambda d: (d / "adapter_model.bin").write_bytes(b"\x80\x04K\x01."), None, "pickle_format"),
    "pickle_pt_only": ({}, lambda d: ((d / W).unlink(), (d / "weights.pt").write_bytes(b"\x80\x04."))[0],
                       None, "pickle_format"),
    "missing_weights": ({}, lambda d: (d / W).unlink(), None, "missing_file"),
    "missing_config": ({}, lambda d: (d / C).unlink(), None, "missing_file"),
    "truncated_data": ({}, _truncate, None, "truncated"),
    "truncated_header": ({}, _truncate_header, None, "truncated"),
    "header_length_lies": ({}, _huge_header_len, None, "bad_header"),
    "garbage_header": ({}, _garbage_header, None, "bad_header"),
    "duplicate_tensor_name": ({}, _duplicate_tensor_name, None, "bad_header"),
    "bad_config_json": ({}, lambda d: (d / C).write_text("{not json"), None, "bad_config"),
    "dora": ({"config": {"use_dora": True}}, None, None, "unsupported_feature"),
    "modules_to_save": ({"config": {"modules_to_save": ["lm_head"]}}, None, None, "unsupported_feature"),
    "rank_pattern_over_cap": ({"config": {"rank_pattern": {"q_proj": 32}}}, None, None, "rank_too_large"),
    "not_lora": ({"config": {"peft_type": "IA3"}}, None, None, "unsupported_feature"),
    "lora_bias": ({"config": {"lora_bias": True}}, None, None, "unsupported_feature"),
    "trainable_tokens": ({"config": {"trainable_token_indices": [1, 2]}}, None, None, "unsupported_feature"),
    "outside_layers_to_transform": ({"config": {"layers_to_transform": [0]}}, None, None, "layer_out_of_range"),
    "rank_over_cap": ({"rank": 32}, None, None, "rank_too_large"),
    "target_not_allowed": ({"config": {"target_modules": ["q_proj", "lm_head"]}}, None, None,
                           "target_module_not_allowed"),
    "wrong_shapes": ({"tensors": lambda t: {k: torch.zeros(v.shape[0] + 1, v.shape[1]) if "lora_B" in k else v
                                            for k, v in t.items()}}, None, None, "shape_mismatch"),
    "rank_mismatch": ({"config": {"r": 8}}, None, None, "rank_mismatch"),
    "other_base_model": ({"info": OTHER, "config": {"base_model_revision": TINY.revision}}, None, None,
                         "base_model_mismatch"),
    "other_base_shapes": ({"info": OTHER, "config": {"base_model_name_or_path": "tiny",
                                                     "base_model_revision": TINY.revision}}, None, None,
                          "shape_mismatch"),
    "other_base_hub_id": ({"config": {"base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}}, None, None,
                          "base_model_mismatch"),
    "local_path_other_base_shapes": ({"info": OTHER, "config": {"base_model_name_or_path": "/home/me/train/base",
                                                                "base_model_revision": TINY.revision}}, None, None,
                                     "shape_mismatch"),
    "alpha_1e38": ({"alpha": 1e38}, None, None, "scale_too_large"),
    "alpha_1e300": ({"alpha": 1e300}, None, None, "scale_too_large"),
    "alpha_nan": ({"alpha": float("nan")}, None, None, "bad_config"),
    "alpha_infinity": ({"alpha": float("inf")}, None, None, "bad_config"),
    "alpha_overflows_to_inf": ({}, _config_text('"lora_alpha": 8', '"lora_alpha": 1e999'), None, "bad_config"),
    "alpha_huge_int": ({}, _config_text('"lora_alpha": 8', '"lora_alpha": 1' + "0" * 400), None, "bad_config"),
    "alpha_zero": ({"alpha": 0}, None, None, "bad_config"),
    "alpha_negative": ({"alpha": -16}, None, None, "bad_config"),
    "alpha_string": ({"alpha": "16"}, None, None, "bad_config"),
    "duplicate_alpha_key": ({}, _config_text('"lora_alpha": 8', '"lora_alpha": 8, "lora_alpha": 1e30'), None,
                            "bad_config"),
    "scale_over_cap": ({"alpha": 4 * 257}, None, None, "scale_too_large"),
    "rslora_scale_over_cap": ({"alpha": 600, "config": {"use_rslora": True}}, None, None, "scale_too_large"),
    "alpha_pattern_over_cap": ({"config": {"alpha_pattern": {"q_proj": 5000}}}, None, None, "scale_too_large"),
    "delta_over_float16": ({"tensors": lambda t: {k: _large(v) for k, v in t.items()}}, None, None,
                           "delta_too_large"),
    "hard_link": ({}, _hard_link_from_outside, None, "hard_link"),
    "fifo_weights": ({}, lambda d: ((d / W).unlink(), os.mkfifo(d / W))[0], None, "not_regular_file"),
    "layer_out_of_range": ({"tensors": lambda t: {k.replace("layers.1.", "layers.7."): v for k, v in t.items()}},
                           None, None, "layer_out_of_range"),
    "unexpected_tensor": ({"tensors": lambda t: {**t, "base_model.model.lm_head.weight": torch.zeros(2, 2)}},
                          None, None, "unexpected_tensor"),
    "tensor_for_untargeted_module": ({"config": {"target_modules": ["q_proj"]}}, None, None, "unexpected_tensor"),
    "missing_lora_b": ({"tensors": lambda t: {k: v for k, v in t.items() if "layers.0.self_attn.v_proj.lora_B" not in k}},
                       None, None, "missing_tensor"),
    "integer_dtype": ({"tensors": lambda t: {k: v.to(torch.int8) for k, v in t.items()}}, None, None, "bad_dtype"),
    "nan_weights": ({"tensors": _mutate_tensor("lora_A", _nan)}, None, None, "non_finite"),
    "inf_weights": ({"tensors": _mutate_tensor("lora_B", _inf)}, None, None, "non_finite"),
    "nan_bf16_weights": ({"tensors": lambda t: _mutate_tensor("lora_B", _nan)(
        {k: v.to(torch.bfloat16) for k, v in t.items()})}, None, None, "non_finite"),
    "inf_f16_weights": ({"tensors": lambda t: _mutate_tensor("lora_A", _inf)(
        {k: v.to(torch.float16) for k, v in t.items()})}, None, None, "non_finite"),
    "base_revision_mismatch": ({"config": {"base_model_revision": "some-other-rev"}}, None, None,
                               "base_revision_mismatch"),
    "symlink_inside": ({}, _symlink_inside, None, "symlink"),
    "path_escape_dotdot": ({}, None, "../outside", "path_escape"),
    "path_escape_absolute": ({}, None, "/etc", "path_escape"),
    "path_escape_file_uri": ({}, None, "file:///tmp", "path_escape"),
    "unsupported_scheme": ({}, None, "s3://bucket/adapter", "unsupported_uri"),
    "not_found": ({}, None, "does-not-exist", "not_found"),
}


def make_case(settings: Settings, name: str) -> tuple[str, str]:
    """Write the bad adapter for ``name``; return (uri, expected code)."""
    kwargs, hook, uri, code = CASES[name]
    kwargs = dict(kwargs)
    info = kwargs.pop("info", TINY)
    d = write_adapter(root(settings) / name, info, **kwargs)
    if hook is not None:
        hook(d)
    if name == "path_escape_dotdot":
        write_adapter(root(settings).parent / "outside", TINY)
    return uri or name, code


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_adapter_is_refused(settings, case):
    uri, code = make_case(settings, case)
    with pytest.raises(AdmissionError) as exc:
        admit(uri, TINY, settings)
    assert exc.value.code == code, exc.value.message
    assert exc.value.message


@pytest.mark.parametrize("path", ["/home/me/train/outputs/base", "./base", "../models/base", "~/models/base",
                                  "C:\\models\\base", "outputs/run-3/base-model"])
def test_a_local_training_path_is_accepted_for_the_registered_base_and_a_hub_id_is_not(settings, path):
    """PEFT writes the training machine's path when it trained from a local copy: it names no
    model, so the base given at registration decides (the shapes are the check); a hub id that
    names another model is refused, and the refusal says what to do."""
    write_adapter(root(settings) / "local", TINY, config={"base_model_name_or_path": path})
    assert admit("local", TINY, settings).rank == 4
    write_adapter(root(settings) / "hub", TINY, config={"base_model_name_or_path": "meta-llama/Llama-3.1-8B"})
    with pytest.raises(AdmissionError) as exc:
        admit("hub", TINY, settings)
    assert exc.value.code == "base_model_mismatch"
    assert "register it against the base model it was trained on" in exc.value.message
    assert "a local path there" in exc.value.message


def test_oversized_adapter_is_refused(settings):
    write_adapter(root(settings) / "big", TINY, rank=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    with pytest.raises(AdmissionError) as exc:
        admit("big", TINY, settings.replace(max_adapter_bytes=4096))
    assert exc.value.code == "too_large"


def test_symlinked_adapter_directory_is_refused(settings, tmp_path):
    real = write_adapter(root(settings) / "real", TINY)
    os.symlink(real, root(settings) / "alias")
    outside = write_adapter(tmp_path / "elsewhere", TINY)
    os.symlink(outside, root(settings) / "escape")
    for uri in ("alias", "escape", str(root(settings) / "escape")):
        with pytest.raises(AdmissionError) as exc:
            admit(uri, TINY, settings)
        assert exc.value.code == "symlink"


def test_expected_revision_and_allowed_modules_from_settings(settings):
    write_adapter(root(settings) / "mlp", TINY, targets=("gate_proj", "up_proj"), config={"base_model_revision": None})
    with pytest.raises(AdmissionError) as exc:
        admit("mlp", TINY, settings, expected_revision="stale-rev")
    assert exc.value.code == "base_revision_mismatch"
    with pytest.raises(AdmissionError) as exc:
        admit("mlp", TINY, settings.replace(allowed_target_modules=("q_proj", "v_proj")))
    assert exc.value.code == "target_module_not_allowed"
    assert admit("mlp", TINY, settings).target_modules == ["gate_proj", "up_proj"]


def test_header_reader_matches_safetensors(settings):
    d = write_adapter(root(settings) / "h", TINY)
    header = read_safetensors_header(d / W)
    from safetensors import safe_open

    with safe_open(str(d / W), framework="pt") as fh:
        assert set(fh.keys()) == {k for k in header if k != "__metadata__"}
        for k in fh.keys():
            assert list(fh.get_slice(k).get_shape()) == header[k]["shape"]
    assert json.loads((d / C).read_text())["r"] == 4


async def test_refusals_leave_registry_unchanged(db_url, tmp_path):
    await fresh_registry(db_url)
    settings = make_settings(tmp_path, db_url, max_lora_rank=16)
    svc = RegistryService(settings)
    try:
        await svc.register_base_model(TINY)
        await svc.create_tenant("acme")
        version = await svc.version()
        audit = await svc.audit()
        for case in sorted(CASES):
            uri, code = make_case(settings, case)
            with pytest.raises(Invalid) as exc:
                await svc.register_adapter(case.replace("_", "-"), uri, "tiny", owner="acme")
            assert exc.value.status == 422 and exc.value.code == code
        with pytest.raises(Invalid) as exc:
            await svc.register_adapter("good", str(write_adapter(root(settings) / "ok", TINY)), "tiny",
                                       expected_revision="nope")
        assert exc.value.code == "base_revision_mismatch"
        assert await svc.version() == version
        assert await svc.audit() == audit
        assert await svc.list_adapters() == []
    finally:
        await svc.close()


def test_regex_targets_are_checked_per_tensor(settings):
    write_adapter(root(settings) / "rx", TINY, targets=("q_proj", "gate_proj"),
                  config={"target_modules": ".*(q_proj|gate_proj)", "use_rslora": True, "layers_to_transform": [0, 1]})
    assert admit("rx", TINY, settings).target_modules == ["q_proj", "gate_proj"]
    with pytest.raises(AdmissionError) as exc:
        admit("rx", TINY, settings.replace(allowed_target_modules=("q_proj",)))
    assert exc.value.code == "target_module_not_allowed"


def test_adapter_saved_by_peft_is_admitted(settings, monkeypatch):
    """What PEFT's save_pretrained writes (names, config keys) passes admission unchanged."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=TINY.hidden_size, intermediate_size=TINY.intermediate_size, num_hidden_layers=TINY.num_layers,
        num_attention_heads=TINY.num_heads, num_key_value_heads=TINY.num_kv_heads, vocab_size=TINY.vocab_size,
        max_position_embeddings=TINY.context_length))
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                  target_modules=["q_proj", "k_proj", "o_proj", "up_proj"]))
    out = root(settings) / "from-peft"
    peft_model.save_pretrained(str(out))
    a = admit("from-peft", TINY, settings)
    assert (a.rank, a.alpha, a.target_modules) == (8, 16.0, ["q_proj", "k_proj", "o_proj", "up_proj"])
    assert a.num_tensors == 2 * 4 * TINY.num_layers
