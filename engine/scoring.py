"""Teacher-forced logits: the model's next-token logits at every position of a given text."""

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
