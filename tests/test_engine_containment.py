"""A bad adapter or a bad row fails only its own request.

Poisons: ``lora_alpha`` 1e38 (loads; its rows overflow at run time), 1e300 (its scale
overflows float32: refused at load), NaN/Inf weights (refused at load; injected into a
device slot they overflow at run time), ``scale * B`` overflowing. Checked: the other rows
of a mixed batch (base, other adapters, both rank classes) produce the tokens they produce
without the bad row, the bad row ends with ``non_finite_output`` (or ``adapter_load_failed``),
no KV block keeps a non-finite value, blocks reused after a NaN row give what a fresh engine
gives, exceptions in the forward fail only the rows they can be pinned on, and the engine
keeps serving — with the native kernels on and off.
"""

from __future__ import annotations

import ctypes
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engine.admission_policy import FairAdmission
from engine.api import create_worker_app
from engine.engine import Engine, EngineConfig
from engine.kv_cache import BlockAllocator
from engine.lora.batch import LoRABatch
from engine.lora.manager import AdapterLoadError, AdapterManager
from engine.lora.peft import LoRAModule, LoRAWeights
from engine.lora.runtime import LoRARuntime
from engine.lora.slots import NonFiniteAdapter, SlotBank, check_finite
from engine.native_lora import _LoraCall
from engine.scheduler import AdmissionPolicy, Scheduler
from engine.sequence import SamplingParams, SeqEvent, Sequence
from engine.warmstart import warm
from loraplex.digest import digest_directory
from loraplex.peft_config import ConfigLimits
from loraplex.prefix import block_hashes, tenant_scope
from loraplex.settings import Settings
from loraplex.wire import AdapterRef
from tests.lora_fixtures import ALL, model_info, peft_adapters, run_to_completion, save_tiny_llama

UNBOUNDED = ConfigLimits(max_rank=64, max_scale=math.inf, max_delta=math.inf)
"""No admission-style bounds: the engine must contain what the bounds would refuse."""

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)


# --- unit: the load-time check ---------------------------------------------------------------

def _weights(scale: float = 2.0, a: float = 0.1, b: float = 0.1, rank: int = 4) -> LoRAWeights:
    mod = LoRAModule(torch.full((rank, 8), a), torch.full((6, rank), b), scale)
    return LoRAWeights({(0, "q_proj"): mod}, rank)


@pytest.mark.parametrize(("weights", "dtype", "words"), [
    (_weights(scale=1e300 / 8), torch.float32, "LoRA scale"),
    (_weights(scale=math.inf), torch.float32, "LoRA scale"),
    (_weights(scale=math.nan), torch.float32, "LoRA scale"),
    (_weights(a=math.nan), torch.float32, "lora_A"),
    (_weights(b=math.inf), torch.float32, "lora_B"),
    (_weights(scale=1e36, b=1e6), torch.float32, "overflows"),
    (_weights(scale=1e5), torch.float16, "LoRA scale"),
    (_weights(a=1e5), torch.float16, "lora_A"),
    (_weights(scale=100.0, b=1e3), torch.float16, "overflows"),
])
def test_check_finite_refuses_non_finite_in_the_serving_dtype(weights, dtype, words):
    with pytest.raises(NonFiniteAdapter, match=words):
        check_finite(weights, dtype)


def test_check_finite_accepts_large_but_finite():
    check_finite(_weights(scale=1e38 / 8), torch.float32)  # caught at run time instead
    check_finite(_weights(scale=100.0, b=1.0), torch.float16)


def test_slot_write_refuses_overflowing_scale_without_touching_the_slot():
    bank = SlotBank(2, {"q_proj": (8, 6)}, rank_classes=(4,), slots_per_class=2)
    bank.write(0, _weights(scale=3.0))
    with pytest.raises(NonFiniteAdapter):
        bank.write(0, _weights(scale=1e300))  # used to raise "value cannot be converted" half-way
    a, _b, scale = bank.stacks(0, 0, "q_proj")
    assert float(scale[0]) == 3.0 and float(a[0, 0, 0]) == pytest.approx(0.1)


