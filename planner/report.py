"""What ``loraplex plan`` says: the per-size table, the recommendation, JSON and an SVG plot."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planner.prefixes import PrefixResult
from planner.replay import Load, Replayed, TierResult
from planner.trace import Trace
from planner.zipf import fit_zipf


@dataclass
class Plan:
    trace: dict[str, Any]
    zipf_s: float
    device: list[TierResult]
    host: list[TierResult]
    span_s: float
    target_cold: float
    target_slot_miss: float
    current: dict[str, int]
    load: list[Load]
    worker_tokens_per_s: float | None = None
    """What one worker sustains (tokens/s); fleets whose busiest worker needs more are not advised."""
    prefix: list[PrefixResult] = field(default_factory=list)
    """The prefix caches' replay (empty when the trace names no prefix)."""

    def _carries(self, workers: int) -> bool:
        if self.worker_tokens_per_s is None:
            return True
        return all(x.computed <= self.worker_tokens_per_s for x in self.load if x.workers == workers)

    def recommendation(self) -> dict[str, Any]:
        """The smallest fleet (fewest workers, then the smallest host cache) whose cold-start
        share is within ``target_cold`` and whose busiest worker stays within
        ``worker_tokens_per_s`` (when given); then the fewest device slots whose slot-miss share is
        within ``target_slot_miss`` for that many workers (else the most the sweep tried).

        A target below the floor (the share of requests that are an adapter's first in the logs:
        cold with any size) is said as such, with the smallest fleet at the fewest cold starts tried."""
        if not any(self._carries(x.workers) for x in self.load):
            most = max(self.load, key=lambda x: x.workers)
            return {"met": False, "workers": most.workers,
                    "why": f"no worker count tried carries the load: with {_n(most.workers, 'worker')} the busiest "
                           f"worker needs {most.computed:,.0f} tokens/s at the busiest minute, over the "
                           f"{self.worker_tokens_per_s:,.0f} given; try more --workers"}
        floor = float(self.trace.get("first_use_share", 0.0))
        if self.target_cold < floor:
            fewest = min(1.0 - r.hit_ratio for r in self.host if self._carries(r.workers))
            rec = self._pick(fewest)
            rec.update(met=False, floor=floor,
                       why=f"the target {self.target_cold:.1%} is below the floor of {floor:.2%}: that share of "
                           "requests are an adapter's first in the logs, a cold start no size avoids (a longer "
                           f"window makes it smaller); this is the smallest fleet at the fewest cold starts tried, "
                           f"{fewest:.2%}")
            return rec
        return self._pick(self.target_cold)

    def _pick(self, target_cold: float) -> dict[str, Any]:
        ok = [r for r in self.host if 1.0 - r.hit_ratio <= target_cold and self._carries(r.workers)]
        if not ok:
            best = max((r for r in self.host if self._carries(r.workers)),
                       key=lambda r: (r.hit_ratio, -r.workers, -r.capacity))
            return {"met": False, "workers": best.workers, "max_cpu_loras": best.capacity,
                    "cold_share": round(1.0 - best.hit_ratio, 4),
                    "why": f"no size tried keeps cold starts within {target_cold:.1%}: the best is "
                           f"{1.0 - best.hit_ratio:.2%} ({_n(best.workers, 'worker')}, max_cpu_loras "
                           f"{best.capacity}); try more workers or larger --max-cpu-loras"}
        pick = min(ok, key=lambda r: (r.workers, r.capacity))
        slots = sorted((r for r in self.device if r.workers == pick.workers), key=lambda r: r.capacity)
        fit = [r for r in slots if 1.0 - r.hit_ratio <= self.target_slot_miss]
        dev = fit[0] if fit else slots[-1]
        return {"met": True, "workers": pick.workers, "max_cpu_loras": pick.capacity, "max_loras": dev.capacity,
                "cold_share": round(1.0 - pick.hit_ratio, 4), "slot_miss_share": round(1.0 - dev.hit_ratio, 4),
                "loads_per_s_per_worker": round(self._per_worker_s(pick), 4),
                "why": f"the fewest workers{' that carry the peak load' if self.worker_tokens_per_s else ''} "
                       f"and smallest host cache that keep cold starts within "
                       f"{target_cold:.1%}; the fewest slots with slot misses within {self.target_slot_miss:.0%}"
                       + ("" if fit else " (none reached it: the largest tried)")}

    def _per_worker_s(self, r: TierResult) -> float:
        return (r.requests - r.hits) / self.span_s / r.workers

    def rows(self, tier: str) -> list[dict[str, Any]]:
        out = []
        for r in self.device if tier == "device" else self.host:
            out.append({"workers": r.workers, ("max_loras" if tier == "device" else "max_cpu_loras"): r.capacity,
                        "hit_ratio": round(r.hit_ratio, 4), "miss_share": round(1.0 - r.hit_ratio, 4),
                        "loads_per_s_per_worker": round(self._per_worker_s(r), 4),
                        "loads_per_s_busiest_worker": round(r.misses_max_worker / self.span_s, 4),
                        "replayed": r.sampled})
        return out

    def to_json(self) -> dict[str, Any]:
        return {"trace": self.trace, "zipf_exponent": self.zipf_s, "current": self.current,
                "targets": {"cold_share": self.target_cold, "slot_miss_share": self.target_slot_miss},
                "worker_tokens_per_s": self.worker_tokens_per_s,
                "load": [{"workers": x.workers, "peak_tokens_per_s": x.peak_tokens_per_s,
                          "peak_computed_tokens_per_s": x.computed,
                          "peak_requests_per_s": x.peak_requests_per_s} for x in self.load],
                "prefix_cache": [{"workers": r.workers, "kv_tokens": r.kv_tokens, "hit_ratio": round(r.hit_ratio, 4),
                                  "cached_tokens": r.cached_tokens, "prompt_tokens": r.prompt_tokens}
                                 for r in self.prefix],
                "device_slots": self.rows("device"), "host_cache": self.rows("host"),
                "recommendation": self.recommendation()}

    def text(self) -> str:
        t = self.trace
        lines = [f"trace: {t['requests']:,} requests ({t['adapter_requests']:,} on adapters, "
                 f"{t['distinct_adapters']:,} adapters) over {t['span_s']:,.0f} s "
                 f"({t['requests_per_s']:,.1f} req/s) on {_n(t['workers'], 'worker')}; "
                 f"Zipf exponent {self.zipf_s:.2f}",
                 f"first uses: {t['first_use_share']:.2%} of adapter requests are an adapter's first in the "
                 "trace, a cold start no size avoids (a longer window makes it smaller)",
                 "busiest worker at the busiest minute: " + ", ".join(
                     f"{x.peak_tokens_per_s:,.0f} tokens/s ({x.peak_requests_per_s:,.1f} req/s) with {_n(x.workers, 'worker')}"
                     + ("" if x.peak_computed_tokens_per_s is None else f" ({x.computed:,.0f} computed)")
                     for x in self.load)
                 + (f"; one worker sustains {self.worker_tokens_per_s:,.0f}" if self.worker_tokens_per_s else ""),
                 ""]
        lines += self._prefix_text()
        lines.append("host cache (max_cpu_loras): hit ratio | cold starts | loads/s per worker (busiest)")
        lines += _table(self.host, self._per_worker_s, self.span_s)
        lines.append("")
        lines.append("device slots (max_loras): hit ratio | slot misses | slot loads/s per worker (busiest)")
        lines += _table(self.device, self._per_worker_s, self.span_s)
        rec = self.recommendation()
        lines.append("")
        if rec["met"] or "floor" in rec:
            head = "recommendation" if rec["met"] else "recommendation, the target being below the floor"
            lines.append(f"{head}: {_n(rec['workers'], 'worker')}, LORAPLEX_MAX_CPU_LORAS={rec['max_cpu_loras']}, "
                         f"LORAPLEX_MAX_LORAS={rec['max_loras']}: cold starts {rec['cold_share']:.2%} "
                         f"(target {self.target_cold:.1%}), slot misses {rec['slot_miss_share']:.1%}, "
                         f"{rec['loads_per_s_per_worker']:.2f} adapter loads/s per worker")
            lines.append(f"  ({rec['why']})")
        else:
            lines.append(f"recommendation: none met: {rec['why']}")
        return "\n".join(lines)

    def _prefix_text(self) -> list[str]:
        """The prefix reuse the plan assumes: the replay's table, or why it assumes none; and what
        the logs say the serving fleet's caches supplied, where they say it."""
        said = self.trace.get("logged_cached_requests", 0)
        logged = ([f"  (as logged, the fleet's own caches supplied {self.trace['logged_cached_share']:.1%} of the "
                   f"prompt tokens of the {said:,} records that say cached_tokens)"] if said else [])
        if not self.prefix:
            return ["prefix cache: no record names a prefix (prefix_id, prefix_tokens), so no reuse is assumed "
                    "(0.0% of prompt tokens cached)", *logged, ""]
        sizes = sorted({r.kv_tokens for r in self.prefix})
        fleets = sorted({r.workers for r in self.prefix})
        by = {(r.workers, r.kv_tokens): r for r in self.prefix}
        named = self.trace.get("prefix_requests", 0)
        out = [f"prefix cache (KV tokens per worker): prompt tokens served from cache, assumed from the "
               f"{named:,} records that name a prefix; computed load at {sizes[0]:,} KV tokens",
               f"  {'tokens':>9} " + "".join(f"| {_n(w, 'worker'):^11} " for w in fleets)]
        for s in sizes:
            out.append(f"  {s:>9,} " + "".join(f"| {by[(w, s)].hit_ratio:11.1%} " for w in fleets))
        return [*out, *logged, ""]

    def svg(self) -> str:
        return _svg([("host cache: hit ratio by max_cpu_loras", self.host),
                     ("device slots: hit ratio by max_loras", self.device)], self.zipf_s)


