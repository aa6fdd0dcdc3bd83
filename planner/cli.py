"""``loraplex plan``: how many workers, device slots and host-cache adapters a fleet needs,
from its own traffic.

    loraplex plan gateway-*.log                       # the whole logs, sizes around today's
    loraplex plan g.log --last 1h --workers 2,4,8 --max-cpu-loras 64,256,1024 --target-cold 0.005
    loraplex plan g.log --json > plan.json --plot plan.svg
    loraplex plan g.log --kv-tokens 5824,65536     # prefix reuse, for logs whose records name prefixes
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from datetime import datetime
from typing import Any

import numpy as np

from loraplex.settings import Settings
from planner.prefixes import default_sizes, prefix_keys
from planner.replay import replay
from planner.report import plan
from planner.trace import Trace, TraceError, read_trace

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _sizes(text: str) -> list[int]:
    try:
        out = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of whole numbers: {text!r}") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"sizes must be 1 or more: {text!r}")
    return out


def _when(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time (unix seconds or ISO 8601): {text!r}") from None
    return dt.timestamp()


def _duration(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration (like 90s, 30m, 2h, 1d): {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def _share(text: str) -> float:
    v = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"a share is between 0 and 1 (or 0% and 100%): {text!r}")
    return v


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="size the fleet (workers, device slots, host cache) from access logs",
                              description=" ".join(__doc__.splitlines()[:2]).replace("``", ""),
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("logs", nargs="+", help="gateway access logs (JSON lines; other lines are skipped)")
    p.add_argument("--since", type=_when, help="only requests that started at or after (unix seconds or ISO 8601)")
    p.add_argument("--until", type=_when, help="only requests that started before")
    p.add_argument("--last", type=_duration, help="only the last DURATION of the logs (90s, 30m, 2h, 1d)")
    p.add_argument("--workers", type=_sizes, help="worker counts to try (default: the logs' own, half, double)")
    p.add_argument("--max-loras", type=_sizes, help="device slots per worker to try (default: around "
                   "LORAPLEX_MAX_LORAS)")
    p.add_argument("--max-cpu-loras", type=_sizes, help="host-cache adapters per worker to try (default: "
                   "16, 64, 256, ... until one worker holds every adapter seen, and LORAPLEX_MAX_CPU_LORAS)")
    p.add_argument("--target-cold", type=_share, default=0.01,
                   help="most requests that may wait for an adapter load (default 0.01, 1%%)")
    p.add_argument("--target-slot-miss", type=_share, default=0.10,
                   help="most requests whose adapter may need a slot copy (default 0.10)")
    p.add_argument("--worker-tokens-per-s", type=float, metavar="N",
                   help="tokens/s one worker sustains (from a load test such as bench/serve_vs_vllm.py): "
                   "advise only fleets whose busiest worker stays within it at the busiest minute")
    p.add_argument("--kv-tokens", type=_sizes, help="tokens one worker's KV pool holds, for the prefix cache's "
                   "replay (the worker's start-up line says it; default: 4096 and x4 steps until one pool holds "
                   "every prefix); used only when records name prefixes (prefix_id, prefix_tokens)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE.svg", help="write hit ratio against size as an SVG chart")
    p.add_argument("--jobs", type=int, default=None, help="processes to read and replay with (default: CPUs)")
    p.set_defaults(handler=run)


def _defaults(args: argparse.Namespace, trace: Trace, settings: Settings) -> None:
    seen = max(1, len(trace.workers))
    if args.workers is None:
        args.workers = sorted({max(1, seen // 2), seen, seen * 2})
    ml = settings.max_loras
    if args.max_loras is None:
        args.max_loras = sorted({max(1, ml // 2), ml, ml * 2, ml * 4})
    if args.max_cpu_loras is None:  # x4 steps from 16 until one worker of the smallest fleet holds them all
        distinct = int(np.unique(trace.adapter[trace.adapter >= 0]).size)
        sizes, c = {settings.max_cpu_loras}, 16
        while True:
            sizes.add(c)
            if c * min(args.workers) >= distinct:
                break
            c *= 4
        args.max_cpu_loras = sorted(sizes)
    if args.kv_tokens is None and trace.names_prefixes:
        args.kv_tokens = default_sizes(trace, prefix_keys(trace), settings.kv_block_size)


def run(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    t0 = time.perf_counter()

    def say(msg: str) -> None:  # progress on stderr: stdout is the plan (text or JSON)
        print(msg, file=sys.stderr, flush=True)

    try:
        trace = read_trace(args.logs, jobs=args.jobs)
        since = args.since
        if args.last is not None:
            since = max(since or 0.0, float(trace.start[-1]) - args.last)
        if since is not None or args.until is not None:
            trace = trace.window(since, args.until)
            if not len(trace):
                raise TraceError("no request in the window given")
    except (OSError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    say(f"read {len(trace):,} requests from {len(args.logs)} file(s) in {time.perf_counter() - t0:.1f} s "
        f"({trace.skipped:,} other lines skipped)")
    _defaults(args, trace, settings)
    t1 = time.perf_counter()
    last = [0.0]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if now - last[0] > 2.0 or done == total:
            last[0] = now
            say(f"  replayed {done}/{total} tier runs ({now - t1:.1f} s)")

    replayed = replay(trace, args.workers, {"device": args.max_loras, "host": args.max_cpu_loras},
                      jobs=args.jobs, progress=progress, kv_tokens=args.kv_tokens, block=settings.kv_block_size)
    result = plan(trace, replayed, target_cold=args.target_cold, target_slot_miss=args.target_slot_miss,
                  current={"workers": len(trace.workers), "max_loras": settings.max_loras,
                           "max_cpu_loras": settings.max_cpu_loras}, worker_tokens_per_s=args.worker_tokens_per_s)
    say(f"replayed in {time.perf_counter() - t1:.1f} s")
    if args.plot:
        with open(args.plot, "w", encoding="utf-8") as fh:
            fh.write(result.svg())
        say(f"wrote {args.plot}")
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(result.text())
    return 0
