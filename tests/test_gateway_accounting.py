"""Token limits end to end: a real uvicorn gateway, a stub worker process that counts prompts with
a real tokenizer and generates up to ``max_tokens``; what is reserved, refused (400 vs 429) and
settled for every way a request can end, and the access log recording the settled numbers."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid

import httpx
import pytest

from gateway.app import create_app
from gateway.ratelimit import Lease, LocalLimiter
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokenizer import TextTokenizer
from loraplex.tokens import mint
from tests.engine_fixtures import demo_gguf, train_tokenizer  # noqa: F401
from tests.stub_worker import MutableSnapshots, StubProcess, ThreadServer, free_port, make_snapshot

BINDING = {"bindings": {"support": {"active": ("sup", 1)}}}
TENANTS = {
    "acme": {"tokens_per_min": 100_000, **BINDING},
    "burst": {"tokens_per_min": 2000, **BINDING},
    "small": {"tokens_per_min": 300, **BINDING},
    "big": {"tokens_per_min": 20_000, **BINDING},
    "slow": {"tokens_per_min": 6000, **BINDING},
}
HI = [{"role": "user", "content": "hi"}]


class RecordingLimiter(LocalLimiter):
    """The local limiter, keeping what each request was settled at."""

    def __init__(self) -> None:
        super().__init__()
        self.settled: list[tuple[Lease, int]] = []
        self.lock = threading.Lock()

    def settle_nowait(self, lease: Lease, used_tokens: int) -> None:
        with self.lock:
            self.settled.append((lease, used_tokens))
        super().settle_nowait(lease, used_tokens)

    def remaining(self, tenant: str, tpm: int, *, at_last_call: bool = False) -> float:
        """The tenant's tokens now, or as its last acquire or settle left them."""
        from gateway.ratelimit import _level

        b = self._buckets[tenant]
        return _level(b.tk, b.tt, tpm, b.tt if at_last_call else time.monotonic())


class AccessLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))

    def of(self, request_id: str) -> dict:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            found = [x for x in self.lines if x["request_id"] == request_id]
            if found:
                return found[-1]
            time.sleep(0.02)
        raise AssertionError(f"no access log line for {request_id}")


def _tokenizer_file(tmp_path_factory, tok: TextTokenizer) -> str:
    path = tmp_path_factory.mktemp("served") / "tokenizer.json"
    path.write_text(json.dumps(tok.to_dict()))
    return str(path)


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory) -> TextTokenizer:
    d = tmp_path_factory.mktemp("tok")
    train_tokenizer(d)
    return TextTokenizer.from_hf_dir(d)


@pytest.fixture(scope="module")
def stub(tmp_path_factory, tiny_tok):
    with StubProcess("w1", extra=("--chunks", "4000", "--tokenizer", _tokenizer_file(tmp_path_factory, tiny_tok))
                     ) as p:
        yield p


@pytest.fixture(scope="module")
def access():
    logger = logging.getLogger("loraplex.gateway.access")
    handler = AccessLines()
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


class System:
    def __init__(self, worker_url: str) -> None:
        self.settings = Settings(worker_urls=(worker_url,))
        self.limiter = RecordingLimiter()
        self.app = create_app(self.settings, snapshots=MutableSnapshots(make_snapshot(TENANTS)),
                              limiter=self.limiter, residency=MemoryResidency(), mount_admin=False)
        self.server = ThreadServer(self.app)

    def headers(self, tenant: str, rid: str | None = None) -> dict[str, str]:
        return {"authorization": f"Bearer {mint(self.settings, 'u', tenant=tenant)}",
                "x-request-id": rid or uuid.uuid4().hex}

    def settled(self, tenant: str) -> list[int]:
        return [used for lease, used in self.limiter.settled if lease.tenant == tenant]

    def wait_tokenizer(self, c: httpx.Client) -> None:
        deadline = time.monotonic() + 10
        while not self.app.gateway.prompts.known("smol"):
            assert time.monotonic() < deadline, "the gateway never got the tokenizer"
            c.post("/v1/chat/completions", json={"model": "support", "messages": HI, "max_tokens": 1},
                   headers=self.headers("acme"))
            time.sleep(0.05)


