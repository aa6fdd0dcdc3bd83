"""Batched LoRA op: every path == the per-row definition; base rows untouched."""

from __future__ import annotations

import pytest
import torch

from engine.cpu import cpu_flags
from engine.lora.batch import LoRABatch
from engine.lora.ops import (
    NATIVE_MAX_TOKENS_PER_ADAPTER,
    SegmentPlan,
    choose_path,
    lora_apply,
    lora_reference,
    native_max_tokens,
    native_usable,
)
from engine.lora.peft import LoRAModule, LoRAWeights
from engine.lora.slots import RankTooLarge, SlotBank
from engine.native_lora import lora_rows_kernel


def _naive(x, slots, adapters):
    """Float64 per-row definition over unpadded adapters: {slot: (A, B, scale)}."""
    y = torch.zeros(x.shape[0], adapters[next(iter(adapters))][1].shape[0], dtype=torch.float64)
    for i, s in enumerate(slots):
        if s >= 0:
            a, b, sc = adapters[s]
            y[i] = (x[i].double() @ a.double().T) @ b.double().T * sc
    return y


@pytest.mark.parametrize("tokens", [1, 2, 7, 64, 200])
@pytest.mark.parametrize("num_slots", [1, 3, 8])
@pytest.mark.parametrize("layout", ["random", "contiguous"])
def test_paths_agree_with_definition(tokens, num_slots, layout):
    g = torch.Generator().manual_seed(tokens * 100 + num_slots)
    fin, fout, r = 40, 24, 8
    a = torch.randn(num_slots, r, fin, generator=g, dtype=torch.float64)
    b = torch.randn(num_slots, fout, r, generator=g, dtype=torch.float64)
    scale = torch.rand(num_slots, generator=g, dtype=torch.float64) + 0.5
    if layout == "random":
        slots = torch.randint(-1, num_slots, (tokens,), generator=g)
    else:
        slots = torch.sort(torch.randint(-1, num_slots, (tokens,), generator=g)).values
    x = torch.randn(tokens, fin, generator=g, dtype=torch.float64)
    y0 = torch.randn(tokens, fout, generator=g, dtype=torch.float64)
    expect = y0.clone()
    lora_reference(expect, x, a, b, scale, slots)
    plan = SegmentPlan.build(slots)
    for path in ("segmented", "padded", "reference", None):
        y = y0.clone()
        lora_apply(y, x, a, b, scale, plan, path=path)
        torch.testing.assert_close(y, expect, rtol=1e-12, atol=1e-12)
        base = slots < 0
        assert torch.equal(y[base], y0[base]), "base rows must be untouched bit for bit"


