"""Multi-LoRA engine throughput vs PEFT mixed batches vs this machine's floor; Zipf adapter stream.

Scenario 1 (demo model, float32, same threads for everyone): 64 synthetic rank-16 adapters on
all seven projections, batch 32, 128-token prompts, 64 new tokens (greedy, EOS ignored). For
the base model alone and for 1, 8 and 32 distinct adapters in the batch it measures

* this engine's decode tokens/s (tokens produced after every row has its first token, over
  the time that took) and mean time to first token;
* PEFT: a ``PeftModel`` holding the adapters, ``generate(..., adapter_names=[...])`` on the
  same mixed batch (``--peft-new`` new tokens, by default as many as ours; decode tokens/s timed from the
  first generated token to the last inside one ``generate``);
* the floor ``batch / max(bytes / bandwidth, flops / matmul_rate)`` where ``bytes`` is the
  base weights plus the distinct adapters' bytes and ``flops`` include every row's adapter
  matmuls; bandwidth and matmul rate come from ``bench/engine_base.py``'s measurements, taken
  here and now.

Scenario 2: a Poisson request stream (short prompts, few new tokens) whose adapters follow
Zipf(1.1) over 500 synthetic rank-8 adapters (q_proj and v_proj, PEFT's default targets)
with ``max_loras=16`` and ``max_cpu_loras=128``: throughput, time to first token p50/p99
split by where the adapter was when the request arrived (``device`` slot, ``host`` memory,
``cold`` = on disk), adapter loads per second. Then the same rate over an active set of 32
adapters (twice the 16 slots, all in host memory) against 16 adapters all resident in
slots: the ratio of p50 time to first token. The arrival rate is half the engine's measured
capacity for this request shape (``--load`` changes the fraction).

Prints tables and writes ``bench/results/engine_lora.json``. Synthetic adapters are written
once (deterministic seed) under ``bench/results/adapters/``.

    python bench/engine_lora.py [--quick] [--threads 2] [--batch 32] [--prompt 128] [--new 64]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_base import make_prompts, measure_bandwidth, measure_matmul

from loraplex.modelinfo import PROJECTIONS, ModelInfo
from loraplex.wire import AdapterRef

RESULTS = Path(__file__).resolve().parent / "results"


# --- synthetic adapters -----------------------------------------------------------------------

def write_adapters(root: Path, info: ModelInfo, count: int, rank: int, targets: list[str], seed: int,
                   base_name: str) -> list[Path]:
    """``count`` PEFT LoRA directories (safetensors) under ``root``; existing complete ones are kept."""
    from safetensors.torch import save_file

    dirs = []
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
           "target_modules": sorted(targets), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
           "fan_in_fan_out": False, "base_model_name_or_path": base_name, "inference_mode": True}
    for i in range(count):
        d = root / f"a{i:03d}"
        dirs.append(d)
        if (d / "adapter_model.safetensors").is_file() and (d / "adapter_config.json").is_file():
            continue
        d.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(seed * 100_003 + i)
        tensors = {}
        for layer in range(info.num_layers):
            for proj in targets:
                n_in, n_out = info.projection_shape(proj)
                part = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / math.sqrt(n_in)
                tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.02
        tmp = d / "adapter_model.safetensors.tmp"
        save_file(tensors, str(tmp))
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        tmp.rename(d / "adapter_model.safetensors")
    return dirs


def adapter_params(info: ModelInfo, rank: int, targets: list[str]) -> int:
    return info.num_layers * sum(rank * sum(info.projection_shape(p)) for p in targets)


def refs_of(dirs: list[Path], tag: str) -> list[AdapterRef]:
    return [AdapterRef(id=f"{tag}-{d.name}", name=f"{tag}-{d.name}", uri=d.as_uri()) for d in dirs]


# --- engine plumbing --------------------------------------------------------------------------

def attach(engine: Any, info: ModelInfo, *, max_loras: int, max_cpu_loras: int, cache_dir: str) -> Any:
    from engine.lora.manager import AdapterManager
    from engine.lora.runtime import LoRARuntime
    from engine.lora.slots import SlotBank
    from loraplex.settings import Settings

    bank = SlotBank.for_model(info, Settings().lora_rank_classes, slots_per_class=max_loras,
                              weights_dtype=engine.model.lora_weights_dtype)
    rt = LoRARuntime(AdapterManager(info, bank, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                                    cache_dir=cache_dir))
    engine.lora_runtime = rt
    engine.scheduler.policy = rt
    return rt


def preload(rt: Any, refs: list[AdapterRef], *, place: bool) -> None:
    """Bring adapters to host memory (and, with ``place``, into device slots, then let go)."""
    m = rt.manager
    for r in refs:
        m.prefetch(r)
    deadline = time.monotonic() + 600
    while not all(m.ready(r) for r in refs):
        if any(m.state(r).state == "failed" for r in refs):
            raise RuntimeError(next(m.state(r).error for r in refs if m.state(r).state == "failed"))
        if time.monotonic() > deadline:
            raise TimeoutError("adapters did not load")
        time.sleep(0.01)
    if place:
        m.acquire_slots(refs)
        m.release(refs)


def run_ours(engine: Any, prompts: list[list[int]], adapters: list[AdapterRef | None], new: int) -> dict[str, Any]:
    from engine.sequence import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.monotonic()
    seqs = [engine.add_request(p, params, adapter=a) for p, a in zip(prompts, adapters, strict=True)]
    while not all(s.first_token_time is not None for s in seqs):
        if not engine.step():
            time.sleep(0.001)
    t_first = time.monotonic()
    while not all(s.is_finished for s in seqs):
        engine.step()
    t_end = time.monotonic()
    assert all(len(s.output_ids) == new for s in seqs), [s.finish_reason for s in seqs]
    return {"ttft_s": sum(s.first_token_time - t0 for s in seqs) / len(seqs),
            "decode_tok_s": len(seqs) * (new - 1) / (t_end - t_first), "tokens": [s.output_ids for s in seqs]}


def run_peft(model: Any, prompts: list[list[int]], names: list[str] | None, new: int) -> dict[str, Any]:
    """One ``generate``; a stopping criterion stamps the time of every generated token, so decode
    tokens/s is measured from the first token to the last inside the same call."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = torch.tensor(prompts)
    clock = Clock()
    kw: dict[str, Any] = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                              max_new_tokens=new, min_new_tokens=new,
                              stopping_criteria=StoppingCriteriaList([clock]))
    if names is not None:
        kw["adapter_names"] = names
    with torch.inference_mode():
        t0 = time.perf_counter()
        if names is None:
            with model.disable_adapter():
                out = model.generate(**kw)
        else:
            out = model.generate(**kw)
    decode_s = clock.times[-1] - clock.times[0]
    return {"ttft_s": clock.times[0] - t0,
            "decode_tok_s": len(prompts) * (new - 1) / decode_s if new > 1 else float("nan"),
            "tokens": out[:, ids.shape[1]:].tolist()}


