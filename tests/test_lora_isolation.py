"""Cross-tenant isolation: every row of a mixed multi-LoRA batch equals PEFT for its own adapter.

A tiny random GQA Llama (a Hugging Face directory loaded by the engine) serves base rows and
rows of nine adversarial adapters (ranks 8, 16, 64; different target subsets; rsLoRA) with
strong random weights, interleaved, with mixed prompt lengths. Every logits row the engine
samples, prefill and decode, is compared with PEFT (float64) for that row's adapter alone
(``set_adapter``; ``disable_adapter()`` for base rows), and every greedy token stream with
PEFT's greedy stream for that adapter alone. The same holds with a KV pool small enough to
force preemption, with chunked prefill, and with ``max_loras`` below the number of distinct
adapters. Mutations of the slot assignment (rows swapped between adapters, an adapter leaking
into a base row, adapters silently dropped) must make the comparison fail.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.lora.batch import LoRABatch
from engine.lora.runtime import LoRARuntime
from engine.sequence import SamplingParams
from tests.lora_fixtures import (
    ISOLATION_SPECS,
    PeftReference,
    Recorder,
    attach_runtime,
    model_info,
    peft_adapters,
    refs_for,
    rel_err,
    run_to_completion,
    save_tiny_llama,
    tiny_engine,
)

TOL = 1e-4
NEW_TOKENS = 5
ADAPTERS = list(ISOLATION_SPECS)


@dataclass
class World:
    base_dir: Path
    dirs: dict[str, Path]
    reference: PeftReference
    refs: dict[str, Any]
    cache: Path


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("isolation")
    base_dir = save_tiny_llama(root / "base")
    model, dirs = peft_adapters(base_dir, root / "adapters", ISOLATION_SPECS)
    return World(base_dir, dirs, PeftReference(model), refs_for(dirs), root / "cache")


def _plan(n_rows: int = 20, seed: int = 7) -> list[tuple[str | None, list[int]]]:
    """Rows interleaved base, a1, a2, base, a3, ... with prompt lengths from 1 to 23."""
    g = torch.Generator().manual_seed(seed)
    names = itertools.cycle(ADAPTERS)
    plan: list[tuple[str | None, list[int]]] = []
    for i in range(n_rows):
        name = None if i % 3 == 0 else next(names)
        n = 1 + (i * 11) % 23
        plan.append((name, torch.randint(1, 128, (n,), generator=g).tolist()))
    return plan


def _run(world: World, engine: Any, plan: list[tuple[str | None, list[int]]],
         new_tokens: int = NEW_TOKENS, stagger: bool = True) -> tuple[list[tuple[str | None, list[int], Any]], Recorder]:
    rec = Recorder()
    rec.install(engine)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seqs = []
    for k, (name, prompt) in enumerate(plan):
        if k == len(plan) // 2 and stagger:  # later rows prefill while earlier ones decode
            for _ in range(2):
                engine.step()
        seqs.append((name, prompt, engine.add_request(prompt, params, adapter=world.refs[name] if name else None)))
    run_to_completion(engine, [s for _, _, s in seqs])
    return seqs, rec


def _warm(engine: Any, refs: Any) -> None:
    """Load every adapter into host memory before the first step, so which rows share a step
    depends on the plan alone, not on how fast the background loads ran on this machine."""
    manager = engine.lora_runtime.manager
    for ref in refs:
        manager.prefetch(ref)
    for ref in refs:
        assert manager.wait(ref, timeout=60).state in ("host", "device"), ref


def _mismatches(world: World, seqs: list[tuple[str | None, list[int], Any]], rec: Recorder,
                new_tokens: int = NEW_TOKENS) -> list[str]:
    """Every recorded row against PEFT for its adapter alone; greedy streams against PEFT's."""
    bad: list[str] = []
    for name, prompt, seq in seqs:
        rows = rec.rows.get(seq.seq_id, [])
        covered = {len(prefix) for prefix, _ in rows}
        missing = set(range(len(prompt), len(prompt) + new_tokens)) - covered
        if missing:
            bad.append(f"{name}: no logits for positions {sorted(missing)}")
        for prefix, logits in rows:
            err = rel_err(logits, world.reference.logits(name, prefix))
            if not err < TOL:
                bad.append(f"{name} seq {seq.seq_id} at {len(prefix)}: rel err {err:.2e}")
        want = world.reference.greedy(name, prompt, new_tokens)
        if seq.output_ids != want:
            bad.append(f"{name} seq {seq.seq_id}: greedy {seq.output_ids} != {want}")
    return bad


