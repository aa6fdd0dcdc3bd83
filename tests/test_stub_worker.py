"""The stub worker's bench-only switch: ``--no-secret-check`` serves clients that send no secret."""

import httpx

from tests.stub_worker import StubProcess

BODY = {"model": "support", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_stub_refuses_a_request_without_the_secret_by_default():
    with StubProcess("w-default") as stub:
        r = httpx.post(stub.url + "/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 401


def test_no_secret_check_serves_a_plain_openai_request():
    with StubProcess("w-open", extra=("--no-secret-check",)) as stub:
        r = httpx.post(stub.url + "/v1/chat/completions", json=BODY, timeout=10,
                       headers={"authorization": "Bearer sk-anything", "user-agent": "AsyncOpenAI/Python"})
        stats = stub.stats()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "ok from w-open"
    assert stats["completed"] == 1 and stats["adapters"] == {"base": 1}
