"""End to end: one tenant's response-format schemas cannot slow another tenant.

PostgreSQL + Redis, two gateways and one worker on the demo model (the topology the attack was
found on). ``mallory`` sends, four at a time, the costliest distinct schemas its requests may
carry (required properties up to the size limit, each about a second of compiling); ``victim``
meanwhile sends plain chat requests through the other gateway. Rounds alternate quiet and
attacked; the victim's median latency under attack stays within 20% of its quiet median.
Before compiles ran one at a time per tenant at the lowest CPU priority, four such schemas
made every other request about four times slower.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid

import httpx
import pytest

from loraplex.openai_request import MAX_GRAMMAR_BYTES, spec_key
from tests.e2e_cluster import Cluster
from tests.engine_fixtures import demo_model_file

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ATTACKERS = 4
VICTIM_REQUESTS = 6
ROUNDS = 2


@pytest.fixture(scope="module")
def cluster(pg_url, redis_url, tmp_path_factory):
    model = demo_model_file()
    c = Cluster(home=tmp_path_factory.mktemp("e2e-grammar"), database_url=pg_url, redis_url=redis_url,
                redis_prefix=f"loraplex-e2e-{uuid.uuid4().hex[:8]}", model=str(model),
                worker_env={"LORAPLEX_THREADS": "0"})  # the default: every core, as in production
    with c.running(workers=("w1",), gateways=("g1", "g2")):
        c.base_name = c.admin("POST", "/base-models", {"path": c.model})["name"]
        for slug in ("mallory", "victim"):
            c.admin("POST", "/tenants", {"slug": slug, "requests_per_min": 10_000, "tokens_per_min": 10_000_000,
                                         "max_concurrent": ATTACKERS})
        c.wait_current()
        yield c


def worst_schema(tag: str) -> dict:
    """Distinct required properties, as many as fit under the size limit."""
    def schema(n: int) -> dict:
        names = [f"{tag}_{i}" for i in range(n)]
        return {"type": "object", "properties": {k: {"type": "string"} for k in names}, "required": names,
                "additionalProperties": False}

    n = 100
    while len(spec_key("json_schema", schema(n * 2))) <= MAX_GRAMMAR_BYTES:
        n *= 2
    step = n // 2
    while step:  # the largest n that fits
        if len(spec_key("json_schema", schema(n + step))) <= MAX_GRAMMAR_BYTES:
            n += step
        step //= 2
    return schema(n)


def test_worst_schemas_of_one_tenant_leave_another_within_20_percent(cluster):
    c = cluster
    victim_url = c.gateways[1].url + "/v1/chat/completions"
    victim_h = {"authorization": f"Bearer {c.token('victim')}"}
    mallory_url = c.gateways[0].url + "/v1/chat/completions"
    mallory_h = {"authorization": f"Bearer {c.token('mallory')}"}
    template = worst_schema("p")
    assert len(template["properties"]) > 2500
    stop = threading.Event()
    outcomes: list[int] = []

    def attack(k: int) -> None:
        with httpx.Client(timeout=300.0) as http:
            i = 0
            while not stop.is_set():
                i += 1
                schema = worst_schema(f"m{k}x{i}")  # distinct every time: never a cache hit
                body = {"model": c.base_name, "max_tokens": 8, "messages": [{"role": "user", "content": "Fill it."}],
                        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}
                outcomes.append(http.post(mallory_url, json=body, headers=mallory_h).status_code)

    def victim_round(http: httpx.Client) -> list[float]:
        out = []
        for q in range(VICTIM_REQUESTS):
            body = {"model": c.base_name, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Count to ten, round {q}."}]}
            t0 = time.perf_counter()
            r = http.post(victim_url, json=body, headers=victim_h)
            out.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 16
        return out

    quiet: list[float] = []
    attacked: list[float] = []
    with httpx.Client(timeout=120.0) as http:
        victim_round(http)  # warm-up
        for _ in range(ROUNDS):
            quiet += victim_round(http)
            stop.clear()
            attackers = [threading.Thread(target=attack, args=(k,)) for k in range(ATTACKERS)]
            for t in attackers:
                t.start()
            time.sleep(3.0)  # the attack is compiling
            attacked += victim_round(http)
            stop.set()
            for t in attackers:
                t.join(timeout=300)
    q, a = statistics.median(quiet), statistics.median(attacked)
    print(f"victim latency: quiet median {q:.3f}s, attacked median {a:.3f}s ({a / q:.2f}x); "
          f"mallory answers: {sorted(set(outcomes))} x{len(outcomes)}")
    assert outcomes and set(outcomes) <= {200, 400}, outcomes  # served, or refused as too complex
    assert a <= 1.2 * q, f"attacked median {a:.3f}s against quiet {q:.3f}s"
