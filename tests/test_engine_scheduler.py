"""Scheduler, KV block allocator and sampler on their own (no model)."""

from __future__ import annotations

import pytest
import torch

from engine import sampler
from engine.kv_cache import BlockAllocator, OutOfBlocksError
from engine.sampler import apply_penalties, sample, token_logprobs
from engine.scheduler import AdmissionPolicy, QueueFullError, Scheduler
from engine.sequence import SamplingParams, SeqStatus, Sequence


def _seq(n: int, priority: int = 1, **params) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(**params), priority=priority)


def _sched(blocks: int = 64, bs: int = 4, budget: int = 32, seqs: int = 8, waiting: int = 16) -> Scheduler:
    return Scheduler(BlockAllocator(blocks, bs), max_num_seqs=seqs, max_num_batched_tokens=budget,
                     max_waiting=waiting)


def _run(s: Scheduler, out) -> None:
    """Pretend the model ran: advance computed tokens and sample a token when a chunk completes."""
    for seq, n in out.chunks:
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.output_ids.append(7)


def test_allocator_allocates_and_frees():
    a = BlockAllocator(4, 16)
    got = a.allocate(3)
    assert len(set(got)) == 3 and a.num_free == 1
    with pytest.raises(OutOfBlocksError):
        a.allocate(2)
    a.free(got)
    assert a.num_free == 4
    assert a.blocks_for(17) == 2


def test_allocator_keeps_a_sequences_blocks_in_runs_while_the_pool_allows():
    a = BlockAllocator(32, 4)
    first = a.allocate(2, reserve=6)  # a prompt of 2 blocks that may grow to 6
    other = a.allocate(2, reserve=4)  # the next sequence starts past that room
    assert (first, other) == ([0, 1], [6, 7])
    assert a.allocate(1, after=first[-1]) == [2]  # growth: the block after its last
    assert a.allocate(1, after=other[-1]) == [8]
    # The block after is taken: any free one (at the cursor), correct if not contiguous.
    taken = a.allocate(1, after=5)
    assert taken == [10]
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free([2, 2])
    # A full pool hands out whatever is free, the room of others included.
    b = BlockAllocator(6, 4)
    x = b.allocate(1, reserve=5)
    assert sorted(b.allocate(5)) == [1, 2, 3, 4, 5] and b.num_free == 0
    b.free(x)
    assert b.allocate(1, after=5) == [0]


def test_scheduler_grows_each_sequence_into_the_blocks_after_its_own():
    """Interleaved decoding sequences keep their blocks in order (decode attention reads them as
    one stream), their prompts spaced by prompt + max_tokens."""
    s = _sched(blocks=64, bs=4, budget=64, seqs=4)
    seqs = [_seq(6, max_tokens=10) for _ in range(3)]
    for q in seqs:
        s.add(q)
    for _ in range(9):
        _run(s, s.schedule())
    for q in seqs:
        t = q.block_table
        assert len(t) == 4 and t == list(range(t[0], t[0] + 4)), t
    assert sorted(q.block_table[0] for q in seqs) == [0, 4, 8]


def test_budget_chunks_long_prompt_and_mixes_decode():
    s = _sched(budget=32)
    short, long = _seq(5), _seq(70)
    s.add(short)
    s.add(long)
    out = s.schedule()
    assert [(q, n) for q, n in out.chunks] == [(short, 5), (long, 27)]
    _run(s, out)
    out = s.schedule()  # short decodes (1) while long continues its prefill (31)
    assert [(q, n) for q, n in out.chunks] == [(short, 1), (long, 31)]
    _run(s, out)
    out = s.schedule()
    assert [(q, n) for q, n in out.chunks] == [(short, 1), (long, 12)]
    assert out.num_tokens <= 32


def test_priority_then_arrival_order():
    s = _sched(budget=4, seqs=8)
    low, normal1, high, normal2 = _seq(4, 2), _seq(4, 1), _seq(4, 0), _seq(4, 1)
    for q in (low, normal1, high, normal2):
        s.add(q)
    admitted = []
    for _ in range(4):
        out = s.schedule()
        admitted += [q for q, _ in out.chunks if q not in admitted]
        for q, _ in out.chunks:
            s.finish(q)
    assert admitted == [high, normal1, normal2, low]


