"""``loraplex plan``'s prefix-cache replay: what a record names, what one worker's cache holds
and evicts, and what the plan says it assumed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson

from planner.prefixes import default_sizes, prefix_keys, replay_worker
from planner.replay import replay
from planner.trace import read_trace

BIN = Path(sys.executable).parent / "loraplex"
B = 16  # tokens a KV block


def record(i: int, *, adapter: str = "base", tenant: str = "t1", worker: str = "w1", prompt: int = 544,
           completion: int = 32, **kw: object) -> bytes:
    rec = {"ts": 1000.0 + i * 0.1, "request_id": f"r{i}", "tenant": tenant, "alias": "a", "adapter": adapter,
           "worker": worker, "prompt_tokens": prompt, "completion_tokens": completion, "status": 200,
           "latency_ms": 50.0, "stream": True, "route": "completions"}
    rec.update(kw)
    return orjson.dumps(rec)


def repeating_log(path: Path, n: int = 400, workers: int = 1, named: bool = True) -> Path:
    """vLLM's ``prefix_repetition`` shape: 4 shared 512-token prefixes, each prompt 544 tokens."""
    with open(path, "wb") as fh:
        for i in range(n):
            extra = {"prefix_id": f"system-{i % 4}", "prefix_tokens": 512} if named else {}
            fh.write(record(i, worker=f"w{i // 4 % workers + 1}", **extra) + b"\n")  # each meets every prefix
    return path


def one(keys: list[int], shared: list[int], prompt: list[int], total: list[int], kv: int) -> list[int]:
    return replay_worker(keys, shared, prompt, total, kv, B)


# --- one worker's cache --------------------------------------------------------------------------

def test_a_repeated_prefix_is_served_in_whole_blocks_short_of_the_last_prompt_token():
    assert one([0, 0], [512, 512], [544, 544], [576, 576], 65536) == [0, 512]
    # The whole prompt named: the last token is computed, so one block short of it.
    assert one([0, 0], [512, 512], [512, 512], [520, 520], 65536) == [0, 496]
    # A prefix that is not whole blocks: only its whole blocks.
    assert one([0, 0], [100, 100], [200, 200], [210, 210], 65536) == [0, 96]
    # A longer turn of the same conversation reuses what the earlier one computed, and no more.
    assert one([0, 0, 0], [300, 700, 700], [300, 700, 800], [340, 740, 840], 65536) == [0, 288, 688]
    # No prefix named: nothing served.
    assert one([-1, -1], [0, 0], [544, 544], [576, 576], 65536) == [0, 0]


def test_the_pool_evicts_the_least_recently_used_prefix():
    # Room for two 512-token prefixes and nothing else (requests without output blocks of their own).
    kv = 1024
    a, b, c = 0, 1, 2
    keys = [a, b, a, c, b, a]
    n = [512] * 6
    got = one(keys, n, [513] * 6, [513] * 6, kv)
    # a b a(hit) c(evicts b, the least recent) b(miss, evicts a) a(miss)
    assert got == [0, 0, 512, 0, 0, 0]
    keys = [a, b, a, c, a]
    assert one(keys, n[:5], [513] * 5, [513] * 5, kv) == [0, 0, 512, 0, 512]


def test_a_trimmed_chain_keeps_its_first_blocks():
    # 3 blocks of room: a's 48 tokens, then b's 32 take its last two blocks; a keeps 16.
    got = one([0, 1, 0], [48, 32, 48], [49, 33, 64], [49, 33, 64], 48)
    assert got == [0, 0, 16]


def test_a_requests_own_blocks_take_room_in_the_pool():
    # 4 prefixes in turn and 64 tokens of each request's own: 1,024 tokens of pool hold only the
    # last request's, so every prefix is gone when it comes back; 4,096 hold them all.
    keys = [i % 4 for i in range(40)]
    args = (keys, [512] * 40, [544] * 40, [576] * 40)
    assert sum(replay_worker(*args, 1024, B)) == 0
    assert replay_worker(*args, 4096, B) == [0] * 4 + [512] * 36


def test_the_same_prefix_id_under_another_adapter_or_tenant_is_another_prefix(tmp_path):
    log = tmp_path / "g.log"
    log.write_bytes(b"\n".join([
        record(0, prefix_id="sys", prefix_tokens=512),
        record(1, prefix_id="sys", prefix_tokens=512, adapter="a@1"),
        record(2, prefix_id="sys", prefix_tokens=512, tenant="t2"),
        record(3, prefix_id="sys", prefix_tokens=512),
        record(4),
    ]) + b"\n")
    t = read_trace([log], jobs=1)
    keys = prefix_keys(t).tolist()
    assert keys[0] == keys[3] and len({keys[0], keys[1], keys[2]}) == 3 and keys[4] == -1
    cached = one(keys, t.prefix_tokens.tolist(), t.prompt.tolist(), t.tokens.tolist(), 65536)
    assert cached == [0, 0, 0, 512, 0]


# --- reading -------------------------------------------------------------------------------------

def test_prefix_fields_are_read_clamped_to_the_prompt_and_a_malformed_pair_is_skipped(tmp_path):
    log = tmp_path / "g.log"
    log.write_bytes(b"\n".join([
        record(0, prefix_id="sys", prefix_tokens=512),
        record(1, prompt=100, prefix_id="sys", prefix_tokens=512),  # longer than the prompt: the prompt's
        record(2),
        record(3, prefix_id="sys"),  # no length
        record(4, prefix_id="", prefix_tokens=10),
        record(5, prefix_id="sys", prefix_tokens=-1),
        record(6, prefix_id=7, prefix_tokens=10),
    ]) + b"\n")
    t = read_trace([log], jobs=1)
    assert len(t) == 3 and t.skipped == 4
    assert t.prefix_tokens.tolist() == [512, 100, 0] and t.prefix.tolist() == [0, 0, -1]
    assert t.prompt.tolist() == [544, 100, 544] and t.prefixes == ["sys"] and t.names_prefixes
    assert t.window(1000.0, None).prefix.tolist() == [0, -1]


