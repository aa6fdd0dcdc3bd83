"""The gateway's prefix map (``gateway.prefix_routes``): bounded, least recently used out first,
namespaced as the workers' caches are, and weighed against load; and the router putting the
worker that holds a prompt's prefix first, only among the candidates it already allows."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from gateway.prefix_routes import (
    AFFINITY,
    CHUNK_TOKENS,
    CONTINUATION,
    LOAD,
    MAX_HASHED_TOKENS,
    PREFIX,
    PrefixQuery,
    PrefixRoutes,
    chain,
    within_margin,
)
from gateway.router import Router
from loraplex.prefix import namespace, shared_scope, tenant_scope
from loraplex.residency import MemoryResidency
from loraplex.wire import WorkerReport

DIGEST_A = "a" * 64
DIGEST_B = "b" * 64
PROMPT = list(range(1000, 1000 + 10 * CHUNK_TOKENS))


@dataclass
class W:
    id: str
    load: int = 0


def _ns(scope: str = "tenant:acme", digest: str | None = None, rev: str = "r1") -> bytes:
    return namespace(rev, digest, scope)


def test_a_chain_is_one_key_per_full_chunk_of_the_hashed_opening():
    root = _ns()
    assert len(chain(root, PROMPT)) == 10
    assert len(chain(root, PROMPT + [7] * (CHUNK_TOKENS - 1))) == 10  # a partial chunk has no key
    assert chain(root, PROMPT[:CHUNK_TOKENS * 3]) == chain(root, PROMPT)[:3]  # a prefix's keys are a prefix
    long = list(range(MAX_HASHED_TOKENS * 2))
    assert len(chain(root, long)) == MAX_HASHED_TOKENS // CHUNK_TOKENS
    assert chain(root, tuple(PROMPT)) == chain(root, PROMPT)


def test_the_longest_held_chain_wins_and_the_walk_stops_at_the_first_miss():
    m = PrefixRoutes()
    keys = chain(_ns(), PROMPT)
    m.record(keys[:3], "w1")
    m.record(keys[:7], "w2")
    assert m.depths(keys, {"w1", "w2", "w3"}) == {"w1": 3, "w2": 7}
    assert m.depths(keys, {"w1"}) == {"w1": 3}  # only the workers asked about are read
    assert m.depths(chain(_ns(), [5] * CHUNK_TOKENS + PROMPT), {"w1", "w2"}) == {}  # another opening
    first, why = m.prefer(PrefixQuery(keys), [W("w1"), W("w2"), W("w3")])
    assert (first.id, why) == ("w2", PREFIX)


def test_scopes_adapters_and_revisions_never_match_each_other():
    m = PrefixRoutes()
    roots = {
        "acme": _ns(tenant_scope("acme")),
        "globex": _ns(tenant_scope("globex")),
        "shared": _ns(shared_scope("corp")),
        "adapter a": _ns(digest=DIGEST_A),
        "adapter b": _ns(digest=DIGEST_B),
        "new base": _ns(rev="r2"),
    }
    for i, root in enumerate(roots.values()):
        m.record(chain(root, PROMPT), f"w{i}")
    workers = {f"w{i}" for i in range(len(roots))}
    for i, root in enumerate(roots.values()):
        # The same tokens under each namespace find only the worker that served that namespace.
        assert m.depths(chain(root, PROMPT), workers) == {f"w{i}": 10}
    # An adapter's request never steers toward the base model's entries, nor the reverse.
    assert m.depths(chain(_ns(digest=DIGEST_A), PROMPT), {"w0"}) == {}
    assert m.depths(chain(_ns(), PROMPT), {"w3"}) == {}


def test_the_map_is_bounded_and_drops_the_least_recently_used():
    m = PrefixRoutes(max_chunks=25)
    a, b, c = (chain(_ns(), [t] * CHUNK_TOKENS + PROMPT) for t in (1, 2, 3))  # 11 keys each
    m.record(a, "wa")
    m.record(b, "wb")
    m.record(a, "wa")  # a used again: b is now the oldest
    m.record(c, "wc")
    assert len(m) == 25
    assert m.depths(a, {"wa"}) == {"wa": 11} and m.depths(c, {"wc"}) == {"wc": 11}
    # b lost its deepest chunks first: its opening was recorded last, so it is what is left.
    assert m.depths(b, {"wb"}) == {"wb": 3}
    for _ in range(3):
        m.record(chain(_ns(), [9] * CHUNK_TOKENS * 20), "wx")
    assert len(m) == 25 and m.depths(b, {"wb"}) == {}


def test_a_holder_serves_within_the_load_margin_and_a_hot_prefix_spreads_past_it():
    m = PrefixRoutes()
    keys = chain(_ns(), PROMPT)
    q = PrefixQuery(keys)
    m.record(keys, "w1")
    # Within max(2, half the least load) of the least-loaded candidate: the holder serves.
    assert m.prefer(q, [W("w2", 0), W("w1", 2)]) == (W("w1", 2), PREFIX)
    assert m.prefer(q, [W("w2", 10), W("w1", 15)]) == (W("w1", 15), PREFIX)
    # Beyond it: the least-loaded candidate, for load, and it holds the prefix from then on.
    assert m.prefer(q, [W("w1", 3), W("w2", 0), W("w3", 0)]) == (W("w2", 0), LOAD)
    assert m.prefer(q, [W("w2", 10), W("w1", 16)]) == (W("w2", 10), LOAD)
    m.record(keys, "w2")
    # Two holders of the same chain: the less loaded one.
    assert m.prefer(q, [W("w1", 2), W("w2", 1), W("w3", 0)]) == (W("w2", 1), PREFIX)
    # A deeper holder past the margin gives way to a shallower one within it.
    m.record(keys, "w3")
    deeper = chain(_ns(), PROMPT + [1] * CHUNK_TOKENS)
    m.record(deeper, "w1")
    assert m.prefer(PrefixQuery(deeper), [W("w1", 9), W("w3", 4), W("w4", 3)]) == (W("w3", 4), PREFIX)
    assert within_margin(2, 0) and not within_margin(3, 0) and within_margin(6, 4) and not within_margin(7, 4)


def test_nothing_held_leaves_the_order_to_the_router():
    m = PrefixRoutes()
    assert m.prefer(PrefixQuery(chain(_ns(), PROMPT)), [W("w1")]) == (None, "")
    m.record(chain(_ns(), PROMPT), "gone")  # a worker no longer among the candidates
    assert m.prefer(PrefixQuery(chain(_ns(), PROMPT)), [W("w1"), W("w2")]) == (None, "")
    assert m.prefer(PrefixQuery([]), [W("w1")]) == (None, "")


def test_a_continuation_goes_to_the_previous_turns_worker_whatever_the_margin():
    m = PrefixRoutes(max_turns=2)
    m.served_turn("resp_1", "w2")
    q = PrefixQuery([], after=m.turn_worker("resp_1"))
    assert m.prefer(q, [W("w1", 0), W("w2", 9)]) == (W("w2", 9), CONTINUATION)
    assert m.prefer(q, [W("w1", 0), W("w3", 0)]) == (None, "")  # not a candidate: the router's order
    m.served_turn("resp_2", "w1")
    m.served_turn("resp_3", "w1")
    assert m.turn_worker("resp_1") is None and m.turn_worker("resp_3") == "w1"  # bounded


# --- the router ---------------------------------------------------------------------------------

def _report(wid: str, load: int = 0, device=(), host=()):
    return WorkerReport(worker_id=wid, url=f"http://{wid}", base_model="smol", base_revision="r",
                        device_adapters=list(device), host_adapters=list(host), running=load, timestamp=time.time())


async def _router(reports, **kw) -> tuple[Router, MemoryResidency, list[str]]:
    res = MemoryResidency()
    for r in reports:
        await res.publish(r, 30)
    router = Router(res, candidates=3, **kw)
    reasons: list[str] = []
    router.on_route = reasons.append
    await router.refresh()
    return router, res, reasons


async def test_the_router_puts_the_prefix_holder_before_the_ring_order():
    router, _, reasons = await _router([_report(w) for w in ("w1", "w2", "w3")])
    ring = [w.id for w in await router.route("smol", None)]
    keys = chain(_ns(), PROMPT)
    q = PrefixQuery(keys)
    assert [w.id for w in await router.route("smol", None, q)] == ring  # nothing held yet
    router.prefixes.record(keys, ring[2])
    order = [w.id for w in await router.route("smol", None, q)]
    assert order == [ring[2], ring[0], ring[1]]
    other = PrefixQuery(chain(_ns(tenant_scope("globex")), PROMPT))  # another tenant's same prompt
    assert [w.id for w in await router.route("smol", None, other)] == ring
    assert reasons == [AFFINITY, AFFINITY, PREFIX, AFFINITY]


async def test_a_prefix_never_costs_an_adapter_load_nor_passes_the_load_bound():
    router, res, reasons = await _router([_report("w1", device=["a"]), _report("w2", host=["a"]), _report("w3")])
    keys = chain(_ns(digest=DIGEST_A), PROMPT)
    q = PrefixQuery(keys)
    router.prefixes.record(keys, "w3")  # holds the prefix, but the adapter is not resident there
    assert (await router.route("smol", "a", q))[0].id == "w1"
    await res.publish(_report("w3", device=["a"]), 30)
    await router.refresh()
    assert (await router.route("smol", "a", q))[0].id == "w3"  # now of the best tier
    await res.publish(_report("w3", load=40, device=["a"]), 30)  # far above 1.5 x mean + 1
    await router.refresh()
    assert (await router.route("smol", "a", q))[0].id == "w1"
    assert reasons == [AFFINITY, PREFIX, AFFINITY]


async def test_a_busy_holder_gives_way_and_a_failed_or_stale_one_is_ignored():
    router, res, reasons = await _router([_report("w1"), _report("w2"), _report("w3")], load_factor=3.0)
    ring = [w.id for w in await router.route("smol", None)]
    keys = chain(_ns(), PROMPT)
    q = PrefixQuery(keys)
    router.prefixes.record(keys, ring[0])
    await res.publish(_report(ring[0], load=3), 30)  # under 3 x mean + 1, past the margin over 0
    await router.refresh()
    order = [w.id for w in await router.route("smol", None, q)]
    assert order[0] == ring[1] and reasons[-1] == LOAD
    router.prefixes.record(keys, ring[2])
    router.mark_failed(next(w for w in router.workers() if w.id == ring[2]))
    order = [w.id for w in await router.route("smol", None, q)]
    assert ring[2] not in order and order[0] == ring[1] and reasons[-1] == LOAD
    # A worker that stopped reporting: never chosen, its entries unread.
    router, res, reasons = await _router([_report("w1"), _report("w2")], report_ttl_s=0.2)
    router.prefixes.record(keys, "w2")
    assert (await router.route("smol", None, q))[0].id == "w2"
    await res.publish(_report("w1"), 30)
    await asyncio.sleep(0.3)
    await router.refresh()
    assert [w.id for w in await router.route("smol", None, q)] == ["w1"]


async def test_the_router_sends_a_continuation_back_while_the_worker_is_a_candidate():
    router, res, reasons = await _router([_report("w1"), _report("w2", load=2), _report("w3", load=3)])
    router.prefixes.served_turn("resp_1", "w3")
    q = PrefixQuery([], after="w3")
    assert (await router.route("smol", None, q))[0].id == "w3" and reasons[-1] == CONTINUATION
    await res.publish(_report("w3", load=50), 30)  # past the load bound: no longer a candidate
    await router.refresh()
    assert (await router.route("smol", None, q))[0].id != "w3" and reasons[-1] == AFFINITY
