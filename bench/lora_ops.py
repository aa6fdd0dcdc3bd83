"""Batched LoRA op on CPU: segmented vs padded-bmm vs the C kernel vs a per-row loop.

Demo-model shapes (SmolLM2-135M: hidden 576, intermediate 1536, 9 heads, 3 kv heads,
head_dim 64), rank 16, float32. For each (tokens, distinct adapters, layout) the time of
one op call is averaged over the seven projections; the base projection GEMM
(``x @ W.T``) on the same tokens is the baseline column. ``layout``: ``interleaved``
(token i uses adapter i mod n: decode batches) or ``contiguous`` (each adapter's tokens
in one range: prefill). Stacks hold max(8, adapters) slots (``max_loras`` = 8 per class).
``pick`` is the path ``engine.lora.ops.choose_path`` dispatches to, ``best`` the fastest.

A second table times a whole step's projections (30 layers x 7) through
``LoRABatch.apply`` (slots from a ``SlotBank``) next to the same step's base GEMMs: the
LoRA overhead of a mixed-adapter batch relative to base-only.

    python bench/lora_ops.py [--threads 2,1] [--min-time 0.05]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from engine.lora.ops import (
    PADDED_MAX_TOKENS_PER_ADAPTER,
    PADDED_MIN_ADAPTERS,
    SegmentPlan,
    choose_path,
    lora_native,
    lora_padded,
    lora_reference,
    lora_segmented,
    native_max_tokens,
    native_usable,
)
from loraplex.modelinfo import PROJECTIONS, ModelInfo

DEMO = ModelInfo(name="smollm2-135m", revision="-", architecture="llama", hidden_size=576,
                 intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                 vocab_size=49152, context_length=8192)


def timeit(fn, min_time: float) -> float:
    """Median seconds per call (robust to the descheduling a shared machine causes)."""
    fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 5 or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run_table(stacks: dict, r: int, threads: int, min_time: float, g: torch.Generator) -> list[dict]:
    rows: list[dict] = []
    seen: set[tuple[int, int, str]] = set()
    native = native_usable(torch.empty(0))
    header = (f"{'tokens':>6} {'adapters':>8} {'layout':>11} | {'base mm':>9} {'segmented':>9} "
              f"{'padded':>9} {'native':>9} {'loop':>9} | {'pick':>9} {'best':>9} {'pick/base':>9}")
    print(f"LoRA op per projection (mean of 7), rank {r}, float32, {threads} threads, median times in us")
    print(header)
    print("-" * len(header))
    for tokens in (1, 8, 32, 128):
        for n_adapters in (1, 8, 32):
            distinct = min(tokens, n_adapters)
            layouts = ["interleaved"] if distinct in (1, tokens) else ["interleaved", "contiguous"]
            for layout in layouts:
                if (tokens, distinct, layout) in seen:
                    continue
                seen.add((tokens, distinct, layout))
                if layout == "interleaved":
                    slots = torch.arange(tokens) % distinct
                else:
                    slots = torch.sort(torch.arange(tokens) % distinct).values
                plan = SegmentPlan.build(slots)
                t = {"base": 0.0, "segmented": 0.0, "padded": 0.0, "native": 0.0, "loop": 0.0}
                cap = max(8, distinct)  # a bank of max_loras=8 slots per class, grown for 32 adapters
                for p in PROJECTIONS:
                    a, b, sc, w = stacks[p]
                    a, b, sc = a[:cap], b[:cap], sc[:cap]
                    x = torch.randn(tokens, w.shape[1], generator=g)
                    y = torch.zeros(tokens, w.shape[0])
                    t["base"] += timeit(partial(torch.mm, x, w.T), min_time)
                    t["segmented"] += timeit(partial(lora_segmented, y, x, a, b, sc, plan), min_time)
                    t["padded"] += timeit(partial(lora_padded, y, x, a, b, sc, plan), min_time)
                    if native:
                        t["native"] += timeit(partial(lora_native, y, x, a, b, sc, plan), min_time)
                    t["loop"] += timeit(partial(lora_reference, y, x, a, b, sc, slots), min_time)
                us = {k: v / len(PROJECTIONS) * 1e6 for k, v in t.items()}
                pick = choose_path(plan, cap, native=native, native_max=native_max_tokens(r))
                candidates = ("segmented", "padded", "native") if native else ("segmented", "padded")
                best = min(candidates, key=lambda k: us[k])
                row = {"threads": threads, "tokens": tokens, "adapters": n_adapters, "distinct": distinct, "layout": layout,
                       "base_mm_us": us["base"], "segmented_us": us["segmented"],
                       "padded_us": us["padded"], "native_us": us["native"] if native else None,
                       "loop_us": us["loop"], "pick": pick, "best": best,
                       "pick_over_best": us[pick] / us[best]}
                rows.append(row)
                print(f"{tokens:>6} {distinct:>8} {layout:>11} | {us['base']:>9.1f} "
                      f"{us['segmented']:>9.1f} {us['padded']:>9.1f} {us['native']:>9.1f} {us['loop']:>9.1f} | "
                      f"{pick:>9} {best:>9} "
                      f"{us[pick] / us['base']:>9.2f}")
    return rows


def run_step_table(r: int, threads: int, min_time: float, g: torch.Generator) -> list[dict]:
    from engine.lora.batch import LoRABatch
    from engine.lora.peft import LoRAModule, LoRAWeights
    from engine.lora.slots import SlotBank

    layers = DEMO.num_layers
    bank = SlotBank.for_model(DEMO, (r,), slots_per_class=8)
    for slot in range(8):
        mods = {}
        for layer in range(layers):
            for p in PROJECTIONS:
                fin, fout = DEMO.projection_shape(p)
                mods[(layer, p)] = LoRAModule(torch.randn(r, fin, generator=g) * 0.05,
                                              torch.randn(fout, r, generator=g) * 0.05, 2.0)
        bank.write(slot, LoRAWeights(mods, r))
    weights = {p: torch.randn(DEMO.projection_shape(p)[1], DEMO.projection_shape(p)[0], generator=g) * 0.05
               for p in PROJECTIONS}
    print(f"\nwhole step: {layers} layers x 7 projections, rank {r}, {threads} threads, median ms")
    header = f"{'step':>22} | {'base GEMMs':>10} {'LoRA':>9} {'LoRA/base':>9} {'seg only':>9} {'seg/base':>9}"
    print(header)
    print("-" * len(header))
    rows = []
    shapes = [("decode 8 seqs, 8 ad.", 8, 8, False), ("decode 32 seqs, 8 ad.", 32, 8, False),
              ("prefill 128 tok, 1 ad.", 128, 1, True), ("prefill 128 tok, 4 ad.", 128, 4, True)]
    for label, tokens, n_ad, contiguous in shapes:
        slots = torch.arange(tokens) % n_ad
        if contiguous:
            slots = torch.sort(slots).values
        batch = LoRABatch.build(bank, slots)
        seg_batch = LoRABatch.build(bank, slots, path="segmented")
        xs = {p: torch.randn(tokens, DEMO.projection_shape(p)[0], generator=g) for p in PROJECTIONS}
        outs = {p: torch.zeros(tokens, DEMO.projection_shape(p)[1]) for p in PROJECTIONS}

        def base(xs=xs) -> None:
            for _layer in range(layers):
                for p in PROJECTIONS:
                    torch.mm(xs[p], weights[p].T)

        def lora(batch=batch, xs=xs, outs=outs) -> None:
            for layer in range(layers):
                for p in PROJECTIONS:
                    batch.apply(layer, p, xs[p], outs[p])

        tb, tl = timeit(base, min_time) * 1e3, timeit(lora, min_time) * 1e3
        ts = timeit(partial(lora, batch=seg_batch), min_time) * 1e3
        rows.append({"threads": threads, "step": label, "tokens": tokens, "adapters": n_ad,
                     "base_ms": tb, "lora_ms": tl, "lora_over_base": tl / tb,
                     "segmented_only_ms": ts})
        print(f"{label:>22} | {tb:>10.2f} {tl:>9.2f} {tl / tb:>9.2f} {ts:>9.2f} {ts / tb:>9.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="2,1", help="comma-separated torch thread counts, one table each")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--min-time", type=float, default=0.05)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "lora_ops.json"))
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    r, max_slots = args.rank, 32
    stacks = {}
    for p in PROJECTIONS:
        fin, fout = DEMO.projection_shape(p)
        # B as SlotBank stores it: the transposed view of a contiguous [slots, r, out] block.
        stacks[p] = (torch.randn(max_slots, r, fin, generator=g) * 0.05,
                     (torch.randn(max_slots, r, fout, generator=g) * 0.05).transpose(1, 2),
                     torch.rand(max_slots, generator=g) + 0.5,
                     torch.randn(fout, fin, generator=g) * 0.05)
    rows: list[dict] = []
    steps: list[dict] = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        rows += run_table(stacks, r, threads, args.min_time, g)
        steps += run_step_table(r, threads, args.min_time, g)
    worst = max(rows, key=lambda row: row["pick_over_best"])
    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (other work shares this machine)")
    limit = native_max_tokens(r)
    print(f"heuristic (engine.lora.ops.choose_path): native (C kernel, when built) for segments of "
          f"{'any length' if limit is None else f'<= {limit} tokens'}; padded when >= {PADDED_MIN_ADAPTERS} adapters, "
          f"segments <= {PADDED_MAX_TOKENS_PER_ADAPTER} tokens and padding <= 2x; else segmented")
    print(f"worst pick/best ratio {worst['pick_over_best']:.2f} (threads {worst['threads']}, tokens "
          f"{worst['tokens']}, adapters {worst['distinct']}, {worst['layout']})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "bench": "lora_ops", "rank": r, "threads": args.threads, "dtype": "float32",
        "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
        "loadavg_at_end": os.getloadavg(), "shapes": DEMO.to_dict(),
        "rows": rows, "steps": steps,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