def _close(engine: Any) -> None:
    rt = engine.lora_runtime
    if rt is not None:
        assert all(rt.manager.state(f"id-{n}").users == 0 for n in ADAPTERS), "finished sequences keep slots"
        rt.manager.close()


# --- the reference itself is adversarial ------------------------------------------------------

def test_adapters_are_adversarial(world):
    """Each adapter moves the logits far from the base and from every other adapter."""
    prompt = _plan()[1][1]
    outs = {n: world.reference.logits(n, prompt) for n in [None, *ADAPTERS]}
    for a, b in itertools.combinations(outs, 2):
        assert rel_err(outs[a], outs[b]) > 0.05, (a, b)


# --- isolation --------------------------------------------------------------------------------

def test_mixed_batch_every_row_matches_its_adapter_alone(world):
    engine = tiny_engine(world.base_dir)
    attach_runtime(engine, model_info(world.base_dir), world.cache)
    _warm(engine, world.refs.values())
    plan = _plan()
    seqs, rec = _run(world, engine, plan)
    assert _mismatches(world, seqs, rec) == []
    # One step held base rows and at least 8 different adapters together, prefill and decode.
    assert max(len(s) for s in rec.step_adapters) >= 8
    assert any(p > 0 and d > 0 for p, d in rec.step_kinds), rec.step_kinds
    _close(engine)


def test_rank16_adapter_changes_outputs(world):
    """No silent 'adapter not applied': a rank-16 row differs from the base row on the same prompt."""
    engine = tiny_engine(world.base_dir)
    attach_runtime(engine, model_info(world.base_dir), world.cache)
    prompt = _plan()[4][1]
    seqs, rec = _run(world, engine, [(None, prompt), ("r16_all", prompt)], new_tokens=3)
    (_, _, base), (_, _, lora) = seqs
    assert rel_err(rec.rows[lora.seq_id][0][1], rec.rows[base.seq_id][0][1]) > 0.05
    assert _mismatches(world, seqs, rec, new_tokens=3) == []
    _close(engine)


def test_isolation_under_forced_preemption_and_chunked_prefill(world):
    """A KV pool of a few blocks: sequences are preempted and recomputed; streams stay exact."""
    # 4-token blocks; the pool holds about two sequences' worth, prefill chunks of at most 8 tokens.
    engine = tiny_engine(world.base_dir, kv_cache_bytes=14 * 2 * 2 * 2 * 16 * 4 * 4, kv_block_size=4,
                         max_num_batched_tokens=24)
    attach_runtime(engine, model_info(world.base_dir), world.cache)
    _warm(engine, world.refs.values())  # every row competes for the pool from the first step
    plan = _plan(16, seed=11)
    seqs, rec = _run(world, engine, plan, new_tokens=8)
    assert sum(s.num_preemptions for _, _, s in seqs) > 0, "the pool was large enough: no preemption forced"
    assert _mismatches(world, seqs, rec, new_tokens=8) == []
    _close(engine)


def test_isolation_with_fewer_slots_than_adapters(world):
    """max_loras=3 for nine adapters: requests wait for slots, each result still its adapter's."""
    engine = tiny_engine(world.base_dir)
    attach_runtime(engine, model_info(world.base_dir), world.cache, max_loras=3, slots_per_class=2)
    plan = _plan(18, seed=13)
    seqs, rec = _run(world, engine, plan)
    assert max(len(s) for s in rec.step_adapters) <= 3
    assert set().union(*rec.step_adapters) == {f"id-{n}" for n in ADAPTERS}
    assert _mismatches(world, seqs, rec) == []
    _close(engine)


