"""A request inside the engine: its tokens, sampling parameters, KV blocks and status."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from loraplex.wire import PRIORITY_CLASSES, AdapterRef

if TYPE_CHECKING:
    from engine.detokenizer import IncrementalDecoder


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 or 0: no top-k."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted once per token present / per occurrence, over the generated tokens."""
    repetition_penalty: float = 1.0
    """Hugging Face's: over prompt and generated tokens, divides positive logits, multiplies negative."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    """Report each sampled token's log-probability (and ``top_logprobs`` alternatives)."""
    top_logprobs: int = 0
    n: int = 1
    """Samples of the request (each its own sequence; see ``Engine.add_request``)."""
    grammar: str | None = None
    """The output's grammar (``loraplex.openai_request.spec_key``): a JSON object, or one matching a schema."""

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class TokenLogprob:
    """A sampled token's log-probability under the model's distribution (before any sampling
    transform), and the ``top_logprobs`` most likely tokens with theirs."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SeqEvent:
    """What the engine tells a request's listener after a step."""

    seq_id: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None
    """Machine-readable error code (``adapter_load_failed``, ``engine_error`` ...)."""
    logprobs: list[TokenLogprob] | None = None
    """With ``params.logprobs``: the entries of the tokens whose text is in the output."""


_ids = itertools.count(1)


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None = None
    tenant: str = ""
    priority: int = PRIORITY_CLASSES["normal"]
    request_id: str = ""
    listener: Callable[[SeqEvent], None] | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens of ``all_token_ids`` whose K/V are in the cache."""
    max_total_len: int = 0
    """Context limit (prompt + output) for this sequence."""
    finish_reason: str | None = None
    aborted: bool = False
    num_preemptions: int = 0
    first_token_time: float | None = None
    generator: torch.Generator | None = None
    output_text: str = ""
    sent_text_len: int = 0
    decoder: IncrementalDecoder | None = None
    """The engine's decoder of the output text."""
    extra: dict[str, Any] = field(default_factory=dict)
    matcher: Any = None
    """With ``params.grammar``: this row's xgrammar ``GrammarMatcher`` (the tokens accepted so far)."""
    share_from: Sequence | None = None
    """Sample ``i`` > 0 of a request: the first sample, whose prompt KV blocks it starts from."""
    index: int = 0
    """Which of the request's samples (the choice index)."""
    samples: list[Sequence] = field(default_factory=list)
    """On the first sample of an ``n`` > 1 request: all of them, itself first."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """With ``params.logprobs``: one entry per output token whose text is in the output."""
    cache_root: bytes | None = None
    """The prefix cache's namespace for this request (``loraplex.prefix.namespace``); ``None``: its
    blocks are neither looked up nor cached."""
    block_keys: list[bytes] = field(default_factory=list)
    """Prefix-cache keys of the full blocks of ``all_token_ids`` computed so far (grows)."""
    num_keyed: int = 0
    """Blocks of ``block_table`` given their key in the cache (or found there)."""
    cached_tokens: int = 0
    """Prompt tokens whose K/V came from the prefix cache when the request was first admitted
    (``usage.prompt_tokens_details.cached_tokens``)."""

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(int(self.params.seed))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        """Tokens still to put through the model before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