# --- model-level world ------------------------------------------------------------------------

@dataclass
class World:
    base: Path
    good: dict[str, Path]
    poison: dict[str, Path]
    cache: Path


def _variant(src: Path, dst: Path, *, alpha: float | None = None, tensor_fn: Any = None) -> Path:
    shutil.copytree(src, dst)
    if alpha is not None:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        cfg["lora_alpha"] = alpha
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensor_fn is not None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(dst / "adapter_model.safetensors"))
        save_file({k: tensor_fn(k, v) for k, v in tensors.items()}, str(dst / "adapter_model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("containment")
    base = save_tiny_llama(root / "base")
    specs = {"r8": {"r": 8, "lora_alpha": 16, "target_modules": ALL},
             "r16": {"r": 16, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}}
    _, good = peft_adapters(base, root / "adapters", specs)
    src = good["r8"]

    def nan_first_b(key: str, t: torch.Tensor) -> torch.Tensor:
        if "layers.0." in key and "lora_B" in key:
            t = t.clone()
            t[0, 0] = math.nan
        return t

    poison = {
        "alpha1e38": _variant(src, root / "alpha1e38", alpha=1e38),
        "alpha1e30": _variant(src, root / "alpha1e30", alpha=1e30),
        "alpha1e300": _variant(src, root / "alpha1e300", alpha=1e300),
        "nan_weights": _variant(src, root / "nan_weights", tensor_fn=nan_first_b),
        "scaled_overflow": _variant(src, root / "scaled_overflow", alpha=1e36,
                                    tensor_fn=lambda k, t: t * 1e6 if "lora_B" in k else t),
    }
    return World(base, good, poison, root / "cache")


def _engine(world: World, native: bool, kv_cache_bytes: int = 1 << 20, kv_cache_dtype: str = "auto",
            weights: str = "") -> Engine:
    eng = Engine.from_path(world.base, EngineConfig(kv_cache_bytes=kv_cache_bytes, kv_block_size=16,
                                                    max_model_len=96, native_kernels=native,
                                                    kv_cache_dtype=kv_cache_dtype, weights=weights))
    info = model_info(world.base)
    bank = SlotBank.for_model(info, (8, 16), slots_per_class=4)
    rt = LoRARuntime(AdapterManager(info, bank, max_loras=8, cache_dir=str(world.cache), limits=UNBOUNDED),
                     native=native)
    eng.lora_runtime = rt
    eng.scheduler.policy = FairAdmission(rt)
    return eng


def _ref(name: str, path: Path) -> AdapterRef:
    return AdapterRef(id=f"id-{name}", name=name, uri=path.as_uri())


PROMPTS = [list(range(5, 26)), [3, 4, 5], [9] * 17, [40, 41, 42, 43, 44, 45, 46], [7] * 33]


def _good_rows(world: World) -> list[tuple[AdapterRef | None, list[int], SamplingParams]]:
    r8, r16 = _ref("r8", world.good["r8"]), _ref("r16", world.good["r16"])
    return [(None, PROMPTS[0], GREEDY), (r8, PROMPTS[1], GREEDY), (r16, PROMPTS[3], GREEDY),
            (None, PROMPTS[4], SEEDED), (r8, PROMPTS[4], SEEDED)]


def _run(eng: Engine, rows: list[tuple[AdapterRef | None, list[int], SamplingParams]],
         ) -> list[tuple[Sequence, list[SeqEvent]]]:
    """Every row to its end; a deadline in time, not steps, since rows may wait on loads."""
    out = []
    for ref, prompt, params in rows:
        events: list[SeqEvent] = []
        seq = eng.add_request(prompt, params, adapter=ref, listener=events.append)
        out.append((seq, events))
    run_to_completion(eng, [s for s, _ in out], timeout_s=60.0)
    return out


def _tokens(results: list[tuple[Sequence, list[SeqEvent]]]) -> list[list[int]]:
    return [s.output_ids for s, _ in results]


def _cache_finite(eng: Engine) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in (*eng.cache.k, *eng.cache.v))


@pytest.fixture(scope="module", params=[True, False], ids=["native", "torch"])
def native(request) -> bool:
    return request.param


@pytest.fixture(scope="module")
def expected(world, native) -> list[list[int]]:
    """The good rows' tokens on a fresh engine, without any poisoned row."""
    eng = _engine(world, native)
    try:
        return _tokens(_run(eng, _good_rows(world)))
    finally:
        eng.close()


def _poke_nan_into_slot(eng: Engine, ref: AdapterRef, value: float) -> None:
    """Corrupt a resident adapter's device slot (weights that passed the load check)."""
    manager = eng.lora_runtime.manager
    assert manager.wait(ref, timeout=30).state == "host"
    [slot] = manager.acquire_slots([ref])
    manager.release([ref])
    c, i = manager.bank.split(slot)
    a, _b, _scale = manager.bank.stacks(c, 0, "q_proj")
    a[i, 0, :] = value


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["alpha1e38", "alpha1e30", "slot_nan", "slot_inf"])
def test_poisoned_row_fails_alone_in_a_mixed_batch(world, native, expected, kind):
    eng = _engine(world, native)
    try:
        if kind.startswith("slot_"):
            bad = _ref(kind, world.good["r8"])  # a good adapter whose slot gets corrupted
            eng.lora_runtime.manager.prefetch(bad)
            _poke_nan_into_slot(eng, bad, math.nan if kind == "slot_nan" else math.inf)
        else:
            bad = _ref(kind, world.poison[kind])
        good = _good_rows(world)
        rows = [*good[:2], (bad, PROMPTS[2], GREEDY), *good[2:]]
        results = _run(eng, rows)
        bad_seq, bad_events = results.pop(2)
        assert _tokens(results) == expected
        assert all(s.finish_reason == "length" for s, _ in results)
        assert bad_seq.finish_reason == "error" and bad_seq.output_ids == []
        last = bad_events[-1]
        assert last.finished and last.error_code == "non_finite_output"
        assert kind in last.error and "non-finite" in last.error
        assert _cache_finite(eng), "a non-finite K/V value stayed in the cache"
        assert eng.fault is None  # an adapter's fault, not the worker's
        # The engine keeps serving: the same rows again give the same tokens.
        assert _tokens(_run(eng, _good_rows(world))) == expected
    finally:
        eng.close()