def test_logprobs_of_every_row_equal_peft_log_softmax(world):
    """Mixed batch, every row asking for logprobs: each greedy token's logprob and its top 5 equal
    ``log_softmax`` of PEFT's logits for that row's adapter alone (within 1e-3)."""
    engine = tiny_engine(world.base_dir)
    attach_runtime(engine, model_info(world.base_dir), world.cache)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True,
                            top_logprobs=5)
    seqs = [(name, prompt, engine.add_request(prompt, params, adapter=world.refs[name] if name else None))
            for name, prompt in _plan(12, seed=5)]
    run_to_completion(engine, [s for _, _, s in seqs])
    worst = 0.0
    for name, prompt, seq in seqs:
        assert [e.token for e in seq.logprobs] == seq.output_ids and len(seq.output_ids) == NEW_TOKENS
        ids = list(prompt)
        for e in seq.logprobs:
            ref = torch.log_softmax(world.reference.logits(name, ids).double(), dim=-1)
            top = ref.topk(5)
            assert [t for t, _ in e.top] == top.indices.tolist(), (name, len(ids))
            errs = [abs(e.logprob - float(ref[e.token]))]
            errs += [abs(lp - float(v)) for (_, lp), v in zip(e.top, top.values, strict=True)]
            worst = max(worst, *errs)
            ids.append(e.token)
    assert worst < 1e-3, worst
    _close(engine)


def test_isolation_with_samples_sharing_prompt_blocks(world):
    """n=3 requests of different adapters and base, sampled: every logits row of every sample (the
    ones starting from their first sample's shared prompt blocks included) equals PEFT for its
    adapter alone on that sample's own tokens."""
    engine = tiny_engine(world.base_dir, kv_block_size=4)
    attach_runtime(engine, model_info(world.base_dir), world.cache)
    rec = Recorder()
    rec.install(engine)
    rows = []
    for k, (name, prompt) in enumerate(_plan(9, seed=23)):
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=100 + k, ignore_eos=True, n=3)
        first = engine.add_request(prompt, params, adapter=world.refs[name] if name else None)
        rows += [(name, s) for s in first.samples]
    run_to_completion(engine, [s for _, s in rows])
    assert len({tuple(s.output_ids) for _, s in rows}) > len(rows) // 3  # samples differ
    assert any(s.share_from is not None and s.num_preemptions == 0 for _, s in rows)
    bad = []
    for name, seq in rows:
        got = rec.rows.get(seq.seq_id, [])
        assert len(got) == NEW_TOKENS, (name, seq.index, len(got))
        for prefix, logits in got:
            err = rel_err(logits, world.reference.logits(name, prefix))
            if not err < TOL:
                bad.append(f"{name} sample {seq.index} at {len(prefix)}: rel err {err:.2e}")
    assert bad == []
    assert engine.cache.allocator.num_used == 0
    _close(engine)


# --- grammar-constrained rows -----------------------------------------------------------------

JSON_SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "bb", "ccc"]}},
     "required": ["ok", "tag"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,5}$"}},
     "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     "required": ["xs"], "additionalProperties": False},
]
JSON_ADAPTERS = ["r8_all", "r16_mlp", "r64_qv"]


@pytest.fixture(scope="module")
def json_world(tmp_path_factory) -> World:
    """A tiny Llama with a byte-level BPE tokenizer (JSON can be spelled) and three adapters."""
    from tests.engine_fixtures import make_tiny_model

    root = tmp_path_factory.mktemp("isolation_json")
    base_dir = make_tiny_model(root / "base", "llama")
    model, dirs = peft_adapters(base_dir, root / "adapters", {n: ISOLATION_SPECS[n] for n in JSON_ADAPTERS})
    return World(base_dir, dirs, PeftReference(model), refs_for(dirs), root / "cache")


def _greedy_under_grammar(world: World, grammars: Any, name: str | None, prompt: list[int], key: str,
                          n: int) -> list[int]:
    """PEFT's greedy tokens for ``name`` alone, masked by its own matcher of the same grammar."""
    import xgrammar as xgr

    m = grammars.matcher(key)
    ids, out = list(prompt), []
    for _ in range(n):
        logits = world.reference.logits(name, ids).clone().unsqueeze(0)
        bitmask = xgr.allocate_token_bitmask(1, logits.shape[1])
        m.fill_next_token_bitmask(bitmask, 0)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        t = int(logits.argmax())
        out.append(t)
        if not m.accept_token(t) or m.is_terminated():
            break
        ids.append(t)
    return out