def test_preempts_newest_when_kv_runs_out_and_recomputes():
    s = _sched(blocks=6, bs=4, budget=64)
    a, b = _seq(8), _seq(8)  # 2 blocks each
    s.add(a)
    s.add(b)
    _run(s, s.schedule())
    assert s.allocator.num_free == 2
    # Grow both until the pool is exhausted: the newer one (b) is preempted.
    preempted = []
    for _ in range(12):
        out = s.schedule()
        preempted += out.preempted
        _run(s, out)
        if preempted:
            break
    assert preempted == [b]
    assert b.status is SeqStatus.WAITING and b.block_table == [] and b.num_computed == 0
    assert b.num_preemptions == 1
    s.finish(a)
    assert s.allocator.num_free == 6
    out = s.schedule()  # b comes back and recomputes prompt + produced tokens in one chunk
    assert out.chunks == [(b, b.num_tokens)]


def test_abort_frees_blocks_and_queue_bound():
    s = _sched(waiting=2)
    a, b = _seq(10), _seq(10)
    s.add(a)
    s.add(b)
    with pytest.raises(QueueFullError):
        s.add(_seq(3))
    s.schedule()
    used = s.allocator.num_used
    assert used > 0
    s.finish(a)
    s.finish(b)
    assert s.allocator.num_used == 0 and not s.has_work()


def test_never_fitting_request_fails_instead_of_waiting_forever():
    s = _sched(blocks=2, bs=4)
    big = _seq(20)
    s.add(big)
    out = s.schedule()
    assert out.failed == [big] and not s.has_work()


def test_admission_policy_hook_can_hold_back_candidates():
    class OneAdapter(AdmissionPolicy):
        def admit(self, seq, batch):
            return all(q.tenant == seq.tenant for q in batch)

    s = _sched()
    s.policy = OneAdapter()
    x1, y, x2 = _seq(3), _seq(3), _seq(3)
    x1.tenant, y.tenant, x2.tenant = "x", "y", "x"
    for q in (x1, y, x2):
        s.add(q)
    out = s.schedule()
    assert [q for q, _ in out.chunks] == [x1, x2]
    assert s.num_waiting == 1


def test_sampler_greedy_topk_topp_and_seed():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    greedy = _seq(1, temperature=0.0)
    top1 = _seq(1, temperature=1.0, top_k=1)
    nucleus = _seq(1, temperature=1.0, top_p=1e-6)
    free = _seq(1, temperature=1.0)
    out = sample(logits, [greedy, top1, nucleus, free])
    best = logits.argmax(-1).tolist()
    assert out[:3] == best[:3]
    a = [_seq(1, temperature=0.8, seed=42) for _ in range(2)]
    draws_a = [sample(logits[:1].clone(), [a[0]])[0] for _ in range(20)]
    draws_b = [sample(logits[:1].clone(), [a[1]])[0] for _ in range(20)]
    assert draws_a == draws_b and len(set(draws_a)) > 1
    k3 = _seq(1, temperature=2.0, top_k=3)
    allowed = set(logits[0].topk(3).indices.tolist())
    assert {sample(logits[:1], [k3])[0] for _ in range(50)} <= allowed


def test_sampler_draws_each_token_at_its_probability():
    """Many rows of one distribution (a token masked to -inf among them), drawn in one batch: the
    counts match softmax(logits / T) (chi-square, 5 degrees of freedom, far past p = 1e-6), the
    masked token never comes, and a seeded row draws what it draws alone."""
    torch.manual_seed(3)
    logits = torch.tensor([1.5, 0.2, -0.7, 2.1, float("-inf"), 0.9, -1.8])
    temperature, n = 0.8, 24_000
    rows = [_seq(1, temperature=temperature) for _ in range(n)]
    counts = torch.bincount(torch.tensor(sample(logits.expand(n, -1).contiguous(), rows)), minlength=7)
    assert counts[4] == 0
    expected = torch.softmax(logits / temperature, dim=-1) * n
    live = expected > 0
    chi2 = float((((counts[live] - expected[live]) ** 2) / expected[live]).sum())
    assert chi2 < 40.0, (counts.tolist(), expected.tolist())
    alone = sample(logits.unsqueeze(0), [_seq(1, temperature=temperature, seed=5)])
    batch = sample(logits.expand(4, -1), [_seq(1, temperature=temperature) for _ in range(3)]
                   + [_seq(1, temperature=temperature, seed=5)])
    assert batch[3] == alone[0]