def plan(trace: Trace, replayed: Replayed, *, target_cold: float, target_slot_miss: float,
         current: dict[str, int], worker_tokens_per_s: float | None = None) -> Plan:
    mask = trace.adapter >= 0
    counts = np.bincount(trace.adapter[mask], minlength=len(trace.adapters))
    facts = {"requests": len(trace), "adapter_requests": int(mask.sum()), "distinct_adapters": int((counts > 0).sum()),
             "span_s": round(trace.span_s, 3), "requests_per_s": round(len(trace) / trace.span_s, 3),
             "tokens_per_s": round(float(trace.tokens.sum()) / trace.span_s, 1), "workers": len(trace.workers),
             "skipped_lines": trace.skipped,
             "first_use_share": round(int((counts > 0).sum()) / max(1, int(mask.sum())), 4),
             "prompt_tokens": int(trace.prompt.sum()), "prefix_requests": int((trace.prefix >= 0).sum()),
             **_logged_cache(trace),
             "from": float(trace.start[0]), "to": float(trace.start[-1])}
    return Plan(facts, fit_zipf(counts), replayed.device, replayed.host, trace.span_s, target_cold,
                target_slot_miss, current, replayed.load, worker_tokens_per_s, replayed.prefix)


def _logged_cache(trace: Trace) -> dict[str, Any]:
    """The share of prompt tokens the serving fleet's caches supplied, over the records that log it."""
    said = trace.cached >= 0
    prompt = int(trace.prompt[said].sum())
    return {"logged_cached_requests": int(said.sum()),
            "logged_cached_share": round(int(trace.cached[said].sum()) / prompt, 4) if prompt else None}


