"""Tokenizer and chat template: GGUF-built and HF-dir tokenizers against transformers."""

from __future__ import annotations

import pytest

from loraplex.tokenizer import ChatTemplateError, TextTokenizer
from tests.engine_fixtures import demo_gguf, hf_demo_tokenizer, make_tiny_model  # noqa: F401

STRINGS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing   ",
    "line one\nline two\n\n\ttabbed",
    "Unicode: café, naïve, 日本語, emoji 🙂 and ümlaut.",
    "def f(x):\n    return x ** 2  # square",
    "<|im_start|>user\nhi<|im_end|>\n",
    "It's we'll they've I'm",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
]


def _ids(x) -> list[int]:
    return list(x["input_ids"] if isinstance(x, dict) or hasattr(x, "keys") else x)


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers(demo_gguf):  # noqa: F811
    ours = TextTokenizer.from_gguf(demo_gguf)
    ref = hf_demo_tokenizer()
    for s in STRINGS:
        assert ours.encode(s) == ref.encode(s), s
        assert ours.encode(s, add_special_tokens=False) == ref.encode(s, add_special_tokens=False), s
        ids = ours.encode(s)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_id == ref.eos_token_id and ours.bos_token_id == ref.bos_token_id


@pytest.mark.slow
def test_gguf_digits_split_one_by_one(demo_gguf):  # noqa: F811
    """llama.cpp's ``smollm`` pre-tokenizer (and SmolLM's own tokenizer.json) split digits singly;
    transformers' GGUF tokenizer does not, so here the reference is the single-digit tokens."""
    ours = TextTokenizer.from_gguf(demo_gguf)
    ids = ours.encode("year 2024")
    assert [ours.decode([i]) for i in ids[-4:]] == ["2", "0", "2", "4"]
    assert ours.decode(ids) == "year 2024"


@pytest.mark.slow
def test_gguf_chat_template_matches_transformers(demo_gguf):  # noqa: F811
    ours = TextTokenizer.from_gguf(demo_gguf)
    ref = hf_demo_tokenizer()
    for conv in CONVERSATIONS:
        for gen in (True, False):
            text = ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert ours.render_chat(conv, add_generation_prompt=gen) == text
            ref_ids = _ids(ref.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True))
            assert ours.encode_chat(conv, add_generation_prompt=gen) == ref_ids


@pytest.mark.slow
def test_hf_dir_tokenizer_and_template_match_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_path, "llama")
    ours = TextTokenizer.from_hf_dir(path)
    ref = AutoTokenizer.from_pretrained(path)
    for s in STRINGS:
        assert ours.encode(s) == ref.encode(s), s
    for conv in CONVERSATIONS:
        text = ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        assert ours.render_chat(conv) == text
        assert ours.encode_chat(conv) == _ids(ref.apply_chat_template(conv, add_generation_prompt=True))


def test_template_errors_are_chat_template_errors(tmp_path):
    from tokenizers import Tokenizer, models

    tk = TextTokenizer(Tokenizer(models.BPE()), bos_token=None, eos_token=None, add_bos=False,
                       chat_template="{{ raise_exception('only user turns') }}")
    with pytest.raises(ChatTemplateError, match="only user turns"):
        tk.render_chat([{"role": "system", "content": "x"}])
    none = TextTokenizer(Tokenizer(models.BPE()), bos_token=None, eos_token=None, add_bos=False,
                         chat_template=None)
    with pytest.raises(ChatTemplateError):
        none.render_chat([{"role": "user", "content": "x"}])


def _same(a: TextTokenizer, b: TextTokenizer) -> None:
    for s in STRINGS:
        assert a.encode(s) == b.encode(s), s
        assert a.encode(s, add_special_tokens=False) == b.encode(s, add_special_tokens=False), s
        assert b.count(s) == len(a.encode(s)) and b.count(s, False) == len(a.encode(s, False)), s
    for conv in CONVERSATIONS:
        assert a.encode_chat(conv) == b.encode_chat(conv)
    assert (a.bos_token_id, a.eos_token_id, a.vocab_size) == (b.bos_token_id, b.eos_token_id, b.vocab_size)


def test_served_form_rebuilds_the_same_tokenizer(tmp_path):
    """What a worker serves on /internal/tokenizer (JSON) encodes exactly as the worker does."""
    import json

    path = make_tiny_model(tmp_path, "llama")
    ours = TextTokenizer.from_hf_dir(path)
    _same(ours, TextTokenizer.from_dict(json.loads(json.dumps(ours.to_dict()))))


@pytest.mark.slow
def test_served_form_of_the_gguf_tokenizer(demo_gguf):  # noqa: F811
    import json

    ours = TextTokenizer.from_gguf(demo_gguf)
    _same(ours, TextTokenizer.from_dict(json.loads(json.dumps(ours.to_dict()))))
