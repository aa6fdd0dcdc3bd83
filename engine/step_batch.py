"""Per-step batch metadata: what one forward pass over a mixed prefill/decode batch needs.

The scheduler picks, for each running sequence, a contiguous chunk of its tokens
that are not yet in the KV cache (a prompt chunk, a recompute after preemption, or
the one newest token of a decoding sequence). ``build_batch`` flattens all chunks
into one token dimension ``T`` (sequence after sequence, in batch order) and records:

* ``input_ids``, ``positions``, ``slot_mapping`` (KV slot each token's K/V is written to);
* ``token_seq[t]``: index (into ``seqs``) of the sequence token row ``t`` belongs to,
  and ``seq_adapters`` / ``seq_slots`` — what a LoRA layer needs to map rows to
  adapter slots;
* ``sample_rows``: the token row of each sequence that samples this step (the last
  token of a chunk that reaches the end of the sequence); only these rows go through
  the final norm and the LM head;
* attention plans: one batched ``DecodeGroup`` for all single-token chunks and one
  ``PrefillItem`` per multi-token chunk; and ``kv_tables``, every sequence's block table
  (what the native kernel needs to attend every row, prefill rows included, in one call).

``lora`` is the hook object a LoRA manager sets (``None`` for base-only batches); see
``engine.model`` for the call contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.sequence import Sequence


@dataclass
class DecodeGroup:
    rows: torch.Tensor
    """``[B]`` token rows (one per decoding sequence)."""
    blocks: torch.Tensor
    """``[B * nb]`` KV blocks to gather, row-major (``nb`` blocks of the longest context; a shorter
    row is padded with its own last block, never another sequence's)."""
    valid: torch.Tensor
    """``[B, nb * block_size]`` bool: key position is inside that sequence's context."""
    contiguous: bool
    """True when ``rows`` is ``0..B-1`` (a pure decode step), so no scatter is needed."""
    lens: torch.Tensor
    """``[B]`` int64: context length of each sequence (this step's token included)."""
    masked: torch.Tensor | None = None
    """``[kv_heads * B, 1, C]`` bool, True outside each context; built once per step by the attention."""


@dataclass
class PrefillItem:
    start: int
    end: int
    """Token rows ``[start, end)`` of this chunk."""
    blocks: torch.Tensor
    """``[nb]`` the sequence's KV blocks covering positions ``0..C-1`` (``C = nb * block_size``)."""
    mask: torch.Tensor
    """``[L, C]`` bool causal mask (query at position p sees keys ``0..p``)."""
    first: int
    """The chunk's first position: every row sees keys ``0..first``, and only the columns after
    ``first`` are masked for some row."""
    masked: torch.Tensor | None = None
    """``[L, C]`` ``~mask``, built once per step by the attention."""


@dataclass
class BatchContext:
    seqs: list[Sequence]
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    token_seq: torch.Tensor
    """``[T]`` long: sequence index (into ``seqs``) of each token row."""
    chunk_lens: list[int]
    sample_rows: torch.Tensor
    """``[S]`` long: token rows whose logits are computed."""
    sample_seqs: list[int]
    """Sequence index (into ``seqs``) of each sampled row."""
    decode: DecodeGroup | None
    prefills: list[PrefillItem]
    lora: Any = None
    """LoRA hook (``apply(layer_idx, module, x, out)``) or ``None``."""
    seq_slots: torch.Tensor | None = None
    """``[num_seqs]`` adapter slot per sequence, filled by the LoRA manager if it wants."""
    row_finite: torch.Tensor | None = None
    """``[T]`` bool, set by the forward: the row's final hidden state is all finite."""
    kv_tables: torch.Tensor | None = None
    """``[num_seqs, nb]`` int64: each sequence's KV blocks covering its context after this step,
    padded with its own last block (``nb`` blocks of the longest context)."""
    row_blocks: torch.Tensor | None = None
    """``[R, nb]`` the ``kv_tables`` row of each token row the native kernel attends, built once
    per step by the attention."""
    row_lens: torch.Tensor | None = None
    """``[R]`` int64: keys each of those rows attends to (its position + 1), with ``row_blocks``."""
    row_max_len: int = 0
    """The largest of ``row_lens``."""
    kernel_rows: torch.Tensor | None = None
    """``[R]`` int64: the token rows the native kernel attends, or None for every row."""
    matmul_prefills: list[PrefillItem] = field(default_factory=list)
    """Prefill chunks over a long cached context, attended by matrix products instead of the
    native kernel (``engine.attention``)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_adapters(self) -> list[Any]:
        return [s.adapter for s in self.seqs]


def build_batch(chunks: list[tuple[Sequence, int]], block_size: int, device: torch.device) -> BatchContext:
    """Flatten ``(sequence, chunk_len)`` pairs (chunk starts at ``seq.num_computed``)."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    token_seq: list[int] = []
    sample_rows: list[int] = []
    sample_seqs: list[int] = []
    dec_rows: list[int] = []
    dec_seq: list[Sequence] = []
    prefill_specs: list[tuple[int, int, Sequence]] = []
    row = 0
    for i, (seq, n) in enumerate(chunks):
        start = seq.num_computed
        toks = seq.all_token_ids
        ids.extend(toks[start:start + n])
        pos.extend(range(start, start + n))
        table = seq.block_table
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        token_seq.extend([i] * n)
        if start + n == len(toks):
            sample_rows.append(row + n - 1)
            sample_seqs.append(i)
        if n == 1:
            dec_rows.append(row)
            dec_seq.append(seq)
        else:
            prefill_specs.append((row, row + n, seq))
        row += n

    decode = None
    if dec_rows:
        lens = [s.num_computed + 1 for s in dec_seq]
        nb = -(-max(lens) // block_size)
        flat: list[int] = []
        for s in dec_seq:
            table = s.block_table[:nb]
            flat.extend(table)
            flat.extend([table[-1]] * (nb - len(table)))
        lens_t = torch.tensor(lens)
        valid = torch.arange(nb * block_size).unsqueeze(0) < lens_t.unsqueeze(1)
        contiguous = dec_rows == list(range(len(dec_rows))) and row == len(dec_rows)
        decode = DecodeGroup(torch.tensor(dec_rows, device=device), torch.tensor(flat, device=device),
                             valid.to(device), contiguous, lens_t.to(device))
    prefills = []
    for start_row, end_row, seq in prefill_specs:
        n = end_row - start_row
        c = seq.num_computed + n
        nb = -(-c // block_size)
        qpos = torch.arange(seq.num_computed, c)
        mask = torch.arange(nb * block_size).unsqueeze(0) <= qpos.unsqueeze(1)
        prefills.append(PrefillItem(start_row, end_row, torch.tensor(seq.block_table[:nb], device=device),
                                    mask.to(device), seq.num_computed))
    ends = [seq.num_computed + n for seq, n in chunks]
    nb_all = -(-max(ends, default=1) // block_size)
    tables: list[list[int]] = []
    for (seq, _), end in zip(chunks, ends, strict=True):
        table = seq.block_table[:-(-end // block_size)]
        tables.append(table + [table[-1]] * (nb_all - len(table)))
    return BatchContext(
        seqs=[s for s, _ in chunks],
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        token_seq=torch.tensor(token_seq, dtype=torch.long, device=device),
        chunk_lens=[n for _, n in chunks],
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        sample_seqs=sample_seqs,
        decode=decode,
        prefills=prefills,
        kv_tables=torch.tensor(tables, dtype=torch.long, device=device) if tables else None,
    )