def test_blocks_a_non_finite_row_held_are_never_found_again(world):
    """A row that goes non-finite after starting from cached blocks: those blocks (and its own)
    leave the prefix cache, so no later request of that namespace starts from them."""
    eng = _engine(world, True)
    try:
        ref = _ref("slot_cached", world.good["r8"])
        prompt = [9] * 17 + [3]
        [(clean, _)] = _run(eng, [(ref, prompt, GREEDY)])
        assert clean.finish_reason == "length"
        keys = block_hashes(eng._cache_root(ref, tenant_scope("")), prompt, 16)
        assert eng.cache.allocator.lookup(keys) != [], "the clean run left nothing cached"
        manager = eng.lora_runtime.manager
        [slot] = manager.acquire_slots([ref])
        manager.release([ref])
        c, i = manager.bank.split(slot)
        manager.bank.stacks(c, 0, "q_proj")[0][i, 0, :] = math.nan
        [(seq, events)] = _run(eng, [(ref, prompt, GREEDY)])
        assert seq.cached_tokens == 16 and events[-1].error_code == "non_finite_output"
        assert eng.cache.allocator.lookup(keys) == []
        eng.cache.allocator.check()
        assert _cache_finite(eng)
    finally:
        eng.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["alpha1e300", "nan_weights", "scaled_overflow"])
def test_adapter_that_cannot_be_held_finitely_fails_to_load(world, native, expected, kind):
    eng = _engine(world, native)
    try:
        bad = _ref(kind, world.poison[kind])
        good = _good_rows(world)
        results = _run(eng, [*good[:2], (bad, PROMPTS[2], GREEDY), *good[2:]])
        _, bad_events = results.pop(2)
        assert _tokens(results) == expected  # no step failed
        assert bad_events[-1].error_code == "adapter_load_failed"
        assert "NaN or Inf" in bad_events[-1].error or "not finite" in bad_events[-1].error \
            or "overflows" in bad_events[-1].error
        st = eng.lora_runtime.manager.state(bad)
        assert st.state == "failed" and st.slot is None
    finally:
        eng.close()


