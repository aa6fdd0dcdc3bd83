"""The prefix cache: exact, isolated, and consistent under eviction, preemption and aborts.

Rows are checked as in ``test_lora_isolation``: every sampled logits row against PEFT (float64)
for that row's adapter alone, and every greedy stream against PEFT's. With the cache on, rows
that start from cached blocks must still match, and the hit counters must show they did start
from them. The namespace rules (adapter digest, base apart, tenant scope) are checked through
``Sequence.cached_tokens``; the allocator's bookkeeping through ``BlockAllocator.check`` and a
fuzz of allocate/hold/cache/evict/free against a model of it.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.kv_cache import BlockAllocator, OutOfBlocksError
from engine.sequence import SamplingParams
from loraplex.digest import digest_directory
from loraplex.wire import AdapterRef
from tests.lora_fixtures import (
    ISOLATION_SPECS,
    PeftReference,
    Recorder,
    attach_runtime,
    model_info,
    peft_adapters,
    rel_err,
    run_to_completion,
    save_tiny_llama,
    tiny_engine,
)

TOL = 1e-4
NEW = 5
ADAPTERS = ["r8_all", "r16_mlp", "rs16_qvd", "r64_qv"]
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("prefix")
    base_dir = save_tiny_llama(root / "base")
    model, dirs = peft_adapters(base_dir, root / "adapters", {n: ISOLATION_SPECS[n] for n in ADAPTERS})
    refs = {n: AdapterRef(id=f"id-{n}", name=n, uri=d.as_uri(), sha256=digest_directory(d)) for n, d in dirs.items()}
    return {"base": base_dir, "reference": PeftReference(model), "refs": refs, "cache": root / "cache"}


def _engine(world: dict[str, Any], **kw: Any) -> Any:
    engine = tiny_engine(world["base"], **kw)
    attach_runtime(engine, model_info(world["base"]), world["cache"])
    manager = engine.lora_runtime.manager
    for ref in world["refs"].values():
        manager.prefetch(ref)
    for ref in world["refs"].values():
        assert manager.wait(ref, timeout=60).state in ("host", "device")
    return engine


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = _tokens(40, 1)
"""A shared system prompt: two full 16-token blocks and a partial one."""


def _submit(engine: Any, world: dict[str, Any], rows: list[tuple[str | None, list[int]]], **kw: Any) -> list[Any]:
    return [(name, prompt, engine.add_request(prompt, GREEDY, adapter=world["refs"][name] if name else None, **kw))
            for name, prompt in rows]


def _mismatches(world: dict[str, Any], seqs: list[Any], rec: Recorder) -> list[str]:
    ref: PeftReference = world["reference"]
    bad = []
    for name, prompt, seq in seqs:
        rows = rec.rows.get(seq.seq_id, [])
        if {len(p) for p, _ in rows} != set(range(len(prompt), len(prompt) + NEW)):
            bad.append(f"{name}: logits rows at {sorted(len(p) for p, _ in rows)}")
        for prefix, logits in rows:
            err = rel_err(logits, ref.logits(name, prefix))
            if not err < TOL:
                bad.append(f"{name} at {len(prefix)}: rel err {err:.2e}")
        if seq.output_ids != ref.greedy(name, prompt, NEW):
            bad.append(f"{name}: greedy {seq.output_ids}")
    return bad


def _mixed_waves() -> tuple[list[tuple[str | None, list[int]]], list[tuple[str | None, list[int]]]]:
    """Wave 1: each namespace's first request. Wave 2: the same system prompt with new suffixes
    and one exact repeat, base and every adapter interleaved."""
    names: list[str | None] = [None, *ADAPTERS]
    first = [(n, SYSTEM + _tokens(3 + i, 10 + i)) for i, n in enumerate(names)]
    second = [(n, SYSTEM + _tokens(5 + (i * 7) % 13, 30 + i)) for i, n in enumerate(names * 2)]
    second.append(first[2])
    return first, second


def test_mixed_adapter_batch_is_exact_with_the_cache_and_hits_it(world):
    on = _engine(world)
    off = _engine(world)
    off.scheduler.prefix_cache = False
    first, second = _mixed_waves()
    results = {}
    for label, engine in (("on", on), ("off", off)):
        rec = Recorder()
        rec.install(engine)
        wave1 = _submit(engine, world, first)
        run_to_completion(engine, [s for _, _, s in wave1])
        wave2 = _submit(engine, world, second)  # one concurrent mixed batch
        run_to_completion(engine, [s for _, _, s in wave2])
        assert _mismatches(world, wave1 + wave2, rec) == [], label
        results[label] = [s for _, _, s in wave1 + wave2]
        engine.cache.allocator.check()
    assert [s.output_ids for s in results["on"]] == [s.output_ids for s in results["off"]]
    hits = [s.cached_tokens for s in results["on"]]
    assert hits[:len(first)] == [0] * len(first)  # nothing cached yet
    assert all(h == 32 for h in hits[len(first):-1]), hits  # the system prompt's two full blocks
    assert hits[-1] == 32  # the repeat: 43 tokens, two full blocks short of its last token
    assert all(s.cached_tokens == 0 for s in results["off"])
    on.lora_runtime.manager.close()
    off.lora_runtime.manager.close()


def test_namespaces_never_meet(world):
    """Another adapter, the base model, another tenant and a re-registered version (same name,
    other weights) never reuse a request's blocks; one shared scope does."""
    engine = _engine(world)
    refs = world["refs"]
    prompt = [*SYSTEM, 5, 6, 7]

    def run(adapter: AdapterRef | None, **kw: Any) -> Any:
        seq = engine.add_request(prompt, GREEDY, adapter=adapter, **kw)
        run_to_completion(engine, [seq])
        return seq

    assert run(refs["r8_all"], tenant="acme").cached_tokens == 0
    assert run(refs["r8_all"], tenant="acme").cached_tokens == 32
    assert run(refs["r16_mlp"], tenant="acme").cached_tokens == 0
    assert run(None, tenant="acme").cached_tokens == 0
    assert run(refs["r8_all"], tenant="globex").cached_tokens == 0
    # Re-registered: the name of r8_all, r16_mlp's weights, a new id and digest.
    swapped = AdapterRef(id="id-r8-v2", name="r8_all", uri=refs["r16_mlp"].uri, sha256=refs["r16_mlp"].sha256)
    rec = Recorder()
    rec.install(engine)
    seq = run(swapped, tenant="acme")
    assert seq.cached_tokens == 32  # r16_mlp's own blocks for acme: the same digest is the same weights
    assert _mismatches(world, [("r16_mlp", prompt, seq)], rec) == []
    # The same name and id as r8_all but other weights (a reload in place) must not meet r8_all's blocks.
    reloaded = replace(refs["r8_all"], sha256="0" * 64)
    root_old = engine._cache_root(refs["r8_all"], "tenant:acme")
    assert engine._cache_root(reloaded, "tenant:acme") != root_old
    assert run(refs["r64_qv"], cache_scope="shared:holding", tenant="a").cached_tokens == 0
    assert run(refs["r64_qv"], cache_scope="shared:holding", tenant="b").cached_tokens == 32
    assert run(refs["r64_qv"], tenant="c").cached_tokens == 0
    engine.cache.allocator.check()
    engine.lora_runtime.manager.close()