@pytest.mark.skipif(not native_usable(torch.empty(0)), reason="native kernels did not build here")
@pytest.mark.parametrize("tokens", [1, 9, 33, 200])
@pytest.mark.parametrize("rank", [5, 8, 16, 64])
@pytest.mark.parametrize("b_layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_native_kernel_matches_definition(tokens, rank, b_layout, weights):
    """float32 C kernel vs the float64 definition, A/B in float32 or bfloat16; ``out`` a column
    slice; base rows untouched. Ranks 8-64 with B transposed take the blocked path (AVX-512 or
    AVX2 builds: row blocks of up to 4 or 6, expand tiles with a tail), the rest row
    by row; 200 tokens over 6 slots give segments of ~30 rows."""
    g = torch.Generator().manual_seed(tokens * 7 + rank)
    fin, fout, num_slots = 70, 100, 6  # neither a multiple of 8: tails in the shrink and the expand
    a = (torch.randn(num_slots, rank, fin, generator=g) / fin ** 0.5).to(weights)
    bt = torch.randn(num_slots, rank, fout, generator=g).to(weights)
    b = bt.transpose(1, 2) if b_layout == "transposed" else bt.transpose(1, 2).contiguous()
    scale = torch.rand(num_slots, generator=g) + 0.5
    slots = torch.randint(-1, num_slots, (tokens,), generator=g)
    x = torch.randn(tokens, fin, generator=g)
    fused = torch.randn(tokens, fout + 30, generator=g)
    before = fused.clone()
    lora_apply(fused[:, 10:10 + fout], x, a, b, scale, SegmentPlan.build(slots), path="native")
    adapters = {s: (a[s].float(), b[s].float(), float(scale[s])) for s in range(num_slots)}
    expect = before[:, 10:10 + fout].double() + _naive(x, slots.tolist(), adapters)
    torch.testing.assert_close(fused[:, 10:10 + fout].double(), expect, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused[:, :10], before[:, :10]) and torch.equal(fused[:, 10 + fout:], before[:, 10 + fout:])
    base = slots < 0
    assert torch.equal(fused[base], before[base]), "base rows must be untouched bit for bit"


@pytest.mark.skipif(not native_usable(torch.empty(0)), reason="native kernels did not build here")
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_native_kernel_rows_are_batch_invariant(weights):
    """A row's delta is the same bit for bit alone, in a long segment of its adapter, among
    other adapters' rows and at any thread count: a tenant's output must not depend on who
    shares the step (under 8-bit weights a last-bit difference can move a quantized
    activation and show in the logits)."""
    g = torch.Generator().manual_seed(3)
    fin, fout, rank, num_slots = 576, 200, 16, 4
    a = (torch.randn(num_slots, rank, fin, generator=g) / fin ** 0.5).to(weights)
    b = torch.randn(num_slots, rank, fout, generator=g).to(weights).transpose(1, 2)
    scale = torch.rand(num_slots, generator=g) + 0.5
    x = torch.randn(40, fin, generator=g)
    y0 = torch.randn(40, fout, generator=g)
    batches = [torch.full((40,), 2), torch.arange(40) % num_slots, torch.tensor([2] * 3 + [-1] * 30 + [1] * 7)]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for slots in batches:
                y = y0.clone()
                lora_apply(y, x, a, b, scale, SegmentPlan.build(slots), path="native")
                for i in range(40):
                    if slots[i] < 0:
                        continue
                    alone = y0[i:i + 1].clone()
                    lora_apply(alone, x[i:i + 1], a, b, scale, SegmentPlan.build(slots[i:i + 1]), path="native")
                    assert torch.equal(y[i], alone[0]), (n, slots.tolist(), i)
    finally:
        torch.set_num_threads(threads)


def test_plan_runs_and_segments():
    plan = SegmentPlan.build(torch.tensor([-1, 2, 2, 2, -1, 0, 0, -1]))
    assert plan.seg_slots == (0, 2)
    assert plan.runs == ((1, 4, 2), (5, 7, 0))
    assert plan.rows.tolist() == [5, 6, 1, 2, 3]
    interleaved = SegmentPlan.build(torch.tensor([0, 1, 0, 1]))
    assert interleaved.runs is None
    assert interleaved.seg_lens == (2, 2)
    empty = SegmentPlan.build(torch.tensor([-1, -1]))
    assert empty.num_lora_tokens == 0
    y = torch.ones(2, 3)
    lora_apply(y, torch.ones(2, 4), torch.ones(1, 2, 4), torch.ones(1, 3, 2), torch.ones(1), empty)
    assert torch.equal(y, torch.ones(2, 3))


def test_choose_path_heuristic():
    decode = SegmentPlan.build(torch.arange(8))
    prefill = SegmentPlan.build(torch.zeros(128, dtype=torch.int64))
    assert choose_path(decode, 8) == "padded"
    assert choose_path(prefill, 8) == "segmented"
    assert choose_path(SegmentPlan.build(torch.tensor([0, 0, 1, 1, 1])), 2) == "padded"
    assert choose_path(SegmentPlan.build(torch.tensor([0] * 40 + [1])), 2) == "segmented"  # long segment
    assert choose_path(SegmentPlan.build(torch.tensor([3, 3, 3])), 4) == "segmented"  # one adapter
    # With the C kernel: decode-like batches (short segments) go native, prefill stays segmented.
    assert choose_path(decode, 8, native=True) == "native"
    assert choose_path(SegmentPlan.build(torch.tensor([3, 3, 3])), 4, native=True) == "native"
    assert choose_path(prefill, 8, native=True) == "segmented"
    # A blocked build's segments take prefill too (native_max None).
    assert choose_path(prefill, 8, native=True, native_max=None) == "native"
    assert choose_path(prefill, 8, native=False, native_max=None) == "segmented"


@pytest.mark.skipif(not native_usable(torch.empty(0)), reason="native kernels did not build here")
def test_native_max_tokens_follows_the_blocked_paths_conditions():
    """Blocks need B transposed and a rank that is a multiple of 8; otherwise the kernel goes
    row by row and long segments go to torch's GEMMs."""
    blocked = lora_rows_kernel().blocked
    assert blocked == ({"avx2", "fma"} <= cpu_flags())
    assert native_max_tokens(16) == (None if blocked else NATIVE_MAX_TOKENS_PER_ADAPTER)
    assert native_max_tokens(12) == NATIVE_MAX_TOKENS_PER_ADAPTER
    assert native_max_tokens(16, b_transposed=False) == NATIVE_MAX_TOKENS_PER_ADAPTER


@pytest.mark.parametrize("capacity", [4, 12])
def test_padded_layouts(capacity):
    """Whole-stack (capacity <= 2 x adapters) and gathered layouts, uneven segments."""
    g = torch.Generator().manual_seed(capacity)
    slots = torch.tensor([3, -1, 0, 3, 3, 2, -1, 0])
    plan = SegmentPlan.build(slots)
    assert plan.padded_layout(capacity).full_stack == (capacity == 4)
    a = torch.randn(capacity, 4, 10, generator=g, dtype=torch.float64)
    b = torch.randn(capacity, 6, 4, generator=g, dtype=torch.float64)
    scale = torch.rand(capacity, generator=g, dtype=torch.float64)
    x = torch.randn(8, 10, generator=g, dtype=torch.float64)
    y0 = torch.randn(8, 6, generator=g, dtype=torch.float64)
    expect, y = y0.clone(), y0.clone()
    lora_reference(expect, x, a, b, scale, slots)
    lora_apply(y, x, a, b, scale, plan, path="padded")
    torch.testing.assert_close(y, expect, rtol=1e-12, atol=1e-12)
    assert torch.equal(y[slots < 0], y0[slots < 0])


def _random_weights(g, layers, shapes, rank, projs, scale):
    mods = {}
    for layer in range(layers):
        for p in projs:
            fi, fo = shapes[p]
            mods[(layer, p)] = LoRAModule(torch.randn(rank, fi, generator=g), torch.randn(fo, rank, generator=g), scale)
    return LoRAWeights(mods, rank)


@pytest.mark.parametrize("tokens", [1, 5, 96])
@pytest.mark.parametrize("path", ["segmented", "padded", None])
def test_batch_across_rank_classes(tokens, path):
    g = torch.Generator().manual_seed(tokens)
    shapes = {"q_proj": (32, 48), "v_proj": (32, 16), "down_proj": (40, 32)}
    bank = SlotBank(2, shapes, rank_classes=(8, 16, 64), slots_per_class=3)
    ranks = {0: 4, 1: 8, 3: 16, 4: 12, 7: 64}  # global slot -> rank (classes 0, 0, 1, 1, 2)
    adapters = {}
    for slot, rank in ranks.items():
        projs = ("q_proj", "v_proj") if slot != 4 else ("q_proj",)  # slot 4 lacks v_proj
        w = _random_weights(g, 2, shapes, rank, projs, scale=0.5 + slot)
        assert bank.class_of_rank(rank) == slot // 3
        bank.write(slot, w)
        adapters[slot] = w
    choices = torch.tensor([-1, *ranks])
    slots = choices[torch.randint(0, len(choices), (tokens,), generator=g)]
    batch = LoRABatch.build(bank, slots, path=path)
    assert batch.empty == bool((slots < 0).all())
    for layer in range(2):
        for proj in shapes:
            fi, fo = shapes[proj]
            x = torch.randn(tokens, fi, generator=g)
            out0 = torch.randn(tokens, fo, generator=g)
            out = out0.clone()
            batch.apply(layer, proj, x, out)
            expect = out0.double().clone()
            for i, s in enumerate(slots.tolist()):
                mod = adapters[s].modules.get((layer, proj)) if s >= 0 else None
                if mod is not None:
                    expect[i] += (x[i].double() @ mod.a.double().T) @ mod.b.double().T * mod.scale
            torch.testing.assert_close(out.double(), expect, rtol=1e-4, atol=1e-3)
            assert torch.equal(out[slots < 0], out0[slots < 0])


@pytest.mark.parametrize("tokens", [1, 5, 40, 96])
@pytest.mark.parametrize("path", ["segmented", "padded", "reference", None])
def test_bfloat16_slots_under_float32_activations(tokens, path):
    """A/B stored in bfloat16, x/out float32: every path (the native kernel where it is chosen)
    == the float64 definition on the bfloat16-rounded weights; the math is float32 throughout,
    so only the weights' rounding differs from float32 slots."""
    g = torch.Generator().manual_seed(tokens + 11)
    shapes = {"q_proj": (72, 48), "k_proj": (72, 16), "down_proj": (40, 72)}
    bank = SlotBank(2, shapes, rank_classes=(8, 16), slots_per_class=4, weights_dtype=torch.bfloat16)
    ranks = {0: 8, 1: 5, 4: 16, 6: 12}
    adapters = {}
    for slot, rank in ranks.items():
        w = _random_weights(g, 2, shapes, rank, tuple(shapes), scale=0.5 + slot)
        bank.write(slot, w)
        adapters[slot] = w
    a0, b0, sc0 = bank.stacks(0, 0, "q_proj")
    assert a0.dtype == b0.dtype == torch.bfloat16 and sc0.dtype == torch.float32
    choices = torch.tensor([-1, *ranks])
    slots = choices[torch.randint(0, len(choices), (tokens,), generator=g)]
    batch = LoRABatch.build(bank, slots, path=path)
    for layer in range(2):
        x = torch.randn(tokens, 72, generator=g)
        qk0 = torch.randn(tokens, 64, generator=g)
        qk = qk0.clone()
        batch.apply_many(layer, x, (("q_proj", qk[:, :48]), ("k_proj", qk[:, 48:])))
        for proj, out, out0 in (("q_proj", qk[:, :48], qk0[:, :48]), ("k_proj", qk[:, 48:], qk0[:, 48:])):
            expect = out0.double().clone()
            for i, s in enumerate(slots.tolist()):
                if s >= 0:
                    mod = adapters[s].modules[(layer, proj)]
                    a = mod.a.bfloat16().double()
                    b = mod.b.bfloat16().double()
                    expect[i] += (x[i].double() @ a.T) @ b.T * mod.scale
            torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-4)
            assert torch.equal(out[slots < 0], out0[slots < 0]), "base rows must be untouched bit for bit"