def _nucleus_reference(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Each row sorted whole, in float64: the tokens top-k and top-p keep."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    for r in range(logits.shape[0]):
        v, order = torch.sort(logits[r].double(), descending=True)
        k = top_k[r] if top_k[r] > 0 else logits.shape[1]
        p = torch.softmax(v[:k], dim=-1)
        kept = (torch.cumsum(p, dim=-1) - p) < (top_p[r] if top_p[r] < 1.0 else float("inf"))
        kept[0] = True
        keep[r, order[:k][kept]] = True
    return keep


@pytest.mark.parametrize("window", [1024, 8])
def test_top_k_top_p_keep_what_a_whole_sort_keeps(monkeypatch, window):
    """Rows from flat to peaked, top-k and top-p alone and together, a masked token: the filter
    keeps exactly what sorting each row whole in float64 keeps, and leaves the kept logits as they
    were. With a window of 8, every way is taken: the window, the whole row (flat rows, whose
    nucleus cannot fit in 64), and 8 times the window (a plateau of 20 tokens, beside a peaked row:
    the rows left after a pass go on together at the widest any of them needs)."""
    monkeypatch.setattr(sampler, "NUCLEUS_WINDOW", window)
    torch.manual_seed(4)
    scales = [0.3, 1.0, 3.0, 8.0, 20.0, 3.0, 1.0, 8.0]
    logits = torch.stack([torch.randn(700) * s for s in scales] + [torch.randn(700) - 10.0])
    logits[2, 5] = float("-inf")
    logits[8, :20] = 5.0 - 0.01 * torch.arange(20)
    top_k = [-1, -1, -1, -1, 40, 3, 200, -1, -1]
    top_p = [0.9, 0.95, 0.5, 0.99, 0.8, 1.0, 1.0, 1.0, 0.9]
    keep = _nucleus_reference(logits, top_k, top_p)
    assert keep[0].sum() > 64 and 8 < keep[8].sum() < 64 and keep[3].sum() < 8
    for rows in (list(range(9)), [0, 1, 2, 3, 8], [3, 8]):
        out = sampler._filter_top_k_top_p(logits[rows], torch.tensor(top_k)[rows], torch.tensor(top_p)[rows])
        assert torch.equal(out.isfinite(), keep[rows])
        assert torch.equal(out[keep[rows]], logits[rows][keep[rows]])


def test_penalties_and_logit_bias_transform_only_their_rows():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0], [2.0, -1.0, 0.5, 0.0]])
    plain = _seq(2, temperature=0.0)  # prompt ids 1, 2
    pen = _seq(2, temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
               logit_bias=((3, 10.0),))
    pen.output_ids = [0, 0, 2]
    out = apply_penalties(logits, [plain, pen])
    assert torch.equal(out[0], logits[0]) and torch.equal(logits[1], out[0])  # input untouched
    # token 0: output twice (repetition 2.0 -> 1.0, then -0.5 presence, -0.5 frequency);
    # 1: prompt (negative -> *2); 2: prompt+output once (0.25, -0.5, -0.25); 3: bias only.
    assert out[1].tolist() == [0.0, -2.0, -0.5, 10.0]
    assert sample(logits, [plain, pen]) == [0, 3]


def test_token_logprobs_come_from_the_raw_logits():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    rows = [_seq(1, temperature=0.0, logprobs=True, top_logprobs=3), _seq(1, temperature=0.0),
            _seq(1, temperature=0.0, logprobs=True, logit_bias=((5, 100.0),))]
    tokens = sample(logits, rows)
    assert tokens[2] == 5
    lps = token_logprobs(logits, rows, tokens)
    ref = torch.log_softmax(logits, dim=-1)
    assert lps[1] is None
    assert lps[0].token == tokens[0] and abs(lps[0].logprob - float(ref[0].max())) < 1e-6
    assert [t for t, _ in lps[0].top] == ref[0].topk(3).indices.tolist()
    assert abs(lps[2].logprob - float(ref[2, 5])) < 1e-6 and lps[2].top == []  # before the bias