# --- scenario 1 -------------------------------------------------------------------------------

def scenario_batch(args: argparse.Namespace, engine: Any, info: ModelInfo, gguf: Path, dirs: list[Path],
                   bandwidth: float, matmul_rate: float) -> list[dict[str, Any]]:
    refs = refs_of(dirs, "s1")
    cache = tempfile.mkdtemp(prefix="loraplex-bench-")
    rt = attach(engine, info, max_loras=max(args.cases), max_cpu_loras=len(refs), cache_dir=cache)
    b = args.batch
    prompts = make_prompts(b, args.prompt, info.vocab_size, seed=b)
    mc = engine.model.cfg
    layer_params = sum(lw.qkv.numel() + lw.o.numel() + lw.gate_up.numel() + lw.down.numel()
                       for lw in engine.model.w.layers)
    matmul_params = layer_params + engine.model.w.lm_head.numel()
    a_params = adapter_params(info, 16, list(PROJECTIONS))
    a_bytes = 4 * a_params

    peft_model = None
    if not args.skip_peft:
        import peft
        from transformers import AutoModelForCausalLM

        print("loading transformers + PEFT ...", flush=True)
        base = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        peft_model = peft.PeftModel.from_pretrained(base.eval(), str(dirs[0]), adapter_name=dirs[0].name)
        for d in dirs[1:]:
            if any(d in case_dirs(args, dirs, n) for n in args.cases):
                peft_model.load_adapter(str(d), adapter_name=d.name)
        peft_model.eval()

    # A full-size warm-up for both sides: the first full-size run after loading is often slow
    # (page faults on fresh KV and activation memory), which would be charged to the base case.
    run_ours(engine, prompts, [None] * b, 4)
    if peft_model is not None:
        run_peft(peft_model, prompts, None, 2)
    rows = []
    for n in [0, *args.cases]:
        chosen = case_dirs(args, dirs, n)
        by_name = {r.name.removeprefix("s1-"): r for r in refs}
        row_dirs = [chosen[i % len(chosen)] if chosen else None for i in range(b)]
        adapters = [by_name[d.name] if d else None for d in row_dirs]
        if chosen:
            preload(rt, [by_name[d.name] for d in chosen], place=True)
        run_ours(engine, prompts[:2], adapters[:2], 4)  # warm-up
        ours = run_ours(engine, prompts, adapters, args.new)
        ref = None
        if peft_model is not None:
            names = [d.name for d in row_dirs] if chosen else None
            peft_new = args.new if not chosen else min(args.new, args.peft_new)
            run_peft(peft_model, prompts[:2], names[:2] if names else None, 2)  # warm-up
            ref = run_peft(peft_model, prompts, names, peft_new)
        ctx = args.prompt + args.new / 2
        flops = 2 * b * matmul_params + 4 * b * ctx * mc.q_size * mc.num_layers + (2 * b * a_params if n else 0)
        step_bytes = engine.model.weight_bytes + len(chosen) * a_bytes
        floor = b / max(step_bytes / bandwidth, flops / matmul_rate)
        k = min(args.new, args.peft_new) if ref else 0
        same = (sum(x[:k] == y[:k] for x, y in zip(ours["tokens"], ref["tokens"], strict=True)) / b) if ref else None
        rows.append({"distinct_adapters": n, "ours_decode_tok_s": ours["decode_tok_s"], "ours_ttft_s": ours["ttft_s"],
                     "peft_decode_tok_s": ref["decode_tok_s"] if ref else None,
                     "peft_ttft_s": ref["ttft_s"] if ref else None, "floor_tok_s": floor,
                     "adapter_bytes_per_step": len(chosen) * a_bytes,
                     "speedup_vs_peft": ours["decode_tok_s"] / ref["decode_tok_s"] if ref else None,
                     "fraction_of_floor": ours["decode_tok_s"] / floor, "greedy_rows_equal_to_peft": same})
        r = rows[-1]
        print(f"{n:2d} adapters: ours {r['ours_decode_tok_s']:7.1f} tok/s | PEFT "
              f"{r['peft_decode_tok_s'] or float('nan'):7.1f} tok/s | floor {floor:7.1f} tok/s", flush=True)
    rt.manager.close()
    engine.lora_runtime = None
    from engine.scheduler import AdmitAll

    engine.scheduler.policy = AdmitAll()
    return rows


