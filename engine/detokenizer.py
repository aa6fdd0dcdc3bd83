"""Incremental detokenization: a sequence's output text, decoding only its newest tokens."""

from __future__ import annotations

from loraplex.tokenizer import TextTokenizer


class IncrementalDecoder:
    """``text(ids)`` is ``tokenizer.decode(ids)`` for a list of ids that only grows between calls,
    at a cost that does not grow with it.

    The text before ``read`` (a token index where the bytes end on a whole character) never
    changes; each call decodes only the window from ``prefix`` (one step further back, so that
    decoders which look at their first token, e.g. a stripped leading space, decode the new
    tokens as they would inside the whole list) and keeps what the window adds beyond the
    prefix's own text. The window moves on only past text that cannot change: not while it
    ends in U+FFFD (a character whose bytes are still coming) nor inside a run of
    byte-fallback tokens (the run decodes as a whole).
    """

    __slots__ = ("byte_ids", "prefix", "prefix_len", "read", "stable", "tokenizer")

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_ids = tokenizer.byte_fallback_ids
        self.prefix = 0
        self.read = 0
        self.prefix_len = 0
        """Characters ``decode(ids[prefix:read])`` has."""
        self.stable = ""
        """``decode(ids[:read])``: the text that later tokens cannot change."""

    def text(self, ids: list[int]) -> str:
        decode = self.tokenizer.decode
        tail = decode(ids[self.prefix:])[self.prefix_len:]
        text = self.stable + tail
        if tail and not tail.endswith("\ufffd") and len(ids) > self.read and ids[-1] not in self.byte_ids:
            self.prefix_len = len(decode(ids[self.read:]))
            self.prefix, self.read = self.read, len(ids)
            self.stable = text
        return text