@pytest.fixture
def system(stub):
    sys_ = System(stub.url)
    with sys_.server, httpx.Client(base_url=sys_.server.url, timeout=30) as c:
        sys_.wait_tokenizer(c)
        yield sys_, c


def _events(text: str) -> list[str]:
    return [e[len("data: "):] for e in text.split("\n\n") if e.startswith("data: ")]


def test_bypass_reserves_and_generates_the_same_bound(system, access):
    sys_, c = system
    chat = {"model": "support", "messages": HI, "max_tokens": 300, "max_completion_tokens": 1}
    comp = {"model": "support", "prompt": "hello", "max_tokens": 300, "max_completion_tokens": 1}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp)):
        r = c.post(path, json=body, headers=sys_.headers("acme"))
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == 1
        access.of(r.headers["x-request-id"])
        lease, used = sys_.limiter.settled[-1]
        assert lease.reserved == usage["prompt_tokens"] + 1 == used  # reserved = generated bound


def test_burst_never_admits_more_than_the_limit(system):
    sys_, _ = system
    bodies = [("/v1/completions", {"model": "support", "prompt": f"count {i}", "max_tokens": 300,
                                   "max_completion_tokens": 100 + i}) if i % 2 else
              ("/v1/chat/completions", {"model": "support", "messages": [{"role": "user", "content": f"q{i}"}],
                                        "max_tokens": 120}) for i in range(64)]

    import asyncio

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=sys_.server.url, timeout=30) as ac:
            return await asyncio.gather(*(ac.post(p, json=b, headers=sys_.headers("burst")) for p, b in bodies))

    t0 = time.monotonic()
    rs = asyncio.run(burst())
    elapsed = time.monotonic() - t0
    ok = [r for r in rs if r.status_code == 200]
    assert ok and len(ok) < 64 and all(r.status_code in (200, 429) for r in rs)
    spent = sum(r.json()["usage"]["total_tokens"] for r in ok)
    assert spent <= 2000 + math.ceil(elapsed * 2000 / 60)  # the capacity plus what refilled meanwhile


