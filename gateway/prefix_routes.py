"""Prefix-aware routing: which worker most likely holds a request's prompt prefix in its KV cache.

A worker keeps the KV blocks of the prompts it served and reuses them for a later prompt that
starts the same way (``loraplex.prefix``), so the worker that served a prefix answers it again
without computing it. The gateway cannot see workers' caches; it remembers where it sent what:

- **Keys.** The prompt's token ids (the gateway encodes every prompt to count it, with the
  worker's own tokenizer and template: ``gateway.prompt_tokens``) in ``CHUNK_TOKENS`` chunks,
  chained by ``loraplex.prefix.block_hashes`` under the request's ``loraplex.prefix.namespace``
  (base revision, adapter version digest or base, the tenant's cache scope): the same roots as
  the worker's cache, so a prompt never steers toward another scope's, another adapter's or
  another base revision's entries. Only the first ``MAX_HASHED_TOKENS`` are hashed (a
  544-token prompt costs ~26 us of hashing, a tenth of encoding it). Chunks are longer than a
  KV block: a chunk steers only when a worker could reuse that much, so a short common opening
  (a chat template's header) steers nothing. While the gateway has no tokenizer for the base
  model (none fetched yet), or one worker serves it, requests carry no key and route as before.
- **Map.** An LRU of chunk key -> the last ``HOLDERS`` workers sent a prompt holding it,
  at most ``MAX_CHUNKS`` keys (about 150 bytes each: ~10 MB at the cap). A chain is recorded
  last chunk first, so a prompt's opening chunks are the most recent and are evicted last: a
  chain stays a prefix of itself as it ages out. Entries of a worker that left, failed or
  went quiet stay until evicted but are never read: only candidates are looked up.
- **Rule** (``prefer``). Among the candidates the router allows (ring neighbours under the load
  bound, of the best adapter residency tier), the one holding the longest chain of the prompt
  serves, unless its load exceeds the least-loaded candidate's by more than
  ``max(LOAD_SLACK, LOAD_SHARE x that load)``: then the next holder within that margin (a
  shorter chain, or a less loaded holder of the same length), else the least-loaded candidate,
  which then holds the prefix too. One hot prefix therefore spreads over workers once its
  holder is busier than the rest by the margin, instead of pinning one.
- **Conversations.** A Responses continuation goes to the worker that served the previous turn
  (``served_turn`` / ``turn_worker``, an LRU of ``MAX_TURNS`` response ids in this replica) while
  it is a candidate, whatever the margin: its replayed conversation is the longest prefix it
  could reuse, and one conversation is sequential, so it cannot pin a worker by itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from loraplex.prefix import block_hashes

CHUNK_TOKENS = 32
"""Prompt tokens per map key (two of the worker's default 16-token KV blocks)."""
MAX_HASHED_TOKENS = 4096
"""Only a prompt's opening this long is hashed: enough to tell prompts apart, bounded per request."""
MAX_CHUNKS = 65_536
"""Keys the map holds (~2M prompt tokens of distinct prefixes), least recently used out first."""
HOLDERS = 3
"""Workers remembered per key, most recent first."""
MAX_TURNS = 16_384
"""Response ids whose serving worker is remembered."""
LOAD_SLACK = 2
LOAD_SHARE = 0.5
"""A holder serves while its load <= the least-loaded candidate's + max(LOAD_SLACK, LOAD_SHARE x it)."""

PREFIX = "prefix"
CONTINUATION = "continuation"
AFFINITY = "affinity"
LOAD = "load"
REASONS = (PREFIX, CONTINUATION, AFFINITY, LOAD)
"""Why the router put a worker first: it holds the prompt's prefix; it served the previous turn of
the conversation; adapter affinity (residency, then ring order); load (the prefix holders or the
ring candidates are too busy, the least-loaded serves)."""


def chain(root: bytes, token_ids: Sequence[int]) -> list[bytes]:
    """The map keys of a prompt: its ``CHUNK_TOKENS`` chunks chained under ``root`` (a namespace)."""
    ids = token_ids[:MAX_HASHED_TOKENS]
    return block_hashes(root, ids if isinstance(ids, list) else list(ids), CHUNK_TOKENS)


@dataclass(frozen=True, slots=True)
class PrefixQuery:
    """What routing knows of a request's prefix."""

    chain: list[bytes]
    """The prompt's chunk keys (``chain``); empty when the prompt was not encoded."""
    after: str | None = None
    """The worker that served the previous turn of its Responses conversation, if this replica knows."""


class Candidate(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def load(self) -> int: ...


C = TypeVar("C", bound=Candidate)


def within_margin(load: int, least: int) -> bool:
    """Whether a worker with ``load`` may serve for its prefix when the least-loaded candidate has ``least``."""
    return load - least <= max(LOAD_SLACK, LOAD_SHARE * least)


class PrefixRoutes:
    """The bounded map of recent prompt-prefix chunks to the workers they were sent to."""

    def __init__(self, max_chunks: int = MAX_CHUNKS, max_turns: int = MAX_TURNS) -> None:
        self.max_chunks = max_chunks
        self.max_turns = max_turns
        self._chunks: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()
        self._turns: OrderedDict[str, str] = OrderedDict()
        self._solo: dict[str, tuple[str, ...]] = {}
        """One shared ``(worker,)`` tuple per worker (most keys have a single holder)."""

    def __len__(self) -> int:
        return len(self._chunks)

    def record(self, keys: Sequence[bytes], worker_id: str) -> None:
        """``worker_id`` was sent a prompt with these chunk keys (it will hold their KV)."""
        if not keys:
            return
        chunks = self._chunks
        solo = self._solo.get(worker_id)
        if solo is None:
            if len(self._solo) > 4096:
                self._solo.clear()
            solo = self._solo[worker_id] = (worker_id,)
        for key in reversed(keys):  # the opening last: most recent, evicted last
            holders = chunks.get(key)
            if holders is None:
                chunks[key] = solo
                continue
            if holders[0] != worker_id:
                chunks[key] = (worker_id, *[h for h in holders if h != worker_id][:HOLDERS - 1])
            chunks.move_to_end(key)
        while len(chunks) > self.max_chunks:
            chunks.popitem(last=False)

    def depths(self, keys: Sequence[bytes], ids: Container[str]) -> dict[str, int]:
        """How many opening chunks of ``keys`` each of the workers ``ids`` holds (absent: none).
        The walk stops at the first chunk none of them holds."""
        out: dict[str, int] = {}
        get = self._chunks.get
        for i, key in enumerate(keys, 1):
            holders = get(key)
            if holders is None:
                break
            hit = False
            for w in holders:
                if w in ids:
                    out[w] = i
                    hit = True
            if not hit:
                break
        return out

    def prefer(self, query: PrefixQuery, eligible: Sequence[C]) -> tuple[C | None, str]:
        """The worker to try first among ``eligible`` and why (``CONTINUATION``, ``PREFIX`` or
        ``LOAD``), or ``(None, "")`` when neither the conversation nor the prefix points anywhere
        (the router's order stands). The rule is the module's."""
        if not eligible:
            return None, ""
        if query.after is not None:
            for w in eligible:
                if w.id == query.after:
                    return w, CONTINUATION
        if not query.chain or not self._chunks:
            return None, ""
        by_id = {w.id: w for w in eligible}
        depths = self.depths(query.chain, by_id)
        if not depths:
            return None, ""
        least = min(w.load for w in eligible)
        order = {w.id: i for i, w in enumerate(eligible)}
        for wid in sorted(depths, key=lambda i: (-depths[i], by_id[i].load, order[i])):
            w = by_id[wid]
            if within_margin(w.load, least):
                return w, PREFIX
        return next(w for w in eligible if w.load == least), LOAD

    def served_turn(self, response_id: str, worker_id: str) -> None:
        """The Responses turn ``response_id`` was answered by ``worker_id``."""
        turns = self._turns
        turns[response_id] = worker_id
        turns.move_to_end(response_id)
        while len(turns) > self.max_turns:
            turns.popitem(last=False)

    def turn_worker(self, response_id: str) -> str | None:
        """The worker that answered ``response_id``, if this replica served it recently."""
        return self._turns.get(response_id)
