"""Where the gateway's CPU goes: py-spy on this tree's gateway (and ``--baseline REF``'s) under
the non-streamed concurrency-16 load of ``bench/gateway_overhead.py``, samples grouped by part.

Each run starts a gateway with its stub worker and registry (as ``gateway_overhead.py`` does),
samples it with ``py-spy record --format raw`` while the load runs, and measures its CPU per
request over the same load. A sample goes to the part of its innermost frame that belongs to
one (socket writes by their leaf function); the table spreads each side's measured CPU per
request over its parts. Needs py-spy (``pip install py-spy``, not a project dependency) and
the right to trace the gateway process.

    python bench/gateway_profile.py [--baseline 4946e5a] [--runs 2] [--seconds 6]
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import gateway_overhead as g

WRITES = {"StepWrites.flush", "GatewayHttpProtocol.flush", "RespConnection.push", "StreamWriter.write",
          "StreamWriter.writelines", "StreamWriter._writelines", "StreamWriter._write"}
"""Leaf functions whose samples are the send system call (this tree's and older trees')."""
WRITE_LINES = {f"gateway/worker_client.py:{i}" for i, line in
               enumerate((Path(__file__).resolve().parent.parent / "gateway" / "worker_client.py").read_text()
                         .splitlines(), 1) if ".transport.write(" in line}
"""Lines of this tree's worker client that make the send system call from Python (no leaf function)."""
PARTS = [
    ("worker client (Python)", ("/aiohttp/", "/multidict/", "/yarl/", "/gateway/worker_client.py",
                                "/gateway/transport.py")),
    ("HTTP server + edge (Python)", ("/uvicorn/", "/httptools/", "/gateway/http_edge.py", "/gateway/server.py")),
    ("limiter + Redis client (Python)", ("/redis/", "/gateway/ratelimit.py", "/gateway/resp.py")),
    ("event loop (uvloop C, epoll, reads)", ("/asyncio/runners.py",)),
    ("request path (app code)", ("/gateway/", "/loraplex/", "/registry/")),
]
FRAME = re.compile(r"^(.*) \((.*?):\d+\)$")


def part_of(frames: list[str]) -> str:
    leaf = FRAME.match(frames[-1])
    if leaf and (leaf.group(1) in WRITES or any(frames[-1].endswith(f"{w})") for w in WRITE_LINES)):
        return "socket writes (send syscalls)"
    for frame in reversed(frames):
        m = FRAME.match(frame)
        path = "/" + m.group(2) if m else ""
        for part, keys in PARTS:
            if any(k in path for k in keys):
                return part
    return "other"


def profile(tree: Path, tmp: Path, name: str, seconds: float, out: Path) -> tuple[float, collections.Counter]:
    """One gateway under c16 load: its CPU ms per request and its samples by part."""
    side = g.start_loraplex(name, "now", tree, tmp, secret_check=tree == g.ROOT, access_log=True)
    try:
        g.warm_up(side, False, 1.0)
        spy = subprocess.Popen([shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record",
                                "--pid", str(side.proc.pid), "--format", "raw", "--rate", "250", "--nonblocking",
                                "--duration", str(int(seconds + 2)), "-o", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        c0 = g.tree_cpu_seconds(side.proc.pid)
        load = g.run_load(side.port, side.via[False], False, 16, seconds, 2)
        cpu_ms = 1000 * (g.tree_cpu_seconds(side.proc.pid) - c0) / max(1, load["requests"])
        if spy.wait() != 0 or not out.exists():
            raise RuntimeError("py-spy failed (installed? allowed to trace the process?)")
    finally:
        side.close()
    parts: collections.Counter = collections.Counter()
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack:
            parts[part_of(stack.split(";"))] += int(n)
    print(f"  {name}: {load['rps']:.0f} req/s, {cpu_ms:.3f} ms CPU/req, {sum(parts.values())} samples", flush=True)
    return cpu_ms, parts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="", help="git ref whose gateway is profiled beside this tree's")
    ap.add_argument("--runs", type=int, default=2, help="runs per side, in alternation")
    ap.add_argument("--seconds", type=float, default=6.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="loraplex-profile-"))
    try:
        trees = {"this tree": g.ROOT}
        if args.baseline:
            ref = subprocess.run(["git", "-C", str(g.ROOT), "rev-parse", "--short", args.baseline], check=True,
                                 capture_output=True, text=True).stdout.strip()
            trees[ref] = g.export_tree(ref, tmp / f"tree-{ref}")
        cpu: dict[str, list[float]] = {name: [] for name in trees}
        samples: dict[str, collections.Counter] = {name: collections.Counter() for name in trees}
        for run in range(args.runs):
            for name, tree in trees.items():
                ms, parts = profile(tree, tmp, f"{name} run {run + 1}", args.seconds,
                                    tmp / f"{name}-{run}.txt".replace(" ", "-"))
                cpu[name].append(ms)
                samples[name] += parts
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    names = list(trees)
    order = sorted({p for c in samples.values() for p in c}, key=lambda p: -samples[names[0]][p])
    print(f"\n{'part':<38}" + "".join(f" | {n:>16}" for n in names))
    for part in order:
        row = f"{part:<38}"
        for n in names:
            total = sum(samples[n].values()) or 1
            share = samples[n][part] / total
            row += f" | {100 * share:5.1f}% {1000 * share * sum(cpu[n]) / len(cpu[n]):6.1f} us"
        print(row)
    print(f"{'total CPU per request':<38}" + "".join(f" | {'':>6} {1000 * sum(cpu[n]) / len(cpu[n]):6.1f} us"
                                                    for n in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