def case_dirs(args: argparse.Namespace, dirs: list[Path], n: int) -> list[Path]:
    """The adapters of the n-distinct case: the last n for the largest case, else the first n."""
    if n == 0:
        return []
    return dirs[-n:] if n == max(args.cases) else dirs[:n]


# --- scenario 2 -------------------------------------------------------------------------------

def zipf_choice(rng: random.Random, n: int, s: float, k: int) -> list[int]:
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    return rng.choices(range(n), weights=weights, k=k)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def replay(engine: Any, rt: Any, stream: list[tuple[float, AdapterRef, list[int]]], new: int) -> dict[str, Any]:
    """Feed requests at their arrival times (offsets in seconds) while stepping the engine on
    this thread; time to first token counts from the scheduled arrival."""
    from engine.sequence import SamplingParams

    m = rt.manager
    loads0 = dict(m.stats.loads)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    start = time.monotonic()
    pending = list(stream)
    live: list[tuple[float, str, Any]] = []
    i = 0
    while i < len(pending) or any(not s.is_finished for _, _, s in live):
        now = time.monotonic()
        while i < len(pending) and start + pending[i][0] <= now:
            at, ref, prompt = pending[i]
            where = m.state(ref).state
            kind = "device" if where == "device" else "host" if where == "host" else "cold"
            seq = engine.add_request(prompt, params, adapter=ref)
            rt.prefetch(seq)
            live.append((start + at, kind, seq))
            i += 1
        if not engine.step():
            wait = start + pending[i][0] - time.monotonic() if i < len(pending) else 0.002
            time.sleep(min(max(wait, 0.0), 0.002))
    end = time.monotonic()
    failed = [s for _, _, s in live if s.finish_reason not in ("length", "stop")]
    assert not failed, [s.finish_reason for s in failed]
    ttft: dict[str, list[float]] = {"device": [], "host": [], "cold": []}
    for at, kind, s in live:
        ttft[kind].append(s.first_token_time - at)
    every = [x for v in ttft.values() for x in v]
    span = end - start
    loads = {k: m.stats.loads[k] - loads0[k] for k in loads0}
    out: dict[str, Any] = {
        "requests": len(live), "seconds": span, "requests_per_s": len(live) / span,
        "tokens_per_s": len(live) * new / span, "ttft_p50_s": pct(every, 50), "ttft_p99_s": pct(every, 99),
        "loads": loads, "disk_loads_per_s": loads["disk"] / span, "slot_loads_per_s": loads["host"] / span,
        "evictions": dict(m.stats.evictions),
    }
    for kind, xs in ttft.items():
        out[f"{kind}_requests"] = len(xs)
        out[f"{kind}_ttft_p50_s"] = pct(xs, 50)
        out[f"{kind}_ttft_p99_s"] = pct(xs, 99)
    return out