def test_the_cached_tokens_the_fleet_logged_are_said_beside_the_assumption(tmp_path):
    log = tmp_path / "g.log"
    log.write_bytes(b"\n".join([
        record(0, cached_tokens=0),
        record(1, cached_tokens=272),  # half of 544
        record(2),  # an older gateway's line: not counted either way
        record(3, cached_tokens="many"),
    ]) + b"\n")
    t = read_trace([log], jobs=1)
    assert t.cached.tolist() == [0, 272, -1] and t.skipped == 1
    run = subprocess.run([str(BIN), "plan", str(log), "--workers", "1"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "no reuse is assumed" in run.stdout
    assert "the fleet's own caches supplied 25.0% of the prompt tokens of the 2 records" in run.stdout, run.stdout


def test_default_pool_sizes_grow_until_one_holds_every_prefix(tmp_path):
    t = read_trace([repeating_log(tmp_path / "g.log", 40)], jobs=1)
    assert default_sizes(t, prefix_keys(t), B) == [4096]  # 4 x 512 tokens
    with open(tmp_path / "big.log", "wb") as fh:
        for i in range(200):
            fh.write(record(i, prompt=4000, prefix_id=f"p{i % 50}", prefix_tokens=3000) + b"\n")
    t = read_trace([tmp_path / "big.log"], jobs=1)
    assert default_sizes(t, prefix_keys(t), B) == [4096, 16384, 65536, 262144]  # 50 x 2992 = 149,600


# --- the replay and the plan ---------------------------------------------------------------------

def test_each_worker_has_its_own_cache(tmp_path):
    # Two workers, four requests each in turn: each meets each prefix once cold, not once in all.
    t = read_trace([repeating_log(tmp_path / "g.log", 400, workers=2)], jobs=1)
    out = replay(t, [1, 2], {"device": [4], "host": [4]}, jobs=1, kv_tokens=[65536], block=B)
    hit = {r.workers: r for r in out.prefix}
    assert hit[2].cached_tokens == (400 - 8) * 512 and hit[2].prompt_tokens == 400 * 544
    assert hit[1].cached_tokens == (400 - 4) * 512
    load = {x.workers: x for x in out.load}
    # The busiest worker: 200 requests of 576 tokens, 196 of them served 512 from its cache.
    x = load[2]
    assert np.isclose(x.peak_computed_tokens_per_s / x.peak_tokens_per_s, (200 * 576 - 196 * 512) / (200 * 576),
                      rtol=1e-3)
    # The same replay in worker processes gives the same figures.
    forked = replay(t, [1, 2], {"device": [4], "host": [4]}, jobs=2, kv_tokens=[65536], block=B)
    assert forked.prefix == out.prefix and forked.load == out.load


def test_no_prefix_named_means_no_reuse_assumed(tmp_path):
    t = read_trace([repeating_log(tmp_path / "g.log", 40, named=False)], jobs=1)
    out = replay(t, [1], {"device": [4], "host": [4]}, jobs=1, kv_tokens=[65536], block=B)
    assert out.prefix == [] and out.load[0].peak_computed_tokens_per_s is None


def test_the_command_says_the_hit_ratio_it_assumed(tmp_path):
    log = repeating_log(tmp_path / "g.log", 400)
    run = subprocess.run([str(BIN), "plan", str(log), "--workers", "1", "--kv-tokens", "1024,65536", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    hits = {r["kv_tokens"]: r["hit_ratio"] for r in plan["prefix_cache"]}
    assert hits == {1024: 0.0, 65536: round(396 * 512 / (400 * 544), 4)}
    assert plan["trace"]["prefix_requests"] == 400
    # The load is counted at the smallest pool tried: it thrashes, so nothing is saved.
    load = plan["load"][0]
    assert load["peak_computed_tokens_per_s"] == load["peak_tokens_per_s"]
    text = subprocess.run([str(BIN), "plan", str(log), "--workers", "1", "--kv-tokens", "65536"],
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert "prefix cache (KV tokens per worker)" in text.stdout and "93.2%" in text.stdout, text.stdout
    assert "computed)" in text.stdout
    bare = subprocess.run([str(BIN), "plan", str(repeating_log(tmp_path / "n.log", 40, named=False))],
                          capture_output=True, text=True, timeout=120)
    assert bare.returncode == 0, bare.stderr
    assert "no record names a prefix" in bare.stdout and "(0.0% of prompt tokens cached)" in bare.stdout


def test_a_worker_that_carries_the_computed_load_is_enough(tmp_path):
    # 10 requests/s of 576 tokens, 512 of each served from cache after the first four: about
    # 5,760 tokens/s arrive, about 700 are computed; a worker that computes 2,000 carries it.
    log = repeating_log(tmp_path / "g.log", 1200)
    run = subprocess.run([str(BIN), "plan", str(log), "--workers", "1,2", "--kv-tokens", "65536",
                          "--worker-tokens-per-s", "2000", "--json"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert plan["recommendation"]["workers"] == 1, plan["recommendation"]
    assert np.isclose(plan["load"][0]["peak_tokens_per_s"], 5760.0)
