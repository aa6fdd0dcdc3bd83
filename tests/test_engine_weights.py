"""Base weights in bfloat16 under float32 activations (``LORAPLEX_WEIGHTS=bfloat16``).

The base model's projection matrices are stored in bfloat16 (half the memory; on CPUs with
AVX512-BF16 or AMX, twice the matmul rate) while activations, the LoRA branch (unmerged) and
attention stay float32; the KV cache follows (bfloat16 by default, see
tests/test_kv_cache_dtype.py). Checked here: the matmul's rounding contract for one
row and for batches, where the bytes go, the setting, cross-tenant isolation of a mixed
multi-LoRA batch in this format, and (slow) accuracy gates on the demo model against the
float32 engine, with and without an adapter.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.cpu import cpu_has_bf16_matmul
from engine.engine import Engine, EngineConfig, resolve_weights
from engine.linear import BF16Linear, Linear
from engine.lora.batch import LoRABatch
from engine.native import gemv_kernel, panel_matmul_kernel
from engine.quant import INT4
from engine.scoring import agreement, forced_logits
from engine.sequence import SamplingParams, Sequence
from engine.step_batch import build_batch
from loraplex.settings import Settings
from tests.engine_fixtures import demo_gguf  # noqa: F401  (fixture)
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


@pytest.mark.parametrize("rows", [1, 2, 5, 32])
@pytest.mark.parametrize("native", [True, False], ids=["native-gemv", "torch"])
def test_bf16_linear_rounds_like_a_bfloat16_matmul(rows, native):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 80, generator=gen)
    b = torch.randn(96, generator=gen)
    lin = BF16Linear(w.bfloat16(), b, pack_batch=32, gemv=gemv_kernel() if native else None)
    x = torch.randn(rows, 80, generator=gen)
    y = lin(x)
    exact = x.bfloat16().double() @ w.bfloat16().double().T
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    ulp = exact.abs().clamp_min(1e-30) * 2.0 ** -7
    assert ((y.double() - (exact.bfloat16().double() + b.double())).abs() <= ulp + 1e-6).all()


def test_weights_setting_resolves_and_refuses_what_it_cannot_serve(monkeypatch):
    assert resolve_weights("auto", torch.float32) == torch.float32
    assert resolve_weights("", torch.bfloat16) == torch.bfloat16
    assert resolve_weights("bfloat16", torch.float32) == torch.bfloat16
    assert resolve_weights("bf16", torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown weights"):
        resolve_weights("int3", torch.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16 activations"):
        resolve_weights("bfloat16", torch.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16 activations"):
        resolve_weights("float32", torch.bfloat16)
    monkeypatch.setenv("LORAPLEX_WEIGHTS", "bfloat16")
    assert Settings.from_env().weights == "bfloat16"


@pytest.mark.parametrize(("flags", "want"), [
    ({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"}, "bfloat16"),  # AMX Xeon
    ({"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"}, "bfloat16"),  # Zen 4 / Zen 5
    ({"avx2", "fma", "avx512f", "avx512_vnni"}, "float32"),  # Ice Lake, Cascade Lake: no native bfloat16
    ({"avx2", "fma"}, "float32"),  # Zen 3, Haswell to Alder Lake
    ({"sse2"}, "float32"),
])
def test_auto_weights_follow_the_cpu(monkeypatch, flags, want):
    """``weights=auto`` is bfloat16 where the CPU multiplies it natively, else float32 (float32
    activations on CPU only: CUDA and bfloat16 activations keep their dtype); the worker says
    which and why."""
    import engine.cpu as cpu
    import engine.engine as eng

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(eng, "default_weights", cpu.default_weights)
    chosen, why = cpu.default_weights()
    assert chosen == want and why
    expected = {"bfloat16": torch.bfloat16, "int8": torch.int8, "int4": INT4, "float32": torch.float32}[want]
    assert resolve_weights("auto", torch.float32, torch.device("cpu")) == expected
    assert resolve_weights("auto", torch.float32) == torch.float32  # no device named: the activations' dtype
    assert resolve_weights("", torch.float16, torch.device("cpu")) == torch.float16  # the library's default
    assert resolve_weights("auto", torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert resolve_weights("float32", torch.float32, torch.device("cpu")) == torch.float32
    assert EngineConfig().weights == "" and Settings().weights == "auto"


def test_an_auto_engine_serves_this_cpus_format_and_says_why(tmp_path):
    from engine.cpu import default_weights
    from engine.quant import dtype_name
    from tests.engine_fixtures import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny", "llama")
    auto = Engine.from_path(path, EngineConfig(weights="auto", kv_cache_bytes=1 << 20, max_model_len=64))
    chosen, why = default_weights()
    assert dtype_name(auto.model.matmul_dtype) == chosen and auto.weights_reason == f"auto: {why}"
    exact = Engine.from_path(path, EngineConfig(kv_cache_bytes=1 << 20, max_model_len=64))
    assert exact.model.matmul_dtype == torch.float32 and exact.weights_reason == "the activations' dtype"
    prompt = exact.tokenizer.encode("def add(a, b):")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(auto.generate([prompt], [params])[0].output_ids) == 8


@pytest.fixture(scope="module")
def lora_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16-weights")
    base_dir = save_tiny_llama(root / "base")
    model, dirs = peft_adapters(base_dir, root / "adapters", ISOLATION_SPECS)
    return base_dir, dirs, PeftReference(model), refs_for(dirs), root


def test_bf16_weights_hold_the_base_in_half_the_memory_and_keep_the_rest_float32(lora_world):
    base_dir, *_, root = lora_world
    f32 = tiny_engine(base_dir)
    bf16 = tiny_engine(base_dir, weights="bfloat16")
    assert bf16.model.weight_bytes < 0.55 * f32.model.weight_bytes
    layer = bf16.model.layers[0]
    assert all(isinstance(getattr(layer, n), BF16Linear) for n in ("qkv", "o", "gate_up", "down"))
    assert all(isinstance(getattr(f32.model.layers[0], n), Linear) for n in ("qkv", "o", "gate_up", "down"))
    assert bf16.model.w.layers[0].input_norm.dtype == torch.float32
    assert bf16.model.dtype == torch.float32 and bf16.cache.k[0].dtype == torch.bfloat16
    rt = attach_runtime(bf16, model_info(base_dir), root / "cache-mem")
    # The LoRA branch is never merged: its math stays float32, its A/B are stored in bfloat16.
    assert rt.manager.bank.dtype == torch.float32 and rt.manager.bank.weights_dtype == torch.bfloat16
    rt.manager.close()
    engine = Engine.from_settings(Settings(model=str(base_dir), weights="bfloat16", max_loras=2,
                                           adapter_cache_dir=str(root / "cache-worker")))
    assert engine.lora_runtime.manager.bank.weights_dtype == torch.bfloat16, "the worker's slots as these"
    engine.lora_runtime.manager.close()


def test_bf16_weights_keep_matmul_outputs_narrow_without_changing_a_bit(lora_world):
    """A step without LoRA rows hands each bfloat16 matmul output to the next step as it is
    (the norms and SwiGLU read and write bfloat16): the logits are bit for bit those of the
    path that widens every output to float32 and rounds it again, prefill and decode alike."""
    base_dir, *_ = lora_world
    engine = tiny_engine(base_dir, weights="bfloat16")
    assert engine.model.bf16_flow, "bfloat16 matrices with the native elementwise steps"
    assert not tiny_engine(base_dir).model.bf16_flow
    prompt = torch.randint(1, 128, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    narrow = forced_logits(engine, prompt, 17)
    if cpu_has_bf16_matmul():
        # The whole step in one native call (engine.native_decoder.DecoderLayers): the same bits as the
        # layers' kernels called one by one, with SwiGLU fused into gate|up and without.
        assert engine.model.decoder is not None
        engine.model.fused_swiglu = False
        assert torch.equal(forced_logits(engine, prompt, 17), narrow)
        engine.model.decoder = None
        assert torch.equal(forced_logits(engine, prompt, 17), narrow)
        engine.model.fused_swiglu = True  # SwiGLU in the gate|up matmul's epilogue: the same bits again
        assert torch.equal(forced_logits(engine, prompt, 17), narrow)
    engine.model.bf16_flow = False
    assert torch.equal(forced_logits(engine, prompt, 17), narrow)


# The float32 panel kernel is built for AVX2 CPUs without AVX-512; tests/test_native_march.py
# runs these tests with the AVX2 build on AVX-512 machines.
NO_PANELS = pytest.mark.skipif(panel_matmul_kernel() is None, reason="this build has no float32 panel kernel")


@pytest.mark.parametrize("weights", [
    pytest.param("bfloat16", marks=pytest.mark.skipif(not cpu_has_bf16_matmul(),
                                                      reason="the tile kernel needs AVX512-BF16 or AMX")),
    "int8", "int4", pytest.param("auto", marks=NO_PANELS)])
@pytest.mark.parametrize("lora", [False, True], ids=["base", "adapters"])
def test_native_decoder_layers_match_the_kernels_called_one_by_one(lora_world, weights, lora, monkeypatch):
    """A mixed step (decode rows of sequences of different lengths beside a prefill chunk; with
    ``lora``, rows of three adapters of different rank classes and targets beside a base row) in
    the one native call of engine.native_decoder.DecoderLayers: the logits, the residual stream's
    finiteness and the K/V it writes are bit for bit those of the layers' kernels and LoRA hooks
    called one by one."""
    base_dir, _, _, refs, root = lora_world
    engine = tiny_engine(base_dir, weights=weights)
    model, cache = engine.model, engine.cache
    assert model.decoder is not None
    rt = attach_runtime(engine, model_info(base_dir), root / f"cache-decoder-{weights}") if lora else None
    names = [None, "r8_all", "r64_qv", "rs16_qvd"] if lora else [None] * 4
    g = torch.Generator().manual_seed(3)
    seqs = [Sequence(torch.randint(1, 128, (n,), generator=g).tolist(), SamplingParams(temperature=0.0),
                     adapter=refs[name] if name else None) for name, n in zip(names, (5, 17, 30, 9), strict=True)]
    for seq in seqs:
        seq.block_table.extend(cache.allocator.allocate(cache.allocator.blocks_for(seq.num_tokens + 1)))
        if rt is not None:
            rt.prefetch(seq)
            while not rt.admit(seq, []):
                assert rt.failure(seq) is None
    hooks = []
    real = LoRABatch._run_pass
    monkeypatch.setattr(LoRABatch, "_run_pass", lambda self, *a: (hooks.append(1), real(self, *a))[1])

    def step(chunks):
        ctx = build_batch(chunks, cache.block_size, model.device)
        if rt is not None:
            rt.prepare_batch(ctx)
            assert ctx.lora is not None
        return model.forward(ctx, cache), ctx.row_finite

    step([(s, s.num_tokens) for s in seqs[:3]])
    for s in seqs[:3]:
        s.num_computed = s.num_tokens
        s.output_ids.append(int(torch.randint(1, 128, (1,), generator=g)))
    mixed = [(s, 1) for s in seqs[:3]] + [(seqs[3], 9)]
    logits, finite = step(mixed)
    assert not hooks, "the LoRA rows applied inside the native call"
    pools = [p.clone() for p in cache.k + cache.v]
    for pool in cache.k + cache.v:
        pool.zero_()
    decoder, model.decoder = model.decoder, None
    try:
        for s in seqs[:3]:  # the same cache contents, written by the kernels one by one
            s.num_computed = 0
        step([(s, s.num_tokens - 1) for s in seqs[:3]])
        for s in seqs[:3]:
            s.num_computed = s.num_tokens - 1
        ref_logits, ref_finite = step(mixed)
    finally:
        model.decoder = decoder
        if rt is not None:
            rt.manager.close()
    assert bool(hooks) == lora
    assert logits.shape == (4, model.cfg.vocab_size)
    assert torch.equal(logits, ref_logits) and torch.equal(finite, ref_finite) and bool(finite.all())
    assert all(torch.equal(a, b) for a, b in zip(pools, cache.k + cache.v, strict=True))


@NO_PANELS
def test_float32_panels_take_the_one_call_decoder_for_prefill_and_single_rows(lora_world):
    """Float32 weights on the panel kernel go through engine.native_decoder.DecoderLayers too: a prompt's
    prefill on the panels and one sequence's decode rows on the gemv, as Linear runs them, give
    the logits of the layer-by-layer path bit for bit."""
    base_dir, *_ = lora_world
    engine = tiny_engine(base_dir)
    model = engine.model
    assert isinstance(model.layers[0].qkv, Linear) and model.layers[0].qkv.panels is not None
    assert model.decoder is not None, "float32 panels run the one-call decoder"
    prompt = torch.randint(1, 128, (23,), generator=torch.Generator().manual_seed(7)).tolist()
    one_call = forced_logits(engine, prompt, 17)
    model.decoder = None
    assert torch.equal(forced_logits(engine, prompt, 17), one_call)


NEW = 5


def _plan(n_rows: int = 18, seed: int = 11) -> list[tuple[str | None, list[int]]]:
    g = torch.Generator().manual_seed(seed)
    names = itertools.cycle(ISOLATION_SPECS)
    return [(None if i % 3 == 0 else next(names), torch.randint(1, 128, (1 + (i * 7) % 19,), generator=g).tolist())
            for i in range(n_rows)]


def _rows(engine, refs, plan):
    rec = Recorder()
    rec.install(engine)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    seqs = [(name, engine.add_request(p, params, adapter=refs[name] if name else None)) for name, p in plan]
    run_to_completion(engine, [s for _, s in seqs])
    return [(name, s, rec.rows[s.seq_id]) for name, s in seqs]


def assert_rows_isolated(lora_world, alone_tol: float, own_tol: float = 0.1, margin: float = 10.0,
                         **engine_kw) -> None:
    """Each row of a mixed batch (base rows and nine adversarial adapters, prefill and decode
    together) on an engine of ``engine_kw`` equals the same request served alone (logits within
    ``alone_tol`` relative error) and is closer to PEFT in float32 for its own adapter than to any
    other's: within ``own_tol`` relative error and ``margin`` times closer."""
    base_dir, _, reference, refs, root = lora_world
    plan = _plan()
    mixed = tiny_engine(base_dir, **engine_kw)
    attach_runtime(mixed, model_info(base_dir), root / "cache-mixed")
    together = _rows(mixed, refs, plan)
    alone_engine = tiny_engine(base_dir, **engine_kw)
    attach_runtime(alone_engine, model_info(base_dir), root / "cache-alone")
    names = [None, *ISOLATION_SPECS]
    for (name, seq, rows), item in zip(together, plan, strict=True):
        ((_, seq_alone, rows_alone),) = _rows(alone_engine, refs, [item])
        assert seq.output_ids == seq_alone.output_ids, name
        assert len(rows) == len(rows_alone) == NEW
        for (prefix, logits), (prefix_alone, logits_alone) in zip(rows, rows_alone, strict=True):
            assert prefix == prefix_alone
            assert rel_err(logits, logits_alone) < alone_tol, name
            errs = {n: rel_err(logits, reference.logits(n, prefix)) for n in names}
            others = min(e for n, e in errs.items() if n != name)
            assert errs[name] < own_tol and errs[name] < others / margin, (name, errs)
    for eng in (mixed, alone_engine):
        eng.lora_runtime.manager.close()


