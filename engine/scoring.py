"""Teacher-forced logits (the next-token logits at every position of a given text), and how
closely two engines agree on them."""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.sequence import SamplingParams, Sequence
from engine.step_batch import build_batch


def forced_logits(engine: Any, ids: list[int], prefill_len: int, adapter: Any = None,
                  load_timeout_s: float = 120.0) -> torch.Tensor:
    """``engine``'s logits at positions ``prefill_len-1 .. len(ids)-1`` of ``ids``: one prefill of
    the first ``prefill_len`` tokens, then one decode step per further token, with ``adapter``'s
    LoRA (an ``AdapterRef``, loaded first if need be) or the base model. Not for a
    running engine: it steps the model directly, beside the scheduler."""
    seq = Sequence(list(ids[:prefill_len]), SamplingParams(temperature=0.0), adapter=adapter)
    rt = engine.lora_runtime if adapter is not None else None
    if rt is not None:
        rt.prefetch(seq)
        deadline = time.monotonic() + load_timeout_s
        while not rt.admit(seq, []):
            if rt.failure(seq) or time.monotonic() > deadline:
                raise RuntimeError(f"adapter {adapter.id} was not admitted: {rt.failure(seq) or 'timed out'}")
            time.sleep(0.01)
    alloc = engine.cache.allocator
    rows = []
    n = prefill_len
    try:
        while True:
            need = alloc.blocks_for(seq.num_tokens) - len(seq.block_table)
            seq.block_table.extend(alloc.allocate(need))
            ctx = build_batch([(seq, n)], engine.cache.block_size, engine.model.device)
            if rt is not None:
                rt.prepare_batch(ctx)
            rows.append(engine.model.forward(ctx, engine.cache)[0])
            seq.num_computed += n
            if seq.num_tokens >= len(ids):
                break
            seq.output_ids.append(ids[seq.num_tokens])
            n = 1
    finally:
        alloc.free(seq.block_table)
        if rt is not None:
            rt.release(seq)
    return torch.stack(rows)


def agreement(ref: Any, other: Any, prompts: list[list[int]], new: int, adapter: Any = None) -> dict[str, float]:
    """How closely ``other`` follows ``ref`` on ``ref``'s own greedy continuations of ``prompts``
    (``new`` tokens each, teacher-forced into both): the share of positions whose top-1 tokens
    agree and the KL divergence KL(ref || other) per position (mean, p99, max). Steps ``ref``
    directly: not for a running engine."""
    agree = total = 0
    kls = []
    for prompt in prompts:
        seq = ref.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=new), adapter=adapter)
        while not seq.is_finished:
            if not ref.step():
                time.sleep(0.002)  # waiting on an adapter load
        ids = prompt + seq.output_ids
        a = forced_logits(ref, ids, len(prompt), adapter).float().log_softmax(-1)
        b = forced_logits(other, ids, len(prompt), adapter).float().log_softmax(-1)
        kls.append((a.exp() * (a - b)).sum(-1))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    kl = torch.cat(kls)
    return {"positions": total, "top1_agreement": agree / total, "kl_mean": float(kl.mean()),
            "kl_p99": float(kl.quantile(0.99)), "kl_max": float(kl.max())}
