"""One projection matmul per base-weights format: float32, bfloat16, int8 and int4 blocks.

The demo model's fused projection shapes (SmolLM2-135M: q|k|v 960x576, o 576x576, gate|up
3072x576, down 576x1536) with random weights, at 1, 32 and 256 rows, each through the layer
class the engine builds for the format (``engine.linear.make_linear``: oneDNN-prepacked float32,
bfloat16 on the native tile kernel where the CPU has AMX or AVX512-BF16, else oneDNN-prepacked,
the native gemv for one row, the native 8-bit and 4-bit kernels), plus oneDNN's prepacked
bfloat16 matmul beside the tile kernel. Median of repeated calls after a warm-up; the ratio is
float32's time over the format's. float32 runs as the engine runs it: on the native panel kernel on
AVX2 CPUs without AVX-512.

Then each format's matmul-only ceiling for ``serve_vs_vllm.py``'s base-only cases: the tokens/s a
server would reach if a step did nothing but the projections (``LAYERS`` layers) and the LM head,
at the best per-row rate measured over the row counts of at least 32, with the weights in cache
(an upper bound: attention, norms, sampling and the weights' trips from memory come on top). A
prompt-heavy token (100-token prompt, 64 new) takes (100 + 64) / 64 rows through the layers and
one through the LM head, a decode-heavy one (16, 256) 272 / 256 and one. Where
``bench/results/serve_vs_vllm.json`` holds vLLM's tokens/s for those cases, the ceiling is shown
over it: below 2.0, a format cannot serve twice vLLM's rate on this CPU.

Last, the multiply units' own peak (``bench/peak.c``: the instruction each format's kernel
multiplies with, float32 FMA, AVX512-BF16's pair dot product, AVX512-VNNI's 8-bit one, looped on
registers alone on every thread), each format's best projection rate as a share of it, and the
base-only cases' tokens/s if every multiply ran at that peak and nothing else ran: a bound no
kernel can pass on this CPU (none where the CPU lacks the instruction, or on AMX, whose tiles the
probe does not drive).

Prints the tables and writes ``bench/results/block_matmul.json``.

    python bench/block_matmul.py [--threads 2] [--rows 1,32,256] [--min-time 0.2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import peak
import torch
from serve_vs_vllm import LOADS

from engine.linear import BF16Linear, make_linear
from engine.native import (
    gemv_kernel,
    panel_matmul_kernel,
    q4_matmul_kernel,
    q8_matmul_kernel,
    tile_matmul_kernel,
)
from engine.quant import pack_q4, pack_q8, quantize_q4, quantize_q8

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
"""(out, in) of the demo model's fused projections and its LM head."""
LAYERS = 30
"""The demo model's decoder layers."""
BASE_CASES = {f"{load}/base": shape for load, shape in LOADS.items()}
"""serve_vs_vllm.py's base-only cases: (prompt tokens, new tokens)."""
FORMATS = ("float32", "bfloat16", "int8", "int4")


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


def layers(w: torch.Tensor, pack_batch: int) -> dict[str, object]:
    """The engine's projection for ``w`` in each format."""
    gemv = gemv_kernel()
    return {
        "float32": make_linear(w, None, torch.float32, pack_batch, gemv, panel=panel_matmul_kernel()),
        "bfloat16": make_linear(w.bfloat16(), None, torch.float32, pack_batch, gemv, tile=tile_matmul_kernel()),
        "bf16-onednn": BF16Linear(w.bfloat16(), None, pack_batch, gemv),
        "int8": make_linear(pack_q8(quantize_q8(w)), None, torch.float32, q8_kernel=q8_matmul_kernel()),
        "int4": make_linear(pack_q4(quantize_q4(w)), None, torch.float32, q4_kernel=q4_matmul_kernel()),
    }


def ceiling(rows: list[dict], fmt: str, prompt: int, new: int) -> float | None:
    """Tokens/s if a step were only matmuls at ``fmt``'s best per-row rate (rows >= 32)."""
    def per_row(names: tuple[str, ...]) -> float | None:
        best = [min((r[f"{fmt}_s"] / r["rows"] for r in rows if r["projection"] == n and r["rows"] >= 32),
                    default=None) for n in names]
        return None if None in best else sum(best)

    layer, head = per_row(("qkv", "o", "gate_up", "down")), per_row(("lm_head",))
    if layer is None or head is None:
        return None
    return 1.0 / (LAYERS * layer * (prompt + new) / new + head)


def vllm_tok_s() -> dict[str, float | None]:
    """vLLM's tokens/s per case in ``bench/results/serve_vs_vllm.json``, where it has them."""
    served = RESULTS / "serve_vs_vllm.json"
    if not served.exists():
        return {}
    return {r["case"]: r.get("vllm_tok_s") for r in json.loads(served.read_text()).get("rows", [])}


def print_ceilings(rows: list[dict], vllm: dict[str, float | None]) -> dict[str, dict[str, float | None]]:
    print("\nmatmul-only ceiling, tokens/s (projections and LM head alone, weights in cache; "
          "over vLLM's tokens/s in bench/results/serve_vs_vllm.json where it has them)")
    print(f"{'case':>18} | " + " | ".join(f"{f:>16}" for f in FORMATS) + f" | {'vLLM tok/s':>10}")
    out: dict[str, dict[str, float | None]] = {}
    for case, (prompt, new) in BASE_CASES.items():
        out[case] = {f: ceiling(rows, f, prompt, new) for f in FORMATS}
        v = vllm.get(case)
        cells = [("-" if c is None else f"{c:.0f}" + (f" ({c / v:.2f}x)" if v else "")) for c in out[case].values()]
        print(f"{case:>18} | " + " | ".join(f"{c:>16}" for c in cells) + f" | {v or '-':>10}")
        out[case]["vllm_tok_s"] = v
    return out