def test_mixed_batch_rows_equal_each_request_alone_with_bf16_weights(lora_world):
    """Cross-tenant isolation in this format: each row of a mixed batch (base rows and nine
    adversarial adapters, prefill and decode together) equals the same request served alone,
    to bfloat16 rounding, and is closer to PEFT for its own adapter than to any other's (ten times
    closer, with the adapters' A/B stored in bfloat16 as the worker stores them, and bfloat16 K/V,
    the default with bfloat16 weights). Measured: own error up to 0.071, at most 0.071 of the
    nearest other's (float32 K/V: 0.067 and 0.054; float32 slots too: 0.028 -- these adapters'
    deltas are as large as the logits, so the slots' bfloat16 rounding shows)."""
    assert_rows_isolated(lora_world, 1e-2, weights="bfloat16")


# --- accuracy gates on the demo model (slow) -----------------------------------------------------

CHATS = ["Write one sentence about the sea.", "Explain gravity to a child.", "Write a haiku about autumn.",
         "How do I sort a list in Python?"]


@pytest.mark.slow
def test_demo_bf16_weights_track_float32_and_keep_the_adapters_delta(demo_gguf, tmp_path):  # noqa: F811
    """Measured on the demo model (SmolLM2-135M, Q4_1 weights widened), bfloat16 weights and
    (by default with them) bfloat16 K/V: top-1 agreement 0.97-1.0, KL per token 3e-4..7e-4
    mean, about 5e-3 max, base and adapter alike (float32 K/V: much the same). The gates leave
    room for other CPUs' summation order, not for a broken kernel (which gives KL > 0.1)."""
    from tests.test_demo_adapters import ADAPTERS

    f32 = Engine.from_path(demo_gguf, EngineConfig(kv_cache_bytes=1 << 26))
    bf16 = Engine.from_path(demo_gguf, EngineConfig(kv_cache_bytes=1 << 26, weights="bfloat16"))
    assert bf16.cache.dtype == torch.bfloat16
    info = model_info(demo_gguf)
    for eng, sub in ((f32, "a"), (bf16, "b")):
        attach_runtime(eng, info, tmp_path / sub)
    french = refs_for({"french": ADAPTERS / "french"})["french"]
    prompts = [f32.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in CHATS]
    for adapter in (None, french):
        got = agreement(f32, bf16, prompts, 32, adapter)
        assert got["top1_agreement"] >= 0.93 and got["kl_mean"] <= 2e-3 and got["kl_max"] <= 5e-2, (adapter, got)
    # The LoRA delta is applied in bfloat16-weights serving as in float32: same direction, same size.
    prompt = f32.tokenizer.encode_chat([{"role": "user", "content": "Describe your morning."}])
    d32 = forced_logits(f32, prompt, len(prompt), french)[-1] - forced_logits(f32, prompt, len(prompt))[-1]
    d16 = forced_logits(bf16, prompt, len(prompt), french)[-1] - forced_logits(bf16, prompt, len(prompt))[-1]
    assert d16.abs().max() > 1.0, "the adapter moves the logits"
    cos = torch.nn.functional.cosine_similarity(d32, d16, dim=0)
    assert cos > 0.98 and 0.9 < d16.norm() / d32.norm() < 1.1, (float(cos), float(d16.norm() / d32.norm()))
    for eng in (f32, bf16):
        eng.lora_runtime.manager.close()