def test_a_new_turn_over_a_cached_history_is_exact_by_matmul(world, monkeypatch):
    """A conversation's next turn starts from its history's cached blocks; its new tokens, far
    fewer than the history, are attended by matrix products (``engine.attention.by_matmul``,
    thresholds lowered to this model's sizes) in the same steps as other requests' kernel rows,
    and through the layer-by-layer path (the one-call decoder attends every row by the kernel).
    Every row still equals PEFT's."""
    import engine.attention as attention

    monkeypatch.setattr(attention, "MATMUL_MIN_ROWS", 8)
    monkeypatch.setattr(attention, "MATMUL_MIN_CONTEXT", 2)
    routed = []
    real = attention._prefill
    monkeypatch.setattr(attention, "_prefill", lambda item, *a: (routed.append(item.end - item.start), real(item, *a)))
    engine = _engine(world)
    rec = Recorder()
    rec.install(engine)
    names: list[str | None] = [None, *ADAPTERS[:2]]
    turn1 = [(n, SYSTEM + _tokens(30, 300 + i)) for i, n in enumerate(names)]
    run_to_completion(engine, [s for _, _, s in _submit(engine, world, turn1)])
    turn2 = [(n, p + _tokens(20, 400 + i)) for i, (n, p) in enumerate(turn1)]
    turn2.append((ADAPTERS[2], _tokens(6, 500)))  # a short newcomer beside them: kernel rows
    seqs = _submit(engine, world, turn2)
    run_to_completion(engine, [s for _, _, s in seqs])
    assert _mismatches(world, seqs, rec) == []
    assert [s.cached_tokens for _, _, s in seqs[:-1]] == [64] * len(names)
    assert routed and min(routed) >= 8, routed
    engine.cache.allocator.check()
    engine.lora_runtime.manager.close()