def test_shared_blocks_return_to_the_pool_with_their_last_holder():
    alloc = BlockAllocator(4, 4)
    a = alloc.allocate(2)
    alloc.hold(a)
    alloc.hold(a[:1])
    assert alloc.holders(a[0]) == 3 and alloc.num_free == 2
    alloc.free(a)
    assert alloc.num_free == 2 and alloc.holders(a[0]) == 2
    alloc.free(a[:1])
    alloc.free(a)
    assert alloc.num_free == 4 and alloc.holders(a[0]) == 0
    with pytest.raises(RuntimeError):
        alloc.free(a)


def test_samples_wait_for_the_parent_prompt_then_share_it():
    s = _sched(blocks=16, bs=4, budget=64)
    parent = _seq(10)
    child = _seq(10)
    child.share_from = parent
    s.add(parent)
    s.add(child)
    out = s.schedule()
    assert [(q, n) for q, n in out.chunks] == [(parent, 10)]  # the child waits for the prompt
    parent.num_computed += 10
    parent.output_ids.append(7)
    out = s.schedule()
    # 9 prompt tokens covered: blocks 0-1 shared, block 2 (token 8) copied; the child computes token 9 only
    assert (child, 1) in out.chunks and child.num_computed == 9
    assert child.block_table[:2] == parent.block_table[:2] and out.copies == [(parent.block_table[2],
                                                                               child.block_table[2])]
    assert s.allocator.holders(parent.block_table[0]) == 2
    s.finish(parent)
    s.finish(child)
    assert s.allocator.num_free == 16


def test_burst_budget_widens_steps_only_while_the_queue_exceeds_the_budget():
    s = Scheduler(BlockAllocator(256, 4), max_num_seqs=16, max_num_batched_tokens=32, max_waiting=16,
                  burst_batched_tokens=100)
    # Steady traffic: two prompts fit the budget; the step stays at 32 tokens at most.
    for _ in range(2):
        s.add(_seq(12))
    out = s.schedule()
    assert out.num_tokens == 24
    _run(s, out)
    # A burst: 8 prompts of 12 (96 tokens queued > 32): one step takes them all, with the two
    # decode rows (98 <= 100).
    burst = [_seq(12) for _ in range(8)]
    for q in burst:
        s.add(q)
    out = s.schedule()
    assert out.num_tokens == 98 and {id(q) for q, n in out.chunks if n == 12} == {id(q) for q in burst}
    _run(s, out)
    # A bigger burst is capped at the burst budget, and the rest waits for the next step.
    for _ in range(6):
        s.add(_seq(20))
    out = s.schedule()
    assert out.num_tokens == 100
    # Without a burst budget the same queue gets the plain budget.
    plain = _sched(blocks=256, budget=32, seqs=16)
    for _ in range(6):
        plain.add(_seq(20))
    assert plain.schedule().num_tokens == 32


@pytest.mark.parametrize(("flags", "want"), [({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, 4096),
                                             ({"avx512f", "avx512_bf16", "avx512_vnni"}, 0), ({"avx2", "fma"}, 0)])
def test_the_burst_budget_defaults_by_device(monkeypatch, flags, want):
    """Wider burst steps only where larger prefill matmuls pay (AMX's tiles, CUDA): on other CPUs a
    burst in one step makes every one of its requests wait for all of it."""
    import torch

    import engine.cpu as cpu
    from engine.engine import EngineConfig, burst_tokens
    from loraplex.settings import Settings

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    assert Settings().burst_batched_tokens == -1 and EngineConfig().burst_batched_tokens == 0
    assert burst_tokens(-1, torch.device("cpu")) == want
    assert burst_tokens(-1, torch.device("cuda")) == 4096
    assert burst_tokens(0, torch.device("cpu")) == 0 and burst_tokens(2048, torch.device("cpu")) == 2048