def test_single_token_and_no_lora_batch():
    shapes = {"q_proj": (8, 8)}
    bank = SlotBank(1, shapes, rank_classes=(8,), slots_per_class=2)
    g = torch.Generator().manual_seed(0)
    bank.write(1, _random_weights(g, 1, shapes, 8, ("q_proj",), 1.0))
    none = LoRABatch.build(bank, [-1, -1, -1])
    assert none.empty
    out = torch.randn(3, 8)
    before = out.clone()
    none.apply(0, "q_proj", torch.randn(3, 8), out)
    assert torch.equal(out, before)
    one = LoRABatch.build(bank, [1])
    x, out = torch.randn(1, 8), torch.zeros(1, 8)
    one.apply(0, "q_proj", x, out)
    a, b, sc = bank.stacks(0, 0, "q_proj")
    torch.testing.assert_close(out, (x @ a[1].T) @ b[1].T * sc[1])


def test_slot_bank_padding_clear_and_limits():
    shapes = {"q_proj": (8, 8)}
    bank = SlotBank(1, shapes, rank_classes=(16, 8), slots_per_class=2)
    assert bank.rank_classes == (8, 16) and bank.num_slots == 4
    assert not bank.allocated(1)
    g = torch.Generator().manual_seed(1)
    w = _random_weights(g, 1, shapes, 12, ("q_proj",), 2.0)
    bank.write(3, w)
    assert bank.allocated(1) and not bank.allocated(0)
    assert bank.capacity(1) == 2 and bank.capacity(0) == 0  # slot 3 is the class's second slot
    a, b, sc = bank.stacks(1, 0, "q_proj")
    assert torch.equal(a[1, :12], w.modules[(0, "q_proj")].a) and torch.count_nonzero(a[1, 12:]) == 0
    assert torch.count_nonzero(b[1, :, 12:]) == 0 and float(sc[1]) == 2.0
    bank.clear(3)
    assert torch.count_nonzero(a[1]) == 0 and float(sc[1]) == 0.0
    with pytest.raises(RankTooLarge):
        bank.class_of_rank(17)
    with pytest.raises(RankTooLarge):
        bank.write(0, w)  # class 8 slot
    with pytest.raises(IndexError):
        LoRABatch.build(bank, [4])