def make_stream(rng: random.Random, refs: list[AdapterRef], picks: list[int], rate: float, prompt: int,
                vocab: int) -> list[tuple[float, AdapterRef, list[int]]]:
    t = 0.0
    out = []
    for k in picks:
        t += rng.expovariate(rate)
        out.append((t, refs[k], [rng.randrange(1000, vocab - 1000) for _ in range(prompt)]))
    return out


def scenario_zipf(args: argparse.Namespace, engine: Any, info: ModelInfo, dirs: list[Path]) -> dict[str, Any]:
    refs = refs_of(dirs, "z")
    rng = random.Random(1234)
    vocab = info.vocab_size

    def fresh() -> Any:
        return attach(engine, info, max_loras=16, max_cpu_loras=128, cache_dir=tempfile.mkdtemp(prefix="loraplex-z-"))

    # Capacity for this request shape with 16 resident adapters, all requests queued at once.
    rt = fresh()
    preload(rt, refs[:16], place=True)
    n_cal = max(32, args.zipf_requests // 8)
    cal = make_stream(rng, refs, [i % 16 for i in range(n_cal)], 1e9, args.zipf_prompt, vocab)
    capacity = replay(engine, rt, cal, args.zipf_new)["requests_per_s"]
    rt.manager.close()
    rate = args.load * capacity
    print(f"capacity {capacity:.1f} req/s with 16 resident adapters; replaying at {rate:.1f} req/s", flush=True)

    out: dict[str, Any] = {"capacity_requests_per_s": capacity, "rate_requests_per_s": rate}
    rt = fresh()
    picks = zipf_choice(rng, len(refs), 1.1, args.zipf_requests)
    out["zipf"] = replay(engine, rt, make_stream(rng, refs, picks, rate, args.zipf_prompt, vocab), args.zipf_new)
    out["zipf"]["distinct_adapters"] = len(set(picks))
    rt.manager.close()

    n_cmp = max(64, args.zipf_requests // 2)
    rt = fresh()
    preload(rt, refs[:16], place=True)
    out["resident16"] = replay(engine, rt, make_stream(rng, refs, [rng.randrange(16) for _ in range(n_cmp)], rate,
                                                       args.zipf_prompt, vocab), args.zipf_new)
    rt.manager.close()
    rt = fresh()
    active = refs[100:132]
    preload(rt, active, place=False)
    out["active32"] = replay(engine, rt, make_stream(rng, active, [rng.randrange(32) for _ in range(n_cmp)], rate,
                                                     args.zipf_prompt, vocab), args.zipf_new)
    rt.manager.close()
    out["p50_ratio_active32_vs_resident16"] = out["active32"]["ttft_p50_s"] / out["resident16"]["ttft_p50_s"]
    from engine.scheduler import AdmitAll

    engine.lora_runtime = None
    engine.scheduler.policy = AdmitAll()
    return out


# --- main -------------------------------------------------------------------------------------

def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch 8, prompt 32, 16 new tokens, short streams")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--peft-new", type=int, default=None,
                    help="new tokens for PEFT's adapter cases (default: --new, the same decode lengths as ours)")
    ap.add_argument("--cases", default="1,8,32", help="distinct adapters per batch (besides base only)")
    ap.add_argument("--zipf-requests", type=int, default=600)
    ap.add_argument("--zipf-prompt", type=int, default=16)
    ap.add_argument("--zipf-new", type=int, default=8)
    ap.add_argument("--load", type=float, default=0.5, help="arrival rate as a fraction of measured capacity")
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--skip-zipf", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.prompt, args.new = 8, 32, 16
        args.cases, args.zipf_requests = "1,4,8", 160
    args.cases = [int(c) for c in str(args.cases).split(",")]
    if args.peft_new is None:
        args.peft_new = args.new
    if max(args.cases) > args.batch:
        ap.error("a case has more distinct adapters than rows")
    torch.set_num_threads(args.threads)
    t_start = time.monotonic()

    from engine.engine import Engine, EngineConfig
    from engine.fetch_demo import fetch_demo
    from loraplex.modelinfo import describe_model

    gguf = fetch_demo()
    info = describe_model(gguf)
    engine = Engine.from_path(gguf, EngineConfig(device="cpu", dtype="float32", kv_cache_bytes=512 << 20,
                                                 max_num_seqs=max(32, args.batch), max_num_batched_tokens=512))
    print("writing synthetic adapters ...", flush=True)
    n_batch_adapters = 64 if not args.quick else 16
    dirs16 = write_adapters(RESULTS / "adapters" / "r16-all", info, n_batch_adapters, 16, list(PROJECTIONS),
                            seed=16, base_name=info.name)
    dirs8 = [] if args.skip_zipf else write_adapters(RESULTS / "adapters" / "r8-qv", info, 500, 8,
                                                     ["q_proj", "v_proj"], seed=8, base_name=info.name)
    print(f"measuring this machine ({args.threads} threads) ...", flush=True)
    bandwidth = measure_bandwidth()
    matmul_rate = measure_matmul()

    rows = scenario_batch(args, engine, info, gguf, dirs16, bandwidth, matmul_rate)
    zipf = None if args.skip_zipf else scenario_zipf(args, engine, info, dirs8)
    load_avg = os.getloadavg()

    print(f"\nScenario 1: batch {args.batch}, prompt {args.prompt}, {args.new} new tokens "
          f"(PEFT adapter cases: {args.peft_new}), rank-16 adapters on all 7 projections, float32, "
          f"{args.threads} threads")
    print(f"{'adapters':>8} | {'ours tok/s':>10} | {'PEFT tok/s':>10} | {'floor tok/s':>11} | {'ours/PEFT':>9} | "
          f"{'ours/floor':>10} | {'ours ttft ms':>12} | {'PEFT ttft ms':>12} | {'same greedy':>11}")
    for r in rows:
        label = "base" if r["distinct_adapters"] == 0 else str(r["distinct_adapters"])
        same = r["greedy_rows_equal_to_peft"]
        print(f"{label:>8} | {r['ours_decode_tok_s']:>10.1f} | {r['peft_decode_tok_s'] or float('nan'):>10.1f} | "
              f"{r['floor_tok_s']:>11.1f} | {r['speedup_vs_peft'] or float('nan'):>9.2f} | "
              f"{r['fraction_of_floor']:>10.2f} | {ms(r['ours_ttft_s']):>12} | {ms(r['peft_ttft_s']):>12} | "
              f"{'-' if same is None else f'{same:.2f}':>11}")
    if zipf is not None:
        z = zipf["zipf"]
        print(f"\nScenario 2: Zipf(1.1) over 500 rank-8 adapters, max_loras=16, max_cpu_loras=128; "
              f"prompt {args.zipf_prompt}, {args.zipf_new} new tokens; {zipf['rate_requests_per_s']:.1f} req/s "
              f"({args.load:.0%} of the measured {zipf['capacity_requests_per_s']:.1f} req/s)")
        print(f"{'stream':>11} | {'req':>4} | {'req/s':>6} | {'tok/s':>6} | {'p50 ms':>6} | {'p99 ms':>6} | "
              f"{'device p50/p99':>14} | {'host p50/p99':>13} | {'cold p50/p99':>13} | {'disk loads/s':>12} | "
              f"{'slot loads/s':>12}")
        for name in ("zipf", "resident16", "active32"):
            s = zipf[name]
            cols = [f"{ms(s[f'{k}_ttft_p50_s'])}/{ms(s[f'{k}_ttft_p99_s'])} ({s[f'{k}_requests']})"
                    for k in ("device", "host", "cold")]
            print(f"{name:>11} | {s['requests']:>4} | {s['requests_per_s']:>6.1f} | {s['tokens_per_s']:>6.1f} | "
                  f"{ms(s['ttft_p50_s']):>6} | {ms(s['ttft_p99_s']):>6} | {cols[0]:>14} | {cols[1]:>13} | "
                  f"{cols[2]:>13} | {s['disk_loads_per_s']:>12.1f} | {s['slot_loads_per_s']:>12.1f}")
        print(f"distinct adapters in the Zipf stream: {z['distinct_adapters']}; p50 TTFT, 32 active adapters on 16 "
              f"slots vs 16 resident: {zipf['p50_ratio_active32_vs_resident16']:.2f}x (target <= 3x)")
    top = next((r for r in rows if r["distinct_adapters"] == max(args.cases)), None)
    if top is not None and top["speedup_vs_peft"] is not None:
        print(f"\n{max(args.cases)} distinct adapters: {top['speedup_vs_peft']:.1f}x PEFT (target >= 5x), "
              f"{top['fraction_of_floor']:.0%} of the floor (target >= 50%)")
    elapsed = time.monotonic() - t_start
    print(f"bandwidth {bandwidth / 1e9:.1f} GB/s; sgemm {matmul_rate / 1e9:.1f} GFLOP/s; rank-16 adapter "
          f"{4 * adapter_params(info, 16, list(PROJECTIONS)) / 1e6:.1f} MB; load average {load_avg[0]:.1f} on "
          f"{os.cpu_count()} CPUs; run took {elapsed:.0f} s")
    out = {"model": gguf.name, "dtype": "float32", "threads": args.threads, "quick": args.quick,
           "batch": args.batch, "prompt_tokens": args.prompt, "new_tokens": args.new, "peft_new_tokens": args.peft_new,
           "bandwidth_bytes_s": bandwidth, "matmul_flop_s": matmul_rate, "load_average": load_avg,
           "cpus": os.cpu_count(), "machine": platform.platform(), "torch": torch.__version__,
           "elapsed_s": elapsed, "batch_rows": rows, "stream": zipf}
    dest = RESULTS / "engine_lora.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2))
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
