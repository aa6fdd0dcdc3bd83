"""Woken from idle, the engine gathers the requests of a burst into its first step
(``Engine._gather_arrivals``, setting ``idle_gather_ms``) instead of stepping at the first one."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from engine.engine import Engine, EngineConfig
from engine.sequence import SamplingParams
from loraplex.settings import Settings
from tests.engine_fixtures import make_tiny_model

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gather") / "m")


def engine(model: Path, gather_ms: float, step_tokens: int = 512) -> Engine:
    return Engine.from_path(model, EngineConfig(kv_cache_bytes=4 << 20, idle_gather_ms=gather_ms,
                                                max_num_batched_tokens=step_tokens))


def add_later(eng: Engine, n: int, every_s: float, prompt_len: int = 10) -> threading.Thread:
    """Adds ``n`` requests from another thread, ``every_s`` apart (the first at once)."""
    def run() -> None:
        for i in range(n):
            if i:
                time.sleep(every_s)
            eng.add_request([5 + i] * prompt_len, PARAMS)

    t = threading.Thread(target=run)
    t.start()
    return t


def gather(eng: Engine) -> float:
    """``_gather_arrivals`` as the engine thread calls it, after the first request arrived;
    returns the seconds it waited."""
    while eng.scheduler.num_waiting == 0:
        time.sleep(0.001)
    t0 = time.monotonic()
    with eng._wake:
        eng._gather_arrivals()
    return time.monotonic() - t0


def test_it_waits_for_a_quiet_gap_after_the_last_arrival(model):
    eng = engine(model, gather_ms=100)
    adder = add_later(eng, 3, every_s=0.01)
    waited = gather(eng)
    adder.join()
    assert eng.scheduler.num_waiting == 3
    assert waited >= 0.1  # a whole gap with no arrival ends it


def test_it_stops_once_the_waiting_prompts_fill_a_step(model):
    eng = engine(model, gather_ms=2000, step_tokens=64)
    adder = add_later(eng, 5, every_s=0.05, prompt_len=40)
    waited = gather(eng)
    queued = eng.scheduler.num_waiting
    adder.join()
    assert queued == 2  # 80 tokens >= 64: the first step is full, nothing to gain by waiting
    assert waited < 1.0


def test_it_waits_five_gaps_at_most_while_requests_keep_coming(model):
    eng = engine(model, gather_ms=40)
    adder = add_later(eng, 60, every_s=0.01)
    waited = gather(eng)
    queued = eng.scheduler.num_waiting
    adder.join()
    assert waited < 0.6  # 5 x 40 ms, with room for a loaded machine
    assert queued < 60


def test_zero_steps_at_once(model):
    eng = engine(model, gather_ms=0)
    eng.add_request([5] * 10, PARAMS)
    assert gather(eng) < 0.05 and eng.scheduler.num_waiting == 1


def test_a_burst_shares_the_engine_threads_first_step(model):
    """The running engine: eight requests arriving 2 ms apart go in one first step."""
    eng = engine(model, gather_ms=50)
    steps: list[int] = []
    schedule = eng.scheduler.schedule

    def recording():
        out = schedule()
        if out.chunks:
            steps.append(len(out.chunks))
        return out

    eng.scheduler.schedule = recording
    eng.start()
    try:
        time.sleep(0.1)  # idle
        add_later(eng, 8, every_s=0.002).join()
        deadline = time.monotonic() + 10
        while eng.scheduler.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        eng.close()
    assert steps and steps[0] == 8


def test_the_worker_gathers_five_ms_by_default_and_the_library_not_at_all():
    assert Settings().idle_gather_ms == 5.0 and EngineConfig().idle_gather_ms == 0.0
    assert Settings.from_env({"LORAPLEX_IDLE_GATHER_MS": "0"}).idle_gather_ms == 0.0