@pytest.mark.parametrize("path", ["segmented", "padded", None])
@pytest.mark.parametrize("layout", ["runs", "interleaved"])
def test_out_may_be_a_column_slice_of_a_fused_output(path, layout):
    """The model passes q/k/v and gate/up outputs as column views of one fused matmul."""
    shapes = {"q_proj": (16, 12), "k_proj": (16, 4)}
    bank = SlotBank(1, shapes, rank_classes=(8,), slots_per_class=3)
    g = torch.Generator().manual_seed(5)
    for s in range(3):
        bank.write(s, _random_weights(g, 1, shapes, 8, tuple(shapes), 0.5 + s))
    slots = [0, 0, 0, -1, 2, 2] if layout == "runs" else [0, 2, 0, -1, 1, 2]
    x = torch.randn(6, 16, generator=g)
    fused0 = torch.randn(6, 20, generator=g)
    fused = fused0.clone()
    q, k = fused[:, :12], fused[:, 12:16]
    assert not q.is_contiguous()
    batch = LoRABatch.build(bank, slots, path=path)
    with torch.inference_mode():
        batch.apply(0, "q_proj", x, q)
        batch.apply(0, "k_proj", x, k)
    expect_q, expect_k = fused0[:, :12].clone(), fused0[:, 12:16].clone()
    LoRABatch.build(bank, slots, path="reference").apply(0, "q_proj", x, expect_q)
    LoRABatch.build(bank, slots, path="reference").apply(0, "k_proj", x, expect_k)
    torch.testing.assert_close(fused[:, :12], expect_q)
    torch.testing.assert_close(fused[:, 12:16], expect_k)
    assert torch.equal(fused[:, 16:], fused0[:, 16:]), "columns of other projections untouched"
    assert torch.equal(fused[3], fused0[3])


