"""``loraplex plan``: reading access logs, replaying routing and tiers, the fit, the advice,
and (slow) its prediction against a real fleet's measured hit ratios."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import orjson
import pytest

import planner.replay as replay_mod
import planner.trace as trace_mod
from engine.lora.eviction import LRUPolicy
from planner.replay import Load, TierResult, assign, hit_ratio, replay, replay_tier
from planner.report import Plan
from planner.trace import TraceError, read_trace
from planner.zipf import fit_zipf

BIN = Path(sys.executable).parent / "loraplex"


def record(ts: float, adapter: str, worker: str = "w1", latency_ms: float = 100.0, **kw: object) -> bytes:
    rec = {"ts": ts, "request_id": "r", "tenant": "t", "alias": "a", "adapter": adapter, "worker": worker,
           "prompt_tokens": 10, "completion_tokens": 5, "status": 200, "latency_ms": latency_ms, "stream": False,
           "route": "chat"}
    rec.update(kw)
    return orjson.dumps(rec)


def zipf_keys(n: int, adapters: int, s: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, adapters + 1) ** s
    return rng.permutation(adapters)[rng.choice(adapters, size=n, p=p / p.sum())].astype(np.int32)


def write_log(path: Path, keys: np.ndarray, workers: int = 1, every_s: float = 0.01) -> Path:
    with open(path, "wb") as fh:
        for i, k in enumerate(keys.tolist()):
            fh.write(record(1000.0 + i * every_s + 0.1, f"ad-{k}@1", f"w{k % workers + 1}") + b"\n")
    return path


# --- reading -------------------------------------------------------------------------------------

def test_the_trace_keeps_served_requests_in_start_order_and_skips_everything_else(tmp_path):
    log = tmp_path / "gateway.log"
    log.write_bytes(b"\n".join([
        b"INFO uvicorn started",
        record(10.0, "a@1", latency_ms=5000),  # started at 5.0: first
        b"2026-12-06T10:00:00Z gateway-1 " + record(7.0, "base", "w2", latency_ms=1000),  # a shipper's prefix
        record(8.0, "b@2", worker=""),  # refused before any worker: not traffic a worker saw
        b'{"ts": 9.0, "adapter": "broken"',
        record(9.0, "a@1", latency_ms=500),
        b"Traceback (most recent call last):",
    ]) + b"\n")
    t = read_trace([log], jobs=1)
    assert t.start.tolist() == [5.0, 6.0, 8.5]
    assert [t.adapters[a] if a >= 0 else "base" for a in t.adapter.tolist()] == ["a@1", "base", "a@1"]
    assert [t.workers[w] for w in t.worker.tolist()] == ["w1", "w2", "w1"]
    assert t.skipped == 4 and t.tokens.tolist() == [15, 15, 15]
    assert len(t.window(5.5, 8.5)) == 1


def test_byte_ranges_read_by_several_processes_give_the_same_trace(tmp_path, monkeypatch):
    keys = zipf_keys(3000, 50, 1.0)
    logs = [write_log(tmp_path / "g1.log", keys[:2000], workers=3), write_log(tmp_path / "g2.log", keys[2000:], 3)]
    whole = read_trace(logs, jobs=1)
    monkeypatch.setattr(trace_mod, "_CHUNK", 4096)  # many ranges, lines crossing every boundary
    split = read_trace(logs, jobs=2)
    assert len(split) == len(whole) == 3000 and split.skipped == whole.skipped == 0
    names = [split.adapters[a] for a in split.adapter.tolist()]
    assert names == [whole.adapters[a] for a in whole.adapter.tolist()]
    assert [split.workers[w] for w in split.worker.tolist()] == [whole.workers[w] for w in whole.worker.tolist()]


def test_logs_without_records_are_an_error(tmp_path):
    log = tmp_path / "empty.log"
    log.write_text("nothing here\n")
    with pytest.raises(TraceError, match="no access-log records"):
        read_trace([log], jobs=1)


# --- replay --------------------------------------------------------------------------------------

def test_the_tier_replay_evicts_by_the_engines_lru_policy():
    # capacity 2: a b a c (evicts b) b (miss, evicts a) a (miss) -> hits: a once
    assert replay_tier([1, 2, 1, 3, 2, 1], 2) == 1
    assert replay_tier([1, 2, 1, 3, 1, 2], 2) == 2  # a stays (recently used), b was evicted
    calls: list[tuple[str, object]] = []

    class Recording(LRUPolicy):
        def victim(self, candidates):
            out = super().victim(candidates)
            calls.append(("victim", out))
            return out

    replay_tier([1, 2, 3], 2, Recording)
    assert calls == [("victim", 1)]


def test_lru_victim_is_the_first_of_its_order():
    rng = random.Random(3)
    for _ in range(200):
        p, tracked = LRUPolicy(), set()
        for _ in range(rng.randint(1, 30)):
            k = rng.randint(0, 9)
            if rng.random() < 0.2:
                p.remove(k)
                tracked.discard(k)
            else:
                p.touch(k)
                tracked.add(k)
        cands = set(rng.sample(range(12), rng.randint(0, 12)))
        order, v = p.order(cands), p.victim(cands)
        if not order:
            assert v is None
        elif order[0] in tracked:
            assert v == order[0]
        else:  # no candidate was ever used: any of them
            assert v in cands and not cands & tracked


def test_a_sampled_replay_of_a_long_stream_stays_within_a_point(monkeypatch):
    keys = zipf_keys(400_000, 5000, 1.0, seed=2)
    monkeypatch.setattr(replay_mod, "SAMPLE_BUDGET", 40_000)
    for capacity in (4, 16, 64):
        est, sampled = hit_ratio(keys, capacity)
        full = replay_tier(keys.tolist(), capacity) / keys.size
        assert sampled, capacity
        assert abs(est - full) < 0.01, (capacity, est, full)  # a tenth of the budget CLI runs use
    est, sampled = hit_ratio(keys, 5000)  # holds every adapter: only first uses miss, exactly
    assert not sampled and est == 1.0 - np.unique(keys).size / keys.size


def test_routing_keeps_the_fleets_own_assignment_and_rings_other_sizes(tmp_path):
    keys = zipf_keys(4000, 200, 0.8)
    t = read_trace([write_log(tmp_path / "g.log", keys, workers=2)], jobs=1)
    assert (assign(t, 2) == t.worker).all()
    three, four = assign(t, 3), assign(t, 4)
    for where in (three, four):  # one worker per adapter, as the ring's first candidate
        pairs = set(zip(t.adapter.tolist(), where.tolist(), strict=True))
        assert len(pairs) == len(set(t.adapter.tolist()))
    # Consistent hashing: growing from 3 to 4 workers moves about a quarter of the adapters, not most.
    a3 = dict(zip(t.adapter.tolist(), three.tolist(), strict=True))
    a4 = dict(zip(t.adapter.tolist(), four.tolist(), strict=True))
    moved = sum(a3[a] != a4[a] for a in a3) / len(a3)
    assert 0.1 < moved < 0.45, moved
    assert set(four.tolist()) == {0, 1, 2, 3}


def test_more_workers_and_bigger_tiers_hit_more(tmp_path):
    keys = zipf_keys(6000, 400, 1.0)
    t = read_trace([write_log(tmp_path / "g.log", keys, workers=1)], jobs=1)
    tiers = replay(t, [1, 4], {"device": [4, 16], "host": [32, 128]}, jobs=2)
    host = {(r.workers, r.capacity): r.hit_ratio for r in tiers.host}
    dev = {(r.workers, r.capacity): r.hit_ratio for r in tiers.device}
    assert host[(1, 32)] < host[(1, 128)] and host[(1, 32)] < host[(4, 32)]
    assert dev[(1, 4)] < dev[(1, 16)] <= host[(1, 32)]
    one = next(r for r in tiers.host if r.workers == 1 and r.capacity == 32)
    assert one.hits == replay_tier(t.adapter.tolist(), 32) and one.requests == 6000
    # 100 requests/s of 15 tokens each on one worker: 1,500 tokens/s at its busiest minute
    load = {x.workers: x for x in tiers.load}
    assert load[1].peak_tokens_per_s == 1500.0 and load[1].peak_requests_per_s == 100.0
    assert 375.0 <= load[4].peak_tokens_per_s < 1500.0


def test_the_zipf_fit_recovers_the_exponent():
    for s in (0.7, 1.0, 1.3):
        counts = np.bincount(zipf_keys(200_000, 2000, s, seed=5))
        assert abs(fit_zipf(counts) - s) < 0.05, s
    assert fit_zipf(np.array([10])) == 0.0


def _plan(host: list[tuple[int, int, float]], device: list[tuple[int, int, float]], target: float,
          peaks: dict[int, float] | None = None, capacity: float | None = None,
          trace: dict[str, float] | None = None) -> Plan:
    def rows(spec: list[tuple[int, int, float]]) -> list[TierResult]:
        return [TierResult(w, c, 1000, 1000 * h, 1000 * (1 - h) / w, False) for w, c, h in spec]

    load = [Load(w, t, t / 100) for w, t in (peaks or {1: 100.0, 2: 50.0}).items()]
    return Plan(trace or {}, 1.0, rows(device), rows(host), 100.0, target, 0.1, {}, load, capacity)


def test_the_recommendation_is_the_smallest_fleet_within_the_targets():
    host = [(1, 64, 0.90), (1, 256, 0.985), (2, 64, 0.992), (2, 256, 0.999)]
    device = [(1, 4, 0.7), (1, 8, 0.92), (1, 16, 0.95), (2, 4, 0.8), (2, 8, 0.9)]
    rec = _plan(host, device, target=0.02).recommendation()
    assert (rec["met"], rec["workers"], rec["max_cpu_loras"], rec["max_loras"]) == (True, 1, 256, 8)
    # One worker cannot carry 900 tokens/s at the peak when it sustains 600: two are advised.
    rec = _plan(host, device, target=0.02, peaks={1: 900.0, 2: 480.0}, capacity=600).recommendation()
    assert (rec["met"], rec["workers"], rec["max_cpu_loras"], rec["max_loras"]) == (True, 2, 64, 8)
    rec = _plan(host, device, target=0.02, peaks={1: 900.0, 2: 480.0}, capacity=400).recommendation()
    assert not rec["met"] and "carries the load" in rec["why"]
    rec = _plan(host=[(1, 64, 0.90), (2, 64, 0.95)], device=[(1, 4, 0.5), (2, 4, 0.5)], target=0.01).recommendation()
    assert not rec["met"] and "no size tried" in rec["why"] and rec["workers"] == 2
    rec = _plan(host=[(1, 64, 0.90)], device=[(1, 4, 0.5)], target=0.01, peaks={1: 100.0}).recommendation()
    assert "(1 worker, max_cpu_loras 64)" in rec["why"]


def test_a_target_below_the_first_use_floor_is_said_with_the_floor():
    """2.88% of the requests are an adapter's first: no size gets below that, so a 1% target is
    not advice to add workers but a target below the floor; the plan is the smallest fleet at the
    fewest cold starts tried."""
    host = [(1, 64, 0.95), (1, 256, 0.97), (2, 64, 0.97), (2, 256, 0.97)]
    device = [(1, 4, 0.8), (1, 8, 0.95), (2, 4, 0.9)]
    rec = _plan(host, device, target=0.01, trace={"first_use_share": 0.0288}).recommendation()
    assert (rec["met"], rec["floor"], rec["workers"], rec["max_cpu_loras"], rec["max_loras"]) == \
        (False, 0.0288, 1, 256, 8)
    assert "below the floor of 2.88%" in rec["why"] and "3.00%" in rec["why"]
    assert "try more workers" not in rec["why"]
    # At or above the floor: the ordinary advice.
    rec = _plan(host, device, target=0.035, trace={"first_use_share": 0.0288}).recommendation()
    assert rec["met"] and "floor" not in rec and (rec["workers"], rec["max_cpu_loras"]) == (1, 256)


def test_the_command_on_a_short_window_says_the_floor_and_counts_right(tmp_path):
    # 300 requests over 100 adapters, all on one worker: a third are first uses.
    log = write_log(tmp_path / "g.log", zipf_keys(300, 100, 0.8), workers=1)
    run = subprocess.run([str(BIN), "plan", str(log), "--workers", "1,2", "--max-cpu-loras", "16,128"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "none met" not in run.stdout and "try more workers" not in run.stdout
    assert "recommendation, the target being below the floor: 1 worker," in run.stdout, run.stdout
    assert "on 1 worker;" in run.stdout and "1 workers" not in run.stdout


# --- the command ---------------------------------------------------------------------------------

def test_the_command_prints_a_plan_json_and_a_plot(tmp_path):
    log = write_log(tmp_path / "g.log", zipf_keys(5000, 300, 1.1), workers=2)
    svg = tmp_path / "plan.svg"
    run = subprocess.run([str(BIN), "plan", str(log), "--workers", "1,2", "--max-loras", "4,8",
                          "--max-cpu-loras", "32,64,128", "--target-cold", "10%", "--plot", str(svg)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "Zipf exponent 1.1" in run.stdout and "recommendation:" in run.stdout
    assert "read 5,000 requests" in run.stderr and "replayed in" in run.stderr
    root = ET.fromstring(svg.read_text())
    assert root.tag.endswith("svg") and len(root.findall(".//{http://www.w3.org/2000/svg}polyline")) == 4
    js = subprocess.run([str(BIN), "plan", str(log), "--last", "20s", "--json", "--max-cpu-loras", "16,64",
                         "--worker-tokens-per-s", "1000"], capture_output=True, text=True, timeout=120)
    plan = json.loads(js.stdout)
    # 100 requests/s of 15 tokens: 1,500 tokens/s, more than one worker's 1,000
    assert {x["workers"]: x["peak_tokens_per_s"] for x in plan["load"]}[1] == 1500.0
    assert plan["recommendation"]["workers"] >= 2
    assert plan["trace"]["requests"] == 2001  # the last 20 s at 100 requests/s
    assert {r["max_cpu_loras"] for r in plan["host_cache"]} == {16, 64}
    assert {r["workers"] for r in plan["host_cache"]} == {1, 2, 4}  # the logs' own, half and double
    assert plan["recommendation"]["workers"] in (2, 4)


@pytest.mark.parametrize("args, message", [
    (["--max-loras", "0,4"], "sizes must be 1 or more"),
    (["--last", "soon"], "not a duration"),
    (["--since", "yesterday"], "not a time"),
    (["--target-cold", "2"], "a share is between 0 and 1"),
])
def test_bad_arguments_are_refused_by_name(tmp_path, args, message):
    log = write_log(tmp_path / "g.log", zipf_keys(10, 5, 1.0))
    run = subprocess.run([str(BIN), "plan", str(log), *args], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr


def test_a_window_with_no_requests_or_a_missing_file_is_a_clear_error(tmp_path):
    log = write_log(tmp_path / "g.log", zipf_keys(10, 5, 1.0))
    run = subprocess.run([str(BIN), "plan", str(log), "--since", "2030-01-01T00:00:00Z"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "no request in the window" in run.stderr and "Traceback" not in run.stderr
    run = subprocess.run([str(BIN), "plan", str(tmp_path / "nope.log")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "nope.log" in run.stderr and "Traceback" not in run.stderr


# --- against a real fleet ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.e2e
def test_the_plan_predicts_a_real_fleets_hit_ratios_within_five_points(tmp_path, pg_url, redis_url):
    from bench.plan_check import Config, run
    from tests.engine_fixtures import demo_model_file

    cfg = Config(workers=2, adapters=40, tenants=4, requests=400, clients=4, zipf=1.0, max_loras=4, max_cpu_loras=12)
    out = run(cfg, tmp_path, str(demo_model_file()), database_url=pg_url, redis_url=redis_url)
    assert out["requests_failed"] == 0
    assert sum(out["arrivals"].values()) == out["trace_requests"] == cfg.requests
    assert all(sum(w.values()) > 0 for w in out["arrivals_per_worker"].values())  # both workers served
    m, p = out["measured"], out["predicted"]
    assert 0.05 < m["device"] < m["host"] < 0.98  # the tiers were exercised: hits and misses in each
    assert abs(p["device"] - m["device"]) <= 0.05, out
    assert abs(p["host"] - m["host"]) <= 0.05, out
