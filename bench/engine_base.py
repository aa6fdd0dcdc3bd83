"""Base-model engine throughput vs transformers ``generate`` vs this machine's floor.

One run, same weights (the demo GGUF, float32), same thread count: for batch 1, 8
and 32 with 128-token prompts and 64 new tokens (greedy, EOS ignored), it measures

* decode tokens/s (tokens produced after every row has its first token, divided by
  the time that took) and mean time to first token, for this engine and for
  transformers;
* the floor: ``batch / max(weight_bytes / bandwidth, flops_per_step / matmul_rate)``
  with bandwidth from a large tensor copy and the matmul rate from a large sgemm,
  both measured here and now.

Prints a table and writes ``bench/results/engine_base.json``.

    python bench/engine_base.py [--threads 2] [--batches 1,8,32] [--prompt 128] [--new 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP runs with its defaults (spin briefly, then sleep), as a worker does; both engines
# share this process and so the same setting. On an oversubscribed machine
# OMP_WAIT_POLICY=PASSIVE from the shell keeps spinning threads from starving each other.

import torch


def measure_bandwidth(mb: int = 512, reps: int = 5) -> float:
    """Bytes/s of a large copy (read + write counted)."""
    n = mb * 1024 * 1024 // 4
    src = torch.ones(n)
    dst = torch.empty(n)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * n * 4 / best


def measure_matmul(n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of an ``n x n x n`` float32 matmul."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    c = torch.empty(n, n)
    torch.matmul(a, b, out=c)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Ordinary tokens only (skip the first few hundred: special and byte tokens).
    return torch.randint(1000, vocab - 1000, (batch, length), generator=g).tolist()


def run_ours(engine, prompts: list[list[int]], new: int) -> dict[str, float]:
    from engine.sequence import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.monotonic()
    seqs = [engine.add_request(p, params) for p in prompts]
    while not all(s.first_token_time is not None for s in seqs):
        engine.step()
    t_first = time.monotonic()
    while not all(s.is_finished for s in seqs):
        engine.step()
    t_end = time.monotonic()
    assert all(len(s.output_ids) == new for s in seqs)
    ttft = sum(s.first_token_time - t0 for s in seqs) / len(seqs)
    decoded = len(seqs) * (new - 1)
    return {"ttft_s": ttft, "decode_tok_s": decoded / (t_end - t_first), "total_s": t_end - t0,
            "tokens": [s.output_ids for s in seqs]}


def run_transformers(model, prompts: list[list[int]], new: int) -> dict[str, float]:
    """One ``generate`` call; a stopping criterion timestamps every produced token."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):  # type: ignore[no-untyped-def]
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = torch.tensor(prompts)
    clock = Clock()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]))
        t_end = time.perf_counter()
    t_first = clock.times[0]  # after the prefill step produced every row's first token
    decoded = len(prompts) * (new - 1)
    return {"ttft_s": t_first - t0, "decode_tok_s": decoded / (t_end - t_first), "total_s": t_end - t0,
            "tokens": out[:, ids.shape[1]:].tolist()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]

    from engine.engine import Engine, EngineConfig
    from engine.fetch_demo import fetch_demo

    path = fetch_demo()
    max_b = max(batches)
    cfg = EngineConfig(device="cpu", dtype="float32", kv_cache_bytes=512 * 1024 * 1024,
                       max_num_seqs=max(32, max_b), max_num_batched_tokens=512)
    engine = Engine.from_path(path, cfg)
    mc = engine.model.cfg
    weight_bytes = engine.model.weight_bytes
    # Matmul parameters per token: every layer projection + the LM head (the embedding is a lookup).
    layer_params = sum(lw.qkv.numel() + lw.o.numel() + lw.gate_up.numel() + lw.down.numel()
                       for lw in engine.model.w.layers)
    matmul_params = layer_params + engine.model.w.lm_head.numel()

    print(f"measuring this machine ({args.threads} threads) ...", flush=True)
    bandwidth = measure_bandwidth()
    matmul_rate = measure_matmul()

    hf = None
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32).eval()

    rows = []
    for b in batches:
        prompts = make_prompts(b, args.prompt, mc.vocab_size, seed=b)
        # Warm up both paths once on a small run (allocator, thread pool, lazy init).
        run_ours(engine, prompts[:1], 4)
        ours = run_ours(engine, prompts, args.new)
        ref = None
        if hf is not None:
            run_transformers(hf, prompts[:1], 4)
            ref = run_transformers(hf, prompts, args.new)
        ctx = args.prompt + args.new / 2  # mean context during decode
        flops = 2 * b * matmul_params + 4 * b * ctx * mc.q_size * mc.num_layers
        step_floor_s = max(weight_bytes / bandwidth, flops / matmul_rate)
        floor_tps = b / step_floor_s
        same = None
        if ref is not None:
            same = sum(x == y for x, y in zip(ours["tokens"], ref["tokens"], strict=True)) / b
        rows.append({
            "batch": b,
            "ours_decode_tok_s": ours["decode_tok_s"], "ours_ttft_s": ours["ttft_s"],
            "hf_decode_tok_s": ref["decode_tok_s"] if ref else None, "hf_ttft_s": ref["ttft_s"] if ref else None,
            "floor_tok_s": floor_tps,
            "speedup_vs_hf": ours["decode_tok_s"] / ref["decode_tok_s"] if ref else None,
            "fraction_of_floor": ours["decode_tok_s"] / floor_tps,
            "greedy_rows_equal_to_hf": same,
        })
        r = rows[-1]
        print(f"batch {b:3d}: ours {r['ours_decode_tok_s']:8.1f} tok/s  ttft {r['ours_ttft_s'] * 1000:8.0f} ms | "
              f"transformers {r['hf_decode_tok_s'] or float('nan'):8.1f} tok/s  "
              f"ttft {(r['hf_ttft_s'] or float('nan')) * 1000:8.0f} ms | floor {floor_tps:8.1f} tok/s", flush=True)

    print()
    print(f"{'batch':>5} | {'ours tok/s':>10} | {'hf tok/s':>9} | {'floor tok/s':>11} | {'ours/hf':>7} | "
          f"{'ours/floor':>10} | {'ours ttft ms':>12} | {'hf ttft ms':>10} | {'same greedy':>11}")
    for r in rows:
        hf_tps = r["hf_decode_tok_s"]
        print(f"{r['batch']:>5} | {r['ours_decode_tok_s']:>10.1f} | "
              f"{(hf_tps if hf_tps else float('nan')):>9.1f} | {r['floor_tok_s']:>11.1f} | "
              f"{(r['speedup_vs_hf'] or float('nan')):>7.2f} | {r['fraction_of_floor']:>10.2f} | "
              f"{r['ours_ttft_s'] * 1000:>12.0f} | {(r['hf_ttft_s'] or float('nan')) * 1000:>10.0f} | "
              f"{r['greedy_rows_equal_to_hf'] if r['greedy_rows_equal_to_hf'] is not None else '-':>11}")
    print(f"\nweights {weight_bytes / 1e6:.0f} MB float32; bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"sgemm {matmul_rate / 1e9:.1f} GFLOP/s; threads {args.threads}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    out = {
        "model": str(path.name), "dtype": "float32", "threads": args.threads, "prompt_tokens": args.prompt,
        "new_tokens": args.new, "weight_bytes": weight_bytes, "bandwidth_bytes_s": bandwidth,
        "matmul_flop_s": matmul_rate, "load_average": os.getloadavg(), "cpus": os.cpu_count(),
        "machine": platform.platform(), "torch": torch.__version__, "rows": rows,
    }
    dest = Path(__file__).resolve().parent / "results" / "engine_base.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2))
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