def test_eviction_under_pressure_keeps_every_answer_exact(world):
    """A pool of 24 four-token blocks for waves of prompts over three system prompts: cached
    blocks are evicted and found again, every row still equals PEFT's."""
    engine = _engine(world, kv_cache_bytes=24 * 2 * 2 * 2 * 16 * 4 * 4, kv_block_size=4, max_num_batched_tokens=24)
    rec = Recorder()
    rec.install(engine)
    systems = [_tokens(18, 100 + k) for k in range(3)]
    names: list[str | None] = [None, *ADAPTERS]
    seqs = []
    for wave in range(4):
        rows = [(names[(wave + i) % len(names)], systems[(wave + i) % 3] + _tokens(2 + i, 200 + 10 * wave + i))
                for i in range(4)]
        batch = _submit(engine, world, rows)
        run_to_completion(engine, [s for _, _, s in batch])
        engine.cache.allocator.check()
        seqs += batch
    alloc = engine.cache.allocator
    assert alloc.evictions > 0, "the pool was large enough: nothing evicted"
    assert sum(s.cached_tokens for _, _, s in seqs) > 0, "no hit"
    assert _mismatches(world, seqs, rec) == []
    assert alloc.num_free == alloc.num_blocks
    engine.lora_runtime.manager.close()