@pytest.mark.slow
def test_blocks_reused_after_a_nan_row_give_fresh_engine_output(world, native):
    """A NaN row's blocks go back to the pool; new sequences (base and adapter) that take them,
    with a partial last block, must see exactly what they see on a fresh engine."""
    reuse = [(None, [11] * 20, GREEDY), (_ref("r8", world.good["r8"]), [12] * 5, GREEDY),
             (None, [13] * 3, GREEDY)]
    fresh = _engine(world, native, kv_cache_bytes=64 << 10)
    try:
        want = _tokens(_run(fresh, reuse))
    finally:
        fresh.close()
    eng = _engine(world, native, kv_cache_bytes=64 << 10)
    try:
        blocks_before = eng.cache.allocator.num_free
        [(bad_seq, _)] = _run(eng, [(_ref("alpha1e38", world.poison["alpha1e38"]), [9] * 40, GREEDY)])
        assert bad_seq.finish_reason == "error"
        assert eng.cache.allocator.num_free == blocks_before
        assert _cache_finite(eng)
        assert _tokens(_run(eng, reuse)) == want
    finally:
        eng.close()


# --- KV hygiene at the attention level --------------------------------------------------------

@pytest.mark.slow
def test_stale_non_finite_keys_outside_the_context_are_ignored(world, native):
    """K values a previous owner left past a sequence's length (or anywhere in free blocks)
    must not reach its attention: masked scores are set, not added to."""
    rows = [(None, [11] * 20, GREEDY), (None, [13] * 3, GREEDY), (None, list(range(30, 70)), GREEDY)]
    clean = _engine(world, native)
    try:
        want = _tokens(_run(clean, rows))
    finally:
        clean.close()
    eng = _engine(world, native)
    try:
        for k in eng.cache.k:
            k.fill_(math.nan)  # every block free: all of it stale
        assert _tokens(_run(eng, rows)) == want
    finally:
        eng.close()


@pytest.mark.slow
def test_decode_padding_never_reads_another_sequences_blocks(world):
    """Torch decode path: a short row padded to the longest row's block count reads its own
    blocks, not block 0 (which a live sequence may be filling with NaN in the same step)."""
    rows = [(None, [11] * 40, GREEDY), (None, [13] * 3, GREEDY)]

    def run(poison: bool) -> list[list[int]]:
        eng = _engine(world, native=False)
        try:
            holder = eng.cache.allocator.allocate(1)  # another sequence's block (block 0)
            assert holder == [0]
            if poison:
                for pool in (*eng.cache.k, *eng.cache.v):
                    pool.view(pool.shape[0], eng.cache.num_blocks, -1)[:, 0] = math.nan
            return _tokens(_run(eng, rows))
        finally:
            eng.close()

    assert run(poison=True) == run(poison=False)


# --- exceptions in the forward ------------------------------------------------------------------

def _fail_native_pass(monkeypatch, eng, broken_class: int) -> None:
    """Where a step's layers run in one native call, the call reports the LoRA pass that failed
    (its index) instead of raising: make it report the pass of ``broken_class`` whenever that
    class is in the step, as the kernel would."""
    decoder = eng.model.decoder
    if decoder is None:
        return
    batches: list[LoRABatch] = []
    real_steps = LoRABatch.native_steps

    def recording(self, *args):
        steps = real_steps(self, *args)
        batches.append(self)
        return steps

    class Faulty:
        def __getattr__(self, name):
            return getattr(decoder, name)

        def __call__(self, *args):
            failed = decoder(*args)
            steps = args[-1]
            if steps is not None and batches:
                hit = [k for k, p in enumerate(batches[-1]._passes) if p.class_index == broken_class]
                if hit:
                    return hit[0]
            return failed

    monkeypatch.setattr(LoRABatch, "native_steps", recording)
    monkeypatch.setattr(eng.model, "decoder", Faulty())


