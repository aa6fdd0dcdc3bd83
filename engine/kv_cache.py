"""Paged KV cache: one pool of fixed-size blocks, per-sequence block tables.

Storage is one tensor per layer for K and one for V, shaped
``[num_kv_heads, num_blocks * block_size, head_dim]``: a token at position ``p`` of a
sequence lives in slot ``block_table[p // block_size] * block_size + p % block_size``.
Keeping the slot axis second lets a step gather every sequence's context with one
``index_select`` per layer (see ``engine.attention``).

``BlockAllocator`` hands out block ids; the scheduler asks it before admitting or
extending a sequence and returns blocks when a sequence finishes, is aborted or is
preempted. The number of blocks follows from ``kv_cache_bytes``. Blocks are refcounted:
the samples of one request (``n`` > 1) share their prompt's full blocks (``share``), and a
block goes back to the pool when its last holder frees it. A shared block is never written:
a sample's first own block starts as a copy of the parent's partial block (copy on write,
``KVCache.copy_blocks``).

Reused blocks are not cleared: attention gives every position outside a sequence's
context a weight of exactly 0 (scores masked, not added to), which is exact as long as
the stale V values there are finite. The engine keeps it so: K/V a row wrote while its
hidden state went non-finite are zeroed (``scrub``) before the blocks can be reused.

The pools may hold a narrower dtype than the activations (``LORAPLEX_KV_CACHE_DTYPE``:
bfloat16 K/V under float32 activations, as vLLM-CPU keeps them): half the bytes per token,
so twice the tokens in ``kv_cache_bytes`` and half the memory traffic of decode attention.
``write`` rounds K/V to the pool dtype (to nearest, ties to even) and ``gather`` widens them
back (exact) for the attention math, which stays in the activations' dtype. A float32 value
beyond bfloat16's range becomes Inf in the pool; the row that wrote it reads it back in the
same step (every token attends to itself), so its output goes non-finite and ``scrub``
clears it as it would a NaN.
"""

from __future__ import annotations

import math
import mmap
from collections import OrderedDict

import torch

from engine.config import ModelConfig


class OutOfBlocksError(RuntimeError):
    pass


