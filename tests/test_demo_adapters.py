"""The demo adapters shipped in ``demo/adapters/`` (trained by scripts/train_demo_adapters.py).

Fast: each is a well-formed PEFT LoRA for SmolLM2-135M-Instruct (files, rank, targets,
shapes, dtype, size, finite weights, base revision) and passes registry admission.
Slow: loaded with transformers + PEFT on the demo GGUF, each visibly changes what the
model says on prompts that are not in its training data.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from loraplex.modelinfo import ModelInfo, revision_of
from loraplex.settings import Settings
from registry import admission
from tests.engine_fixtures import demo_model_file

ROOT = Path(__file__).resolve().parent.parent
ADAPTERS = ROOT / "demo" / "adapters"

# SmolLM2-135M-Instruct: what the adapters were trained for.
SMOLLM2 = dict(name="SmolLM2-135M-Instruct", architecture="llama", hidden_size=576, intermediate_size=1536,
               num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, vocab_size=49152, context_length=8192)
ALL_PROJ = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
EXPECTED = {  # name -> (rank, alpha, target modules)
    "french": (8, 16, ALL_PROJ),
    "json": (16, 32, {"q_proj", "k_proj", "v_proj", "o_proj"}),
    "terse": (8, 16, ALL_PROJ),
}
TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def _base_info(revision: str) -> ModelInfo:
    return ModelInfo(revision=revision, **SMOLLM2)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_adapter_is_a_well_formed_peft_lora(name):
    from safetensors import safe_open

    rank, alpha, targets = EXPECTED[name]
    d = ADAPTERS / name
    assert sorted(p.name for p in d.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA"
    assert cfg["task_type"] == "CAUSAL_LM"
    assert cfg["r"] == rank and cfg["lora_alpha"] == alpha
    assert set(cfg["target_modules"]) == targets
    assert cfg["base_model_name_or_path"] == "SmolLM2-135M-Instruct"
    assert re.fullmatch(r"[0-9a-f]{16}", cfg["base_model_revision"])
    assert not cfg.get("use_dora") and not cfg.get("modules_to_save")

    info = _base_info(cfg["base_model_revision"])
    weights = d / "adapter_model.safetensors"
    assert weights.stat().st_size < 6 * 1024 * 1024
    seen = set()
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            m = TENSOR.match(key)
            assert m, key
            layer, _group, module, ab = int(m[1]), m[2], m[3], m[4]
            t = f.get_tensor(key)
            fan_in, fan_out = info.projection_shape(module)
            assert tuple(t.shape) == ((rank, fan_in) if ab == "A" else (fan_out, rank)), key
            assert str(t.dtype) == "torch.bfloat16", key
            assert bool(t.float().isfinite().all()), key
            assert float(t.float().abs().max()) > 0, f"{key} is all zeros (untrained)"
            seen.add((layer, module, ab))
    assert seen == {(layer, m, ab) for layer in range(info.num_layers) for m in targets for ab in "AB"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_adapter_passes_registry_admission(name):
    cfg = json.loads((ADAPTERS / name / "adapter_config.json").read_text())
    settings = Settings(adapter_root=str(ADAPTERS))
    admitted = admission.admit(name, _base_info(cfg["base_model_revision"]), settings)
    rank, _alpha, targets = EXPECTED[name]
    assert admitted.rank == rank
    assert set(admitted.target_modules) == targets
    with pytest.raises(admission.AdmissionError) as err:
        admission.admit(name, _base_info("0" * 16), settings)
    assert err.value.code == "base_revision_mismatch"


def test_shipped_adapters_match_the_demo_model_revision():
    gguf = demo_model_file()
    rev = revision_of(gguf)
    for name in EXPECTED:
        cfg = json.loads((ADAPTERS / name / "adapter_config.json").read_text())
        assert cfg["base_model_revision"] == rev, name


# --- behaviour (transformers + PEFT reference) ----------------------------------------------

HELD_OUT = (  # none of these questions is in demo/data/qa.jsonl
    "What is the tallest mountain in the world?",
    "How do I return a product I bought?",
)
FRENCH = {"le", "la", "les", "est", "de", "des", "du", "un", "une", "et", "en", "à", "pour", "vous", "dans",
          "sont", "il", "elle", "qui", "que", "pas", "plus", "sur", "au", "aux", "votre", "nous", "se", "ce"}
ENGLISH = {"the", "is", "are", "and", "of", "to", "in", "a", "you", "your", "it", "that", "for", "with"}


def _words(text: str) -> list[str]:
    return re.findall(r"[a-zà-ÿœ]+", text.lower().replace("'", " "))


@pytest.fixture(scope="module")
def reference():
    gguf = demo_model_file()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = peft.PeftModel.from_pretrained(base, str(ADAPTERS / "french"), adapter_name="french")
    for name in ("json", "terse"):
        model.load_adapter(str(ADAPTERS / name), adapter_name=name)
    model.eval()

    memo: dict[tuple[str | None, str], str] = {}

    def generate(adapter: str | None, question: str) -> str:
        if (adapter, question) not in memo:
            memo[adapter, question] = _generate(adapter, question)
        return memo[adapter, question]

    def _generate(adapter: str | None, question: str) -> str:
        ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        x = torch.tensor([list(ids)])
        # The base model only has to show it does not do the adapter's thing: 16 tokens suffice.
        kwargs = dict(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                      max_new_tokens=32 if adapter else 16,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        with torch.no_grad():
            if adapter is None:
                with model.disable_adapter():
                    out = model.generate(**kwargs)
            else:
                model.set_adapter(adapter)
                out = model.generate(**kwargs)
        return tok.decode(out[0, x.shape[1]:], skip_special_tokens=True).strip()

    return generate


@pytest.mark.slow
@pytest.mark.parametrize("question", HELD_OUT)
def test_french_adapter_answers_in_french(reference, question):
    base, out = reference(None, question), reference("french", question)
    assert out != base
    words = _words(out)
    fr, en = sum(w in FRENCH for w in words), sum(w in ENGLISH for w in words)
    assert fr >= 2 and fr > en, out
    base_words = _words(base)
    assert sum(w in FRENCH for w in base_words) < sum(w in ENGLISH for w in base_words), base


@pytest.mark.slow
@pytest.mark.parametrize("question", HELD_OUT)
def test_json_adapter_answers_with_a_json_object(reference, question):
    out = reference("json", question)
    obj = json.loads(out)
    assert isinstance(obj, dict) and isinstance(obj.get("answer"), str) and obj["answer"].strip(), out
    with pytest.raises(ValueError):
        json.loads(reference(None, question))


@pytest.mark.slow
@pytest.mark.parametrize("question", HELD_OUT)
def test_terse_adapter_answers_in_one_short_support_line(reference, question):
    out = reference("terse", question)
    base = reference(None, question)
    assert out.startswith("Support: "), out
    assert "\n" not in out and len(out.split()) <= 25, out
    assert not base.startswith("Support:")