def test_responses_are_reserved_and_settled_exactly_under_concurrency(system, access):
    """64 Responses turns at once (half streamed) on a 2,000 tokens/min tenant: never more admitted
    than the limit, and each admitted turn settled at exactly the usage it reported."""
    sys_, _ = system

    async def turn(ac: httpx.AsyncClient, i: int) -> tuple[httpx.Response, str]:
        rid = uuid.uuid4().hex
        body = {"model": "support", "input": f"question {i}", "max_output_tokens": 90 + i, "store": False,
                "stream": bool(i % 2)}
        return await ac.post("/v1/responses", json=body, headers=sys_.headers("burst", rid)), rid

    import asyncio

    async def burst() -> list[tuple[httpx.Response, str]]:
        async with httpx.AsyncClient(base_url=sys_.server.url, timeout=30) as ac:
            return await asyncio.gather(*(turn(ac, i) for i in range(64)))

    t0 = time.monotonic()
    rs = asyncio.run(burst())
    elapsed = time.monotonic() - t0
    ok = [(r, rid) for r, rid in rs if r.status_code == 200]
    assert ok and len(ok) < 64 and all(r.status_code in (200, 429) for r, _ in rs)
    totals = []
    for r, rid in ok:
        if r.headers["content-type"].startswith("text/event-stream"):
            done = json.loads([ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")][-1])
            assert done["type"] == "response.completed"
            usage = done["response"]["usage"]
        else:
            usage = r.json()["usage"]
        line = access.of(rid)
        assert line["route"] == "responses"
        assert (line["prompt_tokens"], line["completion_tokens"]) == (usage["input_tokens"], usage["output_tokens"])
        totals.append(usage["total_tokens"])
    assert sorted(sys_.settled("burst")) == sorted(totals)
    assert sum(totals) <= 2000 + math.ceil(elapsed * 2000 / 60)


def test_small_limit_tenant_without_max_tokens_is_served(system, stub, tiny_tok):
    sys_, c = system
    r = c.post("/v1/chat/completions", json={"model": "support", "messages": HI}, headers=sys_.headers("small"))
    assert r.status_code == 200, r.text
    prompt = len(tiny_tok.encode_chat(HI))
    assert r.json()["usage"]["prompt_tokens"] == prompt
    assert stub.stats()["exts"][-1]["max_tokens"] == 300 - prompt  # filled to what the limit allows


def test_request_that_can_never_fit_is_400_naming_the_limit(system):
    sys_, c = system
    r = c.post("/v1/chat/completions", json={"model": "support", "messages": HI, "max_tokens": 500},
               headers=sys_.headers("small"))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "request_exceeds_token_limit" and err["param"] == "max_tokens"
    assert "300 tokens per minute" in err["message"] and "retry-after" not in r.headers
    r = c.post("/v1/completions", json={"model": "support", "prompt": "word " * 400, "max_tokens": 1},
               headers=sys_.headers("small"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_retry_after_says_when_the_reservation_fits(system, tiny_tok):
    sys_, c = system
    prompt = len(tiny_tok.encode_chat(HI))
    body = {"model": "support", "messages": HI, "max_tokens": 2900}
    assert c.post("/v1/chat/completions", json=body, headers=sys_.headers("slow")).status_code == 200
    r = c.post("/v1/chat/completions", json=body | {"max_tokens": 3200}, headers=sys_.headers("slow"))
    assert r.status_code == 429
    left = sys_.limiter.remaining("slow", 6000, at_last_call=True)  # as the refusal saw it
    need = prompt + 3200
    wait_s = (need - left) * 60 / 6000  # 100 tokens/s
    assert 0.3 < wait_s < 5
    assert abs(int(r.headers["retry-after-ms"]) - wait_s * 1000) < 20
    assert int(r.headers["retry-after"]) == math.ceil(float(r.headers["retry-after-ms"]) / 1000)
    time.sleep(int(r.headers["retry-after"]))
    assert c.post("/v1/chat/completions", json=body | {"max_tokens": 3200},
                  headers=sys_.headers("slow")).status_code == 200


@pytest.mark.parametrize(("mode", "status"), [("400", 400), ("500", 502)])
def test_worker_errors_charge_nothing(system, access, mode, status):
    sys_, c = system
    rid = uuid.uuid4().hex
    r = c.post("/v1/chat/completions", json={"model": "support", "messages": [{"role": "user", "content": "x" * 5000}],
                                             "metadata": {"stub_mode": mode}}, headers=sys_.headers("acme", rid))
    assert r.status_code == status
    line = access.of(rid)  # written after the settlement
    assert sys_.settled("acme")[-1] == 0
    assert sys_.limiter.remaining("acme", 100_000) == 100_000  # the whole reservation came back
    assert (line["prompt_tokens"], line["completion_tokens"], line["status"]) == (0, 0, status)


def test_no_worker_charges_nothing(access):
    sys_ = System(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with sys_.server, httpx.Client(base_url=sys_.server.url, timeout=30) as c:
        rid = uuid.uuid4().hex
        r = c.post("/v1/chat/completions", json={"model": "support", "messages": HI, "max_tokens": 50},
                   headers=sys_.headers("acme", rid))
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
        assert (access.of(rid)["prompt_tokens"], access.of(rid)["completion_tokens"]) == (0, 0)
        assert sys_.settled("acme") == [0]


def test_cancelled_stream_charges_prompt_and_tokens_streamed(system, access, tiny_tok):
    sys_, _ = system
    rid = uuid.uuid4().hex
    body = {"model": "support", "messages": HI, "max_tokens": 50, "stream": True,
            "metadata": {"stub_chunk_delay": "0.3"}}
    got = 0
    with httpx.Client(base_url=sys_.server.url, timeout=30) as c, c.stream(
            "POST", "/v1/chat/completions", json=body, headers=sys_.headers("acme", rid)) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got == 2:
                    break  # hang up after two tokens
    prompt = len(tiny_tok.encode_chat(HI))
    line = access.of(rid)
    assert (line["prompt_tokens"], line["completion_tokens"]) == (prompt, 2)
    assert sys_.settled("acme")[-1] == prompt + 2


def test_broken_stream_charges_prompt_and_tokens_streamed(system, access, tiny_tok):
    sys_, c = system
    rid = uuid.uuid4().hex
    body = {"model": "support", "messages": HI, "max_tokens": 6, "stream": True, "metadata": {"stub_mode": "break"}}
    r = c.post("/v1/chat/completions", json=body, headers=sys_.headers("acme", rid))
    events = _events(r.text)
    assert json.loads(events[-1])["error"]["code"] == "stream_interrupted"
    assert all('"usage"' not in e for e in events)  # the per-chunk usage is not the client's
    streamed = len(events) - 1  # the stub breaks after 3 of its 6 tokens
    assert streamed == 3
    prompt = len(tiny_tok.encode_chat(HI))
    line = access.of(rid)
    assert (line["prompt_tokens"], line["completion_tokens"]) == (prompt, 3)
    assert sys_.settled("acme")[-1] == prompt + 3


def test_abandoned_non_streamed_request_charges_the_reservation(system, access, tiny_tok):
    sys_, _ = system
    rid = uuid.uuid4().hex
    # Hang up after 2 s: the reservation was made long before, the answer is 5 s away.
    with httpx.Client(base_url=sys_.server.url, timeout=2.0) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/chat/completions", json={"model": "support", "messages": HI, "max_tokens": 40,
                                             "metadata": {"stub_delay": "5"}}, headers=sys_.headers("acme", rid))
    prompt = len(tiny_tok.encode_chat(HI))
    line = access.of(rid)
    assert (line["prompt_tokens"], line["completion_tokens"], line["status"]) == (prompt, 40, 499)
    assert sys_.settled("acme")[-1] == prompt + 40


def test_success_charges_and_logs_the_usage(system, access):
    sys_, c = system
    rid = uuid.uuid4().hex
    r = c.post("/v1/completions", json={"model": "support", "prompt": "hello there", "max_tokens": 7},
               headers=sys_.headers("acme", rid))
    usage = r.json()["usage"]
    line = access.of(rid)
    assert (line["prompt_tokens"], line["completion_tokens"]) == (usage["prompt_tokens"], 7)
    assert sys_.settled("acme")[-1] == usage["total_tokens"]


@pytest.mark.slow
def test_long_prompt_on_a_20k_tenant_is_served(tmp_path_factory, demo_gguf):  # noqa: F811
    """7,500 prompt tokens of English (~34 KB: the byte bound alone was over 20,000)."""
    tok = TextTokenizer.from_gguf(demo_gguf)
    words = ("The committee reviewed the quarterly report and agreed that the shipping delays were caused "
             "by the new warehouse software. ").split()
    text = " ".join(words * 400)
    ids = tok.encode(text, add_special_tokens=False)
    text = tok.decode(ids[:7500])
    with StubProcess("w-demo", extra=("--chunks", "4000", "--tokenizer", _tokenizer_file(tmp_path_factory, tok))
                     ) as worker:
        sys_ = System(worker.url)
        with sys_.server, httpx.Client(base_url=sys_.server.url, timeout=30) as c:
            sys_.wait_tokenizer(c)
            r = c.post("/v1/chat/completions", json={"model": "support", "messages": [{"role": "user", "content": text}]},
                       headers=sys_.headers("big"))
            assert r.status_code == 200, r.text
            assert len(text.encode()) > 20_000
            assert 7500 <= r.json()["usage"]["prompt_tokens"] < 7600
