"""bench/serve_vs_vllm.py reads the engine's step counters from the worker's Prometheus text:
the names it looks for must be the ones WorkerMetrics writes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from engine.metrics import WorkerMetrics

BENCH = Path(__file__).resolve().parents[1] / "bench" / "serve_vs_vllm.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("serve_vs_vllm", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


class _Engine:
    grammars = None
    lora_runtime = None

    def load(self) -> dict[str, int]:
        return {"queue_depth": 0, "running": 0, "kv_blocks_used": 0, "kv_blocks_total": 1}


def test_step_counters_read_worker_metrics(bench):
    m = WorkerMetrics(_Engine(), "w1")
    m.observe_step(0.25, 32)
    before = bench.step_counters(m.render().decode())
    assert before == {"steps": 1.0, "step_s": 0.25, "step_tokens": 32.0}
    m.observe_step(0.5, 40)
    m.observe_step(0.25, 24)
    delta = bench.counter_delta(before, bench.step_counters(m.render().decode()))
    assert delta == {"steps": 2.0, "step_s": 0.75, "step_tokens": 64.0}

    tally = bench.Tally(t0=10.0, t1=11.5, tokens=64, steps=delta)
    r = tally.result()
    assert r["tok_s"] == pytest.approx(64 / 1.5)
    assert r["step_ms"] == pytest.approx(375.0)
    assert r["tokens_per_step"] == pytest.approx(32.0)
    assert r["busy"] == pytest.approx(0.5)


def test_no_step_counters_for_other_servers(bench):
    r = bench.Tally(t0=0.0, t1=1.0, tokens=5).result()
    assert "steps" not in r and r["tok_s"] == 5.0


def test_median_round_per_case(bench):
    rounds = [{"a": {"tok_s": 10.0, "ttft_p99_s": 1.0}, "b": {"tok_s": 5.0}},
              {"a": {"tok_s": 30.0, "ttft_p99_s": 3.0}, "b": {"tok_s": 7.0}},
              {"a": {"tok_s": 20.0, "ttft_p99_s": 2.0}, "b": {"tok_s": 6.0}}]
    out = bench.median_of_rounds(rounds)
    assert out["a"] == {"tok_s": 20.0, "ttft_p99_s": 2.0, "rounds_tok_s": [10.0, 30.0, 20.0]}
    assert out["b"]["tok_s"] == 6.0
    assert bench.median_of_rounds(rounds[:2])["a"]["tok_s"] == 10.0  # even: the lower middle


def test_every_case_carries_the_cores_speed_around_its_server(bench, capsys):
    """The probe brackets each server process, so a reader can tell a drifting machine from a
    slower server."""
    before = bench.speed_probe(1)
    assert 0.1 < before < 1e5  # a real measurement: peak.c built and run
    res = {"single": bench.Tally(t0=0.0, t1=1.0, tokens=3).result(), "prompt-heavy/base": {"tok_s": 1.0}}
    out = bench.with_probes("worker", res, before, before / 2)
    assert [r["probe_gflops"] for r in out.values()] == [[before, before / 2]] * 2
    assert "speed probe" in capsys.readouterr().out
