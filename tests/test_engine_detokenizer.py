"""Incremental detokenization: the text at every token equals decoding the whole output, and the
engine's streamed deltas and stop strings are those of decoding the whole output every token."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models

import engine.engine as engine_module
from engine.detokenizer import IncrementalDecoder
from engine.engine import Engine, EngineConfig
from engine.sequence import SamplingParams, SeqEvent
from loraplex.tokenizer import TextTokenizer
from tests.engine_fixtures import demo_gguf, make_tiny_model  # noqa: F401

TRICKY = ["héllo wörld", "日本語のテキスト", "emoji 🦙🙂👍🏽 flags 🇫🇷", "∑ x² ≤ ∞", "tab\tnew\nline",
          "a\ufffdb", "mixed café 😀 end"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_detok"), "llama", seed=3)


def _byte_fallback_tokenizer() -> TextTokenizer:
    """A SentencePiece-style tokenizer (Llama 2's decoders): ``▁`` for spaces, ``<0xNN>`` byte
    tokens, and the first token's leading space stripped (the case the decode window is for)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "▁Hello", "▁world", "▁the", "s", "é", "▁caf", "日本", "!", "▁a"]:
        vocab[piece] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.add_special_tokens(["<s>", "</s>"])
    return TextTokenizer(tk, bos_token="<s>", eos_token="</s>", add_bos=False, chat_template=None)


def _id_lists(tok: TextTokenizer, seed: int) -> list[list[int]]:
    """Encoded tricky strings, and random ids over the whole vocabulary (lone bytes of partial
    characters, special tokens), glued together."""
    rng = random.Random(seed)
    vocab = tok.vocab_size
    out = [tok.encode(s, add_special_tokens=False) for s in TRICKY]
    for _ in range(12):
        ids: list[int] = []
        while len(ids) < 60:
            ids += rng.choice(out[:len(TRICKY)]) if rng.random() < 0.4 else \
                [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        out.append(ids)
    return out


def _assert_prefixes_decode_alike(tok: TextTokenizer, seed: int) -> None:
    lists = _id_lists(tok, seed)
    assert any("\ufffd" in tok.decode(ids) for ids in lists)  # partial characters are exercised
    for ids in lists:
        dec = IncrementalDecoder(tok)
        for k in range(1, len(ids) + 1):
            assert dec.text(ids[:k]) == tok.decode(ids[:k]), (ids[:k], k)
        assert tok.decode(ids[:dec.read]) == dec.stable


def test_byte_level_tokenizer_decodes_incrementally_as_whole(tiny_dir):
    _assert_prefixes_decode_alike(TextTokenizer.from_hf_dir(tiny_dir), seed=1)


def test_byte_fallback_tokenizer_decodes_incrementally_as_whole():
    tok = _byte_fallback_tokenizer()
    assert tok.decode(tok.encode("Hello world", add_special_tokens=False)) == "Hello world"
    _assert_prefixes_decode_alike(tok, seed=2)


@pytest.mark.slow
def test_demo_tokenizer_decodes_incrementally_as_whole(demo_gguf):  # noqa: F811
    _assert_prefixes_decode_alike(TextTokenizer.from_gguf(demo_gguf), seed=3)


def _reference_events(tok: TextTokenizer, script: list[int], params: SamplingParams,
                      eos: frozenset[int]) -> list[tuple[str, str | None]]:
    """(text delta, finish reason) per token, by decoding the whole output at every token; what
    may be the start of a stop string is held back from the complete characters."""
    out: list[int] = []
    sent = 0
    events = []
    for t in script:
        out.append(t)
        reason = None
        text_ids = out
        if (t in eos and not params.ignore_eos) or t in params.stop_token_ids:
            reason, text_ids = "stop", out[:-1]
        elif len(out) >= params.max_tokens:
            reason = "length"
        text = tok.decode(text_ids)
        if params.stop:
            cut = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=-1)
            if cut >= 0:
                text, reason = text[:cut], "stop"
        if reason is None:
            safe = len(text.rstrip("\ufffd"))
            if params.stop:
                safe -= max(len(s) for s in params.stop) - 1
        else:
            safe = len(text)
        events.append((text[sent:safe] if safe > sent else "", reason))
        sent = max(sent, safe)
        if reason is not None:
            break
    return events


def _run_scripted(eng: Engine, cases: list[tuple[list[int], SamplingParams]],
                  monkeypatch) -> list[tuple[list[SeqEvent], str]]:
    """Requests whose sampled tokens are the scripts, all at once: the real steps, forward and events."""
    scripts: dict[int, list[int]] = {}
    monkeypatch.setattr(engine_module, "sample", lambda logits, seqs, scan=None: [scripts[s.seq_id].pop(0) for s in seqs])
    runs = []
    for ids, params in cases:
        events: list[SeqEvent] = []
        seq = eng.add_request([5, 6, 7], params, listener=events.append)
        scripts[seq.seq_id] = list(ids)
        runs.append((seq, events))
    while not all(seq.is_finished for seq, _ in runs):
        eng.step()
    return [(events, seq.output_text) for seq, events in runs]


def test_engine_streams_the_whole_decode_and_stops_as_before(tiny_dir, monkeypatch):
    eng = Engine.from_path(tiny_dir, EngineConfig(kv_cache_bytes=1 << 22))
    tok = eng.tokenizer
    rng = random.Random(7)
    cases = []
    for ids in _id_lists(tok, seed=4):
        text = tok.decode(ids)
        n = len(text)
        stops: list[tuple[str, ...]] = [(), (text[n // 2:n // 2 + 2],), (text[n // 3:n // 3 + 4], "zz", text[-3:]),
                                        ("\ufffd",), (text[:1],)]
        for stop in stops:
            cases.append((ids, SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=stop)))
        cases.append((ids, SamplingParams(max_tokens=len(ids), stop_token_ids=(rng.choice(ids),))))
        cases.append((ids, SamplingParams(max_tokens=len(ids) // 2, ignore_eos=True)))
        cases.append((ids, SamplingParams(max_tokens=len(ids))))  # ends at its first end-of-sequence id
    stopped = 0
    for (ids, params), (events, output_text) in zip(cases, _run_scripted(eng, cases, monkeypatch), strict=True):
        want = _reference_events(tok, ids, params, eng.eos_token_ids)
        assert [(e.text_delta, e.finish_reason) for e in events] == want, (ids, params)
        assert "".join(e.text_delta for e in events) == output_text, (ids, params)
        stopped += want[-1][1] == "stop"
    assert stopped > len(cases) // 3  # stop strings and ids were hit, not only lengths