def test_slot_storage_grows_and_keeps_contents():
    shapes = {"q_proj": (8, 8), "v_proj": (8, 4)}
    bank = SlotBank(2, shapes, rank_classes=(8,), slots_per_class=5)
    g = torch.Generator().manual_seed(9)
    ws = [_random_weights(g, 2, shapes, 8, ("q_proj",) if i % 2 else tuple(shapes), 1.0 + i) for i in range(5)]
    caps = []
    for i, w in enumerate(ws):
        bank.write(i, w)
        caps.append(bank.capacity(0))
    assert caps == [1, 2, 4, 4, 5]
    for i, w in enumerate(ws):
        for (layer, proj), mod in w.modules.items():
            a, b, sc = bank.stacks(0, layer, proj)
            assert torch.equal(a[i], mod.a) and torch.equal(b[i], mod.b) and float(sc[i]) == mod.scale
    assert bank.layers_with_module(0, "v_proj", [1, 3]) == [False, False]
    assert bank.layers_with_module(0, "v_proj", [1, 4]) == [True, True]


def test_native_flag_keeps_decode_batches_on_torch(monkeypatch):
    """``native=False`` (LORAPLEX_NATIVE_KERNELS=false) never reaches the C kernel."""
    calls: list[int] = []
    monkeypatch.setattr("engine.lora.ops.lora_native", lambda *args: calls.append(1))
    plan = SegmentPlan.build(torch.arange(4))
    x, a, b, sc = torch.randn(4, 6), torch.randn(4, 2, 6), torch.randn(4, 8, 2), torch.ones(4)
    y = torch.zeros(4, 8)
    lora_apply(y, x, a, b, sc, plan, native=False)
    assert not calls and bool(y.abs().sum() > 0)
    if native_usable(y):
        lora_apply(y, x, a, b, sc, plan)
        assert calls == [1]