@pytest.mark.slow
def test_lora_exception_fails_only_that_adapters_rows(world, native, expected, monkeypatch):
    eng = _engine(world, native)
    try:
        manager = eng.lora_runtime.manager
        r16 = _ref("r16", world.good["r16"])
        broken_class = manager.bank.class_of_rank(16)
        real = LoRABatch._run_pass

        def failing(self, p, layer, x, todo):
            if p.class_index == broken_class:
                raise RuntimeError("kernel fault")
            return real(self, p, layer, x, todo)

        monkeypatch.setattr(LoRABatch, "_run_pass", failing)  # the layer-by-layer path
        _fail_native_pass(monkeypatch, eng, broken_class)  # the one-call decoder's (AVX2 float32 panels, ...)
        results = _run(eng, _good_rows(world))
        r16_seq, r16_events = results.pop(2)
        want = [t for j, t in enumerate(expected) if j != 2]
        assert _tokens(results) == want
        assert r16_seq.adapter == r16 and r16_events[-1].error_code == "adapter_error"
        assert "r16" in r16_events[-1].error
        monkeypatch.undo()
        assert _tokens(_run(eng, _good_rows(world))) == expected
        assert _cache_finite(eng)
    finally:
        eng.close()


@pytest.mark.slow
def test_lora_failure_inside_the_native_decoder_fails_only_that_adapters_rows(world, monkeypatch):
    """8-bit weights: steps with LoRA rows run every layer in one native call
    (engine.native_decoder.DecoderLayers). A LoRA call of one rank class that fails in C there (a rank
    the kernel refuses) fails that class's adapter rows alone, as a hook's exception does."""
    eng = _engine(world, True, weights="int8")
    try:
        assert eng.model.decoder is not None
        expected = _tokens(_run(eng, _good_rows(world)))
        broken_class = eng.lora_runtime.manager.bank.class_of_rank(16)
        real = LoRABatch.native_steps
        poisoned = []

        def failing(self, num_layers, inputs, cols):
            steps = real(self, num_layers, inputs, cols)
            for k, p in enumerate(self._passes):
                if steps is None or p.class_index != broken_class:
                    continue
                for at in range(k, len(steps._calls), steps.num_passes):
                    if steps._calls[at]:
                        bad = _LoraCall.from_buffer_copy(_LoraCall.from_address(steps._calls[at]))
                        bad.rank = 1 << 20  # past the kernel's MAX_RANK: it returns an error
                        poisoned.append(bad)
                        steps._calls[at] = ctypes.addressof(bad)
            return steps

        monkeypatch.setattr(LoRABatch, "native_steps", failing)
        results = _run(eng, _good_rows(world))
        _, r16_events = results.pop(2)
        assert poisoned
        assert _tokens(results) == [t for j, t in enumerate(expected) if j != 2]
        assert r16_events[-1].error_code == "adapter_error" and "r16" in r16_events[-1].error
        monkeypatch.setattr(LoRABatch, "native_steps", real)
        assert _tokens(_run(eng, _good_rows(world))) == expected
        assert _cache_finite(eng)
    finally:
        eng.close()


@pytest.mark.slow
def test_unattributed_exception_fails_the_steps_rows_and_the_engine_keeps_serving(world, native, expected):
    eng = _engine(world, native)
    try:
        forward = eng.model.forward
        calls = {"n": 0}

        def flaky(ctx, cache):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("transient fault")
            return forward(ctx, cache)

        eng.model.forward = flaky
        first = [eng.add_request(PROMPTS[0], GREEDY)]
        eng.step()  # the first step's rows fail; nothing raises out of step()
        assert first[0].finish_reason == "error"
        eng.model.forward = forward
        assert _tokens(_run(eng, _good_rows(world))) == expected
    finally:
        eng.close()


