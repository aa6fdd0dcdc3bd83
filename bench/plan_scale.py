"""How fast ``loraplex plan`` reads and replays an internet-scale trace.

Writes a synthetic access log (``--requests`` requests, Zipf(``--zipf``) over ``--adapters``
adapters, served by ``--workers`` workers on the gateway's ring, one JSON line per request
exactly as a gateway writes it), then times ``loraplex plan`` on it, reading and replaying
apart, and prints a table and writes JSON to ``bench/results/plan_scale.json``.

    python bench/plan_scale.py                 # 10 million requests over 100k adapters
    python bench/plan_scale.py --requests 1000000 --adapters 10000
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson

RESULTS = Path(__file__).resolve().parent / "results"


def write_log(path: Path, requests: int, adapters: int, zipf: float, workers: int, seed: int) -> None:
    from gateway.router import Router

    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, adapters + 1) ** zipf
    picks = rng.permutation(adapters)[rng.choice(adapters, size=requests, p=p / p.sum())]
    ids = [f"worker-{k}" for k in range(1, workers + 1)]
    router = Router(None, candidates=1, static_urls=tuple(ids))
    names = [f"tenant-{i % 5000}-fine-tune-{i}@1" for i in range(adapters)]
    home = [router.candidates("", n)[0] for n in names]
    t = 1_765_000_000.0 + np.cumsum(rng.exponential(0.001, size=requests))
    lat = rng.uniform(50, 900, size=requests)
    with open(path, "wb") as fh:
        buf = []
        for i in range(requests):
            a = int(picks[i])
            buf.append(orjson.dumps({
                "ts": round(float(t[i] + lat[i] / 1000), 3), "request_id": f"r{i:x}", "tenant": f"tenant-{a % 5000}",
                "alias": "support", "adapter": names[a], "worker": home[a], "prompt_tokens": 300,
                "completion_tokens": 60, "status": 200, "latency_ms": round(float(lat[i]), 3), "stream": False,
                "route": "chat"}))
            if len(buf) == 100_000:
                fh.write(b"\n".join(buf) + b"\n")
                buf = []
        if buf:
            fh.write(b"\n".join(buf) + b"\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000_000)
    ap.add_argument("--adapters", type=int, default=100_000)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--log", default=str(RESULTS / "plan_scale.log"))
    ap.add_argument("--plan-args", default="", help="extra arguments for loraplex plan")
    ap.add_argument("--reuse", action="store_true", help="keep the log of an earlier run with the same arguments")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    log = Path(args.log)
    stamp = log.with_suffix(".args")
    same = f"{args.requests} {args.adapters} {args.zipf} {args.workers}"
    if not (args.reuse and log.exists() and stamp.exists() and stamp.read_text() == same):
        t0 = time.perf_counter()
        write_log(log, args.requests, args.adapters, args.zipf, args.workers, seed=0)
        stamp.write_text(same)
        print(f"wrote {log} ({log.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", flush=True)
    cmd = [str(Path(sys.executable).parent / "loraplex"), "plan", str(log), "--json", *args.plan_args.split()]
    t1 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    total = time.perf_counter() - t1
    if run.returncode:
        print(run.stderr, file=sys.stderr)
        return 1
    plan = json.loads(run.stdout)
    read = float(re.search(r"requests from .* in ([\d.]+) s", run.stderr).group(1))
    replayed = float(re.search(r"replayed in ([\d.]+) s", run.stderr).group(1))
    fleets = len(plan["load"])
    sizes = len({r["max_loras"] for r in plan["device_slots"]} | {r["max_cpu_loras"] for r in plan["host_cache"]})
    out = {"requests": args.requests, "adapters": args.adapters, "zipf": args.zipf, "workers": args.workers,
           "read_s": read, "replay_s": replayed, "total_s": round(total, 1), "worker_counts": fleets, "sizes": sizes,
           "fitted_zipf": plan["zipf_exponent"], "recommendation": plan["recommendation"],
           "cpus": os.cpu_count()}
    print(f"| requests | adapters | read s | replay s ({fleets} worker counts x {sizes} sizes) | plan total s "
          "| fitted Zipf |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.requests:,} | {args.adapters:,} | {read:.1f} | {replayed:.1f} | {total:.1f} | "
          f"{plan['zipf_exponent']:.3f} (true {args.zipf}) |")
    (RESULTS / "plan_scale.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