@pytest.mark.parametrize("path", ["segmented", "padded", None])
@pytest.mark.parametrize("native", [True, False])
def test_apply_many_equals_one_projection_at_a_time(path, native):
    """q/k/v of one input in one call (one native kernel call on CPU) == each on its own;
    a projection no adapter of the batch touches is left alone; rank classes mixed."""
    shapes = {"q_proj": (24, 20), "k_proj": (24, 8), "v_proj": (24, 8)}
    bank = SlotBank(2, shapes, rank_classes=(8, 16), slots_per_class=4)
    g = torch.Generator().manual_seed(11)
    for s, (rank, projs) in {0: (8, ("q_proj", "k_proj")), 1: (5, ("q_proj",)), 4: (16, ("q_proj", "k_proj")),
                             6: (12, ("k_proj",))}.items():
        bank.write(s, _random_weights(g, 2, shapes, rank, projs, 0.25 + s))
    slots = [0, 4, -1, 1, 6, 0, 4, 4, -1, 1]
    x = torch.randn(len(slots), 24, generator=g)
    fused0 = torch.randn(len(slots), 36, generator=g)
    cols = {"q_proj": (0, 20), "k_proj": (20, 28), "v_proj": (28, 36)}
    for layer in range(2):
        together, alone = fused0.clone(), fused0.clone()
        batch = LoRABatch.build(bank, slots, path=path, native=native)
        batch.apply_many(layer, x, tuple((p, together[:, lo:hi]) for p, (lo, hi) in cols.items()))
        for p, (lo, hi) in cols.items():
            LoRABatch.build(bank, slots, path="reference").apply(layer, p, x, alone[:, lo:hi])
        # two float32 computations summing in different orders (measured up to 1.4e-5 relative)
        torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4)
        assert torch.equal(together[:, 28:], fused0[:, 28:]), "v_proj: no adapter of the batch adapts it"
        assert torch.equal(together[[2, 8]], fused0[[2, 8]]), "base rows untouched"
        assert not torch.equal(together[:, :28], fused0[:, :28])