def test_admission_error_fails_only_that_request():
    class Flaky(AdmissionPolicy):
        def admit(self, seq, batch):
            if seq.prompt_ids[0] == 99:
                raise RuntimeError("policy fault")
            return True

    sched = Scheduler(BlockAllocator(16, 4), max_num_seqs=8, max_num_batched_tokens=64, max_waiting=8,
                      policy=Flaky())
    ok1, bad, ok2 = (Sequence([1, 2], GREEDY), Sequence([99, 2], GREEDY), Sequence([3], GREEDY))
    for s in (ok1, bad, ok2):
        sched.add(s)
    out = sched.schedule()
    assert [s for s, _ in out.chunks] == [ok1, ok2]
    assert [s for s, _ in out.errors] == [bad] and bad.is_finished and not bad.block_table
    assert sched.num_waiting == 0


# --- health and the warm-start hook -----------------------------------------------------------

@pytest.mark.slow
async def test_health_degraded_while_base_rows_come_out_non_finite(world, tmp_path):
    eng = _engine(world, native=True)
    try:
        app = create_worker_app(Settings(home=str(tmp_path), worker_id="w-h"), engine=eng, report=False,
                                warm_start=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w") as c:
            assert (await c.get("/health")).status_code == 200
            row = eng.model.w.embed[50].clone()
            eng.model.w.embed[50] = math.nan  # corrupted base weights: not an adapter's doing
            [(_, events)] = _run(eng, [(None, [50, 51, 52], GREEDY)])
            assert events[-1].error_code == "non_finite_output" and "base model" in events[-1].error
            h = await c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "degraded" and h.json()["error"]
            eng.model.w.embed[50] = row
            _run(eng, [(None, [50, 51, 52], GREEDY)])
            h = await c.get("/health")
            assert h.status_code == 200 and h.json()["status"] == "ok"
            assert _cache_finite(eng)
    finally:
        eng.close()


@pytest.mark.slow
def test_preloading_a_poisoned_adapter_reports_the_reason(world):
    eng = _engine(world, native=True)
    try:
        refs = [_ref(k, world.poison[k]) for k in ("alpha1e300", "alpha1e38")]
        result = warm(eng.lora_runtime.manager, refs, [])
        assert "not finite in float32" in result.failed["id-alpha1e300"]
        assert result.loaded == ["id-alpha1e38"]  # finite when stored: contained per row instead
        with pytest.raises(AdapterLoadError, match="not finite"):
            eng.lora_runtime.manager.acquire_slots([refs[0]])
    finally:
        eng.close()


@pytest.mark.slow
async def test_worker_hook_preloaded_poison_fails_only_its_requests(world, tmp_path):
    """How an end-to-end test forces poisoned adapters into a running worker without the
    registry: ``preload_adapters`` (``LORAPLEX_PRELOAD_ADAPTERS=ID=URI``), the internal load
    API, or a worker request whose ``loraplex`` extension names the adapter's URI."""
    import asyncio

    from engine.warmstart import warm_start
    from loraplex.wire import HDR_WORKER_SECRET

    secret = "containment-secret-0123"
    settings = Settings(home=str(tmp_path), model=str(world.base), worker_id="w-poison", device="cpu",
                        dtype="float32", weights="float32", kv_cache_bytes=1 << 20, max_num_seqs=8, max_loras=4,
                        lora_rank_classes=(8, 16), worker_secret=secret, max_body_bytes=64 * 1024,
                        max_lora_scale=math.inf, max_lora_delta=math.inf,
                        adapter_root=str(world.poison["alpha1e38"].parent),
                        preload_adapters=(f"p38={world.poison['alpha1e38'].as_uri()}",
                                          f"p300={world.poison['alpha1e300'].as_uri()}"))
    eng = Engine.from_settings(settings)
    eng.start()
    try:
        result = await warm_start(eng, settings)
        assert result is not None and result.loaded == ["p38"] and "not finite" in result.failed["p300"]
        app = create_worker_app(settings, engine=eng, report=False, warm_start=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://w",
                                     timeout=60, headers={HDR_WORKER_SECRET: secret}) as c:
            r = await c.post("/internal/adapters/load", headers={HDR_WORKER_SECRET: secret},
                             json={"adapter": {"id": "p300", "uri": world.poison["alpha1e300"].as_uri(),
                                               "sha256": digest_directory(world.poison["alpha1e300"])}})
            assert r.status_code == 422 and r.json()["error"]["code"] == "adapter_load_failed"
            assert "not finite in float32" in r.json()["error"]["message"]

            def req(adapter_id: str | None) -> dict:
                b: dict[str, Any] = {"prompt": "t5 t6 t7 t8", "max_tokens": 5, "temperature": 0,
                                     "ignore_eos": True}
                if adapter_id is not None:
                    path = world.poison["alpha1e38" if adapter_id == "p38" else "alpha1e300"]
                    b["loraplex"] = {"adapter": {"id": adapter_id, "name": adapter_id, "uri": path.as_uri(),
                                                 "sha256": digest_directory(path)}, "tenant": "x"}
                return b

            alone = (await c.post("/v1/completions", json=req(None))).json()["choices"][0]["text"]
            got = await asyncio.gather(*(c.post("/v1/completions", json=req(a)) for a in (None, "p38", "p300", None)))
            assert [r.status_code for r in got] == [200, 503, 503, 200]
            assert [got[i].json()["choices"][0]["text"] for i in (0, 3)] == [alone, alone]
            assert got[1].json()["error"]["code"] == "non_finite_output"
            assert got[2].json()["error"]["code"] == "adapter_load_failed"
            h = await c.get("/health")
            assert h.status_code == 200 and h.json()["status"] == "ok"
            assert (await c.post("/v1/completions", json=req(None))).json()["choices"][0]["text"] == alone
        assert _cache_finite(eng)
    finally:
        eng.close()


@pytest.mark.slow
def test_large_but_finite_float16_rows_are_not_taken_for_non_finite(world):
    """The row check sums in float32: a float16 row of large finite values must pass."""
    eng = Engine.from_path(world.base, EngineConfig(kv_cache_bytes=1 << 20, max_model_len=96, dtype="float16"))
    try:
        eng.model.w.embed[60] = 2000.0  # 64 x 2000 overflows a float16 sum, not float16 values
        [(seq, events)] = _run(eng, [(None, [60, 60, 61], GREEDY)])
        assert seq.finish_reason == "length", events[-1].error
    finally:
        eng.close()


@pytest.mark.slow
def test_failing_slot_write_fails_only_that_adapters_load(world, native, expected, monkeypatch):
    """A slot write that raises (say, out of device memory) inside admission must fail that
    adapter's requests with the reason and hand the slot back, not fail the step."""
    eng = _engine(world, native)
    try:
        bank = eng.lora_runtime.manager.bank
        real = SlotBank.write
        doomed = _ref("doomed", world.good["r8"])

        def write(self, slot, weights):
            if weights is eng.lora_runtime.manager._entries[doomed.id].weights:
                raise RuntimeError("CUDA out of memory (simulated)")
            return real(self, slot, weights)

        eng.lora_runtime.manager.prefetch(doomed)
        assert eng.lora_runtime.manager.wait(doomed, timeout=30).state == "host"
        monkeypatch.setattr(SlotBank, "write", write)
        free_before = {c: list(v) for c, v in eng.lora_runtime.manager._free.items()}
        good = _good_rows(world)
        results = _run(eng, [*good[:2], (doomed, PROMPTS[2], GREEDY), *good[2:]])
        _, events = results.pop(2)
        assert _tokens(results) == expected
        assert events[-1].error_code == "adapter_load_failed" and "out of memory" in events[-1].error
        st = eng.lora_runtime.manager.state(doomed)
        assert st.state == "failed" and st.slot is None
        in_slots = {e.slot for e in eng.lora_runtime.manager._entries.values() if e.slot is not None}
        free_after = {c: set(v) for c, v in eng.lora_runtime.manager._free.items()}
        for c, slots in free_before.items():
            assert set(slots) == free_after[c] | {s for s in in_slots if bank.split(s)[0] == c}
    finally:
        eng.close()
