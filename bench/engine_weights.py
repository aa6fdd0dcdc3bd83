"""Base weights in bfloat16, 8 and 4 bits against float32: memory, decode speed with and without
adapters, and accuracy.

One process, the demo model loaded once per format: ``LORAPLEX_WEIGHTS=float32`` (the
reference, its KV cache float32 too), ``bfloat16`` (the base's matrices in bfloat16), ``int8``
(the projections in 8-bit blocks of 32, ``engine.quant``) and ``int4`` (in 4-bit blocks: the demo
file's Q4_1 blocks as stored), all under float32 activations (LoRA and attention stay float32; the
others' KV cache in ``--kv-cache-dtype``: ``auto``, the default, is bfloat16 under each of them,
``float32`` measures the weights alone). Memory: the base
model's weight bytes as loaded (all of it, embedding table and LM head included, and the
projections alone). For each case (base only, 32 distinct rank-16 adapters on all seven projections; batch 32,
128-token prompts, 64 new tokens, greedy, EOS ignored) the engines run in alternating rounds and
the best round of each is kept: decode tokens/s, mean time to first token, and the ratio to
float32.

Accuracy, teacher-forced on the float32 engine's own greedy continuations of chat prompts: the
share of positions where the engines' top-1 tokens agree, and the KL divergence per token
KL(float32 || other) (mean, p99, max); with an adapter too.

Prints tables and writes ``bench/results/engine_weights.json``.

    python bench/engine_weights.py [--rounds 2] [--batch 32] [--prompt 128] [--new 64] [--threads 2]
        [--kv-cache-dtype auto|float32|bfloat16] [--formats float32,bfloat16,int8,int4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_base import make_prompts, measure_bandwidth
from engine_lora import attach, preload, refs_of, run_ours, write_adapters

from loraplex.modelinfo import PROJECTIONS

RESULTS = Path(__file__).resolve().parent / "results"
FORMATS = ("float32", "bfloat16", "int8", "int4")
CHATS = ["Write one sentence about the sea.", "What is the capital of France?", "Explain gravity to a child.",
         "List three colours.", "Write a haiku about autumn.", "How do I sort a list in Python?",
         "Name two planets and one fact about each.", "Give me a recipe for pancakes."]


def weight_memory(engine: Any) -> dict[str, int]:
    """The engine's base weights in bytes as held: all of them, and the projections alone."""
    proj = 0
    for lw in engine.model.w.layers:
        for w in (lw.qkv, lw.o, lw.gate_up, lw.down):
            proj += w.nbytes if not isinstance(w, torch.Tensor) else w.numel() * w.element_size()
    return {"weight_bytes": engine.model.weight_bytes, "projections_bytes": proj}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--accuracy-new", type=int, default=48, help="greedy tokens per chat prompt for accuracy")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="the other formats' KV cache (auto: bfloat16 with bfloat16 weights)")
    ap.add_argument("--formats", default=",".join(FORMATS), help="weights formats; the first is the reference")
    args = ap.parse_args()
    formats = args.formats.split(",")
    ref_fmt, others = formats[0], formats[1:]
    torch.set_num_threads(args.threads)

    from engine.cpu import cpu_has_bf16_matmul
    from engine.engine import Engine, EngineConfig
    from engine.fetch_demo import fetch_demo
    from engine.scoring import agreement
    from loraplex.modelinfo import describe_model

    gguf = fetch_demo()
    info = describe_model(gguf)
    dirs = write_adapters(RESULTS / "adapters" / "r16-all", info, 64, 16, list(PROJECTIONS), seed=16,
                          base_name=info.name)[-args.adapters:]
    refs = refs_of(dirs, "w")
    engines, runtimes = {}, {}
    for fmt in formats:
        print(f"loading the demo model with weights={fmt} ...", flush=True)
        kv = "float32" if fmt == ref_fmt else args.kv_cache_dtype
        eng = Engine.from_path(gguf, EngineConfig(device="cpu", dtype="float32", weights=fmt, kv_cache_dtype=kv,
                                                  kv_cache_bytes=512 << 20, max_num_seqs=max(32, args.batch)))
        rt = attach(eng, info, max_loras=args.adapters, max_cpu_loras=args.adapters,
                    cache_dir=tempfile.mkdtemp(prefix="loraplex-bench-"))
        preload(rt, refs, place=True)
        engines[fmt], runtimes[fmt] = eng, rt
    kv_dtypes = {fmt: str(eng.cache.dtype).removeprefix("torch.") for fmt, eng in engines.items()}
    memory = {fmt: weight_memory(eng) for fmt, eng in engines.items()}
    bandwidth = measure_bandwidth()
    prompts = make_prompts(args.batch, args.prompt, info.vocab_size, seed=args.batch)
    cases = {"base": [None] * args.batch,
             f"{args.adapters} adapters": [refs[i % len(refs)] for i in range(args.batch)]}
    for eng in engines.values():  # full-size warm-up
        run_ours(eng, prompts, [None] * args.batch, 4)
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in range(args.rounds):
        for case, adapters in cases.items():
            for fmt in (formats if r % 2 == 0 else formats[::-1]):
                out = run_ours(engines[fmt], prompts, adapters, args.new)
                key = (case, fmt)
                if key not in best or out["decode_tok_s"] > best[key]["decode_tok_s"]:
                    best[key] = out
                print(f"round {r + 1}: {case:>12} {fmt:>8}: {out['decode_tok_s']:7.1f} tok/s, "
                      f"ttft {out['ttft_s'] * 1000:.0f} ms", flush=True)
    rows = []
    for case in cases:
        ref = best[(case, ref_fmt)]
        row: dict[str, Any] = {"case": case, f"{ref_fmt}_decode_tok_s": ref["decode_tok_s"],
                               f"{ref_fmt}_ttft_s": ref["ttft_s"]}
        for fmt in others:
            got = best[(case, fmt)]
            row[f"{fmt}_decode_tok_s"] = got["decode_tok_s"]
            row[f"{fmt}_ratio"] = got["decode_tok_s"] / ref["decode_tok_s"]
            row[f"{fmt}_ttft_s"] = got["ttft_s"]
            row[f"{fmt}_greedy_rows_equal"] = sum(
                a == b for a, b in zip(ref["tokens"], got["tokens"], strict=True)) / args.batch
        rows.append(row)
    print("measuring accuracy ...", flush=True)
    chats = [engines[ref_fmt].tokenizer.encode_chat([{"role": "user", "content": t}]) for t in CHATS]
    acc = {fmt: {"base": agreement(engines[ref_fmt], engines[fmt], chats, args.accuracy_new),
                 "adapter": agreement(engines[ref_fmt], engines[fmt], chats, args.accuracy_new, refs[0])}
           for fmt in others}
    for rt in runtimes.values():
        rt.manager.close()

    print(f"\nbatch {args.batch}, prompt {args.prompt}, {args.new} new tokens, {args.threads} threads; "
          f"CPU bfloat16 matmul: {cpu_has_bf16_matmul()}; bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"reference {ref_fmt}; KV cache: "
          + ", ".join(f"{kv_dtypes[fmt]} ({fmt} weights)" for fmt in formats))
    print(f"{'format':>8} | {'weights MB':>10} | {'projections MB':>14} | {'ratio':>10}")
    ref_bytes = memory[ref_fmt]["projections_bytes"]
    for fmt, mem in memory.items():
        print(f"{fmt:>8} | {mem['weight_bytes'] / 1e6:>10.1f} | {mem['projections_bytes'] / 1e6:>14.1f} | "
              f"{mem['projections_bytes'] / ref_bytes:>10.3f}")
    print(f"{'case':>12} | {'format':>8} | {'tok/s':>7} | {'ratio':>5} | {'ttft ms':>7} | {'same greedy rows':>16}")
    for r in rows:
        print(f"{r['case']:>12} | {ref_fmt:>8} | {r[f'{ref_fmt}_decode_tok_s']:>7.1f} | {1:>5.2f} | "
              f"{r[f'{ref_fmt}_ttft_s'] * 1000:>7.0f} | {'':>16}")
        for fmt in others:
            print(f"{'':>12} | {fmt:>8} | {r[f'{fmt}_decode_tok_s']:>7.1f} | {r[f'{fmt}_ratio']:>5.2f} | "
                  f"{r[f'{fmt}_ttft_s'] * 1000:>7.0f} | {r[f'{fmt}_greedy_rows_equal']:>16.2f}")
    print(f"\n{'format':>8} | {'accuracy':>8} | {'positions':>9} | {'top-1 agree':>11} | {'KL mean':>9} | "
          f"{'KL p99':>9} | {'KL max':>9}")
    for fmt, by_case in acc.items():
        for name, a in by_case.items():
            print(f"{fmt:>8} | {name:>8} | {a['positions']:>9} | {a['top1_agreement']:>11.3f} | "
                  f"{a['kl_mean']:>9.2e} | {a['kl_p99']:>9.2e} | {a['kl_max']:>9.2e}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                       "bf16_matmul": cpu_has_bf16_matmul(), "bandwidth_bytes_s": bandwidth,
                       "load_average": os.getloadavg()},
           "args": vars(args), "kv_cache_dtype": kv_dtypes, "memory": memory,
           "speed": rows, "accuracy": acc, "time": time.time()}
    (RESULTS / "engine_weights.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS / 'engine_weights.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