class BlockAllocator:
    """Block ids for sequences, kept in runs where the pool allows, and the prefix cache's index.

    Decode attention streams each sequence's K and V block by block; blocks that follow each other
    in the pool are read as one stream, scattered ones each pay a memory round trip (2 cores of a
    Sapphire Rapids, 32 rows of 144 tokens over 30 layers of bfloat16 blocks: 10.5-11.1 ms
    scattered, 7.1-7.2 ms with each sequence's blocks in order). So a sequence grows into the
    block after its last one when that one is free (``after``), and a new sequence's first blocks
    come from a cursor that then moves past the room its request may grow into (``reserve``):
    the next sequence starts beyond it. The room is not held: when the cursor comes round to it
    (the pool is busy), any free block is taken, and a sequence whose next block is gone grows
    into whatever block is free.

    Prefix cache: a full block whose K/V are computed may be given a key (``cache``: the chained
    hash of ``loraplex.prefix.block_hashes``). A later sequence finds its prompt's longest chain
    of cached keys (``lookup``) and holds those blocks (``hold``) instead of computing them. A
    cached block no one holds stays in the pool, evictable, least recently freed first: it counts
    as free, and ``allocate`` takes truly free blocks first, then evicts. Every block is in exactly
    one state: truly free, evictable (cached, no holder) or held (one holder, plus ``_shared``
    beyond the first)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._is_free = bytearray(b"\x01") * num_blocks
        """Truly free: no holder and no cached content."""
        self._num_free = num_blocks
        self._cursor = 0
        """Where the next block without a predecessor is looked for (then onward, wrapping)."""
        self._shared: dict[int, int] = {}
        """Holders beyond the first, of blocks more than one sequence holds."""
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        """The prefix cache: block <-> key, for held and evictable cached blocks alike."""
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Cached blocks no sequence holds, the next to evict first."""
        self.evictions = 0
        """Cached blocks given to another use since start (a counter)."""

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: truly free and evictable."""
        return self._num_free + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks with a prefix-cache key, held or evictable."""
        return len(self._key_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def _evict(self, b: int) -> int:
        """Drop an evictable block's key and hand it out as truly free (the caller takes it)."""
        del self._evictable[b]
        del self._block_of[self._key_of.pop(b)]
        self.evictions += 1
        self._num_free += 1  # counted back out by the caller, as for a truly free block
        self._is_free[b] = 1
        return b

    def _take(self, nxt: int) -> int:
        """The block a sequence grows into: ``nxt`` (the one after its last, ``-1``: none) when it
        is truly free; else a truly free one from the cursor on; else, with none left, ``nxt`` if
        it is evictable (the sequence stays one run), else the least recently freed evictable."""
        free = self._is_free
        if 0 <= nxt < self.num_blocks and free[nxt]:
            return nxt
        b = free.find(1, self._cursor)
        if b < 0:
            b = free.find(1)
        if b >= 0:
            self._cursor = b + 1
            return b
        if nxt in self._evictable:
            return self._evict(nxt)
        return self._evict(next(iter(self._evictable)))

    def allocate(self, n: int, after: int | None = None, reserve: int = 0) -> list[int]:
        """``n`` blocks, each the one after the previous where it is free; the first after block
        ``after`` (a sequence's last), else at the cursor, which then skips ``reserve`` blocks in
        all from the first (the room the sequence may grow into). Evicts cached blocks only when
        no truly free one is left (``_take``)."""
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} KV blocks, {self.num_free} free")
        free = self._is_free
        out: list[int] = []
        prev = after
        for _ in range(n):
            b = self._take(prev + 1 if prev is not None else -1)
            free[b] = 0
            self._num_free -= 1
            out.append(b)
            prev = b
        if after is None and n and reserve > n:
            self._cursor = (out[0] + reserve) % self.num_blocks
        return out

    def hold(self, blocks: list[int]) -> None:
        """One more holder for each of ``blocks``: held ones (a parent sample's) or cached ones
        (``lookup``'s; an evictable one leaves the eviction queue)."""
        for b in blocks:
            if b in self._evictable:
                del self._evictable[b]
            else:
                self._shared[b] = self._shared.get(b, 0) + 1

    def holders(self, block: int) -> int:
        if self._is_free[block] or block in self._evictable:
            return 0
        return 1 + self._shared.get(block, 0)

    def evictable_among(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are evictable (holding them takes that many free blocks)."""
        return sum(1 for b in blocks if b in self._evictable)

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each block; a block's last holder frees it, to the eviction queue if it
        is cached. A sequence's blocks are queued last first, so a chain is evicted from its tail
        (its head, which more prompts share, stays findable longest)."""
        if self._shared:
            last = []
            for b in blocks:
                k = self._shared.get(b)
                if k is None:
                    last.append(b)
                elif k == 1:
                    del self._shared[b]
                else:
                    self._shared[b] = k - 1
            blocks = last
        free = self._is_free
        for b in reversed(blocks):
            if free[b] or b in self._evictable:
                raise RuntimeError("KV block freed twice")
            if b in self._key_of:
                self._evictable[b] = None
            else:
                free[b] = 1
                self._num_free += 1

    def cache(self, block: int, key: bytes) -> bool:
        """Give a held, fully computed block its prefix key. False when the key already names
        another block (computed twice at once) or the block has a key: the first one stays."""
        if key in self._block_of or block in self._key_of:
            return False
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys``."""
        out = []
        for k in keys:
            b = self._block_of.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def uncache(self, blocks: list[int]) -> None:
        """Forget the keys of ``blocks`` (their content must not be reused); an evictable one
        becomes truly free."""
        for b in blocks:
            key = self._key_of.pop(b, None)
            if key is None:
                continue
            del self._block_of[key]
            if b in self._evictable:
                del self._evictable[b]
                self._is_free[b] = 1
                self._num_free += 1

    def check(self) -> None:
        """Raise if the bookkeeping disagrees with itself (tests)."""
        free = self._is_free
        assert self._num_free == sum(free), "truly free count"
        assert all(b in self._key_of and not free[b] for b in self._evictable), "evictable not cached"
        assert all(not free[b] for b in self._key_of), "a free block is cached"
        assert all(self._block_of[k] == b for b, k in self._key_of.items()), "cache maps disagree"
        assert len(self._block_of) == len(self._key_of), "cache maps disagree"
        assert all(not free[b] and b not in self._evictable for b in self._shared), "shared block not held"


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * block_size * elem


def _zeros(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed pool. On CPU, anonymous mapped memory, zero until written: a pool sized for the
    machine takes resident memory only as its blocks are first used, not all at start-up."""
    if device.type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, compute_dtype: torch.dtype | None = None) -> None:
        """``dtype``: the pools' dtype; ``compute_dtype``: the activations' (default ``dtype``),
        in which ``gather`` hands K/V to attention."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        slots = num_blocks * block_size
        shape = (cfg.num_kv_heads, slots, cfg.head_dim)
        self.k = [_zeros(shape, device, dtype) for _ in range(cfg.num_layers)]
        self.v = [_zeros(shape, device, dtype) for _ in range(cfg.num_layers)]
        self.allocator = BlockAllocator(num_blocks, block_size)
        self._gather_k = torch.empty(0, device=device, dtype=dtype)
        self._gather_v = torch.empty(0, device=device, dtype=dtype)
        self._wide_k = torch.empty(0, device=device, dtype=self.compute_dtype)
        self._wide_v = torch.empty(0, device=device, dtype=self.compute_dtype)
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim

    @classmethod
    def from_bytes(cls, cfg: ModelConfig, cache_bytes: int, block_size: int, device: torch.device,
                   dtype: torch.dtype, compute_dtype: torch.dtype | None = None) -> KVCache:
        """As many blocks of ``dtype`` K/V as ``cache_bytes`` holds."""
        n = cache_bytes // block_bytes(cfg, block_size, dtype)
        if n < 1:
            raise ValueError(f"kv_cache_bytes={cache_bytes} holds no {block_size}-token block "
                             f"({block_bytes(cfg, block_size, dtype)} bytes each)")
        return cls(cfg, int(n), block_size, device, dtype, compute_dtype)

    @staticmethod
    def _workspace(buf: torch.Tensor, numel: int) -> torch.Tensor:
        return buf if buf.numel() >= numel else torch.empty(numel, device=buf.device, dtype=buf.dtype)

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``blocks`` as ``[kv_heads, len(blocks) * block_size, head_dim]``, in the
        compute dtype (pools of a narrower dtype are widened).

        The result lives in a reused workspace (valid until the next ``gather``): fresh
        multi-megabyte buffers every layer would cost page faults on CPU.
        """
        n = int(blocks.shape[0])
        numel = self.num_kv_heads * n * self.block_size * self.head_dim
        self._gather_k = self._workspace(self._gather_k, numel)
        self._gather_v = self._workspace(self._gather_v, numel)
        shape = (self.num_kv_heads, n, self.block_size * self.head_dim)
        k_out = self._gather_k[:numel].view(shape)
        v_out = self._gather_v[:numel].view(shape)
        kc = self.k[layer].view(self.num_kv_heads, self.num_blocks, -1)
        vc = self.v[layer].view(self.num_kv_heads, self.num_blocks, -1)
        torch.index_select(kc, 1, blocks, out=k_out)
        torch.index_select(vc, 1, blocks, out=v_out)
        if self.dtype != self.compute_dtype:
            self._wide_k = self._workspace(self._wide_k, numel)
            self._wide_v = self._workspace(self._wide_v, numel)
            k_out = self._wide_k[:numel].view(shape).copy_(k_out)
            v_out = self._wide_v[:numel].view(shape).copy_(v_out)
        out_shape = (self.num_kv_heads, n * self.block_size, self.head_dim)
        return k_out.view(out_shape), v_out.view(out_shape)

    def scrub(self, slots: torch.Tensor | None = None, blocks: list[int] | None = None) -> None:
        """Zero K and V in every layer at token ``slots`` and over whole ``blocks``."""
        for layer in range(len(self.k)):
            for pool in (self.k[layer], self.v[layer]):
                if slots is not None and slots.numel():
                    pool.index_fill_(1, slots.to(pool.device), 0)
                if blocks:
                    idx = torch.tensor(blocks, dtype=torch.long, device=pool.device)
                    pool.view(self.num_kv_heads, self.num_blocks, -1).index_fill_(1, idx, 0)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy K and V of block ``src`` to ``dst`` in every layer, for each ``(src, dst)``."""
        if not pairs:
            return
        dev = self.k[0].device
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=dev)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=dev)
        for layer in range(len(self.k)):
            for pool in (self.k[layer], self.v[layer]):
                view = pool.view(self.num_kv_heads, self.num_blocks, -1)
                view.index_copy_(1, dst, view.index_select(1, src))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` of shape ``[T, kv_heads, head_dim]`` at ``slots`` ``[T]``, rounded to
        the pools' dtype (to nearest, ties to even) where it is narrower."""
        self.k[layer].index_copy_(1, slots, k.transpose(0, 1).to(self.dtype))
        self.v[layer].index_copy_(1, slots, v.transpose(0, 1).to(self.dtype))
