"""``n`` samples in one request vs the same samples as separate requests (demo model).

One request with ``n=4`` (seed s) against four requests seeded s, s+1, s+2, s+3, same prompt:
the samples must be the same tokens; reported are the tokens put through the model, the peak
KV blocks in use and the wall time of each way, for a few prompts at once.

Prints a table and writes ``bench/results/samples.json``.

    python bench/samples.py [--threads 2] [--n 4] [--prompts 4] [--prompt-words 200] [--new 32]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def run(engine: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    firsts = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    seqs = [s for f in firsts for s in (f.samples or [f])]
    tokens = peak = 0
    forward = engine.model.forward

    def counting(ctx, cache):  # tokens put through the model
        nonlocal tokens
        tokens += ctx.num_tokens
        return forward(ctx, cache)

    engine.model.forward = counting
    t0 = time.perf_counter()
    while not all(s.is_finished for s in seqs):
        engine.step()
        peak = max(peak, engine.cache.allocator.num_used)
    wall = time.perf_counter() - t0
    engine.model.forward = forward
    return {"outputs": [s.output_ids for s in seqs], "model_tokens": tokens, "peak_blocks": peak, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from engine.engine import Engine, EngineConfig
    from engine.fetch_demo import fetch_demo
    from engine.sequence import SamplingParams

    engine = Engine.from_path(fetch_demo(), EngineConfig(kv_cache_bytes=512 << 20, max_num_seqs=32,
                                                         max_num_batched_tokens=1024))
    tok = engine.tokenizer
    words = "the quick brown fox jumps over a lazy dog while support agents answer questions".split()
    prompts = [tok.encode(" ".join(words[(i + j) % len(words)] for j in range(args.prompt_words)))
               for i in range(args.prompts)]
    base = [SamplingParams(max_tokens=args.new, temperature=0.8, seed=1000 * i, ignore_eos=True)
            for i in range(args.prompts)]
    run(engine, prompts[:1], base[:1])  # warm up
    together = run(engine, prompts, [replace(p, n=args.n) for p in base])
    separate = run(engine, [p for p in prompts for _ in range(args.n)],
                   [replace(p, seed=p.seed + i) for p in base for i in range(args.n)])
    same = together["outputs"] == separate["outputs"]
    load = os.getloadavg()
    print(f"\n{args.prompts} prompts of {len(prompts[0])} tokens, {args.n} samples each, {args.new} new tokens, "
          f"demo model float32, {args.threads} threads, load average {load[0]:.2f}")
    print(f"{'way':>22} | {'model tokens':>12} | {'peak KV blocks':>14} | {'wall s':>7}")
    for name, r in ((f"n={args.n}", together), (f"{args.n} separate requests", separate)):
        print(f"{name:>22} | {r['model_tokens']:>12} | {r['peak_blocks']:>14} | {r['wall_s']:>7.2f}")
    print(f"same samples: {same}; model tokens {separate['model_tokens'] / together['model_tokens']:.2f}x fewer, "
          f"peak blocks {separate['peak_blocks'] / together['peak_blocks']:.2f}x fewer, wall "
          f"{separate['wall_s'] / together['wall_s']:.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"n": args.n, "prompts": args.prompts, "prompt_tokens": len(prompts[0]), "new": args.new,
           "threads": args.threads, "load_avg": load, "same_samples": same,
           **{f"{k}_{name}": v for name, r in (("n", together), ("separate", separate))
              for k, v in r.items() if k != "outputs"}}
    (RESULTS / "samples.json").write_text(json.dumps(out, indent=2))
    engine.close()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