def test_isolation_with_grammar_constrained_rows(json_world):
    """Base and adapter rows, three schemas and free rows in the same steps: every raw logits row
    equals PEFT for its adapter alone, every constrained row equals PEFT's greedy under the same
    grammar (and is valid JSON for its schema), every free row PEFT's plain greedy."""
    import json

    import jsonschema

    from loraplex.openai_request import spec_key

    world = json_world
    engine = tiny_engine(world.base_dir)
    attach_runtime(engine, model_info(world.base_dir), world.cache)
    _warm(engine, world.refs.values())
    rec = Recorder()
    rec.install(engine)
    names = itertools.cycle([None, *JSON_ADAPTERS])
    rows = []
    for i, (_, prompt) in enumerate(_plan(16, seed=17)):
        name = next(names)
        schema = JSON_SCHEMAS[i % 3] if i % 4 != 3 else None
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=schema is None,
                                grammar=spec_key("json_schema", schema) if schema else None)
        if i == 8:  # later rows prefill while earlier ones decode
            engine.step()
        rows.append((name, prompt, schema, engine.add_request(prompt, params, adapter=world.refs[name] if name else None)))
    run_to_completion(engine, [s for *_, s in rows])
    assert max(len(s) for s in rec.step_adapters) >= 3
    bad: list[str] = []
    for name, prompt, schema, seq in rows:
        for prefix, logits in rec.rows[seq.seq_id]:
            err = rel_err(logits, world.reference.logits(name, prefix))
            if not err < TOL:
                bad.append(f"{name} seq {seq.seq_id} at {len(prefix)}: rel err {err:.2e}")
        if schema is None:
            want = world.reference.greedy(name, prompt, 40)
        else:
            want = _greedy_under_grammar(world, engine.grammars, name, prompt, seq.params.grammar, 40)
            if seq.finish_reason == "stop":
                jsonschema.validate(json.loads(seq.output_text), schema)
        if seq.output_ids != want:
            bad.append(f"{name} seq {seq.seq_id} (schema {schema is not None}): {seq.output_ids} != {want}")
    assert sum(s.finish_reason == "stop" for *_, sch, s in rows if sch) >= 6
    assert bad == []
    _close(engine)


# --- the test can fail ------------------------------------------------------------------------

class _MutatedRuntime(LoRARuntime):
    """Correct admission, but the per-step slot ids are tampered with before the forward."""

    mode = "swap"

    def prepare_batch(self, ctx: Any) -> None:
        super().prepare_batch(ctx)
        slots = ctx.seq_slots.clone()
        used = sorted({int(s) for s in slots.tolist() if s >= 0})
        if self.mode == "swap" and len(used) >= 2:  # each adapter row gets the next adapter's slot
            nxt = {a: b for a, b in zip(used, used[1:] + used[:1], strict=True)}
            slots = torch.tensor([nxt.get(int(s), int(s)) for s in slots.tolist()])
        elif self.mode == "leak" and used:  # base rows get some tenant's adapter
            slots = torch.where(slots < 0, used[0], slots)
        elif self.mode == "drop":  # adapters silently not applied
            slots = torch.full_like(slots, -1)
        token_slots = slots[ctx.token_seq.cpu()]
        batch = LoRABatch.build(self.manager.bank, token_slots)
        ctx.seq_slots = slots
        ctx.lora = None if batch.empty else batch


@pytest.mark.parametrize("mode", ["swap", "leak", "drop"])
def test_mutated_slot_assignment_is_caught(world, mode):
    engine = tiny_engine(world.base_dir)
    runtime_cls = type(f"Mutated_{mode}", (_MutatedRuntime,), {"mode": mode})
    attach_runtime(engine, model_info(world.base_dir), world.cache, runtime_cls=runtime_cls)
    # Adapters in host memory first, so adapter rows share steps with base rows from the start
    # (otherwise fast base rows may finish before any adapter loads, and nothing can leak).
    manager = engine.lora_runtime.manager
    for name in ADAPTERS:
        manager.prefetch(world.refs[name])
    deadline = time.monotonic() + 120
    while not all(manager.ready(world.refs[name]) for name in ADAPTERS):
        assert time.monotonic() < deadline, "adapters did not load"
        time.sleep(0.01)
    plan = _plan(12, seed=17)
    seqs, rec = _run(world, engine, plan, new_tokens=2)
    bad = _mismatches(world, seqs, rec, new_tokens=2)
    wrong_rows = {line.split(" ")[0] for line in bad}
    if mode == "leak":
        assert wrong_rows == {"None"}, bad  # exactly the base rows are wrong
    else:
        assert wrong_rows == {n for n, _ in plan if n}, bad  # exactly the adapter rows are wrong
    _close(engine)