def _table(rows: list[TierResult], per_worker: Any, span_s: float) -> list[str]:
    sizes = sorted({r.capacity for r in rows})
    fleets = sorted({r.workers for r in rows})
    by = {(r.workers, r.capacity): r for r in rows}
    out = [f"  {'size':>7} " + "".join(f"| {_n(w, 'worker'):^31} " for w in fleets)]
    for c in sizes:
        cells = []
        for w in fleets:
            r = by[(w, c)]
            cells.append(f"| {r.hit_ratio:6.1%} {1 - r.hit_ratio:6.2%} {per_worker(r):7.2f} "
                         f"({r.misses_max_worker / span_s:6.2f}) ")
        out.append(f"  {c:>7} " + "".join(cells))
    return out


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")


def _svg(panels: list[tuple[str, list[TierResult]]], zipf_s: float) -> str:
    """Hit ratio against tier size (log2 axis), one line per worker count, one panel per tier."""
    pw, ph, left, top, gap = 420, 260, 56, 60, 40
    width = left + len(panels) * (pw + gap) + 90
    height = top + ph + 46
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="15">loraplex plan: hit ratio against size '
           f'(Zipf exponent {zipf_s:.2f})</text>']
    fleets = sorted({r.workers for _, rows in panels for r in rows})
    for p, (title, rows) in enumerate(panels):
        x0 = left + p * (pw + gap)
        sizes = sorted({r.capacity for r in rows})
        lo, hi = math.log2(sizes[0]), math.log2(sizes[-1])
        span = hi - lo or 1.0

        def x(c: int, x0: int = x0, lo: float = lo, span: float = span) -> float:
            return x0 + pw * (math.log2(c) - lo) / span

        def y(v: float) -> float:
            return top + ph * (1.0 - v)

        out.append(f'<text x="{x0}" y="{top - 8}">{html.escape(title)}</text>')
        out.append(f'<rect x="{x0}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
        for v in (0.0, 0.25, 0.5, 0.75, 1.0):
            out.append(f'<line x1="{x0}" x2="{x0 + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>')
            out.append(f'<text x="{x0 - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0%}</text>')
        for c in sizes:
            out.append(f'<text x="{x(c):.1f}" y="{top + ph + 16}" text-anchor="middle">{c}</text>')
        out.append(f'<text x="{x0 + pw / 2:.0f}" y="{top + ph + 34}" text-anchor="middle" fill="#555">'
                   'adapters per worker</text>')
        for i, w in enumerate(fleets):
            pts = sorted((r.capacity, r.hit_ratio) for r in rows if r.workers == w)
            color = _COLORS[i % len(_COLORS)]
            path = " ".join(f"{x(c):.1f},{y(v):.1f}" for c, v in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
            out += [f'<circle cx="{x(c):.1f}" cy="{y(v):.1f}" r="3" fill="{color}"/>' for c, v in pts]
    lx = left + len(panels) * (pw + gap) - gap + 12
    for i, w in enumerate(fleets):
        color = _COLORS[i % len(_COLORS)]
        out.append(f'<rect x="{lx}" y="{top + 18 * i}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{lx + 18}" y="{top + 18 * i + 11}">{_n(w, "worker")}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
