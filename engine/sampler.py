"""Choose the next token for each sampled row: greedy, temperature, top-k, top-p, seeds.

All rows are processed together; only the random draw is per row, so a request with
a ``seed`` draws from its own ``torch.Generator`` and reproduces its tokens whatever
else shares the batch. Sampling uses the exponential race (``argmax(p / E)`` with
``E ~ Exp(1)``), which draws exactly from ``p``.
"""

from __future__ import annotations

import torch

from engine.sequence import Sequence


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and nucleus; ``top_k <= 0`` means all."""
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly before each token
    drop |= before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """``logits``: float32 ``[S, V]``; ``seqs``: the sequence of each row."""
    n = logits.shape[0]
    if n == 0:
        return []
    out = torch.argmax(logits, dim=-1)
    random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        sub = logits.index_select(0, idx)
        ps = [seqs[i].params for i in random_rows]
        temp = torch.tensor([p.temperature for p in ps], dtype=sub.dtype, device=sub.device)
        sub = sub / temp.unsqueeze(1)
        top_k = torch.tensor([p.top_k for p in ps], device=sub.device)
        top_p = torch.tensor([p.top_p for p in ps], dtype=sub.dtype, device=sub.device)
        if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
            sub = _filter_top_k_top_p(sub, top_k, top_p)
        probs = torch.softmax(sub, dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(random_rows) if seqs[i].generator is None]
        if unseeded:
            noise[unseeded] = torch.empty((len(unseeded), probs.shape[1]), device=probs.device).exponential_()
        for j, i in enumerate(random_rows):
            g = seqs[i].generator
            if g is not None:
                noise[j] = torch.empty(probs.shape[1]).exponential_(generator=g).to(probs.device)
        chosen = torch.argmax(probs / noise, dim=-1)
        out[idx] = chosen
    return out.tolist()