def test_preempted_and_aborted_sequences_leave_the_cache_consistent(world):
    engine = _engine(world, kv_cache_bytes=14 * 2 * 2 * 2 * 16 * 4 * 4, kv_block_size=4, max_num_batched_tokens=24)
    rec = Recorder()
    rec.install(engine)
    names: list[str | None] = [None, *ADAPTERS]
    rows = [(names[i % len(names)], SYSTEM[:12] + _tokens(3 + i % 5, 300 + i)) for i in range(12)]
    seqs = _submit(engine, world, rows)
    for step in range(40):
        engine.step()
        engine.cache.allocator.check()
        if step in (3, 9, 15):
            engine.abort(seqs[step // 3][2])
    run_to_completion(engine, [s for _, _, s in seqs], on_step=engine.cache.allocator.check)
    assert sum(s.num_preemptions for _, _, s in seqs) > 0, "no preemption forced"
    kept = [row for i, row in enumerate(seqs) if i not in (1, 3, 5)]
    assert all(not s.aborted for _, _, s in kept)
    assert _mismatches(world, kept, rec) == []
    alloc = engine.cache.allocator
    alloc.check()
    assert alloc.num_free == alloc.num_blocks and all(alloc.holders(b) == 0 for b in range(alloc.num_blocks))
    engine.lora_runtime.manager.close()


def test_cache_off_neither_finds_nor_keeps(world, monkeypatch):
    engine = _engine(world)
    engine.scheduler.prefix_cache = False
    seqs = _submit(engine, world, [(None, [*SYSTEM, 1]), (None, [*SYSTEM, 1])])
    run_to_completion(engine, [seqs[0][2]])
    run_to_completion(engine, [seqs[1][2]])
    assert [s.cached_tokens for _, _, s in seqs] == [0, 0] and engine.cache.allocator.num_cached == 0
    engine.lora_runtime.manager.close()


# --- the allocator ------------------------------------------------------------------------------

def _fuzz(seed: int, num_blocks: int = 12, ops: int = 3000) -> None:
    """Random allocate/hold/cache/lookup/uncache/free against a model of holders and keys."""
    rng = random.Random(seed)
    alloc = BlockAllocator(num_blocks, 4)
    held: list[list[int]] = []  # one list of blocks per simulated sequence
    keys: dict[bytes, int] = {}  # the model's cache
    for _ in range(ops):
        op = rng.random()
        holders = {b: sum(t.count(b) for t in held) for b in range(num_blocks)}
        if op < 0.3:
            n = rng.randint(1, 4)
            if n > num_blocks - sum(1 for b in holders if holders[b]):
                with pytest.raises(OutOfBlocksError):
                    alloc.allocate(n)
                continue
            got = alloc.allocate(n, after=held[-1][-1] if held and held[-1] and rng.random() < 0.3 else None)
            assert all(holders[b] == 0 for b in got), "a held block allocated again"
            for b in got:  # an evicted block's key is gone
                for k in [k for k, v in keys.items() if v == b]:
                    del keys[k]
            held.append(got)
        elif op < 0.45 and keys:
            want = rng.sample(sorted(keys), k=min(len(keys), rng.randint(1, 3)))
            found = alloc.lookup(want)
            model = []
            for k in want:
                if k not in keys:
                    break
                model.append(keys[k])
            assert found == model
            if found and alloc.can_allocate(alloc.evictable_among(found)):
                alloc.hold(found)
                held.append(list(found))
        elif op < 0.6 and held:
            t = rng.choice(held)
            b = rng.choice(t)
            k = rng.randbytes(4)
            ok = alloc.cache(b, k)
            assert ok == (b not in keys.values())
            if ok:
                keys[k] = b
        elif op < 0.65 and held:
            t = rng.choice(held)
            alloc.uncache(t)
            for k in [k for k, v in keys.items() if v in t]:
                del keys[k]
        elif held:
            t = held.pop(rng.randrange(len(held)))
            alloc.free(t)
        alloc.check()
        holders = {b: sum(t.count(b) for t in held) for b in range(num_blocks)}
        assert all(alloc.holders(b) == holders[b] for b in range(num_blocks))
        assert alloc.num_free == sum(1 for b in holders if holders[b] == 0)
        assert alloc.num_cached == len(keys)
    for t in held:
        alloc.free(t)
    alloc.check()
    assert alloc.num_free == num_blocks


@pytest.mark.parametrize("seed", range(6))
def test_allocator_fuzz_keeps_its_invariants(seed):
    _fuzz(seed)


def test_allocator_takes_truly_free_blocks_before_evicting():
    alloc = BlockAllocator(4, 2)
    a = alloc.allocate(2)
    alloc.cache(a[0], b"k0")
    alloc.cache(a[1], b"k1")
    alloc.free(a)
    assert alloc.num_free == 4 and alloc.num_cached == 2
    b = alloc.allocate(2)
    assert set(b).isdisjoint(a) and alloc.num_cached == 2 and alloc.evictions == 0
    c = alloc.allocate(1)  # now an eviction: the chain's tail goes first
    assert c == [a[1]] and alloc.lookup([b"k0", b"k1"]) == [a[0]] and alloc.evictions == 1
    alloc.check()


def test_freed_twice_is_refused_cached_or_not():
    alloc = BlockAllocator(2, 2)
    a = alloc.allocate(1)
    alloc.cache(a[0], b"k")
    alloc.free(a)
    with pytest.raises(RuntimeError):
        alloc.free(a)


def test_pool_is_sized_from_the_machine_unless_set(tmp_path: Path):
    from engine.kv_budget import CPU_CAP, CPU_FLOOR, resolve_kv_cache_bytes

    assert resolve_kv_cache_bytes(123 << 20, torch.device("cpu")) == (123 << 20, "kv_cache_bytes set")
    n, why = resolve_kv_cache_bytes(0, torch.device("cpu"))
    assert CPU_FLOOR <= n <= CPU_CAP and why.startswith("auto:")


def test_a_burst_of_one_prompt_computes_it_once(world):
    """Requests that arrive together with one system prompt: the first computes its blocks, the
    others wait for them instead of computing them beside it, and every answer stays exact."""
    engine = _engine(world, max_num_batched_tokens=4096)
    tokens = 0
    forward = engine.model.forward

    def counting(ctx: Any, cache: Any) -> torch.Tensor:
        nonlocal tokens
        tokens += int(ctx.input_ids.numel())
        return forward(ctx, cache)

    engine.model.forward = counting
    rec = Recorder()
    rec.install(engine)
    rows = [("r8_all", [*SYSTEM, *_tokens(4, 400 + i)]) for i in range(4)]
    seqs = _submit(engine, world, rows)
    run_to_completion(engine, [s for _, _, s in seqs])
    assert [s.cached_tokens for _, _, s in seqs] == [0, 32, 32, 32]
    prompt_tokens = sum(len(p) for _, p in rows)
    assert tokens == prompt_tokens - 3 * 32 + 4 * (NEW - 1)
    assert _mismatches(world, seqs, rec) == []
    engine.lora_runtime.manager.close()
