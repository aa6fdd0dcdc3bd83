"""The engine's stop decisions as tables: ``token_finish`` (a sampled token) and ``release_text``
(the decoded output text: stop strings and the held-back text)."""

from __future__ import annotations

import pytest

from engine.sequence import SamplingParams
from engine.stopping import TextRelease, TokenFinish, release_text, token_finish

EOS = frozenset({2, 3})
P = SamplingParams(max_tokens=8)
GO = TokenFinish(None)
STOP = TokenFinish("stop", hide=True)

# (case, token, params, grammar ended, generated, total, max_total_len, expected)
TOKENS = [
    ("an ordinary token goes on", 7, P, False, 1, 5, 100, GO),
    ("EOS stops, its text out", 2, P, False, 1, 5, 100, STOP),
    ("any of the EOS ids", 3, P, False, 1, 5, 100, STOP),
    ("ignore_eos: EOS is a token", 2, SamplingParams(max_tokens=8, ignore_eos=True), False, 1, 5, 100, GO),
    ("ignore_eos: EOS at max_tokens is length", 2, SamplingParams(max_tokens=8, ignore_eos=True), False, 8, 12, 100,
     TokenFinish("length")),
    ("a stop token id stops, its text out", 9, SamplingParams(max_tokens=8, stop_token_ids=(9,)), False, 1, 5, 100,
     STOP),
    ("ignore_eos leaves stop token ids", 9, SamplingParams(max_tokens=8, stop_token_ids=(9,), ignore_eos=True), False,
     1, 5, 100, STOP),
    ("a stop token at max_tokens is stop", 9, SamplingParams(max_tokens=8, stop_token_ids=(9,)), False, 8, 12, 100,
     STOP),
    ("EOS at max_tokens is stop", 2, P, False, 8, 12, 100, STOP),
    ("one short of max_tokens goes on", 7, P, False, 7, 11, 100, GO),
    ("max_tokens", 7, P, False, 8, 12, 100, TokenFinish("length")),
    ("the context's end", 7, P, False, 3, 100, 100, TokenFinish("length")),
    ("one short of the context's end", 7, P, False, 3, 99, 100, GO),
    ("the grammar's end on EOS: its text out", 2, P, True, 1, 5, 100, STOP),
    ("the grammar's end on EOS under ignore_eos", 2, SamplingParams(max_tokens=8, ignore_eos=True), True, 1, 5, 100,
     STOP),
    ("the grammar's end on a text token keeps it", 7, P, True, 1, 5, 100, TokenFinish("stop")),
    ("the grammar's end before max_tokens", 7, P, True, 8, 12, 100, TokenFinish("stop")),
]


@pytest.mark.parametrize(("case", "tok", "params", "ended", "generated", "total", "limit", "want"), TOKENS,
                         ids=[row[0] for row in TOKENS])
def test_token_finish(case, tok, params, ended, generated, total, limit, want):
    got = token_finish(tok, params, EOS, grammar_ended=ended, generated=generated, total=total, max_total_len=limit)
    assert got == want, case


# (case, text, stop strings, searched, sent, finishing, expected (text, delta, sent, stopped))
TEXTS = [
    ("no stop strings: all of it", "Hello", (), 0, 0, False, ("Hello", "Hello", 5, False)),
    ("only what was not sent", "Hello world", (), 0, 5, False, ("Hello world", " world", 11, False)),
    ("an unfinished character waits", "Hel\ufffd", (), 0, 0, False, ("Hel\ufffd", "Hel", 3, False)),
    ("finishing sends an unfinished character", "Hel\ufffd", (), 0, 0, True, ("Hel\ufffd", "Hel\ufffd", 4, False)),
    ("a stop string's length less one is held back", "Hello E", ("END",), 0, 0, False,
     ("Hello E", "Hello", 5, False)),
    ("the longest stop string sets the holdback", "Hello E", ("END", "X"), 0, 0, False,
     ("Hello E", "Hello", 5, False)),
    ("holdback and an unfinished character", "Hello\ufffd", ("AB",), 0, 0, False,
     ("Hello\ufffd", "Hell", 4, False)),
    ("nothing yet when the text is shorter than the holdback", "ab", ("LONGSTOP",), 0, 0, False,
     ("ab", "", 0, False)),
    ("finishing sends the held-back text", "Hello E", ("END",), 0, 5, True, ("Hello E", " E", 7, False)),
    ("a stop string cuts the text and stops", "Hello END more", ("END",), 0, 0, False,
     ("Hello ", "Hello ", 6, True)),
    ("the earliest of the stop strings", "xxaxbx", ("b", "a"), 0, 0, False, ("xx", "xx", 2, True)),
    ("a stop string at the start", "ENDx", ("END",), 0, 0, False, ("", "", 0, True)),
    ("a stop string ending just past the searched text", "abEND", ("END",), 4, 0, False, ("ab", "ab", 2, True)),
    ("the searched text is not searched again", "aENDb", ("END",), 5, 0, False, ("aENDb", "aEN", 3, False)),
    ("sent text is never taken back", "abEND", ("END",), 0, 3, False, ("ab", "", 3, True)),
    ("a stop string in a finishing token's text", "Hello END", ("END",), 0, 0, True,
     ("Hello ", "Hello ", 6, True)),
]


@pytest.mark.parametrize(("case", "text", "stop", "searched", "sent", "finishing", "want"), TEXTS,
                         ids=[row[0] for row in TEXTS])
def test_release_text(case, text, stop, searched, sent, finishing, want):
    got = release_text(text, stop, searched=searched, sent=sent, finishing=finishing)
    assert got == TextRelease(*want), case


# (case, the output text after each token, stop strings, expected deltas, stopped at the last)
STREAMS = [
    ("a stop string spanning three tokens", ["Hel", "Hello S", "Hello STO", "Hello STOP and"], ("STOP",),
     ["", "Hell", "o ", ""], True),
    ("a stop string's start that does not complete", ["Hel", "Hello S", "Hello STO", "Hello STOW go"], ("STOP",),
     ["", "Hell", "o ", "STOW"], False),
    ("the first of two stop strings to complete", ["a-", "a-b", "a-b+c"], ("+c", "-bz"),
     ["", "a", "-b"], True),
]


@pytest.mark.parametrize(("case", "texts", "stop", "deltas", "stopped"), STREAMS, ids=[row[0] for row in STREAMS])
def test_stop_strings_across_tokens(case, texts, stop, deltas, stopped):
    sent, searched, got = 0, 0, []
    out = None
    for text in texts:
        out = release_text(text, stop, searched=searched, sent=sent, finishing=False)
        got.append(out.delta)
        sent, searched = out.sent, len(text)  # as if each token's text were final at once
    assert got == deltas, case
    assert out is not None and out.stopped is stopped
    streamed = "".join(got)
    assert out.text.startswith(streamed), "what was sent is the output's start"
    assert not any(s in streamed for s in stop), "no stop string is ever sent"