# --- the demo model and its shipped adapters --------------------------------------------------

DEMO_ADAPTERS = Path(__file__).resolve().parent.parent / "demo" / "adapters"
QUESTIONS = ["How do I reset my password?", "Can I get a refund for my order?"]


@pytest.mark.slow
def test_demo_adapters_mixed_batch_equal_peft_greedy(tmp_path):
    """Demo model: french, json and terse rows mixed with base rows; each row's first 16 greedy
    tokens equal transformers+PEFT greedy for that adapter alone, and each differs from base."""
    import peft

    from engine.engine import Engine, EngineConfig
    from loraplex.modelinfo import describe_model
    from loraplex.wire import AdapterRef
    from tests.engine_fixtures import demo_model_file, hf_demo_model, hf_demo_tokenizer

    gguf = demo_model_file()

    tok = hf_demo_tokenizer()
    prompts = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    names = ["french", "json", "terse"]
    engine = Engine.from_path(gguf, EngineConfig(kv_cache_bytes=64 << 20, max_model_len=512))
    rt = attach_runtime(engine, describe_model(gguf), tmp_path / "cache", max_loras=4, slots_per_class=4)
    refs = {n: AdapterRef(id=f"demo-{n}", name=n, uri=(DEMO_ADAPTERS / n).as_uri()) for n in names}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=5)
    rows = [(n, p) for p in prompts for n in (None, *names)]  # interleaved: base, french, json, terse, base, ...
    seqs = [(n, p, engine.add_request(p, params, adapter=refs[n] if n else None)) for n, p in rows]
    run_to_completion(engine, [s for _, _, s in seqs], timeout_s=300)
    assert all(rt.manager.state(r).users == 0 for r in refs.values())
    rt.manager.close()

    model = peft.PeftModel.from_pretrained(hf_demo_model(), str(DEMO_ADAPTERS / "french"), adapter_name="french")
    try:
        for n in names[1:]:
            model.load_adapter(str(DEMO_ADAPTERS / n), adapter_name=n)
        model.eval()
        ours = {(n, tuple(p)): s.output_ids for n, p, s in seqs}
        seq_of = {(n, tuple(p)): s for n, p, s in seqs}
        for n, p, _ in seqs:
            x = torch.tensor([p])
            kw = dict(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16,
                      min_new_tokens=16, pad_token_id=tok.eos_token_id)
            with torch.no_grad():
                if n is None:
                    with model.disable_adapter():
                        ref = model.generate(**kw)[0, x.shape[1]:].tolist()
                else:
                    model.set_adapter(n)
                    ref = model.generate(**kw)[0, x.shape[1]:].tolist()
            got = ours[n, tuple(p)]
            _check_logprobs(model, n, p, got, seq_of[n, tuple(p)].logprobs)
            # EOS is suppressed by min_new_tokens in the reference: compare up to our first EOS.
            cut = next((i for i, t in enumerate(got) if t in engine.eos_token_ids), len(got))
            assert got[:cut] == ref[:cut], (n, tok.decode(got), tok.decode(ref))
            if n is not None:
                assert got != ours[None, tuple(p)], f"{n} output equals the base model's"
    finally:
        model.unload()  # give hf_demo_model() back without adapter layers


def _check_logprobs(model: Any, adapter: str | None, prompt: list[int], out: list[int], entries: list[Any]) -> None:
    """Our logprobs of ``out`` (and top 5) against transformers+PEFT ``log_softmax`` on the same
    tokens (teacher-forced), within 1e-3."""
    x = torch.tensor([prompt + out])
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                logits = model(input_ids=x).logits[0]
        else:
            model.set_adapter(adapter)
            logits = model(input_ids=x).logits[0]
    ref = torch.log_softmax(logits[len(prompt) - 1:-1].double(), dim=-1)
    assert [e.token for e in entries] == out
    for i, e in enumerate(entries):
        assert abs(e.logprob - float(ref[i, e.token])) < 1e-3, (adapter, i, e.logprob, float(ref[i, e.token]))
        top = ref[i].topk(5)
        assert max(abs(lp - float(v)) for (_, lp), v in zip(e.top, top.values, strict=True)) < 1e-3, (adapter, i)
