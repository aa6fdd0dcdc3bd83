"""When a sampled token finishes its sequence, and how much of the output text may be sent.

Decisions only; ``Engine._append_token`` acts on them (the sequence, its decoder, its listener):

* :func:`token_finish` looks at the new token: the end of the grammar (``params.grammar``),
  an EOS token (unless ``ignore_eos``) or one of ``stop_token_ids`` finish with ``stop``;
  ``max_tokens`` or the end of the context with ``length``. A stop token's text is not in the
  output, nor its logprob in the report; the token that completes a grammar keeps its text
  unless it is EOS.
* :func:`release_text` looks at the decoded output text: the earliest stop string cuts it and
  finishes with ``stop``. While the sequence goes on, the text is held back from its end by
  an unfinished character (U+FFFD) and by the longest stop string less one character, which
  a stop string spanning tokens may be starting. A finished sequence releases all of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sequence import SamplingParams


@dataclass(frozen=True, slots=True)
class TokenFinish:
    reason: str | None
    """``stop``, ``length``, or None: the sequence goes on."""
    hide: bool = False
    """The token's text stays out of the output and its logprob out of the report."""


GOES_ON = TokenFinish(None)


def token_finish(tok: int, params: SamplingParams, eos_token_ids: frozenset[int], *, grammar_ended: bool,
                 generated: int, total: int, max_total_len: int) -> TokenFinish:
    """Does ``tok``, just sampled, finish its sequence? ``grammar_ended``: its grammar matcher
    refused the token or can accept none after it; ``generated``: output tokens, ``tok``
    included; ``total``: prompt and output tokens, against ``max_total_len``."""
    if grammar_ended:
        return TokenFinish("stop", hide=tok in eos_token_ids)
    if (tok in eos_token_ids and not params.ignore_eos) or tok in params.stop_token_ids:
        return TokenFinish("stop", hide=True)
    if generated >= params.max_tokens or total >= max_total_len:
        return TokenFinish("length")
    return GOES_ON


@dataclass(frozen=True, slots=True)
class TextRelease:
    text: str
    """The output text, cut before a stop string."""
    delta: str
    """Text to send now."""
    sent: int
    """Characters of ``text`` sent, ``delta`` included."""
    stopped: bool
    """A stop string was found: the sequence finishes with ``stop``."""


def release_text(text: str, stop: tuple[str, ...], *, searched: int, sent: int, finishing: bool) -> TextRelease:
    """What of the output ``text`` to send. ``searched``: characters at its start that were
    searched for stop strings already (a stop string found now ends past them); ``sent``:
    characters sent before; ``finishing``: the token finishes the sequence anyway."""
    stopped = False
    if stop:
        cut = min((i for i in (text.find(s, max(0, searched - len(s) + 1)) for s in stop) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
            stopped = True
    if finishing or stopped:
        safe = len(text)
    else:
        safe = len(text.rstrip("\ufffd"))
        if stop:
            safe -= max(len(s) for s in stop) - 1
    delta = text[sent:safe] if safe > sent else ""
    return TextRelease(text, delta, max(sent, safe), stopped)
