"""Base weights in 4 bits under float32 activations (``LORAPLEX_WEIGHTS=int4``).

The base model's projections are 4-bit values with a float32 scale and offset per block of 32
inputs (``engine.quant``, GGUF Q4_1's form; Q4_0 maps onto it with offset -8 x scale); each
activation row is quantized to int8 per block on the fly and every block adds an exact integer
dot product and the offset times the block's activation sum (the native kernel). LoRA
(unmerged), attention, norms and the KV cache stay float32; the embedding table and LM head are
bfloat16 on CPUs that multiply it natively, else float32 (as under int8).
Checked here: quantize and pack, the kernel (AVX512-VNNI here, and the AVX2 and plain C builds)
against a torch reference of the same arithmetic and a float64 product of the dequantized
weights, GGUF Q4_0/Q4_1 tensors kept as the file's blocks (Q8_0 ones staying 8-bit), the
setting, mixed-batch isolation in this format, adapters' deltas, and (slow) accuracy gates on
the demo model against the float32 engine, which widens the same Q4_1 weights.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.cpu import cpu_flags
from engine.engine import Engine, EngineConfig, resolve_weights
from engine.linear import Int4Linear, Int8Linear
from engine.loader import load_gguf, load_hf_dir, unpermute_rope_rows
from engine.model import DecoderModel
from engine.native import CFLAGS, CSRC, q4_matmul_kernel
from engine.quant import (
    BLOCK,
    INT4,
    TILE,
    pack_q4,
    q4_from_gguf,
    q4_matmul_reference,
    quantize_blocks,
    quantize_q4,
)
from engine.scoring import agreement, forced_logits
from loraplex.settings import Settings
from loraplex.tokenizer import TextTokenizer
from tests.engine_fixtures import demo_gguf  # noqa: F401  (fixture)
from tests.lora_fixtures import (
    ISOLATION_SPECS,
    TINY_DIMS,
    PeftReference,
    attach_runtime,
    model_info,
    peft_adapters,
    refs_for,
    rel_err,
    save_tiny_llama,
    tiny_engine,
)
from tests.test_engine_int8 import assert_table_and_head, write_quantized_gguf
from tests.test_engine_weights import assert_rows_isolated

SHAPES = [(96, 40), (100, 33), (160, 70)]
"""(K, N): inputs not a multiple of 64 (nor, for 100, of 32), outputs not a multiple of 16."""


def _weight(k: int, n: int, seed: int) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[3, :BLOCK] = 0.75  # a constant block: scale 0, the offset alone
    w[5] *= 40.0  # a row of another magnitude
    w[7] += 3.0  # a row far from zero: the offsets carry it
    w[9] = 1.0
    w[9, ::BLOCK] = 0.0  # q = 15 but for one 0 a block: the widest integer sums
    return w


def _exact(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 product with the dequantized weights: the definition the kernel approximates
    (only the activations' 8-bit rounding apart)."""
    y = x.double() @ w.double().T
    return y + bias.double() if bias is not None else y


