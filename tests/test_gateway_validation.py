"""Bad input on the gateway routes: OpenAI-shaped 400/404/405/413, never a 500; plus a fuzz test."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.ratelimit import LocalLimiter
from gateway.validate import estimate, reserve, validate
from loraplex.json_body import MAX_DEPTH
from loraplex.residency import MemoryResidency
from loraplex.settings import Settings
from loraplex.tokens import mint
from tests.stub_worker import MutableSnapshots, make_snapshot, mock_worker_transport
from tests.worker_double import worker_client

TENANTS = {"acme": {"bindings": {"support": {"active": ("sup", 1)}}}}
MSG = [{"role": "user", "content": "hi"}]


def _app(**kw):
    s = Settings(**{"worker_urls": ("http://worker",), "max_body_bytes": 4096} | kw)
    client = worker_client(mock_worker_transport())
    app = create_app(s, snapshots=MutableSnapshots(make_snapshot(TENANTS)), limiter=LocalLimiter(),
                     residency=MemoryResidency(), http_client=client, mount_admin=False)
    return app, {"authorization": f"Bearer {mint(s, 'u', tenant='acme')}"}


def _check_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    assert "Traceback" not in r.text and "File \"" not in r.text
    return err


CHAT_BAD = [
    ({"messages": MSG}, "model"),
    ({"model": 3, "messages": MSG}, "model"),
    ({"model": "support"}, "messages"),
    ({"model": "support", "messages": []}, "messages"),
    ({"model": "support", "messages": "hi"}, "messages"),
    ({"model": "support", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "support", "messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
    ({"model": "support", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "support", "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "support", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"model": "support", "messages": ["hi"]}, "messages[0]"),
    ({"model": "support", "messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"model": "support", "messages": MSG, "max_tokens": 10**12}, "max_tokens"),
    ({"model": "support", "messages": MSG, "max_tokens": "5"}, "max_tokens"),
    ({"model": "support", "messages": MSG, "max_tokens": True}, "max_tokens"),
    ({"model": "support", "messages": MSG, "max_tokens": 5.5}, "max_tokens"),
    ({"model": "support", "messages": MSG, "n": 17}, "n"),
    ({"model": "support", "messages": MSG, "temperature": 5}, "temperature"),
    ({"model": "support", "messages": MSG, "temperature": -0.1}, "temperature"),
    ({"model": "support", "messages": MSG, "temperature": "hot"}, "temperature"),
    ({"model": "support", "messages": MSG, "top_p": 0}, "top_p"),
    ({"model": "support", "messages": MSG, "top_p": 1.5}, "top_p"),
    ({"model": "support", "messages": MSG, "presence_penalty": 3}, "presence_penalty"),
    ({"model": "support", "messages": MSG, "stop": [str(i) for i in range(17)]}, "stop"),
    ({"model": "support", "messages": MSG, "logit_bias": {"1": 500}}, "logit_bias"),
    ({"model": "support", "messages": MSG, "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"model": "support", "messages": MSG, "stop": 5}, "stop"),
    ({"model": "support", "messages": MSG, "stream": "yes"}, "stream"),
    ({"model": "support", "messages": MSG, "stream_options": {"include_usage": "y"}},
     "stream_options.include_usage"),
    ({"model": "support", "messages": MSG, "user": 7}, "user"),
    ({"model": "support", "messages": MSG, "top_logprobs": 99}, "top_logprobs"),
    ({"model": "support", "messages": MSG, "loraplex": {"tenant": "other"}}, "loraplex"),
]


async def _send(app, headers, path, **kw) -> httpx.Response:
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        return await c.post(path, headers=headers, **kw)


@pytest.mark.parametrize(("body", "param"), CHAT_BAD)
async def test_bad_chat_bodies_are_400(body, param):
    app, h = _app()
    err = _check_error(await _send(app, h, "/v1/chat/completions", json=body), 400)
    assert err["param"] == param


@pytest.mark.parametrize("body", [
    {"model": "support"}, {"model": "support", "prompt": 5}, {"model": "support", "prompt": ["a", "b"]},
    {"model": "support", "prompt": []}, {"model": "support", "prompt": [1, -2]},
    {"model": "support", "prompt": "x", "logprobs": "many"},
])
async def test_bad_completion_bodies_are_400(body):
    app, h = _app()
    _check_error(await _send(app, h, "/v1/completions", json=body), 400)


@pytest.mark.parametrize("raw", [b"{", b"", b"null", b"[]", b'"str"', b"{'a': 1}", b'{"model": NaN}',
                                 b"\xff\xfe", b'{"model": "support", "messages": [}'])
async def test_malformed_json_is_400(raw):
    app, h = _app()
    _check_error(await _send(app, h | {"content-type": "application/json"}, "/v1/chat/completions",
                             content=raw), 400)


def _nested(levels: int) -> object:
    deep: object = 1
    for _ in range(levels):
        deep = [deep]
    return deep


@pytest.mark.parametrize("field", ["web_search_options", "prediction"])
async def test_json_nested_deeper_than_the_limit_is_400(field):
    # The depth is checked once, right after parsing (loraplex.json_body), for every field.
    app, h = _app()
    body = {"model": "support", "messages": MSG, "max_tokens": 4, field: _nested(MAX_DEPTH)}
    err = _check_error(await _send(app, h, "/v1/chat/completions", json=body), 400)
    assert err["code"] == "invalid_json" and err["param"] == field
    assert f"at most {MAX_DEPTH} levels" in err["message"]
    body[field] = _nested(MAX_DEPTH - 1)  # MAX_DEPTH levels in all, the body counted: forwarded
    assert (await _send(app, h, "/v1/chat/completions", json=body)).status_code == 200


def deep_parameters_body(levels: int) -> bytes:
    """A chat body whose one tool's ``parameters`` nest ``levels`` objects deep (stdlib
    ``json.dumps`` cannot write that many levels)."""
    params = '{"x":' * (levels - 1) + '{"type":"object"}' + "}" * (levels - 1)
    return ('{"model":"support","messages":[{"role":"user","content":"hi"}],'
            '"tools":[{"type":"function","function":{"name":"f","parameters":' + params + "}}]}").encode()


@pytest.mark.parametrize("levels", [70, 500, 1000, 1020])
async def test_tool_parameters_nested_deep_are_400_not_500(levels):
    # 1,000-1,020 levels were a 500: stdlib json.dumps hit the recursion limit while the
    # gateway counted the prompt's tokens, before any depth check.
    app, h = _app(max_body_bytes=1 << 20)
    r = await _send(app, h | {"content-type": "application/json"}, "/v1/chat/completions",
                    content=deep_parameters_body(levels))
    err = _check_error(r, 400)
    assert err["code"] == "invalid_json" and err["param"] == "tools", err


async def test_oversized_body_is_413_declared_and_streamed():
    app, h = _app()
    big = {"model": "support", "messages": [{"role": "user", "content": "x" * 10_000}]}
    _check_error(await _send(app, h, "/v1/chat/completions", json=big), 413)

    async def chunks():
        for _ in range(10):
            yield b"x" * 1000

    _check_error(await _send(app, h, "/v1/chat/completions", content=chunks()), 413)


async def test_wrong_method_and_unknown_path():
    app, h = _app()
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        _check_error(await c.get("/v1/chat/completions", headers=h), 405)
        _check_error(await c.get("/v1/nothing", headers=h), 404)
        _check_error(await c.post("/v1/models", headers=h), 405)


async def test_valid_extras_pass_through_and_max_tokens_filled():
    body = {"model": "support", "messages": MSG, "temperature": 0.5, "top_p": 0.9, "stop": ["\n"],
            "seed": 3, "metadata": {"k": "v"}, "max_completion_tokens": 20}
    req = validate(dict(body), chat=True, max_tokens_cap=100)
    assert req.fields.max_tokens == 20 and req.body["metadata"] == {"k": "v"}
    req = validate({"model": "m", "messages": MSG}, chat=True, max_tokens_cap=100)
    plan = reserve(req.fields, 10, exact=True, max_model_len=None, tokens_per_min=0, default_max_tokens=50)
    assert (plan.max_tokens, plan.tokens) == (50, 60)
    # The estimate bounds the prompt: every UTF-8 byte counted, plus template overhead.
    text = "héllo wörld " * 10
    req = validate({"model": "m", "messages": [{"role": "user", "content": text}]}, chat=True, max_tokens_cap=100)
    assert estimate(req.fields) >= len(text.encode()) + 8


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(["model", "messages", "prompt", "max_tokens", "n", "temperature", "top_p", "stream",
                          "stream_options", "stop", "user", "seed", "logprobs", "top_logprobs", "loraplex",
                          "presence_penalty", "max_completion_tokens"])
bodies = st.one_of(
    json_values,
    st.fixed_dictionaries({"model": st.sampled_from(["support", "smol", "nope", ""]),
                           "messages": st.just(MSG)}).flatmap(
        lambda base: st.dictionaries(fields, json_values, max_size=4).map(lambda extra: {**base, **extra})),
)


def test_fuzz_routes_never_500():
    loop = asyncio.new_event_loop()
    app, h = _app()
    ctx = app.router.lifespan_context(app)
    loop.run_until_complete(ctx.__aenter__())
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
    try:
        @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=bodies, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
               raw=st.booleans(), junk=st.binary(max_size=64))
        def run(body, path, raw, junk):
            kw = {"content": junk} if raw else {"json": body}
            r = loop.run_until_complete(client.post(path, headers=h, **kw))
            assert r.status_code in (200, 400, 404, 413, 422), (r.status_code, r.text)
            if r.status_code != 200:
                _check_error(r, r.status_code)

        run()
    finally:
        loop.run_until_complete(client.aclose())
        loop.run_until_complete(ctx.__aexit__(None, None, None))
        loop.close()
