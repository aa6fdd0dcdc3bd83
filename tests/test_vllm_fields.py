"""Every request field the checks read reaches a vLLM worker or is withheld from it on purpose.

The fields are what ``loraplex.openai_request.parse`` (the one reader, the gateway's and the
bundled worker's) actually looks up, recorded while it reads bodies that take each of its
branches; ``gateway.vllm_backend`` forwards ``FORWARDED`` and withholds ``WITHHELD``. A field
added to the reader but to neither would reach bundled workers and silently not vLLM ones.
"""

from __future__ import annotations

from typing import Any

from gateway.vllm_backend import FORWARDED, WITHHELD
from loraplex.openai_request import parse

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
SAMPLING = {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 7, "presence_penalty": 0.1,
            "frequency_penalty": 0.1, "repetition_penalty": 1.1, "stop": ["\n\n"], "stop_token_ids": [2],
            "ignore_eos": False, "logit_bias": {"17": 1.5}, "response_format": {"type": "json_object"}}
EVERYTHING = {"model": "m", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
              "n": 2, "max_tokens": 16, "max_completion_tokens": 8, "user": "u", "metadata": {"k": "v"}, **SAMPLING}
BODIES: list[tuple[bool, dict[str, Any]]] = [
    (True, {"model": "m", "messages": MESSAGES}),
    (False, {"model": "m", "prompt": "hi"}),
    (True, {**EVERYTHING, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2, "tools": TOOLS,
            "tool_choice": "auto", "parallel_tool_calls": False}),
    (False, {**EVERYTHING, "prompt": [1, 2, 3], "logprobs": 2}),
]


class Recorded(dict[str, Any]):
    """A body that notes every top-level key looked up in it."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.read: set[str] = set()

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.read.add(key)
        return super().__contains__(key)


def read_fields() -> set[str]:
    """The top-level fields ``parse`` looks up in bodies that take each of its branches."""
    read: set[str] = set()
    for chat, body in BODIES:
        recorded = Recorded(body)
        req = parse(recorded, chat=chat)
        assert req.chat is chat
        read |= recorded.read
    return read


def test_the_bodies_reach_every_branch_of_the_reader():
    fields = read_fields()
    assert {"messages", "prompt", "temperature", "logit_bias", "tool_choice", "parallel_tool_calls",
            "top_logprobs", "metadata"} <= fields


def test_every_field_the_reader_reads_is_forwarded_to_vllm_or_withheld():
    placed = FORWARDED | WITHHELD.keys()
    dropped = read_fields() - placed
    assert not dropped, (f"loraplex.openai_request reads {sorted(dropped)}, which gateway.vllm_backend neither "
                         "forwards (FORWARDED) nor withholds (WITHHELD): vLLM workers would drop it unseen")


def test_vllm_gets_only_fields_the_reader_checked():
    assert FORWARDED <= read_fields(), sorted(FORWARDED - read_fields())
    assert FORWARDED.isdisjoint(WITHHELD), sorted(FORWARDED & WITHHELD.keys())
