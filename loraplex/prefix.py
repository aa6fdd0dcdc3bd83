"""Prefix-cache keys: what makes two requests' KV blocks the same, shared by worker and gateway.

A KV block holds the keys and values of ``block_size`` prompt tokens, and they depend on
everything before them (the tokens of earlier blocks), on the base model and on the adapter
whose LoRA deltas shaped the projections. So a block's key is a chain: the first block's
parent is the request's *namespace*, a digest of (base model revision, adapter version
digest or ``base``, cache scope), and each later block's key hashes its parent's key with its
own tokens. Two requests share a block only when all of that matches exactly:

- the adapter is named by its content digest, never by its name or registry id, so a name
  re-registered with other weights, or reloaded in place, never meets the old blocks;
- the base model and a base-model request are namespaced as ``base``: no adapter's blocks;
- the scope is the tenant's own by default (``tenant:<slug>``), or a shared scope an operator
  set (``shared:<name>``). It comes from the gateway's registry lookup, never from the client:
  a shared prefix cache answers faster for prompts another tenant sent, which is a side
  channel across tenants ("I Know What You Asked", NDSS 2025).

SHA-256 throughout (as vLLM's ``sha256`` prefix hashing): a collision would hand one request
another's KV, so the keys must not collide by accident or by construction.
"""

from __future__ import annotations

import hashlib
from array import array

_DOMAIN = b"loraplex.prefix.v1\x00"

BASE = "base"
"""The adapter part of a base-model request's namespace (adapter digests are 64 hex digits)."""


def tenant_scope(slug: str) -> str:
    """The scope of a tenant that shares with no one: its own."""
    return f"tenant:{slug}"


def shared_scope(name: str) -> str:
    """The scope an operator puts several tenants in."""
    return f"shared:{name}"


def namespace(base_revision: str, adapter_digest: str | None, scope: str) -> bytes:
    """The root of a request's block chain: (base model revision, adapter digest or ``base``, scope)."""
    h = hashlib.sha256(_DOMAIN)
    for part in (base_revision, adapter_digest or BASE, scope):
        raw = part.encode("utf-8", "surrogatepass")
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
    return h.digest()


def cache_salt(ns: bytes) -> str:
    """vLLM's ``cache_salt`` for a namespace: vLLM mixes it into its first block's hash, so
    a vLLM fleet gets the same isolation."""
    return ns.hex()


def block_hashes(root: bytes, token_ids: list[int], block_size: int, known: list[bytes] | None = None) -> list[bytes]:
    """The keys of every full ``block_size``-token block of ``token_ids`` under ``root``.
    ``known``: keys already computed for a prefix of the same tokens (extended, not redone)."""
    out = list(known) if known else []
    parent = out[-1] if out else root
    for i in range(len(out) * block_size, len(token_ids) - block_size + 1, block_size):
        h = hashlib.sha256(parent)
        h.update(array("q", token_ids[i:i + block_size]).tobytes())
        parent = h.digest()
        out.append(parent)
    return out
