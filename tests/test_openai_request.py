"""The one reading of OpenAI request fields: the gateway and the engine agree on every field,
``max_tokens``/``max_completion_tokens`` above all (a disagreement there bypassed the limits)."""

from __future__ import annotations

import pytest

from engine.protocol import RequestError, parse_request
from gateway.errors import GatewayError
from gateway.validate import reserve, validate
from loraplex.openai_request import FieldError, parse
from loraplex.tokenizer import TextTokenizer
from tests.engine_fixtures import train_tokenizer

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> TextTokenizer:
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(path)
    return TextTokenizer.from_hf_dir(path)


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize(("given", "expected"), [
    ({"max_tokens": 300, "max_completion_tokens": 1}, 1),
    ({"max_tokens": 1, "max_completion_tokens": 300}, 300),
    ({"max_tokens": 7}, 7),
    ({"max_completion_tokens": 9}, 9),
])
def test_reserved_bound_is_the_generated_bound(tok, chat, given, expected):
    body = ({"model": "m", "messages": MSG} if chat else {"model": "m", "prompt": "hello"}) | given
    gw = validate(dict(body), chat=chat, max_tokens_cap=8192)
    plan = reserve(gw.fields, 10, exact=True, max_model_len=None, tokens_per_min=2000, default_max_tokens=1024)
    worker = parse_request(dict(body), "chat" if chat else "completion", tok, 4096, "m")
    assert plan.max_tokens == worker.params.max_tokens == expected
    assert plan.tokens == 10 + expected


def test_cleaned_messages_are_what_the_template_renders():
    req = parse({"messages": [{"role": "system", "content": [{"type": "text", "text": "a"},
                                                             {"type": "text", "text": "b"}]},
                              {"role": "assistant", "content": None, "name": "bot"},
                              {"role": "user", "content": "q", "name": "ann"}]}, chat=True)
    assert req.messages == [{"role": "system", "content": "ab"}, {"role": "assistant", "content": ""},
                            {"role": "user", "content": "q"}]


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": ""}]}, "messages"),
    ({"messages": MSG, "stop": ["a"] * 17}, "stop"),
    ({"messages": MSG, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": [1]}, "logit_bias"),
    ({"messages": MSG, "logprobs": 1}, "logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MSG, "n": 17}, "n"),
    ({"messages": MSG, "n": 2.0}, "n"),
    ({"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MSG, "stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
    ({"messages": MSG, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": MSG, "top_k": -2}, "top_k"),
    ({"messages": MSG, "ignore_eos": "yes"}, "ignore_eos"),
])
def test_both_sides_refuse_the_same_bodies(tok, body, param):
    with pytest.raises(FieldError) as shared:
        parse(body, chat=True)
    assert shared.value.param == param
    with pytest.raises(GatewayError) as gw:
        validate({"model": "m", **body}, chat=True, max_tokens_cap=8192)
    with pytest.raises(RequestError) as worker:
        parse_request(dict(body), "chat", tok, 4096, "m")
    assert gw.value.param == worker.value.body["error"]["param"] == param


def test_stream_options_only_with_stream():
    req = parse({"prompt": "x", "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                chat=False)
    assert not req.include_usage and not req.continuous_usage
    req = parse({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}, chat=False)
    assert req.continuous_usage and not req.include_usage


def test_logprobs_read_one_way_on_both_routes():
    chat = parse({"messages": MSG, "logprobs": True, "top_logprobs": 3}, chat=True)
    assert (chat.logprobs, chat.top_logprobs) == (True, 3)
    comp = parse({"prompt": "x", "logprobs": 2}, chat=False)
    assert (comp.logprobs, comp.top_logprobs) == (True, 2)
    assert parse({"prompt": "x", "logprobs": 0}, chat=False).logprobs
    assert not parse({"prompt": "x"}, chat=False).logprobs
    with pytest.raises(FieldError) as exc:
        parse({"prompt": "x", "logprobs": True}, chat=False)
    assert exc.value.param == "logprobs"
    with pytest.raises(FieldError) as exc:
        parse({"prompt": "x", "top_logprobs": 2}, chat=False)
    assert exc.value.param == "top_logprobs"


def test_logit_bias_and_many_stops(tok):
    body = {"messages": MSG, "logit_bias": {"7": -100, "3": 2.5}, "stop": [str(i) for i in range(16)],
            "presence_penalty": 0.5, "frequency_penalty": -0.5}
    req = parse(body, chat=True)
    assert req.logit_bias == ((3, 2.5), (7, -100.0)) and len(req.stop) == 16
    params = parse_request(dict(body), "chat", tok, 4096, "m").params
    assert params.logit_bias == req.logit_bias and params.stop == req.stop
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -0.5)


def test_reservation_counts_every_choice():
    gw = validate({"model": "m", "messages": MSG, "n": 4, "max_tokens": 50}, chat=True, max_tokens_cap=8192)
    plan = reserve(gw.fields, 10, exact=True, max_model_len=4096, tokens_per_min=1000, default_max_tokens=64)
    assert (plan.max_tokens, plan.tokens) == (50, 10 + 4 * 50)
    gw = validate({"model": "m", "messages": MSG, "n": 4}, chat=True, max_tokens_cap=8192)
    plan = reserve(gw.fields, 10, exact=True, max_model_len=4096, tokens_per_min=210, default_max_tokens=64)
    assert plan.max_tokens == 50 and plan.tokens == 210  # the default shrinks to fit all choices
    with pytest.raises(GatewayError) as exc:
        gw = validate({"model": "m", "messages": MSG, "n": 4, "max_tokens": 60}, chat=True, max_tokens_cap=8192)
        reserve(gw.fields, 10, exact=True, max_model_len=4096, tokens_per_min=210, default_max_tokens=64)
    assert exc.value.code == "request_exceeds_token_limit" and "each of 4 choices" in str(exc.value)