def test_quantize_and_pack_round_trip():
    k, n = 100, 33
    w = _weight(k, n, 0)
    qw = quantize_q4(w)
    assert qw.q.dtype == torch.uint8 and qw.q.shape == (n, 128) and qw.d.shape == qw.m.shape == (n, 4)
    assert qw.shape == (n, k) and int(qw.q.max()) == 15 and int(qw.q.min()) == 0 and (qw.q[:, k:] == 0).all()
    # Each value within half a step of its block's scale; the constant block exact.
    deq = qw.dequantize()
    step = qw.d.repeat_interleave(BLOCK, dim=1)[:, :k]
    assert ((deq - w).abs() <= step / 2 + 1e-5 * w.abs()).all()
    assert qw.d[3, 0] == 0 and (deq[3, :BLOCK] == 0.75).all()
    # The last block (4 real inputs) takes its min and max from those alone, not the padding.
    assert torch.equal(qw.m[:, 3], w[:, 96:].amin(1))
    packed = pack_q4(qw)
    assert packed.q.shape == (3, 4, 4, TILE, 4), "n padded to whole tiles of 16; 4 pairs of 64 bytes a block"
    assert packed.q.dtype == torch.uint8 and (packed.q[2, :, :, 1:] == 0).all() and (packed.d[2, :, 1:] == 0).all()
    # Pair 2 of block 1, row 7: inputs 8..11 of the block in the low nibbles, 24..27 in the high.
    byte = packed.q[0, 1, 2, 7]
    assert (byte & 0x0F).tolist() == qw.q[7, BLOCK + 8:BLOCK + 12].tolist()
    assert (byte >> 4).tolist() == qw.q[7, BLOCK + 24:BLOCK + 28].tolist()
    assert torch.equal(packed.m[0, 1], qw.m[:TILE, 1]) and torch.equal(packed.d[1, 2], qw.d[TILE:2 * TILE, 2])
    back = packed.unpack()
    assert torch.equal(back.q, qw.q) and torch.equal(back.d, qw.d) and torch.equal(back.m, qw.m)
    assert back.in_features == k
    # Half a byte per (padded) weight plus a float32 scale and offset per block.
    assert packed.nbytes == 3 * TILE * 128 // 2 + 3 * TILE * 4 * 8