@pytest.mark.skipif(not native_usable(torch.empty(0)), reason="native kernels did not build here")
def test_native_tables_follow_slot_storage_growth(monkeypatch):
    """The kernel's argument tables are memoized per storage: a class that grows (new
    tensors) gets new tables, so a later step never reads freed memory."""
    shapes = {"q_proj": (16, 12)}
    bank = SlotBank(1, shapes, rank_classes=(8,), slots_per_class=8)
    g = torch.Generator().manual_seed(3)
    bank.write(0, _random_weights(g, 1, shapes, 8, ("q_proj",), 1.0))
    runs: list[str] = []
    from engine.native_lora import LoRARows

    real_run = LoRARows.run
    monkeypatch.setattr(LoRARows, "run", lambda self, *a: (runs.append("run"), real_run(self, *a))[1])
    x = torch.randn(3, 16, generator=g)

    def step(slots):
        out = torch.zeros(3, 12)
        LoRABatch.build(bank, slots).apply(0, "q_proj", x, out)
        ref = torch.zeros(3, 12)
        LoRABatch.build(bank, slots, path="reference").apply(0, "q_proj", x, ref)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    step([0, -1, 0])
    first = bank.derived(0, ("native", 0, ("q_proj",)), lambda: None)
    for s in range(1, 5):  # capacity 1 -> 2 -> 4 -> 8: reallocated storage
        bank.write(s, _random_weights(g, 1, shapes, 8, ("q_proj",), 1.0 + s))
    step([4, 0, 3])
    assert bank.derived(0, ("native", 0, ("q_proj",)), lambda: None) is not first
    assert runs == ["run", "run"]


def test_native_flag_keeps_lora_batches_on_torch(monkeypatch):
    from engine.native_lora import LoRARows

    calls: list[int] = []
    monkeypatch.setattr(LoRARows, "run", lambda self, *a: calls.append(1))
    shapes = {"q_proj": (8, 8)}
    bank = SlotBank(1, shapes, rank_classes=(8,), slots_per_class=2)
    bank.write(1, _random_weights(torch.Generator().manual_seed(0), 1, shapes, 8, ("q_proj",), 1.0))
    out = torch.zeros(2, 8)
    LoRABatch.build(bank, [1, -1], native=False).apply(0, "q_proj", torch.randn(2, 8), out)
    assert not calls and bool(out.abs().sum() > 0)
    if native_usable(out):
        LoRABatch.build(bank, [1, -1]).apply(0, "q_proj", torch.randn(2, 8), out)
        assert calls == [1]


def test_a_slot_image_fills_a_slot_exactly_as_the_weights_do():
    """The loader builds an adapter's slot image off the engine thread; writing it must leave the
    slot as writing the weights does: padded to the class rank, B transposed, scales and
    presence per layer, projections it lacks zeroed (over a previous tenant's values)."""
    g = torch.Generator().manual_seed(5)
    shapes = {"q_proj": (32, 48), "v_proj": (32, 16), "down_proj": (40, 32)}
    old = _random_weights(g, 3, shapes, 16, tuple(shapes), 2.0)
    w = _random_weights(g, 3, shapes, 12, ("q_proj", "down_proj"), 0.75)
    del w.modules[(1, "down_proj")]  # a layer the adapter leaves alone
    by_weights = SlotBank(3, shapes, rank_classes=(8, 16), slots_per_class=2, weights_dtype=torch.bfloat16)
    by_image = SlotBank(3, shapes, rank_classes=(8, 16), slots_per_class=2, weights_dtype=torch.bfloat16)
    for bank in (by_weights, by_image):
        bank.write(2, old)
    by_weights.write(2, w)
    img = by_image.image(w)
    assert img.class_index == 1 and set(img.a) == {"q_proj", "down_proj"} and img.a["q_proj"].dtype == torch.bfloat16
    by_image.write(2, img)
    for layer in range(3):
        for proj in shapes:
            for x, y in zip(by_weights.stacks(1, layer, proj), by_image.stacks(1, layer, proj), strict=True):
                assert torch.equal(x, y), (layer, proj)
        assert by_image.layers_with_module(1, "down_proj", [0]) == [True, False, True]
    assert by_image.layers_with_module(1, "v_proj", [0]) == [False, False, False]
    with pytest.raises(ValueError, match="rank class 16 cannot fill slot 0"):
        by_image.write(0, img)
    with pytest.raises(RankTooLarge):
        by_image.image(w, class_index=0)