PEAK_KINDS = {"float32": peak.FLOAT32, "bfloat16": peak.BFLOAT16, "int8": peak.INT8, "int4": peak.INT8}
"""``bench/peak.c``'s instruction for each format's kernel (int4's multiplies its unpacked nibbles
as bytes)."""


def unit_peaks(threads: int, bf16_isa: str | None) -> dict[str, float | None]:
    """GFLOP/s of each format's multiply instruction on ``threads`` threads (``bench/peak.c``, built
    as the native kernels are); None where this CPU has no such instruction, and for bfloat16
    where its kernel is not the AVX512-BF16 one."""
    fn = peak.peak_kernel()
    if fn is None:
        return dict.fromkeys(FORMATS)
    out: dict[str, float | None] = {}
    for fmt in FORMATS:
        if fmt == "bfloat16" and bf16_isa != "avx512_bf16":
            out[fmt] = None
            continue
        best = max(fn(PEAK_KINDS[fmt], 20_000_000, threads) for _ in range(3))
        out[fmt] = best if best > 0 else None
    return out


def flops_per_token(prompt: int, new: int) -> float:
    """Multiply FLOP of one generated token: ``(prompt + new) / new`` rows through the layers'
    projections, one through the LM head."""
    layer = sum(n * k for name, (n, k) in SHAPES.items() if name != "lm_head")
    n, k = SHAPES["lm_head"]
    return 2.0 * (LAYERS * layer * (prompt + new) / new + n * k)


def print_peaks(rows: list[dict], peaks: dict[str, float | None],
                vllm: dict[str, float | None]) -> dict[str, dict[str, float | None]]:
    print("\nmultiply units' peak (bench/peak.c), each format's best projection rate (>= 32 rows) against it, "
          "and tokens/s with every multiply at that peak and nothing else")
    print(f"{'format':>9} | {'peak GFLOP/s':>12} | {'best GFLOP/s':>12} | {'of peak':>7} | "
          + " | ".join(f"{c:>24}" for c in BASE_CASES))
    out: dict[str, dict[str, float | None]] = {}
    for fmt in FORMATS:
        best = max((2 * r["rows"] * r["out"] * r["in"] / r[f"{fmt}_s"] / 1e9 for r in rows if r["rows"] >= 32),
                   default=None)
        peak = peaks.get(fmt)
        bounds = {case: (peak * 1e9 / flops_per_token(*load) if peak else None) for case, load in BASE_CASES.items()}
        cells = [("-" if b is None else f"{b:.0f}" + (f" ({b / vllm[c]:.2f}x vLLM)" if vllm.get(c) else ""))
                 for c, b in bounds.items()]
        share = f"{best / peak:.0%}" if peak and best else "-"
        print(f"{fmt:>9} | {f'{peak:.0f}' if peak else '-':>12} | {f'{best:.0f}' if best else '-':>12} | {share:>7} | "
              + " | ".join(f"{c:>24}" for c in cells))
        out[fmt] = {"peak_gflops": peak, "best_gflops": best, **{f"{c}_tok_s_at_peak": b for c, b in bounds.items()}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,32,256")
    ap.add_argument("--min-time", type=float, default=0.2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert q4_matmul_kernel() is not None and q8_matmul_kernel() is not None, "the native kernels build"
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    out = []
    tile = tile_matmul_kernel()
    print(f"bfloat16: {'the ' + tile.isa + ' tile kernel' if tile else 'oneDNN (no native bfloat16 kernel here)'}")
    print(f"{'proj':>8} | {'rows':>4} | {'float32 us':>10} | {'bf16 us':>8} | {'onednn bf16 us':>14} | {'int8 us':>8} | "
          f"{'int4 us':>8} | {'bf16 x':>6} | {'int8 x':>6} | {'int4 x':>6}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=gen) * 0.05
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            lin = layers(w, max(m, 2))
            with torch.inference_mode():
                t = {fmt: timeit(lambda f=f, x=x: f(x), args.min_time) for fmt, f in lin.items()}
            row = {"projection": name, "out": n, "in": k, "rows": m, **{f"{f}_s": s for f, s in t.items()}}
            out.append(row)
            ref = t["float32"]
            print(f"{name:>8} | {m:>4} | {ref * 1e6:>10.1f} | {t['bfloat16'] * 1e6:>8.1f} | "
                  f"{t['bf16-onednn'] * 1e6:>14.1f} | {t['int8'] * 1e6:>8.1f} | "
                  f"{t['int4'] * 1e6:>8.1f} | {ref / t['bfloat16']:>6.2f} | {ref / t['int8']:>6.2f} | "
                  f"{ref / t['int4']:>6.2f}", flush=True)
    vllm = vllm_tok_s()
    ceilings = print_ceilings(out, vllm)
    peaks = print_peaks(out, unit_peaks(args.threads, tile.isa if tile else None), vllm)
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
            "bf16_kernel": tile.isa if tile else "onednn",
            "load_average": os.getloadavg()}
    (RESULTS / "block_matmul.json").write_text(json.dumps({"machine": meta, "args": vars(args), "matmuls": out,
                                                           "ceilings": ceilings, "peaks": peaks,
                                                           "time": time.time()}, indent=2))
    print(f"wrote {RESULTS / 'block_matmul.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