def test_reference_is_the_blockwise_quantized_product():
    """The torch reference really adds, per block, the integer dot product and the offset times
    the activations' sum (against a plain loop), and lands within the activations' quantization
    error of the float64 product with the dequantized weights."""
    k, n = 96, 40
    w, x = _weight(k, n, 1), torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    qw = quantize_q4(w)
    y = q4_matmul_reference(x, qw)
    xq, xd = quantize_blocks(x)
    for r in range(3):
        for o in (0, 3, 5, 7, 39):
            want = 0.0
            for b in range(k // BLOCK):
                xb, wb = xq[r, b * BLOCK:(b + 1) * BLOCK].long(), qw.q[o, b * BLOCK:(b + 1) * BLOCK].long()
                want += float(xd[r, b]) * (float(qw.d[o, b]) * int((xb * wb).sum()) + float(qw.m[o, b]) * int(xb.sum()))
            assert abs(float(y[r, o]) - want) <= 1e-5 * abs(want) + 1e-4
    exact = _exact(x, qw.dequantize())
    assert rel_err(y, exact) < 0.02 and rel_err(_exact(x.round(decimals=1), qw.dequantize()), exact) > 1e-4


def _check(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor) -> None:
    """``got`` (a kernel) equals the reference ``want`` up to float32 summation order, and both
    are within the activations' 8-bit rounding of the float64 definition ``exact``."""
    assert got.shape == want.shape == exact.shape
    if got.numel():
        assert ((got - want).abs() <= 1e-4 * want.abs() + 1e-4 * want.abs().max()).all()
        assert rel_err(got, exact) < 0.02, rel_err(got, exact)


@pytest.mark.parametrize("rows", [0, 1, 3, 32, 100, 1700])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_native_kernel_equals_the_reference(rows, k, n):
    """Every batch shape, 1700 rows included: past the AVX2 build's 256 KiB chunk of activations
    at k = 160, so its second chunk runs too."""
    kernel = q4_matmul_kernel()
    assert kernel is not None, "the native kernels build on this machine"
    gen = torch.Generator().manual_seed(rows * 1000 + k)
    qw = quantize_q4(_weight(k, n, rows))
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 1, rows).unsqueeze(1)
    if rows:
        x[0, :BLOCK] = 0.0  # an all-zero activation block
    bias = torch.randn(n, generator=gen)
    want = q4_matmul_reference(x, qw, bias)
    got = Int4Linear(pack_q4(qw), bias, kernel)(x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    _check(got, want, _exact(x, qw.dequantize(), bias))
    # Strided input rows (a column slice) and the torch fallback give the same.
    wide = torch.cat([x, torch.randn(rows, 7, generator=gen)], dim=1)[:, :k]
    assert torch.equal(Int4Linear(pack_q4(qw), bias, kernel)(wide), got)
    assert torch.allclose(Int4Linear(pack_q4(qw), bias, None)(x), want, rtol=1e-6, atol=1e-6)


# Builds of the kernel for CPUs without AVX512-VNNI: plain C (any x86-64) and AVX2's maddubs
# (x86-64-v3, run only where this CPU can execute it).
PORTABLE = ["x86-64"] + (["x86-64-v3"] if {"avx2", "fma"} <= cpu_flags() else [])


@pytest.mark.parametrize("march", PORTABLE)
def test_portable_kernel_builds_equal_the_reference(tmp_path, march):
    """The same C source built for CPUs without AVX512-VNNI."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    assert cc is not None, "a C compiler (the native kernels need one)"
    so = tmp_path / "portable.so"
    flags = [f for f in CFLAGS if f != "-march=native"] + [f"-march={march}"]
    subprocess.run([cc, *flags, str(CSRC / "cpu_kernels.c"), "-o", str(so)], check=True, capture_output=True)
    fn = ctypes.CDLL(str(so)).loraplex_q4_matmul_f32
    fn.restype = ctypes.c_int
    i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [p, i64, i32, i32, p, p, p, i32, p, p, i64, i32]
    for rows, (k, n) in [(1, SHAPES[0]), (13, SHAPES[1]), (100, SHAPES[2])]:
        qw = quantize_q4(_weight(k, n, rows))
        packed = pack_q4(qw)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        x[0] = 1.0  # all +127: with row 9, the AVX2 build's int16 sums at their widest (30480 < 2^15)
        bias = torch.randn(n)
        y = torch.empty(rows, n)
        assert fn(x.data_ptr(), k, rows, k, packed.q.data_ptr(), packed.d.data_ptr(), packed.m.data_ptr(), n,
                  bias.data_ptr(), y.data_ptr(), n, 2) == 0
        _check(y, q4_matmul_reference(x, qw, bias), _exact(x, qw.dequantize(), bias))


def test_int4_setting_resolves_and_refuses_what_it_cannot_serve(monkeypatch):
    assert resolve_weights("int4", torch.float32) == INT4
    with pytest.raises(ValueError, match="float32 activations"):
        resolve_weights("int4", torch.bfloat16)
    monkeypatch.setenv("LORAPLEX_WEIGHTS", "int4")
    assert Settings.from_env().weights == "int4"


# --- GGUF Q4_0 / Q4_1: the file's blocks, as they are --------------------------------------------

def test_q4_blocks_read_as_gguf_dequantizes_them():
    """Both layouts straight from bytes: the nibble order (low = inputs 0..15 of a block), the
    float16 scale and offset (Q4_0: -8 x scale), bit for bit what gguf's dequantize gives."""
    import gguf

    w = _weight(96, 40, 3).numpy()
    for qtype, offset in ((gguf.GGMLQuantizationType.Q4_0, False), (gguf.GGMLQuantizationType.Q4_1, True)):
        raw = gguf.quants.quantize(w, qtype)
        got = q4_from_gguf(raw, w.shape, offset)
        want = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
        assert got.q.dtype == torch.uint8 and int(got.q.max()) <= 15
        assert np.array_equal(got.dequantize().numpy(), want), qtype.name
        # ... and packing for the kernel keeps every bit.
        back = pack_q4(got).unpack()
        assert torch.equal(back.q, got.q) and torch.equal(back.d, got.d) and torch.equal(back.m, got.m)


_Q = {"attn_q": "Q4_1", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q4_0", "ffn_gate": "Q8_0",
      "ffn_up": "Q4_1", "ffn_down": "Q8_0"}
"""A GGUF file's projection types: both 4-bit layouts (fused q|k|v mixes them), an 8-bit one,
and gate|up fusing 8 and 4 bits."""


def _dequantized(raw: np.ndarray, qtype: str, n_head: int | None = None) -> torch.Tensor:
    """gguf's own float32 reading of a tensor's raw blocks (rows un-permuted when ``n_head``)."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    rows = raw.shape[0]
    w = gguf.quants.dequantize(raw, t).reshape(rows, -1)
    return torch.from_numpy(np.ascontiguousarray(unpermute_rope_rows(w, n_head) if n_head else w))


def test_gguf_q4_projections_stay_the_files_blocks(tmp_path):
    import gguf

    base_dir = save_tiny_llama(tmp_path / "base")
    path = tmp_path / "tiny-q4.gguf"
    raw = write_quantized_gguf(base_dir, path, {n: gguf.GGMLQuantizationType[t] for n, t in _Q.items()})
    heads, kv_heads = TINY_DIMS["num_attention_heads"], TINY_DIMS["num_key_value_heads"]
    kept = load_gguf(path, keep_q8_0=True, keep_q4=True)
    widened = load_gguf(path)
    tokenizer = TextTokenizer.from_hf_dir(base_dir)
    config = EngineConfig(kv_cache_bytes=4 << 20, max_model_len=96)
    int4 = Engine(DecoderModel(kept, torch.device("cpu"), torch.float32, 96, matmul_dtype=INT4), tokenizer, config)
    f32 = Engine(DecoderModel(widened, torch.device("cpu"), torch.float32, 96), tokenizer, config)
    for i, layer in enumerate(kept.layers):
        def deq(name: str, n_head: int | None = None, i: int = i) -> torch.Tensor:
            return _dequantized(raw[f"blk.{i}.{name}"], _Q[name], n_head)

        want = {"qkv": torch.cat([deq("attn_q", heads), deq("attn_k", kv_heads), deq("attn_v")]),
                "o": deq("attn_output"), "gate_up": torch.cat([deq("ffn_gate"), deq("ffn_up")]),
                "down": deq("ffn_down")}
        for field, values in want.items():
            loaded = getattr(layer, field)
            served = getattr(int4.model.layers[i], field)
            # ... and the float32 engine holds exactly the file's values.
            assert torch.equal(getattr(f32.model.w.layers[i], field), values), field
            if field == "gate_up":  # Q8_0 and Q4_1 fused: 8-bit, the 4-bit rows quantized to 8 bits
                assert isinstance(served, Int8Linear) and loaded.q.dtype == torch.int8
                inter = TINY_DIMS["intermediate_size"]
                assert torch.equal(loaded.dequantize()[:inter], values[:inter])
                assert rel_err(loaded.dequantize()[inter:], values[inter:]) < 0.01
                continue
            if field == "down":  # Q8_0 stays 8-bit
                assert isinstance(served, Int8Linear) and loaded.q.dtype == torch.int8
            else:
                assert isinstance(served, Int4Linear) and loaded.q.dtype == torch.uint8, field
            assert torch.equal(loaded.dequantize(), values), field
            assert torch.equal(served.weight.unpack().dequantize(), values), field
    # The q/k rows come out in Hugging Face order: near the original float weights (4 bits).
    hf = load_hf_dir(base_dir)
    assert rel_err(kept.layers[0].qkv.dequantize(), hf.layers[0].qkv) < 0.1  # measured 0.052
    ids, prompt_len = [5, 17, 3, 99, 42, 8, 61, 7, 23, 11, 12, 13], 9
    a = forced_logits(f32, ids, prompt_len)
    b = forced_logits(int4, ids, prompt_len)
    assert rel_err(b, a) < 0.02, rel_err(b, a)  # measured 0.0063: the activations' 8-bit rounding
    assert rel_err(a, forced_logits(tiny_engine(base_dir), ids, prompt_len)) > 1e-3


# --- engines --------------------------------------------------------------------------------------

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_q4_exact_llama(path: Path) -> Path:
    """The tiny Llama with its projections replaced by their 4-bit values (as a GGUF Q4_1 file
    holds them): int4 serving reads the same base the float32 PEFT reference runs, so what is
    left between them is the activations' rounding, as for a Q4_1 model."""
    save_tiny_llama(path)
    f = path / "model.safetensors"
    sd = load_file(str(f))
    for name, t in sd.items():
        if any(f".{p}." in name for p in _PROJ):
            sd[name] = quantize_q4(t).dequantize()
    save_file(sd, str(f), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def lora_world(tmp_path_factory):
    root = tmp_path_factory.mktemp("int4-weights")
    base_dir = save_q4_exact_llama(root / "base")
    model, dirs = peft_adapters(base_dir, root / "adapters", ISOLATION_SPECS)
    return base_dir, dirs, PeftReference(model), refs_for(dirs), root


def test_int4_weights_hold_the_base_in_under_a_fifth_of_the_memory(lora_world):
    base_dir, *_, root = lora_world
    f32 = tiny_engine(base_dir)
    int4 = tiny_engine(base_dir, weights="int4")
    projections = ("qkv", "o", "gate_up", "down")
    f32_bytes = sum(getattr(lw, f).numel() * 4 for lw in f32.model.w.layers for f in projections)
    assert sum(getattr(lw, f).nbytes for lw in int4.model.w.layers for f in projections) < 0.2 * f32_bytes
    assert int4.model.weight_bytes < f32.model.weight_bytes
    layer = int4.model.layers[0]
    assert all(isinstance(getattr(layer, n), Int4Linear) for n in projections)
    # The quantization of these (already 4-bit) float weights gives them back.
    for lw4, lw32 in zip(int4.model.w.layers, f32.model.w.layers, strict=True):
        for f in projections:
            assert rel_err(getattr(lw4, f).unpack().dequantize(), getattr(lw32, f)) < 1e-6
    assert_table_and_head(int4.model)
    assert int4.model.w.layers[0].input_norm.dtype == torch.float32
    assert int4.cache.k[0].dtype == torch.bfloat16  # auto: bfloat16 K/V under narrow matrices
    rt = attach_runtime(int4, model_info(base_dir), root / "cache-mem")
    # The LoRA branch is never merged: its math stays float32, its A/B are stored in bfloat16.
    assert rt.manager.bank.dtype == torch.float32 and rt.manager.bank.weights_dtype == torch.bfloat16
    rt.manager.close()
    # A worker built from settings (LORAPLEX_WEIGHTS=int4) serves the same.
    engine = Engine.from_settings(Settings(model=str(base_dir), weights="int4", max_loras=2,
                                           adapter_cache_dir=str(root / "cache-worker")))
    assert isinstance(engine.model.layers[0].gate_up, Int4Linear)
    assert engine.lora_runtime.manager.bank.weights_dtype == torch.bfloat16, "the worker's slots as these"
    engine.lora_runtime.manager.close()


@pytest.mark.parametrize(("weights", "vnni", "avx2", "warned"), [
    ("int4", False, True, False),  # AVX2's maddubs build outruns float32: nothing to warn about
    ("int4", False, False, True),  # plain C
    ("int8", False, True, True),  # 8 bits need two integer multiplies a group on AVX2: no faster
    ("int8", True, True, False),
])
def test_slow_block_formats_are_warned_about(lora_world, monkeypatch, caplog, weights, vnni, avx2, warned):
    import engine.model

    monkeypatch.setattr(engine.model, "cpu_has_vnni", lambda: vnni)
    monkeypatch.setattr(engine.model, "cpu_has_avx2", lambda: avx2)
    with caplog.at_level("WARNING", logger="loraplex.engine.model"):
        tiny_engine(lora_world[0], weights=weights)
    assert any("no faster than float32" in r.getMessage() for r in caplog.records) == warned


def test_mixed_batch_rows_equal_each_request_alone_with_int4_weights(lora_world):
    """Cross-tenant isolation in this format: each row of a mixed batch (base rows and nine
    adversarial adapters, prefill and decode together) equals the same request served alone,
    and is closer to PEFT (float32, on the same 4-bit base values) for its own adapter than to
    any other's: ten times closer, and within 0.1 relative error (measured: own error up to 0.057,
    at most 0.047 of the nearest other's, with these adversarial adapters, their A/B in bfloat16
    and, on CPUs with native bfloat16, a bfloat16 LM head)."""
    assert_rows_isolated(lora_world, 1e-4, weights="int4")


def test_adapters_deltas_are_applied_with_int4_weights(lora_world):
    """An adapter's output differs from the base's under int4 by what it does in float32
    (measured: the deltas within 0.013 relative error of float32's, their largest entry 1.4-1.6x
    the largest logit)."""
    base_dir, _, _, refs, root = lora_world
    f32, int4 = tiny_engine(base_dir), tiny_engine(base_dir, weights="int4")
    for eng, sub in ((f32, "a"), (int4, "b")):
        attach_runtime(eng, model_info(base_dir), root / f"cache-delta-{sub}")
    ids, prompt_len = [5, 17, 3, 99, 42, 8, 61, 7, 23, 11], 7
    for name in ("r8_all", "r16_all"):
        d32 = forced_logits(f32, ids, prompt_len, refs[name]) - forced_logits(f32, ids, prompt_len)
        d4 = forced_logits(int4, ids, prompt_len, refs[name]) - forced_logits(int4, ids, prompt_len)
        assert d4.abs().max() > 0.1 * forced_logits(int4, ids, prompt_len).abs().max(), "the adapter moves the logits"
        assert rel_err(d4, d32) < 0.1, (name, rel_err(d4, d32))
    for eng in (f32, int4):
        eng.lora_runtime.manager.close()


# --- accuracy gates on the demo model (slow) -----------------------------------------------------

CHATS = ["Write one sentence about the sea.", "Explain gravity to a child.", "Write a haiku about autumn.",
         "How do I sort a list in Python?"]


@pytest.mark.slow
def test_demo_int4_weights_track_float32_and_keep_the_adapters_delta(demo_gguf, tmp_path):  # noqa: F811
    """The demo model (SmolLM2-135M) stores its projections in Q4_1: int4 serves those blocks as
    they are, the float32 engine widens the same values, so only the activations' 8-bit rounding
    parts them, and the bfloat16 LM head on CPUs with native bfloat16. Measured (with it):
    top-1 agreement 0.96 (base) and 0.97 (adapter), KL per token 3e-3 (base) and 4e-3 (adapter)
    mean, 0.028 max; the adapter's delta at cosine 0.99996 and 1.006x the float32 one's norm.
    The gates leave room for other CPUs' summation order and prompts, not for a broken kernel
    (KL > 0.1)."""
    from tests.test_demo_adapters import ADAPTERS

    f32 = Engine.from_path(demo_gguf, EngineConfig(kv_cache_bytes=1 << 26))
    int4 = Engine.from_path(demo_gguf, EngineConfig(kv_cache_bytes=1 << 26, weights="int4"))
    assert all(isinstance(getattr(layer, n), Int4Linear)
               for layer in int4.model.layers for n in ("qkv", "o", "gate_up", "down"))
    info = model_info(demo_gguf)
    for eng, sub in ((f32, "a"), (int4, "b")):
        attach_runtime(eng, info, tmp_path / sub)
    french = refs_for({"french": ADAPTERS / "french"})["french"]
    prompts = [f32.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in CHATS]
    for adapter in (None, french):
        got = agreement(f32, int4, prompts, 32, adapter)
        assert got["top1_agreement"] >= 0.9 and got["kl_mean"] <= 1.5e-2 and got["kl_max"] <= 0.15, (adapter, got)
    # The LoRA delta is applied in 4-bit-weights serving as in float32: same direction, same size.
    prompt = f32.tokenizer.encode_chat([{"role": "user", "content": "Describe your morning."}])
    d32 = forced_logits(f32, prompt, len(prompt), french)[-1] - forced_logits(f32, prompt, len(prompt))[-1]
    d4 = forced_logits(int4, prompt, len(prompt), french)[-1] - forced_logits(int4, prompt, len(prompt))[-1]
    assert d4.abs().max() > 1.0, "the adapter moves the logits"
    cos = torch.nn.functional.cosine_similarity(d32, d4, dim=0)
    assert cos > 0.99 and 0.95 < d4.norm() / d32.norm() < 1.05, (float(cos), float(d4.norm() / d32.norm()))
    for eng in (f32, int4):
        eng.lora_runtime.manager.close()
